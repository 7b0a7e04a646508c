"""Mixture-of-experts feed-forward blocks (flaxformer_lite/nn/moe.py) and the models built on them.

The routing arithmetic is checked on router logits built by hand, the block against a float64
NumPy mixture written here and against the dense block it generalises, the models through
cached decoding and training, and expert parallelism on 8 simulated devices against 1.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from flaxformer_lite import DecoderOnly, EncoderClassifier, EncoderDecoder, TransformerConfig
from flaxformer_lite.nn import moe
from flaxformer_lite.nn.mlp import MlpBlock

from helpers.runs import final_loss, run_train, saved_state, train_here

# ----------------------------------------------------------------------------- routing


def test_route_fills_first_choices_first_and_drops_over_capacity():
    """One group, 4 tokens, 2 experts, top-2, capacity 2 per expert. Every token prefers
    expert 0 except token 2. Priority: all first choices in token order, then second choices.
      first choices:  t0->e0 (slot 0), t1->e0 (slot 1), t2->e1 (slot 0), t3->e0 (full: drop)
      second choices: t0->e1 (slot 1), t1->e1 (full: drop), t2->e0 (full), t3->e1 (full)
    """
    logits = jnp.array([[[2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [4.0, 0.0]]])
    expert, slot, gate, probs = moe.route(logits, k=2, slots=2)
    np.testing.assert_array_equal(expert[0], [[0, 1], [0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(slot[0], [[0, 1], [1, 2], [0, 2], [2, 2]])  # 2 = dropped
    p = np.asarray(probs[0])
    expected_gate = np.array(
        [[p[0, 0], p[0, 1]], [p[1, 0], 0.0], [p[2, 1], 0.0], [0.0, 0.0]]
    )  # top-2 probabilities sum to 1 with two experts: renormalising changes nothing
    np.testing.assert_allclose(gate[0], expected_gate, rtol=1e-6)


def test_route_skips_invalid_tokens_and_top1_gate_is_the_probability():
    logits = jnp.array([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
    valid = jnp.array([[True, False, True]])
    expert, slot, gate, probs = moe.route(logits, k=1, slots=1, valid=valid)
    np.testing.assert_array_equal(expert[0, :, 0], [2, 0, 2])
    # Token 1 is padding: no slot; token 2 finds expert 2 already full with token 0.
    np.testing.assert_array_equal(slot[0, :, 0], [0, 1, 1])
    np.testing.assert_allclose(gate[0, :, 0], [probs[0, 0, 2], 0.0, 0.0], rtol=1e-6)


def test_capacity_formula():
    assert moe.capacity(10, 4, 2, 1.25) == 7  # ceil(1.25 * 10 * 2 / 4) = ceil(6.25)
    assert moe.capacity(10, 4, 2, 100.0) == 10  # never above the tokens of a group
    assert moe.capacity(10, 4, 2, None) == 10
    assert moe.capacity(1, 8, 1, 1.0) == 1


def test_auxiliary_losses():
    # Uniform probabilities: the load-balancing loss is exactly 1 whatever the assignment.
    probs = jnp.full((2, 5, 4), 0.25)
    expert = jnp.zeros((2, 5, 2), jnp.int32)
    assert float(moe.load_balancing_loss(probs, expert)) == pytest.approx(1.0)
    # Everything on expert 0 with probability 1: E * 1 * 1 = E.
    probs = jnp.zeros((1, 3, 4)).at[..., 0].set(1.0)
    assert float(moe.load_balancing_loss(probs, jnp.zeros((1, 3, 1), jnp.int32))) == 4.0
    logits = jnp.array([[[0.0, 0.0], [1.0, 2.0]]])
    expected = np.mean([np.log(2.0) ** 2, np.log(np.exp(1.0) + np.exp(2.0)) ** 2])
    assert float(moe.router_z_loss(logits)) == pytest.approx(expected, rel=1e-6)


def test_dispatch_builds_nothing_of_size_tokens_x_experts_x_capacity():
    """GShard's one-hot dispatch tensor `[tokens, experts, capacity]` never appears."""
    g, t, e, k, d = 2, 64, 8, 2, 4
    slots = moe.capacity(t, e, k, 2.0)
    logits = jax.random.normal(jax.random.key(0), (g, t, e))
    x = jax.random.normal(jax.random.key(1), (g, t, d))

    def f(logits, x):
        expert, slot, gate, _ = moe.route(logits, k, slots)
        buffer = moe.dispatch(x, expert, slot, e, slots)
        return moe.combine(buffer, expert, slot, gate)

    jaxpr = jax.make_jaxpr(f)(logits, x)
    sizes = [
        int(np.prod(v.aval.shape))
        for eqn in jaxpr.jaxpr.eqns
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    ]
    assert max(sizes) < g * t * e * slots, (max(sizes), g * t * e * slots)


