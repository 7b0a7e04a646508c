"""The three models from NNX on 8 simulated devices; run by tests/models/test_nnx.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/nnx_mesh.py OUT

Under a (data 2, fsdp 1, tensor 4) mesh: ``models.to_nnx(..., mesh=)`` for each model, and
the plain bridge (``nnx.bridge.ToNNX`` + ``lazy_init`` inside ``jax.set_mesh``, no switch) for
the classifier. Writes ``OUT/facts.json``: per model and parameter, the NNX Variable's sharding
spec and the one linen's ``sharding.logical_shardings`` gives the same parameter (the
reference), and whether they are equivalent; then two ``nnx.Optimizer`` steps of the sharded
EncoderDecoder and two linen/optax steps of its initial parameters on one device, written to
``OUT/train.npz`` (``nnx/...`` and ``linen/...`` per parameter, ``*_losses``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flaxformer_lite.core import sharding
from flaxformer_lite.models import DecoderOnly, EncoderClassifier, EncoderDecoder
from flaxformer_lite.models.layouts import param_path
from flaxformer_lite.models.nnx_bridge import linen_params, to_nnx
from flaxformer_lite.nn.config import TransformerConfig

# 4 heads and a vocabulary of 24 split over tensor=4; 2 kv heads do not, so the key/value
# kernels fall back to splitting d_model ("kv_embed"): the shape-dependent rule.
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
)
MESH = (2, 1, 4)
SRC = np.array([[5, 9, 7, 1, 0, 0]] * 4 + [[12, 4, 6, 20, 8, 1]] * 4, np.int32)
TGT = np.array([[6, 8, 10, 1, 0]] * 4 + [[7, 7, 11, 13, 1]] * 4, np.int32)
STEPS = 2


def inputs_of(model_cls: type) -> tuple:
    return (SRC, TGT) if model_cls is EncoderDecoder else (SRC,)


def shardings(model: nnx.Module, model_cls: type, mesh) -> dict:
    """path -> [NNX spec, linen spec, equivalent] for every parameter."""
    cfg = CONFIG
    abstract = jax.eval_shape(lambda: model_cls(cfg).init(jax.random.key(0), *inputs_of(model_cls)))
    expected = sharding.logical_shardings(abstract, mesh)["params"]
    got = linen_params(model)
    facts = {}
    flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected))
    for path, value in jax.tree_util.tree_leaves_with_path(got):
        want = flat_expected[path]
        facts[param_path(path)] = [
            str(value.sharding.spec),
            str(want.spec),
            bool(value.sharding.is_equivalent_to(want, value.ndim)),
        ]
    assert len(facts) == len(flat_expected)
    return facts


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    weights = (targets != 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights) / jnp.sum(weights)


def main(out: Path) -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = sharding.make_mesh(MESH)
    facts: dict = {}
    models = {}
    for model_cls in (EncoderDecoder, DecoderOnly, EncoderClassifier):
        model = to_nnx(model_cls(CONFIG), *inputs_of(model_cls), mesh=mesh)
        facts[f"to_nnx/{model_cls.__name__}"] = shardings(model, model_cls, mesh)
        models[model_cls] = model
    with jax.set_mesh(mesh):  # the plain bridge, as a user writes it
        plain = nnx.bridge.ToNNX(EncoderClassifier(CONFIG), rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(plain, SRC)
    facts["plain/EncoderClassifier"] = shardings(plain, EncoderClassifier, mesh)

    # Training: nnx.Optimizer under the mesh; the reference is optax on plain arrays.
    model = models[EncoderDecoder]
    initial = jax.tree_util.tree_map(np.asarray, linen_params(model))
    # SGD with momentum: an update linear in the gradient, so the two runs agree to float
    # rounding. (Adam turns the rounding noise of a gradient that is zero in exact arithmetic,
    # a key bias under softmax, into a whole learning-rate step of either sign.)
    tx = optax.sgd(0.5, momentum=0.9)
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model, optimizer, src, tgt):
            loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(src, tgt), tgt))(model)
            optimizer.update(model, grads)
            return loss

        nnx_losses = [float(nnx_step(model, optimizer, SRC, TGT)) for _ in range(STEPS)]
    mu = optimizer.opt_state[0].trace  # the momentum: sharded as its parameter
    mu_specs = [
        v.get_value().sharding.is_equivalent_to(p.get_value().sharding, p.get_value().ndim)
        for v, p in zip(
            jax.tree_util.tree_leaves(mu, is_leaf=lambda x: isinstance(x, nnx.Variable)),
            jax.tree_util.tree_leaves(
                nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
            ),
            strict=True,
        )
    ]
    facts["optimizer_state_sharded_as_params"] = mu_specs

    linen_model = EncoderDecoder(CONFIG)

    @jax.jit
    def linen_step(params, opt_state):
        def loss_of(p):
            return loss_fn(linen_model.apply({"params": p}, SRC, TGT), TGT)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(initial, jax.devices()[0])
    opt_state = tx.init(params)
    linen_losses = []
    for _ in range(STEPS):
        params, opt_state, loss = linen_step(params, opt_state)
        linen_losses.append(float(loss))

    arrays = {"nnx_losses": np.array(nnx_losses), "linen_losses": np.array(linen_losses)}
    for path, value in jax.tree_util.tree_leaves_with_path(linen_params(model)):
        arrays[f"nnx/{param_path(path)}"] = np.asarray(value)
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        arrays[f"linen/{param_path(path)}"] = np.asarray(value)
    np.savez(out / "train.npz", **arrays)
    (out / "facts.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
