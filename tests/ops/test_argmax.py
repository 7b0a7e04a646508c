"""ops.argmax.row_argmax against NumPy's argmax (the first index of the maximum, the first NaN
if any): random rows with ties, NaN, +-inf and maxima placed at block edges, every block
layout (whole blocks, a short last block, a single block), several leading shapes and float
dtypes, under jit and vmap; and greedy decoding, which chooses its tokens with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops.argmax import divisor_near, row_argmax


def adversarial_rows(n: int, block: int, rows: int, seed: int) -> np.ndarray:
    """float32 `[rows, n]` from a few distinct values (many ties), then special rows."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (rows, n)).astype(np.float32)
    specials = [
        lambda r: r.fill(-np.inf),  # all -inf: index 0
        lambda r: r.fill(np.nan),  # all NaN: index 0
        lambda r: r.fill(2.5),  # all equal: index 0
        lambda r: r.__setitem__([n - 1], 9.0),  # the last element
        lambda r: r.__setitem__([min(block, n - 1) - 1, min(block, n - 1)], 9.0),  # a block edge
        lambda r: r.__setitem__([n - 1, 0], 9.0),  # a tie, first and last
        lambda r: r.__setitem__([1, n - 2], [np.inf, np.nan]),  # NaN after +inf: the NaN
        lambda r: r.__setitem__([n // 2, n - 1], np.nan),  # two NaN: the first
        lambda r: r.__setitem__([min(2 * block, n - 1)], np.inf),
        lambda r: r.__setitem__(slice(None), -np.inf) or r.__setitem__([n - 1], -1.0),
        # +inf and -inf in one block sum to NaN like a NaN: the +inf is the answer,
        lambda r: r.__setitem__([0, min(1, n - 1)], [-np.inf, np.inf]),
        # or a later NaN is.
        lambda r: r.__setitem__([0, 1, n - 1], [np.inf, -np.inf, np.nan]),
    ]
    for i, special in enumerate(specials):
        if i < rows:
            special(x[i])
    return x


@pytest.mark.parametrize(
    "n, block",
    [
        (58101, 512),  # opus-mt's vocabulary: 107 blocks of 543
        (8000, 512),  # Multi30k's: 16 blocks of 500
        (1000, 4),  # many blocks of 4 (1000 = 250 x 4)
        (37, 4),  # prime: 9 blocks of 4 and a short last block of 1
        (103, 16),  # prime: 6 blocks of 16 and a short last one of 7
        (10, 4),  # two blocks of 5 (divisor_near)
        (7, 4),  # one block of 7: jnp.argmax itself
    ],
)
def test_row_argmax_equals_numpys_first_index_argmax(n, block):
    x = adversarial_rows(n, divisor_near(n, block), rows=24, seed=n)
    argmax = jax.jit(row_argmax, static_argnums=1)
    # Without the +-inf rows (the block maxima decide) and with them (rows 10-11, for which
    # the batch takes the plain argmax), and those rows moved among plain rows.
    for rows in (np.r_[0:10, 12:24], np.arange(24), np.r_[12:18, 10, 18:24, 11]):
        got = np.asarray(argmax(jnp.asarray(x[rows]), block))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(x[rows], axis=-1))


def test_row_argmax_over_leading_axes_dtypes_and_vmap():
    x = adversarial_rows(999, divisor_near(999, 64), rows=30, seed=1)  # 999 = 27 x 37
    expected = np.argmax(x, axis=-1)
    three = jnp.asarray(x.reshape(5, 6, 999))
    np.testing.assert_array_equal(row_argmax(three, 64), expected.reshape(5, 6))
    np.testing.assert_array_equal(jax.vmap(lambda r: row_argmax(r, 64))(jnp.asarray(x)), expected)
    np.testing.assert_array_equal(row_argmax(jnp.asarray(x[7]), 64), expected[7])  # one row
    for dtype in (jnp.bfloat16, jnp.float16):
        low = jnp.asarray(x, dtype)  # the values are small integers, +-inf and NaN: exact
        np.testing.assert_array_equal(row_argmax(low, 64), np.argmax(np.asarray(low), -1))


def test_row_argmax_refuses_integer_input():
    with pytest.raises(TypeError, match="row_argmax: x must be a float array; got int32"):
        row_argmax(jnp.zeros((2, 600), jnp.int32))


def test_divisor_near_prefers_a_divisor_of_the_row():
    assert divisor_near(58101, 512) == 543 and 58101 % 543 == 0
    assert divisor_near(58101, 128) == 107
    assert divisor_near(8000, 512) == 500
    assert divisor_near(37, 4) == 4  # no divisor within a factor 2: the block itself
