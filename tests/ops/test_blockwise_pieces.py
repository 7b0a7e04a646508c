"""The named pieces of ops/blockwise.py, each against a float64 NumPy (or brute-force index)
reference: the online-softmax fold of the forward pass, one block's gradients in the backward
pass, the allowed pattern of a block, and the key/query block ranges the loops visit."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops.blockwise import (
    _block_allowed,
    _block_gradients,
    _block_mask_and_bias,
    _k_block_range,
    _online_softmax_finish,
    _online_softmax_init,
    _online_softmax_update,
    _pad_key_padding,
    _pad_segment_ids,
    _plan_blocks,
    _q_block_range,
)

B, KVH, G, QB, KB, D = 2, 2, 3, 3, 4, 5  # batch, kv heads, groups, q_block, k_block, head_dim
NUM_K_BLOCKS = 3


def softmax_rows_f64(s: np.ndarray) -> np.ndarray:
    """Row softmax in float64; rows with no finite logit are all zeros."""
    s = np.asarray(s, np.float64)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def test_online_softmax_fold_over_key_blocks_equals_float64_softmax():
    rng = np.random.default_rng(0)
    # Logits spread over +-30: the running max grows from block to block, so the rescaling of
    # the old sums matters (without it the result is off by factors of e^10 and more).
    s = (30 * rng.standard_normal((B, KVH, G, QB, NUM_K_BLOCKS * KB))).astype(np.float32)
    s[..., ::3] += np.linspace(0, 20, NUM_K_BLOCKS * KB)[::3]  # later keys win more often
    allowed = rng.random(s.shape) > 0.3
    allowed[0, 0, 0, 0] = False  # a row that sees nothing: out 0, lse +inf
    allowed[0, 0, 0, 1, :KB] = False  # a row whose first key block is all masked
    allowed[1, 1, 2, 2, : 2 * KB] = False  # ... and whose first two are
    s = np.where(allowed, s, -np.inf).astype(np.float32)
    v = rng.standard_normal((B, NUM_K_BLOCKS * KB, KVH, D)).astype(np.float32)

    carry = _online_softmax_init(B, KVH, G, QB, D)
    for j in range(NUM_K_BLOCKS):
        carry = _online_softmax_update(
            jnp.asarray(s[..., j * KB : (j + 1) * KB]),
            jnp.asarray(v[:, j * KB : (j + 1) * KB]),
            *carry,
        )
    out, lse = _online_softmax_finish(*carry, jnp.float32)

    p = softmax_rows_f64(s)  # [b, kvh, g, q, k]
    want = np.einsum("bhgqk,bkhd->bhgqd", p, v.astype(np.float64))
    with np.errstate(divide="ignore"):
        finite = np.where(allowed, s.astype(np.float64), -np.inf)
        row_max = finite.max(axis=-1)
        safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
        want_lse = safe_max + np.log(np.exp(finite - safe_max[..., None]).sum(axis=-1))
    want_lse = np.where(np.isfinite(row_max), want_lse, np.inf)

    assert out.shape == (B, KVH, G, QB, D) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[0, 0, 0, 0], 0.0)
    assert np.isposinf(np.asarray(lse)[0, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6)


def test_block_gradients_equal_float64_softmax_jacobian():
    """One block holding every key: p is the full softmax, and the block's contributions are
    the whole gradient of <dO, softmax(q k^T) v>, computed here with the explicit Jacobian."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, QB, KVH, G, D)).astype(np.float32)
    k = rng.standard_normal((B, KB, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, KB, KVH, D)).astype(np.float32)
    d_out = rng.standard_normal((B, QB, KVH, G, D)).astype(np.float32)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, d_out))

    s = np.einsum("bqhgd,bkhd->bhgqk", q64, k64)
    s[0, 1, 2, 1, 3] = -np.inf  # one masked entry: its dS must be exactly 0
    p = softmax_rows_f64(s)
    o = np.einsum("bhgqk,bkhd->bqhgd", p, v64)
    delta = np.einsum("bqhgd,bqhgd->bhgq", do64, o)

    dq, dk, dv, ds = _block_gradients(
        jnp.asarray(p, jnp.float32),
        jnp.asarray(delta, jnp.float32),
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(d_out),
    )

    # d loss / d p = dO v^T; through the softmax's Jacobian diag(p) - p p^T, row by row.
    dp = np.einsum("bqhgd,bkhd->bhgqk", do64, v64)
    jacobian = np.einsum("...k,kl->...kl", p, np.eye(KB)) - p[..., :, None] * p[..., None, :]
    want_ds = np.einsum("...kl,...k->...l", jacobian, dp)
    want_dq = np.einsum("bhgqk,bkhd->bqhgd", want_ds, k64)
    want_dk = np.einsum("bhgqk,bqhgd->bkhd", want_ds, q64)
    want_dv = np.einsum("bhgqk,bqhgd->bkhd", p, do64)

    for name, got, want in (("ds", ds, want_ds), ("dq", dq, want_dq), ("dk", dk, want_dk)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(dv), want_dv, rtol=1e-5, atol=1e-5, err_msg="dv")
    assert np.asarray(ds)[0, 1, 2, 1, 3] == 0.0


