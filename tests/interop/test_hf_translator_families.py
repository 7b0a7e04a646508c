"""The Translator on Hugging Face BART and T5 folders: the folder's own tokenizer in and out,
decoding as its ``generate`` does (greedy and beam 4 with the folder's generation config),
compared with transformers' ``generate`` + ``batch_decode`` on the same 32 texts.

The folders are tiny random models: a ``BartForConditionalGeneration`` (``helpers.hf_bart``;
sharper attention so that rows differ) with a byte-level BPE tokenizer of exactly its 64 ids,
and a T5 v1.1 (``helpers.hf_t5``) with a SentencePiece ``T5Tokenizer`` of 34 ids (the model has
3 more rows, as t5-small's 32,128 exceed its tokenizer's 32,100).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the BART reference runs in PyTorch")
transformers = pytest.importorskip("transformers", reason="BartForConditionalGeneration")

from flaxformer_lite.data.hf_vocabulary import HFVocabulary  # noqa: E402
from flaxformer_lite.inference.translator import Translator  # noqa: E402

from helpers import hf_t5  # noqa: E402
from helpers.hf_bart import (  # noqa: E402
    BOS,
    DECODING_QK_GAIN,
    EOS,
    PAD,
    random_bart,
    write_model_sized_tokenizer,
)

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456"
# bart-large's decoding: beam 4, <s> forced first, EOS forced at max_length.
BART_GENERATION = dict(
    decoder_start_token_id=EOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    forced_bos_token_id=BOS, forced_eos_token_id=EOS, num_beams=4, max_length=12,
)  # fmt: skip
# T5's ids (decoder start = pad 0, EOS 1), beam 4, no forced tokens.
T5_GENERATION = dict(
    decoder_start_token_id=hf_t5.PAD, eos_token_id=hf_t5.EOS, pad_token_id=hf_t5.PAD,
    num_beams=4, max_length=12,
)  # fmt: skip


def sentences(n: int, seed: int, words: list[str] | None = None) -> list[str]:
    """``n`` texts of 1-6 of ``words``, or (None) of 1-4 words of 1-5 of CHARS."""
    rng = random.Random(seed)
    if words is not None:
        return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(n)]
    return [
        " ".join(
            "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(n)
    ]


def bart_folder(folder):
    random_bart("bart", seed=2, qk_gain=DECODING_QK_GAIN).save_pretrained(folder)
    write_model_sized_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(BART_GENERATION, indent=2))
    model = transformers.BartForConditionalGeneration.from_pretrained(str(folder)).eval()
    return model, sentences(32, 0)


def t5_folder(folder):
    tokenizer = hf_t5.t5_tokenizer(folder.parent)
    hf_t5.random_t5("v1_1", seed=2, vocab_size=len(tokenizer) + 3).save_pretrained(folder)
    tokenizer.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps(T5_GENERATION, indent=2))
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(folder)).eval()
    return model, sentences(32, 0, hf_t5.TOKENIZER_WORDS.split())


@pytest.fixture(scope="module", params=["bart", "t5"])
def family(request, tmp_path_factory):
    """(name, the folder, the transformers model, its tokenizer, the texts, the Translator)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_translator") / "model"
    model, texts = {"bart": bart_folder, "t5": t5_folder}[request.param](folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    translator = Translator.from_pretrained(str(folder))
    return request.param, folder, model, tokenizer, texts, translator


def reference(model, tokenizer, texts, **kwargs) -> list[str]:
    """transformers' ``generate`` (the folder's generation config, ``kwargs`` over it) and
    ``batch_decode``, whitespace runs joined (the Translator's output normalisation)."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, **kwargs)
    return [" ".join(s.split()) for s in tokenizer.batch_decode(out, skip_special_tokens=True)]


def test_the_translator_encodes_with_the_folders_tokenizer(family):
    name, _, model, tokenizer, texts, translator = family
    assert isinstance(translator.source_vocab, HFVocabulary)
    ids, truncated = translator.encode(texts)
    assert truncated == 0 and ids == tokenizer(texts)["input_ids"]  # BART: <s> ... </s>
    assert translator.config.bos_id == model.config.decoder_start_token_id  # </s>; T5: pad
    assert translator.config.vocab_size == model.config.vocab_size


def test_beam_4_equals_generate(family):
    _, _, model, tokenizer, texts, translator = family
    want = reference(model, tokenizer, texts)
    assert translator.generation.method == "beam" and translator.generation.beam_size == 4
    assert translator.translate(texts) == want
    assert len(set(want)) >= 10, "the random model must not translate every row alike"


def test_greedy_equals_generate(family):
    _, _, model, tokenizer, texts, translator = family
    want = reference(model, tokenizer, texts, num_beams=1)
    assert translator.translate(texts, method="greedy") == want
    beam = reference(model, tokenizer, texts)
    assert sum(a != b for a, b in zip(want, beam, strict=True)) >= 5  # the two searches differ


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    """helpers.hf_bart.write_tokenizer's 64 ids plus an added <mask>: id 64 has no row."""
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    from helpers.hf_bart import write_tokenizer

    folder = tmp_path / "too_large"
    write_tokenizer(folder)
    tokenizer = load_hf_tokenizer(str(folder), "bart")
    with pytest.raises(ValueError, match=r"has 65 ids but the model's vocab_size is 64"):
        HFVocabulary(tokenizer, target=False, vocab_size=64, decoder_start_id=EOS)


def test_mbart_sides_end_with_the_language_code_and_eos(tmp_path):
    """mBART (cc25's layout): a source ends ``</s> en_XX``; a target ends at ``</s>`` (the
    decoder starts from the model's decoder start), both split off as the suffix."""
    from flaxformer_lite.data import hf_vocabulary
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    from helpers.hf_bart import LANGUAGE_CODE, model_sized_tokens

    folder = tmp_path / "mbart"
    write_model_sized_tokenizer(folder)
    hf_config = {"model_type": "mbart", "vocab_size": 64, "decoder_start_token_id": EOS}
    with pytest.raises(ValueError, match=r"config\.tokenizer_src_lang is not set"):
        hf_vocabulary.copy_to_workdir(str(folder), hf_config, str(tmp_path / "run0"))
    workdir = tmp_path / "run"
    hf_vocabulary.copy_to_workdir(
        str(folder), hf_config, str(workdir), src_lang=LANGUAGE_CODE, tgt_lang=LANGUAGE_CODE
    )
    source, target = hf_vocabulary.load_workdir_vocabularies(str(workdir))
    lang = model_sized_tokens().index(LANGUAGE_CODE)
    assert source.suffix_ids == (EOS, lang) and target.suffix_ids == (EOS,)
    assert source.prefix_ids == () and source.bos_id == EOS and source.vocab_size == 64
    full = load_hf_tokenizer(str(folder), "mbart", src_lang=LANGUAGE_CODE).encode(["ab c"])[0]
    assert [*source.encode("ab c"), *source.suffix_ids] == full
    assert full[-2:] == [EOS, lang] and len(full) == 6  # a, b, Ġ, c, </s>, en_XX
    assert source.decode([*source.encode("ab c"), EOS, 9]) == "ab c"
    assert np.all(np.asarray(target.encode("ab c")) != EOS)
