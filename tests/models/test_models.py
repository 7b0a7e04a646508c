"""The three models: padding invariance, causality, packing, cache, shapes, parameter count."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderClassifier, EncoderDecoder, TransformerConfig

TINY = TransformerConfig(
    vocab_size=50,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=24,
    dropout_rate=0.1,
)

VARIANTS = {
    "paper": TINY,
    "pre_ln_rotary_swiglu_gqa": TINY.replace(
        norm_position="pre",
        position="rotary",
        activation="swiglu",
        num_kv_heads=2,
        norm_type="rmsnorm",
    ),
    "blockwise_attention": TINY.replace(attention_implementation="blockwise"),
    "learned_untied": TINY.replace(
        position="learned",
        share_embeddings=False,
        tie_output_embedding=False,
        target_vocab_size=40,
        use_bias=False,
        activation="gelu",
    ),
}


def tokens(rng, batch, length, vocab, pad_from=None):
    """Random real tokens in [3, vocab); positions >= pad_from[b] are padding (0)."""
    t = rng.integers(3, vocab, size=(batch, length))
    if pad_from is not None:
        for b, n in enumerate(pad_from):
            t[b, n:] = 0
    return jnp.asarray(t, jnp.int32)


@pytest.fixture(scope="module", params=list(VARIANTS))
def seq2seq(request):
    cfg = VARIANTS[request.param]
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(0)
    x = tokens(rng, 2, 8, cfg.vocab_size, pad_from=[8, 5])
    y = tokens(rng, 2, 6, cfg.output_vocab_size, pad_from=[6, 4])
    params = jax.jit(model.init)(jax.random.key(0), x, y)["params"]
    apply = jax.jit(model.apply, static_argnames="deterministic")
    return cfg, model, params, apply, x, y


def test_padding_invariance_encoder_and_decoder(seq2seq):
    cfg, model, params, apply, x, y = seq2seq
    encode = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode))
    enc = encode(params, x)
    x_more = jnp.pad(x, ((0, 0), (0, 5)))
    enc_more = encode(params, x_more)
    real = np.asarray(x != 0)
    np.testing.assert_allclose(
        np.asarray(enc_more)[:, :8][real], np.asarray(enc)[real], rtol=1e-5, atol=1e-5
    )
    logits = apply({"params": params}, x, y)
    logits_more = apply({"params": params}, x_more, jnp.pad(y, ((0, 0), (0, 4))))
    real_t = np.asarray(y != 0)
    np.testing.assert_allclose(
        np.asarray(logits_more)[:, :6][real_t], np.asarray(logits)[real_t], rtol=1e-5, atol=1e-5
    )
    # The check can fail: changing a real source token does change the logits.
    changed = apply({"params": params}, x.at[0, 1].set(x[0, 1] % 40 + 4), y)
    assert np.abs(np.asarray(changed - logits)).max() > 1e-4


def test_causality(seq2seq):
    cfg, model, params, apply, x, y = seq2seq
    logits = apply({"params": params}, x, y)
    t = 3
    y2 = y.at[:, t].set(y[:, t] % 30 + 5)
    logits2 = apply({"params": params}, x, y2)
    # logits[:, i] predicts targets[:, i] from targets[:, :i]: positions <= t cannot see y[t].
    np.testing.assert_allclose(logits2[:, : t + 1], logits[:, : t + 1], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(logits2[0, t + 1] - logits[0, t + 1])).max() > 1e-4


def test_packed_rows_equal_separate_examples(seq2seq):
    cfg, model, params, apply, _, _ = seq2seq
    rng = np.random.default_rng(1)
    xa, xb = tokens(rng, 1, 4, cfg.vocab_size), tokens(rng, 1, 3, cfg.vocab_size)
    ya, yb = tokens(rng, 1, 3, cfg.output_vocab_size), tokens(rng, 1, 4, cfg.output_vocab_size)
    packed_x = jnp.concatenate([xa, xb, jnp.zeros((1, 2), jnp.int32)], axis=1)
    packed_y = jnp.concatenate([ya, yb, jnp.zeros((1, 1), jnp.int32)], axis=1)
    seg_x = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]])
    pos_x = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]])
    seg_y = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    pos_y = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
    packed = jax.jit(model.apply)(
        {"params": params},
        packed_x,
        packed_y,
        inputs_positions=pos_x,
        targets_positions=pos_y,
        inputs_segmentation=seg_x,
        targets_segmentation=seg_y,
    )
    a = apply({"params": params}, xa, ya)
    b = apply({"params": params}, xb, yb)
    np.testing.assert_allclose(packed[0, :3], a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:7], b[0], rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_full_forward(seq2seq):
    cfg, model, params, apply, x, y = seq2seq
    full = apply({"params": params}, x, y)
    # encode and the cache's init jitted: cold, op-by-op eager dispatch cost more CPU
    encoded = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode))(params, x)
    shifted = jnp.concatenate([jnp.full((2, 1), cfg.bos_id, jnp.int32), y[:, :-1]], axis=1)
    cache = jax.jit(
        lambda x, d: model.init(
            jax.random.key(0),
            x,
            d,
            decode=True,
            method=lambda m, x, d, decode: m.decode(m.encode(x), x, d, decode=decode),
        )["cache"]
    )(x, shifted)
    step = jax.jit(
        lambda p, c, tok: model.apply(
            {"params": p, "cache": c},
            encoded,
            x,
            tok,
            decode=True,
            mutable=["cache"],
            method=model.decode,
        )
    )
    # A two-token prompt in one call (prefill), then one token at a time.
    logits, state = step(params, cache, shifted[:, :2])
    outs = [logits]
    for t in range(2, shifted.shape[1]):
        logits, state = step(params, state["cache"], shifted[:, t : t + 1])
        outs.append(logits)
    cached = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_models_shapes_dtypes_jit_grad(dtype):
    cfg = TINY.replace(dtype=dtype, num_classes=3, num_encoder_layers=1, num_decoder_layers=1)
    rng = np.random.default_rng(2)
    x = tokens(rng, 2, 7, cfg.vocab_size, pad_from=[7, 3])
    y = tokens(rng, 2, 5, cfg.vocab_size)
    cases = [
        (EncoderDecoder(cfg), (x, y), (2, 5, cfg.vocab_size)),
        (DecoderOnly(cfg), (y,), (2, 5, cfg.vocab_size)),
        (EncoderClassifier(cfg), (x,), (2, 3)),
    ]
    if dtype == "bfloat16":  # the decoder-only and classifier paths are the same layers
        cases = cases[:1]
    for model, args, shape in cases:

        def loss(p, args, model=model):
            return jnp.mean(
                model.apply(
                    {"params": p}, *args, deterministic=False, rngs={"dropout": jax.random.key(1)}
                )
                ** 2
            )

        # init, apply and the gradient in one jitted program (one compile per model, not three)
        @jax.jit
        def init_apply_grad(args, model=model, loss=loss):
            params = model.init(jax.random.key(0), *args)["params"]
            out = model.apply({"params": params}, *args)
            return params, out, jax.grad(loss)(params, args)

        params, out, grads = init_apply_grad(args)
        leaves = jax.tree_util.tree_leaves(nn.meta.unbox(params))
        assert all(p.dtype == jnp.float32 for p in leaves)  # params stay float32
        assert out.shape == shape and out.dtype == jnp.float32
        assert np.isfinite(np.asarray(out)).all()
        norms = [
            float(jnp.linalg.norm(g.astype(jnp.float32)))
            for g in jax.tree_util.tree_leaves(nn.meta.unbox(grads))
        ]
        assert all(np.isfinite(norms)) and sum(norms) > 0


def test_remat_gives_the_same_loss_and_gradients():
    y = tokens(np.random.default_rng(4), 2, 5, TINY.vocab_size)
    x = tokens(np.random.default_rng(5), 2, 6, TINY.vocab_size)
    model = EncoderDecoder(TINY)
    params = jax.jit(model.init)(jax.random.key(0), x, y)["params"]

    def loss(p, model):
        out = model.apply({"params": p}, x, y, deterministic=False,
                          rngs={"dropout": jax.random.key(3)})  # fmt: skip
        return jnp.mean(out**2)

    plain = jax.jit(jax.value_and_grad(lambda p: loss(p, model)))(params)
    rematted = jax.jit(jax.value_and_grad(
        lambda p: loss(p, EncoderDecoder(TINY.replace(remat=True)))))(params)  # fmt: skip
    assert float(plain[0]) == pytest.approx(float(rematted[0]), rel=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(plain[1]), jax.tree_util.tree_leaves(rematted[1]),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_dropout_is_active_only_when_not_deterministic():
    model = DecoderOnly(TINY)
    y = tokens(np.random.default_rng(3), 2, 5, TINY.vocab_size)
    # Jitted: cold, op-by-op eager dispatch of these calls cost more CPU than the compiles.
    params = jax.jit(model.init)(jax.random.key(0), y)["params"]
    apply = jax.jit(model.apply, static_argnames="deterministic")
    det1 = apply({"params": params}, y)
    det2 = apply({"params": params}, y, deterministic=True)
    np.testing.assert_array_equal(det1, det2)
    noisy = apply({"params": params}, y, deterministic=False, rngs={"dropout": jax.random.key(5)})
    assert np.abs(np.asarray(noisy - det1)).max() > 1e-3


def test_parameters_carry_logical_axis_names():
    model = EncoderDecoder(TINY)
    x = jnp.ones((1, 4), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), x, x)["params"]  # names, no values
    specs = nn.get_partition_spec(boxed)
    q = specs["encoder"]["layers_0"]["self_attention"]["query"]["kernel"]
    assert tuple(q) == ("embed", "heads", "kv")
    k = specs["decoder"]["layers_0"]["cross_attention"]["key"]["kernel"]
    assert tuple(k) == ("kv_embed", "kv_heads", "kv")  # split by kv heads or else d_model
    assert tuple(specs["source_embedding"]["embedding"]) == ("vocab", "embed")
    assert tuple(specs["decoder"]["layers_1"]["mlp"]["wi"]["kernel"]) == ("embed", "mlp")
    named = set()
    for spec in jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, tuple)):
        named.update(a for a in spec if a)
    assert {"embed", "heads", "kv", "kv_embed", "kv_heads", "mlp", "vocab"} <= named


def base_parameter_count(vocab: int, d: int, dff: int, n_enc: int, n_dec: int) -> int:
    """The paper's base model with one embedding shared by source, target and output."""
    attention = 4 * (d * d + d)  # Q, K, V, output projections with biases
    ffn = d * dff + dff + dff * d + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return vocab * d + n_enc * encoder_layer + n_dec * decoder_layer


