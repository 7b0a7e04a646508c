"""generate() on a real (tiny, randomly initialised) EncoderDecoder against plain references.

The references recompute everything with ``model.apply`` (no cache, no search tricks): greedy
decoding that re-runs the whole prefix at every step, and exhaustive enumeration of every
output sequence for beam search. The output projection is scaled up ("peaky" model) so that
low-temperature sampling is greedy in practice, and the naive loop asserts that the best and
second-best logits are far apart compared with float32 rounding, so that "same tokens" can
never hinge on a near-tie between the cached and the full computation.

Random models tend to loop on one token; the seed is chosen so that rows have varied tokens
and end at different steps, and the tests assert it (a new seed is the fix if JAX's random
numbers ever change).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import continue_prompt, generate
from flaxformer_lite.decoding.search import BOS_ID, EOS_ID, PAD_ID, length_penalty
from flaxformer_lite.models import DecoderOnly, EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]

CONFIG = TransformerConfig(
    vocab_size=24,
    d_model=32,
    num_heads=2,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=16,
    tie_output_embedding=False,  # the output projection alone is scaled to make it peaky
)
SEED = 23
# Sources of different lengths (EOS-terminated, PAD after): the padded-batch test needs them.
SOURCES = [[5, 9, 7, 1], [12, 4, 6, 20, 8, 11, 1], [17, 1]]
MAX_LEN = 10
MIN_MARGIN = 1e-3  # smallest top-1 / top-2 logit gap accepted: 100x float32 rounding here


def init_params(config: TransformerConfig, seed: int, scale: float) -> dict:
    """Random parameters with the output projection multiplied by ``scale``."""
    model = EncoderDecoder(config)
    tokens = jnp.ones((1, 4), jnp.int32)
    # jit: one compile is faster than running init op by op.
    variables = jax.jit(model.init)(jax.random.key(seed), tokens, tokens)
    params = nn.meta.unbox(variables["params"])
    kernel = params["decoder"]["logits"]["kernel"]
    params["decoder"]["logits"]["kernel"] = kernel * scale
    return params


def padded(rows: list[list[int]], length: int | None = None) -> jnp.ndarray:
    length = length or max(map(len, rows))
    out = np.full((len(rows), length), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return jnp.asarray(out)


@functools.partial(jax.jit, static_argnums=1)
def full_logits(params, config, inputs, decoder_inputs):
    """Logits `[batch, t, vocab]` of the whole (shifted) decoder input: no cache, the encoder
    and every decoder position recomputed from scratch."""
    model = EncoderDecoder(config)
    return model.apply(
        {"params": params},
        inputs,
        decoder_inputs,
        method=lambda m, x, y: m.decode(m.encode(x), x, y),
    )


def teacher_forced_log_probs(params, config, inputs, tokens) -> np.ndarray:
    """log p(tokens[:, t] | tokens[:, :t], inputs) `[batch, len, vocab]` for every t."""
    bos = np.full((tokens.shape[0], 1), BOS_ID, np.int32)
    decoder_inputs = np.concatenate([bos, np.asarray(tokens)[:, :-1]], axis=1)
    logits = full_logits(params, config, inputs, jnp.asarray(decoder_inputs))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def naive_greedy(params, config, inputs, max_len: int) -> tuple[np.ndarray, float]:
    """Greedy decoding that recomputes the full prefix ``[BOS, y_1 .. y_t]`` at every step.

    The prefix is padded to ``max_len`` so one compiled shape serves every step; the decoder
    is causal, so what follows position t cannot change the logits read at t.
    Returns tokens `[batch, max_len]` (EOS, then PAD) and the smallest top-1 / top-2 logit
    margin met while choosing.
    """
    batch = inputs.shape[0]
    decoder_inputs = np.full((batch, max_len), PAD_ID, np.int32)
    decoder_inputs[:, 0] = BOS_ID
    tokens = np.full((batch, max_len), PAD_ID, np.int32)
    finished = np.zeros(batch, bool)
    margin = np.inf
    for t in range(max_len):
        logits = np.asarray(full_logits(params, config, inputs, jnp.asarray(decoder_inputs)))
        logits = logits[:, t]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = min(margin, float((top2[:, 1] - top2[:, 0])[~finished].min()))
        nxt = np.where(finished, PAD_ID, logits.argmax(-1)).astype(np.int32)
        tokens[:, t] = nxt
        finished |= nxt == EOS_ID
        if finished.all():
            break
        if t + 1 < max_len:
            decoder_inputs[:, t + 1] = nxt
    return tokens, margin


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=SEED, scale=8.0)


@pytest.fixture(scope="module")
def inputs():
    return padded(SOURCES)


@pytest.fixture(scope="module")
def greedy(params, inputs):
    tokens, scores = generate(params, CONFIG, inputs, method="greedy", max_len=MAX_LEN)
    return np.asarray(tokens), np.asarray(scores)


def generated_lengths(tokens: np.ndarray) -> list[int]:
    """Tokens up to and including EOS (max_len when there is none), per row."""
    return [
        int(np.argmax(row == EOS_ID)) + 1 if (row == EOS_ID).any() else len(row) for row in tokens
    ]


# ----------------------------------------------------------------------------- greedy


def test_cached_greedy_equals_full_recomputation(params, inputs, greedy):
    tokens, scores = greedy
    expected, margin = naive_greedy(params, CONFIG, inputs, MAX_LEN)
    assert margin > MIN_MARGIN, f"near-tie in the random model (margin {margin}): change seed"
    np.testing.assert_array_equal(tokens, expected)
    # The test means something only if rows are long and end at different steps.
    lengths = generated_lengths(tokens)
    assert max(lengths) >= 4 and len(set(lengths)) > 1, lengths
    # Scores: the summed log-probs of the generated tokens, EOS included.
    logp = teacher_forced_log_probs(params, CONFIG, inputs, tokens)
    for row, length in enumerate(lengths):
        expected_score = logp[row, np.arange(length), tokens[row, :length]].sum()
        np.testing.assert_allclose(scores[row], expected_score, rtol=1e-5, atol=1e-4)


def test_padded_batch_equals_rows_decoded_alone(params, greedy):
    tokens, _ = greedy
    for row, source in enumerate(SOURCES):
        alone, _ = generate(
            params, CONFIG, jnp.asarray([source], jnp.int32), method="greedy", max_len=MAX_LEN
        )
        np.testing.assert_array_equal(np.asarray(alone)[0], tokens[row], err_msg=f"row {row}")


def test_row_max_len_cuts_each_row_at_its_own_limit(params, inputs, greedy):
    tokens, scores = greedy
    lengths = generated_lengths(tokens)
    # Row 0 cut before its EOS, row 1 given more than it uses, row 2 cut at 1 token.
    limits = [lengths[0] - 2, MAX_LEN, 1]
    assert lengths[0] - 2 >= 1 and lengths[2] > 1, lengths
    got, got_scores = generate(
        params, CONFIG, inputs, method="greedy", max_len=MAX_LEN, row_max_len=limits
    )
    # A row alone with limit L: greedy's first L tokens, PAD after them; scores summed over
    # them (the teacher-forced log-probs of the unlimited run).
    keep = np.arange(MAX_LEN)[None, :] < np.asarray(limits)[:, None]
    np.testing.assert_array_equal(np.asarray(got), np.where(keep, tokens, PAD_ID))
    logp = teacher_forced_log_probs(params, CONFIG, inputs, tokens)
    for row, limit in enumerate(limits):
        n = min(limit, lengths[row])
        want = logp[row, np.arange(n), tokens[row, :n]].sum()
        np.testing.assert_allclose(got_scores[row], want, rtol=1e-5, atol=1e-4)


def test_greedy_and_beams_over_a_long_cache_equal_full_recomputation():
    """A cache of 70 slots: a step attends over the prefix that holds the slots written so far
    (32 slots, then all 70: ``kv_cache.prefix_widths``) and the rows run past slot 32, so the
    search crosses from one to the other. Greedy equals the full recomputation; beam search
    (in place and reordering: the same tokens) returns hypotheses whose scores are the full
    recomputation's log-probs of their tokens."""
    config, max_len = CONFIG.replace(max_len=80), 70
    params = init_params(config, seed=1, scale=4.0)  # seed: rows that run long, checked
    inputs = padded(SOURCES)
    tokens, scores = generate(params, config, inputs, method="greedy", max_len=max_len)
    tokens = np.asarray(tokens)
    expected, margin = naive_greedy(params, config, inputs, max_len)
    assert margin > MIN_MARGIN, f"near-tie in the random model (margin {margin}): change seed"
    np.testing.assert_array_equal(tokens, expected)
    lengths = generated_lengths(tokens)
    assert min(lengths) > 40 and len(set(lengths)) > 1, lengths
    logp = teacher_forced_log_probs(params, config, inputs, tokens)
    for row, length in enumerate(lengths):
        want = logp[row, np.arange(length), tokens[row, :length]].sum()
        np.testing.assert_allclose(scores[row], want, rtol=1e-5, atol=1e-4)

    options = dict(method="beam", beam_size=3, alpha=0.0, max_len=max_len)
    beams, beam_scores = generate(params, config, inputs, beam_cache="in_place", **options)
    reordered, _ = generate(params, config, inputs, beam_cache="reorder", **options)
    beams = np.asarray(beams)
    np.testing.assert_array_equal(beams, np.asarray(reordered))
    lengths = generated_lengths(beams)
    assert min(lengths) > 40, lengths
    logp = teacher_forced_log_probs(params, config, inputs, beams)
    for row, length in enumerate(lengths):
        want = logp[row, np.arange(length), beams[row, :length]].sum()
        np.testing.assert_allclose(float(beam_scores[row]), want, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- beam search


def beam1_expectation(logp: np.ndarray, tokens: np.ndarray, length: int):
    """What beam search with one beam and alpha=0 returns, given greedy's path.

    Beam search keeps finished hypotheses apart. With one beam it scores the two best
    extensions of its live hypothesis at every step; when EOS is the *second* best at step
    t, "greedy prefix + EOS" is finished with log-prob logp(prefix) + logp(EOS) while the
    search goes on along greedy's path. Log-probs only fall, so at the end the best of these
    early hypotheses and greedy's own result is returned: beam-1 equals greedy exactly when
    no early EOS hypothesis scores above greedy's final log-prob.

    Args: logp `[len, vocab]` teacher-forced along greedy's tokens `[len]`; ``length`` greedy's
    generated tokens (EOS included). Returns (tokens, score) of the expected result.
    """
    steps = np.arange(length)
    so_far = np.concatenate([[0.0], np.cumsum(logp[steps, tokens[:length]])])
    best = (tokens[:length], so_far[length])
    for t in range(length - 1):
        if np.argsort(logp[t])[-2] == EOS_ID and so_far[t] + logp[t, EOS_ID] > best[1]:
            best = (np.append(tokens[:t], EOS_ID), so_far[t] + logp[t, EOS_ID])
    out = np.full(len(tokens), PAD_ID, np.int32)
    out[: len(best[0])] = best[0]
    return out, best[1]


def test_beam_size_1_equals_greedy(params, inputs, greedy):
    """With alpha=0 and max_len=3 the condition of ``beam1_expectation`` holds for every row
    of this model (checked), so beam-1 gives greedy's tokens and scores."""
    max_len = 3
    tokens = greedy[0][:, :max_len]  # greedy is prefix-consistent: shorter max_len, same start
    beam, beam_scores = generate(
        params, CONFIG, inputs, method="beam", beam_size=1, alpha=0.0, max_len=max_len
    )
    logp = teacher_forced_log_probs(params, CONFIG, inputs, tokens)
    for row, length in enumerate(generated_lengths(tokens)):
        expected, score = beam1_expectation(logp[row], tokens[row], length)
        np.testing.assert_array_equal(expected, tokens[row], err_msg="condition fails: new seed")
        np.testing.assert_array_equal(np.asarray(beam)[row], tokens[row])
        np.testing.assert_allclose(float(beam_scores[row]), score, rtol=1e-5, atol=1e-4)


def test_beam_size_1_returns_an_early_eos_that_beats_greedy(params, inputs, greedy):
    """At max_len 10, row 0's greedy path has EOS second best at an early step and that
    shorter hypothesis scores above greedy's final one: beam-1 returns it; the other rows
    equal greedy. Every row matches ``beam1_expectation``."""
    tokens = greedy[0]
    beam, beam_scores = generate(
        params, CONFIG, inputs, method="beam", beam_size=1, alpha=0.0, max_len=MAX_LEN
    )
    logp = teacher_forced_log_probs(params, CONFIG, inputs, tokens)
    differs = []
    for row, length in enumerate(generated_lengths(tokens)):
        expected, score = beam1_expectation(logp[row], tokens[row], length)
        np.testing.assert_array_equal(np.asarray(beam)[row], expected, err_msg=f"row {row}")
        np.testing.assert_allclose(float(beam_scores[row]), score, rtol=1e-5, atol=1e-4)
        differs.append(not np.array_equal(expected, tokens[row]))
    assert differs == [True, False, False], "the seed no longer shows the case: new seed"


def every_sequence(vocab_size: int, max_len: int) -> tuple[list[tuple[int, ...]], np.ndarray,
                                                         jnp.ndarray]:  # fmt: skip
    """Every output of at most ``max_len`` tokens: 0 to max_len - 1 non-EOS ids then EOS, or
    max_len non-EOS ids (truncated). The hypotheses, their lengths and the targets
    `[n, max_len]` (PAD after EOS: causal, never read)."""
    non_eos = [t for t in range(vocab_size) if t != EOS_ID]
    hypotheses = [
        (*body, EOS_ID) for n in range(max_len) for body in itertools.product(non_eos, repeat=n)
    ]
    hypotheses += list(itertools.product(non_eos, repeat=max_len))
    lengths = np.array([len(h) for h in hypotheses])
    return hypotheses, lengths, padded([list(h) for h in hypotheses], max_len)


def penalised_scores(logp, targets, lengths, alpha: float) -> np.ndarray:
    """Each target's summed log-probability under ``logp`` `[n, max_len, vocab]` over its
    length, divided by the GNMT length penalty (beam search's score)."""
    picked = np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)[..., 0]
    total = np.where(np.arange(logp.shape[1]) < lengths[:, None], picked, 0.0).sum(-1)
    return total / np.asarray(length_penalty(lengths, alpha))


