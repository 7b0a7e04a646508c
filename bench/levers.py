"""Train-step levers, one at a time: each variant of the step as a ratio to our default step.

The model and step of bench/train_step.py (its "small" config: d_model 256, 4 heads, d_ff 1024,
3+3 layers, vocabulary 8192, length 32, batch 64, float32, forward + backward + Adam, dropout
0.1), built with its helpers. All variants are compiled first (``jit(...).lower(...).compile()``,
timed), warmed up once, then timed in interleaved rounds in one process (the order reversed
every other round), so that machine load hits all alike; tok/s is the median over rounds.

* (a) fused_qkv: ``TransformerConfig(fused_qkv=True)``, one projection for q, k and v.
* (b) donation: ``donate_argnums=(0,)`` on the state (the default, as train.py) vs none.
* (c) scan_layers: ``TransformerConfig(scan_layers=True)`` (``nn.scan`` over the layers):
  tok/s and compile time; in the full run also the compile time at 12+12 layers (no run).
* (d) remat: ``TransformerConfig(remat=True)``.
* (e) additive mask bias: the attention masks (boolean, what the library passes) turned into
  a float32 bias of the same shape, ``where(mask, 0, finfo(float32).min)``, built in every
  attention call (per layer) and passed as ``dot_product_attention(..., mask=None,
  bias=bias)``. The models build their masks inside and take no bias, so this swaps, in this
  process and while the step is traced, the ``dot_product_attention`` name that
  flaxformer_lite.nn.attention calls for a wrapper around the public function; nothing in the
  library is edited. Checked: the first step's loss equals the default's.
* (f) padding: a Multi30k-like corpus (29,000 pairs of random tokens, lengths from a fixed
  seed: normal, mean 16, std 6, target correlated 0.8 with source, clipped to 4..56) batched
  with ``batch_by_tokens`` over ``bucket_boundaries(64)`` (the default: buckets) vs
  ``pack_examples`` into rows of 64, both ~4096 tokens per batch, rows a multiple of 8:
  padding share and real (non-PAD) target tokens per second of one epoch, steady state. Each
  batch shape is compiled once (compile time reported apart) and timed in the rounds (half
  the steps: the batches are twice the default's); the epoch time is the sum over its
  batches of the median step time of their shape (the cost of a step depends on its shape,
  not on the tokens).

Variants with the default's parameter tree (b, d, e, f) start from copies of its initial
parameters; a lever whose config field does not exist (yet) is skipped with a note. The
table is the small config's; ``--quick`` is a smoke test of the script (a tiny model:
d_model 128, 1+1 layers, vocabulary 2048, batch 32 x 32; 2 rounds of 1 step; (f) padding
shares of 5,000 pairs, not timed; no 12+12 compile), its numbers are not the table.

    .venv/bin/python bench/levers.py --quick   # ~40-55 s on 2 idle cores (mostly compiling)
    .venv/bin/python bench/levers.py           # small config, 5 rounds: ~4-5 min

Writes bench/results/levers.json (levers_quick.json with --quick) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_step  # noqa: E402  (bench/train_step.py: model, step and batch helpers)

from flaxformer_lite.core.special_ids import EOS_ID, PAD_ID  # noqa: E402
from flaxformer_lite.data.batching import (  # noqa: E402
    batch_by_tokens,
    bucket_boundaries,
    padding_fraction,
    rows_for_length,
)
from flaxformer_lite.data.packing import pack_examples  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn import attention as attention_layer  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

RESULTS = HERE / "results"
SMALL = train_step.CONFIGS["small"]
# --quick only: a smoke test of every code path, fast to compile.
TINY = dict(d_model=128, num_heads=4, d_ff=512, layers=1, vocab=2048, length=32, batch=32)
DEEP_LAYERS = 12
# Padding lever: max_len (bucket_boundaries(max_len), packed row length; >= the longest pair,
# 56), tokens per batch, rows a multiple of 8 (as the library's training configs).
MAX_LEN, TOKENS_PER_BATCH, BATCH_SIZE_MULTIPLE = 64, 4096, 8
MULTI30K_PAIRS = 29_000
FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
LEVER_FIELDS = ("fused_qkv", "scan_layers", "remat")


# ----------------------------------------------------------------------------- variants


@contextlib.contextmanager
def additive_bias_masks():
    """While active, the attention layers pass their boolean mask to the public
    ``dot_product_attention`` as an additive float32 bias of the same shape (built in every
    call, i.e. per layer) and ``mask=None``. Nothing in the library is edited: this swaps, in
    this process, the name flaxformer_lite.nn.attention calls, for the duration of tracing. Yields
    the list of bias shapes built, so that a caller can tell that the swap took effect."""
    original = attention_layer.dot_product_attention
    shapes = []

    def with_bias(query, key, value, mask=None, bias=None, **kwargs):
        if mask is not None:
            additive = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
            bias = additive if bias is None else bias + additive
            shapes.append(tuple(additive.shape))
        return original(query, key, value, None, bias, **kwargs)

    attention_layer.dot_product_attention = with_bias
    try:
        yield shapes
    finally:
        attention_layer.dot_product_attention = original


def flag_variant(field: str) -> tuple[dict | None, str, str | None]:
    """(config overrides flipping boolean ``field`` from its default, label, None), or
    (None, label, why it is skipped) when TransformerConfig has no such field (yet)."""
    if field not in FIELDS:
        return None, field, f"skipped: TransformerConfig has no field {field!r} (yet)"
    flipped = not getattr(TransformerConfig(), field)
    return {field: flipped}, f"{field}={flipped}", None


def build(spec: dict, *, donate=True, bias=False, params=None, **overrides) -> dict:
    """Compiles one variant of the step; returns dict(run, compile_s) or dict(error)."""
    try:
        with additive_bias_masks() if bias else contextlib.nullcontext() as shapes:
            run, compile_s = train_step.ours_step(spec, donate=donate, params=params, **overrides)
    except Exception as e:  # a config field mid-change elsewhere: report, don't crash
        return {"error": f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    if bias and not shapes:
        return {
            "error": "skipped: the layers no longer call flaxformer_lite.nn.attention."
            "dot_product_attention, so masks could not be turned into a bias"
        }
    out = {"run": run, "compile_s": compile_s}
    if bias:
        out["bias_shapes"] = sorted(set(shapes))
    return out


def interleaved(runs: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of every ``runs[name](steps)``, round by round, alternating order."""
    times = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            runs[name](steps)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def first_loss(metrics) -> float:
    return float(metrics["smoothed_kl"]) / max(float(metrics["count"]), 1.0)


