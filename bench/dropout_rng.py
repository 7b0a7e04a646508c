"""Dropout's random bits from JAX's other PRNG implementations: the Multi30k train step with
its dropout keys drawn from "rbg" / "unsafe_rbg" (XLA's RngBitGenerator) instead of the
default threefry, as a ratio to the default step, interleaved in one process.

The step is train.py's ``train_step`` on ``configs/multi30k.py``'s model (d_model 128, 4 heads,
SwiGLU width 176, 4+4 layers, rotary positions, dropout 0.2, attention dropout 0.1, a
vocabulary of 8,000) and its batch shape (32 rows of 64 tokens, 2,048 target tokens), AdamW,
label smoothing 0.1, on one device. A variant swaps, in this process and while the step is
traced, the ``forward`` that ``train.loss_sums`` calls for one that turns the step's raw
threefry key into a key of the other implementation (four words drawn from it), so that every
dropout mask of the model comes from that implementation; nothing in the library is edited.
Each variant is compiled, warmed up, then timed in rounds (order reversed every other round);
seconds per step are medians over rounds. Profiles put dropout's random bits at 7% of a small
train step (docs/benchmarks.md), the lever this measures.

    .venv/bin/python bench/dropout_rng.py               # 5 rounds of 10 steps, ~2 min
    .venv/bin/python bench/dropout_rng.py --quick       # 2 rounds of 2 steps: a smoke test

Writes bench/results/dropout_rng.json (dropout_rng_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_step  # noqa: E402  (bench/train_step.py: batch and init helpers)
from levers import interleaved  # noqa: E402  (bench/levers.py: alternating-order timing)
from translate_speed import cpu_flags  # noqa: E402

import train  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
SPEC = dict(batch=32, length=64, vocab=8000)  # configs/multi30k.py: packed rows of 64


def multi30k_model(**overrides) -> EncoderDecoder:
    """configs/multi30k.py's model; ``overrides``: TransformerConfig fields to change."""
    fields = dict(
        vocab_size=SPEC["vocab"], d_model=128, num_heads=4, d_ff=176,
        num_encoder_layers=4, num_decoder_layers=4, dropout_rate=0.2,
        attention_dropout_rate=0.1, max_len=SPEC["length"], position="rotary",
        activation="swiglu",
    )  # fmt: skip
    return EncoderDecoder(TransformerConfig(**{**fields, **overrides}))


def compile_step(model, params, batch, forward=None):
    """``run(n)``: n train steps (train.py's, AdamW) of ``model`` from a copy of ``params``
    on ``batch``, the last step's smoothed KL returned; ``forward``: traced in place of
    ``train.forward`` (this process only)."""
    tx = optax.adamw(1e-4, weight_decay=0.3)
    state = train.TrainState(
        step=jnp.array(0, jnp.int32), params=jax.tree_util.tree_map(jnp.copy, params),
        opt_state=tx.init(params), rng=jax.random.PRNGKey(0),
    )  # fmt: skip
    step = jax.jit(
        functools.partial(
            train.train_step, model=model, kind="translation", tx=tx, schedule=lambda s: 1e-4,
            label_smoothing=0.1, accum_steps=1, skip_nonfinite=False,
        ),
        donate_argnums=(0,),
    )  # fmt: skip
    default_forward = train.forward
    train.forward = forward or default_forward
    try:
        compiled = step.lower(state, batch).compile()
    finally:
        train.forward = default_forward
    holder = {"state": state}

    def run(n: int) -> float:
        for _ in range(n):
            holder["state"], metrics = compiled(holder["state"], batch)
        return float(metrics["smoothed_kl"])

    return run


def compile_variant(impl: str, model, params, batch):
    """``run(n)``: n train steps whose dropout keys come from ``impl``."""

    def forward(model, kind, params, batch, *, deterministic, rng=None):
        if rng is not None and impl != "threefry2x32":
            words = jax.random.bits(rng, (4,), jnp.uint32)  # an rbg key holds 4 words
            rng = jax.random.wrap_key_data(words, impl=impl)
        return default_forward(model, kind, params, batch, deterministic=deterministic, rng=rng)

    default_forward = train.forward
    return compile_step(model, params, batch, forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps (a smoke test)")
    parser.add_argument("--out", default=None, help="default: bench/results/dropout_rng.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 2
    name = "dropout_rng_quick.json" if args.quick else "dropout_rng.json"
    args.out = args.out or str(HERE / "results" / name)

    model = multi30k_model()
    batch = {k: jnp.asarray(v) for k, v in train_step.make_batch(SPEC).items()}
    params = train_step.init_params(model, batch)
    runs = {impl: compile_variant(impl, model, params, batch) for impl in IMPLS}
    for run in runs.values():
        run(2)  # warm-up
    seconds = interleaved(runs, args.rounds, args.steps)
    base = float(np.median(seconds["threefry2x32"]))
    rows = []
    for impl in IMPLS:
        median = float(np.median(seconds[impl]))
        rows.append({"impl": impl, "seconds_per_step": median, "speed_vs_threefry": base / median})
        print(f"{impl:13s} {1000 * median:7.1f} ms/step   speed {base / median:.3f}x threefry")
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