def greedy_path(logp, hypotheses, max_len: int) -> tuple[int, ...]:
    """Greedy's path read from the enumeration's table ``logp`` `[n, max_len, vocab]`."""
    path: tuple[int, ...] = ()
    while len(path) < max_len and EOS_ID not in path:
        t = len(path)
        i = next(i for i, h in enumerate(hypotheses) if h[:t] == path)
        path += (int(np.argmax(logp[i, t])),)
    return path


def test_beam_as_wide_as_the_search_space_finds_the_exhaustive_best():
    """Vocabulary 5 (PAD, EOS, BOS, UNK and one symbol), max_len 4: a hypothesis is 0-3
    non-EOS tokens then EOS, or 4 non-EOS tokens (truncated): 1 + 4 + 16 + 64 + 256 = 341
    sequences. With 64 beams (every live prefix of length 3) nothing is ever pruned, so beam
    search must return the sequence with the best GNMT-penalised score among all of them.
    The search may emit PAD, BOS and UNK too (the model gives them probability), so the
    enumeration includes them."""
    config = CONFIG.replace(vocab_size=5, d_model=16, d_ff=32)
    # Seed chosen so that the best sequence is not greedy's in either row (checked below).
    params = init_params(config, seed=6, scale=1.0)
    inputs = padded([[4, 4, 1], [4, 1, 0]])
    max_len, alpha, beam_size = 4, 0.6, 64
    sequences, scores = generate(
        params, config, inputs, method="beam", beam_size=beam_size, alpha=alpha, max_len=max_len
    )
    hypotheses, lengths, targets = every_sequence(config.vocab_size, max_len)
    assert len(hypotheses) == 341
    for row in range(inputs.shape[0]):
        source = jnp.repeat(inputs[row : row + 1], len(hypotheses), axis=0)
        logp = teacher_forced_log_probs(params, config, source, targets)
        penalised = penalised_scores(logp, targets, lengths, alpha)
        best = int(np.argmax(penalised))
        # Greedy's path read from the same table: the test must tell beam search from greedy.
        greedy = greedy_path(logp, hypotheses, max_len)
        assert greedy != hypotheses[best], f"row {row}: greedy finds the best too; new seed"
        np.testing.assert_array_equal(np.asarray(sequences)[row], np.asarray(targets)[best])
        np.testing.assert_allclose(float(scores[row]), penalised[best], rtol=1e-5, atol=1e-5)
        # A runner-up close to the best would make the comparison a matter of rounding.
        runner_up = np.sort(penalised)[-2]
        assert penalised[best] - runner_up > 1e-4, (row, penalised[best], runner_up)


