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

One module per job; this package re-exports their public names:

  tokens           check_tokens, shift_right, default_positions
  embedder         the embedding tables, Embedder (token embedding + absolute positions)
  stack            layer_stack (unrolled or scanned layers), relative_bias
  encoder          Encoder
  decoder          Decoder (training and cached decoding), reorder_beam_cache
  encoder_decoder  EncoderDecoder
  decoder_only     DecoderOnly
  classifier       EncoderClassifier
  layouts          unstack_layers, unrolled, param_path, abstract_params
  intermediates    attention_weights_per_layer
  nnx_bridge       to_nnx (the models as Flax NNX modules), linen_params
"""

from flaxformer_lite.models.classifier import EncoderClassifier
from flaxformer_lite.models.decoder import BEAM_ANCESTORS, Decoder, reorder_beam_cache
from flaxformer_lite.models.decoder_only import DecoderOnly
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.encoder_decoder import EncoderDecoder
from flaxformer_lite.models.intermediates import attention_weights_per_layer
from flaxformer_lite.models.layouts import abstract_params, param_path, unrolled, unstack_layers
from flaxformer_lite.models.nnx_bridge import linen_params, to_nnx
from flaxformer_lite.models.stack import layer_stack
from flaxformer_lite.models.tokens import check_tokens, shift_right

__all__ = [
    "BEAM_ANCESTORS",
    "Decoder",
    "DecoderOnly",
    "Encoder",
    "EncoderClassifier",
    "EncoderDecoder",
    "abstract_params",
    "attention_weights_per_layer",
    "check_tokens",
    "layer_stack",
    "linen_params",
    "param_path",
    "reorder_beam_cache",
    "shift_right",
    "to_nnx",
    "unrolled",
    "unstack_layers",
]
