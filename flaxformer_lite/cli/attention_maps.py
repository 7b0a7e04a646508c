"""Heatmaps of every attention head for the greedy translation of one sentence, or the pooling
attention of a classifier over one text.

    python -m flaxformer_lite.cli.attention_maps --workdir runs/m30k \
        --text "A man rides a bike." --out maps/
    python -m flaxformer_lite.cli.attention_maps --workdir runs/imdb --text "A fine film." \
        --out maps/

Writes one PNG per layer and kind, each a grid of its heads, axes labelled with the subword
pieces (``--workdir`` and ``--out`` may be ``gs://`` URIs):

  encoder_self_layer{i}.png     queries: source pieces, keys: source pieces
  decoder_self_layer{i}.png     queries: generated pieces, keys: decoder inputs (BOS, shifted)
  encoder_decoder_layer{i}.png  queries: generated pieces, keys: source pieces

Row t of a decoder map is the position that predicted generated piece t.

A classification workdir trained with ``pooling="attention"`` (configs/imdb.py) gives one figure
instead, ``pooling_attention.png``: the text's pieces in reading order, each shaded by the
weight the pooling gave it, titled with the predicted class and its probability.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.cli.translate import plain_warnings
from flaxformer_lite.core import paths
from flaxformer_lite.inference.translator import Translator

KINDS = {
    # kind: (weights key, query labels key, key labels key, title)
    "encoder_self": ("encoder_self", "source_pieces", "source_pieces", "encoder self-attention"),
    "decoder_self": (
        "decoder_self",
        "target_pieces",
        "decoder_input_pieces",
        "decoder self-attention",
    ),
    "encoder_decoder": (
        "encoder_decoder",
        "target_pieces",
        "source_pieces",
        "encoder-decoder attention",
    ),
}


def plot_heads(
    weights: np.ndarray,
    query_labels: Sequence[str],
    key_labels: Sequence[str],
    title: str,
    path: str,
) -> None:
    """Saves a grid of heatmaps, one per head, of ``weights`` `[heads, q_len, kv_len]`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (headless servers, CI)
    import matplotlib.pyplot as plt

    heads, q_len, kv_len = weights.shape
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    # Cells of about a third of an inch keep piece labels readable on long sentences.
    cell_w, cell_h = max(2.5, 0.3 * kv_len + 1.0), max(2.5, 0.3 * q_len + 1.0)
    fig, axes = plt.subplots(
        rows, cols, figsize=(cols * cell_w, rows * cell_h), squeeze=False, constrained_layout=True
    )
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(kv_len), labels=list(key_labels), rotation=90, fontsize=7)
        ax.set_yticks(range(q_len), labels=list(query_labels), fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title)
    with epath.Path(path).open("wb") as f:  # local or gs://
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def write_maps(maps: dict[str, Any], out_dir: str) -> list[str]:
    """All PNGs of ``Translator.attention`` output ``maps`` into ``out_dir`` (local or ``gs://``);
    returns the paths."""
    paths.makedirs(out_dir)
    written = []
    for kind, (key, queries, keys, title) in KINDS.items():
        for layer, weights in enumerate(maps[key]):
            path = os.path.join(out_dir, f"{kind}_layer{layer}.png")
            plot_heads(
                np.asarray(weights),
                maps[queries],
                maps[keys],
                f"{title}, layer {layer}",
                path,
            )
            written.append(path)
    return written


# ----------------------------------------------------------------------------- classifiers


