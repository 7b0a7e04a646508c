"""The fast attention paths do what they claim.

cuDNN: the dispatch decision is a pure function of backend, dtype, shapes and mask structure
(a table); off a GPU the "cudnn" switch runs the reference after one warning and keeps its
contract (any broadcastable mask, zeros for rows with nothing allowed). Blockwise: an
``AttentionMask`` (causal, padding, segment ids, applied per block) equals its dense matrix,
the models with blockwise attention give the reference's logits, and forward + backward memory
of EncoderDecoder and DecoderOnly grows linearly in length (compiled memory analysis at 4k and
16k tokens: compiled only, never run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderDecoder, TransformerConfig
from flaxformer_lite.ops.attention import (
    cudnn_unsupported_reason,
    dot_product_attention,
    warn_cudnn_fallback,
)
from flaxformer_lite.ops.blockwise import blockwise_attention
from flaxformer_lite.ops.masks import AttentionMask

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- cuDNN dispatch

H100, A100 = (9, 0), (8, 0)
Q, K = (2, 128, 8, 64), (2, 128, 2, 64)  # [batch, len, heads, head_dim], grouped-query keys
BF16 = ("bfloat16",) * 3

DISPATCH = [
    # (backend, dtypes, query shape, key shape, dense mask/bias, segments, capability) -> reason
    (("cuda", BF16, Q, K, False, False, A100), None),
    (("cuda", ("float16",) * 3, Q, K, True, False, A100), None),
    (("cuda", BF16, Q, (2, 96, 1, 64), False, False, H100), None),  # multi-query, T != S
    (("cpu", BF16, Q, K, False, False, None), "backend is 'cpu'"),
    (("tpu", BF16, Q, K, False, False, None), "backend is 'tpu'"),
    (("rocm", BF16, Q, K, False, False, None), "backend is 'rocm'"),
    (("cuda", ("float32",) * 3, Q, K, False, False, A100), "dtype float32"),
    (("cuda", ("bfloat16", "float16", "float16"), Q, K, False, False, A100), "dtypes differ"),
    (("cuda", BF16, (2, 128, 8, 12), (2, 128, 2, 12), False, False, A100), "head_dim 12"),
    (("cuda", BF16, (2, 128, 2, 256), (2, 128, 2, 256), False, False, A100), "head_dim 256"),
    (("cuda", BF16, (2, 128, 2, 256), (2, 128, 2, 256), False, False, H100), None),
    (("cuda", BF16, (2, 127, 8, 64), K, True, False, A100), "odd lengths"),
    (("cuda", BF16, (2, 127, 8, 64), K, False, True, A100), "odd lengths"),
    (("cuda", BF16, (2, 127, 8, 64), K, False, False, A100), None),  # causal/lengths: any length
    (("cuda", BF16, (2, 0, 8, 64), K, False, False, A100), "empty sequence"),
]


@pytest.mark.parametrize("args,want", DISPATCH)
def test_cudnn_dispatch_is_a_pure_function_of_backend_dtype_shapes_and_mask(args, want):
    backend, dtypes, q_shape, k_shape, dense, segments, capability = args
    reason = cudnn_unsupported_reason(
        backend=backend,
        dtypes=dtypes,
        query_shape=q_shape,
        key_shape=k_shape,
        dense_mask_or_bias=dense,
        segments=segments,
        compute_capability=capability,
    )
    if want is None:
        assert reason is None
    else:
        assert reason is not None and want in reason


def random_qkv(batch, q_len, kv_len, heads, kv_heads, dim, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(batch, q_len, heads, dim)).astype(np.float32),
        rng.normal(size=(batch, kv_len, kv_heads, dim)).astype(np.float32),
        rng.normal(size=(batch, kv_len, kv_heads, dim)).astype(np.float32),
    )


def test_cudnn_off_gpu_warns_once_then_runs_the_reference_with_any_mask_rank():
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the fallback; on a GPU the dispatch table covers the choice")
    q, k, v = random_qkv(2, 4, 5, 4, 2, 8)
    key_mask = np.array([True, True, False, True, False])  # rank 1: broadcast over everything
    masks = [key_mask, key_mask[None], np.ones((4, 5), bool), np.ones((2, 1, 4, 5), bool)]
    masks[-1][1, 0, 2] = False  # row 2 of example 1 sees nothing: zeros
    warn_cudnn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mask in masks:
            got = dot_product_attention(q, k, v, mask, implementation="cudnn")
            want = dot_product_attention(q, k, v, np.broadcast_to(mask, (2, 1, 4, 5)))
            np.testing.assert_array_equal(got, want)
    fallback = [w for w in caught if "runs the XLA reference instead" in str(w.message)]
    assert len(fallback) == 1 and "backend is 'cpu'" in str(fallback[0].message)
    np.testing.assert_array_equal(got[1, 2], 0.0)
    with pytest.raises(ValueError, match="rank <= 4"):
        dot_product_attention(q, k, v, np.ones((1, 2, 1, 4, 5), bool), implementation="cudnn")


# ----------------------------------------------------------------------------- AttentionMask


def test_attention_mask_structure_equals_its_dense_matrix_on_every_path():
    """Causal + padding + packed segments, grouped-query heads, blocks of 3 queries x 4 keys (so
    several blocks, some wholly in the future, some of one segment only): values and gradients."""
    batch, length = 2, 11
    q, k, v = random_qkv(batch, length, length, 4, 2, 8, seed=1)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    real = np.array([[True] * 9 + [False] * 2, [True] * 8 + [False] * 3])
    structured = AttentionMask(
        query_valid=jnp.asarray(real),
        key_valid=jnp.asarray(real),
        query_segment_ids=jnp.asarray(seg),
        key_segment_ids=jnp.asarray(seg),
        causal=True,
    )
    dense = structured.dense(length, length)
    assert dense.shape == (batch, 1, length, length)
    assert not np.asarray(dense)[0, 0, 4, :4].any() and np.asarray(dense)[0, 0, 5, 4]

    def blockwise(q, k, v):  # the structure as blockwise_attention's own arguments
        out = blockwise_attention(
            q, k, v, causal=True, key_padding=jnp.asarray(real), query_segment_ids=seg,
            key_segment_ids=seg, query_block=3, key_block=4,
        )  # fmt: skip
        return jnp.where(jnp.asarray(real)[:, :, None, None], out, 0)

    paths = {
        "reference_dense": lambda q, k, v: dot_product_attention(q, k, v, dense),
        "reference_structured": lambda q, k, v: dot_product_attention(q, k, v, structured),
        "blockwise_structured": lambda q, k, v: dot_product_attention(
            q, k, v, structured, implementation="blockwise"
        ),
        "blockwise_small_blocks": blockwise,
    }
    cot = np.random.default_rng(2).normal(size=q.shape).astype(np.float32)
    results = {}
    for name, fn in paths.items():

        def value_and_grads(q, k, v, cot, fn=fn):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(cot)

        out, grads = jax.jit(value_and_grads)(q, k, v, cot)  # one compile per path
        results[name] = (np.asarray(out), [np.asarray(g) for g in grads])
    want_out, want_grads = results.pop("reference_dense")
    np.testing.assert_array_equal(want_out[0, 9:], 0.0)  # padded queries: zeros
    for name, (out, grads) in results.items():
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5, err_msg=name)
        for g, g_want in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, g_want, rtol=1e-4, atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------- models

SMALL = TransformerConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=16,
    dropout_rate=0.0,
)


def random_variables(model, *args, seed: int = 0) -> dict:
    """Variables of ``model`` with N(0, 0.3^2) entries: shapes from ``eval_shape`` (the real
    initialisers cost a compile; any values serve to compare two implementations)."""
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), *args)))
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), shapes
    )


def test_blockwise_models_equal_the_reference_on_padded_and_packed_batches():
    """A padded EncoderDecoder batch (query and key padding) and a packed DecoderOnly one
    (causal + segments); the packed EncoderDecoder case is test_models' packed-equals-separate
    on its blockwise variant."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(3, 40, size=(2, 9)), jnp.int32).at[1, 5:].set(0)
    y = jnp.asarray(rng.integers(3, 40, size=(2, 7)), jnp.int32).at[1, 4:].set(0)
    seg_y = jnp.array([[1, 1, 1, 2, 2, 2, 0]] * 2)
    pos_y = jnp.array([[0, 1, 2, 0, 1, 2, 0]] * 2)
    blockwise = SMALL.replace(attention_implementation="blockwise")
    seq2seq = random_variables(EncoderDecoder(SMALL), x, y)
    lm = random_variables(DecoderOnly(SMALL), y)
    for name, model_of, variables, args, kwargs in (
        ("seq2seq_padded", EncoderDecoder, seq2seq, (x, y), {}),
        ("lm_packed", DecoderOnly, lm, (y,), dict(positions=pos_y, segmentation=seg_y)),
    ):
        # Jitted too: eager dispatch compiles op by op (4.6 CPU s here against 1.3 s).
        want = jax.jit(model_of(SMALL).apply)(variables, *args, **kwargs)
        got = jax.jit(model_of(blockwise).apply)(variables, *args, **kwargs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


MEMORY_CFG = TransformerConfig(
    vocab_size=32,
    d_model=64,
    num_heads=4,
    d_ff=128,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=16384,
    dropout_rate=0.0,
    attention_implementation="blockwise",
)


def train_memory_mib(model_of, length: int) -> float:
    """Temp + output bytes of the compiled loss gradient at ``length`` tokens (batch 1)."""
    model = model_of(MEMORY_CFG)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    args = (tokens, tokens) if model_of is EncoderDecoder else (tokens,)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), *(jnp.ones((1, 8), jnp.int32) for _ in args))
    )["params"]

    def loss(params, *args):
        logp = jax.nn.log_softmax(model.apply({"params": params}, *args))
        return -jnp.mean(jnp.take_along_axis(logp, args[-1][..., None], axis=-1))

    memory = jax.jit(jax.grad(loss)).lower(params, *args).compile().memory_analysis()
    return (memory.temp_size_in_bytes + memory.output_size_in_bytes) / 2**20


