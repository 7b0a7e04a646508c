"""Translate a file (or stdin) with a trained workdir, one output line per input line.

    python -m flaxformer_lite.cli.translate --workdir runs/m30k --input test.en --output test.hyp
    python -m flaxformer_lite.cli.translate --workdir gs://BUCKET/run --input gs://BUCKET/test.en \
        --output gs://BUCKET/test.hyp
    echo "A dog runs." | python -m flaxformer_lite.cli.translate --workdir runs/m30k --method greedy

Lines are split on "\\n" only, so output line i always translates input line i; an empty input
line gives an empty output line. All of stdin is read before decoding starts (sentences are
batched by length).

Flags are checked before the model is loaded: an ``--input`` that is missing or a folder, an
``--output`` in a folder that does not exist or that is itself a folder, or a decoding option
out of range ends the command at once with one ``error: argument --NAME: ...`` line (exit 2),
nothing read or written. An input that is not UTF-8 ends it the same way, naming the file (or
stdin), the line and the byte (a file is read before the model is loaded, stdin after).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.decoding.generation_config import METHODS, GenerationConfig
from flaxformer_lite.inference.translator import Translator


class NotUtf8Error(ValueError):
    """A text input holds bytes that are not UTF-8 (the message names the file, line and byte)."""


def decode_utf8(data: bytes, name: str) -> str:
    """``data`` decoded as UTF-8; else :class:`NotUtf8Error` naming ``name`` (the file), the
    line (1-based, counting "\\n") and the first bad byte's position in it (1-based)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)  # rfind: -1 on the first line
        raise NotUtf8Error(
            f"{name} line {line}: byte {column} (0x{data[e.start]:02x}) is not UTF-8; convert "
            "the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_lines(path: str | None) -> list[str]:
    """Lines of ``path`` (local or ``gs://``; stdin for None or "-"), split on "\\n" only,
    without the newline. Raises :class:`NotUtf8Error` on bytes that are not UTF-8.

    Universal newlines would also split on "\\r", U+2028, U+0085 ... inside a sentence and
    shift every later output line against its input.
    """
    if path in (None, "-"):
        text = decode_utf8(sys.stdin.buffer.read(), "stdin")
    else:
        text = decode_utf8(epath.Path(path).read_bytes(), path)
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


def input_file_problem(path: str | None) -> str | None:
    """Why ``path`` cannot be read as a text file (None or "-" = stdin: fine), else None."""
    if path in (None, "-"):
        return None
    file = paths.resolve(path)
    if file.is_dir():
        return f"{path} is a folder; give a text file, one sentence per line (or - for stdin)"
    if not file.is_file():
        return f"{path} does not exist; give a text file, one sentence per line"
    return None


def output_file_problem(path: str | None) -> str | None:
    """Why ``path`` cannot be written as a file (None or "-" = stdout: fine), else None.

    A local file needs an existing parent folder; a URI's "folder" exists with its objects
    (``paths.makedirs``), so only a URI naming an existing folder is refused.
    """
    if path in (None, "-"):
        return None
    file = paths.resolve(path)
    if file.is_dir():
        return f"{path} is a folder; give a file name"
    if not paths.is_uri(path) and not file.parent.is_dir():
        return f"folder {file.parent} does not exist; create it or write elsewhere"
    return None


def check_decoding_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit 2, one line naming the flag) on a decoding flag out of range."""
    checks = [
        ("--step", args.step, args.step is None or args.step >= 0, "an int >= 0"),
        ("--average", args.average, args.average is None or args.average >= 1, "an int >= 1"),
        (
            "--beam_size",
            args.beam_size,
            args.beam_size is None or args.beam_size >= 1,
            "an int >= 1",
        ),
        ("--batch_size", args.batch_size, args.batch_size >= 1, "an int >= 1"),
        ("--max_len", args.max_len, args.max_len is None or args.max_len >= 1, "an int >= 1"),
        ("--temperature", args.temperature, args.temperature >= 0, "a number >= 0"),
        ("--top_k", args.top_k, args.top_k >= 0, "an int >= 0 (0: off)"),
        ("--top_p", args.top_p, 0 < args.top_p <= 1, "a number in (0, 1] (1: off)"),
    ]
    for flag, value, ok, valid in checks:
        if not ok:  # also NaN for the float flags
            parser.error(f"argument {flag}: must be {valid}; got {value}")


def check_paths(
    parser: argparse.ArgumentParser,
    inputs: Sequence[tuple[str, str | None]],
    outputs: Sequence[tuple[str, str | None]],
) -> None:
    """``parser.error`` (exit 2, one line naming the flag) on the first (flag, path) of
    ``inputs`` that cannot be read or of ``outputs`` that cannot be written."""
    for flag, path in inputs:
        if problem := input_file_problem(path):
            parser.error(f"argument {flag}: {problem}")
    for flag, path in outputs:
        if problem := output_file_problem(path):
            parser.error(f"argument {flag}: {problem}")


def read_input(parser: argparse.ArgumentParser, flag: str, path: str | None) -> list[str]:
    """:func:`read_lines` of ``path``; an input that is not UTF-8 is ``parser.error`` (exit 2,
    one line naming ``flag``, the file, the line and the byte)."""
    try:
        return read_lines(path)
    except NotUtf8Error as e:
        parser.error(f"argument {flag}: {e}")


def plain_warnings() -> None:
    """Prints warnings as ``warning: message`` lines: a CLI user needs the message (e.g. how
    many lines were truncated), not the library line that raised it."""
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """--workdir, --step, --average and the decoding options of the translate and evaluate CLIs."""
    parser.add_argument(
        "--workdir",
        required=True,
        help="train.py workdir to load, or a Hugging Face encoder-decoder folder or hub id "
        "(Marian, BART, mBART, ...: with its tokenizer)",
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--ensemble",
        nargs="+",
        default=None,
        metavar="WORKDIR",
        help="more workdirs of the same architecture and vocabulary (e.g. other seeds), decoded "
        "with --workdir as one ensemble: the mean of their next-token probabilities at every "
        "step; each loads its latest checkpoint with --average",
    )
    parser.add_argument(
        "--average",
        type=int,
        default=None,
        help="average the parameters of this many last checkpoints up to --step (default: "
        "the run's config.average_checkpoints, else 1)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default=None,
        help="decoding method (default: beam; a Hugging Face folder: its generate's, greedy "
        "unless num_beams > 1)",
    )
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
        help="most tokens to generate (default: min(model max_len, 1.5 * source + 10); a "
        "Hugging Face folder: its max_length)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top_k", type=int, default=0, help="sampling: keep the k best (0: off)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sampling: nucleus mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--quantize",
        choices=["int8"],
        default=None,
        help="int8: decode with int8 weights and activations (default: float)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="store the weights and compute the matmuls in this dtype (default: the model's)",
    )


def load_translator(args: argparse.Namespace) -> Translator:
    """The Translator the flags name: ``--workdir`` at ``--step`` (``--average``,
    ``--quantize``, ``--dtype``), or, with ``--ensemble``, the ensemble of it and those
    workdirs (``Translator.ensemble``)."""
    options = dict(average=args.average, quantize=args.quantize, dtype=args.dtype)
    translator = Translator.from_pretrained(args.workdir, step=args.step, **options)
    if not args.ensemble:
        return translator
    others = [Translator.from_pretrained(w, **options) for w in args.ensemble]
    return Translator.ensemble([translator, *others])


def generation_from_flags(args: argparse.Namespace, default: GenerationConfig) -> GenerationConfig:
    """The GenerationConfig the decoding flags ask for: ``default`` (the model's, e.g.
    ``Translator.generation``) with ``--method``, ``--beam_size``, ``--alpha`` and
    ``--max_len`` where given, and the sampling flags ``--temperature``, ``--top_k`` and
    ``--top_p``."""
    given = dict(
        method=args.method, beam_size=args.beam_size, alpha=args.alpha, max_len=args.max_len
    )
    fields = {k: v for k, v in given.items() if v is not None}
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return default.replace(**fields, **sampling)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.cli.translate",
        description="Translate sentences (one per line) with a trained flaxformer_lite workdir.",
    )
    add_decoding_flags(parser)
    parser.add_argument("--input", default=None, help="source file (default: stdin)")
    parser.add_argument("--output", default=None, help="output file (default: stdout)")
    return parser


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    parser = parser or make_parser()
    args = parser.parse_args(argv)
    check_decoding_flags(parser, args)
    check_paths(parser, [("--input", args.input)], [("--output", args.output)])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parse_args(argv, parser)
    plain_warnings()

    # A file is read (a bad one refused) before the model loads; stdin after, so that a bad
    # --workdir is reported at once rather than after the user has typed the input.
    stdin = args.input in (None, "-")
    try:
        sentences = None if stdin else read_input(parser, "--input", args.input)
        translator = load_translator(args)
        if stdin:
            sentences = read_input(parser, "--input", args.input)
        outputs = translator.translate(
            sentences,
            generation_from_flags(args, translator.generation),
            batch_size=args.batch_size,
            seed=args.seed,
            progress=args.input not in (None, "-"),
        )
    except (FileNotFoundError, ValueError) as e:  # a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_lines(args.output, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