# ----------------------------------------------------------------------------- the block


def _mixture_float64(params, x, k, activation):
    """A float64 NumPy mixture: softmax router, top-k renormalised, sum of expert FFNs."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    act = {"relu": lambda z: np.maximum(z, 0.0), "silu": lambda z: z / (1 + np.exp(-z))}
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            top = np.argsort(-probs[b, t], kind="stable")[:k]
            w = probs[b, t, top] / (probs[b, t, top].sum() if k > 1 else 1.0)
            for e, we in zip(top, w, strict=True):
                h = act[activation](x[b, t] @ p["wi"][e] + p["wi_bias"][e])
                out[b, t] += we * (h @ p["wo"][e] + p["wo_bias"][e])
    return out


@pytest.mark.parametrize("k, activation", [(2, "relu"), (1, "silu")])
def test_block_matches_a_float64_mixture_without_capacity(k, activation):
    block = moe.MoeBlock(num_experts=4, k=k, d_ff=16, activation=activation)
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    params = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(1), x)["params"])
    rng = np.random.default_rng(0)  # non-zero biases and a router that is not near-uniform
    params = {
        name: (rng.standard_normal(v.shape) * (1.0 if name == "router" else 0.3)).astype(np.float32)
        for name, v in params.items()
    }
    out = jax.jit(functools.partial(block.apply, deterministic=True))({"params": params}, x)
    np.testing.assert_allclose(out, _mixture_float64(params, x, k, activation), atol=2e-5)


def _routing_float64(probs, valid, k, factor):
    """Combine weights `[groups, tokens, experts]` of top-k routing with capacity, in float64:
    per group, capacity ceil(factor x real tokens x k / experts) (at least 1, at most the real
    tokens), slots filled by every real token's first choice in token order, then every
    second choice ...; padding routes nothing and takes no slot."""
    groups, tokens, experts = probs.shape
    weights = np.zeros_like(probs)
    for g in range(groups):
        real = [t for t in range(tokens) if valid[g, t]]
        cap = len(real)
        if factor is not None:
            cap = max(1, min(len(real), math.ceil(factor * len(real) * k / experts)))
        top = {t: np.argsort(-probs[g, t], kind="stable")[:k] for t in real}
        used = np.zeros(experts, int)
        for choice in range(k):
            for t in real:
                e = top[t][choice]
                if used[e] < cap:
                    used[e] += 1
                    norm = probs[g, t, top[t]].sum() if k > 1 else 1.0
                    weights[g, t, e] = probs[g, t, e] / norm
    return weights


def _capacity_mixture_float64(params, x, valid, k, factor):
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    weights = _routing_float64(probs, valid, k, factor)
    h = np.maximum(np.einsum("btd,edf->btef", x, p["wi"]) + p["wi_bias"], 0.0)
    y = np.einsum("btef,efd->bted", h, p["wo"]) + p["wo_bias"][None, None]
    return np.einsum("bted,bte->btd", y, weights), weights


@pytest.mark.parametrize("k", [2, 1])
def test_capacity_counts_real_tokens_only_against_a_float64_routing(k):
    """Training (capacity factor 1.0, drops happen) with padding inside and after the real
    tokens: capacity from each row's real tokens, pads take no slot and do not move the real
    tokens' priority; the same outputs at the real positions as the row without its pads."""
    e, factor = 4, 1.0
    block = moe.MoeBlock(num_experts=e, k=k, d_ff=16, capacity_factor=factor)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 12, 8)).astype(np.float32)
    valid = np.ones((3, 12), bool)
    valid[0, 7:] = False  # trailing padding
    valid[1, [1, 4, 5, 10]] = False  # padding between real tokens
    params = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(1), jnp.asarray(x))["params"])
    params = {n: (rng.standard_normal(v.shape) * 0.5).astype(np.float32) for n, v in params.items()}
    params["router"] = params["router"] * 4.0  # far from uniform: experts overflow
    apply = jax.jit(functools.partial(block.apply, deterministic=False, mutable=["losses"]))
    out, state = apply({"params": params}, jnp.asarray(x), jnp.asarray(valid))
    expected, weights = _capacity_mixture_float64(params, x, valid, k, factor)
    kept = (weights > 0).sum()
    assert 0 < kept < valid.sum() * k  # capacity binds
    np.testing.assert_allclose(out, expected, atol=2e-5)
    dropped = float(state["losses"]["moe_dropped"][0])
    assert dropped == pytest.approx(1.0 - kept / (valid.sum() * k), abs=1e-6)
    # Row 1 without its pads: the same outputs at its real tokens.
    compact = x[1][valid[1]][None]
    alone, _ = apply({"params": params}, jnp.asarray(compact))
    np.testing.assert_allclose(alone[0], out[1][valid[1]], atol=2e-5)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_one_expert_top1_without_limit_is_the_dense_block(activation):
    dense = MlpBlock(d_ff=16, activation=activation)
    block = moe.MoeBlock(num_experts=1, k=1, d_ff=16, capacity_factor=None, activation=activation)
    x = jax.random.normal(jax.random.key(0), (3, 7, 8))
    dp = nn.meta.unbox(jax.jit(dense.init)(jax.random.key(1), x)["params"])
    mp = nn.meta.unbox(jax.jit(block.init)(jax.random.key(2), x)["params"])
    mp["wi"], mp["wi_bias"] = dp["wi"]["kernel"][None], dp["wi"]["bias"][None] + 0.1
    dp["wi"]["bias"] = dp["wi"]["bias"] + 0.1
    mp["wo"], mp["wo_bias"] = dp["wo"]["kernel"][None], dp["wo"]["bias"][None]
    if activation == "swiglu":
        mp["wi_up"], mp["wi_up_bias"] = dp["wi_up"]["kernel"][None], dp["wi_up"]["bias"][None]
    y_dense = jax.jit(dense.apply)({"params": dp}, x)
    # training: capacity None
    y_moe = jax.jit(functools.partial(block.apply, deterministic=False))({"params": mp}, x)
    np.testing.assert_allclose(y_moe, y_dense, rtol=1e-6, atol=1e-6)


