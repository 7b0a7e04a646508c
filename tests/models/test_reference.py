"""Whole models against an independent float64 NumPy forward pass
(tests/helpers/numpy_reference.py), and the numerical contracts no agreement test between two
JAX paths can see: rotary angles in closed form, the float32 softmax under bfloat16, per-layer
dropout under scan, remat in the jaxpr, and the bfloat16 model's distance from the float32 one.

Every model runs in float32 on random parameters unlike their initial values (non-zero
biases, non-unit norm scales), on padded batches whose rows have different lengths; logits are
compared at real positions only (padded query rows carry no meaning).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderClassifier, EncoderDecoder, TransformerConfig

from helpers import numpy_reference as ref
from helpers.random_weights import random_params

LOGITS_ATOL = 1e-5  # float32 model vs float64 reference, logits of size O(1)

TINY = TransformerConfig(
    vocab_size=48,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=16,
    dropout_rate=0.1,
    num_classes=3,
)
SRC_LENGTHS = (9, 6, 3)  # real tokens per row; the rest is padding
TGT_LENGTHS = (7, 4, 2)


def padded_tokens(
    rng: np.random.Generator, lengths, length: int, vocab: int, pad: int = 0
) -> np.ndarray:
    """int32 `[len(lengths), length]`: real ids in [0, vocab) other than ``pad``, then ``pad``."""
    t = rng.integers(1, vocab, size=(len(lengths), length)).astype(np.int32)
    t = np.where(t == pad, 0, t)  # 0 is real unless it is the pad id, and then never drawn
    for row, n in enumerate(lengths):
        t[row, n:] = pad
    return t


@functools.cache
def jitted_apply(model_class: type[nn.Module], cfg: TransformerConfig):
    """One compiled ``apply`` per (model, config) for the whole module: tests that share a
    configuration share its compilation."""
    return jax.jit(model_class(cfg).apply, static_argnames="deterministic")


def max_error_at(model_out, reference, real: np.ndarray) -> float:
    """Largest |model - reference| over the positions where ``real`` `[b, n]` is True."""
    return float(np.max(np.abs(np.asarray(model_out, np.float64) - reference)[real]))


# ----------------------------------------------------------------------------- 1. whole models

SEQ2SEQ = {
    "post_relu": TINY,  # the paper (the default config)
    "post_swiglu": TINY.replace(activation="swiglu"),
    "pre_relu": TINY.replace(norm_position="pre"),
    "pre_geglu": TINY.replace(norm_position="pre", activation="geglu"),
    "post_gelu_exact": TINY.replace(activation="gelu_exact"),
    # configs/lm_tinyshakespeare and others: learned positions; untied, unshared, no bias, gelu.
    "learned_untied_nobias_gelu": TINY.replace(
        position="learned",
        share_embeddings=False,
        tie_output_embedding=False,
        target_vocab_size=40,
        use_bias=False,
        activation="gelu",
    ),
    "rotary_rmsnorm_gqa_fused_scan": TINY.replace(
        norm_position="pre",
        position="rotary",
        norm_type="rmsnorm",
        num_kv_heads=2,
        fused_qkv=True,
        scan_layers=True,
    ),
    # Marian (opus-mt): swish, sin|cos halves, unscaled embeddings, a final logits bias,
    # LayerNorm eps 1e-5, pad = decoder start = last id, EOS 0, UNK 1.
    "marian": TINY.replace(
        activation="silu",
        sinusoid_layout="halves",
        scale_embeddings=False,
        logits_bias=True,
        layer_norm_epsilon=1e-5,
        pad_id=47,
        bos_id=47,
        eos_id=0,
        unk_id=1,
    ),
    # T5's relative position bias: 8 buckets, max distance 7 (no distance lands on an exact
    # bucket boundary, where float64 rounding in the reference could flip a bucket).
    "relative": TINY.replace(position="relative", relative_num_buckets=8, relative_max_distance=7),
    # Restricted attention: r = 2 keys on each side (encoder), a sliding window (decoder).
    "window_both": TINY.replace(attention_window=2),
    "window_encoder_blockwise": TINY.replace(
        attention_window=3, attention_window_layers="encoder", attention_implementation="blockwise"
    ),
    # Heads 12 wide, not 32 / 4 = 8: attention 48 wide inside; fused multi-head self-attention,
    # separate cross-attention projections.
    "head_dim_12_fused": TINY.replace(head_dim=12, fused_qkv=True),
    # T5 v1.0 (t5-small): pre-RMSNorm, relative bias, no biases, unscaled embeddings, logits
    # q.k without 1/sqrt(d_k), the decoder output scaled by d_model^-1/2 before the tied table.
    "t5_v1_0": TINY.replace(
        norm_position="pre",
        norm_type="rmsnorm",
        position="relative",
        relative_num_buckets=8,
        relative_max_distance=7,
        use_bias=False,
        scale_embeddings=False,
        scale_attention_logits=False,
        scale_decoder_output=True,
    ),
    # T5 v1.1 / Flan-T5: gated GELU, an untied output kernel, no output scaling; heads 12
    # wide (T5's d_kv apart from d_model / heads).
    "t5_v1_1_head_dim_12": TINY.replace(
        norm_position="pre",
        norm_type="rmsnorm",
        position="relative",
        relative_num_buckets=8,
        relative_max_distance=7,
        use_bias=False,
        scale_embeddings=False,
        scale_attention_logits=False,
        activation="geglu",
        tie_output_embedding=False,
        head_dim=12,
    ),
}


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_encoder_decoder_matches_float64_reference(name):
    cfg = SEQ2SEQ[name]
    rng = np.random.default_rng(0)
    x = padded_tokens(rng, SRC_LENGTHS, 10, cfg.vocab_size, cfg.pad_id)
    y = padded_tokens(rng, TGT_LENGTHS, 8, cfg.output_vocab_size, cfg.pad_id)
    model = EncoderDecoder(cfg)
    params = random_params(model, x, y)
    logits = jitted_apply(type(model), cfg)({"params": params}, x, y)
    expected = ref.encoder_decoder_logits(cfg, params, x, y)
    assert logits.shape == expected.shape == (3, 8, cfg.output_vocab_size)
    assert max_error_at(logits, expected, y != cfg.pad_id) < LOGITS_ATOL


DECODER_ONLY = {
    "post_relu": TINY,
    "pre_swiglu": TINY.replace(norm_position="pre", activation="swiglu"),
    # configs/lm_tinyshakespeare: pre-LN with learned positions.
    "pre_learned": TINY.replace(norm_position="pre", position="learned"),
    "rotary_geglu_mqa_fused": TINY.replace(
        position="rotary", activation="geglu", num_kv_heads=1, fused_qkv=True
    ),
    "relative_pre_scan": TINY.replace(
        position="relative",
        relative_num_buckets=8,
        relative_max_distance=10,
        norm_position="pre",
        scan_layers=True,
    ),
    "window_rotary_blockwise": TINY.replace(
        attention_window=3, position="rotary", attention_implementation="blockwise"
    ),
    "window_encoder_only_leaves_decoder_full": TINY.replace(
        attention_window=2, attention_window_layers="encoder"
    ),
    "head_dim_12_rotary_gqa_fused": TINY.replace(
        head_dim=12, position="rotary", num_kv_heads=2, fused_qkv=True
    ),
    "head_dim_12_pre": TINY.replace(head_dim=12, norm_position="pre"),
    # T5's two output-side options in a decoder-only stack: unscaled attention logits, the
    # output scaled by d_model^-1/2 before the tied table.
    "unscaled_logits_scaled_output": TINY.replace(
        scale_attention_logits=False, scale_decoder_output=True
    ),
}


@pytest.mark.parametrize("name", list(DECODER_ONLY))
def test_decoder_only_matches_float64_reference(name):
    cfg = DECODER_ONLY[name]
    tokens = padded_tokens(np.random.default_rng(1), (12, 7, 2), 12, cfg.vocab_size)
    model = DecoderOnly(cfg)
    params = random_params(model, tokens)
    logits = jitted_apply(type(model), cfg)({"params": params}, tokens)
    expected = ref.decoder_only_logits(cfg, params, tokens)
    assert logits.shape == expected.shape == (3, 12, cfg.vocab_size)
    assert max_error_at(logits, expected, tokens != 0) < LOGITS_ATOL


CLASSIFIER = {
    "post_relu_mean": TINY,
    "pre_swiglu_mean_scan": TINY.replace(
        norm_position="pre", activation="swiglu", scan_layers=True
    ),
    "post_rotary_first": TINY.replace(position="rotary", pooling="first"),
    "post_attention_pooling": TINY.replace(pooling="attention"),
    "relative_mean": TINY.replace(
        position="relative", relative_num_buckets=8, relative_max_distance=7
    ),
    "window_mean": TINY.replace(attention_window=2),
}


@pytest.mark.parametrize("name", list(CLASSIFIER))
def test_encoder_classifier_matches_float64_reference(name):
    cfg = CLASSIFIER[name]
    tokens = padded_tokens(np.random.default_rng(2), (10, 4, 1), 10, cfg.vocab_size)
    model = EncoderClassifier(cfg)
    params = random_params(model, tokens)
    logits = jitted_apply(type(model), cfg)({"params": params}, tokens)
    expected = ref.classifier_logits(cfg, params, tokens)
    assert logits.shape == expected.shape == (3, cfg.num_classes)
    assert float(np.max(np.abs(np.asarray(logits, np.float64) - expected))) < LOGITS_ATOL


# ----------------------------------------------------------------------------- 2. contracts


def test_rotary_matches_closed_form_rotation():
    """positions.rotary against RoFormer's block rotation matrices, theta_i = 10000^(-2i/d) on
    the channel pairs (i, i + d/2), built in float64 by ``numpy_reference.rotation_matrix``; at
    arbitrary (not only increasing) positions, head_dim 8 and 16."""
    from flaxformer_lite.ops.positions import rotary

    rng = np.random.default_rng(3)
    for head_dim in (8, 16):
        x = rng.standard_normal((2, 5, 3, head_dim)).astype(np.float32)
        positions = rng.integers(0, 40, size=(2, 5)).astype(np.int32)
        got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(positions)), np.float64)
        expected = ref.rotate(x.astype(np.float64), positions)
        # float32 angles up to 40 rad: sin/cos of a rounded angle are off by ~40 * 2^-24.
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
        # A rotation keeps every head vector's norm (a sanity check of the reference itself).
        np.testing.assert_allclose(
            np.linalg.norm(expected, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6
        )


# Logits 200, 200.375 and 200.75: exact in float32, but bfloat16 (8 significant bits) has a
# spacing of 1 in [128, 256), so a bfloat16 softmax sees 200, 200, 201. Every input is exact in
# bfloat16 and the scale 1/sqrt(4) = 0.5 is a power of two, so a float32 softmax is exact up
# to its own rounding: the weights must then agree with float64 to 1e-6, while the bfloat16
# softmax is off by 0.1 (0.318 -> 0.212 on the middle key).
CLOSE_QUERY = np.array([[32.0, 2.0, 0.0, 0.0]])  # times 0.5: [16, 1, 0, 0]
CLOSE_KEYS = np.array(  # dims 0-1 set the logits; dims 2-3 (zero in the query) tag the values
    [[12.5, 0.0, 1.0, 0.0], [12.5, 0.375, 0.0, 1.0], [12.5, 0.75, 0.0, 0.0]]
)
CLOSE_WEIGHTS = ref.softmax(np.array([0.0, 0.375, 0.75]))  # float64: 0.219, 0.318, 0.463
# bfloat16 outputs: the float32 weights are rounded to bfloat16 (relative 2^-8) before the
# weighted sum, whose result is rounded again (2^-8): 2 * 2^-8 relative, under 4e-3 absolute
# on values <= 1. The bfloat16-softmax error above is 25 times that.
BF16_OUT_RTOL = 2 * 2.0**-8


def test_softmax_stays_float32_under_bfloat16_attention_function():
    from flaxformer_lite.ops.attention import dot_product_attention

    bf16 = jnp.bfloat16
    q = jnp.asarray(CLOSE_QUERY[None, :, None], bf16)  # [1, 1, 1, 4]
    k = jnp.asarray(CLOSE_KEYS[None, :, None], bf16)  # [1, 3, 1, 4]
    v = jnp.asarray(np.eye(3, 4)[None, :, None], bf16)  # one-hot: output = the weights
    out, weights = dot_product_attention(q, k, v, return_weights=True)
    assert weights.dtype == jnp.float32 and out.dtype == bf16
    np.testing.assert_allclose(np.asarray(weights)[0, 0, 0], CLOSE_WEIGHTS, rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(out, np.float64)[0, 0, 0, :3], CLOSE_WEIGHTS, rtol=BF16_OUT_RTOL, atol=0
    )


def test_softmax_stays_float32_under_bfloat16_attention_module():
    """The same logits through ``MultiHeadAttention(dtype=bfloat16)`` with identity
    projections (keys and values from ``inputs_kv``), against the float64 reference layer."""
    from flaxformer_lite.nn.attention import MultiHeadAttention

    eye = np.eye(4, dtype=np.float32)
    proj = {"kernel": eye[:, None, :], "bias": np.zeros((1, 4), np.float32)}
    params = {
        "query": proj,
        "key": proj,
        "value": proj,
        "out": {"kernel": eye[None], "bias": np.zeros(4, np.float32)},
    }
    layer = MultiHeadAttention(num_heads=1, head_dim=4, dtype=jnp.bfloat16)
    x_q, x_kv = CLOSE_QUERY[None].astype(np.float32), CLOSE_KEYS[None].astype(np.float32)
    out, sown = layer.apply({"params": params}, x_q, x_kv, mutable=["intermediates"])
    (weights,) = sown["intermediates"]["attention_weights"]
    np.testing.assert_allclose(np.asarray(weights)[0, 0, 0], CLOSE_WEIGHTS, rtol=0, atol=1e-6)
    expected = ref.multi_head_attention(
        TINY.replace(d_model=4, num_heads=1), ref.to_float64(params),
        x_q.astype(np.float64), x_kv.astype(np.float64), np.ones((1, 1, 3), bool),
    )  # fmt: skip
    np.testing.assert_allclose(expected[0, 0, 2:], CLOSE_WEIGHTS[:2], rtol=1e-12)
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=BF16_OUT_RTOL, atol=BF16_OUT_RTOL
    )


# Unrolled layers are distinct named modules (their RNGs differ by name); under nn.scan one
# module runs every layer, so only the scan's RNG split separates them.
DROPOUT_STACKS = {
    "scan": dict(scan_layers=True),
    "scan_remat": dict(scan_layers=True, remat=True),
}


@pytest.mark.parametrize("name", list(DROPOUT_STACKS))
def test_each_layer_and_sublayer_draws_its_own_dropout_mask(name):
    """With the attention output and FFN output kernels zeroed, every residual sub-layer adds a
    constant (its output bias, the same in both layers) and passes the gradient through
    unchanged, so d loss / d bias = sum over positions of dropout_mask * g / (1 - rate), with
    the same g for all four sub-layers. Without dropout the four gradients are therefore
    equal; with dropout they differ exactly when the masks do. Reusing one dropout RNG across
    the scanned layers (or across sub-layers) would make them equal."""
    cfg = TINY.replace(norm_position="pre", dropout_rate=0.5, **DROPOUT_STACKS[name])
    model = DecoderOnly(cfg)
    tokens = padded_tokens(np.random.default_rng(4), (8, 8), 8, cfg.vocab_size)
    params = random_params(model, tokens)
    stack = params["decoder"]["layers"]  # scanned: leaves [num_layers, ...]
    stack["self_attention"]["out"]["kernel"][...] = 0.0
    stack["mlp"]["wo"]["kernel"][...] = 0.0
    biases = [np.tile(np.linspace(-1.0, 1.0, cfg.d_model, dtype=np.float32), (2, 1))] * 2
    probe = np.random.default_rng(5).standard_normal((2, 8, cfg.vocab_size)).astype(np.float32)

    @functools.partial(jax.jit, static_argnames="deterministic")
    def bias_grads(biases, deterministic):
        """d loss / d (attention output bias, FFN output bias), each `[num_layers, d_model]`;
        only these are differentiated, so no kernel gradient is compiled."""

        def loss(biases):
            layers = dict(stack)
            layers["self_attention"] = dict(
                stack["self_attention"],
                out={"kernel": stack["self_attention"]["out"]["kernel"], "bias": biases[0]},
            )
            layers["mlp"] = dict(
                stack["mlp"], wo={"kernel": stack["mlp"]["wo"]["kernel"], "bias": biases[1]}
            )
            p = dict(params, decoder=dict(params["decoder"], layers=layers))
            logits = model.apply(
                {"params": p},
                tokens,
                deterministic=deterministic,
                rngs={"dropout": jax.random.key(6)},
            )
            return jnp.sum(logits * probe)

        return jax.grad(loss)(biases)

    def four(grads):  # layer 0 attention, layer 0 FFN, layer 1 attention, layer 1 FFN
        attention, ffn = (np.asarray(g) for g in grads)
        return [attention[0], ffn[0], attention[1], ffn[1]]

    dropped = four(bias_grads(biases, False))
    if name == "scan":  # remat changes no value or gradient: check the construction once
        plain = four(bias_grads(biases, True))
        assert np.abs(plain[0]).max() > 1e-2  # the probe reaches the biases
        for g in plain[1:]:  # without dropout nothing tells the four sub-layers apart
            np.testing.assert_allclose(g, plain[0], rtol=1e-5, atol=1e-6)
    scale = np.abs(dropped[0]).max()
    for i in range(4):
        for j in range(i):
            gap = np.abs(dropped[i] - dropped[j]).max()
            assert gap > 0.1 * scale, (name, i, j, gap)


def _count_primitive(jaxpr, primitive) -> int:
    """Equations of ``primitive`` in a jaxpr and every jaxpr nested in its equations' params
    (scan bodies, jit calls, custom derivatives, remat bodies)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is primitive
        stack = list(eqn.params.values())
        while stack:
            v = stack.pop()
            if isinstance(v, (tuple, list)):
                stack.extend(v)
            elif hasattr(v, "eqns"):
                count += _count_primitive(v, primitive)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                count += _count_primitive(v.jaxpr, primitive)
    return count


