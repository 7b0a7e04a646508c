"""flaxformer_lite.data.marian_tokenizer against transformers.MarianTokenizer (the reference), on
SentencePiece models trained here and a vocabulary built the way Marian's is: the same ids for
thousands of sentences on both sides, the same text back, and files each can read."""

from __future__ import annotations

import json
import random

import pytest

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip(
    "transformers", reason="MarianTokenizer is the reference (pip install -e '.[test]')"
)

from flaxformer_lite.data.marian_tokenizer import MarianTokenizer  # noqa: E402

EN = "the a dog cat man woman child runs walks sees big small red old new house park".split()
DE = "der die das Hund Katze Mann Frau Kind läuft geht sieht groß klein rot alt neu Haus".split()
RARE = ["ß", "é", "ø", "Ω", "日本", "№", "ﬁ"]  # some never in training: <unk> or byte pieces


def sentences(rng: random.Random, words: list[str], n: int) -> list[str]:
    out = []
    for _ in range(n):
        ws = [rng.choice(words) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws) + 1), str(rng.randint(0, 2000)))
        if rng.random() < 0.2:
            ws.insert(rng.randrange(len(ws) + 1), rng.choice(RARE))
        text = " ".join(ws)
        if rng.random() < 0.5:
            text = text[0].upper() + text[1:] + rng.choice([".", "!", "?", " ,", "..."])
        if rng.random() < 0.1:
            text = "  " + text.replace(" ", "  ") + " "
        out.append(text)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(shared-vocabulary folder, separate-vocabulary folder, source texts, target texts)."""
    root = tmp_path_factory.mktemp("marian_tok")
    rng = random.Random(0)
    src_train, tgt_train = sentences(rng, EN, 3000), sentences(rng, DE, 3000)
    models = {}
    for side, lines in (("source", src_train), ("target", tgt_train)):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=str(root / side),
            vocab_size=120,
            model_type="unigram",
            character_coverage=0.999,
            bos_id=-1,
            eos_id=1,
            unk_id=0,
            pad_id=-1,
        )
        sp = spm.SentencePieceProcessor(model_file=str(root / f"{side}.model"))
        models[side] = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def table(pieces):  # Marian's layout: </s> 0, <unk> 1, pieces, <pad> last
        out = {"</s>": 0, "<unk>": 1}
        for p in pieces:
            if p not in out and p not in ("<s>", "<pad>"):
                out[p] = len(out)
        out[">>de<<"] = len(out)
        out[">>fr<<"] = len(out)
        out["<pad>"] = len(out)
        return out

    shared, separate = root / "shared", root / "separate"
    for folder in (shared, separate):
        folder.mkdir()
        for side in ("source", "target"):
            (folder / f"{side}.spm").write_bytes((root / f"{side}.model").read_bytes())
    # Drop some pieces from the shared table so that <unk> happens for known pieces too.
    kept = [p for k, p in enumerate(models["source"] + models["target"]) if k % 17 != 5]
    (shared / "vocab.json").write_text(json.dumps(table(kept), ensure_ascii=False))
    (separate / "vocab.json").write_text(json.dumps(table(models["source"]), ensure_ascii=False))
    (separate / "target_vocab.json").write_text(
        json.dumps(table(models["target"]), ensure_ascii=False)
    )
    (separate / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True}))
    rng = random.Random(1)
    return shared, separate, sentences(rng, EN, 2000), sentences(rng, DE, 2000)


def reference(folder, separate=False):
    files = {s: str(folder / f"{s}.spm") for s in ("source", "target")}
    kw = dict(separate_vocabs=True, target_vocab_file=str(folder / "target_vocab.json"))
    return transformers.MarianTokenizer(
        files["source"], files["target"], str(folder / "vocab.json"), **(kw if separate else {})
    )


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
def test_ids_and_text_match_marian_tokenizer(folders, separate):
    shared, sep, src, tgt = folders
    folder = sep if separate else shared
    ours, theirs = MarianTokenizer.load(str(folder)), reference(folder, separate)
    expected_src = theirs(src)["input_ids"]
    expected_tgt = theirs(text_target=tgt)["input_ids"]
    unk = 0
    for text, ids in zip(src, expected_src, strict=True):
        assert [*ours.source.encode(text), ours.eos_id] == ids, text
        unk += ids.count(ours.unk_id)
    for text, ids in zip(tgt, expected_tgt, strict=True):
        assert [*ours.target.encode(text), ours.eos_id] == ids, text
        assert ours.target.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert unk > 0  # the comparison covers unknown pieces
    assert ours.source.vocab_size == theirs.vocab_size


def test_language_code_and_special_tokens(folders):
    shared, _, _, _ = folders
    ours, theirs = MarianTokenizer.load(str(shared)), reference(shared)
    for text in [">>de<< the dog runs", ">>fr<<the cat", "the dog >>de<< runs", ">>xx<< a man"]:
        assert [*ours.source.encode(text), 0] == theirs(text)["input_ids"], text
    assert (
        ours.pad_id
        == ours.source.bos_id
        == len(json.loads((shared / "vocab.json").read_text())) - 1
    )
    assert (ours.eos_id, ours.unk_id) == (0, 1)
    ids = ours.target.encode("der Hund läuft")
    assert ours.target.decode([ours.pad_id, *ids, ours.eos_id, 5, 6]) == "der Hund läuft"


def test_save_is_read_by_transformers_with_the_same_ids(folders, tmp_path):
    shared, sep, src, _ = folders
    for folder, separate in ((shared, False), (sep, True)):
        out = tmp_path / folder.name
        MarianTokenizer.load(str(folder)).save(str(out))
        loaded = transformers.MarianTokenizer.from_pretrained(str(out))
        assert loaded.separate_vocabs == separate
        assert loaded(src[:200])["input_ids"] == reference(folder, separate)(src[:200])["input_ids"]
        assert MarianTokenizer.load(str(out)).source.encode(src[0]) == MarianTokenizer.load(
            str(folder)
        ).source.encode(src[0])


def test_missing_files_are_named(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="missing source.spm, target.spm"):
        MarianTokenizer.load(str(tmp_path))
