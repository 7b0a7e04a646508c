"""The three models, built from the same layers.

  EncoderDecoder     translation: source tokens + target tokens -> target logits
  DecoderOnly        language model: tokens -> next-token logits
  EncoderClassifier  classification: tokens -> class logits (pooled encoder output)

Token arrays are int `[batch, length]` with padding id ``config.pad_id`` (0). Targets are shifted
right *inside* the models (BOS = ``config.bos_id`` first), as in the Flax wmt example: pass the
targets themselves and compare the logits with them. ``decode`` methods take decoder inputs that
are already shifted; decoding loops use those.

Packed rows (several examples in one row) pass ``*_segmentation`` (1..n per example, 0 on padding)
and ``*_positions`` (restarting at 0 in each example).

Masks go to the attention layers as ``masks.AttentionMask`` structure (causal flag, padding as
`[batch, length]` validity, segment ids), never as `[batch, 1, n, n]` matrices: the reference
attention builds the matrix itself, blockwise attention applies it block by block (memory linear
in length, future key blocks skipped), cuDNN gets ``is_causal`` and sequence lengths.

With ``config.scan_layers`` each layer stack is one ``nn.scan`` over a layer: parameters
``encoder/layers/...`` and ``decoder/layers/...`` hold every layer stacked on a leading axis
`[num_layers, ...]` (logical axis "layers") where the unrolled model has ``layers_0`` ...
``layers_{N-1}``; ``layer_stack`` builds either. ``unstack_layers`` converts the first layout
into the second; cached decoding (``decode=True``) runs on the unrolled one (``unrolled`` gives
its parameters and config).

With ``position="relative"`` each stack owns T5's bias table (``encoder/relative_bias`` and
``decoder/relative_bias``, `[num_buckets, heads]`, outside the scanned layers): the stack computes
the bias once and every layer's self-attention adds it to its logits.

Attention weights are sown into the "intermediates" collection by every attention layer when
the caller makes it mutable; ``attention_weights_per_layer`` lists them per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.layers import (
    DecoderLayer,
    Embed,
    EncoderLayer,
    Int8Dense,
    make_norm,
    ring_key_positions,
)
from flaxformer_lite.ops import beam_cache
from flaxformer_lite.ops import positions as pos_lib
from flaxformer_lite.ops.masks import AttentionMask

Array = jax.Array


def check_tokens(name: str, tokens: Array, config: TransformerConfig) -> None:
    """Fails on tokens that would otherwise broadcast or clamp silently."""
    shape = getattr(tokens, "shape", None)
    dtype = getattr(tokens, "dtype", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"{name} must be int tokens [batch, length]; got shape {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{name} must have an integer dtype (token ids); got {dtype}, shape {shape}"
        )
    if config.position in ("sinusoidal", "learned") and shape[1] > config.max_len:
        raise ValueError(
            f"{name} has length {shape[1]} > TransformerConfig.max_len={config.max_len} "
            f"(position={config.position!r}); shape {shape}. Raise max_len or truncate the input."
        )


def shift_right(targets: Array, bos_id: int, positions: Array | None = None) -> Array:
    """Decoder inputs: BOS then the targets shifted one step right.

    With packing, every example in the row starts with BOS (where its position is 0).
    targets `[batch, length]` -> `[batch, length]`.
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if positions is not None:
        shifted = jnp.where(positions == 0, bos_id, shifted)
    return shifted.astype(targets.dtype)


def _constrain(x: Array) -> Array:
    """Names the axes of the residual stream `[batch, length, d_model]` for sharding rules
    (batch split over data-parallel devices); a no-op outside a mesh."""
    return nn.with_logical_constraint(
        x, ("activation_batch", "activation_length", "activation_embed")
    )


def _default_positions(tokens: Array) -> Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


# ----------------------------------------------------------------------------- layer stacks


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
        return _constrain(layer(x, *shared)), None

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


