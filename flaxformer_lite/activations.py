"""The feed-forward non-linearities by name: the one list that ``TransformerConfig.activation``
is checked against and ``layers.MlpBlock`` applies."""

from __future__ import annotations

import flax.linen as nn

# name -> element-wise function. "swiglu" and "geglu" are gated (Shazeer 2020): the function is
# applied to one projection and multiplied by a second, linear one.
ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "swiglu": nn.silu,
    "geglu": nn.gelu,
}
GATED = ("swiglu", "geglu")
