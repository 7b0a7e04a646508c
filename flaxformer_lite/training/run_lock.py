"""One run per workdir: a lock file, ``WORKDIR/run.lock``, that a second run on the same workdir
finds and refuses on, before any work, with one line naming the live run.

The lock holds its holder: host, pid (and the process's start time, to tell a reused pid),
since when, the time of its last renewal and a unique token. It is created only where none
exists and replaced only where unchanged (``core.exclusive_files``: ``O_EXCL``-like on a local
disk, a generation precondition on ``gs://``), so of two runs starting together exactly one
wins.

A run killed without a chance to clean up (SIGKILL, a crashed host) leaves its lock behind;
the next run takes it over, saying so in one line, when the holder is gone:

  * the same host, and its pid is not running (or is running a different process);
  * another host (a shared NFS workdir, a bucket), and the lease has expired: the live run
    renews the lock every ``RENEW_SECONDS`` from a background thread, and one not renewed for
    ``LEASE_SECONDS`` is taken to be dead. Clocks of two hosts are compared, hence a lease of
    minutes.

On the same host the pid decides, not the lease: a run suspended with Ctrl-Z keeps its lock.

``train.py --break_lock`` takes the lock whoever holds it, for the user who knows the holder is
gone (a host that is down but whose lease has not yet run out). It is a flag of this one
command, not a config field: ``config.json`` must not remember it, or every later resume of
the workdir would break locks silently.

Multi-host: process 0 takes the lock and every process learns its verdict (a broadcast), so
all refuse together, each with the same line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

from flaxformer_lite.core import exclusive_files

LOCK_NAME = "run.lock"
LEASE_SECONDS = 300.0  # a lock another host has not renewed for this long is stale
RENEW_SECONDS = 60.0  # how often the live run renews it
_MESSAGE_BYTES = 2048  # room for the broadcast line of a multi-host verdict


class WorkdirInUse(RuntimeError):
    """Another live run holds the workdir's lock; the message is the one line the user sees."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a workdir: the content of its lock file."""

    host: str
    pid: int
    pid_start: int | None  # the process's start (clock ticks after boot; Linux), else None
    since: str  # when it took the lock, local time with offset (ISO 8601)
    renewed: float  # Unix time of its last renewal
    token: str  # unique per acquisition: the lock file's bytes differ between holders

    @classmethod
    def this_process(cls, now: float) -> Holder:
        since = datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds")
        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start(pid), since, now, uuid.uuid4().hex)

    def encode(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), indent=1) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> Holder | None:
        """The holder a lock file names; None if its bytes are not a lock's."""
        try:
            fields = json.loads(data)
            return cls(**fields)
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since}"


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, /proc/PID/stat field 22);
    None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3


