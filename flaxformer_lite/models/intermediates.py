"""What the models sow into the "intermediates" collection, read back one layer at a time.

Every attention layer sows its weights there when the caller makes the collection mutable.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from flaxformer_lite.models.layouts import unstack_layers

Array = jax.Array


def attention_weights_per_layer(intermediates: Mapping) -> list[dict[str, Array]]:
    """The attention weights an encoder or decoder sowed, one dict per layer.

    ``intermediates``: the stack's subtree of the "intermediates" collection, e.g.
    ``model.apply(..., method=model.encode, mutable=["intermediates"])[1]["intermediates"]
    ["encoder"]``, scanned (``layers``, leaves `[num_layers, ...]`) or unrolled (``layers_i``).
    Returns ``[{"self": [batch, heads, q_len, kv_len], "cross": [batch, heads, q_len, src_len]},
    ...]`` ("cross" only in the decoder of an encoder-decoder), float32.
    """
    layers = unstack_layers(intermediates)
    names = sorted((k for k in layers if k.startswith("layers_")), key=lambda k: int(k[7:]))
    return [
        {
            kind: layers[name][f"{kind}_attention"]["attention_weights"][0]
            for kind in ("self", "cross")
            if f"{kind}_attention" in layers[name]
        }
        for name in names
    ]
