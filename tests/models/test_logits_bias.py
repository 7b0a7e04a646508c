"""A float32 decoder's ``logits_bias`` folded into the tied logits' product when decoding
enough rows (models/decoder.py, ``FOLD_BIAS_MIN_ROWS``): the same tokens and scores as the
bias added to the logits, and the folded program's logits product has the extra term."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import generate_jit
from flaxformer_lite.models import decoder

D_MODEL, VOCAB = 32, 61
CFG = TransformerConfig(
    vocab_size=VOCAB, d_model=D_MODEL, num_heads=4, d_ff=64, num_encoder_layers=1,
    num_decoder_layers=2, max_len=16, logits_bias=True, dropout_rate=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def params():
    model = EncoderDecoder(CFG)
    x = jnp.ones((1, 5), jnp.int32)
    p = jax.jit(lambda: model.init(jax.random.key(0), x, x)["params"])()
    # A bias large enough to decide tokens (zeros at initialisation would prove nothing).
    bias = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32) * 2.0
    return {**p, "decoder": {**p["decoder"], "logits_bias": jnp.asarray(bias)}}


def decode(params, monkeypatch, min_rows: int, method: str, beam_size: int):
    """(tokens, scores, the dot contraction sizes of the compiled program's HLO) of 8 sources."""
    monkeypatch.setattr(decoder, "FOLD_BIAS_MIN_ROWS", min_rows)
    jax.clear_caches()  # the setting is read at trace time
    src = jnp.asarray(np.random.default_rng(2).integers(3, VOCAB, (8, 6)), jnp.int32)
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    lowered = generate_jit.lower(
        params, CFG, src, mesh=mesh, method=method, max_len=6, beam_size=beam_size, alpha=0.6
    )
    tokens, scores = lowered.compile()(params, src)
    shapes = re.findall(r"stablehlo\.dot_general .*: \(tensor<([\dx]+)xf32>", lowered.as_text())
    return np.asarray(tokens), np.asarray(scores), {s.split("x")[-1] for s in shapes}


def test_folded_bias_decodes_as_the_added_bias(params, monkeypatch):
    """Beam 4 over 8 sources: 32 rows. (Greedy decoding takes the same Decoder._logits.)"""
    rows = 8 * 4
    folded = decode(params, monkeypatch, rows, "beam", 4)  # 32 rows: folded
    added = decode(params, monkeypatch, rows + 1, "beam", 4)  # one row short: added
    assert str(D_MODEL + 1) in folded[2] and str(D_MODEL + 1) not in added[2]
    np.testing.assert_array_equal(folded[0], added[0])
    np.testing.assert_allclose(folded[1], added[1], rtol=1e-6, atol=1e-6)