@pytest.mark.parametrize("model_of", [EncoderDecoder, DecoderOnly], ids=["seq2seq", "lm"])
def test_blockwise_model_forward_backward_memory_grows_linearly(model_of):
    """Measured here (4k -> 16k tokens): EncoderDecoder 62.8 -> 243.1 MiB (3.9x), DecoderOnly
    26.2 -> 97.3 MiB (3.7x); with the dense `[batch, 1, n, n]` masks the models passed before,
    94.8 -> 755.1 MiB (8.0x) and 42.2 -> 353.3 MiB (8.4x)."""
    short, long = train_memory_mib(model_of, 4096), train_memory_mib(model_of, 16384)
    assert long / short <= 5.0, (short, long)


# ----------------------------------------------------------------------------- tensor parallel

TENSOR_PARALLEL = """
import json
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
base = TransformerConfig(vocab_size=64, d_model=64, num_heads=8, d_ff=64, num_encoder_layers=1,
                         num_decoder_layers=1, max_len=16, dropout_rate=0.0)
x = jnp.ones((2, 6), jnp.int32)
unsplit = []
for shape in [(1, 1, 8), (2, 1, 4)]:
    mesh = sharding.make_mesh(shape)
    for kv in (None, 2, 1):  # multi-head, grouped-query, multi-query
        for fused in (True, False):
            cfg = base.replace(num_kv_heads=kv, fused_qkv=fused)
            sharding.check_attention_fits_mesh(cfg, mesh)
            model = EncoderDecoder(cfg)
            boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), x, x)["params"])
            shardings = sharding.logical_shardings(boxed, mesh)
            flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
            named = [(jax.tree_util.keystr(p), sh.spec) for p, sh in flat]
            kernels = [(p, spec) for p, spec in named if "attention" in p and "kernel" in p]
            assert len(kernels) >= 5, kernels
            unsplit += [f"{shape} kv={kv} fused={fused} {p} {spec}" for p, spec in kernels
                        if "tensor" not in jax.tree_util.tree_leaves(tuple(spec))]
errors = {}
for heads, shape in [(4, (1, 1, 8)), (6, (2, 1, 4))]:
    try:
        bad = base.replace(num_heads=heads, d_model=8 * heads)
        sharding.check_attention_fits_mesh(bad, sharding.make_mesh(shape))
    except ValueError as err:
        errors[heads] = str(err)
# Multi-query, fused, on a (2, 1, 4) mesh: sharded logits equal the single-device ones.
cfg = base.replace(num_kv_heads=1, fused_qkv=True)
model = EncoderDecoder(cfg)
y = jnp.asarray(np.random.default_rng(0).integers(3, 64, size=(2, 6)), jnp.int32)
params, _ = sharding.sharded_init(lambda: model.init(jax.random.key(0), y, y)["params"],
                                  sharding.make_mesh((2, 1, 4)))
kv_spec = params["decoder"]["layers_0"]["self_attention"]["qkv"]["kv_kernel"].sharding.spec
local = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), params)
apply = jax.jit(lambda p: model.apply({"params": p}, y, y))
diff = float(np.abs(np.asarray(apply(params)) - np.asarray(apply(local))).max())
print(json.dumps({"unsplit": unsplit, "errors": errors, "diff": diff, "kv_spec": str(kv_spec)}))
"""


def test_every_attention_kernel_splits_over_tensor_for_mha_gqa_mqa_fused_or_not():
    """8 simulated devices, meshes (1, 1, 8) and (2, 1, 4), EncoderDecoder with 8 heads over 8,
    2 and 1 kv heads, fused and unfused: every attention kernel's spec names "tensor"; heads the
    tensor degree does not divide are rejected naming num_heads; a sharded multi-query fused
    model (kv kernel split over d_model) computes the single-device logits."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    done = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["unsplit"] == []
    assert set(out["errors"]) == {"4", "6"}
    for message in out["errors"].values():
        assert "num_heads" in message and "tensor" in message
    assert "tensor" in out["kv_spec"]
    assert out["diff"] < 1e-5
