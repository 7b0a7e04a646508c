"""Fine-tuning a T5 checkpoint with train.py (configs/finetune_marian.py, --config.init_from =
a tiny random T5 v1.1 folder saved by transformers with a SentencePiece ``T5Tokenizer``) and
writing the run back as a Hugging Face folder.

The translation task reads the folder's own tokenizer (``config.tokenizer`` follows
``init_from``), trained on the data's words with exactly the model's VOCAB ids, so every
parameter is restored (no row partially restored or new) and the decoder starts from T5's pad
0. Checked: the run keeps the T5 architecture and its eval loss falls from the restored start;
``hf.export_workdir`` writes a folder that transformers' ``T5ForConditionalGeneration`` and
``AutoTokenizer`` read, with our teacher-forced logits within 1e-5 and the pretrained
tokenizer's ids; ``python -m flaxformer_lite.inference.export`` serves the run with the
Translator's translations.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the pretrained model is built with PyTorch")
transformers = pytest.importorskip("transformers", reason="T5ForConditionalGeneration")
pytest.importorskip("sentencepiece")

import train  # noqa: E402
from flaxformer_lite.inference import export  # noqa: E402
from flaxformer_lite.inference.translator import Translator  # noqa: E402
from flaxformer_lite.interop import hf, init_from  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

from helpers.finetune import (  # noqa: E402
    DE,
    EN,
    eval_loss,
    final_params,
    finetune_config,
    generated_pairs,
    write_data,
)
from helpers.hf_t5 import PAD, VOCAB, random_t5, t5_config, t5_tokenizer  # noqa: E402

STEPS, MAX_NEW = 40, 8
# T5 does not divide q.k by sqrt(d_kv): the paper's scaling folded into the random kernels
# keeps attention soft enough that float32 rounding in the two implementations stays within
# the logits bound (as test_hf_t5's logits test does).
QK_GAIN = t5_config("v1_1").d_kv ** -0.25
SENTENCES = [" ".join(EN[:3]), " ".join(EN[3:8]), "the dog", "a red house", "old man sees cat"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(train config, the pretrained folder, the workdir, train.py's log) of a STEPS-step
    fine-tune."""
    root = tmp_path_factory.mktemp("t5_finetune")
    data = root / "data"
    write_data(data, generated_pairs(300, 0), generated_pairs(40, 1))
    pretrained = root / "pretrained"
    random_t5("v1_1", seed=0, qk_gain=QK_GAIN).save_pretrained(pretrained)
    # The data's words in exactly the model's VOCAB ids: every embedding row is a piece.
    tokenizer = t5_tokenizer(root, vocab_size=VOCAB, words=" ".join(EN + DE))
    assert len(tokenizer) == VOCAB
    tokenizer.save_pretrained(str(pretrained))
    # A higher rate than Marian's 3e-3: random T5 weights start far from the data, and
    # STEPS must stay few (the module's runtime).
    config = finetune_config(pretrained, data, STEPS, learning_rate=1e-2)
    assert config.tokenizer == str(pretrained)  # the folder's own tokenizer
    workdir = root / "run"
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train.train_and_evaluate(config, str(workdir))
    sys.stdout.write(log.getvalue())
    return config, pretrained, workdir, log.getvalue()


