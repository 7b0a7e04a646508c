"""The feed-forward non-linearities by name: the one list that ``TransformerConfig.activation``
is checked against and ``nn.mlp.MlpBlock`` applies."""

from __future__ import annotations

import functools

import flax.linen as nn

# name -> element-wise function. "swiglu" and "geglu" are gated (Shazeer 2020): the function is
# applied to one projection and multiplied by a second, linear one.
ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": nn.gelu,  # the tanh approximation (GPT-2's; Hugging Face's "gelu_new")
    "gelu_exact": functools.partial(nn.gelu, approximate=False),  # erf (Hugging Face's "gelu")
    "silu": nn.silu,  # x * sigmoid(x), a.k.a. swish (Marian's)
    "swiglu": nn.silu,
    "geglu": nn.gelu,
}
GATED = ("swiglu", "geglu")