def test_base_parameter_count_matches_formula():
    cfg = TransformerConfig.base()
    model = EncoderDecoder(cfg)
    x = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, x), x)["params"]
    count = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(nn.meta.unbox(shapes)))
    expected = base_parameter_count(37000, 512, 2048, 6, 6)
    assert count == expected
    assert 60e6 < count < 66e6  # the paper's Table 3 lists 65M for base


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda m, p, x: m.apply({"params": p}, x[0], x), "inputs"),
        (lambda m, p, x: m.apply({"params": p}, x.astype(jnp.float32), x), "inputs"),
        (lambda m, p, x: m.apply({"params": p}, x, x[:, :, None]), "targets"),
        (lambda m, p, x: m.apply({"params": p}, jnp.ones((1, 30), jnp.int32), x), "max_len"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    cfg = TINY.replace(position="learned")
    model = EncoderDecoder(cfg)
    x = jnp.ones((1, 4), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), x, x)["params"]
    with pytest.raises(ValueError, match=name):
        call(model, params, x)


def test_dataclass_config_is_hashable_for_jit_static_use():
    assert hash(TINY) == hash(dataclasses.replace(TINY))


# ----------------------------------------------------------------------------- decoding limits

LM = TINY.replace(num_decoder_layers=1, max_len=8, dropout_rate=0.0)


