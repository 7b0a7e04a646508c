"""Which XLA CPU flags speed up the train step: each setting in a fresh process, same model.

XLA reads XLA_FLAGS once, when the backend starts, so every setting runs in its own
subprocess; they alternate over several rounds so that machine load hits all alike. Reports the
float32 matmul peak and the small config's train-step tokens per second for each setting.

    .venv/bin/python bench/xla_flags.py            # writes bench/results/xla_flags.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "default": "",
    "eigen only (YNNPACK off)": "--xla_cpu_experimental_ynn_fusion_type=",
    "XNNPACK dots": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "fast math": "--xla_cpu_enable_fast_math=true",
}

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import jax
from flaxformer_lite.training.flops import matmul_peak_flops
sys.path.insert(0, sys.argv[1] + "/bench")
from train_step import CONFIGS, ours_step
spec = CONFIGS["small"]
run, compile_s = ours_step(spec)
run(1)
best = float("inf")
for _ in range(3):
    t0 = time.perf_counter(); run(4); best = min(best, (time.perf_counter() - t0) / 4)
print(json.dumps({"peak_gflops": matmul_peak_flops() / 1e9,
                  "tokens_per_s": spec["batch"] * spec["length"] / best,
                  "compile_s": compile_s}))
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, flags in SETTINGS.items():
            env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
            out = subprocess.run([sys.executable, "-c", WORKER, str(ROOT)], env=env,
                                 capture_output=True, text=True)  # fmt: skip
            if out.returncode:
                results[name].append({"error": out.stderr.strip().splitlines()[-1]})
                continue
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = ["| XLA_FLAGS | matmul GFLOP/s | small train tok/s | compile s |", "|---|---|---|---|"]
    summary = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {name} (`{SETTINGS[name]}`) | error: {runs[0]['error']} | | |")
            continue
        best = {k: max(r[k] for r in ok) for k in ("peak_gflops", "tokens_per_s")}
        best["compile_s"] = min(r["compile_s"] for r in ok)
        summary[name] = {"flags": SETTINGS[name], **best}
        lines.append(
            f"| {name} (`{SETTINGS[name] or 'none'}`) | {best['peak_gflops']:.0f} | "
            f"{best['tokens_per_s']:.0f} | {best['compile_s']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "xla_flags.json").write_text(json.dumps({"settings": summary, "table": table}, indent=2))


if __name__ == "__main__":
    main()
