"""Sharded training: the same steps on 1 device, on 8 simulated devices under several meshes,
and across 2 processes, end with the same parameters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from flaxformer_lite import sharding
from flaxformer_lite.checkpoints import Checkpointer

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--config.batch_size=16",
    "--config.num_train_steps=6",
    "--config.log_every=3",
    "--config.eval_every=0",
    "--config.checkpoint_every=100",
    "--config.warmup_steps=2",
    "--config.learning_rate=0.003",
    "--config.synthetic.max_len=6",
    "--config.synthetic.min_len=2",
    "--config.synthetic.num_eval=32",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.d_ff=64",
    "--config.model.num_encoder_layers=1",
    "--config.model.num_decoder_layers=1",
    "--config.model.dropout_rate=0.1",
    # The key bias has a zero gradient in exact arithmetic (softmax ignores a constant per
    # query); Adam would turn its rounding noise into full-size steps that differ by layout.
    "--config.model.use_bias=False",
]


def run_train(workdir: Path, *extra: str, devices: int = 1, env_extra=None, wait=True):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(env_extra or {})
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs/default.py"),
        "--workdir",
        str(workdir),
        *TINY,
        *extra,
    ]
    if not wait:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def saved_state(workdir: Path):
    ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
    state, data = ckpt.restore()
    ckpt.close()
    return state, data


def final_loss(workdir: Path) -> float:
    import json

    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "train/loss" in m][-1]["train/loss"]


def assert_same_params(a, b, atol=1e-5):
    la, lb = jax.tree_util.tree_leaves(a["params"]), jax.tree_util.tree_leaves(b["params"])
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=atol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny run on one device."""
    workdir = tmp_path_factory.mktemp("one_device")
    run_train(workdir)
    return workdir


@pytest.mark.parametrize("mesh", ["(8,1,1)", "(1,8,1)", "(2,2,2)"])
def test_eight_simulated_devices_match_one_device(reference, tmp_path, mesh):
    out = run_train(tmp_path, f"--config.mesh_shape={mesh}", devices=8)
    dims = tuple(int(d) for d in mesh.strip("()").split(","))
    assert f"mesh {{'data': {dims[0]}, 'fsdp': {dims[1]}, 'tensor': {dims[2]}}}" in out.stdout
    a, _ = saved_state(reference)
    b, _ = saved_state(tmp_path)
    assert int(b["step"]) == 6
    assert final_loss(tmp_path) == pytest.approx(final_loss(reference), abs=1e-5)
    assert_same_params(a, b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(reference, tmp_path):
    workdir = tmp_path / "two"
    address = f"127.0.0.1:{free_port()}"
    procs = [
        run_train(
            workdir,
            f"--coordinator_address={address}",
            "--num_processes=2",
            f"--process_id={i}",
            wait=False,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in outs[0]
    a, _ = saved_state(reference)
    b, data = saved_state(workdir)
    assert int(b["step"]) == 6 and data["train"] == {"index": 6}
    assert_same_params(a, b)
    # The 2-process checkpoint restores in a 1-process run, which carries on from step 6.
    resumed = run_train(workdir, "--config.num_train_steps=8")
    assert "resumed from step 6" in resumed.stdout
    c, _ = saved_state(workdir)
    assert int(c["step"]) == 8


def test_mesh_shape_resolution_and_errors():
    assert sharding.mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert sharding.mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    for bad in [(3, 1, 1), (-1, -1, 1), (0, 1, 1), (2, 2)]:
        with pytest.raises(ValueError, match="mesh_shape"):
            sharding.mesh_shape(bad, 8)


def test_logical_to_spec_falls_back_rule_by_rule_and_replicates_what_nothing_divides():
    sizes = {"data": 2, "fsdp": 1, "tensor": 4}
    to_spec = sharding.logical_to_spec
    # A vocabulary of 37,003 over 4 tensor-parallel devices: that axis is simply not split.
    assert to_spec(("vocab", "embed"), (37003, 64), sizes) == PartitionSpec(None, "fsdp")
    assert to_spec(("vocab", "embed"), (37000, 64), sizes) == PartitionSpec("tensor", "fsdp")
    # Key/value kernels: kv heads over tensor when it divides them, else the input axis.
    kv = ("kv_embed", "kv_heads", "kv")
    assert to_spec(kv, (64, 4, 16), sizes) == PartitionSpec("fsdp", "tensor", None)
    assert to_spec(kv, (64, 1, 16), sizes) == PartitionSpec(("fsdp", "tensor"), None, None)
    assert to_spec(kv, (72, 1, 16), {**sizes, "fsdp": 8}) == PartitionSpec("fsdp", None, None)
    assert to_spec(kv, (66, 2, 16), sizes) == PartitionSpec("fsdp", None, None)  # no tensor
    assert to_spec(kv, (66, 2, 16), {**sizes, "fsdp": 4}) == PartitionSpec(None, None, None)


def test_process_rows_slices_this_process():
    batch = {"x": np.arange(8).reshape(8, 1)}
    np.testing.assert_array_equal(sharding.process_rows(batch)["x"], batch["x"])
