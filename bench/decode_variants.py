"""A decoding layout of the library switched on and off, in one process: the whole jitted
search (``generate_jit``) at opus-mt size (``decode_breakdown``'s random model with a random
``logits_bias``, float32 and its bfloat16 copy, 24 source tokens, 32 new tokens), compiled once
per setting, timed in interleaved rounds (median), tokens compared with the layout switched off.

  small_logits   bfloat16: the logits of up to ``nn.embed.SMALL_LOGITS_ROWS`` rows (8) table
                 first against ``x @ table.T`` (0 rows), for which XLA's CPU backend copies the
                 table transposed at every call

The threshold is a module constant read when a program is traced; each setting clears JAX's
caches before it compiles. (A second variant, ``fold_bias``, measured folding ``logits_bias``
into the float32 tied product at commit 520b545: 0.98-1.01x on an idle machine, not kept;
docs/benchmarks.md.)

    .venv/bin/python bench/decode_variants.py                       # 4 shapes
    .venv/bin/python bench/decode_variants.py --shapes 1x1 32x4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from decode_breakdown import OPUS_MT, SRC_LEN  # bench/, the script's folder
from translate_speed import cpu_flags

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import generate_jit, place_params
from flaxformer_lite.inference.translator import with_dtype
from flaxformer_lite.models import EncoderDecoder
from flaxformer_lite.nn import embed
from flaxformer_lite.nn.config import TransformerConfig

RESULTS = Path(__file__).resolve().parent / "results"
# variant: (dtype, module, constant, value when on, value when off)
VARIANTS = {
    "small_logits": ("bfloat16", embed, "SMALL_LOGITS_ROWS", embed.SMALL_LOGITS_ROWS, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--shapes", nargs="+", default=["1x1", "1x4", "32x1", "32x4"],
                        help="sentences x beams (1 beam: greedy)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_variants.json")
    args = parser.parse_args()

    config = TransformerConfig(max_len=64, **OPUS_MT)
    model = EncoderDecoder(config)
    x = jnp.ones((1, SRC_LEN), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), x, x)["params"])
    # Marian's final_logits_bias: random, so that it decides tokens.
    bias = np.random.default_rng(5).standard_normal(OPUS_MT["vocab_size"]) * 0.5
    params["decoder"]["logits_bias"] = jnp.asarray(bias, jnp.float32)
    models = {"float32": (params, config), "bfloat16": with_dtype(params, config, "bfloat16")}
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes:
        batch, beams = (int(n) for n in shape.split("x"))
        src = rng.integers(2, OPUS_MT["pad_id"], (batch, SRC_LEN))
        src[:, -1] = OPUS_MT["eos_id"]
        src = jnp.asarray(src, jnp.int32)
        for name in args.variants:
            dtype, module, constant, on, off = VARIANTS[name]
            placed = place_params(models[dtype][0], EncoderDecoder, models[dtype][1], mesh)
            compiled, tokens = {}, {}
            for state, value in (("off", off), ("on", on)):
                setattr(module, constant, value)
                jax.clear_caches()
                compiled[state] = generate_jit.lower(
                    placed, models[dtype][1], src, mesh=mesh,
                    method="greedy" if beams == 1 else "beam", max_len=32, beam_size=beams,
                    alpha=0.0,
                ).compile()  # fmt: skip
                tokens[state] = np.asarray(compiled[state](placed, src)[0])
            setattr(module, constant, on)
            seconds = {"off": [], "on": []}
            for _ in range(args.rounds):
                for state in ("off", "on"):
                    start = time.perf_counter()
                    jax.block_until_ready(compiled[state](placed, src))
                    seconds[state].append(time.perf_counter() - start)
            off_s, on_s = (statistics.median(seconds[s]) for s in ("off", "on"))
            row = {
                "variant": name, "dtype": dtype, "batch": batch, "beams": beams,
                "new_tokens": 32, "off_s": off_s, "on_s": on_s, "speedup": off_s / on_s,
                "tokens_equal": float(np.mean(tokens["on"] == tokens["off"])),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = ["| variant | dtype | batch x beams | off s | on s | on / off speed | tokens equal |",
             "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['dtype']} | {r['batch']} x {r['beams']} | {r['off_s']:.3f} | "
            f"{r['on_s']:.3f} | {r['speedup']:.2f} | {r['tokens_equal']:.3f} |"
        )
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": cpu_flags(), "jax": jax.__version__, "rounds": args.rounds, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
