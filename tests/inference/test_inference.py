"""Inference from a training workdir: Translator, the translate / evaluate / attention_maps CLIs.

One tiny synthetic run (reverse digit strings) is trained once for the module, with the
top-level ``train.py``; every test reads its workdir. The model barely learns in that time:
the tests check the plumbing (order, empty lines, truncation, errors, files), not quality.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.cli import (
    attention_maps,  # noqa: E402
    evaluate,
    translate,
)
from flaxformer_lite.inference.translator import SymbolVocabulary, Translator  # noqa: E402

from helpers.tiny_configs import translator_config

# Four non-empty lines (one compiled shape for every translate call below: 4 rows, and sources
# padded to the model's max_len of 7), two empty ones, in an order that sorting would change.
LINES = ["3141", "", "27", "   ", "5 5 0 1 9", "9"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synthetic_run")
    train.train_and_evaluate(translator_config(), str(path))
    return path


@pytest.fixture(scope="module")
def translator(workdir) -> Translator:
    return Translator.from_workdir(str(workdir))


def run_cli(module: str, *args: str) -> int:
    """``python -m flaxformer_lite.<module> ARGS`` run in this process: ``runpy.run_module`` is
    what ``-m`` calls, so the module runs as ``__main__``, its ``if __name__ == "__main__"``
    line included, with ``sys.argv`` as the command line gives it. Returns the exit status.
    (In process, the run reuses this process's imports and compiled programs: a subprocess
    cost a JAX import and a model load and proved nothing more.)"""
    argv = sys.argv
    sys.argv = [f"flaxformer_lite/{module}.py", *args]
    try:
        with warnings.catch_warnings():  # runpy: "found in sys.modules ... prior to execution"
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(f"flaxformer_lite.{module}", run_name="__main__", alter_sys=True)
    except SystemExit as exit_info:
        return exit_info.code
    finally:
        sys.argv = argv
    raise AssertionError(f"flaxformer_lite.{module} as __main__ did not exit")


# ----------------------------------------------------------------------------- Translator


def test_from_workdir_loads_the_latest_or_a_given_step(workdir, translator):
    assert "step 40" in translator.name
    assert isinstance(translator.source_vocab, SymbolVocabulary)
    assert translator.source_vocab.symbols == "0123456789"
    earlier = Translator.from_workdir(str(workdir), step=20)
    assert "step 20" in earlier.name
    a = jax.tree_util.tree_leaves(translator.params)
    b = jax.tree_util.tree_leaves(earlier.params)
    assert len(a) == len(b) and not all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(FileNotFoundError, match=r"step 30 .*\[20, 40\]"):
        Translator.from_workdir(str(workdir), step=30)


def test_checkpoint_averaging_is_the_elementwise_mean(workdir, translator):
    earlier = Translator.from_workdir(str(workdir), step=20)
    averaged = Translator.from_workdir(str(workdir), average=2)
    assert "mean of steps [20, 40]" in averaged.name
    for m, a, b in zip(
        *(jax.tree_util.tree_leaves(t.params) for t in (averaged, translator, earlier)),
        strict=True,
    ):
        assert m.dtype == a.dtype
        np.testing.assert_allclose(m, (np.float64(a) + np.float64(b)) / 2, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"average=3 needs 3 checkpoints .*\[20, 40\]"):
        Translator.from_workdir(str(workdir), average=3)
    with pytest.raises(ValueError, match="average must be a positive int"):
        Translator.from_workdir(str(workdir), average=0)


def test_weighted_checkpoint_averaging_is_the_weighted_mean(workdir, translator):
    # An exponential moving average sampled at the checkpoints weighs the newer one more.
    from flaxformer_lite.core.checkpoints import average_params

    earlier = Translator.from_workdir(str(workdir), step=20)
    checkpoints, expected = (
        str(workdir / "checkpoints"),
        Translator.abstract_params(translator.config),
    )
    weighted = average_params(checkpoints, [20, 40], expected, weights=[1.0, 3.0])
    leaves = jax.tree_util.tree_leaves(weighted)
    for w, a, b in zip(
        leaves, *(jax.tree_util.tree_leaves(t.params) for t in (translator, earlier)), strict=True
    ):
        assert w.dtype == a.dtype
        np.testing.assert_allclose(w, (3 * np.float64(a) + np.float64(b)) / 4, rtol=1e-6, atol=1e-7)
    for bad, message in (
        ([1.0], r"one finite non-negative number per step \(2 steps \[20, 40\]\)"),
        ([1.0, -1.0], "one finite non-negative number per step"),
        ([1.0, float("nan")], "one finite non-negative number per step"),
        ([0.0, 0.0], "positive sum"),
    ):
        with pytest.raises(ValueError, match=message):
            average_params(checkpoints, [20, 40], expected, weights=bad)


def test_the_runs_average_checkpoints_is_the_default(workdir, translator, tmp_path):
    # A copy of the run whose config.json asks for the mean of its last 2 checkpoints (the
    # recipe's choice, made on val): from_workdir and the evaluate CLI use it by default.
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    run = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**run, "average_checkpoints": 2}))
    default = Translator.from_workdir(str(copy))
    assert default.checkpoint_steps == (20, 40) and "mean of steps [20, 40]" in default.name
    explicit = Translator.from_workdir(str(workdir), average=2)
    for a, b in zip(
        *(jax.tree_util.tree_leaves(t.params) for t in (default, explicit)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # An explicit average still wins; the original run (no such field) loads its last step.
    assert Translator.from_workdir(str(copy), average=1).checkpoint_steps == (40,)
    assert translator.checkpoint_steps == (40,)
    (tmp_path / "src.txt").write_text("3141\n27\n")
    (tmp_path / "ref.txt").write_text("1413\n72\n")
    report = tmp_path / "report.json"
    args = ["--workdir", str(copy), "--source", str(tmp_path / "src.txt")]
    args += ["--reference", str(tmp_path / "ref.txt"), "--report", str(report)]
    assert run_cli("cli.evaluate", *args) == 0
    record = json.loads(report.read_text())
    assert (record["average"], record["checkpoint_steps"]) == (2, [20, 40])


def test_translate_keeps_order_and_empty_lines(translator):
    outputs = translator.translate(LINES)
    assert len(outputs) == len(LINES)
    assert outputs[1] == "" and outputs[3] == ""
    assert all(set(out) <= set("0123456789") for out in outputs)
    # Input order: each line translated alone gives the same output as in the batch.
    alone = [translator.translate([line] * 4)[0] for line in LINES]
    assert alone == outputs


# A random model whose special ids (PAD, EOS, BOS, UNK) get logit 0 while the scaled-up symbol
# logits reach far above it: it never ends a sentence, so every sentence runs into its decode
# limit and the limit shows in the output length.
SHORT = "314"  # 3 symbols + EOS: its own limit is int(4 * 1.5) + 10 = 16 tokens
LONG = "271828182845904523536028747135"  # 30 symbols + EOS: limit min(48, 56) = 48


@pytest.fixture(scope="module")
def endless_translator() -> Translator:
    from flaxformer_lite.core.special_ids import SPECIAL_PIECES
    from flaxformer_lite.nn.config import TransformerConfig

    config = TransformerConfig(
        vocab_size=14,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        max_len=48,
        tie_output_embedding=False,
    )
    rng = np.random.default_rng(0)  # numpy draws: no compile for random weights
    params = jax.tree_util.tree_map(
        lambda s: rng.normal(0.0, 0.3, s.shape).astype(s.dtype),
        Translator.abstract_params(config),
    )
    kernel = params["decoder"]["logits"]["kernel"] * 8.0
    kernel[:, : len(SPECIAL_PIECES)] = 0.0
    params["decoder"]["logits"]["kernel"] = kernel
    return Translator(params, config, SymbolVocabulary("0123456789"), beam_size=2)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_a_sentence_translates_the_same_alone_and_beside_a_long_one(endless_translator, method):
    alone = endless_translator.translate([SHORT], method=method)[0]
    together = endless_translator.translate([LONG, SHORT], method=method)
    assert together[1] == alone
    # Each sentence stops at its own limit (1.5 x its tokens + 10), not at one derived from
    # the longest sentence of its batch (48 here) or from its padded length (34 alone).
    assert len(alone) == int((len(SHORT) + 1) * 1.5) + 10
    assert len(together[0]) == min(48, int((len(LONG) + 1) * 1.5) + 10)
    if method == "greedy":  # an explicit max_len is every sentence's limit
        assert [len(t) for t in endless_translator.translate([LONG, SHORT], max_len=20)] == [20] * 2


def test_bleu_evaluation_in_training_decodes_each_source_to_its_own_limit(endless_translator):
    from types import SimpleNamespace

    from flaxformer_lite.decoding.generate import default_mesh

    vocab, config = endless_translator.source_vocab, endless_translator.config

    def hypotheses(*sources: str) -> list[str]:
        ids = [[*vocab.encode(text), 1] for text in sources]  # EOS-terminated
        inputs = np.zeros((len(ids), max(map(len, ids))), np.int32)
        for row, x in enumerate(ids):
            inputs[row, : len(x)] = x
        task = SimpleNamespace(
            metric="bleu",
            decode_inputs=[inputs],
            decode_references=[list(sources)],
            detokenize=vocab.decode,
            source_detokenize=vocab.decode,
        )
        _, examples = train.decode_metric(task, endless_translator.params, config, default_mesh())
        return [hyp for _, hyp, _ in examples]

    alone = hypotheses(SHORT)[0]
    assert len(alone) == int((len(SHORT) + 1) * 1.5) + 10
    assert hypotheses(SHORT, LONG)[0] == alone


def test_sampling_is_reproducible_by_seed(translator):
    """Same seed, same samples; other seeds, other samples. At temperature 2 the barely
    trained model spreads its choices over many digits, so three seeds drawing the same 4
    outputs of up to 7 tokens each would be a sampler that ignores its seed."""
    lines = [line for line in LINES if line.strip()]
    samples = {
        seed: translator.translate(lines, method="sample", temperature=2.0, seed=seed)
        for seed in (5, 6, 7)
    }
    assert translator.translate(lines, method="sample", temperature=2.0, seed=5) == samples[5]
    assert all(len(out) == len(lines) for out in samples.values())
    assert len({tuple(out) for out in samples.values()}) == 3, samples


def test_over_long_inputs_are_truncated_with_one_warning(translator):
    lines = ["3141", "123456789", "12", "9876543210"]  # max_len 7: 6 symbols + EOS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = translator.translate(lines)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "2 of 4 input lines" in messages[0] and "truncated" in messages[0]
    assert len(outputs) == 4
    # A truncated line is translated as its first max_len - 1 symbols.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert translator.translate(["123456"] * 4)[0] == outputs[1]


def test_translate_rejects_bad_arguments(translator):
    with pytest.raises(ValueError, match="method"):
        translator.translate(["1"], method="nucleus")
    with pytest.raises(ValueError, match="beam_size"):
        translator.translate(["1"], beam_size=0)
    with pytest.raises(ValueError, match="max_len"):
        translator.translate(["1"], max_len=1000)


def test_attention_weights_cover_every_layer_and_head(translator):
    maps = translator.attention("3141")
    src, tgt = len(maps["source_pieces"]), len(maps["target_pieces"])
    assert maps["source_pieces"] == ["3", "1", "4", "1", "</s>"]
    assert maps["decoder_input_pieces"][0] == "<s>"
    assert maps["encoder_self"].shape == (1, 2, src, src)
    assert maps["decoder_self"].shape == (1, 2, tgt, tgt)
    assert maps["encoder_decoder"].shape == (1, 2, tgt, src)
    for key in ("encoder_self", "decoder_self", "encoder_decoder"):
        np.testing.assert_allclose(maps[key].sum(-1), 1.0, rtol=1e-5)
    # Causal: decoder position t never looks at later positions.
    assert np.all(np.triu(maps["decoder_self"][0, 0], k=1) == 0)
    assert maps["translation"] == "".join(p for p in maps["target_pieces"] if p != "</s>")


# ----------------------------------------------------------------------------- errors


def test_workdir_without_checkpoint_names_the_directory(workdir, tmp_path):
    empty = tmp_path / "no_checkpoint"
    empty.mkdir()
    for name in ("model_config.json", "config.json", "vocab.json"):
        shutil.copy(workdir / name, empty / name)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {empty}"):
        Translator.from_workdir(str(empty))
    with pytest.raises(FileNotFoundError, match="model_config.json"):
        Translator.from_workdir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Translator.from_workdir(str(tmp_path / "missing"))


def test_checkpoint_that_does_not_match_model_config_is_reported(workdir, tmp_path):
    other = tmp_path / "mismatch"
    shutil.copytree(workdir, other, ignore=shutil.ignore_patterns("tensorboard"))
    config = json.loads((other / "model_config.json").read_text())
    config["d_ff"] = 48
    (other / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not match.*mlp/wi/kernel.*\(32, 64\).*\(32, 48\)"):
        Translator.from_workdir(str(other))
    config["d_ff"], config["vocab_size"] = 64, 20
    (other / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary .* 14 entries .* 20"):
        Translator.from_workdir(str(other))


# ----------------------------------------------------------------------------- CLIs


def test_translate_cli_round_trips_a_file(workdir, translator, tmp_path, capsys):
    source, output = tmp_path / "input.txt", tmp_path / "output.txt"
    source.write_text("\n".join(LINES) + "\n")
    code = run_cli(
        "translate", "--workdir", str(workdir), "--input", str(source), "--output", str(output)
    )
    assert code == 0, capsys.readouterr().err
    lines = output.read_text().split("\n")
    assert lines[-1] == ""  # newline-terminated
    assert lines[:-1] == translator.translate(LINES)


def test_an_ensemble_of_one_model_twice_translates_as_the_model(translator):
    twice = Translator.ensemble([translator, translator])
    assert twice.translate(LINES) == translator.translate(LINES)
    assert twice.translate(LINES, method="greedy") == translator.translate(LINES, method="greedy")
    assert twice.name == f"{translator.name} + {translator.name}"


def test_ensemble_cli_decodes_the_workdirs_together(workdir, translator, tmp_path, capsys):
    """--workdir W --step 20 --ensemble W: the run's checkpoints 20 and 40 as one model (the
    search over two different models is checked in tests/decoding/test_generate.py). The
    translate CLI writes the Translator ensemble's output; evaluate's report names both."""
    earlier = Translator.from_workdir(str(workdir), step=20)
    expected = Translator.ensemble([earlier, translator]).translate(LINES)
    source, output = tmp_path / "input.txt", tmp_path / "output.txt"
    source.write_text("\n".join(LINES) + "\n")
    flags = ["--workdir", str(workdir), "--step", "20", "--ensemble", str(workdir)]
    code = run_cli("translate", *flags, "--input", str(source), "--output", str(output))
    assert code == 0, capsys.readouterr().err
    assert output.read_text().split("\n")[:-1] == expected
    report = tmp_path / "report.json"
    code = evaluate.main([*flags, "--source", str(source), "--reference", str(source),
                          "--report", str(report)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    record = json.loads(report.read_text())
    assert record["checkpoint"] == f"{earlier.name} + {translator.name}"
    assert record["ensemble"] == [str(workdir)]


def test_an_ensemble_refuses_what_it_cannot_combine(translator, spm_workdir):
    with pytest.raises(ValueError, match="needs 2 or more translators; got 1"):
        Translator.ensemble([translator])
    other = Translator.from_workdir(str(spm_workdir))
    with pytest.raises(ValueError, match=r"members\[1\] .* different model configs"):
        Translator.ensemble([translator, other])
    with pytest.raises(ValueError, match=r"members\[0\] is already an ensemble"):
        Translator.ensemble([Translator.ensemble([translator, translator]), translator])
    with pytest.raises(ValueError, match="attention\\(\\) of an ensemble"):
        Translator.ensemble([translator, translator]).attention("12")


def test_an_int8_ensemble_translates_and_mixed_precisions_are_refused(workdir, translator):
    """Members quantized by the Translator (``quantize="int8"``: int8 kernels, the config's
    ``quantization``) decode together as the int8 model does; an int8 member beside a float32
    one, or a bfloat16 one beside a float32 one, is refused, the differing fields named (the
    ensemble's arithmetic across precisions: tests/test_feature_matrix.py path i)."""
    int8 = Translator.from_workdir(str(workdir), quantize="int8")
    assert Translator.ensemble([int8, int8]).translate(LINES) == int8.translate(LINES)
    with pytest.raises(ValueError, match=r"model configs \(quantization=None / 'int8'\)"):
        Translator.ensemble([translator, int8])
    bf16 = Translator.from_workdir(str(workdir), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dtype='float32' / 'bfloat16'; param_dtype="):
        Translator.ensemble([translator, bf16])


def test_translate_cli_help_and_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        translate.main(["--help"])
    assert exit_info.value.code == 0 and "--beam_size" in capsys.readouterr().out
    assert translate.main(["--workdir", "/nonexistent/run"]) == 2
    assert "/nonexistent/run" in capsys.readouterr().err


def test_evaluate_cli_prints_bleu_with_signature(workdir, translator, tmp_path, capsys):
    source, reference, hyps = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "hyp.txt"
    sentences = [line for line in LINES if line.strip()]
    source.write_text("\n".join(sentences) + "\n")
    reference.write_text("\n".join(s.replace(" ", "")[::-1] for s in sentences) + "\n")
    code = evaluate.main(
        [
            "--workdir",
            str(workdir),
            "--source",
            str(source),
            "--reference",
            str(reference),
            "--output",
            str(hyps),
            "--report",
            str(tmp_path / "report.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "cased:      BLEU = " in out and "lowercased: BLEU = " in out
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    assert "case:lc" in out
    outputs = translator.translate(sentences)
    assert hyps.read_text().split("\n")[:-1] == outputs
    # The JSON record: the printed scores, recomputed here with sacrebleu itself (not through
    # evaluate.bleu_report) on the same text.
    import sacrebleu

    record = json.loads((tmp_path / "report.json").read_text())
    refs = [[s.replace(" ", "")[::-1] for s in sentences]]
    cased = sacrebleu.corpus_bleu(outputs, refs)
    lower = sacrebleu.corpus_bleu(outputs, refs, lowercase=True)
    assert record["bleu"] == round(cased.score, 2)
    assert record["bleu_lowercase"] == round(lower.score, 2)
    assert f"BLEU = {record['bleu']:.2f} " in out
    assert record["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    assert "case:lc" in record["signature_lowercase"]
    assert (record["beam_size"], record["alpha"], record["method"]) == (
        translator.beam_size,
        translator.alpha,
        "beam",
    )
    assert record["num_sentences"] == len(sentences) and str(workdir) in record["checkpoint"]


def test_bleu_report_equals_hand_computed_bleu():
    # Single-letter words: sacrebleu's 13a tokenizer keeps them as they are. Matched n-grams
    # over the corpus (cased):  1-grams 4+3+4 of 5+4+4, 2-grams 3+2+3 of 4+3+3,
    # 3-grams 2+1+2 of 3+2+2, 4-grams 1+0+1 of 2+1+1; hypothesis length = reference length, so
    # no brevity penalty. Lowercased, "X y z w" matches its reference entirely.
    hyps = ["a b c d e", "X y z w", "p q r s"]
    refs = ["a b c d f", "x y z w", "p q r s"]
    report = evaluate.bleu_report(hyps, refs)
    cased = 100 * (11 / 13 * 8 / 10 * 5 / 7 * 2 / 4) ** 0.25
    lower = 100 * (12 / 13 * 9 / 10 * 6 / 7 * 3 / 4) ** 0.25
    assert report["bleu"].score == pytest.approx(cased, abs=1e-9)  # 70.12
    assert report["bleu_lowercase"].score == pytest.approx(lower, abs=1e-9)  # 85.49
    assert report["exact_match"] == pytest.approx(1 / 3) and report["num_sentences"] == 3
    assert "case:mixed" in report["signature"] and "case:lc" in report["signature_lowercase"]
    # Every n-gram matches but the hypotheses are 8 words for 10: BLEU = brevity penalty
    # exp(1 - 10 / 8).
    short = evaluate.bleu_report(["a b c d", "x y z w"], ["a b c d e f", "x y z w"])
    assert short["bleu"].score == pytest.approx(100 * math.exp(1 - 10 / 8), abs=1e-9)  # 77.88


def test_attention_maps_cli_writes_pngs(workdir, tmp_path, capsys):
    out_dir = tmp_path / "maps"
    code = attention_maps.main(["--workdir", str(workdir), "--text", "3141", "--out", str(out_dir)])
    assert code == 0
    names = sorted(os.listdir(out_dir))
    assert names == [
        "decoder_self_layer0.png",
        "encoder_decoder_layer0.png",
        "encoder_self_layer0.png",
    ]
    for name in names:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "translation:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- SentencePiece


CORPUS = [
    "A man rides a bike down the street.",
    "Two dogs play in the snow.",
    "A woman is reading a book in the park.",
    "Children are playing football on the grass.",
    "An old man sits on a bench.",
    "A girl in a red dress is dancing.",
] * 4


@pytest.fixture(scope="module")
def spm_workdir(tmp_path_factory) -> Path:
    """A translation-style workdir written by hand: shared SentencePiece model, config files
    and an Orbax checkpoint of a train state with random parameters (the layout train.py
    writes), so the SentencePiece path is tested without a translation training run."""
    from flaxformer_lite.core.checkpoints import Checkpointer
    from flaxformer_lite.data.tokenizer import Tokenizer
    from flaxformer_lite.nn.config import TransformerConfig

    path = tmp_path_factory.mktemp("spm_run")
    tokenizer = Tokenizer.train(CORPUS, str(path / "spm_shared.model"), 48, num_threads=1)
    config = TransformerConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        max_len=24,
    )
    (path / "model_config.json").write_text(config.to_json())
    (path / "config.json").write_text(json.dumps({"task": "translation", "beam_size": 2}))
    # numpy draws instead of model.init: no compile needed for random weights.
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda s: rng.normal(0.0, 0.3, s.shape).astype(s.dtype),
        Translator.abstract_params(config),
    )
    state = {"step": np.int32(7), "params": params, "opt_state": {"mu": params}}
    checkpointer = Checkpointer(str(path / "checkpoints"), async_save=False)
    checkpointer.save(7, state, {"train": {"index": 7}}, force=True)
    checkpointer.close()
    return path


def test_sentencepiece_workdir_translates_and_labels_pieces(spm_workdir):
    translator = Translator.from_workdir(str(spm_workdir))
    assert translator.beam_size == 2  # from the run's config.json
    outputs = translator.translate(
        ["A man reads a book.", "", "Two dogs\tdance  in the park."], method="greedy", max_len=8
    )
    assert len(outputs) == 3 and outputs[1] == ""
    assert all(isinstance(out, str) and "\n" not in out for out in outputs)
    maps = translator.attention("A man reads a book.", max_len=8)
    assert maps["source_pieces"][0].startswith("\u2581")  # SentencePiece word-start marker
    assert maps["source_pieces"][-1] == "</s>"
    assert maps["encoder_decoder"].shape[-1] == len(maps["source_pieces"])
