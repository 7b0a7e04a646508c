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
from typing import Any, NamedTuple

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

    @property
    def q_padded(self) -> int:
        """Query length padded to whole blocks, ``num_q_blocks * q_block``."""
        return self.num_q_blocks * self.q_block

    @property
    def kv_padded(self) -> int:
        """Key length padded to whole blocks, ``num_k_blocks * k_block``."""
        return self.num_k_blocks * self.k_block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- operands
# blockwise_attention's checks and layouts: every operand padded to whole blocks, the broadcast
# axes of the mask and bias never expanded.


def _check_options(
    *,
    return_weights: bool,
    dropout_rate: float,
    deterministic: bool,
    window: int | None,
    query_block: int,
    key_block: int,
) -> None:
    """Raises ValueError for what blockwise attention does not do or cannot block by, before any
    array is touched."""
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


def _plan_blocks(
    q_len: int,
    kv_len: int,
    *,
    query_block: int,
    key_block: int,
    causal: bool,
    causal_offset: int,
    window: int | None,
) -> _Config:
    """The blocking of a `[q_len, kv_len]` attention (both >= 1): block sizes clipped to the
    lengths, the number of blocks on each axis (the last block may be partly padding), and the
    index-built mask (causal diagonal, window) every block applies."""
    q_block = min(query_block, q_len)
    k_block = min(key_block, kv_len)
    return _Config(
        q_block=q_block,
        k_block=k_block,
        num_q_blocks=_cdiv(q_len, q_block),
        num_k_blocks=_cdiv(kv_len, k_block),
        kv_len=kv_len,
        causal=bool(causal),
        causal_offset=int(causal_offset),
        window=window,
    )


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


def _block_mask_and_bias(
    mask: Array | None,
    bias: Array | None,
    cfg: _Config,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
) -> tuple[Array | None, Array | None]:
    """Checks ``mask`` (boolean) and ``bias`` (a non-float bias becomes float32) and lays both
    out for block cutting.

    mask bool / bias float, broadcastable to `[batch, heads, q_len, kv_len]`
    -> `[b|1, kvh|1, groups|1, Qp|1, Kp|1]` each (None stays None).
    """
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
        kv_len=cfg.kv_len,
        q_padded=cfg.q_padded,
        kv_padded=cfg.kv_padded,
    )
    return _block_operand(mask, "mask", **operand_dims), _block_operand(
        bias, "bias", **operand_dims
    )


def _pad_key_padding(key_padding: Array | None, cfg: _Config, *, batch: int) -> Array | None:
    """Checks ``key_padding`` and pads it with False (padded keys are no keys).

    key_padding bool `[batch|1, kv_len]` -> `[batch|1, Kp]` (None stays None).
    """
    if key_padding is None:
        return None
    key_padding = jnp.asarray(key_padding)
    if key_padding.dtype != jnp.bool_ or key_padding.ndim != 2:
        raise ValueError(
            "key_padding must be boolean [batch, kv_len] (True = real key); "
            f"got {key_padding.dtype} {key_padding.shape}"
        )
    if key_padding.shape[0] not in (1, batch) or key_padding.shape[1] != cfg.kv_len:
        raise ValueError(
            f"key_padding must be [{batch} or 1, {cfg.kv_len}]; got {key_padding.shape}"
        )
    return _pad_axis(key_padding, 1, cfg.kv_padded)


def _pad_segment_ids(
    query_segment_ids: Array | None,
    key_segment_ids: Array | None,
    cfg: _Config,
    *,
    batch: int,
    q_len: int,
) -> tuple[Array, Array] | None:
    """Checks the packed rows' segment ids (given together) and pads them with segment 0.

    query_segment_ids int `[batch|1, q_len]`, key_segment_ids int `[batch|1, kv_len]`
    -> (`[batch|1, Qp]`, `[batch|1, Kp]`), or None when neither is given.
    """
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("query_segment_ids and key_segment_ids must be given together")
    if query_segment_ids is None:
        return None
    q_seg, k_seg = jnp.asarray(query_segment_ids), jnp.asarray(key_segment_ids)
    for name, ids, length in (("query", q_seg, q_len), ("key", k_seg, cfg.kv_len)):
        if ids.ndim != 2 or ids.shape[0] not in (1, batch) or ids.shape[1] != length:
            raise ValueError(
                f"{name}_segment_ids must be [{batch} or 1, {length}]; got {ids.shape}"
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name}_segment_ids must be integers; got {ids.dtype}")
    # Padded query rows get segment 0 (nothing); padded keys are masked by index anyway.
    return _pad_axis(q_seg, 1, cfg.q_padded), _pad_axis(k_seg, 1, cfg.kv_padded)


