"""TransformerConfig.scan_layers and fused_qkv against the plain (unrolled, unfused) models.

scan_layers: the scanned model's parameters, unstacked (``unstack_layers``), give the unrolled
model the same logits, gradients and attention weights; with remat too; decoding (which runs
unrolled) gives the same tokens; training, sharded initialisation and the Translator accept it.
fused_qkv: a fused kernel assembled from the unfused query/key/value kernels gives the same
logits (multi-head and grouped-query), and cached greedy decoding equals recomputing the
whole prefix at every step. Tiny models; every jitted function is compiled once per module.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderDecoder, TransformerConfig
from flaxformer_lite.decoding.generate import continue_prompt, generate, init_cache
from flaxformer_lite.inference.translator import SymbolVocabulary, Translator
from flaxformer_lite.models import (
    attention_weights_per_layer,
    shift_right,
    unrolled,
    unstack_layers,
)

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-5

SEQ2SEQ = TransformerConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=16,
    dropout_rate=0.1,
)
# Pre-LN, rotary, grouped-query (4 query heads over 2 kv heads), gated MLP, RMSNorm.
LM = SEQ2SEQ.replace(
    norm_position="pre",
    position="rotary",
    num_kv_heads=2,
    activation="swiglu",
    norm_type="rmsnorm",
)


def tokens(seed: int, batch: int, length: int, vocab: int, pad_from=None) -> jax.Array:
    """Random real tokens in [3, vocab); positions >= pad_from[b] are padding."""
    t = np.random.default_rng(seed).integers(3, vocab, size=(batch, length))
    for b, n in enumerate(pad_from or []):
        t[b, n:] = 0
    return jnp.asarray(t, jnp.int32)


X = tokens(0, 2, 7, 40, pad_from=[7, 4])  # sources
Y = tokens(1, 2, 6, 40, pad_from=[6, 3])  # targets


def init(model: nn.Module, *args) -> dict:
    """Boxed parameters (one compile: faster than running init op by op)."""
    return jax.jit(model.init)(jax.random.key(0), *args)["params"]


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over real target tokens."""
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    real = targets != 0
    return -(picked * real).sum() / real.sum()


@functools.partial(jax.jit, static_argnums=0)
def seq2seq_outputs(cfg: TransformerConfig, params, x, y):
    """Logits `[b, t, vocab]`, parameter gradients of the loss, and attention weights
    (encoder: per layer {"self": `[b, h, s, s]`}; decoder: per layer {"self", "cross"})."""
    model = EncoderDecoder(cfg)

    def loss(p):
        logits = model.apply({"params": p}, x, y)
        return loss_fn(logits, y), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    encoded, enc = model.apply(
        {"params": params}, x, method=model.encode, mutable=["intermediates"]
    )
    _, dec = model.apply(
        {"params": params},
        encoded,
        x,
        shift_right(y, cfg.bos_id),
        method=model.decode,
        mutable=["intermediates"],
    )
    enc = attention_weights_per_layer(enc["intermediates"]["encoder"])
    dec = attention_weights_per_layer(dec["intermediates"]["decoder"])
    return logits, grads, (enc, dec)


@functools.partial(jax.jit, static_argnums=0)
def lm_outputs(cfg: TransformerConfig, params, y):
    """Logits, gradients and per-layer decoder weights of a DecoderOnly."""
    model = DecoderOnly(cfg)

    def loss(p):
        logits = model.apply({"params": p}, y)
        return loss_fn(logits, y), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    _, dec = model.apply(
        {"params": params},
        shift_right(y, cfg.bos_id),
        method=model.decode,
        mutable=["intermediates"],
    )
    return logits, grads, attention_weights_per_layer(dec["intermediates"]["decoder"])


def assert_trees_close(a, b, atol: float = ATOL) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


# ----------------------------------------------------------------------------- scan_layers


@pytest.fixture(scope="module")
def scanned_seq2seq():
    cfg = SEQ2SEQ.replace(scan_layers=True)
    boxed = init(EncoderDecoder(cfg), X, Y)
    params = nn.meta.unbox(boxed)
    return cfg, boxed, params, seq2seq_outputs(cfg, params, X, Y)