# q_len, kv_len, q_block, k_block, causal, causal_offset, window, masks (key_padding/segments)
PATTERNS = {
    "causal_ragged": (10, 10, 3, 4, True, 0, None, False),
    "causal_offset_window": (7, 13, 2, 5, True, 6, 3, True),
    "window_both_sides": (11, 9, 4, 3, False, -1, 2, True),
    "plain_padding_segments": (6, 7, 4, 3, False, 0, None, True),
}


def reference_allowed(q_len, kv_len, causal, offset, window, key_padding, q_seg, k_seg, mask):
    """`[b, q_len, kv_len]` from indices and the masks, brute force in NumPy."""
    qi, kj = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    allowed = np.ones((q_len, kv_len), bool)
    if causal:
        allowed &= kj <= qi + offset
    if window is not None:
        allowed &= np.abs(qi + offset - kj) <= window
    allowed = np.broadcast_to(allowed, (B, q_len, kv_len)).copy()
    if key_padding is not None:
        allowed &= key_padding[:, None, :]
    if q_seg is not None:
        allowed &= (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)
    if mask is not None:
        allowed &= mask[:, 0]
    return allowed


@pytest.mark.parametrize("name", list(PATTERNS))
def test_block_allowed_and_block_ranges_against_brute_force(name):
    q_len, kv_len, qb, kb, causal, offset, window, masked = PATTERNS[name]
    cfg = _plan_blocks(
        q_len,
        kv_len,
        query_block=qb,
        key_block=kb,
        causal=causal,
        causal_offset=offset,
        window=window,
    )
    rng = np.random.default_rng(2)
    key_padding = q_seg = k_seg = mask = None
    if masked:
        key_padding = rng.random((B, kv_len)) > 0.2
        q_seg, k_seg = rng.integers(0, 3, (B, q_len)), rng.integers(0, 3, (B, kv_len))
        mask = rng.random((B, 1, q_len, kv_len)) > 0.2
    blocked_mask, _ = _block_mask_and_bias(
        mask, None, cfg, batch=B, heads=1, kv_heads=1, q_len=q_len
    )
    padded_kp = _pad_key_padding(key_padding, cfg, batch=B)
    segments = _pad_segment_ids(q_seg, k_seg, cfg, batch=B, q_len=q_len)

    blocks = np.zeros((B, cfg.num_q_blocks, cfg.num_k_blocks, cfg.q_block, cfg.k_block), bool)
    for i, j in itertools.product(range(cfg.num_q_blocks), range(cfg.num_k_blocks)):
        got = _block_allowed(cfg, blocked_mask, padded_kp, segments, jnp.asarray(i), jnp.asarray(j))
        blocks[:, i, j] = np.broadcast_to(np.asarray(got), (B, 1, 1, cfg.q_block, cfg.k_block))[
            :, 0, 0
        ]
    stitched = blocks.transpose(0, 1, 3, 2, 4).reshape(B, cfg.q_padded, cfg.kv_padded)
    want = reference_allowed(q_len, kv_len, causal, offset, window, key_padding, q_seg, k_seg, mask)
    np.testing.assert_array_equal(stitched[:, :q_len, :kv_len], want)
    assert not stitched[:, :, kv_len:].any()  # padded keys are never allowed
    if masked:  # padded queries get segment 0: they see nothing either
        assert not stitched[:, q_len:].any()

    # The loops skip only blocks without an allowed entry (over real query rows), and with a
    # causal diagonal or a window they do skip some.
    visited_by_rows = np.zeros((cfg.num_q_blocks, cfg.num_k_blocks), bool)
    visited_by_keys = np.zeros_like(visited_by_rows)
    for i in range(cfg.num_q_blocks):
        lo, hi = _k_block_range(cfg, jnp.asarray(i))
        visited_by_rows[i, int(lo) : int(hi)] = True
    for j in range(cfg.num_k_blocks):
        lo, hi = _q_block_range(cfg, jnp.asarray(j))
        visited_by_keys[int(lo) : int(hi), j] = True
    real = blocks.copy()
    real_rows = (np.arange(cfg.q_padded) < q_len).reshape(cfg.num_q_blocks, cfg.q_block)
    real &= real_rows[None, :, None, :, None]
    needed = real.any(axis=(0, 3, 4))  # [num_q_blocks, num_k_blocks]
    assert not (needed & ~visited_by_rows).any(), (needed, visited_by_rows)
    assert not (needed & ~visited_by_keys).any(), (needed, visited_by_keys)
    if causal or window is not None:
        assert not visited_by_rows.all() and not visited_by_keys.all()
