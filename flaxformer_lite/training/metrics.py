"""Metrics to ``metrics.jsonl`` (one JSON object per line) and TensorBoard event files.

A resumed run continues from its last checkpoint, so the rows a crashed run wrote after that
checkpoint belong to a branch that no longer exists: the resumed run writes those steps again.
:meth:`MetricWriter.set_aside_rows_after` moves them to a file of their own, so that
``metrics.jsonl`` holds one row per step and kind (TensorBoard drops such orphaned events by
itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from flaxformer_lite.core import paths


class MetricWriter:
    """Appends ``{"step": s, "time": t, name: value, ...}`` lines; mirrors scalars to
    TensorBoard. ``time`` is the Unix time of the write (wall-clock curves, e.g.
    :mod:`flaxformer_lite.cli.plot_metrics`). Only process 0 of a multi-host run writes
    (``active=False`` elsewhere).

    ``workdir`` may be a ``gs://`` URI. An object store has no append, so there the file is
    kept in memory (what a resumed run finds, plus each new line) and uploaded whole after
    every line: the object always holds complete lines. TensorBoard events are written to a
    local temporary folder and their files uploaded to ``workdir/tensorboard`` at every write
    (tensorboardX's own gs:// writer re-uploads from ``__del__`` at interpreter exit, which
    blocks for minutes when the store is gone). The folder is named after the workdir
    (:func:`staging_folder`): a run killed before :meth:`close` leaves it behind, and the
    run that resumes that workdir empties it and removes it when done.
    """

    def __init__(self, workdir: str, *, active: bool = True) -> None:
        self.active = active
        self.path = paths.resolve(workdir) / "metrics.jsonl"
        self._remote = paths.is_uri(self.path)
        self._text: str | None = None  # the whole file, for a store without append
        self._tb = None
        self._tb_dir = self.path.parent / "tensorboard"
        self._tb_staging: str | None = None  # local folder mirrored to _tb_dir
        if active:
            paths.makedirs(self.path.parent)
            logdir = str(self._tb_dir)
            if self._remote:
                self._text = self.path.read_text() if self.path.exists() else ""
                if self._text and not self._text.endswith("\n"):
                    self._text += "\n"
                self._tb_staging = logdir = staging_folder(str(self._tb_dir))
                shutil.rmtree(logdir, ignore_errors=True)  # a killed run's, all uploaded
                os.makedirs(logdir, mode=0o700)
            self._tb = summary_writer_class()(logdir)

    def set_aside_rows_after(
        self, step: int, *, now: Callable[[], float] = time.time
    ) -> str | None:
        """Moves the lines of ``metrics.jsonl`` past ``step`` (the step this run starts from: the
        restored checkpoint's, 0 for a fresh start) to ``metrics.orphaned-<UTC time>.jsonl``
        beside it; returns the one line that says so, or None when there is nothing to move
        (and on every process but 0).

        The file of orphans is written first and ``metrics.jsonl`` replaced after it (each
        all-or-nothing, :func:`paths.write_atomic`), so a crash in between leaves a second copy
        of the orphans, never a lost row.
        """
        if not self.active:
            return None
        data = self._text.encode("utf-8") if self._remote else _read_bytes(self.path)
        kept, orphaned = split_rows_after(data, step)
        if not orphaned:
            return None
        aside = _orphan_path(self.path, now())
        paths.write_atomic(aside, orphaned)
        paths.write_atomic(self.path, kept)
        if self._remote:
            self._text = kept.decode("utf-8")
        return orphans_line(orphaned, step, self.path, aside)

    def has_row(self, step: int, prefix: str) -> bool:
        """Whether ``metrics.jsonl`` holds a row of ``step`` with a metric named ``prefix...``
        (e.g. "eval/"); False on a process that does not write."""
        if not self.active:
            return False
        data = self._text.encode("utf-8") if self._remote else _read_bytes(self.path)
        return any(
            row["step"] == step and any(k.startswith(prefix) for k in row) for row in _rows(data)
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        values = {k: float(v) for k, v in metrics.items()}
        line = json.dumps({"step": int(step), "time": time.time(), **values}) + "\n"
        if self._remote:
            self._text += line
            self.path.write_text(self._text)
        else:
            with open(self.path, "a") as f:
                f.write(line)
        for k, v in values.items():
            self._tb.add_scalar(k, v, int(step))
        self._tb.flush()
        self._upload_events()

    def _upload_events(self) -> None:
        if self._tb_staging is None:
            return
        for name in os.listdir(self._tb_staging):
            with open(os.path.join(self._tb_staging, name), "rb") as f:
                (self._tb_dir / name).write_bytes(f.read())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._upload_events()
            self._tb = None
        if self._tb_staging is not None:
            shutil.rmtree(self._tb_staging, ignore_errors=True)
            self._tb_staging = None


def staging_folder(remote_dir: str) -> str:
    """The local folder whose TensorBoard event files are mirrored to ``remote_dir`` (a URI):
    in the temporary directory, named after a hash of the URI, the same for every run of it."""
    digest = hashlib.sha256(remote_dir.encode("utf-8")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"flaxformer_tensorboard_{digest}")


def _read_bytes(path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _row_step(line: bytes) -> int | None:
    """The ``step`` of one metrics line, or None for a line that is no complete row (cut short
    by a crash mid-write, or not JSON)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


def _rows(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.split(b"\n") if _row_step(line) is not None]


def split_rows_after(data: bytes, step: int) -> tuple[bytes, bytes]:
    """``(kept, orphaned)``: the lines of a ``metrics.jsonl`` (``data``) with ``"step" <=
    step``, and all others: rows past ``step``, and a line that is no complete row (a last
    line without its newline, cut short by a crash mid-write; a line that is not JSON). Every
    line ends with a newline in either part; each part keeps the lines' order, and the two
    together hold every byte of ``data`` (plus that newline)."""
    lines = data.split(b"\n")
    last = lines.pop()  # b"" after a final newline; else a line a crash cut short
    kept, orphaned = [], []
    for line in lines:
        row_step = _row_step(line)
        blank = not line.strip()
        keep = blank or (row_step is not None and row_step <= step)
        (kept if keep else orphaned).append(line + b"\n")
    if last:
        orphaned.append(last + b"\n")
    return b"".join(kept), b"".join(orphaned)


def orphans_line(orphaned: bytes, step: int, path, aside) -> str:
    """The one line that tells the user where :meth:`MetricWriter.set_aside_rows_after` moved
    the ``orphaned`` lines of ``path`` and why."""
    count = orphaned.count(b"\n")
    steps = [row["step"] for row in _rows(orphaned)]
    what = f"{count} line{'s' if count > 1 else ''}"
    if steps:
        what += f" of step{'s' if len(set(steps)) > 1 else ''} " + (
            f"{min(steps)}-{max(steps)}" if min(steps) < max(steps) else f"{steps[0]}"
        )
    why = (
        f"stopped before a checkpoint past step {step}, and this run writes them again from step "
        f"{step}"
        if step
        else "stopped before its first checkpoint, and this run starts again from step 0"
    )
    return f"metrics: moved {what} from {path} to {aside}: the run that wrote them {why}"


def _orphan_path(path, now: float):
    """``metrics.orphaned-<UTC time>.jsonl`` beside ``path``, a new name (``-2``, ``-3`` ...
    after the time when two runs set rows aside within the same second)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    candidate, n = path.parent / f"metrics.orphaned-{stamp}.jsonl", 1
    while candidate.exists():
        n += 1
        candidate = path.parent / f"metrics.orphaned-{stamp}-{n}.jsonl"
    return candidate


def read_metrics(workdir: str) -> list[dict[str, float]]:
    """All lines of ``workdir/metrics.jsonl`` (local or ``gs://``)."""
    path = paths.resolve(workdir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {workdir}")
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without PyTorch.

    tensorboardX's writer module tries ``import torch`` (to accept torch tensors, which this
    writer never receives): 0.9 s more at every run's start where PyTorch is installed
    (measured: 1.08 s against 0.19 s). Unless PyTorch is already loaded, its name is held as
    absent for that one import and released at once, so that a later ``import torch`` works.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter
