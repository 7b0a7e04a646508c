"""Beam search over a key/value cache that never moves: pure functions for the attention layers.

Beam search keeps ``beam`` hypotheses per source in rows ``b * beam + i`` of the decoder. After
each step the surviving hypotheses descend from arbitrary parents, so the classic
implementation reorders every cache row by parent (``decoding.beam_search`` without a
``reorder_cache``): at opus-mt size and batch 32, 6 layers x keys and values x 128 rows x 128
positions every step, as costly as the model call itself.

Here the keys and values stay in the row that wrote them. Each row tracks where its history
lives instead: ``ancestors`` int32 `[batch * beam, slots]`, row ``b * beam + i``'s key at cache
slot ``t`` lives in row ``b * beam + ancestors[b * beam + i, t]`` (a beam index of the same
source). A step writes its key at slot ``t`` of its own row and sets ``ancestors[., t]`` to its
own beam index; after the step only ``ancestors`` is gathered by parent (``reorder``), a
`[rows, slots]` int array.

Attention of a decoding step then groups the beams of one source: the queries of beam ``i``
attend over the keys of every beam ``j`` of the source on one joint axis `[beam * slots]`,
masked to ``ancestors[(b, i), t] == j``. Exactly one ``j`` survives per slot, so the softmax
over the joint axis is attention over the row's own history; each cache entry is read once per
step (as greedy does) at the price of ``beam`` times the attention FLOPs, small next to the
projections. It is a reshape and a mask around ``attention.dot_product_attention``.

Shapes: ``rows = batch * beam``; queries `[rows, q_len, heads, head_dim]`, keys and values
`[rows, slots, kv_heads, head_dim]`, masks and biases broadcastable to
`[rows, heads, q_len, slots]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.kv_cache import heads_first

Array = jax.Array


def _check_rows(rows, beam: int, name: str) -> None:
    if not jax.export.is_symbolic_dim(rows) and rows % beam:
        raise ValueError(f"{name} has {rows} rows, not a multiple of beam_size={beam}")


def own_beam(rows, beam: int) -> Array:
    """int32 `[rows]`: each row's beam index within its source (``row % beam``)."""
    return jnp.arange(rows, dtype=jnp.int32) % beam


def reorder(ancestors: Array, parents: Array) -> Array:
    """``ancestors`` `[rows, slots]` of the surviving hypotheses: row ``r`` takes the history of
    row ``parents[r]`` (int `[rows]`, a row of the same source). Keys and values stay put."""
    return jnp.take(ancestors, parents, axis=0)


