"""Beam search's in-place attention (``ops.beam_cache.attend_beams``) in other operand layouts,
measured on the whole jitted beam search, interleaved in one process (issue 26).

``bench/profile_ops.py`` shows XLA copying the self-attention cache around ``attend_beams``'s
dots at every layer and step (the keys and values rearranged for the dots). The variants here
remove those copies by reading the cache in the order it is stored (``kv_cache.heads_first``:
`[rows, kv_heads, slots, head_dim]`); each is swapped into ``beam_cache`` while
``generate_jit`` is traced, in this process only:

  library    ``attend_beams`` as it is: the cache's rows split into (batch, key beam), the
             logits `[batch, kv_heads, groups, queries, beam, slots]`
  split      the same split of the rows, taken from the heads-first view, and the key beam
             second in the logits, so that both dots read the cache without a copy
  per_row    no split of the cache at all: each source's queries repeated for its ``beam``
             cache rows, both dots batched over (row, kv_head), the softmax over a source's
             (beam, slot) keys

    .venv/bin/python bench/beam_attention_layouts.py --rounds 5

At opus-mt size (d_model 512, 6+6 layers, vocabulary 58,101, random weights), beam 4, batch
32, 24 source tokens, 32 new tokens. Prints new tokens per second per variant and the ratio
to ``library`` per round; every variant's tokens are checked equal to ``library``'s. Writes
bench/results/beam_attention_layouts.json.
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


def _beam_major(x, kv_heads: int, beam: int, slots: int):
    """A grouped mask or bias `[batch|1, heads|1, beam * q_len, beam * slots]` as
    `[batch|1, beam, kv_heads|1, groups|1, beam * q_len, slots]`."""
    lead, heads, joint_q = x.shape[0], x.shape[1], x.shape[2]
    groups = 1 if heads == 1 else heads // kv_heads
    x = x.reshape(lead, min(heads, kv_heads), groups, joint_q, beam, slots)
    return jnp.moveaxis(x, 4, 1)


def _queries(query, beam: int, kv_heads: int, scale):
    batch, joint_q, heads, head_dim = query.shape
    scale = jnp.asarray(head_dim**-0.5 if scale is None else scale, query.dtype)
    q = (query * scale).reshape(batch, 1, joint_q, kv_heads, heads // kv_heads, head_dim)
    return jnp.broadcast_to(q, (batch, beam, joint_q, kv_heads, heads // kv_heads, head_dim))


def _softmax(logits, mask, bias, kv_heads, beam, slots, dtype):
    """Softmax over a source's (beam, slot) keys of logits `[batch, beam, kv_heads, groups,
    queries, slots]`; zeros where nothing is allowed, as ``dot_product_attention``."""
    if bias is not None:
        logits = logits + _beam_major(bias, kv_heads, beam, slots).astype(jnp.float32)
    allowed = _beam_major(mask, kv_heads, beam, slots)
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


VARIANTS = {
    "library": beam_cache.attend_beams,
    "split": attend_split,
    "per_row": attend_per_row,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
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
        for name, fn in VARIANTS.items():
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
