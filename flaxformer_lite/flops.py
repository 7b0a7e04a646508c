"""Model FLOPs for MFU: an analytic count of every matmul, and the measured matmul peak.

MFU = model FLOPs per second / peak matmul FLOPs per second of the same machine, where the model
FLOPs count 2*m*n*k for every matrix product of the forward pass (projections, attention scores,
attention-weighted values, feed-forward, logits) and forward + backward = 3 x forward.
Attention is counted over the full square even where a causal mask discards half.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def forward_flops(
    *,
    batch: int,
    src_len: int,
    tgt_len: int,
    d_model: int,
    d_ff: int,
    encoder_layers: int,
    decoder_layers: int,
    vocab: int,
) -> float:
    """Matmul FLOPs of one forward pass of an encoder-decoder on `[batch, src/tgt_len]`.

    A decoder-only model is ``encoder_layers=0, src_len=0``; its decoder then has no
    cross-attention term because ``src_len`` is 0.
    """
    d, s, t = d_model, src_len, tgt_len
    encoder = s * encoder_layers * (8 * d * d + 4 * s * d + 4 * d * d_ff)
    cross = (4 * d * d + 4 * s * d) if s else 0
    decoder = t * decoder_layers * (8 * d * d + 4 * t * d + cross + 4 * d * d_ff)
    cross_kv = s * decoder_layers * 4 * d * d if s else 0
    logits = t * 2 * d * vocab
    return float(batch * (encoder + decoder + cross_kv + logits))


def train_flops(**kwargs) -> float:
    """Forward + backward: 3 x the forward matmul FLOPs (the backward does two products per
    forward product: gradients with respect to inputs and to weights)."""
    return 3.0 * forward_flops(**kwargs)


def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """Measured FLOP/s of a jitted ``size`` x ``size`` matmul on the default device."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = f(a, b)
        out.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 * repeats / best
