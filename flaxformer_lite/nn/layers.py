"""The encoder and decoder layers: each sub-layer (attention, feed-forward) in its residual.

Layers built from a ``TransformerConfig`` out of the leaf modules, which take plain arguments
and can be lifted into other projects alone: ``attention.MultiHeadAttention`` (with
``projections``), ``mlp.MlpBlock``, ``embed.Embed``, ``dense.Int8Dense``; ``moe.MoeBlock`` for a
mixture-of-experts feed-forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from flaxformer_lite.core.logical_params import logical_init
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.dense import Int8Dense
from flaxformer_lite.nn.embed import Embed, tied_logits
from flaxformer_lite.nn.flax_layers import LayerNorm, RMSNorm
from flaxformer_lite.nn.mlp import MlpBlock
from flaxformer_lite.nn.projections import (
    KV_AXES,
    QUERY_AXES,
    FusedQKVProjection,
    HeadProjection,
    OutputProjection,
)
from flaxformer_lite.ops.kv_cache import check_cache_room, heads_first, ring_key_positions

# The leaf modules and cache functions lived here until the split of issue 24; the deprecated
# path flaxformer_lite.layers (this module) still gives them for one release.
__all__ = [
    "KV_AXES",
    "QUERY_AXES",
    "DecoderLayer",
    "Embed",
    "EncoderLayer",
    "FusedQKVProjection",
    "HeadProjection",
    "Int8Dense",
    "MlpBlock",
    "MultiHeadAttention",
    "OutputProjection",
    "check_cache_room",
    "heads_first",
    "make_norm",
    "residual",
    "ring_key_positions",
    "tied_logits",
]

Array = jax.Array

_zeros = nn.initializers.zeros_init()


def make_norm(config: TransformerConfig, name: str) -> nn.Module:
    kw = dict(
        epsilon=config.layer_norm_epsilon,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        scale_init=logical_init(nn.initializers.ones_init(), ("embed",)),
        name=name,
    )
    if config.norm_type == "rmsnorm":
        return RMSNorm(**kw)
    return LayerNorm(bias_init=logical_init(_zeros, ("embed",)), **kw)


def residual(
    x: Array,
    sublayer: Callable[[Array], Array],
    norm: nn.Module,
    dropout: nn.Dropout,
    *,
    pre_norm: bool,
    deterministic: bool,
) -> Array:
    """Post-LN LayerNorm(x + Dropout(f(x))) (the paper) or pre-LN x + Dropout(f(LN(x)))."""
    y = dropout(sublayer(norm(x) if pre_norm else x), deterministic=deterministic)
    return x + y if pre_norm else norm(x + y)


def _attention(
    config: TransformerConfig, name: str, *, cross: bool = False, window: int | None = None
) -> MultiHeadAttention:
    return MultiHeadAttention(
        num_heads=config.num_heads,
        head_dim=config.effective_head_dim,
        num_kv_heads=config.num_kv_heads,
        dropout_rate=config.attention_dropout_rate,
        use_bias=config.use_bias,
        # Rotary encodes distances within one sequence; queries and keys of cross-attention
        # live in different sequences, so it applies to self-attention only.
        use_rotary=config.position == "rotary" and not cross,
        cross_attention=cross,
        fused_qkv=config.fused_qkv and not cross,
        implementation=config.attention_implementation,
        window=window,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        quantization=config.quantization,
        int8_kernel=config.int8_kernel,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        qkv_bias=config.use_bias or config.qkv_bias,
        logits_scale=None if config.scale_attention_logits else 1.0,
        name=name,
    )


def _feed_forward(
    config: TransformerConfig, moe: bool, deterministic: bool, valid: Array | None = None
) -> Callable[[Array], Array]:
    """The layer's feed-forward sub-layer: ``MlpBlock``, or ``moe.MoeBlock`` in a
    mixture-of-experts layer (routing only the ``valid`` `[batch, length]` tokens)."""
    if not moe:
        mlp = _mlp(config)
        return lambda h: mlp(h, deterministic=deterministic)
    from flaxformer_lite.nn.moe import MoeBlock

    block = MoeBlock(
        num_experts=config.num_experts,
        k=config.num_experts_per_token,
        d_ff=config.d_ff,
        capacity_factor=config.expert_capacity_factor,
        activation=config.activation,
        use_bias=config.use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        name="moe",
    )
    return lambda h: block(h, valid, deterministic=deterministic)


def _mlp(config: TransformerConfig) -> MlpBlock:
    return MlpBlock(
        d_ff=config.d_ff,
        activation=config.activation,
        use_bias=config.use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        quantization=config.quantization,
        int8_kernel=config.int8_kernel,
        dropout_rate=config.activation_dropout_rate,
        name="mlp",
    )


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual sub-layer. `[b, s, d]` -> `[b, s, d]`.

    Only arrays are call arguments (the flags are attributes), so ``nn.remat`` and ``nn.scan``
    take the layer as it is (``models.layer_stack``). ``moe``: the feed-forward block is a
    mixture of experts (``moe.MoeBlock``, routing the real tokens of ``mask.query_valid``).
    """

    config: TransformerConfig
    deterministic: bool = True
    moe: bool = False

    @nn.compact
    def __call__(
        self, x: Array, mask: Any, positions: Array | None = None, bias: Array | None = None
    ) -> Array:
        """bias: added to the self-attention logits, `[batch|1, heads, len, len]` (the stack's
        relative position bias)."""
        cfg = self.config
        kw = dict(pre_norm=cfg.norm_position == "pre", deterministic=self.deterministic)
        dropout = nn.Dropout(cfg.dropout_rate)
        attn = _attention(cfg, "self_attention")

        def self_attention(h: Array) -> Array:
            return attn(
                h, None, mask, bias, positions_q=positions, deterministic=self.deterministic
            )

        x = residual(x, self_attention, make_norm(cfg, "self_attention_norm"), dropout, **kw)
        valid = getattr(mask, "query_valid", None)
        ffn = _feed_forward(cfg, self.moe, self.deterministic, valid)
        return residual(x, ffn, make_norm(cfg, "mlp_norm"), dropout, **kw)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward; each a residual sub-layer.

    `[b, t, d]` -> `[b, t, d]`. With ``cross_attention=False`` (decoder-only models) the middle
    sub-layer is absent. ``decode=True`` runs the self-attention from its key/value cache
    (``positions`` are then the new tokens' absolute positions, see ``MultiHeadAttention``), and
    the encoder-decoder attention from cached encoder keys/values when ``encoded`` is None.
    ``check_cache``: see ``MultiHeadAttention``. Only arrays are call arguments. ``moe``: the
    feed-forward block is a mixture of experts (``moe.MoeBlock``, routing the positions that
    ``valid`` marks, every position when it is None).
    ``beam_size`` (with ``decode=True``): rows are ``batch * beam_size`` beam-search
    hypotheses; the cross-attention cache and ``encoded`` have ``batch`` rows, and
    ``beam_ancestors`` (when given) makes self-attention follow each row's history through an
    unmoved cache (``MultiHeadAttention``, ``beam_cache``).
    """

    config: TransformerConfig
    cross_attention: bool = True
    deterministic: bool = True
    decode: bool = False
    check_cache: bool = True
    moe: bool = False
    beam_size: int = 1

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array | None,
        self_mask: Any,
        cross_mask: Any,
        positions: Array | None = None,
        bias: Array | None = None,
        beam_ancestors: Array | None = None,
        valid: Array | None = None,
        left_padding: Array | None = None,
    ) -> Array:
        """bias: added to the self-attention logits, `[batch|1, heads, len, kv_len]` (the
        stack's relative position bias; with ``decode=True`` kv_len is the cache length).
        beam_ancestors: int `[batch * beam_size, slots]`, see ``beam_cache``. valid: bool
        `[batch, len]`, the real positions (padding is not routed by a mixture of experts).
        left_padding: int `[batch]` (``decode=True``): the left-padded prompt slots of each row
        (``MultiHeadAttention``)."""
        cfg = self.config
        kw = dict(pre_norm=cfg.norm_position == "pre", deterministic=self.deterministic)
        dropout = nn.Dropout(cfg.dropout_rate)
        self_attn = _attention(cfg, "self_attention", window=cfg.self_attention_window("decoder"))

        def self_attention(h: Array) -> Array:
            return self_attn(
                h,
                None,
                self_mask,
                bias,
                positions_q=positions,
                deterministic=self.deterministic,
                decode=self.decode,
                check_cache=self.check_cache,
                beam_size=self.beam_size,
                beam_ancestors=beam_ancestors,
                left_padding=left_padding,
            )

        x = residual(x, self_attention, make_norm(cfg, "self_attention_norm"), dropout, **kw)
        if self.cross_attention:
            cross_attn = _attention(cfg, "cross_attention", cross=True)

            def cross_attention(h: Array) -> Array:
                return cross_attn(
                    h,
                    encoded,
                    cross_mask,
                    deterministic=self.deterministic,
                    decode=self.decode,
                    beam_size=self.beam_size if self.decode else 1,
                )

            x = residual(x, cross_attention, make_norm(cfg, "cross_attention_norm"), dropout, **kw)
        ffn = _feed_forward(cfg, self.moe, self.deterministic, valid)
        return residual(x, ffn, make_norm(cfg, "mlp_norm"), dropout, **kw)
