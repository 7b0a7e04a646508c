"""Fine-tuning from a BART folder (train.py with --config.init_from) and serving the result.

The "pretrained" model is a tiny random ``BartForConditionalGeneration`` saved by transformers
(tests/helpers/hf_bart.py); the data are test_finetune's generated word-for-word pairs. The
translation task reads a pretrained *Marian* tokenizer only, so the run trains its own
SentencePiece vocabulary on the data (``config.tokenizer`` removed) and init_from restores every
BART parameter, the embedding and logits-bias rows the two vocabularies share partially.
Checked: the run keeps BART's architecture (post-LN, learned positions with offset 2, embedding
norm), its eval loss falls from the restored start, and ``python -m
flaxformer_lite.inference.export`` serves it with the Translator's translations.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

torch = pytest.importorskip("torch", reason="the pretrained model is built with PyTorch")
transformers = pytest.importorskip("transformers", reason="BartForConditionalGeneration")

from test_finetune import (  # noqa: E402
    EN,
    eval_loss,
    final_params,
    finetune_config,
    generated_pairs,
    write_data,
)

import train  # noqa: E402
from flaxformer_lite.inference import export  # noqa: E402
from flaxformer_lite.inference.translator import Translator  # noqa: E402
from flaxformer_lite.interop import hf  # noqa: E402

from helpers.hf_bart import random_bart  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, DATA_VOCAB, MAX_NEW = 30, 60, 8


@pytest.fixture(scope="module")
def bart_run(tmp_path_factory):
    """(train config, the BART folder, the workdir) of a 30-step fine-tune."""
    root = tmp_path_factory.mktemp("finetune_bart")
    data = root / "data"
    write_data(data, generated_pairs(400, 0), generated_pairs(40, 1))
    pretrained = root / "pretrained"
    random_bart("bart", seed=0).save_pretrained(pretrained)
    config = finetune_config(pretrained, data, STEPS)
    del config["tokenizer"]  # the data's own SentencePiece vocabulary (see the docstring)
    config.vocab_size = DATA_VOCAB
    workdir = root / "run"
    train.train_and_evaluate(config, str(workdir))
    return config, pretrained, workdir


def test_the_run_keeps_bart_and_its_eval_loss_falls(bart_run):
    config, pretrained, workdir = bart_run
    model_config = json.loads((workdir / "model_config.json").read_text())
    assert model_config["position"] == "learned" and model_config["learned_position_offset"] == 2
    assert model_config["embedding_norm"] and model_config["norm_position"] == "post"
    assert model_config["vocab_size"] == DATA_VOCAB
    # The restored start: every BART tensor, the shared vocabulary rows of the others.
    _, start, _ = hf.load_pretrained(str(pretrained))
    start["source_embedding"]["embedding"] = start["source_embedding"]["embedding"][:DATA_VOCAB]
    start["decoder"]["logits_bias"] = start["decoder"]["logits_bias"][:DATA_VOCAB]
    end = final_params(workdir)
    before, after = eval_loss(config, workdir, start), eval_loss(config, workdir, end)
    print(f"BART fine-tune: eval smoothed KL {before:.3f} (restored) -> {after:.3f} ({STEPS})")
    assert after < 0.8 * before, (before, after)


def test_the_export_serves_the_translators_translations(bart_run, tmp_path):
    _, _, workdir = bart_run
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
