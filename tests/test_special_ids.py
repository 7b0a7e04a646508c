"""Non-default special ids end to end: a Marian-like layout (eos 0, unk 1, pad = vocab - 1,
decoder start = pad) through the data pipeline, the loss weights, the model config of a run,
train.py's decoding metric and the Translator.

The vocabulary here puts EOS where the project's vocabularies put PAD (0), so a pipeline or a
translator that still pads with 0, appends 1 or trims at 1 gives other tokens, other outputs
or other weights than the references built in this file from the layout alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

import train  # noqa: E402
from flaxformer_lite.core import sharding  # noqa: E402
from flaxformer_lite.data.batching import (  # noqa: E402
    batch_by_tokens,
    classification_batches,
    lm_batches,
    padding_fraction,
)
from flaxformer_lite.data.encoding import encode_labeled, encode_pairs, lm_token_stream  # noqa: E402
from flaxformer_lite.data.packing import pack_examples  # noqa: E402
from flaxformer_lite.data.tasks.base import Task, vocabulary_ids  # noqa: E402
from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.inference.translator import BUCKET, SymbolVocabulary, Translator  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

EOS, UNK = 0, 1
SYMBOLS = "0123456789"
VOCAB = 2 + len(SYMBOLS) + 1  # eos, unk, the symbols, pad
PAD = VOCAB - 1


class MarianLikeVocabulary:
    """Marian's layout on digit symbols: ``</s>`` 0, ``<unk>`` 1, symbols 2..11, ``<pad>``
    last; no BOS (decoding starts from pad)."""

    vocab_size, pad_id, eos_id, unk_id = VOCAB, PAD, EOS, UNK

    def encode(self, text: str) -> list[int]:
        return [2 + SYMBOLS.index(c) if c in SYMBOLS else UNK for c in text if not c.isspace()]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            if int(i) == EOS:
                break
            if 2 <= int(i) < PAD:
                out.append(SYMBOLS[int(i) - 2])
        return "".join(out)

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        names = {EOS: "</s>", UNK: "<unk>", PAD: "<pad>"}
        return [
            names.get(int(i), SYMBOLS[int(i) - 2] if 2 <= int(i) < PAD else "<unk>") for i in ids
        ]


VOCABULARY = MarianLikeVocabulary()
CONFIG = TransformerConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=32,
    tie_output_embedding=False,
    **vocabulary_ids(VOCABULARY),
)
SENTENCES = ["3141", "27", "5 5 0 1 9", "9", "8x2"]  # "x" is unknown


def default_config():
    """configs/default.py's training config."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("default", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_vocabulary_ids_are_the_config_fields_and_refuse_disagreeing_sides():
    assert vocabulary_ids(VOCABULARY) == {"pad_id": PAD, "eos_id": 0, "unk_id": 1, "bos_id": PAD}
    assert (CONFIG.pad_id, CONFIG.bos_id, CONFIG.eos_id, CONFIG.unk_id) == (PAD, PAD, 0, 1)
    default = SymbolVocabulary(SYMBOLS)
    assert vocabulary_ids(default) == {"pad_id": 0, "eos_id": 1, "unk_id": 3, "bos_id": 2}
    with pytest.raises(ValueError, match="share the special ids"):
        vocabulary_ids(VOCABULARY, default)


def test_model_config_takes_the_ids_of_the_task_vocabulary():
    config = default_config()
    config.model = dict(d_model=16, num_heads=2, d_ff=32, dtype="float32")
    task = Task(kind="translation", train=None, eval_batches=[], vocab_size=VOCAB,
                target_vocab_size=None, max_len=32,
                special_ids=vocabulary_ids(VOCABULARY))  # fmt: skip
    cfg = train.model_config(config, task)
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id, cfg.unk_id) == (PAD, PAD, 0, 1)
    config.model["eos_id"] = 0  # the same as the vocabulary's: fine
    assert train.model_config(config, task).eos_id == 0
    config.model["pad_id"] = 0  # the project's default, not this vocabulary's
    with pytest.raises(ValueError, match=rf"config.model.pad_id=0 .* pad_id={PAD}"):
        train.model_config(config, task)


