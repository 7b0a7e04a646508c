"""Metrics to ``metrics.jsonl`` (one JSON object per line) and TensorBoard event files."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
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
    blocks for minutes when the store is gone).
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
                self._tb_staging = logdir = tempfile.mkdtemp(prefix="flaxformer_tensorboard_")
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir)

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


def read_metrics(workdir: str) -> list[dict[str, float]]:
    """All lines of ``workdir/metrics.jsonl`` (local or ``gs://``)."""
    path = paths.resolve(workdir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {workdir}")
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
