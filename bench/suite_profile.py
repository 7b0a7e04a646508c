"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time, its
process's CPU time, the CPU time of the subprocesses it waited for, and the seconds JAX spent
tracing (jaxpr), lowering (MLIR) and compiling (XLA) in the test's own process; then a summary
by module.

    rm -rf /tmp/suite_profile && PYTHONPATH=bench SUITE_PROFILE=/tmp/suite_profile \\
        JAX_COMPILATION_CACHE_DIR=$(mktemp -d) .venv/bin/python -m pytest tests -q -n 2 \\
        -p suite_profile
    .venv/bin/python bench/suite_profile.py /tmp/suite_profile      # the table, slowest first

A fresh compilation cache makes it a cold run, as CI's. JAX reports its phases through
``jax.monitoring`` event durations (the ``/jax/core/compile/...`` events); each xdist worker
appends one JSON line per test to ``SUITE_PROFILE/<worker>.jsonl``. Subprocesses (train.py runs,
the 2-process tests) count as ``child`` CPU only: their phases are not split.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

PHASES = {
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile": "/jax/core/compile/backend_compile_duration",
}

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **_) -> None:
    _seconds[event] += duration
    _counts[event] += 1


def pytest_configure(config) -> None:
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_listen)


def _cpu(times: os.times_result) -> tuple[float, float]:
    return times.user + times.system, times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    """Wraps setup, call and teardown of one test (module fixtures count in their first test)."""
    _seconds.clear()
    _counts.clear()
    start, (cpu, child) = time.perf_counter(), _cpu(os.times())
    yield
    wall, (cpu_end, child_end) = time.perf_counter() - start, _cpu(os.times())
    row = {
        "test": item.nodeid,
        "wall": wall,
        "cpu": cpu_end - cpu,
        "child": child_end - child,
        **{name: _seconds[event] for name, event in PHASES.items()},
        "compiles": _counts[PHASES["compile"]],
    }
    folder = Path(os.environ.get("SUITE_PROFILE", "suite_profile"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def summarize(folder: str, top: int) -> str:
    rows = [json.loads(line) for f in Path(folder).glob("*.jsonl") for line in open(f)]
    if not rows:
        raise SystemExit(f"error: no profile rows in {folder}/*.jsonl")
    fields = ("wall", "cpu", "child", "trace", "lower", "compile", "compiles")
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    for row in rows:
        counted = {k: row[k] for k in fields} | {"tests": 1}
        modules[row["test"].split("::")[0]].update(counted)
        total.update(counted)
    jax_share = (total["trace"] + total["lower"] + total["compile"]) / total["cpu"]
    lines = [
        f"{len(rows)} tests; CPU s in the workers {total['cpu']:.0f} "
        f"(tracing {total['trace']:.0f}, "
        f"lowering {total['lower']:.0f}, compiling {total['compile']:.0f}: {jax_share:.0%}), in "
        f"subprocesses {total['child']:.0f}; {total['compiles']} compilations",
        "",
        "| module | tests | wall s | CPU s | subprocess CPU s | trace s | lower s | compile s "
        "| compilations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ranked = sorted(modules.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child"]))
    for name, c in ranked[:top]:
        lines.append(
            f"| {name} | {c['tests']} | {c['wall']:.1f} | {c['cpu']:.1f} | {c['child']:.1f} | "
            f"{c['trace']:.1f} | {c['lower']:.1f} | {c['compile']:.1f} | {c['compiles']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the SUITE_PROFILE folder of a profiled pytest run")
    parser.add_argument("--top", type=int, default=30, help="modules to list, costliest first")
    args = parser.parse_args()
    print(summarize(args.folder, args.top))


if __name__ == "__main__":
    main()
