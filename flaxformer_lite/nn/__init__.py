"""Flax linen layers built on ``ops``, and the one frozen ``TransformerConfig`` they read.

``config`` (the validated, JSON round-tripping model config), ``layers`` (projections, attention,
MLP, embeddings, encoder and decoder layers), ``moe`` (the mixture-of-experts feed-forward block).
"""