def test_a_t5_folder_fine_tunes_with_its_tokenizer_architecture_and_falling_loss(run):
    config, pretrained, workdir, log = run
    restored = [line for line in log.splitlines() if f"init_from {pretrained}:" in line]
    assert (
        len(restored) == 1 and "0 partially restored, 0 newly initialised, 0 dropped" in restored[0]
    ), restored
    pre_config, start, _ = hf.load_pretrained(str(pretrained))
    tuned = TransformerConfig.from_json((workdir / "model_config.json").read_text())
    assert init_from.same_architecture(tuned, pre_config)
    assert not tuned.scale_attention_logits and not tuned.tie_output_embedding
    assert tuned.vocab_size == VOCAB and tuned.target_vocab_size is None
    assert tuned.bos_id == PAD == 0  # T5's decoder start, not a trained vocabulary's 2
    assert not (workdir / "spm_shared.model").exists()  # no vocabulary trained on the data
    end = hf.plain_params(final_params(workdir), tuned)[0]
    shapes = jax.tree_util.tree_map(np.shape, end)
    assert shapes == jax.tree_util.tree_map(np.shape, start)  # the T5 tree, nothing new
    before, after = eval_loss(config, workdir, start), eval_loss(config, workdir, end)
    print(f"T5 v1.1 fine-tune: eval smoothed KL {before:.3f} (pretrained) -> {after:.3f}")
    assert after < 0.8 * before, (before, after)
    generation = json.loads((workdir / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 0  # the pretrained folder's, kept


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The run written back by ``hf.export_workdir``: (folder, transformers' model of it)."""
    workdir = run[2]
    folder = tmp_path_factory.mktemp("t5_exported") / "hf"
    hf.export_workdir(str(workdir), str(folder))
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(folder)).eval()
    return folder, model


def test_the_exported_folder_gives_our_logits_and_the_tokenizer(run, exported):
    _, pretrained, workdir, _ = run
    folder, model = exported
    names = [p.name for p in pretrained.iterdir() if p.name.startswith("tokenizer")]
    assert "tokenizer.json" in names  # what transformers 5 writes for T5Tokenizer
    for name in names:  # the pretrained folder's tokenizer, through the workdir, unchanged
        assert (folder / name).read_bytes() == (pretrained / name).read_bytes(), name
    reference = transformers.AutoTokenizer.from_pretrained(str(pretrained))
    written = transformers.AutoTokenizer.from_pretrained(str(folder))
    texts = SENTENCES + [" ".join(DE[:5])]
    assert written(texts)["input_ids"] == reference(texts)["input_ids"]
    src = written(texts, padding=True, return_tensors="np")["input_ids"]
    tgt = written([" ".join(DE[i : i + 4]) for i in range(len(texts))], padding=True)
    tgt = np.asarray(written.pad(tgt, return_tensors="np")["input_ids"])
    assert (src == PAD).any() and (tgt == PAD).any()  # padded batches
    dec_in = np.concatenate([np.full((len(texts), 1), PAD), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        expected = model(
            input_ids=torch.from_numpy(src).long(),
            attention_mask=torch.from_numpy(src != PAD),
            decoder_input_ids=torch.from_numpy(dec_in).long(),
        ).logits.numpy()
    translator = Translator.from_workdir(str(workdir))
    config = TransformerConfig.from_json((workdir / "model_config.json").read_text())
    ours = jax.jit(EncoderDecoder(config).apply)(
        {"params": translator.params}, src.astype(np.int32), tgt.astype(np.int32)
    )
    real = tgt != PAD
    err = np.abs(np.asarray(ours) - expected)[real].max()
    print(f"T5 fine-tuned export: max logit error {err:.2e}, |logits| <= {np.abs(expected).max()}")
    assert err < 1e-5, err
    assert np.abs(expected).max() > 1.0  # not two near-zero arrays


def test_the_export_serves_the_translators_translations(run, tmp_path):
    workdir = run[2]
    artifact = tmp_path / "artifact"
    argv = ["--workdir", str(workdir), "--out", str(artifact), "--method", "greedy"]
    assert export.main([*argv, "--max-len", str(MAX_NEW)]) == 0
    spec = importlib.util.spec_from_file_location("t5_runtime", artifact / "runtime.py")
    runtime = importlib.util.module_from_spec(spec)
    sys.modules["t5_runtime"] = runtime
    spec.loader.exec_module(runtime)
    served = runtime.load(str(artifact))
    sentences = SENTENCES[:3]
    expected = Translator.from_workdir(str(workdir)).translate(
        sentences, method="greedy", max_len=MAX_NEW
    )
    assert served.translate(sentences) == expected
    assert any(expected)  # not all empty
