"""What XLA on this CPU does with int8 and bf16 matmuls, against float32, at decoding shapes.

For each `[M, K] x [K, N]` shape, in one process and interleaved rounds (the order rotates every
round, so machine load hits all variants alike), the median time of:

* ``f32``: float32 x float32 dot;
* ``int8_dot``: ``lax.dot_general`` int8 x int8 with ``preferred_element_type=int32`` alone;
* ``int8_dynamic``: the whole dynamic scheme: per-row absmax quantization of the float32
  activations, the int8 x int8 -> int32 dot, rescaling by row x column scales (float32 out);
* ``bf16``: bfloat16 x bfloat16 -> float32 (activations cast per call, weights stored bf16);
* ``w8_dequant``: weight-only int8, the weights converted to float32 inside the jitted call,
  float32 dot, output columns scaled (what XLA does when the weights stay int8 in memory);
* ``int8_pad4``: ``int8_dot`` with fewer than 4 rows padded to 4 with zeros and the result
  sliced back (what ``ops.quantize.int8_matmul`` does on XLA's dot: ``MIN_INT8_ROWS``);
* ``onednn_dot``: the exact int8 x int8 -> int32 product by oneDNN's kernel
  (``ops.onednn_int8.matmul``), the weights packed once beforehand, as a decoding loop has them
  (XLA hoists the pack out of the loop);
* ``onednn_dynamic``: ``ops.quantize.int8_matmul`` with ``kernel="onednn"``: the whole dynamic
  scheme (as ``int8_dynamic``) with that product, the pack inside the call.
The oneDNN variants are left out (with the reason printed) where the kernel does not load.

Each XLA_FLAGS setting runs in its own subprocess (XLA reads the flags once per process).
Prints ratios vs f32 (>1: faster than float32) and writes bench/results/int8_matmul.json
(``--out``), adding to a record of the same CPU.

    .venv/bin/python bench/int8_matmul.py               # default + oneDNN + XNNPACK dots
    .venv/bin/python bench/int8_matmul.py --settings default --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {
    "default": "",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "XNNPACK dots": "--xla_cpu_experimental_xnn_fusion_type=dot",
}
K = 512
SHAPES = [(m, K, n) for m in (1, 32, 128) for n in (512, 2048, 58101)]
SHAPES += [(2048, K, 512), (2048, K, 2048)]  # train-ish
VARIANTS = ("f32", "int8_dot", "int8_dynamic", "bf16", "w8_dequant", "int8_pad4")
VARIANTS += ("onednn_dot", "onednn_dynamic")


def worker(rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flaxformer_lite.ops import onednn_int8
    from flaxformer_lite.ops.quantize import int8_matmul

    variants = VARIANTS
    if onednn_int8.unavailable_reason():
        print("oneDNN kernel left out:", onednn_int8.unavailable_reason(), file=sys.stderr)
        variants = tuple(v for v in VARIANTS if not v.startswith("onednn"))

    def quantize_rows(x):  # [M, K] -> int8 [M, K], scale [M, 1]
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / 127.0
        return jnp.round(x / scale).astype(jnp.int8), scale

    def int_dot(a, b):
        dims = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32)

    fns = {
        "f32": jax.jit(lambda x, w: x @ w),
        "int8_dot": jax.jit(int_dot),
        "int8_dynamic": jax.jit(
            lambda x, wq, ws: (lambda q, s: int_dot(q, wq).astype(jnp.float32) * s * ws)(
                *quantize_rows(x)
            )
        ),
        "bf16": jax.jit(
            lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        ),
        "w8_dequant": jax.jit(lambda x, wq, ws: (x @ wq.astype(jnp.float32)) * ws),
        "int8_pad4": jax.jit(
            lambda a, b: int_dot(jnp.pad(a, ((0, max(0, 4 - a.shape[0])), (0, 0))), b)[: a.shape[0]]
        ),
        "onednn_dot": jax.jit(lambda a, p, n: onednn_int8.matmul(a, p, n), static_argnums=2),
        "onednn_dynamic": jax.jit(lambda x, wq, ws: int8_matmul(x, wq, ws[0], kernel="onednn")),
    }
    out = {}
    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        w = rng.standard_normal((k, n), np.float32) * k**-0.5
        ws = np.abs(w).max(axis=0, keepdims=True) / 127.0
        wq = jnp.asarray(np.round(w / ws).astype(np.int8))
        xq = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
        w, ws = jnp.asarray(w), jnp.asarray(ws)
        args = {
            "f32": (x, w),
            "int8_dot": (xq, wq),
            "int8_dynamic": (x, wq, ws),
            "bf16": (x, w.astype(jnp.bfloat16)),
            "w8_dequant": (x, wq, ws),
            "int8_pad4": (xq, wq),
        }
        if "onednn_dot" in variants:
            args["onednn_dot"] = (xq, jax.jit(onednn_int8.pack)(wq), n)
            args["onednn_dynamic"] = (x, wq, ws)
        for v in variants:  # compile + warm
            fns[v](*args[v]).block_until_ready()
        # Enough repetitions for ~20 ms per timing at float32 speed.
        t0 = time.perf_counter()
        fns["f32"](*args["f32"]).block_until_ready()
        reps = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
        times = {v: [] for v in variants}
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                t0 = time.perf_counter()
                for _ in range(reps):
                    y = fns[v](*args[v])
                y.block_until_ready()
                times[v].append((time.perf_counter() - t0) / reps)
        med = {v: statistics.median(t) for v, t in times.items()}
        out[f"{m}x{k}x{n}"] = {
            "f32_ms": med["f32"] * 1e3,
            **{f"{v}_vs_f32": med["f32"] / med[v] for v in variants[1:]},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "int8_matmul.json",
        help="JSON record; settings run separately accumulate in it when the CPU is the same",
    )  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds)))
        return
    results = {}
    for name in args.settings:
        env = {**os.environ, "XLA_FLAGS": SETTINGS[name], "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1]}
            print(name, "error:", results[name]["error"])
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"\n{name} (XLA_FLAGS={SETTINGS[name]!r}): speed vs float32 (>1 = faster)")
        shown = [v for v in VARIANTS[1:] if f"{v}_vs_f32" in next(iter(results[name].values()))]
        print("| M x K x N | f32 ms | " + " | ".join(shown) + " |")
        print("|---|---:|" + "---:|" * len(shown))
        for shape, row in results[name].items():
            ratios = " | ".join(f"{row[f'{v}_vs_f32']:.2f}" for v in shown)
            print(f"| {shape} | {row['f32_ms']:.3f} | {ratios} |")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "")
    flags = next((ln.split(":", 1)[1].split() for ln in cpu.splitlines() if "Flags" in ln), [])
    record = {
        "cpu": model,
        "cpu_flags": [f for f in flags if f.startswith(("avx512", "avx2", "amx", "fma"))],
        "cores": os.cpu_count(),
        "settings": {n: SETTINGS[n] for n in args.settings},
        "results": results,
    }
    path = args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    same_cpu = all(old.get(k) == record[k] for k in ("cpu", "cpu_flags", "cores"))
    if same_cpu:  # settings run separately accumulate in one file; another CPU's are replaced
        record["settings"] = {**old.get("settings", {}), **record["settings"]}
        record["results"] = {**old.get("results", {}), **record["results"]}
    path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