def shared_params(spec: dict):
    """The default model's initial parameters on the host: the variants with the same tree
    start from copies of them (one ``model.init`` compilation instead of one per variant)."""
    batch = {k: jnp.asarray(v) for k, v in train_step.make_batch(spec).items()}
    params = train_step.init_params(EncoderDecoder(train_step.ours_config(spec)), batch)
    return jax.tree_util.tree_map(np.asarray, params)


def step_levers(spec: dict, rounds: int, steps: int, params) -> tuple[list[dict], dict]:
    """Rows of levers (a)-(e) and the default row; the default's numbers for later levers."""
    defaults = [f"{f}={getattr(TransformerConfig(), f)}" for f in LEVER_FIELDS if f in FIELDS]
    fused, fused_label, fused_skip = flag_variant("fused_qkv")
    scan, scan_label, scan_skip = flag_variant("scan_layers")
    remat, remat_label, remat_skip = flag_variant("remat")
    skips = {"(a) fused q/k/v": fused_skip, "(c) scan layers": scan_skip, "(d) remat": remat_skip}
    same = {"params": params}  # variants with the default's parameter tree
    # (lever, variant label, config overrides or None to skip, other build options)
    levers = [
        ("default", ", ".join([*defaults, "donation on", "boolean masks"]), {}, same),
        ("(a) fused q/k/v", fused_label, fused, {}),
        ("(b) buffer donation", "off: donate_argnums=()", {}, {"donate": False, **same}),
        ("(c) scan layers", scan_label, scan, {}),
        ("(d) remat", remat_label, remat, same),
        ("(e) masks as bias", "float32 additive bias, built per layer", {}, {"bias": True, **same}),
    ]
    built = {}
    for lever, label, overrides, opts in levers:
        b = {"error": skips[lever]} if overrides is None else build(spec, **opts, **overrides)
        built[lever] = b
        print(
            f"{lever}: {label}: "
            + (b["error"] if "error" in b else f"compiled in {b['compile_s']:.1f} s"),
            flush=True,
        )
    if "error" in built["default"]:
        raise RuntimeError(f"the default step does not build: {built['default']['error']}")
    runs = {k: b["run"] for k, b in built.items() if "run" in b}
    losses = {k: first_loss(run(1)) for k, run in runs.items()}  # warm-up: first step
    times = interleaved(runs, rounds, steps)
    tokens = spec["batch"] * spec["length"]
    default_s = float(np.median(times["default"]))
    default_compile = built["default"]["compile_s"]
    rows = []
    for lever, label, overrides, opts in levers:
        b = built[lever]
        row = {"lever": lever, "variant": label, "overrides": overrides or {}}
        if "error" in b:
            rows.append({**row, "note": b["error"]})
            continue
        s = float(np.median(times[lever]))
        row.update(
            tokens_per_s=tokens / s,
            ratio=default_s / s,
            seconds_per_step=s,
            seconds_per_step_rounds=times[lever],
            compile_s=b["compile_s"],
            compile_ratio=b["compile_s"] / default_compile,
            first_step_loss=losses[lever],
        )
        notes = []
        if lever != "default" and "params" in opts:
            # Same parameters, data and dropout keys as the default: same first loss.
            equal = abs(losses[lever] - losses["default"]) <= 1e-4 * abs(losses["default"])
            row["same_first_loss_as_default"] = equal
            notes.append(
                "first-step loss = default's"
                if equal
                else "WARNING: first-step loss differs from the default's"
            )
        if "bias_shapes" in b:
            row["bias_shapes"] = b["bias_shapes"]
            notes.append(
                "bias shapes " + ", ".join("x".join(map(str, shape)) for shape in b["bias_shapes"])
            )
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows, {"tokens_per_s": tokens / default_s, "compile_s": default_compile}


