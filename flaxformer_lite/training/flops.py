"""Model FLOPs for MFU: an analytic count of every matmul, and the measured matmul peak;
the parameter count from its formula (``parameter_count``).

MFU = model FLOPs per second / peak matmul FLOPs per second of the same machine, where the model
FLOPs count 2*m*n*k for every matrix product of the forward pass and forward + backward = 3 x
forward. Per layer on ``n`` query and ``m`` key positions, with ``h`` query heads, ``kv`` key/value
heads of width ``hd`` (``config.effective_head_dim``) and model width ``d``::

  query and output projections   2 * n * d * (h * hd)        each
  key and value projections      2 * m * d * (kv * hd)       each (multi-/grouped-query: kv < h)
  scores q k^T and weights @ v   2 * n * m * (h * hd)        each
  feed-forward                   2 * n * d * d_ff * (2, or 3 for the gated swiglu/geglu)
  mixture-of-experts layer       k x that (the k experts a token is routed to; capacity
                                 slots left empty are not model FLOPs) + router 2 * n * d * E
  logits (once)                  2 * t * d * vocab

Attention is counted over the full square even where a causal mask discards half (what the
reference "xla" path computes; "blockwise" skips the future key blocks). Element-wise work
(softmax, norms, residuals) is not counted; on a model whose matmuls dominate it is a few
percent of XLA's own count (``compiled.cost_analysis()["flops"]``; tested within 5%).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from flaxformer_lite.nn.config import TransformerConfig


def _attention_flops(config: TransformerConfig, n: int, m: int) -> int:
    """One attention layer: ``n`` queries over ``m`` keys/values (projections included)."""
    d, hd = config.d_model, config.effective_head_dim
    q_width, kv_width = config.num_heads * hd, config.kv_heads * hd
    projections = 2 * n * d * q_width * 2 + 2 * m * d * kv_width * 2  # q, out; k, v
    scores_and_values = 2 * n * m * q_width * 2
    return projections + scores_and_values


def _ffn_flops(config: TransformerConfig, n: int) -> int:
    matrices = 3 if config.activation in ("swiglu", "geglu") else 2
    return 2 * n * config.d_model * config.d_ff * matrices


def _layer_ffn_flops(config: TransformerConfig, n: int, index: int) -> int:
    """Feed-forward FLOPs of layer ``index``: dense, or k routed experts plus the router."""
    if not config.is_moe_layer(index):
        return _ffn_flops(config, n)
    router = 2 * n * config.d_model * config.num_experts
    return config.num_experts_per_token * _ffn_flops(config, n) + router


def forward_flops(
    config: TransformerConfig, batch: int, src_len: int, tgt_len: int, *, num_classes: int = 0
) -> float:
    """Matmul FLOPs of one forward pass on ``batch`` rows of ``src_len`` source and ``tgt_len``
    target tokens.

    ``EncoderDecoder``: both lengths. ``DecoderOnly``: ``src_len=0`` (no encoder, no
    cross-attention). ``EncoderClassifier``: ``tgt_len=0`` (no decoder, no logits over the
    vocabulary; ``num_classes`` adds its pooled head).
    """
    if min(batch, src_len, tgt_len) < 0:
        raise ValueError(
            f"batch, src_len and tgt_len must be >= 0; got {batch}, {src_len}, {tgt_len}"
        )
    s, t = src_len, tgt_len
    encoder = config.num_encoder_layers * _attention_flops(config, s, s) + sum(
        _layer_ffn_flops(config, s, i) for i in range(config.num_encoder_layers)
    )
    decoder = 0
    if t:
        cross = _attention_flops(config, t, s) if s else 0
        decoder = (
            config.num_decoder_layers * (_attention_flops(config, t, t) + cross)
            + sum(_layer_ffn_flops(config, t, i) for i in range(config.num_decoder_layers))
            + 2 * t * config.d_model * config.output_vocab_size
        )
    head = 2 * config.d_model * num_classes
    return float(batch * ((encoder if s else 0) + decoder + head))


MODEL_KINDS = ("encoder_decoder", "decoder_only", "classifier")


def _attention_params(config: TransformerConfig) -> int:
    """One attention layer: query `[d, h, hd]`, key and value `[d, kv, hd]`, output
    `[h, hd, d]` (the same count fused or not), with biases `[h, hd]`, `[kv, hd]`, `[d]`."""
    d, hd = config.d_model, config.effective_head_dim
    q_width, kv_width = config.num_heads * hd, config.kv_heads * hd
    weights = 2 * d * q_width + 2 * d * kv_width
    biases = q_width + 2 * kv_width + d if config.use_bias else 0
    return weights + biases


def _ffn_params(config: TransformerConfig, index: int) -> int:
    """Layer ``index``'s feed-forward block: dense, or ``num_experts`` copies plus the
    router `[d, experts]` (biases, when ``use_bias``, on every expert)."""
    d, f = config.d_model, config.d_ff
    gated = config.activation in ("swiglu", "geglu")
    dense = (3 if gated else 2) * d * f
    if config.use_bias:
        dense += (2 if gated else 1) * f + d
    if not config.is_moe_layer(index):
        return dense
    return config.num_experts * dense + d * config.num_experts


def parameter_count(config: TransformerConfig, model: str = "encoder_decoder") -> int:
    """Number of parameters (scalars) of ``model`` built from ``config``, from the formula.

    ``model``: "encoder_decoder" (``EncoderDecoder``), "decoder_only" (``DecoderOnly``) or
    "classifier" (``EncoderClassifier``). Counts embeddings (shared or not), learned position
    tables and relative position bias tables (one per stack), every layer's attention
    (``_attention_params``: widths num_heads * head_dim and kv_heads * head_dim, so
    ``head_dim`` apart from d_model / num_heads changes them), feed-forward or
    mixture-of-experts blocks, norms (LayerNorm: scale and bias; RMSNorm: scale; a final norm
    per stack when pre-LN, an embedding norm per stack with ``embedding_norm``), the untied
    output projection, the logits bias and the classifier head (and its pooling query).
    ``scan_layers`` stacks the same parameters, so it does not change the count.
    """
    if model not in MODEL_KINDS:
        raise ValueError(f"model must be one of {MODEL_KINDS}; got {model!r}")
    d = config.d_model
    norm = d * (1 if config.norm_type == "rmsnorm" else 2)
    final_norm = norm if config.norm_position == "pre" else 0
    embedding_norm = norm if config.embedding_norm else 0
    positions = {
        # a `[offset + max_len, d]` table per stack
        "learned": (config.learned_position_offset + config.max_len) * d,
        "relative": config.relative_num_buckets * config.num_heads,  # `[buckets, heads]`
    }.get(config.position, 0)
    attention = _attention_params(config)

    def stack(layers: int, attentions: int) -> int:
        per_layer = [
            attentions * attention + _ffn_params(config, i) + (attentions + 1) * norm
            for i in range(layers)
        ]
        return sum(per_layer) + final_norm + embedding_norm + positions

    encoder = stack(config.num_encoder_layers, 1)
    if model == "classifier":
        head = d * config.num_classes + config.num_classes
        pooling = d if config.pooling == "attention" else 0
        return config.vocab_size * d + encoder + head + pooling
    vocab_out = config.output_vocab_size
    output = (0 if config.tie_output_embedding else d * vocab_out) + (
        vocab_out if config.logits_bias else 0
    )
    if model == "decoder_only":
        return config.vocab_size * d + stack(config.num_decoder_layers, 1) + output
    embeddings = config.vocab_size * d + (0 if config.share_embeddings else vocab_out * d)
    return embeddings + encoder + stack(config.num_decoder_layers, 2) + output


def train_flops(
    config: TransformerConfig, batch: int, src_len: int, tgt_len: int, *, num_classes: int = 0
) -> float:
    """Forward + backward: 3 x the forward matmul FLOPs (the backward does two products per
    forward product: gradients with respect to inputs and to weights)."""
    return 3.0 * forward_flops(config, batch, src_len, tgt_len, num_classes=num_classes)


@functools.cache
def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """Measured FLOP/s of a jitted ``size`` x ``size`` matmul on the default device (measured
    once per process and arguments: a process that trains several times pays it once)."""
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


def peak_multiplier(backend: str, device_count: int, process_count: int) -> int:
    """How many times one device's measured :func:`matmul_peak_flops` the run's peak is:
    every accelerator adds its own, while the CPU devices of one process
    (``config.cpu_devices``) share that process's cores, which one device's measurement
    already used (a 1024-square matmul on device 0: 262, 250 and 273 GFLOP/s with 1 CPU
    device, 2 by ``jax_num_cpu_devices`` and 2 by the XLA flag, 2 Xeon cores)."""
    return process_count if backend == "cpu" else device_count


def run_peak_flops(
    configured: float | None,
    *,
    backend: str,
    device_count: int,
    process_count: int,
    dtype=jnp.float32,
) -> float:
    """The run's peak FLOP/s, the denominator of its MFU: one device's peak (``configured``,
    e.g. a datasheet figure from ``config.peak_flops``, or else :func:`matmul_peak_flops` of a
    square matmul in ``dtype``) times :func:`peak_multiplier`. On a CPU a 1024-square matmul
    reaches the peak of a 2048 one (67.8 vs 68.9 GFLOP/s measured on a 2-core EPYC) in a sixth
    of the time (1.4 s vs 8.6 s, paid at every start); accelerators need a larger product."""
    if configured is None:
        configured = matmul_peak_flops(1024 if backend == "cpu" else 4096, dtype=dtype)
    return configured * peak_multiplier(backend, device_count, process_count)