def test_capacity_drops_in_training_only():
    block = moe.MoeBlock(num_experts=2, k=1, d_ff=8, capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(0), (1, 8, 4))
    params = jax.jit(block.init)(jax.random.key(1), x)["params"]
    apply = jax.jit(block.apply, static_argnames=("deterministic", "mutable"))
    train, state = apply(
        {"params": params}, x, deterministic=False, mutable=("losses",)
    )  # capacity ceil(0.5 * 8 / 2) = 2 per expert: at most 4 of 8 tokens kept
    dropped = float(state["losses"]["moe_dropped"][0])
    assert dropped >= 0.5
    evaluation, state = apply({"params": params}, x, deterministic=True, mutable=("losses",))
    assert float(state["losses"]["moe_dropped"][0]) == 0.0
    zero_rows = np.all(np.asarray(train[0]) == 0.0, axis=-1)
    assert zero_rows.sum() == round(dropped * 8)  # a dropped token gets nothing from the block
    assert not np.any(np.all(np.asarray(evaluation[0]) == 0.0, axis=-1))


# ----------------------------------------------------------------------------- models

MOE = TransformerConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=16,
    dropout_rate=0.0,
    num_experts=4,
    num_experts_per_token=2,
    moe_every=2,
)


def test_moe_layers_are_the_selected_ones_and_config_errors_name_the_field():
    model = EncoderDecoder(MOE)
    x = jnp.ones((1, 4), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), x, x)["params"]
    for stack in ("encoder", "decoder"):
        assert "mlp" in params[stack]["layers_0"] and "moe" not in params[stack]["layers_0"]
        assert "moe" in params[stack]["layers_1"] and "mlp" not in params[stack]["layers_1"]
    with pytest.raises(ValueError, match="num_experts_per_token"):
        MOE.replace(num_experts_per_token=5)
    with pytest.raises(ValueError, match="moe_every must be 1 with scan_layers"):
        MOE.replace(scan_layers=True)
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        MOE.replace(expert_capacity_factor=0.0)


