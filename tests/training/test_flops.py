"""flops.forward_flops against XLA's own count of the compiled forward pass.

XLA's ``cost_analysis()["flops"]`` counts every operation (2*m*n*k per matmul plus the
element-wise work); the analytic count covers the matmuls only, so it must sit a little below
XLA's and within 5% on models whose matmuls dominate: gated feed-forwards (three matrices),
multi-query and grouped-query key/value projections and the attention scores included.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderClassifier, EncoderDecoder, TransformerConfig
from flaxformer_lite.training import flops

BASE = TransformerConfig(
    vocab_size=256,
    d_model=128,
    num_heads=4,
    d_ff=512,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=64,
    dropout_rate=0.0,
)
BATCH, SRC, TGT = 2, 32, 24

CASES = {
    # name: (config, encoder-decoder?) -- each architecture switch on one model kind
    "relu_seq2seq": (BASE, True),
    "swiglu_lm": (BASE.replace(activation="swiglu"), False),
    "multi_query_seq2seq": (BASE.replace(num_kv_heads=1), True),
    "grouped_query_geglu_lm": (BASE.replace(num_kv_heads=2, activation="geglu"), False),
    # Heads 48 wide (not 128 / 4 = 32): attention is 192 wide between its projections.
    "head_dim_48_seq2seq": (BASE.replace(head_dim=48), True),
}


def xla_forward_flops(cfg: TransformerConfig, seq2seq: bool) -> float:
    inputs = jnp.ones((BATCH, SRC), jnp.int32)
    targets = jnp.ones((BATCH, TGT), jnp.int32)
    if seq2seq:
        model, args = EncoderDecoder(cfg), (inputs, targets)
    else:
        model, args = DecoderOnly(cfg), (targets,)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))
    return jax.jit(model.apply).lower(variables, *args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("name", list(CASES))
def test_forward_flops_within_5_percent_of_xla_cost_analysis(name):
    cfg, seq2seq = CASES[name]
    xla = xla_forward_flops(cfg, seq2seq)
    ours = flops.forward_flops(cfg, BATCH, SRC if seq2seq else 0, TGT)
    # Element-wise work (softmax, norms, residuals) is in XLA's count, not in ours.
    assert 0.95 * xla <= ours <= xla, (name, ours, xla)


def test_train_flops_is_three_forwards_and_counts_the_classifier_head():
    cfg = BASE.replace(activation="swiglu", num_kv_heads=2)
    assert flops.train_flops(cfg, 3, 10, 7) == 3 * flops.forward_flops(cfg, 3, 10, 7)
    encoder_only = flops.forward_flops(cfg, 1, 10, 0)
    assert flops.forward_flops(cfg, 1, 10, 0, num_classes=5) == encoder_only + 2 * 128 * 5
    with pytest.raises(ValueError, match="src_len"):
        flops.forward_flops(cfg, 1, -1, 0)


def test_mixture_of_experts_counts_the_routed_experts_and_the_router():
    """Every second layer has 4 experts, top-2: those layers' feed-forward FLOPs double
    (2 experts per token) and the router adds 2 * n * d * 4; dense layers are unchanged."""
    dense = BASE.replace(num_encoder_layers=2, num_decoder_layers=2)
    moe = dense.replace(num_experts=4, num_experts_per_token=2, moe_every=2)
    ffn = 2 * 128 * 512 * 2  # per token: two matrices of d x d_ff
    router = 2 * 128 * 4
    extra_per_token = ffn + router  # one more expert + the router, in one layer per stack
    expected = BATCH * (SRC + TGT) * extra_per_token
    assert flops.forward_flops(moe, BATCH, SRC, TGT) - flops.forward_flops(
        dense, BATCH, SRC, TGT
    ) == pytest.approx(expected)


SMALL = TransformerConfig(
    vocab_size=40,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=2,
    num_decoder_layers=3,
    max_len=12,
    num_classes=3,
)
# name: (config, model kind): every switch that adds, removes or reshapes a parameter.
COUNT_CASES = {
    "paper": (SMALL, "encoder_decoder"),
    "head_dim_12_gqa_fused": (
        SMALL.replace(head_dim=12, num_heads=4, num_kv_heads=2, fused_qkv=True),
        "encoder_decoder",
    ),
    "head_dim_5_mqa_untied_learned_pre_rms_nobias": (
        SMALL.replace(
            head_dim=5,
            num_kv_heads=1,
            share_embeddings=False,
            target_vocab_size=30,
            tie_output_embedding=False,
            logits_bias=True,
            position="learned",
            norm_position="pre",
            norm_type="rmsnorm",
            use_bias=False,
            activation="swiglu",
        ),
        "encoder_decoder",
    ),
    "moe_geglu_scan": (
        SMALL.replace(num_experts=3, moe_every=1, activation="geglu", scan_layers=True, head_dim=6),
        "encoder_decoder",
    ),
    "moe_every_2_lm_untied_bias": (
        SMALL.replace(
            num_experts=4, moe_every=2, tie_output_embedding=False, logits_bias=True, head_dim=10
        ),
        "decoder_only",
    ),
    "lm_learned_pre": (SMALL.replace(position="learned", norm_position="pre"), "decoder_only"),
    "relative_head_dim_6": (
        SMALL.replace(position="relative", relative_num_buckets=8, head_dim=6),
        "encoder_decoder",
    ),
    "lm_relative": (SMALL.replace(position="relative", num_heads=4), "decoder_only"),
    "classifier_attention_pooling": (
        SMALL.replace(pooling="attention", head_dim=20, num_kv_heads=1),
        "classifier",
    ),
    "classifier_mean_pre": (SMALL.replace(norm_position="pre"), "classifier"),
    # BART (post-LN) and mBART (pre-LN): offset position rows and an embedding norm per stack.
    "bart_offset_embedding_norm": (
        SMALL.replace(position="learned", learned_position_offset=2, embedding_norm=True),
        "encoder_decoder",
    ),
    "mbart_pre_rms_embedding_norm_lm": (
        SMALL.replace(
            position="learned",
            learned_position_offset=3,
            embedding_norm=True,
            norm_position="pre",
            norm_type="rmsnorm",
        ),
        "decoder_only",
    ),
    "classifier_embedding_norm": (SMALL.replace(embedding_norm=True), "classifier"),
}
MODELS = {
    "encoder_decoder": EncoderDecoder,
    "decoder_only": DecoderOnly,
    "classifier": EncoderClassifier,
}


def initialised_parameter_count(cfg: TransformerConfig, kind: str) -> int:
    """Scalars in the ``params`` of the model as ``init`` builds it (shapes only)."""
    model = MODELS[kind](cfg)
    tokens = jnp.ones((1, 5), jnp.int32)
    args = (tokens, tokens) if kind == "encoder_decoder" else (tokens,)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
    return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(nn.meta.unbox(shapes)))


@pytest.mark.parametrize("name", list(COUNT_CASES))
def test_parameter_count_formula_equals_the_initialised_model(name):
    cfg, kind = COUNT_CASES[name]
    assert flops.parameter_count(cfg, kind) == initialised_parameter_count(cfg, kind)


def test_parameter_count_follows_head_dim_and_rejects_unknown_models():
    """SMALL (d 16, 2 heads, multi-head, biases) has 2 encoder and 2 x 3 decoder attention
    layers, each with 4 * d * (2 * hd) weights and 3 * (2 * hd) + d biases: head_dim 12
    instead of 16 / 2 = 8 adds 4 * 16 * 8 + 3 * 8 = 536 parameters to each of the 8."""
    wider = flops.parameter_count(SMALL.replace(head_dim=12))
    assert wider - flops.parameter_count(SMALL) == (2 + 2 * 3) * 536
    assert flops.parameter_count(SMALL.replace(head_dim=8)) == flops.parameter_count(SMALL)
    with pytest.raises(ValueError, match="model must be one of"):
        flops.parameter_count(SMALL, "encoder_only")


def test_the_peak_counts_accelerators_but_a_processs_cpu_devices_once():
    """CPU devices of one process (config.cpu_devices) share its cores: 2 of them must not
    halve the MFU a run reports; every GPU or TPU adds its own peak; CPU hosts add theirs."""
    assert flops.peak_multiplier("cpu", device_count=2, process_count=1) == 1
    assert flops.peak_multiplier("cpu", device_count=8, process_count=2) == 2
    assert flops.peak_multiplier("gpu", device_count=8, process_count=1) == 8
    assert flops.peak_multiplier("tpu", device_count=16, process_count=4) == 16


def test_a_configured_peak_replaces_the_measurement_and_still_counts_devices(monkeypatch):
    """config.peak_flops (one device's datasheet figure) skips the start-up matmul; the
    measurement, when it runs, uses the backend's matrix size and the compute dtype."""
    measured = []

    def measure(size, dtype):
        measured.append((size, dtype))
        return 5.0

    monkeypatch.setattr(flops, "matmul_peak_flops", measure)

    def peak(configured, backend, devices, processes):
        return flops.run_peak_flops(
            configured, backend=backend, device_count=devices, process_count=processes,
            dtype=jnp.bfloat16,
        )  # fmt: skip

    assert peak(197e12, "tpu", 8, 2) == 8 * 197e12
    assert peak(3e11, "cpu", 2, 1) == 3e11
    assert measured == []
    assert peak(None, "cpu", 2, 1) == 5.0
    assert peak(None, "gpu", 4, 1) == 20.0
    assert measured == [(1024, jnp.bfloat16), (4096, jnp.bfloat16)]
