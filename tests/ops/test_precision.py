"""Low-precision products summed in float32 (ops/precision.py): exact jnp in float32, one
rounding of a float32 sum in bfloat16, and a bfloat16 model whose every matmul (training
forward, beam search with the in-place cache) takes bfloat16 operands to a float32 result."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import generate_jit
from flaxformer_lite.ops.precision import accumulation_dtype, dot_general_in, einsum_in


@pytest.mark.parametrize(
    "dtype,expected",
    [
        (jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.float32),
        (jnp.float32, None),
        (jnp.float64, None),
        (jnp.int8, None),
        ("bfloat16", jnp.float32),
    ],
)
def test_accumulation_dtype(dtype, expected):
    assert accumulation_dtype(dtype) == expected


def test_float32_is_exactly_jnp():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((3, 5, 64), np.float32), rng.standard_normal((64, 7), np.float32)
    expected = jnp.einsum("bld,df->blf", x, y)
    np.testing.assert_array_equal(einsum_in("bld,df->blf", x, y, jnp.float32), expected)
    dims = (((2,), (0,)), ((), ()))
    out = dot_general_in(jnp.asarray(x), jnp.asarray(y), dims)
    np.testing.assert_array_equal(out, jax.lax.dot_general(x, y, dims))
    assert out.dtype == jnp.float32


def test_bfloat16_products_are_summed_in_float32_and_rounded_once():
    """Against NumPy: the float64 sum of the products of the bfloat16 operands, rounded to
    bfloat16 once. A sum kept in bfloat16 would drift by many units of its last place over
    4,096 terms; a float32 sum rounds to the same bfloat16 value or its neighbour."""
    rng = np.random.default_rng(1)
    bf16 = ml_dtypes.bfloat16
    x = rng.uniform(0.5, 1.5, (8, 4096)).astype(bf16)
    y = rng.uniform(0.5, 1.5, (4096, 16)).astype(bf16)
    exact = x.astype(np.float64) @ y.astype(np.float64)
    for out in (
        einsum_in("mk,kn->mn", x, y, jnp.bfloat16),
        dot_general_in(jnp.asarray(x), jnp.asarray(y), (((1,), (0,)), ((), ()))),
    ):
        assert out.dtype == jnp.bfloat16
        got = np.asarray(out).astype(np.float64)
        ulp = np.abs(exact.astype(bf16).astype(np.float64)) * 2.0**-7  # bfloat16: 8 bits
        assert np.all(np.abs(got - exact) <= ulp), np.max(np.abs(got - exact) / ulp)


DOT = re.compile(
    r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
)


def dots(lowered) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in a lowered program."""
    found = DOT.findall(lowered.as_text())
    return [tuple(t.rsplit("x", 1)[-1].rstrip(">") for t in types) for types in found]


def test_a_bfloat16_model_multiplies_bfloat16_into_float32():
    """XLA's CPU backend computes bfloat16 x bfloat16 -> bfloat16 by converting the operands
    (weights included) to float32 at every call, twice float32's time; into float32 it uses the
    CPU's bfloat16 units. The weight products of a bfloat16 model ask for the float32 result
    (projections, feed-forward, tied logits; attention scores did already), in the training
    forward and in beam search."""
    cfg = TransformerConfig(
        vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=16, dtype="bfloat16",
    )  # fmt: skip
    model = EncoderDecoder(cfg)
    x = jnp.full((2, 6), 5, jnp.int32)
    y = jnp.full((2, 5), 7, jnp.int32)
    params = jax.jit(lambda: model.init(jax.random.key(0), x, y)["params"])()
    forward = jax.jit(lambda p: model.apply({"params": p}, x, y)).lower(params)
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    beam = generate_jit.lower(
        params, cfg, x, mesh=mesh, method="beam", max_len=4, beam_size=2, alpha=0.0
    )
    for lowered in (forward, beam):
        found = dots(lowered)
        # The 3 attentions' weighted sums of values stay bfloat16 x bfloat16 -> bfloat16
        # (ops.precision: XLA's CPU fallback dot has no float32 result for their layouts).
        assert found.count(("bf16", "bf16", "bf16")) == 3, found
        assert found.count(("bf16", "bf16", "f32")) == len(found) - 3 >= 17, found
    # The backward pass stays in bfloat16 (ops.precision's custom gradient): differentiating
    # the float32 sum itself would make every transposed product float32 x float32. The only
    # float32 products are the two transposes of each of the 3 attentions' scores, whose
    # float32 result the softmax reads.
    loss = lambda p: model.apply({"params": p}, x, y).astype(jnp.float32).sum()  # noqa: E731
    found = dots(jax.jit(jax.grad(loss)).lower(params))
    wide = [d for d in found if d[:2] == ("f32", "f32")]
    assert len(wide) == 2 * 3 and len(found) > 60, found
