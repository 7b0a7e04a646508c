"""Attention's projections: into heads (``HeadProjection``; ``FusedQKVProjection`` for
self-attention's queries, keys and values at once) and back out (``OutputProjection``).

Each holds an int8 kernel and its scales with ``quantization="int8"`` (``dense.make_kernel``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.nn.dense import kernel_matmul, make_kernel

Array = jax.Array
Dtype = Any

_zeros = nn.initializers.zeros_init()

QUERY_AXES = ("embed", "heads", "kv")
# Key/value projections: their heads split over "tensor" when the tensor degree divides them;
# else (multi-query, few kv heads) their input axis does (sharding.LOGICAL_RULES).
KV_AXES = ("kv_embed", "kv_heads", "kv")


class HeadProjection(nn.Module):
    """`[batch, len, features]` -> `[batch, len, heads, head_dim]` with kernel `[embed, heads, kv]`.

    Written out instead of ``nn.DenseGeneral``, which initialises a flattened kernel and so
    cannot carry rank-3 logical axis names through sharding constraints. ``axis_names``: the
    kernel's logical names (``QUERY_AXES``, or ``KV_AXES`` for keys and values).
    """

    heads: int
    head_dim: int
    axis_names: tuple[str, str, str] = QUERY_AXES
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None
    int8_kernel: str = "auto"  # with an int8 kernel: what multiplies it (quantize.int8_product)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
        shape = (x.shape[-1], self.heads, self.head_dim)
        kernel, scale = make_kernel(
            self, "kernel", init, self.axis_names, shape, self.param_dtype, self.quantization
        )
        y = kernel_matmul(
            "bld,dhk->blhk", x, kernel, scale, self.dtype, int8_kernel=self.int8_kernel
        )
        if self.use_bias:
            bias = read_param(
                self,
                "bias",
                logical_init(_zeros, self.axis_names[1:]),
                (self.heads, self.head_dim),
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


def _xavier_heads(key: Array, embed: int, heads: int, head_dim: int, dtype: Dtype) -> Array:
    """`[embed, heads, head_dim]` as ``HeadProjection`` initialises it."""
    init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
    return init(key, (embed, heads, head_dim), dtype)


def _fused_mha_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """`[embed, 3, heads, head_dim]`: query, key and value kernels each initialised as a separate
    ``HeadProjection`` would be."""
    embed, _, heads, head_dim = shape
    parts = [_xavier_heads(r, embed, heads, head_dim, dtype) for r in jax.random.split(key, 3)]
    return jnp.stack(parts, axis=1)


def _fused_kv_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """`[embed, 2, kv_heads, head_dim]`: key and value kernels as separate projections."""
    embed, _, kv_heads, head_dim = shape
    parts = [_xavier_heads(r, embed, kv_heads, head_dim, dtype) for r in jax.random.split(key, 2)]
    return jnp.stack(parts, axis=1)


class FusedQKVProjection(nn.Module):
    """Self-attention's queries, keys and values with fused kernels.

    `[batch, len, features]` -> query `[batch, len, heads, head_dim]`, key and value
    `[batch, len, kv_heads, head_dim]`. Two layouts, each splitting heads under tensor
    parallelism for any ``num_kv_heads``:

    * multi-head (``kv_heads == heads``): one kernel `[embed, 3, heads, head_dim]` (query, key,
      value stacked on axis 1; logical axes ("embed", None, "heads", "kv")), one matmul: each
      tensor-parallel device holds the query, key and value of its own heads.
    * grouped- and multi-query: ``query_kernel`` `[embed, heads, head_dim]` ("embed", "heads",
      "kv") and ``kv_kernel`` `[embed, 2, kv_heads, head_dim]` ("kv_embed", None, "kv_heads",
      "kv"), two matmuls. Query heads split over "tensor"; the key/value kernel splits its kv
      heads when the tensor degree divides them, else its input axis (each device projects its
      slice of d_model, one all-reduce of the small keys/values): never replicated whole.

    Query head ``h`` uses kv head ``h // (heads // kv_heads)``, the grouping of ``attention``.
    """

    heads: int
    kv_heads: int
    head_dim: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None
    int8_kernel: str = "auto"  # with an int8 kernel: what multiplies it (quantize.int8_product)

    def _project(self, x: Array, name: str, init, names: tuple, shape: tuple) -> Array:
        """x `[b, l, embed]` times kernel `[embed, *shape]` (+ bias `[*shape]`)."""
        kernel, scale = make_kernel(
            self,
            f"{name}kernel",
            init,
            names,
            (x.shape[-1], *shape),
            self.param_dtype,
            self.quantization,
        )
        y = kernel_matmul(
            "bld,d...->bl...", x, kernel, scale, self.dtype, int8_kernel=self.int8_kernel
        )
        if self.use_bias:
            bias_init = logical_init(_zeros, names[1:])
            bias = read_param(self, f"{name}bias", bias_init, shape, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, Array, Array]:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        d = self.head_dim
        if self.kv_heads == self.heads:
            names = ("embed", None, "heads", "kv")
            y = self._project(x, "", _fused_mha_init, names, (3, self.heads, d))
            return y[:, :, 0], y[:, :, 1], y[:, :, 2]
        init = lambda key, shape, dtype=jnp.float32: _xavier_heads(key, *shape, dtype)  # noqa: E731
        query = self._project(x, "query_", init, QUERY_AXES, (self.heads, d))
        names = ("kv_embed", None, "kv_heads", "kv")
        kv = self._project(x, "kv_", _fused_kv_init, names, (2, self.kv_heads, d))
        return query, kv[:, :, 0], kv[:, :, 1]


class OutputProjection(nn.Module):
    """`[batch, len, heads, head_dim]` -> `[batch, len, features]`, kernel `[heads, kv, embed]`."""

    features: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None
    int8_kernel: str = "auto"  # with an int8 kernel: what multiplies it (quantize.int8_product)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)
        names = ("heads", "kv", "embed")
        shape = (x.shape[-2], x.shape[-1], self.features)
        kernel, scale = make_kernel(
            self, "kernel", init, names, shape, self.param_dtype, self.quantization, in_axes=2
        )
        y = kernel_matmul(
            "blhk,hkd->bld", x, kernel, scale, self.dtype, in_axes=2, int8_kernel=self.int8_kernel
        )
        if self.use_bias:
            bias = read_param(
                self, "bias", logical_init(_zeros, ("embed",)), (self.features,), self.param_dtype
            )
            y = y + bias.astype(self.dtype)
        return y
