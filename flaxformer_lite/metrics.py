"""Metrics to ``metrics.jsonl`` (one JSON object per line) and TensorBoard event files."""

from __future__ import annotations

import json
import os
import time
from typing import Any


class MetricWriter:
    """Appends ``{"step": s, "time": t, name: value, ...}`` lines; mirrors scalars to
    TensorBoard. ``time`` is the Unix time of the write (wall-clock curves, e.g.
    :mod:`flaxformer_lite.plot_metrics`). Only process 0 of a multi-host run writes
    (``active=False`` elsewhere).
    """

    def __init__(self, workdir: str, *, active: bool = True) -> None:
        self.active = active
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if active:
            os.makedirs(workdir, exist_ok=True)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        values = {k: float(v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "time": time.time(), **values}) + "\n")
        for k, v in values.items():
            self._tb.add_scalar(k, v, int(step))
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, float]]:
    """All lines of ``workdir/metrics.jsonl``."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
