"""A language model: the decoder stack without encoder-decoder attention."""

from __future__ import annotations

import flax.linen as nn
import jax

from flaxformer_lite.models.decoder import Decoder
from flaxformer_lite.models.embedder import make_embedding
from flaxformer_lite.models.tokens import check_tokens, shift_right
from flaxformer_lite.nn.config import TransformerConfig

Array = jax.Array


class DecoderOnly(nn.Module):
    """A language model: the decoder stack without encoder-decoder attention.

    ``model.apply(variables, tokens)``: int `[batch, length]` -> logits `[batch, length, vocab]`,
    logits[:, t] predicting tokens[:, t] from BOS + tokens[:, :t] (shifted inside).
    """

    config: TransformerConfig

    def setup(self) -> None:
        self.decoder = Decoder(
            self.config,
            make_embedding(self.config, self.config.vocab_size, "embedding", attends=True),
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
        left_padding: Array | None = None,
    ) -> Array:
        """Logits from *shifted* inputs `[batch, length]`; ``decode=True`` uses the cache
        (``check_cache``, ``beam_size`` and ``targets_valid`` as in ``EncoderDecoder.decode``;
        ``left_padding`` int `[batch]` for left-padded prompts, see ``Decoder``).

        Hugging Face's causal LMs take their inputs this way: ``decode(input_ids)`` (BOS
        included, as their tokenizers add it) gives their logits; with an attention mask,
        ``decoder_positions`` and ``segmentation`` from ``tokens.positions_from_mask``."""
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
            left_padding=left_padding,
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
