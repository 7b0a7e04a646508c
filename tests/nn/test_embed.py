"""The token embedding and its tied logits (nn/embed.py) in a 16-bit float model: the logits of
a few rows, computed table first, are one rounding of the float64 product, and a bfloat16
decoding program never copies or converts the whole table (XLA's CPU backend did, once per
call: a transposed copy for the logits, a float32 copy for the token lookup)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import generate_jit
from flaxformer_lite.nn.embed import SMALL_LOGITS_ROWS, tied_logits

from helpers import hlo as hlo_text

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("shape", [(1, 1), (3,), (2, 4), (SMALL_LOGITS_ROWS + 1,), (4, 5)])
def test_bfloat16_logits_are_one_rounding_of_the_float64_product(shape):
    """Rows 1 to SMALL_LOGITS_ROWS take the table-first product, more rows ``x @ table.T``:
    either is the float64 product of the bfloat16 operands rounded once to bfloat16 (a float32
    sum can land on the neighbouring value), in ``x``'s shape."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, (*shape, 512)).astype(BF16)
    table = rng.uniform(0.5, 1.5, (37, 512)).astype(BF16)
    out = jax.jit(tied_logits)(x, table)
    assert out.shape == (*shape, 37) and out.dtype == jnp.bfloat16
    exact = x.astype(np.float64) @ table.astype(np.float64).T
    ulp = np.abs(exact.astype(BF16).astype(np.float64)) * 2.0**-7  # bfloat16: 8 bits
    got = np.asarray(out).astype(np.float64)
    assert np.all(np.abs(got - exact) <= ulp), np.max(np.abs(got - exact) / ulp)


def test_float32_logits_are_exactly_the_einsum():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, 64), np.float32)
    table = rng.standard_normal((37, 64), np.float32)
    expected = jnp.einsum("bld,vd->blv", x, table)
    np.testing.assert_array_equal(jax.jit(tied_logits)(x, table), expected)


def table_sized(hlo: str, vocab: int, features: int) -> list[tuple[str, str]]:
    """(opcode, line) of each instruction of an optimized HLO module, outside fusion bodies,
    whose output has the table's two sizes in either order."""
    want = sorted((vocab, features))
    return [(i.opcode, i.line) for i in hlo_text.unfused(hlo) if sorted(i.dims) == want]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU backend's layouts")
@pytest.mark.parametrize("method,beam_size", [("greedy", 1), ("beam", 2)])
def test_bfloat16_decoding_never_copies_the_table(method, beam_size):
    """Greedy and beam search of one sentence in bfloat16: the compiled program reads the
    token table where it lies (as a parameter, passed on unchanged). Before, XLA's CPU
    backend made a float32 copy of it for the token lookup (hoisted out of the decoding loop,
    as the table does not change) and a transposed copy for the logits' bfloat16 product, at
    every call."""
    vocab, features = 997, 48  # sizes no other array of the model has
    cfg = TransformerConfig(
        vocab_size=vocab, d_model=features, num_heads=4, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=16, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    model = EncoderDecoder(cfg)
    src = jnp.full((1, 6), 5, jnp.int32)
    params = jax.jit(lambda: model.init(jax.random.key(0), src, src)["params"])()
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    compiled = generate_jit.lower(
        params, cfg, src, mesh=mesh, method=method, max_len=4, beam_size=beam_size, alpha=0.0
    ).compile()
    found = table_sized(compiled.as_text(), vocab, features)
    assert "parameter" in {op for op, _ in found}  # the table itself is seen
    copies = [line for op, line in found if op not in hlo_text.NOT_A_COPY]
    assert copies == [], copies
