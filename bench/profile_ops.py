"""Where the time of one train step and one decoding step goes, per XLA op, from the profiler.

Each step is compiled ahead of time, run twice to warm up, then run ``--steps`` times under
``jax.profiler.trace(dir, create_perfetto_trace=True)``. On the CPU backend the Perfetto JSON
holds one complete event per executed thunk (a fusion, a dot, a copy...), named like the
instruction in the compiled HLO (``compiled.as_text()``), on XLA's worker threads. Each event
is matched to its HLO instruction, which names what it computes: opcode, output shape, the
fused computation's body (dot, reduce, scatter, gather, transpose, random bits...), the jax
op name of its metadata and the innermost source function of its stack frames. Ops are then
grouped into the parts of the step (matmuls by layer role, forward or backward; the loss; the
Adam update; dropout's random bits; layer norm; attention softmax; embedding gather and
scatter-add; layout copies and transposes).

The steps:
  train small / base   ``bench/train_step.py``'s step (built with its ``ours_setup``): forward +
                       backward + Adam, dropout 0.1, label smoothing 0.1, state donated
  decode greedy        one cached decoder call at opus-mt size (``bench/decode_breakdown.py``'s
                       model: d_model 512, 6+6 layers, 8 heads, d_ff 2048, vocab 58,101),
                       32 rows, a cache of 128 positions half filled

    .venv/bin/python bench/profile_ops.py                  # all three, ~3 min on 2 cores
    .venv/bin/python bench/profile_ops.py --steps train_small

Op times are thread times: XLA runs independent thunks on its worker threads at once, so they
can add up to more than the wall time of the step (both are reported). Profiling adds a few
microseconds per op. Writes bench/results/profile_ops.json and profile_ops.md.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import decode_breakdown  # noqa: E402
import train_step as ts  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STEPS = ("train_small", "train_base", "decode_greedy")

# ----------------------------------------------------------------------------- HLO parsing

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")


def _table(text: str, title: str) -> dict[int, str]:
    """One of the id tables at the top of ``as_text()`` (FileNames, FunctionNames...)."""
    out: dict[int, str] = {}
    m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.M)
    for line in m.group(1).splitlines() if m else []:
        k, v = line.split(" ", 1)
        out[int(k)] = v.strip('"')
    return out


def parse_hlo(text: str) -> tuple[dict, dict]:
    """(instructions by name, computations by name) of a compiled module's text.

    An instruction: {opcode, shape, calls, op_name, frames: [(file, function, line), ...]
    innermost first}. A computation: the list of its instructions' opcodes."""
    files, funcs = _table(text, "FileNames"), _table(text, "FunctionNames")
    locs, frames = {}, {}
    for k, v in _table(text, "FileLocations").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (files.get(int(f["file_name_id"]), "?"), funcs.get(int(f["function_name_id"]),
                   "?"), int(f["line"]))  # fmt: skip
    for k, v in _table(text, "StackFrames").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        frames[k] = (int(f["file_location_id"]), int(f["parent_frame_id"]))

    def chain(frame_id: int) -> list:
        out, seen = [], set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            loc, frame_id = frames[frame_id]
            out.append(locs.get(loc, ("?", "?", 0)))
        return out

    instrs, comps, current = {}, {}, None
    for line in text.splitlines():
        c = _COMP.match(line)
        if c:
            current = c.group(1)
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        if current is not None:
            comps[current].append(opcode)
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        kind = re.search(r'"kind":"(\w+)"', rest)
        instrs[name] = {
            "opcode": opcode, "shape": shape, "calls": calls.group(1) if calls else None,
            "op_name": op_name.group(1) if op_name else "",
            "frames": chain(int(frame.group(1))) if frame else [],
            "fusion_kind": kind.group(1) if kind else "",
        }  # fmt: skip
    return instrs, comps


def body_ops(instr: dict, comps: dict) -> set[str]:
    """Opcodes of an instruction, with those of the computation it calls (one level)."""
    ops = {instr["opcode"]}
    if instr["calls"]:
        ops |= set(comps.get(instr["calls"], []))
    return ops


# ----------------------------------------------------------------------------- naming ops


def source(instr: dict) -> str:
    """Innermost frame in this repository, flax or optax, as ``file:function:line``."""
    for file, func, line in instr["frames"]:
        if any(s in file for s in ("flaxformer_lite", "train.py", "optax", "flax/linen")):
            return f"{Path(file).name}:{func}:{line}"
    return ""


def _role(op_name: str) -> str:
    """The layer role of a matmul from its jax op name."""
    if "attend" in op_name:
        return "logits (tied embedding)"
    if "/mlp/" in op_name:
        return "MLP"
    if any(k in op_name for k in ("query", "/key/", "/value/", "/out/", "qkv")):
        return "q/k/v/out projections"
    if "attention" in op_name:
        return "attention scores and values"
    return "other"


def category(instr: dict, ops: set[str]) -> str:
    """The part of the step an op belongs to (first rule that matches)."""
    name, src = instr["op_name"], source(instr)
    backward = "transpose(" in name
    if "dot" in ops:
        return f"matmul {'bwd' if backward else 'fwd'}: {_role(name)}"
    if any(k in name for k in ("bernoulli", "threefry", "_uniform", "random_bits")):
        return "dropout: random bits"
    if "optax" in src or "optax" in " ".join(f for f, _, _ in instr["frames"][:3]):
        return "optimizer: Adam update, grad norm"
    if "correct_predictions" in src:
        return "metrics: argmax accuracy"
    if "losses.py" in src:
        return "loss: log-softmax, label smoothing"
    if "scatter" in ops:
        return "embedding / label scatter-add (backward)"
    if "gather" in ops:
        return "embedding gather"
    if "Dropout" in name:
        return "dropout: mask and scale"
    if "normalization.py" in src or "_norm" in name:
        return "layer norm"
    if "attention.py" in src:
        return "attention: softmax, mask, scaling"
    if "train.py" in src:
        return "train step glue (finite checks, grad scaling)"
    if ops <= {"copy", "transpose", "bitcast", "parameter", "fusion"} and (
        "copy" in ops or "transpose" in ops
    ):
        return "layout: copy / transpose"
    return "other elementwise"