def test_cached_decoding_equals_full_forward_with_experts():
    model = EncoderDecoder(MOE)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(3, 40, size=(2, 7)), jnp.int32).at[1, 5:].set(0)
    y = jnp.asarray(rng.integers(3, 40, size=(2, 6)), jnp.int32)
    # Every call jitted (the decode step compiled once for all 6 steps): cold, op-by-op eager
    # dispatch of the MoE model cost more CPU than these four compiles.
    params = jax.jit(model.init)(jax.random.key(0), x, y)["params"]
    full = jax.jit(model.apply)({"params": params}, x, y)
    encoded = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode))(params, x)
    shifted = jnp.concatenate([jnp.full((2, 1), MOE.bos_id, jnp.int32), y[:, :-1]], axis=1)
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
        lambda c, tok: model.apply(
            {"params": params, "cache": c},
            encoded,
            x,
            tok,
            decode=True,
            mutable=["cache"],
            method=model.decode,
        )
    )
    outs = []
    for t in range(shifted.shape[1]):
        logits, state = step(cache, shifted[:, t : t + 1])
        cache = state["cache"]
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


MOE_FLAGS = [
    "--config.model.num_experts=4",
    "--config.model.num_experts_per_token=2",
    "--config.model.expert_capacity_factor=1.0",
]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The one-device run, in this process (the eight-device run parses the same flags)."""
    workdir = tmp_path_factory.mktemp("moe_one_device")
    train_here(workdir, *MOE_FLAGS)
    return workdir


def test_training_logs_the_auxiliary_losses(moe_reference):
    import json

    lines = [json.loads(x) for x in (moe_reference / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "train/moe_aux_loss" in m]
    assert train, "no train/moe_aux_loss in metrics.jsonl"
    for m in train:
        assert m["train/moe_aux_loss"] >= 1.0 - 1e-4  # E * sum f P >= 1 (Cauchy-Schwarz bound)
        assert m["train/router_z_loss"] > 0.0
        assert 0.0 <= m["train/moe_dropped"] < 1.0


def test_eight_simulated_devices_with_expert_parallelism_match_one(moe_reference, tmp_path):
    """Experts split 4-way over the data axis, heads 2-way: the same losses and parameters."""
    out = run_train(tmp_path, *MOE_FLAGS, "--config.mesh_shape=(4,1,2)", devices=8)
    assert "mesh {'data': 4, 'fsdp': 1, 'tensor': 2}" in out.stdout
    a, _ = saved_state(moe_reference)
    b, _ = saved_state(tmp_path)
    assert final_loss(tmp_path) == pytest.approx(final_loss(moe_reference), abs=1e-5)
    la, lb = jax.tree_util.tree_leaves(a["params"]), jax.tree_util.tree_leaves(b["params"])
    for p, q in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- padding

PADDED = MOE.replace(moe_every=1, expert_capacity_factor=1.0, num_classes=3)


def _random_params(model, *args, seed=0):
    """Parameters drawn with numpy on eval_shape's shapes (no eager init), routers scaled up
    so that routing is far from uniform and capacity 1.0 drops assignments."""
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), *args)["params"])

    def draw(path, s):
        scale = 2.0 if path[-1].key == "router" else 0.3
        return jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _sown(losses):
    """Per layer (flattened order) each sown loss, and the batch's auxiliary losses."""
    flat = {
        path: np.concatenate([np.ravel(v) for v in leaf])
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            losses, is_leaf=lambda x: isinstance(x, tuple)
        )[0]
    }
    batch = moe.batch_auxiliary_losses(moe.routing_statistics(losses))
    return flat, {k: float(v) for k, v in batch.items()}