def group_queries(x: Array, beam: int) -> Array:
    """`[batch * beam, len, ...]` -> `[batch, beam * len, ...]`: the queries of one source's
    beams on one axis (beam-major), e.g. against one shared cross-attention cache."""
    rows, length = x.shape[:2]
    _check_rows(rows, beam, "the queries")
    return x.reshape((rows // beam, beam * length) + x.shape[2:])


def ungroup_queries(x: Array, beam: int) -> Array:
    """Inverse of :func:`group_queries`: `[batch, beam * len, ...]` -> `[rows, len, ...]`."""
    batch, joint = x.shape[:2]
    return x.reshape((batch * beam, joint // beam) + x.shape[2:])


def group_keys(x: Array, beam: int) -> Array:
    """Keys or values `[batch * beam, slots, ...]` -> `[batch, beam * slots, ...]` (beam ``j``'s
    slot ``t`` at ``j * slots + t``): a reshape, nothing moves."""
    return group_queries(x, beam)


def _grouped_4d(x: Array, rows, beam: int, q_len: int, slots: int) -> Array:
    """A mask or bias broadcastable to `[rows, heads, q_len, slots]` as
    `[batch|1, heads|1, beam|1, q_len, 1, slots]` (query beam on axis 2, key beam on 4)."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, (x.shape[0], x.shape[1], q_len, slots))
    if x.shape[0] == 1:
        return x[:, :, None, :, None, :]
    x = x.reshape((rows // beam, beam) + x.shape[1:])  # [batch, beam, h, q, slots]
    return jnp.swapaxes(x, 1, 2)[:, :, :, :, None, :]


def history_mask(ancestors: Array, beam: int, q_len: int, mask: Array | None = None) -> Array:
    """bool `[batch, heads|1, beam * q_len, beam * slots]`: the joint mask of grouped attention.

    Query ``(i, q)`` of source ``b`` may attend key ``(j, t)`` iff ``ancestors[b * beam + i, t]
    == j`` and ``mask`` (broadcastable to `[rows, heads, q_len, slots]`, e.g. the causal mask
    over the cache; None: everything) allows ``(q, t)`` for row ``b * beam + i``.
    """
    rows, slots = ancestors.shape
    _check_rows(rows, beam, "ancestors")
    held = ancestors.reshape(rows // beam, 1, beam, 1, 1, slots)  # [b, h, i, q, j, t]
    joint = held == jnp.arange(beam, dtype=ancestors.dtype).reshape(1, 1, 1, 1, beam, 1)
    if mask is not None:
        joint = joint & _grouped_4d(mask, rows, beam, q_len, slots)
    joint = jnp.broadcast_to(joint, joint.shape[:2] + (beam, q_len, beam, slots))
    return joint.reshape(joint.shape[:2] + (beam * q_len, beam * slots))


def group_bias(bias: Array, rows, beam: int, q_len: int, slots: int) -> Array:
    """A bias broadcastable to `[rows, heads, q_len, slots]` (e.g. the relative position bias)
    as `[batch|1, heads, beam * q_len, beam * slots]`, the same for every key beam."""
    x = _grouped_4d(bias, rows, beam, q_len, slots)
    x = jnp.broadcast_to(x, x.shape[:2] + (beam, q_len, beam, slots))
    return x.reshape(x.shape[:2] + (beam * q_len, beam * slots))


def _beam_major(x: Array, kv_heads: int, beam: int, slots: int) -> Array:
    """A grouped mask or bias `[batch|1, heads|1, beam * q_len, beam * slots]` as
    `[batch|1, beam, kv_heads|1, groups|1, beam * q_len, slots]` (the key beam second)."""
    lead, heads, joint_q = x.shape[0], x.shape[1], x.shape[2]
    if heads == 1:
        x = x.reshape(lead, 1, 1, joint_q, beam, slots)
    else:
        x = x.reshape(lead, kv_heads, heads // kv_heads, joint_q, beam, slots)
    return jnp.moveaxis(x, 4, 1)


def attend_beams(
    query: Array,
    key: Array,
    value: Array,
    mask: Array,
    bias: Array | None,
    beam: int,
    scale: float | None = None,
) -> Array:
    """Grouped attention of a beam step without moving the cache: equals
    ``dot_product_attention(query, group_keys(key, beam), group_keys(value, beam), mask, bias)``
    (the reference path, no dropout), computed per cache row.

    ``group_keys`` would put every source's ``beam * slots`` keys on one axis, which XLA
    materialises as a copy of the whole cache per layer and step. Here nothing of the cache
    moves: each cache row (a key beam ``j`` of source ``b``) meets the queries of every beam
    of its source (copied per row; they are few), both dots batch over (row, kv_head), the
    order the cache is stored in (``kv_cache.heads_first``), and their outputs come in
    ``dot_general``'s own order (batch, lhs free, rhs free): any other order, or the rows
    split into (batch, beam) as dot batch dimensions, had XLA's CPU backend copy each
    layer's keys and values every step (bench/beam_attention_layouts.py). The logits dot
    takes the keys as its left operand, so a row's slots are the product's rows and its few
    queries the columns (logits `[row, kv_head, slot, group, query]`): 1.03-1.12x the whole
    float32 beam search at batch 32 of the transposed product on an Intel Xeon (the bench's
    ``queries_first``). The softmax runs over a source's joint ``(j, slot)`` keys, the values
    dot reads the weights in that order, and the per-row outputs are summed over ``j``.

    query `[batch, beam * q_len, heads, head_dim]` (``group_queries``); key, value
    `[batch * beam, slots, kv_heads, head_dim]`; mask bool `[batch, heads|1, beam * q_len,
    beam * slots]` (``history_mask``); bias None or `[batch|1, heads, beam * q_len, beam *
    slots]` (``group_bias``). ``scale``: the factor on ``q . k`` (None: 1/sqrt(head_dim)).
    Returns `[batch, beam * q_len, heads, head_dim]`.
    """
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    _check_rows(rows, beam, "keys")
    groups = heads // kv_heads
    scale = jnp.asarray(head_dim**-0.5 if scale is None else scale, query.dtype)
    q = (query * scale).reshape(batch, 1, joint_q, kv_heads, groups, head_dim)
    q = jnp.broadcast_to(q, (batch, beam, joint_q, kv_heads, groups, head_dim))
    q = jnp.transpose(q.reshape(rows, joint_q, kv_heads, groups, head_dim), (0, 2, 3, 1, 4))
    k, v = heads_first(key), heads_first(value)  # [rows, kv_heads, slots, head_dim]: as stored
    logits = jnp.einsum("rhkd,rhgqd->rhkgq", k, q, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, beam, kv_heads, slots, groups, joint_q)

    def keys_first(x):  # [b|1, heads|1, beam * q, beam * slots] -> [b|1, j, kv|1, k, g|1, q]
        return jnp.moveaxis(_beam_major(x, kv_heads, beam, slots), 5, 3)

    if bias is not None:
        logits = logits + keys_first(bias).astype(jnp.float32)
    allowed = keys_first(mask)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=(1, 3))
    # A query with nothing allowed gets zeros, as dot_product_attention gives it.
    weights = jnp.where(allowed, weights, 0.0).astype(value.dtype)
    weights = weights.reshape(rows, kv_heads, slots, groups, joint_q)
    out = jnp.einsum("rhkgq,rhkd->rhgqd", weights, v)
    out = out.reshape(batch, beam, kv_heads, groups, joint_q, head_dim).sum(axis=1)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, joint_q, heads, head_dim)
