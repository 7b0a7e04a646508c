"""Decoding speed: the key/value cache against full recomputation and PyTorch; beam 4 vs greedy.

One randomly initialised EncoderDecoder (d_model 256, 4 heads, d_ff 1024, 3+3 layers, vocabulary
8192, source length 32, batch 32, float32), in one process:

* cached greedy: ``generate(method="greedy")``: the encoder runs once, each step runs the
  decoder on one new position against the cache (keys/values of earlier positions and of the
  encoder output are stored).
* full recomputation: greedy decoding where every step runs the whole decoder over the prefix,
  padded to the final length so that one compiled shape serves every step (a ``lax.fori_loop``
  in one jitted call), and reads the logits at position t. The encoder also runs once.
  Every step of it costs the same (same shape), so at long lengths only ``--naive-steps``
  steps are run and timed and the total is that time x (new tokens / steps run); the table
  says where.
* beam 4: ``generate(method="beam", beam_size=4, alpha=0.6)``, cached, same model.
* PyTorch naive greedy (the peer): ``torch.nn.Transformer`` of the same size (batch_first,
  post-LN, ReLU, dropout 0, eval mode, ``torch.no_grad``, float32, one embedding shared by
  source and target, sinusoidal positions, untied output projection without bias), decoded
  the way the PyTorch translation tutorial does: the encoder memory computed once, then at
  every step the whole decoder over the prefix so far (no cache, the prefix grows by one),
  the logits of the last position, argmax, append. Its step cost grows with the prefix, so
  outputs longer than ``--torch-full-max`` tokens (default 128) are not decoded in full: the
  step is timed at ``--torch-samples`` prefix lengths spread over 1..new tokens and the
  per-step times, linearly interpolated, are summed (plus the encoder); the table says where.
  Without torch the column is skipped (``pip install torch==2.13.0``).

Random weights would stop at a random EOS; for fixed-length timing the output projection is
untied and its EOS column set to zero: the EOS logit is exactly 0 while the best of 8191
other logits is far above it (about +3.7 standard deviations), so no row or beam ever ends
early (checked after each run: no EOS in the output). The PyTorch model gets the same: its
output projection has no bias and a zero EOS row. Tokens per second count batch x new
tokens, for beam search too (the sentences it returns), so the beam ratio is a time ratio.
All measurements of one length alternate in one process, repeat by repeat (the order
reversed every other repeat), so that machine load hits all alike; PyTorch runs on
``os.cpu_count()`` threads.

Writes bench/results/decode.json (decode_quick.json with --quick) and prints a markdown table.

    .venv/bin/python bench/decode.py --quick   # small model, under a minute on 2 cores
    .venv/bin/python bench/decode.py           # 32, 128, 512 new tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxformer_lite.core.sharding import make_mesh
from flaxformer_lite.decoding.generate import generate_jit
from flaxformer_lite.decoding.search import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.models import EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig

RESULTS = Path(__file__).resolve().parent / "results"

FULL = dict(
    model=dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3),
    vocab_size=8192,
    batch=32,
    source_len=32,
    lengths=(32, 128, 512),
)
QUICK = dict(
    model=dict(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2, num_decoder_layers=2),
    vocab_size=2048,
    batch=8,
    source_len=16,
    lengths=(16, 32, 64),
)


def make_model(settings: dict, max_len: int) -> tuple[TransformerConfig, dict]:
    """Random parameters with the EOS column of the (untied) output projection set to zero."""
    config = TransformerConfig(
        vocab_size=settings["vocab_size"],
        dropout_rate=0.0,
        max_len=max_len,
        tie_output_embedding=False,
        **settings["model"],
    )
    model = EncoderDecoder(config)
    tokens = jnp.ones((1, 8), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens)["params"])
    kernel = params["decoder"]["logits"]["kernel"]
    params["decoder"]["logits"]["kernel"] = kernel.at[:, EOS_ID].set(0.0)
    return config, params


@functools.partial(jax.jit, static_argnames=("config", "steps", "length"))
def recompute_greedy(params, config: TransformerConfig, inputs, *, steps: int, length: int):
    """Greedy decoding without a cache: ``steps`` steps, each running the decoder on the whole
    prefix padded to ``length`` and reading position t. Returns tokens `[batch, steps]`."""
    model = EncoderDecoder(config)
    variables = {"params": params}
    batch = inputs.shape[0]
    encoded = model.apply(variables, inputs, method=model.encode)
    decoder_inputs = jnp.full((batch, length), PAD_ID, jnp.int32).at[:, 0].set(BOS_ID)
    tokens = jnp.zeros((batch, steps), jnp.int32)

    def step(t, carry):
        decoder_inputs, tokens = carry
        logits = model.apply(variables, encoded, inputs, decoder_inputs, method=model.decode)
        nxt = jnp.argmax(lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), axis=-1)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None].astype(jnp.int32), (0, t))
        # At t = length - 1 the index clamps onto the last position: no step reads it after.
        decoder_inputs = lax.dynamic_update_slice(
            decoder_inputs, nxt[:, None].astype(jnp.int32), (0, t + 1)
        )
        return decoder_inputs, tokens

    return lax.fori_loop(0, steps, step, (decoder_inputs, tokens))[1]


def compile_aot(jitted, args: tuple, kwargs: dict) -> tuple[Callable[[], tuple], float]:
    """Compiles ``jitted(*args, **kwargs)`` ahead of time (static options in ``kwargs``);
    returns a runner, ``() -> (wall seconds, output)``, and the compile time.

    Ahead-of-time compilation replaces a warm-up run, which would double the cost of the long
    runs."""
    start = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    compile_s = time.perf_counter() - start
    dynamic = (args[0], args[2])  # params, inputs: the config and the options are static

    def run() -> tuple[float, object]:
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*dynamic))
        return time.perf_counter() - start, out

    return run, compile_s


# ----------------------------------------------------------------------------- PyTorch peer


def torch_or_none():
    """The torch module, or None (with a message) when it is not installed."""
    try:
        import torch
    except ImportError:
        print(
            "PyTorch column skipped: torch is not installed "
            "(`.venv/bin/python -m pip install torch==2.13.0`, the CPU wheel, to add it)",
            flush=True,
        )
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    return torch


def torch_model(torch, settings: dict, positions: int):
    """nn.Transformer of the benchmark's size, random weights (seed 0), eval mode, float32;
    the output projection has no bias and a zero EOS row (EOS logit exactly 0)."""
    from torch import nn

    torch.manual_seed(0)
    m, vocab = settings["model"], settings["vocab_size"]
    d = m["d_model"]

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)  # shared by source and target, as ours
            nn.init.normal_(self.embed.weight, std=d**-0.5)
            self.transformer = nn.Transformer(
                d,
                m["num_heads"],
                m["num_encoder_layers"],
                m["num_decoder_layers"],
                m["d_ff"],
                dropout=0.0,
                batch_first=True,
            )
            self.logits = nn.Linear(d, vocab, bias=False)
            nn.init.xavier_uniform_(self.logits.weight)
            with torch.no_grad():
                self.logits.weight[EOS_ID] = 0.0
            pos = torch.arange(positions)[:, None] / 10000 ** (torch.arange(0, d, 2)[None] / d)
            pe = torch.zeros(positions, d)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos), torch.cos(pos)
            self.register_buffer("pe", pe)
            mask = nn.Transformer.generate_square_subsequent_mask(positions)
            self.register_buffer("causal", mask)

        def embed_tokens(self, tokens):
            return self.embed(tokens) * d**0.5 + self.pe[: tokens.shape[1]]

        def encode(self, src, src_padding):
            with warnings.catch_warnings():  # the encoder's nested-tensor fast path
                warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
                return self.transformer.encoder(
                    self.embed_tokens(src), src_key_padding_mask=src_padding
                )

        def next_logits(self, prefix, memory, src_padding):
            """Logits of the last position after running the decoder over the whole prefix."""
            n = prefix.shape[1]
            h = self.transformer.decoder(
                self.embed_tokens(prefix),
                memory,
                tgt_mask=self.causal[:n, :n],
                tgt_is_causal=True,
                memory_key_padding_mask=src_padding,
            )
            return self.logits(h[:, -1])

    return Seq2Seq().eval()


def torch_naive_greedy(torch, model, src, new_tokens: int) -> tuple[float, np.ndarray]:
    """The tutorial loop: memory once, then the decoder over the growing prefix each step.
    Returns (wall seconds, tokens [batch, new_tokens])."""
    start = time.perf_counter()
    with torch.no_grad():
        padding = src == PAD_ID
        memory = model.encode(src, padding)
        ys = torch.full((src.shape[0], 1), BOS_ID, dtype=torch.long)
        for _ in range(new_tokens):
            nxt = model.next_logits(ys, memory, padding).argmax(-1)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
    return time.perf_counter() - start, ys[:, 1:].numpy()


def torch_sampled_greedy(torch, model, src, new_tokens: int, samples: int) -> tuple[float, int]:
    """Estimated seconds of ``torch_naive_greedy`` for long outputs: the encoder plus the sum
    over steps t = 1..new_tokens of the step time at prefix length t, linearly interpolated
    between ``samples`` timed steps (random prefixes: the cost does not depend on the tokens).
    Returns (estimated seconds, steps timed)."""
    points = np.unique(np.linspace(1, new_tokens, samples).round().astype(int))
    generator = torch.Generator().manual_seed(0)
    costs = []
    with torch.no_grad():
        start = time.perf_counter()
        padding = src == PAD_ID
        memory = model.encode(src, padding)
        encode_s = time.perf_counter() - start
        for t in points:
            ys = torch.randint(
                4, model.logits.out_features, (src.shape[0], int(t)), generator=generator
            )
            ys[:, 0] = BOS_ID
            start = time.perf_counter()
            nxt = model.next_logits(ys, memory, padding).argmax(-1)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            costs.append(time.perf_counter() - start)
    steps = np.interp(np.arange(1, new_tokens + 1), points, costs)
    return encode_s + float(steps.sum()), len(points)


# ----------------------------------------------------------------------------- measurement


def measure(
    params,
    config,
    inputs,
    new_tokens: int,
    naive_steps: int,
    repeats: int,
    peer: dict | None,
) -> dict:
    """One row. ``peer``: dict(torch, model, src, full_max, samples) or None (no PyTorch)."""
    batch = inputs.shape[0]
    produced = batch * new_tokens
    args = (params, config, inputs)
    steps = min(new_tokens, naive_steps)
    runs, compile_s = {}, {}
    one = make_mesh((1, 1, 1), jax.devices()[:1])  # one device, as the PyTorch peer
    runs["cached_greedy"], compile_s["cached_greedy"] = compile_aot(
        generate_jit, args, dict(mesh=one, method="greedy", max_len=new_tokens)
    )
    runs["beam4"], compile_s["beam4"] = compile_aot(
        generate_jit,
        args,
        dict(mesh=one, method="beam", beam_size=4, alpha=0.6, max_len=new_tokens),
    )
    runs["recompute"], compile_s["recompute"] = compile_aot(
        recompute_greedy, args, dict(steps=steps, length=new_tokens)
    )
    torch_sampled = peer is not None and new_tokens > peer["full_max"]
    if peer is not None:
        torch, model, src = peer["torch"], peer["model"], peer["src"]
        if torch_sampled:
            runs["torch"] = lambda: torch_sampled_greedy(
                torch, model, src, new_tokens, peer["samples"]
            )
        else:
            runs["torch"] = lambda: torch_naive_greedy(torch, model, src, new_tokens)

    # Interleaved: every repeat runs each method once, the order reversed every other repeat.
    times, outputs = {name: [] for name in runs}, {}
    order = list(runs)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            seconds, outputs[name] = runs[name]()
            times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}

    greedy_tokens, beam_tokens = outputs["cached_greedy"][0], outputs["beam4"][0]
    # No EOS anywhere: every row and beam ran all new_tokens steps.
    for name, tokens in (("greedy", greedy_tokens), ("beam", beam_tokens)):
        if np.any(np.asarray(tokens) == EOS_ID) or np.any(np.asarray(tokens) == PAD_ID):
            raise RuntimeError(f"{name} decoding stopped early: the timing would be wrong")
    # The tutorial loop stops on EOS only (a PAD id is just another argmax to it).
    if peer is not None and not torch_sampled and np.any(outputs["torch"] == EOS_ID):
        raise RuntimeError("PyTorch greedy produced EOS: a real loop would stop early")

    greedy_s, beam_s = median["cached_greedy"], median["beam4"]
    naive_s = median["recompute"] * new_tokens / steps
    # Same greedy decisions (up to float rounding near ties): the baseline does the same work.
    agree = float(np.mean(np.asarray(outputs["recompute"]) == np.asarray(greedy_tokens)[:, :steps]))
    row = {
        "new_tokens": new_tokens,
        "batch": batch,
        "repeats": repeats,
        "cached_greedy_s": greedy_s,
        "cached_greedy_tok_s": produced / greedy_s,
        "recompute_greedy_s": naive_s,
        "recompute_greedy_tok_s": produced / naive_s,
        "recompute_steps_run": steps,
        "recompute_extrapolated": steps < new_tokens,
        "recompute_agreement": agree,
        "cache_speedup": naive_s / greedy_s,
        "beam4_s": beam_s,
        "beam4_tok_s": produced / beam_s,
        "beam4_over_greedy_time": beam_s / greedy_s,
        "compile_s": compile_s,
        "torch_naive_greedy_s": None,
        "torch_naive_greedy_tok_s": None,
        "torch_sampled_steps": None,
        "cached_greedy_over_torch": None,
        "beam4_over_torch": None,
    }
    if peer is not None:
        torch_s = median["torch"]
        row.update(
            torch_naive_greedy_s=torch_s,
            torch_naive_greedy_tok_s=produced / torch_s,
            torch_sampled_steps=outputs["torch"] if torch_sampled else None,
            cached_greedy_over_torch=torch_s / greedy_s,
            beam4_over_torch=torch_s / beam_s,
        )
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| new tokens | cached greedy tok/s | full recompute tok/s | cache speed-up "
        "| beam 4 tok/s | beam 4 time / greedy time | PyTorch naive greedy tok/s "
        "| cached greedy / PyTorch | beam 4 / PyTorch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        note = f" (from {r['recompute_steps_run']} steps)" if r["recompute_extrapolated"] else ""
        if r.get("torch_naive_greedy_tok_s") is None:
            peer = "n/a (no torch) | n/a | n/a"
        else:
            sampled = r.get("torch_sampled_steps")
            peer = (
                f"{r['torch_naive_greedy_tok_s']:,.0f}"
                + (f" (from {sampled} sampled steps)" if sampled else "")
                + f" | {r['cached_greedy_over_torch']:.1f}x | {r['beam4_over_torch']:.1f}x"
            )
        lines.append(
            f"| {r['new_tokens']} | {r['cached_greedy_tok_s']:,.0f} | "
            f"{r['recompute_greedy_tok_s']:,.0f}{note} | {r['cache_speedup']:.1f}x | "
            f"{r['beam4_tok_s']:,.0f} | {r['beam4_over_greedy_time']:.2f}x | {peer} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and lengths (<1 min)")
    parser.add_argument(
        "--naive-steps",
        type=int,
        default=None,
        help="full recomputation runs at most this many steps (each step costs the same); "
        "longer outputs are extrapolated (default: 16, --quick: 64 i.e. all)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--torch-full-max",
        type=int,
        default=128,
        help="PyTorch naive greedy decodes outputs up to this length in full; longer ones "
        "are estimated from --torch-samples timed steps (default 128)",
    )
    parser.add_argument("--torch-samples", type=int, default=16)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch column")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()

    settings = QUICK if args.quick else FULL
    naive_steps = args.naive_steps or (64 if args.quick else 16)
    lengths = settings["lengths"]
    config, params = make_model(settings, max_len=max(lengths))
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, config.vocab_size, (settings["batch"], settings["source_len"]))
    inputs[:, -1] = EOS_ID
    peer = None
    torch = None if args.no_torch else torch_or_none()
    if torch is not None:
        model = torch_model(torch, settings, positions=max(max(lengths), settings["source_len"]))
        src = torch.from_numpy(inputs.astype(np.int64))
        peer = dict(
            torch=torch,
            model=model,
            src=src,
            full_max=args.torch_full_max,
            samples=args.torch_samples,
        )
        torch_naive_greedy(torch, model, src, min(8, min(lengths)))  # warm-up (thread pool)
    inputs = jnp.asarray(inputs, jnp.int32)

    rows = []
    for new_tokens in lengths:
        # One timed run of the longest length: beam search alone takes about a minute there.
        repeats = args.repeats if new_tokens < max(lengths) or args.quick else 1
        row = measure(params, config, inputs, new_tokens, naive_steps, repeats, peer)
        rows.append(row)
        versus = ""
        if row["torch_naive_greedy_tok_s"] is not None:
            versus = (
                f", PyTorch naive greedy {row['torch_naive_greedy_tok_s']:,.0f} tok/s "
                f"(cached greedy {row['cached_greedy_over_torch']:.1f}x)"
            )
        print(
            f"{new_tokens:>4} new tokens: cached {row['cached_greedy_tok_s']:,.0f} tok/s, "
            f"recompute {row['recompute_greedy_tok_s']:,.0f} tok/s, "
            f"beam 4 {row['beam4_tok_s']:,.0f} tok/s{versus}; recompute agrees with cached "
            f"greedy on {100 * row['recompute_agreement']:.1f}% of tokens",
            flush=True,
        )

    device = jax.devices()[0]
    meta = {
        "mode": "quick" if args.quick else "full",
        "model": {**settings["model"], "vocab_size": settings["vocab_size"]},
        "batch": settings["batch"],
        "source_len": settings["source_len"],
        "dtype": "float32",
        "repeats": args.repeats,
        "timing": "compiled ahead of time; median wall time of `repeats` runs (1 at the "
        "longest length of the full run)",
        "eos": "output projection untied, EOS column zeroed: no early stop (checked)",
        "recompute": "decoder over the prefix padded to the final length each step; "
        "totals extrapolated from recompute_steps_run steps where fewer than new_tokens",
        "timing_order": "per length, every repeat runs each method once (cached greedy, beam "
        "4, recompute, PyTorch), the order reversed every other repeat",
        "torch": None
        if torch is None
        else {
            "version": torch.__version__,
            "threads": torch.get_num_threads(),
            "model": "nn.Transformer, batch_first, post-LN, ReLU, dropout 0, eval, no_grad, "
            "float32; shared embedding x sqrt(d) + sinusoidal; Linear output, no bias, EOS row 0",
            "decoding": "naive greedy (tutorial loop): encoder once, decoder over the whole "
            "growing prefix every step, argmax of the last position",
            "full_max": args.torch_full_max,
            "sampled": f"longer outputs: {args.torch_samples} steps timed at prefix lengths "
            "spread over 1..new tokens, interpolated and summed, plus the encoder",
        },
        "jax": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "host": platform.processor() or platform.machine(),
    }
    out = args.out or RESULTS / ("decode_quick.json" if args.quick else "decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print()
    print(
        f"Decoding, batch {settings['batch']}, source length {settings['source_len']}, "
        f"d_model {settings['model']['d_model']}, "
        f"{settings['model']['num_encoder_layers']}+{settings['model']['num_decoder_layers']} "
        f"layers, vocabulary {settings['vocab_size']}, float32, {meta['device']}. "
        "EOS is suppressed (zeroed output column) so every run decodes exactly the stated "
        "number of tokens. Full recomputation pads the prefix to the final length (one "
        "compiled shape, equal cost per step); rows marked 'from N steps' time N steps and "
        "scale to the full length. PyTorch: nn.Transformer of the same size, naive greedy "
        "(decoder over the whole prefix every step, no cache); 'from N sampled steps' sums "
        "interpolated step times."
    )
    print()
    print(markdown_table(rows))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