def pid_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` of this host runs, and is the one that started at ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    now_start = process_start(pid)
    return start is None or now_start is None or now_start == start


def why_stale(
    holder: Holder,
    *,
    now: float,
    host: str,
    alive: Callable[[int, int | None], bool] = pid_alive,
    lease: float = LEASE_SECONDS,
) -> str | None:
    """Why ``holder`` no longer holds its lock (a phrase for the user), or None if it is live:
    on this host its process must run; on another its lease must be younger than ``lease``."""
    if holder.host == host:
        if alive(holder.pid, holder.pid_start):
            return None
        return f"pid {holder.pid} no longer runs on {host}"
    age = now - holder.renewed
    if age > lease:
        return f"host {holder.host} last renewed its lease {age:.0f} s ago (lease {lease:.0f} s)"
    return None


def refusal(workdir: str, path: str, holder: Holder, now: float) -> str:
    """The line a second run on ``workdir`` sees."""
    return (
        f"workdir {workdir} is in use by another run ({holder.describe()}; lock {path}, "
        f"renewed {max(now - holder.renewed, 0):.0f} s ago); wait for it to end, or if you "
        f"know it is gone, rerun with --break_lock"
    )


class RunLock:
    """A held lock: renews itself from a daemon thread until ``release``."""

    def __init__(self, path: str, holder: Holder, version, *, renew_seconds: float) -> None:
        self.path, self.holder, self._version = path, holder, version
        self._mutex = threading.Lock()  # the version: renewals and release take turns
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew_until_stopped, args=(renew_seconds,), daemon=True
        )
        self._thread.start()

    def _renew_until_stopped(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._mutex:
                if self._version is None:
                    return
                renewed = dataclasses.replace(self.holder, renewed=time.time())
                try:
                    version = exclusive_files.rewrite_if(self.path, renewed.encode(), self._version)
                except OSError as e:  # storage unreachable for a while: try again next time
                    print(f"warning: could not renew the run lock {self.path}: {e}", flush=True)
                    continue
                if version is None:
                    print(
                        f"warning: the run lock {self.path} was taken over by another run; "
                        "two runs may now write this workdir",
                        file=sys.stderr,
                        flush=True,
                    )
                self.holder, self._version = renewed, version

    def release(self) -> None:
        """Removes the lock if this run still holds it (idempotent)."""
        self._stop.set()
        self._thread.join()
        with self._mutex:
            if self._version is not None:
                exclusive_files.remove_if(self.path, self._version)
                self._version = None


def acquire(
    workdir: str,
    *,
    break_lock: bool = False,
    log: Callable[[str], None] = print,
    lease: float = LEASE_SECONDS,
    renew_seconds: float = RENEW_SECONDS,
) -> RunLock:
    """Takes ``workdir``'s run lock (the folder must exist), taking over a stale one (or any,
    with ``break_lock``) with a line through ``log``.

    Raises:
      WorkdirInUse: a live run holds it (the message names it and the override).
    """
    path = os.path.join(workdir, LOCK_NAME)
    for _ in range(5):  # a lost race reads the lock again
        now = time.time()
        me = Holder.this_process(now)
        version = exclusive_files.create_new(path, me.encode())
        if version is not None:
            return RunLock(path, me, version, renew_seconds=renew_seconds)
        found = exclusive_files.read(path)
        if found is None:  # released in between
            continue
        data, version = found
        holder = Holder.decode(data)
        if break_lock:
            reason = "--break_lock"
        elif holder is None:
            raise WorkdirInUse(
                f"workdir {workdir} has a lock file {path} that is not a run lock "
                f"({data[:60]!r}); remove it, or rerun with --break_lock"
            )
        else:
            reason = why_stale(holder, now=now, host=me.host, lease=lease)
            if reason is None:
                raise WorkdirInUse(refusal(workdir, path, holder, now))
        version = exclusive_files.replace_if(path, me.encode(), version)
        if version is not None:
            previous = holder.describe() if holder else "an unreadable lock"
            log(f"run lock: took {path} over from {previous}: {reason}")
            return RunLock(path, me, version, renew_seconds=renew_seconds)
    raise WorkdirInUse(f"workdir {workdir}: its run lock {path} keeps changing hands; retry")


def acquire_on_all_processes(workdir: str, *, break_lock: bool = False, **kwargs) -> RunLock | None:
    """``acquire`` on process 0 and its verdict on every process: process 0's lock (None on the
    others), or WorkdirInUse raised on all with process 0's line."""
    import jax

    lock, message = None, ""
    if jax.process_index() == 0:
        try:
            lock = acquire(workdir, break_lock=break_lock, **kwargs)
        except WorkdirInUse as e:
            message = str(e)
    if jax.process_count() > 1:
        message = _broadcast_from_process_0(message)
    if message:
        raise WorkdirInUse(message)
    return lock


def _broadcast_from_process_0(text: str) -> str:
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.zeros(_MESSAGE_BYTES, np.uint8)
    encoded = text.encode()[:_MESSAGE_BYTES]
    raw[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(got).rstrip(b"\0").decode(errors="replace")