def _block_qkv(
    query: Array, key: Array, value: Array, cfg: _Config, scale: float | None = None
) -> tuple[Array, Array, Array]:
    """Scales the query by ``scale`` (None: 1/sqrt(head_dim)), groups its heads by the
    key/value head they share, and pads every operand to whole blocks.

    query `[b, q_len, heads, d]`, key/value `[b, kv_len, kvh, d]`
    -> q `[b, Qp, kvh, heads // kvh, d]` (pre-scaled), k/v `[b, Kp, kvh, d]`.
    """
    batch, q_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    # Scale the query in its own dtype before the matmul, exactly as the reference does.
    q = (query * jnp.asarray(scale, query.dtype)).reshape(
        batch, q_len, kv_heads, heads // kv_heads, head_dim
    )
    q = _pad_axis(q, 1, cfg.q_padded)  # padded query rows are computed and then dropped
    k = _pad_axis(key, 1, cfg.kv_padded)  # padded keys are masked by index in _block_allowed
    v = _pad_axis(value, 1, cfg.kv_padded)
    return q, k, v


# ----------------------------------------------------------------------------- one block
# What query block i and key block j see of each other: the allowed pattern, the logits.


def _cut(x: Array, i: Array, j: Array, cfg: _Config) -> Array:
    """Block (i, j) of a `[B, H, G, Qp|1, Kp|1]` operand; broadcast axes stay size 1."""
    if x.shape[3] != 1:
        x = lax.dynamic_slice_in_dim(x, i * cfg.q_block, cfg.q_block, axis=3)
    if x.shape[4] != 1:
        x = lax.dynamic_slice_in_dim(x, j * cfg.k_block, cfg.k_block, axis=4)
    return x


def _block_allowed(
    cfg: _Config,
    mask: Array | None,
    key_padding: Array | None,
    segments: tuple[Array, Array] | None,
    i: Array,
    j: Array,
) -> Array:
    """Where query block i may attend to key block j: real keys only, the causal diagonal and
    the window (from indices), ``key_padding``, same non-zero segment, and the mask's block.

    mask `[B|1, kvh|1, g|1, Qp|1, Kp|1]`, key_padding `[b|1, Kp]`, segments (`[b|1, Qp]`,
    `[b|1, Kp]`) -> bool broadcastable to `[b, kvh, g, q_block, k_block]`.
    """
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
    return allowed


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
    allowed = _block_allowed(cfg, mask, key_padding, segments, i, j)
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


# ----------------------------------------------------------------------------- forward
# The online softmax: per query block, key blocks are folded in one at a time.


def _online_softmax_init(
    batch: int, kv_heads: int, groups: int, q_block: int, head_dim: int
) -> tuple[Array, Array, Array]:
    """The statistics of a query block that has seen no key yet: running max ``m = -inf``,
    denominator 0, weighted value sum 0.

    -> m, denom `[b, kvh, g, q_block]`, acc `[b, kvh, g, q_block, d]` (float32).
    """
    stats_shape = (batch, kv_heads, groups, q_block)
    return (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )


def _online_softmax_update(
    s: Array, v_blk: Array, m: Array, denom: Array, acc: Array
) -> tuple[Array, Array, Array]:
    """Folds one key block into a query block's running softmax statistics, rescaling the old
    sums whenever the running max grows.

    s `[b, kvh, g, q_block, k_block]` float32 logits (-inf = not allowed),
    v_blk `[b, k_block, kvh, d]`; m, denom `[b, kvh, g, q_block]`, acc `[b, kvh, g, q_block, d]`
    (float32) -> the updated (m, denom, acc), same shapes: m the max logit seen, denom the sum of
    exp(s - m), acc the sum of exp(s - m) v.
    """
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row that has seen no allowed key yet has m_new = -inf; subtracting 0 instead keeps
    # exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(m - m_safe)  # rescales the old sums to the new max
    denom = denom * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum(
        "bhgqk,bkhd->bhgqd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
    )
    acc = acc * correction[..., None] + pv
    return m_new, denom, acc


