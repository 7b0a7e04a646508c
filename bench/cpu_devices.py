"""Training speed of configs/multi30k.py with the host's CPU as one XLA device or split into
several (``config.cpu_devices``), through train.py itself: the ratio of each count's target
tokens per second to one device's, measured in one run on one machine.

    .venv/bin/python bench/cpu_devices.py --data ../shared/data/multi30k   # ~8 min on 2 cores

One device runs each op of the step on all cores (XLA's intra-op threads); N devices each run
their share of the batch (data parallelism over the mesh) on their own thread. Every (count,
round) is a fresh ``train.py`` process on a fresh workdir (``--config.time_budget_minutes=0
--config.num_train_steps=STEPS``, no evaluation or checkpoint until the end); the counts
alternate, reversed every other round, so that machine load hits all alike. tokens/s is the
median over the log windows after the first (which holds the compilation) of
``train/tokens_per_second`` (real target tokens), then the median over rounds.

Writes bench/results/cpu_devices.json and prints a markdown table.
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
sys.path.insert(0, str(ROOT / "bench"))
from translate_speed import cpu_flags  # noqa: E402


def tokens_per_second(workdir: Path) -> float:
    """The median ``train/tokens_per_second`` of a run's log windows after its first."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train/tokens_per_second"] for r in rows if "train/tokens_per_second" in r]
    if len(speeds) < 2:
        raise RuntimeError(f"{workdir}: fewer than 2 timed log windows; raise --steps")
    return statistics.median(speeds[1:])


def train_cmd(data: str, steps: int, workdir: Path, *extra: str) -> list[str]:
    """train.py on configs/multi30k.py for ``steps`` fixed steps, a log row every 25, no
    evaluation or checkpoint before the end (also bench/huge_pages.py's run)."""
    return [
        sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "multi30k.py"),
        f"--config.data_dir={data}", "--workdir", str(workdir),
        "--config.time_budget_minutes=0", f"--config.num_train_steps={steps}",
        "--config.eval_every=0", f"--config.checkpoint_every={steps}", "--config.log_every=25",
        *extra,
    ]  # fmt: skip


def run(count: int, data: str, steps: int, scratch: Path) -> float:
    workdir = Path(tempfile.mkdtemp(prefix=f"devices{count}_", dir=scratch))
    cmd = train_cmd(data, steps, workdir, f"--config.cpu_devices={count}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(cmd, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"cpu_devices={count}: {done.stderr.strip().splitlines()[-1]}")
    mesh = f"mesh {{'data': {count}, 'fsdp': 1, 'tensor': 1}}"
    if mesh not in done.stdout:
        raise RuntimeError(f"cpu_devices={count}: the run did not report {mesh}")
    return tokens_per_second(workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_devices.json"))
    args = parser.parse_args()
    if 1 not in args.counts:
        parser.error("--counts must include 1 (the reference)")
    speeds: dict[int, list[float]] = {c: [] for c in args.counts}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for count in args.counts if r % 2 == 0 else reversed(args.counts):
                speeds[count].append(run(count, args.data, args.steps, Path(scratch)))
                print(f"round {r + 1}: cpu_devices={count}: {speeds[count][-1]:.0f} tok/s")
    median = {c: statistics.median(v) for c, v in speeds.items()}
    lines = [
        "| config.cpu_devices | target tokens/s (median) | ratio to 1 device | rounds |",
        "|---:|---:|---:|---|",
    ]
    for c in args.counts:
        rounds = ", ".join(f"{s:.0f}" for s in speeds[c])
        lines.append(f"| {c} | {median[c]:.0f} | {median[c] / median[1]:.2f}x | {rounds} |")
    table = "\n".join(lines)
    print(table)
    record = {
        "machine": cpu_flags(),
        "command": "python bench/cpu_devices.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "tokens_per_second": {str(c): v for c, v in speeds.items()},
        "median": {str(c): v for c, v in median.items()},
        "table": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
