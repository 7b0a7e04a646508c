"""A checkpoint restores on a mesh of another shape, bit for bit, with the target's sharding.

A train state (tiny EncoderDecoder, Adam, two steps) is saved from one mesh and restored the
way train.py resumes (into the shapes and shardings of the state on the target mesh) on
others: (1,1,1) -> (2,2,2) and (1,8,1), and back from (2,2,2) and (1,8,1). Every leaf
must equal the saved one bit for bit, carry the sharding the target mesh gives it, and every
device must hold exactly its piece of the global array.

The meshes need 8 devices, so the saving and restoring runs in one subprocess on 8 simulated
CPU devices (this file run as a script); the tests check what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# (saved from, restored on): mesh shapes (data, fsdp, tensor).
CASES = {
    "111->222": ((1, 1, 1), (2, 2, 2)),
    "111->181": ((1, 1, 1), (1, 8, 1)),
    "222->111": ((2, 2, 2), (1, 1, 1)),
    "181->111": ((1, 8, 1), (1, 1, 1)),
    "222->181": ((2, 2, 2), (1, 8, 1)),
}


# ----------------------------------------------------------------------------- the worker


def _worker(out: Path) -> None:
    """Saves and restores as CASES say; writes the saved leaves (saved.npz), each restore's
    leaves ({case}.npz) and, per restored leaf, its spec and whether its sharding and shards
    are right (facts.json)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import train
    from flaxformer_lite import EncoderDecoder, TransformerConfig
    from flaxformer_lite.core import sharding
    from flaxformer_lite.core.checkpoints import Checkpointer

    assert jax.device_count() == 8, jax.devices()
    cfg = TransformerConfig(
        vocab_size=40, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=8, dropout_rate=0.0,
    )  # fmt: skip
    model, tx = EncoderDecoder(cfg), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(4, 40, (8, 6)), jnp.int32)
    y = jnp.asarray(rng.integers(4, 40, (8, 5)), jnp.int32)

    def init_fn(seed: int):
        params = model.init(jax.random.PRNGKey(seed), x[:1], y[:1])["params"]
        step = jnp.array(0, jnp.int32)
        return train.TrainState(
            step=step, params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(seed)
        )

    def mesh_of(shape):
        devices = jax.devices()[: int(np.prod(shape))]
        return sharding.make_mesh(shape, devices)

    @jax.jit
    def step_fn(state):
        def loss(params):
            logits = model.apply({"params": params}, x, y)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    def leaves(state) -> dict[str, np.ndarray]:
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        return {jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in flat}

    def shards_ok(leaf, want) -> bool:
        """Every device of the target mesh holds the piece of the global value its index
        names, and no other device holds any."""
        value = np.asarray(jax.device_get(leaf))
        shards = leaf.addressable_shards
        if {s.device for s in shards} != set(want.mesh.devices.flat):
            return False
        return all(np.array_equal(np.asarray(s.data), value[s.index]) for s in shards)

    with jax.set_mesh(mesh_of((1, 1, 1))):
        state, _ = sharding.sharded_init(lambda: init_fn(0), mesh_of((1, 1, 1)))
        state = step_fn(step_fn(state))
    saved = leaves(state)
    np.savez(out / "saved.npz", **saved)

    abstract = jax.eval_shape(lambda: init_fn(1))  # boxed: logical axis names
    facts, restored_on, written = {}, {(1, 1, 1): state}, {}
    for case, (source, target) in CASES.items():
        if source not in written:  # the state as restored on `source` (the original on 1)
            directory = out / "from_{}x{}x{}".format(*source)
            checkpointer = Checkpointer(str(directory), async_save=False)
            checkpointer.save(2, restored_on[source], {"train": {"index": 2}}, force=True)
            checkpointer.close()
            written[source] = directory
        # The target: shapes, dtypes and the shardings train.py gives the state on that mesh.
        shardings = sharding.logical_shardings(abstract, mesh_of(target))
        wanted = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nn.meta.unbox(abstract),
            shardings,
        )
        checkpointer = Checkpointer(str(written[source]), async_save=False)
        restored, data = checkpointer.restore(wanted)
        checkpointer.close()
        assert data == {"train": {"index": 2}}, data
        restored_on.setdefault(target, restored)
        np.savez(out / f"{case}.npz", **leaves(restored))
        flat = jax.tree_util.tree_flatten_with_path(restored)[0]
        facts[case] = {
            jax.tree_util.keystr(path): {
                "spec": [a if a is None or isinstance(a, str) else list(a) for a in want.spec],
                "mesh": dict(leaf.sharding.mesh.shape)
                if isinstance(leaf.sharding, jax.sharding.NamedSharding)
                else repr(leaf.sharding),
                "has_target_sharding": leaf.sharding.is_equivalent_to(want, leaf.ndim),
                "shards_ok": shards_ok(leaf, want),
                "shard_shape": list(leaf.addressable_shards[0].data.shape),
            }
            for (path, leaf), want in zip(flat, jax.tree_util.tree_leaves(shardings), strict=True)
        }
    (out / "facts.json").write_text(json.dumps(facts))


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def restores(tmp_path_factory):
    """(saved leaves, {case: restored leaves}, {case: {leaf: facts}}) from the worker."""
    out = tmp_path_factory.mktemp("mesh_restore")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = dict(np.load(out / "saved.npz"))
    restored = {case: dict(np.load(out / f"{case}.npz")) for case in CASES}
    return saved, restored, json.loads((out / "facts.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_restores_bitwise_on_another_mesh_with_its_sharding(restores, case):
    saved, restored, facts = restores
    got, facts = restored[case], facts[case]
    assert set(got) == set(saved) == set(facts) and len(saved) > 30
    assert int(saved[".step"]) == 2
    assert any(np.abs(v).max() > 0 for k, v in saved.items() if k.startswith(".opt_state[0].mu"))
    for name, want in saved.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    target = CASES[case][1]
    for name, fact in facts.items():
        assert fact["mesh"] == dict(zip(("data", "fsdp", "tensor"), target, strict=True)), name
        assert fact["has_target_sharding"], (name, fact)
        assert fact["shards_ok"], (name, fact)
    # Step, RNG key and Adam's count are replicated: a whole copy on every device.
    for name in (".step", ".rng", ".opt_state[0].count"):
        assert facts[name]["spec"] == [], (name, facts[name])
        assert facts[name]["shard_shape"] == list(saved[name].shape), (name, facts[name])
    # The target mesh really splits parameters (else any restore would pass the above).
    split = [n for n, f in facts.items() if f["shard_shape"] != list(saved[n].shape)]
    assert (len(split) > len(saved) // 2) == (target != (1, 1, 1)), split
    if target == (2, 2, 2):
        embedding = facts[".params['source_embedding']['embedding']"]
        assert embedding["spec"] == ["tensor", "fsdp"] and embedding["shard_shape"] == [20, 16]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
