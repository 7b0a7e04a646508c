"""The encoder stack: embedding, N encoder layers, the final norm of pre-LN models."""

from __future__ import annotations

import flax.linen as nn
import jax

from flaxformer_lite.models.embedder import Embedder
from flaxformer_lite.models.stack import constrain_residual, layer_stack, relative_bias
from flaxformer_lite.models.tokens import default_positions
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.layers import EncoderLayer, make_norm
from flaxformer_lite.ops.masks import AttentionMask

Array = jax.Array


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
        positions = default_positions(inputs) if inputs_positions is None else inputs_positions
        x = constrain_residual(
            Embedder(cfg, self.embedding, name="embedder")(
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
            at = default_positions(inputs)[:1]
            shared.append(relative_bias(cfg, bidirectional=True)(at, at))
        x = layer_stack(
            lambda name, i: EncoderLayer(
                cfg, deterministic=deterministic, moe=cfg.is_moe_layer(i), name=name
            ),
            cfg, cfg.num_encoder_layers, x, *shared,
        )  # fmt: skip
        if cfg.norm_position == "pre":
            x = make_norm(cfg, "final_norm")(x)
        return x
