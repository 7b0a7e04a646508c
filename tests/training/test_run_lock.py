"""One run per workdir (training/run_lock.py on core/exclusive_files.py): a second train.py on a
live workdir, local or in a bucket, refuses before any work with one line naming the live run,
while the first finishes untouched; a lock whose holder is gone is taken over."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flaxformer_lite.core import exclusive_files
from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.training import run_lock
from flaxformer_lite.training.metrics import read_metrics

from helpers.runs import ROOT, train_cmd, wait_for_checkpoint

HOST = socket.gethostname()
REFUSAL = re.compile(
    r"^error: workdir (\S+) is in use by another run \(host (\S+), pid (\d+), since (\S+); "
    r"lock (\S+), renewed \d+ s ago\); wait for it to end, or if you know it is gone, rerun "
    r"with --break_lock$"
)


def file_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def lock_bytes(host: str, pid: int, renewed: float) -> bytes:
    """A lock file as another run would have left it (written here by hand)."""
    fields = dict(host=host, pid=pid, pid_start=None, since="2026-01-02T03:04:05+00:00",
                  renewed=renewed, token="x" * 32)  # fmt: skip
    return json.dumps(fields).encode()


def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- the storage layer


@pytest.fixture(params=["local", "gs"])
def folder(request, tmp_path) -> str:
    if request.param == "gs":
        request.getfixturevalue("gcs")
        return f"gs://bucket/{tmp_path.name}"
    return str(tmp_path)


def test_an_exclusive_file_is_created_once_and_changed_only_at_the_version_read(folder):
    path = f"{folder}/x.lock"
    assert exclusive_files.read(path) is None
    first = exclusive_files.create_new(path, b"one")
    assert first is not None
    assert exclusive_files.create_new(path, b"two") is None  # it exists: nothing written
    assert exclusive_files.read(path) == (b"one", first)
    second = exclusive_files.replace_if(path, b"three", first)
    assert second is not None and second != first
    assert exclusive_files.read(path) == (b"three", second)
    assert exclusive_files.replace_if(path, b"four", first) is None  # changed since read
    assert exclusive_files.rewrite_if(path, b"four", first) is None
    assert not exclusive_files.remove_if(path, first)
    assert exclusive_files.read(path)[0] == b"three"
    third = exclusive_files.rewrite_if(path, b"five", second)
    assert exclusive_files.read(path) == (b"five", third)
    assert exclusive_files.remove_if(path, third)
    assert exclusive_files.read(path) is None
    assert not exclusive_files.remove_if(path, third)
    with pytest.raises(ValueError, match=r"s3://x/y: exclusive files need a local path or a gs"):
        exclusive_files.create_new("s3://x/y", b"")


def test_of_racing_writers_exactly_one_creates_and_one_takes_over(tmp_path):
    path = str(tmp_path / "x.lock")
    barrier = threading.Barrier(8)
    # Each writer's bytes differ from the version read (a lock's token does that): a file whose
    # bytes equal the version is, by definition, that version.

    def race(write, *args):
        won = []

        def one(i):
            barrier.wait()
            if write(path, f"{write.__name__} {i}".encode(), *args) is not None:
                won.append(i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return won

    created = race(exclusive_files.create_new)
    assert len(created) == 1 and Path(path).read_bytes() == f"create_new {created[0]}".encode()
    (data, version) = exclusive_files.read(path)
    taken = race(exclusive_files.replace_if, version)
    assert len(taken) == 1 and Path(path).read_bytes() == f"replace_if {taken[0]}".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.lock"]  # nothing left aside


# ----------------------------------------------------------------------------- the lock's rules


def test_a_holder_is_stale_on_this_host_when_its_pid_is_gone_elsewhere_when_its_lease_is():
    holder = run_lock.Holder("here", 41, None, "2026-01-02T03:04:05+00:00", 1000.0, "t")
    stale = lambda h, now, alive: run_lock.why_stale(  # noqa: E731
        h, now=now, host="here", alive=lambda pid, start: alive, lease=300.0
    )
    assert stale(holder, 99999.0, alive=True) is None  # this host: the pid decides, not the lease
    assert stale(holder, 1000.0, alive=False) == "pid 41 no longer runs on here"
    there = run_lock.Holder("there", 41, None, "2026-01-02T03:04:05+00:00", 1000.0, "t")
    assert stale(there, 1299.0, alive=False) is None  # another host: its lease, 299 s old
    assert stale(there, 1301.0, alive=True) == (
        "host there last renewed its lease 301 s ago (lease 300 s)"
    )
    assert run_lock.pid_alive(os.getpid(), run_lock.process_start(os.getpid()))
    assert not run_lock.pid_alive(dead_pid(), None)
    if run_lock.process_start(os.getpid()) is not None:  # a reused pid is another process
        assert not run_lock.pid_alive(os.getpid(), run_lock.process_start(os.getpid()) + 1)


def test_a_lock_is_taken_over_from_a_dead_pid_or_an_expired_lease_and_refused_when_live(
    tmp_path,
):
    workdir, lines = str(tmp_path), []
    path = tmp_path / "run.lock"
    gone = dead_pid()
    path.write_bytes(lock_bytes(HOST, gone, time.time()))
    lock = run_lock.acquire(workdir, log=lines.append)
    assert lines == [
        f"run lock: took {path} over from host {HOST}, pid {gone}, since "
        f"2026-01-02T03:04:05+00:00: pid {gone} no longer runs on {HOST}"
    ]
    held = json.loads(path.read_bytes())
    assert (held["host"], held["pid"]) == (HOST, os.getpid())
    # This process is live: a second acquire is refused with the line naming it.
    with pytest.raises(run_lock.WorkdirInUse) as refused:
        run_lock.acquire(workdir)
    assert REFUSAL.match(f"error: {refused.value}").groups() == (
        workdir, HOST, str(os.getpid()), held["since"], str(path)
    )  # fmt: skip
    assert json.loads(path.read_bytes()) == held  # the refused call changed nothing
    lock.release()
    assert not path.exists()
    lock.release()  # idempotent

    # Another host: a fresh lease holds, an expired one is taken over.
    path.write_bytes(lock_bytes("elsewhere", 7, time.time() - 10))
    with pytest.raises(run_lock.WorkdirInUse, match=r"host elsewhere, pid 7, since 2026"):
        run_lock.acquire(workdir)
    path.write_bytes(lock_bytes("elsewhere", 7, time.time() - 301))
    lines.clear()
    run_lock.acquire(workdir, log=lines.append).release()
    assert re.fullmatch(r".*: host elsewhere last renewed its lease 30\d s ago \(lease 300 s\)",
                        lines[0])  # fmt: skip
    # --break_lock takes a live one; a file that is no lock is refused, naming it.
    path.write_bytes(lock_bytes(HOST, os.getpid(), time.time()))
    lines.clear()
    run_lock.acquire(workdir, break_lock=True, log=lines.append).release()
    assert lines[0].endswith(f"pid {os.getpid()}, since 2026-01-02T03:04:05+00:00: --break_lock")
    path.write_bytes(b"garbage")
    with pytest.raises(run_lock.WorkdirInUse, match=r"not a run lock \(b'garbage'\)"):
        run_lock.acquire(workdir)


def test_the_live_run_renews_its_lease(tmp_path):
    lock = run_lock.acquire(str(tmp_path), renew_seconds=0.05)
    first = json.loads((tmp_path / "run.lock").read_bytes())
    deadline = time.time() + 30
    while json.loads((tmp_path / "run.lock").read_bytes())["renewed"] == first["renewed"]:
        assert time.time() < deadline, "not renewed"
        time.sleep(0.05)
    renewed = json.loads((tmp_path / "run.lock").read_bytes())
    assert renewed["renewed"] > first["renewed"]
    assert {k: v for k, v in renewed.items() if k != "renewed"} == {
        k: v for k, v in first.items() if k != "renewed"
    }
    lock.release()
    assert not (tmp_path / "run.lock").exists()


# ----------------------------------------------------------------------------- two train.py runs


def refused_run(workdir: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A second train.py on ``workdir``, finished: it must refuse before any work (its start
    takes seconds; one that trains instead is stopped after 120 s, and the test fails)."""
    try:
        return subprocess.run(
            train_cmd(workdir, 100000, schedule="constant"),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the second run did not refuse:\n{e.stdout}") from None


def assert_refused_naming(done: subprocess.CompletedProcess, workdir: str, pid: int) -> None:
    """rc 1, one line on stderr naming ``workdir`` and the live run, nothing else said."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    match = REFUSAL.match(lines[0])
    assert match, lines[0]
    assert match[1] == workdir and match[2] == HOST and match[3] == str(pid)
    assert match[5] == f"{workdir}/run.lock"


def test_a_second_run_on_a_live_workdir_refuses_and_the_first_finishes_untouched(tmp_path):
    workdir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen(
        train_cmd(workdir, 100000, schedule="constant", keep_checkpoints=1000),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_for_checkpoint(workdir, first)
        before = file_hashes(workdir / "checkpoints")
        kept = finished_steps(workdir / "checkpoints")
        second = refused_run(str(workdir), env)
        assert first.poll() is None, "the first run ended before the second was refused"
        assert_refused_naming(second, str(workdir), first.pid)
    finally:
        first.send_signal(signal.SIGTERM)  # the first stops as a preempted run: saved, rc 0
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-3000:]
    (stopped,) = [int(s) for s in re.findall(r"SIGTERM: saving step (\d+)", out)]
    after = file_hashes(workdir / "checkpoints")
    for step in kept:  # the checkpoints saved before the second run, byte for byte
        files = {k: v for k, v in before.items() if k.startswith(f"{step}/")}
        assert files and {k: after[k] for k in files} == files
    # One train row per logged step (every 5, and the stopped step), one TensorBoard file.
    logged = [m["step"] for m in read_metrics(str(workdir)) if "train/smoothed_kl" in m]
    assert logged == sorted({s for s in range(5, stopped + 1, 5)} | {stopped})
    assert len(list((workdir / "tensorboard").iterdir())) == 1
    assert not (workdir / "run.lock").exists()  # released on the way out


def test_a_second_run_on_a_live_bucket_workdir_refuses(gcs, tmp_path):
    """The live run is this test's process holding gs://bucket/live's lock (as train.py's
    process 0 does); a train.py started on that workdir refuses, and the lock is unchanged."""
    workdir = "gs://bucket/live"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    lock = run_lock.acquire(workdir)
    try:
        held = exclusive_files.read(f"{workdir}/run.lock")
        assert_refused_naming(refused_run(workdir, env), workdir, os.getpid())
        assert exclusive_files.read(f"{workdir}/run.lock") == held
    finally:
        lock.release()
    assert exclusive_files.read(f"{workdir}/run.lock") is None
