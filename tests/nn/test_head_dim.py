"""Heads of a width set apart from d_model (``TransformerConfig.head_dim``).

d_model 32 with 4 heads of 12 (not 32 / 4 = 8): attention is 48 wide between its projections.
The logits against the float64 NumPy reference are in test_reference.py (``head_dim_12_*``);
the parameter count formula and FLOPs in test_flops.py. Here: the kernel and cache shapes,
cached decoding against the full forward (multi-head, and grouped-query + rotary + fused +
blockwise together), blockwise against the reference attention at that width, the config's
errors, and the places that must refuse or split such a model (Marian export, tensor
parallelism).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
from flaxformer_lite.interop import hf

from helpers.random_weights import random_params

HD = TransformerConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    head_dim=12,
    d_ff=48,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=12,
    dropout_rate=0.0,
)
# Everything that touches head_dim at once: 4 query heads over 2 kv heads, rotary positions
# (pairs within each 12-wide head), fused projections, blockwise attention.
COMBO = HD.replace(
    num_kv_heads=2,
    position="rotary",
    fused_qkv=True,
    attention_implementation="blockwise",
    norm_position="pre",
)


def tokens(seed: int, lengths, length: int, vocab: int) -> jnp.ndarray:
    """int32 `[len(lengths), length]`: ids in [3, vocab), then padding (0) after lengths[b]."""
    t = np.random.default_rng(seed).integers(3, vocab, size=(len(lengths), length))
    for row, n in enumerate(lengths):
        t[row, n:] = 0
    return jnp.asarray(t, jnp.int32)


def shapes(tree):
    return jax.tree_util.tree_map(lambda a: tuple(a.shape), nn.meta.unbox(tree))


# ----------------------------------------------------------------------------- shapes


def test_kernels_and_caches_are_heads_by_head_dim():
    x, y = tokens(0, (5, 3), 5, 40), tokens(1, (4, 2), 4, 40)
    model = EncoderDecoder(HD)
    params = shapes(jax.eval_shape(lambda: model.init(jax.random.key(0), x, y))["params"])
    layer = params["decoder"]["layers_0"]
    for name in ("query", "key", "value"):
        assert layer["self_attention"][name] == {"kernel": (32, 4, 12), "bias": (4, 12)}
        assert layer["cross_attention"][name]["kernel"] == (32, 4, 12)
    assert layer["self_attention"]["out"] == {"kernel": (4, 12, 32), "bias": (32,)}

    cache = jax.eval_shape(
        lambda: model.init(
            jax.random.key(0),
            x,
            jnp.ones((2, 9), jnp.int32),
            decode=True,
            method=lambda m, x, d, decode: m.decode(m.encode(x), x, d, decode=decode),
        )["cache"]
    )
    attention = shapes(cache)["decoder"]["layers_1"]
    assert attention["self_attention"]["cached_key"] == (2, 4, 9, 12)  # [b, kv_heads, len, hd]
    assert attention["cross_attention"]["cross_value"] == (2, 4, 5, 12)

    fused = shapes(jax.eval_shape(lambda: DecoderOnly(COMBO).init(jax.random.key(0), y))["params"])[
        "decoder"
    ]["layers_0"]["self_attention"]
    assert fused["qkv"]["query_kernel"] == (32, 4, 12)
    assert fused["qkv"]["kv_kernel"] == (32, 2, 2, 12)  # [embed, k|v, kv_heads, head_dim]
    assert fused["out"]["kernel"] == (4, 12, 32)


# ----------------------------------------------------------------------------- decoding


def _cached_logits(cache, step, prompt: jnp.ndarray) -> jnp.ndarray:
    """Logits of ``prompt`` `[batch, length]` decoded with the cache: its first two tokens
    in one call (prefill), then one token per call."""
    logits, state = step(cache, prompt[:, :2])
    outs = [logits]
    for t in range(2, prompt.shape[1]):
        logits, state = step(state["cache"], prompt[:, t : t + 1])
        outs.append(logits)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("cfg", [HD, COMBO], ids=["multi_head", "gqa_rotary_fused_blockwise"])
def test_encoder_decoder_cached_decoding_equals_full_forward(cfg):
    model = EncoderDecoder(cfg)
    x, y = tokens(2, (7, 4), 7, 40), tokens(3, (6, 6), 6, 40)
    params = random_params(model, x, y, seed=1)
    full = jax.jit(model.apply)({"params": params}, x, y)
    encoded = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode))(params, x)
    shifted = jnp.concatenate([jnp.full((2, 1), cfg.bos_id, jnp.int32), y[:, :-1]], axis=1)
    # The cache as init makes it; jitted: one compiled program (parameter draws unused, so
    # dropped) instead of every initialiser run operation by operation.
    cache = jax.jit(
        lambda x, shifted: model.init(
            jax.random.key(0),
            x,
            shifted,
            decode=True,
            method=lambda m, x, d, decode: m.decode(m.encode(x), x, d, decode=decode),
        )["cache"]
    )(x, shifted)
    step = jax.jit(
        lambda c, tok: model.apply(
            {"params": params, "cache": c},
            encoded,
            x,
            tok,
            decode=True,
            mutable=["cache"],
            method=model.decode,
        )
    )
    cached = _cached_logits(cache, step, shifted)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [HD, COMBO, COMBO.replace(attention_window=3)],
    ids=["multi_head", "gqa_rotary_fused_blockwise", "and_a_window_ring_buffer"],
)
def test_decoder_only_cached_decoding_equals_full_forward(cfg):
    model = DecoderOnly(cfg)
    y = tokens(4, (8, 8), 8, 40)
    params = random_params(model, y, seed=2)
    full = jax.jit(model.apply)({"params": params}, y)
    shifted = jnp.concatenate([jnp.full((2, 1), cfg.bos_id, jnp.int32), y[:, :-1]], axis=1)
    cache = jax.jit(  # the cache as init makes it (jitted, as above)
        lambda shifted: model.init(jax.random.key(0), shifted, decode=True, method=model.decode)[
            "cache"
        ]
    )(shifted)
    step = jax.jit(
        lambda c, tok: model.apply(
            {"params": params, "cache": c}, tok, decode=True, mutable=["cache"], method=model.decode
        )
    )
    cached = _cached_logits(cache, step, shifted)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


def test_blockwise_equals_reference_attention_at_head_dim_12():
    """The COMBO model with blockwise attention against the same parameters with the reference
    ("xla") attention, which test_reference.py checks against NumPy at head_dim 12."""
    x, y = tokens(5, (9, 3), 9, 40), tokens(6, (7, 5), 7, 40)
    params = random_params(EncoderDecoder(COMBO), x, y, seed=3)
    reference = COMBO.replace(attention_implementation="xla")
    got = jax.jit(EncoderDecoder(COMBO).apply)({"params": params}, x, y)
    want = jax.jit(EncoderDecoder(reference).apply)({"params": params}, x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("value", [0, -12, True, 12.0, "12"])
def test_head_dim_must_be_none_or_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"TransformerConfig\.head_dim must be None or a positive"):
        HD.replace(head_dim=value)


def test_rotary_needs_an_even_head_dim():
    with pytest.raises(ValueError, match=r"TransformerConfig\.head_dim must be even for rotary"):
        HD.replace(position="rotary", head_dim=7)
    # Unset, the derived width 12 / 4 = 3 is odd: the message still names head_dim.
    with pytest.raises(ValueError, match=r"head_dim=None, effective width 3"):
        TransformerConfig(d_model=12, num_heads=4, position="rotary")
    assert HD.replace(position="rotary", head_dim=6).effective_head_dim == 6


def test_d_model_need_not_divide_by_heads_once_head_dim_is_set():
    with pytest.raises(ValueError, match="divisible by num_heads .* or set head_dim"):
        TransformerConfig(d_model=30, num_heads=4)
    cfg = TransformerConfig(d_model=30, num_heads=4, head_dim=8)
    assert (cfg.head_dim, cfg.effective_head_dim) == (8, 8)
    assert TransformerConfig(d_model=32, num_heads=4).effective_head_dim == 8


def test_head_dim_round_trips_through_json_and_older_configs_load():
    assert TransformerConfig.from_json(HD.to_json()) == HD
    older = {k: v for k, v in dataclasses.asdict(HD).items() if k != "head_dim"}
    assert TransformerConfig.from_dict(older).head_dim is None


def test_marian_export_refuses_a_head_dim_apart_from_d_model_over_heads():
    marian = TransformerConfig(
        vocab_size=40,
        d_model=32,
        num_heads=4,
        sinusoid_layout="halves",
        activation="silu",
        layer_norm_epsilon=1e-5,
    )
    hf.config_to_hf(marian)  # a Marian architecture
    hf.config_to_hf(marian.replace(head_dim=8))  # 8 = 32 / 4: the same model
    with pytest.raises(ValueError, match=r"head_dim=12 \(Marian: d_model / num_heads = 8"):
        hf.config_to_hf(marian.replace(head_dim=12))


def test_tensor_parallel_check_wants_d_model_split_when_kv_heads_are_not():
    """Multi-query keys/values split their d_model axis over "tensor": with head_dim set
    apart, d_model (30) need not be a multiple of the tensor degree (4)."""
    cfg = TransformerConfig(d_model=30, num_heads=4, head_dim=8, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"TransformerConfig\.d_model \(30\) must be divisible"):
        sharding.check_attention_fits_mesh(cfg, {"tensor": 4})
    sharding.check_attention_fits_mesh(cfg, {"tensor": 2})  # 30 splits in two
    sharding.check_attention_fits_mesh(cfg.replace(num_kv_heads=4), {"tensor": 4})  # by heads
