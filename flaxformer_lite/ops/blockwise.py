"""Memory-efficient (blockwise, "flash") attention in pure JAX: O(n) memory for forward + backward.

Same contract as ``flaxformer_lite.ops.attention.dot_product_attention`` (shapes, grouped-query
heads, boolean mask, additive bias, 1/sqrt(head_dim) scaling, float32 softmax statistics, zeros
for a query row with nothing to attend to), computed without ever holding a `[q_len, kv_len]`
matrix:

Forward: for each block of ``query_block`` queries, loop over blocks of ``key_block`` keys keeping
an online softmax -- running max ``m``, running denominator ``denom`` and running weighted sum of
values ``acc`` -- rescaling the old statistics whenever the max grows (Milakov & Gimelshein 2018;
Rabe & Staats 2021; Dao et al. 2022). Only the output and the per-row log-sum-exp
``lse = m + log(denom)`` are kept for the backward pass.

Backward (``jax.custom_vjp``, FlashAttention-2 style): for each key block, loop over query blocks,
recompute the probabilities ``p = exp(s - lse)`` from the saved ``lse``, and accumulate
``dV += p^T dO``, ``dS = p * (dO V^T - rowsum(dO * O))``, ``dQ += dS K``, ``dK += dS^T Q``
(and ``dBias += dS`` reduced over the bias's broadcast axes). Residuals and accumulators are all
`[batch, length, heads, head_dim]`-sized, so peak memory grows linearly in the sequence length;
the only quadratic arrays are those the caller passes in (a full `[b, h, n, n]` mask or bias).

Long-sequence users need no quadratic array at all: ``causal=True`` builds the causal pattern per
block from indices (and skips the key blocks that lie entirely in the future, halving the work),
``window=r`` keeps each query to the keys within distance r (key blocks wholly outside are skipped:
linear work), and ``key_padding`` `[batch, kv_len]` masks padded keys; packed rows pass
``query_segment_ids`` / ``key_segment_ids`` (a query sees only keys of its own segment, segment 0
sees nothing), also compared block by block. The models hand their masks over in this form
(``masks.AttentionMask``), never as `[batch, 1, n, n]` matrices.

Shapes:
  query  `[batch, q_len, heads, head_dim]`
  key    `[batch, kv_len, kv_heads, head_dim]`   (``heads`` a multiple of ``kv_heads``)
  value  `[batch, kv_len, kv_heads, head_dim]`
  mask   bool, broadcastable to `[batch, heads, q_len, kv_len]`, True where attention is allowed
  bias   float, broadcastable to `[batch, heads, q_len, kv_len]`, added to the logits
  key_padding  bool `[batch, kv_len]` (or `[1, kv_len]`), True for a real key
  query_segment_ids / key_segment_ids  int `[batch, q_len]` / `[batch, kv_len]`
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from flaxformer_lite.ops.shapes import check_shapes

Array = jax.Array

DEFAULT_QUERY_BLOCK = 512
DEFAULT_KEY_BLOCK = 512


class _Config(NamedTuple):
    """Static (hashable) description of the blocking; a ``nondiff_argnums`` of the custom VJP."""

    q_block: int  # queries per block
    k_block: int  # keys per block
    num_q_blocks: int
    num_k_blocks: int
    kv_len: int  # real (unpadded) number of keys; padded keys are masked by index
    causal: bool
    causal_offset: int  # query i may see key j iff j <= i + causal_offset
    window: int | None  # query i may see key j iff |j - (i + causal_offset)| <= window


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_axis(x: Array, axis: int, size: int) -> Array:
    """Zero/False-pad ``x`` along ``axis`` up to ``size`` (a no-op when already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _block_operand(
    x: Array | None,
    name: str,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    q_padded: int,
    kv_padded: int,
) -> Array | None:
    """Broadcastable `[b|1, heads|1, q_len|1, kv_len|1]` -> `[b|1, kvh|1, groups|1, Qp|1, Kp|1]`.

    Broadcast (size-1) axes stay size 1 -- they are never materialised; full query/key axes are
    padded to the blocked lengths so every block can be cut with a fixed-size dynamic slice.
    """
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must broadcast to [batch, heads, q_len, kv_len]; got {x.shape}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, h, q, k = x.shape
    for got, want, axis in ((b, batch, "batch"), (h, heads, "head"), (q, q_len, "query")):
        if got not in (1, want):
            raise ValueError(f"{name} {axis} axis must be 1 or {want}; got shape {x.shape}")
    if k not in (1, kv_len):
        raise ValueError(f"{name} key axis must be 1 or {kv_len}; got shape {x.shape}")
    if h == 1:
        x = x[:, :, None]
    else:
        x = x.reshape(b, kv_heads, heads // kv_heads, q, k)
    if q != 1:
        x = _pad_axis(x, 3, q_padded)
    if k != 1:
        x = _pad_axis(x, 4, kv_padded)
    return x


def _cut(x: Array, i: Array, j: Array, cfg: _Config) -> Array:
    """Block (i, j) of a `[B, H, G, Qp|1, Kp|1]` operand; broadcast axes stay size 1."""
    if x.shape[3] != 1:
        x = lax.dynamic_slice_in_dim(x, i * cfg.q_block, cfg.q_block, axis=3)
    if x.shape[4] != 1:
        x = lax.dynamic_slice_in_dim(x, j * cfg.k_block, cfg.k_block, axis=4)
    return x


def _block_logits(
    cfg: _Config,
    q_blk: Array,
    k_blk: Array,
    mask: Array | None,
    bias: Array | None,
    key_padding: Array | None,
    segments: tuple[Array, Array] | None,
    i: Array,
    j: Array,
) -> Array:
    """Masked float32 logits of query block i against key block j.

    q_blk `[b, q_block, kvh, g, d]` (pre-scaled), k_blk `[b, k_block, kvh, d]`
    -> `[b, kvh, g, q_block, k_block]`, -inf where attention is not allowed.
    """
    # Low-precision inputs multiply in their own dtype and accumulate in float32, as the
    # reference does.
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32)
    if bias is not None:
        s = s + _cut(bias, i, j, cfg).astype(jnp.float32)
    k_idx = j * cfg.k_block + jnp.arange(cfg.k_block)
    allowed = (k_idx < cfg.kv_len)[None, :]  # padded keys never count; [1, k_block]
    if cfg.causal or cfg.window is not None:
        diagonal = i * cfg.q_block + jnp.arange(cfg.q_block) + cfg.causal_offset  # [q_block]
        distance = diagonal[:, None] - k_idx[None, :]  # [q_block, k_block]
        if cfg.causal:
            allowed = allowed & (distance >= 0)
        if cfg.window is not None:
            allowed = allowed & (jnp.abs(distance) <= cfg.window)
    if key_padding is not None:
        kp = lax.dynamic_slice_in_dim(key_padding, j * cfg.k_block, cfg.k_block, axis=1)
        allowed = allowed & kp[:, None, None, None, :]
    if segments is not None:
        q_seg = lax.dynamic_slice_in_dim(segments[0], i * cfg.q_block, cfg.q_block, axis=1)
        k_seg = lax.dynamic_slice_in_dim(segments[1], j * cfg.k_block, cfg.k_block, axis=1)
        same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)
        allowed = allowed & same[:, None, None]  # [b, 1, 1, q_block, k_block]
    if mask is not None:
        allowed = allowed & _cut(mask, i, j, cfg)
    # -inf (not the most negative finite float): exp(-inf - m) is exactly 0 for any finite m, so
    # masked entries drop out of both the forward sums and the recomputed backward probabilities.
    return jnp.where(allowed, s, -jnp.inf)


