"""Minimum Bayes risk decoding on Multi30k val: does choosing, per sentence, the candidate that
agrees most with the model's other outputs beat beam search's own choice? Val only: a
decoding setting is chosen there, never on test2016 (issue 28's rule).

    python bench/multi30k_mbr.py --workdir W --data ../shared/data/multi30k \
        --samples 16 --temperature 1.0 --out bench/results/multi30k/mbr_W.json

Candidates: beam search's output at every (``--beam_sizes``, ``--alphas``) cell, and
``--samples`` ancestral samples (``method="sample"``, ``--temperature``, ``--top_p``; seed i
for sample i). Pseudo-references: every candidate (samples and beam outputs). For each
utility (sentence chrF, sentence BLEU with effective order; sacrebleu) and each pool of
candidates ("beams": the beam outputs only; "beams+samples"), the sentence's output is the
candidate of the highest mean utility against the pseudo-references (Kumar & Byrne, 2004;
Eikema & Aziz, 2020). Printed and written: val BLEU (cased / lowercased, sacrebleu as the
evaluate CLI scores) of every beam cell, of the first sample, and of every MBR variant.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from multi30k_select import add_run_arguments, read_lines
from sacrebleu.metrics import BLEU, CHRF

from flaxformer_lite.cli.evaluate import bleu_report
from flaxformer_lite.inference.translator import Translator


def scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    report = bleu_report(hypotheses, references)
    return {
        "bleu": round(report["bleu"].score, 2),
        "bleu_lowercase": round(report["bleu_lowercase"].score, 2),
    }


def mbr_choice(candidates: list[str], pseudo: list[str], utility) -> str:
    """The candidate of the highest mean ``utility(candidate, pseudo_reference)``."""
    unique = list(dict.fromkeys(candidates))
    expected = [np.mean([utility(c, p) for p in pseudo]) for c in unique]
    return unique[int(np.argmax(expected))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "folder with val.{en,de}")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--beam_sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 1.4])
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    sources = read_lines(os.path.join(args.data, f"val.{args.source_lang}"))
    references = [
        " ".join(r.split()) for r in read_lines(os.path.join(args.data, f"val.{args.target_lang}"))
    ]
    translator = Translator.from_workdir(args.workdir)
    start = time.perf_counter()
    beams = {}
    for beam_size in args.beam_sizes:
        for alpha in args.alphas:
            beams[f"beam{beam_size}_alpha{alpha}"] = translator.translate(
                sources, method="beam", beam_size=beam_size, alpha=alpha,
                batch_size=args.batch_size,
            )  # fmt: skip
    sampling = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    samples = [
        translator.translate(
            sources, method="sample", seed=seed, batch_size=args.batch_size, **sampling
        )
        for seed in range(args.samples)
    ]
    record = {
        "workdir": args.workdir,
        "checkpoint": translator.name,
        "samples": args.samples,
        "sampling": sampling,
        "decoding_seconds": round(time.perf_counter() - start, 1),
        "beam_cells": {name: scores(h, references) for name, h in beams.items()},
        "first_sample": scores(samples[0], references),
        "mbr": {},
    }
    print(json.dumps(record), flush=True)
    chrf, bleu = CHRF(), BLEU(effective_order=True)
    utilities = {
        "chrf": lambda h, r: chrf.sentence_score(h, [r]).score,
        "bleu": lambda h, r: bleu.sentence_score(h, [r]).score,
    }
    for name, utility in utilities.items():
        for pool in ("beams", "beams+samples"):
            chosen = []
            for i in range(len(sources)):
                outputs = [h[i] for h in beams.values()]
                drawn = [s[i] for s in samples]
                candidates = outputs + drawn if pool == "beams+samples" else outputs
                chosen.append(mbr_choice(candidates, outputs + drawn, utility))
            record["mbr"][f"{name}, {pool}"] = scores(chosen, references)
            print(name, pool, record["mbr"][f"{name}, {pool}"], flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
