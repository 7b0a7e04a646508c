"""BLEU of a trained workdir on a test set, with sacrebleu on detokenized text.

    python -m flaxformer_lite.cli.evaluate --workdir runs/m30k \
        --source test2016.en --reference test2016.de --output test2016.hyp

Every path (workdir, source, reference, output, report) may be a ``gs://`` URI. They are
checked before the model is loaded (as in ``translate``): a missing or folder ``--source`` /
``--reference``, an ``--output`` / ``--report`` in a missing folder or naming a folder, or both
naming the same file, ends the command with one ``error: argument --NAME: ...`` line (exit 2);
so does a source or reference that is not UTF-8 (the file, line and byte named).

Prints the cased BLEU with sacrebleu's signature (the line to publish: it pins the tokenizer,
smoothing and version), the lowercased BLEU, and the exact-match rate; writes the hypotheses
(``--output``) and a JSON record of the scores and decoding settings (``--report``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from etils import epath

from flaxformer_lite.cli.translate import (
    add_decoding_flags,
    check_decoding_flags,
    check_paths,
    generation_from_flags,
    load_translator,
    plain_warnings,
    read_input,
    write_lines,
)
from flaxformer_lite.core import paths


def bleu_report(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, object]:
    """Cased and lowercased corpus BLEU (sacrebleu defaults: 13a tokenizer, exp smoothing).

    Returns ``{"bleu", "signature", "bleu_lowercase", "signature_lowercase", "exact_match",
    "num_sentences"}``; the BLEU values are sacrebleu ``BLEUScore`` objects (``.score``).
    """
    from sacrebleu.metrics import BLEU

    cased, lower = BLEU(), BLEU(lowercase=True)
    refs = [list(references)]
    hyps = list(hypotheses)
    matches = sum(h == r for h, r in zip(hyps, references, strict=True))
    return {
        "bleu": cased.corpus_score(hyps, refs),
        "signature": str(cased.get_signature()),
        "bleu_lowercase": lower.corpus_score(hyps, refs),
        "signature_lowercase": str(lower.get_signature()),
        "exact_match": matches / max(len(hyps), 1),
        "num_sentences": len(hyps),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.cli.evaluate",
        description="Translate a source file and score it against references with sacrebleu.",
    )
    add_decoding_flags(parser)
    parser.add_argument("--source", required=True, help="source sentences, one per line")
    parser.add_argument("--reference", required=True, help="references, aligned with --source")
    parser.add_argument("--output", default=None, help="write the hypotheses here")
    parser.add_argument(
        "--report", default=None, help="write the scores and decoding settings here (JSON)"
    )
    return parser


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    parser = parser or make_parser()
    args = parser.parse_args(argv)
    check_decoding_flags(parser, args)
    check_paths(
        parser,
        [("--source", args.source), ("--reference", args.reference)],
        [("--output", args.output), ("--report", args.report)],
    )
    if args.output and args.report and paths.resolve(args.output) == paths.resolve(args.report):
        parser.error(
            f"argument --report: {args.report} is also --output; give the report its own file"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parse_args(argv, parser)
    plain_warnings()

    try:
        sources = read_input(parser, "--source", args.source)
        references = read_input(parser, "--reference", args.reference)
        if len(sources) != len(references):
            raise ValueError(
                f"{args.source} has {len(sources)} lines but {args.reference} has "
                f"{len(references)}: they must be aligned"
            )
        translator = load_translator(args)
        generation = generation_from_flags(args, translator.generation)
        hypotheses = translator.translate(
            sources, generation, batch_size=args.batch_size, seed=args.seed, progress=True
        )
    except (FileNotFoundError, ValueError) as e:  # a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        write_lines(args.output, hypotheses)
    # References are compared as detokenized text, whitespace-normalised as in training.
    report = bleu_report(hypotheses, [" ".join(r.split()) for r in references])
    print(f"{translator.name}: {report['num_sentences']} sentences, method {generation.method}")
    # str(BLEUScore) is "BLEU = 34.80 65.1/40.2/26.9/18.2 (BP = ... ref_len = ...)".
    print(f"cased:      {report['bleu']}")
    print(f"signature:  {report['signature']}")
    print(f"lowercased: {report['bleu_lowercase']}")
    print(f"signature:  {report['signature_lowercase']}")
    print(f"exact match = {100 * report['exact_match']:.2f}%")
    if args.report:
        record = {
            "workdir": args.workdir,
            "ensemble": args.ensemble or [],
            "checkpoint": translator.name,
            "average": len(translator.checkpoint_steps) or args.average,
            "checkpoint_steps": list(translator.checkpoint_steps),
            "method": generation.method,
            "quantize": args.quantize,
            "dtype": translator.config.dtype,
            "beam_size": generation.beam_size,
            "alpha": generation.alpha,
            "generation": generation.to_dict(),
            "source": args.source,
            "reference": args.reference,
            "num_sentences": report["num_sentences"],
            "bleu": round(report["bleu"].score, 2),
            "bleu_detail": str(report["bleu"]),
            "signature": report["signature"],
            "bleu_lowercase": round(report["bleu_lowercase"].score, 2),
            "bleu_lowercase_detail": str(report["bleu_lowercase"]),
            "signature_lowercase": report["signature_lowercase"],
            "exact_match": report["exact_match"],
        }
        epath.Path(args.report).write_bytes((json.dumps(record, indent=2) + "\n").encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
