"""Flax linen layers built on ``ops``, and the one frozen ``TransformerConfig`` they read.

``config`` (the validated, JSON round-tripping model config); the leaf modules, which take plain
arguments: ``attention`` (``MultiHeadAttention``, every mode: self/cross, cache, ring buffer,
beams), ``projections`` (into and out of heads, separate or fused), ``mlp`` (``MlpBlock``),
``embed`` (``Embed``, tied logits), ``dense`` (kernels that may be int8, ``Int8Dense``), ``moe``
(the mixture-of-experts feed-forward block); ``layers`` (the encoder and decoder layers built
from a config).
"""