# remat, scan -> checkpoint equations in the forward jaxpr: one per layer when unrolled, one
# per scanned stack body (encoder and decoder) when scanned, none without remat.
REMAT_CASES = {(False, False): 0, (False, True): 0, (True, False): 4, (True, True): 2}


@pytest.mark.parametrize("remat,scan", list(REMAT_CASES))
def test_remat_appears_in_the_jaxpr_exactly_when_enabled(remat, scan):
    remat_primitive = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive
    cfg = TINY.replace(remat=remat, scan_layers=scan)
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(0)
    x = padded_tokens(rng, SRC_LENGTHS, 10, cfg.vocab_size)
    y = padded_tokens(rng, TGT_LENGTHS, 8, cfg.vocab_size)
    params = random_params(model, x, y)
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x, y, deterministic=True))(params)
    assert _count_primitive(jaxpr.jaxpr, remat_primitive) == REMAT_CASES[remat, scan]


# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8. Along the path to a logit every
# sub-layer rounds about four times (its input cast, the projections, the activations or
# attention weights, the output projection); 2 encoder + 2 decoder layers are 10 sub-layers,
# ~40 roundings, plus the embedding and the output projection. Independent relative errors of
# size u add in quadrature, sqrt(40) u ~ 6.3u, so the RMS logit error should stay under
# 8u * RMS(logits); the largest of the 624 compared logits (13 real positions x 48), a tail
# value, under 4 times that (32u). Measured: RMS about 2u, largest 7-9u here (6-14u across
# the SEQ2SEQ variants). The softmax, where bfloat16 does visible harm, has its own tests
# above; this one bounds the model as a whole.
BF16_U = 2.0**-8


