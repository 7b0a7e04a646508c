"""Input pipeline start-up: time to the first training batch and peak host memory per process.

A synthetic parallel corpus (``--pairs``, default 1,000,000 pairs; random "words" of a fixed
5,000-word lexicon, 4 to 40 words a sentence, the target a word-by-word mapping of the
source) is written once to local text files. Each measured run is a fresh Python process (or
two) that builds the WMT14-style translation data (shared SentencePiece vocabulary of 8,000
pieces, max_len 128, length buckets, 25,000 tokens per batch) and takes its first training
batch; it reports its wall time from interpreter start-up to that batch (imports included),
the part of it spent building the data (``data_s``: after the imports and, for 2 processes,
``jax.distributed`` start-up), and its peak resident memory (``ru_maxrss``).

The vocabulary is trained once, before the runs, on the first 20,000 pairs (SentencePiece
on the whole corpus would dominate everything and is the same cost before and after, on
process 0 only after), and copied into every workdir, so that every run measures reading,
tokenizing and batching.

* before: the code of another checkout (``--before /work/main``: PYTHONPATH points there):
  every process reads and tokenizes the whole corpus, no cache. Two processes are two plain
  processes (that code needs no ``jax.distributed``).
* after: this checkout. ``cold``: an empty workdir (process 0 tokenizes once into the token
  cache, the other waits at the barrier); ``warm``: the cache exists (a resumed run, or any
  host after the first start). Two processes are a real 2-process ``jax.distributed`` run
  on localhost.

    .venv/bin/python bench/input_pipeline.py --before /work/main          # 1M pairs
    .venv/bin/python bench/input_pipeline.py --quick --before /work/main  # 100k pairs

Writes bench/results/input_pipeline.json and .md (``_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
START = time.time()

CONFIG = {
    "dataset": None,
    "dataset_config": None,
    "data_format": "parallel_text",
    "source_lang": "en",
    "target_lang": "de",
    "train_split": "train",
    "eval_split": "val",
    "vocab_size": 8000,
    "shared_vocab": True,
    "spm_model_type": "unigram",
    "max_len": 128,
    "too_long": "truncate",
    "tokens_per_batch": 25000,
    "batch_size_multiple": 8,
    "packing": False,
    "streaming": False,
    "seed": 0,
}


def write_corpus(directory: Path, pairs: int) -> None:
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    mapped = [w[::-1] + "e" for w in lexicon]
    for split, n in (("train", pairs), ("val", 1000)):
        with (
            open(directory / f"{split}.en", "w", encoding="utf-8") as en,
            open(directory / f"{split}.de", "w", encoding="utf-8") as de,
        ):
            for start in range(0, n, 100_000):
                count = min(100_000, n - start)
                lengths = rng.integers(4, 41, size=count)
                words = rng.zipf(1.3, size=int(lengths.sum())) % 5000
                src, tgt, offset = [], [], 0
                for length in lengths.tolist():
                    ids = words[offset : offset + length].tolist()
                    offset += length
                    src.append(" ".join(lexicon[i] for i in ids))
                    tgt.append(" ".join(mapped[i] for i in ids))
                en.write("\n".join(src) + "\n")
                de.write("\n".join(tgt) + "\n")


def worker(args: argparse.Namespace) -> None:
    """One measured process: build the data, take the first batch, print one JSON line."""
    import types

    import jax

    if args.num_processes > 1 and args.distributed:
        from flaxformer_lite.core import sharding

        sharding.initialize_distributed(args.address, args.num_processes, args.process_id)
    from flaxformer_lite.data.tasks import translation as translation_task

    config = types.SimpleNamespace(**CONFIG, data_dir=args.data_dir)
    build_start = time.time()
    built = translation_task.build_translation_data(
        config, args.workdir, process_index=args.process_id, process_count=args.num_processes
    )
    batch = built.train.next()
    seconds = time.time() - START
    print(
        "RESULT "
        + json.dumps(
            {
                "process": args.process_id,
                "startup_s": round(seconds, 2),
                "data_s": round(time.time() - build_start, 2),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "first_batch_shape": list(batch["targets"].shape),
                "kept": built.stats.num_kept,
                "jax_processes": jax.process_count(),
            }
        ),
        flush=True,
    )


def old_first_fit_rows(in_len, tgt_len, length):
    """The packer's row choice before (a scan of every open row per example)."""
    import numpy as np

    n = len(in_len)
    in_fill, tgt_fill = np.zeros(n, np.int64), np.zeros(n, np.int64)
    open_rows, rows = 0, np.empty(n, np.int64)
    for i in range(n):
        fits = (in_fill[:open_rows] + in_len[i] <= length) & (
            tgt_fill[:open_rows] + tgt_len[i] <= length
        )
        row = int(np.argmax(fits)) if fits.any() else open_rows
        open_rows += row == open_rows
        in_fill[row] += in_len[i]
        tgt_fill[row] += tgt_len[i]
        rows[i] = row
    return rows


