"""Token embeddings, and the tied pre-softmax logits that read the same table."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.nn.dense import make_kernel
from flaxformer_lite.ops.precision import accumulation_dtype, einsum_in
from flaxformer_lite.ops.quantize import int8_matmul

Array = jax.Array
Dtype = Any

_zeros = nn.initializers.zeros_init()
# Logits of a 16-bit float model for at most this many rows (decoding one sentence or a few)
# are computed table first, `[vocab, features] x [features, rows]`, on at least
# SMALL_LOGITS_PAD rows (zeros below): XLA's CPU backend runs a bfloat16 x bfloat16 -> float32
# product on its bfloat16 units (YNNPACK) only with a row-major right operand, so ``x @ table.T``
# had it copy the whole table transposed at every decoding call (85 ms at opus-mt size), and a
# product of fewer than 4 rows falls back to a matrix-vector product at 1/6 of the speed.
# With Embed's lookup below, bfloat16 decoding of one sentence at opus-mt size went from 0.73x
# to 1.16x our float32 (greedy) and from 1.34x to 1.79x (beam 4; docs/benchmarks.md). At 32
# rows it gained nothing measurable: one copy of the table per call is then a small share.
SMALL_LOGITS_ROWS = 8
SMALL_LOGITS_PAD = 4


class Embed(nn.Module):
    """Token embedding `[vocab, features]` with ``attend`` for tied pre-softmax logits.

    Initialised N(0, features^-1/2): multiplied by sqrt(features) on lookup (the paper's scaling),
    the embedded tokens have unit variance, the scale of the sinusoids they are added to.
    ``scale=False`` looks tokens up unscaled (Marian models with ``scale_embedding=False``).
    ``int8_attend``: ``attend`` multiplies in int8 by ``attend_kernel`` int8 `[features, vocab]`
    (the table transposed, quantized per vocabulary entry, with ``attend_kernel_scale``
    `[vocab]`; ``quantize.quantize_params``), while lookups keep reading the float table;
    ``int8_kernel`` says what multiplies it (``quantize.int8_product``).
    """

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scale: bool = True
    int8_attend: bool = False
    int8_kernel: str = "auto"

    def setup(self) -> None:
        self.embedding = read_param(
            self,
            "embedding",
            logical_init(nn.initializers.normal(self.features**-0.5), ("vocab", "embed")),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )
        if self.int8_attend:
            shape = (self.features, self.num_embeddings)
            self.attend_kernel, self.attend_scale = make_kernel(
                self, "attend_kernel", _zeros, ("embed", "vocab"), shape, jnp.int8, "int8"
            )

    def __call__(self, tokens: Array) -> Array:
        """int `[batch, length]` -> `[batch, length, features]`, scaled by sqrt(features)
        when ``scale``."""
        table = jnp.asarray(self.embedding, self.dtype)
        if accumulation_dtype(self.dtype) is not None:
            # XLA's CPU backend converts the rows a 16-bit float gather reads to float32, and
            # in a decoding loop hoists that conversion onto the whole table, which does not
            # change from step to step: a float32 copy of the table at every call (90 ms and
            # 238 MB at opus-mt size). Tied to the tokens, the table is new at each step for
            # XLA, and only the rows read are converted.
            table, tokens = jax.lax.optimization_barrier((table, tokens))
        x = jnp.take(table, tokens, axis=0)
        return x * jnp.asarray(self.features**0.5, self.dtype) if self.scale else x

    def attend(self, x: Array) -> Array:
        """`[batch, length, features]` -> logits `[batch, length, vocab]` (x times table^T)."""
        if self.int8_attend:
            q, scale = self.attend_kernel, self.attend_scale
            return int8_matmul(x, q, scale, kernel=self.int8_kernel).astype(self.dtype)
        table = jnp.asarray(self.embedding, self.dtype)
        return tied_logits(x.astype(self.dtype), table)


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """`[..., features]` x `[vocab, features]` -> `[..., vocab]`: ``x @ table.T``.

    The gradient of ``table`` is taken as ``(x^T @ g)^T``: the `[features, vocab]` product,
    then its transpose. Autodiff's ``g^T @ x`` makes XLA's CPU backend (its YNNPACK dots take
    row-major operands only) copy the logits' gradient `[tokens, vocab]` into a transposed
    layout first, the largest array of the step (64 MB at 2,048 tokens x 8,192 ids); here
    only ``x`` (`[tokens, features]`) and the result (`[features, vocab]`) are transposed.
    An ``optimization_barrier`` keeps XLA from folding the transpose back into the dot.
    """
    rows = math.prod(x.shape[:-1]) if all(isinstance(n, int) for n in x.shape) else None
    if accumulation_dtype(x.dtype) is not None and rows and rows <= SMALL_LOGITS_ROWS:
        flat = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, max(0, SMALL_LOGITS_PAD - rows)), (0, 0)))
        logits_t = einsum_in("vd,rd->vr", table, flat, x.dtype)[:, :rows]  # [vocab, rows]
        return logits_t.T.reshape(*x.shape[:-1], table.shape[0])
    return einsum_in("...d,vd->...v", x, table, x.dtype)


def _tied_logits_fwd(x, table):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g):
    x, table = residuals
    d_x = einsum_in("...v,vd->...d", g, table, x.dtype)
    flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    d_table_t = jnp.matmul(flat_x.T, flat_g, preferred_element_type=accumulation_dtype(x.dtype))
    d_table_t = jax.lax.optimization_barrier(d_table_t)  # [features, vocab]
    return d_x, d_table_t.T.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)
