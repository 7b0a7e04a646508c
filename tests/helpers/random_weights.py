"""Random parameters for the tests that compare two paths of one model (or a model with the
float64 reference), drawn by NumPy over ``model.init``'s shapes: nothing compiles."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np


def random_params(model: nn.Module, *inputs, seed: int = 1) -> dict:
    """float32 NumPy parameters of ``model`` drawn away from its initialisation: biases and norm
    offsets non-zero, norm scales 1 +- 0.1 (so a dropped or misplaced one changes the logits),
    tables and kernels N(0, d_model^-1/2). Shapes come from ``jax.eval_shape`` of ``init``:
    nothing is compiled and no JAX op runs per leaf."""
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"])
    rng = np.random.default_rng(seed)
    std = model.config.d_model**-0.5

    def draw(path, leaf):
        name = path[-1].key
        if name == "scale":
            x = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif "bias" in name:
            x = 0.1 * rng.standard_normal(leaf.shape)
        else:
            x = std * rng.standard_normal(leaf.shape)
        return x.astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)
