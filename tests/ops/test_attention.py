"""dot_product_attention against a naive float64 NumPy reference, and its edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops.attention import dot_product_attention
from flaxformer_lite.ops.masks import causal_mask, padding_mask


def naive_attention(q, k, v, mask=None, bias=None):
    """softmax(q k^T / sqrt(d) + bias, masked) v in float64, one head at a time."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, ql, h, d = q.shape
    kl, kvh = k.shape[1], k.shape[2]
    out = np.zeros((b, ql, h, d))
    weights = np.zeros((b, h, ql, kl))
    m = None if mask is None else np.broadcast_to(np.asarray(mask), (b, h, ql, kl))
    bb = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), (b, h, ql, kl))
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // kvh)
            logits = q[bi, :, hi] @ k[bi, :, kv].T / np.sqrt(d)
            if bb is not None:
                logits = logits + bb[bi, hi]
            for qi in range(ql):
                allowed = np.ones(kl, bool) if m is None else m[bi, hi, qi]
                if not allowed.any():
                    continue
                row = np.where(allowed, logits[qi], -np.inf)
                p = np.exp(row - row.max())
                p /= p.sum()
                weights[bi, hi, qi] = p
                out[bi, qi, hi] = p @ v[bi, :, kv]
    return out, weights


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


SHAPES = [  # batch, q_len, kv_len, heads, kv_heads, head_dim
    (2, 5, 7, 4, 4, 8),
    (1, 3, 3, 8, 2, 16),  # grouped-query
    (3, 6, 4, 4, 1, 8),  # multi-query
    (2, 1, 9, 2, 2, 32),  # one decoding step
]


def random_inputs(shape, seed=0, dtype=np.float32):
    b, ql, kl, h, kvh, d = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, ql, h, d)).astype(dtype)
    k = rng.normal(size=(b, kl, kvh, d)).astype(dtype)
    v = rng.normal(size=(b, kl, kvh, d)).astype(dtype)
    return q, k, v


def random_mask(shape, seed=1):
    b, ql, kl, h, _, _ = shape
    rng = np.random.default_rng(seed)
    mask = rng.random((b, 1, ql, kl)) > 0.3
    mask[..., 0] = True  # keep every row non-empty; empty rows are tested on their own
    return mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(shape, with_mask, with_bias):
    q, k, v = random_inputs(shape)
    b, ql, kl, h, _, _ = shape
    mask = random_mask(shape) if with_mask else None
    bias = (
        np.random.default_rng(2).normal(size=(1, h, ql, kl)).astype(np.float32)
        if with_bias
        else None
    )
    out, weights = dot_product_attention(q, k, v, mask, bias, return_weights=True)
    ref_out, ref_w = naive_attention(q, k, v, mask, bias)
    assert out.shape == (b, ql, h, shape[-1]) and out.dtype == jnp.float32
    assert weights.shape == (b, h, ql, kl)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(weights, ref_w) < 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_agrees_with_jax_nn_and_cudnn_switch(shape):
    q, k, v = random_inputs(shape, seed=3)
    mask = random_mask(shape, seed=4)
    ours = dot_product_attention(q, k, v, mask)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask)
    switched = dot_product_attention(q, k, v, mask, implementation="cudnn")
    blockwise = dot_product_attention(q, k, v, mask, implementation="blockwise")
    assert rel_err(ours, theirs) < 1e-5
    assert rel_err(switched, ours) < 1e-5
    assert rel_err(blockwise, ours) < 1e-5


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    shape = (2, 4, 5, 4, 2, 8)
    q, k, v = random_inputs(shape)
    mask = np.ones((2, 1, 4, 5), bool)
    mask[0, 0, 2, :] = False  # query 2 of row 0 sees nothing
    mask[1] = False  # the whole second example sees nothing
    out = dot_product_attention(q, k, v, mask)
    np.testing.assert_array_equal(out[0, 2], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.abs(np.asarray(out[0, 1])).sum() > 0
    cudnn = dot_product_attention(q, k, v, mask, implementation="cudnn")
    np.testing.assert_array_equal(cudnn[1], 0.0)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, mask) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(grads[0][1], 0.0)