@pytest.mark.parametrize(
    "kind, deterministic",
    [("translation", False), ("translation", True), ("lm", False), ("classification", False)],
)
def test_padding_changes_nothing_at_real_positions(kind, deterministic):
    """The same rows with 4 more source and 3 more target pad columns: the same logits at the
    real positions and the same auxiliary losses and drops, layer by layer (capacity factor
    1.0, so that assignments are dropped in training)."""
    rng = np.random.default_rng(0)
    x = rng.integers(3, 40, size=(3, 9))
    x[1, 5:], x[2, 8:] = 0, 0
    y = rng.integers(3, 40, size=(3, 7))
    y[0, 3:], y[2, 6:] = 0, 0
    xp, yp = np.pad(x, ((0, 0), (0, 4))), np.pad(y, ((0, 0), (0, 3)))
    if kind == "translation":
        model, args, padded, real = EncoderDecoder(PADDED), (x, y), (xp, yp), y != 0
    elif kind == "lm":
        model, args, padded, real = DecoderOnly(PADDED), (y,), (yp,), y != 0
    else:
        model, args, padded, real = EncoderClassifier(PADDED), (x,), (xp,), np.ones(3, bool)
    params = _random_params(model, *args)
    run = jax.jit(
        lambda *a: model.apply(
            {"params": params}, *a, deterministic=deterministic, mutable=["losses"]
        )
    )
    logits, state = run(*map(jnp.asarray, args))
    logits_p, state_p = run(*map(jnp.asarray, padded))
    if kind != "classification":
        logits_p = logits_p[:, : y.shape[1]]
    np.testing.assert_allclose(logits_p[real], logits[real], rtol=1e-5, atol=1e-5)
    layers, batch = _sown(state["losses"])
    layers_p, batch_p = _sown(state_p["losses"])
    assert layers.keys() == layers_p.keys()
    for path in layers:
        np.testing.assert_allclose(layers_p[path], layers[path], rtol=1e-5, atol=1e-6)
    assert batch_p == pytest.approx(batch, rel=1e-6)
    assert (batch["moe_dropped"] > 0.05) != deterministic  # drops in training only


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_gradient_accumulation_gives_the_whole_batch_auxiliary_losses(capacity_factor):
    """grad_accum_steps 2 against 1: the same gradient (routers included) and the same
    logged load-balancing loss, z-loss and drops, those of the whole batch, which is the
    blocks' own layer mean over the whole batch. With capacity (factor 1.0) too: a group is
    a row, which a micro-batch holds whole. Auxiliary weights of 1 and 0.1, so that they
    dominate the routers' gradient; unequal real-token counts across micro-batches."""
    import optax

    cfg = PADDED.replace(
        num_encoder_layers=1,
        num_decoder_layers=1,
        expert_capacity_factor=capacity_factor,
        moe_aux_loss_weight=1.0,
        router_z_loss_weight=0.1,
    )
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(2)
    batch = {"inputs": rng.integers(3, 40, (8, 7)), "targets": rng.integers(3, 40, (8, 6))}
    batch["inputs"][::3, 4:] = 0
    batch["targets"][1::3, 2:] = 0
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    params = _random_params(model, batch["inputs"], batch["targets"], seed=3)
    tx = optax.sgd(1.0)
    state = train.TrainState(
        step=jnp.array(0), params=params, opt_state=tx.init(params), rng=jax.random.key(0)
    )
    grads, metrics = {}, {}
    for k in (1, 2):
        step = functools.partial(
            train.train_step, model=model, kind="translation", tx=tx,
            schedule=lambda s: 1.0, label_smoothing=0.1, accum_steps=k, skip_nonfinite=False,
        )  # fmt: skip
        new, m = jax.jit(step)(state, batch)
        grads[k] = jax.tree_util.tree_map(lambda a, b: np.asarray(a - b), params, new.params)
        metrics[k] = {key: float(v) / float(m["count"]) for key, v in m.items() if "moe" in key}
        metrics[k]["router_z_loss"] = float(m["router_z_loss"]) / float(m["count"])
    # The reference: each block's own losses over the whole batch, averaged over layers.
    # Jitted: one compile instead of op-by-op eager dispatch (8 of the test's CPU seconds cold).
    _, state_ = jax.jit(
        lambda p, x, y: model.apply({"params": p}, x, y, deterministic=False, mutable=["losses"])
    )(params, batch["inputs"], batch["targets"])
    flat = jax.tree_util.tree_flatten_with_path(state_["losses"])[0]
    for key in train.MOE_KEYS:
        values = [float(v) for path, v in flat if path[-2].key == key]
        assert len(values) == 2
        for k in (1, 2):
            assert metrics[k][key] == pytest.approx(np.mean(values), rel=1e-6, abs=1e-7), (k, key)
    assert (metrics[1]["moe_dropped"] > 0.05) == (capacity_factor is not None)
    for k in (2,):
        for path, g in jax.tree_util.tree_flatten_with_path(grads[k])[0]:
            ref = grads[1]
            for p in path:
                ref = ref[p.key]
            np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6, err_msg=f"{k} {path}")
    router = grads[1]["encoder"]["layers_0"]["moe"]["router"]
    assert np.abs(router).max() > 1e-2  # the routers do learn from the auxiliary losses