# ----------------------------------------------------------------------------- ensembles


def test_an_ensemble_searches_the_mean_of_its_models_distributions():
    """Two models as one (``generate(params=(a, b))``): at every step the search sees log of
    the mean of their next-token probabilities. Checked against the 341-sequence enumeration
    above, each sequence scored under the mean of the two models' teacher-forced
    probabilities: beam search (64 beams, nothing pruned; the cache in place and reordered)
    returns the best of them and greedy follows the mean's argmax. The seeds are chosen so
    that the ensemble's best sequence is neither model's own best (checked below)."""
    config = CONFIG.replace(vocab_size=5, d_model=16, d_ff=32)
    members = (init_params(config, seed=6, scale=1.0), init_params(config, seed=8, scale=1.0))
    inputs = padded([[4, 4, 1], [4, 1, 0]])
    max_len, alpha = 4, 0.6
    hypotheses, lengths, targets = every_sequence(config.vocab_size, max_len)
    decoded = beam_both_ways(
        functools.partial(generate, members, config, inputs), alpha=alpha, max_len=max_len
    )
    greedy_tokens, _ = generate(members, config, inputs, method="greedy", max_len=max_len)

    for row in range(inputs.shape[0]):
        source = jnp.repeat(inputs[row : row + 1], len(hypotheses), axis=0)
        logps = [teacher_forced_log_probs(p, config, source, targets).astype(np.float64)
                 for p in members]  # fmt: skip
        check_ensemble_search(row, logps, decoded, greedy_tokens, alpha)