def abstract_params(config: TransformerConfig) -> Any:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of an EncoderDecoder's parameters."""
    model = EncoderDecoder(config)
    tokens = jnp.ones((1, 1), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))
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


class _Embedder(nn.Module):
    """Token embedding (scaled by sqrt(d_model) unless ``scale_embeddings=False``) + absolute
    positions + dropout."""

    config: TransformerConfig
    embedding: Embed

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, *, deterministic: bool) -> Array:
        cfg = self.config
        x = self.embedding(tokens)
        if cfg.position == "sinusoidal":
            x = pos_lib.add_sinusoidal(x, positions, cfg.max_len, cfg.sinusoid_layout)
        elif cfg.position == "learned":
            x = pos_lib.LearnedPositions(
                cfg.max_len, cfg.d_model, cfg.parameter_dtype, name="positions"
            )(x, positions)
        return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class Encoder(nn.Module):
    """Embedding + N encoder layers (+ final norm when pre-LN). `[b, s]` -> `[b, s, d_model]`."""

    config: TransformerConfig
    embedding: Embed

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        *,
        inputs_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        cfg = self.config
        positions = _default_positions(inputs) if inputs_positions is None else inputs_positions
        x = _constrain(
            _Embedder(cfg, self.embedding, name="embedder")(
                inputs, positions, deterministic=deterministic
            )
        )
        real = inputs != cfg.pad_id  # padding neither attends nor is attended to
        mask = AttentionMask(
            query_valid=real,
            key_valid=real,
            query_segment_ids=inputs_segmentation,
            key_segment_ids=inputs_segmentation,
            window=cfg.self_attention_window("encoder"),
        )
        shared = [mask, positions]
        if cfg.position == "relative":
            # One table for the stack and one `[1, heads, s, s]` bias for every row: it depends
            # on index differences only, which equal position differences inside a packed
            # segment (positions count up from 0 in each), and pairs across segments are masked.
            at = _default_positions(inputs)[:1]
            shared.append(_relative_bias(cfg, bidirectional=True)(at, at))
        x = layer_stack(
            lambda name, i: EncoderLayer(
                cfg, deterministic=deterministic, moe=cfg.is_moe_layer(i), name=name
            ),
            cfg, cfg.num_encoder_layers, x, *shared,
        )  # fmt: skip
        if cfg.norm_position == "pre":
            x = make_norm(cfg, "final_norm")(x)
        return x


