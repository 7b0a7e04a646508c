"""Beam search's in-place attention (``ops.beam_cache.attend_beams``) in other operand layouts,
measured on the whole jitted beam search, interleaved in one process (issue 26).

``bench/profile_ops.py`` showed XLA copying the self-attention cache around ``attend_beams``'s
dots at every layer and step (the keys and values rearranged for the dots; 18% of the beam
step at batch 32). The variants read the cache stored heads first (``kv_cache.heads_first``:
`[rows, kv_heads, slots, head_dim]`) in other ways; each is swapped into ``beam_cache`` while
``generate_jit`` is traced, in this process only:

  library    ``attend_beams`` as it is: no split of the cache's rows, each source's queries
             repeated for its ``beam`` cache rows, both dots batched over (row, kv_head), their
             outputs in dot_general's own order, the keys the logits dot's left operand
             (logits `[rows, kv_heads, slots, groups, queries]`); the softmax over a source's
             (beam, slot) keys
  queries_first  the library before issue 26's keys-first logits: the queries the logits
             dot's left operand, logits `[rows, kv_heads, groups, queries, slots]` (4 queries
             against a row's 32 slots per product)
  by_beam    the library before queries_first: the rows split into (batch, key beam), the
             key beam a batch dimension of both dots, the logits `[batch, kv_heads, groups,
             queries, beam, slots]` (XLA copies the keys and values of every layer at every
             step)
  split      the same split of the rows, taken from the heads-first view, and the key beam
             second in the logits (XLA duplicates the cache write and copies the cache)
  per_row    the library's dots with the outputs in the callers' order (XLA's slow loop dot
             for the values)
  reduce     no dots: both products as broadcast multiplies and sums
  reduce_logits  the logits as a multiply and a sum, the values by ``split``'s dot
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import decode_breakdown  # noqa: E402
from translate_speed import cpu_flags  # noqa: E402

from flaxformer_lite.core import sharding  # noqa: E402
from flaxformer_lite.decoding.generate import generate_jit, place_params  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.ops import beam_cache  # noqa: E402


def _queries(query, beam: int, kv_heads: int, scale):
    batch, joint_q, heads, head_dim = query.shape
    scale = jnp.asarray(head_dim**-0.5 if scale is None else scale, query.dtype)
    q = (query * scale).reshape(batch, 1, joint_q, kv_heads, heads // kv_heads, head_dim)
    return jnp.broadcast_to(q, (batch, beam, joint_q, kv_heads, heads // kv_heads, head_dim))


def _softmax(logits, mask, bias, kv_heads, beam, slots, dtype):
    """Softmax over a source's (beam, slot) keys of logits `[batch, beam, kv_heads, groups,
    queries, slots]`; zeros where nothing is allowed, as ``dot_product_attention``."""
    if bias is not None:
        logits = logits + beam_cache._beam_major(bias, kv_heads, beam, slots).astype(jnp.float32)
    allowed = beam_cache._beam_major(mask, kv_heads, beam, slots)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=(1, 5))
    return jnp.where(allowed, weights, 0.0).astype(dtype)


def attend_split(query, key, value, mask, bias, beam, scale=None):
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    q = _queries(query, beam, kv_heads, scale)
    k = jnp.swapaxes(key, 1, 2).reshape(batch, beam, kv_heads, slots, head_dim)
    v = jnp.swapaxes(value, 1, 2).reshape(batch, beam, kv_heads, slots, head_dim)
    logits = jnp.einsum("bjqhgd,bjhkd->bjhgqk", q, k, preferred_element_type=jnp.float32)
    weights = _softmax(logits, mask, bias, kv_heads, beam, slots, value.dtype)
    out = jnp.einsum("bjhgqk,bjhkd->bjqhgd", weights, v).sum(axis=1)
    return out.reshape(batch, joint_q, heads, head_dim)


def attend_per_row(query, key, value, mask, bias, beam, scale=None):
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    groups = heads // kv_heads
    q = _queries(query, beam, kv_heads, scale).reshape(rows, joint_q, kv_heads, groups, head_dim)
    k, v = jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)  # [rows, kv_heads, slots, d]
    logits = jnp.einsum("rqhgd,rhkd->rhgqk", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, beam, *logits.shape[1:])
    weights = _softmax(logits, mask, bias, kv_heads, beam, slots, value.dtype)
    weights = weights.reshape(rows, *weights.shape[2:])
    out = jnp.einsum("rhgqk,rhkd->rqhgd", weights, v)
    return out.reshape(batch, beam, joint_q, heads, head_dim).sum(axis=1)


def _reduce_logits(query, key, beam, scale):
    """logits `[batch, beam, kv_heads, groups, queries, slots]` as a product and a sum over
    head_dim, no dot: XLA fuses both and reads the cache where it lies."""
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    q = _queries(query, 1, kv_heads, scale)  # [batch, 1, q, kv_heads, groups, d]
    q = jnp.transpose(q, (0, 1, 3, 4, 2, 5))[:, :, :, :, :, None, :]  # [b, 1, h, g, q, 1, d]
    k = jnp.swapaxes(key, 1, 2).reshape(batch, beam, kv_heads, 1, 1, slots, head_dim)
    return jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=-1)


def attend_reduce(query, key, value, mask, bias, beam, scale=None):
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    logits = _reduce_logits(query, key, beam, scale)
    weights = _softmax(logits, mask, bias, kv_heads, beam, slots, value.dtype)
    v = jnp.swapaxes(value, 1, 2).reshape(batch, beam, kv_heads, 1, 1, slots, head_dim)
    out = jnp.sum(weights[..., None] * v, axis=(1, 5))  # [batch, kv_heads, groups, q, d]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, joint_q, heads, head_dim)


def attend_reduce_logits(query, key, value, mask, bias, beam, scale=None):
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    logits = _reduce_logits(query, key, beam, scale)
    weights = _softmax(logits, mask, bias, kv_heads, beam, slots, value.dtype)
    v = jnp.swapaxes(value, 1, 2).reshape(batch, beam, kv_heads, slots, head_dim)
    out = jnp.einsum("bjhgqk,bjhkd->bjqhgd", weights, v).sum(axis=1)
    return out.reshape(batch, joint_q, heads, head_dim)


def attend_by_beam(query, key, value, mask, bias, beam, scale=None):
    """``attend_beams`` before issue 26's last change: the cache's rows split into (batch, key
    beam), the key beam a batch dimension of both dots next to (batch, kv_head), the logits
    `[batch, kv_heads, groups, queries, beam, slots]`."""
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    groups = heads // kv_heads
    scale = jnp.asarray(head_dim**-0.5 if scale is None else scale, query.dtype)
    q = (query * scale).reshape(batch, 1, joint_q, kv_heads, groups, head_dim)
    q = jnp.broadcast_to(q, (batch, beam, joint_q, kv_heads, groups, head_dim))
    k = key.reshape(batch, beam, slots, kv_heads, head_dim)
    v = value.reshape(batch, beam, slots, kv_heads, head_dim)
    logits = jnp.einsum("bjqhgd,bjkhd->bhgqjk", q, k, preferred_element_type=jnp.float32)

    def by_heads(x):  # [batch|1, heads|1, q, beam * slots] -> [batch|1, kv|1, g|1, q, beam, slots]
        lead, h = x.shape[:2]
        return x.reshape(lead, min(h, kv_heads), h // min(h, kv_heads), joint_q, beam, slots)

    if bias is not None:
        logits = logits + by_heads(bias).astype(jnp.float32)
    allowed = by_heads(mask)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    shape = logits.shape
    weights = jax.nn.softmax(logits.reshape(shape[:4] + (beam * slots,)), axis=-1)
    weights = jnp.where(allowed, weights.reshape(shape), 0.0).astype(value.dtype)
    out = jnp.einsum("bhgqjk,bjkhd->bjqhgd", weights, v).sum(axis=1)
    return out.reshape(batch, joint_q, heads, head_dim)


def attend_queries_first(query, key, value, mask, bias, beam, scale=None):
    """``attend_beams`` before issue 26's keys-first logits: the same per-row dots with the
    queries as the logits dot's left operand, logits `[rows, kv_heads, groups, queries,
    slots]`."""
    batch, joint_q, heads, head_dim = query.shape
    rows, slots, kv_heads, _ = key.shape
    groups = heads // kv_heads
    q = _queries(query, beam, kv_heads, scale).reshape(rows, joint_q, kv_heads, groups, head_dim)
    q = jnp.transpose(q, (0, 2, 3, 1, 4))  # [rows, kv_heads, groups, q, d]
    k, v = jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)  # [rows, kv_heads, slots, d]
    logits = jnp.einsum("rhgqd,rhkd->rhgqk", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, beam, kv_heads, groups, joint_q, slots)
    weights = _softmax(logits, mask, bias, kv_heads, beam, slots, value.dtype)
    weights = weights.reshape(rows, kv_heads, groups, joint_q, slots)
    out = jnp.einsum("rhgqk,rhkd->rhgqd", weights, v)
    out = out.reshape(batch, beam, kv_heads, groups, joint_q, head_dim).sum(axis=1)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, joint_q, heads, head_dim)


VARIANTS = {
    "library": beam_cache.attend_beams,
    "by_beam": attend_by_beam,
    "split": attend_split,
    "per_row": attend_per_row,
    "reduce": attend_reduce,
    "reduce_logits": attend_reduce_logits,
    "queries_first": attend_queries_first,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--out", default=str(decode_breakdown.RESULTS / "beam_attention_layouts.json")
    )
    args = parser.parse_args()

    model, params = decode_breakdown.opus_model(args.new_tokens + 8)
    config = model.config
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    params = place_params(params, EncoderDecoder, config, mesh)
    src = np.random.default_rng(0).integers(
        2, config.pad_id, (args.batch, decode_breakdown.SRC_LEN)
    )
    src[:, -1] = config.eos_id
    src = src.astype(np.int32)

    compiled = {}
    library = beam_cache.attend_beams
    try:
        for name in ["library"] + [v for v in args.variants if v != "library"]:
            fn = VARIANTS[name]
            beam_cache.attend_beams = fn
            jax.clear_caches()  # trace anew with this variant
            compiled[name] = generate_jit.lower(
                params, config, src, mesh=mesh, method="beam", max_len=args.new_tokens,
                beam_size=4, alpha=0.0, beam_cache="in_place",
            ).compile()  # fmt: skip
    finally:
        beam_cache.attend_beams = library
    tokens = {name: np.asarray(c(params, src)[0]) for name, c in compiled.items()}
    for name, t in tokens.items():
        if not np.array_equal(t, tokens["library"]):
            raise SystemExit(f"{name}: tokens differ from the library's")

    seconds = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(params, src))
            seconds[name].append(time.perf_counter() - start)
    new = args.batch * args.new_tokens
    result = {
        "cpu": cpu_flags(),
        "jax": jax.__version__,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "tokens_equal": True,
        "seconds": seconds,
        "tokens_per_second": {k: round(new / float(np.median(v)), 1) for k, v in seconds.items()},
        "ratio_to_library_per_round": {
            k: [round(lib / s, 3) for lib, s in zip(seconds["library"], v, strict=True)]
            for k, v in seconds.items()
            if k != "library"
        },
    }
    for k, v in result["tokens_per_second"].items():
        ratios = result["ratio_to_library_per_round"].get(k, "")
        print(f"{k:8s} {v:7.1f} new tok/s (median of {args.rounds})  per round / library: {ratios}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
