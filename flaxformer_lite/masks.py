"""Attention masks as pure functions: boolean, True where a query may attend to a key.

Every mask broadcasts to `[batch, heads, q_len, kv_len]` and combines with ``combine_masks``
(logical and). Booleans, not additive float biases: they cost a quarter of the memory and the
attention function turns them into the dtype's most negative finite logit in one place.

A packed decoder example: two sequences packed in one row,
``segment_ids = [1, 1, 1, 2, 2, 0]`` (0 = padding). Combining
``causal_mask(6)`` with ``segment_mask(segment_ids, segment_ids)`` gives, for that row::

    q\\k  0 1 2 3 4 5
    0    1 0 0 0 0 0
    1    1 1 0 0 0 0
    2    1 1 1 0 0 0
    3    0 0 0 1 0 0
    4    0 0 0 1 1 0
    5    0 0 0 0 0 0      <- padding attends to nothing (its output is zero)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def padding_mask(query_tokens: Array, key_tokens: Array, pad_id: int = 0) -> Array:
    """Both the query and the key position hold a real token.

    Args:
      query_tokens: int `[batch, q_len]`.
      key_tokens: int `[batch, kv_len]`.
      pad_id: the padding id.

    Returns:
      bool `[batch, 1, q_len, kv_len]`.
    """
    q = jnp.asarray(query_tokens) != pad_id
    k = jnp.asarray(key_tokens) != pad_id
    return (q[:, None, :, None] & k[:, None, None, :]).astype(jnp.bool_)


def causal_mask(length: int) -> Array:
    """Query position i sees key positions j <= i. Returns bool `[1, 1, length, length]`."""
    idx = jnp.arange(length)
    return (idx[:, None] >= idx[None, :])[None, None]


def segment_mask(query_segment_ids: Array, key_segment_ids: Array) -> Array:
    """Packed sequences: attend only within the same segment; segment 0 is padding.

    Args:
      query_segment_ids: int `[batch, q_len]`, 1..n per packed example, 0 on padding.
      key_segment_ids: int `[batch, kv_len]`.

    Returns:
      bool `[batch, 1, q_len, kv_len]`.
    """
    q = jnp.asarray(query_segment_ids)
    k = jnp.asarray(key_segment_ids)
    same = q[:, None, :, None] == k[:, None, None, :]
    return same & (q[:, None, :, None] != 0)


def local_mask(length: int, window: int) -> Array:
    """Restricted self-attention: position i sees the positions j with |i - j| <= window.

    This is the paper's "self-attention (restricted)" of neighbourhood size r (its Table 1),
    which brings the cost per layer from O(n^2 d) to O(r n d). Combine with ``causal_mask``
    for a decoder. Returns bool `[1, 1, length, length]`.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0; got {window}")
    idx = jnp.arange(length)
    return (jnp.abs(idx[:, None] - idx[None, :]) <= window)[None, None]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical and of broadcastable boolean masks; None entries are ignored.

    Returns None when every entry is None (attend everywhere).
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for m in present:
        if m.dtype != jnp.bool_:
            raise ValueError(f"masks must be boolean; got dtype {m.dtype}")
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out
