"""Every config in configs/ loads and trains: a few steps each, in process, with a tiny model
on tiny local data this module writes (the hub is never asked).

Each run must end with a finite loss, a checkpoint of its last step that restores, the
vocabulary its task trains, and the evaluation metrics its config promises: exact match
(synthetic), BLEU by greedy decoding (translation: Multi30k's packed batches, WMT14's token
buckets), perplexity and a sampled continuation (language model), accuracy (classification).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.core.checkpoints import Checkpointer, finished_steps  # noqa: E402
from flaxformer_lite.training.metrics import read_metrics  # noqa: E402

from helpers.tiny_configs import load_config

STEPS = 4
TINY_MODEL = dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1)
LOOP = dict(
    num_train_steps=STEPS,
    warmup_steps=2,
    log_every=2,
    eval_every=STEPS,
    checkpoint_every=2,
    schedule="constant",
    learning_rate=1e-3,
    time_budget_minutes=None,  # configs/multi30k.py's hour: STEPS steps here
    cpu_devices=None,  # configs/multi30k.py's 2: this process's JAX already runs
)

# ----------------------------------------------------------------------------- tiny corpora

SUBJECTS = [("a man", "ein mann"), ("a woman", "eine frau"), ("the dog", "der hund")]
VERBS = [("sees", "sieht"), ("reads", "liest"), ("likes", "mag"), ("finds", "findet")]
OBJECTS = [("a book", "ein buch"), ("the ball", "den ball"), ("a red car", "ein rotes auto")]


def parallel_pairs() -> list[tuple[str, str]]:
    """36 English-German sentence pairs from a tiny grammar."""
    return [
        (f"{s} {v} {o} .", f"{sd} {vd} {od} .")
        for (s, sd), (v, vd), (o, od) in itertools.product(SUBJECTS, VERBS, OBJECTS)
    ]


def write_parallel(folder: Path, split: str, pairs: list[tuple[str, str]]) -> None:
    for lang, side in (("en", 0), ("de", 1)):
        (folder / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("config_data")
    pairs = parallel_pairs()
    multi30k, wmt14, sst2 = root / "multi30k", root / "wmt14", root / "sst2"
    for folder in (multi30k, wmt14, sst2):
        folder.mkdir()
    # Multi30k names its validation split "val" (config.local_splits); WMT14 keeps the hub's.
    write_parallel(multi30k, "train", pairs[:28])
    write_parallel(multi30k, "val", pairs[28:])
    write_parallel(wmt14, "train", pairs[:28])
    write_parallel(wmt14, "validation", pairs[28:])
    text = root / "input.txt"
    text.write_text("".join(f"{en}\n{de}\n" for en, de in pairs * 3))
    rows = [(en, int("dog" in en)) for en, _ in pairs]
    for name, part in (("train", rows[:28]), ("dev", rows[28:])):
        lines = ["sentence\tlabel", *(f"{t}\t{label}" for t, label in part)]
        (sst2 / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    imdb = root / "imdb"  # the SST-2 layout with IMDB's column name
    imdb.mkdir()
    for name in ("train", "dev"):
        lines = (sst2 / f"{name}.tsv").read_text().splitlines()
        (imdb / f"{name}.tsv").write_text("\n".join(["text\tlabel", *lines[1:]]) + "\n")
    marian = root / "marian"  # a "pretrained" Marian folder of TINY_MODEL's size, random
    marian_folder(marian, [t for pair in pairs for t in pair])
    return {
        "multi30k": multi30k,
        "wmt14": wmt14,
        "sst2": sst2,
        "imdb": imdb,
        "text": text,
        "marian": marian,
    }


def marian_folder(folder: Path, texts: list[str]) -> None:
    """A Hugging Face Marian folder written by our own save_pretrained (no torch needed):
    SentencePiece models on ``texts``, Marian's vocab.json, random TINY_MODEL weights."""
    import jax
    import sentencepiece as spm

    from flaxformer_lite import EncoderDecoder, TransformerConfig
    from flaxformer_lite.data.marian_tokenizer import MarianTokenizer
    from flaxformer_lite.interop import hf

    folder.mkdir()
    for side in ("source", "target"):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(folder / side),
            vocab_size=40,
            hard_vocab_limit=False,
            bos_id=-1,
            eos_id=1,
            unk_id=0,
            pad_id=-1,
        )
    vocab = {"</s>": 0, "<unk>": 1}
    for side in ("source", "target"):
        sp = spm.SentencePieceProcessor(model_file=str(folder / f"{side}.model"))
        for i in range(sp.get_piece_size()):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab.pop("<s>", None)
    vocab = {p: i for i, p in enumerate(vocab)}
    vocab["<pad>"] = len(vocab)
    tokenizer = MarianTokenizer(
        (folder / "source.model").read_bytes(), (folder / "target.model").read_bytes(), vocab
    )
    pad = len(vocab) - 1
    config = TransformerConfig(
        vocab_size=len(vocab),
        activation="silu",
        sinusoid_layout="halves",
        logits_bias=True,
        layer_norm_epsilon=1e-5,
        pad_id=pad,
        bos_id=pad,
        eos_id=0,
        unk_id=1,
        max_len=64,
        **TINY_MODEL,
    )
    x = jax.numpy.ones((1, 4), jax.numpy.int32)
    # Jitted: any random weights serve, and an eager init compiles op by op (several times
    # the CPU seconds of one program).
    params = jax.jit(EncoderDecoder(config).init)(jax.random.key(0), x, x)["params"]
    hf.save_pretrained(str(folder), config, params, tokenizer)


