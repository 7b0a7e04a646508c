"""Fine-tuning from a pretrained Marian model (configs/finetune_marian.py, --config.init_from).

The "pretrained" model is a tiny random ``MarianMTModel`` saved by transformers, beside a Marian
tokenizer (SentencePiece models trained here, Marian's vocab.json) saved by ours; the data is
generated here (always) or the Multi30k sample in ../shared (skipped with a reason when absent).
Checked: the eval loss falls from the pretrained starting point, frozen parameters stay bitwise
unchanged (and get no optimizer state), the pad row (Marian's decoder start) is never trained,
a resumed run ignores init_from, the Translator translates with the result, and the workdir
exports back to a folder MarianMTModel reads with the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the pretrained model is built with PyTorch")
transformers = pytest.importorskip("transformers", reason="MarianMTModel (test extra)")
spm = pytest.importorskip("sentencepiece")

import optax  # noqa: E402

import train  # noqa: E402
from flaxformer_lite.data.marian_tokenizer import MarianTokenizer  # noqa: E402
from flaxformer_lite.inference.translator import Translator  # noqa: E402
from flaxformer_lite.interop import (
    hf,  # noqa: E402
    init_from,
)
from flaxformer_lite.training import optim

from helpers.finetune import (
    EN,
    eval_loss,
    final_params,
    finetune_config,
    generated_pairs,
    write_data,
)
from helpers.hf_models import marian_config
from helpers.layout_reference import flatten, relayout
from helpers.runs import checkpoint_params

ROOT = Path(__file__).resolve().parents[2]


def multi30k_pairs(folder: Path, split: str, n: int) -> list[tuple[str, str]]:
    en = (folder / f"{split}.en").read_text().splitlines()[:n]
    de = (folder / f"{split}.de").read_text().splitlines()[:n]
    return list(zip(en, de, strict=True))


def pretrained_folder(folder: Path, texts: list[str], layers: int = 1) -> Path:
    """A Hugging Face Marian folder: tokenizer trained on ``texts``, random tiny model with
    ``layers`` encoder and decoder layers."""
    folder.mkdir(parents=True)
    for side in ("source", "target"):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(folder / side),
            vocab_size=min(200, 40 + len(set(" ".join(texts))) * 2),
            model_type="unigram",
            bos_id=-1,
            eos_id=1,
            unk_id=0,
            pad_id=-1,
            hard_vocab_limit=False,
        )
        (folder / f"{side}.model").rename(folder / f"{side}.spm")
        (folder / f"{side}.vocab").unlink()
    pieces = []
    for side in ("source", "target"):
        sp = spm.SentencePieceProcessor(model_file=str(folder / f"{side}.spm"))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1}
    for p in pieces:
        if p not in vocab and p not in ("<s>",):
            vocab[p] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    config = marian_config(
        vocab_size=len(vocab),
        encoder_layers=layers,
        decoder_layers=layers,
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        forced_eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.MarianMTModel(config).save_pretrained(folder)
    MarianTokenizer.load(str(folder)).save(str(folder))  # tokenizer_config.json etc.
    # opus-mt's decoding defaults, which a fine-tuned run's export must keep.
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(
        num_beams=4, max_length=12, bad_words_ids=[[len(vocab) - 1]], renormalize_logits=True
    )
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


@pytest.fixture(scope="module")
def generated_run(tmp_path_factory):
    """The first 40 steps of a 45-step fine-tune of the encoder-frozen model on generated
    pairs, stopped there with a checkpoint (test_resuming_ignores_init_from runs the rest: the
    same config, so the train step compiled here serves it; the cosine schedule's length is
    part of the program)."""
    root = tmp_path_factory.mktemp("finetune")
    data = root / "data"
    write_data(data, generated_pairs(400, 0), generated_pairs(40, 1))
    texts = [t for pair in generated_pairs(400, 0) for t in pair]
    pretrained = pretrained_folder(root / "pretrained", texts)
    workdir = root / "run"
    config = finetune_config(pretrained, data, 45, freeze=("encoder/.*",))
    train.train_and_evaluate(config, str(workdir), stop_at=40)
    return config, pretrained, workdir


def test_loss_falls_from_the_pretrained_start_and_frozen_params_stay(generated_run):
    config, pretrained, workdir = generated_run
    _, start, _ = hf.load_pretrained(str(pretrained))
    end = final_params(workdir)
    before, after = eval_loss(config, workdir, start), eval_loss(config, workdir, end)
    print(f"generated pairs: eval smoothed KL {before:.3f} (pretrained) -> {after:.3f} (40 steps)")
    assert after < 0.8 * before, (before, after)
    flat_start = dict(jax.tree_util.tree_leaves_with_path(start))
    changed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(end):
        name = optim.param_path(path)
        same = np.array_equal(np.asarray(leaf), np.asarray(flat_start[path]))
        if name.startswith("encoder/"):
            assert same, name  # frozen: bitwise the pretrained value
        else:
            changed += not same
    assert changed >= 10
    # The pad row (Marian's decoder start) is never trained: still HF's zero row.
    pad = hf.load_pretrained(str(pretrained))[0].pad_id
    table = np.asarray(end["source_embedding"]["embedding"])
    np.testing.assert_array_equal(
        table[pad], np.asarray(start["source_embedding"]["embedding"])[pad]
    )
    assert not np.array_equal(table[:pad], np.asarray(start["source_embedding"]["embedding"])[:pad])


def test_frozen_parameters_get_no_optimizer_state():
    params = {"encoder": {"w": np.ones((3, 4))}, "decoder": {"w": np.ones((4, 5))}}
    tx = optim.with_frozen(optax.adam(1e-2), ("encoder/.*",))
    state = tx.init(params)
    sizes = [x.size for x in jax.tree_util.tree_leaves(state) if hasattr(x, "size")]
    assert sum(sizes) == 2 * 20 + 1  # mu and nu of the decoder's 20 values, one count
    grads = jax.tree_util.tree_map(np.ones_like, params)
    updates, _ = tx.update(grads, state, params)
    assert not np.any(updates["encoder"]["w"]) and np.all(updates["decoder"]["w"] != 0)
    with pytest.raises(ValueError, match=r"match no parameter.*encoder/w"):
        optim.freeze_labels(params, ("embedding",))


def test_partial_restore_copies_the_rows_a_grown_vocabulary_shares():
    fresh = {"emb": {"embedding": np.zeros((12, 4), np.float32)}, "head": np.ones(3, np.float32)}
    pre = {"emb": {"embedding": np.full((10, 4), 2.0, np.float32)}, "old": np.ones(2)}
    out, summary = init_from.restore_into(jax.tree_util.tree_map(jax.numpy.asarray, fresh), pre)
    table = np.asarray(out["emb"]["embedding"])
    assert np.all(table[:10] == 2.0) and np.all(table[10:] == 0.0)
    assert np.all(np.asarray(out["head"]) == 1.0)
    assert "1 partially restored" in summary and "1 newly initialised" in summary
    assert "1 dropped" in summary and "emb/embedding (10 of 12 rows)" in summary


def test_a_hugging_face_model_restores_bitwise_into_a_scanned_fine_tune(tmp_path, capsys):
    """Marian's unrolled layers (2 + 2) stacked into the ``scan_layers`` model: every parameter
    restored (all frozen for one step, so the checkpoint is the restore), compared with the
    Hugging Face parameters stacked by NumPy indexing in helpers.layout_reference.relayout."""
    data = tmp_path / "data"
    write_data(data, generated_pairs(64, 0), generated_pairs(8, 1))
    texts = [t for pair in generated_pairs(64, 0) for t in pair]
    pretrained = pretrained_folder(tmp_path / "pretrained", texts, layers=2)
    config = finetune_config(pretrained, data, 2, freeze=(".*",), decode_eval=False)
    config.model = {"dropout_rate": 0.0, "scan_layers": True}
    train.train_and_evaluate(config, str(tmp_path / "run"), stop_at=1)
    out = capsys.readouterr()
    line = next(x for x in out.out.splitlines() if x.startswith(f"init_from {pretrained}"))
    assert ", 0 newly initialised, 0 dropped" in line and "WARNING" not in out.err, line
    assert init_from.pretrained_config(str(tmp_path / "run")).scan_layers

    got = flatten(checkpoint_params(tmp_path / "run"))
    source = flatten(hf.load_pretrained(str(pretrained))[1])
    assert sum("/layers_1/" in n for n in source) >= 20
    expected = relayout(source, scanned=True, layers=2)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_resuming_ignores_init_from(generated_run, capsys):
    config, _, workdir = generated_run
    before = final_params(workdir)
    more = finetune_config(
        Path(config.init_from), Path(config.data_dir), 45, freeze=("encoder/.*",)
    )
    assert more == config  # the stopped run's own config, continued to its end
    train.train_and_evaluate(more, str(workdir))
    out = capsys.readouterr().out
    assert "resumed from step 40" in out and "init_from" in out and "ignored" in out
    after = final_params(workdir)
    # Continued from its own step-40 weights, not restarted from the pretrained ones.
    enc = [optim.param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(after)]
    assert any(n.startswith("decoder/") for n in enc)
    assert not np.array_equal(
        np.asarray(after["decoder"]["logits_bias"]), np.asarray(before["decoder"]["logits_bias"])
    )


def test_translator_and_export_of_the_fine_tuned_run(generated_run, tmp_path):
    config, pretrained, workdir = generated_run
    tuned = Translator.from_pretrained(str(workdir))
    assert tuned.search_options == {
        "beam_style": "hf",
        "early_stopping": False,
        "forced_eos": True,
        "banned_ids": (tuned.config.pad_id,),
    }
    sentences = [" ".join(EN[:3]), " ".join(EN[3:8])]
    assert all(isinstance(t, str) for t in tuned.translate(sentences, method="beam"))
    # A Hugging Face folder directly: decoded as MarianMTModel.generate decodes it with the
    # folder's generation config (beam 4, max_length 12, forced EOS, PAD banned, renormalised).
    direct = Translator.from_pretrained(str(pretrained))
    out = direct.translate(sentences)
    tok = transformers.MarianTokenizer.from_pretrained(str(pretrained))
    reference = transformers.MarianMTModel.from_pretrained(str(pretrained)).eval()
    with torch.no_grad():
        generated = reference.generate(**tok(sentences, padding=True, return_tensors="pt"))
    expected = tok.batch_decode(generated, skip_special_tokens=True)
    assert out == [" ".join(e.split()) for e in expected] and all(out)
    assert generated.shape[1] - 1 == 11  # rows cut by max_length (the random model rambles)
    ids = [[*direct.source_vocab.encode(s), direct.config.eos_id] for s in sentences]
    src = np.full((2, 8), direct.config.pad_id, np.int32)
    for r, row in enumerate(ids):
        src[r, : len(row)] = row
    # The translate CLI takes the Hugging Face folder as its --workdir too, same defaults.
    from flaxformer_lite.cli import translate as translate_cli

    (tmp_path / "in.txt").write_text("\n".join(sentences) + "\n")
    args = ["--workdir", str(pretrained), "--input", str(tmp_path / "in.txt")]
    assert translate_cli.main([*args, "--output", str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_text().splitlines() == out

    # Back to Hugging Face: MarianMTModel reads the export and computes our logits.
    export = tmp_path / "export"
    assert hf.main(["--workdir", str(workdir), "--out", str(export)]) == 0
    # It keeps the pretrained folder's generation config, every field.
    original = json.loads((pretrained / "generation_config.json").read_text())
    assert json.loads((export / "generation_config.json").read_text()) == original
    assert (
        transformers.GenerationConfig.from_pretrained(str(export)).to_diff_dict()
        == transformers.GenerationConfig.from_pretrained(str(pretrained)).to_diff_dict()
    )
    model = transformers.MarianMTModel.from_pretrained(str(export)).eval()
    tok = transformers.MarianTokenizer.from_pretrained(str(export))
    assert tok(sentences)["input_ids"][0] == ids[0]
    cfg, params, _ = hf.load_pretrained(str(export))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, tuned.params)  # bitwise
    from flaxformer_lite import EncoderDecoder

    tgt = np.array([[5, 6, 0]], np.int32)
    # Jitted: an eager apply dispatches (and compiles) op by op.
    ours = jax.jit(EncoderDecoder(cfg).apply)({"params": params}, src[:1], tgt)
    dec = torch.tensor([[cfg.bos_id, 5, 6]])
    with torch.no_grad():
        ref = model(
            input_ids=torch.from_numpy(src[:1].astype(np.int64)),
            attention_mask=torch.from_numpy(src[:1] != cfg.pad_id),
            decoder_input_ids=dec,
        ).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)


def test_the_export_averages_the_checkpoints_the_runs_translator_averages(generated_run, tmp_path):
    """A run whose config names average_checkpoints = 2 is exported as its Translator decodes
    it: the mean of its last two checkpoints (after test_resuming_ignores_init_from: steps 40
    and 45), recomputed here in float64 from each checkpoint alone; --average 1 the last."""
    import shutil

    _, _, workdir = generated_run
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "average_checkpoints": 2}))
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-2:] == [40, 45], steps
    alone = [Translator.from_workdir(str(run), step=s, average=1).params for s in (40, 45)]
    mean = jax.tree_util.tree_map(
        lambda a, b: (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2, *alone
    )
    assert Translator.from_workdir(str(run)).checkpoint_steps == (40, 45)
    assert hf.main(["--workdir", str(run), "--out", str(tmp_path / "mean")]) == 0
    _, params, _ = hf.load_pretrained(str(tmp_path / "mean"))
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float64), y, atol=1e-7),
        params, mean,
    )  # fmt: skip
    # Asked for one: the last checkpoint, bitwise (and it differs from the mean).
    assert hf.main(["--workdir", str(run), "--out", str(tmp_path / "last"), "--average", "1"]) == 0
    _, last, _ = hf.load_pretrained(str(tmp_path / "last"))
    jax.tree_util.tree_map(np.testing.assert_array_equal, last, alone[1])
    assert not np.array_equal(
        np.asarray(last["decoder"]["logits_bias"]), np.asarray(params["decoder"]["logits_bias"])
    )


def test_finetuning_on_the_multi30k_sample_lowers_its_loss(shared_data, tmp_path):
    """../shared/data/multi30k (skipped with a reason when absent, see conftest.shared_data)."""
    m30k = shared_data / "multi30k"
    data = tmp_path / "data"
    write_data(data, multi30k_pairs(m30k, "train", 600), multi30k_pairs(m30k, "val", 64))
    texts = [t for pair in multi30k_pairs(m30k, "train", 2000) for t in pair]
    pretrained = pretrained_folder(tmp_path / "pretrained", texts)
    config = finetune_config(pretrained, data, 30)
    workdir = tmp_path / "run"
    train.train_and_evaluate(config, str(workdir))
    start = hf.load_pretrained(str(pretrained))[1]
    before = eval_loss(config, workdir, start)
    after = eval_loss(config, workdir, final_params(workdir))
    print(f"Multi30k sample: eval smoothed KL {before:.3f} (pretrained) -> {after:.3f} (30 steps)")
    assert after < before - 0.5, (before, after)