def _k_block_range(cfg: _Config, i: Array) -> tuple[Array | int, Array | int]:
    """Key blocks [lo, hi) that query block i may see: all of them, less those wholly in the
    future (causal) or wholly outside the window (then at most ``window // k_block + 2`` blocks
    on each side of the diagonal, a number independent of the length)."""
    lo, hi = 0, cfg.num_k_blocks
    first = i * cfg.q_block + cfg.causal_offset  # diagonal of the block's first row
    last = first + cfg.q_block - 1  # ... and of its last row
    if cfg.causal:
        hi = jnp.clip(last // cfg.k_block + 1, 0, cfg.num_k_blocks)
    if cfg.window is not None:
        lo = jnp.clip((first - cfg.window) // cfg.k_block, 0, cfg.num_k_blocks)
        hi = jnp.minimum(hi, jnp.clip((last + cfg.window) // cfg.k_block + 1, 0, cfg.num_k_blocks))
        hi = jnp.maximum(hi, lo)  # an empty range, never a negative one
    return lo, hi


def _q_block_range(cfg: _Config, j: Array) -> tuple[Array | int, Array | int]:
    """Query blocks [lo, hi) that see any key of key block j: all of them, less those wholly
    before it (causal) or wholly outside the window."""
    lo, hi = 0, cfg.num_q_blocks
    first = j * cfg.k_block - cfg.causal_offset  # the query whose diagonal is the first key
    last = first + cfg.k_block - 1  # ... and the last key
    if cfg.causal:
        lo = jnp.clip(first // cfg.q_block, 0, cfg.num_q_blocks)
    if cfg.window is not None:
        lo = jnp.maximum(lo, jnp.clip((first - cfg.window) // cfg.q_block, 0, cfg.num_q_blocks))
        hi = jnp.clip((last + cfg.window) // cfg.q_block + 1, 0, cfg.num_q_blocks)
        hi = jnp.maximum(hi, lo)
    return lo, hi


def _forward(
    cfg: _Config,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    bias: Array | None,
    key_padding: Array | None,
    segments: tuple[Array, Array] | None,
) -> tuple[Array, Array]:
    """Online-softmax forward.

    q `[b, Qp, kvh, g, d]` (pre-scaled), k/v `[b, Kp, kvh, d]`
    -> out `[b, Qp, kvh, g, d]` (dtype of v), lse `[num_q_blocks, b, kvh, g, q_block]` (float32,
    +inf on rows with nothing to attend to).
    """
    b, _, kvh, g, d = q.shape

    def q_step(_, i):
        q_blk = lax.dynamic_slice_in_dim(q, i * cfg.q_block, cfg.q_block, axis=1)

        def k_step(j, carry):
            m, denom, acc = carry
            k_blk = lax.dynamic_slice_in_dim(k, j * cfg.k_block, cfg.k_block, axis=1)
            v_blk = lax.dynamic_slice_in_dim(v, j * cfg.k_block, cfg.k_block, axis=1)
            s = _block_logits(cfg, q_blk, k_blk, mask, bias, key_padding, segments, i, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row that has seen no allowed key yet has m_new = -inf; subtracting 0 instead keeps
            # exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan.
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            correction = jnp.exp(m - m_safe)  # rescales the old sums to the new max
            denom = denom * correction + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bhgqk,bkhd->bhgqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32
            )
            acc = acc * correction[..., None] + pv
            return m_new, denom, acc

        stats_shape = (b, kvh, g, cfg.q_block)
        init = (
            jnp.full(stats_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, d), jnp.float32),
        )
        lo, hi = _k_block_range(cfg, i)
        m, denom, acc = lax.fori_loop(lo, hi, k_step, init)
        seen = denom > 0.0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
        # +inf on empty rows makes the backward's exp(s - lse) exactly 0 there.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), jnp.inf)
        return None, (out.astype(v.dtype), lse)

    _, (out, lse) = lax.scan(q_step, None, jnp.arange(cfg.num_q_blocks))
    # [nq, b, kvh, g, q_block, d] -> [b, nq * q_block, kvh, g, d]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, -1, kvh, g, d)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(
    cfg: _Config,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    bias: Array | None,
    key_padding: Array | None,
    segments: tuple[Array, Array] | None,
) -> Array:
    return _forward(cfg, q, k, v, mask, bias, key_padding, segments)[0]


def _flash_fwd(cfg, q, k, v, mask, bias, key_padding, segments):
    out, lse = _forward(cfg, q, k, v, mask, bias, key_padding, segments)
    # O(n) residuals only: inputs, output, and one float32 statistic per query row.
    return out, (q, k, v, mask, bias, key_padding, segments, out, lse)


def _flash_bwd(cfg, residuals, d_out):
    q, k, v, mask, bias, key_padding, segments, out, lse = residuals
    b, qp, kvh, g, d = q.shape
    # delta_i = sum_j p_ij dP_ij = dO_i . O_i: the softmax Jacobian's row term, O(n) to compute.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta.reshape(b, cfg.num_q_blocks, cfg.q_block, kvh, g).transpose(1, 0, 3, 4, 2)

    def k_step(carry, j):
        k_blk = lax.dynamic_slice_in_dim(k, j * cfg.k_block, cfg.k_block, axis=1)
        v_blk = lax.dynamic_slice_in_dim(v, j * cfg.k_block, cfg.k_block, axis=1)

        def q_step(i, inner):
            dk, dv, dq_acc, dbias_acc = inner
            q_blk = lax.dynamic_slice_in_dim(q, i * cfg.q_block, cfg.q_block, axis=1)
            do_blk = lax.dynamic_slice_in_dim(d_out, i * cfg.q_block, cfg.q_block, axis=1)
            s = _block_logits(cfg, q_blk, k_blk, mask, bias, key_padding, segments, i, j)
            p = jnp.exp(s - lse[i][..., None])  # recomputed probabilities [b, kvh, g, qb, kb]
            dv = dv + jnp.einsum(
                "bhgqk,bqhgd->bkhd",
                p.astype(d_out.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[i][..., None])  # d loss / d logits; exactly 0 where masked
            dq_blk = jnp.einsum(
                "bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32
            )
            start = i * cfg.q_block
            dq_old = lax.dynamic_slice_in_dim(dq_acc, start, cfg.q_block, axis=1)
            dq_acc = lax.dynamic_update_slice_in_dim(dq_acc, dq_old + dq_blk, start, axis=1)
            dk = dk + jnp.einsum(
                "bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q_blk, preferred_element_type=jnp.float32
            )
            if dbias_acc is not None:
                dbias_acc = _accumulate_bias_grad(cfg, dbias_acc, ds, i, j)
            return dk, dv, dq_acc, dbias_acc

        dq_acc, dbias_acc = carry
        zeros = jnp.zeros((b, cfg.k_block, kvh, d), jnp.float32)
        lo, hi = _q_block_range(cfg, j)
        dk, dv, dq_acc, dbias_acc = lax.fori_loop(lo, hi, q_step, (zeros, zeros, dq_acc, dbias_acc))
        return (dq_acc, dbias_acc), (dk, dv)

    dq_acc = jnp.zeros(q.shape, jnp.float32)
    dbias_acc = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    (dq_acc, dbias_acc), (dk, dv) = lax.scan(
        k_step, (dq_acc, dbias_acc), jnp.arange(cfg.num_k_blocks)
    )
    # q was pre-scaled by 1/sqrt(d) outside; logits = q_scaled . k, so dq_scaled = dS k (the
    # chain rule through the scaling is JAX's, in the wrapper) and dk = dS^T q_scaled.
    dq = dq_acc.astype(q.dtype)
    # [nk, b, k_block, kvh, d] -> [b, nk * k_block, kvh, d]
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(k.shape).astype(k.dtype)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(v.shape).astype(v.dtype)
    dbias = None if bias is None else dbias_acc.astype(bias.dtype)
    # Boolean mask, key_padding and segment ids get no cotangent (None = zero).
    return dq, dk, dv, None, dbias, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _accumulate_bias_grad(cfg: _Config, acc: Array, ds: Array, i: Array, j: Array) -> Array:
    """Add dS of block (i, j), summed over the bias's broadcast axes, into ``acc``.

    acc `[B, H, G, Qp|1, Kp|1]` (the bias's blocked shape), ds `[b, kvh, g, q_block, k_block]`.
    """
    block_shape = (
        *acc.shape[:3],
        cfg.q_block if acc.shape[3] != 1 else 1,
        cfg.k_block if acc.shape[4] != 1 else 1,
    )
    axes = tuple(ax for ax in range(5) if block_shape[ax] == 1 and ds.shape[ax] != 1)
    contribution = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
    q_start = i * cfg.q_block if acc.shape[3] != 1 else 0
    k_start = j * cfg.k_block if acc.shape[4] != 1 else 0
    starts = (0, 0, 0, q_start, k_start)
    old = lax.dynamic_slice(acc, starts, block_shape)
    return lax.dynamic_update_slice(acc, old + contribution, starts)


def blockwise_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    bias: Array | None = None,
    *,
    causal: bool = False,
    causal_offset: int = 0,
    window: int | None = None,
    key_padding: Array | None = None,
    query_segment_ids: Array | None = None,
    key_segment_ids: Array | None = None,
    query_block: int = DEFAULT_QUERY_BLOCK,
    key_block: int = DEFAULT_KEY_BLOCK,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    return_weights: bool = False,
) -> Array:
    """softmax(q k^T / sqrt(head_dim) + bias, masked) v with O(length) memory, forward and backward.

    Args:
      query: `[batch, q_len, heads, head_dim]`.
      key: `[batch, kv_len, kv_heads, head_dim]`, ``heads % kv_heads == 0`` (multi-query and
        grouped-query attention share each key/value head among ``heads // kv_heads`` queries).
      value: `[batch, kv_len, kv_heads, head_dim]`.
      mask: bool, broadcastable to `[batch, heads, q_len, kv_len]`; True = may attend. Sliced
        block by block; its broadcast axes are never expanded.
      bias: broadcastable to `[batch, heads, q_len, kv_len]`; added to the (scaled) logits and
        differentiable (its gradient is summed over its broadcast axes).
      causal: query i attends only to keys j <= i + ``causal_offset``, built per block from
        indices (no mask array); key blocks wholly in the future are skipped.
      causal_offset: shift of the causal diagonal (static int). 0 matches
        ``masks.causal_mask`` and ``jax.nn.dot_product_attention(is_causal=True)``;
        ``kv_len - q_len`` aligns the queries with the last keys (a prompt appended to a cache);
        it shifts the window's centre too.
      window: restricted attention (static int >= 0, None = full): query i attends only to keys
        j with ``|j - (i + causal_offset)| <= window``, r keys on each side as ``masks.local_mask``
        (with ``causal``: a sliding window of the window keys before and the diagonal). Built
        per block from indices; key blocks wholly outside the window are skipped, so the work
        grows linearly in the length.
      key_padding: bool `[batch, kv_len]` (or `[1, kv_len]`); True for a real key, False for
        padding. Combined (logical and) with ``mask`` and ``causal``.
      query_segment_ids, key_segment_ids: int `[batch, q_len]` and `[batch, kv_len]` (or batch
        1), given together: packed rows, where query i sees key j only if both carry the same
        segment id and the query's is not 0 (padding), as ``masks.segment_mask``; compared per
        block, never materialised.
      query_block: queries per block (clipped to ``q_len``); ``q_len`` need not divide by it.
      key_block: keys per block (clipped to ``kv_len``); ``kv_len`` need not divide by it.
      dropout_rate, deterministic: attention dropout is not supported; a ValueError is raised
        when it would be active (``dropout_rate > 0`` and not ``deterministic``).
      return_weights: not supported (the weights are never materialised); raises ValueError.

    Returns:
      `[batch, q_len, heads, head_dim]` in the dtype of ``value``. Query rows with no allowed key
      are exactly zero, with finite (zero) gradients.
    """
    if return_weights:
        raise ValueError(
            "blockwise attention never materialises the attention weights; return_weights is "
            "not supported (use implementation='xla')"
        )
    if dropout_rate > 0.0 and not deterministic:
        raise ValueError(
            "blockwise attention does not support attention dropout; use dropout_rate=0, "
            "deterministic=True, or implementation='xla'"
        )
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 0
    ):
        raise ValueError(f"window must be None or an int >= 0; got {window!r}")
    if query_block < 1 or key_block < 1:
        raise ValueError(f"block sizes must be >= 1; got {query_block} and {key_block}")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    check_shapes(query, key, value)
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if q_len == 0 or kv_len == 0:  # nothing to attend to (or nobody asking): zeros
        return jnp.zeros((batch, q_len, heads, value.shape[-1]), value.dtype)

    q_block = min(query_block, q_len)
    k_block = min(key_block, kv_len)
    num_q_blocks, num_k_blocks = _cdiv(q_len, q_block), _cdiv(kv_len, k_block)
    q_padded, kv_padded = num_q_blocks * q_block, num_k_blocks * k_block

    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
    operand_dims = dict(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        q_padded=q_padded,
        kv_padded=kv_padded,
    )
    mask = _block_operand(mask, "mask", **operand_dims)
    bias = _block_operand(bias, "bias", **operand_dims)
    if key_padding is not None:
        key_padding = jnp.asarray(key_padding)
        if key_padding.dtype != jnp.bool_ or key_padding.ndim != 2:
            raise ValueError(
                "key_padding must be boolean [batch, kv_len] (True = real key); "
                f"got {key_padding.dtype} {key_padding.shape}"
            )
        if key_padding.shape[0] not in (1, batch) or key_padding.shape[1] != kv_len:
            raise ValueError(
                f"key_padding must be [{batch} or 1, {kv_len}]; got {key_padding.shape}"
            )
        key_padding = _pad_axis(key_padding, 1, kv_padded)
    segments = None
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("query_segment_ids and key_segment_ids must be given together")
    if query_segment_ids is not None:
        q_seg, k_seg = jnp.asarray(query_segment_ids), jnp.asarray(key_segment_ids)
        for name, ids, length in (("query", q_seg, q_len), ("key", k_seg, kv_len)):
            if ids.ndim != 2 or ids.shape[0] not in (1, batch) or ids.shape[1] != length:
                raise ValueError(
                    f"{name}_segment_ids must be [{batch} or 1, {length}]; got {ids.shape}"
                )
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(f"{name}_segment_ids must be integers; got {ids.dtype}")
        # Padded query rows get segment 0 (nothing); padded keys are masked by index anyway.
        segments = (_pad_axis(q_seg, 1, q_padded), _pad_axis(k_seg, 1, kv_padded))

    scale = head_dim**-0.5
    # Scale the query in its own dtype before the matmul, exactly as the reference does.
    q = (query * jnp.asarray(scale, query.dtype)).reshape(batch, q_len, kv_heads, groups, head_dim)
    q = _pad_axis(q, 1, q_padded)  # padded query rows are computed and then dropped
    k = _pad_axis(key, 1, kv_padded)  # padded keys are masked by index in _block_logits
    v = _pad_axis(value, 1, kv_padded)
    cfg = _Config(
        q_block=q_block,
        k_block=k_block,
        num_q_blocks=num_q_blocks,
        num_k_blocks=num_k_blocks,
        kv_len=kv_len,
        causal=bool(causal),
        causal_offset=int(causal_offset),
        window=window,
    )
    out = _flash(cfg, q, k, v, mask, bias, key_padding, segments)  # [b, Qp, kvh, g, d]
    return out[:, :q_len].reshape(batch, q_len, heads, value.shape[-1])