class Decoder(nn.Module):
    """Embedding + N decoder layers + logits. Decoder inputs `[b, t]` -> logits `[b, t, vocab]`.

    ``encoded`` `[b, s, d_model]` and ``inputs`` `[b, s]` (the source tokens, for the padding
    mask) are None in a decoder-only model. Logits are float32.
    """

    config: TransformerConfig
    embedding: Embed
    cross_attention: bool = True

    def _cache_length(self, new_positions: int) -> int:
        """Slots of the self-attention key/value caches: their length in the "cache"
        collection, or ``new_positions`` on the call that allocates them."""
        cache = self.variables.get("cache", {})
        lengths = {
            leaf.shape[2]  # [batch, kv_heads, slots, head_dim]
            for path, leaf in traverse_util.flatten_dict(cache).items()
            if path[-1] == "cached_key"
        }
        if len(lengths) > 1:
            raise ValueError(f"the decoder's key/value caches differ in length: {lengths}")
        return lengths.pop() if lengths else new_positions

    def _beam_ancestors(
        self, decoder_inputs: Array, start: Array, beam_size: int, initialized: bool
    ) -> Array | None:
        """Updates the cache's ``beam_ancestors`` int32 `[rows, slots]` for the new positions
        (written by each row itself, so its own beam index) and returns what the layers'
        self-attention follows: the ancestors of every slot it reads (``beam_cache``).

        A cache without them (prefilled before the beams were tiled, see ``generate``) gets
        zeros: every earlier slot read from beam 0, right while a source's beams are copies.
        A sliding-window ring buffer (``window`` slots, see ``layers.MultiHeadAttention``)
        attends to the ring as it was, then its new keys; their slot is written afterwards.
        """
        rows, q_len = decoder_inputs.shape
        slots = self._cache_length(q_len)
        window = self.config.self_attention_window("decoder")
        if window is not None and slots >= window:  # the allocating call makes a ring
            slots = window
        ring = window is not None and slots == window
        held = self.variable("cache", BEAM_ANCESTORS, jnp.zeros, (rows, slots), jnp.int32)
        if not initialized:  # allocation only: the layers attend without the cache
            return None
        if not q_len:
            return held.value
        own = jnp.broadcast_to(beam_cache.own_beam(rows, beam_size)[:, None], (rows, q_len))
        if ring:
            if q_len != 1:
                raise ValueError(
                    f"beam search over a sliding-window ring buffer writes one position per "
                    f"step; got {q_len} (prefill the prompt before the beams are tiled)"
                )
            attended = jnp.concatenate([held.value, own], axis=1)
            held.value = jax.lax.dynamic_update_slice(held.value, own, (0, start % window))
            return attended
        held.value = jax.lax.dynamic_update_slice(held.value, own, (0, start))
        return held.value

    @nn.compact
    def __call__(
        self,
        encoded: Array | None,
        inputs: Array | None,
        decoder_inputs: Array,
        *,
        decoder_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        targets_valid: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        check_cache: bool = True,
        beam_size: int = 1,
    ) -> Array:
        """targets_valid: bool `[b, t]`, the positions whose target is real; mixture-of-experts
        layers route only those (capacity and auxiliary losses count real tokens only), so
        padding changes nothing at the real positions. None: every position is real."""
        cfg = self.config
        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
            raise ValueError(f"beam_size must be a positive int; got {beam_size!r}")
        if beam_size > 1 and not decode:
            raise ValueError(f"beam_size={beam_size} applies to cached decoding (decode=True)")
        if decode and cfg.scan_layers:
            raise ValueError(
                "decode=True needs a key/value cache per layer, but TransformerConfig."
                "scan_layers=True stacks the decoder layers: decode with the unrolled model, "
                "models.unrolled(params, config) (unstack_layers(params) and scan_layers=False). "
                "generate(), continue_prompt() and init_cache() do that themselves."
            )
        if decode:
            # The model's one decoding counter: how many positions the cache holds. The new
            # tokens' positions derive from it, and each self-attention layer writes its cache
            # at those positions. Packing does not apply here.
            initialized = self.has_variable("cache", "position_index")
            index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
            start = index.value
            positions = jnp.broadcast_to(
                index.value + jnp.arange(decoder_inputs.shape[1]), decoder_inputs.shape
            )
            if initialized:
                index.value = index.value + decoder_inputs.shape[1]
            self_mask = None  # each attention layer builds its causal mask over the cache
        else:
            positions = (
                _default_positions(decoder_inputs)
                if decoder_positions is None
                else decoder_positions
            )
            # Causality alone keeps real positions from seeing padding: every key at or before
            # a real target position is real.
            self_mask = AttentionMask(
                causal=True,
                query_segment_ids=targets_segmentation,
                key_segment_ids=targets_segmentation,
                window=cfg.self_attention_window("decoder"),
            )
        cross_mask = None
        if self.cross_attention:
            both = targets_segmentation is not None and inputs_segmentation is not None
            cross_mask = AttentionMask(
                key_valid=inputs != cfg.pad_id,
                query_segment_ids=targets_segmentation if both else None,
                key_segment_ids=inputs_segmentation if both else None,
            )

        x = _constrain(
            _Embedder(cfg, self.embedding, name="embedder")(
                decoder_inputs, positions, deterministic=deterministic
            )
        )
        shared = [encoded, self_mask, cross_mask, positions]
        if cfg.position == "relative":
            # Causal buckets, one table for the stack. Decoding: the new positions against
            # every cache slot (the causal mask hides the slots not written yet).
            if decode:
                query_at = positions[:1]
                length = self._cache_length(decoder_inputs.shape[1])
                window = cfg.self_attention_window("decoder")
                if initialized and window == length and decoder_inputs.shape[1]:
                    # a sliding-window ring buffer: its slots, then the new positions
                    key_at = ring_key_positions(positions[0], window)[None]
                else:
                    key_at = jnp.arange(length)[None]
            else:
                query_at = key_at = _default_positions(decoder_inputs)[:1]  # as in the encoder
            shared.append(_relative_bias(cfg, bidirectional=False)(query_at, key_at))
        ancestors = None
        if decode and beam_size > 1:  # the index is read before this call moved it
            ancestors = self._beam_ancestors(decoder_inputs, start, beam_size, initialized)
        if ancestors is not None:
            shared += [None] * (5 - len(shared)) + [ancestors]  # after the (absent) bias
        if targets_valid is not None and cfg.num_experts > 0:  # DecoderLayer's ``valid``
            shared += [None] * (6 - len(shared)) + [targets_valid]
        x = layer_stack(
            lambda name, i: DecoderLayer(
                cfg,
                cross_attention=self.cross_attention,
                deterministic=deterministic,
                decode=decode,
                check_cache=check_cache,
                moe=cfg.is_moe_layer(i),
                beam_size=beam_size if decode else 1,
                name=name,
            ),
            cfg, cfg.num_decoder_layers, x, *shared,
        )  # fmt: skip
        if cfg.norm_position == "pre":
            x = make_norm(cfg, "final_norm")(x)
        if cfg.tie_output_embedding:
            logits = self.embedding.attend(x)
        elif cfg.quantization is not None:
            logits = Int8Dense(cfg.output_vocab_size, ("embed", "vocab"), False, name="logits")(x)
        else:
            logits = nn.DenseGeneral(
                cfg.output_vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.xavier_uniform(), ("embed", "vocab")
                ),
                dtype=cfg.compute_dtype,
                param_dtype=cfg.parameter_dtype,
                name="logits",
            )(x)
        logits = logits.astype(jnp.float32)
        if cfg.logits_bias:
            bias = self.param(
                "logits_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                (cfg.output_vocab_size,),
                cfg.parameter_dtype,
            )
            logits = logits + jnp.asarray(bias, jnp.float32)
        return logits