def test_low_precision_uses_float32_softmax_and_no_overflow():
    shape = (2, 6, 6, 4, 4, 16)
    q, k, v = random_inputs(shape, seed=5)
    tokens = jnp.array([[3, 4, 5, 0, 0, 0], [3, 4, 5, 6, 7, 8]])
    mask = padding_mask(tokens, tokens) & causal_mask(6)
    ref, _ = naive_attention(q, k, v, np.asarray(mask))
    for dtype, tol in ((jnp.bfloat16, 3e-2), (jnp.float16, 3e-3)):
        out, w = dot_product_attention(
            *(jnp.asarray(a, dtype) for a in (q, k, v)), mask, return_weights=True
        )
        assert out.dtype == dtype and w.dtype == jnp.float32
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert rel_err(np.asarray(out, np.float32), ref) < tol


def test_jit_vmap_and_grad_agree_with_eager():
    shape = (2, 3, 4, 2, 2, 4)
    q, k, v = random_inputs(shape, seed=6)
    mask = random_mask(shape, seed=7)
    eager = dot_product_attention(q, k, v, mask)
    jitted = jax.jit(dot_product_attention)(q, k, v, mask)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
    # vmap over an extra leading axis equals a Python loop.
    stack = lambda a: jnp.stack([a, 2 * a])  # noqa: E731
    vm = jax.vmap(dot_product_attention)(stack(q), stack(k), stack(v), jnp.stack([mask, mask]))
    np.testing.assert_allclose(vm[1], dot_product_attention(2 * q, 2 * k, 2 * v, mask), rtol=1e-5)
    # The gradient against a central finite difference in one direction.
    f = lambda q: jnp.sum(jnp.sin(dot_product_attention(q, k, v, mask)))  # noqa: E731
    direction = np.random.default_rng(8).normal(size=q.shape).astype(np.float32)
    eps = 1e-2
    fd = (f(q + eps * direction) - f(q - eps * direction)) / (2 * eps)
    analytic = jnp.vdot(jax.grad(f)(q), direction)
    assert float(analytic) == pytest.approx(float(fd), rel=2e-3, abs=2e-3)


def test_dropout_scales_kept_weights_and_needs_a_key():
    q, k, _ = random_inputs((1, 5, 4, 2, 2, 4), seed=9)
    # One-hot values (v[:, j, :, :] = e_j) make the output equal the weight rows themselves.
    v = np.broadcast_to(np.eye(4, dtype=np.float32)[None, :, None, :], (1, 4, 2, 4))
    _, w = dot_product_attention(q, k, v, return_weights=True)
    dropped = dot_product_attention(
        q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1), deterministic=False
    )
    ref = np.swapaxes(np.asarray(w), 1, 2)  # [b, q, h, kv] like the output
    kept = np.asarray(dropped) != 0
    assert 0.2 < kept.mean() < 0.8
    np.testing.assert_allclose(np.asarray(dropped)[kept], 2 * ref[kept], rtol=1e-5)
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False)
    # deterministic=True ignores the rate.
    np.testing.assert_array_equal(
        dot_product_attention(q, k, v, dropout_rate=0.5), dot_product_attention(q, k, v)
    )


def test_bad_arguments_name_themselves():
    q, k, v = random_inputs((1, 2, 2, 3, 2, 4))
    with pytest.raises(ValueError, match="multiple"):
        dot_product_attention(q, k, v)
    q, k, v = random_inputs((1, 2, 2, 2, 2, 4))
    with pytest.raises(ValueError, match="query"):
        dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="implementation"):
        dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="boolean"):
        dot_product_attention(q, k, v, np.ones((1, 1, 2, 2), np.float32))
    with pytest.raises(ValueError, match="dropout_rate"):
        dot_product_attention(q, k, v, dropout_rate=1.0)


# ----------------------------------------------------------------------------- the layer


def _mha_inputs():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    enc = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)
    return x, enc


