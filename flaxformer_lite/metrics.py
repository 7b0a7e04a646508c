"""Metrics to ``metrics.jsonl`` (one JSON object per line) and TensorBoard event files."""

from __future__ import annotations

import json
import time
from typing import Any

from flaxformer_lite import paths


class MetricWriter:
    """Appends ``{"step": s, "time": t, name: value, ...}`` lines; mirrors scalars to
    TensorBoard. ``time`` is the Unix time of the write (wall-clock curves, e.g.
    :mod:`flaxformer_lite.plot_metrics`). Only process 0 of a multi-host run writes
    (``active=False`` elsewhere).

    ``workdir`` may be a ``gs://`` URI. An object store has no append, so there the file is
    kept in memory (what a resumed run finds, plus each new line) and uploaded whole after
    every line: the object always holds complete lines. TensorBoard events go to
    ``workdir/tensorboard`` through tensorboardX, which writes ``gs://`` itself.
    """

    def __init__(self, workdir: str, *, active: bool = True) -> None:
        self.active = active
        self.path = paths.resolve(workdir) / "metrics.jsonl"
        self._remote = paths.is_uri(self.path)
        self._text: str | None = None  # the whole file, for a store without append
        self._tb = None
        if active:
            paths.makedirs(self.path.parent)
            if self._remote:
                self._text = self.path.read_text() if self.path.exists() else ""
                if self._text and not self._text.endswith("\n"):
                    self._text += "\n"
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))

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

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, float]]:
    """All lines of ``workdir/metrics.jsonl`` (local or ``gs://``)."""
    path = paths.resolve(workdir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {workdir}")
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
