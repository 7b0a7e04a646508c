"""Weight averaging of a Multi30k run, scored on val: the last checkpoint, plain means of the
last N and exponential moving averages of the weights sampled at the checkpoints.

    python bench/multi30k_averaging.py --workdir runs/m30k --data ../shared/data/multi30k \
        --means 5 10 --time_constants 300 1000 3000 --alphas 1.0 1.4 \
        --out bench/results/multi30k/averaging.json

An exponential moving average (EMA) of the weights with time constant tau steps (decay
exp(-1/tau) per step) weighs the weights of step t by exp(-(T - t) / tau) at the last step T.
Sampled at the kept checkpoints, each checkpoint stands for the steps since the one before it:
its weight is that span times exp(-(T - step) / tau), and the weights are normalised over the
kept checkpoints (the oldest one cuts the tail off; normalising is what an EMA's bias
correction does). With checkpoints every 200 steps this follows a per-step EMA closely for tau
of a few hundred steps and more; ``--config.keep_checkpoints`` bounds how far back it reaches.

Every variant is decoded on val only (beam search with the run's beam size, at each alpha) and
scored with sacrebleu as ``bench/multi30k_select.py`` does, all in one process from one run:
the comparison is paired (same trajectory, same data), not across runs. test2016 is not
decoded: this measures whether averaging is worth a recipe change; a recipe chosen on val is
scored on test2016 by ``multi30k_select.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from multi30k_select import add_run_arguments, read_lines, score  # bench/, the script's folder

from flaxformer_lite.core.checkpoints import average_params, state_steps
from flaxformer_lite.inference.translator import Translator


def ema_weights(steps: list[int], span_before_first: int, tau: float) -> list[float]:
    """Per checkpoint step: the steps since the previous checkpoint (``span_before_first`` for
    the oldest) times exp(-(last step - step) / tau)."""
    last = steps[-1]
    spans = [span_before_first] + [b - a for a, b in zip(steps[:-1], steps[1:], strict=True)]
    return [span * math.exp(-(last - s) / tau) for span, s in zip(spans, steps, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "folder with val.<source> and val.<target>")
    parser.add_argument(
        "--means", type=int, nargs="*", default=[5], help="plain means of the last N"
    )
    parser.add_argument("--time_constants", type=float, nargs="*", default=[300, 1000, 3000])
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0])
    parser.add_argument("--out", required=True, help="JSON record of every variant")
    args = parser.parse_args()

    val = tuple(
        read_lines(os.path.join(args.data, f"val.{lang}"))
        for lang in (args.source_lang, args.target_lang)
    )
    with open(os.path.join(args.workdir, "config.json")) as f:
        run = json.load(f)
    checkpoints = os.path.join(args.workdir, "checkpoints")
    steps = state_steps(checkpoints)
    last = Translator.from_workdir(args.workdir, average=1)
    expected = Translator.abstract_params(last.config)

    variants: list[tuple[str, list[int], list[float] | None]] = [("last", steps[-1:], None)]
    for n in args.means:
        if n > len(steps):
            parser.error(f"--means {n}: only {len(steps)} checkpoints are kept: {steps}")
        variants.append((f"mean of last {n}", steps[-n:], None))
    every = int(run.get("checkpoint_every") or steps[-1] - steps[-2])
    for tau in args.time_constants:
        if not tau > 0:
            parser.error(f"--time_constants must be positive steps; got {tau}")
        variants.append((f"EMA tau {tau:g}", steps, ema_weights(steps, every, tau)))

    rows = []
    for label, chosen, weights in variants:
        if weights is None and len(chosen) == 1:
            translator = last
        else:
            params = average_params(checkpoints, chosen, expected, weights=weights)
            translator = Translator(
                params, last.config, last.source_vocab, last.target_vocab,
                generation=last.generation, name=label,
            )  # fmt: skip
        for alpha in args.alphas:
            row = {"variant": label, "steps": chosen, "alpha": alpha}
            if weights is not None:
                total = sum(weights)
                row["weights"] = [round(w / total, 4) for w in weights]
            row["val"] = score(translator, *val, beam_size=last.beam_size, alpha=alpha)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "weights"}), flush=True)
    best = max(rows, key=lambda r: (r["val"]["bleu"], r["val"]["bleu_lowercase"]))
    print(f"best on val: {best['variant']}, alpha {best['alpha']}: {best['val']['bleu']} cased")
    with open(args.out, "w") as f:
        json.dump({"workdir": args.workdir, "checkpoint_steps": steps, "rows": rows}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
