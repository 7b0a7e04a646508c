"""The Translator on a Hugging Face BART folder: its own tokenizer in and out, decoding as the
folder's ``generate`` does (greedy and beam 4 with the folder's generation config), compared
with transformers' ``generate`` + ``batch_decode`` on the same texts.

The folder is a tiny random ``BartForConditionalGeneration`` (``helpers.hf_bart``; sharper
attention so that rows differ) with a byte-level BPE tokenizer of exactly the model's 64 ids.
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
GENERATION = dict(
    decoder_start_token_id=EOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    forced_bos_token_id=BOS, forced_eos_token_id=EOS, num_beams=4, max_length=12,
)  # fmt: skip


def sentences(n: int, seed: int) -> list[str]:
    """``n`` texts of 1-4 words of 1-5 characters, all in the tokenizer's vocabulary."""
    rng = random.Random(seed)
    return [
        " ".join(
            "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(n)
    ]


TEXTS = sentences(32, 0)


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
    """(the folder, the transformers model, its tokenizer)."""
    folder = tmp_path_factory.mktemp("bart_translator") / "bart"
    random_bart("bart", seed=2, qk_gain=DECODING_QK_GAIN).save_pretrained(folder)
    write_model_sized_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    model = transformers.BartForConditionalGeneration.from_pretrained(str(folder)).eval()
    return folder, model, transformers.AutoTokenizer.from_pretrained(str(folder))


def reference(model, tokenizer, **kwargs) -> list[str]:
    """transformers' ``generate`` (the folder's generation config, ``kwargs`` over it) and
    ``batch_decode``, whitespace runs joined (the Translator's output normalisation)."""
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, **kwargs)
    return [" ".join(s.split()) for s in tokenizer.batch_decode(out, skip_special_tokens=True)]


@pytest.fixture(scope="module")
def translator(bart_folder):
    return Translator.from_pretrained(str(bart_folder[0]))


def test_the_translator_encodes_with_the_folders_tokenizer(bart_folder, translator):
    _, _, tokenizer = bart_folder
    assert isinstance(translator.source_vocab, HFVocabulary)
    ids, truncated = translator.encode(TEXTS)
    assert truncated == 0 and ids == tokenizer(TEXTS)["input_ids"]  # <s> ... </s>
    assert translator.config.bos_id == EOS  # BART's decoder start


def test_beam_4_equals_generate(bart_folder, translator):
    _, model, tokenizer = bart_folder
    want = reference(model, tokenizer)
    assert translator.generation.method == "beam" and translator.generation.beam_size == 4
    assert translator.translate(TEXTS) == want
    assert len(set(want)) >= 10, "the random model must not translate every row alike"


def test_greedy_equals_generate(bart_folder, translator):
    _, model, tokenizer = bart_folder
    want = reference(model, tokenizer, num_beams=1)
    assert translator.translate(TEXTS, method="greedy") == want
    assert (
        sum(a != b for a, b in zip(want, reference(model, tokenizer), strict=True)) >= 5
    )  # beam differs


def test_a_tokenizer_larger_than_the_model_is_refused(bart_folder):
    """helpers.hf_bart.write_tokenizer's 64 ids plus an added <mask>: id 64 has no row."""
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    from helpers.hf_bart import write_tokenizer

    folder = bart_folder[0].parent / "too_large"
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