@pytest.fixture(scope="module")
def lm_cache():
    """A DecoderOnly, its parameters, an empty cache of 4 positions, and the jitted decode step
    ``(cache, tokens) -> (logits, {"cache": cache})``."""
    model = DecoderOnly(LM)
    y = jnp.ones((1, 4), jnp.int32)
    variables = jax.jit(
        lambda: model.init(jax.random.key(0), y, decode=True, method=model.decode)
    )()
    params = variables["params"]
    step = jax.jit(lambda c, t: _step(model, params, c, t))
    return model, params, variables["cache"], step


def _step(model, params, cache, tokens):
    return model.apply(
        {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"],
        method=model.decode,
    )  # fmt: skip


def test_decoding_past_the_cache_raises_eagerly_under_jit_and_while_tracing(lm_cache):
    model, params, cache, step = lm_cache
    # One counter: the decoder's; the attention layers keep none.
    counters = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
        if np.ndim(leaf) == 0
    ]
    assert counters == ["['decoder']['position_index']"]
    logits, full = step(cache, jnp.ones((1, 4), jnp.int32))  # fills all 4 slots
    assert int(full["cache"]["decoder"]["position_index"]) == 4
    assert np.isfinite(np.asarray(logits)).all()
    tok = jnp.ones((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="max_len=4"):  # eager: the counter is concrete
        _step(model, params, full["cache"], tok)
    with pytest.raises(jax.errors.JaxRuntimeError, match="max_len=4"):  # jit: checked on device
        jax.block_until_ready(step(full["cache"], tok))
    with pytest.raises(ValueError, match="max_len=4"):  # static: 5 new positions never fit
        step(cache, jnp.ones((1, 5), jnp.int32))


def test_parameter_paths_unchanged():
    """Checkpoints of earlier versions load: the parameter tree names are pinned."""
    cfg = TINY.replace(num_encoder_layers=1, num_decoder_layers=1)
    x = jnp.ones((1, 3), jnp.int32)
    shapes = jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), x, x)["params"]
    paths = {
        "/".join(k.key for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(shapes))
    }
    layer = "decoder/layers_0/"
    expected = {"source_embedding/embedding"}
    for prefix, subs in (
        ("encoder/layers_0/", ("self_attention",)),
        (layer, ("self_attention", "cross_attention")),
    ):
        for sub in subs:
            for proj in ("query", "key", "value", "out"):
                expected |= {f"{prefix}{sub}/{proj}/kernel", f"{prefix}{sub}/{proj}/bias"}
            expected |= {f"{prefix}{sub}_norm/scale", f"{prefix}{sub}_norm/bias"}
        for dense in ("wi", "wo"):
            expected |= {f"{prefix}mlp/{dense}/kernel", f"{prefix}mlp/{dense}/bias"}
        expected |= {f"{prefix}mlp_norm/scale", f"{prefix}mlp_norm/bias"}
    assert paths == expected


def test_tied_logits_gradient_equals_autodiff_of_the_einsum():
    """embed.tied_logits takes the table's gradient as (x^T g)^T; it equals autodiff's."""
    from flaxformer_lite.nn.embed import tied_logits

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (3, 5, 8))
    table = jax.random.normal(k2, (11, 8))
    w = jax.random.normal(k3, (3, 5, 11))
    ours = jax.grad(lambda x, t: (tied_logits(x, t) * w).sum() ** 2, argnums=(0, 1))(x, table)
    plain = jax.grad(lambda x, t: (jnp.einsum("bld,vd->blv", x, t) * w).sum() ** 2, argnums=(0, 1))(
        x, table
    )
    np.testing.assert_array_equal(tied_logits(x, table), jnp.einsum("bld,vd->blv", x, table))
    for a, b in zip(ours, plain, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
