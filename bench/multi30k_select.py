"""Choose a Multi30k run's decoding settings on val, then score them once on test2016.

    python bench/multi30k_select.py --workdir runs/m30k --data ../shared/data/multi30k \
        --averages 1 5 10 --alphas 0.6 1.0 1.5 --out bench/results/multi30k/select.json

Every (checkpoints averaged, beam size, alpha) cell is decoded on val only and scored with
sacrebleu (cased and lowercased, the evaluate CLI's ``bleu_report``); the cell with the best
val BLEU (cased, then lowercased) is chosen, and only then are test2016's scores computed:
for the chosen cell and for the plain one (the last checkpoint, the run's configured beam
and alpha), the two rows an ablation table needs. test2016 never takes part in the choice.
The chosen cell is the `python -m flaxformer_lite.cli.evaluate --average N --beam_size B
--alpha A` command that reproduces it.

``--ensemble W2 [W3 ...]``: score the ensemble of ``--workdir`` and those runs instead
(``Translator.ensemble``, each run averaged over the cell's N checkpoints), as the evaluate
CLI's ``--ensemble`` does.

``--precisions bfloat16 int8 int8+bfloat16`` then decodes the chosen cell again (val and
test2016) with the same parameters in those precisions (``Translator(dtype=, quantize=)``):
the BLEU cost of each against float32 on one checkpoint, and its decoding seconds beside
float32's (measured in this process, one after the other; compilation excluded by a warm-up
call on the first 64 sentences).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from flaxformer_lite.cli.evaluate import bleu_report
from flaxformer_lite.inference.translator import Translator


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def score(translator: Translator, sources, references, *, beam_size: int, alpha: float, warm=False):
    """Cased and lowercased BLEU of beam search with these settings (the CLI's defaults);
    ``warm``: decode the first 64 sentences once first, so that the time excludes compiling."""
    generation = translator.generation.replace(method="beam", beam_size=beam_size, alpha=alpha)
    if warm:
        translator.translate(sources[:64], generation)
    start = time.perf_counter()
    hypotheses = translator.translate(sources, generation)
    seconds = time.perf_counter() - start
    report = bleu_report(hypotheses, [" ".join(r.split()) for r in references])
    return {
        "bleu": round(report["bleu"].score, 2),
        "bleu_lowercase": round(report["bleu_lowercase"].score, 2),
        "signature": report["signature"],
        "signature_lowercase": report["signature_lowercase"],
        "seconds": round(seconds, 1),
    }


def add_data_arguments(parser: argparse.ArgumentParser, data_help: str) -> None:
    """--data and the two languages: where every Multi30k scoring script reads its text."""
    parser.add_argument("--data", required=True, help=data_help)
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--target_lang", default="de")


def add_run_arguments(parser: argparse.ArgumentParser, data_help: str) -> None:
    """--workdir and add_data_arguments': what a script scoring one run reads."""
    parser.add_argument("--workdir", required=True)
    add_data_arguments(parser, data_help)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "folder with val.* and test2016.*")
    parser.add_argument("--averages", type=int, nargs="+", default=[1])
    parser.add_argument("--beam_sizes", type=int, nargs="+", default=[4])
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0])
    parser.add_argument(
        "--precisions",
        nargs="*",
        default=[],
        choices=["bfloat16", "int8", "int8+bfloat16"],
        help="also decode the chosen cell in these precisions (BLEU cost against float32)",
    )
    parser.add_argument(
        "--ensemble", nargs="+", default=[], help="more workdirs decoded with --workdir as one"
    )
    parser.add_argument("--out", required=True, help="JSON record of every cell")
    args = parser.parse_args()

    def load(average: int, **options) -> Translator:
        members = [
            Translator.from_workdir(w, average=average, **options)
            for w in [args.workdir, *args.ensemble]
        ]
        return members[0] if len(members) == 1 else Translator.ensemble(members)

    def split(name: str):
        src = read_lines(os.path.join(args.data, f"{name}.{args.source_lang}"))
        ref = read_lines(os.path.join(args.data, f"{name}.{args.target_lang}"))
        return src, ref

    val, test = split("val"), split("test2016")
    with open(os.path.join(args.workdir, "config.json")) as f:
        run_config = json.load(f)
    plain = (1, run_config.get("beam_size", 4), run_config.get("alpha", 1.0))

    cells, translators = [], {}
    for average in args.averages:
        translators[average] = load(average)
        for beam_size in args.beam_sizes:
            for alpha in args.alphas:
                row = {"average": average, "beam_size": beam_size, "alpha": alpha}
                row["val"] = score(translators[average], *val, beam_size=beam_size, alpha=alpha)
                cells.append(row)
                print(json.dumps(row), flush=True)
    best = max(cells, key=lambda r: (r["val"]["bleu"], r["val"]["bleu_lowercase"]))
    chosen = (best["average"], best["beam_size"], best["alpha"])
    record = {
        "workdir": args.workdir,
        "ensemble": args.ensemble,
        "checkpoint_steps": None,
        "cells": cells,
        "test2016": {},
    }
    for label, (average, beam_size, alpha) in (("plain", plain), ("chosen", chosen)):
        if average not in translators:
            translators[average] = load(average)
        result = score(translators[average], *test, beam_size=beam_size, alpha=alpha)
        record["test2016"][label] = {
            "average": average, "beam_size": beam_size, "alpha": alpha, **result,
            "name": translators[average].name,
        }  # fmt: skip
        print(label, json.dumps(record["test2016"][label]), flush=True)
    record["checkpoint_steps"] = {a: t.name for a, t in translators.items()}
    average, beam_size, alpha = chosen
    record["precisions"] = {}
    for precision in ["float32", *args.precisions]:
        translator = (
            translators[average]
            if precision == "float32"
            else load(
                average,
                dtype="bfloat16" if "bfloat16" in precision else None,
                quantize="int8" if "int8" in precision else None,
            )
        )
        record["precisions"][precision] = {
            split: score(translator, *data, beam_size=beam_size, alpha=alpha, warm=True)
            for split, data in (("val", val), ("test2016", test))
        }
        print(precision, json.dumps(record["precisions"][precision]), flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