@pytest.mark.parametrize("name", ["post_relu", "rotary_rmsnorm_gqa_fused_scan"])
def test_bfloat16_logits_within_rounding_bound_of_float32(name):
    cfg = SEQ2SEQ[name]
    rng = np.random.default_rng(0)
    x = padded_tokens(rng, SRC_LENGTHS, 10, cfg.vocab_size)
    y = padded_tokens(rng, TGT_LENGTHS, 8, cfg.output_vocab_size)
    params = random_params(EncoderDecoder(cfg), x, y)
    real = y != 0
    full = np.asarray(jitted_apply(EncoderDecoder, cfg)({"params": params}, x, y))[real]
    half_cfg = cfg.replace(dtype="bfloat16")
    half = jitted_apply(EncoderDecoder, half_cfg)({"params": params}, x, y)
    assert half.dtype == jnp.float32  # logits leave the model in float32
    error = np.asarray(half)[real] - full
    scale = float(np.sqrt(np.mean(full**2)))
    assert float(np.sqrt(np.mean(error**2))) < 8 * BF16_U * scale
    assert float(np.max(np.abs(error))) < 32 * BF16_U * scale
    # bfloat16 really ran: the logits are not the float32 ones.
    assert float(np.max(np.abs(error))) > 0.5 * BF16_U * scale
