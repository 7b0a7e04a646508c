"""The models' embedding tables and the embedder that adds absolute positions to them."""

from __future__ import annotations

import flax.linen as nn
import jax

from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.layers import make_norm
from flaxformer_lite.ops import positions as pos_lib

Array = jax.Array


def make_embedding(
    config: TransformerConfig, vocab_size: int, name: str, *, attends: bool = False
) -> Embed:
    """The table `[vocab_size, d_model]` named ``name``. attends: the table also gives the
    output logits (a quantized model then keeps an int8 copy for them; see
    ``Embed.int8_attend``)."""
    return Embed(
        vocab_size,
        config.d_model,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        scale=config.scale_embeddings,
        int8_attend=attends and config.tie_output_embedding and config.quantization is not None,
        int8_kernel=config.int8_kernel,
        name=name,
    )


class Embedder(nn.Module):
    """Token embedding (scaled by sqrt(d_model) unless ``scale_embeddings=False``; whole rows
    dropped at ``word_dropout_rate`` in training) + absolute positions (+ the
    ``embedding_norm``) + dropout: int `[batch, length]` -> `[batch, length, d_model]`."""

    config: TransformerConfig
    embedding: Embed

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, *, deterministic: bool) -> Array:
        cfg = self.config
        x = self.embedding(tokens)
        if cfg.word_dropout_rate > 0:
            # One draw per token, broadcast over d_model: whole rows dropped.
            x = nn.Dropout(
                cfg.word_dropout_rate, broadcast_dims=(x.ndim - 1,), name="word_dropout"
            )(x, deterministic=deterministic)
        if cfg.position == "sinusoidal":
            x = pos_lib.add_sinusoidal(x, positions, cfg.max_len, cfg.sinusoid_layout)
        elif cfg.position == "learned":
            x = pos_lib.LearnedPositions(
                cfg.max_len,
                cfg.d_model,
                cfg.parameter_dtype,
                offset=cfg.learned_position_offset,
                name="positions",
            )(x, positions)
        if cfg.embedding_norm:
            x = make_norm(cfg, "embedding_norm")(x)
        return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