def beam_both_ways(decode, **options) -> dict:
    """``{beam_cache: decode(...)}`` of beam search with 64 beams (nothing pruned in the
    341-sequence space), the cache in place and reordered."""
    return {
        cache: decode(method="beam", beam_size=64, beam_cache=cache, **options)
        for cache in ("in_place", "reorder")
    }


def check_ensemble_search(row: int, logps, decoded: dict, greedy_tokens, alpha: float) -> None:
    """Row ``row`` of an ensemble's searches against the enumeration (``every_sequence``) of
    two models' teacher-forced float64 log-probabilities ``logps`` `[341, max_len, vocab]`:
    each beam search in ``decoded`` ({beam_cache: (tokens, scores)}) returns the best sequence
    under log((p_a + p_b) / 2) and its score, greedy follows that mean's argmax; the seeds
    must make the best neither model's own, with no near-tie."""
    max_len = logps[0].shape[1]
    hypotheses, lengths, targets = every_sequence(logps[0].shape[2], max_len)
    mean = np.logaddexp(logps[0], logps[1]) - np.log(2.0)  # log((p_a + p_b) / 2)
    scores = penalised_scores(mean, targets, lengths, alpha)
    best = int(np.argmax(scores))
    own = [int(np.argmax(penalised_scores(lp, targets, lengths, alpha))) for lp in logps]
    assert best not in own, "new seeds"
    assert scores[best] - np.sort(scores)[-2] > 1e-3, "near-tie: new seeds"
    for cache, (sequences, got) in decoded.items():
        np.testing.assert_array_equal(
            np.asarray(sequences)[row], np.asarray(targets)[best], err_msg=cache
        )
        np.testing.assert_allclose(float(got[row]), scores[best], rtol=1e-5, atol=1e-5)
    path = greedy_path(mean, hypotheses, max_len)
    np.testing.assert_array_equal(
        np.asarray(greedy_tokens)[row], np.asarray(padded([list(path)], max_len))[0]
    )


