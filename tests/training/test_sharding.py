"""Sharded training: the same steps on 1 device, on 8 simulated devices under several meshes,
and across 2 processes, end with the same parameters; a preemption notice to one of 2 processes
saves the same step on both, and resuming ends bitwise where the uninterrupted run does."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from flaxformer_lite.core import sharding
from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.training import run_lock, time_budget
from flaxformer_lite.training.metrics import read_metrics

from helpers.runs import (
    assert_one_row_per_step_and_kind,
    digests,
    final_loss,
    free_port,
    run_train,
    saved_state,
    train_here,
)
from helpers.small_disk import room_for, small_tmpfs

ROOT = Path(__file__).resolve().parents[2]


def assert_same_params(a, b, atol=1e-5):
    la, lb = jax.tree_util.tree_leaves(a["params"]), jax.tree_util.tree_leaves(b["params"])
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=atol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny run on one device (in this process: a subprocess would only add a start)."""
    workdir = tmp_path_factory.mktemp("one_device")
    train_here(workdir)
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


def test_muon_on_eight_simulated_devices_matches_one_device(tmp_path):
    """Muon orthogonalizes kernels that the (2, 2, 2) mesh splits over fsdp and tensor: its
    Newton-Schulz products gather what they need, and the run ends where one device does."""
    muon = ("--config.optimizer=muon", "--config.weight_decay=0.1")
    train_here(tmp_path / "one", *muon)
    run_train(tmp_path / "eight", *muon, "--config.mesh_shape=(2,2,2)", devices=8)
    a, _ = saved_state(tmp_path / "one")
    b, _ = saved_state(tmp_path / "eight")
    assert int(a["step"]) == int(b["step"]) == 6
    assert final_loss(tmp_path / "eight") == pytest.approx(final_loss(tmp_path / "one"), abs=1e-5)
    # Newton-Schulz multiplies a matrix's smallest singular directions by up to 3.4445^5 (~490):
    # float32 rounding in them (another reduction order on the mesh) reaches ~1.3e-5 in a few
    # elements after 6 steps. A layout error (say, each shard orthogonalized alone) moves every
    # element by whole updates, RMS 0.2 * lr = 6e-4 per step.
    assert_same_params(a, b, atol=1e-4)


def test_cpu_devices_splits_the_host_into_a_data_parallel_mesh(reference, tmp_path, capsys):
    """--config.cpu_devices=2 and no XLA flag: train.py splits the CPU into 2 devices before
    JAX starts, the batch is data-parallel over them, and the run ends where the one-device
    run does. In this process, where JAX already runs, the setting is refused with a warning
    and changes nothing."""
    out = run_train(tmp_path, "--config.cpu_devices=2")
    assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in out.stdout
    a, _ = saved_state(reference)
    b, _ = saved_state(tmp_path)
    assert final_loss(tmp_path) == pytest.approx(final_loss(reference), abs=1e-5)
    assert_same_params(a, b)

    import ml_collections

    import train

    have = len(jax.devices("cpu"))
    train.use_cpu_devices(ml_collections.ConfigDict({"cpu_devices": have}))  # already so
    assert capsys.readouterr().err == ""
    train.use_cpu_devices(ml_collections.ConfigDict({"cpu_devices": have + 1}))
    err = capsys.readouterr().err
    assert f"config.cpu_devices={have + 1} not applied: JAX already runs with {have}" in err
    assert len(jax.devices("cpu")) == have


# The 2-process runs: 24 steps with a checkpoint every 6, all kept.
TWO_PROCESS_STEPS = 24
TWO_PROCESS = [
    f"--config.num_train_steps={TWO_PROCESS_STEPS}",
    "--config.checkpoint_every=6",
    "--config.keep_checkpoints=10",
]


