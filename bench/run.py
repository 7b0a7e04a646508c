"""All benchmarks in one process, one after the other; writes bench/results/latest.{json,md}.

    .venv/bin/python bench/run.py --quick   # a few minutes on 2 CPU cores
    .venv/bin/python bench/run.py

Runs bench/train_step.py (flaxformer_lite vs PyTorch nn.Transformer, MFU, compile time),
bench/decode.py (KV cache vs recomputation, beam 4 vs greedy) and bench/attention_memory.py
(blockwise vs reference attention: memory and time against sequence length, with a PNG).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import attention_memory  # noqa: E402
import decode  # noqa: E402
import train_step  # noqa: E402

RESULTS = HERE / "results"


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    flag = ["--quick"] if quick else []
    suffix = "_quick" if quick else ""
    sections = [
        ("Train step vs PyTorch", train_step, f"train_step{suffix}.json"),
        ("Decoding", decode, f"decode{suffix}.json"),
        ("Attention memory", attention_memory, "attention_memory.json"),
    ]
    latest, markdown = {"quick": quick}, []
    for title, module, output in sections:
        sys.argv = [module.__file__, *flag]
        module.main()
        result = json.loads((RESULTS / output).read_text())
        latest[module.__name__] = result
        table = result.get("table") or module.markdown_table(result["rows"])
        markdown.append(f"## {title}\n\n{table}\n")
    (RESULTS / "latest.json").write_text(json.dumps(latest, indent=2))
    (RESULTS / "latest.md").write_text("\n".join(markdown))
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