BEAM_ANCESTORS = "beam_ancestors"  # the Decoder's cache entry for beam search in place


def reorder_beam_cache(cache: Any, parents: Array) -> Any:
    """A decoding cache after a beam-search step, for ``decoding.beam_search(reorder_cache=)``:
    only the ``beam_ancestors`` entries `[rows, slots]` are gathered by ``parents`` (int
    `[rows]`, flat row indices); keys, values and the rest stay where they are."""
    flat = traverse_util.flatten_dict(cache)
    if not any(path[-1] == BEAM_ANCESTORS for path in flat):
        raise ValueError(
            "reorder_beam_cache needs a cache with beam_ancestors (made by a decode call with "
            "beam_size > 1); reorder a plain cache by gathering every row instead"
        )
    return traverse_util.unflatten_dict(
        {
            path: beam_cache.reorder(leaf, parents) if path[-1] == BEAM_ANCESTORS else leaf
            for path, leaf in flat.items()
        }
    )


def _relative_bias(config: TransformerConfig, *, bidirectional: bool) -> nn.Module:
    """The stack's T5 relative position bias (``position="relative"``), shared by its layers."""
    return pos_lib.RelativePositionBias(
        num_heads=config.num_heads,
        num_buckets=config.relative_num_buckets,
        max_distance=config.relative_max_distance,
        bidirectional=bidirectional,
        param_dtype=config.parameter_dtype,
        name="relative_bias",
    )


