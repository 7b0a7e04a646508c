"""``TransformerConfig.word_dropout_rate``: word dropout at the inputs of both stacks of an
encoder-decoder in training. Checked against NumPy on the model's own embedding table: every
token's row, as the encoder's and the decoder's word dropout pass it on, is either zero in all
d_model channels or the table row times sqrt(d_model) / (1 - rate); about ``rate`` of the
rows are dropped; positions are added after the drop (a dropped row of a sinusoidal model
reads the position encoding alone); a deterministic call is the model without word dropout,
bitwise."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import EncoderDecoder, TransformerConfig

RATE = 0.25
VOCAB, D_MODEL, BATCH, LENGTH = 50, 16, 8, 64
CONFIG = TransformerConfig(
    vocab_size=VOCAB, d_model=D_MODEL, num_heads=2, d_ff=32, num_encoder_layers=1,
    num_decoder_layers=1, max_len=LENGTH, dropout_rate=0.1, word_dropout_rate=RATE,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_and_batch():
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = jax.random.randint(keys[0], (BATCH, LENGTH), 3, VOCAB)
    targets = jax.random.randint(keys[1], (BATCH, LENGTH), 3, VOCAB)
    model = EncoderDecoder(CONFIG)
    params = model.init(keys[2], inputs, targets)["params"]
    return model, params, inputs, targets


def stack_inputs(model, params, inputs, targets, **kwargs):
    """What the encoder's and the decoder's word dropout return, and the embedders' outputs."""
    _, state = model.apply(
        {"params": params}, inputs, targets, capture_intermediates=True,
        mutable=["intermediates"], **kwargs,
    )  # fmt: skip
    found = state["intermediates"]
    words = {s: found[s]["embedder"]["word_dropout"]["__call__"][0] for s in ("encoder", "decoder")}
    embedded = {s: found[s]["embedder"]["__call__"][0] for s in ("encoder", "decoder")}
    return words, embedded


def test_whole_rows_are_dropped_or_scaled_in_both_stacks(model_and_batch):
    model, params, inputs, targets = model_and_batch
    table = np.asarray(nn.meta.unbox(params)["source_embedding"]["embedding"], np.float64)
    rngs = {"dropout": jax.random.key(1)}
    words, embedded = stack_inputs(model, params, inputs, targets, deterministic=False, rngs=rngs)
    _, plain = stack_inputs(model, params, inputs, targets, deterministic=True)
    # The decoder reads the targets shifted right behind BOS.
    shifted = np.concatenate([np.full((BATCH, 1), CONFIG.bos_id), targets[:, :-1]], axis=1)
    masks = {}
    for stack, tokens in (("encoder", np.asarray(inputs)), ("decoder", shifted)):
        rows = np.asarray(words[stack], np.float64)
        scaled = table[tokens] * np.sqrt(D_MODEL) / (1.0 - RATE)
        dropped = np.all(rows == 0.0, axis=-1)
        kept = np.all(np.abs(rows - scaled) <= 1e-5 * np.abs(scaled).max(), axis=-1)
        assert (dropped ^ kept).all(), stack  # each row one or the other, whole
        share = dropped.mean()
        assert abs(share - RATE) < 0.05, (stack, share)  # 512 rows: ~0.02 standard deviation
        masks[stack] = dropped
        # A dropped row still carries its position: the sinusoid, what the deterministic
        # embedder output holds beyond the scaled table row; the embedder's residual dropout
        # (rate 0.1) then zeroes some channels and scales the rest.
        positions = np.asarray(plain[stack], np.float64) - table[tokens] * np.sqrt(D_MODEL)
        sums = np.asarray(embedded[stack], np.float64)[dropped]
        live = sums != 0.0  # the residual dropout's zeros aside
        expected = positions[dropped] / (1.0 - CONFIG.dropout_rate)
        np.testing.assert_allclose(sums[live], expected[live], atol=1e-5, err_msg=stack)
    assert not np.array_equal(masks["encoder"], masks["decoder"])  # drawn apart


def test_deterministic_calls_are_the_model_without_word_dropout(model_and_batch):
    model, params, inputs, targets = model_and_batch
    without = EncoderDecoder(CONFIG.replace(word_dropout_rate=0.0))
    np.testing.assert_array_equal(
        np.asarray(model.apply({"params": params}, inputs, targets)),
        np.asarray(without.apply({"params": params}, inputs, targets)),
    )


@pytest.mark.parametrize("rate", [1.0, -0.1, "0.1"])
def test_a_bad_rate_names_the_field(rate):
    with pytest.raises(ValueError, match="word_dropout_rate"):
        TransformerConfig(word_dropout_rate=rate)


def test_rows_of_the_training_output_change_with_the_rng(model_and_batch):
    model, params, inputs, targets = model_and_batch
    a, b = (
        model.apply(
            {"params": params},
            inputs,
            targets,
            deterministic=False,
            rngs={"dropout": jax.random.key(k)},
        )  # fmt: skip
        for k in (1, 2)
    )
    assert jnp.isfinite(a).all() and not np.array_equal(np.asarray(a), np.asarray(b))
