"""blockwise_attention against the reference dot_product_attention: values, gradients, memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops.attention import dot_product_attention
from flaxformer_lite.ops.blockwise import blockwise_attention
from flaxformer_lite.ops.masks import causal_mask


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def random_inputs(shape, seed=0, dtype=np.float32):
    b, ql, kl, h, kvh, d = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, ql, h, d)).astype(dtype)
    k = rng.normal(size=(b, kl, kvh, d)).astype(dtype)
    v = rng.normal(size=(b, kl, kvh, d)).astype(dtype)
    return q, k, v


def reference_mask(shape, mask=None, causal=False, causal_offset=0, key_padding=None):
    """The equivalent explicit boolean mask for the reference, `[b|1, 1|h, q_len, kv_len]`."""
    b, ql, kl = shape[:3]
    full = np.ones((1, 1, ql, kl), bool)
    if causal:
        full = full & (np.arange(kl)[None, :] <= np.arange(ql)[:, None] + causal_offset)
    if key_padding is not None:
        full = full & np.asarray(key_padding)[:, None, None, :]
    if mask is not None:
        full = full & np.asarray(mask)
    return full


def value_and_grads(fn, q, k, v, bias, cotangent):
    """Output and d<out, cotangent>/d(q, k, v[, bias]), jitted."""

    def loss(q, k, v, bias):
        out = fn(q, k, v, bias)
        return jnp.sum(out * cotangent), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        q, k, v, bias
    )
    return out, grads


# batch, q_len, kv_len, heads, kv_heads, head_dim; blocks; mask/bias/causal/key_padding options
CASES = {
    "plain_ragged_blocks": ((2, 13, 13, 4, 4, 8), (4, 5), {}),
    "gqa_mask_full_bias": ((2, 9, 17, 8, 2, 16), (4, 6), {"mask": "full", "bias": "full"}),
    "mqa_key_bias_padding": ((3, 11, 6, 4, 1, 8), (3, 4), {"bias": "key", "key_padding": True}),
    "causal_exact_blocks": ((1, 16, 16, 2, 2, 8), (4, 4), {"causal": True, "bias": "full"}),
    "causal_offset_q_ne_kv": (
        (2, 10, 14, 4, 2, 8),
        (4, 3),
        {"causal": True, "offset": 4, "key_padding": True, "mask": "key"},
    ),
    "decode_step": ((2, 1, 9, 2, 2, 32), (1, 4), {"mask": "key", "bias": "head"}),
    "default_blocks_longer_than_seq": ((1, 7, 5, 2, 1, 8), (512, 512), {"causal": True}),
}


def build_case(shape, opts, seed=1):
    b, ql, kl, h, _, _ = shape
    rng = np.random.default_rng(seed)
    mask = None
    if opts.get("mask") == "full":
        mask = rng.random((b, 1, ql, kl)) > 0.3
        mask[..., 0] = True
    elif opts.get("mask") == "key":
        mask = rng.random((b, 1, 1, kl)) > 0.2
        mask[..., 0] = True
    bias = {
        None: None,
        "full": lambda: rng.normal(size=(1, h, ql, kl)),
        "key": lambda: rng.normal(size=(b, 1, 1, kl)),  # broadcast over heads and queries
        "head": lambda: rng.normal(size=(h, 1, kl)),  # rank 3: broadcast over batch and queries
    }[opts.get("bias")]
    bias = None if bias is None else bias().astype(np.float32)
    key_padding = None
    if opts.get("key_padding"):
        key_padding = rng.random((b, kl)) > 0.25
        key_padding[:, 0] = True
    return mask, bias, key_padding


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_values_and_gradients(case):
    shape, (qb, kb), opts = CASES[case]
    q, k, v = random_inputs(shape)
    mask, bias, key_padding = build_case(shape, opts)
    causal, offset = opts.get("causal", False), opts.get("offset", 0)
    ref_mask = reference_mask(shape, mask, causal, offset, key_padding)
    cot = np.random.default_rng(2).normal(size=q.shape[:3] + (v.shape[-1],)).astype(np.float32)

    ours, our_grads = value_and_grads(
        lambda q, k, v, bias: blockwise_attention(
            q,
            k,
            v,
            mask,
            bias,
            causal=causal,
            causal_offset=offset,
            key_padding=key_padding,
            query_block=qb,
            key_block=kb,
        ),
        q,
        k,
        v,
        bias,
        cot,
    )
    ref, ref_grads = value_and_grads(
        lambda q, k, v, bias: dot_product_attention(q, k, v, ref_mask, bias), q, k, v, bias, cot
    )
    assert ours.shape == ref.shape and ours.dtype == jnp.float32
    assert rel_err(ours, ref) < 1e-5
    names = ("query", "key", "value", "bias")[: len(ref_grads)]
    for name, g, g_ref in zip(names, our_grads, ref_grads, strict=True):
        assert g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) < 1e-5, name


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    shape = (2, 6, 5, 4, 2, 8)
    q, k, v = random_inputs(shape, seed=3)
    mask = np.ones((2, 1, 6, 5), bool)
    mask[0, 0, 2, :] = False  # query 2 of example 0 sees nothing
    mask[1] = False  # example 1 sees nothing at all
    # causal_offset=-2: queries 0 and 1 see no key (and their block has no key block to visit).
    kwargs = dict(causal=True, causal_offset=-2, query_block=2, key_block=2)
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, mask, **kwargs))(q, k, v)
    np.testing.assert_array_equal(out[0, :3], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.abs(np.asarray(out[0, 3])).sum() > 0
    ref = dot_product_attention(q, k, v, reference_mask(shape, mask, True, -2))
    assert rel_err(out, ref) < 1e-5

    # key_padding all False: nothing to attend to either.
    empty = jax.jit(
        lambda q, k, v: blockwise_attention(q, k, v, key_padding=np.zeros((2, 5), bool))
    )(q, k, v)
    np.testing.assert_array_equal(empty, 0.0)

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, mask, **kwargs) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(grads[0][1], 0.0)
    np.testing.assert_array_equal(grads[0][0, :3], 0.0)


def test_bfloat16_close_to_float32_reference():
    shape = (2, 12, 12, 4, 2, 16)
    q, k, v = random_inputs(shape, seed=5)
    key_padding = np.array([[True] * 9 + [False] * 3, [True] * 12])
    ref_mask = reference_mask(shape, causal=True, key_padding=key_padding)
    cot = np.random.default_rng(4).normal(size=q.shape).astype(np.float32)
    ref, ref_grads = value_and_grads(
        lambda q, k, v, _: dot_product_attention(q, k, v, ref_mask), q, k, v, None, cot
    )
    low = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    out, grads = value_and_grads(
        lambda q, k, v, _: blockwise_attention(
            q, k, v, causal=True, key_padding=key_padding, query_block=5, key_block=4
        ).astype(jnp.float32),
        *low,
        None,
        cot,
    )
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < 3e-2
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert g.dtype == jnp.bfloat16
        assert rel_err(np.asarray(g, np.float32), g_ref) < 5e-2


def test_jit_vmap_and_grad_of_vmap():
    shape = (2, 7, 9, 4, 2, 8)
    q, k, v = random_inputs(shape, seed=6)
    mask = np.random.default_rng(7).random((2, 1, 7, 9)) > 0.3
    ours = lambda q, k, v, m: blockwise_attention(q, k, v, m, query_block=3, key_block=4)  # noqa: E731
    ref = lambda q, k, v, m: dot_product_attention(q, k, v, m)  # noqa: E731
    # vmap over an extra leading axis (batched masks too); grad of the vmapped function.
    stack = lambda a: jnp.stack([a, 2 * a])  # noqa: E731
    masks = jnp.stack([mask, ~mask])

    def run(fn):
        def loss(q):
            out = jax.vmap(fn)(stack(q), stack(k), stack(v), masks)
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.grad(loss, has_aux=True))(q)

    g, vm = run(ours)
    g_ref, vm_ref = run(ref)
    assert rel_err(vm, vm_ref) < 1e-5
    assert rel_err(g, g_ref) < 1e-5
    # The vmapped result equals separate calls.
    assert rel_err(vm[1], jax.jit(ours)(2 * q, 2 * k, 2 * v, ~mask)) < 1e-6


def test_unsupported_and_bad_arguments_raise():
    q, k, v = random_inputs((1, 4, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="dropout"):
        blockwise_attention(q, k, v, dropout_rate=0.1, deterministic=False)
    # dropout_rate with deterministic=True is inactive (as a layer passes it at eval time).
    blockwise_attention(q, k, v, dropout_rate=0.1, deterministic=True)
    with pytest.raises(ValueError, match="return_weights"):
        blockwise_attention(q, k, v, return_weights=True)
    with pytest.raises(ValueError, match="boolean"):
        blockwise_attention(q, k, v, np.ones((1, 1, 4, 4), np.float32))
    with pytest.raises(ValueError, match="key_padding"):
        blockwise_attention(q, k, v, key_padding=np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="mask query axis"):
        blockwise_attention(q, k, v, np.ones((1, 1, 3, 4), bool))
    with pytest.raises(ValueError, match="multiple"):
        blockwise_attention(np.concatenate([q, q[:, :, :1]], axis=2), k, v)
    with pytest.raises(ValueError, match="block sizes"):
        blockwise_attention(q, k, v, query_block=0)


def _temp_bytes(fn, n, heads=2, head_dim=32):
    """Compiled temp memory of jit(grad) of a causal attention at length n (compile only)."""
    spec = jax.ShapeDtypeStruct((1, n, heads, head_dim), jnp.float32)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_is_linear_in_length():
    short, long = 1024, 4096
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, causal=True)  # noqa: E731
    reference = lambda q, k, v: dot_product_attention(q, k, v, causal_mask(q.shape[1]))  # noqa: E731
    ratio = long / short
    bw_short, bw_long = _temp_bytes(blockwise, short), _temp_bytes(blockwise, long)
    ref_short, ref_long = _temp_bytes(reference, short), _temp_bytes(reference, long)
    assert bw_long / bw_short <= 1.5 * ratio, (bw_short, bw_long)
    assert ref_long / ref_short > 2 * ratio, (ref_short, ref_long)  # quadratic
    # And in absolute terms: well under one [n, n] float32 logits matrix per head at 4k.
    assert bw_long < 2 * long * long * 4, bw_long
