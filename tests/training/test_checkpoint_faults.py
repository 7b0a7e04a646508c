"""A full disk during a save and a damaged newest checkpoint, each met for real by train.py in a
subprocess: a tmpfs too small for a third checkpoint (a real ENOSPC from tensorstore), and a
truncated data file. Each run ends with its one line, leaves the earlier checkpoints byte for
byte as they were, and a rerun ends bitwise equal to an uninterrupted run of the same total."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.training.metrics import read_metrics

from helpers.runs import assert_one_row_per_step_and_kind, digests, saved_state, train_cmd
from helpers.small_disk import room_for, small_tmpfs

TOTAL = 12  # every scenario ends here, bitwise equal to one uninterrupted run
# Constant after warmup: the compiled step does not depend on num_train_steps, so runs of
# different lengths share one program (and the compilation cache). log_every above every run's
# length: train rows only at a run's end, none on a lost branch. A wide feed-forward block makes
# a checkpoint about 6 MB, of which OCDBT's save-to-save differences (up to about 200 KB) are
# a few percent: 2.5 checkpoints' room holds two and never three (with the tiny model's 0.5 MB,
# a loaded CI machine once failed the second save of a tmpfs sized for two).
FLAGS = {
    "schedule": "constant",
    "log_every": 100,
    "eval_every": 0,
    "decode_eval": False,
    "model.d_ff": 4096,
}
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def run(workdir: Path, steps: int, **config) -> subprocess.CompletedProcess:
    cmd = train_cmd(workdir, steps, **{**FLAGS, **config})
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


def assert_bitwise_equal(workdir: Path, reference: Path) -> None:
    a, data_a = saved_state(workdir)
    b, data_b = saved_state(reference)
    assert int(a["step"]) == int(b["step"]) == TOTAL and data_a == data_b
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of TOTAL steps."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    done = run(workdir, TOTAL, checkpoint_every=4)
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


@pytest.fixture
def small_disk(tmp_path, reference):
    """``tmp_path/run/checkpoints`` on a tmpfs with room for two of the reference run's
    checkpoints, not three: (the mount, ``grow()``)."""
    mount = tmp_path / "run" / "checkpoints"
    with small_tmpfs(mount, room_for(reference / "checkpoints" / "4", 2.5)) as grow:
        yield mount, grow


def test_full_disk_stops_the_run_with_one_line_and_the_rerun_resumes_bitwise(small_disk, reference):
    mount, grow = small_disk
    workdir = mount.parent
    # Saves every 3 steps: 3 and 6 fit, 9 meets ENOSPC; the run would go on to 60.
    proc = subprocess.Popen(
        train_cmd(workdir, 60, **FLAGS, checkpoint_every=3),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    before = {}
    deadline = time.time() + 300
    while len(before) < 2 and time.time() < deadline:  # hash 3 and 6 as soon as they exist
        for step in finished_steps(mount):
            if step in (3, 6) and step not in before:
                before[step] = digests(mount / str(step))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    line = err.strip().splitlines()[-1]
    stopped = re.search(r"the run stopped at step (\d+);", line)
    # Stopped at a step boundary after the failure, at the latest the next save's (12), not
    # at the end of its 60 steps.
    assert stopped and 9 < int(stopped[1]) <= 12, err[-3000:]
    expected = (
        f"error: saving checkpoint 9 in {mount} failed: No space left on device; the run "
        f"stopped at step {stopped[1]}; intact checkpoints: 3, 6; rerun to resume from step 6 "
        "(once the cause is fixed)"
    )
    assert line == expected, err[-3000:]
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-3000:]
    assert "final:" not in out
    assert max(int(n) for n in re.findall(r"(\d+)/60", err)) < 60, err[-3000:]
    assert sorted(os.listdir(mount)) == ["3", "6"]  # the partial 9.orbax-checkpoint-tmp is gone
    assert {s: digests(mount / str(s)) for s in (3, 6)} == before
    assert not (workdir / "metrics.jsonl").exists() or not [
        m for m in read_metrics(str(workdir)) if m["step"] > 6
    ]  # no row of the lost steps

    grow()
    done = run(workdir, TOTAL, checkpoint_every=3)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step 6 ({mount})" in done.stdout
    assert_bitwise_equal(workdir, reference)
    assert_one_row_per_step_and_kind(workdir)


def test_a_failed_save_stops_the_run_at_a_step_boundary_before_the_next_save(small_disk):
    """The failed save of step 600 stops the run at a step boundary before step 800, the next
    save and log step: the loop asks at every step, not only where it saves or logs (which
    would stop it at 800, having logged step 800's row). Steps take milliseconds and the
    failure shows within about 50 of them (measured: 31), so 200 leave a wide margin."""
    mount, _ = small_disk
    workdir = mount.parent
    every = dict(checkpoint_every=200, log_every=200)  # 200 and 400 fit, 600 does not
    done = subprocess.run(
        train_cmd(workdir, 2000, **{**FLAGS, **every}),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    stopped = re.search(r"the run stopped at step (\d+);", line)
    assert stopped and 600 < int(stopped[1]) < 800, line
    assert line.startswith(f"error: saving checkpoint 600 in {mount} failed: No space left")
    assert line.endswith("intact checkpoints: 200, 400; rerun to resume from step 400 (once the "
                         "cause is fixed)")  # fmt: skip
    assert [m["step"] for m in read_metrics(str(workdir))] == [200, 400, 600]
    assert sorted(os.listdir(mount)) == ["200", "400"]


def test_a_damaged_newest_checkpoint_falls_back_loudly_and_restore_step_chooses(
    tmp_path, reference
):
    workdir = tmp_path / "run"
    first = run(workdir, 8, checkpoint_every=4)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = workdir / "checkpoints"
    kept = digests(checkpoints / "4")
    data_files = sorted((checkpoints / "8" / "state").rglob("ocdbt.process_0/d/*"))
    largest = max(data_files, key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    os.truncate(largest, 1000)  # an interrupted copy: the file's first 1000 bytes

    done = run(workdir, TOTAL, checkpoint_every=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert size > 1000
    lines = [x for x in done.stderr.splitlines() if "checkpoint" in x]
    assert lines[0].startswith(f"checkpoint 8 cannot be read: {largest}: truncated ("), lines
    set_aside = workdir / "checkpoints-set-aside"
    assert lines[1] == (
        "WARNING: resuming from step 4 (the newest readable checkpoint), not from step 8: "
        f"steps 5-8 are trained again; checkpoints 8 moved to {set_aside}"
    )
    assert "Traceback" not in done.stderr
    assert "resumed from step 4 " in done.stdout
    assert (set_aside / "8" / largest.relative_to(checkpoints / "8")).stat().st_size == 1000
    assert digests(checkpoints / "4") == kept
    assert_bitwise_equal(workdir, reference)
    assert_one_row_per_step_and_kind(workdir)

    # A step that is not kept is refused before any work, naming the valid ones.
    bad = run(workdir, TOTAL, checkpoint_every=4, restore_step=7)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: config.restore_step=7: no checkpoint of that step in {checkpoints}; "
        "valid steps: 4, 8, 12"
    )
    # The user's choice: back to step 4 although 8 and 12 are readable; the same end.
    chosen = run(workdir, TOTAL, checkpoint_every=4, restore_step=4)
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert (
        "WARNING: resuming from step 4 (as config.restore_step asks), not from step 12: steps "
        f"5-12 are trained again; checkpoints 8, 12 moved to {set_aside}"
    ) in chosen.stderr.splitlines()
    assert digests(checkpoints / "4") == kept
    assert_bitwise_equal(workdir, reference)
