"""Restricted (local) self-attention, ``TransformerConfig.attention_window``: one convention
(r keys on each side, |i - j| <= r) from the mask functions through blockwise attention (key
blocks outside the window skipped) to the ring-buffer key/value cache of decoding.

The whole-model float64 checks are in test_reference.py (the ``window_*`` variants); here:
the mask structure against ``local_mask``, blockwise against the reference attention with the
dense mask, the block ranges against brute force, and cached decoding against the uncached
forward.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderDecoder, TransformerConfig
from flaxformer_lite.decoding.generate import continue_prompt, generate, init_cache
from flaxformer_lite.ops.attention import cudnn_unsupported_reason, dot_product_attention
from flaxformer_lite.ops.blockwise import (
    _Config,
    _k_block_range,
    _q_block_range,
    blockwise_attention,
)
from flaxformer_lite.ops.masks import AttentionMask, causal_mask, combine_masks, local_mask

# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("causal", [False, True])
def test_attention_mask_window_is_local_mask(causal):
    for n, r in ((7, 0), (7, 2), (9, 8), (5, 20)):
        dense = AttentionMask(window=r, causal=causal).dense(n, n)
        expected = combine_masks(local_mask(n, r), causal_mask(n) if causal else None)
        np.testing.assert_array_equal(dense, expected)
    # r keys on each side: an interior query of the bidirectional mask sees 2r + 1 keys.
    assert int(local_mask(9, 2)[0, 0, 4].sum()) == 5


def test_config_window_validation():
    with pytest.raises(ValueError, match="attention_window must be None or a positive"):
        TransformerConfig(attention_window=0)
    with pytest.raises(ValueError, match="attention_window_layers must be one of"):
        TransformerConfig(attention_window=2, attention_window_layers="cross")
    cfg = TransformerConfig(attention_window=4, attention_window_layers="decoder")
    assert cfg.self_attention_window("decoder") == 4
    assert cfg.self_attention_window("encoder") is None


def test_cudnn_refuses_a_bidirectional_window_only():
    kw = dict(
        backend="cuda",
        dtypes=["bfloat16"] * 3,
        query_shape=(1, 64, 4, 64),
        key_shape=(1, 64, 4, 64),
        dense_mask_or_bias=False,
        compute_capability=(9, 0),
    )
    assert "causal sliding window" in cudnn_unsupported_reason(**kw, window=8, causal=False)
    assert cudnn_unsupported_reason(**kw, window=8, causal=True) is None


# ----------------------------------------------------------------------------- blockwise


def _qkv(seed, b=2, n=37, heads=4, kv_heads=2, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, heads, d)).astype(np.float32)
    k = rng.standard_normal((b, n, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((b, n, kv_heads, d)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


BLOCKWISE_CASES = [  # (window, causal, query_block, key_block, padded/segmented)
    (3, False, 4, 8, False),
    (3, True, 4, 8, True),
    (10, False, 7, 5, True),
    (0, True, 8, 8, False),
    (5, True, 16, 3, False),
]


@pytest.mark.parametrize("window,causal,q_block,k_block,structured", BLOCKWISE_CASES)
def test_blockwise_window_equals_reference(window, causal, q_block, k_block, structured):
    """Outputs and gradients of blockwise attention with a window (small blocks, so most key
    blocks are skipped) equal the reference with the dense mask of ``AttentionMask.dense``."""
    q, k, v = _qkv(window + q_block)
    b, n = q.shape[:2]
    valid = segments = None
    if structured:
        valid = jnp.asarray(np.arange(n)[None] < np.array([[n], [n - 9]]))
        seg = np.ones((b, n), np.int32)
        seg[0, 20:] = 2
        seg[1, n - 9 :] = 0
        segments = jnp.asarray(seg)
    mask = AttentionMask(
        key_valid=valid,
        query_segment_ids=segments,
        key_segment_ids=segments,
        causal=causal,
        window=window,
    )
    dense = mask.dense(n, n)
    cotangent = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cotangent)

    def blockwise(q, k, v):
        return blockwise_attention(
            q,
            k,
            v,
            causal=causal,
            window=window,
            key_padding=valid,
            query_segment_ids=segments,
            key_segment_ids=segments,
            query_block=q_block,
            key_block=k_block,
        )

    def reference(q, k, v):
        return dot_product_attention(q, k, v, dense)

    got = jax.jit(blockwise)(q, k, v)
    want = reference(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    grads = jax.jit(jax.grad(functools.partial(loss, blockwise), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)
    # The model path: dot_product_attention hands the AttentionMask (window included) over.
    via_mask = dot_product_attention(q, k, v, mask, implementation="blockwise")
    np.testing.assert_allclose(via_mask, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_block_ranges_cover_the_window_and_stay_bounded(causal):
    """Every (query block, key block) pair with an allowed entry is visited, in both the
    forward (key ranges) and the backward (query ranges); the number of key blocks a query
    block visits is bounded by the window and block sizes, not by the length (linear work)."""
    for n, qb, kb, window, offset in ((40, 4, 8, 3, 0), (50, 7, 5, 9, 0), (33, 8, 3, 0, 2)):
        nq, nk = -(-n // qb), -(-(n + offset) // kb)
        cfg = _Config(qb, kb, nq, nk, n + offset, causal, offset, window)
        qi = np.arange(nq * qb)[:, None] + offset
        kj = np.arange(nk * kb)[None, :]
        allowed = np.abs(qi - kj) <= window
        if causal:
            allowed &= kj <= qi
        blocks = allowed.reshape(nq, qb, nk, kb).any(axis=(1, 3))  # [nq, nk]
        for i in range(nq):
            lo, hi = (int(x) for x in _k_block_range(cfg, jnp.int32(i)))
            needed = np.flatnonzero(blocks[i])
            assert lo <= needed.min() and needed.max() < hi
            assert hi - lo <= (qb + 2 * window) // kb + 2
        for j in range(nk):
            lo, hi = (int(x) for x in _q_block_range(cfg, jnp.int32(j)))
            needed = np.flatnonzero(blocks[:, j])
            if needed.size:
                assert lo <= needed.min() and needed.max() < hi
            assert hi - lo <= (kb + 2 * window) // qb + 2


# ----------------------------------------------------------------------------- decoding

WINDOW = 3
LM = TransformerConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=24,
    dropout_rate=0.0,
    attention_window=WINDOW,
    position="rotary",
)
SEQ2SEQ = LM.replace(position="sinusoidal", num_kv_heads=None)


def _peaky_params(model, *inputs, seed=3):
    """Random parameters with the output embedding scaled up, so greedy choices are far from
    ties and "same tokens" cannot hinge on float32 rounding. ``init`` is jitted: one compiled
    program (the same draws) instead of every initialiser compiled and run op by op."""
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(seed), *inputs)["params"])
    for name in [name for name in params if name.endswith("embedding")]:  # tied: the output too
        params[name]["embedding"] = params[name]["embedding"] * 4.0
    return params


@pytest.fixture(scope="module")
def lm():
    model = DecoderOnly(LM)
    tokens = jnp.ones((2, LM.max_len), jnp.int32)
    return model, _peaky_params(model, tokens)


def test_cache_size_is_the_window_whatever_max_len(lm):
    model, params = lm
    shapes = [
        [x.shape for x in jax.tree_util.tree_leaves(init_cache(model, params, 2, n))]
        for n in (8, 16, 24)
    ]
    assert shapes[0] == shapes[1] == shapes[2]
    cache = init_cache(model, params, 2, 16)
    key = cache["decoder"]["layers_0"]["self_attention"]["cached_key"]
    assert key.shape == (2, LM.kv_heads, WINDOW, LM.effective_head_dim)  # heads first
    # A cache shorter than the window stays linear (nothing ever falls out of the window).
    short = init_cache(model, params, 2, WINDOW - 1)
    assert short["decoder"]["layers_0"]["self_attention"]["cached_key"].shape[2] == WINDOW - 1


@pytest.mark.parametrize("chunks", [(1,) * 14, (5, 1, 1, 7), (2, 12)])
def test_ring_cache_decoding_equals_uncached_forward(lm, chunks):
    """Feeding a sequence through the ring cache in chunks (one token per step, a prefill longer
    than the window, ...) gives the logits of one uncached forward with the window mask."""
    model, params = lm
    n = sum(chunks)
    tokens = jnp.asarray(np.random.default_rng(5).integers(1, LM.vocab_size, (2, n)), jnp.int32)
    # No shift, no cache; jitted (one program, not every operation compiled eagerly).
    full = jax.jit(functools.partial(model.apply, method=model.decode))({"params": params}, tokens)
    cache = init_cache(model, params, 2, n)
    step = jax.jit(
        lambda c, t: model.apply(
            {"params": params, "cache": c}, t, decode=True, mutable=["cache"], method=model.decode
        )
    )
    start, pieces = 0, []
    for size in chunks:
        logits, variables = step(cache, tokens[:, start : start + size])
        cache, start = variables["cache"], start + size
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
    # The window matters: full attention gives other logits at the far positions.
    free = DecoderOnly(LM.replace(attention_window=None))
    unrestricted = jax.jit(functools.partial(free.apply, method=free.decode))(
        {"params": params}, tokens
    )
    assert float(jnp.max(jnp.abs(unrestricted[:, WINDOW + 1 :] - full[:, WINDOW + 1 :]))) > 1e-3


def _greedy_by_full_forward(apply_fn, first_tokens, steps):
    """Greedy tokens by re-running the uncached model on the whole prefix at every step. The
    prefix sits in a buffer of its final length (one compiled shape); causality makes the
    positions after it irrelevant to the logits read at its end."""
    n = first_tokens.shape[1]
    seq = jnp.pad(first_tokens, ((0, 0), (0, steps)), constant_values=first_tokens[0, 0])
    forward = jax.jit(apply_fn)
    for t in range(n, n + steps):
        nxt = jnp.argmax(forward(seq)[:, t - 1], axis=-1).astype(jnp.int32)
        seq = seq.at[:, t].set(nxt)
    return seq[:, n:]


def _until_eos(tokens, eos_id):
    """Rows as lists, cut after the first EOS (what the searches emit before padding)."""
    rows = []
    for row in np.asarray(tokens).tolist():
        rows.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return rows


def test_continue_prompt_greedy_equals_uncached_argmax(lm):
    model, params = lm
    prompt = jnp.asarray(np.random.default_rng(6).integers(3, LM.vocab_size, (2, 6)), jnp.int32)
    steps = LM.max_len - prompt.shape[1] - 1
    got, _ = continue_prompt(params, LM, prompt, max_len=steps)
    start = jnp.concatenate([jnp.full((2, 1), LM.bos_id, jnp.int32), prompt], axis=1)
    want = _greedy_by_full_forward(
        lambda s: model.apply({"params": params}, s, method=model.decode), start, steps
    )
    assert _until_eos(got, LM.eos_id) == _until_eos(want, LM.eos_id)
    assert max(len(r) for r in _until_eos(got, LM.eos_id)) > 2 * WINDOW  # beyond the window


def test_generate_greedy_equals_uncached_argmax():
    model = EncoderDecoder(SEQ2SEQ)
    src = jnp.asarray(np.random.default_rng(8).integers(3, SEQ2SEQ.vocab_size, (2, 9)), jnp.int32)
    params = _peaky_params(model, src, jnp.ones((2, SEQ2SEQ.max_len), jnp.int32), seed=4)
    got, _ = generate(params, SEQ2SEQ, src, max_len=16)
    start = jnp.full((2, 1), SEQ2SEQ.bos_id, jnp.int32)
    want = _greedy_by_full_forward(
        lambda s: model.apply({"params": params}, src, s, method=_decode_prefix), start, 16
    )
    assert _until_eos(got, SEQ2SEQ.eos_id) == _until_eos(want, SEQ2SEQ.eos_id)
    assert max(len(r) for r in _until_eos(got, SEQ2SEQ.eos_id)) > 2 * WINDOW


def _decode_prefix(model, src, decoder_inputs):
    """Uncached logits for decoder inputs that start with BOS (no shift)."""
    return model.decode(model.encode(src), src, decoder_inputs)
