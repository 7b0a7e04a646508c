"""Int8 inference (``quantize``): the weight round trip, the int8 matmul against its error
bound, a quantized model against its float self, a trained model's greedy tokens, the errors."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.cli import translate  # noqa: E402
from flaxformer_lite.inference.translator import Translator  # noqa: E402
from flaxformer_lite.models import EncoderClassifier, EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402
from flaxformer_lite.ops.quantize import (  # noqa: E402
    dequantize_params,
    int8_matmul,
    quantize_params,
    quantize_weight,
)

from helpers.tiny_configs import translator_config


@pytest.mark.parametrize("shape, in_axes", [((48, 20), 1), ((4, 6, 10), 2), ((16, 3, 2, 5), 1)])
def test_weight_round_trip_is_within_half_a_step_per_channel(shape, in_axes):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[(slice(None),) * in_axes + (0,) * (len(shape) - in_axes)] = 0.0  # an all-zero channel
    q, scale = quantize_weight(w, in_axes)
    assert q.dtype == np.int8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == shape[in_axes:]
    error = np.abs(w - q.astype(np.float32) * scale)
    assert np.all(error <= scale / 2 * (1 + 1e-6))  # round to nearest: half a step at most
    peak = np.abs(q).max(axis=tuple(range(in_axes)))  # every channel's largest weight is +-127
    assert np.all((peak == 127) | (scale == 1.0)) and peak.flat[0] == 0


@pytest.mark.parametrize("lead", [(3, 5), (1,), (1, 3)])  # 15 rows; 1 and 3: padded to 4
def test_int8_matmul_is_the_integer_product_and_within_its_error_bound(lead):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((*lead, 64)).astype(np.float32)
    zero = x.size // 64 > 1
    if zero:
        x.reshape(-1, 64)[-1] = 0.0  # a zero row stays exactly zero
    w = (rng.standard_normal((64, 40)) * 0.1).astype(np.float32)
    q, s = quantize_weight(w)
    y = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)))
    # Reference: the same quantized rows multiplied in int64 by numpy, then rescaled.
    rows = x.reshape(-1, 64)
    r = np.where(np.abs(rows).max(1, keepdims=True) > 0, np.abs(rows).max(1, keepdims=True), 127)
    r = r.astype(np.float32) / np.float32(127)
    p = np.clip(np.rint(rows / r), -127, 127).astype(np.int64)
    expected = (p @ q.astype(np.int64)).astype(np.float32) * r * s
    np.testing.assert_allclose(y.reshape(-1, 40), expected, rtol=1e-6, atol=1e-6)
    # x = p r + dx, w = q s + dw with |dx| <= r/2, |dw| <= s/2, so
    # |x w - (p r)(q s)| = |x dw + dx w - dx dw| <= s/2 |x|_1 + r/2 |w|_1 + K r s / 4.
    bound = (
        s / 2 * np.abs(rows).sum(1, keepdims=True)
        + r / 2 * np.abs(w).sum(0, keepdims=True)
        + 64 * r * s / 4
    )
    error = np.abs(rows @ w - y.reshape(-1, 40))
    assert np.all(error <= bound * (1 + 1e-5) + 1e-6)
    assert error.max() > 0 and (not zero or np.all(y.reshape(-1, 40)[-1] == 0))


def small_config(**overrides) -> TransformerConfig:
    kw = dict(
        vocab_size=40,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        max_len=16,
    )
    return TransformerConfig(**{**kw, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(tie_output_embedding=False, share_embeddings=False, fused_qkv=True)],
    ids=["tied", "untied_fused"],
)
def test_int8_model_matches_its_float_self(overrides):
    config = small_config(**overrides)
    tokens = jnp.asarray(np.random.default_rng(2).integers(4, 40, (2, 12)), jnp.int32)
    params = nn.meta.unbox(EncoderDecoder(config).init(jax.random.key(0), tokens, tokens))
    params = params["params"]
    config_q = config.replace(quantization="int8")
    params_q = quantize_params(params, config)
    # The tree init builds under quantization="int8" (what sharding places): same names,
    # shapes and dtypes.
    abstract = jax.eval_shape(
        lambda: EncoderDecoder(config_q).init(jax.random.key(1), tokens, tokens)
    )
    shapes = lambda t: jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)  # noqa: E731
    assert shapes(nn.meta.unbox(abstract["params"])) == shapes(params_q)
    # dequantize_params: back to the float model's tree, each quantized weight within half a
    # step of its float original (q * scale), everything else (tables, norms, biases) as it was.
    float_q = traverse_util.flatten_dict(params_q)
    deq = traverse_util.flatten_dict(dequantize_params(params_q))
    flat = traverse_util.flatten_dict(params)
    assert shapes(deq) == shapes(flat)
    quantized = 0
    for path, w in flat.items():
        scale = float_q.get((*path[:-1], path[-1] + "_scale"))
        if scale is None:
            np.testing.assert_array_equal(deq[path], w)
        else:
            quantized += 1
            assert np.all(np.abs(deq[path] - np.asarray(w)) <= scale / 2 * (1 + 1e-6))
            np.testing.assert_array_equal(deq[path], float_q[path].astype(np.float32) * scale)
    assert quantized >= 10
    logits = EncoderDecoder(config).apply({"params": params}, tokens, tokens)
    logits_q = EncoderDecoder(config_q).apply({"params": params_q}, tokens, tokens)
    # Per matmul the bound above is, relative to |x|_1 max|w|, at most 1/254 + 1/254 (+ a
    # 1/(4 * 127^2) term): 0.79%. A logit goes through 9 quantized matmuls in sequence here
    # (encoder: qkv, out, wi, wo; decoder: cross-attention keys/values, out, wi, wo; the
    # logits), so to first order (norms rescale, they do not amplify the relative error) it
    # is within 9 x 0.79% = 7.1% of the logits' scale; typical errors are far smaller.
    error = np.abs(np.asarray(logits_q) - np.asarray(logits))
    assert error.max() <= 0.071 * np.abs(np.asarray(logits)).max()
    assert np.linalg.norm(error) <= 0.02 * np.linalg.norm(np.asarray(logits))
    assert error.max() > 0  # the int8 path ran


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synthetic_run")
    train.train_and_evaluate(translator_config(steps=60), str(path))
    return path


# 32 digit strings of 2 to 6 digits: the synthetic task's inputs.
LINES = ["".join(map(str, np.random.default_rng(i).integers(0, 10, 2 + i % 5))) for i in range(32)]


def assert_mostly_agrees(reference: Translator, translator: Translator) -> None:
    """Greedy translations of LINES equal on at least 85% of them."""
    ref = reference.translate(LINES, method="greedy", batch_size=32)
    out = translator.translate(LINES, method="greedy", batch_size=32)
    same = sum(a == b for a, b in zip(ref, out, strict=True))
    assert same >= 0.85 * len(LINES), list(zip(ref, out, strict=True))


def assert_cli_matches(workdir, tmp_path, flags: list[str], translator: Translator) -> None:
    """The translate CLI with ``flags`` prints ``translator``'s strings."""
    (tmp_path / "in.txt").write_text("\n".join(LINES[:4]) + "\n")
    argv = ["--workdir", str(workdir), "--method", "greedy", *flags]
    argv += ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")]
    assert translate.main(argv) == 0
    expected = translator.translate(LINES[:4], method="greedy")
    assert (tmp_path / "out.txt").read_text().splitlines() == expected