def _embedding(
    config: TransformerConfig, vocab_size: int, name: str, *, attends: bool = False
) -> Embed:
    """attends: the table also gives the output logits (a quantized model then keeps an int8
    copy for them; see ``Embed.int8_attend``)."""
    return Embed(
        vocab_size,
        config.d_model,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        scale=config.scale_embeddings,
        int8_attend=attends and config.tie_output_embedding and config.quantization is not None,
        name=name,
    )


class EncoderDecoder(nn.Module):
    """The paper's Transformer for translation.

    ``model.apply(variables, inputs, targets, deterministic=True)``: inputs int `[batch, src_len]`,
    targets int `[batch, tgt_len]` (pad 0, EOS-terminated, *not* shifted: shifting happens
    inside) -> logits float32 `[batch, tgt_len, target_vocab]`, where logits[:, t] predicts
    targets[:, t] from targets[:, :t]. ``encode`` and ``decode`` expose the two halves so that
    decoding runs the encoder once.
    """

    config: TransformerConfig

    def setup(self) -> None:
        cfg = self.config
        shared = cfg.share_embeddings
        source = _embedding(cfg, cfg.vocab_size, "source_embedding", attends=shared)
        target = (
            source
            if shared
            else _embedding(cfg, cfg.output_vocab_size, "target_embedding", attends=True)
        )
        self.encoder = Encoder(cfg, source)
        self.decoder = Decoder(cfg, target)

    def encode(
        self,
        inputs: Array,
        *,
        inputs_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """int `[batch, src_len]` -> `[batch, src_len, d_model]`."""
        check_tokens("inputs", inputs, self.config)
        return self.encoder(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            deterministic=deterministic,
        )

    def decode(
        self,
        encoded: Array,
        inputs: Array,
        decoder_inputs: Array,
        *,
        decoder_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        targets_valid: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        check_cache: bool = True,
        beam_size: int = 1,
    ) -> Array:
        """Logits `[batch, tgt_len, vocab]` from *shifted* decoder inputs `[batch, tgt_len]`.

        ``targets_valid``: bool `[batch, tgt_len]`, the positions that predict a real target
        (``__call__`` passes ``targets != pad_id``): a mixture of experts routes only those.

        ``decode=True`` runs one or more new positions against the key/value cache. In that mode
        ``encoded`` may be None once a call with it has stored the projected encoder keys and
        values in the cache (a call with zero-length ``decoder_inputs`` does only that).
        Writing past the end of the cache raises ValueError (under ``jit``: a
        ``JaxRuntimeError`` with the same message, unless ``check_cache=False``; see
        ``layers.check_cache_room``).

        ``beam_size > 1`` (with ``decode=True``): ``decoder_inputs`` has ``batch * beam_size``
        rows, beam search's hypotheses (row ``b * beam_size + i``), while ``encoded``, ``inputs``
        and the cross-attention cache keep one row per source; the self-attention cache is
        followed through the ``beam_ancestors`` cache entry instead of being reordered (see
        ``beam_cache``, ``reorder_beam_cache``).
        """
        check_tokens("decoder_inputs", decoder_inputs, self.config)
        return self.decoder(
            encoded,
            inputs,
            decoder_inputs,
            decoder_positions=decoder_positions,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
            targets_valid=targets_valid,
            deterministic=deterministic,
            decode=decode,
            check_cache=check_cache,
            beam_size=beam_size,
        )

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        check_tokens("targets", targets, self.config)
        encoded = self.encode(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            deterministic=deterministic,
        )
        decoder_inputs = shift_right(targets, self.config.bos_id, targets_positions)
        return self.decode(
            encoded,
            inputs,
            decoder_inputs,
            decoder_positions=targets_positions,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
            targets_valid=targets != self.config.pad_id,
            deterministic=deterministic,
        )


class DecoderOnly(nn.Module):
    """A language model: the decoder stack without encoder-decoder attention.

    ``model.apply(variables, tokens)``: int `[batch, length]` -> logits `[batch, length, vocab]`,
    logits[:, t] predicting tokens[:, t] from BOS + tokens[:, :t] (shifted inside).
    """

    config: TransformerConfig

    def setup(self) -> None:
        self.decoder = Decoder(
            self.config,
            _embedding(self.config, self.config.vocab_size, "embedding", attends=True),
            cross_attention=False,
        )

    def decode(
        self,
        decoder_inputs: Array,
        *,
        decoder_positions: Array | None = None,
        segmentation: Array | None = None,
        targets_valid: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        check_cache: bool = True,
        beam_size: int = 1,
    ) -> Array:
        """Logits from *shifted* inputs `[batch, length]`; ``decode=True`` uses the cache
        (``check_cache``, ``beam_size`` and ``targets_valid`` as in ``EncoderDecoder.decode``)."""
        check_tokens("decoder_inputs", decoder_inputs, self.config)
        return self.decoder(
            None,
            None,
            decoder_inputs,
            decoder_positions=decoder_positions,
            targets_segmentation=segmentation,
            targets_valid=targets_valid,
            deterministic=deterministic,
            decode=decode,
            check_cache=check_cache,
            beam_size=beam_size,
        )

    def __call__(
        self,
        tokens: Array,
        *,
        positions: Array | None = None,
        segmentation: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        check_tokens("tokens", tokens, self.config)
        return self.decode(
            shift_right(tokens, self.config.bos_id, positions),
            decoder_positions=positions,
            segmentation=segmentation,
            targets_valid=tokens != self.config.pad_id,
            deterministic=deterministic,
        )


class EncoderClassifier(nn.Module):
    """Encoder, pooled, then a linear head: int `[batch, length]` -> logits `[batch, classes]`.

    ``pooling="mean"`` averages the encoder output over real (non-pad) tokens; ``"first"`` takes
    position 0 (put a classification token there); ``"attention"`` weighs the real tokens by a
    softmax of their scores against a learned query `[d_model]` and sows those weights
    (`[batch, length]`, 0 on padding) into "intermediates" as ``pooling_weights``.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: Array, *, deterministic: bool = True) -> Array:
        cfg = self.config
        if cfg.quantization is not None:
            raise ValueError(
                f"EncoderClassifier does not support quantization={cfg.quantization!r} "
                "(int8 inference is for EncoderDecoder and DecoderOnly)"
            )
        check_tokens("inputs", inputs, cfg)
        encoded = Encoder(cfg, _embedding(cfg, cfg.vocab_size, "embedding"), name="encoder")(
            inputs, deterministic=deterministic
        )
        real = inputs != cfg.pad_id
        if cfg.pooling == "first":
            pooled = encoded[:, 0]
        elif cfg.pooling == "attention":
            query = self.param(
                "pooling_query",
                nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed",)),
                (cfg.d_model,),
                cfg.parameter_dtype,
            )
            scores = jnp.einsum(
                "bnd,d->bn", encoded.astype(jnp.float32), query.astype(jnp.float32)
            ) / jnp.sqrt(jnp.float32(cfg.d_model))
            weights = jax.nn.softmax(jnp.where(real, scores, -jnp.inf), axis=-1)
            weights = jnp.where(real, weights, 0.0)  # a row of padding only: all zero
            self.sow("intermediates", "pooling_weights", weights)
            pooled = jnp.einsum("bn,bnd->bd", weights.astype(encoded.dtype), encoded)
        else:
            mask = real[..., None].astype(encoded.dtype)
            pooled = (encoded * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1)
        pooled = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
        logits = nn.Dense(
            cfg.num_classes,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.xavier_uniform(), ("embed", None)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            name="head",
        )(pooled)
        return logits.astype(jnp.float32)
