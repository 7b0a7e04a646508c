"""Products in a low-precision compute dtype, summed in float32.

A model computing in bfloat16 (or float16) multiplies its operands in that dtype and should
sum the products in float32, then round the result once: the sum keeps float32's precision and
the hardware's fast path is the one that takes narrow inputs to a float32 result (TPU MXUs,
GPU tensor cores, the AMX and AVX512-BF16 units of CPUs). ``einsum_in`` and ``dot_general_in``
ask for it explicitly (``preferred_element_type``), which matters on a CPU: XLA's CPU backend
computes a bfloat16 x bfloat16 -> bfloat16 product by converting both operands, weights
included, to float32 at every call and rounding the result back (`[128, 512] x [512, 58101]`
on an AMX Xeon: 2x the float32 time), while bfloat16 x bfloat16 -> float32 runs on its bfloat16
units (0.4-0.5x the float32 time). In float32 and wider both are exactly their jnp / lax
counterparts.

The layers use them for their weight products (``nn.dense.kernel_matmul``, the feed-forward
``nn.Dense``, the logits). Attention's weighted sum of values and the mixture of experts'
expert-batched products stay plain ``einsum`` in the narrow dtype: for those layouts XLA's CPU
backend falls back to a dot (``DotThunk``) that has no bfloat16 x bfloat16 -> float32 and
fails at run time ("Unsupported element type"); they are a small share of a step's FLOPs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any


def accumulation_dtype(dtype: Dtype) -> Dtype | None:
    """float32 for a float compute ``dtype`` narrower than 32 bits (bfloat16, float16), else
    None (a product accumulates in its operands' own dtype)."""
    dtype = jnp.dtype(dtype)
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else None


def einsum_in(subscripts: str, x: Array, y: Array, dtype: Dtype) -> Array:
    """``einsum(subscripts, x, y)`` in ``dtype``: the operands cast to it, their products
    summed in float32 when ``dtype`` is bfloat16 or float16 (``accumulation_dtype``), the
    result cast back to ``dtype``; the gradient as ``jnp.einsum``'s in ``dtype``. Float32 and
    wider: exactly ``jnp.einsum``."""
    x, y = x.astype(dtype), y.astype(dtype)
    if accumulation_dtype(dtype) is None:
        return jnp.einsum(subscripts, x, y)
    return _narrow_product(("einsum", subscripts), x, y)


def dot_general_in(lhs: Array, rhs: Array, dimension_numbers, precision=None, **_) -> Array:
    """``lax.dot_general`` with ``einsum_in``'s float32 sum for bfloat16 / float16 operands
    (both of one dtype), the result in that dtype: the ``dot_general`` of ``nn.Dense`` and
    ``nn.DenseGeneral``, which cast both operands to their ``dtype`` first."""
    if accumulation_dtype(lhs.dtype) is None:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)
    dims = jax.tree_util.tree_map(int, dimension_numbers)  # hashable: a static argument
    return _narrow_product(("dot_general", dims, precision), lhs, rhs)


def _product(spec: tuple, x: Array, y: Array, preferred: Dtype | None) -> Array:
    if spec[0] == "einsum":
        return jnp.einsum(spec[1], x, y, preferred_element_type=preferred)
    _, dims, precision = spec
    return jax.lax.dot_general(x, y, dims, precision=precision, preferred_element_type=preferred)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrow_product(spec: tuple, x: Array, y: Array) -> Array:
    """The product ``spec`` names (``("einsum", subscripts)`` or ``("dot_general",
    dimension_numbers, precision)``) of two arrays of one narrow float dtype, summed in
    float32 and rounded to that dtype."""
    return _product(spec, x, y, jnp.float32).astype(x.dtype)


def _narrow_product_fwd(spec, x, y):
    return _narrow_product(spec, x, y), (x, y)


def _narrow_product_bwd(spec, residuals, g):
    # The gradient the product has without the float32 sum: its transposed products in the
    # narrow dtype. Differentiating the float32-summed product itself would multiply the
    # float32 cotangent by operands converted to float32 (float32 x float32 products in the
    # backward pass, slower than the narrow ones on GPUs and in memory everywhere).
    x, y = residuals
    _, vjp = jax.vjp(lambda a, b: _product(spec, a, b, None), x, y)
    return vjp(g.astype(x.dtype))


_narrow_product.defvjp(_narrow_product_fwd, _narrow_product_bwd)
