"""The jax.export serving artifact against generate() and Hugging Face, run where only jax,
numpy and sentencepiece are imported.

One tiny random EncoderDecoder (d_model 32, 2 + 2 layers, its output projection scaled up so
that rows differ and end at different steps) with a SentencePiece vocabulary trained in
tmp_path is exported ONCE per method. A subprocess that never imports flaxformer_lite loads
the artifact with its copied runtime.py and (a) calls the program on batch sizes 1, 3 and 8
times two source lengths, whose tokens must equal generate()'s with the same options, and
(b) translates strings, which must equal Translator.translate()'s. It also counts XLA
compilations (jax.monitoring): the exported program is never traced again, but XLA compiles
once per concrete input shape, so the six raw shapes compile six times while the runtime's
bucketed translate() (8 rows, sources padded to 16) serves 1, 3 and 8 sentences with one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.core.special_ids import EOS_ID, PAD_ID
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.decoding.generate import generate
from flaxformer_lite.inference import export
from flaxformer_lite.inference.npz import flatten_params
from flaxformer_lite.inference.translator import Translator
from flaxformer_lite.models import EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig

from helpers.hf_models import CORPUS, marian_dir

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = ["a dog runs", "the cat", "", "two men"]
MAX_LEN = 12
BEAM, ALPHA = 3, 0.6
SHAPES = [(batch, src_len) for batch in (1, 3, 8) for src_len in (5, 11)]
SEED, SCALE = 1, 8.0

# Run with only jax, numpy and sentencepiece importable from the artifact: argv = artifact,
# cases .npz (source ids per shape), output .json. Prints nothing; writes tokens and counts.
RUNTIME_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import jax
    artifact, cases_path, out_path = sys.argv[1:4]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    sys.path.insert(0, artifact)
    import runtime
    model = runtime.load(artifact)
    result = {"tokens": {}, "raw_compiles": [], "translate": {}}
    with np.load(cases_path) as cases:
        for name in cases.files:
            before = len(compiles)
            start = time.perf_counter()
            tokens, scores = model(cases[name])
            result["tokens"][name] = tokens.tolist()
            result["raw_compiles"].append(
                [name, len(compiles) - before, sum(compiles[before:]), time.perf_counter() - start])
    sentences = json.loads(sys.argv[4])
    for count in (1, 3, 8):
        before = len(compiles)
        batch = (sentences * 8)[:count]
        result["translate"][str(count)] = [model.translate(batch), len(compiles) - before]
    result["encoded"] = [model.encode(s) for s in sentences]
    result["imported"] = sorted(m.split(".")[0] for m in sys.modules)
    assert "flaxformer_lite" not in sys.modules
    with open(out_path, "w") as f:
        json.dump(result, f)
    """
)