def describe(instr: dict, ops: set[str]) -> str:
    """Short text of what an op computes: interesting opcodes of its body and its output."""
    keep = sorted(ops & {"dot", "reduce", "scatter", "gather", "transpose", "copy", "exponential",
                         "log", "sqrt", "rsqrt", "rng-bit-generator", "shift-right-logical",
                         "select", "compare", "dynamic-update-slice", "dynamic-slice",
                         "concatenate", "custom-call"})  # fmt: skip
    lib = {"__ynn_fusion": " (YNNPACK)", "__xnn_fusion": " (XNNPACK)"}.get(instr["fusion_kind"], "")
    return f"{instr['shape'].split('{')[0]} {'+'.join(keep) or instr['opcode']}{lib}"


# ----------------------------------------------------------------------------- profiling


def trace_events(trace_dir: str) -> list[dict]:
    files = sorted(Path(trace_dir).glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    data = json.load(gzip.open(files[-1]))
    return data["traceEvents"] if isinstance(data, dict) else data


def profile(compiled, run_once, steps: int) -> dict:
    """Per-op durations (ms per step) of ``steps`` calls of ``run_once`` under the profiler,
    named from ``compiled``'s HLO, plus the wall time per step outside and inside the trace."""
    instrs, comps = parse_hlo(compiled.as_text())
    run_once(), run_once()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        run_once()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                run_once()
            traced_ms = (time.perf_counter() - t0) / steps * 1e3
        events = trace_events(d)
    per_op = collections.defaultdict(float)
    counts = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in instrs:
            per_op[e["name"]] += e.get("dur", 0.0) / 1e3 / steps
            counts[e["name"]] += 1
    rows = []
    for name, ms in per_op.items():
        instr = instrs[name]
        ops = body_ops(instr, comps)
        rows.append({
            "op": name, "ms": ms, "calls_per_step": counts[name] / steps,
            "category": category(instr, ops), "computes": describe(instr, ops),
            "source": source(instr), "op_name": instr["op_name"][-120:],
        })  # fmt: skip
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total
    cats = collections.defaultdict(lambda: {"ms": 0.0, "ops": 0})
    for r in rows:
        cats[r["category"]]["ms"] += r["ms"]
        cats[r["category"]]["ops"] += 1
    categories = sorted(
        ({"category": k, **v, "share": v["ms"] / total} for k, v in cats.items()),
        key=lambda c: -c["ms"],
    )
    return {"wall_ms_per_step": wall_ms, "traced_wall_ms_per_step": traced_ms,
            "op_ms_per_step": total, "categories": categories, "ops": rows}  # fmt: skip


def train_target(name: str, **overrides):
    spec = ts.CONFIGS[name]
    step, state, batch = ts.ours_setup(spec, **overrides)
    compiled, _ = ts.aot_compile(step, state, batch)
    holder = {"state": state}

    def run_once():
        holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready(metrics)

    return compiled, run_once


def decode_target(rows: int = 32, cache: int = 128):
    step, args = decode_breakdown.greedy_step(rows=rows, cache=cache)
    compiled = step.lower(*args).compile()
    return compiled, lambda: jax.block_until_ready(compiled(*args))


# ----------------------------------------------------------------------------- report


def markdown(name: str, res: dict, top: int) -> str:
    lines = [
        f"### {name}: wall {res['wall_ms_per_step']:.1f} ms/step (traced "
        f"{res['traced_wall_ms_per_step']:.1f}), op time {res['op_ms_per_step']:.1f} ms/step",
        "",
        "| part of the step | ms/step | share | ops |",
        "|---|---:|---:|---:|",
    ]
    for c in res["categories"]:
        lines.append(f"| {c['category']} | {c['ms']:.1f} | {100 * c['share']:.1f}% | {c['ops']} |")
    lines += [
        "",
        "| op | computes | part | source | ms/step | share |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in res["ops"][:top]:
        lines.append(
            f"| {r['op']} | {r['computes']} | {r['category']} | {r['source']} | {r['ms']:.1f} | "
            f"{100 * r['share']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    ap.add_argument("--repeats", type=int, default=3, help="profiled calls per step")
    ap.add_argument("--top", type=int, default=15, help="ops listed per step in the markdown")
    ap.add_argument("--out", default="profile_ops", help="name of the results files")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")  # fmt: skip
    flags = open("/proc/cpuinfo").read()
    results = {"cpu": cpu, "avx512f": " avx512f " in flags, "cpu_count": os.cpu_count(),
               "jax": jax.__version__, "steps": {}}  # fmt: skip
    parts = []
    for name in args.steps.split(","):
        if name.startswith("train_"):
            compiled, run_once = train_target(name.removeprefix("train_"))
        elif name == "decode_greedy":
            compiled, run_once = decode_target()
        else:
            raise SystemExit(f"--steps: unknown step {name!r}; choose from {STEPS}")
        res = profile(compiled, run_once, args.repeats)
        results["steps"][name] = res
        parts.append(markdown(name, res, args.top))
        print(parts[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (
        f"CPU: {cpu} (AVX-512: {results['avx512f']}), {os.cpu_count()} cores, jax {jax.__version__}"
    )
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(header + "\n\n" + "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