def packing_bench(workdir: Path) -> dict:
    """First-fit row choice on the token cache's real lengths (rows of max_len): the old
    scan against the new pointers, at sizes where the old one still ends."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from flaxformer_lite.data.packing import first_fit_rows

    (cache,) = (workdir / "data_cache").iterdir()
    in_len = np.diff(np.load(cache / "inputs_offsets.npy"))
    tgt_len = np.diff(np.load(cache / "targets_offsets.npy"))
    order = np.random.default_rng(0).permutation(len(in_len))
    in_len, tgt_len = in_len[order], tgt_len[order]
    out = {}
    for n in (20_000, 100_000, len(in_len)):
        t = time.time()
        new = first_fit_rows(in_len[:n], tgt_len[:n], CONFIG["max_len"])
        out[f"new_{n}_s"] = round(time.time() - t, 2)
        if n <= 20_000:
            t = time.time()
            old = old_first_fit_rows(in_len[:n], tgt_len[:n], CONFIG["max_len"])
            out[f"old_{n}_s"] = round(time.time() - t, 2)
            assert (old == new).all()
        print(out, flush=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(code: Path, workdir: Path, data_dir: Path, processes: int, distributed: bool):
    env = {**os.environ, "PYTHONPATH": str(code), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--workdir",
                str(workdir),
                "--data_dir",
                str(data_dir),
                "--process_id",
                str(i),
                "--num_processes",
                str(processes),
                "--address",
                address,
                *(["--distributed"] if distributed else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd="/tmp",
        )  # fmt: skip
        for i in range(processes)
    ]
    results = []
    for p in procs:
        out = p.communicate(timeout=1200)[0]
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"worker failed ({p.returncode}):\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 pairs")
    parser.add_argument("--before", default=None, help="checkout with the old code")
    parser.add_argument("--dir", default="/tmp/flaxformer_input_bench")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workdir")
    parser.add_argument("--data_dir")
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--address")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument(
        "--packing", action="store_true", help="only: first-fit timing on the cached lengths"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    pairs = 100_000 if args.quick else args.pairs
    base = Path(args.dir)
    if args.packing:
        name = "input_pipeline_packing" + ("_quick" if args.quick else "")
        record = {"pairs": pairs, "max_len": CONFIG["max_len"], "load_average_before": list(
            os.getloadavg()), **packing_bench(base / "work_after_1")}  # fmt: skip
        (HERE / "results" / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        return
    data_dir = base / f"corpus_{pairs}"
    if not (data_dir / "val.de").is_file():
        t = time.time()
        write_corpus(data_dir, pairs)
        print(f"wrote {pairs:,} pairs to {data_dir} in {time.time() - t:.0f} s", flush=True)
    sys.path.insert(0, str(ROOT))
    from flaxformer_lite.data.reading import iter_pairs
    from flaxformer_lite.data.tokenizer import Tokenizer

    vocab = base / f"spm_{pairs}.model"
    spm_seconds = None
    if not vocab.is_file():
        t = time.time()
        sample = itertools.islice(
            iter_pairs(data_dir=str(data_dir), split="train", source_lang="en", target_lang="de"),
            20_000,
        )
        Tokenizer.train((s for pair in sample for s in pair), str(vocab), CONFIG["vocab_size"])
        spm_seconds = round(time.time() - t, 1)
        print(f"SentencePiece on the first 20,000 pairs: {spm_seconds} s", flush=True)

    runs = []
    plan = [("after", ROOT, 1, "cold"), ("after", ROOT, 1, "warm"),
            ("after", ROOT, 2, "cold"), ("after", ROOT, 2, "warm")]  # fmt: skip
    if args.before:
        plan = [("before", Path(args.before), 1, "-"), ("before", Path(args.before), 2, "-")] + plan
    workdirs: dict[int, Path] = {}
    for label, code, processes, state in plan:
        if state in ("cold", "-"):
            workdir = base / f"work_{label}_{processes}"
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            shutil.copy(vocab, workdir / "spm_shared.model")
            workdirs[processes] = workdir
        t = time.time()
        results = measure(code, workdirs[processes], data_dir, processes, label == "after")
        row = {
            "code": label,
            "processes": processes,
            "cache": state,
            "wall_s": round(time.time() - t, 1),
            "per_process": results,
        }
        runs.append(row)
        print(json.dumps(row), flush=True)

    load = os.getloadavg()
    record = {
        "pairs": pairs,
        "config": CONFIG,
        "sentencepiece_training_s_first_20k_pairs": spm_seconds,
        "runs": runs,
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "load_average_after": [round(x, 1) for x in load],
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    name = "input_pipeline_quick" if args.quick else "input_pipeline"
    out = HERE / "results"
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"Input pipeline start-up, {pairs:,} pairs ({record['date']}, {record['machine']['cpu']}, "
        f"{os.cpu_count()} cores, load average after {record['machine']['load_average_after']})",
        "",
        "| code | processes | token cache | start-up s (each process) | of which data s | "
        "peak RSS MiB (each) |",
        "|---|---:|---|---|---|---|",
    ]
    for r in runs:
        times = " / ".join(f"{p['startup_s']:.1f}" for p in r["per_process"])
        data_s = " / ".join(f"{p['data_s']:.1f}" for p in r["per_process"])
        rss = " / ".join(f"{p['peak_rss_mib']:,}" for p in r["per_process"])
        lines.append(
            f"| {r['code']} | {r['processes']} | {r['cache']} | {times} | {data_s} | {rss} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