def run_runtime(artifact: Path, cases: dict[str, np.ndarray], sentences, tmp: Path) -> dict:
    """RUNTIME_SCRIPT in a fresh process (cwd outside the repository, no PYTHONPATH, no
    persistent compilation cache so that compilations are counted, not loaded)."""
    np.savez(tmp / "cases.npz", **cases)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR") and not k.startswith("PYTEST")
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNTIME_SCRIPT,
            str(artifact),
            str(tmp / "cases.npz"),
            str(tmp / "out.json"),
            json.dumps(sentences),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def source_cases(vocab_size: int, eos_id: int, pad_id: int, specials: set[int]) -> dict:
    """Source ids per shape name "BxS": random ordinary ids, EOS-terminated, rows of
    different lengths (the last column is always used by row 0), PAD after EOS."""
    rng = np.random.default_rng(0)
    ordinary = np.array([i for i in range(vocab_size) if i not in specials])
    cases = {}
    for batch, src_len in SHAPES:
        ids = np.full((batch, src_len), pad_id, np.int32)
        for row in range(batch):
            length = src_len if row == 0 else int(rng.integers(2, src_len + 1))
            ids[row, : length - 1] = rng.choice(ordinary, length - 1)
            ids[row, length - 1] = eos_id
        cases[f"{batch}x{src_len}"] = ids
    return cases


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(translator, train.py-style workdir, {method: artifact}): the beam artifact through the
    CLI from the workdir (its checkpoint, config.json's beam size and alpha), the greedy one
    through ``export_translator``."""
    from flaxformer_lite.core.checkpoints import Checkpointer

    work = tmp_path_factory.mktemp("export")
    vocab = Tokenizer.train(CORPUS, str(work / "spm_shared.model"), 60, num_threads=1)
    config = TransformerConfig(
        vocab_size=vocab.vocab_size,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
        max_len=24,
        tie_output_embedding=False,
    )
    tokens = jnp.ones((1, 1), jnp.int32)
    params = nn.meta.unbox(EncoderDecoder(config).init(jax.random.key(SEED), tokens, tokens))
    params = jax.device_get(params["params"])
    params["decoder"]["logits"]["kernel"] = params["decoder"]["logits"]["kernel"] * SCALE
    # The layout train.py writes: configs and an Orbax checkpoint of a train state.
    (work / "model_config.json").write_text(config.to_json())
    run = {"task": "translation", "beam_size": BEAM, "alpha": ALPHA}
    (work / "config.json").write_text(json.dumps(run))
    checkpointer = Checkpointer(str(work / "checkpoints"), async_save=False)
    state = {"step": np.int32(3), "params": params, "opt_state": {}}
    checkpointer.save(3, state, {"train": {"index": 3}}, force=True)
    checkpointer.close()
    translator = Translator.from_workdir(str(work))
    artifacts = {method: work / "artifacts" / method for method in ("beam", "greedy")}
    cli = ["--workdir", str(work), "--out", str(artifacts["beam"]), "--max-len", str(MAX_LEN)]
    assert export.main(cli) == 0
    export.export_translator(
        translator, str(artifacts["greedy"]), str(work), method="greedy", max_len=MAX_LEN
    )
    return translator, work, artifacts


def reference(translator, ids: np.ndarray, method: str) -> np.ndarray:
    tokens, _ = generate(
        translator.params,
        translator.config,
        ids,
        method=method,
        max_len=MAX_LEN,
        beam_size=BEAM if method == "beam" else 1,
        alpha=ALPHA if method == "beam" else 0.0,
        mesh=translator.mesh,
    )
    return np.asarray(tokens)


def test_artifact_files_and_manifest(model):
    translator, _, artifacts = model
    root = artifacts["beam"]
    names = {p.name for p in root.iterdir()}
    assert {
        "manifest.json",
        "translate.jax",
        "params.npz",
        "runtime.py",
        "spm_shared.model",
    } <= names
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["method"] == "beam" and manifest["beam_size"] == BEAM
    assert manifest["max_len"] == MAX_LEN and manifest["vocabulary"] == "spm"
    assert manifest["ids"]["pad"] == PAD_ID and manifest["ids"]["eos"] == EOS_ID
    assert manifest["versions"]["jax"] == jax.__version__
    exported = jax.export.deserialize(bytearray((root / "translate.jax").read_bytes()))
    # One program for every batch size and source length: the input shapes are symbolic.
    assert [str(a.shape) for a in exported.in_avals[-2:]] == ["(b, s)", "(b,)"]
    with np.load(root / "params.npz") as flat:
        ours = flatten_params(translator.params)
        assert sorted(flat.files) == sorted(ours)
        assert all(np.array_equal(flat[k], ours[k]) for k in ours)


@pytest.mark.parametrize("method", ["beam", "greedy"])
def test_runtime_matches_generate_without_flaxformer_lite(model, method, tmp_path):
    translator, _, artifacts = model
    config = translator.config
    cases = source_cases(config.vocab_size, EOS_ID, PAD_ID, {0, 1, 2, 3})
    if method == "greedy":  # the full grid runs for beam; greedy checks two shapes
        cases = {k: v for k, v in cases.items() if k in ("3x11", "8x5")}
    result = run_runtime(artifacts[method], cases, SENTENCES, tmp_path)
    assert "flaxformer_lite" not in result["imported"] and "flax" not in result["imported"]
    varied = set()
    for name, ids in cases.items():
        ours = np.asarray(result["tokens"][name])
        np.testing.assert_array_equal(ours, reference(translator, ids, method), err_msg=name)
        varied |= {tuple(row) for row in ours.tolist()}
    assert len(varied) >= 3, "the random model must not translate every row alike"
    # Each new concrete shape compiles once in XLA (no model code is traced again).
    assert [count for _, count, *_ in result["raw_compiles"]] == [1] * len(cases)
    # Bucketed: 1, 3 and 8 sentences are all 8 rows x 16 source positions: one compilation.
    assert max(len(ids) for ids in result["encoded"] if ids) <= 16
    counts = [result["translate"][k][1] for k in ("1", "3", "8")]
    assert counts == [1, 0, 0]
    # Every source here has 1.5 * length + 10 > MAX_LEN: each row's limit is MAX_LEN on both.
    expected = translator.translate((SENTENCES * 8)[:8], method=method, max_len=MAX_LEN)
    assert result["translate"]["8"][0] == expected
    assert result["translate"]["3"][0] == expected[:3]
    print(method, "raw calls [shape, compiles, compile s, call s]:", result["raw_compiles"])
    print(method, "encoded", result["encoded"], "translate", result["translate"]["3"])


def test_bad_arguments(model, tmp_path, capsys):
    translator, work, _ = model
    with pytest.raises(ValueError, match="method must be one of"):
        export.export_translator(translator, str(tmp_path / "x"), str(work), method="sample")
    with pytest.raises(FileNotFoundError, match="no exportable vocabulary"):
        export.export_translator(translator, str(tmp_path / "x"), str(tmp_path))
    with pytest.raises(ValueError, match="max_len"):
        export.export_translator(translator, str(tmp_path / "x"), str(work), max_len=99)
    assert export.main(["--workdir", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "workdir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        export.main(["--workdir", str(work), "--out", str(tmp_path), "--method", "sample"])
    assert e.value.code == 2
    assert "invalid choice: 'sample'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Hugging Face

HF_SENTENCES = ["a dog runs", "the cat sleeps", ">>de<< two men", "", "red bikes", "a girl sings"]
HF_MAX_LEN = 8


def test_marian_folder_exports_and_matches_hugging_face(model, tmp_path):
    torch = pytest.importorskip("torch", reason="the Marian reference runs in PyTorch (test extra)")
    transformers = pytest.importorskip("transformers", reason="MarianMTModel is the reference")
    _, work, _ = model
    hf_dir, _ = marian_dir(tmp_path / "marian", work / "spm_shared.model")
    artifact = tmp_path / "artifact"
    argv = ["--workdir", str(hf_dir), "--out", str(artifact), "--method", "greedy"]
    assert export.main([*argv, "--max-len", str(HF_MAX_LEN)]) == 0
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["vocabulary"] == "marian" and manifest["ids"]["eos"] == 0
    assert manifest["decoding"] == {  # greedy: the beam rules do not apply
        "forced_eos": True,
        "banned_ids": [manifest["ids"]["pad"]],
    }
    assert manifest["per_row_limit"] is False  # every row gets --max-len, as generate's

    tokenizer = transformers.MarianTokenizer(
        source_spm=str(hf_dir / "source.spm"),
        target_spm=str(hf_dir / "target.spm"),
        vocab=str(hf_dir / "vocab.json"),
    )
    hf_model = transformers.MarianMTModel.from_pretrained(str(hf_dir)).eval()
    texts = [s for s in HF_SENTENCES if s]
    batch = tokenizer(texts, padding=True, return_tensors="np")
    with torch.no_grad():
        hf_out = hf_model.generate(
            input_ids=torch.from_numpy(batch["input_ids"]),
            attention_mask=torch.from_numpy(batch["attention_mask"]),
            num_beams=1,
            do_sample=False,
            max_new_tokens=HF_MAX_LEN,
            min_length=0,
        ).numpy()  # the folder's forced_eos_token_id and bad_words_ids apply
    pad = manifest["ids"]["pad"]
    hf_tokens = np.full((len(texts), HF_MAX_LEN), pad, np.int64)
    hf_tokens[:, : hf_out.shape[1] - 1] = hf_out[:, 1:]  # without the decoder start
    source = batch["input_ids"].astype(np.int32)
    result = run_runtime(artifact, {"hf": source}, HF_SENTENCES, tmp_path)

    unk = manifest["ids"]["unk"]
    expected_ids = [tokenizer(s)["input_ids"] if s else None for s in HF_SENTENCES]
    assert result["encoded"] == expected_ids
    assert any(unk in ids for ids in expected_ids if ids)  # ">>de<<" and "▁d" are unknown
    np.testing.assert_array_equal(result["tokens"]["hf"], hf_tokens)
    assert len({tuple(row) for row in hf_tokens.tolist()}) >= 3
    # Both ways of stopping: EOS chosen early, and EOS forced at the limit.
    early = (hf_tokens[:, :-1] == manifest["ids"]["eos"]).any(axis=1)
    assert 0 < early.sum() < len(texts)
    assert (hf_tokens[~early, -1] == manifest["ids"]["eos"]).all()
    hf_strings = tokenizer.batch_decode(hf_out, skip_special_tokens=True)
    print("hf strings", hf_strings, "tokens", hf_tokens.tolist())
    assert sum(bool(s) for s in hf_strings) >= 3
    expected = dict(zip(texts, hf_strings, strict=True))
    got = result["translate"]["8"][0]
    assert got == [expected.get(s, "") for s in (HF_SENTENCES * 8)[:8]]


def test_one_artifact_for_cpu_and_cuda(model):
    """Lowered for CPU and CUDA on this CPU machine; the CPU half gives the same tokens."""
    translator, _, _ = model
    exported = export.export_function(
        translator.params,
        translator.config,
        method="greedy",
        max_len=MAX_LEN,
        platforms=("cpu", "cuda"),
    )
    assert exported.platforms == ("cpu", "cuda")
    restored = jax.export.deserialize(exported.serialize())
    ids = source_cases(translator.config.vocab_size, EOS_ID, PAD_ID, {0, 1, 2, 3})["3x11"]
    tokens, _ = restored.call(translator.params, ids, np.full((3,), MAX_LEN, np.int32))
    np.testing.assert_array_equal(np.asarray(tokens), reference(translator, ids, "greedy"))


# ----------------------------------------------------------------------------- every source

# The runtime with nothing but the manifest's requirements importable: argv = artifact,
# modules to block as well (JSON list), sentences (JSON), output .json. A meta-path gate makes
# every third-party top-level module (one that an installed distribution provides) whose
# distribution the manifest's ``requirements`` do not name fail to import, as in an environment
# where only those are installed (optional imports, e.g. jax's of etils, then take their
# fallbacks); the third-party modules imported after the prelude are recorded.
STRICT_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata, json, sys
    artifact, block, sentences, out_path = sys.argv[1:5]
    block, sentences = set(json.loads(block)), json.loads(sentences)
    with open(artifact + "/manifest.json") as f:
        manifest = json.load(f)
    norm = lambda name: name.lower().replace("-", "_")
    allowed = {norm(r.split("==")[0]) for r in manifest.get("requirements", [])}
    owners = importlib.metadata.packages_distributions()
    dists = {k: {norm(d) for d in v} for k, v in owners.items()}
    before, refused = set(sys.modules), set()

    class Gate(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in block or (dists.get(top) and not dists[top] & allowed):
                refused.add(top)
                raise ModuleNotFoundError(f"No module named {top!r} (not installed)", name=top)
            return None

    sys.meta_path.insert(0, Gate())
    sys.path.insert(0, artifact)
    result = {"refused": refused}
    try:
        import runtime
        model = runtime.load(artifact)
        result["translations"] = model.translate(sentences)
    except ImportError as e:
        result["error"] = str(e)
    new = {m.partition(".")[0] for m in set(sys.modules) - before}
    result["third_party"] = sorted(m for m in new if dists.get(m))
    result["distributions"] = sorted({d for m in new for d in dists.get(m, ())})
    result["refused"] = sorted(refused)
    with open(out_path, "w") as f:
        json.dump(result, f)
    """
)
EXPORT_SENTENCES = [
    "a dog runs in the park",
    "the cat sleeps",
    "two men ride bikes down the road",
    "a woman reads",
    "",
    "children play with a ball near the water",
    "the old man walks his dog",
    "a girl sings",
    "people wait for the bus in the rain",
    "red bikes",
    "the cat sleeps on a red mat in the sun",
    "two women walk",
    "a dog",  # short sources: a per-row limit of 1.5 x source + 10 would cut them sooner
    "red",
    "a man",
]


