"""What an encoder or decoder stack shares between its layers: the loop over them (unrolled or
one ``nn.scan``), the residual stream's sharding names, T5's relative position bias."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops import positions as pos_lib

Array = jax.Array


def constrain_residual(x: Array) -> Array:
    """Names the axes of the residual stream `[batch, length, d_model]` for sharding rules
    (batch split over data-parallel devices); a no-op outside a mesh."""
    return nn.with_logical_constraint(
        x, ("activation_batch", "activation_length", "activation_embed")
    )


def layer_stack(
    make_layer: Callable[[str, int], nn.Module], config: TransformerConfig, num_layers: int,
    x: Array, *shared: Any,
) -> Array:  # fmt: skip
    """``num_layers`` layers applied in turn to x `[batch, length, d_model]`.

    ``make_layer(name, index)`` builds layer ``index`` (an ``EncoderLayer`` or
    ``DecoderLayer``, flags as attributes) called as ``layer(x, *shared) -> x``; ``shared``
    (masks, positions, encoder output) is the same for every layer. Unrolled, the layers are
    ``layers_0`` ... ``layers_{N-1}``. With ``config.scan_layers`` they are one ``nn.scan``
    over a single layer named ``layers`` (built with index 0): parameters stacked on a leading
    axis `[num_layers, ...]` (logical axis "layers"), fresh parameter and dropout RNGs per
    layer, sown intermediates (attention weights) and losses (mixture-of-experts auxiliary
    losses) stacked the same way. ``config.remat`` recomputes each layer's activations in the
    backward pass.
    """

    def step(layer: nn.Module, x: Array, *shared: Any) -> tuple[Array, None]:
        return constrain_residual(layer(x, *shared)), None

    if config.scan_layers:
        if config.remat:
            step = nn.remat(step, prevent_cse=False)  # inside a scan, CSE cannot undo the remat
        scan = nn.scan(
            step,
            variable_axes={"params": 0, "intermediates": 0, "losses": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * len(shared),
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return scan(make_layer("layers", 0), x, *shared)[0]
    if config.remat:
        step = nn.remat(step)
    for i in range(num_layers):
        x, _ = step(make_layer(f"layers_{i}", i), x, *shared)
    return x


def relative_bias(config: TransformerConfig, *, bidirectional: bool) -> nn.Module:
    """The stack's T5 relative position bias (``position="relative"``), shared by its layers:
    parameters ``relative_bias`` `[num_buckets, heads]`, outside the (scanned) layers."""
    return pos_lib.RelativePositionBias(
        num_heads=config.num_heads,
        num_buckets=config.relative_num_buckets,
        max_distance=config.relative_max_distance,
        bidirectional=bidirectional,
        param_dtype=config.parameter_dtype,
        name="relative_bias",
    )