@functools.partial(jax.jit, static_argnums=1)
def lm_logits(params, config, decoder_inputs):
    """A DecoderOnly's logits `[batch, t, vocab]` of its (shifted) inputs, no cache."""
    model = DecoderOnly(config)
    return model.apply({"params": params}, decoder_inputs, method=model.decode)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "relative"])
def test_a_left_padded_prompt_continues_at_its_own_positions(position):
    """``continue_prompt(prompt_mask=...)`` with the position encodings that are not rotary
    (tests/interop/test_hf_llama.py covers rotary against transformers): sinusoids and a
    learned table enter at the embeddings, where a left-padded row's positions must count its
    real tokens only; T5's relative bias sees distances. Greedy follows the argmax (top-2
    margins asserted) of the uncached model run on the row's real tokens alone, with its score;
    beam 4 (cache in place) continues the row as it continues unpadded."""
    config = CONFIG.replace(vocab_size=11, d_model=16, d_ff=32, num_decoder_layers=2,
                            max_len=24, position=position, norm_position="pre")  # fmt: skip
    model = DecoderOnly(config)
    variables = jax.jit(model.init)(jax.random.key(1), jnp.ones((1, 4), jnp.int32))
    params = nn.meta.unbox(variables["params"])
    prompt = np.array([[5, 7, 3, 9, 4, 6], [PAD_ID, PAD_ID, PAD_ID, 8, 3, 10]], np.int32)
    mask = (np.arange(6)[None] >= np.array([[0], [3]])).astype(np.int32)
    real = prompt[1:, 3:]
    new = 5
    tokens, scores = continue_prompt(params, config, prompt, method="greedy", max_len=new,
                                     prompt_mask=mask)  # fmt: skip
    got = np.asarray(tokens)[1]
    eos = np.flatnonzero(got == EOS_ID)
    got = got[: eos[0] + 1] if eos.size else got
    # One teacher-forced call over BOS, the real tokens and the continuation: each new token
    # must be the argmax (by a margin) of the logits before it.
    context = np.concatenate([[BOS_ID], real[0], got[:-1]]).astype(np.int32)
    logits = np.asarray(lm_logits(params, config, jnp.asarray(context[None])), np.float64)[0]
    logits = logits[len(real[0]) :]  # [len(got), vocab]: the logits that chose each new token
    top = np.sort(logits, axis=-1)[:, -2:]
    assert (top[:, 1] - top[:, 0] > MIN_MARGIN).all()
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    score = logp[np.arange(len(got)), got].sum()
    np.testing.assert_allclose(float(scores[1]), score, rtol=1e-5, atol=1e-5)
    beam = {"method": "beam", "beam_size": 4, "max_len": new, "beam_cache": "in_place"}
    padded, padded_scores = continue_prompt(params, config, prompt, prompt_mask=mask, **beam)
    alone, alone_scores = continue_prompt(params, config, real, **beam)
    np.testing.assert_array_equal(np.asarray(padded)[1], np.asarray(alone)[0])
    np.testing.assert_allclose(float(padded_scores[1]), float(alone_scores[0]), rtol=1e-5)