def test_scanned_parameters_are_stacked_with_a_layers_axis(scanned_seq2seq):
    cfg, boxed, params, _ = scanned_seq2seq
    query = params["encoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert query.shape == (2, 32, 4, 8)  # [layers, embed, heads, head_dim]
    assert set(params["encoder"]) == set(params["decoder"]) == {"layers"}
    specs = nn.get_partition_spec(boxed)
    assert tuple(specs["encoder"]["layers"]["self_attention"]["query"]["kernel"]) == (
        "layers",
        "embed",
        "heads",
        "kv",
    )
    assert tuple(specs["decoder"]["layers"]["mlp"]["wi"]["kernel"]) == ("layers", "embed", "mlp")
    # Boxed trees unstack too: the layer axis name goes with the layer axis.
    flat = unstack_layers(boxed)
    assert set(flat["encoder"]) == {"layers_0", "layers_1"}
    unstacked_specs = nn.get_partition_spec(flat)
    assert tuple(unstacked_specs["encoder"]["layers_1"]["self_attention"]["query"]["kernel"]) == (
        "embed",
        "heads",
        "kv",
    )
    np.testing.assert_array_equal(
        nn.meta.unbox(flat)["decoder"]["layers_1"]["mlp"]["wo"]["kernel"],
        params["decoder"]["layers"]["mlp"]["wo"]["kernel"][1],
    )


def test_unstack_layers_matches_the_unrolled_model_layout_and_is_pure(scanned_seq2seq):
    cfg, _, params, _ = scanned_seq2seq
    reference = jax.eval_shape(
        lambda: EncoderDecoder(SEQ2SEQ).init(jax.random.key(0), X, Y)["params"]
    )
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), unstack_layers(params))
    want = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), nn.meta.unbox(reference))
    assert shapes == want
    assert "layers" in params["encoder"]  # the input is left alone
    flat = unstack_layers(params)
    assert unstack_layers(flat) == flat  # an unrolled tree comes back unchanged
    same, cfg_same = unrolled(flat, SEQ2SEQ)
    assert same is flat and cfg_same is SEQ2SEQ
    _, cfg_flat = unrolled(params, cfg)
    assert cfg_flat == SEQ2SEQ


def test_scanned_seq2seq_equals_unrolled_logits_grads_and_weights(scanned_seq2seq):
    cfg, _, params, (logits, grads, weights) = scanned_seq2seq
    ref_logits, ref_grads, ref_weights = seq2seq_outputs(SEQ2SEQ, unstack_layers(params), X, Y)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=ATOL)
    assert_trees_close(unstack_layers(grads), ref_grads)
    assert len(weights[0]) == len(weights[1]) == 2
    assert weights[1][0]["cross"].shape == (2, 4, 6, 7)
    assert_trees_close(weights, ref_weights)


def test_remat_inside_the_scan_gives_the_same_logits_and_grads(scanned_seq2seq):
    cfg, _, params, (logits, grads, weights) = scanned_seq2seq
    remat_logits, remat_grads, remat_weights = seq2seq_outputs(
        cfg.replace(remat=True), params, X, Y
    )
    np.testing.assert_allclose(remat_logits, logits, rtol=0, atol=ATOL)
    assert_trees_close(remat_grads, grads)
    assert_trees_close(remat_weights, weights)


def test_scanned_dropout_differs_per_layer_and_from_deterministic(scanned_seq2seq):
    cfg, _, params, (logits, _, _) = scanned_seq2seq
    model = EncoderDecoder(cfg)
    noisy = jax.jit(
        lambda p, r: model.apply({"params": p}, X, Y, deterministic=False, rngs={"dropout": r})
    )
    a, b = noisy(params, jax.random.key(1)), noisy(params, jax.random.key(2))
    assert np.abs(np.asarray(a - logits)).max() > 1e-3
    assert np.abs(np.asarray(a - b)).max() > 1e-3


@pytest.fixture(scope="module")
def scanned_lm():
    """Scanned, fused and grouped-query at once: the switches compose."""
    cfg = LM.replace(scan_layers=True, fused_qkv=True)
    params = nn.meta.unbox(init(DecoderOnly(cfg), Y))
    return cfg, params


