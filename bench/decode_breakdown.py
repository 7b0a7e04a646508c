"""Where one decoding step spends its time, at opus-mt size, measured piece by piece.

The model is a random ``EncoderDecoder`` of Marian's opus-mt shape (d_model 512, 6+6 layers,
8 heads, d_ff 2048, vocabulary 58,101, float32), the source 24 tokens. For greedy (32 rows)
and beam 4 (32 sentences = 128 rows), with the key/value cache sized for ``--cache`` decoder
positions, each jitted piece is timed alone (median of ``--repeats`` calls, after a warm-up):

  step           the whole model call of one step: embedding, 6 decoder layers against the
                 cache (self-attention over every cached position, cross-attention over the
                 encoder keys/values), logits
  layers         step minus logits: the decoder layers (and embedding) alone
  logits         the output projection alone, `[rows, 512] x [512, 58101]`
  log_softmax    over `[rows, 58101]`
  top_k          beam search's selection: top 2k of `[batch, k * vocab]` (what decoding.py does)
  top_k_2stage   the same selection as per-beam top 2k, then top 2k of `[batch, k * 2k]`
  gather_cache   reordering every cache leaf by parent beam (what beam search does each step)

The pieces do not add up to a search step exactly (the search also compares, writes tokens
and keeps finished hypotheses), but they show which parts matter.

    .venv/bin/python bench/decode_breakdown.py --cache 32
    .venv/bin/python bench/decode_breakdown.py --cache 128
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

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.generate import _decoder_call, init_cache
from flaxformer_lite.models import EncoderDecoder

RESULTS = Path(__file__).resolve().parent / "results"
SRC_LEN = 24
OPUS_MT = dict(
    vocab_size=58101,
    d_model=512,
    num_heads=8,
    d_ff=2048,
    num_encoder_layers=6,
    num_decoder_layers=6,
    dropout_rate=0.0,
    activation="silu",
    sinusoid_layout="halves",
    scale_embeddings=True,
    logits_bias=True,
    layer_norm_epsilon=1e-5,
    pad_id=58100,
    bos_id=58100,
    eos_id=0,
    unk_id=1,
)


def timed(fn, *args, repeats: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def opus_model(cache: int):
    """(model, params): a random opus-mt-shaped EncoderDecoder whose cache holds ``cache``."""
    config = TransformerConfig(max_len=max(cache, 64), **OPUS_MT)
    model = EncoderDecoder(config)
    x = jnp.ones((1, SRC_LEN), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), x, x)["params"])
    return model, params


def step_inputs(model, params, rows: int, cache_len: int):
    """(jitted decoder step ``(params, cache, tokens, src) -> (logits, cache)``, its arguments):
    ``rows`` random sources of SRC_LEN tokens, the cache primed with their encoder keys/values
    and half filled (the step writes position ``cache_len // 2``)."""
    src = jnp.asarray(np.random.default_rng(0).integers(2, 58100, (rows, SRC_LEN)), jnp.int32)
    encoded = jax.jit(lambda p, s: model.apply({"params": p}, s, method=model.encode))(params, src)
    cache = init_cache(model, params, rows, cache_len, SRC_LEN)
    prime = jax.jit(
        lambda p, c, e, s: _decoder_call(model, p, e, s)(jnp.zeros((rows, 0), jnp.int32), c)[1]
    )
    cache = prime(params, cache, encoded, src)
    # Half the cache filled: the position the step writes.
    cache = jax.tree_util.tree_map(
        lambda v: v if v.ndim else jnp.asarray(cache_len // 2, v.dtype), cache
    )
    tokens = jnp.full((rows, 1), 5, jnp.int32)
    step = jax.jit(lambda p, c, t, s: _decoder_call(model, p, None, s)(t, c))
    return step, (params, cache, tokens, src)


def greedy_step(rows: int = 32, cache: int = 128):
    """(jitted decoder step, its arguments) of greedy decoding at opus-mt size (``step_inputs``)."""
    model, params = opus_model(cache)
    return step_inputs(model, params, rows, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=int, default=32, help="decoder positions in the cache")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, params = opus_model(args.cache)

    def measure(name: str, beams: int) -> dict:
        rows = args.batch * beams
        step, (_, cache, tokens, src) = step_inputs(model, params, rows, args.cache)

        h = jnp.ones((rows, 1, 512), jnp.float32)
        table = params["source_embedding"]["embedding"]
        logits_fn = jax.jit(lambda h, e: jnp.einsum("bld,vd->blv", h, e))
        logits = logits_fn(h, table)[:, 0]
        log_softmax = jax.jit(lambda z: jax.nn.log_softmax(z, axis=-1))
        k = beams
        flat = logits.reshape(args.batch, k * logits.shape[-1])
        top = jax.jit(lambda z: jax.lax.top_k(z, 2 * k))

        def two_stage(z):
            per_beam_val, per_beam_idx = jax.lax.top_k(z, 2 * k)  # [rows, 2k]
            v = per_beam_val.reshape(args.batch, k * 2 * k)
            best, pos = jax.lax.top_k(v, 2 * k)
            beam = pos // (2 * k)
            token = jnp.take_along_axis(per_beam_idx.reshape(args.batch, -1), pos, axis=1)
            return best, beam * z.shape[-1] + token

        two = jax.jit(two_stage)
        parent = jnp.asarray(np.random.default_rng(1).integers(0, rows, rows), jnp.int32)
        gather = jax.jit(
            lambda c, idx: jax.tree_util.tree_map(
                lambda v: jnp.take(v, idx, axis=0) if v.ndim else v, c
            )
        )
        entry = {
            "search": name,
            "rows": rows,
            "cache_positions": args.cache,
            "step_ms": timed(step, params, cache, tokens, src, repeats=args.repeats),
            "logits_ms": timed(logits_fn, h, table, repeats=args.repeats),
            "log_softmax_ms": timed(log_softmax, logits, repeats=args.repeats),
        }
        entry["layers_ms"] = entry["step_ms"] - entry["logits_ms"]
        if beams > 1:
            entry["top_k_ms"] = timed(top, flat, repeats=args.repeats)
            entry["top_k_2stage_ms"] = timed(two, logits, repeats=args.repeats)
            entry["gather_cache_ms"] = timed(gather, cache, parent, repeats=args.repeats)
            a, b = top(flat), two(logits)
            assert np.array_equal(np.asarray(a[1]), np.asarray(b[1])), "selections differ"
        return entry

    rows_out = []
    for name, beams in (("greedy", 1), ("beam4", 4)):
        rows_out.append(measure(name, beams))
        print(json.dumps(rows_out[-1]), flush=True)

    keys = ["step", "layers", "logits", "log_softmax", "top_k", "top_k_2stage", "gather_cache"]
    lines = ["| search | rows | cache | " + " | ".join(f"{k} ms" for k in keys) + " |"]
    lines.append("|" + "---|" * (len(keys) + 3))
    for e in rows_out:
        cells = " | ".join(f"{e[f'{k}_ms']:.1f}" if f"{k}_ms" in e else "-" for k in keys)
        lines.append(f"| {e['search']} | {e['rows']} | {e['cache_positions']} | {cells} |")
    table = "\n".join(lines)
    print(table)
    out = args.out or RESULTS / f"decode_breakdown_{args.cache}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": rows_out, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
