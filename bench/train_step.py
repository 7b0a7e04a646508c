"""Training-step speed: flaxformer_lite against PyTorch ``nn.Transformer``, interleaved.

Both models have the same size (shared embedding tied to the output projection, sinusoidal
positions, post-LN, ReLU, residual and attention dropout 0.1 as nn.Transformer applies it,
label smoothing 0.1, Adam), the same batch of random
tokens and the same float32 arithmetic; each step is forward + backward + Adam update. The two
are timed in alternating rounds in one process so that machine load hits both alike. Reports
target tokens per second, their ratio, compile time, and MFU: analytic model FLOPs per second
(every matmul, forward x 3 for forward + backward) over the float32 matmul peak of each
framework measured in the same run.

    .venv/bin/python bench/train_step.py --quick      # small config only, under 3 minutes
    .venv/bin/python bench/train_step.py              # small and base

Needs torch (``pip install torch==2.13.0``, the CPU wheel); writes bench/results/train_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from flaxformer_lite import EncoderDecoder, TransformerConfig  # noqa: E402
from flaxformer_lite.training.flops import matmul_peak_flops, train_flops  # noqa: E402

CONFIGS = {
    "small": dict(d_model=256, num_heads=4, d_ff=1024, layers=3, vocab=8192, length=32, batch=64),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, layers=6, vocab=8192, length=32, batch=32),
}


def make_batch(spec, seed=0):
    rng = np.random.default_rng(seed)
    shape = (spec["batch"], spec["length"])
    return {
        "inputs": rng.integers(4, spec["vocab"], shape).astype(np.int32),
        "targets": rng.integers(4, spec["vocab"], shape).astype(np.int32),
    }


# ----------------------------------------------------------------------------- ours


def ours_config(spec, **overrides):
    """The TransformerConfig of ``spec``; ``overrides`` go through ``dataclasses.replace``
    (an unknown field raises TypeError: callers check ``dataclasses.fields`` first)."""
    cfg = TransformerConfig(
        vocab_size=spec["vocab"], d_model=spec["d_model"], num_heads=spec["num_heads"],
        d_ff=spec["d_ff"], num_encoder_layers=spec["layers"], num_decoder_layers=spec["layers"],
        dropout_rate=0.1, attention_dropout_rate=0.1, max_len=spec["length"],
    )  # fmt: skip
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def init_params(model, batch):
    """The model's initial parameters (seed 0), unboxed."""
    params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["targets"])["params"]
    return jax.tree_util.tree_map(lambda x: x, __import__("flax").linen.meta.unbox(params))


def ours_setup(spec, *, donate=True, params=None, **overrides):
    """(jitted train step, initial TrainState, device batch of ``make_batch(spec)``).

    ``params``: initial parameters to copy instead of initialising (same tree as the model's;
    saves the compilation of ``model.init`` when several variants share one tree)."""
    model = EncoderDecoder(ours_config(spec, **overrides))
    tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
    batch = {k: jnp.asarray(v) for k, v in make_batch(spec).items()}
    if params is None:
        params = init_params(model, batch)
    else:  # fresh buffers: the step donates its state
        params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
    state = train.TrainState(
        step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
        rng=jax.random.PRNGKey(0),
    )  # fmt: skip
    step = jax.jit(
        functools.partial(
            train.train_step, model=model, kind="translation", tx=tx, schedule=lambda s: 1e-4,
            label_smoothing=0.1, accum_steps=1, skip_nonfinite=False,
        ),
        donate_argnums=(0,) if donate else (),
    )  # fmt: skip
    return step, state, batch


