"""Beam search over a single model callback, ``tokens_to_logits(tokens, cache) -> (logits,
new_cache)``, as every search of :mod:`flaxformer_lite.decoding.search` (whose module docstring
gives the contract: shapes, PAD after EOS, ``row_max_len``, ``forced_eos``, ``banned_ids``).

:func:`beam_search` is a loop over pure functions of one step, each testable on fixed arrays:
candidate selection (:func:`select_candidates` with :func:`constrained_log_probs`, or
:func:`select_candidates_from_logits`, the same from the raw logits without materialising the
log-probs, which the loop uses; :func:`candidate_sequences`), the finishing rule
(:func:`ended_candidates`, :func:`finished_candidates`, and when the search may stop:
:func:`gnmt_can_improve`, :func:`hf_still_open`) and the state update (:func:`select_live`,
:func:`flat_parents`, :func:`merge_finished`), between :func:`initial_beam_state` and
:func:`final_hypotheses`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from flaxformer_lite.decoding.search import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    PyTree,
    TokensToLogits,
    _banned_mask,
    _check_positive_int,
    _checked_logits,
    _initial_tokens,
    _map_batched,
    _row_limits,
    check_search_options,
    length_penalty,
)
from flaxformer_lite.ops.beam_top_k import log_softmax_top_k

__all__ = ["beam_search"]


def _tile_cache(cache: PyTree, batch_size: int, beam_size: int) -> PyTree:
    """Brings batched cache leaves to the flat ``[batch * beam, ...]`` layout.

    Leaves with leading axis ``batch_size`` are tiled; leaves already at
    ``batch_size * beam_size`` (e.g. tiled by the caller with :func:`expand_to_beams`) are kept.
    For ``beam_size > 1`` the two sizes differ, so the choice is unambiguous; for
    ``beam_size == 1`` both are the same and nothing needs doing.
    """

    def tile(x):
        if x.shape[0] == batch_size * beam_size:
            return x
        if x.shape[0] == batch_size:
            return jnp.repeat(x, beam_size, axis=0)
        raise ValueError(
            f"cache leaf with shape {x.shape}: leading axis must be batch_size={batch_size} "
            f"or batch_size * beam_size={batch_size * beam_size}."
        )

    return _map_batched(tile, cache)


def _gather_rows(cache: PyTree, parents: jax.Array) -> PyTree:
    """The default reordering: every batched cache leaf gathered by ``parents`` (flat rows)."""
    return _map_batched(lambda x: jnp.take(x, parents, axis=0), cache)


def _gather_beams(x: jax.Array, parent: jax.Array) -> jax.Array:
    """``x[b, parent[b, j]]`` for ``x`` ``[batch, beam_in, ...]``, ``parent`` ``[batch, n]``."""
    idx = parent.reshape(parent.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


# The pieces of one beam-search step, pure functions over arrays (beam_search is the loop that
# calls them): candidate selection, the finishing rule, the state update.


# --- Candidate selection ------------------------------------------------------------------


def constrained_log_probs(
    step_log_probs: jax.Array,
    length: jax.Array | int,
    limits: jax.Array,
    *,
    eos_id: int,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    renormalize: bool = False,
    forced_bos_id: int | None = None,
) -> jax.Array:
    """Next-token log-probs as Hugging Face's logits processors leave them for its beam search.

    Banned ids get ``-inf``; with ``forced_bos_id``, at ``length`` 1 every id gets ``-inf`` but
    that one, which costs 0 (``ForcedBOSTokenLogitsProcessor``); with ``forced_eos``, for a
    batch element whose ``length`` reaches its limit, every id gets ``-inf`` but EOS, which
    costs 0. Nothing is renormalised unless ``renormalize`` (Hugging Face's
    ``LogitNormalization``, its last processor: a ``log_softmax`` over the constrained
    values).

    Args:
      step_log_probs: float ``[batch, beam, vocab]`` the model's next-token log-probs.
      length: int (0-d), tokens in a hypothesis once this step's token is appended.
      limits: int ``[batch]`` per-element token limits.
      eos_id, forced_eos, banned_ids, renormalize, forced_bos_id: as in :func:`beam_search`.

    Returns:
      ``[batch, beam, vocab]``, the dtype of ``step_log_probs``.
    """
    vocab = step_log_probs.shape[-1]
    logp = step_log_probs
    banned = _banned_mask(banned_ids, vocab)
    if banned is not None:
        logp = jnp.where(banned, -jnp.inf, logp)
    if forced_bos_id is not None:  # before forced EOS, which wins at a limit of 1 (as in HF)
        only_bos = jnp.where(jnp.arange(vocab) == forced_bos_id, 0.0, -jnp.inf).astype(logp.dtype)
        logp = jnp.where(jnp.asarray(length) == 1, only_bos, logp)
    if forced_eos:
        only_eos = jnp.where(jnp.arange(vocab) == eos_id, 0.0, -jnp.inf).astype(logp.dtype)
        logp = jnp.where((length >= limits)[:, None, None], only_eos, logp)
    if renormalize:
        logp = jax.nn.log_softmax(logp, axis=-1)
    return logp


def select_candidates(
    live_log_probs: jax.Array,
    step_log_probs: jax.Array,
    length: jax.Array | int,
    limits: jax.Array,
    *,
    eos_id: int,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    renormalize: bool = False,
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The best ``2 * beam`` one-token extensions of the live beams, over all ``beam * vocab``.

    Candidate ``(j, v)`` of batch element ``b`` (live beam ``j`` extended by token ``v``) has
    log-prob ``live_log_probs[b, j] + constrained[b, j, v]``, ``constrained`` being
    :func:`constrained_log_probs`. ``2 * beam`` candidates are enough for ``beam`` live ones
    to survive even if ``beam`` of them end with EOS (each live beam has a single EOS
    extension).

    Args:
      live_log_probs: float32 ``[batch, beam]`` summed log-probs of the live beams; ``-inf``
        for a slot without a hypothesis (beams 1.. at the first step).
      step_log_probs: float32 ``[batch, beam, vocab]`` the model's next-token log-probs.
      length: int (0-d), tokens in a candidate (this step's token included).
      limits: int ``[batch]`` per-element token limits.
      eos_id, forced_eos, banned_ids, renormalize, forced_bos_id: as in :func:`beam_search`.

    Returns:
      ``(log_probs, parents, tokens)``, each ``[batch, n]`` with ``n = min(2 * beam, beam *
      vocab)``, best first (``lax.top_k`` order): float32 candidate log-probs (``-inf`` for an
      impossible one), int32 parent beam in ``[0, beam)``, int32 token.

    Raises:
      ValueError: ``forced_eos`` or ``banned_ids`` are not valid (see
        :func:`check_search_options`).
    """
    banned_ids = check_search_options(forced_eos=forced_eos, banned_ids=banned_ids, eos_id=eos_id)
    batch, beam, vocab = step_log_probs.shape
    logp = constrained_log_probs(
        step_log_probs,
        length,
        limits,
        eos_id=eos_id,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        renormalize=renormalize,
        forced_bos_id=forced_bos_id,
    )
    cand = (live_log_probs[:, :, None] + logp).reshape(batch, beam * vocab)
    log_probs, flat_index = lax.top_k(cand, min(2 * beam, beam * vocab))  # sorted
    return log_probs, flat_index // vocab, (flat_index % vocab).astype(jnp.int32)


