"""Masks against hand-written expected matrices."""

import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops import masks


def test_padding_mask_hand_written():
    q = jnp.array([[5, 6, 0]])
    k = jnp.array([[7, 0]])
    expected = np.array([[[[1, 0], [1, 0], [0, 0]]]], dtype=bool)
    got = masks.padding_mask(q, k)
    assert got.shape == (1, 1, 3, 2) and got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, expected)


def test_padding_mask_custom_pad_id():
    tokens = jnp.array([[9, 3, 9]])
    got = masks.padding_mask(tokens, tokens, pad_id=9)
    expected = np.zeros((1, 1, 3, 3), bool)
    expected[0, 0, 1, 1] = True
    np.testing.assert_array_equal(got, expected)


def test_causal_mask_hand_written():
    expected = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=bool)[None, None]
    np.testing.assert_array_equal(masks.causal_mask(3), expected)


def test_segment_mask_with_causal_matches_docstring_example():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    got = masks.combine_masks(masks.causal_mask(6), masks.segment_mask(seg, seg))
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ],
        dtype=bool,
    )[None, None]
    np.testing.assert_array_equal(got, expected)


def test_segment_mask_cross():
    q = jnp.array([[1, 2, 0]])
    k = jnp.array([[1, 1, 2, 2]])
    expected = np.array([[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=bool)[None, None]
    np.testing.assert_array_equal(masks.segment_mask(q, k), expected)


def test_local_mask_window_one():
    expected = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=bool)[
        None, None
    ]
    np.testing.assert_array_equal(masks.local_mask(4, 1), expected)
    with pytest.raises(ValueError, match="window"):
        masks.local_mask(4, -1)


def test_combine_masks_none_and_and():
    assert masks.combine_masks(None, None) is None
    a = masks.causal_mask(3)
    np.testing.assert_array_equal(masks.combine_masks(None, a), a)
    b = jnp.array([[[[True, False, True]]]])
    expected = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 1]], dtype=bool)[None, None]
    np.testing.assert_array_equal(masks.combine_masks(a, None, b), expected)
    with pytest.raises(ValueError, match="boolean"):
        masks.combine_masks(a, jnp.ones((1, 1, 3, 3)))
