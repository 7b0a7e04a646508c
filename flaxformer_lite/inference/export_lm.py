"""A prompt-continuation serving artifact of a decoder-only model (Llama) through ``jax.export``.

    python -m flaxformer_lite.inference.export --workdir llama-folder/ --out serving/lm \\
        --max-len 64

(``export.main`` hands a Hugging Face folder of a decoder-only family here.) The program is
``continue_prompt_jit`` itself (prefill of the left-padded prompts, then the cached greedy or
beam search) traced once with a symbolic batch size and prompt length
(``2 <= prompt_len <= max_prompt_len``, what the model's positions leave after ``max_len`` new
tokens): ``(params, prompt_ids int32 [b, p], left_padding int32 [b]) -> (tokens int32 [b,
max_len], scores float32 [b])``. The folder also holds the parameters (``params.npz``), the
model's ``tokenizer.json`` when it has one, ``manifest.json``, ``README.md`` and ``runtime.py``
(a copy of ``lm_runtime``, which runs it without flaxformer_lite). Decoding follows the
folder's generation config as ``GenerationConfig.from_hugging_face`` reads it (prompt ids as
given: the tokenizer adds BOS); ``max_len`` must be an int (the output width is fixed).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.core import paths, sharding
from flaxformer_lite.decoding.generate import continue_prompt_jit
from flaxformer_lite.decoding.generation_config import GenerationConfig
from flaxformer_lite.inference import lm_runtime
from flaxformer_lite.inference.npz import save_params
from flaxformer_lite.nn.config import TransformerConfig

EXPORT_METHODS = ("beam", "greedy")
FORMAT = "flaxformer_lite.inference.export_lm/1"


def max_prompt_len(config: TransformerConfig, generation: GenerationConfig) -> int:
    """The longest prompt the program takes: the model's positions less ``max_len`` new
    tokens (and BOS when ``prepend_bos``).

    Raises:
      ValueError: ``max_len`` is not an int, ``method`` cannot be exported, or no prompt fits.
    """
    if generation.method not in EXPORT_METHODS:
        raise ValueError(f"method must be one of {EXPORT_METHODS}; got {generation.method!r}")
    if not isinstance(generation.max_len, int):
        raise ValueError(
            f"max_len must be an int (the artifact's output width) for a prompt-continuation "
            f"export; got {generation.max_len!r}"
        )
    longest = config.max_len - generation.max_len - (1 if generation.prepend_bos else 0)
    if longest < 2:  # the program's prompts have 2 columns at least
        raise ValueError(
            f"max_len={generation.max_len} new tokens leave no prompt room in the model's "
            f"max_len={config.max_len} positions"
        )
    return longest


def export_function(
    params: Any,
    config: TransformerConfig,
    generation: GenerationConfig,
    *,
    platforms: Sequence[str] | None = None,
) -> jax.export.Exported:
    """``continue_prompt_jit`` for ``config`` exported with a symbolic batch and prompt length;
    ``params`` are only read for their shapes and dtypes."""
    # The artifact runs where this package and its oneDNN kernel are absent: XLA's int8 dot,
    # no custom call (the int32 products, and so the tokens, are the same).
    config = config.replace(int8_kernel="xla")
    longest = max_prompt_len(config, generation)
    traced = generation.canonical()
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])

    def continue_(params, prompt_ids, left_padding):
        return continue_prompt_jit(
            params, config, prompt_ids, traced, mesh=mesh, left_padding=left_padding
        )

    # At least 2 columns: the prefill writes all but the last (a one-id prompt comes padded).
    batch, prompt_len = jax.export.symbolic_shape("b, p", constraints=("p >= 2", f"p <= {longest}"))
    specs = (
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
        jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    return jax.export.export(jax.jit(continue_), platforms=platforms)(*specs)


def export_model(
    params: Any,
    config: TransformerConfig,
    out_dir: str,
    generation: GenerationConfig,
    *,
    tokenizer_dir: str | None = None,
    batch_size: int = 8,
    platforms: Sequence[str] | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Writes the prompt-continuation artifact of a ``DecoderOnly`` to the local ``out_dir``
    and returns its manifest. ``tokenizer_dir``: a folder whose ``tokenizer.json`` is copied
    (``lm_runtime.ServingLM.complete`` then takes text).

    Raises:
      ValueError: see :func:`max_prompt_len`; ``batch_size`` not a positive int.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    longest = max_prompt_len(config, generation)
    params = jax.tree_util.tree_map(np.asarray, params)
    exported = export_function(params, config, generation, platforms=platforms)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / lm_runtime.EXPORTED).write_bytes(exported.serialize())
    param_bits = save_params(out / lm_runtime.PARAMS, params)
    tokenizer = None if tokenizer_dir is None else paths.resolve(tokenizer_dir) / "tokenizer.json"
    if tokenizer is not None and tokenizer.is_file():
        (out / lm_runtime.TOKENIZER).write_bytes(tokenizer.read_bytes())
    shutil.copyfile(lm_runtime.__file__, out / "runtime.py")
    traced = generation.canonical()
    manifest = {
        "format": FORMAT,
        "kind": lm_runtime.KIND,
        "source": source,
        "generation": traced.to_dict(),
        "method": traced.method,
        "max_len": traced.max_len,
        "max_prompt_len": longest,
        "param_bits": param_bits,
        "prepend_bos": traced.prepend_bos,
        "batch_size": batch_size,
        "ids": {"pad": config.pad_id, "eos": config.eos_id, "bos": config.bos_id},
        "tokenizer": (out / lm_runtime.TOKENIZER).is_file(),
        "platforms": list(exported.platforms),
        "signature": (
            "(params, prompt_ids int32 [b, p], left_padding int32 [b]) -> "
            "(tokens int32 [b, max_len], scores float32 [b]); 2 <= p <= max_prompt_len"
        ),
        "versions": {"jax": jax.__version__, "numpy": np.__version__},
    }
    (out / lm_runtime.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(
        "# flaxformer_lite prompt-continuation artifact\n\n"
        "Needs jax, numpy and flatbuffers (and tokenizers for text).\n\n"
        "```python\nimport sys; sys.path.insert(0, ARTIFACT)\nimport runtime\n"
        "model = runtime.load(ARTIFACT)\nmodel.continue_ids([[1, 450, 4996]])\n```\n\n"
        f"Decoding: {traced.method}, at most {traced.max_len} new tokens after prompts of up "
        f"to {longest} ids. See manifest.json.\n"
    )
    return manifest


def export_hf_folder(folder: str, out_dir: str, **options: Any) -> dict[str, Any]:
    """:func:`export_model` of a Hugging Face decoder-only folder, decoding as its generation
    config says (``GenerationConfig.from_hugging_face``) with ``options``' GenerationConfig
    fields replacing its own (``max_len``, ``method``, ``beam_size``, ``alpha``) and
    ``batch_size``, ``platforms``, ``source`` passed on.

    Raises:
      FileNotFoundError, ValueError: as ``hf.load_pretrained`` and :func:`export_model`.
    """
    from flaxformer_lite.interop import hf

    config, params, _ = hf.load_pretrained(folder)
    passed = {k: options.pop(k) for k in ("batch_size", "platforms") if k in options}
    source = options.pop("source", str(folder))
    generation = GenerationConfig.from_hugging_face(folder, config).replace(**options)
    return export_model(
        params, config, out_dir, generation, tokenizer_dir=folder, source=source, **passed
    )
