"""The Multi30k train step under changes to its model, each as a ratio to the config's own step,
interleaved in one process: issue 28's "faster steps" levers (a faster step is more steps in
the hour), measured before a run is spent on one.

The step is train.py's ``train_step`` on ``configs/multi30k.py``'s model and batch shape (the
model of bench/dropout_rng.py: d_model 128, SwiGLU 176, 4+4 layers, rotary positions, dropout
0.2, attention dropout 0.1; 32 rows of 64 tokens), AdamW, label smoothing 0.1, on one device.
The variants (``VARIANTS``: ``TransformerConfig`` fields changed):

- ``bfloat16``: ``dtype="bfloat16"`` compute (the parameters and Adam's moments stay float32;
  softmax and loss float32), "bf16 where the CPU has it";
- ``attention_dropout_0``: no dropout on the attention probabilities (one random bit per
  [batch, heads, query, key] entry of every attention block otherwise).

Each is compiled from the same initial parameters, warmed up, then timed in rounds (order
reversed every other round); seconds per step are medians over rounds. The first step's
smoothed KL (summed over the batch's tokens) of each is printed beside: bfloat16's differs from
the config's by rounding only, a dropout change's by its masks (fused q/k/v, whose parameters
have other shapes, starts from its own initialisation).

    .venv/bin/python bench/train_variants.py              # 5 rounds of 10 steps, ~3 min
    .venv/bin/python bench/train_variants.py --quick      # 2 rounds of 2 steps: a smoke test
    .venv/bin/python bench/train_variants.py --set current   # CURRENT_VARIANTS, the config now
    .venv/bin/python bench/train_variants.py --set argmax    # the accuracy metric's argmax
    .venv/bin/python bench/train_variants.py --set loss      # the loss's saved log-probs

``--set argmax``: the config as committed with the train step's accuracy metric
(``losses.correct_predictions``) computed as before ``ops.argmax`` (a max, then the min of the
indices holding it) or with ``jnp.argmax``, against its ``row_argmax`` (block maxima): the same
counts, so the same training, at another cost per step. ``--set loss``: the label-smoothed
loss as it was before it kept the log-sum-exp instead of the log-probabilities (its forward pass
wrote the `[batch, length, vocab]` log-probs for the backward pass), against the config's.

Writes bench/results/train_variants.json (train_variants_quick.json with --quick).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_step  # noqa: E402  (bench/train_step.py: batch and init helpers)
from dropout_rng import SPEC, compile_step, multi30k_model  # noqa: E402
from levers import interleaved  # noqa: E402
from translate_speed import cpu_flags  # noqa: E402

from flaxformer_lite.training import losses  # noqa: E402

VARIANTS = {
    "config": {},
    "bfloat16": {"dtype": "bfloat16"},
    "attention_dropout_0": {"attention_dropout_rate": 0.0},
}
# --set current: the config as committed since 2026-11-29's runs (no attention dropout,
# dropout on the feed-forward hidden units) against the changes that leave the model's
# function as it is: q, k and v as one [d_model, 3, heads, head_dim] matmul instead of three;
# RMSNorm (no mean, no bias) for LayerNorm; both.
CURRENT = {"attention_dropout_rate": 0.0, "activation_dropout_rate": 0.1}
CURRENT_VARIANTS = {
    "config": {},
    "fused_qkv": {"fused_qkv": True},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "fused_qkv_rmsnorm": {"fused_qkv": True, "norm_type": "rmsnorm"},
}

# --set argmax: losses.correct_predictions swapped for an earlier form while the step is traced.


def _max_then_min(logits, labels, weights):
    best = jnp.max(logits, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first = jnp.min(jnp.where((logits == best) | jnp.isnan(logits), ids, logits.shape[-1]), -1)
    return ((first == labels).astype(jnp.float32) * weights).sum()


def _plain_argmax(logits, labels, weights):
    return ((jnp.argmax(logits, -1) == labels).astype(jnp.float32) * weights).sum()


ARGMAX_VARIANTS = {"config": {}, "max_then_min": {}, "jnp_argmax": {}}
LOSS_VARIANTS = {"config": {}, "saved_log_probs": {}}
SWAPS = {  # variant: (attribute of losses, the function traced in its place)
    "max_then_min": ("correct_predictions", _max_then_min),
    "jnp_argmax": ("correct_predictions", _plain_argmax),
}


def _log_probs_fwd(logits, labels, weights, label_smoothing):
    confidence, low, entropy = losses._smoothing(logits.shape[-1], label_smoothing)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    label_log_prob = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    loss = -(confidence - low) * label_log_prob - low * log_probs.sum(axis=-1) - entropy
    out = ((loss * weights).sum(), weights.astype(jnp.float32).sum())
    return out, (log_probs, labels, weights, loss, jnp.zeros((), logits.dtype))


def _log_probs_bwd(label_smoothing, residuals, cotangents):
    log_probs, labels, weights, loss, like = residuals
    confidence, low, _ = losses._smoothing(log_probs.shape[-1], label_smoothing)
    ids = jax.lax.broadcasted_iota(labels.dtype, log_probs.shape, log_probs.ndim - 1)
    target = jnp.where(ids == labels[..., None], confidence, low)
    scale = (cotangents[0] * weights).astype(jnp.float32)[..., None]
    d_logits = ((jnp.exp(log_probs) - target) * scale).astype(like.dtype)
    return d_logits, None, (cotangents[0] * loss).astype(weights.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _log_probs_ce(logits, labels, weights, label_smoothing):
    return _log_probs_fwd(logits, labels, weights, label_smoothing)[0]


_log_probs_ce.defvjp(_log_probs_fwd, _log_probs_bwd)
SWAPS["saved_log_probs"] = (
    "smoothed_cross_entropy",
    lambda logits, labels, weights, label_smoothing=0.1: _log_probs_ce(
        logits, labels, weights, float(label_smoothing)
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps (a smoke test)")
    parser.add_argument(
        "--set",
        choices=("first", "current", "argmax", "loss"),
        default="first",
        help="first: VARIANTS against the 2026-11-29 config; current: CURRENT_VARIANTS against "
        "the config as committed; argmax: ARGMAX_VARIANTS (the accuracy metric), loss: "
        "LOSS_VARIANTS (the loss's saved log-probs), each against the config as committed",
    )
    parser.add_argument(
        "--out", default=None, help="default: bench/results/train_variants[_SET].json"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 2
    base, variants = {
        "first": ({}, VARIANTS),
        "current": (CURRENT, CURRENT_VARIANTS),
        "argmax": (CURRENT, ARGMAX_VARIANTS),
        "loss": (CURRENT, LOSS_VARIANTS),
    }[args.set]
    stem = "train_variants" + ("" if args.set == "first" else f"_{args.set}")
    args.out = args.out or str(HERE / "results" / f"{stem}{'_quick' if args.quick else ''}.json")

    batch = {k: jnp.asarray(v) for k, v in train_step.make_batch(SPEC).items()}
    params = train_step.init_params(multi30k_model(**base), batch)  # float32, shared

    def own_params(model):  # fused q/k/v has other parameter shapes: its own initialisation
        shapes = jax.eval_shape(lambda: train_step.init_params(model, batch))
        same = jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(params)
        return params if same else train_step.init_params(model, batch)

    runs = {}
    for name, fields in variants.items():
        model = multi30k_model(**base, **fields)
        attribute, swapped = SWAPS.get(name, ("correct_predictions", None))
        kept = getattr(losses, attribute)
        setattr(losses, attribute, swapped or kept)
        try:
            runs[name] = compile_step(model, own_params(model), batch)
        finally:
            setattr(losses, attribute, kept)
    first_loss = {name: run(1) for name, run in runs.items()}
    for run in runs.values():
        run(1)  # warm-up
    seconds = interleaved(runs, args.rounds, args.steps)
    reference = float(np.median(seconds["config"]))
    rows = []
    for name, fields in variants.items():
        median = float(np.median(seconds[name]))
        rows.append(
            {
                "variant": name,
                "fields": fields,
                "seconds_per_step": median,
                "speed_vs_config": reference / median,
                "first_step_smoothed_kl_sum": first_loss[name],
            }
        )
        print(
            f"{name:20s} {1000 * median:7.1f} ms/step   speed {reference / median:.3f}x the "
            f"config's   first-step KL sum {first_loss[name]:.1f}"
        )
    record = {
        "machine": cpu_flags(),
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "base_fields": base,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
