"""metrics.jsonl across a crash: a run SIGKILLed after a checkpoint and some further rows, then
resumed, holds one row per step and kind, equal to an uninterrupted run's; the rows of the lost
branch are kept aside in a file of their own (``MetricWriter.set_aside_rows_after``)."""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.training.metrics import MetricWriter, read_metrics, split_rows_after

from helpers.runs import train_cmd

# Constant after warmup: the compiled step does not depend on num_train_steps, so the killed run
# (endless), the resumed one and the reference (both to TARGET) share one compiled program.
FLAGS = dict(
    schedule="constant",
    checkpoint_every=10,
    log_every=5,
    eval_every=10,
    decode_eval=False,
    keep_checkpoints=50,  # every checkpoint of the killed run stays, to compare byte for byte
)
# Fields that measure the machine, not the run: the only ones allowed to differ.
CLOCK_FIELDS = {"time", "train/tokens_per_second", "train/mfu"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _kind(row: dict) -> str:
    """ "train" or "eval": the prefix of a row's metric names (each row holds one kind)."""
    (kind,) = {k.split("/")[0] for k in row if k not in ("step", "time")}
    return kind


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def kill_with_rows_past_a_checkpoint(workdir: Path, proc: subprocess.Popen) -> tuple[int, bytes]:
    """SIGKILLs ``proc`` at a moment when ``workdir`` holds a complete checkpoint and two or
    more metrics rows of later steps; returns (that checkpoint's step, metrics.jsonl then).

    The process is frozen (SIGSTOP) while both are read, so the checkpoint cannot complete and
    no row can be added between the look and the kill; if the moment is not right it goes on.
    """
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
        if finished_steps(workdir / "checkpoints") and metrics.exists():
            proc.send_signal(signal.SIGSTOP)
            saved = finished_steps(workdir / "checkpoints")
            text = metrics.read_bytes()
            complete = text[: text.rfind(b"\n") + 1]
            if sum(json.loads(line)["step"] > saved[-1] for line in complete.splitlines()) > 1:
                proc.send_signal(signal.SIGKILL)
                return saved[-1], text
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no metrics row past a checkpoint in time")


@pytest.fixture(scope="module")
def crash_and_resume(tmp_path_factory):
    """A run SIGKILLed with rows past its latest checkpoint, its resume to ``target`` steps,
    and an uninterrupted run to ``target`` (run beside the resume: both load the killed run's
    compiled step from the persistent compilation cache)."""
    root = tmp_path_factory.mktemp("crash")
    workdir, reference = root / "run", root / "reference"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    popen = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = subprocess.Popen(train_cmd(workdir, 100000, **FLAGS), **popen)
    restored, at_kill = kill_with_rows_past_a_checkpoint(workdir, killed)
    killed.communicate(timeout=60)
    saved = finished_steps(workdir / "checkpoints")
    checkpoints = {s: _tree_hashes(workdir / "checkpoints" / str(s)) for s in saved}
    # Past the killed run's last row: the resumed run writes every orphaned step again.
    target = max(json.loads(line)["step"] for line in at_kill.splitlines()) + 5
    log = open(root / "reference.log", "w")
    uninterrupted = subprocess.Popen(
        train_cmd(reference, target, **FLAGS), env=env, stdout=log, stderr=subprocess.STDOUT
    )
    resumed = subprocess.run(
        train_cmd(workdir, target, **FLAGS), capture_output=True, text=True, env=env, timeout=300
    )
    assert uninterrupted.wait(timeout=300) == 0, (root / "reference.log").read_text()
    log.close()
    return dict(
        workdir=workdir,
        reference=reference,
        killed=killed,
        restored=restored,
        at_kill=at_kill,
        checkpoints=checkpoints,
        resumed=resumed,
        target=target,
    )


def test_a_killed_run_resumed_keeps_one_metrics_row_per_step_and_the_lost_rows_aside(
    crash_and_resume,
):
    c = crash_and_resume
    workdir, restored, resumed = c["workdir"], c["restored"], c["resumed"]
    assert c["killed"].returncode == -signal.SIGKILL
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from step {restored} " in resumed.stdout

    # The lost branch's rows (complete lines past the restored step, as the kill left them) are
    # in one file beside metrics.jsonl, byte for byte, and the one line says where and why.
    complete = [line for line in c["at_kill"].splitlines(keepends=True) if line.endswith(b"\n")]
    lost = [line for line in complete if json.loads(line)["step"] > restored]
    (aside,) = workdir.glob("metrics.orphaned-*.jsonl")
    cut = c["at_kill"][len(b"".join(complete)) :]  # a line the kill cut short, if any
    assert aside.read_bytes() == b"".join(lost) + (cut + b"\n" if cut else b"")
    steps = [json.loads(line)["step"] for line in lost]
    line = (
        f"metrics: moved {len(lost)} lines of steps {min(steps)}-{max(steps)} from "
        f"{workdir}/metrics.jsonl to {aside}: the run that wrote them stopped before a "
        f"checkpoint past step {restored}, and this run writes them again from step {restored}"
    )
    assert [x for x in resumed.stdout.splitlines() if x.startswith("metrics:")] == [line]

    # One row per step and kind, each equal to the uninterrupted run's in every field but the
    # clock's (losses bitwise: JSON keeps a float's every bit), in the same order.
    rows, expected = _lines(workdir / "metrics.jsonl"), _lines(c["reference"] / "metrics.jsonl")
    keys = [(r["step"], _kind(r)) for r in rows]
    assert len(keys) == len(set(keys))
    assert keys == [(r["step"], _kind(r)) for r in expected]
    assert ("eval", "train") == tuple(sorted({k for _, k in keys}))
    assert max(steps) < c["target"] and keys[-1][0] == c["target"]
    for row, want in zip(rows, expected, strict=True):
        assert row.keys() == want.keys()
        assert {k: v for k, v in row.items() if k not in CLOCK_FIELDS} == {
            k: v for k, v in want.items() if k not in CLOCK_FIELDS
        }
    # The rows up to the restored step are the killed run's, untouched (their own times).
    kept = [json.loads(x) for x in complete if json.loads(x)["step"] <= restored]
    assert rows[: len(kept)] == kept
    assert read_metrics(str(workdir)) == rows

    # The killed run's checkpoints are byte for byte what they were at the kill.
    for step, hashes in c["checkpoints"].items():
        assert _tree_hashes(workdir / "checkpoints" / str(step)) == hashes, step


def test_a_rerun_of_a_finished_run_writes_no_second_row(crash_and_resume, tmp_path):
    """The uninterrupted run, run again to the same step: nothing to train, the same final
    line (evaluated again), and metrics.jsonl byte for byte as the finished run left it."""
    workdir = tmp_path / "again"
    shutil.copytree(crash_and_resume["reference"], workdir)
    before = (workdir / "metrics.jsonl").read_bytes()
    again = subprocess.run(
        train_cmd(workdir, crash_and_resume["target"], **FLAGS),
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    finals = [x for x in again.stdout.splitlines() if x.startswith("final: ")]
    log = (crash_and_resume["reference"].parent / "reference.log").read_text()
    assert finals == [x for x in log.splitlines() if x.startswith("final: ")]
    assert (workdir / "metrics.jsonl").read_bytes() == before


# ----------------------------------------------------------------------------- the pieces


def _row(step: int, **values) -> bytes:
    return json.dumps({"step": step, "time": 1.5, **values}).encode() + b"\n"


def test_split_rows_after_keeps_steps_up_to_the_restored_one_and_every_byte():
    a, b, c, d = _row(5, x=1.0), _row(10, x=2.0), _row(10, y=3.0), _row(15, x=4.0)
    cut = b'{"step": 20, "ti'  # a crash mid-write: no newline
    kept, orphaned = split_rows_after(a + b + c + d + b"not json\n" + cut, 10)
    assert kept == a + b + c
    assert orphaned == d + b"not json\n" + cut + b"\n"
    assert split_rows_after(a + b, 10) == (a + b, b"")
    assert split_rows_after(b"", 0) == (b"", b"")
    assert split_rows_after(a + b, 0) == (b"", a + b)  # a fresh start keeps nothing


def test_a_fresh_start_sets_aside_the_rows_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(_row(5, x=1.0) + _row(10, x=2.0))
    writer = MetricWriter(str(tmp_path))
    at = calendar.timegm((2025, 3, 4, 5, 6, 7))
    line = writer.set_aside_rows_after(0, now=lambda: at)
    aside = tmp_path / "metrics.orphaned-20250304T050607Z.jsonl"
    assert line == (
        f"metrics: moved 2 lines of steps 5-10 from {tmp_path}/metrics.jsonl to {aside}: the "
        "run that wrote them stopped before its first checkpoint, and this run starts again "
        "from step 0"
    )
    assert aside.read_bytes() == _row(5, x=1.0) + _row(10, x=2.0)
    writer.write(1, {"train/x": 7.0})
    writer.close()
    assert [(r["step"], r["train/x"]) for r in read_metrics(str(tmp_path))] == [(1, 7.0)]
    # A second set-aside in the same second gets its own file; nothing to move: no line.
    (tmp_path / "metrics.jsonl").write_bytes(_row(3, x=1.0))
    again = MetricWriter(str(tmp_path))
    second = tmp_path / "metrics.orphaned-20250304T050607Z-2.jsonl"
    assert again.set_aside_rows_after(0, now=lambda: at).startswith(
        f"metrics: moved 1 line of step 3 from {tmp_path}/metrics.jsonl to {second}: "
    )
    assert second.read_bytes() == _row(3, x=1.0) and aside.read_bytes() == _row(5, x=1.0) + _row(
        10, x=2.0
    )
    assert again.set_aside_rows_after(0) is None
    again.close()
    assert MetricWriter(str(tmp_path), active=False).set_aside_rows_after(0) is None