def _online_softmax_finish(m: Array, denom: Array, acc: Array, dtype: Any) -> tuple[Array, Array]:
    """A query block's output and log-sum-exp from its final statistics.

    m, denom `[b, kvh, g, q_block]`, acc `[b, kvh, g, q_block, d]` -> out `[b, kvh, g, q_block,
    d]` in ``dtype`` (exactly 0 on rows with no allowed key), lse `[b, kvh, g, q_block]` float32
    (+inf on those rows).
    """
    seen = denom > 0.0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
    # +inf on empty rows makes the backward's exp(s - lse) exactly 0 there.
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), jnp.inf)
    return out.astype(dtype), lse


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
    """Online-softmax forward: a scan over query blocks, each a loop over the key blocks it may
    see.

    q `[b, Qp, kvh, g, d]` (pre-scaled), k/v `[b, Kp, kvh, d]`
    -> out `[b, Qp, kvh, g, d]` (dtype of v), lse `[num_q_blocks, b, kvh, g, q_block]` (float32,
    +inf on rows with nothing to attend to).
    """
    b, _, kvh, g, d = q.shape

    def q_step(_, i):
        q_blk = lax.dynamic_slice_in_dim(q, i * cfg.q_block, cfg.q_block, axis=1)

        def k_step(j, carry):
            k_blk = lax.dynamic_slice_in_dim(k, j * cfg.k_block, cfg.k_block, axis=1)
            v_blk = lax.dynamic_slice_in_dim(v, j * cfg.k_block, cfg.k_block, axis=1)
            s = _block_logits(cfg, q_blk, k_blk, mask, bias, key_padding, segments, i, j)
            return _online_softmax_update(s, v_blk, *carry)

        init = _online_softmax_init(b, kvh, g, cfg.q_block, d)
        lo, hi = _k_block_range(cfg, i)
        m, denom, acc = lax.fori_loop(lo, hi, k_step, init)
        return None, _online_softmax_finish(m, denom, acc, v.dtype)

    _, (out, lse) = lax.scan(q_step, None, jnp.arange(cfg.num_q_blocks))
    # [nq, b, kvh, g, q_block, d] -> [b, nq * q_block, kvh, g, d]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, -1, kvh, g, d)
    return out, lse


# ----------------------------------------------------------------------------- backward
# FlashAttention-2's backward: per key block, the query blocks that see it, probabilities
# recomputed from the saved log-sum-exp.


def _softmax_row_term(cfg: _Config, d_out: Array, out: Array) -> Array:
    """delta_i = sum_j p_ij dP_ij = dO_i . O_i: the softmax Jacobian's row term, O(n) to compute.

    d_out, out `[b, Qp, kvh, g, d]` -> `[num_q_blocks, b, kvh, g, q_block]` float32.
    """
    b, _, kvh, g, _ = out.shape
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta.reshape(b, cfg.num_q_blocks, cfg.q_block, kvh, g).transpose(1, 0, 3, 4, 2)


def _block_gradients(
    p: Array, delta_blk: Array, q_blk: Array, k_blk: Array, v_blk: Array, do_blk: Array
) -> tuple[Array, Array, Array, Array]:
    """The gradient contributions of block (i, j) from its recomputed probabilities.

    p `[b, kvh, g, q_block, k_block]` float32, delta_blk `[b, kvh, g, q_block]`,
    q_blk/do_blk `[b, q_block, kvh, g, d]`, k_blk/v_blk `[b, k_block, kvh, d]`
    -> dq_blk `[b, q_block, kvh, g, d]`, dk_blk and dv_blk `[b, k_block, kvh, d]` (float32), and
    ds `[b, kvh, g, q_block, k_block]` = d loss / d logits (exactly 0 where masked).
    """
    dv_blk = jnp.einsum(
        "bhgqk,bqhgd->bkhd",
        p.astype(do_blk.dtype),
        do_blk,
        preferred_element_type=jnp.float32,
    )
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_blk, v_blk, preferred_element_type=jnp.float32)
    ds = p * (dp - delta_blk[..., None])  # d loss / d logits; exactly 0 where masked
    dq_blk = jnp.einsum(
        "bhgqk,bkhd->bqhgd", ds.astype(k_blk.dtype), k_blk, preferred_element_type=jnp.float32
    )
    dk_blk = jnp.einsum(
        "bhgqk,bqhgd->bkhd", ds.astype(q_blk.dtype), q_blk, preferred_element_type=jnp.float32
    )
    return dq_blk, dk_blk, dv_blk, ds


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


