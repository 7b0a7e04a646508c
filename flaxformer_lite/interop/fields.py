"""What a family can express: the differences of a ``TransformerConfig`` from a family's
fixed choices, one line each, and the special ids an encoder-decoder's generation config names.

Every family module's ``problems`` is its ``wanted`` values plus what it alone checks; the
checks every family shares (activation, mixture-of-experts layers, int8 weights) are here once,
so their messages agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flaxformer_lite.nn.config import TransformerConfig


def differences(
    config: TransformerConfig,
    family: str,
    wanted: Mapping[str, Any],
    *,
    activations: Iterable[str] | None,
    dequantize: bool,
    decoder_only: bool = False,
) -> list[str]:
    """``name=value (family: wanted value)`` for each field of ``wanted`` that ``config``
    does not have, an activation outside ``activations`` (None: ``wanted`` decides it),
    mixture-of-experts layers (in the decoder alone when ``decoder_only``) and int8 weights
    unless ``dequantize``."""
    found = [
        f"{name}={getattr(config, name)!r} ({family}: {value!r})"
        for name, value in wanted.items()
        if getattr(config, name) != value
    ]
    if activations is not None and config.activation not in activations:
        found.append(f"activation={config.activation!r} ({family}: one of {list(activations)})")
    layers = (
        config.num_decoder_layers
        if decoder_only
        else max(config.num_encoder_layers, config.num_decoder_layers)
    )
    if any(config.is_moe_layer(i) for i in range(layers)):
        found.append(
            f"num_experts={config.num_experts} with moe_every={config.moe_every} ({family}: "
            "dense feed-forward layers, num_experts=0)"
        )
    if config.quantization is not None and not dequantize:
        found.append(
            f"quantization={config.quantization!r} ({family}: float weights, None; "
            "dequantize=True, or --dequantize, writes the int8 weights as float32 q * scale)"
        )
    return found


def seq2seq_generation_ids(config: TransformerConfig) -> dict[str, int]:
    """The special ids an encoder-decoder's ``generation_config.json`` names."""
    return {
        "decoder_start_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
    }