@pytest.mark.parametrize("fused", [False, True])
def test_rotary_self_attention_same_with_and_without_decode_when_no_cache_is_read(fused):
    # decode=True on a layer without a cache (the init call) used to skip rotating the keys.
    from flaxformer_lite.nn.attention import MultiHeadAttention

    x, _ = _mha_inputs()
    mha = MultiHeadAttention(num_heads=2, head_dim=8, use_rotary=True, fused_qkv=fused)
    mask = causal_mask(5)
    params = mha.init(jax.random.key(0), x, mask=mask)["params"]
    plain = mha.apply({"params": params}, x, mask=mask)
    decoding, _ = mha.apply({"params": params}, x, mask=mask, decode=True, mutable=["cache"])
    np.testing.assert_array_equal(np.asarray(decoding), np.asarray(plain))
    # Rotation matters here: without it the output differs.
    unrotated = MultiHeadAttention(num_heads=2, head_dim=8, fused_qkv=fused)
    assert (
        np.abs(np.asarray(unrotated.apply({"params": params}, x, mask=mask) - plain)).max() > 1e-3
    )


def test_rotary_cross_attention_same_with_and_without_decode():
    # With decode=True the projected encoder keys are cached: they must be stored rotated,
    # and a later call that reads them back must give the same result too.
    from flaxformer_lite.nn.attention import MultiHeadAttention

    x, enc = _mha_inputs()
    mha = MultiHeadAttention(num_heads=2, head_dim=8, use_rotary=True, cross_attention=True)
    params = mha.init(jax.random.key(0), x, enc)["params"]
    plain = mha.apply({"params": params}, x, enc)
    first, state = mha.apply({"params": params}, x, enc, decode=True, mutable=["cache"])
    again = mha.apply({"params": params, **state}, x, None, decode=True)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(plain))


def test_weights_are_sown_only_on_request_and_match_across_implementations():
    from flaxformer_lite.nn.attention import MultiHeadAttention
    from flaxformer_lite.ops.masks import AttentionMask

    x, _ = _mha_inputs()
    mask = AttentionMask(causal=True, key_valid=jnp.array([[True] * 5, [True] * 3 + [False] * 2]))
    outs, sown = {}, {}
    for impl in ("xla", "blockwise"):
        mha = MultiHeadAttention(num_heads=2, head_dim=8, implementation=impl)
        params = mha.init(jax.random.key(0), x, mask=mask)["params"]
        apply = lambda p, mha=mha: mha.apply({"params": p}, x, mask=mask)  # noqa: E731
        # Not requested: no [batch, heads, q, k] array anywhere in the blockwise computation.
        if impl == "blockwise":
            jaxpr = str(jax.make_jaxpr(apply)(params))
            assert "f32[2,2,5,5]" not in jaxpr
        outs[impl], state = mha.apply({"params": params}, x, mask=mask, mutable=["intermediates"])
        (sown[impl],) = state["intermediates"]["attention_weights"]
        np.testing.assert_array_equal(np.asarray(outs[impl]), np.asarray(apply(params)))
    w = np.asarray(sown["xla"])
    assert w.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.triu(w, 1) == 0) and np.all(w[1, :, :, 3:] == 0)  # causal, key padding
    np.testing.assert_allclose(np.asarray(sown["blockwise"]), w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(outs["blockwise"]), np.asarray(outs["xla"]), atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_scale_replaces_one_over_sqrt_head_dim(implementation):
    """``scale=1.0`` (T5) equals the float64 reference on queries multiplied by sqrt(d) (the
    reference divides by sqrt(d)), in the reference and the blockwise implementation, with a
    mask and a bias; and differs from the default scaling."""
    rng = np.random.default_rng(11)
    q = rng.normal(size=(2, 5, 4, 16)).astype(np.float32)
    k = rng.normal(size=(2, 7, 2, 16)).astype(np.float32)
    v = rng.normal(size=(2, 7, 2, 16)).astype(np.float32)
    mask = (np.arange(7) < np.array([7, 4])[:, None])[:, None, None, :]  # [2, 1, 1, 7]
    bias = rng.normal(size=(1, 4, 5, 7)).astype(np.float32)
    want, _ = naive_attention(q * 4.0, k, v, mask, bias)  # sqrt(16) = 4 cancels 1/sqrt(d)
    got = dot_product_attention(q, k, v, mask, bias, scale=1.0, implementation=implementation)
    assert rel_err(got, want) < 1e-5
    default = dot_product_attention(q, k, v, mask, bias, implementation=implementation)
    assert np.abs(np.asarray(default) - want).max() > 1e-2  # the scale is not ignored


def test_scale_must_be_a_positive_number():
    q = jnp.zeros((1, 2, 2, 4))
    for bad in (0.0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="scale must be None"):
            dot_product_attention(q, q, q, scale=bad)
