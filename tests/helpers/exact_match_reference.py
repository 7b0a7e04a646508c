"""An independent recomputation of a synthetic run's greedy decoding and ``eval/exact_match``.

train.py scores a synthetic run by cached greedy decoding (``generate``) on a mesh. This
module recomputes it from the run's last checkpoint with none of that: greedy decoding that
re-runs the full (uncached) model on the whole prefix at every step, on one device, and a
plain NumPy comparison with the held-out targets. A decoder, gather or metric that is wrong
gives different tokens or a different score.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
from flaxformer_lite.core.checkpoints import Checkpointer
from flaxformer_lite.data import tasks
from flaxformer_lite.data.tasks.synthetic import FIRST_SYMBOL, SymbolVocabulary


@functools.cache
def _forward(model: EncoderDecoder):
    return jax.jit(lambda p, x, y: model.apply({"params": p}, x, y))


def naive_greedy(model: EncoderDecoder, params, inputs: np.ndarray, steps: int):
    """Greedy tokens `[rows, steps]` (``model.config``'s EOS, then its PAD) from the full
    forward pass on the targets decoded so far: the model shifts them right behind BOS and is
    causal, so the logits at position t see only tokens before t (later positions hold PAD and
    do not matter).

    Returns (tokens, margin `[rows]`: the smallest top-1 minus top-2 logit of each row's
    choices, which says how far float rounding is from flipping one)."""
    apply = _forward(model)
    pad, eos = model.config.pad_id, model.config.eos_id
    rows = inputs.shape[0]
    tokens = np.full((rows, steps), pad, np.int32)
    margin = np.full(rows, np.inf)
    done = np.zeros(rows, bool)
    for t in range(steps):
        logits = np.asarray(apply(params, jnp.asarray(inputs), jnp.asarray(tokens)))[:, t]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = np.where(done, margin, np.minimum(margin, top2[:, 1] - top2[:, 0]))
        token = np.where(done, pad, logits.argmax(-1)).astype(np.int32)
        tokens[:, t] = token
        done |= token == eos
        if done.all():
            break
    return tokens, margin


def naive_decoding(config, workdir: Path, scratch: Path):
    """Naive greedy decoding of the held-out sources of a synthetic run with the parameters
    of ``workdir``'s last checkpoint (``config``: the run's config; ``scratch``: a folder for
    the task's vocabulary file, so the workdir is not touched).

    Returns (the task, the model, its parameters, per eval batch: (tokens
    `[rows, target_len]`, targets, margins `[rows]`))."""
    task = tasks.build_task(config, str(scratch))
    cfg = TransformerConfig.from_json((workdir / "model_config.json").read_text())
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    state, _ = checkpointer.restore()
    checkpointer.close()
    model = EncoderDecoder(cfg)
    return task, model, state["params"], decode_all(task, model, state["params"])


def decode_all(task, model, params):
    """:func:`naive_greedy` of every decode batch of ``task``: (tokens, targets, margins)."""
    out = []
    for inputs, targets in zip(task.decode_inputs, task.decode_references, strict=True):
        targets = np.asarray(targets)
        tokens, margin = naive_greedy(model, params, np.asarray(inputs), targets.shape[1])
        out.append((tokens, targets, margin))
    return out


def exact_match(tokens: list[np.ndarray], targets: list[np.ndarray], pad_id: int) -> float:
    """The share of real (not all-``pad_id``) target rows that ``tokens`` equal exactly, NumPy
    only."""
    hits = [
        bool((np.asarray(got)[row] == want[row]).all())
        for got, want in zip(tokens, targets, strict=True)
        for row in range(len(want))
        if (want[row] != pad_id).any()
    ]
    return float(np.mean(hits))


def check_decoding_eval(
    recorded,
    decoded,
    metric: float,
    min_margin: float = 1e-4,
    *,
    pad_id: int = SymbolVocabulary.pad_id,  # a synthetic run's
) -> None:
    """Asserts train.py's decoded tokens of its last evaluation (``recorded``: what its
    ``greedy_decode_in_order`` returned, per batch) equal the naive ones on every real row
    whose choices were not near-ties (at least 90% of rows), and its ``eval/exact_match`` is
    the share of those tokens that match the targets."""
    assert len(recorded) == len(decoded)
    compared = total = 0
    for got, (tokens, targets, margin) in zip(recorded, decoded, strict=True):
        got = np.asarray(got)
        assert got.shape == tokens.shape, (got.shape, tokens.shape)
        real = (targets != pad_id).any(axis=1)
        clear = real & (margin > min_margin)
        np.testing.assert_array_equal(got[clear], tokens[clear])
        compared, total = compared + int(clear.sum()), total + int(real.sum())
    assert compared >= 0.9 * total, f"only {compared} of {total} rows are clear of near-ties"
    assert metric == exact_match(recorded, [targets for _, targets, _ in decoded], pad_id)


def check_decode_metric_on_diverse_outputs(train, recorded: list, task, model, params) -> float:
    """``train.decode_metric`` where the right answer is known and not 0: redrawn parameters
    (rows decode differently) and references that are the naive decoding itself on even rows
    and one token off on odd rows. Asserts the decoding eval decodes the naive tokens
    (``recorded`` collects what ``train.greedy_decode_in_order`` returns) and scores exactly
    the even rows; returns that score."""
    rng = np.random.default_rng(1)

    def redraw(path, p):  # as at init, with larger kernels: norms 1, biases 0
        name = jax.tree_util.keystr(path[-1:])
        if "scale" in name or "bias" in name:
            return np.full(p.shape, float("scale" in name), p.dtype)
        return rng.normal(0.0, 0.3, p.shape).astype(p.dtype)

    params = jax.tree_util.tree_map_with_path(redraw, params)
    decoded = decode_all(task, model, params)
    pad = model.config.pad_id
    references = []
    for tokens, targets, _ in decoded:
        refs = tokens.copy()
        odd = np.arange(1, len(refs), 2)
        where = (odd // 2) % refs.shape[1]  # one token off, at a position that varies
        symbols = model.config.vocab_size - FIRST_SYMBOL
        refs[odd, where] = FIRST_SYMBOL + (refs[odd, where] + 1) % symbols
        refs[~(targets != pad).any(axis=1)] = pad  # padding rows of the eval set stay padding
        references.append(refs)
    real = (np.concatenate(references) != pad).any(axis=1)
    rows = np.concatenate([t for t, _, _ in decoded])[real]
    # Rows decode differently, neighbours too: a decoder that mixes rows up gets caught.
    distinct = len({tuple(r) for r in rows})
    changes = int((rows[1:] != rows[:-1]).any(axis=1).sum())
    assert distinct >= 3 and changes >= len(rows) // 4, (len(rows), distinct, changes)
    expected = exact_match([t for t, _, _ in decoded], references, pad)
    assert 0.3 < expected < 0.7, expected
    task = dataclasses.replace(task, decode_references=references)
    mesh = sharding.make_mesh((-1, 1, 1))
    del recorded[:]
    metrics, _ = train.decode_metric(task, params, model.config, mesh)
    check_decoding_eval(
        recorded,
        [(t, r, m) for (t, _, m), r in zip(decoded, references, strict=True)],
        metrics["eval/exact_match"],
        pad_id=pad,
    )
    assert metrics["eval/exact_match"] == expected
    return expected