def test_scanned_decoder_only_equals_unrolled(scanned_lm):
    cfg, params = scanned_lm
    qkv = params["decoder"]["layers"]["self_attention"]["qkv"]
    assert qkv["query_kernel"].shape == (2, 32, 4, 8)  # [layers, embed, heads, head_dim]
    assert qkv["kv_kernel"].shape == (2, 32, 2, 2, 8)  # [layers, embed, k|v, kv_heads, head_dim]
    logits, grads, weights = lm_outputs(cfg, params, Y)
    flat_params, flat_cfg = unrolled(params, cfg)
    ref_logits, ref_grads, ref_weights = lm_outputs(flat_cfg, flat_params, Y)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=ATOL)
    assert_trees_close(unstack_layers(grads), ref_grads)
    assert weights[1]["self"].shape == (2, 4, 6, 6) and "cross" not in weights[1]
    assert_trees_close(weights, ref_weights)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_generate_with_a_scanned_model_equals_the_unrolled_model(scanned_seq2seq, method):
    cfg, _, params, _ = scanned_seq2seq
    kw = dict(method=method, max_len=6, beam_size=2)
    tokens_scan, scores_scan = generate(params, cfg, X, **kw)
    tokens_flat, scores_flat = generate(unstack_layers(params), SEQ2SEQ, X, **kw)
    np.testing.assert_array_equal(tokens_scan, tokens_flat)
    np.testing.assert_allclose(scores_scan, scores_flat, rtol=0, atol=ATOL)


def test_continue_prompt_with_a_scanned_model_equals_the_unrolled_model(scanned_lm):
    cfg, params = scanned_lm
    prompt = tokens(2, 2, 3, 40)
    tokens_scan, _ = continue_prompt(params, cfg, prompt, method="greedy", max_len=5)
    flat_params, flat_cfg = unrolled(params, cfg)
    tokens_flat, _ = continue_prompt(flat_params, flat_cfg, prompt, method="greedy", max_len=5)
    np.testing.assert_array_equal(tokens_scan, tokens_flat)


def test_init_cache_of_a_scanned_model_is_the_unrolled_per_layer_cache(scanned_lm):
    cfg, params = scanned_lm
    cache = init_cache(DecoderOnly(cfg), params, batch_size=3, max_len=9)
    layer = cache["decoder"]["layers_1"]["self_attention"]
    assert layer["cached_key"].shape == (3, 2, 9, 8)  # [batch, kv_heads, max_len, head_dim]
    assert "layers" not in cache["decoder"]


def test_decode_true_on_a_scanned_model_names_the_switch_and_the_fix(scanned_lm):
    cfg, params = scanned_lm
    model = DecoderOnly(cfg)
    with pytest.raises(ValueError, match="scan_layers.*unstack_layers"):
        model.apply({"params": params}, Y, decode=True, mutable=["cache"], method=model.decode)


def test_translator_unrolls_a_scanned_model_once(scanned_seq2seq):
    cfg, _, params, _ = scanned_seq2seq
    vocab = SymbolVocabulary("abcdefghijklmnopqrstuvwxyz0123456789")  # 4 + 36 = 40 ids
    translator = Translator(params, cfg, vocab)
    assert translator.config == SEQ2SEQ
    assert set(translator.params["encoder"]) == {"layers_0", "layers_1"}


