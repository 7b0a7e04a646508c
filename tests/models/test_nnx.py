"""The three models from Flax NNX (issue 25 section 3), checked against linen.

The plain bridge (``nnx.bridge.ToNNX`` + ``lazy_init``) needs no switch; ``models.to_nnx``
initialises in one jitted call; an ``nnx.Optimizer`` trains; the NNX module decodes with its
own key/value cache (Cache Variables) the tokens ``decoding.generate`` / ``continue_prompt``
give on the linen parameters; and on 8 simulated devices every parameter (and its optimizer
state) is sharded as linen's ``sharding.logical_shardings`` places it, and sharded training
steps equal linen/optax steps on one device (tests/helpers/nnx_mesh.py, one subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from flaxformer_lite.core import logical_params
from flaxformer_lite.decoding import generate as gen
from flaxformer_lite.decoding import search
from flaxformer_lite.models import (
    DecoderOnly,
    EncoderClassifier,
    EncoderDecoder,
    linen_params,
    to_nnx,
)
from flaxformer_lite.nn.config import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TransformerConfig(
    vocab_size=24,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=16,
    num_classes=3,
    tie_output_embedding=False,
)
SRC = np.array([[5, 9, 7, 1, 0, 0], [12, 4, 6, 20, 8, 1], [17, 1, 0, 0, 0, 0]], np.int32)
TGT = np.array([[6, 8, 10, 1, 0], [7, 7, 11, 13, 1], [9, 1, 0, 0, 0]], np.int32)
PROMPT = np.array([[5, 9, 7], [12, 4, 6], [17, 3, 8]], np.int32)
MAX_LEN = 8  # tokens decoded
LOGITS_SCALE = 8.0  # top-1 logits clear of the rest: no near-ties for rounding to flip


def inputs_of(model_cls: type) -> tuple:
    return (SRC, TGT) if model_cls is EncoderDecoder else (SRC,)


def param_shapes(tree) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in leaves}


@pytest.mark.parametrize("model_cls", [EncoderDecoder, DecoderOnly, EncoderClassifier])
def test_plain_bridge_needs_no_switch(model_cls):
    """The issue's failing call (eager sharding of the logical names) now initialises: the
    parameters have linen's names and shapes, and no sharding outside a mesh."""

    def create():
        model = nnx.bridge.ToNNX(model_cls(CONFIG), rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(model, *inputs_of(model_cls))
        return model

    abstract = nnx.eval_shape(create)
    reference = jax.eval_shape(
        lambda: model_cls(CONFIG).init(jax.random.key(0), *inputs_of(model_cls))
    )
    assert param_shapes(linen_params(abstract)) == param_shapes(nn.meta.unbox(reference["params"]))
    variables = jax.tree_util.tree_leaves(
        nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    assert variables and all(v.get_metadata()["out_sharding"] is None for v in variables)
    stack = abstract.decoder if model_cls is DecoderOnly else abstract.encoder
    kernel = stack["layers_0"]["self_attention"]["key"]["kernel"]
    assert kernel.get_metadata()["logical_axes"] == ("kv_embed", "kv_heads", "kv")


def test_plain_bridge_classifier_equals_linen_apply():
    """Eagerly, as the issue's snippet runs: the NNX call gives linen's logits for the
    parameters it holds."""
    model = nnx.bridge.ToNNX(EncoderClassifier(CONFIG), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, SRC)
    got = nnx.jit(lambda m, x: m(x))(model, SRC)
    want = EncoderClassifier(CONFIG).apply({"params": linen_params(model)}, SRC)
    assert got.shape == (3, CONFIG.num_classes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def encoder_decoder():
    return to_nnx(EncoderDecoder(CONFIG), SRC, TGT, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def decoder_only():
    return to_nnx(DecoderOnly(CONFIG), PROMPT, rngs=nnx.Rngs(4))


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    weights = (targets != 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights) / jnp.sum(weights)


def test_nnx_optimizer_steps_equal_linen_optax_steps(encoder_decoder):
    model = nnx.clone(encoder_decoder)
    initial = jax.tree_util.tree_map(np.asarray, linen_params(model))
    # SGD with momentum: linear in the gradient, so both sides agree to float rounding
    # (Adam would turn the rounding noise of a key bias's exactly-zero gradient into a step).
    tx = optax.sgd(0.5, momentum=0.9)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(SRC, TGT), TGT))(model)
        optimizer.update(model, grads)
        return loss

    linen_model = EncoderDecoder(CONFIG)

    @jax.jit
    def linen_step(params, opt_state):
        def loss_of(p):
            return loss_fn(linen_model.apply({"params": p}, SRC, TGT), TGT)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = initial, tx.init(initial)
    nnx_losses, linen_losses = [], []
    for _ in range(4):
        nnx_losses.append(float(nnx_step(model, optimizer)))
        params, opt_state, loss = linen_step(params, opt_state)
        linen_losses.append(float(loss))
    assert nnx_losses[-1] < 0.8 * nnx_losses[0]
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-5)
    got, want = linen_params(model), params
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    moved = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: a - b, want, initial))
    assert max(float(np.abs(m).max()) for m in moved) > 0.05
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def scaled_logits(model: nnx.Module) -> nnx.Module:
    """A copy whose output projection is ``LOGITS_SCALE`` times larger."""
    model = nnx.clone(model)
    kernel = model.decoder["logits"]["kernel"]
    kernel.set_value(kernel.get_value() * LOGITS_SCALE)
    return model


