"""Translate a file (or stdin) with a trained workdir, one output line per input line.

    python -m flaxformer_lite.translate --workdir runs/m30k --input test.en --output test.hyp
    python -m flaxformer_lite.translate --workdir gs://BUCKET/run --input gs://BUCKET/test.en \
        --output gs://BUCKET/test.hyp
    echo "A dog runs." | python -m flaxformer_lite.translate --workdir runs/m30k --method greedy

Lines are split on "\\n" only, so output line i always translates input line i; an empty input
line gives an empty output line. All of stdin is read before decoding starts (sentences are
batched by length).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from etils import epath

from flaxformer_lite.generate import METHODS
from flaxformer_lite.inference import Translator


def read_lines(path: str | None) -> list[str]:
    """Lines of ``path`` (local or ``gs://``; stdin for None or "-"), split on "\\n" only,
    without the newline.

    Universal newlines would also split on "\\r", U+2028, U+0085 ... inside a sentence and
    shift every later output line against its input.
    """
    if path in (None, "-"):
        text = sys.stdin.buffer.read().decode("utf-8")
    else:
        text = epath.Path(path).read_bytes().decode("utf-8")
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":  # the final newline ends the last line; it does not start a new one
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def write_lines(path: str | None, lines: Sequence[str]) -> None:
    """Writes one line per entry to ``path`` (local or ``gs://``; stdout for None or "-");
    newlines inside an entry become spaces so the line count always matches."""
    text = "".join(" ".join(line.split("\n")) + "\n" for line in lines)
    if path in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        epath.Path(path).write_bytes(text.encode("utf-8"))


def plain_warnings() -> None:
    """Prints warnings as ``warning: message`` lines: a CLI user needs the message (e.g. how
    many lines were truncated), not the library line that raised it."""
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """--workdir, --step, --average and the decoding options of the translate and evaluate CLIs."""
    parser.add_argument("--workdir", required=True, help="train.py workdir to load")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--average",
        type=int,
        default=1,
        help="average the parameters of this many last checkpoints up to --step (default 1)",
    )
    parser.add_argument("--method", choices=METHODS, default="beam", help="decoding method")
    parser.add_argument(
        "--beam_size", type=int, default=None, help="beams (default: the run's config, else 4)"
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="GNMT length penalty exponent (default: the run's config, else 0.6)",
    )
    parser.add_argument("--batch_size", type=int, default=64, help="sentences per batch")
    parser.add_argument(
        "--max_len",
        type=int,
        default=None,
        help="most tokens to generate (default: min(model max_len, 1.5 * source + 10))",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top_k", type=int, default=0, help="sampling: keep the k best (0: off)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sampling: nucleus mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")


def decoding_kwargs(args: argparse.Namespace) -> dict:
    """The ``Translator.translate`` keyword arguments from parsed flags."""
    return dict(
        method=args.method,
        beam_size=args.beam_size,
        alpha=args.alpha,
        batch_size=args.batch_size,
        max_len=args.max_len,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.translate",
        description="Translate sentences (one per line) with a trained flaxformer_lite workdir.",
    )
    add_decoding_flags(parser)
    parser.add_argument("--input", default=None, help="source file (default: stdin)")
    parser.add_argument("--output", default=None, help="output file (default: stdout)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plain_warnings()

    try:
        translator = Translator.from_workdir(args.workdir, step=args.step, average=args.average)
        sentences = read_lines(args.input)
        outputs = translator.translate(
            sentences, progress=args.input not in (None, "-"), **decoding_kwargs(args)
        )
    except (FileNotFoundError, ValueError) as e:  # a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_lines(args.output, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