def run_strict(artifact: Path, sentences, tmp: Path, block=()) -> dict:
    """STRICT_SCRIPT in a fresh process (cwd outside the repository, no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST")}
    out = tmp / "strict.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            STRICT_SCRIPT,
            str(artifact),
            json.dumps(list(block)),
            json.dumps(sentences),
            str(out),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def finetuned_workdir(work: Path, folder: Path) -> Path:
    """The workdir ``train.py --config configs/finetune_marian.py --config.init_from=folder``
    leaves (its model and run configs, the Marian tokenizer, the folder's
    generation_config.json, a checkpoint), with the folder's weights as the checkpoint."""
    import shutil

    from flaxformer_lite.core.checkpoints import Checkpointer
    from flaxformer_lite.interop import hf

    config, params, _ = hf.load_pretrained(str(folder))
    work.mkdir()
    (work / "model_config.json").write_text(config.to_json())
    run = {
        "task": "translation",
        "init_from": str(folder),
        "beam_size": 4,
        "alpha": 1.0,
        "beam_style": "hf",
        "early_stopping": False,
        "forced_eos": True,
        "ban_pad": True,
    }  # configs/finetune_marian.py's decoding fields
    (work / "config.json").write_text(json.dumps(run))
    for name in ("source.spm", "target.spm", "vocab.json", "generation_config.json"):
        shutil.copyfile(folder / name, work / name)
    checkpointer = Checkpointer(str(work / "checkpoints"), async_save=False)
    state = {"step": np.int32(5), "params": params, "opt_state": {}}
    checkpointer.save(5, state, {"train": {"index": 5}}, force=True)
    checkpointer.close()
    return work