def test_training_a_scanned_fused_model_then_translating(tmp_path, monkeypatch):
    """train.py end to end (sharded init with the "layers" axis, dropout, decoding eval,
    checkpoints), then the Translator restores the scanned checkpoint."""
    import importlib.util

    import train

    spec = importlib.util.spec_from_file_location("default", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.synthetic.update(min_len=2, max_len=6, num_eval=16)
    c.model = dict(
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.1,
        scan_layers=True,
        fused_qkv=True,
        remat=True,
    )
    c.batch_size = 16
    c.num_train_steps = 4
    c.warmup_steps = 2
    c.learning_rate = 3e-3
    c.log_every = 2
    c.eval_every = 4
    c.checkpoint_every = 4
    from helpers import exact_match_reference

    recorded, decode = [], train.greedy_decode_in_order  # the tokens the decoding eval gets
    monkeypatch.setattr(
        train,
        "greedy_decode_in_order",
        lambda *a, **k: recorded.append(decode(*a, **k)) or recorded[-1],
    )
    metrics = train.train_and_evaluate(c, str(tmp_path))
    assert np.isfinite(metrics["eval/smoothed_kl"])
    # The eval decoded what an uncached one-device decoder of the scanned, fused checkpoint
    # decodes, and scored those tokens right.
    task, model, params, decoded = exact_match_reference.naive_decoding(
        c, tmp_path, tmp_path / "scratch"
    )
    exact_match_reference.check_decoding_eval(recorded, decoded, metrics["eval/exact_match"])
    exact_match_reference.check_decode_metric_on_diverse_outputs(
        train, recorded, task, model, params
    )
    saved = json.loads((tmp_path / "model_config.json").read_text())
    assert saved["scan_layers"] is True and saved["fused_qkv"] is True
    translator = Translator.from_workdir(str(tmp_path))
    assert not translator.config.scan_layers
    maps = translator.attention("3141")
    assert maps["encoder_self"].shape[:2] == (2, 2)  # [layers, heads, ...]
    assert maps["encoder_decoder"].shape[0] == 2


SHARDED_INIT = """
import json
import flax.linen as nn
import jax, jax.numpy as jnp
from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.core import sharding
cfg = TransformerConfig(vocab_size=48, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                        num_decoder_layers=2, max_len=16, scan_layers=True, fused_qkv=True)
model = EncoderDecoder(cfg)
x = jnp.ones((1, 4), jnp.int32)
mesh = sharding.make_mesh((2, 2, 2))
params, _ = sharding.sharded_init(lambda: model.init(jax.random.key(0), x, x)["params"], mesh)
reference = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.key(0), x, x)["params"]))()
pairs = zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True)
diff = max(float(jnp.abs(a - b).max()) for a, b in pairs)
def spec(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return [a if a is None or isinstance(a, str) else list(a) for a in tree.sharding.spec]
paths = ["encoder/layers/self_attention/qkv/kernel", "encoder/layers/mlp/wi/kernel",
         "decoder/layers/cross_attention/query/kernel", "decoder/layers/mlp/wo/bias",
         "source_embedding/embedding"]
print(json.dumps({"devices": jax.device_count(), "diff": diff,
                  "specs": {p: spec(params, p) for p in paths}}))
"""


def test_scanned_model_initialises_sharded_on_a_2x2x2_mesh():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_INIT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    assert out["diff"] == 0.0  # the same values as an unsharded init
    # The stacked "layers" axis is replicated; the others are split as in the unrolled model.
    assert out["specs"] == {
        "encoder/layers/self_attention/qkv/kernel": [None, "fsdp", None, "tensor", None],
        "encoder/layers/mlp/wi/kernel": [None, "fsdp", "tensor"],
        "decoder/layers/cross_attention/query/kernel": [None, "fsdp", "tensor", None],
        "decoder/layers/mlp/wo/bias": [None, "fsdp"],
        "source_embedding/embedding": ["tensor", "fsdp"],
    }


# ----------------------------------------------------------------------------- fused_qkv


def fuse_qkv(params: dict, group: int) -> dict:
    """Unfused parameters -> the fused model's: every self-attention's query `[e, h, d]`, key
    and value `[e, kv, d]` kernels become "qkv" `kernel` `[e, 3, h, d]` (multi-head) or
    `query_kernel` `[e, h, d]` + `kv_kernel` `[e, 2, kv, d]` (grouped/multi-query), biases
    alike; cross-attention keeps its projections."""
    if not isinstance(params, dict):
        return params
    out = {k: fuse_qkv(v, group) for k, v in params.items()}
    attention = out.get("self_attention")
    if attention is not None and "query" in attention:
        q, k, v = (attention.pop(name) for name in ("query", "key", "value"))
        if group == 1:
            attention["qkv"] = {n: jnp.stack([q[n], k[n], v[n]], axis=-3) for n in q}
        else:
            attention["qkv"] = {f"query_{n}": q[n] for n in q}
            attention["qkv"].update({f"kv_{n}": jnp.stack([k[n], v[n]], axis=-3) for n in k})
    return out


@functools.partial(jax.jit, static_argnums=0)
def decoder_logits(cfg: TransformerConfig, params, x, decoder_inputs):
    """Full (uncached) logits `[b, t, vocab]` from already shifted decoder inputs."""
    if x is None:
        model = DecoderOnly(cfg)
        return model.apply({"params": params}, decoder_inputs, method=model.decode)
    model = EncoderDecoder(cfg)
    encoded = model.apply({"params": params}, x, method=model.encode)
    return model.apply({"params": params}, encoded, x, decoder_inputs, method=model.decode)


FUSED_CASES = {
    # name: (unfused config, sources or None for a DecoderOnly)
    "seq2seq_multi_head": (SEQ2SEQ, X),
    "lm_grouped_query_rotary": (LM, None),
}


@pytest.fixture(scope="module", params=list(FUSED_CASES))
def fused(request):
    cfg, x = FUSED_CASES[request.param]
    model = DecoderOnly(cfg) if x is None else EncoderDecoder(cfg)
    params = nn.meta.unbox(init(model, Y) if x is None else init(model, x, Y))
    fused_cfg = cfg.replace(fused_qkv=True)
    return cfg, params, fused_cfg, fuse_qkv(params, cfg.num_heads // cfg.kv_heads), x


def test_fused_parameter_layout_matches_an_init_of_the_fused_model(fused):
    cfg, _, fused_cfg, fused_params, x = fused
    model = DecoderOnly(fused_cfg) if x is None else EncoderDecoder(fused_cfg)
    args = (Y,) if x is None else (x, Y)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    want = jax.tree_util.tree_map(lambda s: s.shape, nn.meta.unbox(boxed))
    assert jax.tree_util.tree_map(lambda a: a.shape, fused_params) == want
    layer = nn.get_partition_spec(boxed)["decoder"]["layers_0"]
    qkv = layer["self_attention"]["qkv"]
    if cfg.kv_heads == cfg.num_heads:
        assert tuple(qkv["kernel"]) == ("embed", None, "heads", "kv")
    else:
        assert tuple(qkv["query_kernel"]) == ("embed", "heads", "kv")
        assert tuple(qkv["kv_kernel"]) == ("kv_embed", None, "kv_heads", "kv")
    assert set(layer["self_attention"]) == {"qkv", "out"}
    if x is not None:  # cross-attention is not fused
        assert set(layer["cross_attention"]) == {"query", "key", "value", "out"}


def test_fused_kernel_built_from_unfused_kernels_gives_the_same_logits(fused):
    cfg, params, fused_cfg, fused_params, x = fused
    decoder_inputs = shift_right(Y, cfg.bos_id)
    want = decoder_logits(cfg, params, x, decoder_inputs)
    got = decoder_logits(fused_cfg, fused_params, x, decoder_inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def naive_greedy(cfg, params, x, context: np.ndarray, steps: int) -> np.ndarray:
    """Greedy tokens `[b, steps]` recomputing the whole prefix every step (no cache): EOS
    ends a row, PAD after it. ``context`` `[b, c]` is BOS (+ prompt)."""
    batch, start = context.shape
    inputs = np.zeros((batch, start + steps), np.int32)  # one compiled shape for every step
    inputs[:, :start] = context
    out = np.zeros((batch, steps), np.int32)
    done = np.zeros(batch, bool)
    for t in range(steps):
        logits = np.asarray(decoder_logits(cfg, params, x, jnp.asarray(inputs)))[:, start - 1 + t]
        top2 = np.sort(logits[~done], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-4).all(), "near-tie: pick another seed"
        token = np.where(done, 0, logits.argmax(-1))
        out[:, t] = token
        done |= token == 1
        if t + 1 < steps:
            inputs[:, start + t] = token
    return out


def test_cached_greedy_decoding_of_a_fused_model_equals_uncached(fused):
    _, _, fused_cfg, fused_params, x = fused
    steps = 6
    if x is None:
        prompt = tokens(3, 2, 3, 40)
        got, _ = continue_prompt(fused_params, fused_cfg, prompt, method="greedy", max_len=steps)
        bos = np.full((2, 1), fused_cfg.bos_id, np.int32)
        context = np.concatenate([bos, np.asarray(prompt)], axis=1)
    else:
        got, _ = generate(fused_params, fused_cfg, x, method="greedy", max_len=steps)
        context = np.full((2, 1), fused_cfg.bos_id, np.int32)
    want = naive_greedy(fused_cfg, fused_params, x, context, steps)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_fused_qkv_must_be_a_bool():
    with pytest.raises(ValueError, match="fused_qkv"):
        TransformerConfig(fused_qkv=1)
    with pytest.raises(ValueError, match="scan_layers"):
        TransformerConfig(scan_layers="yes")
