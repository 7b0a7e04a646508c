"""Float32 vs int8 (``--quantize int8``) translation speed of a trained workdir, one process.

Both translators decode the same source lines (beam search with the run's beam size and alpha,
or greedy) in interleaved rounds (the order alternates, so machine load hits both alike);
prints the median tokens per second (output pieces, EOS excluded) of each and their ratio.
``int8`` multiplies with oneDNN's kernel where it loads (``int8_kernel="auto"``); ``int8-xla`` is
the same int8 model on XLA's int8 dot (the same int32 products: its lines must equal int8's).

    .venv/bin/python bench/quantized_translate.py --workdir runs/m30k \\
        --source ../shared/data/multi30k/test2016.en --lines 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flaxformer_lite.inference.translator import Translator
from flaxformer_lite.ops import onednn_int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--lines", type=int, default=256, help="first N source lines")
    parser.add_argument("--method", default="beam", choices=("beam", "greedy"))
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with open(args.source, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f][: args.lines]
    translators = {
        "float32": Translator.from_workdir(args.workdir),
        "int8": Translator.from_workdir(args.workdir, quantize="int8"),
        "int8-xla": Translator.from_workdir(args.workdir, quantize="int8"),
    }
    translators["int8-xla"].config = translators["int8-xla"].config.replace(int8_kernel="xla")
    kw = dict(method=args.method, batch_size=args.batch_size)
    outputs = {name: t.translate(lines, **kw) for name, t in translators.items()}  # compile
    times = {name: [] for name in translators}
    names = list(translators)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            outputs[name] = translators[name].translate(lines, **kw)
            times[name].append(time.perf_counter() - start)
    vocab = translators["float32"].target_vocab
    result = {}
    for name, outs in outputs.items():
        tokens = sum(len(vocab.encode(o)) for o in outs)
        result[f"{name}_tok_s"] = tokens / statistics.median(times[name])
    result["int8_vs_float32"] = result["int8_tok_s"] / result["float32_tok_s"]
    result["int8_vs_int8_xla"] = result["int8_tok_s"] / result["int8-xla_tok_s"]
    result["int8_kernel"] = "xla" if onednn_int8.unavailable_reason() else "onednn"
    assert outputs["int8"] == outputs["int8-xla"], "the int8 kernels' lines differ"
    result["identical_lines"] = sum(
        a == b for a, b in zip(outputs["float32"], outputs["int8"], strict=True)
    ) / len(lines)
    result.update(lines=len(lines), method=args.method, batch_size=args.batch_size)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
