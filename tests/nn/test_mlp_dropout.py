"""``MlpBlock(dropout_rate=...)`` (``TransformerConfig.activation_dropout_rate``, BART's
``activation_dropout``): dropout on the hidden units between the activation and the output
projection, checked against NumPy: the hidden units are recovered from the output through the
output kernel (full row rank: d_ff < d_model), and each is either dropped or scaled by
1 / (1 - rate)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import erf

from flaxformer_lite.nn.mlp import MlpBlock

D_MODEL, D_FF, RATE = 16, 8, 0.25


def test_hidden_units_are_dropped_or_scaled_and_deterministic_calls_are_unchanged():
    x = jax.random.normal(jax.random.key(0), (4, 64, D_MODEL))
    block = MlpBlock(d_ff=D_FF, activation="gelu_exact", dropout_rate=RATE)
    variables = block.init(jax.random.key(1), x)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), nn.meta.unbox(variables))
    p = p["params"]
    xs = np.asarray(x, np.float64)
    pre = xs @ p["wi"]["kernel"] + p["wi"]["bias"]
    hidden = 0.5 * pre * (1.0 + erf(pre / np.sqrt(2.0)))  # exact GELU

    # Deterministic: the block without dropout, bitwise.
    plain = MlpBlock(d_ff=D_FF, activation="gelu_exact").apply(variables, x)
    np.testing.assert_array_equal(np.asarray(block.apply(variables, x)), np.asarray(plain))
    np.testing.assert_allclose(
        np.asarray(plain), hidden @ p["wo"]["kernel"] + p["wo"]["bias"], atol=1e-5
    )

    # Training: out = (hidden * keep / (1 - rate)) @ wo + b; solve for the hidden units.
    out = block.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    target = np.asarray(out, np.float64) - p["wo"]["bias"]
    dropped = np.linalg.lstsq(p["wo"]["kernel"].T, target.reshape(-1, D_MODEL).T, rcond=None)[0]
    dropped = dropped.T.reshape(hidden.shape)
    kept = np.abs(dropped - hidden / (1 - RATE)) < 1e-4
    zero = np.abs(dropped) < 1e-4
    assert (kept | zero).all()
    share = 1.0 - kept.mean()
    assert abs(share - RATE) < 0.05, share  # 2048 units: ~0.01 standard deviation
    assert not np.array_equal(np.asarray(out), np.asarray(plain))
    assert jnp.isfinite(out).all()
