"""Decoding with a cache wider than the sentences: attention over the written prefix, against
the whole cache and against CTranslate2, on identical weights, interleaved in one process.

A translation's decoding width is fixed before it starts: a Hugging Face folder's
``max_length`` (512 for opus-mt, so 511 new tokens), the model's ``max_len``, or 1.5 x the
source + 10. The sentences end long before (here: every row at 32 new tokens,
``row_max_len``, the way EOS ends them). CTranslate2 and ``generate`` grow their caches with
the tokens; ours is allocated at the width, and each step's self-attention reads only the
prefix that holds the slots written so far (``kv_cache.over_written_prefix``: 32, 64, ... up
to half the cache, then the whole). ``whole`` is the same program with one prefix, the whole
cache (what every step read before), by ``kv_cache.PREFIX_FRACTION`` set out of reach while it
is traced.

The model is ``translate_speed.py``'s (opus-mt size, random weights shared by every system,
EOS and pad kept out of every output by their logits bias), 24 source tokens, 32 new tokens:

    .venv/bin/python bench/written_prefix.py --widths 32 128 511 --batches 32 1 --rounds 3

Prints per cell the new tokens per second of CTranslate2 float32 (32 new tokens at most) and
of ours at each width, with and without the prefix; writes bench/results/written_prefix.json.
Needs the bench extra (ctranslate2, torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from translate_speed import FULL, METHODS, RESULTS, batch_mesh, build_models, cpu_flags  # noqa: E402

from flaxformer_lite.decoding.generate import generate_jit, place_params  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.ops import kv_cache  # noqa: E402

NEW_TOKENS = 32


def compile_ours(params, config, src, limits, mesh, beams: int, width: int, whole: bool):
    """``generate_jit`` compiled for ``width`` new tokens at most, rows ending at ``limits``;
    ``whole``: every step over the whole cache (one prefix)."""
    fraction = kv_cache.PREFIX_FRACTION
    kv_cache.PREFIX_FRACTION = 10**9 if whole else fraction
    jax.clear_caches()  # the tracing cache does not see the module constant
    try:
        return generate_jit.lower(
            params, config, src, mesh=mesh, method="greedy" if beams == 1 else "beam",
            max_len=width, beam_size=beams, alpha=0.0, row_max_len=limits,
        ).compile()  # fmt: skip
    finally:
        kv_cache.PREFIX_FRACTION = fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", nargs="+", type=int, default=[32, 128, 511])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 1])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    parser.add_argument("--out", type=Path, default=RESULTS / "written_prefix.json")
    args = parser.parse_args()
    if min(args.widths) < NEW_TOKENS:
        raise SystemExit(f"--widths must be at least {NEW_TOKENS} (the new tokens)")

    import ctranslate2

    threads = os.cpu_count() or 1
    settings = dict(FULL, batches=tuple(args.batches), new_tokens=(NEW_TOKENS,))
    rows, rng = [], np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        _, config, params, ct2_dir, vocab = build_models(settings, max(args.widths), Path(tmp))
        ct2 = ctranslate2.Translator(
            str(ct2_dir), device="cpu", compute_type="float32", intra_threads=threads
        )
        index = {t: i for i, t in enumerate(vocab)}
        for batch in args.batches:
            src = rng.integers(2, config.pad_id, size=(batch, settings["source_len"]))
            src[:, -1] = config.eos_id
            src = src.astype(np.int32)
            src_tokens = [[vocab[i] for i in row] for row in src]
            limits = np.full((batch,), NEW_TOKENS, np.int32)
            mesh = batch_mesh(batch)
            placed = place_params(params, EncoderDecoder, config, mesh)
            for method in args.methods:
                beams = METHODS[method]
                compiled = {}
                for width in args.widths:
                    for whole in (False, True) if kv_cache.prefix_widths(width)[:-1] else (False,):
                        name = f"ours-{width}" + ("-whole" if whole else "")
                        compiled[name] = compile_ours(
                            placed, config, src, limits, mesh, beams, width, whole
                        )

                def run_ours(name, compiled=compiled, src=src, limits=limits, placed=placed):
                    tokens, _ = compiled[name](placed, src, row_max_len=limits)
                    return np.asarray(jax.block_until_ready(tokens))[..., :NEW_TOKENS]

                def run_ct2(src_tokens=src_tokens, beams=beams):
                    out = ct2.translate_batch(
                        src_tokens, beam_size=beams, max_decoding_length=NEW_TOKENS,
                        min_decoding_length=0, max_batch_size=0,
                    )  # fmt: skip
                    return np.array([[index[t] for t in r.hypotheses[0]] for r in out])

                runners = {"ct2-float32": run_ct2}
                runners.update({name: (lambda n=name: run_ours(n)) for name in compiled})
                names = tuple(runners)
                outputs = {name: runners[name]() for name in names}  # warm-up
                times = {name: [] for name in names}
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        start = time.perf_counter()
                        outputs[name] = runners[name]()
                        times[name].append(time.perf_counter() - start)
                row = dict(method=method, batch=batch, new_tokens=NEW_TOKENS)
                for name in names:
                    assert outputs[name].shape == (batch, NEW_TOKENS), (name, outputs[name].shape)
                    row[f"{name}_tok_s"] = batch * NEW_TOKENS / statistics.median(times[name])
                    row[f"{name}_per_round_s"] = times[name]
                    row[f"{name}_agreement_ct2"] = float(
                        (outputs[name] == outputs["ct2-float32"]).mean()
                    )
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if "round" not in k}), flush=True)

    print("| search | batch | width | CT2 float32 tok/s | ours tok/s | ours, whole cache tok/s "
          "| ours / CT2 | prefix / whole | tokens equal to CT2 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ct2_speed = row["ct2-float32_tok_s"]
        for width in args.widths:
            ours = row[f"ours-{width}_tok_s"]
            whole = row.get(f"ours-{width}-whole_tok_s")
            print(
                f"| {row['method']} | {row['batch']} | {width} | {ct2_speed:,.0f} | {ours:,.0f} "
                f"| {'-' if whole is None else f'{whole:,.0f}'} | {ours / ct2_speed:.2f} "
                f"| {'-' if whole is None else f'{ours / whole:.2f}'} "
                f"| {row[f'ours-{width}_agreement_ct2']:.3f} |"
            )
    meta = dict(
        machine=cpu_flags(),
        jax=jax.__version__,
        ctranslate2=ctranslate2.__version__,
        widths=args.widths,
        rounds=args.rounds,
        prefix_fraction=kv_cache.PREFIX_FRACTION,
        smallest_prefix=kv_cache.SMALLEST_PREFIX,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
