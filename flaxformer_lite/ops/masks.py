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

The models do not build these `[batch, 1, n, n]` matrices themselves: they describe the mask as an
``AttentionMask`` (causal flag, local window, query/key validity, segment ids: all O(length)), and
each attention implementation takes what it can use -- the reference path materialises
``AttentionMask.dense``, blockwise attention builds each block's mask from indices and skips future
key blocks and those outside the window, cuDNN gets ``is_causal``, a sliding window and sequence
lengths.
"""

from __future__ import annotations

import dataclasses

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
    """Restricted self-attention: position i sees the positions j with ``|i - j| <= window``.

    This is the paper's "self-attention (restricted)" of neighbourhood size r (its Table 1),
    which brings the cost per layer from O(n^2 d) to O(r n d). ``window`` is r *on each side*:
    a query sees up to 2r + 1 keys (itself, r before, r after); combined with ``causal_mask``
    (a decoder's sliding window) it sees itself and the r before it. The same convention as
    ``AttentionMask.window`` and ``TransformerConfig.attention_window``.
    Returns bool `[1, 1, length, length]`.
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


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """A mask as structure instead of a `[batch, heads, q_len, kv_len]` matrix.

    Query i may attend to key j iff every present part allows it::

      causal             j <= i (static; the diagonal of ``causal_mask``)
      query_valid        bool `[batch, q_len]`: False rows attend to nothing (output zero)
      key_valid          bool `[batch, kv_len]`: False keys are never attended to
      query_segment_ids  int `[batch, q_len]` and key_segment_ids int `[batch, kv_len]`
                         (given together): same segment, and the query's segment is not 0
      window             |i - j| <= window (static int, r keys on each side; ``local_mask``);
                         with ``causal`` a sliding window: i - window <= j <= i

    ``dense(q_len, kv_len)`` gives exactly what ``combine_masks`` of ``padding_mask``,
    ``causal_mask``, ``segment_mask`` and ``local_mask`` would. A pytree (``causal`` and
    ``window`` are static metadata), so it passes through ``jit``, ``nn.scan`` and ``nn.remat``
    like an array.
    """

    query_valid: Array | None = None
    key_valid: Array | None = None
    query_segment_ids: Array | None = None
    key_segment_ids: Array | None = None
    causal: bool = False
    window: int | None = None

    def check(self) -> None:
        """Fails on parts that cannot describe a mask (called by the attention functions, not
        at construction: pytree transformations rebuild the object with placeholder leaves)."""
        if (self.query_segment_ids is None) != (self.key_segment_ids is None):
            raise ValueError(
                "AttentionMask needs both query_segment_ids and key_segment_ids, or neither"
            )
        for name in ("query_valid", "key_valid", "query_segment_ids", "key_segment_ids"):
            value = getattr(self, name)
            if value is not None and jnp.ndim(value) != 2:
                raise ValueError(
                    f"AttentionMask.{name} must be [batch, length]; got shape {jnp.shape(value)}"
                )
        for name in ("query_valid", "key_valid"):
            value = getattr(self, name)
            if value is not None and jnp.asarray(value).dtype != jnp.bool_:
                raise ValueError(f"AttentionMask.{name} must be boolean; got {value.dtype}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 0):
            raise ValueError(f"AttentionMask.window must be None or an int >= 0; got {self.window}")

    def dense(self, q_len: int, kv_len: int) -> Array | None:
        """bool, broadcastable to `[batch, 1, q_len, kv_len]`; None when nothing is masked."""
        parts = []
        if self.causal:
            parts.append((jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :])[None, None])
        if self.query_valid is not None:
            parts.append(jnp.asarray(self.query_valid)[:, None, :, None])
        if self.key_valid is not None:
            parts.append(jnp.asarray(self.key_valid)[:, None, None, :])
        if self.query_segment_ids is not None:
            parts.append(segment_mask(self.query_segment_ids, self.key_segment_ids))
        if self.window is not None:
            distance = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
            parts.append((jnp.abs(distance) <= self.window)[None, None])
        return combine_masks(*parts)


jax.tree_util.register_dataclass(
    AttentionMask,
    data_fields=["query_valid", "key_valid", "query_segment_ids", "key_segment_ids"],
    meta_fields=["causal", "window"],
)
