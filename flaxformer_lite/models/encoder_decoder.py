"""The paper's Transformer for translation: source tokens + target tokens -> target logits."""

from __future__ import annotations

import flax.linen as nn
import jax

from flaxformer_lite.models.decoder import Decoder
from flaxformer_lite.models.embedder import make_embedding
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.tokens import check_tokens, shift_right
from flaxformer_lite.nn.config import TransformerConfig

Array = jax.Array


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
        source = make_embedding(cfg, cfg.vocab_size, "source_embedding", attends=shared)
        target = (
            source
            if shared
            else make_embedding(cfg, cfg.output_vocab_size, "target_embedding", attends=True)
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
        ``ops.kv_cache.check_cache_room``).

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
