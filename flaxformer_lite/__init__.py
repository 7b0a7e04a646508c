"""flaxformer_lite: the Transformer of "Attention Is All You Need" in JAX and Flax linen.

Importing the package loads jax, flax and numpy only. Training, data, decoding CLIs and plotting
live in submodules that import their own heavier dependencies.
"""

from flaxformer_lite import _moved
from flaxformer_lite.models import Decoder, DecoderOnly, Encoder, EncoderClassifier, EncoderDecoder
from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.layers import DecoderLayer, EncoderLayer
from flaxformer_lite.nn.mlp import MlpBlock
from flaxformer_lite.ops import attention, masks, positions
from flaxformer_lite.ops.attention import dot_product_attention

__all__ = [
    "Decoder",
    "DecoderLayer",
    "DecoderOnly",
    "Embed",
    "Encoder",
    "EncoderClassifier",
    "EncoderDecoder",
    "EncoderLayer",
    "MlpBlock",
    "MultiHeadAttention",
    "TransformerConfig",
    "attention",
    "dot_product_attention",
    "masks",
    "positions",
]
__version__ = "0.1.0"

_moved.install()  # the flat module paths of 0.1 (flaxformer_lite.hf, ...) still import
