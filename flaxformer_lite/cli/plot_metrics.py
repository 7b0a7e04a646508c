"""Training and validation loss of a ``train.py`` run against wall-clock time, as a PNG.

    python -m flaxformer_lite.cli.plot_metrics --workdir runs/m30k --output loss.png

The workdir and the output may be ``gs://`` URIs.

Reads ``metrics.jsonl``; the loss plotted is the cross-entropy per target token without label
smoothing (the log of ``*/perplexity``), so training and validation are comparable. Time is
minutes since the first record (a resumed run shows its pause as a gap).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from etils import epath

from flaxformer_lite.training.metrics import read_metrics


def loss_curves(records: Sequence[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """``{"train" | "eval": (minutes, cross-entropy)}`` from metrics records that carry a
    ``time``; records without one (written before times were logged) are skipped."""
    timed = [r for r in records if "time" in r]
    if not timed:
        raise ValueError("no record with a 'time' field: was the run logged by this version?")
    start = min(r["time"] for r in timed)
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for prefix in ("train", "eval"):
        key = f"{prefix}/perplexity"
        rows = [(r["time"], r[key]) for r in timed if key in r]
        curves[prefix] = (
            [(t - start) / 60.0 for t, _ in rows],
            [math.log(p) for _, p in rows],
        )
    return curves


def plot_loss(records: Sequence[dict], output: str, title: str = "") -> None:
    """Writes the figure of :func:`loss_curves` to ``output`` (local or ``gs://``; the format
    follows the extension, PNG by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = loss_curves(records)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for prefix, label, style in (("train", "training", "-"), ("eval", "validation", "o-")):
        minutes, loss = curves[prefix]
        if minutes:
            ax.plot(minutes, loss, style, label=label, markersize=3)
    ax.set_xlabel("wall time (minutes)")
    ax.set_ylabel("cross-entropy per target token (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with epath.Path(output).open("wb") as f:
        fig.savefig(f, format=epath.Path(output).suffix.lstrip(".") or None)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.cli.plot_metrics", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workdir", required=True, help="train.py workdir (reads metrics.jsonl)")
    parser.add_argument("--output", required=True, help="PNG path")
    parser.add_argument("--title", default="", help="plot title")
    args = parser.parse_args(argv)
    try:
        plot_loss(read_metrics(args.workdir), args.output, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