@pytest.fixture(scope="module")
def sources(model, tmp_path_factory):
    """{kind: a folder to export}: the plain train.py workdir, a fine-tuned Marian workdir and
    a Hugging Face folder with opus-mt's generation config (beam 4, max_length 21, forced EOS,
    PAD banned, renormalised). PAD's logits bias is raised so that banning it matters."""
    pytest.importorskip("torch", reason="the Marian model is built in PyTorch (test extra)")
    pytest.importorskip("transformers", reason="MarianMTModel (test extra)")
    _, work, _ = model
    root = tmp_path_factory.mktemp("sources")
    folder, _ = marian_dir(root / "marian", work / "spm_shared.model", 2, 2.0, 5.5)
    generation = json.loads((folder / "generation_config.json").read_text())
    pad = generation["pad_token_id"]
    generation.update(num_beams=4, max_length=21, bad_words_ids=[[pad]], renormalize_logits=True)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    tuned = finetuned_workdir(root / "finetuned", folder)
    return {"workdir": work, "finetuned": tuned, "hf_folder": folder}


@pytest.mark.parametrize("kind", ["workdir", "finetuned", "hf_folder"])
def test_artifact_translates_as_the_translator(sources, kind, tmp_path):
    """``python -m flaxformer_lite.inference.export --workdir SOURCE`` with no decoding flags: the
    runtime's strings are ``Translator.from_pretrained(SOURCE).translate``'s, and it runs with
    only the manifest's requirements importable (their distributions cover every third-party
    module it imports)."""
    source = sources[kind]
    artifact = tmp_path / "artifact"
    assert export.main(["--workdir", str(source), "--out", str(artifact)]) == 0
    expected = Translator.from_pretrained(str(source)).translate(EXPORT_SENTENCES)
    result = run_strict(artifact, EXPORT_SENTENCES, tmp_path)
    manifest = json.loads((artifact / "manifest.json").read_text())
    print(kind, manifest["method"], manifest["decoding"], "refused", result["refused"])
    assert "error" not in result, result["error"]
    assert result["translations"] == expected
    assert len(set(expected)) >= 5
    allowed = {r.split("==")[0].lower().replace("-", "_") for r in manifest["requirements"]}
    assert set(result["distributions"]) <= allowed
    assert {"jax", "numpy", "sentencepiece", "flatbuffers"} <= set(result["third_party"])
    assert "flaxformer_lite" not in result["third_party"] and "flax" not in result["third_party"]
    readme = (artifact / "README.md").read_text()
    assert all(r in readme for r in manifest["requirements"])


