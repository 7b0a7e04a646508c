"""Tests of the SentencePiece wrapper (tiny corpora in tmp_path, no network)."""

import os
import random

import pytest

from flaxformer_lite.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    load_or_train,
)

WORDS = "the a cat dog sat ran on under mat red blue house small big tree".split()


def make_corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "."
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return make_corpus()


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("spm") / "unigram.model")
    return Tokenizer.train(corpus, path, 60)


def test_special_ids_are_fixed(tok):
    assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tok.id_to_piece([0, 1, 2, 3]) == ["<pad>", "</s>", "<s>", "<unk>"]


@pytest.mark.parametrize("model_type", ["unigram", "bpe", "char"])
def test_round_trip_of_training_sentences(corpus, tmp_path, model_type):
    tok = Tokenizer.train(corpus, str(tmp_path / "m.model"), 60, model_type=model_type)
    assert 4 < tok.vocab_size <= 60
    for sentence in corpus[:50]:
        ids = tok.encode(sentence)
        assert ids and all(4 <= i < tok.vocab_size for i in ids)  # no BOS/EOS/PAD/UNK
        assert tok.decode(ids) == sentence


def test_char_model_has_single_character_pieces(corpus, tmp_path):
    tok = Tokenizer.train(corpus, str(tmp_path / "c.model"), 60, model_type="char")
    pieces = tok.id_to_piece(range(4, tok.vocab_size))
    assert all(len(p) == 1 for p in pieces), pieces
    assert set("".join(corpus).replace(" ", "")) <= set(pieces)
    assert tok.id_to_piece(tok.encode("cat sat")) == ["▁", "c", "a", "t", "▁", "s", "a", "t"]


def test_decode_stops_at_eos_and_skips_pad_bos(tok, corpus):
    first, second = tok.encode(corpus[0]), tok.encode(corpus[1])
    assert tok.decode([BOS_ID, *first, EOS_ID, *second]) == corpus[0]
    assert tok.decode([PAD_ID, BOS_ID, *first, PAD_ID, PAD_ID]) == corpus[0]
    assert tok.decode([EOS_ID, *first]) == ""
    # Out-of-vocabulary ids (e.g. a padded output layer) decode as UNK, not an exception.
    assert tok.decode([tok.vocab_size + 5]) == tok.decode([UNK_ID]) != ""


def test_decode_lines_turns_eos_into_newlines(tok, corpus):
    first, second = tok.encode(corpus[0]), tok.encode(corpus[1])
    ids = [*first, EOS_ID, PAD_ID, *second, EOS_ID]
    assert tok.decode_lines(ids) == f"{corpus[0]}\n{corpus[1]}\n"
    assert tok.decode_lines(first[:0]) == ""


def test_encode_batch_matches_encode(tok, corpus):
    assert tok.encode_batch(corpus[:10]) == [tok.encode(s) for s in corpus[:10]]


def test_non_breaking_space_is_normalized(tok):
    assert tok.encode("the\xa0cat") == tok.encode("the cat")


def test_soft_vocab_limit_on_tiny_corpus(tmp_path):
    tok = Tokenizer.train(["a b c", "b c a"], str(tmp_path / "t.model"), 500)
    assert 4 < tok.vocab_size < 500


def test_train_writes_atomically_and_loads(corpus, tmp_path):
    path = str(tmp_path / "sub" / "m.model")
    tok = Tokenizer.train(corpus, path, 60, seed=3)
    assert os.listdir(tmp_path / "sub") == ["m.model"]  # no tmp file left behind
    assert tok.path == path
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.encode(corpus[5]) == tok.encode(corpus[5])


def test_same_corpus_and_seed_give_identical_model(corpus, tmp_path):
    Tokenizer.train(corpus, str(tmp_path / "a.model"), 60, seed=1)
    Tokenizer.train(corpus, str(tmp_path / "b.model"), 60, seed=1)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()


def test_load_or_train_reuses_existing_file(corpus, tmp_path):
    path = str(tmp_path / "m.model")
    first = load_or_train(path, lambda: corpus, 60)
    mtime = os.stat(path).st_mtime_ns
    pieces = first.id_to_piece(range(first.vocab_size))

    def must_not_be_called():
        raise AssertionError("texts_fn called although the model exists")

    # A different vocab_size and corpus would give another model if it were retrained.
    second = load_or_train(path, must_not_be_called, 40)
    assert os.stat(path).st_mtime_ns == mtime
    assert second.id_to_piece(range(second.vocab_size)) == pieces


def test_load_or_train_trains_when_missing(corpus, tmp_path):
    path = tmp_path / "new.model"
    calls = []

    def texts():
        calls.append(1)
        return iter(corpus)

    tok = load_or_train(str(path), texts, 50, model_type="bpe")
    assert calls == [1] and path.is_file()
    assert tok.decode(tok.encode(corpus[0])) == corpus[0]


def test_errors(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer.load(str(tmp_path / "nope.model"))
    with pytest.raises(ValueError, match="model_type"):
        Tokenizer.train(corpus, str(tmp_path / "x.model"), 60, model_type="wordpiece")
