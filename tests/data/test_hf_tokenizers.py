"""flaxformer_lite.data.hf_tokenizers against transformers' tokenizers (the reference), built
offline: SentencePiece models trained here (unigram for T5 and mBART, BPE with byte fallback for
Llama 2) and byte-level BPEs trained with the `tokenizers` library (BART, Llama 3 style), each
loaded by its transformers class from a folder and saved with save_pretrained. For each family and
each of its file layouts, ids and decoded text equal transformers' on thousands of sentences."""

from __future__ import annotations

import json
import random
import shutil

import pytest

spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip(
    "transformers", reason="transformers' tokenizers are the reference (pip install -e '.[test]')"
)

from flaxformer_lite.data.hf_json_tokenizer import JsonTokenizer  # noqa: E402
from flaxformer_lite.data.hf_sentencepiece import (  # noqa: E402
    LlamaSentencePiece,
    MBartSentencePiece,
    T5SentencePiece,
)
from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer  # noqa: E402

SYLLABLES = "ka lo mi nu pe ra si to vu be da fe go hi ju".split()
WORDS = [
    "".join(random.Random(k).choice(SYLLABLES) for _ in range(1 + k % 4)) for k in range(300)
] + "the a dog cat runs walks big small red Haus läuft groß café".split()
# Never in training: unknown pieces (T5, mBART), byte fallback (Llama 2), new bytes (BPE).
RARE = ["ß", "é", "ø", "Ω", "日本", "№", "ﬁ", "🙂", "Ǆ", "ｆｕｌｌ", "x\u0301", "Zürich", "Ĳ"]
PUNCT = [".", ",", "!", "?", "...", " ,", " .", "'s", " n't", "(", ")", "-", '"', ":"]
SPACES = [" ", "  ", "\t", "\n", "\u00a0", "\u3000"]
N_SENTENCES = 3000


def sentences(rng: random.Random, n: int) -> list[str]:
    out = ["", " ", "  ", "a", " a", "a ", "hello", "123", "2024, 7.5%", "\u00a0x", "x\ty"]
    while len(out) < n:
        ws = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws) + 1), str(rng.randint(0, 100000)))
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws) + 1), rng.choice(RARE))
        if rng.random() < 0.3:
            k = rng.randrange(len(ws))
            ws[k] += rng.choice(PUNCT)
        text = " ".join(ws)
        if rng.random() < 0.5:
            text = text[0].upper() + text[1:] + rng.choice(PUNCT)
        if rng.random() < 0.15:
            text = text.replace(" ", rng.choice(SPACES), rng.randint(1, 3))
        if rng.random() < 0.15:
            text = rng.choice(SPACES) + text
        if rng.random() < 0.15:
            text += rng.choice(SPACES)
        out.append(text)
    return out


def train_spm(root, name: str, **options) -> None:
    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(WORDS[:300]) for _ in range(rng.randint(1, 10))) for _ in range(3000)
    ]
    lines += [f"{rng.randint(0, 999)} {rng.choice(WORDS)}." for _ in range(300)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(root / name),
        character_coverage=0.995,
        minloglevel=2,
        **options,
    )


def train_byte_level_bpe(special_tokens: list[str]):
    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(WORDS[:300]) for _ in range(rng.randint(1, 10))) for _ in range(3000)
    ]
    lines += [f"{rng.randint(0, 999)} {rng.choice(WORDS)}." for _ in range(300)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=400, min_frequency=2, special_tokens=special_tokens)
    return bpe


