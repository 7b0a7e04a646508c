"""What each change of issue 15 buys the train step, interleaved in one process.

The step of ``bench/train_step.py`` (its ``ours_step``) compiled with the library as it is
("all") and with one or all of the changes undone ("before"): the earlier implementations
are kept here and swapped in, in this process only, while a variant is traced.

  loss_grad   losses.smoothed_cross_entropy with autodiff's gradient (the one-hot scatter,
              the broadcast smoothing term) instead of the hand-written one-pass gradient
  tied_bwd    embed.tied_logits as a plain einsum: XLA copies the logits' gradient into a
              transposed layout for the embedding's gradient
  argmax      losses.correct_predictions with jnp.argmax's (value, index) reduction

    .venv/bin/python bench/train_changes.py --configs small --rounds 5

Prints tokens per second and the ratio to "before" of each variant; every variant's first
loss is checked against "before"'s (the changes are float rounding only).
"""

from __future__ import annotations

import argparse
import contextlib
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

import train_step as ts  # noqa: E402

from flaxformer_lite.nn import embed  # noqa: E402
from flaxformer_lite.training import losses


def old_smoothed_cross_entropy(logits, labels, weights, label_smoothing=0.1):
    vocab = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    label_log_prob = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    cross = -(confidence - low) * label_log_prob - low * log_probs.sum(axis=-1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = (cross - entropy) * weights
    return loss.sum(), weights.astype(jnp.float32).sum()


def old_tied_logits(x, table):
    return jnp.einsum("...d,vd->...v", x, table)


def old_correct_predictions(logits, labels, weights):
    hits = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (hits * weights).sum()


UNDO = {
    "loss_grad": (losses, "smoothed_cross_entropy", old_smoothed_cross_entropy),
    "tied_bwd": (embed, "tied_logits", old_tied_logits),
    "argmax": (losses, "correct_predictions", old_correct_predictions),
}
VARIANTS = {
    "before": ["loss_grad", "tied_bwd", "argmax"],
    "+loss_grad": ["tied_bwd", "argmax"],
    "+loss_grad+tied_bwd": ["argmax"],
    "all": [],
}


@contextlib.contextmanager
def undone(names):
    saved = [(UNDO[n][0], UNDO[n][1], getattr(UNDO[n][0], UNDO[n][1])) for n in names]
    try:
        for n in names:
            setattr(UNDO[n][0], UNDO[n][1], UNDO[n][2])
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="small,base")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    flags = open("/proc/cpuinfo").read()
    cpu = next(ln.split(":", 1)[1].strip() for ln in flags.splitlines() if "model name" in ln)
    out = {"cpu": cpu, "avx512f": " avx512f " in flags, "configs": {}}
    for name in args.configs.split(","):
        spec = ts.CONFIGS[name]
        params = None
        runs, first = {}, {}
        for v in args.variants.split(","):
            with undone(VARIANTS[v]):
                if params is None:
                    batch = {k: jnp.asarray(x) for k, x in ts.make_batch(spec).items()}
                    params = ts.init_params(ts.EncoderDecoder(ts.ours_config(spec)), batch)
                runs[v], _ = ts.ours_step(spec, params=params)
            first[v] = float(runs[v](1)["smoothed_kl"])
        times = {v: [] for v in runs}
        order = list(runs)
        for r in range(args.rounds):
            for v in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                runs[v](args.steps)
                times[v].append((time.perf_counter() - t0) / args.steps)
        tokens = spec["batch"] * spec["length"]
        base = float(np.median(times[order[0]]))
        rows = {}
        for v in order:
            t = float(np.median(times[v]))
            rows[v] = {"tokens_per_s": tokens / t, "ratio": base / t, "first_loss": first[v]}
            print(f"{name} {v:24s} {tokens / t:8.0f} tok/s  x{base / t:.3f}  "
                  f"first loss {first[v]:.6f}", flush=True)  # fmt: skip
        out["configs"][name] = rows
    res = ROOT / "bench" / "results" / "train_changes.json"
    res.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
