"""plot_metrics: loss against wall time from metrics.jsonl, and its command line."""

import json
import math

import pytest

from flaxformer_lite.cli import plot_metrics


def _write_metrics(workdir, records):
    workdir.mkdir(exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


RECORDS = [
    {"step": 0, "train/perplexity": 999.0},  # logged before times were recorded: skipped
    {"step": 50, "time": 1000.0, "train/perplexity": math.e**3},
    {"step": 100, "time": 1090.0, "train/perplexity": math.e**2, "eval/perplexity": math.e**2.5},
    {"step": 150, "time": 1180.0, "train/perplexity": math.e**1.5},
]


def test_loss_curves_are_log_perplexity_against_minutes_since_the_first_timed_record():
    curves = plot_metrics.loss_curves(RECORDS)
    minutes, loss = curves["train"]
    assert minutes == pytest.approx([0.0, 1.5, 3.0])
    assert loss == pytest.approx([3.0, 2.0, 1.5])
    assert curves["eval"][0] == pytest.approx([1.5])
    assert curves["eval"][1] == pytest.approx([2.5])


def test_loss_curves_without_times_is_an_error():
    with pytest.raises(ValueError, match="no record with a 'time' field"):
        plot_metrics.loss_curves([{"step": 1, "train/perplexity": 3.0}])


def test_cli_writes_a_png_and_reports_a_missing_workdir(tmp_path, capsys):
    _write_metrics(tmp_path / "run", RECORDS)
    out = tmp_path / "loss.png"
    assert plot_metrics.main(["--workdir", str(tmp_path / "run"), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    missing = str(tmp_path / "nowhere")
    assert plot_metrics.main(["--workdir", missing, "--output", str(out)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
