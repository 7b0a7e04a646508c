"""Mixture of experts against the dense model of the same active parameters, on the default task.

Two ``train.py`` runs of the embedded default (configs/default.py: the synthetic "reverse"
task, d_model 128, 2+2 layers), identical but for the feed-forward blocks:

* ``moe``: 4 experts of d_ff 512 in every layer, each token routed to 2 (capacity factor 1.25,
  load-balancing loss weight 0.01, router z-loss 0.001): 4x the feed-forward parameters, 2x
  the feed-forward compute per token;
* ``dense``: d_ff 1024, the same active feed-forward parameters and matmul FLOPs per token as
  the mixture (minus its small router).

Each run trains ``--steps`` steps; the table gives the training tokens per second (train.py's
``train/tokens_per_second``, the mean over the run's log windows, compilation excluded), the
last training loss (``train/smoothed_kl``), the held-out loss and exact match at the end, and
the mixture's last load-balancing loss and dropped fraction. The runs alternate ``--rounds``
times so machine load affects both alike.

    .venv/bin/python bench/moe.py --steps 300   # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODELS = {
    "moe": [
        "--config.model.d_ff=512",
        "--config.model.num_experts=4",
        "--config.model.num_experts_per_token=2",
        "--config.model.expert_capacity_factor=1.25",
    ],
    "dense": ["--config.model.d_ff=1024"],
}


def run(name: str, steps: int, workdir: Path) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs/default.py"),
        "--workdir",
        str(workdir),
        f"--config.num_train_steps={steps}",
        f"--config.eval_every={steps}",
        f"--config.checkpoint_every={steps}",
        f"--config.log_every={max(steps // 10, 1)}",
        *MODELS[name],
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "train/tokens_per_second" in m]
    evals = [m for m in lines if "eval/smoothed_kl" in m]
    params = next(
        int(w.replace(",", ""))
        for line in done.stdout.splitlines()
        if "parameters" in line
        for w, nxt in zip(line.split(), line.split()[1:], strict=False)
        if nxt.startswith("parameters")
    )
    return {
        "parameters": params,
        "tokens_per_second": statistics.mean(m["train/tokens_per_second"] for m in train),
        "train_loss": train[-1]["train/smoothed_kl"],
        "eval_loss": evals[-1]["eval/smoothed_kl"],
        "exact_match": evals[-1].get("eval/exact_match"),
        "moe_aux_loss": train[-1].get("train/moe_aux_loss"),
        "moe_dropped": train[-1].get("train/moe_dropped"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(MODELS) if r % 2 == 0 else list(MODELS)[::-1]
            for name in order:
                results[name].append(run(name, args.steps, Path(tmp) / f"{name}{r}"))
                print(name, json.dumps(results[name][-1]), flush=True)
    rows = [
        "| model | parameters | tokens/s | train loss | eval loss | exact match | aux | dropped |"
    ]
    rows.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        last = runs[-1]
        speed = statistics.median(x["tokens_per_second"] for x in runs)
        aux = "-" if last["moe_aux_loss"] is None else f"{last['moe_aux_loss']:.3f}"
        dropped = "-" if last["moe_dropped"] is None else f"{last['moe_dropped']:.1%}"
        rows.append(
            f"| {name} | {last['parameters']:,} | {speed:,.0f} | {last['train_loss']:.3f} | "
            f"{last['eval_loss']:.3f} | {last['exact_match']:.1%} | {aux} | {dropped} |"
        )
    table = "\n".join(rows)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"steps": args.steps, "runs": results, "table": table}, indent=2)
    )


if __name__ == "__main__":
    main()
