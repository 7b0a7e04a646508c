"""Int8 inference: int8 weights with per-output-channel scales, int8 x int8 -> int32 matmuls.

The scheme is CTranslate2's ``int8``: every weight matrix `[in..., out...]` is stored as int8
``q`` with one float32 scale per output channel ``s = max|w[:, c]| / 127`` (``w ~ q * s``,
round to nearest, so ``|w - q * s| <= s / 2``). At run time each activation row is quantized
the same way (dynamic, per row: ``x ~ p * r``), the int8 dot accumulates exactly in int32 and
the result is rescaled: ``y[i, c] = (p @ q)[i, c] * r[i] * s[c]``. On an x86-64 CPU the int32
product comes from oneDNN's VNNI / AMX kernel (``onednn_int8``; ``int8_product``'s
``kernel``, ``TransformerConfig.int8_kernel``), elsewhere from XLA's int8 dot: exact either way.

Quantized: the attention projections (query/key/value or fused, output), the feed-forward
``wi``/``wi_up``/``wo`` and the output projection (the untied ``logits`` kernel, or for a tied
embedding an int8 copy of the table transposed, ``attend_kernel`` `[embed, vocab]`, beside the
float table that token lookups keep reading). Embedding lookups, norms, biases, position tables
and mixture-of-experts blocks stay float.

    params_q = quantize_params(params, config)    # a float model's parameter tree
    config_q = config.replace(quantization="int8")
    logits = EncoderDecoder(config_q).apply({"params": params_q}, inputs, targets)

``quantize_params`` is a pure function of the tree: the quantized tree has exactly the names,
shapes and dtypes that ``init`` of the model under ``config_q`` gives (``param_shardings``
places it with the same logical axes).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.ops import onednn_int8

Array = jax.Array

QUANTIZATIONS = (None, "int8")
# What multiplies int8 matrices on a CPU (``int8_product``): exact int32 products either way.
INT8_KERNELS = ("auto", "xla", "onednn")
# "auto" leaves matrices of fewer entries, or of fewer input rows (k), to XLA's dot: an opus-mt
# size model (k 512 and 2,048) decodes 1.6-2.3x faster with oneDNN, the d_model 128 Multi30k
# model 0.89-0.95x with oneDNN on its [128, 8000] logits matrix (docs/benchmarks.md, "int8
# through oneDNN").
ONEDNN_MIN_WEIGHTS = 512 * 512
ONEDNN_MIN_DEPTH = 512
SCALE_SUFFIX = "_scale"
# Parent module name -> how many leading kernel axes are contracted (the input axes).
_IN_AXES = {"query": 1, "key": 1, "value": 1, "qkv": 1, "out": 2, "logits": 1}
_IN_AXES.update(wi=1, wi_up=1, wo=1)
_KERNELS = ("kernel", "query_kernel", "kv_kernel")
# An int8 product of fewer rows is computed on this many (zeros below): XLA's CPU int8 dot of
# 1 row runs at 0.12-0.39x the float32 one, of 4 rows (3 of them zeros) at 2-3x, on an AVX-512
# VNNI / AMX Xeon (bench/int8_matmul.py, its int8_pad4; docs/benchmarks.md). Greedy decoding of one
# sentence is all 1-row products.
MIN_INT8_ROWS = 4


def check_quantization(value: Any, name: str = "quantization") -> None:
    """Raises ValueError unless ``value`` is one of ``QUANTIZATIONS``."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"{name} must be one of {QUANTIZATIONS}; got {value!r}")


