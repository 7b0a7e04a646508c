"""The argmax over a row of logits, three ways, at decoding and training shapes.

* ``jnp.argmax``: XLA's reduction of (value, index) pairs;
* ``max_then_min``: the max, then the min of the indices that hold it (what
  ``losses.correct_predictions`` computed before ``ops.argmax``);
* ``row_argmax``: ``ops.argmax.row_argmax``, block maxima then the one winning block.

Shapes: `[32, 58101]` and `[128, 58101]` (greedy at batch 32 and beam 4 x batch 32 with an
opus-mt vocabulary), `[2048, 8000]` (a Multi30k training batch). Each variant is jitted alone,
its result checked equal to ``jnp.argmax``'s on rows with ties, ``-inf`` and NaN; rounds are
interleaved in one process (the order rotates), medians reported.

    .venv/bin/python bench/argmax.py --rounds 5 --out bench/results/argmax.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from translate_speed import cpu_flags  # noqa: E402

from flaxformer_lite.ops.argmax import row_argmax  # noqa: E402

SHAPES = ((32, 58101), (128, 58101), (2048, 8000))


def max_then_min(x):
    best = jnp.max(x, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    at_best = (x == best) | jnp.isnan(x)
    return jnp.min(jnp.where(at_best, ids, x.shape[-1]), axis=-1)


VARIANTS = {
    "jnp.argmax": lambda x: jnp.argmax(x, axis=-1),
    "max_then_min": max_then_min,
    "row_argmax": row_argmax,
}


def logits(shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    rows = shape[0]
    x[0, :] = -np.inf  # all -inf: index 0
    x[1, [7, shape[1] - 1]] = 100.0  # a tie: the lower index
    x[2, shape[1] - 1] = 100.0  # the row's last element
    if rows > 4:
        x[3, [5, shape[1] // 2]] = np.nan  # NaN counts as the maximum: the first one
        x[4, :] = 1.0  # all equal
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for shape in SHAPES:
        x = jnp.asarray(logits(shape, 0))
        expected = np.argmax(np.asarray(x), axis=-1)  # NumPy: first max, NaN first
        compiled = {}
        for name, fn in VARIANTS.items():
            compiled[name] = jax.jit(fn).lower(x).compile()
            got = np.asarray(compiled[name](x))
            assert (got == expected).all(), f"{name} {shape}: differs from np.argmax"
        times = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                jax.block_until_ready(compiled[name](x))
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = compiled[name](x)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / args.calls * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        row = {"shape": list(shape), "ms": ms}
        row["row_argmax_speedup_vs_argmax"] = ms["jnp.argmax"] / ms["row_argmax"]
        row["row_argmax_speedup_vs_max_then_min"] = ms["max_then_min"] / ms["row_argmax"]
        results.append(row)
        cells = "  ".join(f"{n} {v:.2f} ms" for n, v in ms.items())
        print(f"{shape}: {cells}  row_argmax {row['row_argmax_speedup_vs_argmax']:.1f}x argmax")
    record = {
        "command": "bench/argmax.py " + " ".join(sys.argv[1:]),
        "cpu_flags": cpu_flags(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