def test_a_bfloat16_translator_exports_what_it_translates(model, tmp_path):
    """``Translator(dtype="bfloat16")`` exported: NumPy's .npz has no bfloat16 (it writes raw
    2-byte voids that read back as bytes), so the weights go as their uint16 bits, named in
    the manifest's ``param_bits``; the runtime, in a fresh process with only the manifest's
    requirements, views them back and prints the translator's own strings."""
    translator, work, _ = model
    bf16 = Translator(
        translator.params, translator.config, translator.source_vocab, translator.target_vocab,
        generation=translator.generation, dtype="bfloat16",
    )  # fmt: skip
    artifact = tmp_path / "bf16"
    export.export_translator(bf16, str(artifact), str(work), method="greedy", max_len=MAX_LEN)
    manifest = json.loads((artifact / "manifest.json").read_text())
    names = set(flatten_params(bf16.params))
    assert manifest["param_bits"] == dict.fromkeys(names, "bfloat16")  # every leaf is float
    with np.load(artifact / "params.npz") as flat:
        assert {flat[k].dtype for k in flat.files} == {np.dtype(np.uint16)}
    expected = bf16.translate(EXPORT_SENTENCES, method="greedy", max_len=MAX_LEN)
    result = run_strict(artifact, EXPORT_SENTENCES, tmp_path)
    assert "error" not in result, result["error"]
    assert result["translations"] == expected and len(set(expected)) >= 5
    # A float32 export stores plain arrays and names no bits.
    plain = json.loads((work / "artifacts" / "greedy" / "manifest.json").read_text())
    assert plain["param_bits"] == {}