def test_an_ensemble_of_language_models_continues_with_the_mean_of_their_distributions():
    """``continue_prompt(params=(a, b))``: two DecoderOnly models continue a prompt as one.
    Each of the 341 continuations (at most 4 tokens, vocabulary 5) is scored under the mean
    of the two models' teacher-forced probabilities after BOS and the prompt: beam search
    (64 beams, in place and reordered) returns the best, greedy follows the mean's argmax."""
    config = CONFIG.replace(vocab_size=5, d_model=16, d_ff=32)
    tokens = jnp.ones((1, 4), jnp.int32)
    members = tuple(
        nn.meta.unbox(jax.jit(DecoderOnly(config).init)(jax.random.key(seed), tokens)["params"])
        for seed in (1, 10)  # seeds that make the best neither model's own (asserted)
    )
    prompts = np.array([[4, 4], [4, 3]], np.int32)
    max_len, alpha = 4, 0.6
    decoded = beam_both_ways(
        functools.partial(continue_prompt, members, config, prompts), alpha=alpha, max_len=max_len
    )
    greedy_tokens, _ = continue_prompt(members, config, prompts, method="greedy", max_len=max_len)
    _, _, targets = every_sequence(config.vocab_size, max_len)
    for row, prompt in enumerate(prompts):
        context = np.concatenate([[BOS_ID], prompt])
        inputs = np.concatenate(
            [np.repeat(context[None], targets.shape[0], axis=0), np.asarray(targets)[:, :-1]],
            axis=1,
        ).astype(np.int32)
        logps = [
            np.asarray(jax.nn.log_softmax(lm_logits(p, config, jnp.asarray(inputs)), axis=-1),
                       np.float64)[:, len(context) - 1 :]
            for p in members
        ]  # fmt: skip
        check_ensemble_search(row, logps, decoded, greedy_tokens, alpha)


def test_an_ensemble_of_one_model_twice_decodes_as_the_model(params, inputs, greedy):
    tokens, scores = greedy
    twice, twice_scores = generate((params, params), CONFIG, inputs, method="greedy",
                                   max_len=MAX_LEN)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(twice), tokens)
    np.testing.assert_allclose(np.asarray(twice_scores), scores, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="params: an empty sequence"):
        generate((), CONFIG, inputs)


