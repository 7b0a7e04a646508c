"""The pieces of one beam-search step (flaxformer_lite.decoding.beam), t5x style: fixed
log-prob arrays in, exact token ids, parents and scores out, no model.

Expected values are written by hand (the comments show the sums) or come from a few lines of
NumPy in this file: a sort over ``beam * vocab`` for candidate selection, an enumeration of
the reachable lengths for GNMT's stopping bound, a transcription of Hugging Face's
``BeamHypotheses.is_done`` for its rule, a stable sort for the finished pool.

Ids: 0 PAD, 1 EOS, 2 BOS, 3 and 4 ordinary tokens (vocab 5).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flaxformer_lite.decoding.beam import (
    EOS_ID,
    PAD_ID,
    candidate_sequences,
    ended_candidates,
    final_hypotheses,
    finished_candidates,
    flat_parents,
    gnmt_can_improve,
    hf_still_open,
    initial_beam_state,
    merge_finished,
    select_candidates,
    select_candidates_from_logits,
    select_live,
)

F32 = np.float32
INF = np.inf

# Two batch elements, two live beams each, vocab 5: next-token log-probs [batch, beam, vocab]
# (any numbers: the pieces never assume they are normalised).
LIVE_LOGP = np.array([[-0.5, -1.0], [-0.25, -2.0]], F32)
STEP_LOGP = np.array(
    [
        [[-9.0, -1.25, -9.0, -0.375, -2.0], [-9.0, -0.125, -9.0, -0.5, -3.0]],
        [[-9.0, -4.0, -9.0, -0.5, -0.75], [-9.0, -0.25, -9.0, -0.125, -6.0]],
    ],
    F32,
)
LIMITS = np.array([6, 6], np.int32)


def np_top_candidates(live_logp, step_logp, n):
    """(log-probs, parents, tokens) of the n best of beam x vocab; ties to the lower index."""
    batch, beam, vocab = step_logp.shape
    flat = (live_logp[:, :, None] + step_logp).reshape(batch, beam * vocab)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :n]
    return np.take_along_axis(flat, order, axis=1), order // vocab, order % vocab


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    finite = np.where(np.isfinite(x), x, -np.inf)
    m = finite.max(-1, keepdims=True)
    return x - m - np.log(np.exp(finite - m).sum(-1, keepdims=True))


def gnmt_penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


# ---------------------------------------------------------------------------
# Candidate selection
# ---------------------------------------------------------------------------


def test_select_candidates_picks_the_top_2k_of_beams_by_vocab_with_their_parents():
    logp, parents, tokens = select_candidates(LIVE_LOGP, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID)
    # Element 0: beam 0 + 3 = -0.875, beam 1 + EOS = -1.125, beam 1 + 3 = -1.5,
    # beam 0 + EOS = -1.75 (beam 0 + 4 = -2.5 is fifth).
    # Element 1: both from beam 0 first: + 3 = -0.75, + 4 = -1.0; then beam 1 + 3 = -2.125,
    # beam 1 + EOS = -2.25 (beam 0 + EOS = -4.25 is out).
    np.testing.assert_array_equal(parents, [[0, 1, 1, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(tokens, [[3, 1, 3, 1], [3, 4, 3, 1]])
    np.testing.assert_array_equal(
        logp, np.array([[-0.875, -1.125, -1.5, -1.75], [-0.75, -1.0, -2.125, -2.25]], F32)
    )
    assert tokens.dtype == np.int32 and logp.dtype == np.float32
    ref = np_top_candidates(LIVE_LOGP, STEP_LOGP, 4)
    for got, want in zip((logp, parents, tokens), ref, strict=True):
        np.testing.assert_array_equal(got, want)


def test_select_candidates_at_the_first_step_extends_beam_zero_only():
    # Only beam 0 is real at the start (the copies are -inf): all 2k candidates are its.
    live = np.array([[0.0, -INF], [0.0, -INF]], F32)
    logp, parents, tokens = select_candidates(live, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID)
    np.testing.assert_array_equal(parents, np.zeros((2, 4)))
    np.testing.assert_array_equal(tokens, [[3, 1, 4, 0], [3, 4, 1, 0]])
    np.testing.assert_array_equal(logp, [[-0.375, -1.25, -2.0, -9.0], [-0.5, -0.75, -4.0, -9.0]])


def test_select_candidates_never_picks_a_banned_id():
    # 3 banned: element 0 keeps beam 1 + EOS -1.125, beam 0 + EOS -1.75, beam 0 + 4 -2.5,
    # beam 1 + 4 -4.0; element 1 beam 0 + 4 -1.0, beam 1 + EOS -2.25, beam 0 + EOS -4.25,
    # beam 1 + 4 -8.0. PAD (0) and BOS (2) banned too: nothing changes, they were never chosen.
    for banned in ((3,), (0, 2, 3)):
        logp, parents, tokens = select_candidates(
            LIVE_LOGP, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID, banned_ids=banned
        )
        np.testing.assert_array_equal(tokens, [[1, 1, 4, 4], [4, 1, 1, 4]])
        np.testing.assert_array_equal(parents, [[1, 0, 0, 1], [0, 1, 0, 1]])
        np.testing.assert_array_equal(
            logp, [[-1.125, -1.75, -2.5, -4.0], [-1.0, -2.25, -4.25, -8.0]]
        )


def test_select_candidates_with_enough_banned_ids_returns_impossible_candidates_last():
    # Only EOS allowed: each live beam has one candidate; the other 2 of the 2k are -inf.
    logp, parents, tokens = select_candidates(
        LIVE_LOGP, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID, banned_ids=(0, 2, 3, 4)
    )
    np.testing.assert_array_equal(logp[:, :2], [[-1.125, -1.75], [-2.25, -4.25]])
    np.testing.assert_array_equal(parents[:, :2], [[1, 0], [1, 0]])
    np.testing.assert_array_equal(tokens[:, :2], [[1, 1], [1, 1]])
    assert np.all(logp[:, 2:] == -INF)


def test_select_candidates_forces_eos_at_the_limit_at_no_cost():
    # Element 0 is at its limit (length 3 >= 3): only EOS, which adds 0 to each beam.
    # Element 1 (limit 6) is untouched.
    limits = np.array([3, 6], np.int32)
    logp, parents, tokens = select_candidates(
        LIVE_LOGP, STEP_LOGP, 3, limits, eos_id=EOS_ID, forced_eos=True
    )
    np.testing.assert_array_equal(logp[0], [-0.5, -1.0, -INF, -INF])
    np.testing.assert_array_equal(parents[0, :2], [0, 1])
    np.testing.assert_array_equal(tokens[0, :2], [EOS_ID, EOS_ID])
    np.testing.assert_array_equal(logp[1], [-0.75, -1.0, -2.125, -2.25])
    np.testing.assert_array_equal(tokens[1], [3, 4, 3, 1])
    # Below the limit forced_eos changes nothing.
    below = select_candidates(LIVE_LOGP, STEP_LOGP, 2, limits, eos_id=EOS_ID, forced_eos=True)
    for got, want in zip(below, np_top_candidates(LIVE_LOGP, STEP_LOGP, 4), strict=True):
        np.testing.assert_array_equal(got, want)


def test_select_candidates_renormalize_after_the_constraints():
    # Banned 3, then a log_softmax over what is left, then the sum with the live log-probs.
    banned = np.isin(np.arange(5), [3])
    constrained = np_log_softmax(np.where(banned, -INF, STEP_LOGP))
    ref = np_top_candidates(LIVE_LOGP.astype(np.float64), constrained, 4)
    logp, parents, tokens = select_candidates(
        LIVE_LOGP, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID, banned_ids=(3,), renormalize=True
    )
    np.testing.assert_array_equal(parents, ref[1])
    np.testing.assert_array_equal(tokens, ref[2])
    np.testing.assert_allclose(logp, ref[0], rtol=1e-6)


def test_select_candidates_with_a_tiny_vocab_returns_all_beam_times_vocab():
    # beam 3 x vocab 1 = 3 candidates < 2 * beam.
    live = np.array([[-1.0, -0.5, -2.0]], F32)
    logp, parents, tokens = select_candidates(
        live, np.zeros((1, 3, 1), F32), 1, np.array([4], np.int32), eos_id=0
    )
    np.testing.assert_array_equal(logp, [[-0.5, -1.0, -2.0]])
    np.testing.assert_array_equal(parents, [[1, 0, 2]])
    np.testing.assert_array_equal(tokens, [[0, 0, 0]])


@pytest.mark.parametrize(
    "banned_ids, message",
    [
        ((7,), r"banned_ids must be a sequence of token ids \(ints in \[0, 5\)\)"),
        ((EOS_ID,), "banned_ids must not contain eos_id=1"),
    ],
)
def test_select_candidates_bad_banned_ids(banned_ids, message):
    with pytest.raises(ValueError, match=message):
        select_candidates(LIVE_LOGP, STEP_LOGP, 1, LIMITS, eos_id=EOS_ID, banned_ids=banned_ids)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"banned_ids": (0, 3)},
        {"forced_eos": True},
        {"renormalize": True, "banned_ids": (0,)},
        {"forced_bos_id": 4},
    ],
)
@pytest.mark.parametrize("vocab", [5, 40])
def test_select_candidates_from_logits_equals_selecting_from_the_log_softmax(options, vocab):
    # The fused path (vocab 40; vocab 5 is not longer than a row's selection) and the plain
    # one (forced_eos, renormalize, forced_bos_id) against selecting from the log-softmax: identical
    # candidates, the log-probs bitwise; at length 6 every element is at its limit, so
    # forced_eos acts.
    import jax

    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((2, 3, vocab)) * 3).astype(F32)
    logits[0, 1, 5 % vocab :] = logits[0, 1, 0]  # exact ties in one row
    live = np.array([[-0.5, -1.0, -1.0], [0.0, -INF, -INF]], F32)
    for length in (2, 6):
        got = select_candidates_from_logits(live, logits, length, LIMITS, eos_id=EOS_ID, **options)
        step_logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        want = select_candidates(live, step_logp, length, LIMITS, eos_id=EOS_ID, **options)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        if not options:  # the selection itself, independently: a stable sort in NumPy
            _, parents, tokens = np_top_candidates(live, step_logp, 6)
            np.testing.assert_array_equal(np.asarray(got[1]), parents)
            np.testing.assert_array_equal(np.asarray(got[2]), tokens)


def test_candidate_sequences_extend_their_parents():
    live_seqs = np.array([[[3, 4, 0, 0], [4, 4, 0, 0]]], np.int32)  # [1, 2, 4], step 2 next
    seqs = candidate_sequences(live_seqs, np.array([[1, 0, 1]]), np.array([[1, 3, 4]], np.int32), 2)
    np.testing.assert_array_equal(seqs, [[[4, 4, 1, 0], [3, 4, 3, 0], [4, 4, 4, 0]]])


# ---------------------------------------------------------------------------
# The finishing rule
# ---------------------------------------------------------------------------


def test_ended_candidates_end_with_eos_or_at_the_limit():
    tokens = np.array([[1, 3, 4, 1], [3, 4, 3, 4]], np.int32)
    ended = ended_candidates(tokens, 3, np.array([5, 3], np.int32), eos_id=EOS_ID)
    np.testing.assert_array_equal(ended, [[True, False, False, True], [True] * 4])


def test_finished_candidates_gnmt_every_ended_one_hf_only_the_best_k_of_open_elements():
    # 4 candidates (beam 2), best first; 3 have ended, the last is impossible (-inf).
    logp = np.array([[-0.5, -1.0, -1.5, -INF]] * 2, F32)
    ended = np.array([[False, True, True, True]] * 2)
    open_elements = np.array([True, False])
    fin, scores = finished_candidates(
        logp, ended, 3, open_elements, alpha=1.0, beam_style="gnmt", beam_size=2
    )
    # GNMT: penalty ((5 + 3) / 6) ** 1 = 4 / 3; "open" means nothing to it.
    np.testing.assert_array_equal(fin, [[False, True, True, False]] * 2)
    np.testing.assert_allclose(scores, [[-INF, -0.75, -1.125, -INF]] * 2, rtol=1e-6)
    fin, scores = finished_candidates(
        logp, ended, 3, open_elements, alpha=1.0, beam_style="hf", beam_size=2
    )
    # HF: only candidates 0 and 1 may finish, only in the open element 0; penalty 3 ** 1.
    np.testing.assert_array_equal(fin, [[False, True, False, False], [False] * 4])
    np.testing.assert_allclose(scores, [[-INF, -1.0 / 3.0, -INF, -INF], [-INF] * 4], rtol=1e-6)


def test_finished_candidates_without_length_penalty_score_their_log_prob():
    logp = np.array([[-0.5, -1.0]], F32)
    for style in ("gnmt", "hf"):
        fin, scores = finished_candidates(
            logp,
            np.array([[True, True]]),
            4,
            np.array([True]),
            alpha=0.0,
            beam_style=style,
            beam_size=2,
        )
        np.testing.assert_array_equal(scores, logp)


def np_gnmt_can_improve(live_best, worst_finished, pool_full, next_length, limit, alpha):
    """A live beam can improve when some length it can still reach, next_length .. limit,
    scores it above the worst finished hypothesis (log-probs only decrease, so its log-prob
    now is the most it can have); anything can while the pool has an empty slot."""
    if live_best == -INF:
        return False
    if not pool_full:
        return True
    reachable = [live_best / gnmt_penalty(n, alpha) for n in range(next_length, limit + 1)]
    return max(reachable) > worst_finished


def test_gnmt_can_improve_stops_exactly_when_no_live_beam_beats_the_worst_finished():
    # alpha 1, next length 1, limit 7: the best reachable penalty is ((5 + 7) / 6) = 2.
    # Rows: live -3.0 reaches -1.5, worst finished -1.5: a tie cannot improve; -2.9375 reaches
    # -1.46875 > -1.5: can; a pool with an empty slot: any finite live beam can; a row past its
    # limit (live beams all -inf) cannot.
    live = np.array([[-3.0, -4.0], [-2.9375, -4.0], [-100.0, -101.0], [-INF, -INF]], F32)
    fin_scores = np.array([[-1.0, -1.5], [-1.0, -1.5], [-1.0, -INF], [-1.0, -INF]], F32)
    fin_flags = np.array([[True, True], [True, True], [True, False], [True, False]])
    limits = np.full(4, 7, np.int32)
    can = gnmt_can_improve(live, fin_scores, fin_flags, 1, limits, alpha=1.0)
    np.testing.assert_array_equal(can, [False, True, True, False])
    # alpha -1: the penalty shrinks with length, so the best is at the next length (penalty
    # 1 at length 1), not at the limit (0.5): -2.0 ties -2.0, -1.9375 beats it.
    live = np.array([[-2.0, -3.0], [-1.9375, -3.0]], F32)
    fin_scores = np.array([[-1.0, -2.0], [-1.0, -2.0]], F32)
    can = gnmt_can_improve(
        live, fin_scores, np.ones((2, 2), bool), 1, np.full(2, 7, np.int32), alpha=-1.0
    )
    np.testing.assert_array_equal(can, [False, True])


def test_gnmt_can_improve_against_enumerating_the_reachable_lengths():
    rng = np.random.default_rng(0)
    n = 64
    live = np.sort(-rng.exponential(2.0, size=(n, 2)), axis=1)[:, ::-1].astype(F32)
    fin_scores = np.sort(-rng.exponential(1.0, size=(n, 2)), axis=1)[:, ::-1].astype(F32)
    fin_flags = np.stack([np.ones(n, bool), rng.random(n) < 0.8], axis=1)
    fin_scores[:, 1] = np.where(fin_flags[:, 1], fin_scores[:, 1], -INF)
    limits = rng.integers(3, 9, size=n).astype(np.int32)
    for alpha, next_length in itertools.product((-1.0, 0.0, 0.6, 2.0), (1, 3)):
        can = gnmt_can_improve(live, fin_scores, fin_flags, next_length, limits, alpha=alpha)
        want = [
            np_gnmt_can_improve(
                float(live[b, 0]),
                float(fin_scores[b, -1]),
                bool(fin_flags[b].all()),
                next_length,
                int(limits[b]),
                alpha,
            )
            for b in range(n)
        ]
        np.testing.assert_array_equal(can, want, err_msg=f"alpha={alpha}, next={next_length}")
        assert 0 < sum(want) < n  # both outcomes occur


def np_hf_is_done(finished, num_beams, best_sum_logprobs, cur_len, max_length, lp, early):
    """Hugging Face's ``BeamHypotheses.is_done`` (transformers 4.x, generation/beam_search.py)
    for one batch element: ``finished`` is the list of its finished scores."""
    if len(finished) < num_beams:
        return False
    if early is True:
        return True
    if early is False:
        highest_attainable_score = best_sum_logprobs / cur_len**lp
    elif lp > 0.0:  # "never"
        highest_attainable_score = best_sum_logprobs / max_length**lp
    else:
        highest_attainable_score = best_sum_logprobs / cur_len**lp
    return min(finished) >= highest_attainable_score


def test_hf_still_open_by_hand_for_each_early_stopping_value():
    # Beam 1, alpha 2, length 1, limit 3. Pool: log .6 = -0.51; live log .4 = -0.92.
    # False and True score the live beam at its length: -0.92 < -0.51, closed; "never" at the
    # limit: -0.92 / 9 = -0.10 > -0.51, open.
    live, pool = np.array([np.log(0.4)], F32), np.array([[np.log(0.6)]], F32)
    full, limits = np.array([[True]]), np.array([3], np.int32)
    got = {
        es: bool(hf_still_open(live, pool, full, 1, limits, alpha=2.0, early_stopping=es)[0])
        for es in (False, True, "never")
    }
    assert got == {False: False, True: False, "never": True}
    # A live beam above the worst finished: False and "never" stay open, True closes since
    # the pool is full.
    live = np.array([np.log(0.7)], F32)
    got = {
        es: bool(hf_still_open(live, pool, full, 1, limits, alpha=2.0, early_stopping=es)[0])
        for es in (False, True, "never")
    }
    assert got == {False: True, True: False, "never": True}
    # A pool with an empty slot keeps every element open, whatever the scores.
    pool2, half = np.array([[np.log(0.6), -INF]], F32), np.array([[True, False]])
    for es in (False, True, "never"):
        assert bool(
            hf_still_open(
                np.array([-50.0], F32), pool2, half, 1, limits, alpha=2.0, early_stopping=es
            )[0]
        )


def test_hf_still_open_follows_hf_is_done_for_each_early_stopping_value():
    # 48 elements (pools of 2, full or not) over a grid of rules, alphas and lengths.
    rng = np.random.default_rng(1)
    n = 48
    best_live = -rng.exponential(2.0, size=n).astype(F32)
    fin_scores = np.sort(-rng.exponential(1.0, size=(n, 2)), axis=1)[:, ::-1].astype(F32)
    fin_flags = np.stack([np.ones(n, bool), rng.random(n) < 0.75], axis=1)
    fin_scores[:, 1] = np.where(fin_flags[:, 1], fin_scores[:, 1], -INF)
    limits = rng.integers(4, 9, size=n).astype(np.int32)
    outcomes = {False: set(), True: set(), "never": set()}
    for early, alpha, length in itertools.product(
        (False, True, "never"), (-1.0, 0.0, 1.0, 2.0), (1, 3)
    ):
        got = hf_still_open(
            best_live, fin_scores, fin_flags, length, limits, alpha=alpha, early_stopping=early
        )
        want = [
            not np_hf_is_done(
                [float(s) for s, f in zip(fin_scores[b], fin_flags[b], strict=True) if f],
                2,
                float(best_live[b]),
                length,
                int(limits[b]),
                alpha,
                early,
            )
            for b in range(n)
        ]
        np.testing.assert_array_equal(got, want, err_msg=f"{early}, alpha={alpha}, len={length}")
        outcomes[early].update(want)
    # Not vacuous: under each rule some elements stay open and some close.
    assert all(seen == {False, True} for seen in outcomes.values()), outcomes


# ---------------------------------------------------------------------------
# The state update
# ---------------------------------------------------------------------------


def test_select_live_keeps_the_best_k_that_did_not_end():
    logp = np.array([[-0.125, -0.25, -0.375, -0.5]], F32)
    parents = np.array([[1, 0, 0, 1]], np.int32)
    tokens = np.array([[1, 3, 1, 4]], np.int32)
    seqs = np.array([[[4, 1], [3, 3], [3, 1], [4, 4]]], np.int32)
    ended = np.array([[True, False, True, False]])
    live_logp, live_tok, live_seqs, live_parents = select_live(
        logp, parents, tokens, seqs, ended, 2
    )
    np.testing.assert_array_equal(live_logp, [[-0.25, -0.5]])
    np.testing.assert_array_equal(live_tok, [[3, 4]])
    np.testing.assert_array_equal(live_seqs, [[[3, 3], [4, 4]]])
    np.testing.assert_array_equal(live_parents, [[0, 1]])


def test_flat_parents_index_the_rows_of_the_same_element():
    np.testing.assert_array_equal(
        flat_parents(np.array([[1, 0], [0, 0], [1, 1]], np.int32)), [1, 0, 2, 2, 5, 5]
    )


def np_merge_finished(fin_seqs, fin_scores, fin_flags, new_seqs, new_scores, new_flags):
    """Best ``beam`` of kept + new by score; a stable sort keeps the kept first on ties."""
    beam = fin_scores.shape[1]
    scores = np.concatenate([fin_scores, new_scores], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :beam]
    flags = np.concatenate([fin_flags, new_flags], axis=1)
    seqs = np.concatenate([fin_seqs, new_seqs], axis=1)
    return (
        np.take_along_axis(seqs, order[:, :, None], axis=1),
        np.take_along_axis(scores, order, axis=1),
        np.take_along_axis(flags, order, axis=1),
    )


def test_merge_finished_keeps_the_best_k_by_score():
    # Element 0: kept -1.0, -3.0; new -2.0 and -0.5 finish -> -0.5 (new), -1.0 (kept).
    # Element 1: kept -2.0 and an empty slot; new -2.0 ties the kept one (the kept, older, one
    # stays first) and fills the slot.
    # Element 2: nothing finished ever: the pool stays empty.
    fin_seqs = np.array([[[3, 1], [4, 1]], [[3, 1], [0, 0]], [[0, 0], [0, 0]]], np.int32)
    fin_scores = np.array([[-1.0, -3.0], [-2.0, -INF], [-INF, -INF]], F32)
    fin_flags = np.array([[True, True], [True, False], [False, False]])
    new_seqs = np.array([[[1, 0], [3, 4], [4, 4], [4, 3]]] * 3, np.int32)
    new_scores = np.array([[-2.0, -INF, -0.5, -INF], [-INF, -2.0, -INF, -INF], [-INF] * 4], F32)
    new_flags = new_scores > -INF
    got = merge_finished(fin_seqs, fin_scores, fin_flags, new_seqs, new_scores, new_flags)
    np.testing.assert_array_equal(got[0][0], [[4, 4], [3, 1]])
    np.testing.assert_array_equal(got[1][0], [-0.5, -1.0])
    np.testing.assert_array_equal(got[0][1], [[3, 1], [3, 4]])
    np.testing.assert_array_equal(got[1][1], [-2.0, -2.0])
    np.testing.assert_array_equal(got[2], [[True, True], [True, True], [False, False]])
    assert np.all(got[1][2] == -INF)
    for g, w in zip(
        got,
        np_merge_finished(fin_seqs, fin_scores, fin_flags, new_seqs, new_scores, new_flags),
        strict=True,
    ):
        np.testing.assert_array_equal(g, w)


def test_initial_state_has_one_real_beam_and_an_empty_pool():
    state = initial_beam_state(
        np.array([2, 3], np.int32), {}, beam_size=3, max_len=4, pad_id=PAD_ID
    )
    np.testing.assert_array_equal(state["live_logp"], [[0.0, -INF, -INF]] * 2)
    np.testing.assert_array_equal(state["live_tok"], [[2, 2, 2], [3, 3, 3]])
    np.testing.assert_array_equal(state["live_seqs"], np.full((2, 3, 4), PAD_ID))
    np.testing.assert_array_equal(state["fin_scores"], np.full((2, 3), -INF))
    assert not np.any(state["fin_flags"]) and np.all(state["open"]) and state["step"] == 0


def test_final_hypotheses_fall_back_to_live_beams_where_nothing_finished():
    # Element 0 has a finished pool: returned as it is. Element 1 has none: its live beams,
    # scored at their length min(steps 3, limit 2) = 2 with GNMT's penalty (alpha 1: 7 / 6).
    live_seqs = np.array([[[3, 3, 3], [4, 4, 4]], [[3, 4, 0], [4, 3, 0]]], np.int32)
    live_logp = np.array([[-1.0, -2.0], [-0.7, -1.4]], F32)
    fin_seqs = np.array([[[3, 1, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]], np.int32)
    fin_scores = np.array([[-0.25, -INF], [-INF, -INF]], F32)
    fin_flags = np.array([[True, False], [False, False]])
    seqs, scores = final_hypotheses(
        live_seqs,
        live_logp,
        fin_seqs,
        fin_scores,
        fin_flags,
        3,
        np.array([3, 2], np.int32),
        alpha=1.0,
        beam_style="gnmt",
    )
    np.testing.assert_array_equal(seqs, [[[3, 1, 0], [0, 0, 0]], [[3, 4, 0], [4, 3, 0]]])
    np.testing.assert_array_equal(scores[0], [-0.25, -INF])
    np.testing.assert_allclose(scores[1], [-0.7 * 6 / 7, -1.4 * 6 / 7], rtol=1e-6)
