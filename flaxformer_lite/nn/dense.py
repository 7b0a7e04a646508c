"""Kernels that may be int8: their parameters, their matmul, and ``Int8Dense``.

Every kernel carries logical axis names ("embed", "heads", "kv", "mlp", "vocab"; key/value
projections "kv_embed" and "kv_heads", see ``sharding.LOGICAL_RULES``) through
``core.logical_params.logical_init`` (linen's logical partitioning box, which also becomes a
sharded ``nnx.Variable``), so sharding rules can place it without touching the layers. With
``quantization="int8"`` a kernel is stored as int8 with a float32 scale per output channel, as
``quantize.quantize_params`` writes them, and multiplied in int8 (``quantize.int8_matmul``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.ops.precision import einsum_in
from flaxformer_lite.ops.quantize import SCALE_SUFFIX, int8_matmul

Array = jax.Array
Dtype = Any

_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def make_kernel(
    module: nn.Module,
    name: str,
    init: Callable,
    names: tuple[str | None, ...],
    shape: tuple[int, ...],
    param_dtype: Dtype,
    quantization: str | None,
    in_axes: int = 1,
) -> tuple[Array, Array | None]:
    """A kernel `[in..., out...]` (``in_axes`` input axes) and None; with
    ``quantization="int8"`` an int8 kernel and its per-output-channel scale `[out...]`
    (parameter ``<name>_scale``), as ``quantize.quantize_params`` writes them."""
    if quantization is None:
        return read_param(module, name, logical_init(init, names), shape, param_dtype), None
    kernel = read_param(module, name, logical_init(_zeros, names), shape, jnp.int8)
    scale_names, scale_shape = names[in_axes:], shape[in_axes:]
    scale = read_param(
        module, name + SCALE_SUFFIX, logical_init(_ones, scale_names), scale_shape, jnp.float32
    )
    return kernel, scale


def kernel_matmul(
    subscripts: str,
    x: Array,
    kernel: Array,
    scale: Array | None,
    dtype: Dtype,
    in_axes: int = 1,
    *,
    int8_kernel: str = "auto",
) -> Array:
    """``einsum_in(subscripts, x, kernel, dtype)``; with a ``scale`` (an int8 kernel) the
    int8 x int8 -> int32 matmul of ``quantize.int8_matmul`` (by ``int8_kernel``) instead."""
    if scale is None:
        return einsum_in(subscripts, x, kernel, dtype)
    return int8_matmul(x, kernel, scale, in_axes, int8_kernel).astype(dtype)


class Int8Dense(nn.Module):
    """``nn.Dense`` with an int8 kernel: `[..., in]` -> `[..., features]`.

    Parameters as ``nn.Dense``'s (``kernel`` `[in, features]`, int8 here, and ``bias``) plus
    ``kernel_scale`` `[features]`; ``names``: the kernel's logical axes.
    """

    features: int
    names: tuple[str, str]
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    int8_kernel: str = "auto"  # what multiplies the kernel (quantize.int8_product)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (x.shape[-1], self.features)
        kernel, scale = make_kernel(self, "kernel", _zeros, self.names, shape, jnp.int8, "int8")
        y = int8_matmul(x, kernel, scale, kernel=self.int8_kernel).astype(self.dtype)
        if self.use_bias:
            bias = read_param(self, "bias", logical_init(_zeros, self.names[1:]), (self.features,))
            y = y + bias.astype(self.dtype)
        return y