def quantize_weight(w: Any, in_axes: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of ``w`` `[in..., out...]` per output channel.

    The first ``in_axes`` axes are the contracted (input) ones: each output channel gets the
    scale ``max|w|`` over them / 127 (1 for an all-zero channel). Returns int8 ``q`` (shape of
    ``w``, values in [-127, 127]) and float32 ``scale`` `[out...]` with
    ``|w - q * scale| <= scale / 2`` elementwise.
    """
    w = np.asarray(w, np.float32)
    absmax = np.abs(w).max(axis=tuple(range(in_axes)))
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def quantize_rows(x: Array) -> tuple[Array, Array]:
    """Dynamic int8 quantization of activations `[rows, k]`: int8 `[rows, k]` and float32
    scales `[rows, 1]` (a row's absmax / 127; rows of zeros get scale 1)."""
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def int8_matmul(x: Array, q: Array, scale: Array, in_axes: int = 1, kernel: str = "auto") -> Array:
    """``x`` float `[..., in...]` times int8 ``q`` `[in..., out...]` with per-output-channel
    ``scale`` `[out...]` -> float32 `[..., out...]`.

    The last ``in_axes`` axes of ``x`` are contracted with the first ``in_axes`` of ``q``.
    Each row of ``x`` is quantized to int8 (``quantize_rows``), multiplied exactly in int32
    (``int8_product``, by ``kernel``), then rescaled by its row scale and the channel scales.
    """
    in_shape, out_shape = q.shape[:in_axes], q.shape[in_axes:]
    if x.shape[x.ndim - in_axes :] != in_shape:
        raise ValueError(f"x {x.shape} does not end in the kernel's input axes {in_shape}")
    batch = x.shape[: x.ndim - in_axes]
    k, n = int(np.prod(in_shape)), int(np.prod(out_shape))
    xq, row_scale = quantize_rows(x.reshape(-1, k).astype(jnp.float32))
    acc = int8_product(xq, q.reshape(k, n), kernel)
    y = acc.astype(jnp.float32) * row_scale * scale.reshape(1, n).astype(jnp.float32)
    return y.reshape(*batch, *out_shape)


def check_int8_kernel(value: Any, name: str = "int8_kernel") -> None:
    """Raises ValueError unless ``value`` is one of ``INT8_KERNELS``."""
    if value not in INT8_KERNELS:
        raise ValueError(f"{name} must be one of {INT8_KERNELS}; got {value!r}")


def int8_product(xq: Array, q: Array, kernel: str = "auto") -> Array:
    """int8 `[rows, k]` x int8 `[k, n]` -> the exact int32 product `[rows, n]`.

    ``kernel``: "onednn" multiplies with oneDNN's kernel on the CPU (``onednn_int8``; refused
    with its reason where it does not load), "xla" with XLA's int8 dot, "auto" with oneDNN
    where it loads, the default backend is the CPU and the matrix has ``ONEDNN_MIN_WEIGHTS``
    entries or more and ``ONEDNN_MIN_DEPTH`` rows or more. The choice is made per platform at
    lowering: other platforms always take XLA's dot. Under a symbolic row count
    (``jax.export``) XLA's dot too.
    """
    check_int8_kernel(kernel)
    rows = xq.shape[0]
    # "auto" on a GPU / TPU host: XLA's dot without building the CPU kernel.
    skip = kernel == "auto" and (
        q.shape[0] * q.shape[1] < ONEDNN_MIN_WEIGHTS
        or q.shape[0] < ONEDNN_MIN_DEPTH
        or jax.default_backend() != "cpu"
    )
    if kernel != "xla" and not skip and isinstance(rows, int):
        reason = onednn_int8.unavailable_reason()
        if reason is None:
            return jax.lax.platform_dependent(
                xq, q, cpu=onednn_int8.int8_product, default=_xla_int8_product
            )
        if kernel == "onednn":
            raise ValueError(f"int8_kernel='onednn' is not available here: {reason}")
        if onednn_int8.fixable():
            _warn_once(f"int8 products take XLA's slower int8 dot, not oneDNN's: {reason}")
    return _xla_int8_product(xq, q)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _xla_int8_product(xq: Array, q: Array) -> Array:
    rows = xq.shape[0]
    # Zero rows: their int32 products are zeros, sliced off. (Not under a symbolic row count,
    # jax.export's shape polymorphism: no static shape to pad.)
    if isinstance(rows, int) and rows < MIN_INT8_ROWS:
        xq = jnp.pad(xq, ((0, MIN_INT8_ROWS - rows), (0, 0)))
    return jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)[
        :rows
    ]


def quantize_params(params: Any, config: Any) -> Any:
    """The int8 parameter tree of a float model's ``params`` (nested dicts, unboxed) for the
    ``TransformerConfig`` ``config`` it was built with (an ``EncoderDecoder`` or a
    ``DecoderOnly``).

    Every quantized kernel (see the module docstring) becomes int8 with a ``<name>_scale``
    sibling `[out...]`; with ``config.tie_output_embedding`` the embedding that gives the logits
    (``target_embedding``, else the shared ``source_embedding``, else a decoder-only model's
    ``embedding``) gains ``attend_kernel`` int8 `[embed, vocab]` and ``attend_kernel_scale``
    `[vocab]`; everything else is returned unchanged. A scanned (``scan_layers``) tree is
    refused: unroll it first (``models.unrolled``, as ``generate`` and the translator do).
    """
    if config.scan_layers:
        raise ValueError(
            "quantize_params takes an unrolled model; convert a scan_layers model with "
            "models.unrolled first"
        )
    out = _quantize(params, parent="")
    if config.tie_output_embedding:
        name = next(n for n in ("target_embedding", "source_embedding", "embedding") if n in out)
        table = np.asarray(out[name]["embedding"], np.float32)  # [vocab, embed]
        kernel, scale = quantize_weight(table.T)
        out[name] = {**out[name], "attend_kernel": kernel, "attend_kernel" + SCALE_SUFFIX: scale}
    return out


def _quantize(tree: Any, parent: str) -> Any:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out[name] = _quantize(value, name)
        elif name in _KERNELS and parent in _IN_AXES:
            out[name], out[name + SCALE_SUFFIX] = quantize_weight(value, _IN_AXES[parent])
        else:
            out[name] = value
    return out


def dequantize_params(params: Any) -> Any:
    """The float parameter tree of a ``quantize_params`` tree (nested dicts, unboxed): every
    int8 kernel with a ``<name>_scale`` sibling becomes float32 ``q * scale`` (the scale
    broadcast over the kernel's input axes) and loses its scale; a tied embedding's
    ``attend_kernel`` (an int8 copy of the float table that the tree keeps) is dropped.
    Everything else is returned unchanged, so a float tree comes back as it was. The result
    has the names and shapes of the float model's tree (``quantization=None``)."""
    out = {}
    for name, value in params.items():
        if name.startswith("attend_kernel") or (
            name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in params
        ):
            continue
        if isinstance(value, Mapping):
            out[name] = dequantize_params(value)
        elif name + SCALE_SUFFIX in params:
            scale = np.asarray(params[name + SCALE_SUFFIX], np.float32)
            out[name] = np.asarray(value, np.float32) * scale
        else:
            out[name] = value
    return out