def nnx_cached_greedy(model: nnx.Module, write_context, context_args, first, cache_len):
    """Greedy decoding through the NNX module and its Cache Variables.

    ``write_context(m, *context_args)`` runs on the merged module: it makes the cache
    (``cache_len`` positions, zeroed) and writes what precedes the first step into it;
    ``first`` int `[batch]` the first decoder inputs. Returns tokens `[batch, MAX_LEN]`."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, context_args, first):
        m = nnx.merge(graphdef, state)
        step_args = write_context(m, cache_len, *context_args)
        # The loop carries the cache and the rng counters (each ToNNX call draws a key).
        carried = (nnx.Cache, nnx.RngState)
        graph, cache, rest = nnx.split(m, carried, ...)

        def tokens_to_logits(tokens, cache):
            step = nnx.merge(graph, cache, rest)
            logits = step.decode(*step_args, tokens, decode=True, mutable=["cache"])
            return logits[:, -1], nnx.state(step, carried)

        return search.greedy_search(
            tokens_to_logits,
            cache,
            batch_size=first.shape[0],
            max_len=MAX_LEN,
            initial_tokens=first,
            bos_id=CONFIG.bos_id,
            eos_id=CONFIG.eos_id,
            pad_id=CONFIG.pad_id,
        )[0]

    return np.asarray(run(state, context_args, first))


def fresh_cache(m: nnx.Module, decode_args: tuple, batch: int, cache_len: int) -> None:
    """Creates the module's Cache Variables for ``cache_len`` positions (one decoding call
    over that many), then zeroes them: the cache ``decoding.init_cache`` builds for linen."""
    m.decode(*decode_args, jnp.zeros((batch, cache_len), jnp.int32), decode=True, mutable=True)
    nnx.update(m, jax.tree_util.tree_map(jnp.zeros_like, nnx.state(m, nnx.Cache)))


def test_encoder_decoder_decodes_with_the_nnx_cache(encoder_decoder):
    model = scaled_logits(encoder_decoder)

    def write_context(m, cache_len, src):
        encoded = m.encode(src)
        fresh_cache(m, (encoded, src), src.shape[0], cache_len)
        # A zero-length call stores the projected encoder keys and values.
        m.decode(encoded, src, jnp.zeros((src.shape[0], 0), jnp.int32), decode=True, mutable=True)
        return (None, src)

    first = np.full((len(SRC),), CONFIG.bos_id, np.int32)
    got = nnx_cached_greedy(model, write_context, (SRC,), first, MAX_LEN)
    want, _ = gen.generate(linen_params(model), CONFIG, SRC, max_len=MAX_LEN)
    assert len({tuple(r) for r in np.asarray(want)}) == len(SRC)  # rows decode differently
    np.testing.assert_array_equal(got, np.asarray(want))


def test_decoder_only_continues_prompts_with_the_nnx_cache(decoder_only):
    model = scaled_logits(decoder_only)
    bos = np.full((len(PROMPT), 1), CONFIG.bos_id, np.int32)
    context = np.concatenate([bos, PROMPT], axis=1)

    def write_context(m, cache_len, prefix):
        fresh_cache(m, (), prefix.shape[0], cache_len)
        m.decode(prefix, decode=True, mutable=True)  # prefill: BOS and the prompt but its last
        return ()

    cache_len = context.shape[1] + MAX_LEN
    got = nnx_cached_greedy(model, write_context, (context[:, :-1],), context[:, -1], cache_len)
    want, _ = gen.continue_prompt(linen_params(model), CONFIG, PROMPT, max_len=MAX_LEN)
    assert len({tuple(r) for r in np.asarray(want)}) == len(PROMPT)
    np.testing.assert_array_equal(got, np.asarray(want))


def test_logical_param_resolves_names_under_a_mesh():
    """A key/value kernel `[d_model, kv_heads, head_dim]` with 2 kv heads on tensor=4: the
    heads cannot split, so d_model takes fsdp x tensor (the rules' shape-dependent fallback,
    written out here by hand); outside a mesh no sharding."""
    box = logical_params.LogicalParam(jnp.zeros((16, 2, 4)), ("kv_embed", "kv_heads", "kv"))
    outside = box.to_nnx_metadata()
    assert outside["out_sharding"] is None
    mesh = AbstractMesh((2, 1, 4), ("data", "fsdp", "tensor"))
    with jax.sharding.use_abstract_mesh(mesh):
        inside = box.to_nnx_metadata()
    assert inside["out_sharding"] == PartitionSpec(("fsdp", "tensor"), None, None)
    back = logical_params.LogicalParam.from_nnx_metadata(dict(inside))
    assert back.names == ("kv_embed", "kv_heads", "kv") and back.value is box.value


def test_foreign_mesh_is_refused_naming_the_axes():
    box = logical_params.LogicalParam(jnp.zeros((16, 4)), ("embed", "mlp"))
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",))):
        with pytest.raises(ValueError, match=r"lack \('data', 'fsdp', 'tensor'\)"):
            box.to_nnx_metadata()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match=r"mesh must have the axes"):
        to_nnx(EncoderClassifier(CONFIG), SRC, mesh=mesh)
    with pytest.raises(ValueError, match=r"module must be a flax.linen Module"):
        to_nnx(lambda x: x, SRC)


@pytest.fixture(scope="module")
def on_eight_devices(tmp_path_factory):
    out = tmp_path_factory.mktemp("nnx_mesh")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "nnx_mesh.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "facts.json").read_text()), dict(np.load(out / "train.npz"))


@pytest.mark.parametrize(
    "case",
    [
        "to_nnx/EncoderDecoder",
        "to_nnx/DecoderOnly",
        "to_nnx/EncoderClassifier",
        "plain/EncoderClassifier",
    ],
)
def test_mesh_shards_every_parameter_as_linen(on_eight_devices, case):
    facts, _ = on_eight_devices
    specs = facts[case]
    assert len(specs) > 10
    wrong = {path: s for path, s in specs.items() if not s[2]}
    assert not wrong, wrong
    # Tensor parallelism is real: heads, MLP units and the vocabulary are split.
    assert sum("tensor" in nnx_spec for nnx_spec, _, _ in specs.values()) >= 8


def test_mesh_training_equals_one_device_linen(on_eight_devices):
    facts, arrays = on_eight_devices
    assert facts["optimizer_state_sharded_as_params"]
    assert all(facts["optimizer_state_sharded_as_params"])
    assert arrays["nnx_losses"][-1] < arrays["nnx_losses"][0]
    np.testing.assert_allclose(arrays["nnx_losses"], arrays["linen_losses"], rtol=1e-5)
    names = [k[len("nnx/") :] for k in arrays if k.startswith("nnx/")]
    assert len(names) > 10 and all(f"linen/{n}" in arrays for n in names)
    for name in names:
        np.testing.assert_allclose(
            arrays[f"nnx/{name}"], arrays[f"linen/{name}"], rtol=1e-5, atol=1e-6, err_msg=name
        )
