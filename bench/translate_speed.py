"""Batch translation speed against the real peers, on identical weights.

One random Marian model at opus-mt size (d_model 512, 6+6 layers, 8 heads, d_ff 2048, swish,
vocabulary 58,101, post-LN, sinusoidal halves, float32) is built once with Hugging Face
``MarianMTModel``, loaded into flaxformer_lite with ``hf.load_pretrained``, written back with
``hf.save_pretrained`` and converted from that folder with CTranslate2's converter. Then, at
each batch size and number of new tokens, in one process and in interleaved rounds (the order
rotates every round, so machine load hits every system alike), greedy and beam 4 with:

* ``flaxformer_lite``: ``generate_jit`` (one jitted call: encoder, key/value cache, search),
  compiled ahead of time, compilation not timed; beam search with the cache in place (the
  default, ``beam_cache="in_place"``);
* ``ours-1device`` (with ``--cpu_devices N``, N > 1): ours on the first of the N CPU devices
  alone, beside ``flaxformer_lite`` on every device that divides the batch (the host CPU split
  into N XLA devices, ``sharding.use_cpu_devices``: the batch data-parallel over them, each
  device's rows on its own thread, as ``config.cpu_devices`` trains);
* ``ours-reorder`` (beam search only): the same with ``beam_cache="reorder"``, the search that
  gathers every cache row by parent beam after each step (what main did before issue 15);
* ``hf``: ``MarianMTModel.generate`` (PyTorch eager, its key/value cache, ``torch.no_grad``,
  ``os.cpu_count()`` threads), ``num_beams`` 1 or 4, ``length_penalty`` 1;
* ``ct2-float32`` and ``ct2-int8``: ``ctranslate2.Translator.translate_batch`` on the converted
  model, ``compute_type`` float32 or int8 (weights quantized at load), ``beam_size`` 1 or 4;
* ``flaxformer_lite-int8``: ours with ``quantize.quantize_params`` and
  ``quantization="int8"`` (int8 weights per output channel, int8 activations per row, int32
  accumulation: CTranslate2's int8 scheme), its products by oneDNN's VNNI / AMX kernel where
  it loads (``int8_kernel="auto"``, ``ops.onednn_int8``);
* ``ours-int8-xla``: the same int8 model with ``int8_kernel="xla"``, XLA's int8 dot (the same
  int32 products, so the same tokens: its agreement with ``flaxformer_lite-int8`` is checked).
* ``flaxformer_lite-bf16``: ours with the weights stored and the matmuls computed in bfloat16
  (``Translator(dtype="bfloat16")``'s ``with_dtype``), against ``ct2-bfloat16`` and
  ``ct2-int8_bfloat16`` (CTranslate2's compute types, where the CPU has them:
  ``ctranslate2.get_supported_compute_types("cpu")``).
* ``ours-int8-bf16``: the int8 model of ``flaxformer_lite-int8`` with its floating parameters
  (scales, norms, biases) and every computation but the int8 products in bfloat16
  (``with_dtype`` on the quantized weights): CTranslate2's ``int8_bfloat16`` scheme.

Every system must produce exactly ``new`` tokens per sentence: the final logits bias of EOS and
of pad is -1e4 in the shared weights, so no system can end a sentence early (checked: no EOS in
any output). Tokens per second count batch x new tokens (the returned sentences, also for beam
search), so ratios are time ratios. Where weights are identical (all but int8), the token
agreement of each system with flaxformer_lite is reported (greedy should agree except where
float rounding flips a near-tie; beam search may legitimately differ in its stopping rule, but
cannot stop early here).

Writes bench/results/translate_speed.json (translate_speed_quick.json with --quick) and prints
a markdown table. Needs the bench extra (transformers, torch, ctranslate2).

    .venv/bin/python bench/translate_speed.py --quick    # small model, about a minute
    .venv/bin/python bench/translate_speed.py            # opus-mt size: batch 1/8/32, 32/128 new
    .venv/bin/python bench/translate_speed.py --systems flaxformer_lite flaxformer_lite-int8 \
        ct2-float32 ct2-int8 --batches 8 32 --new_tokens 32   # the int8 comparison alone
    .venv/bin/python bench/translate_speed.py --methods beam4 --batches 1 32 --new_tokens 32
    .venv/bin/python bench/translate_speed.py --cpu_devices 2 --systems flaxformer_lite \
        ours-1device ct2-float32 --batches 1 32 --new_tokens 32   # 2 CPU devices against 1
    .venv/bin/python bench/translate_speed.py --systems flaxformer_lite-bf16 ct2-float32 \
        ct2-bfloat16 ct2-int8_bfloat16 --batches 1 32 --new_tokens 32   # bfloat16 alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding.generate import generate_jit, place_params
from flaxformer_lite.inference.translator import with_dtype
from flaxformer_lite.interop import hf
from flaxformer_lite.models import EncoderDecoder
from flaxformer_lite.ops import onednn_int8
from flaxformer_lite.ops.quantize import quantize_params

RESULTS = Path(__file__).resolve().parent / "results"

FULL = dict(
    model=dict(
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
    ),
    vocab_size=58101,
    source_len=24,
    batches=(1, 8, 32),
    new_tokens=(32, 128),
)
QUICK = dict(
    model=dict(
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
    ),
    vocab_size=4001,
    source_len=16,
    batches=(1, 8),
    new_tokens=(16,),
)
SYSTEMS = (
    "flaxformer_lite",
    "ours-reorder",
    "ours-1device",
    "hf",
    "ct2-float32",
    "ct2-int8",
    "flaxformer_lite-int8",
    "ours-int8-xla",
    "flaxformer_lite-bf16",
    "ours-int8-bf16",
    "ct2-bfloat16",
    "ct2-int8_bfloat16",
)
CT2_SYSTEMS = {  # name: compute_type
    "ct2-float32": "float32",
    "ct2-int8": "int8",
    "ct2-bfloat16": "bfloat16",
    "ct2-int8_bfloat16": "int8_bfloat16",
}
METHODS = {"greedy": 1, "beam4": 4}


def cpu_flags() -> str:
    """The CPU's vector and matrix extensions (AVX, AMX) as lscpu reports them (figures differ
    between machines)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if "Flags" in ln), [])
    vector = sorted(f for f in flags if f.startswith(("avx", "amx")))  # AMX: int8/bf16 tiles
    return f"{model}; {os.cpu_count()} cores; " + (" ".join(vector) if vector else "no AVX")


