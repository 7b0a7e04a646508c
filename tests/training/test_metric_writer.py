"""MetricWriter's TensorBoard side in a fresh Python: the events hold every scalar, and
tensorboardX is imported without PyTorch (which its writer module would otherwise load, a
second at every run's start), while a later ``import torch`` still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.runs import ROOT
from helpers.tensorboard import tensorboard_scalars

SCRIPT = """
import importlib.util, json, sys
from flaxformer_lite.training.metrics import MetricWriter
writer = MetricWriter(sys.argv[1])
for step in (1, 2):
    writer.write(step, {"train/loss": 1.0 / step, "train/accuracy": 0.5})
writer.close()
loaded = "torch" in sys.modules
installed = importlib.util.find_spec("torch") is not None
if installed:
    import torch  # the name is free again
    torch.zeros(1)
print(json.dumps({"loaded": loaded, "installed": installed}))
"""


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loaded"] is False, result
    assert tensorboard_scalars(str(tmp_path / "tensorboard")) == {
        (tag, step) for tag in ("train/loss", "train/accuracy") for step in (1, 2)
    }
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