def deep_compile_rows(spec: dict) -> list[dict]:
    """Compile time of the step at 12+12 layers, scan_layers off vs on (no run)."""
    overrides, label, skip = flag_variant("scan_layers")
    lever = f"(c) scan layers, {DEEP_LAYERS}+{DEEP_LAYERS} layers, compile only"
    if overrides is None:
        print(f"{lever}: {skip}")
        return [{"lever": lever, "variant": label, "note": skip}]
    deep = {**spec, "layers": DEEP_LAYERS}
    rows = []
    for variant, kw in (("default (unrolled layers)", {}), (label, overrides)):
        b = build(deep, **kw)
        row = {"lever": lever, "variant": variant, "overrides": kw, "layers": DEEP_LAYERS}
        row.update({"note": b["error"]} if "error" in b else {"compile_s": b["compile_s"]})
        print(f"{lever}: {variant}: " + row.get("note", f"{row.get('compile_s', 0):.1f} s"))
        rows.append(row)
    if all("compile_s" in r for r in rows):
        rows[1]["compile_ratio"] = rows[1]["compile_s"] / rows[0]["compile_s"]
        rows[0]["compile_ratio"] = 1.0
    return rows


# ----------------------------------------------------------------------------- padding


def multi30k_like(num_pairs: int, vocab: int, seed: int = 0) -> tuple[list[dict], dict]:
    """Translation examples of random tokens (EOS last) with Multi30k-like lengths: normal,
    mean 16, std 6, the target correlated 0.8 with the source, rounded, clipped to 4..56
    (EOS included)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((num_pairs, 2))
    raw = np.stack([z[:, 0], 0.8 * z[:, 0] + 0.6 * z[:, 1]], axis=1) * 6.0 + 16.0
    lengths = np.clip(np.rint(raw), 4, 56).astype(np.int64)
    examples = []
    for src_len, tgt_len in lengths:
        pair = {}
        for side, n in (("inputs", src_len), ("targets", tgt_len)):
            ids = rng.integers(4, vocab, n).astype(np.int32)
            ids[-1] = EOS_ID
            pair[side] = ids
        examples.append(pair)
    stats = {
        "pairs": num_pairs,
        "seed": seed,
        "mean": lengths.mean(0).tolist(),
        "std": lengths.std(0).tolist(),
        "min": lengths.min(0).tolist(),
        "max": lengths.max(0).tolist(),
        "order": ["inputs", "targets"],
    }
    return examples, stats


def shape_key(batch: dict) -> tuple:
    return tuple(sorted((k, v.shape) for k, v in batch.items()))


def padding_rows(
    spec: dict,
    num_pairs: int,
    rounds: int,
    steps: int,
    *,
    max_len: int = MAX_LEN,
    params=None,
    timed: bool = True,
) -> list[dict]:
    """Rows of lever (f): padding shares, and (``timed``) real target tokens per second."""
    examples, length_stats = multi30k_like(num_pairs, spec["vocab"])
    boundaries = bucket_boundaries(max_len)
    pack_rows = rows_for_length(max_len, TOKENS_PER_BATCH, BATCH_SIZE_MULTIPLE)
    variants = {
        "bucketed": (
            batch_by_tokens(
                examples,
                tokens_per_batch=TOKENS_PER_BATCH,
                boundaries=boundaries,
                pad_id=PAD_ID,
                batch_size_multiple=BATCH_SIZE_MULTIPLE,
                seed=0,
            ),
            f"batch_by_tokens, bucket_boundaries({max_len}) = {boundaries}",
        ),
        "packed": (
            pack_examples(
                examples, length=max_len, rows_per_batch=pack_rows, pad_id=PAD_ID, seed=0
            ),
            f"pack_examples, {pack_rows} rows x {max_len}",
        ),
    }
    rows = []
    for name, (batches, how) in variants.items():
        by_shape = {}
        for b in batches:
            by_shape.setdefault(shape_key(b), []).append(b)
        real = sum(int(np.count_nonzero(b["targets"] != PAD_ID)) for b in batches)
        real_in = sum(int(np.count_nonzero(b["inputs"] != PAD_ID)) for b in batches)
        in_pad = 1 - real_in / sum(b["inputs"].size for b in batches)
        pad = padding_fraction(batches, PAD_ID)
        note = (
            f"padding {100 * pad:.0f}% of target positions, {100 * in_pad:.0f}% of inputs; "
            f"{len(batches)} batches in {len(by_shape)} shape(s)"
        )
        rows.append(
            {
                "lever": "(f) padding",
                "variant": f"{name}: {how}",
                "batching": name,
                "real_target_tokens": real,
                "batches": len(batches),
                "target_padding_share": pad,
                "input_padding_share": in_pad,
                "lengths": length_stats,
                "groups": list(by_shape.values()),
                "note": note if timed else f"{note}; --quick: not timed",
            }
        )
    if timed:
        time_padding(rows, {**spec, "length": max_len}, rounds, steps, params)
    for row in rows:
        del row["groups"]
    return rows


def time_padding(rows: list[dict], spec: dict, rounds: int, steps: int, params) -> None:
    """Adds steady-state real target tokens per second (and compile times) to ``rows``."""
    # One model (max_len = spec length) and one state for every shape: only the data changes.
    step, state, _ = train_step.ours_setup(spec, params=params)
    holder = {"state": state}
    runs, counts, compile_s = {}, {}, {}
    for row in rows:
        for group in row["groups"]:
            batch = {k: jnp.asarray(v) for k, v in group[0].items()}
            compiled, seconds = train_step.aot_compile(step, state, batch)
            label = "{} {}x{}".format(row["batching"], *group[0]["targets"].shape)
            compile_s[label], counts[label] = seconds, len(group)

            def run(n, compiled=compiled, batch=batch):
                for _ in range(n):
                    holder["state"], metrics = compiled(holder["state"], batch)
                jax.block_until_ready(metrics["smoothed_kl"])

            runs[label] = run
            print(f"(f) padding, {label}: compiled in {seconds:.1f} s", flush=True)
    for run in runs.values():
        run(1)  # warm-up
    times = interleaved(runs, rounds, steps)
    for row in rows:
        labels = [k for k in runs if k.startswith(row["batching"] + " ")]
        epoch_s = sum(counts[k] * float(np.median(times[k])) for k in labels)
        row.update(
            tokens_per_s=row["real_target_tokens"] / epoch_s,
            epoch_s=epoch_s,
            compile_s=sum(compile_s[k] for k in labels),
            shapes={
                k: {
                    "batches": counts[k],
                    "compile_s": compile_s[k],
                    "seconds_per_step": float(np.median(times[k])),
                    "seconds_per_step_rounds": times[k],
                }
                for k in labels
            },
            note="real target tok/s; " + row["note"],
        )
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["compile_ratio"] = row["compile_s"] / rows[0]["compile_s"]


# ----------------------------------------------------------------------------- output


def markdown_table(rows: list[dict]) -> str:
    def num(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    lines = [
        "| lever | variant | tok/s | vs default | compile s | compile vs default | notes |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lever']} | {r['variant']} | {num(r, 'tokens_per_s', ',.0f')} | "
            f"{num(r, 'ratio', '.2f')}{'x' if 'ratio' in r else ''} | "
            f"{num(r, 'compile_s', '.1f')} | "
            f"{num(r, 'compile_ratio', '.2f')}{'x' if 'compile_ratio' in r else ''} | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny model, 2 rounds, 5,000 pairs, no 12+12 compile",
    )
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 2)")
    ap.add_argument("--pairs", type=int, default=None, help="padding lever corpus size")
    ap.add_argument(
        "--max-len", type=int, default=MAX_LEN, help=f"padding lever max_len (default {MAX_LEN})"
    )
    ap.add_argument("--no-deep", action="store_true", help="skip the 12+12 compile times")
    ap.add_argument("--no-padding", action="store_true", help="skip lever (f)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args()
    spec = TINY if args.quick else SMALL
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (1 if args.quick else 2)
    pairs = args.pairs or (5_000 if args.quick else MULTI30K_PAIRS)
    t_start = time.perf_counter()

    params = shared_params(spec)
    rows, default = step_levers(spec, rounds, steps, params)
    if not args.quick and not args.no_deep:
        rows += deep_compile_rows(spec)
    if not args.no_padding:
        # Its batches hold twice the default's tokens: half the steps per round.
        rows += padding_rows(
            spec,
            pairs,
            rounds,
            max(1, steps // 2),
            max_len=args.max_len,
            params=params,
            timed=not args.quick,
        )

    table = markdown_table(rows)
    device = jax.devices()[0]
    meta = {
        "mode": "quick" if args.quick else "full",
        "spec": spec,
        "rounds": rounds,
        "steps_per_round": steps,
        "default": default,
        "tokens_per_s": "target tokens per second (batch x length); for (f) real (non-PAD) "
        "target tokens of one epoch over its steady-state time",
        "timing": "every variant compiled ahead of time and warmed up, then interleaved "
        "rounds (order reversed every other round); median seconds per step",
        "padding": {
            "max_len": args.max_len,
            "tokens_per_batch": TOKENS_PER_BATCH,
            "batch_size_multiple": BATCH_SIZE_MULTIPLE,
            "pairs": pairs,
        },
        "config_fields_present": {f: f in FIELDS for f in LEVER_FIELDS},
        "jax": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "host": platform.processor() or platform.machine(),
        "wall_s": time.perf_counter() - t_start,
    }
    out = args.out or RESULTS / ("levers_quick.json" if args.quick else "levers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=2) + "\n")
    print()
    print(
        f"Train-step levers, d_model {spec['d_model']}, {spec['layers']}+{spec['layers']} "
        f"layers, vocabulary {spec['vocab']}, batch {spec['batch']} x {spec['length']}, "
        f"float32, {meta['device']}; median of {rounds} interleaved rounds; "
        f"{meta['wall_s']:.0f} s in all."
    )
    print()
    print(table)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
