"""Where one decoding step spends its time, at opus-mt size, measured piece by piece.

The model is a random ``EncoderDecoder`` of Marian's opus-mt shape (d_model 512, 6+6 layers,
8 heads, d_ff 2048, vocabulary 58,101, float32), the source 24 tokens. For greedy (32 rows)
and beam 4 (32 sentences = 128 rows), with the key/value cache sized for ``--cache`` decoder
positions, each jitted piece is timed alone, in ``--repeats`` interleaved rounds (every piece
of every search once per round, after a warm-up; the median is reported):

  step           the whole model call of one step: embedding, 6 decoder layers against the
                 cache (self-attention over every cached position, cross-attention over the
                 encoder keys/values), logits
  layers         step minus logits: the decoder layers (and embedding) alone
  logits         the output projection alone, `[rows, 512] x [512, 58101]`
  log_softmax    over `[rows, 58101]`
  top_k          beam search's selection: top 2k of `[batch, k * vocab]` (what decoding.py does)
  top_k_2stage   the same selection as per-beam top 2k, then top 2k of `[batch, k * 2k]`
  select_fused   what beam search runs now instead of log_softmax + top_k: the same selection
                 from the raw logits (``ops.beam_top_k.log_softmax_top_k``: log-sum-exp per
                 row, exact per-row top-(2k+1) over blocks, scores for those alone), bitwise
                 equal to log_softmax then top_k (checked)
  gather_cache   what beam search reorders by parent beam after each step: every cache leaf
                 (beam4, ``generate(beam_cache="reorder")``), or only the `[rows, cache]` int32
                 ancestry of the cache that stays in place (beam4_in_place, the default:
                 ``models.reorder_beam_cache``); its step attends over the 4 beams of a source
                 under the ancestry mask and reads one cross-attention entry per source)

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
from translate_speed import cpu_flags  # bench/, the script's folder

from flaxformer_lite.decoding.generate import _decoder_call, init_cache
from flaxformer_lite.models import BEAM_ANCESTORS, EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops import beam_cache
from flaxformer_lite.ops.beam_top_k import log_softmax_top_k, reference_top_k

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


def opus_model(cache: int):
    """(model, params): a random opus-mt-shaped EncoderDecoder whose cache holds ``cache``."""
    config = TransformerConfig(max_len=max(cache, 64), **OPUS_MT)
    model = EncoderDecoder(config)
    x = jnp.ones((1, SRC_LEN), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), x, x)["params"])
    return model, params


def step_inputs(model, params, batch: int, cache_len: int, beams: int = 1, in_place: bool = False):
    """(jitted decoder step ``(params, cache, tokens, src) -> (logits, cache)``, its arguments)
    for ``batch`` random sources of SRC_LEN tokens x ``beams`` rows each: the cache primed with
    their encoder keys/values and half filled (the step writes position ``cache_len // 2``).
    ``in_place``: beam search's in-place cache (one source row per sentence, random ancestry)."""
    rows = batch * beams
    # In place: one source row (encoder output, cross-attention cache) per sentence.
    src_rows = batch if in_place else rows
    kw = dict(beam_size=beams) if in_place else {}
    src = np.random.default_rng(0).integers(2, 58100, (batch, SRC_LEN))
    src = jnp.asarray(np.repeat(src, src_rows // batch, axis=0), jnp.int32)
    encoded = jax.jit(lambda p, s: model.apply({"params": p}, s, method=model.encode))(params, src)
    cache = init_cache(model, params, src_rows, cache_len, SRC_LEN, **kw)
    prime = jax.jit(
        lambda p, c, e, s: _decoder_call(model, p, e, s, **kw)(jnp.zeros((rows, 0), jnp.int32), c)[
            1
        ]
    )
    cache = prime(params, cache, encoded, src)
    # Half the cache filled: the position the step writes; random ancestry.
    ancestry = np.random.default_rng(2).integers(0, beams, (rows, cache_len))
    cache = jax.tree_util.tree_map_with_path(
        lambda path, v: (
            jnp.asarray(cache_len // 2, v.dtype)
            if not v.ndim
            else jnp.asarray(ancestry, v.dtype)
            if "beam_ancestors" in jax.tree_util.keystr(path)
            else v
        ),
        cache,
    )
    tokens = jnp.full((rows, 1), 5, jnp.int32)
    step = jax.jit(lambda p, c, t, s: _decoder_call(model, p, None, s, **kw)(t, c))
    return step, (params, cache, tokens, src)


def greedy_step(rows: int = 32, cache: int = 128):
    """(jitted decoder step, its arguments) of greedy decoding at opus-mt size (``step_inputs``)."""
    model, params = opus_model(cache)
    return step_inputs(model, params, rows, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=int, default=32, help="decoder positions in the cache")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, params = opus_model(args.cache)

    def measure(name: str, beams: int, in_place: bool = False) -> dict:
        rows = args.batch * beams
        step, (_, cache, tokens, src) = step_inputs(
            model, params, args.batch, args.cache, beams, in_place
        )

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
        # Parents within each sentence's beams, as beam search picks them.
        parent = (np.arange(rows) // beams) * beams + np.random.default_rng(1).integers(
            0, beams, rows
        )
        parent = jnp.asarray(parent, jnp.int32)
        # In place only the ancestry changes (reorder_beam_cache passes the other leaves on;
        # returning them from a jitted call of their own would time copies the loop never
        # makes).
        gather = jax.jit(
            (lambda c, idx: beam_cache.reorder(c["decoder"][BEAM_ANCESTORS], idx))
            if in_place
            else lambda c, idx: jax.tree_util.tree_map(
                lambda v: jnp.take(v, idx, axis=0) if v.ndim else v, c
            )
        )
        leaves = jax.tree_util.tree_leaves(cache)
        entry = {
            "search": name,
            "cache_mib": sum(v.size * v.dtype.itemsize for v in leaves) / 2**20,
            "rows": rows,
            "cache_positions": args.cache,
        }
        pieces = {
            "step": (step, (params, cache, tokens, src)),
            "logits": (logits_fn, (h, table)),
            "log_softmax": (log_softmax, (logits,)),
        }
        if beams > 1:
            pieces["top_k"] = (top, (flat,))
            pieces["top_k_2stage"] = (two, (logits,))
            live = jnp.asarray(np.tile([0.0, -1.0, -2.0, -3.0][:k], (args.batch, 1)), jnp.float32)
            by_beam = logits.reshape(args.batch, k, -1)
            fused = jax.jit(lambda z, o: log_softmax_top_k(z, o, 2 * k))
            pieces["select_fused"] = (fused, (by_beam, live))
            plain = jax.jit(lambda z, o: reference_top_k(z, o, 2 * k))
            for x, y in zip(fused(by_beam, live), plain(by_beam, live), strict=True):
                assert np.array_equal(np.asarray(x), np.asarray(y)), "fused selection differs"
            pieces["gather_cache"] = (gather, (cache, parent))
            a, b = top(flat), two(logits)
            assert np.array_equal(np.asarray(a[1]), np.asarray(b[1])), "selections differ"
        for fn, fn_args in pieces.values():  # compile and warm up
            jax.block_until_ready(fn(*fn_args))
        return entry, pieces

    searches = [
        measure(name, beams, in_place)
        for name, beams, in_place in (
            ("greedy", 1, False),
            ("beam4", 4, False),
            ("beam4_in_place", 4, True),
        )
    ]
    # Interleaved rounds: every piece of every search once per round (other jobs on the
    # machine then slow all of them alike); the median of the rounds.
    times = [{piece: [] for piece in pieces} for _, pieces in searches]
    for _ in range(args.repeats):
        for (_, pieces), spent in zip(searches, times, strict=True):
            for piece, (fn, fn_args) in pieces.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*fn_args))
                spent[piece].append(time.perf_counter() - start)
    rows_out = []
    for (entry, _), spent in zip(searches, times, strict=True):
        entry.update({f"{k}_ms": statistics.median(v) * 1000.0 for k, v in spent.items()})
        entry["layers_ms"] = entry["step_ms"] - entry["logits_ms"]
        rows_out.append(entry)
        print(json.dumps(entry), flush=True)
    old, new = rows_out[1], rows_out[2]
    ratio = (old["step_ms"] + old["gather_cache_ms"]) / (new["step_ms"] + new["gather_cache_ms"])
    summary = f"beam4 step + gather: reorder / in place = {ratio:.2f}x"

    keys = ["step", "layers", "logits", "log_softmax", "top_k", "top_k_2stage", "select_fused"]
    keys.append("gather_cache")
    lines = ["| search | rows | cache | cache MiB | " + " | ".join(f"{k} ms" for k in keys) + " |"]
    lines.append("|" + "---|" * (len(keys) + 4))
    for e in rows_out:
        cells = " | ".join(f"{e[f'{k}_ms']:.1f}" if f"{k}_ms" in e else "-" for k in keys)
        lines.append(
            f"| {e['search']} | {e['rows']} | {e['cache_positions']} | {e['cache_mib']:.0f} | "
            f"{cells} |"
        )
    table = "\n".join(lines + ["", summary])
    print(table)
    machine = cpu_flags()
    print(machine)
    out = args.out or RESULTS / f"decode_breakdown_{args.cache}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": machine, "results": rows_out, "table": table}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
