"""bfloat16 compute in the Multi30k train step: ``TransformerConfig(dtype="bfloat16")`` (the
parameters and Adam's moments stay float32; softmax and loss float32) as a ratio to the float32
step, interleaved in one process.

The step is train.py's ``train_step`` on ``configs/multi30k.py``'s model and batch shape (the
model of bench/dropout_rng.py: d_model 128, SwiGLU 176, 4+4 layers, rotary positions; 32 rows
of 64 tokens), AdamW, label smoothing 0.1, on one device. Each variant is compiled, warmed up,
then timed in rounds (order reversed every other round); seconds per step are medians over
rounds. The first step's smoothed KL (summed over the batch's tokens) of each is printed
beside (the same initial parameters: the two differ by bfloat16's rounding only). Issue 28's
lever "bf16 where the CPU has it": a faster step is more steps in the hour.

    .venv/bin/python bench/train_precision.py              # 5 rounds of 10 steps, ~2 min
    .venv/bin/python bench/train_precision.py --quick      # 2 rounds of 2 steps: a smoke test

Writes bench/results/train_precision.json (train_precision_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_step  # noqa: E402  (bench/train_step.py: batch and init helpers)
from dropout_rng import SPEC, compile_step, interleaved_seconds, multi30k_model  # noqa: E402
from translate_speed import cpu_flags  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps (a smoke test)")
    parser.add_argument("--out", default=None, help="default: bench/results/train_precision.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 2
    name = "train_precision_quick.json" if args.quick else "train_precision.json"
    args.out = args.out or str(HERE / "results" / name)

    batch = {k: jnp.asarray(v) for k, v in train_step.make_batch(SPEC).items()}
    params = train_step.init_params(multi30k_model(), batch)  # float32, shared by both
    runs = {dtype: compile_step(multi30k_model(dtype=dtype), params, batch) for dtype in DTYPES}
    first_loss = {dtype: run(1) for dtype, run in runs.items()}
    for run in runs.values():
        run(1)  # warm-up
    seconds = interleaved_seconds(runs, args.rounds, args.steps)
    base = float(np.median(seconds["float32"]))
    rows = []
    for dtype in DTYPES:
        median = float(np.median(seconds[dtype]))
        rows.append(
            {
                "dtype": dtype,
                "seconds_per_step": median,
                "speed_vs_float32": base / median,
                "first_step_smoothed_kl_sum": first_loss[dtype],
            }
        )
        print(
            f"{dtype:9s} {1000 * median:7.1f} ms/step   speed {base / median:.3f}x float32"
            f"   first-step KL sum {first_loss[dtype]:.1f}"
        )
    record = {
        "machine": cpu_flags(),
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