# ----------------------------------------------------------------------------- the runs


TRANSLATION = dict(vocab_size=48, max_len=16, tokens_per_batch=128, batch_size_multiple=8)

# Per config: (overrides of its top-level fields, with paths filled from `data`, the
# evaluation metrics it must report, the vocabulary file it must write).
RUNS = {
    "default": (
        lambda d: dict(batch_size=8, synthetic=dict(min_len=2, max_len=5, num_eval=8)),
        {"eval/exact_match"},
        "vocab.json",
    ),
    # decode_eval: Multi30k scores BLEU with the evaluate CLI after training; on here, the
    # packed run decodes its eval set too.
    "multi30k": (
        lambda d: dict(data_dir=str(d["multi30k"]), decode_eval=True, **TRANSLATION),
        {"eval/bleu"},
        "spm_shared.model",
    ),
    "wmt14_base": (
        lambda d: dict(data_dir=str(d["wmt14"]), **TRANSLATION),
        {"eval/bleu"},
        "spm_shared.model",
    ),
    "lm_tinyshakespeare": (
        # max_len 48: the sampled continuation follows a 32-token prompt.
        lambda d: dict(data_file=str(d["text"]), vocab_size=40, max_len=48, batch_size=8),
        {"eval/perplexity"},
        "spm_lm.model",
    ),
    "sst2": (
        lambda d: dict(data_dir=str(d["sst2"]), vocab_size=48, max_len=16, batch_size=8),
        {"eval/accuracy"},
        "spm_cls.model",
    ),
    "imdb": (
        lambda d: dict(data_dir=str(d["imdb"]), vocab_size=48, max_len=16, batch_size=8),
        {"eval/accuracy"},
        "spm_cls.model",
    ),
    # Starts from the "pretrained" Marian folder and its tokenizer (copied into the workdir).
    "finetune_marian": (
        lambda d: dict(
            init_from=str(d["marian"]), data_dir=str(d["multi30k"]), decode_eval=True, **TRANSLATION
        ),
        {"eval/bleu"},
        "vocab.json",
    ),
}


def test_every_config_file_is_run_here():
    files = {p.stem for p in (ROOT / "configs").glob("*.py")} - {"common"}
    assert files == set(RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_config_trains_a_few_steps_and_reports_its_metrics(name, data, tmp_path, capsys):
    overrides, promised, vocabulary = RUNS[name]
    config = load_config(name)
    config.model.update(TINY_MODEL)
    config.update({**LOOP, **overrides(data)})
    metrics = train.train_and_evaluate(config, str(tmp_path))
    out = capsys.readouterr().out

    assert promised <= set(metrics), sorted(metrics)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    lines = read_metrics(str(tmp_path))
    losses = [m["train/smoothed_kl"] for m in lines if "train/smoothed_kl" in m]
    assert len(losses) == STEPS // LOOP["log_every"] and all(map(math.isfinite, losses))
    assert [m["step"] for m in lines if "eval/smoothed_kl" in m] == [STEPS]
    # The last step's checkpoint is complete and restores, data position included.
    assert finished_steps(str(tmp_path / "checkpoints"))[-1] == STEPS
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    state, data_state = checkpointer.restore()
    checkpointer.close()
    assert int(state["step"]) == STEPS and "train" in data_state
    assert (tmp_path / vocabulary).is_file()
    saved = json.loads((tmp_path / "model_config.json").read_text())
    assert {k: saved[k] for k in TINY_MODEL} == TINY_MODEL
    if name == "lm_tinyshakespeare":
        # No label smoothing: the loss is the mean negative log-likelihood.
        assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/smoothed_kl"]))
        assert "sample:" in out
    if "eval/bleu" in promised:
        assert 0.0 <= metrics["eval/bleu"] <= 100.0
