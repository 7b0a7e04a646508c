"""Beam search's candidate selection from raw logits, exact, without the log-probabilities.

Beam search scores every one-token extension of every live beam, ``offset[b, j] +
log_softmax(logits[b, j])[v]``, and keeps the best ``k`` of the ``beam * vocab`` per batch
element. Written plainly (:func:`reference_top_k`) that materialises the `[rows, vocab]`
log-probabilities and then the `[batch, beam * vocab]` candidate scores (two full writes and
reads of a 30 MB array at opus-mt size, batch 32, beam 4) before one top-k over the long axis.

:func:`log_softmax_top_k` returns the same values and indices, bitwise, while reading the
logits three times and writing nothing of their size:

1. per row, the max and ``log(sum(exp(x - max)))``, the very expressions of
   ``jax.nn.log_softmax``;
2. per row, the top ``k + 1`` logits (:func:`row_top_k`: the maxima of blocks of about 128
   logits, then ``lax.top_k`` over the ``k + 1`` best blocks only; XLA's CPU ``TopK`` over the
   whole row was the slowest part); the log-softmax is monotone in the logit and so is adding
   the row's offset, so a row's best candidates are among its best logits;
3. only those ``beam * (k + 1)`` candidates get their score, computed with the reference's
   operations in the reference's order (so the same float32 rounding), and a last top-k over
   them (in flat-index order, so ties break as in the reference) picks the ``k``.

Rounding makes the map from logit to score monotone but not strictly: two different logits
can round to one score, and then the reference breaks the tie by index while step 2 ordered
them by logit. The ``(k + 1)``-th logit of each row bounds every score left out of that row;
when the ``k``-th selected score is strictly above every row's bound, nothing left out can
reach or tie it and the result is exact. Otherwise (a near-tie, or fewer than ``k`` finite
candidates) the function falls back to :func:`reference_top_k` under a ``lax.cond``, so the
result is always the reference's.

Shapes: ``logits`` float32 `[batch, beam, vocab]`, ``offsets`` float32 `[batch, beam]` (the
live beams' summed log-probs, ``-inf`` for a slot without a hypothesis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flaxformer_lite.ops.argmax import divisor_near

Array = jax.Array

# Elements per block of row_top_k, about: 9 blocks of 107 per row at beam 4 and vocabulary
# 58,101 (963 elements searched).
BLOCK = 128


def _check(logits: Array, offsets: Array, k: int, banned: Array | None) -> None:
    if logits.ndim != 3:
        raise ValueError(f"logits must be [batch, beam, vocab]; got shape {logits.shape}")
    if offsets.shape != logits.shape[:2]:
        raise ValueError(
            f"offsets must be [batch, beam] = {logits.shape[:2]}; got shape {offsets.shape}"
        )
    if not isinstance(k, int) or not 1 <= k <= logits.shape[1] * logits.shape[2]:
        raise ValueError(f"k must be an int in [1, beam * vocab]; got {k!r}")
    if banned is not None and banned.shape != logits.shape[-1:]:
        raise ValueError(f"banned must be bool [vocab={logits.shape[-1]}]; got {banned.shape}")


def _masked(log_probs: Array, banned: Array | None) -> Array:
    return log_probs if banned is None else jnp.where(banned, -jnp.inf, log_probs)


def reference_top_k(
    logits: Array,
    offsets: Array,
    k: int,
    banned: Array | None = None,
    renormalize: bool = False,
) -> tuple[Array, Array]:
    """The plain selection: ``lax.top_k`` of ``offsets + log_softmax(logits)`` (``banned``
    ids, bool `[vocab]`, set to ``-inf`` after the log-softmax; with ``renormalize`` a second
    log-softmax after that) over the flat ``beam * vocab``.

    Returns:
      ``(values, flat_index)``: float32 `[batch, k]`, best first, and int32 `[batch, k]`,
      ``beam_index * vocab + token``.
    """
    _check(logits, offsets, k, banned)
    batch, beam, vocab = logits.shape
    log_probs = _masked(jax.nn.log_softmax(logits, axis=-1), banned)
    if renormalize:
        log_probs = jax.nn.log_softmax(log_probs, axis=-1)
    candidates = (offsets[:, :, None] + log_probs).reshape(batch, beam * vocab)
    values, flat_index = lax.top_k(candidates, k)
    return values, flat_index


def log_softmax_top_k(
    logits: Array,
    offsets: Array,
    k: int,
    banned: Array | None = None,
    renormalize: bool = False,
) -> tuple[Array, Array]:
    """:func:`reference_top_k`'s result, bitwise, without materialising the log-probs (see
    the module docstring).

    Args:
      logits: float32 `[batch, beam, vocab]`.
      offsets: float32 `[batch, beam]` added to each beam's log-probs.
      k: how many candidates per batch element, in ``[1, beam * vocab]``.
      banned: optional bool `[vocab]`, ids whose log-prob is ``-inf``.
      renormalize: a second log-softmax after the banned ids' ``-inf`` (Hugging Face's
        ``renormalize_logits``): one more pass over the row, still nothing written.

    Returns:
      ``(values, flat_index)``: float32 `[batch, k]`, best first, and int32 `[batch, k]`.
    """
    _check(logits, offsets, k, banned)
    batch, beam, vocab = logits.shape
    per_row = k + 1  # one more than needed: its score bounds every score left out
    if per_row >= vocab:  # a row is not longer than its selection: nothing to save
        return reference_top_k(logits, offsets, k, banned, renormalize)
    # One materialised copy of the logits for every reader below: without the barrier XLA
    # recomputes the producer (the model's bias add) once per reader, a full pass each.
    logits = lax.optimization_barrier(logits)
    best_logits, best_tokens = row_top_k(_masked(logits, banned), per_row)  # [b, beam, k+1]
    # jax.nn.log_softmax's expressions: log_softmax(x) = (x - max) - log(sum(exp(x - max))).
    # Without banned ids the row's max is the best logit (a reduction of the selected values,
    # no pass over the row; slicing it off lax.top_k's values instead would make XLA's CPU
    # backend lower that top-k as a full sort).
    if banned is None:
        row_max = jnp.max(best_logits, axis=-1, keepdims=True)
    else:
        row_max = jnp.max(logits, axis=-1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
    # Scores as the reference rounds them: offset + ((x - max) - log_sum).
    log_probs = _masked((best_logits - row_max) - log_sum, _banned_at(banned, best_tokens))
    if renormalize:  # the same expressions again, over the masked log-probs of the whole row
        max_2 = jnp.max(log_probs, axis=-1, keepdims=True)  # the best unbanned one is selected
        row_log_probs = _masked((logits - row_max) - log_sum, banned)
        log_sum_2 = jnp.log(jnp.sum(jnp.exp(row_log_probs - max_2), axis=-1, keepdims=True))
        log_probs = (log_probs - max_2) - log_sum_2
    scores = offsets[:, :, None] + log_probs
    # Flat-index order within each row (lax.top_k returned logit order), so that the last
    # top-k breaks ties by flat index as the reference does.
    best_tokens, scores = lax.sort((best_tokens, scores), dimension=-1, num_keys=1)
    flat_index = jnp.arange(beam, dtype=jnp.int32)[None, :, None] * vocab + best_tokens
    values, position = lax.top_k(scores.reshape(batch, beam * per_row), k)
    chosen = jnp.take_along_axis(flat_index.reshape(batch, beam * per_row), position, axis=1)
    # Every left-out score of a row is <= that row's lowest selected score (the score of its
    # (k+1)-th logit); exact when the k-th value beats every such bound strictly.
    bound = jnp.max(jnp.min(scores, axis=-1), axis=-1)  # [batch]
    exact = jnp.all(values[:, -1] > bound)
    return lax.cond(
        exact,
        lambda: (values, chosen),
        lambda: reference_top_k(logits, offsets, k, banned, renormalize),
    )


def row_top_k(x: Array, k: int, block: int = BLOCK) -> tuple[Array, Array]:
    """``lax.top_k(x, k)`` over the last axis (values and indices, ties to the lower index),
    reading ``x`` once in full: the top ``k`` elements lie in the ``k`` blocks of ``block``
    consecutive elements with the largest maxima (ties to the lower block), so only those are
    searched.

    Why the blocks suffice: take a top-``k`` element ``e`` in block ``B``. Every block ranked
    above ``B`` has a maximum ``>= max(B) >= e`` (equal only from a lower block, whose first
    maximum then also precedes ``e``), so if ``k`` blocks ranked above ``B``, ``k`` elements
    would rank above ``e``. XLA's CPU ``TopK`` runs one row at a time on one thread; the block
    maxima are one vectorised reduction, the rest is ``k * block`` elements per row.

    Args:
      x: float `[..., n]`.
      k: static, ``1 <= k <= n``.
      block: static block length.

    Returns:
      ``(values, indices)``: like ``x`` `[..., k]` and int32 `[..., k]`, best first.
    """
    n = x.shape[-1]
    block = divisor_near(n, block)
    whole = n // block
    if whole <= k:  # no fewer elements to search than the plain top-k
        return lax.top_k(x, k)
    lead = x.shape[:-1]
    if whole * block == n:
        maxima = jnp.max(x.reshape(*lead, whole, block), axis=-1)
    else:  # a short last block; XLA copies the sliced row before reducing it
        head = x[..., : whole * block].reshape(*lead, whole, block)
        tail = jnp.max(x[..., whole * block :], -1, keepdims=True)
        maxima = jnp.concatenate([jnp.max(head, axis=-1), tail], -1)
    _, blocks = lax.top_k(maxima, k)
    # In index order, so that positions in the gathered row order as indices do (ties).
    blocks = jnp.sort(blocks, axis=-1)
    index = (blocks[..., :, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(
        *lead, k * block
    )
    inside = index < n  # the short last block's missing tail
    gathered = jnp.take_along_axis(x, jnp.minimum(index, n - 1), axis=-1)
    # -inf at the highest positions: never chosen over a real element (k * block - missing >= k).
    gathered = jnp.where(inside, gathered, -jnp.inf)
    values, position = lax.top_k(gathered, k)
    return values, jnp.take_along_axis(index, position, axis=-1)


def _banned_at(banned: Array | None, tokens: Array) -> Array | None:
    """bool like ``tokens``: whether each token is banned (None without banned ids)."""
    return None if banned is None else banned[tokens]
