"""Position encodings against the paper's formula and rotary's relative property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops import positions


def test_sinusoidal_matches_paper_formula_elementwise():
    length, dim = 7, 10
    table = np.asarray(positions.sinusoidal(length, dim))
    assert table.shape == (length, dim) and table.dtype == np.float32
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)
    np.testing.assert_array_equal(table[0, 0::2], 0.0)
    np.testing.assert_array_equal(table[0, 1::2], 1.0)


def test_sinusoidal_odd_dim_rejected():
    with pytest.raises(ValueError, match="dim"):
        positions.sinusoidal(4, 5)


def test_rotary_depends_only_on_distance():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)

    def score(m, n):
        rq = positions.rotary(q, jnp.array([[m]]))
        rk = positions.rotary(k, jnp.array([[n]]))
        return float(jnp.sum(rq * rk))

    assert score(3, 1) == pytest.approx(score(7, 5), rel=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
    # A rotation keeps the norm.
    r = positions.rotary(q, jnp.array([[11]]))
    assert float(jnp.linalg.norm(r)) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)


def test_learned_positions_gather_by_position():
    module = positions.LearnedPositions(max_len=6, dim=4)
    x = jnp.zeros((1, 3, 4))
    pos = jnp.array([[0, 0, 5]])
    variables = module.init(jax.random.key(0), x, pos)
    out = module.apply(variables, x, pos)
    table = jax.tree_util.tree_leaves(variables)[0]
    np.testing.assert_array_equal(out[0, 0], table[0])
    np.testing.assert_array_equal(out[0, 1], table[0])
    np.testing.assert_array_equal(out[0, 2], table[5])


def test_learned_positions_with_an_offset_skip_the_leading_rows():
    """BART's table: `[offset + max_len, dim]`, position p reads row p + offset."""
    module = positions.LearnedPositions(max_len=6, dim=4, offset=2)
    x = jnp.ones((1, 3, 4))
    pos = jnp.array([[0, 3, 5]])
    variables = module.init(jax.random.key(0), x, pos)
    table = np.asarray(jax.tree_util.tree_leaves(variables)[0])
    assert table.shape == (8, 4)
    out = np.asarray(module.apply(variables, x, pos))
    np.testing.assert_array_equal(out[0], 1.0 + table[[2, 5, 7]])