def select_candidates_from_logits(
    live_log_probs: jax.Array,
    logits: jax.Array,
    length: jax.Array | int,
    limits: jax.Array,
    *,
    eos_id: int,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    renormalize: bool = False,
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`select_candidates` of ``log_softmax(logits)``, bitwise, from the raw logits.

    For float32 logits without ``forced_bos_id`` the log-probs are never materialised
    (:func:`flaxformer_lite.ops.beam_top_k.log_softmax_top_k`: per-row top-k of the logits,
    scores for those alone, an exact fallback on near-ties), except with ``forced_eos`` at a
    step where some element reaches its limit; there and otherwise this is
    ``select_candidates(live_log_probs, log_softmax(logits).astype(float32), ...)``.

    Args:
      live_log_probs: float32 ``[batch, beam]``.
      logits: float ``[batch, beam, vocab]`` the model's next-token logits.
      length, limits, eos_id, forced_eos, banned_ids, renormalize, forced_bos_id: as in
        :func:`select_candidates`.

    Returns:
      ``(log_probs, parents, tokens)`` as :func:`select_candidates`.
    """
    options = dict(
        eos_id=eos_id,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        renormalize=renormalize,
        forced_bos_id=forced_bos_id,
    )

    def plain():
        step_log_probs = jax.nn.log_softmax(logits, axis=-1).astype(jnp.float32)
        return select_candidates(live_log_probs, step_log_probs, length, limits, **options)

    if forced_bos_id is not None or logits.dtype != jnp.float32:
        return plain()
    banned_ids = check_search_options(forced_eos=forced_eos, banned_ids=banned_ids, eos_id=eos_id)
    _, beam, vocab = logits.shape

    def fused():
        banned = _banned_mask(banned_ids, vocab)
        n = min(2 * beam, beam * vocab)
        log_probs, flat_index = log_softmax_top_k(logits, live_log_probs, n, banned, renormalize)
        return log_probs, flat_index // vocab, (flat_index % vocab).astype(jnp.int32)

    if not forced_eos:
        return fused()
    # Forced EOS changes whole elements at their limit (only EOS allowed): the plain path at
    # the steps where some element reaches its limit, the fused one otherwise.
    return lax.cond(jnp.any(length >= limits), plain, fused)


def candidate_sequences(
    live_sequences: jax.Array, parents: jax.Array, tokens: jax.Array, step: jax.Array | int
) -> jax.Array:
    """The candidates' token sequences: their parent's with ``tokens`` written at ``step``.

    Args:
      live_sequences: int32 ``[batch, beam, max_len]``.
      parents: int ``[batch, n]`` beam index in ``[0, beam)`` of each candidate.
      tokens: int32 ``[batch, n]`` each candidate's new token.
      step: int (0-d), the position written.

    Returns:
      int32 ``[batch, n, max_len]``.
    """
    sequences = _gather_beams(live_sequences, parents)
    return lax.dynamic_update_slice(sequences, tokens[:, :, None], (0, 0, step))


# --- The finishing rule -------------------------------------------------------------------


def ended_candidates(
    tokens: jax.Array, length: jax.Array | int, limits: jax.Array, *, eos_id: int
) -> jax.Array:
    """bool ``[batch, n]``: a candidate ends when its token (``tokens`` ``[batch, n]``) is EOS
    (kept in the sequence) or when its ``length`` (int, 0-d) reaches its element's limit
    (``limits`` int ``[batch]``; truncated there). An ended candidate never goes on live."""
    return (tokens == eos_id) | (length >= limits[:, None])


def finished_candidates(
    log_probs: jax.Array,
    ended: jax.Array,
    length: jax.Array | int,
    open_elements: jax.Array,
    *,
    alpha: float,
    beam_style: str,
    beam_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Which ended candidates enter the finished pool, and their scores.

    A candidate with log-prob ``-inf`` (from a padding beam or an impossible token) never
    counts. ``beam_style="gnmt"``: every other ended candidate enters. ``"hf"``: only those
    among the best ``beam_size`` candidates, and only into an open element's pool. The score
    is ``log_prob / length_penalty(length, alpha, beam_style)``.

    Args:
      log_probs: float32 ``[batch, n]`` candidate log-probs, best first (as
        :func:`select_candidates` returns them).
      ended: bool ``[batch, n]``, see :func:`ended_candidates`.
      length: int (0-d), tokens in each candidate.
      open_elements: bool ``[batch]``, elements whose pool may still change (``"hf"`` only;
        ignored by ``"gnmt"``).
      alpha: length-penalty exponent.
      beam_style: one of :data:`BEAM_STYLES`.
      beam_size: static number of beams.

    Returns:
      ``(finished, scores)``: bool ``[batch, n]`` and float32 ``[batch, n]``, ``-inf`` where
      not finished.
    """
    finished = ended & (log_probs > -jnp.inf)
    if beam_style == "hf":
        best_k = jnp.arange(log_probs.shape[1]) < beam_size
        finished = finished & best_k & open_elements[:, None]
    scores = jnp.where(finished, log_probs / length_penalty(length, alpha, beam_style), -jnp.inf)
    return finished, scores


def gnmt_can_improve(
    live_log_probs: jax.Array,
    finished_scores: jax.Array,
    finished_flags: jax.Array,
    next_length: jax.Array | int,
    limits: jax.Array,
    *,
    alpha: float,
) -> jax.Array:
    """bool ``[batch]``: whether a live beam can still beat the worst finished hypothesis
    under GNMT's rule (the search goes on while any element can).

    Log-probs only decrease, so the best score a live beam can reach is its log-prob over the
    largest penalty of the lengths still reachable, ``next_length .. limit``: the penalty is
    monotone in the length, so that is at one end (at the limit for ``alpha > 0``, at
    ``next_length`` for ``alpha < 0``). Until the pool is full, any finite live beam can (it
    fills an empty slot); an element past its limit has only ``-inf`` live beams and cannot.

    Args:
      live_log_probs: float32 ``[batch, beam]``, best first.
      finished_scores: float32 ``[batch, beam]`` the finished pool, best first.
      finished_flags: bool ``[batch, beam]``, which pool slots hold a hypothesis.
      next_length: int (0-d), the length of the live beams' next extensions.
      limits: int ``[batch]`` per-element token limits.
      alpha: length-penalty exponent.
    """
    best_penalty = jnp.maximum(
        length_penalty(next_length, alpha, "gnmt"), length_penalty(limits, alpha, "gnmt")
    )
    best_live = live_log_probs[:, 0] / best_penalty
    full = jnp.all(finished_flags, axis=1)
    return best_live > jnp.where(full, finished_scores[:, -1], -jnp.inf)


def hf_still_open(
    best_live_logp: jax.Array,
    fin_scores: jax.Array,
    fin_flags: jax.Array,
    length: jax.Array,
    limits: jax.Array,
    *,
    alpha: float,
    early_stopping: bool | str,
) -> jax.Array:
    """bool ``[batch]``: whether Hugging Face's beam search keeps a batch element open after a
    step (``_check_early_stop_heuristic``, and a full pool under ``early_stopping=True``).

    ``best_live_logp`` ``[batch]`` is the best live beam's log-prob after the step, ``length``
    (int) its length; ``fin_scores`` / ``fin_flags`` ``[batch, beam]`` the finished pool, best
    first. The best live beam is scored at its current length or, for
    ``early_stopping="never"`` and ``alpha > 0``, at the element's limit; the element stays
    open while that beats the worst finished score (any score does until the pool is full).
    """
    best_len = limits if (early_stopping == "never" and alpha > 0) else length
    best = best_live_logp / length_penalty(best_len, alpha, "hf")
    full = jnp.all(fin_flags, axis=1)
    open_ = best > jnp.where(full, fin_scores[:, -1], -jnp.inf)
    if early_stopping is True:
        open_ = open_ & ~full
    return open_


# --- The state update ---------------------------------------------------------------------


def select_live(
    log_probs: jax.Array,
    parents: jax.Array,
    tokens: jax.Array,
    sequences: jax.Array,
    ended: jax.Array,
    beam_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The new live beams: the best ``beam_size`` candidates that have not ended.

    Args:
      log_probs: float32 ``[batch, n]`` candidate log-probs.
      parents: int ``[batch, n]`` each candidate's parent beam.
      tokens: int32 ``[batch, n]`` each candidate's last token.
      sequences: int32 ``[batch, n, max_len]`` the candidates' tokens.
      ended: bool ``[batch, n]``, see :func:`ended_candidates`.
      beam_size: static number of live beams, ``<= n``.

    Returns:
      ``(log_probs, tokens, sequences, parents)`` of the live beams, best first: float32
      ``[batch, beam]`` (``-inf`` for a slot without a hypothesis), int32 ``[batch, beam]``,
      int32 ``[batch, beam, max_len]``, int ``[batch, beam]`` parent beam in the previous step.
    """
    live_log_probs, live_pos = lax.top_k(jnp.where(ended, -jnp.inf, log_probs), beam_size)
    live_sequences = _gather_beams(sequences, live_pos)
    live_tokens = jnp.take_along_axis(tokens, live_pos, axis=1)
    live_parents = jnp.take_along_axis(parents, live_pos, axis=1)
    return live_log_probs, live_tokens, live_sequences, live_parents


def flat_parents(parents: jax.Array) -> jax.Array:
    """int ``[batch * beam]``: the flat cache row (``b * beam + parents[b, j]``) each live beam
    came from, for ``parents`` int ``[batch, beam]`` in ``[0, beam)``; what the cache is
    gathered by, or what ``reorder_cache`` receives."""
    batch, beam = parents.shape
    return (jnp.arange(batch)[:, None] * beam + parents).reshape(-1)


def merge_finished(
    finished_sequences: jax.Array,
    finished_scores: jax.Array,
    finished_flags: jax.Array,
    new_sequences: jax.Array,
    new_scores: jax.Array,
    new_flags: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The finished pool after a step: the best ``beam`` of the kept and the new hypotheses.

    Empty slots and candidates that did not finish score ``-inf``, so any real hypothesis
    outranks them; on equal scores the kept (older) hypothesis comes first.

    Args:
      finished_sequences: int32 ``[batch, beam, max_len]`` the pool, best first.
      finished_scores: float32 ``[batch, beam]``.
      finished_flags: bool ``[batch, beam]``, which slots hold a hypothesis.
      new_sequences: int32 ``[batch, n, max_len]`` the step's candidates.
      new_scores: float32 ``[batch, n]``, ``-inf`` where not finished (see
        :func:`finished_candidates`).
      new_flags: bool ``[batch, n]``, which candidates finished.

    Returns:
      ``(sequences, scores, flags)`` of the pool, ``[batch, beam, max_len]``, ``[batch,
      beam]``, ``[batch, beam]``, best first.
    """
    beam = finished_scores.shape[1]
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    all_flags = jnp.concatenate([finished_flags, new_flags], axis=1)
    all_sequences = jnp.concatenate([finished_sequences, new_sequences], axis=1)
    scores, pos = lax.top_k(all_scores, beam)
    flags = jnp.take_along_axis(all_flags, pos, axis=1)
    return _gather_beams(all_sequences, pos), scores, flags


def initial_beam_state(
    first_tokens: jax.Array, cache: PyTree, *, beam_size: int, max_len: int, pad_id: int
) -> dict[str, Any]:
    """beam_search's loop state before the first step.

    Only beam 0 of each element is real (log-prob 0); the copies get ``-inf`` so the first
    step does not produce ``beam_size`` identical hypotheses. The finished pool is empty
    (scores ``-inf``) and every element open.

    Args:
      first_tokens: int32 ``[batch]`` every element's first input.
      cache: the model cache, already in the layout the callback expects.
      beam_size, max_len, pad_id: as in :func:`beam_search`.

    Returns:
      dict: ``step`` int32 0-d; ``live_tok`` int32 ``[batch, beam]``; ``live_seqs`` and
      ``fin_seqs`` int32 ``[batch, beam, max_len]`` (all PAD); ``live_logp`` and
      ``fin_scores`` float32 ``[batch, beam]``; ``fin_flags`` bool ``[batch, beam]``;
      ``open`` bool ``[batch]`` (``"hf"``: elements whose pool may still change); ``cache``.
    """
    batch_size, k = first_tokens.shape[0], beam_size
    return {
        "step": jnp.array(0, jnp.int32),
        "live_tok": jnp.repeat(first_tokens[:, None], k, axis=1),
        "live_seqs": jnp.full((batch_size, k, max_len), pad_id, jnp.int32),
        "live_logp": jnp.tile(
            jnp.array([0.0] + [-jnp.inf] * (k - 1), jnp.float32)[None], (batch_size, 1)
        ),
        "fin_seqs": jnp.full((batch_size, k, max_len), pad_id, jnp.int32),
        "fin_scores": jnp.full((batch_size, k), -jnp.inf, jnp.float32),
        "fin_flags": jnp.zeros((batch_size, k), bool),
        "open": jnp.ones((batch_size,), bool),
        "cache": cache,
    }


def final_hypotheses(
    live_sequences: jax.Array,
    live_log_probs: jax.Array,
    finished_sequences: jax.Array,
    finished_scores: jax.Array,
    finished_flags: jax.Array,
    steps: jax.Array | int,
    limits: jax.Array,
    *,
    alpha: float,
    beam_style: str,
) -> tuple[jax.Array, jax.Array]:
    """beam_search's result after its last step: per batch element the finished pool or, where
    nothing finished, the live beams scored at their length ``min(steps, limit)``.

    Hypotheses reaching their limit are finished by construction, so the live beams are
    returned only when no candidate with a finite log-prob ever ended (e.g. EOS impossible
    and the limit never reached).

    Args:
      live_sequences, finished_sequences: int32 ``[batch, beam, max_len]``.
      live_log_probs, finished_scores: float32 ``[batch, beam]``, best first.
      finished_flags: bool ``[batch, beam]``, which pool slots hold a hypothesis.
      steps: int (0-d), the number of steps run.
      limits: int ``[batch]`` per-element token limits.
      alpha, beam_style: the length penalty's, as in :func:`beam_search`.

    Returns:
      ``(sequences, scores)``: int32 ``[batch, beam, max_len]``, float32 ``[batch, beam]``.
    """
    none_finished = ~jnp.any(finished_flags, axis=1)
    live_len = jnp.minimum(steps, limits)[:, None]
    live_scores = live_log_probs / length_penalty(live_len, alpha, beam_style)
    sequences = jnp.where(none_finished[:, None, None], live_sequences, finished_sequences)
    scores = jnp.where(none_finished[:, None], live_scores, finished_scores)
    return sequences, scores


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    alpha: float = 0.6,
    eos_id: int = EOS_ID,
    initial_tokens: jax.Array | None = None,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    row_max_len: jax.Array | None = None,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    reorder_cache: Callable[[PyTree, jax.Array], PyTree] | None = None,
    renormalize: bool = False,
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with live and finished hypotheses kept apart, under GNMT's rules (the
    default) or those of Hugging Face's ``generate(num_beams=beam_size)``.

    The callback is called with ``batch_size * beam_size`` rows (row ``b * beam_size + j`` is
    beam ``j`` of batch element ``b``). Without ``reorder_cache``, cache leaves with
    ``ndim > 0`` are tiled to that layout once (leaves already of size
    ``batch_size * beam_size``, e.g. made with :func:`expand_to_beams`, are kept as they are)
    and, after every step, gathered along the leading axis by the parent beam each surviving
    hypothesis came from; 0-d leaves are never tiled or gathered. With
    ``reorder_cache(cache, parents) -> cache`` the cache is the caller's: passed as it is (no
    tiling) and, after every step, handed to ``reorder_cache`` with ``parents`` int32
    ``[batch_size * beam_size]``, the flat row each surviving hypothesis came from (a row of
    the same batch element), e.g. ``models.reorder_beam_cache``, which moves only the small
    ancestry array of a cache that is never reordered (``beam_cache``).

    Each step scores all ``beam * vocab`` one-token extensions of the live beams and keeps the
    best ``2 * beam`` of them, enough for ``beam`` live ones to survive even if ``beam`` of the
    candidates end with EOS. A candidate is *finished* when its token is EOS (included in the
    sequence) or when it reaches ``max_len`` tokens (truncated); its score is
    ``log_prob / length_penalty(length, alpha, beam_style)``, ``length`` counting EOS. The best
    ``beam`` unfinished candidates go on; the finished pool keeps the best ``beam``
    hypotheses.

    ``beam_style="gnmt"``: penalty ``((5 + length) / 6) ** alpha``; every finished candidate
    may enter the pool. The loop stops at ``max_len`` or as soon as, for every batch element,
    no live beam can still beat the worst finished one (exact bound: log-probs only
    decrease, so a live beam's best reachable score is ``log_prob / max(penalty)`` over the
    lengths still reachable).

    ``beam_style="hf"`` (transformers 5 ``_beam_search`` with ``length_penalty=alpha``):
    penalty ``length ** alpha``; only finished candidates among the best ``beam`` of the
    ``2 * beam`` enter the pool. A batch element *closes* (its pool frozen) when its pool is
    full and its best live beam, scored at its current length (``early_stopping`` False or
    True) or at its limit (``"never"`` with ``alpha > 0``), does not beat the worst finished
    score, or, with ``early_stopping=True``, as soon as its pool is full. The loop stops at
    ``max_len`` or when every element is closed.

    Args:
      tokens_to_logits: model callback, see the module docstring.
      cache: initial cache pytree, batched leaves ``[batch_size, ...]`` or
        ``[batch_size * beam_size, ...]``.
      batch_size: static batch size.
      beam_size: static number of beams (and of returned hypotheses) per batch element.
      max_len: static maximum number of generated tokens (BOS not counted).
      alpha: length-penalty exponent (0 = plain log-probability); Hugging Face's
        ``length_penalty`` under ``beam_style="hf"`` (its default there is 1.0).
      eos_id: end-of-sequence id.
      initial_tokens: optional int32 ``[batch_size]`` first inputs (default: ``bos_id``).
      pad_id: id written after EOS / unused positions.
      bos_id: default first input.
      row_max_len: optional int ``[batch_size]``: the hypotheses of batch element ``b`` end
        at ``min(row_max_len[b], max_len)`` tokens instead of ``max_len`` (everything above,
        bound and truncation included, then holds per element with its own limit).
      beam_style: static, one of :data:`BEAM_STYLES`.
      early_stopping: static, one of :data:`EARLY_STOPPING`; not False only with
        ``beam_style="hf"``.
      forced_eos: static; at its limit a hypothesis can only end with EOS, which then adds 0
        to its log-prob (Hugging Face's ``forced_eos_token_id``).
      banned_ids: static ids that no hypothesis contains (single-token ``bad_words_ids``).
      renormalize: static; the constrained next-token log-probs are normalised again (a
        ``log_softmax`` after ``banned_ids`` and ``forced_eos``), as Hugging Face's
        ``renormalize_logits=True`` (opus-mt's generation config) does. Without it the mass
        of the banned ids is simply lost, as in ``generate``'s default.
      reorder_cache: optional ``(cache, parents) -> cache``, see above (None: tile and gather
        every leaf).
      forced_bos_id: static; every hypothesis's first token is this id, at a cost of 0
        (Hugging Face's ``forced_bos_token_id``: mBART's target language code); None: none.

    Returns:
      ``(sequences, scores)``: int32 ``[batch_size, beam_size, max_len]`` and float32
      ``[batch_size, beam_size]``, best first. Slots for which fewer than ``beam_size``
      hypotheses with finite log-probability exist have score ``-inf``. If a batch element has
      no finished hypothesis at all, its live beams are returned, scored at their length.

    Raises:
      ValueError: a size is not a positive int, or a search option is not valid (see
        :func:`check_search_options`).
    """
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("beam_size", beam_size)
    _check_positive_int("max_len", max_len)
    banned_ids = check_search_options(
        beam_style, early_stopping, forced_eos, banned_ids, eos_id=eos_id
    )
    first = _initial_tokens(initial_tokens, batch_size, bos_id)
    limits = _row_limits(row_max_len, batch_size, max_len)  # [batch]
    k = beam_size
    hf = beam_style == "hf"
    if reorder_cache is None:
        cache = _tile_cache(cache, batch_size, k)
        reorder = _gather_rows
    else:
        reorder = reorder_cache

    def cond(state):
        step = state["step"]
        if hf:  # an element stays open until it closes or reaches its limit
            return (step < max_len) & jnp.any(state["open"] & (step < limits))
        can_improve = gnmt_can_improve(
            state["live_logp"],
            state["fin_scores"],
            state["fin_flags"],
            step + 1,
            limits,
            alpha=alpha,
        )
        return (step < max_len) & jnp.any(can_improve)

    def body(state):
        step = state["step"]
        length = step + 1  # tokens generated once this step's token is appended
        logits, new_cache = tokens_to_logits(state["live_tok"].reshape(-1, 1), state["cache"])
        logits = _checked_logits(logits, batch_size * k)

        # Candidate selection: the best 2k one-token extensions of the live beams.
        cand_logp, cand_parent, cand_tok = select_candidates_from_logits(
            state["live_logp"],
            logits.reshape(batch_size, k, logits.shape[-1]),
            length,
            limits,
            eos_id=eos_id,
            forced_eos=forced_eos,
            banned_ids=banned_ids,
            renormalize=renormalize,
            forced_bos_id=forced_bos_id,
        )
        cand_seqs = candidate_sequences(state["live_seqs"], cand_parent, cand_tok, step)

        # The finishing rule: which candidates end, which of those enter the finished pool.
        ended = ended_candidates(cand_tok, length, limits, eos_id=eos_id)
        new_fin, new_scores = finished_candidates(
            cand_logp,
            ended,
            length,
            state["open"],
            alpha=alpha,
            beam_style=beam_style,
            beam_size=k,
        )

        # The state update: the best k candidates that did not end go on (the cache follows
        # their parents); the pool keeps the best k finished hypotheses.
        live_logp, live_tok, live_seqs, parent = select_live(
            cand_logp, cand_parent, cand_tok, cand_seqs, ended, k
        )
        fin_seqs, fin_scores, fin_flags = merge_finished(
            state["fin_seqs"],
            state["fin_scores"],
            state["fin_flags"],
            cand_seqs,
            new_scores,
            new_fin,
        )
        open_ = state["open"]
        if hf:  # the "gnmt" bound is checked in cond
            open_ = open_ & hf_still_open(
                live_logp[:, 0],
                fin_scores,
                fin_flags,
                length,
                limits,
                alpha=alpha,
                early_stopping=early_stopping,
            )
        return {
            "step": step + 1,
            "live_tok": live_tok,
            "live_seqs": live_seqs,
            "live_logp": live_logp,
            "fin_seqs": fin_seqs,
            "fin_scores": fin_scores,
            "fin_flags": fin_flags,
            "open": open_,
            "cache": reorder(new_cache, flat_parents(parent)),
        }

    state = initial_beam_state(first, cache, beam_size=k, max_len=max_len, pad_id=pad_id)
    state = lax.while_loop(cond, body, state)
    return final_hypotheses(
        state["live_seqs"],
        state["live_logp"],
        state["fin_seqs"],
        state["fin_scores"],
        state["fin_flags"],
        state["step"],
        limits,
        alpha=alpha,
        beam_style=beam_style,
    )
