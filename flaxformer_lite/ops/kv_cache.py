"""The key/value cache of cached decoding: pure functions for the attention layer's cache.

A self-attention layer that decodes (``nn.attention.MultiHeadAttention`` with ``decode=True``)
keeps the keys and values of every position it has seen, heads first (``heads_first``):
`[batch, kv_heads, slots, head_dim]`. Each decoding call brings the keys and values of ``q_len``
new positions `[batch, q_len, kv_heads, head_dim]` at consecutive absolute positions
``positions`` int `[q_len]` (the same in every row). Two layouts:

* the full cache (``slots = max_len``): position p lives in slot p. ``write_cache`` writes the
  new positions in place (``check_cache_room`` first: a write past the end raises), and
  ``cache_mask`` says which slots each new query sees (causal, and within ``window`` when one
  is set but the cache is shorter than it). A step reads only the prefix of the cache that
  holds the slots written so far (``over_written_prefix``: 32, 64, ... slots, or all of them):
  a cache sized for 511 tokens costs a 30-token sentence what a cache of 32 does.
* the ring buffer (``slots = window``, restricted self-attention): position p lives in slot
  p % window, the newest one of its residue class. ``ring_update`` gives what a step attends
  over, the ring as it was followed by the new keys (their positions: ``ring_key_positions``),
  and the ring after writing the new keys over the oldest slots; ``ring_mask`` is the causal
  window over the keys attended. Decoding may then go on past ``max_len``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def heads_first(x: Array) -> Array:
    """`[batch, length, heads, head_dim]` <-> `[batch, heads, length, head_dim]` (its own inverse).

    Decoding caches are stored heads first: attention's two dots batch over (batch, heads), and
    XLA's CPU dots want the batch dimensions leading, so a cache stored `[batch, length, heads,
    head_dim]` was copied whole into that order by every layer at every step (about 30% of a
    greedy step at opus-mt size, bench/README.md). Read back through this transpose, the
    stored order is the one the dots use and XLA folds the two transposes away.
    """
    return jnp.swapaxes(x, 1, 2)


# ----------------------------------------------------------------------------- the full cache


def write_cache(cache: Array, new: Array, index: Array) -> Array:
    """The cache `[batch, kv_heads, max_len, head_dim]` (heads first) with ``new`` `[batch,
    q_len, kv_heads, head_dim]` written at slots ``index .. index + q_len - 1``, in the cache's
    dtype. ``dynamic_update_slice`` clamps a write past the end: check it first
    (``check_cache_room``)."""
    zero = jnp.array(0, jnp.int32)
    start = (zero, zero, index, zero)
    return jax.lax.dynamic_update_slice(cache, heads_first(new).astype(cache.dtype), start)


def cache_mask(positions: Array, max_len: int, window: int | None = None) -> Array:
    """bool `[q_len, max_len]`: which slots of the full cache each new query sees.

    ``positions`` int `[q_len]`, the new queries' absolute positions: query i sees the cached
    positions <= positions[i] (causal) and, with a ``window``, >= positions[i] - window (a
    cache shorter than the window: nothing falls out yet, but a long prompt may).
    """
    distance = positions[:, None] - jnp.arange(max_len)[None, :]  # [q_len, max_len]
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance <= window)
    return allowed


def _raise_cache_full(index: Any, *, q_len: int, max_len: int) -> None:
    raise ValueError(
        f"decode=True writes {q_len} new position(s) from position {int(index)} into a key/value "
        f"cache of max_len={max_len} (positions 0..{max_len - 1}): the cache is full. Allocate "
        "a longer cache (init with longer decoder inputs, up to TransformerConfig.max_len) or "
        "stop decoding earlier."
    )


def check_cache_room(index: Array, q_len: int, max_len: int, *, runtime: bool = True) -> None:
    """Raises ValueError unless positions ``index .. index + q_len - 1`` fit in a cache of
    ``max_len`` slots (``dynamic_update_slice`` would otherwise clamp the write onto the last
    slots and decoding would go on with corrupted keys).

    ``q_len`` and ``max_len`` are static: ``q_len > max_len`` raises while tracing. A concrete
    ``index`` (eager ``apply``) is checked in Python. A traced one (under ``jit``) is checked on
    the device, and only where the write would overflow does a ``jax.debug.callback`` raise
    (surfacing as a ``JaxRuntimeError`` carrying this message when the result is used); with
    ``runtime=False`` that check is left out (the caller guarantees the room statically: a
    ``lax.cond`` per layer and step costs a host synchronisation on GPUs).
    """
    if q_len > max_len:
        _raise_cache_full(0, q_len=q_len, max_len=max_len)
    try:
        concrete = int(index)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        concrete = None
    if concrete is not None:
        if concrete + q_len > max_len:
            _raise_cache_full(concrete, q_len=q_len, max_len=max_len)
        return
    if runtime:
        raise_full = functools.partial(_raise_cache_full, q_len=q_len, max_len=max_len)
        jax.lax.cond(
            index + q_len > max_len,
            lambda: jax.debug.callback(raise_full, index),
            lambda: None,
        )


# ----------------------------------------------------------------------------- the written prefix

# The prefixes a decoding step may attend over instead of the whole cache: 32, 64, ... slots,
# each at most half the cache (XLA copies the prefix out before its dots, so a prefix pays
# only where that copy and the dots cost less than reading every slot; bench/written_prefix.py).
SMALLEST_PREFIX = 32
PREFIX_FRACTION = 2


def prefix_widths(slots: int) -> tuple[int, ...]:
    """The static widths :func:`over_written_prefix` chooses from for a cache of ``slots``:
    ``SMALLEST_PREFIX``, twice that, ... up to ``slots // PREFIX_FRACTION``, then ``slots``
    (alone where ``slots`` is symbolic: ``jax.export`` with a polymorphic length)."""
    if jax.export.is_symbolic_dim(slots):
        return (slots,)
    widths, width = [], SMALLEST_PREFIX
    while width * PREFIX_FRACTION <= slots and width < slots:
        widths.append(width)
        width *= 2
    return (*widths, slots)


def over_written_prefix(
    attend: Any, written: Array | None, slots: int, operands: tuple[tuple[Any, int], ...]
) -> Any:
    """``attend(*operands)`` over the cache's first ``n`` slots only, ``n`` the smallest of
    :func:`prefix_widths` that holds the ``written`` ones (int scalar, traced: slots
    ``0 .. written - 1`` are in use; None: the whole cache).

    A full cache of ``slots`` (e.g. 511 for a Hugging Face folder's ``max_length``) is read
    whole at every step although a sentence uses a few dozen slots: the attention of a step is
    memory-bound on a CPU and costs as much as its width. ``operands``: (array or None, the
    slots axis); an array whose slots axis is not ``slots`` long (a broadcast mask) passes
    whole. ``attend`` must be pure (no Flax state) and mask the slots past ``written``, whose
    results then equal the whole cache's. One ``lax.switch``: each width compiles its own
    branch of ``attend``; a cache under ``SMALLEST_PREFIX * PREFIX_FRACTION`` slots has one,
    ``attend`` itself.
    """
    widths = prefix_widths(slots)
    arrays = tuple(x for x, _ in operands)
    if written is None or len(widths) == 1:
        return attend(*arrays)
    written = jnp.asarray(written)

    def branch(width: int) -> Any:
        def run(*xs: Any) -> Any:
            return attend(
                *(
                    x
                    if x is None or x.shape[axis] != slots
                    else jax.lax.slice_in_dim(x, 0, width, axis=axis)
                    for x, (_, axis) in zip(xs, operands, strict=True)
                )
            )

        return run

    index = sum((written > w).astype(jnp.int32) for w in widths[:-1])
    return jax.lax.switch(index, [branch(w) for w in widths], *arrays)


# ----------------------------------------------------------------------------- the ring buffer


def ring_key_positions(positions: Array, ring: int) -> Array:
    """The positions of the keys a ring-buffer decoding step attends over, int32 `[ring +
    q_len]`: slot s of the ring holds the newest position p < index with p % ring == s (< 0:
    empty), then come the new positions ``positions`` `[q_len]` (index, index + 1, ...)."""
    positions = positions.astype(jnp.int32)
    index = positions[0]
    slots = jnp.arange(ring, dtype=jnp.int32)
    held = (index - 1) - jnp.mod(index - 1 - slots, ring)
    return jnp.concatenate([held, positions])


def ring_mask(positions: Array, ring: int) -> Array:
    """bool `[q_len, ring + q_len]`: the causal window over the keys of ``ring_key_positions``
    (the ring, then the new keys): query i sees the filled slots and new keys at positions
    ``positions[i] - ring .. positions[i]``."""
    positions = positions.astype(jnp.int32)
    key_positions = ring_key_positions(positions, ring)  # [ring + q_len]
    distance = positions[:, None] - key_positions[None, :]
    return (key_positions[None, :] >= 0) & (distance >= 0) & (distance <= ring)


def ring_update(ring_cache: Array, new: Array, positions: Array) -> tuple[Array, Array]:
    """One decoding step's keys (or values) through a ring buffer of ``ring`` slots.

    ring_cache: `[batch, kv_heads, ring, head_dim]` (heads first), slot s holding the newest
    position p < index with p % ring == s. new: `[batch, q_len, kv_heads, head_dim]` at
    ``positions`` int `[q_len]` (index .. index + q_len - 1). Returns (attended `[batch,
    kv_heads, ring + q_len, head_dim]`: the ring as it was, then the new entries, in the
    cache's dtype; the ring after the write `[batch, kv_heads, ring, head_dim]`: each slot
    holds the newest position <= the last new one in its residue class).
    """
    ring = ring_cache.shape[2]
    positions = positions.astype(jnp.int32)
    index, last = positions[0], positions[-1]
    slots = jnp.arange(ring, dtype=jnp.int32)
    attended = jnp.concatenate([ring_cache, heads_first(new).astype(ring_cache.dtype)], axis=2)
    # After the write slot s holds the newest position <= last in its residue class: a new
    # one (at ring + its offset in the concatenation) or the one it held.
    newest = last - jnp.mod(last - slots, ring)
    source = jnp.where(newest >= index, ring + newest - index, slots)  # [ring]
    return attended, jnp.take(attended, source, axis=2)
