"""Hugging Face checkpoints in and out of flaxformer_lite, whatever the family.

    config, params, tokenizer = load_pretrained("Helsinki-NLP/opus-mt-en-de")  # or a local folder
    save_pretrained("out/", config, params, tokenizer)  # transformers / CTranslate2 read it

``load_pretrained`` reads ``config.json``'s ``model_type`` and hands the folder to that
family's module beside this one (``FAMILIES``: ``marian``, ``bart`` for BART and mBART,
``llama``, ...), which knows the family's config fields, its parameter names (as
``naming.Tensor`` rows: one map read both ways) and its tokenizer. ``save_pretrained`` writes a
config as the one family that can express it (or the ``model_type`` asked for).

Reading needs neither torch nor transformers: ``config.json`` is JSON, ``model.safetensors``
reads into NumPy (a ``pytorch_model.bin`` needs torch).

A folder's generation config (how its ``generate()`` decodes) is read by
``decoding.hf_generation``, whose names are re-exported here, and becomes the options of our
searches through ``GenerationConfig.from_hugging_face``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.core.hub import resolve
from flaxformer_lite.decoding.hf_generation import (  # noqa: F401  (defined here before)
    GENERATION_DEFAULT_MAX_LENGTH,
    GENERATION_KEYS,
    generate_new_tokens,
    generation_config,
    generation_defaults,
    unsupported_generation,
)
from flaxformer_lite.interop import bart, llama, marian, t5
from flaxformer_lite.interop.marian import (  # noqa: F401  (defined here before)
    FROM_HF_ACTIVATION,
    TO_HF_ACTIVATION,
)
from flaxformer_lite.nn.config import TransformerConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")

# Each family module has: NAME, MODEL_TYPES, DECODER_ONLY, config_from_hf(hf, *, unk_id),
# problems(config, *, dequantize) -> list[str], config_to_hf(config, *, dequantize),
# params_from_state_dict(state, config), state_dict_from_params(plain params, config),
# generation_ids(config) and default_generation(config) (generation_config.json's special ids,
# and its content when none is given), load_tokenizer(root) -> tokenizer | None.
# Optionally config_from_state(config, state) -> config: what config.json leaves to the
# weights (T5's lm_head, tied or not), applied by load_pretrained and load_config.
FAMILY_MODULES: tuple[ModuleType, ...] = (marian, bart, llama, t5)
FAMILIES: dict[str, ModuleType] = {t: f for f in FAMILY_MODULES for t in f.MODEL_TYPES}

Params = dict[str, Any]


# ----------------------------------------------------------------------------- families


def family_of(hf: Mapping[str, Any]) -> ModuleType:
    """The family module of a ``config.json`` dict, by its ``model_type``.

    Raises:
      ValueError: an unsupported ``model_type`` (named, with the supported ones).
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"config.json has model_type {model_type!r}; load_pretrained reads "
            + ", ".join(f"{f.NAME} (model_type {'/'.join(f.MODEL_TYPES)})" for f in FAMILY_MODULES)
        )
    return FAMILIES[model_type]


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` dict of a supported family.

    ``unk_id``: the vocabulary's unknown id where the model config does not record it (None:
    the family's default).

    Raises:
      ValueError: an unsupported ``model_type``, or a config field the family module cannot
        express (named).
    """
    return family_of(hf).config_from_hf(hf, unk_id=unk_id)


def family_for(
    config: TransformerConfig, *, model_type: str | None = None, dequantize: bool = False
) -> ModuleType:
    """The family that writes ``config``: the one named by ``model_type``, else the only family
    that can express it.

    Raises:
      ValueError: an unknown ``model_type``; or no family (each one's differences listed) or
        several can express ``config`` without ``model_type``.
    """
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ValueError(
                f"model_type={model_type!r} is not a supported family; valid: {sorted(FAMILIES)}"
            )
        family = FAMILIES[model_type]
        family.config_to_hf(config, dequantize=dequantize)  # raises, naming the differences
        return family
    fits = [f for f in FAMILY_MODULES if not f.problems(config, dequantize=dequantize)]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        if len(FAMILY_MODULES) == 1:
            FAMILY_MODULES[0].config_to_hf(config, dequantize=dequantize)  # its one message
        raise ValueError(
            "save_pretrained writes "
            + ", ".join(f.NAME for f in FAMILY_MODULES)
            + " models; this TransformerConfig is none of them: "
            + " | ".join(
                f"{f.NAME}: " + "; ".join(f.problems(config, dequantize=dequantize))
                for f in FAMILY_MODULES
            )
        )
    raise ValueError(
        "this TransformerConfig can be written as "
        + " or ".join(f"model_type={f.MODEL_TYPES[0]!r}" for f in fits)
        + "; pass model_type to choose"
    )


def config_to_hf(
    config: TransformerConfig, *, model_type: str | None = None, dequantize: bool = False
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as ``family_for`` chooses its family.

    Raises:
      ValueError: see ``family_for`` (every field that keeps ``config`` from the family named).
    """
    family = family_for(config, model_type=model_type, dequantize=dequantize)
    return family.config_to_hf(config, dequantize=dequantize)


def plain_params(
    params: Any, config: TransformerConfig, dequantize: bool = False
) -> tuple[Params, TransformerConfig]:
    """Unboxed, unrolled, float32 NumPy parameters (int8 ones dequantized if ``dequantize``)
    and the float, unrolled config they belong to."""
    import flax.linen as nn
    import jax

    from flaxformer_lite.models import unrolled
    from flaxformer_lite.ops.quantize import dequantize_params

    params, config = unrolled(nn.meta.unbox(params), config)
    if config.quantization is not None:
        if not dequantize:
            raise ValueError(
                f"config.quantization={config.quantization!r}: a Hugging Face model has "
                "float weights; pass dequantize=True to write the int8 weights as float32"
            )
        params, config = dequantize_params(params), config.replace(quantization=None)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if np.issubdtype(np.asarray(leaf).dtype, np.integer):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {np.asarray(leaf).dtype}, but "
                f"config.quantization is {config.quantization!r}: pass the config the "
                "parameters were quantized for (quantization='int8') and dequantize=True"
            )
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float32), params)
    return params, config


def state_dict_from_params(
    params: Any,
    config: TransformerConfig,
    *,
    model_type: str | None = None,
    dequantize: bool = False,
) -> dict[str, np.ndarray]:
    """The state dict (Hugging Face names -> float32 NumPy arrays) of our parameters, the
    inverse of the family's ``params_from_state_dict``: boxed or plain, scanned or unrolled.

    ``dequantize``: ``config.quantization="int8"`` parameters (``quantize.quantize_params``)
    are written as float32 ``q * scale`` (``quantize.dequantize_params``); without it they are
    refused (ValueError), as are integer parameters under a float config."""
    family = family_for(config, model_type=model_type, dequantize=dequantize)
    params, config = plain_params(params, config, dequantize)
    return family.state_dict_from_params(params, config)


def params_from_state_dict(
    state: Mapping[str, np.ndarray], config: TransformerConfig, *, model_type: str = "marian"
) -> Params:
    """Our ``params`` from the state dict of a ``model_type`` checkpoint (see its family)."""
    return family_of({"model_type": model_type}).params_from_state_dict(state, config)


# ----------------------------------------------------------------------------- files


def read_state_dict(root: epath.Path) -> dict[str, np.ndarray]:
    """Name -> NumPy array of the weights in ``root``: ``model.safetensors`` (sharded through
    ``model.safetensors.index.json`` too) with safetensors alone, else ``pytorch_model.bin``
    through torch.

    Raises:
      FileNotFoundError: none of ``WEIGHT_FILES`` in ``root``.
    """
    from safetensors.numpy import load as load_safetensors

    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return dict(load_safetensors(single.read_bytes()))
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, np.ndarray] = {}
        for name in files:
            state.update(load_safetensors((root / name).read_bytes()))
        return state
    binary = root / "pytorch_model.bin"
    if binary.is_file():
        try:
            import torch
        except ImportError as e:
            raise ImportError(
                f"{binary} is a PyTorch pickle, which needs torch to read "
                "(pip install torch), or convert it to model.safetensors"
            ) from e
        with binary.open("rb") as f:
            state_t = torch.load(f, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state_t.items()}
    raise FileNotFoundError(f"no weights in {root}: expected one of {list(WEIGHT_FILES)}")


def load_pretrained(path_or_repo_id: str) -> tuple[TransformerConfig, Params, Any]:
    """``(config, params, tokenizer)`` of a Hugging Face model of a supported family.

    Args:
      path_or_repo_id: a folder (local or ``gs://``) with ``config.json``, the weights
        (``model.safetensors`` or ``pytorch_model.bin``) and optionally the tokenizer's files,
        or a hub id such as ``"Helsinki-NLP/opus-mt-en-de"`` (downloaded once into the hub
        cache).

    Returns:
      the ``TransformerConfig``, the parameters (nested dicts of float32 NumPy arrays, the
      ``params`` collection of ``EncoderDecoder(config)``, or of ``DecoderOnly(config)`` for
      a family whose module has ``DECODER_ONLY``), and the family's tokenizer (None when its
      files are absent).

    Raises:
      FileNotFoundError: no such folder or repository, no config.json, no weights.
      ValueError: an unsupported ``model_type`` or config field, or weights that do not match
        the config (named).
    """
    root = resolve(path_or_repo_id)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {root}: is it a Hugging Face model folder?")
    hf = json.loads(config_path.read_text())
    family = family_of(hf)
    tokenizer = family.load_tokenizer(root)
    config = family.config_from_hf(hf, unk_id=tokenizer.unk_id if tokenizer is not None else None)
    state = read_state_dict(root)
    if hasattr(family, "config_from_state"):
        config = family.config_from_state(config, state)
    params = family.params_from_state_dict(state, config)
    return config, params, tokenizer


def load_config(path_or_repo_id: str) -> TransformerConfig:
    """The ``TransformerConfig`` ``load_pretrained`` gives, without its parameters: from
    ``config.json`` (and the weights, for a family whose config.json leaves a choice to them,
    e.g. T5's untied ``lm_head``).

    Raises:
      FileNotFoundError: no such folder or repository, or no config.json.
      ValueError: an unsupported ``model_type`` or config field (named).
    """
    root = resolve(path_or_repo_id)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {root}: is it a Hugging Face model folder?")
    hf = json.loads(config_path.read_text())
    family = family_of(hf)
    tokenizer = family.load_tokenizer(root)
    config = family.config_from_hf(hf, unk_id=tokenizer.unk_id if tokenizer is not None else None)
    if hasattr(family, "config_from_state"):
        config = family.config_from_state(config, read_state_dict(root))
    return config


def _generation_to_save(
    family: ModuleType, config: TransformerConfig, generation: Mapping[str, Any] | None
) -> dict[str, Any]:
    """generation_config.json's content for ``save_pretrained`` (see its ``generation``)."""
    ids = family.generation_ids(config)
    if generation is None:
        return family.default_generation(config)
    if not isinstance(generation, Mapping):
        raise ValueError(
            f"generation must be a dict (a generation config, e.g. hf.generation_config(folder))"
            f" or None; got {type(generation).__name__}"
        )
    wrong = [
        f"{k}={generation[k]!r} (config: {v!r})"
        for k, v in ids.items()
        if generation.get(k) is not None and generation[k] not in (v, [v])
    ]
    if wrong:
        raise ValueError(
            "generation names other special ids than the model config: " + "; ".join(wrong)
        )
    return {**ids, **generation}


def save_pretrained(
    directory: str,
    config: TransformerConfig,
    params: Any,
    tokenizer: Any = None,
    *,
    generation: Mapping[str, Any] | None = None,
    dequantize: bool = False,
    model_type: str | None = None,
) -> None:
    """Writes a Hugging Face model folder: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (float32) and, when given, the tokenizer's files.

    transformers' ``from_pretrained`` (e.g. ``MarianMTModel``) and CTranslate2's
    ``ct2-transformers-converter`` read the result (the converter needs the tokenizer);
    ``load_pretrained`` gives back bitwise the same parameters (a Marian model with one shared
    table and an untied output comes back as two equal tables: Marian unties all three then).

    Args:
      directory: the output folder (local or ``gs://``), created when missing.
      config: a ``TransformerConfig`` a supported family can express (see ``family_for``).
      params: its parameters (boxed or plain, scanned or unrolled, any float dtype).
      tokenizer: the family's tokenizer (its ``save`` writes its files, e.g. a
        ``marian_tokenizer.MarianTokenizer``: source.spm, target.spm, vocab.json,
        tokenizer_config.json), or None.
      generation: the generation config, written to generation_config.json as it is, every
        field kept (e.g. :func:`generation_config` of the folder the model came from: then
        ``MarianMTModel.generate`` decodes the saved folder as it decoded that one); the ids
        it lacks are added from ``config``. None: the ids and the forced EOS alone
        (transformers' defaults for the rest: greedy, 20 tokens).
      dequantize: write an int8 model (``config.quantization="int8"``, parameters from
        ``quantize.quantize_params``) as the float32 model of its dequantized weights
        (``q * scale``; a tied embedding's int8 copy is dropped, its float table kept):
        Hugging Face models have no int8 weights, so without this flag such a model is refused.
        No effect on a float model.
      model_type: the family to write (e.g. ``"marian"``); None: the only family that can
        express ``config``.

    Raises:
      ValueError: no family (or not ``model_type``'s) can express ``config``, or it is int8
        without ``dequantize``
        (the differing fields are named), or ``generation`` is not a dict or names other
        special ids than ``config``; nothing is written then.
    """
    from safetensors.numpy import save as save_safetensors

    # Everything that can fail does before anything is written.
    family = family_for(config, model_type=model_type, dequantize=dequantize)
    hf = family.config_to_hf(config, dequantize=dequantize)
    gen = _generation_to_save(family, config, generation)
    plain, plain_config = plain_params(params, config, dequantize)
    state = family.state_dict_from_params(plain, plain_config)
    root = paths.resolve(directory)
    paths.makedirs(root)
    paths.write_atomic(root / "config.json", json.dumps(hf, indent=2, sort_keys=True) + "\n")
    paths.write_atomic(
        root / "generation_config.json", json.dumps(gen, indent=2, sort_keys=True) + "\n"
    )
    blob = save_safetensors(state, metadata={"format": "pt"})
    paths.write_atomic(root / "model.safetensors", blob)
    if tokenizer is not None:
        tokenizer.save(str(root))


# ----------------------------------------------------------------------------- workdirs


def export_workdir(
    workdir: str,
    directory: str,
    *,
    step: int | None = None,
    average: int | None = None,
    dequantize: bool = False,
) -> TransformerConfig:
    """Writes a train.py workdir (e.g. a Marian model fine-tuned with
    configs/finetune_marian.py) as a Hugging Face folder of the family that can express its
    model (an EncoderDecoder, or a DecoderOnly for a ``DECODER_ONLY`` family such as Llama):
    its ``model_config.json``, the
    parameters of checkpoint ``step`` (default the latest; ``average`` > 1: the mean of that
    many last checkpoints; None: the run's ``average_checkpoints``, as its Translator
    decodes, else 1) and, when the workdir holds them, its tokenizer and the
    ``generation_config.json`` of the folder it was fine-tuned from (every field kept).
    ``dequantize``: an int8 model is written dequantized (see ``save_pretrained``).

    Raises:
      FileNotFoundError: no workdir, model_config.json or checkpoint.
      ValueError: no family can write the model, or int8 without ``dequantize``, or
        int8 with ``average`` > 1 (the differing fields are named).
    """
    from flaxformer_lite.core.checkpoints import average_params, choose_steps
    from flaxformer_lite.models import abstract_params

    root = paths.resolve(workdir)
    config_path = root / "model_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no model_config.json in {workdir}: is it a train.py workdir?")
    config = TransformerConfig.from_json(config_path.read_text())
    # A model no family can write fails here, before the checkpoint is read.
    family = family_for(config, dequantize=dequantize)
    if average is None:
        run_path = root / "config.json"
        run = json.loads(run_path.read_text()) if run_path.is_file() else {}
        average = run.get("average_checkpoints") or 1
    if config.quantization is not None and average != 1:
        raise ValueError(
            f"average={average} with quantization={config.quantization!r}: int8 values with "
            "different scales cannot be averaged; export one checkpoint (average=1)"
        )
    checkpoints = str(root / "checkpoints")
    steps = choose_steps(checkpoints, step=step, average=average)
    shapes = abstract_params(config, decoder_only=family.DECODER_ONLY)
    params = average_params(checkpoints, steps, shapes)
    # A run fine-tuned from a Hugging Face folder keeps that folder's generation config
    # (train.py copies it into the workdir): the export decodes as the original did.
    generation_path = root / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    save_pretrained(
        directory, config, params, family.load_tokenizer(root),
        generation=generation, dequantize=dequantize, model_type=family.MODEL_TYPES[0],
    )  # fmt: skip
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m flaxformer_lite.interop.hf --workdir W --out DIR``: a workdir to a Hugging Face
    folder of its family (then ``ct2-transformers-converter --model DIR`` for CTranslate2)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.interop.hf",
        description="Write a train.py workdir as a Hugging Face model folder ("
        + ", ".join(f.NAME for f in FAMILY_MODULES)
        + ").",
    )
    parser.add_argument("--workdir", required=True, help="train.py workdir (local or gs://)")
    parser.add_argument("--out", required=True, help="output folder (local or gs://)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument(
        "--average",
        type=int,
        default=None,
        help="average the last N checkpoints (default: the run's config.average_checkpoints, "
        "else 1)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write an int8 model (quantization='int8') as float32 q * scale weights "
        "(Hugging Face models have no int8 weights; without this flag an int8 model is refused)",
    )
    args = parser.parse_args(argv)
    if args.average is not None and args.average < 1:
        parser.error(f"argument --average: must be >= 1; got {args.average}")
    out = paths.resolve(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {args.out} is a file; give a folder")
    try:
        config = export_workdir(
            args.workdir, args.out, step=args.step, average=args.average, dequantize=args.dequantize
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    family = family_for(config, dequantize=args.dequantize)
    layers = (
        f"{config.num_decoder_layers} decoder layers"
        if family.DECODER_ONLY
        else f"{config.num_encoder_layers}+{config.num_decoder_layers} layers"
    )
    print(f"wrote {out}: {family.NAME} model, vocabulary {config.vocab_size}, {layers}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
