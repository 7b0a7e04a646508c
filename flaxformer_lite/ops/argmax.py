"""``jnp.argmax`` over the last axis, bitwise, from block maxima.

XLA's CPU backend lowers ``jnp.argmax`` to a reduction of (value, index) pairs that it runs
unvectorised: over a `[32, 58101]` row of logits (greedy decoding at batch 32, an opus-mt
vocabulary) it took more time than the int8 output projection that made the logits, and with
jaxlib 0.10 the max-then-first-index form (a max, then a min over the indices that hold it) is
slower than ``jnp.argmax`` itself at `[128, 58101]` and `[2048, 8000]` (``bench/argmax.py``). A
plain max reduction is vectorised; :func:`row_argmax` does one over blocks of the row, then
``jnp.argmax`` over the block maxima and over the one block that holds the winner, both short.

Why it is exact: ``jnp.argmax`` returns the first index holding the maximum, a NaN counting
as the maximum. A block's maximum is taken as NaN when the block holds one (XLA's CPU max
reduction itself skips NaN), so the first block whose maximum ``jnp.argmax`` ranks first is
the block of the row's first maximum (or first NaN), and ``jnp.argmax`` within it finds that
element. NaN is detected by the block's sum, which is also NaN for a block holding +inf and
-inf: when such a block wins, the row's plain ``jnp.argmax`` is taken instead (``lax.cond``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

BLOCK = 512


def divisor_near(n: int, block: int) -> int:
    """A divisor of ``n`` within a factor 2 of ``block``, the closest (58,101 = 3 x 107 x 181:
    543 for 512, 107 for 128), so that the row splits into blocks without a copy; ``block``
    itself if none."""
    divisors = [d for d in range(max(1, block // 2), 2 * block + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - block), d)) if divisors else block


def _block_max(blocks: Array) -> tuple[Array, Array]:
    """`[..., blocks, block]` -> (maxima, flagged), both `[..., blocks]`: each block's maximum,
    NaN where the block's sum is NaN (``flagged``): where it holds a NaN, and also where it
    holds both +inf and -inf. XLA's CPU max reduction skips NaN, ``jnp.argmax`` ranks it
    first; a sum is one more vectorised pass, where ``isnan(...).any()`` had XLA write a
    boolean of the row's size first."""
    flagged = jnp.isnan(jnp.sum(blocks, axis=-1))
    return jnp.where(flagged, jnp.nan, jnp.max(blocks, axis=-1)), flagged


def row_argmax(x: Array, block: int = BLOCK) -> Array:
    """``jnp.argmax(x, axis=-1)``, bitwise (ties and NaN included), as int32.

    Args:
      x: float `[..., n]`.
      block: static block length (a divisor of ``n`` near it is used where there is one).

    Returns:
      int32 `[...]`: per row, the first index of the maximum (of the first NaN, if any).
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"row_argmax: x must be a float array; got {x.dtype}")
    n = x.shape[-1]
    block = divisor_near(n, block)
    whole = n // block
    if whole < 2:  # one block: nothing to skip
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    lead = x.shape[:-1]
    if whole * block == n:
        maxima, flagged = _block_max(x.reshape(*lead, whole, block))
    else:  # a short last block
        head, head_flagged = _block_max(x[..., : whole * block].reshape(*lead, whole, block))
        tail, tail_flagged = _block_max(x[..., None, whole * block :])
        maxima = jnp.concatenate([head, tail], -1)
        flagged = jnp.concatenate([head_flagged, tail_flagged], -1)
    winner = jnp.argmax(maxima, axis=-1).astype(jnp.int32)  # [...]: the first block at the max
    index = winner[..., None] * block + jnp.arange(block, dtype=jnp.int32)  # [..., block]
    inside = index < n  # the short last block's missing tail
    gathered = jnp.take_along_axis(x, jnp.minimum(index, n - 1), axis=-1)
    # -inf past the row's end: after every real element, so never chosen over one (ties go to
    # the lower index, and the block's real elements come first).
    gathered = jnp.where(inside, gathered, -jnp.inf)
    found = winner * block + jnp.argmax(gathered, axis=-1).astype(jnp.int32)
    # A flagged block ranks first, so the winner is the row's first flagged block if any: exact
    # when that block holds a NaN (the row's first NaN is in it), wrong only when it was
    # flagged for holding +inf and -inf alone. Then (rare: +inf logits) the plain argmax.
    false_flag = jnp.take_along_axis(flagged, winner[..., None], axis=-1)[..., 0] & ~jnp.any(
        jnp.isnan(gathered), axis=-1
    )
    return lax.cond(
        jnp.any(false_flag),
        lambda: jnp.argmax(x, axis=-1).astype(jnp.int32),
        lambda: found,
    )
