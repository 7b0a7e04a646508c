"""Peak memory and time of attention forward + backward: reference ("xla") vs blockwise.

Also blockwise with a local window (``--window``, default 256 keys on each side; causal, so a
sliding window of 257 keys, TransformerConfig.attention_window): key blocks outside the window
are skipped, so its time grows linearly in length where full causal blockwise grows
quadratically.

For causal self-attention at batch 1, 4 heads, head_dim 64, float32, and 1k / 4k / 16k tokens,
compiles ``jit(grad(sum(attention(q, k, v) ** 2)))`` for both paths, reads XLA's compiled memory
estimate (``memory_analysis().temp_size_in_bytes``: the scratch buffers beyond arguments and
outputs, i.e. what grows with the attention matrix), and times one forward + backward where the
estimate fits under ``--max-gb`` (default 8). The reference at 16k needs ~16 GB of temporaries
and is reported as a compiled estimate only.

Writes bench/results/attention_memory.json and attention_memory.png (log-log memory and time
against length; ``attention_memory_quick.*`` with --quick) and prints a markdown table.

    .venv/bin/python bench/attention_memory.py --quick   # 1k and 2k, under half a minute on 2 cores
    .venv/bin/python bench/attention_memory.py           # 1k, 4k, 16k
    .venv/bin/python bench/attention_memory.py --lengths 4096 16384 \
        --implementations blockwise blockwise_window     # the window against full blockwise
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.ops.attention import dot_product_attention
from flaxformer_lite.ops.blockwise import blockwise_attention
from flaxformer_lite.ops.masks import causal_mask

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20


def implementations(window: int) -> dict[str, Callable[..., jax.Array]]:
    return {
        # The reference needs an explicit [1, 1, n, n] causal mask; blockwise builds it per block.
        "reference": lambda q, k, v: dot_product_attention(q, k, v, causal_mask(q.shape[1])),
        "blockwise": lambda q, k, v: blockwise_attention(q, k, v, causal=True),
        "blockwise_window": lambda q, k, v: blockwise_attention(
            q, k, v, causal=True, window=window
        ),
    }


IMPLEMENTATIONS = tuple(implementations(0))
COLORS = {"reference": "tab:red", "blockwise": "tab:blue", "blockwise_window": "tab:green"}


def measure(
    name: str,
    length: int,
    heads: int,
    head_dim: int,
    max_bytes: float,
    repeats: int,
    window: int = 256,
) -> dict:
    """Compile fwd+bwd at one length; run and time it if its memory estimate fits."""
    attention = implementations(window)[name]
    spec = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v) ** 2)

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    row = {
        "implementation": name,
        "length": length,
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "compile_s": round(compile_s, 3),
        "time_s": None,
        "ran": False,
    }
    total = row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
    if total > max_bytes:
        row["note"] = f"compiled estimate only, not run (> {max_bytes / 2**30:.0f} GB)"
        return row
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=spec.shape), jnp.float32) for _ in range(3)]
    jax.block_until_ready(compiled(*args))  # warm-up: first-run allocations and thread pools
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    row.update(time_s=statistics.median(times), ran=True, note="")
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| length | implementation | temp memory (MiB) | x vs shortest | fwd+bwd (ms) | note |",
        "|---:|---|---:|---:|---:|---|",
    ]
    base = {}
    for r in rows:  # each implementation against its own shortest length
        base.setdefault(r["implementation"], r["temp_bytes"])
    for r in rows:
        growth = r["temp_bytes"] / base[r["implementation"]]
        t = f"{1e3 * r['time_s']:.1f}" if r["ran"] else "not run"
        lines.append(
            f"| {r['length']} | {r['implementation']} | {r['temp_bytes'] / MiB:.1f} | "
            f"{growth:.1f} | {t} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for name, color in COLORS.items():
        rs = [r for r in rows if r["implementation"] == name]
        if not rs:
            continue
        ax_mem.plot(
            [r["length"] for r in rs],
            [r["temp_bytes"] / MiB for r in rs],
            "o-",
            c=color,
            label=name,
        )
        ran = [r for r in rs if r["ran"]]
        ax_time.plot(
            [r["length"] for r in ran], [r["time_s"] for r in ran], "o-", c=color, label=name
        )
        for r in rs:
            if not r["ran"]:  # an estimate that was too big to run: hollow marker
                ax_mem.plot(r["length"], r["temp_bytes"] / MiB, "o", mfc="white", c=color)
                ax_mem.annotate("not run", (r["length"], r["temp_bytes"] / MiB), fontsize=8)
    ax_mem.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="compiled temp MiB")
    ax_time.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="fwd+bwd seconds")
    ax_mem.set_title("forward + backward temp memory")
    ax_time.set_title("forward + backward wall time")
    for ax in (ax_mem, ax_time):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 2k tokens only")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--max-gb", type=float, default=8.0, help="don't run above this estimate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--lengths", type=int, nargs="+", help="default 1k 4k 16k (--quick 1k 2k)")
    parser.add_argument(
        "--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS)
    )
    parser.add_argument("--window", type=int, default=256, help="blockwise_window's r (per side)")
    parser.add_argument("--stem", help="output file name stem (default by --quick)")
    args = parser.parse_args()

    lengths = args.lengths or ([1024, 2048] if args.quick else [1024, 4096, 16384])
    rows = []
    for length in lengths:
        for name in args.implementations:
            repeats = 1 if length >= 16384 else args.repeats
            row = measure(
                name,
                length,
                args.heads,
                args.head_dim,
                args.max_gb * 2**30,
                repeats,
                window=args.window,
            )
            row["window"] = args.window if name == "blockwise_window" else None
            rows.append(row)
            print(f"{name:>9} {length:>6}: {row['temp_bytes'] / MiB:10.1f} MiB  {row['note']}")

    device = jax.devices()[0]
    meta = {
        "batch": 1,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "causal": True,
        "dtype": "float32",
        "blockwise_blocks": "default (512 x 512)",
        "window": args.window,
        "jax": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "host": platform.processor() or platform.machine(),
        "memory_metric": "compiled memory_analysis().temp_size_in_bytes of jit(grad(loss))",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("attention_memory_quick" if args.quick else "attention_memory")
    (args.out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    title = (
        f"causal attention fwd+bwd, batch 1, {args.heads} heads, head_dim {args.head_dim}, "
        f"float32, {meta['device']}"
    )
    plot(rows, args.out / f"{stem}.png", title)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