def classifier_pooling(workdir: str, text: str, *, step: int | None = None) -> dict[str, Any]:
    """The pooling attention of a classification workdir over ``text``.

    Returns ``{"pieces": [...], "weights": float [n], "probabilities": float [classes],
    "label": int}`` for the encoded text (cut at ``max_len``, EOS included).

    Raises:
      FileNotFoundError: no workdir, model_config.json, vocabulary or checkpoint.
      ValueError: the run does not pool by attention (``model.pooling`` must be "attention").
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from flaxformer_lite.core.checkpoints import choose_steps
    from flaxformer_lite.data.workdir import load_tokenizer
    from flaxformer_lite.inference.translator import average_params
    from flaxformer_lite.models import EncoderClassifier
    from flaxformer_lite.nn.config import TransformerConfig

    root = paths.resolve(workdir)
    config_path = root / "model_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no model_config.json in {workdir}: is it a train.py workdir?")
    config = TransformerConfig.from_json(config_path.read_text())
    if config.pooling != "attention":
        raise ValueError(
            f"{workdir} pools by {config.pooling!r}; a pooling figure needs a classifier trained "
            "with --config.model.pooling=attention (configs/imdb.py)"
        )
    vocab = load_tokenizer(str(root))
    if vocab is None:
        raise FileNotFoundError(f"no vocabulary (spm_cls.model) in {workdir}")
    ids = [*vocab.encode(text)[: config.max_len - 1], config.eos_id]
    tokens = jnp.asarray([ids], jnp.int32)
    model = EncoderClassifier(config)
    expected = nn.meta.unbox(
        jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
    )
    checkpoints = str(root / "checkpoints")
    params = average_params(checkpoints, choose_steps(checkpoints, step=step), expected)
    # One compiled program: applied eagerly, every op of the model compiles on its own.
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates"]))
    logits, state = apply(params, tokens)
    exp = np.exp(np.asarray(logits[0], np.float64) - float(np.max(logits[0])))
    probabilities = exp / exp.sum()
    return {
        "pieces": vocab.id_to_piece(ids),
        "weights": np.asarray(state["intermediates"]["pooling_weights"][0][0]),
        "probabilities": probabilities,
        "label": int(np.argmax(probabilities)),
    }


def plot_pooling(result: dict[str, Any], path: str, *, per_row: int = 16) -> None:
    """Saves the pieces of ``classifier_pooling``'s ``result`` in reading order, ``per_row``
    to a line, each cell shaded by its pooling weight (relative to the largest one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pieces, weights = result["pieces"], np.asarray(result["weights"], np.float64)
    rows = math.ceil(len(pieces) / per_row)
    fig, ax = plt.subplots(figsize=(per_row * 0.9, rows * 0.35 + 0.9), constrained_layout=True)
    cmap = plt.get_cmap("Reds")
    top = max(float(weights.max()), 1e-12)
    for i, (piece, w) in enumerate(zip(pieces, weights, strict=True)):
        r, c = divmod(i, per_row)
        ax.add_patch(plt.Rectangle((c, -r - 1), 1, 1, color=cmap(0.85 * w / top)))
        ax.text(c + 0.5, -r - 0.5, piece, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, per_row)
    ax.set_ylim(-rows, 0)
    ax.axis("off")
    probability = float(result["probabilities"][result["label"]])
    ax.set_title(
        f"pooling attention over {len(pieces)} pieces: class {result['label']} "
        f"(p = {probability:.2f}); darkest = weight {top:.3f}",
        fontsize=9,
    )
    with epath.Path(path).open("wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def _run_task(workdir: str) -> str:
    """The task a workdir was trained on (its config.json), "translation" when unknown."""
    import json

    run = paths.resolve(workdir) / "config.json"
    return json.loads(run.read_text()).get("task", "translation") if run.is_file() else ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.cli.attention_maps",
        description="Plot encoder self-, decoder self- and encoder-decoder attention of every "
        "layer and head for the greedy translation of one sentence.",
    )
    parser.add_argument("--workdir", required=True, help="train.py workdir to load")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--text", required=True, help="source sentence")
    parser.add_argument("--out", required=True, help="folder for the PNG files")
    parser.add_argument("--max_len", type=int, default=None, help="most tokens to generate")
    args = parser.parse_args(argv)
    # Checked before the model is loaded: one line naming the flag, exit 2, nothing written.
    if not args.text.strip():
        parser.error("argument --text: is empty; give the sentence to translate and plot")
    if args.step is not None and args.step < 0:
        parser.error(f"argument --step: must be an int >= 0; got {args.step}")
    if args.max_len is not None and args.max_len < 1:
        parser.error(f"argument --max_len: must be an int >= 1; got {args.max_len}")
    out = paths.resolve(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {args.out} is a file; give a folder for the PNG files")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plain_warnings()

    try:
        if _run_task(args.workdir) == "classification":
            result = classifier_pooling(args.workdir, args.text, step=args.step)
            paths.makedirs(args.out)
            path = os.path.join(args.out, "pooling_attention.png")
            plot_pooling(result, path)
            print(f"pieces: {' '.join(result['pieces'])}")
            print(f"class {result['label']}, probabilities {np.round(result['probabilities'], 3)}")
            print(f"wrote {paths.resolve(path)}")
            return 0
        translator = Translator.from_workdir(args.workdir, step=args.step)
        generation = translator.generation  # greedy, up to --max_len tokens when given
        if args.max_len is not None:
            generation = generation.replace(max_len=args.max_len)
        maps = translator.attention(args.text, generation)
    except (FileNotFoundError, ValueError) as e:  # a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = write_maps(maps, args.out)
    print(f"source:      {' '.join(maps['source_pieces'])}")
    print(f"translation: {maps['translation']}")
    print(f"pieces:      {' '.join(maps['target_pieces'])}")
    print(f"wrote {len(written)} figures to {paths.resolve(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
