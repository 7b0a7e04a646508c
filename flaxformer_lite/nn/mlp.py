"""The position-wise feed-forward block (the paper's section 3.3) and its gated variants."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.core.logical_params import logical_init
from flaxformer_lite.nn.dense import Int8Dense
from flaxformer_lite.nn.flax_layers import Dense
from flaxformer_lite.ops.activations import ACTIVATIONS, GATED
from flaxformer_lite.ops.precision import dot_general_in

Array = jax.Array
Dtype = Any

_xavier = nn.initializers.xavier_uniform()
_zeros = nn.initializers.zeros_init()


class MlpBlock(nn.Module):
    """Position-wise feed-forward network: `[..., features]` -> `[..., features]`.

    "relu" is the paper's max(0, xW1 + b1)W2 + b2; "gelu" swaps the non-linearity; "swiglu" and
    "geglu" are the gated variants act(xW_gate) * (xW_up) W_down (Shazeer 2020). The names are
    ``activations.ACTIVATIONS``. The paper's residual dropout follows the block (``residual``);
    ``dropout_rate`` > 0 also drops hidden units after the activation (and gate), before the
    output projection (BART's ``activation_dropout``; off when ``deterministic``).
    ``quantization="int8"``: ``Int8Dense`` layers instead of ``nn.Dense``.
    """

    d_ff: int
    activation: str = "relu"
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None
    int8_kernel: str = "auto"  # with an int8 kernel: what multiplies it (quantize.int8_product)
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        def dense(features: int, names: tuple[str, str], name: str) -> nn.Module:
            if self.quantization is not None:
                return Int8Dense(
                    features, names, self.use_bias, self.dtype, self.int8_kernel, name=name
                )
            return Dense(
                features,
                use_bias=self.use_bias,
                kernel_init=logical_init(_xavier, names),
                bias_init=logical_init(_zeros, (names[1],)),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=dot_general_in,  # bfloat16: a float32 sum (ops.precision)
                name=name,
            )

        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}; got {self.activation!r}"
            )
        h = ACTIVATIONS[self.activation](dense(self.d_ff, ("embed", "mlp"), "wi")(x))
        if self.activation in GATED:
            h = h * dense(self.d_ff, ("embed", "mlp"), "wi_up")(x)
        if self.dropout_rate > 0:
            h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return dense(x.shape[-1], ("mlp", "embed"), "wo")(h)