def test_an_ensemble_exports_what_it_translates(model, tmp_path):
    """``Translator.ensemble`` of the model and another (seed 2) exported: one program over
    the mean of their distributions whose parameters ``params.npz`` stores as ``member_i/...``;
    the runtime, in a fresh process with only the manifest's requirements, prints the
    ensemble's own strings, which differ from the first model's."""
    translator, work, _ = model
    tokens = jnp.ones((1, 1), jnp.int32)
    model_def = EncoderDecoder(translator.config)
    other = jax.device_get(
        nn.meta.unbox(model_def.init(jax.random.key(2), tokens, tokens))["params"]
    )
    other["decoder"]["logits"]["kernel"] = other["decoder"]["logits"]["kernel"] * SCALE
    second = Translator(
        other, translator.config, translator.source_vocab, translator.target_vocab,
        generation=translator.generation,
    )  # fmt: skip
    ensemble = Translator.ensemble([translator, second])
    artifact = tmp_path / "ensemble"
    export.export_translator(ensemble, str(artifact), str(work), method="greedy", max_len=MAX_LEN)
    with np.load(artifact / "params.npz") as flat:
        assert {name.split("/")[0] for name in flat.files} == {"member_0", "member_1"}
    expected = ensemble.translate(EXPORT_SENTENCES, method="greedy", max_len=MAX_LEN)
    alone = translator.translate(EXPORT_SENTENCES, method="greedy", max_len=MAX_LEN)
    assert expected != alone  # the second model changes translations
    result = run_strict(artifact, EXPORT_SENTENCES, tmp_path)
    assert "error" not in result, result["error"]
    assert result["translations"] == expected


def test_runtime_without_flatbuffers_says_what_to_install(model, tmp_path):
    """flatbuffers (which jax.export's deserializer imports, and jax does not install) made
    unimportable: loading fails with one line naming the pinned package."""
    _, _, artifacts = model
    result = run_strict(artifacts["greedy"], ["a dog"], tmp_path, block=["flatbuffers"])
    manifest = json.loads((artifacts["greedy"] / "manifest.json").read_text())
    pinned = [r for r in manifest["requirements"] if r.startswith("flatbuffers==")]
    assert len(pinned) == 1
    assert result["error"] == (
        f"this serving runtime needs flatbuffers, which cannot be imported: pip install {pinned[0]}"
    )
    assert "translations" not in result