def aot_compile(jitted, *args):
    """(``jitted.lower(*args).compile()``, its wall time in seconds)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def ours_step(spec, *, donate=True, params=None, **overrides):
    """(run, compile seconds): ``run(n)`` does n train steps on one fixed batch and returns
    the metrics of the last one (blocked on). Options as ``ours_setup``."""
    step, state, batch = ours_setup(spec, donate=donate, params=params, **overrides)
    compiled, compile_s = aot_compile(step, state, batch)
    holder = {"state": state}

    def run(n):
        for _ in range(n):
            holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready(metrics["smoothed_kl"])
        return metrics

    return run, compile_s


# ----------------------------------------------------------------------------- PyTorch


def torch_step(spec):
    import torch
    from torch import nn

    torch.manual_seed(0)
    d, v, n = spec["d_model"], spec["vocab"], spec["length"]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(v, d)
            nn.init.normal_(self.embed.weight, std=d**-0.5)
            self.transformer = nn.Transformer(
                d, spec["num_heads"], spec["layers"], spec["layers"], spec["d_ff"],
                dropout=0.1, batch_first=True,
            )  # fmt: skip
            pos = torch.arange(n)[:, None] / 10000 ** (torch.arange(0, d, 2)[None] / d)
            pe = torch.zeros(n, d)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos), torch.cos(pos)
            self.register_buffer("pe", pe)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(n))

        def forward(self, src, tgt_in):
            e = lambda t: self.embed(t) * math.sqrt(d) + self.pe[: t.shape[1]]  # noqa: E731
            h = self.transformer(e(src), e(tgt_in), tgt_mask=self.causal, tgt_is_causal=True)
            return h @ self.embed.weight.T

    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in make_batch(spec).items()}
    tgt_in = torch.cat([torch.full((spec["batch"], 1), 2), batch["targets"][:, :-1]], 1)

    def run(steps):
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            logits = model(batch["inputs"], tgt_in)
            loss = loss_fn(logits.reshape(-1, v), batch["targets"].reshape(-1))
            loss.backward()
            opt.step()

    return run


def torch_matmul_peak(size=2048, repeats=10):
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- main


def timed(fn, steps):
    t0 = time.perf_counter()
    fn(steps)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small config only, fewer rounds")
    ap.add_argument("--configs", default=None, help="comma-separated subset of small,base")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    names = args.configs.split(",") if args.configs else (["small"] if args.quick else
                                                            ["small", "base"])  # fmt: skip
    rounds = args.rounds or (3 if args.quick else 5)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    xla_peak = matmul_peak_flops()
    torch_peak = torch_matmul_peak()
    results = {"device": str(jax.devices()[0].device_kind), "cpu_count": os.cpu_count(),
               "xla_matmul_peak_gflops": xla_peak / 1e9,
               "torch_matmul_peak_gflops": torch_peak / 1e9, "configs": {}}  # fmt: skip
    print(f"matmul peak float32: XLA {xla_peak / 1e9:.0f} GFLOP/s, "
          f"PyTorch {torch_peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    for name in names:
        spec = CONFIGS[name]
        ours, compile_s = ours_step(spec)
        theirs = torch_step(spec)
        # Steps per round: ~8k target tokens (2 with --quick: a smoke run, not the table).
        steps = 2 if args.quick else max(2, int(4096 / spec["batch"] / spec["length"] * 2))
        ours(1), theirs(1)  # warm-up
        t_ours, t_torch = [], []
        for _ in range(rounds):  # interleaved: load drifts hit both
            t_ours.append(timed(ours, steps) / steps)
            t_torch.append(timed(theirs, steps) / steps)
        tokens = spec["batch"] * spec["length"]
        flops = train_flops(ours_config(spec), spec["batch"], spec["length"], spec["length"])
        o, t = float(np.median(t_ours)), float(np.median(t_torch))
        row = {
            "ours_tokens_per_s": tokens / o, "torch_tokens_per_s": tokens / t,
            "ratio": t / o, "ours_compile_s": compile_s,
            "ours_mfu": flops / o / xla_peak, "torch_mfu": flops / t / torch_peak,
            "ours_mfu_vs_torch_peak": flops / o / torch_peak, "train_gflop_per_step": flops / 1e9,
        }  # fmt: skip
        results["configs"][name] = {"spec": spec, **row}
        print(f"{name}: ours {row['ours_tokens_per_s']:.0f} tok/s, PyTorch "
              f"{row['torch_tokens_per_s']:.0f} tok/s, ratio {row['ratio']:.2f}")  # fmt: skip
    lines = [
        "| config | flaxformer_lite tok/s | PyTorch tok/s | ratio | our MFU | PyTorch MFU "
        "| compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["configs"].items():
        lines.append(
            f"| {name} | {r['ours_tokens_per_s']:.0f} | {r['torch_tokens_per_s']:.0f} | "
            f"{r['ratio']:.2f} | {100 * r['ours_mfu']:.0f}% | {100 * r['torch_mfu']:.0f}% | "
            f"{r['ours_compile_s']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    results["table"] = table
    name = "train_step_quick.json" if args.quick else "train_step.json"
    (out / name).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
