"""Training speed of configs/multi30k.py with glibc's malloc on 4 KiB pages or on transparent
huge pages (what train.py's ``restart_with_huge_pages`` turns on), through train.py itself: the
ratio of target tokens per second, the CPU time in the kernel and the page faults, measured in
one run on one machine.

    .venv/bin/python bench/huge_pages.py --data ../shared/data/multi30k   # ~8 min on 2 cores

"4 KiB pages" runs train.py with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=0`` (train.py then keeps
the user's setting and does not restart); "huge pages" without it (train.py restarts itself with
``glibc.malloc.hugetlb=1``). Every (setting, round) is a fresh ``train.py`` process on a fresh
workdir (``--config.time_budget_minutes=0 --config.num_train_steps=STEPS``, no evaluation or
checkpoint until the end); the settings alternate, reversed every other round, so that machine
load hits both alike. tokens/s is the median over the log windows after the first (which holds
the compilation) of ``train/tokens_per_second``, then the median over rounds; user and system
CPU seconds and minor page faults are the whole process's (``getrusage`` of the child).

Writes bench/results/huge_pages.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from cpu_devices import tokens_per_second, train_cmd  # noqa: E402
from translate_speed import cpu_flags  # noqa: E402

SETTINGS = {"4 KiB pages": "glibc.malloc.hugetlb=0", "huge pages": None}


def run(name: str, data: str, steps: int, scratch: Path) -> dict[str, float]:
    """One train.py run: tokens/s, user and system CPU seconds, minor page faults."""
    workdir = Path(tempfile.mkdtemp(dir=scratch))
    cmd = train_cmd(data, steps, workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
    if SETTINGS[name] is not None:
        env["GLIBC_TUNABLES"] = SETTINGS[name]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    return {
        "tokens_per_second": tokens_per_second(workdir),
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "huge_pages.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for name in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
                runs[name].append(run(name, args.data, args.steps, Path(scratch)))
                got = runs[name][-1]
                print(f"round {r + 1}: {name}: {got['tokens_per_second']:.0f} tok/s, "
                      f"{got['system_s']:.0f} s system CPU", flush=True)  # fmt: skip
    median = {
        name: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    reference = median["4 KiB pages"]["tokens_per_second"]
    lines = [
        "| malloc pages | target tokens/s (median) | ratio | user CPU s | system CPU s | "
        "minor page faults |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in median.items():
        lines.append(
            f"| {name} | {m['tokens_per_second']:.0f} | "
            f"{m['tokens_per_second'] / reference:.2f}x | {m['user_s']:.0f} | "
            f"{m['system_s']:.0f} | {m['minor_faults']:,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    record = {
        "machine": cpu_flags(),
        "transparent_hugepage": Path("/sys/kernel/mm/transparent_hugepage/enabled")
        .read_text()
        .strip(),
        "command": "python bench/huge_pages.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "runs": runs,
        "median": median,
        "table": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
