"""ops.beam_top_k: the fused selection equals the plain one bitwise, ties and fallbacks included.

The expected values come from the definition written out here with jax.nn.log_softmax and one
lax.top_k over the flat ``beam * vocab`` axis (what beam search did before), and the tie
orders from numpy's stable sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flaxformer_lite.ops.beam_top_k import log_softmax_top_k, row_top_k

fused = jax.jit(log_softmax_top_k, static_argnums=(2, 4))


def plain_top_k(logits, offsets, k, banned=None, renormalize=False):
    """The definition: top k of offsets + log_softmax(logits), banned ids -inf (then, with
    renormalize, log_softmax again), flat."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    if banned is not None:
        log_probs = jnp.where(banned, -jnp.inf, log_probs)
    if renormalize:
        log_probs = jax.nn.log_softmax(log_probs, axis=-1)
    batch, beam, vocab = logits.shape
    return lax.top_k((offsets[:, :, None] + log_probs).reshape(batch, beam * vocab), k)


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("beam,vocab", [(4, 50), (2, 300), (1, 20)])
def test_random_logits_equal_the_plain_selection_bitwise(beam, vocab):
    rng = np.random.default_rng(beam * vocab)
    logits = jnp.asarray(rng.standard_normal((3, beam, vocab)) * 4, jnp.float32)
    offsets = jnp.asarray(-rng.random((3, beam)) * 10, jnp.float32)
    k = 2 * beam
    assert_same(fused(logits, offsets, k), plain_top_k(logits, offsets, k))
    banned = jnp.zeros((vocab,), bool).at[jnp.array([0, vocab - 1])].set(True)
    assert_same(
        fused(logits, offsets, k, banned, True), plain_top_k(logits, offsets, k, banned, True)
    )


def test_equal_logits_tie_by_flat_index():
    # Integer logits with many duplicates and equal offsets: ties everywhere.
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.integers(0, 3, (2, 4, 40)), jnp.float32)
    offsets = jnp.zeros((2, 4), jnp.float32)
    values, index = fused(logits, offsets, 8)
    assert_same((values, index), plain_top_k(logits, offsets, 8))
    # Independently: the best value is 2 - log_softmax's normaliser of the row, so the first
    # picks are the lowest flat indices holding the row max of beam 0 and on.
    flat = np.asarray(logits).reshape(2, -1)
    for b in range(2):
        scores = np.asarray(jax.nn.log_softmax(logits[b], axis=-1)).reshape(-1)
        want = np.argsort(-scores, kind="stable")[:8]
        np.testing.assert_array_equal(np.asarray(index[b]), want)
        assert flat[b, want[0]] == 2


def test_logits_that_round_to_one_score_fall_back_to_flat_index_order():
    # Around -2^26 float32 values are 8 apart: log-probs within 1 of each other (about -3.4 ..
    # -2.5 here) all round to the score -2^26, and the reference then orders them by index,
    # not by logit. The row's logits rise with the index, so the per-row top-k (logit order)
    # alone would pick the highest indices.
    vocab = 30
    logits = jnp.tile(jnp.linspace(0.0, 0.9, vocab, dtype=jnp.float32), (1, 2, 1))
    offsets = jnp.full((1, 2), -(2.0**26), jnp.float32)
    values, index = fused(logits, offsets, 4)
    assert_same((values, index), plain_top_k(logits, offsets, 4))
    np.testing.assert_array_equal(np.asarray(index[0]), [0, 1, 2, 3])


@pytest.mark.parametrize("renormalize", [False, True])
def test_impossible_beams_and_banned_ids(renormalize):
    # Beams 1.. without a hypothesis (-inf, beam search's first step) and banned ids.
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((2, 4, 60)), jnp.float32)
    offsets = jnp.asarray([[0.0, -np.inf, -np.inf, -np.inf]] * 2, jnp.float32)
    banned = jnp.zeros((60,), bool).at[jnp.array([3, 7, 59])].set(True)
    values, index = fused(logits, offsets, 8, banned, renormalize)
    assert_same((values, index), plain_top_k(logits, offsets, 8, banned, renormalize))
    assert np.all(np.asarray(index) < 60) and not np.isin(np.asarray(index), [3, 7, 59]).any()


def test_fewer_finite_candidates_than_k():
    # All but 2 ids banned, beam 2: 4 finite candidates for k = 6; the rest are -inf and come
    # in flat-index order, as in the reference.
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 12)), jnp.float32)
    banned = jnp.ones((12,), bool).at[jnp.array([4, 9])].set(False)
    offsets = jnp.asarray([[-1.0, -2.0]], jnp.float32)
    values, index = fused(logits, offsets, 6, banned)
    assert_same((values, index), plain_top_k(logits, offsets, 6, banned))
    assert np.isfinite(np.asarray(values[0, :4])).all() and np.isneginf(values[0, 4:]).all()


def test_a_vocab_not_longer_than_the_selection():
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, 4)), jnp.float32)
    offsets = jnp.asarray([[0.0, -1.0, -2.0]] * 2, jnp.float32)
    assert_same(fused(logits, offsets, 6), plain_top_k(logits, offsets, 6))


@pytest.mark.parametrize(
    "n,block,k",
    [
        (96, 8, 5),  # 8 divides 96: blocks by reshape
        (101, 8, 5),  # prime: no divisor near 8, a short last block (5 elements)
        (90, 8, 3),  # 9 divides 90: blocks of 9
        (40, 8, 5),  # 5 blocks: not more than k, the plain top-k
    ],
)
def test_row_top_k_equals_lax_top_k_with_ties_and_infinities(n, block, k):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 4, (3, 2, n)).astype(np.float32)  # many equal values, across blocks
    x[0, 0] = rng.standard_normal(n)
    x[1, 1, : n // 2] = -np.inf
    x[2, 0, -3:] = 9.0  # the best in the (short) last block
    got = jax.jit(row_top_k, static_argnums=(1, 2))(jnp.asarray(x), k, block)
    # Independently: a stable sort of the negated values (ties to the lower index).
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.asarray(got[1]), order)
    np.testing.assert_array_equal(np.asarray(got[0]), np.take_along_axis(x, order, -1))


@pytest.mark.parametrize(
    "logits_shape,offsets_shape,k,message",
    [
        ((2, 10), (2,), 2, r"logits must be \[batch, beam, vocab\]"),
        ((2, 3, 10), (2, 4), 2, r"offsets must be \[batch, beam\]"),
        ((2, 3, 10), (2, 3), 31, r"k must be an int in \[1, beam \* vocab\]"),
        ((2, 3, 10), (2, 3), 0, r"k must be an int"),
    ],
)
def test_bad_shapes_are_refused(logits_shape, offsets_shape, k, message):
    with pytest.raises(ValueError, match=message):
        log_softmax_top_k(jnp.zeros(logits_shape), jnp.zeros(offsets_shape), k)


def test_bad_banned_mask_is_refused():
    with pytest.raises(ValueError, match=r"banned must be bool \[vocab=10\]"):
        log_softmax_top_k(jnp.zeros((1, 2, 10)), jnp.zeros((1, 2)), 2, jnp.zeros((9,), bool))
