"""The attention's value product (``ops.attention.apply_attention_weights``) with the values
read heads first, measured against the library on beam search and on a train step,
interleaved in one process (issue 26; a lead, not taken).

In the compiled beam 4 search at opus-mt size, the cross-attention's value product (the
grouped queries of a source's beams against its encoder values) is one of XLA's loop dots at
every layer (``dot`` instructions outside fusion bodies, about 4% of the call on an idle Xeon)
instead of a YNNPACK dot. Contracting the weights `[batch, kv_heads, groups, q, k]` with the
values as `[batch, kv_heads, k, head_dim]` (``"bhgqk,bhkd->bhgqd"``) and transposing the small
result leaves no loop dot in that program. The variant is swapped into ``ops.attention`` while
each program is traced, in this process only:

    .venv/bin/python bench/value_product_order.py --rounds 7

Prints the loop dots left in each beam-search program, whether the tokens are equal, and per
round the variant's speed over the library's for the beam search (beam 4, batch 32, 24 source
tokens, 32 new tokens) and for ``train_step.py``'s small train step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import decode_breakdown  # noqa: E402
import train_step as ts  # noqa: E402

from flaxformer_lite.core import sharding  # noqa: E402
from flaxformer_lite.decoding.generate import generate_jit, place_params  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.ops import attention  # noqa: E402

from helpers import hlo as hlo_text  # noqa: E402


def values_heads_first(weights, value):
    """``apply_attention_weights`` with the values contracted heads first."""
    b, h, ql, kl = weights.shape
    kv_heads = value.shape[2]
    w = weights.reshape(b, kv_heads, h // kv_heads, ql, kl).astype(value.dtype)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", w, jnp.swapaxes(value, 1, 2))
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, ql, h, value.shape[-1])


VARIANTS = {"library": attention.apply_attention_weights, "heads_first": values_heads_first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model, params = decode_breakdown.opus_model(40)
    config = model.config
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    params = place_params(params, EncoderDecoder, config, mesh)
    src = np.random.default_rng(0).integers(2, config.pad_id, (32, decode_breakdown.SRC_LEN))
    src[:, -1] = config.eos_id
    src = src.astype(np.int32)
    programs = {}
    try:
        for name, fn in VARIANTS.items():
            attention.apply_attention_weights = fn
            jax.clear_caches()  # trace anew with this variant
            search = generate_jit.lower(
                params, config, src, mesh=mesh, method="beam", max_len=32, beam_size=4,
                alpha=0.0, beam_cache="in_place",
            ).compile()  # fmt: skip
            loop_dots = sum(i.opcode == "dot" for i in hlo_text.unfused(search.as_text()))
            step, state, batch = ts.ours_setup(ts.CONFIGS["small"], donate=False)
            programs[name] = (search, step.lower(state, batch).compile(), state, batch)
            print(f"{name}: {loop_dots} loop dots in the beam search")
    finally:
        attention.apply_attention_weights = VARIANTS["library"]
    tokens = [np.asarray(p[0](params, src)[0]) for p in programs.values()]
    print("tokens equal:", np.array_equal(*tokens))
    seconds = {name: {"beam": [], "train": []} for name in programs}
    for _ in range(args.rounds):
        for name, (search, train, state, batch) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(search(params, src))
            seconds[name]["beam"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(5):
                jax.block_until_ready(train(state, batch))
            seconds[name]["train"].append((time.perf_counter() - start) / 5)
    for part in ("beam", "train"):
        ratios = [
            round(lib / var, 3)
            for lib, var in zip(seconds["library"][part], seconds["heads_first"][part], strict=True)
        ]
        print(f"{part}: heads_first / library speed per round {ratios}")


if __name__ == "__main__":
    main()
