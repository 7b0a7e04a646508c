"""Ctrl-C (training/preemption.py): the first SIGINT saves the next step boundary and exits as a
preempted run does, with one line and no traceback; a second aborts at once."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess

import jax
import numpy as np

from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.training.metrics import read_metrics
from flaxformer_lite.training.preemption import Preemption

from helpers.runs import saved_state, train_cmd, wait_for_checkpoint

NOTICE = re.compile(r"^Ctrl-C: saving step (\d+); rerun to resume \(Ctrl-C again to abort\)$", re.M)


def test_the_first_sigint_asks_to_save_and_the_second_aborts():
    """Real SIGINTs to this process, one process (no jax.distributed): a flag, then
    KeyboardInterrupt; close() gives the handlers back."""
    original = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: None)  # a SIGINT Preemption misses: not pytest's
    try:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        preemption = Preemption()
        aborted = False
        try:
            assert not preemption.reached(1)
            os.kill(os.getpid(), signal.SIGINT)
            assert preemption.reached(2)
            assert preemption.notice(2) == (
                "Ctrl-C: saving step 2; rerun to resume (Ctrl-C again to abort)"
            )
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python runs the handler at its next bytecode boundary
                    pass
            except KeyboardInterrupt:
                aborted = True
        finally:
            preemption.close()
        assert aborted
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        preemption = Preemption()
        try:  # SIGTERM's line is unchanged
            os.kill(os.getpid(), signal.SIGTERM)
            assert preemption.reached(1)
            assert preemption.notice(3) == "SIGTERM: saving step 3; rerun to resume"
        finally:
            preemption.close()
    finally:
        signal.signal(signal.SIGINT, original)


def test_ctrl_c_saves_the_step_it_names_and_the_rerun_ends_bitwise_as_an_uninterrupted_run(
    tmp_path,
):
    workdir, reference = tmp_path / "run", tmp_path / "reference"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Constant after warmup: its compiled step does not depend on num_train_steps, so the
    # rerun and the reference load the first run's program from the compilation cache.
    config = dict(schedule="constant", keep_checkpoints=1000)
    proc = subprocess.Popen(
        train_cmd(workdir, 100000, **config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    wait_for_checkpoint(workdir, proc)
    kept = finished_steps(workdir / "checkpoints")
    hashes = {
        p: hashlib.sha256(p.read_bytes()).hexdigest()
        for step in kept
        for p in sorted((workdir / "checkpoints" / str(step)).rglob("*"))
        if p.is_file()
    }
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # Saved, so a clean exit as SIGTERM's; one line, no traceback.
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    printed = [int(s) for s in NOTICE.findall(out)]
    assert len(printed) == 1, out[-3000:]
    (n,) = printed
    assert "final:" not in out
    assert finished_steps(workdir / "checkpoints")[-1] == n > kept[-1]
    state, data = saved_state(workdir)
    assert int(state["step"]) == n and data["train"] == {"index": n}
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in hashes} == hashes

    # The rerun and an uninterrupted run of as many steps, side by side.
    target = n + 7
    with open(tmp_path / "reference.log", "w") as log:
        straight = subprocess.Popen(
            train_cmd(reference, target, **config), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        done = subprocess.run(
            train_cmd(workdir, target, **config),
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert straight.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from step {n} " in done.stdout
    (a, data_a), (b, data_b) = saved_state(reference), saved_state(workdir)
    assert int(b["step"]) == target and data_a == data_b == {"train": {"index": target}}
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # One train row per logged step: every 5, and the stopped run's last (partial) window.
    logged = [m["step"] for m in read_metrics(str(workdir)) if "train/smoothed_kl" in m]
    assert logged == sorted({s for s in range(5, target + 1, 5)} | {n, target})