def batch_mesh(batch: int) -> jax.sharding.Mesh:
    """The first k devices, k the most of them that divide ``batch`` (no padded rows)."""
    devices = jax.devices()
    k = max(k for k in range(1, len(devices) + 1) if batch % k == 0)
    return sharding.make_mesh((-1, 1, 1), devices[:k])


def build_models(settings: dict, max_new: int, workdir: Path):
    """(HF model, our config, our params, CTranslate2 folder, vocabulary strings)."""
    import ctranslate2
    import sentencepiece as spm
    import torch
    import transformers

    vocab_size = settings["vocab_size"]
    pad = vocab_size - 1
    config = transformers.MarianConfig(
        vocab_size=vocab_size,
        max_position_embeddings=settings["source_len"] + max_new + 8,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=None,
        dropout=0.0,
        **settings["model"],
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.model.shared.weight[pad] = 0.0  # as in every opus-mt model
        bias = torch.zeros_like(model.final_logits_bias)
        bias[0, 0] = bias[0, pad] = -1e4  # neither EOS nor pad: every sentence runs to the end
        model.final_logits_bias.copy_(bias)
    hf_dir, ours_dir, ct2_dir = workdir / "hf", workdir / "ours", workdir / "ct2"
    model.save_pretrained(hf_dir)
    ours_config, params, _ = hf.load_pretrained(str(hf_dir))
    hf.save_pretrained(str(ours_dir), ours_config, params)
    # The converter reads the vocabulary through the tokenizer: a SentencePiece model (any) and
    # a vocab.json with one string per id, Marian's layout (</s> 0, <unk> 1, <pad> last).
    lines = [f"w{i} w{i * 7 % 97} w{i % 13}" for i in range(400)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(workdir / "spm"),
        vocab_size=32,
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
    )
    vocab = ["</s>", "<unk>"] + [f"▁t{i}" for i in range(2, pad)] + ["<pad>"]
    for side in ("source", "target"):
        (ours_dir / f"{side}.spm").write_bytes((workdir / "spm.model").read_bytes())
    (ours_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    ctranslate2.converters.TransformersConverter(str(ours_dir)).convert(str(ct2_dir), force=True)
    return model, ours_config, params, ct2_dir, vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, about a minute")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="override")
    parser.add_argument("--new_tokens", nargs="+", type=int, default=None, help="override")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--cpu_devices", type=int, default=None, help="split the host CPU into N XLA devices"
    )
    args = parser.parse_args()
    if args.cpu_devices and not sharding.use_cpu_devices(args.cpu_devices):
        raise SystemExit(f"--cpu_devices {args.cpu_devices}: JAX already started")
    settings = dict(QUICK if args.quick else FULL)
    if args.batches:
        settings["batches"] = tuple(args.batches)
    if args.new_tokens:
        settings["new_tokens"] = tuple(args.new_tokens)
    systems = tuple(s for s in SYSTEMS if s in args.systems or s == "flaxformer_lite")

    import ctranslate2
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    threads = os.cpu_count() or 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model, config, params, ct2_dir, vocab = build_models(
            settings, max(settings["new_tokens"]), Path(tmp)
        )
        one_device = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
        config_q = config.replace(quantization="int8")
        params_q = quantize_params(params, config)
        params_bf16, config_bf16 = with_dtype(params, config, "bfloat16")
        params_q_bf16, config_q_bf16 = with_dtype(params_q, config_q, "bfloat16")
        kinds = {  # our systems' weights and configs, placed on their devices once per cell
            "f32": (params, config),
            "int8": (params_q, config_q),
            "int8-xla": (params_q, config_q.replace(int8_kernel="xla")),
            "bf16": (params_bf16, config_bf16),
            "int8-bf16": (params_q_bf16, config_q_bf16),
        }
        supported = ctranslate2.get_supported_compute_types("cpu")
        for name, kind in CT2_SYSTEMS.items():
            if name in systems and kind not in supported:
                raise SystemExit(f"{name}: this CPU's CTranslate2 supports only {supported}")
        translators = {
            name: ctranslate2.Translator(
                str(ct2_dir), device="cpu", compute_type=kind, intra_threads=threads
            )
            for name, kind in CT2_SYSTEMS.items()
            if name in systems or name == "ct2-float32"
        }
        index = {t: i for i, t in enumerate(vocab)}
        rng = np.random.default_rng(0)
        for new in settings["new_tokens"]:
            for batch in settings["batches"]:
                src = rng.integers(2, config.pad_id, size=(batch, settings["source_len"]))
                src[:, -1] = config.eos_id
                src = src.astype(np.int32)
                src_tokens = [[vocab[i] for i in row] for row in src]
                for method in args.methods:
                    beams = METHODS[method]
                    mesh = batch_mesh(batch)
                    wanted = [("f32", mesh)]
                    wanted += [("int8", mesh)] if "flaxformer_lite-int8" in systems else []
                    wanted += [("int8-xla", mesh)] if "ours-int8-xla" in systems else []
                    wanted += [("bf16", mesh)] if "flaxformer_lite-bf16" in systems else []
                    wanted += [("int8-bf16", mesh)] if "ours-int8-bf16" in systems else []
                    wanted += [("f32", one_device)] if "ours-1device" in systems else []
                    placed = {  # as the Translator does: on the devices once, not per call
                        (kind, m.devices.size): place_params(
                            kinds[kind][0], EncoderDecoder, kinds[kind][1], m
                        )
                        for kind, m in wanted
                    }

                    def compile_ours(kind, beam_cache="in_place", mesh=mesh, src=src, beams=beams,
                                     new=new, placed=placed):  # fmt: skip
                        return generate_jit.lower(
                            placed[(kind, mesh.devices.size)],
                            kinds[kind][1],
                            src,
                            mesh=mesh,
                            method="greedy" if beams == 1 else "beam",
                            max_len=new,
                            beam_size=beams,
                            alpha=0.0,
                            beam_cache=beam_cache,
                        ).compile()

                    start = time.perf_counter()
                    compiled = compile_ours("f32")
                    compile_s = time.perf_counter() - start
                    compiled_q = compile_ours("int8") if ("int8", mesh) in wanted else None
                    compiled_q_xla = (
                        compile_ours("int8-xla") if ("int8-xla", mesh) in wanted else None
                    )
                    compiled_bf16 = compile_ours("bf16") if ("bf16", mesh) in wanted else None
                    compiled_q_bf16 = (
                        compile_ours("int8-bf16") if ("int8-bf16", mesh) in wanted else None
                    )
                    on_one = (
                        compile_ours("f32", mesh=one_device) if "ours-1device" in systems else None
                    )
                    reordering = (
                        compile_ours("f32", "reorder")
                        if beams > 1 and "ours-reorder" in systems
                        else None
                    )

                    def run_ours(compiled=compiled, src=src, kind="f32", devices=None, mesh=mesh,
                                 placed=placed):  # fmt: skip
                        params = placed[(kind, devices or mesh.devices.size)]
                        tokens, _ = compiled(params, src)
                        return np.asarray(jax.block_until_ready(tokens))

                    def run_hf(src=src, beams=beams, new=new):
                        with torch.no_grad():
                            out = model.generate(
                                input_ids=torch.from_numpy(src.astype(np.int64)),
                                attention_mask=torch.ones(src.shape, dtype=torch.long),
                                num_beams=beams,
                                do_sample=False,
                                max_new_tokens=new,
                                length_penalty=1.0,
                                bad_words_ids=None,
                            )
                        return out[:, 1:].numpy()

                    def run_ct2(name, src_tokens=src_tokens, beams=beams, new=new):
                        out = translators[name].translate_batch(
                            src_tokens,
                            beam_size=beams,
                            max_decoding_length=new,
                            min_decoding_length=0,
                            max_batch_size=0,
                        )
                        return np.array([[index[t] for t in r.hypotheses[0]] for r in out])

                    runners = {
                        "flaxformer_lite": run_ours,
                        "ours-reorder": lambda c=reordering, s=src: run_ours(c, s),
                        "ours-1device": lambda c=on_one, s=src: run_ours(c, s, devices=1),
                        "hf": run_hf,
                        "ct2-float32": lambda: run_ct2("ct2-float32"),
                        "ct2-int8": lambda: run_ct2("ct2-int8"),
                        "flaxformer_lite-int8": lambda c=compiled_q, s=src: run_ours(c, s, "int8"),
                        "ours-int8-xla": lambda c=compiled_q_xla, s=src: run_ours(c, s, "int8-xla"),
                        "flaxformer_lite-bf16": lambda c=compiled_bf16, s=src: run_ours(
                            c, s, "bf16"
                        ),
                        "ours-int8-bf16": lambda c=compiled_q_bf16, s=src: run_ours(
                            c, s, "int8-bf16"
                        ),
                        "ct2-bfloat16": lambda: run_ct2("ct2-bfloat16"),
                        "ct2-int8_bfloat16": lambda: run_ct2("ct2-int8_bfloat16"),
                    }
                    cell = tuple(s for s in systems if beams > 1 or s != "ours-reorder")
                    times = {name: [] for name in cell}
                    outputs = {name: runners[name]() for name in cell}  # warm-up
                    for r in range(args.rounds):
                        order = cell[r % len(cell) :] + cell[: r % len(cell)]
                        for name in order:
                            start = time.perf_counter()
                            outputs[name] = runners[name]()
                            times[name].append(time.perf_counter() - start)
                    for name, out in outputs.items():
                        assert out.shape == (batch, new), (name, out.shape)
                        assert not (out == config.eos_id).any(), name
                    if {"flaxformer_lite-int8", "ours-int8-xla"} <= set(outputs):  # exact int32
                        same = outputs["flaxformer_lite-int8"] == outputs["ours-int8-xla"]
                        assert same.all(), "the int8 kernels' tokens differ"
                    row = dict(
                        method=method,
                        batch=batch,
                        new_tokens=new,
                        compile_s=compile_s,
                        devices=int(mesh.devices.size),
                        int8_kernel="xla" if onednn_int8.unavailable_reason() else "onednn",
                    )
                    for name in cell:
                        seconds = statistics.median(times[name])
                        row[f"{name}_tok_s"] = batch * new / seconds
                        row[f"{name}_agreement"] = float(
                            (outputs[name] == outputs["flaxformer_lite"]).mean()
                        )
                    results.append(row)
                    print(json.dumps(row), flush=True)

    header = "| method | batch | new | " + " | ".join(f"{s} tok/s" for s in systems)
    ratios = [  # (column, numerator, denominator)
        ("ours / ct2-f32", "flaxformer_lite", "ct2-float32"),
        ("ours / hf", "flaxformer_lite", "hf"),
        ("ours / reorder", "flaxformer_lite", "ours-reorder"),
        ("ours / ours-1device", "flaxformer_lite", "ours-1device"),
        ("ct2-int8 / ct2-f32", "ct2-int8", "ct2-float32"),
        ("ours-int8 / ours", "flaxformer_lite-int8", "flaxformer_lite"),
        ("ours-int8 / ct2-int8", "flaxformer_lite-int8", "ct2-int8"),
        ("ours-int8 / ours-int8-xla", "flaxformer_lite-int8", "ours-int8-xla"),
        ("ours-int8-bf16 / ct2-int8", "ours-int8-bf16", "ct2-int8"),
        ("ours-int8-bf16 / ours-int8", "ours-int8-bf16", "flaxformer_lite-int8"),
        ("ours-bf16 / ours", "flaxformer_lite-bf16", "flaxformer_lite"),
        ("ours-bf16 / ct2-bf16", "flaxformer_lite-bf16", "ct2-bfloat16"),
        ("ours-bf16 / ct2-int8-bf16", "flaxformer_lite-bf16", "ct2-int8_bfloat16"),
        ("ct2-bf16 / ct2-f32", "ct2-bfloat16", "ct2-float32"),
    ]
    ratios = [r for r in ratios if r[1] in systems and r[2] in systems]
    agree = [s for s in systems if s != "flaxformer_lite"]
    header += "".join(f" | {r[0]}" for r in ratios) + f" | agreement {', '.join(agree)} |"
    lines = [header, "|" + "---|" * (len(systems) + len(ratios) + 4)]
    for r in results:

        def cell(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        speeds = " | ".join(cell(f"{s}_tok_s", ",.0f") for s in systems)
        quotients = "".join(
            f" | {r[f'{a}_tok_s'] / r[f'{b}_tok_s']:.2f}" if f"{b}_tok_s" in r else " | -"
            for _, a, b in ratios
        )
        agreement = ", ".join(cell(f"{s}_agreement", ".3f") for s in agree)
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['new_tokens']} | {speeds}{quotients} | "
            f"{agreement} |"
        )
    table = "\n".join(lines)
    print(table)
    meta = dict(
        machine=cpu_flags(),
        jax=jax.__version__,
        torch=torch.__version__,
        ctranslate2=ctranslate2.__version__,
        settings={k: v for k, v in settings.items()},
        rounds=args.rounds,
        systems=systems,
        cpu_devices=len(jax.devices("cpu")),
    )
    out = args.out or RESULTS / (
        "translate_speed_quick.json" if args.quick else "translate_speed.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results, table=table), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
