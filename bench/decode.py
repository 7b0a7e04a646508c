"""Decoding speed: the key/value cache against full recomputation, and beam 4 against greedy.

One randomly initialised EncoderDecoder (d_model 256, 4 heads, d_ff 1024, 3+3 layers, vocabulary
8192, source length 32, batch 32, float32), in one process:

* cached greedy: ``generate(method="greedy")``: the encoder runs once, each step runs the
  decoder on one new position against the cache (keys/values of earlier positions and of the
  encoder output are stored).
* full recomputation: greedy decoding where every step runs the whole decoder over the prefix,
  padded to the final length so that one compiled shape serves every step (a ``lax.fori_loop``
  in one jitted call), and reads the logits at position t. The encoder also runs once.
  Every step of it costs the same (same shape), so at long lengths only ``--naive-steps``
  steps are run and timed and the total is that time x (new tokens / steps run); the table
  says where.
* beam 4: ``generate(method="beam", beam_size=4, alpha=0.6)``, cached, same model.

Random weights would stop at a random EOS; for fixed-length timing the output projection is
untied and its EOS column set to zero: the EOS logit is exactly 0 while the best of 8191
other logits is far above it (about +3.7 standard deviations), so no row or beam ever ends
early (checked after each run: no EOS in the output). Tokens per second count batch x new
tokens, for beam search too (the sentences it returns), so the beam ratio is a time ratio.

Writes bench/results/decode.json (decode_quick.json with --quick) and prints a markdown table.

    .venv/bin/python bench/decode.py --quick   # small model, under a minute on 2 cores
    .venv/bin/python bench/decode.py           # 32, 128, 512 new tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.decoding import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.generate import generate
from flaxformer_lite.models import EncoderDecoder

RESULTS = Path(__file__).resolve().parent / "results"

FULL = dict(
    model=dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3),
    vocab_size=8192,
    batch=32,
    source_len=32,
    lengths=(32, 128, 512),
)
QUICK = dict(
    model=dict(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2, num_decoder_layers=2),
    vocab_size=2048,
    batch=8,
    source_len=16,
    lengths=(16, 32, 64),
)


def make_model(settings: dict, max_len: int) -> tuple[TransformerConfig, dict]:
    """Random parameters with the EOS column of the (untied) output projection set to zero."""
    config = TransformerConfig(
        vocab_size=settings["vocab_size"],
        dropout_rate=0.0,
        max_len=max_len,
        tie_output_embedding=False,
        **settings["model"],
    )
    model = EncoderDecoder(config)
    tokens = jnp.ones((1, 8), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens)["params"])
    kernel = params["decoder"]["logits"]["kernel"]
    params["decoder"]["logits"]["kernel"] = kernel.at[:, EOS_ID].set(0.0)
    return config, params


@functools.partial(jax.jit, static_argnames=("config", "steps", "length"))
def recompute_greedy(params, config: TransformerConfig, inputs, *, steps: int, length: int):
    """Greedy decoding without a cache: ``steps`` steps, each running the decoder on the whole
    prefix padded to ``length`` and reading position t. Returns tokens `[batch, steps]`."""
    model = EncoderDecoder(config)
    variables = {"params": params}
    batch = inputs.shape[0]
    encoded = model.apply(variables, inputs, method=model.encode)
    decoder_inputs = jnp.full((batch, length), PAD_ID, jnp.int32).at[:, 0].set(BOS_ID)
    tokens = jnp.zeros((batch, steps), jnp.int32)

    def step(t, carry):
        decoder_inputs, tokens = carry
        logits = model.apply(variables, encoded, inputs, decoder_inputs, method=model.decode)
        nxt = jnp.argmax(lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), axis=-1)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None].astype(jnp.int32), (0, t))
        # At t = length - 1 the index clamps onto the last position: no step reads it after.
        decoder_inputs = lax.dynamic_update_slice(
            decoder_inputs, nxt[:, None].astype(jnp.int32), (0, t + 1)
        )
        return decoder_inputs, tokens

    return lax.fori_loop(0, steps, step, (decoder_inputs, tokens))[1]


def timed(jitted, args: tuple, kwargs: dict, repeats: int) -> tuple[float, object, float]:
    """Compiles ``jitted(*args, **kwargs)`` ahead of time (static options in ``kwargs``), then
    returns the median wall time of ``repeats`` runs, the output and the compile time.

    Ahead-of-time compilation replaces a warm-up run, which would double the cost of the long
    runs."""
    start = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    compile_s = time.perf_counter() - start
    dynamic = (args[0], args[2])  # params, inputs: the config and the options are static
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*dynamic))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out, compile_s


def measure(params, config, inputs, new_tokens: int, naive_steps: int, repeats: int) -> dict:
    batch = inputs.shape[0]
    produced = batch * new_tokens
    args = (params, config, inputs)

    greedy_s, (greedy_tokens, _), greedy_compile_s = timed(
        generate, args, dict(method="greedy", max_len=new_tokens), repeats
    )
    beam_s, (beam_tokens, _), beam_compile_s = timed(
        generate,
        args,
        dict(method="beam", beam_size=4, alpha=0.6, max_len=new_tokens),
        repeats,
    )
    # No EOS anywhere: every row and beam ran all new_tokens steps.
    for name, tokens in (("greedy", greedy_tokens), ("beam", beam_tokens)):
        if np.any(np.asarray(tokens) == EOS_ID) or np.any(np.asarray(tokens) == PAD_ID):
            raise RuntimeError(f"{name} decoding stopped early: the timing would be wrong")

    steps = min(new_tokens, naive_steps)
    naive_run_s, naive_tokens, naive_compile_s = timed(
        recompute_greedy, args, dict(steps=steps, length=new_tokens), repeats
    )
    naive_s = naive_run_s * new_tokens / steps
    # Same greedy decisions (up to float rounding near ties): the baseline does the same work.
    agree = float(np.mean(np.asarray(naive_tokens) == np.asarray(greedy_tokens)[:, :steps]))
    return {
        "new_tokens": new_tokens,
        "batch": batch,
        "repeats": repeats,
        "cached_greedy_s": greedy_s,
        "cached_greedy_tok_s": produced / greedy_s,
        "recompute_greedy_s": naive_s,
        "recompute_greedy_tok_s": produced / naive_s,
        "recompute_steps_run": steps,
        "recompute_extrapolated": steps < new_tokens,
        "recompute_agreement": agree,
        "cache_speedup": naive_s / greedy_s,
        "beam4_s": beam_s,
        "beam4_tok_s": produced / beam_s,
        "beam4_over_greedy_time": beam_s / greedy_s,
        "compile_s": {
            "cached_greedy": greedy_compile_s,
            "beam4": beam_compile_s,
            "recompute": naive_compile_s,
        },
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| new tokens | cached greedy tok/s | full recompute tok/s | cache speed-up "
        "| beam 4 tok/s | beam 4 time / greedy time |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        note = f" (from {r['recompute_steps_run']} steps)" if r["recompute_extrapolated"] else ""
        lines.append(
            f"| {r['new_tokens']} | {r['cached_greedy_tok_s']:,.0f} | "
            f"{r['recompute_greedy_tok_s']:,.0f}{note} | {r['cache_speedup']:.1f}x | "
            f"{r['beam4_tok_s']:,.0f} | {r['beam4_over_greedy_time']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and lengths (<1 min)")
    parser.add_argument(
        "--naive-steps",
        type=int,
        default=None,
        help="full recomputation runs at most this many steps (each step costs the same); "
        "longer outputs are extrapolated (default: 16, --quick: 64 i.e. all)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()

    settings = QUICK if args.quick else FULL
    naive_steps = args.naive_steps or (64 if args.quick else 16)
    lengths = settings["lengths"]
    config, params = make_model(settings, max_len=max(lengths))
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, config.vocab_size, (settings["batch"], settings["source_len"]))
    inputs[:, -1] = EOS_ID
    inputs = jnp.asarray(inputs, jnp.int32)

    rows = []
    for new_tokens in lengths:
        # One timed run of the longest length: beam search alone takes about a minute there.
        repeats = args.repeats if new_tokens < max(lengths) or args.quick else 1
        row = measure(params, config, inputs, new_tokens, naive_steps, repeats)
        rows.append(row)
        print(
            f"{new_tokens:>4} new tokens: cached {row['cached_greedy_tok_s']:,.0f} tok/s, "
            f"recompute {row['recompute_greedy_tok_s']:,.0f} tok/s, "
            f"beam 4 {row['beam4_tok_s']:,.0f} tok/s; recompute agrees with cached greedy "
            f"on {100 * row['recompute_agreement']:.1f}% of tokens",
            flush=True,
        )

    device = jax.devices()[0]
    meta = {
        "mode": "quick" if args.quick else "full",
        "model": {**settings["model"], "vocab_size": settings["vocab_size"]},
        "batch": settings["batch"],
        "source_len": settings["source_len"],
        "dtype": "float32",
        "repeats": args.repeats,
        "timing": "compiled ahead of time; median wall time of `repeats` runs",
        "eos": "output projection untied, EOS column zeroed: no early stop (checked)",
        "recompute": "decoder over the prefix padded to the final length each step; "
        "totals extrapolated from recompute_steps_run steps where fewer than new_tokens",
        "jax": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "host": platform.processor() or platform.machine(),
    }
    out = args.out or RESULTS / ("decode_quick.json" if args.quick else "decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print()
    print(
        f"Decoding, batch {settings['batch']}, source length {settings['source_len']}, "
        f"d_model {settings['model']['d_model']}, "
        f"{settings['model']['num_encoder_layers']}+{settings['model']['num_decoder_layers']} "
        f"layers, vocabulary {settings['vocab_size']}, float32, {meta['device']}. "
        "EOS is suppressed (zeroed output column) so every run decodes exactly the stated "
        "number of tokens. Full recomputation pads the prefix to the final length (one "
        "compiled shape, equal cost per step); rows marked 'from N steps' time N steps and "
        "scale to the full length."
    )
    print()
    print(markdown_table(rows))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