def start_two_processes(
    workdir: Path, *extra: str, prefixes: dict[int, list[str]] | None = None
) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a 2-process run; ``prefixes``: a command to run process i in."""
    address = f"127.0.0.1:{free_port()}"
    flags = (f"--coordinator_address={address}", "--num_processes=2", *TWO_PROCESS, *extra)
    prefixes = prefixes or {}
    return [
        run_train(workdir, *flags, f"--process_id={i}", wait=False, prefix=prefixes.get(i, ()))
        for i in range(2)
    ]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output once all have exited; kills them all if that takes too long."""
    deadline = time.time() + timeout
    try:
        return [p.communicate(timeout=max(deadline - time.time(), 1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # Python's faulthandler (run_train turns it on) prints every stack
            p.send_signal(signal.SIGABRT)
        time.sleep(3)
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        raise AssertionError(
            f"processes still running after {timeout} s:\n" + "\n".join(o[-6000:] for o in outs)
        ) from None


def run_two_processes(workdir: Path, *extra: str, timeout: float = 600) -> list[str]:
    procs = start_two_processes(workdir, *extra)
    outs = finish(procs, timeout)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def assert_bitwise_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The uninterrupted 2-process run (and process 0's output); tests must not write to it."""
    workdir = tmp_path_factory.mktemp("two_processes")
    outs = run_two_processes(workdir)
    return workdir, outs[0]


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(
    reference, two_processes, tmp_path, capsys
):
    source, out = two_processes
    assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in out
    a, _ = saved_state(reference)
    b, data = saved_state(source, step=6)
    assert int(b["step"]) == 6 and data["train"] == {"index": 6}
    assert_same_params(a, b)
    # The 2-process checkpoint restores in a 1-process run, which carries on from it.
    workdir = tmp_path / "copy"
    shutil.copytree(source, workdir)
    end = TWO_PROCESS_STEPS + 2
    capsys.readouterr()
    train_here(workdir, *TWO_PROCESS, f"--config.num_train_steps={end}")  # one process: this
    assert f"resumed from step {TWO_PROCESS_STEPS}" in capsys.readouterr().out
    c, _ = saved_state(workdir)
    assert int(c["step"]) == end


def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(two_processes, tmp_path):
    """SIGTERM to process 1 only: the runtime's preemption sync point makes both processes save
    the same step and exit 0; the two resumed processes end bitwise equal to the
    uninterrupted run."""
    workdir = tmp_path / "preempted"
    only_preemption_saves = "--config.checkpoint_every=100"  # the same math, no periodic saves
    procs = start_two_processes(workdir, only_preemption_saves)
    try:
        # Mid-run: process 0 has logged the train metrics of steps 1-3 (log_every=3).
        metrics, deadline = workdir / "metrics.jsonl", time.time() + 500
        while not (metrics.exists() and metrics.stat().st_size):
            assert all(p.poll() is None for p in procs), "a process exited before step 3"
            assert time.time() < deadline, "no train metrics in time"
            time.sleep(0.05)
        # Freeze process 0 (process 1 then waits in the step's collectives) while process 1
        # takes the notice: the runtime polls its SIGTERM flag once a second, so on a fast
        # machine the remaining steps could otherwise end before anyone noticed.
        os.kill(procs[0].pid, signal.SIGSTOP)
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(2.5)
        os.kill(procs[0].pid, signal.SIGCONT)
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    outs = finish(procs, timeout=300)
    steps = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]  # a preempted run with its checkpoint: clean exit
        saving = re.findall(r"SIGTERM: saving step (\d+)", out)
        assert len(saving) == 1, out[-3000:]
        steps.append(int(saving[0]))
        assert "final:" not in out
    stopped = steps[0]
    assert steps[1] == stopped and 3 <= stopped < TWO_PROCESS_STEPS, steps
    print(f"both processes saved step {stopped}")
    saved = [p.name for p in (workdir / "checkpoints").iterdir()]
    assert saved == [str(stopped)], saved
    state, data = saved_state(workdir)
    assert int(state["step"]) == stopped and data["train"] == {"index": stopped}
    # Both processes resume and end where the uninterrupted run ended, bit for bit.
    outs = run_two_processes(workdir, only_preemption_saves)
    assert f"resumed from step {stopped}" in outs[0]
    a, data_a = saved_state(two_processes[0])
    b, data_b = saved_state(workdir)
    assert int(a["step"]) == int(b["step"]) == TWO_PROCESS_STEPS and data_a == data_b
    assert_bitwise_equal(a, b)


def assert_ends_as_the_uninterrupted_run(workdir: Path, two_processes) -> None:
    a, data_a = saved_state(two_processes[0])
    b, data_b = saved_state(workdir)
    assert int(a["step"]) == int(b["step"]) == TWO_PROCESS_STEPS and data_a == data_b
    assert_bitwise_equal(a, b)
    assert_one_row_per_step_and_kind(workdir)


def test_a_full_disk_stops_both_processes_at_one_step_and_the_rerun_resumes_bitwise(
    two_processes, tmp_path
):
    """A tmpfs with room for checkpoints 6 and 12, not 18 (2.5 times the uninterrupted run's
    checkpoint 6; runs.SHARDING_FLAGS' feed-forward width makes it megabytes, so that OCDBT's
    save-to-save differences do not matter): both processes stop at the same
    sync point after the failed save (log_every=3), each with the one line naming it, exit
    status 1; 6 and 12 stay byte for byte, no partial step is left; 2 processes rerun from 12
    and end bitwise where the uninterrupted run does."""
    workdir = tmp_path / "full"
    mount = workdir / "checkpoints"
    with small_tmpfs(mount, room_for(two_processes[0] / "checkpoints" / "6", 2.5)) as grow:
        procs = start_two_processes(workdir, "--config.num_train_steps=60")  # would go to 60
        before, deadline = {}, time.time() + 300
        while len(before) < 2 and time.time() < deadline:  # hash 6 and 12 once they exist
            for step in finished_steps(mount):
                if step in (6, 12) and step not in before:
                    before[step] = digests(mount / str(step))
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        outs = finish(procs, timeout=300)
        lines = [out.strip().splitlines()[-1] for out in outs]
        stopped = [re.search(r"the run stopped at step (\d+);", line) for line in lines]
        assert all(stopped), "\n".join(out[-3000:] for out in outs)
        step = int(stopped[0][1])
        assert int(stopped[1][1]) == step and 18 < step < 60 and step % 3 == 0, lines
        intact = "intact checkpoints: 6, 12; rerun to resume from step 12 (once the cause is fixed)"
        # Both processes write to the one tmpfs: whichever finds it full names the cause; the
        # other names it too, or, if its own writes fitted, the process whose save failed.
        full = "No space left on device"
        named = [f"the save failed on process {1 - i}" for i in range(2)]
        assert any(full in line for line in lines), lines
        for line, other in zip(lines, named, strict=True):
            assert line in (
                f"error: saving checkpoint 18 in {mount} failed: {full}; the run "
                f"stopped at step {step}; {intact}",
                f"error: saving checkpoint 18 in {mount} failed: {other}; the run "
                f"stopped at step {step}; {intact}",
            ), lines
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 1, out[-3000:]
            assert "Traceback" not in out and "RESOURCE_EXHAUSTED" not in out, out[-3000:]
            assert "final:" not in out
        assert sorted(os.listdir(mount)) == ["12", "6"]  # no 18.orbax-checkpoint-tmp
        assert {s: digests(mount / str(s)) for s in (6, 12)} == before
        # Rows up to the stop (the failure is not known before it); the rerun sets them aside.
        assert max(m["step"] for m in read_metrics(str(workdir))) <= step

        grow()
        outs = run_two_processes(workdir)
        assert f"resumed from step 12 ({mount})" in outs[0]
        assert re.search(r"metrics: moved \d+ lines of steps 15-\d+ from ", outs[0]), outs[0][
            -3000:
        ]
        assert_ends_as_the_uninterrupted_run(workdir, two_processes)


def test_a_checkpoint_one_process_cannot_read_sends_both_back_to_the_same_step(
    two_processes, tmp_path
):
    """Process 1 alone sees a truncated data file in checkpoint 24 (its own mount namespace
    binds a cut copy over it, as a host with a bad local copy would; where that is not
    permitted, the file itself is cut, for both): every process checks 24 before any
    restores it, so both go back to 18, with one WARNING line, and end bitwise where the
    uninterrupted run does."""
    workdir = tmp_path / "damaged"
    shutil.copytree(two_processes[0], workdir)
    checkpoints = workdir / "checkpoints"
    data_files = sorted((checkpoints / "24" / "state").rglob("ocdbt.process_*/d/*"))
    damaged = max(data_files, key=lambda p: p.stat().st_size)
    cut = tmp_path / "cut"
    cut.write_bytes(damaged.read_bytes()[:1000])  # an interrupted copy: the first 1000 bytes
    bind = ["mount", "--bind", str(cut), str(damaged)]
    probe = subprocess.run(["unshare", "--mount", *bind], capture_output=True, text=True)
    if probe.returncode == 0:
        runs_in = ["unshare", "--mount", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && '
                   'exec "$@"', "sh", str(cut), str(damaged)]  # fmt: skip
        procs = start_two_processes(workdir, prefixes={1: runs_in})
        unreadable = f"{checkpoints}/24: unreadable on process 1 of 2"
    else:  # no mount namespace here: both processes meet the truncated file
        os.truncate(damaged, 1000)
        procs = start_two_processes(workdir)
        unreadable = f"{damaged}: truncated ("
    outs = finish(procs, timeout=300)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    lines = [x for x in outs[0].splitlines() if "checkpoint" in x]
    assert lines[0].startswith(f"checkpoint 24 cannot be read: {unreadable}"), lines
    set_aside = workdir / "checkpoints-set-aside"
    assert lines[1] == (
        "WARNING: resuming from step 18 (the newest readable checkpoint), not from step 24: "
        f"steps 19-24 are trained again; checkpoints 24 moved to {set_aside}"
    )
    assert f"resumed from step 18 ({checkpoints})" in outs[0]
    if probe.returncode == 0:  # 24 itself is intact, moved aside byte for byte
        assert digests(set_aside / "24") == digests(two_processes[0] / "checkpoints" / "24")
    else:  # the cut file moved aside with its step
        assert (set_aside / "24" / damaged.relative_to(checkpoints / "24")).stat().st_size == 1000
    assert_ends_as_the_uninterrupted_run(workdir, two_processes)


def test_two_processes_refuse_together_on_a_workdir_a_live_run_holds(tmp_path):
    """Process 0 finds the lock of a live run (this test's process) and both processes learn
    its verdict: each ends with the same one line and exit status 1, nothing written."""
    workdir = tmp_path / "held"
    workdir.mkdir()
    lock = run_lock.acquire(str(workdir))
    try:
        procs = start_two_processes(workdir)
        outs = finish(procs, timeout=300)
        assert [p.name for p in workdir.iterdir()] == ["run.lock"]
    finally:
        lock.release()
    expected = (
        f"error: workdir {workdir} is in use by another run (host {socket.gethostname()}, "
        f"pid {os.getpid()}, since {lock.holder.since}; lock {workdir}/run.lock, renewed "
    )
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 1, out[-3000:]
        assert out.strip().splitlines()[-1].startswith(expected), out[-3000:]
        assert "Traceback" not in out, out[-3000:]


def test_two_processes_on_different_clocks_follow_process_0s_time_budget(tmp_path):
    """A time budget on 2 processes: each process times itself, but the step count decided
    after the first evaluation, and a stop once the budget is spent, are process 0's. Process
    1 runs on a clock five times as fast (tick clocks, helpers/tick_clock_main.py): on its own
    it would decide a fifth of the steps and stop early, leaving process 0 in a collective."""
    workdir = tmp_path / "budget"
    clock = [sys.executable, str(ROOT / "tests" / "helpers" / "tick_clock_main.py")]
    procs = start_two_processes(
        workdir,
        "--config.time_budget_minutes=1",
        "--config.schedule=cosine",
        "--config.warmup_steps=4",
        "--config.eval_every=4",
        prefixes={0: [*clock, "2.0"], 1: [*clock, "10.0"]},
    )
    outs = finish(procs, timeout=300)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    decision = json.loads((workdir / time_budget.FILE).read_text())
    last = decision["stopped_at"] or decision["num_train_steps"]
    print(decision)
    assert decision["decided_at"] == 4 and last > 8, decision  # trained on after deciding
    assert f"time budget 1 min: {decision['num_train_steps']} steps" in outs[0]
    state, data = saved_state(workdir)
    assert int(state["step"]) == last and data["train"] == {"index": last}
    train_rows = [m["step"] for m in read_metrics(str(workdir)) if "train/smoothed_kl" in m]
    assert train_rows and train_rows[-1] == last, train_rows


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


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_process_rows_partition_the_batch_among_processes(monkeypatch, count):
    """Process p of P gets rows [p*R/P, (p+1)*R/P) of every array: together, each row exactly
    once, in order; a row count P does not divide is rejected, naming process_count."""
    batch = {"x": np.arange(16).reshape(8, 2), "y": np.arange(8)[::-1].copy()}
    monkeypatch.setattr(jax, "process_count", lambda: count)
    parts = []
    for index in range(count):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        parts.append(sharding.process_rows(batch))
    per = 8 // count
    for index, part in enumerate(parts):
        assert set(part) == {"x", "y"}
        np.testing.assert_array_equal(part["y"], batch["y"][index * per : (index + 1) * per])
    for key in batch:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), batch[key])
    if count > 1:
        with pytest.raises(ValueError, match=f"divisible by process_count \\({count}\\)"):
            sharding.process_rows({"x": np.arange(count + 1)})