def write_config(folder, **config) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def texts():
    return sentences(random.Random(1), N_SENTENCES)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> (folder, model_type, transformers reference loaded from that folder, our class).
    Each family appears with its own files (sentencepiece / vocab+merges) and as transformers
    saves it (tokenizer.json)."""
    root = tmp_path_factory.mktemp("hf_tok")
    out = {}

    def add(name, folder, model_type, reference_class, our_class, **kwargs):
        reference = reference_class.from_pretrained(str(folder), **kwargs)
        out[name] = (folder, model_type, reference, our_class)
        saved = root / f"{name}_saved"
        reference.save_pretrained(str(saved))
        assert (saved / "tokenizer.json").is_file()
        out[f"{name}_json"] = (
            saved,
            model_type,
            reference_class.from_pretrained(str(saved), **kwargs),
            JsonTokenizer,
        )

    # T5: a unigram model with T5's ids (pad 0, eos 1, unk 2) and T5's nmt_nfkc normalizer.
    train_spm(
        root, "t5", vocab_size=110, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1
    )
    t5 = root / "t5"
    t5.mkdir()
    shutil.copy(root / "t5.model", t5 / "spiece.model")
    write_config(t5, tokenizer_class="T5Tokenizer", extra_ids=10)
    add("t5", t5, "t5", transformers.T5Tokenizer, T5SentencePiece)

    # Llama 2: BPE with byte fallback, split digits, no normalization, as Llama 2's model.
    train_spm(
        root,
        "llama",
        vocab_size=450,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )
    llama = root / "llama"
    llama.mkdir()
    shutil.copy(root / "llama.model", llama / "tokenizer.model")
    write_config(
        llama,
        tokenizer_class="LlamaTokenizer",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
    )
    add("llama2", llama, "llama", transformers.LlamaTokenizer, LlamaSentencePiece)

    # mBART: fairseq's SentencePiece layout (<unk> 0, <s> 1, </s> 2), a unigram model (as
    # mBART's "sentencepiece.bpe.model" is, despite its name).
    train_spm(
        root, "mbart", vocab_size=110, model_type="unigram", unk_id=0, bos_id=1, eos_id=2, pad_id=-1
    )
    mbart = root / "mbart"
    mbart.mkdir()
    shutil.copy(root / "mbart.model", mbart / "sentencepiece.bpe.model")
    write_config(mbart, tokenizer_class="MBartTokenizer", src_lang="en_XX", tgt_lang="ro_RO")
    add("mbart", mbart, "mbart", transformers.MBartTokenizer, MBartSentencePiece)

    # An mBART model trained as a BPE: transformers 5 still scores its pieces as a unigram model.
    train_spm(
        root, "mbart_bpe", vocab_size=150, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1
    )
    mbart_bpe = root / "mbart_bpe"
    mbart_bpe.mkdir()
    shutil.copy(root / "mbart_bpe.model", mbart_bpe / "sentencepiece.bpe.model")
    write_config(mbart_bpe, tokenizer_class="MBartTokenizer")
    reference = transformers.MBartTokenizer.from_pretrained(str(mbart_bpe))
    out["mbart_bpe"] = (mbart_bpe, "mbart", reference, MBartSentencePiece)

    # BART: RoBERTa's byte-level BPE as vocab.json + merges.txt.
    bart = root / "bart"
    bart.mkdir()
    train_byte_level_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]).save_model(str(bart))
    write_config(bart, tokenizer_class="BartTokenizer")
    add("bart", bart, "bart", transformers.BartTokenizer, JsonTokenizer)

    # Llama 3 / SmolLM style: a tokenizer.json alone, BOS through its post-processor.
    llama3 = root / "llama3"
    llama3.mkdir()
    bpe = train_byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>"])
    bpe.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", bpe.token_to_id("<|begin_of_text|>"))],
    )
    bpe.save(str(llama3 / "raw.json"))
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(llama3 / "raw.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    reference.save_pretrained(str(llama3))
    (llama3 / "raw.json").unlink()
    out["llama3"] = (
        llama3,
        "llama",
        transformers.AutoTokenizer.from_pretrained(str(llama3)),
        JsonTokenizer,
    )
    # Qwen2: transformers' Qwen2Tokenizer (NFC, its own pre-tokenizer regex, no BOS, pad = eos)
    # over a byte-level BPE, saved as tokenizer.json.
    bpe = json.loads(train_byte_level_bpe(["<|endoftext|>"]).to_str())["model"]
    qwen = root / "qwen2"
    transformers.Qwen2Tokenizer(
        vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]]
    ).save_pretrained(str(qwen))
    out["qwen2"] = (
        qwen,
        "qwen2",
        transformers.AutoTokenizer.from_pretrained(str(qwen)),
        JsonTokenizer,
    )
    return out


CASES = [
    "t5",
    "t5_json",
    "llama2",
    "llama2_json",
    "mbart",
    "mbart_json",
    "mbart_bpe",
    "bart",
    "bart_json",
    "llama3",
    "qwen2",
]


@pytest.mark.parametrize("name", CASES)
def test_ids_and_text_equal_transformers(cases, texts, name):
    folder, model_type, reference, our_class = cases[name]
    ours = load_hf_tokenizer(str(folder), model_type)
    assert type(ours) is our_class
    expected = reference(texts)["input_ids"]
    got = ours.encode(texts)
    for text, want, have in zip(texts, expected, got, strict=True):
        assert have == want, (name, text)
    expected_text = reference.batch_decode(expected, skip_special_tokens=True)
    assert ours.decode_batch(expected) == expected_text
    assert ours.decode(expected[20]) == expected_text[20]
    # Random ids (pieces in any order, special ids among them) decode alike too.
    rng = random.Random(2)
    noise = [[rng.randrange(len(reference)) for _ in range(rng.randint(0, 20))] for _ in range(500)]
    assert ours.decode_batch(noise) == reference.batch_decode(noise, skip_special_tokens=True)
    # The comparison reached the unknown / byte-fallback paths.
    pieces = {p for ids in expected for p in reference.convert_ids_to_tokens(ids)}
    assert pieces & {"<unk>", "<0xF0>", "ðŁ", "Ã"} or any(p.startswith("<0x") for p in pieces), name


@pytest.mark.parametrize("name", CASES)
def test_special_ids_and_vocab_size_equal_transformers(cases, name):
    folder, model_type, reference, _ = cases[name]
    ours = load_hf_tokenizer(str(folder), model_type)
    assert ours.vocab_size == len(reference)
    assert (ours.pad_id, ours.eos_id, ours.bos_id, ours.unk_id) == (
        reference.pad_token_id,
        reference.eos_token_id,
        reference.bos_token_id,
        reference.unk_token_id,
    )
    for token_id in [0, 1, 2, 3, 50, len(reference) - 1]:
        assert ours.id_to_piece([token_id]) == reference.convert_ids_to_tokens([token_id])


def test_family_conventions(cases):
    """The layouts the families are known by, from their definitions rather than transformers."""
    t5 = load_hf_tokenizer(str(cases["t5"][0]), "t5")
    assert (t5.pad_id, t5.eos_id, t5.unk_id, t5.bos_id) == (0, 1, 2, None)
    assert t5.encode(["", "the dog"])[0] == [1] and t5.encode(["the dog"])[0][-1] == 1
    assert t5.token_to_id("<extra_id_0>") == t5.vocab_size - 1 == 110 + 10 - 1
    assert t5.token_to_id("<extra_id_9>") == 110
    assert t5.encode(["<extra_id_0> dog"])[0][0] == 119
    llama = load_hf_tokenizer(str(cases["llama2"][0]), "llama")
    assert (llama.unk_id, llama.bos_id, llama.eos_id, llama.pad_id) == (0, 1, 2, None)
    ids = llama.encode(["日本"])[0]
    assert ids[0] == 1 and llama.id_to_piece(ids[2:]) == [f"<0x{b:02X}>" for b in "日本".encode()]
    mbart = load_hf_tokenizer(str(cases["mbart"][0]), "mbart")
    sp = spm.SentencePieceProcessor(model_file=str(cases["mbart"][0] / "sentencepiece.bpe.model"))
    assert [mbart.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert mbart.token_to_id("ar_AR") == sp.get_piece_size() + 1
    assert mbart.token_to_id("<mask>") == sp.get_piece_size() + 1 + 25 == mbart.vocab_size - 1
    ids = mbart.encode(["the dog ß"])[0]
    assert ids[-2:] == [2, mbart.token_to_id("en_XX")]
    assert ids[:-2] == [3 if i == 0 else i + 1 for i in sp.encode("the dog ß")]
    assert 3 in ids  # ß is not in the model: fairseq's <unk>


def test_mbart_languages_and_targets_equal_transformers(cases, texts):
    for name in ("mbart", "mbart_json"):
        folder, model_type, reference, _ = cases[name]
        ours = load_hf_tokenizer(str(folder), "mbart")
        assert (
            ours.encode(texts[:300], target=True) == reference(text_target=texts[:300])["input_ids"]
        )
        fr = load_hf_tokenizer(str(folder), "mbart", src_lang="fr_XX", tgt_lang="de_DE")
        theirs = type(reference).from_pretrained(str(folder), src_lang="fr_XX", tgt_lang="de_DE")
        assert fr.encode(texts[:300]) == theirs(texts[:300])["input_ids"]
        assert fr.encode(texts[:300], target=True) == theirs(text_target=texts[:300])["input_ids"]
        assert fr.encode(["a"])[0][-2:] == [2, ours.token_to_id("fr_XX")]


@pytest.mark.parametrize("name", ["t5", "llama2", "mbart", "bart", "bart_json", "llama3"])
def test_special_tokens_in_text_equal_transformers(cases, name):
    folder, model_type, reference, _ = cases[name]
    ours = load_hf_tokenizer(str(folder), model_type)
    specials = [t for t in reference.all_special_tokens if t][:6]
    rng = random.Random(3)
    texts = []
    for _ in range(300):
        parts = [rng.choice(WORDS + specials + specials) for _ in range(rng.randint(1, 6))]
        texts.append(rng.choice(["", " "]).join(parts) + rng.choice(["", " ", "."]))
    expected = reference(texts)["input_ids"]
    assert ours.encode(texts) == expected
    assert ours.decode_batch(expected) == reference.batch_decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("name", CASES)
def test_save_is_read_back_by_transformers(cases, texts, name, tmp_path):
    folder, model_type, reference, _ = cases[name]
    ours = load_hf_tokenizer(str(folder), model_type)
    ours.save(str(tmp_path / "out"))
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert loaded(texts[:300])["input_ids"] == reference(texts[:300])["input_ids"]
    again = load_hf_tokenizer(str(tmp_path / "out"), model_type)
    assert again.encode(texts[:300]) == ours.encode(texts[:300])


def test_folder_without_tokenizer_files_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_hf_tokenizer(str(tmp_path), "t5") is None


def test_bad_input_is_refused_with_one_line(cases, tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt9' has no tokenizer here; supported: t5"):
        load_hf_tokenizer(str(tmp_path), "gpt9")
    with pytest.raises(ValueError, match="is not a directory"):
        load_hf_tokenizer(str(tmp_path / "absent"), "t5")
    shutil.copy(cases["t5"][0] / "spiece.model", tmp_path / "spiece.model")
    with pytest.raises(
        ValueError,
        match=r"none that a 'llama' tokenizer reads: expected tokenizer.json or tokenizer.model",
    ):
        load_hf_tokenizer(str(tmp_path), "llama")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match=r"expected tokenizer.json or vocab.json \+ merges.txt"):
        load_hf_tokenizer(str(tmp_path), "bart")
    with pytest.raises(ValueError, match="src_lang/tgt_lang apply to model_type 'mbart' only"):
        load_hf_tokenizer(str(tmp_path), "t5", src_lang="en_XX")
    with pytest.raises(ValueError, match="language code 'xx_XX' is not one of mBART's"):
        load_hf_tokenizer(str(cases["mbart"][0]), "mbart", src_lang="xx_XX")
    t5 = load_hf_tokenizer(str(cases["t5"][0]), "t5")
    with pytest.raises(ValueError, match="texts must be a sequence of strings, not one str"):
        t5.encode("the dog")
    with pytest.raises(ValueError, match=r"texts\[1\] is int"):
        t5.encode(["a", 3])
