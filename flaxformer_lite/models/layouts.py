"""Parameter layouts: a ``scan_layers`` model's stacked layers <-> the unrolled model's.

With ``config.scan_layers`` each layer stack's parameters ``encoder/layers/...`` and
``decoder/layers/...`` hold every layer stacked on a leading axis `[num_layers, ...]` (logical
axis "layers") where the unrolled model has ``layers_0`` ... ``layers_{N-1}``.
``unstack_layers`` converts the first layout into the second; cached decoding (``decode=True``)
runs on the unrolled one (``unrolled`` gives its parameters and config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.models.decoder_only import DecoderOnly
from flaxformer_lite.models.encoder_decoder import EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _layer_slice(leaf: Any, i: int) -> Any:
    """Row ``i`` of a stacked leaf `[num_layers, ...]`; a boxed leaf also drops its first
    logical axis name ("layers")."""
    if _is_box(leaf):
        return leaf.replace(value=leaf.value[i], names=tuple(leaf.names[1:]))
    return leaf[i]


def _split_layers(stacked: Any) -> list[Any]:
    """A scanned ``layers`` subtree (leaves `[num_layers, ...]`) -> one subtree per layer."""
    leaves = jax.tree_util.tree_leaves(stacked, is_leaf=_is_box)
    if not leaves:
        return []
    first = leaves[0].value if _is_box(leaves[0]) else leaves[0]
    return [
        jax.tree_util.tree_map(lambda x, i=i: _layer_slice(x, i), stacked, is_leaf=_is_box)
        for i in range(first.shape[0])
    ]


def unstack_layers(params: Any) -> Any:
    """A ``scan_layers`` parameter tree -> the unrolled model's tree (same values).

    Every ``layers`` subtree, whose leaves are stacked `[num_layers, ...]`, becomes
    ``layers_0`` ... ``layers_{num_layers - 1}`` holding row i of each leaf `[...]`; all other
    entries are kept. Works on boxed (``nn.LogicallyPartitioned``: the "layers" axis name is
    dropped) or plain parameters, on gradients and on whole variable dicts. Pure: returns new
    dicts and leaves the input alone; a tree without ``layers`` comes back unchanged.
    """
    if not isinstance(params, Mapping):
        return params
    out: dict[str, Any] = {}
    for name, sub in params.items():
        if name == "layers" and isinstance(sub, Mapping):
            for i, layer in enumerate(_split_layers(sub)):
                out[f"layers_{i}"] = layer
        else:
            out[name] = unstack_layers(sub)
    return out


def param_path(path: tuple) -> str:
    """'/'-joined dictionary keys of a parameter's tree path (boxes and indices skipped):
    ``encoder/layers_0/mlp/wi/kernel``."""
    return "/".join(str(k.key) for k in path if hasattr(k, "key"))


def abstract_params(config: TransformerConfig, *, decoder_only: bool = False) -> Any:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of an EncoderDecoder's parameters, or a
    DecoderOnly's with ``decoder_only``."""
    tokens = jnp.ones((1, 1), jnp.int32)
    if decoder_only:
        model, args = DecoderOnly(config), (tokens,)
    else:
        model, args = EncoderDecoder(config), (tokens, tokens)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))
    return nn.meta.unbox(variables["params"])


def unrolled(params: Any, config: TransformerConfig) -> tuple[Any, TransformerConfig]:
    """Parameters and config of the unrolled model that computes what ``config``'s does.

    The identity unless ``config.scan_layers``; then ``unstack_layers(params)`` and the config
    with ``scan_layers=False``. Cached decoding (``generate``, ``continue_prompt``,
    ``init_cache``, the Translator) goes through here: its per-layer caches keep the batch on
    axis 0 (beam search's hypotheses too, see ``EncoderDecoder.decode``).
    """
    if not config.scan_layers:
        return params, config
    return unstack_layers(params), dataclasses.replace(config, scan_layers=False)
