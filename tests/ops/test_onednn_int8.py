"""oneDNN's int8 matmul as XLA custom calls (``ops.onednn_int8``): the exact integer product
against NumPy's int64 one, an int8 model bitwise equal to itself on XLA's int8 dot (logits,
greedy and beam tokens and scores), the weights packed once per call outside the decoding
loop, export free of custom calls, and the refusals."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding import generate as gen
from flaxformer_lite.inference import export
from flaxformer_lite.models import EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops import onednn_int8, quantize

from helpers import hlo as hlo_text

REASON = onednn_int8.unavailable_reason()
needs_onednn = pytest.mark.skipif(
    REASON is not None or jax.default_backend() != "cpu",
    reason=f"oneDNN's int8 kernel runs on the CPU only; here: {REASON or jax.default_backend()}",
)


@needs_onednn
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 512, 1000), (3, 37, 5), (4, 130, 999), (33, 64, 64), (70, 1, 3)],
)
def test_the_product_is_numpys_int64_product(m, k, n):
    """Odd sizes (not multiples of oneDNN's blocks of 4, 16 or 64), one row, extreme values."""
    rng = np.random.default_rng(m * k + n)
    x = rng.integers(-127, 128, (m, k), dtype=np.int8)
    q = rng.integers(-127, 128, (k, n), dtype=np.int8)
    x[0, :] = -127  # the largest magnitudes the quantizer writes: sums of +-16,129
    q[:, 0] = 127
    got = np.asarray(jax.jit(onednn_int8.int8_product)(x, q))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.astype(np.int64) @ q.astype(np.int64))


@needs_onednn
def test_products_run_at_once_stay_exact():
    """Products running at once on several threads (as XLA runs a program's independent
    custom calls, and as threads calling one jitted function do) each stay exact. oneDNN's
    default scratchpad is one buffer shared by all primitives, so each call brings its own:
    with the shared one, the forward pass of 32 opus-mt-sized sentences came out wrong by up
    to 2.4 in a logit in some runs and not in others."""
    rng = np.random.default_rng(11)
    x = rng.integers(-127, 128, (4, 768, 512), dtype=np.int8)
    q = rng.integers(-127, 128, (4, 512, 1024), dtype=np.int8)
    # float64 products of int8 values: exact (every partial sum is below 2^53).
    want = [x[i].astype(np.float64) @ q[i].astype(np.float64) for i in range(4)]
    product = jax.jit(onednn_int8.int8_product)
    jax.block_until_ready(product(x[0], q[0]))  # compiled before the threads start

    def run(i: int) -> bool:
        return all(np.array_equal(np.asarray(product(x[i], q[i])), want[i]) for _ in range(10))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4))) == [True] * 4


@needs_onednn
@pytest.mark.parametrize("lead, in_axes", [((2, 5), 1), ((1,), 1), ((3, 2), 2)])
def test_int8_matmul_is_bitwise_the_xla_kernels(lead, in_axes):
    rng = np.random.default_rng(7)
    in_shape = (24,) if in_axes == 1 else (4, 6)
    x = jnp.asarray(rng.standard_normal((*lead, *in_shape)), jnp.float32)
    q, s = quantize.quantize_weight(rng.standard_normal((*in_shape, 40)), in_axes)
    run = jax.jit(quantize.int8_matmul, static_argnames=("in_axes", "kernel"))
    ours = np.asarray(run(x, q, s, in_axes=in_axes, kernel="onednn"))
    xla = np.asarray(run(x, q, s, in_axes=in_axes, kernel="xla"))
    np.testing.assert_array_equal(ours, xla)
    assert np.abs(ours).max() > 0


SOURCES = np.array([[5, 9, 12, 7, 3, 2, 0, 0], [6, 6, 11, 30, 21, 17, 8, 2]], np.int32)


@pytest.fixture(scope="module")
def int8_model() -> tuple[TransformerConfig, dict]:
    """A tiny encoder-decoder, quantized (tied embeddings: the int8 ``attend_kernel``; and
    an untied one would take ``Int8Dense`` logits, covered by the feature matrix)."""
    config = TransformerConfig(
        vocab_size=48, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
        num_decoder_layers=2, dropout_rate=0.0, max_len=16,
    )  # fmt: skip
    x = jnp.asarray(SOURCES)
    params = nn.meta.unbox(EncoderDecoder(config).init(jax.random.key(3), x, x))["params"]
    return config.replace(quantization="int8"), quantize.quantize_params(params, config)


@needs_onednn
def test_an_int8_model_decodes_bitwise_as_on_xlas_dot(int8_model):
    config, params = int8_model
    kernels = {k: config.replace(int8_kernel=k) for k in ("onednn", "xla")}
    x = jnp.asarray(SOURCES)
    logits = {
        k: np.asarray(jax.jit(EncoderDecoder(c).apply)({"params": params}, x, x))
        for k, c in kernels.items()
    }
    np.testing.assert_array_equal(logits["onednn"], logits["xla"])
    for options in (dict(method="greedy"), dict(method="beam", beam_size=3, alpha=0.6)):
        out = {
            k: gen.generate(params, c, SOURCES, max_len=10, **options) for k, c in kernels.items()
        }
        np.testing.assert_array_equal(np.asarray(out["onednn"][0]), np.asarray(out["xla"][0]))
        np.testing.assert_array_equal(np.asarray(out["onednn"][1]), np.asarray(out["xla"][1]))