def test_an_ensemble_samples_from_the_mean_of_its_models_distributions():
    """Ancestral sampling of two models as one: 4,000 draws of the first token follow the
    float64 mean of the two models' probabilities (each frequency within 4 standard errors),
    which the seeds make far (over 10 standard errors on some token) from either model's
    own distribution and from the normalised geometric mean (the mean of log-probabilities);
    every draw's score is the mean's log-probability of its tokens (teacher-forced)."""
    config = CONFIG.replace(vocab_size=5, d_model=16, d_ff=32)
    members = (init_params(config, seed=6, scale=3.0), init_params(config, seed=8, scale=3.0))
    draws, max_len = 4000, 3
    inputs = jnp.repeat(padded([[4, 3, 1]]), draws, axis=0)
    tokens, scores = generate(
        members, config, inputs, method="sample", max_len=max_len, rng=jax.random.key(0)
    )
    tokens = np.asarray(tokens)
    logps = [teacher_forced_log_probs(p, config, inputs, tokens).astype(np.float64)
             for p in members]  # fmt: skip
    mean = np.logaddexp(logps[0], logps[1]) - np.log(2.0)
    want = np.exp(mean[0, 0])  # the first step does not depend on what is drawn
    std_err = np.sqrt(want * (1.0 - want) / draws)
    freq = np.bincount(tokens[:, 0], minlength=config.vocab_size) / draws
    assert np.all(np.abs(freq - want) <= 4.0 * std_err + 1e-9), (freq, want)
    geometric = (logps[0][0, 0] + logps[1][0, 0]) / 2
    for other in (np.exp(logps[0][0, 0]), np.exp(logps[1][0, 0]),
                  np.exp(geometric - np.logaddexp.reduce(geometric))):  # fmt: skip
        assert np.max(np.abs(other - want) / std_err) > 10.0, "new seeds"
    live = np.cumsum(tokens == EOS_ID, axis=1) - (tokens == EOS_ID) == 0
    picked = np.take_along_axis(mean, tokens[..., None], axis=-1)[..., 0]
    assert live[:, 1:].any()  # draws of more than one token
    np.testing.assert_allclose(
        np.asarray(scores), np.where(live, picked, 0.0).sum(-1), rtol=1e-5, atol=1e-5
    )


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_deterministic_for_a_key(params, inputs):
    def draw(seed):
        tokens, _ = generate(
            params,
            CONFIG,
            inputs,
            method="sample",
            temperature=4.0,  # flat enough that two keys really differ
            max_len=MAX_LEN,
            rng=jax.random.key(seed),
        )
        return np.asarray(tokens)

    np.testing.assert_array_equal(draw(0), draw(0))
    assert not np.array_equal(draw(0), draw(1))


