"""The decoder stack (embedding, N decoder layers, logits), training and cached decoding.

With ``decode=True`` the decoder keeps its one counter (``position_index``, the positions its
caches hold) and, for beam search in place, ``beam_ancestors`` (``ops.beam_cache``) in the
"cache" collection; each self-attention layer keeps its own keys and values
(``nn.attention.MultiHeadAttention``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.models.embedder import Embedder
from flaxformer_lite.models.stack import constrain_residual, layer_stack, relative_bias
from flaxformer_lite.models.tokens import default_positions
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.dense import Int8Dense
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.flax_layers import DenseGeneral
from flaxformer_lite.nn.layers import DecoderLayer, make_norm
from flaxformer_lite.ops import beam_cache
from flaxformer_lite.ops.kv_cache import ring_key_positions
from flaxformer_lite.ops.masks import AttentionMask
from flaxformer_lite.ops.precision import dot_general_in

Array = jax.Array

BEAM_ANCESTORS = "beam_ancestors"  # the Decoder's cache entry for beam search in place


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
        A sliding-window ring buffer (``window`` slots, see ``nn.attention.MultiHeadAttention``)
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
        left_padding: Array | None = None,
    ) -> Array:
        """targets_valid: bool `[b, t]`, the positions whose target is real; mixture-of-experts
        layers route only those (capacity and auxiliary losses count real tokens only), so
        padding changes nothing at the real positions. None: every position is real.

        left_padding (``decode=True`` only): int `[b]`, the pad slots each row's left-padded
        prompt starts with: they are hidden from every query, and cache slot s is position
        ``s - left_padding`` (``MultiHeadAttention``); pass the same values on every call
        that uses the cache."""
        cfg = self.config
        _check_decode_options(cfg, decode=decode, beam_size=beam_size)
        if left_padding is not None and not decode:
            raise ValueError(
                "left_padding applies to cached decoding (decode=True); without a cache pass "
                "decoder_positions and a segmentation (models.tokens.positions_from_mask)"
            )
        embed_positions = None
        if decode:
            initialized, start, positions = self._decode_positions(decoder_inputs)
            if left_padding is not None:
                shift = left_padding.astype(positions.dtype)[:, None]
                embed_positions = jnp.maximum(positions - shift, 0)
            self_mask = None  # each attention layer builds its causal mask over the cache
        else:
            positions = (
                default_positions(decoder_inputs)
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
            cross_mask = self._cross_mask(inputs, inputs_segmentation, targets_segmentation)

        x = constrain_residual(
            Embedder(cfg, self.embedding, name="embedder")(
                decoder_inputs,
                positions if embed_positions is None else embed_positions,
                deterministic=deterministic,
            )
        )
        shared = [encoded, self_mask, cross_mask, positions]
        if cfg.position == "relative":
            if decode:
                bias = self._decode_relative_bias(decoder_inputs, positions, initialized)
            else:  # as in the encoder
                at = default_positions(decoder_inputs)[:1]
                bias = relative_bias(cfg, bidirectional=False)(at, at)
            shared.append(bias)
        ancestors = None
        if decode and beam_size > 1:  # the index is read before this call moved it
            ancestors = self._beam_ancestors(decoder_inputs, start, beam_size, initialized)
        if ancestors is not None:
            shared += [None] * (5 - len(shared)) + [ancestors]  # after the (absent) bias
        if targets_valid is not None and cfg.num_experts > 0:  # DecoderLayer's ``valid``
            shared += [None] * (6 - len(shared)) + [targets_valid]
        if left_padding is not None:  # DecoderLayer's ``left_padding``
            shared += [None] * (7 - len(shared)) + [left_padding]
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
        return self._logits(x)

    def _decode_positions(self, decoder_inputs: Array) -> tuple[bool, Array, Array]:
        """decode=True: the new tokens' absolute positions int `[b, t]`, from the cache's
        counter ``position_index``, which this call moves on by t (the allocating call leaves
        it at 0). Returns (whether the cache existed, the counter before this call, the
        positions)."""
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
        return initialized, start, positions

    def _cross_mask(
        self,
        inputs: Array,
        inputs_segmentation: Array | None,
        targets_segmentation: Array | None,
    ) -> AttentionMask:
        """Encoder-decoder attention's mask: the source's padding ``inputs`` `[b, s]` hidden;
        with both segmentations (packed rows), each target sees its own example's source."""
        both = targets_segmentation is not None and inputs_segmentation is not None
        return AttentionMask(
            key_valid=inputs != self.config.pad_id,
            query_segment_ids=targets_segmentation if both else None,
            key_segment_ids=inputs_segmentation if both else None,
        )

    def _decode_relative_bias(
        self, decoder_inputs: Array, positions: Array, initialized: bool
    ) -> Array:
        """decode=True, ``position="relative"``: causal buckets of the new positions against
        every cache slot (the causal mask hides the slots not written yet), or against the
        ring's slots then the new positions for a sliding-window ring buffer. `[1, heads,
        t, slots]`."""
        query_at = positions[:1]
        length = self._cache_length(decoder_inputs.shape[1])
        window = self.config.self_attention_window("decoder")
        if initialized and window == length and decoder_inputs.shape[1]:
            # a sliding-window ring buffer: its slots, then the new positions
            key_at = ring_key_positions(positions[0], window)[None]
        else:
            key_at = jnp.arange(length)[None]
        return relative_bias(self.config, bidirectional=False)(query_at, key_at)

    def _logits(self, x: Array) -> Array:
        """`[b, t, d_model]` -> float32 logits `[b, t, vocab]`: the embedding transposed
        (``tie_output_embedding``) or a kernel ``logits`` (int8 when quantized), plus
        ``logits_bias`` `[vocab]` when configured; the input first scaled by d_model**-0.5
        with ``scale_decoder_output`` (T5 v1.0)."""
        cfg = self.config
        if cfg.scale_decoder_output:  # T5 v1.0: the tied table's logits are rescaled
            x = x * jnp.asarray(cfg.d_model**-0.5, x.dtype)
        if cfg.tie_output_embedding:
            logits = self.embedding.attend(x)
        elif cfg.quantization is not None:
            logits = Int8Dense(
                cfg.output_vocab_size,
                ("embed", "vocab"),
                False,
                int8_kernel=cfg.int8_kernel,
                name="logits",
            )(x)
        else:
            logits = DenseGeneral(
                cfg.output_vocab_size,
                use_bias=False,
                kernel_init=logical_init(nn.initializers.xavier_uniform(), ("embed", "vocab")),
                dtype=cfg.compute_dtype,
                param_dtype=cfg.parameter_dtype,
                dot_general=dot_general_in,
                name="logits",
            )(x)
        logits = logits.astype(jnp.float32)
        if cfg.logits_bias:
            bias = read_param(
                self,
                "logits_bias",
                logical_init(nn.initializers.zeros_init(), ("vocab",)),
                (cfg.output_vocab_size,),
                cfg.parameter_dtype,
            )
            logits = logits + jnp.asarray(bias, jnp.float32)
        return logits


def _check_decode_options(config: TransformerConfig, *, decode: bool, beam_size: Any) -> None:
    """ValueError for a ``beam_size`` that is not a positive int or is given without
    ``decode``, and for ``decode`` on a ``scan_layers`` model (no per-layer cache)."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int; got {beam_size!r}")
    if beam_size > 1 and not decode:
        raise ValueError(f"beam_size={beam_size} applies to cached decoding (decode=True)")
    if decode and config.scan_layers:
        raise ValueError(
            "decode=True needs a key/value cache per layer, but TransformerConfig."
            "scan_layers=True stacks the decoder layers: decode with the unrolled model, "
            "models.unrolled(params, config) (unstack_layers(params) and scan_layers=False). "
            "generate(), continue_prompt() and init_cache() do that themselves."
        )


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