@needs_onednn
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU program")
def test_the_weights_are_packed_once_outside_the_decoding_loop(int8_model):
    """Every int8 matrix is packed by one custom call outside the while loops (XLA hoists the
    pack, whose operand the loop does not change); the loop bodies only multiply. Packing at
    every step would cost a reorder of every weight matrix per token."""
    config, params = int8_model
    config = config.replace(int8_kernel="onednn")
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    program = gen.generate_jit.lower(
        params, config, jnp.asarray(SOURCES), mesh=mesh, method="beam", max_len=10,
        beam_size=3, alpha=0.6,
    ).compile().as_text()  # fmt: skip
    bodies = hlo_text.loop_bodies(program)
    calls = [i for i in hlo_text.unfused(program) if i.opcode == "custom-call"]
    packs = [i for i in calls if onednn_int8.PACK_TARGET in i.line]
    products = [i for i in calls if onednn_int8.MATMUL_TARGET in i.line]
    # Quantized matrices: per encoder layer q, k, v, out, wi, wo (6); per decoder layer
    # self-attention q, k, v, out, cross-attention q, k, v, out, wi, wo (10); the tied logits.
    matrices = 6 * config.num_encoder_layers + 10 * config.num_decoder_layers + 1
    assert len(packs) == matrices, [i.line for i in packs]
    assert not [i.line for i in packs if i.computation in bodies]
    assert [i for i in products if i.computation in bodies]  # the steps multiply in oneDNN


@needs_onednn
def test_the_serving_export_holds_no_custom_call(int8_model):
    """The artifact runs where this package is not installed: XLA's int8 dot, whatever the
    model's ``int8_kernel``."""
    config, params = int8_model
    exported = export.export_function(
        params, config.replace(int8_kernel="onednn"), method="greedy", max_len=6
    )
    text = exported.mlir_module()
    assert "stablehlo.dot_general" in text
    assert not re.search(r"custom_call.*onednn", text)


def test_an_unknown_kernel_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"TransformerConfig.int8_kernel must be one of"):
        TransformerConfig(int8_kernel="mkl")
    with pytest.raises(ValueError, match=r"int8_kernel must be one of \('auto', 'xla', 'onednn'\)"):
        quantize.int8_product(jnp.zeros((2, 3), jnp.int8), jnp.zeros((3, 4), jnp.int8), "vnni")


def test_onednn_where_it_does_not_load_is_refused_with_the_reason(monkeypatch):
    """Asked for explicitly, a kernel that cannot load is an error naming why; "auto" takes
    XLA's dot (the same integers), with one warning naming why when an install could fix it."""
    monkeypatch.setattr(
        onednn_int8, "_loaded", lambda: (None, "no C++ compiler 'g++' on PATH", True)
    )
    quantize._warn_once.cache_clear()
    rng = np.random.default_rng(5)
    side = max(
        int(quantize.ONEDNN_MIN_WEIGHTS**0.5), quantize.ONEDNN_MIN_DEPTH
    )  # "auto" asks for oneDNN
    x = jnp.asarray(rng.integers(-127, 128, (3, side), dtype=np.int8))
    q = jnp.asarray(rng.integers(-127, 128, (side, side), dtype=np.int8))
    with pytest.raises(ValueError, match=r"int8_kernel='onednn' is not available here: no C\+\+"):
        quantize.int8_product(x, q, "onednn")
    with pytest.warns(UserWarning, match=r"XLA's slower int8 dot, not oneDNN's: no C\+\+"):
        got = quantize.int8_product(x, q, "auto")
    want = np.asarray(x, np.int64) @ np.asarray(q, np.int64)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.skipif(
    REASON is not None and "VNNI" not in REASON, reason=f"oneDNN is not loaded here: {REASON}"
)
def test_a_cpu_without_vnni_takes_xlas_dot_silently():
    """Without VNNI or AMX oneDNN sums pairs of u8 x s8 products in 16 bits, which saturate: a
    [32, 512] x [512, 512] product of random int8 values was off by up to 115,974 with oneDNN
    capped at AVX2 or AVX-512 without VNNI. The kernel is then refused as unsupported (no
    warning: nothing to fix), "auto" takes XLA's exact dot, "onednn" is an error. The cap
    (``ONEDNN_MAX_CPU_ISA``) is read once per process, so the check runs in a subprocess."""
    script = """
import warnings
import numpy as np
from flaxformer_lite.ops import onednn_int8, quantize
warnings.simplefilter("error")
reason = onednn_int8.unavailable_reason()
assert reason and "no VNNI or AMX" in reason and not onednn_int8.fixable(), reason
rng = np.random.default_rng(0)
x = rng.integers(-127, 128, (32, 512), dtype=np.int8)
q = rng.integers(-127, 128, (512, 512), dtype=np.int8)
got = np.asarray(quantize.int8_product(x, q, "auto"))
assert np.array_equal(got, x.astype(np.int64) @ q.astype(np.int64))
try:
    quantize.int8_product(x, q, "onednn")
except ValueError as e:
    assert "no VNNI or AMX" in str(e), e
else:
    raise AssertionError("onednn was not refused")
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