@pytest.mark.parametrize(
    "options",
    [dict(temperature=0.0), dict(temperature=1e-4), dict(temperature=1.0, top_k=1)],
    ids=["temperature0", "temperature1e-4", "top_k1"],
)
def test_sampling_limits_equal_greedy(params, inputs, greedy, options):
    tokens, scores = generate(
        params, CONFIG, inputs, method="sample", max_len=MAX_LEN, rng=jax.random.key(3), **options
    )
    np.testing.assert_array_equal(np.asarray(tokens), greedy[0])
    # Scores are under the unmodified model distribution, so they match greedy's too.
    np.testing.assert_allclose(np.asarray(scores), greedy[1], rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- bad arguments


def test_unknown_method_names_the_argument(params, inputs):
    with pytest.raises(ValueError, match="method"):
        generate(params, CONFIG, inputs, method="nucleus")


def test_inputs_that_are_not_a_batch_of_rows_name_the_argument(params):
    with pytest.raises(ValueError, match=r"inputs must be \[batch, length\]"):
        generate(params, CONFIG, np.array([5, 9, 1]), max_len=4)


def test_sampling_without_rng_fails(params, inputs):
    with pytest.raises(ValueError, match="rng"):
        generate(params, CONFIG, inputs, method="sample", max_len=MAX_LEN)


# ----------------------------------------------------------------------------- meshes


def test_cache_sharding_splits_batch_and_divisible_kv_heads():
    # AbstractMesh: the rule needs only axis sizes. [batch, kv_heads, length, head_dim]: batch
    # 6 over data x fsdp = 2, kv_heads 4 over tensor 2; scalars (the cache index) replicated.
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((1, 2, 2), sharding.MESH_AXES)
    spec = sharding.cache_sharding((6, 4, 10, 8), mesh).spec
    assert spec == PartitionSpec(("data", "fsdp"), "tensor", None, None)
    assert sharding.cache_sharding((6, 3, 10, 8), mesh).spec == PartitionSpec(
        ("data", "fsdp"), None, None, None
    )
    assert sharding.cache_sharding((), mesh).spec == PartitionSpec()


def test_cache_sharding_leaves_what_the_mesh_does_not_divide_whole():
    # AbstractMesh: the rule needs only axis sizes, so 8 devices are not needed here.
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((2, 1, 4), sharding.MESH_AXES)
    assert sharding.cache_sharding((6, 4, 10, 8), mesh).spec == PartitionSpec(
        ("data", "fsdp"), "tensor", None, None
    )
    # Multi-query attention (1 kv head) and an odd row count: replicated there.
    assert sharding.cache_sharding((5, 1, 10, 8), mesh).spec == PartitionSpec(
        None, None, None, None
    )


@pytest.fixture(scope="module")
def sharded_decoding(tmp_path_factory):
    """tests/helpers/sharded_decode.py on 8 simulated devices: one device, (8,1,1) and
    (2,1,4), greedy and beam 4, an ensemble, continue_prompt and the Translator, in one
    subprocess."""
    out = tmp_path_factory.mktemp("sharded_decoding")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "sharded_decode.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(np.load(out / "results.npz")), json.loads((out / "facts.json").read_text())


@pytest.mark.parametrize("mesh", ["8x1x1", "2x1x4"])
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_eight_devices_decode_the_tokens_of_one(sharded_decoding, mesh, method):
    results, facts = sharded_decoding
    ref, got = results[f"one/{method}/tokens"], results[f"{mesh}/{method}/tokens"]
    assert ref.shape == got.shape == (5, MAX_LEN)  # 5 rows: padded to 8 or 6, then dropped
    assert len(set(generated_lengths(ref))) > 1 and len({tuple(r) for r in ref}) == 5
    assert (results["one/beam/tokens"] != results["one/greedy/tokens"]).any()
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(
        results[f"{mesh}/{method}/scores"], results[f"one/{method}/scores"], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_eight_devices_attend_over_the_written_prefix_as_one_device(sharded_decoding, method):
    """A cache of 70 slots, each step over the prefix holding its written slots (a conditional
    per layer), heads split over "tensor" on 2 x 4: one device's tokens and scores, with rows
    that end early and rows that run to the limit through both prefixes."""
    results, _ = sharded_decoding
    ref, got = results[f"one/{method}_long/tokens"], results[f"2x1x4/{method}_long/tokens"]
    lengths = generated_lengths(ref)
    assert ref.shape == (5, 70) and min(lengths) < 32 and max(lengths) == 70, lengths
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(
        results[f"2x1x4/{method}_long/scores"], results[f"one/{method}_long/scores"], rtol=1e-5,
        atol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_eight_devices_decode_an_ensemble_as_one_device(sharded_decoding, method):
    """Two models as one on 2 x 4 (each model's cache split as one model's): one device's
    tokens and scores, which differ from the first model's own (the second one counts)."""
    results, _ = sharded_decoding
    ref, got = results[f"one/ensemble_{method}/tokens"], results[f"2x1x4/ensemble_{method}/tokens"]
    assert (ref != results[f"one/{method}/tokens"]).any()
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(
        results[f"2x1x4/ensemble_{method}/scores"], results[f"one/ensemble_{method}/scores"],
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


def test_sharded_decoding_compiles_once_per_shape_and_splits_heads(sharded_decoding):
    results, facts = sharded_decoding
    assert facts["compiles"] == 6  # 3 meshes x 2 methods
    assert facts["compiles_after_same_shape"] == 6
    assert facts["query_kernel_spec"] == ["fsdp", "tensor", None]  # heads over tensor
    np.testing.assert_array_equal(results["2x1x4/lm/tokens"], results["one/lm/tokens"])
    # The Translator (and so the CLIs) decodes on every device by default, and gives what one
    # device's tokens spell.
    assert facts["translator_devices"] == 8
    assert facts["translator"] == facts["one_greedy_decoded"]
