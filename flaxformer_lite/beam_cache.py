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
