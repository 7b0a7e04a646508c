"""A serving artifact through ``jax.export``: the whole batch translation as one StableHLO program.

    python -m flaxformer_lite.inference.export --workdir runs/m30k --out serving/m30k --method beam
    python -m flaxformer_lite.inference.export --workdir opus-mt-en-de/ --out serving/en-de \
        --max-len 128

``--workdir`` is a ``train.py`` workdir (``model_config.json``, checkpoints, SentencePiece
vocabulary) or a Hugging Face Marian folder (``config.json``, ``model.safetensors``,
``source.spm``, ``target.spm``, ``vocab.json``). Either way the artifact decodes as
``Translator.from_pretrained(workdir).translate`` does: its ``GenerationConfig`` (the method,
beam size, length penalty, search options: a fine-tuned run's Hugging Face rules, forced EOS
and banned pad, a folder's generation config; and length limits: a workdir's per-row
``1.5 * source + 10``, ``max_len="source"``, a folder's ``max_length``). The output folder
holds the serialized program (``translate.jax``), the parameters (``params.npz``, names =
``/``-joined paths; bfloat16 leaves as bits, ``npz.py``), the vocabulary files,
``manifest.json`` (the config as ``generation``, ``GenerationConfig.to_dict()``),
``README.md`` and ``runtime.py`` (a copy of ``serving_runtime``), which loads it all without
flaxformer_lite, flax or optax: the packages it needs are ``serving_runtime.REQUIREMENTS``
(jax and what jax imports, sentencepiece, and flatbuffers, which jax.export's deserializer
needs but jax does not install), pinned in the manifest's ``requirements``.

The program is ``generate_jit`` itself (encoder once, then the cached greedy or beam search of
``decoding``) traced once with a symbolic batch size and source length
(``jax.export.symbolic_shape("b, s", constraints=["s <= max_source_len"])``):
``(params, source_ids int32 [b, s], row_max_len int32 [b]) -> (tokens int32 [b, max_len],
scores float32 [b])``. Limits: ``max_len`` (the output width and the key/value cache), the
method and its options are fixed at export; sampling is not exported (it needs a key
argument); the program runs on the platforms it was lowered for (``--platforms``, default the
exporting machine's) and on one device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.core import paths, sharding
from flaxformer_lite.decoding.generate import generate_jit
from flaxformer_lite.decoding.generation_config import SOURCE, GenerationConfig, resolve
from flaxformer_lite.inference import serving_runtime
from flaxformer_lite.inference.npz import save_params
from flaxformer_lite.inference.translator import Translator
from flaxformer_lite.nn.config import TransformerConfig

EXPORT_METHODS = ("beam", "greedy")
# How export_function and export_model decode unless told otherwise (a Translator's defaults).
DEFAULT_GENERATION = GenerationConfig(method="beam", max_len=SOURCE)
# The manifest's "decoding": the search options its runtime's program was traced with.
_BEAM_OPTIONS = ("beam_style", "early_stopping", "renormalize")
_CONSTRAINTS = ("forced_eos", "banned_ids")
FORMAT = "flaxformer_lite.inference.export/1"
RUNTIME_FILE = "runtime.py"
# Vocabulary kind -> {role: file name}; the same names in the workdir and in the artifact.
SPM_SHARED = {"source": "spm_shared.model", "target": "spm_shared.model"}
SPM_SEPARATE = {"source": "spm_src.model", "target": "spm_tgt.model"}
MARIAN = {"source": "source.spm", "target": "target.spm", "vocab": "vocab.json"}
# A Hugging Face encoder-decoder's own tokenizer (BART, mBART ...): its ``tokenizers`` pipeline,
# written by the export (``hf_json_tokenizer.JsonTokenizer.backend_json``).
HF_TOKENIZER = {"source": "tokenizer.json", "target": "tokenizer.json"}


def vocabulary_files(directory: str) -> tuple[str, dict[str, str]]:
    """(kind, {role: file name}) of the vocabulary in ``directory``: "hf" for the tokenizer of
    a Hugging Face encoder-decoder other than Marian (a folder, or a workdir fine-tuned from
    one: ``hf_tokenizer.json``), "spm" for a ``train.py`` workdir's SentencePiece model(s),
    "marian" for a Hugging Face Marian folder (with ``target_vocab`` when its
    ``tokenizer_config.json`` says ``separate_vocabs``).

    Raises:
      FileNotFoundError: none of the layouts is complete (the expected names are listed).
    """
    root = paths.resolve(directory)
    if _hf_model_type(root) is not None:
        return "hf", dict(HF_TOKENIZER)
    for kind, files in (("spm", SPM_SHARED), ("spm", SPM_SEPARATE), ("marian", MARIAN)):
        if all((root / name).is_file() for name in files.values()):
            files = dict(files)
            tokenizer_config = root / "tokenizer_config.json"
            if kind == "marian" and tokenizer_config.is_file():
                if json.loads(tokenizer_config.read_text()).get("separate_vocabs"):
                    files["target_vocab"] = "target_vocab.json"  # the target side's ids
            return kind, files
    raise FileNotFoundError(
        f"no exportable vocabulary in {directory}: expected spm_shared.model, spm_src.model + "
        "spm_tgt.model (train.py workdir) or source.spm + target.spm + vocab.json (Marian)"
    )


def _hf_model_type(root: Any) -> str | None:
    """The family of the Hugging Face tokenizer in ``root`` (a workdir's ``hf_tokenizer.json``,
    or a model folder's ``config.json`` of a family with one, Marian aside); else None."""
    from flaxformer_lite.data import hf_vocabulary
    from flaxformer_lite.data.hf_tokenizers import MODEL_TYPES

    if (root / hf_vocabulary.MARKER).is_file():
        return json.loads((root / hf_vocabulary.MARKER).read_text())["model_type"]
    if _is_hf_dir(root):
        model_type = json.loads((root / "config.json").read_text()).get("model_type")
        return model_type if model_type in MODEL_TYPES else None
    return None


def _hf_vocabulary(vocabulary_dir: str, config: TransformerConfig) -> dict[str, Any]:
    """The artifact's ``tokenizer.json`` text and what the runtime puts around it (the
    manifest's ``hf_tokenizer``) for the Hugging Face tokenizer in ``vocabulary_dir``.

    Raises:
      ValueError: a tokenizer without a ``tokenizers`` pipeline (SentencePiece-based), which
        the runtime cannot read.
    """
    from flaxformer_lite.data import hf_vocabulary
    from flaxformer_lite.data.hf_json_tokenizer import JsonTokenizer
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    root = paths.resolve(vocabulary_dir)
    if (root / hf_vocabulary.MARKER).is_file():
        source = hf_vocabulary.load_workdir_vocabularies(vocabulary_dir)[0]
    else:
        tokenizer = load_hf_tokenizer(vocabulary_dir, _hf_model_type(root))
        if tokenizer is None:
            raise FileNotFoundError(f"no tokenizer files in {vocabulary_dir}")
        source = hf_vocabulary.vocabularies(
            tokenizer, vocab_size=config.vocab_size, decoder_start_id=config.bos_id
        )[0]
    if not isinstance(source.tokenizer, JsonTokenizer):
        raise ValueError(
            f"the {source.tokenizer.model_type} tokenizer in {vocabulary_dir} is "
            f"{type(source.tokenizer).__name__} (SentencePiece); the serving runtime reads "
            "tokenizer.json pipelines only: save the folder's tokenizer with transformers as "
            "tokenizer.json first"
        )
    return {
        "json": source.tokenizer.backend_json(),
        "manifest": {
            "source_prefix": list(source.prefix_ids),
            "source_suffix": list(source.suffix_ids),
            "clean_up": source.tokenizer.cleans_up,
        },
    }


def _one_device_mesh() -> jax.sharding.Mesh:
    return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


def exported_generation(
    generation: GenerationConfig, config: TransformerConfig
) -> tuple[GenerationConfig, bool]:
    """(the config the program is traced with, whether each row gets its own limit).

    The program's output width is fixed at export: ``generation.max_len`` when an int, the
    model's positions for None and for "source" (the runtime then gives each row
    ``min(width, 1.5 * source + 10)`` tokens through the program's ``row_max_len``). The
    fields the method ignores take fixed values (``GenerationConfig.canonical``).

    Raises:
      ValueError: the method is not one of ``EXPORT_METHODS``, or ``generation`` does not fit
        ``config`` (``GenerationConfig.checked_for``).
    """
    if generation.method not in EXPORT_METHODS:
        raise ValueError(f"method must be one of {EXPORT_METHODS}; got {generation.method!r}")
    generation.checked_for(config)
    per_row = generation.max_len == SOURCE
    width = config.max_len if per_row else generation.decode_len(config)
    return generation.canonical().replace(max_len=width), per_row


def exported_params(params: Any) -> Any:
    """The parameters as an exported program takes them and ``params.npz`` stores them: one
    model's as they are; an ensemble's tuple as ``{"member_0": ..., "member_1": ...}``, which
    the runtime's ``unflatten`` of ``member_i/...`` names rebuilds (a tuple's leaves would be
    stored as ``[0]/...``, read back as a dict that no longer matches the program)."""
    if isinstance(params, (list, tuple)):
        return {f"member_{i}": p for i, p in enumerate(params)}
    return params


def export_function(
    params: Any,
    config: TransformerConfig,
    generation: GenerationConfig | None = None,
    *,
    platforms: Sequence[str] | None = None,
    **overrides: Any,
) -> jax.export.Exported:
    """``generate_jit`` for ``config`` exported with a symbolic batch and source length.

    The result maps ``(params, source_ids int32 [b, s], row_max_len int32 [b])`` to
    ``(tokens int32 [b, max_len], scores float32 [b])`` for any ``b >= 1`` and
    ``1 <= s <= config.max_len``; ``params`` are only read for their shapes and dtypes. A
    tuple of several models' parameters (an ensemble, as ``generate`` takes it) is exported as
    one program over the mean of their distributions that takes ``exported_params(params)``.
    ``generation`` (None: :data:`DEFAULT_GENERATION`, beam 4 over the model's positions) with
    ``overrides`` of its fields (``method="greedy", max_len=32``) says how it decodes; see
    :func:`exported_generation` for the width.

    Raises:
      ValueError: ``method`` not one of ``EXPORT_METHODS``, or an option that is not valid
        (e.g. a ``beam_size`` that is not a positive int, ``max_len`` out of
        ``[1, config.max_len]``: the field named).
      TypeError: an override that is not a GenerationConfig field.
    """
    # The artifact runs where this package and its oneDNN kernel are absent: XLA's int8 dot,
    # no custom call (the int32 products, and so the tokens, are the same).
    config = config.replace(int8_kernel="xla")
    traced, _ = exported_generation(resolve(generation, overrides, DEFAULT_GENERATION), config)
    mesh = _one_device_mesh()
    members = len(params) if isinstance(params, (list, tuple)) else 0
    params = exported_params(params)

    def translate(params, source_ids, row_max_len):
        if members:  # the stored {"member_i": ...} back to the ensemble's tuple
            params = tuple(params[f"member_{i}"] for i in range(members))
        return generate_jit(params, config, source_ids, traced, mesh=mesh, row_max_len=row_max_len)

    batch, source_len = jax.export.symbolic_shape("b, s", constraints=(f"s <= {config.max_len}",))
    specs = (
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
        jax.ShapeDtypeStruct((batch, source_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    return jax.export.export(jax.jit(translate), platforms=platforms)(*specs)


def requirements() -> list[str]:
    """``serving_runtime.REQUIREMENTS`` pinned to the versions installed here (pip names)."""
    from importlib import metadata

    return [f"{name}=={metadata.version(name)}" for name in serving_runtime.REQUIREMENTS]


def _readme(manifest: Mapping[str, Any]) -> str:
    return (
        "# flaxformer_lite serving artifact\n\n"
        f"Needs Python with: `pip install {' '.join(manifest['requirements'])}`\n"
        "(no flaxformer_lite, flax or optax).\n\n"
        "```python\nimport sys; sys.path.insert(0, ARTIFACT)\nimport runtime\n"
        'model = runtime.load(ARTIFACT)\nmodel.translate(["A dog runs."])\n```\n\n'
        f"Decoding: {manifest['method']}, beam size {manifest['beam_size']}, alpha "
        f"{manifest['alpha']}, options {manifest['decoding']}, at most {manifest['max_len']} "
        "tokens per row"
        + (" (1.5 x source + 10 when less)" if manifest["per_row_limit"] else "")
        + ". See manifest.json.\n"
    )


def _versions() -> dict[str, str]:
    import flax
    import jaxlib
    import sentencepiece

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "sentencepiece": sentencepiece.__version__,
    }


def export_model(
    params: Any,
    config: TransformerConfig,
    out_dir: str,
    vocabulary_dir: str,
    generation: GenerationConfig | None = None,
    *,
    batch_size: int = 8,
    platforms: Sequence[str] | None = None,
    source: str = "",
    **overrides: Any,
) -> dict[str, Any]:
    """Writes the serving artifact of an EncoderDecoder to the local folder ``out_dir``.

    Args:
      params: unboxed, unrolled parameters (``Translator.params`` or ``hf.load_pretrained``'s),
        or a tuple of several models' (an ensemble: ``Translator.ensemble``'s).
      config: their TransformerConfig.
      vocabulary_dir: where the vocabulary files are (see :func:`vocabulary_files`).
      generation, platforms, overrides: as :func:`export_function`. Its ``max_len``:
        "source" (the default): ``runtime.translate`` gives each row ``min(model max_len,
        1.5 * source + 10)`` tokens (a workdir's ``Translator``); an int: that many tokens
        for every row (e.g. a Hugging Face folder's ``max_length``).
      batch_size: the rows per call ``runtime.translate`` pads to (one compiled shape).
      source: where the model came from, for the manifest.

    Returns:
      the manifest (also written as ``manifest.json``): ``generation`` (the exported
      ``GenerationConfig.to_dict()``) and, as before it, ``method``, ``beam_size``,
      ``alpha``, ``decoding`` (the search options), ``max_len`` (the output width) and
      ``per_row_limit``, which the runtime reads.

    Raises:
      ValueError: see :func:`export_function`; ``batch_size`` not a positive int.
      FileNotFoundError: no vocabulary in ``vocabulary_dir``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    generation = resolve(generation, overrides, DEFAULT_GENERATION)
    traced, per_row_limit = exported_generation(generation, config)
    kind, files = vocabulary_files(vocabulary_dir)
    hf_tokenizer = _hf_vocabulary(vocabulary_dir, config) if kind == "hf" else None
    params = jax.tree_util.tree_map(np.asarray, params)
    exported = export_function(params, config, traced, platforms=platforms)
    params = exported_params(params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / serving_runtime.EXPORTED).write_bytes(exported.serialize())
    param_bits = save_params(out / serving_runtime.PARAMS, params)
    vocab_root = paths.resolve(vocabulary_dir)
    if hf_tokenizer is not None:
        (out / HF_TOKENIZER["source"]).write_text(hf_tokenizer["json"], encoding="utf-8")
    else:
        for name in set(files.values()):
            (out / name).write_bytes((vocab_root / name).read_bytes())
    shutil.copyfile(serving_runtime.__file__, out / RUNTIME_FILE)
    options = (_BEAM_OPTIONS if traced.method == "beam" else ()) + _CONSTRAINTS
    manifest = {
        "format": FORMAT,
        "source": source,
        "generation": generation.canonical().to_dict(),
        "method": traced.method,
        "beam_size": traced.beam_size,
        "alpha": traced.alpha,
        "decoding": {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in ((k, getattr(traced, k)) for k in options)
        },
        "max_len": traced.max_len,
        "per_row_limit": per_row_limit,
        "max_source_len": config.max_len,
        "batch_size": batch_size,
        "param_bits": param_bits,
        "ids": {
            "pad": config.pad_id,
            "eos": config.eos_id,
            "unk": config.unk_id,
            "decoder_start": config.bos_id,
        },
        "vocabulary": kind,
        "vocabulary_files": files,
        "platforms": list(exported.platforms),
        "signature": (
            "(params, source_ids int32 [b, s], row_max_len int32 [b]) -> "
            "(tokens int32 [b, max_len], scores float32 [b]); 1 <= s <= max_source_len"
        ),
        "calling_convention_version": exported.calling_convention_version,
        "versions": _versions(),
        "requirements": requirements(),
    }
    if hf_tokenizer is not None:
        from importlib import metadata

        manifest["hf_tokenizer"] = hf_tokenizer["manifest"]
        manifest["requirements"].append(f"tokenizers=={metadata.version('tokenizers')}")
    (out / serving_runtime.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(_readme(manifest))
    return manifest


def export_translator(
    translator: Translator,
    out_dir: str,
    vocabulary_dir: str,
    generation: GenerationConfig | None = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`export_model` of a ``Translator``'s parameters and config, decoding as its
    ``translate`` does by default: ``generation`` None = ``translator.generation``, with
    ``options``' GenerationConfig fields replacing its own (e.g. ``max_len=64``: 64 tokens
    for every row, as ``translate(max_len=64)``); ``source`` defaults to its name.
    ``vocabulary_dir``: the folder of its vocabulary files (its workdir or Hugging Face
    folder)."""
    generation = translator.generation if generation is None else generation
    options.setdefault("source", translator.name)
    params = jax.device_get(translator.params)
    return export_model(params, translator.config, out_dir, vocabulary_dir, generation, **options)


def _is_hf_dir(root: Any) -> bool:
    return (root / "config.json").is_file() and not (root / "model_config.json").is_file()


def _is_decoder_only_hf_dir(root: Any) -> bool:
    """A Hugging Face folder of a decoder-only family (``interop.llama``): exported as a
    prompt-continuation artifact (``export_lm``)."""
    if not _is_hf_dir(root):
        return False
    from flaxformer_lite.interop import hf

    model_type = json.loads((root / "config.json").read_text()).get("model_type")
    return model_type in hf.FAMILIES and hf.FAMILIES[model_type].DECODER_ONLY


def export_workdir(workdir: str, out_dir: str, **options: Any) -> dict[str, Any]:
    """:func:`export_translator` of ``Translator.from_pretrained(workdir)``: a ``train.py``
    workdir (latest checkpoint, decoding as its Translator: the run's beam size, alpha and
    search options) or a Hugging Face Marian folder (decoding as ``MarianMTModel.generate``
    with the folder's generation config); explicit ``options`` (GenerationConfig fields,
    ``batch_size``, ``platforms``, ``source``) win. A Hugging Face folder of a decoder-only
    family (Llama) becomes a prompt-continuation artifact instead
    (``export_lm.export_hf_folder``; ``max_len`` then counts new tokens).

    Raises:
      FileNotFoundError: ``workdir`` does not exist, or lacks the model, weights or
        vocabulary files (named).
      ValueError: a bad option (see :func:`export_model`), or a model that is not Marian.
    """
    root = paths.resolve(workdir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"workdir {workdir} does not exist; give a train.py workdir or a Hugging Face "
            "Marian folder"
        )
    if _is_decoder_only_hf_dir(root):  # a prompt-continuation artifact (Llama)
        from flaxformer_lite.inference import export_lm

        return export_lm.export_hf_folder(workdir, out_dir, **options)
    vocabulary_files(workdir)  # before the weights are read
    if _is_hf_dir(root):
        options.setdefault("source", str(root))
    translator = Translator.from_pretrained(workdir)
    return export_translator(translator, out_dir, workdir, **options)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.inference.export",
        description="Export a translation model as a jax.export serving artifact.",
    )
    parser.add_argument(
        "--workdir",
        required=True,
        help="train.py workdir, Hugging Face Marian / BART folder, or Hugging Face Llama "
        "folder (a prompt-continuation artifact)",
    )
    parser.add_argument("--out", required=True, help="output folder (local)")
    parser.add_argument(
        "--method",
        choices=EXPORT_METHODS,
        default=None,
        help="default: the model's (its Translator's: beam for a workdir; a Hugging Face "
        "folder's generate: greedy unless num_beams > 1)",
    )
    parser.add_argument(
        "--beam-size", type=int, default=None, help="beams (default: the model's, else 4)"
    )
    parser.add_argument("--alpha", type=float, default=None, help="GNMT length penalty")
    parser.add_argument(
        "--max-len", type=int, default=None, help="output tokens (default: the model's max_len)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="rows per call of runtime.translate"
    )
    parser.add_argument(
        "--platforms",
        default=None,
        help="comma-separated jax platforms to lower for, e.g. cpu,cuda (default: this one)",
    )
    args = parser.parse_args(argv)
    for flag, value in (
        ("--beam-size", args.beam_size),
        ("--max-len", args.max_len),
        ("--batch-size", args.batch_size),
    ):
        if value is not None and value < 1:
            parser.error(f"argument {flag}: must be an int >= 1; got {value}")
    if Path(args.out).is_file():
        parser.error(f"argument --out: {args.out} is a file; give a folder")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options: dict[str, Any] = dict(batch_size=args.batch_size)
    options.update(
        {
            k: v
            for k, v in dict(
                method=args.method,
                beam_size=args.beam_size,
                alpha=args.alpha,
                max_len=args.max_len,
            ).items()
            if v is not None
        }
    )
    if args.platforms:
        options["platforms"] = [p.strip() for p in args.platforms.split(",") if p.strip()]
    try:
        manifest = export_workdir(args.workdir, args.out, **options)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "continuation" if manifest.get("kind") == "lm" else "translation"
    print(f"exported {manifest['method']} {what} of {args.workdir} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