def test_trained_model_greedy_tokens_mostly_equal_in_int8(workdir, tmp_path):
    float_translator = Translator.from_workdir(str(workdir))
    int8_translator = Translator.from_workdir(str(workdir), quantize="int8")
    assert int8_translator.config.quantization == "int8"
    kernel = int8_translator.params["encoder"]["layers_0"]["mlp"]["wi"]["kernel"]
    assert kernel.dtype == jnp.int8
    assert_mostly_agrees(float_translator, int8_translator)
    assert_cli_matches(workdir, tmp_path, ["--quantize", "int8"], int8_translator)


def test_invalid_quantization_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"TransformerConfig.quantization must be one of"):
        small_config(quantization="int4")
    with pytest.raises(ValueError, match=r"quantize must be one of \(None, 'int8'\); got 'fp8'"):
        Translator({}, small_config(), None, quantize="fp8")
    with pytest.raises(SystemExit):
        translate.parse_args(["--workdir", "w", "--quantize", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    tokens = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="EncoderClassifier does not support quantization"):
        EncoderClassifier(small_config(quantization="int8")).init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="scan_layers"):
        quantize_params({}, small_config(scan_layers=True))


def test_bfloat16_decoding_stores_bfloat16_weights_and_mostly_agrees(workdir, tmp_path):
    float_translator = Translator.from_workdir(str(workdir))
    bf16 = Translator.from_workdir(str(workdir), dtype="bfloat16")
    assert (bf16.config.dtype, bf16.config.param_dtype) == ("bfloat16", "bfloat16")
    leaves = jax.tree_util.tree_leaves(bf16.params)
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    # int8 weights with bfloat16 activations (CTranslate2's int8_bfloat16).
    both = Translator.from_workdir(str(workdir), quantize="int8", dtype="bfloat16")
    assert both.params["encoder"]["layers_0"]["mlp"]["wi"]["kernel"].dtype == jnp.int8
    assert_mostly_agrees(float_translator, bf16)
    assert_mostly_agrees(float_translator, both)
    assert_cli_matches(workdir, tmp_path, ["--dtype", "bfloat16"], bf16)
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
        Translator.from_workdir(str(workdir), dtype="float16")
