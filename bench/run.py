"""All benchmarks in one process, one after the other; writes bench/results/latest.{json,md}
(latest_quick.{json,md} with --quick).

    .venv/bin/python bench/run.py --quick   # under 3 minutes on 2 idle CPU cores
    .venv/bin/python bench/run.py

Runs bench/train_step.py (flaxformer_lite vs PyTorch nn.Transformer, MFU, compile time),
bench/levers.py (the train step's levers one at a time: fused q/k/v, donation, scan over
layers, remat, masks as bias, padding), bench/decode.py (KV cache vs recomputation, beam 4 vs
greedy, PyTorch naive greedy) and bench/attention_memory.py (blockwise vs reference attention:
memory and time against sequence length, with a PNG). ``--quick`` passes ``--quick`` to each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import attention_memory  # noqa: E402
import decode  # noqa: E402
import levers  # noqa: E402
import train_step  # noqa: E402

RESULTS = HERE / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="every script's --quick: a short smoke run"
    )
    quick = parser.parse_args().quick
    flag = ["--quick"] if quick else []
    suffix = "_quick" if quick else ""
    sections = [
        ("Train step vs PyTorch", train_step, f"train_step{suffix}.json"),
        ("Train-step levers", levers, f"levers{suffix}.json"),
        ("Decoding", decode, f"decode{suffix}.json"),
        ("Attention memory", attention_memory, f"attention_memory{suffix}.json"),
    ]
    latest, markdown, seconds = {"quick": quick}, [], {}
    argv = sys.argv
    start = time.perf_counter()
    for title, module, output in sections:
        t0 = time.perf_counter()
        sys.argv = [module.__file__, *flag]
        try:
            module.main()
        finally:
            sys.argv = argv
        seconds[module.__name__] = time.perf_counter() - t0
        result = json.loads((RESULTS / output).read_text())
        latest[module.__name__] = result
        table = result.get("table") or module.markdown_table(result["rows"])
        markdown.append(f"## {title}\n\n{table}\n")
    seconds["total"] = time.perf_counter() - start
    latest["wall_seconds"] = seconds
    timing = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    markdown.append(f"Wall time: {timing}.\n")
    # --quick writes latest_quick.*: a smoke run never overwrites the full tables.
    (RESULTS / f"latest{suffix}.json").write_text(json.dumps(latest, indent=2))
    (RESULTS / f"latest{suffix}.md").write_text("\n".join(markdown))
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