def test_pipeline_appends_eos_0_and_pads_with_pad_id_at_zero_weight():
    pairs = [("3141", "1413"), ("27", "72"), ("9", "9"), ("5 5 0 1 9 2 6", "6 2 9 1 0 5 5")]
    examples = encode_pairs(pairs, VOCABULARY, VOCABULARY, max_len=8)
    for example, (src, tgt) in zip(examples, pairs, strict=True):
        np.testing.assert_array_equal(example["inputs"], [*VOCABULARY.encode(src), EOS])
        np.testing.assert_array_equal(example["targets"], [*VOCABULARY.encode(tgt), EOS])
    lengths = sum(len(e["targets"]) for e in examples)
    for batches in (
        batch_by_tokens(examples, tokens_per_batch=32, boundaries=[8], pad_id=PAD, shuffle=False),
        pack_examples(examples, length=16, rows_per_batch=2, pad_id=PAD, shuffle=False),
    ):
        real = 0
        for batch in batches:
            for side in ("inputs", "targets"):
                for row in batch[side]:  # examples, each ending with EOS 0, then pads
                    ends = np.flatnonzero(row == EOS)
                    stop = ends[-1] + 1 if len(ends) else 0
                    assert np.all(row[stop:] == PAD) and not np.any(row[:stop] == PAD)
            real += int(np.count_nonzero(batch["targets"] != PAD))
        assert real == lengths
        total = sum(b["targets"].size for b in batches)
        assert padding_fraction(batches, PAD) == pytest.approx(1 - lengths / total)

    # train.forward's loss weights: 0 exactly at the pad id, 1 on every real token (EOS 0 too).
    batch = batch_by_tokens(
        examples, tokens_per_batch=32, boundaries=[8], pad_id=PAD, shuffle=False
    )[0]
    model = EncoderDecoder(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"], batch["targets"])["params"]
    _, labels, weights, _ = train.forward(model, "translation", params, batch, deterministic=True)
    np.testing.assert_array_equal(np.asarray(weights), batch["targets"] != PAD)
    assert float(np.asarray(weights)[np.asarray(labels) == EOS].min()) == 1.0

    stream = lm_token_stream(["31", "4"], VOCABULARY)
    np.testing.assert_array_equal(stream, [5, 3, EOS, 6, EOS])
    (window,) = lm_batches(stream, seq_len=5, batch_size=2, pad_id=PAD)
    np.testing.assert_array_equal(window["targets"], [stream, [PAD] * 5])
    labeled = encode_labeled([("31", 1)], VOCABULARY, max_len=4)
    (cls,) = classification_batches(labeled, max_len=4, batch_size=2, pad_id=PAD)
    np.testing.assert_array_equal(cls["inputs"], [[5, 3, EOS, PAD], [PAD] * 4])
    np.testing.assert_array_equal(cls["weights"], [1, 0])


@pytest.fixture(scope="module")
def params():
    """Random weights (numpy draws: no compile), norms 1 and biases 0: with this seed some rows
    end with EOS 0 after a symbol or two and others run to the decode limit."""
    rng = np.random.default_rng(0)

    def draw(path, shape):
        name = jax.tree_util.keystr(path[-1:])
        if "scale" in name or "bias" in name:
            return np.full(shape.shape, float("scale" in name), shape.dtype)
        return rng.normal(0.0, 0.3, shape.shape).astype(shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, Translator.abstract_params(CONFIG))


def reference_tokens(params, sentences, *, method, max_len):
    """generate()'s tokens for ``sentences`` fed exactly as the Translator feeds them (ids +
    EOS 0, padded with the pad id to a multiple of BUCKET, longest first), in input order."""
    ids = [[*VOCABULARY.encode(s), EOS] for s in sentences]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    rows = 1 << (len(ids) - 1).bit_length()
    width = -(-max(len(x) for x in ids) // BUCKET) * BUCKET
    inputs = np.full((rows, width), PAD, np.int32)
    for row, i in enumerate(order):
        inputs[row, : len(ids[i])] = ids[i]
    inputs[len(ids) :] = inputs[0]
    beam = {"beam_size": 2, "alpha": 0.6} if method == "beam" else {"beam_size": 1, "alpha": 0.0}
    tokens, _ = generate(
        params, CONFIG, inputs, method=method, max_len=max_len, **beam,
        row_max_len=np.full((rows,), max_len, np.int32),
    )  # fmt: skip
    tokens = np.asarray(tokens)
    out = np.zeros((len(ids), max_len), np.int32)
    out[order] = tokens[: len(ids)]
    return out


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_translator_equals_generate_decoded_with_eos_0(params, method):
    translator = Translator(params, CONFIG, VOCABULARY, beam_size=2, alpha=0.6)
    max_len = 12
    tokens = reference_tokens(params, SENTENCES, method=method, max_len=max_len)
    ended = []
    for row in tokens:
        ends = np.flatnonzero(row == EOS)
        if len(ends):  # after EOS 0 the searches pad with the pad id, never before
            assert np.all(row[ends[0] + 1 :] == PAD) and not np.any(row[: ends[0]] == PAD)
        ended.append(len(ends) > 0 and ends[0] > 0)
    # Some rows end early with symbols before EOS, others not: both paths are compared.
    assert any(ended) and not all(ended), tokens
    expected = []
    for row in tokens.tolist():
        body = row[: row.index(EOS)] if EOS in row else row
        expected.append("".join(SYMBOLS[t - 2] for t in body if 2 <= t < PAD))
    got = translator.translate(SENTENCES, method=method, max_len=max_len)
    assert got == expected
    assert any(expected) and len(set(expected)) > 2


def test_translator_source_ids_and_attention_use_the_config_ids(params):
    translator = Translator(params, CONFIG, VOCABULARY)
    ids, _ = translator.encode(["31", ""])
    assert ids == [[5, 3, EOS], None]
    maps = translator.attention("3141")
    assert maps["source_pieces"] == ["3", "1", "4", "1", "</s>"]
    # The decoder reads the decoder-start (= pad) id first; its target stops at EOS 0.
    assert maps["decoder_input_pieces"][0] == "<pad>"
    assert "</s>" not in maps["target_pieces"][:-1]
    # A vocabulary with the project's default ids cannot drive this model.
    with pytest.raises(ValueError, match="special ids"):
        Translator(params, CONFIG, SymbolVocabulary(SYMBOLS))


def test_decode_metric_counts_rows_padded_with_the_pad_id(params):
    """train.decode_metric on an exact-match task in this layout: references that are the
    greedy tokens on even rows and one symbol off on odd rows, plus two all-pad padding rows
    that must not count."""
    sentences = ["3141", "27", "55019", "9", "8642", "1"]
    max_len = 8
    tokens = reference_tokens(params, sentences, method="greedy", max_len=max_len)
    inputs = np.full((8, BUCKET), PAD, np.int32)
    for row, s in enumerate(sentences):
        ids = [*VOCABULARY.encode(s), EOS]
        inputs[row, : len(ids)] = ids
    references = np.full((8, max_len), PAD, np.int32)
    references[: len(sentences)] = tokens
    references[1:6:2, 0] = 2 + (references[1:6:2, 0] - 2 + 1) % len(SYMBOLS)
    task = Task(kind="synthetic", train=None, eval_batches=[], vocab_size=VOCAB,
                target_vocab_size=None, max_len=32, decode_inputs=[inputs],
                decode_references=[references], detokenize=VOCABULARY.decode,
                source_detokenize=VOCABULARY.decode)  # fmt: skip
    mesh = sharding.make_mesh((-1, 1, 1))
    metrics, examples = train.decode_metric(task, params, CONFIG, mesh)
    assert metrics["eval/exact_match"] == pytest.approx(3 / 6)
    assert examples[0][0] == "3141"


def test_a_resumed_run_keeps_the_ids_its_vocabulary_gave_model_config_json():
    """preflight compares a resumed run's model with the saved model_config.json: ids that came
    from the workdir's vocabulary (reused on resume) are not a change; ids set in
    config.model are compared."""
    import dataclasses

    from flaxformer_lite.training import preflight

    config = default_config()
    saved = dataclasses.asdict(TransformerConfig(**{**config.model, **vocabulary_ids(VOCABULARY)}))
    assert preflight._model_changes(config, saved) == {}
    config.model["eos_id"] = 1
    assert preflight._model_changes(config, saved) == {"model.eos_id": (EOS, 1)}
