"""How much of a val BLEU difference between Multi30k runs is val's own sentence sampling.

    python bench/multi30k_significance.py --data ../shared/data/multi30k \
        --workdirs runs/base runs/change ... --out bench/results/multi30k/significance.json

Each run's last checkpoint decodes val with beam search (``--beam_size``, ``--alpha``); sacrebleu's
paired bootstrap (``sacrebleu.significance.PairedTest``, ``--samples`` resamplings of val's
sentences) then gives every run's lowercased BLEU with its 95% confidence interval, and for
every run after the first, the p-value of its difference from the first (the baseline). val only:
test2016 is never decoded here. A difference inside the interval is not evidence that one
recipe beats the other; seeds add their own spread on top (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os

from multi30k_select import add_data_arguments, read_lines  # bench/, the script's folder
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from flaxformer_lite.inference.translator import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdirs", nargs="+", required=True, help="runs to compare; the first is the baseline"
    )
    add_data_arguments(parser, "folder with val.<source> and val.<target>")
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.4)
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamplings")
    parser.add_argument("--out", required=True, help="JSON record")
    args = parser.parse_args()
    if len(args.workdirs) < 2:
        parser.error(f"--workdirs needs a baseline and at least one run; got {args.workdirs}")

    sources = read_lines(os.path.join(args.data, f"val.{args.source_lang}"))
    references = read_lines(os.path.join(args.data, f"val.{args.target_lang}"))
    references = [" ".join(r.split()) for r in references]
    systems = []
    for workdir in args.workdirs:
        translator = Translator.from_workdir(workdir)
        generation = translator.generation.replace(
            method="beam", beam_size=args.beam_size, alpha=args.alpha
        )
        systems.append((workdir, translator.translate(sources, generation)))
        print(f"decoded val with {workdir}", flush=True)

    test = PairedTest(
        systems,
        {"BLEU": BLEU(lowercase=True)},
        [references],
        test_type="bs",
        n_samples=args.samples,
    )
    signature, results = test()
    rows = []
    for (workdir, _), result in zip(systems, results["BLEU"], strict=True):
        rows.append(
            {
                "workdir": workdir.rstrip("/"),
                "bleu_lowercase": round(result.score, 2),
                "ci95": round(result.ci, 2),
                "p_value_against_first": result.p_value,
            }
        )
    print("| run | val BLEU lc | 95% CI | p against the first |\n|---|---:|---:|---:|")
    for row in rows:
        p = (
            "baseline"
            if row["p_value_against_first"] is None
            else f"{row['p_value_against_first']:.3f}"
        )
        print(f"| {row['workdir']} | {row['bleu_lowercase']:.2f} | +-{row['ci95']:.2f} | {p} |")
    record = {
        "beam_size": args.beam_size,
        "alpha": args.alpha,
        "samples": args.samples,
        "signature": str(signature["BLEU"]),
        "runs": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
