"""Classification: the encoder stack, pooled, then a linear head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.models.embedder import make_embedding
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.tokens import check_tokens
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.flax_layers import Dense

Array = jax.Array


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
        encoded = Encoder(cfg, make_embedding(cfg, cfg.vocab_size, "embedding"), name="encoder")(
            inputs, deterministic=deterministic
        )
        real = inputs != cfg.pad_id
        if cfg.pooling == "first":
            pooled = encoded[:, 0]
        elif cfg.pooling == "attention":
            query = read_param(
                self,
                "pooling_query",
                logical_init(nn.initializers.normal(1.0), ("embed",)),
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
        logits = Dense(
            cfg.num_classes,
            kernel_init=logical_init(nn.initializers.xavier_uniform(), ("embed", None)),
            bias_init=logical_init(nn.initializers.zeros_init(), (None,)),
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            name="head",
        )(pooled)
        return logits.astype(jnp.float32)
