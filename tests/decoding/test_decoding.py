"""Tests for flaxformer_lite.decoding.search with toy callbacks (fixed logits, no model).

Toy models:

* ``prefix model``: the logits depend on the whole prefix (the cache keeps a base-``V`` code of
  every token fed so far, per row), on a per-row table (the cache keeps the row id) and on the
  position (read from a 0-d ``index`` leaf that the callback increments, like flax's
  ``cache_index``). Wrong tiling / gathering of the cache or touching the 0-d leaf changes the
  results, and order matters.
* ``Markov model``: logits of the next token given only the last one, from a ``[V, V]`` table;
  used for sampling statistics.

PAD and BOS always get ``finfo.min`` logits, so real hypotheses use only EOS and normal tokens,
which keeps numpy enumeration of all sequences cheap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.decoding import search as decoding
from flaxformer_lite.decoding.beam import beam_search
from flaxformer_lite.decoding.search import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    expand_to_beams,
    flatten_beams,
    greedy_search,
    length_penalty,
    sample,
    unflatten_beams,
)

NEG = np.finfo(np.float32).min

# Every toy callback call (also inside jit / while_loop) appends here via jax.debug.callback,
# so tests can check how many decoding steps ran.
CALLS: list[int] = []


def _count_call():
    CALLS.append(1)


def count_calls(fn, *args, **kwargs):
    """Runs ``fn`` and returns ``(its output, number of toy-callback calls)``."""
    CALLS.clear()
    out = jax.block_until_ready(fn(*args, **kwargs))
    jax.effects_barrier()
    return out, len(CALLS)


# ---------------------------------------------------------------------------
# Toy models
# ---------------------------------------------------------------------------


def make_prefix_tables(seed, n_rows, vocab, max_len, *, peaked_eos=False):
    """Random tables ``[n_rows, vocab**max_len, vocab]`` and position bias ``[max_len, vocab]``.

    With ``peaked_eos`` EOS is, per state, either clearly the best token or nearly impossible,
    and there is no position bias (used to compare beam_size=1 with greedy).
    """
    rng = np.random.default_rng(seed)
    tables = rng.normal(size=(n_rows, vocab**max_len, vocab)).astype(np.float32)
    pos_bias = 0.5 * rng.normal(size=(max_len, vocab)).astype(np.float32)
    if peaked_eos:
        others = np.delete(tables, EOS_ID, axis=-1)
        eos_best = rng.random(tables.shape[:2]) < 0.3
        tables[..., EOS_ID] = np.where(
            eos_best, others.max(-1) + 4.0, others.min(-1) - 20.0
        ).astype(np.float32)
        pos_bias[:] = 0.0
    tables[..., PAD_ID] = NEG
    tables[..., BOS_ID] = NEG
    return tables, pos_bias


def prefix_callback(tables, pos_bias):
    """tokens_to_logits for the prefix model; tables/pos_bias may be traced."""
    vocab = tables.shape[-1]

    def tokens_to_logits(tokens, cache):
        jax.debug.callback(_count_call)
        # Trace-time checks that the decoder keeps the layout the callback expects.
        assert tokens.shape[1] == 1 and tokens.dtype == jnp.int32
        assert cache["index"].ndim == 0, "0-d cache leaves must not be expanded"
        assert cache["row"].shape[0] == tokens.shape[0] == cache["code"].shape[0]
        code = cache["code"] * vocab + tokens  # [batch, 1]
        logits = tables[cache["row"], code[:, 0]] + pos_bias[cache["index"]]
        return logits, {"row": cache["row"], "code": code, "index": cache["index"] + 1}

    return tokens_to_logits


def prefix_cache(rows):
    rows = jnp.asarray(rows, jnp.int32)
    return {
        "row": rows,  # [batch]: which table
        "code": jnp.zeros((rows.shape[0], 1), jnp.int32),  # [batch, 1]: prefix code
        "index": jnp.array(0, jnp.int32),  # 0-d: position counter shared by all rows
    }


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_prefix_logprobs(tables, pos_bias, row, prefix):
    """Log-probs of the next token after feeding ``prefix`` (first input included)."""
    vocab = tables.shape[-1]
    code = 0
    for t in prefix:
        code = code * vocab + int(t)
    return np_log_softmax(tables[row, code] + pos_bias[len(prefix) - 1])


def np_greedy(tables, pos_bias, rows, first, max_len, *, forced_eos=False, banned=()):
    """Greedy tokens and model log-probs; ``banned`` ids never chosen, EOS at ``max_len``
    with ``forced_eos``."""
    tokens = np.full((len(rows), max_len), PAD_ID, np.int32)
    scores = np.zeros(len(rows))
    for b, row in enumerate(rows):
        prefix = [int(first[b])]
        for t in range(max_len):
            lp = np_prefix_logprobs(tables, pos_bias, row, prefix)
            allowed = np.where(np.isin(np.arange(len(lp)), banned), -np.inf, lp)
            tok = EOS_ID if forced_eos and t == max_len - 1 else int(np.argmax(allowed))
            tokens[b, t] = tok
            scores[b] += lp[tok]
            if tok == EOS_ID:
                break
            prefix.append(tok)
    return tokens, scores


def np_exhaustive(tables, pos_bias, row, first, max_len, alpha, *, forced_eos=False, banned=()):
    """All sequences over {EOS, normal tokens} ending at EOS or at max_len, best first, scored
    with GNMT's penalty. ``banned`` tokens never occur; with ``forced_eos`` a sequence at
    max_len ends with EOS, which then costs nothing."""
    vocab = tables.shape[-1]
    normal = [t for t in range(vocab) if t not in (PAD_ID, EOS_ID, BOS_ID, *banned)]
    results = []

    def rec(seq, logp):
        lp = np_prefix_logprobs(tables, pos_bias, row, [first] + seq)
        if forced_eos and len(seq) == max_len - 1:
            lp = np.where(np.arange(vocab) == EOS_ID, 0.0, -np.inf)
        for tok in [EOS_ID] + normal:
            if lp[tok] == -np.inf:
                continue
            new_seq, new_logp = seq + [tok], logp + lp[tok]
            if tok == EOS_ID or len(new_seq) == max_len:
                penalty = ((5.0 + len(new_seq)) / 6.0) ** alpha
                results.append((new_logp / penalty, new_seq))
            else:
                rec(new_seq, new_logp)

    rec([], 0.0)
    results.sort(key=lambda r: -r[0])
    return results


def markov_callback(table):
    """tokens_to_logits depending on the last token only; table [V, V]."""

    def tokens_to_logits(tokens, cache):
        return table[tokens[:, 0]], cache

    return tokens_to_logits


def make_markov_table(seed, vocab):
    table = np.random.default_rng(seed).normal(size=(vocab, vocab)).astype(np.float32)
    table[:, PAD_ID] = NEG
    table[:, BOS_ID] = NEG
    return table


# ---------------------------------------------------------------------------
# Jitted runners: one compilation per static configuration.
# ---------------------------------------------------------------------------


CONSTRAINTS = ("forced_eos", "banned_ids")
BEAM_RULES = ("beam_style", "early_stopping")


@functools.partial(jax.jit, static_argnames=("max_len", "eos_id", *CONSTRAINTS))
def jit_greedy(
    tables,
    pos_bias,
    rows,
    first,
    row_max_len=None,
    *,
    max_len,
    eos_id=EOS_ID,
    forced_eos=False,
    banned_ids=(),
):
    return greedy_search(
        prefix_callback(tables, pos_bias),
        prefix_cache(rows),
        batch_size=rows.shape[0],
        max_len=max_len,
        eos_id=eos_id,
        initial_tokens=first,
        row_max_len=row_max_len,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
    )


@functools.partial(
    jax.jit, static_argnames=("max_len", "beam_size", "alpha", *BEAM_RULES, *CONSTRAINTS)
)
def jit_beam(
    tables,
    pos_bias,
    rows,
    first,
    cache=None,
    row_max_len=None,
    *,
    max_len,
    beam_size,
    alpha,
    beam_style="gnmt",
    early_stopping=False,
    forced_eos=False,
    banned_ids=(),
):
    return beam_search(
        prefix_callback(tables, pos_bias),
        prefix_cache(rows) if cache is None else cache,
        batch_size=rows.shape[0],
        beam_size=beam_size,
        max_len=max_len,
        alpha=alpha,
        initial_tokens=first,
        row_max_len=row_max_len,
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
    )


@functools.partial(jax.jit, static_argnames=("max_len", "temperature", "top_k", "top_p"))
def jit_sample_prefix(tables, pos_bias, rows, first, rng, *, max_len, temperature, top_k, top_p):
    return sample(
        prefix_callback(tables, pos_bias),
        prefix_cache(rows),
        rng,
        batch_size=rows.shape[0],
        max_len=max_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        initial_tokens=first,
    )


@functools.partial(
    jax.jit, static_argnames=("batch_size", "max_len", "temperature", "top_k", "top_p")
)
def jit_sample_markov(table, rng, *, batch_size, max_len, temperature, top_k, top_p):
    return sample(
        markov_callback(table),
        (),
        rng,
        batch_size=batch_size,
        max_len=max_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


# Shared fixtures: 3 rows with different tables and different first tokens.
VOCAB, MAX_LEN = 5, 4
# Seed chosen so that greedy rows have lengths 4, 1 and 2 and every greedy choice wins by a
# margin > 0.05 (checked in the tests that rely on it).
TABLES, POS_BIAS = make_prefix_tables(18, 3, VOCAB, MAX_LEN)
ROWS = np.array([2, 0, 1], np.int32)
FIRST = np.array([BOS_ID, 3, 4], np.int32)


def run_greedy_eager(tables, pos_bias, rows, first, max_len):
    """greedy_search without jit: op by op, lax.while_loop runs as a Python loop."""
    with jax.disable_jit():
        return greedy_search(
            prefix_callback(jnp.asarray(tables), jnp.asarray(pos_bias)),
            prefix_cache(rows),
            batch_size=len(rows),
            max_len=max_len,
            initial_tokens=jnp.asarray(first),
        )


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def test_length_penalty():
    np.testing.assert_allclose(length_penalty(np.arange(1, 6), 0.0), np.ones(5))
    np.testing.assert_allclose(length_penalty(1, 0.6), 1.0)
    np.testing.assert_allclose(length_penalty(7, 0.6), 2.0**0.6, rtol=1e-6)
    np.testing.assert_allclose(length_penalty(jnp.array([1, 13]), 1.0), [1.0, 3.0], rtol=1e-6)
    # Hugging Face's: the length itself (EOS counted, the decoder start not).
    np.testing.assert_allclose(length_penalty(jnp.array([1, 4]), 0.5, "hf"), [1.0, 2.0])
    np.testing.assert_allclose(length_penalty(3, 0.0, "hf"), 1.0)
    with pytest.raises(ValueError, match="style must be one of"):
        length_penalty(3, 1.0, "t5")


def test_beam_layout_helpers():
    tree = {
        "a": jnp.arange(6).reshape(2, 3),
        "b": jnp.arange(2.0),
        "idx": jnp.array(7),
    }
    expanded = expand_to_beams(tree, 3)
    assert expanded["a"].shape == (6, 3) and expanded["b"].shape == (6,)
    assert expanded["idx"] is tree["idx"]  # 0-d leaves untouched
    np.testing.assert_array_equal(expanded["b"], [0, 0, 0, 1, 1, 1])  # row b*beam + j
    split = unflatten_beams(expanded, 3)
    assert split["a"].shape == (2, 3, 3) and split["idx"] is tree["idx"]
    np.testing.assert_array_equal(split["a"][1, 2], tree["a"][1])
    merged = flatten_beams(split)
    np.testing.assert_array_equal(merged["a"], expanded["a"])
    assert merged["idx"] is tree["idx"]


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------


def test_greedy_matches_numpy_and_pads_after_eos():
    want_tokens, want_scores = np_greedy(TABLES, POS_BIAS, ROWS, FIRST, MAX_LEN)
    # The fixture must contain both a row that stops early and one that runs to max_len.
    assert (want_tokens[:, -1] == PAD_ID).any() and (want_tokens[:, -1] != PAD_ID).any()
    tokens, scores = jit_greedy(TABLES, POS_BIAS, ROWS, FIRST, max_len=MAX_LEN)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5)
    eager_tokens, eager_scores = run_greedy_eager(TABLES, POS_BIAS, ROWS, FIRST, MAX_LEN)
    np.testing.assert_array_equal(eager_tokens, tokens)
    np.testing.assert_allclose(eager_scores, scores, rtol=1e-6)


def test_greedy_default_bos_and_eos_override():
    first = np.full(3, BOS_ID, np.int32)
    want, _ = np_greedy(TABLES, POS_BIAS, ROWS, first, MAX_LEN)
    tokens, _ = jit_greedy(TABLES, POS_BIAS, ROWS, None, max_len=MAX_LEN)
    np.testing.assert_array_equal(tokens, want)
    # With another "EOS" id, greedy stops at that token instead.
    stop = int(want[0, 0])
    assert stop != EOS_ID
    (tokens, _), calls = count_calls(
        jit_greedy, TABLES, POS_BIAS, ROWS[:1], None, max_len=MAX_LEN, eos_id=stop
    )
    assert calls == 1
    np.testing.assert_array_equal(tokens[0], [stop] + [PAD_ID] * (MAX_LEN - 1))


def test_greedy_stops_when_all_rows_finished():
    want, _ = np_greedy(TABLES, POS_BIAS, ROWS, FIRST, MAX_LEN)
    for b in range(len(ROWS)):
        n_generated = int((want[b] != PAD_ID).sum())
        _, calls = count_calls(
            jit_greedy, TABLES, POS_BIAS, ROWS[b : b + 1], FIRST[b : b + 1], max_len=MAX_LEN
        )
        assert calls == n_generated
    _, calls = count_calls(jit_greedy, TABLES, POS_BIAS, ROWS, FIRST, max_len=MAX_LEN)
    assert calls == int((want != PAD_ID).sum(1).max())


# ---------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------


def test_beam_size_one_equals_greedy():
    # Keeping finished hypotheses apart makes beam search better than greedy in general (an
    # early EOS may beat the greedy continuation). With EOS either clearly best or nearly
    # impossible, and alpha = 0, the two coincide.
    tables, pos_bias = make_prefix_tables(1, 3, VOCAB, MAX_LEN, peaked_eos=True)
    greedy_tokens, greedy_scores = jit_greedy(tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN)
    assert (np.asarray(greedy_tokens)[:, -1] == PAD_ID).any()
    seqs, scores = jit_beam(tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN, beam_size=1, alpha=0.0)
    assert seqs.shape == (3, 1, MAX_LEN) and scores.shape == (3, 1)
    np.testing.assert_array_equal(seqs[:, 0], greedy_tokens)
    np.testing.assert_allclose(scores[:, 0], greedy_scores, rtol=1e-5)


# (vocab, max_len, beam): beam >= number of live prefixes (normal_tokens ** (max_len - 1)),
# so nothing is pruned and beam search is exhaustive.
EXHAUSTIVE_CONFIGS = [(5, 4, 8), (6, 3, 9)]


@pytest.mark.parametrize("vocab,max_len,beam", EXHAUSTIVE_CONFIGS)
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_search_is_exhaustive_with_wide_beam(vocab, max_len, beam, alpha):
    tables, pos_bias = make_prefix_tables(10 + vocab, 3, vocab, max_len)
    first = np.array([BOS_ID, 3, vocab - 1], np.int32)
    seqs, scores = jit_beam(
        tables, pos_bias, ROWS, first, max_len=max_len, beam_size=beam, alpha=alpha
    )
    assert seqs.shape == (3, beam, max_len) and scores.shape == (3, beam)
    for b, row in enumerate(ROWS):
        want = np_exhaustive(tables, pos_bias, int(row), int(first[b]), max_len, alpha)
        # The whole top-`beam` list is exact, not only the best hypothesis.
        for j, (want_score, want_seq) in enumerate(want[:beam]):
            padded = want_seq + [PAD_ID] * (max_len - len(want_seq))
            np.testing.assert_array_equal(seqs[b, j], padded)
            np.testing.assert_allclose(scores[b, j], want_score, rtol=1e-5)


def test_beam_search_sorted_padded_and_consistent():
    tables, pos_bias = make_prefix_tables(3, 3, VOCAB, MAX_LEN)
    alpha = 0.6
    seqs, scores = jit_beam(
        tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN, beam_size=3, alpha=alpha
    )
    seqs, scores = np.asarray(seqs), np.asarray(scores)
    assert np.all(np.isfinite(scores))
    assert np.all(np.diff(scores, axis=1) <= 0), "scores must be sorted best first"
    for b, row in enumerate(ROWS):
        for j in range(3):
            seq = list(seqs[b, j])
            assert PAD_ID not in seq[:1] and BOS_ID not in seq
            length = seq.index(EOS_ID) + 1 if EOS_ID in seq else MAX_LEN
            assert all(t == PAD_ID for t in seq[length:]), "positions after EOS must be PAD"
            assert PAD_ID not in seq[:length]
            # The score is the penalised log-prob of exactly this sequence.
            logp = sum(
                np_prefix_logprobs(tables, pos_bias, int(row), [int(FIRST[b])] + seq[:t])[seq[t]]
                for t in range(length)
            )
            np.testing.assert_allclose(
                scores[b, j], logp / ((5.0 + length) / 6.0) ** alpha, rtol=1e-5
            )
        assert len({tuple(s) for s in seqs[b]}) == 3, "beams must be distinct"


def test_beam_search_stops_early():
    # EOS clearly best everywhere: after a few steps `beam` finished hypotheses exist that no
    # live beam can beat, even with the max-length penalty bound.
    vocab, max_len, beam = 5, 5, 2
    tables, pos_bias = make_prefix_tables(4, 3, vocab, max_len)
    tables[..., EOS_ID] += 6.0
    (seqs, scores), calls = count_calls(
        jit_beam, tables, pos_bias, ROWS, FIRST, max_len=max_len, beam_size=beam, alpha=0.6
    )
    assert calls < max_len
    for b, row in enumerate(ROWS):
        want = np_exhaustive(tables, pos_bias, int(row), int(FIRST[b]), max_len, 0.6)
        for j in range(beam):
            np.testing.assert_allclose(scores[b, j], want[j][0], rtol=1e-5)


def crafted_tables(max_len, states):
    """One-row prefix-model tables from ``{prefix (first token included): {token: prob}}``;
    unlisted states are uniform over EOS and the normal tokens."""
    tables = np.zeros((1, VOCAB**max_len, VOCAB), np.float32)
    for prefix, probs in states.items():
        code = 0
        for t in prefix:
            code = code * VOCAB + t
        tables[0, code] = np.log(1e-12)
        for tok, prob in probs.items():
            tables[0, code, tok] = np.log(prob)
    tables[..., [PAD_ID, BOS_ID]] = NEG
    return tables, np.zeros((max_len, VOCAB), np.float32)


def run_crafted(tables, pos_bias, max_len, beam_size, alpha):
    first = np.array([BOS_ID], np.int32)
    seqs, scores = jit_beam(
        tables,
        pos_bias,
        np.zeros(1, np.int32),
        first,
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
    )
    want = np_exhaustive(tables, pos_bias, 0, BOS_ID, max_len, alpha)[:beam_size]
    for j, (want_score, want_seq) in enumerate(want):
        np.testing.assert_array_equal(seqs[0, j, : len(want_seq)], want_seq)
        np.testing.assert_allclose(scores[0, j], want_score, rtol=1e-5, atol=1e-6)
    return want


def test_beam_search_keeps_k_live_beams_when_candidates_end():
    # Step 1: EOS and token 3 are the top-2 candidates. Keeping only the top k (= 2) candidates
    # would leave a single live beam ([3]) and lose [4, EOS], the second-best hypothesis.
    b = BOS_ID
    tables, pos_bias = crafted_tables(
        3, {(b,): {EOS_ID: 0.9, 3: 0.06, 4: 0.04}, (b, 4): {EOS_ID: 1.0}}
    )
    want = run_crafted(tables, pos_bias, max_len=3, beam_size=2, alpha=0.0)
    assert [w[1] for w in want] == [[EOS_ID], [4, EOS_ID]]


def test_beam_search_bound_uses_max_length_penalty():
    # alpha = 2 rewards length strongly. After two steps the finished pool is full
    # ([EOS], [3, EOS]) and the live beam [3, 3] cannot beat it at length 3, but can at
    # length 4 ([3, 3, 3, EOS]): stopping with a bound at the next length would be wrong.
    b = BOS_ID
    tables, pos_bias = crafted_tables(
        4,
        {
            (b,): {EOS_ID: 0.6, 3: 0.35, 4: 0.05},
            (b, 3): {EOS_ID: 0.7, 3: 0.29, 4: 0.01},
            (b, 3, 3): {3: 1.0},
            (b, 3, 3, 3): {EOS_ID: 1.0},
        },
    )
    want = run_crafted(tables, pos_bias, max_len=4, beam_size=2, alpha=2.0)
    assert [w[1] for w in want] == [[EOS_ID], [3, 3, 3, EOS_ID]]


def test_beam_search_accepts_pre_tiled_cache():
    beam = 3
    cache = prefix_cache(ROWS)
    # Leaves already at batch * beam (as the glue does for encoder outputs) are not re-tiled.
    tiled = dict(cache, row=expand_to_beams(cache["row"], beam))
    kwargs = {"max_len": MAX_LEN, "beam_size": beam, "alpha": 0.6}
    a_seqs, a_scores = jit_beam(TABLES, POS_BIAS, ROWS, FIRST, **kwargs)
    b_seqs, b_scores = jit_beam(TABLES, POS_BIAS, ROWS, FIRST, tiled, **kwargs)
    np.testing.assert_array_equal(a_seqs, b_seqs)
    np.testing.assert_allclose(a_scores, b_scores)
    bad = dict(cache, row=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="batch_size"):
        jit_beam(TABLES, POS_BIAS, ROWS, FIRST, bad, **kwargs)


def test_beam_search_hands_the_parents_to_reorder_cache():
    """With ``reorder_cache`` the cache is the caller's: not tiled, and reordered only by the
    function, which receives the flat parent rows. Gathering every leaf there is the default
    search; not reordering at all gives other hypotheses on this prefix model."""
    beam = 3
    cache = prefix_cache(ROWS)
    tiled = dict(
        cache, row=expand_to_beams(cache["row"], beam), code=expand_to_beams(cache["code"], beam)
    )
    seen = []

    def gather_all(c, parents):
        seen.append(parents.shape)
        return jax.tree.map(lambda x: jnp.take(x, parents, axis=0) if x.ndim else x, c)

    kwargs = dict(batch_size=ROWS.shape[0], beam_size=beam, max_len=MAX_LEN, alpha=0.6)
    kwargs["initial_tokens"] = FIRST
    step = prefix_callback(jnp.asarray(TABLES), jnp.asarray(POS_BIAS))
    want = jax.jit(lambda c: beam_search(step, c, **kwargs))(cache)
    got = jax.jit(lambda c: beam_search(step, c, reorder_cache=gather_all, **kwargs))(tiled)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1])
    assert seen == [(ROWS.shape[0] * beam,)]  # traced once, flat rows
    still = jax.jit(lambda c: beam_search(step, c, reorder_cache=lambda c, p: c, **kwargs))(tiled)
    assert (np.asarray(still[0]) != np.asarray(want[0])).any()


def test_beam_search_without_eos_returns_full_length_beams():
    # EOS impossible: only hopeless (finfo.min) hypotheses end before max_len; hypotheses
    # reaching max_len count as finished, so the best full-length beams come back.
    tables, pos_bias = make_prefix_tables(5, 3, VOCAB, MAX_LEN)
    tables[..., EOS_ID] = NEG
    seqs, scores = jit_beam(tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN, beam_size=2, alpha=0.6)
    assert np.all(np.asarray(seqs) > BOS_ID) and np.all(np.isfinite(scores))
    for b, row in enumerate(ROWS):
        want = np_exhaustive(tables, pos_bias, int(row), int(FIRST[b]), MAX_LEN, 0.6)
        np.testing.assert_array_equal(seqs[b, 0], want[0][1])


# ---------------------------------------------------------------------------
# Per-row limits
# ---------------------------------------------------------------------------

# Row 0 stops at 1 token, row 1 at 3, row 2 at 2; the output stays MAX_LEN (4) wide.
ROW_LIMITS = np.array([1, 3, 2], np.int32)


def limited_tables():
    """Prefix tables where EOS is nearly impossible for batch rows 1 and 2 (their hypotheses
    run into their limit) and left random for row 0."""
    tables, pos_bias = make_prefix_tables(6, 3, VOCAB, MAX_LEN)
    tables[ROWS[1:], :, EOS_ID] -= 20.0
    return tables, pos_bias


def test_greedy_row_max_len_equals_each_row_decoded_alone_with_its_limit():
    tables, pos_bias = limited_tables()
    (tokens, scores), calls = count_calls(
        jit_greedy, tables, pos_bias, ROWS, FIRST, ROW_LIMITS, max_len=MAX_LEN
    )
    for b, row in enumerate(ROWS):
        limit = int(ROW_LIMITS[b])
        want, want_score = np_greedy(tables, pos_bias, [row], FIRST[b : b + 1], limit)
        padded = np.concatenate([want[0], np.full(MAX_LEN - limit, PAD_ID)])
        np.testing.assert_array_equal(tokens[b], padded, err_msg=f"row {b}")
        np.testing.assert_allclose(scores[b], want_score[0], rtol=1e-5)
    # The limits bite: without them rows 1 and 2 run longer.
    unlimited, _ = jit_greedy(tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN)
    assert (np.asarray(unlimited)[1:, -1] != PAD_ID).all()
    # The loop stops once every row has reached its limit (or EOS).
    assert calls == ROW_LIMITS.max()


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_row_max_len_equals_each_row_decoded_alone_with_its_limit(alpha):
    tables, pos_bias = limited_tables()
    beam = 8  # exhaustive: every hypothesis of length <= 3 over 2 normal tokens survives
    (seqs, scores), calls = count_calls(
        jit_beam, tables, pos_bias, ROWS, FIRST, None, ROW_LIMITS,
        max_len=MAX_LEN, beam_size=beam, alpha=alpha,
    )  # fmt: skip
    for b, row in enumerate(ROWS):
        limit = int(ROW_LIMITS[b])
        want = np_exhaustive(tables, pos_bias, int(row), int(FIRST[b]), limit, alpha)[:beam]
        for j, (want_score, want_seq) in enumerate(want):
            padded = want_seq + [PAD_ID] * (MAX_LEN - len(want_seq))
            np.testing.assert_array_equal(seqs[b, j], padded, err_msg=f"row {b} beam {j}")
            np.testing.assert_allclose(scores[b, j], want_score, rtol=1e-5)
        # Short limits leave fewer possible hypotheses than beams: only impossible ones
        # (PAD/BOS tokens, finfo.min logits) or empty slots (-inf) fill the rest.
        assert np.all(np.asarray(scores)[b, len(want) :] < -1e30)
    assert calls <= ROW_LIMITS.max()
    # Decoded with the widest limit for all, row 0 gets a longer best hypothesis.
    wide, _ = jit_beam(tables, pos_bias, ROWS, FIRST, max_len=MAX_LEN, beam_size=beam, alpha=alpha)
    assert not np.array_equal(np.asarray(wide)[:, 0], np.asarray(seqs)[:, 0])


# ---------------------------------------------------------------------------
# Hugging Face's beam rules (beam_style="hf"): hand-computed cases where they and GNMT's
# choose differently. Ids: PAD 0, EOS 1, BOS 2, normal tokens 3 and 4.
# ---------------------------------------------------------------------------


def run_hf(states, max_len, beam_size, alpha, early_stopping=False, beam_style="hf"):
    """(best sequence without padding, its score, decoding steps run) for one crafted row."""
    tables, pos_bias = crafted_tables(max_len, states)
    (seqs, scores), calls = count_calls(
        jit_beam,
        tables,
        pos_bias,
        np.zeros(1, np.int32),
        np.array([BOS_ID], np.int32),
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
    )
    best = [int(t) for t in np.asarray(seqs)[0, 0] if t != PAD_ID]
    return best, float(scores[0, 0]), calls


def test_hf_length_penalty_divides_by_the_length():
    # alpha 1, beam 2, max_len 2. Finished: [EOS] log .5 = -0.69 at length 1, [3, EOS]
    # log .35 = -1.05 at length 2. HF: -1.05 / 2 = -0.52 wins; GNMT: -1.05 / (7/6) = -0.90
    # loses to -0.69 / 1.
    b = BOS_ID
    states = {(b,): {EOS_ID: 0.5, 3: 0.35, 4: 0.15}, (b, 3): {EOS_ID: 1.0}, (b, 4): {EOS_ID: 1.0}}
    best, score, _ = run_hf(states, max_len=2, beam_size=2, alpha=1.0)
    assert best == [3, EOS_ID]
    np.testing.assert_allclose(score, np.log(0.35) / 2, rtol=1e-5)
    assert run_hf(states, max_len=2, beam_size=2, alpha=1.0, beam_style="gnmt")[0] == [EOS_ID]


def test_hf_only_the_best_beam_candidates_may_finish():
    # Beam 1, alpha 0, max_len 2: the 2 candidates of step 0 are [3] (.6) and [EOS] (.4). HF
    # keeps a finished candidate only among the best `beam` (here 1), so [EOS] is dropped and
    # the truncated [3, 4] (.6 * .55) wins; GNMT keeps [EOS], which beats it.
    b = BOS_ID
    states = {(b,): {3: 0.6, EOS_ID: 0.4}, (b, 3): {4: 0.55, EOS_ID: 0.45}}
    best, score, _ = run_hf(states, max_len=2, beam_size=1, alpha=0.0)
    assert best == [3, 4]
    np.testing.assert_allclose(score, np.log(0.6 * 0.55), rtol=1e-5)
    assert run_hf(states, max_len=2, beam_size=1, alpha=0.0, beam_style="gnmt")[0] == [EOS_ID]


def test_hf_early_stopping_false_scores_live_beams_at_their_length():
    # Beam 1, alpha 2, max_len 3. After step 0 the pool holds [EOS] (log .6 = -0.51) and the
    # live [3] has log .4 = -0.92. early_stopping=False (and True) scores it at its length 1:
    # -0.92 < -0.51, so the search stops after one step. "never" scores it at the limit,
    # -0.92 / 3**2 = -0.10, goes on, and finds [3, 3, EOS]: log .36 / 9 = -0.11 > -0.51.
    b = BOS_ID
    states = {(b,): {EOS_ID: 0.6, 3: 0.4}, (b, 3): {3: 0.9, EOS_ID: 0.1}, (b, 3, 3): {EOS_ID: 1.0}}
    for early_stopping in (False, True):
        best, score, calls = run_hf(states, 3, 1, 2.0, early_stopping)
        assert (best, calls) == ([EOS_ID], 1), early_stopping
        np.testing.assert_allclose(score, np.log(0.6), rtol=1e-5)
    best, score, calls = run_hf(states, 3, 1, 2.0, "never")
    assert (best, calls) == ([3, 3, EOS_ID], 3)
    np.testing.assert_allclose(score, np.log(0.36) / 9, rtol=1e-5)


def test_hf_early_stopping_true_stops_with_a_full_pool():
    # Beam 2, alpha 1, max_len 3. Step 0: [3] .6, [EOS] .3 (finishes: log .3 = -1.20), [4] .1.
    # Step 1: [3, EOS] .33 finishes (log .33 / 2 = -0.55): the pool is full. True stops here;
    # False goes on, since the live [3, 3] (.27: log .27 / 2 = -0.65) beats -1.20 at its
    # length, and finds [3, 3, EOS]: log .27 / 3 = -0.44.
    b = BOS_ID
    states = {
        (b,): {3: 0.6, EOS_ID: 0.3, 4: 0.1},
        (b, 3): {EOS_ID: 0.55, 3: 0.45},
        (b, 4): {EOS_ID: 0.5, 3: 0.3, 4: 0.2},
        (b, 3, 3): {EOS_ID: 1.0},
    }
    best, score, calls = run_hf(states, 3, 2, 1.0, True)
    assert (best, calls) == ([3, EOS_ID], 2)
    np.testing.assert_allclose(score, np.log(0.33) / 2, rtol=1e-5)
    best, score, calls = run_hf(states, 3, 2, 1.0, False)
    assert (best, calls) == ([3, 3, EOS_ID], 3)
    np.testing.assert_allclose(score, np.log(0.27) / 3, rtol=1e-5)


# ---------------------------------------------------------------------------
# Token constraints: forced EOS at the limit, banned ids
# ---------------------------------------------------------------------------


def test_greedy_forced_eos_and_banned_ids():
    # Row limits 1, 3, 2 and token 3 banned: every row ends with EOS at the latest at its
    # limit, and 3 never occurs although the unconstrained greedy choice uses it.
    tables, pos_bias = limited_tables()
    plain, _ = jit_greedy(tables, pos_bias, ROWS, FIRST, ROW_LIMITS, max_len=MAX_LEN)
    assert (np.asarray(plain) == 3).any()
    kwargs = dict(max_len=MAX_LEN, forced_eos=True, banned_ids=(3,))
    tokens, scores = jit_greedy(tables, pos_bias, ROWS, FIRST, ROW_LIMITS, **kwargs)
    for b, row in enumerate(ROWS):
        limit = int(ROW_LIMITS[b])
        want, want_score = np_greedy(
            tables, pos_bias, [row], FIRST[b : b + 1], limit, forced_eos=True, banned=(3,)
        )
        padded = np.concatenate([want[0], np.full(MAX_LEN - limit, PAD_ID)])
        np.testing.assert_array_equal(tokens[b], padded, err_msg=f"row {b}")
        # The score stays the model's log-prob, a forced EOS's included.
        np.testing.assert_allclose(scores[b], want_score[0], rtol=1e-5)
    assert all(EOS_ID in list(row) for row in np.asarray(tokens))


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_forced_eos_and_banned_ids_against_enumeration(alpha):
    # Exhaustive beam (as above): the whole top list equals the enumeration of the sequences
    # without token 4, those at max_len ending with an EOS that costs nothing: [EOS], 2 of
    # length 2 and 4 of length 3 over the normal tokens 3 and 5.
    vocab, max_len, beam = 6, 3, 7
    tables, pos_bias = make_prefix_tables(16, 3, vocab, max_len)
    first = np.array([BOS_ID, 3, vocab - 1], np.int32)
    seqs, scores = jit_beam(
        tables, pos_bias, ROWS, first,
        max_len=max_len, beam_size=beam, alpha=alpha, forced_eos=True, banned_ids=(4,),
    )  # fmt: skip
    seqs, scores = np.asarray(seqs), np.asarray(scores)
    for b, row in enumerate(ROWS):
        want = np_exhaustive(
            tables, pos_bias, int(row), int(first[b]), max_len, alpha, forced_eos=True, banned=(4,)
        )
        assert len(want) == beam
        for j, (want_score, want_seq) in enumerate(want):
            padded = want_seq + [PAD_ID] * (max_len - len(want_seq))
            np.testing.assert_array_equal(seqs[b, j], padded)
            np.testing.assert_allclose(scores[b, j], want_score, rtol=1e-5)
    assert not (seqs == 4).any()
    assert all(EOS_ID in list(s) for s in seqs.reshape(-1, max_len))


@jax.jit
def jit_sample_markov_constrained(table, rng):
    return sample(
        markov_callback(table), (), rng, batch_size=64, max_len=3, forced_eos=True, banned_ids=(3,)
    )


def test_sample_never_draws_a_banned_id_and_ends_with_eos_at_the_limit():
    table = MARKOV.copy()
    table[:, 3] += 5.0  # the favourite token, banned below
    tokens, _ = jit_sample_markov_constrained(table, jax.random.key(1))
    tokens = np.asarray(tokens)
    assert not (tokens == 3).any()
    assert all(EOS_ID in list(row) for row in tokens)


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def sample_prefix(rng, max_len=MAX_LEN, temperature=1.0, top_k=0, top_p=1.0, tables=TABLES):
    return jit_sample_prefix(
        tables,
        POS_BIAS,
        ROWS,
        FIRST,
        rng,
        max_len=max_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


def test_sample_same_key_same_tokens_different_keys_differ():
    # Uniform over the 2 non-special tokens, EOS impossible: 64 x 4 draws from two keys agree
    # with probability 2**-256.
    tables = np.zeros((3, VOCAB**MAX_LEN, VOCAB), np.float32)
    tables[..., [PAD_ID, EOS_ID, BOS_ID]] = NEG
    rows = np.zeros(64, np.int32)
    first = np.full(64, BOS_ID, np.int32)

    def run(key):
        return jit_sample_prefix(
            tables, np.zeros_like(POS_BIAS), rows, first, key,
            max_len=MAX_LEN, temperature=1.0, top_k=0, top_p=1.0,
        )  # fmt: skip

    a, la = run(jax.random.key(0))
    b, lb = run(jax.random.key(0))
    c, _ = run(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(a, c)
    np.testing.assert_allclose(la, MAX_LEN * np.log(0.5), rtol=1e-5)
    # Raw uint32 keys work as well.
    d, _ = run(jax.random.PRNGKey(0))
    assert d.shape == a.shape


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.0, 0, 1.0), (1e-4, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6), (0.0, 3, 0.5)],
)
def test_sample_degenerate_settings_equal_greedy(temperature, top_k, top_p):
    want_tokens, want_scores = np_greedy(TABLES, POS_BIAS, ROWS, FIRST, MAX_LEN)
    # Deterministic enough: every greedy choice wins by a margin >> temperature 1e-4.
    for b, row in enumerate(ROWS):
        for t in range(MAX_LEN):
            if want_tokens[b, t] == PAD_ID:
                break
            prefix = [int(FIRST[b])] + [int(x) for x in want_tokens[b, :t]]
            lp = np.sort(np_prefix_logprobs(TABLES, POS_BIAS, int(row), prefix))
            assert lp[-1] - lp[-2] > 0.05
    tokens, scores = sample_prefix(
        jax.random.key(3), temperature=temperature, top_k=top_k, top_p=top_p
    )
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5)


def test_sample_log_probs_and_padding():
    tokens, scores = sample_prefix(jax.random.key(5))
    tokens = np.asarray(tokens)
    for b, row in enumerate(ROWS):
        seq = list(tokens[b])
        length = seq.index(EOS_ID) + 1 if EOS_ID in seq else MAX_LEN
        assert all(t == PAD_ID for t in seq[length:])
        logp = sum(
            np_prefix_logprobs(TABLES, POS_BIAS, int(row), [int(FIRST[b])] + seq[:t])[seq[t]]
            for t in range(length)
        )
        np.testing.assert_allclose(scores[b], logp, rtol=1e-5)


SAMPLE_VOCAB, N_SAMPLES = 8, 4000
MARKOV = make_markov_table(7, SAMPLE_VOCAB)


def empirical_first_token(temperature, top_k=0, top_p=1.0, seed=0):
    tokens, _ = jit_sample_markov(
        MARKOV,
        jax.random.key(seed),
        batch_size=N_SAMPLES,
        max_len=1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    return np.bincount(np.asarray(tokens)[:, 0], minlength=SAMPLE_VOCAB) / N_SAMPLES


def assert_matches_distribution(freq, probs, n_std=4.0):
    std_err = np.sqrt(probs * (1.0 - probs) / N_SAMPLES)
    assert np.all(np.abs(freq - probs) <= n_std * std_err + 1e-9), (freq, probs)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sample_distribution_matches_softmax(temperature):
    probs = np.exp(np_log_softmax(MARKOV[BOS_ID].astype(np.float64) / temperature))
    assert_matches_distribution(empirical_first_token(temperature), probs)


def test_sample_top_k_support_and_distribution():
    logits = MARKOV[BOS_ID].astype(np.float64)
    top = np.argsort(-logits)[:3]
    freq = empirical_first_token(1.0, top_k=3)
    assert freq[np.setdiff1d(np.arange(SAMPLE_VOCAB), top)].sum() == 0
    probs = np.zeros(SAMPLE_VOCAB)
    probs[top] = np.exp(np_log_softmax(logits[top]))
    assert_matches_distribution(freq, probs)


def test_sample_top_p_distribution():
    logits = MARKOV[BOS_ID].astype(np.float64)
    p = np.exp(np_log_softmax(logits))
    order = np.argsort(-p)
    # Nucleus = the two most likely tokens: mass before the 2nd < top_p <= mass before the 3rd.
    top_p = float(p[order[0]] + 0.5 * p[order[1]])
    freq = empirical_first_token(1.0, top_p=top_p)
    probs = np.zeros(SAMPLE_VOCAB)
    probs[order[:2]] = p[order[:2]] / p[order[:2]].sum()
    assert freq[order[2:]].sum() == 0
    assert_matches_distribution(freq, probs)


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_len": 0}, "max_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"initial_tokens": jnp.zeros((2,), jnp.int32)}, "initial_tokens"),
    ],
)
def test_sample_bad_arguments(kwargs, name):
    args = {"batch_size": 3, "max_len": 2} | kwargs
    with pytest.raises(ValueError, match=name):
        sample(markov_callback(MARKOV), (), jax.random.key(0), **args)


@pytest.mark.parametrize(
    "kwargs,name",
    [({"beam_size": 0}, "beam_size"), ({"max_len": 0}, "max_len"), ({"batch_size": -1}, "batch")],
)
def test_beam_and_greedy_bad_arguments(kwargs, name):
    args = {"batch_size": 3, "beam_size": 2, "max_len": 2} | kwargs
    with pytest.raises(ValueError, match=name):
        beam_search(markov_callback(MARKOV), (), **args)
    if "beam_size" not in kwargs:
        args.pop("beam_size")
        with pytest.raises(ValueError, match=name):
            greedy_search(markov_callback(MARKOV), (), **args)
    with pytest.raises(ValueError, match="beam_size"):
        expand_to_beams({"a": jnp.zeros((2,))}, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beam_style": "t5"}, "beam_style must be one of"),
        ({"beam_style": "hf", "early_stopping": "always"}, "early_stopping must be one of"),
        ({"beam_style": "hf", "early_stopping": 1}, "early_stopping must be one of"),
        ({"early_stopping": True}, "early_stopping=True is a rule of beam_style='hf'"),
        ({"forced_eos": 1}, "forced_eos must be True or False"),
        ({"banned_ids": (EOS_ID,)}, "banned_ids must not contain eos_id"),
        ({"banned_ids": (3.0,)}, "banned_ids must be a sequence of token ids"),
        ({"banned_ids": 3}, "banned_ids must be a sequence of token ids"),
        ({"banned_ids": (SAMPLE_VOCAB,)}, r"banned_ids .*ints in \[0, 8\)"),  # at trace time
    ],
)
def test_search_options_bad_arguments(kwargs, message):
    args = {"batch_size": 3, "beam_size": 2, "max_len": 2} | kwargs
    model = markov_callback(jnp.asarray(MARKOV))
    with pytest.raises(ValueError, match=message):
        beam_search(model, (), **args)
    if not ({"beam_style", "early_stopping"} & kwargs.keys()):
        args.pop("beam_size")
        with pytest.raises(ValueError, match=message):
            greedy_search(model, (), **args)


def test_special_ids_are_defined_in_one_place():
    """No module assigns PAD_ID / EOS_ID / BOS_ID / UNK_ID but special_ids; the other
    holders of the ids (config defaults, tokenizer, synthetic vocabulary) agree with it."""
    import ast
    from pathlib import Path

    from flaxformer_lite.core import special_ids
    from flaxformer_lite.data import tokenizer
    from flaxformer_lite.data.tasks import synthetic
    from flaxformer_lite.nn.config import TransformerConfig

    names = {"PAD_ID", "EOS_ID", "BOS_ID", "UNK_ID"}
    root = Path(__file__).resolve().parents[2]
    sources = [
        *(root / "flaxformer_lite").rglob("*.py"),
        root / "train.py",
        *root.glob("bench/*.py"),
    ]
    defined = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                defined += [(path.name, e.id) for e in elts if getattr(e, "id", None) in names]
    assert sorted(defined) == sorted(("special_ids.py", n) for n in names), defined
    config = TransformerConfig()
    assert (config.pad_id, config.bos_id) == (special_ids.PAD_ID, special_ids.BOS_ID)
    for module in (decoding, tokenizer):
        assert (module.PAD_ID, module.EOS_ID, module.BOS_ID) == (PAD_ID, EOS_ID, BOS_ID)
    assert tokenizer.UNK_ID == synthetic.UNK_ID == special_ids.UNK_ID
    assert synthetic.SymbolVocabulary("ab").id_to_piece(range(4)) == list(
        special_ids.SPECIAL_PIECES
    )


def test_public_constants():
    assert (decoding.PAD_ID, decoding.EOS_ID, decoding.BOS_ID) == (0, 1, 2)
    assert all(hasattr(decoding, name) for name in decoding.__all__)
    # Sanity check of the enumeration helper: max_len 2, normal tokens {3, 4}:
    # [EOS] + 2 prefixes x 3 endings (EOS, 3, 4).
    assert len(np_exhaustive(TABLES, POS_BIAS, 0, BOS_ID, 2, 0.0)) == 1 + 2 * 3


@pytest.mark.parametrize(
    "beam_style,constraints",
    [
        ("gnmt", {}),
        ("hf", {}),
        ("hf", {"forced_eos": True, "banned_ids": (PAD_ID,), "renormalize": True}),
    ],
)
def test_beam_search_selects_as_from_the_materialised_log_softmax(
    monkeypatch, beam_style, constraints
):
    # Vocab 64 > 2 * beam + 1, so each step takes the fused selection
    # (ops.beam_top_k.log_softmax_top_k); the reference is the search with the plain one,
    # log_softmax then select_candidates, patched in. Rows of equal logits make ties.
    from flaxformer_lite.decoding import beam as beam_module

    table = make_markov_table(7, 64)
    table[3:9, 10:40] = table[3:9, 10:11]  # exact ties within these rows
    kwargs = dict(batch_size=3, beam_size=4, max_len=7, alpha=0.6, beam_style=beam_style)
    kwargs.update(constraints, row_max_len=jnp.asarray([3, 7, 5], jnp.int32))
    first = jnp.asarray([BOS_ID, 3, 5], jnp.int32)

    def run():
        return jax.jit(
            lambda t: beam_search(markov_callback(t), {}, initial_tokens=first, **kwargs)
        )(table)

    got = run()

    def plain(live, logits, length, limits, **options):
        log_probs = jax.nn.log_softmax(logits, axis=-1).astype(jnp.float32)
        return beam_module.select_candidates(live, log_probs, length, limits, **options)

    monkeypatch.setattr(beam_module, "select_candidates_from_logits", plain)
    want = run()
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