def _backward(
    cfg: _Config,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    bias: Array | None,
    key_padding: Array | None,
    segments: tuple[Array, Array] | None,
    out: Array,
    lse: Array,
    d_out: Array,
) -> tuple[Array, Array, Array, Array | None]:
    """Gradients of the blocked attention: a scan over key blocks, each a loop over the query
    blocks that see it; dK and dV of a key block are finished inside its step, dQ and dBias
    accumulate across steps.

    q/out/d_out `[b, Qp, kvh, g, d]`, k/v `[b, Kp, kvh, d]`, lse as ``_forward`` returns it
    -> dq `[b, Qp, kvh, g, d]`, dk/dv `[b, Kp, kvh, d]` (float32), dbias in the bias's blocked
    shape (float32; None without a bias).
    """
    b, _, kvh, g, d = q.shape
    delta = _softmax_row_term(cfg, d_out, out)

    def k_step(carry, j):
        k_blk = lax.dynamic_slice_in_dim(k, j * cfg.k_block, cfg.k_block, axis=1)
        v_blk = lax.dynamic_slice_in_dim(v, j * cfg.k_block, cfg.k_block, axis=1)

        def q_step(i, inner):
            dk, dv, dq_acc, dbias_acc = inner
            start = i * cfg.q_block
            q_blk = lax.dynamic_slice_in_dim(q, start, cfg.q_block, axis=1)
            do_blk = lax.dynamic_slice_in_dim(d_out, start, cfg.q_block, axis=1)
            s = _block_logits(cfg, q_blk, k_blk, mask, bias, key_padding, segments, i, j)
            p = jnp.exp(s - lse[i][..., None])  # recomputed probabilities [b, kvh, g, qb, kb]
            dq_blk, dk_blk, dv_blk, ds = _block_gradients(p, delta[i], q_blk, k_blk, v_blk, do_blk)
            dq_old = lax.dynamic_slice_in_dim(dq_acc, start, cfg.q_block, axis=1)
            dq_acc = lax.dynamic_update_slice_in_dim(dq_acc, dq_old + dq_blk, start, axis=1)
            if dbias_acc is not None:
                dbias_acc = _accumulate_bias_grad(cfg, dbias_acc, ds, i, j)
            return dk + dk_blk, dv + dv_blk, dq_acc, dbias_acc

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
    # [nk, b, k_block, kvh, d] -> [b, nk * k_block, kvh, d]
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(k.shape)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(v.shape)
    return dq_acc, dk, dv, dbias_acc


# ----------------------------------------------------------------------------- custom VJP


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
    dq, dk, dv, dbias = _backward(cfg, q, k, v, mask, bias, key_padding, segments, out, lse, d_out)
    # q was pre-scaled by 1/sqrt(d) outside; logits = q_scaled . k, so dq_scaled = dS k (the
    # chain rule through the scaling is JAX's, in the wrapper) and dk = dS^T q_scaled.
    dbias = None if bias is None else dbias.astype(bias.dtype)
    # Boolean mask, key_padding and segment ids get no cotangent (None = zero).
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


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
    scale: float | None = None,
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
      scale: the factor on ``q k^T`` instead of 1/sqrt(head_dim) (T5: 1.0); None: that one.

    Returns:
      `[batch, q_len, heads, head_dim]` in the dtype of ``value``. Query rows with no allowed key
      are exactly zero, with finite (zero) gradients.
    """
    _check_options(
        return_weights=return_weights,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        window=window,
        query_block=query_block,
        key_block=key_block,
    )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    check_shapes(query, key, value)
    batch, q_len, heads, _ = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    if q_len == 0 or kv_len == 0:  # nothing to attend to (or nobody asking): zeros
        return jnp.zeros((batch, q_len, heads, value.shape[-1]), value.dtype)

    cfg = _plan_blocks(
        q_len,
        kv_len,
        query_block=query_block,
        key_block=key_block,
        causal=causal,
        causal_offset=causal_offset,
        window=window,
    )
    mask, bias = _block_mask_and_bias(
        mask, bias, cfg, batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len
    )
    key_padding = _pad_key_padding(key_padding, cfg, batch=batch)
    segments = _pad_segment_ids(query_segment_ids, key_segment_ids, cfg, batch=batch, q_len=q_len)
    q, k, v = _block_qkv(query, key, value, cfg, scale)
    out = _flash(cfg, q, k, v, mask, bias, key_padding, segments)  # [b, Qp, kvh, g, d]
    return out[:, :q_len].reshape(batch, q_len, heads, value.shape[-1])
