"""Fine-tuning from a BART folder (train.py with --config.init_from) and serving the result.

The "pretrained" model is a tiny random ``BartForConditionalGeneration`` saved by transformers
with a byte-level BPE tokenizer of exactly its 64 ids (tests/helpers/hf_bart.py); the data are
test_finetune's generated word-for-word pairs. The translation task reads the folder's own
tokenizer (``config.tokenizer`` follows ``init_from``), so the model keeps BART's vocabulary and
every parameter is restored: the embedding and the logits bias, frozen here, end bitwise equal to
the folder's (a row left at its random initialisation would differ). Checked: the workdir holds
the tokenizer's files, the run keeps BART's architecture (post-LN, learned positions with offset
2, embedding norm) and decoder start, its eval loss falls from the restored start, the Translator
and ``python -m flaxformer_lite.cli.translate`` translate with the workdir's tokenizer as
transformers' ``generate`` does on the exported folder, and ``python -m
flaxformer_lite.inference.export`` serves it with the Translator's translations.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the pretrained model is built with PyTorch")
transformers = pytest.importorskip("transformers", reason="BartForConditionalGeneration")

import train  # noqa: E402
from flaxformer_lite.inference import export  # noqa: E402
from flaxformer_lite.inference.translator import Translator, load_vocabularies  # noqa: E402
from flaxformer_lite.interop import hf  # noqa: E402

from helpers.finetune import (  # noqa: E402
    EN,
    eval_loss,
    final_params,
    finetune_config,
    generated_pairs,
    write_data,
)
from helpers.hf_bart import EOS, VOCAB, random_bart, write_model_sized_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, MAX_NEW = 120, 8
FROZEN = ("source_embedding/.*",)  # the vocabulary-sized table (tied: encoder, decoder, output)
SENTENCES = [" ".join(EN[:3]), " ".join(EN[3:8]), "the dog", "a red house", "old man sees cat"]


@pytest.fixture(scope="module")
def bart_run(tmp_path_factory):
    """(train config, the BART folder, the workdir, train.py's log) of a STEPS-step fine-tune."""
    root = tmp_path_factory.mktemp("finetune_bart")
    data = root / "data"
    write_data(data, generated_pairs(400, 0), generated_pairs(40, 1))
    pretrained = root / "pretrained"
    random_bart("bart", seed=0).save_pretrained(pretrained)
    write_model_sized_tokenizer(pretrained)
    config = finetune_config(pretrained, data, STEPS, freeze=FROZEN)
    assert config.tokenizer == str(pretrained)  # the folder's own tokenizer
    workdir = root / "run"
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train.train_and_evaluate(config, str(workdir))
    sys.stdout.write(log.getvalue())
    return config, pretrained, workdir, log.getvalue()


def test_the_workdir_holds_the_bart_tokenizer(bart_run):
    _, pretrained, workdir, _ = bart_run
    names = [p.name for p in pretrained.iterdir() if p.name.startswith("tokenizer")]
    assert "tokenizer.json" in names  # what transformers 5 writes for BartTokenizer
    for name in names:
        assert (workdir / name).read_bytes() == (pretrained / name).read_bytes(), name
    assert not (workdir / "spm_shared.model").exists()
    reference = transformers.AutoTokenizer.from_pretrained(str(pretrained))
    source, target = load_vocabularies(str(workdir))
    texts = [" ".join(EN[:4]), "a big dog"]
    # <s> text </s> on both sides: BART's labels (the decoder starts from </s>).
    for vocab in (source, target):
        assert [[*vocab.encode(t), *vocab.suffix_ids] for t in texts] == reference(texts)[
            "input_ids"
        ]


def test_every_parameter_is_restored_and_the_eval_loss_falls(bart_run):
    config, pretrained, workdir, log = bart_run
    restored = [line for line in log.splitlines() if f"init_from {pretrained}:" in line]
    assert (
        len(restored) == 1
        and "0 partially restored, 0 newly initialised, 0 dropped" in (restored[0])
    ), restored
    model_config = json.loads((workdir / "model_config.json").read_text())
    assert model_config["position"] == "learned" and model_config["learned_position_offset"] == 2
    assert model_config["embedding_norm"] and model_config["norm_position"] == "post"
    assert model_config["vocab_size"] == VOCAB and model_config["target_vocab_size"] is None
    assert model_config["bos_id"] == EOS  # BART's decoder start, from its config.json
    _, start, _ = hf.load_pretrained(str(pretrained))
    end = final_params(workdir)
    # Frozen and restored: bitwise the folder's, every row (no row at its random init).
    np.testing.assert_array_equal(
        end["source_embedding"]["embedding"], start["source_embedding"]["embedding"]
    )
    assert end["decoder"]["logits_bias"].shape == start["decoder"]["logits_bias"].shape == (VOCAB,)
    before, after = eval_loss(config, workdir, start), eval_loss(config, workdir, end)
    print(f"BART fine-tune: eval smoothed KL {before:.3f} (restored) -> {after:.3f} ({STEPS})")
    assert after < 0.8 * before, (before, after)


@pytest.fixture(scope="module")
def exported(bart_run, tmp_path_factory):
    """The fine-tuned run as a Hugging Face folder (model and the workdir's tokenizer) and
    transformers' greedy translations of SENTENCES with it."""
    workdir = bart_run[2]
    folder = tmp_path_factory.mktemp("bart_exported") / "hf"
    hf.export_workdir(str(workdir), str(folder))
    model = transformers.BartForConditionalGeneration.from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, num_beams=1, max_new_tokens=MAX_NEW)
    texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    return [" ".join(t.split()) for t in texts]


def test_the_translator_and_the_cli_translate_with_the_workdirs_tokenizer(
    bart_run, exported, tmp_path
):
    from flaxformer_lite.cli import translate

    workdir = bart_run[2]
    got = Translator.from_pretrained(str(workdir)).translate(
        SENTENCES, method="greedy", max_len=MAX_NEW
    )
    assert got == exported
    assert len(set(got)) >= 3 and all(got)
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{s}\n" for s in SENTENCES))
    argv = ["--workdir", str(workdir), "--input", str(source), "--output", str(tmp_path / "o")]
    assert translate.main([*argv, "--method", "greedy", "--max_len", str(MAX_NEW)]) == 0
    assert (tmp_path / "o").read_text().splitlines() == exported


def test_the_export_serves_the_translators_translations(bart_run, tmp_path):
    workdir = bart_run[2]
    artifact = tmp_path / "artifact"
    argv = ["--workdir", str(workdir), "--out", str(artifact), "--method", "greedy"]
    assert export.main([*argv, "--max-len", str(MAX_NEW)]) == 0
    spec = importlib.util.spec_from_file_location("bart_runtime", artifact / "runtime.py")
    runtime = importlib.util.module_from_spec(spec)
    sys.modules["bart_runtime"] = runtime
    spec.loader.exec_module(runtime)
    served = runtime.load(str(artifact))
    sentences = [" ".join(EN[:3]), " ".join(EN[3:8]), "the dog"]
    expected = Translator.from_workdir(str(workdir)).translate(
        sentences, method="greedy", max_len=MAX_NEW
    )
    assert served.translate(sentences) == expected
    assert any(expected)  # not all empty
