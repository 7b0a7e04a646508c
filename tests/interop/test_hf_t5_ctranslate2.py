"""A T5 folder written by ``hf.save_pretrained`` converts with CTranslate2's converter
(``ctranslate2.converters.TransformersConverter``) and CTranslate2's greedy translations agree
with ours token for token on at least 99% of the tokens, for T5 v1.0 and v1.1.

The tiny random models (tests/helpers/hf_t5.py) get a T5 tokenizer built offline from a
SentencePiece model trained here, which ``load_pretrained`` reads (data.hf_tokenizers: the
same ids as transformers') and ``save_pretrained`` writes back for the converter (it reads the
vocabulary there; the model's last ids are ``<extra_id_i>``, as in every T5 vocabulary).
CTranslate2 4.x decides T5's output scaling from ``config.tie_word_embeddings``, which
transformers 5 sets to True for every T5: a v1.1 folder converts through ``T5Converter`` (the
flag set from ``scale_decoder_outputs`` first; docs/hf_families.md), else CTranslate2 would
scale v1.1's logits as v1.0's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is the reference (test extra)")
torch = pytest.importorskip("torch", reason="the converter loads the model with PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="the converter reads it with transformers"
)
spm = pytest.importorskip("sentencepiece")

from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.interop import hf  # noqa: E402

from helpers.hf_t5 import EOS, PAD, VARIANTS, random_t5  # noqa: E402

WORDS = "the a cat dog house tree river green small old runs sees under over and with".split()
EXTRA_IDS = 3


class T5Converter(ctranslate2.converters.TransformersConverter):
    """CTranslate2's converter with T5's output scaling read from ``scale_decoder_outputs``
    (transformers 5) instead of ``tie_word_embeddings``."""

    def load_model(self, model_class, model_name_or_path, **kwargs):
        model = super().load_model(model_class, model_name_or_path, **kwargs)
        scale = getattr(model.config, "scale_decoder_outputs", None)
        if scale is not None:
            model.config.tie_word_embeddings = scale
        return model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A T5 tokenizer (pad 0, EOS 1, UNK 2, then the pieces) of a SentencePiece model trained
    on random sentences of WORDS."""
    root = tmp_path_factory.mktemp("t5_spm")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(root / "spm"),
        vocab_size=34,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tokenizer, tmp_path_factory):
    """(variant, the CTranslate2 model folder, our config, our params, the vocabulary)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"ct2_{name}")
    model = random_t5(name, seed=2, vocab_size=len(tokenizer) + EXTRA_IDS)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(str(root / "hf"))
    config, params, ours = hf.load_pretrained(str(root / "hf"))
    texts = [" ".join(WORDS[i::3]) for i in range(3)] + ["the cat sees a tree"]
    assert ours.encode(texts) == [tokenizer(t).input_ids for t in texts]
    assert (config.unk_id, ours.eos_id, ours.pad_id) == (2, EOS, PAD)
    hf.save_pretrained(str(root / "ours"), config, params, ours)  # the converter reads it
    T5Converter(str(root / "ours")).convert(str(root / "ct2"), force=True)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    vocab += [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]
    return name, root / "ct2", config, params, vocab


def test_ctranslate2_converts_and_agrees_with_greedy(converted):
    name, ct2_dir, config, params, vocab = converted
    rng = np.random.default_rng(5)
    rows, length, max_new = 64, 12, 10
    src = np.full((rows, length), PAD, np.int32)
    for r in range(rows):
        n = int(rng.integers(3, length + 1))
        src[r, : n - 1] = rng.integers(3, len(vocab) - EXTRA_IDS, size=n - 1)
        src[r, n - 1] = EOS
    ours, _ = generate(params, config, src, method="greedy", max_len=max_new)
    ours = np.asarray(ours)

    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32")
    batch = [[vocab[i] for i in row if i != PAD] for row in src]
    results = translator.translate_batch(
        batch,
        beam_size=1,
        max_decoding_length=max_new,
        min_decoding_length=0,  # CTranslate2's default 1 forbids EOS first; ours allows it
        return_end_token=True,
    )
    theirs = np.full_like(ours, PAD)
    for r, result in enumerate(results):
        ids = [vocab.index(t) for t in result.hypotheses[0]][:max_new]
        theirs[r, : len(ids)] = ids
    real = (ours != PAD) | (theirs != PAD)
    agreement = float((ours == theirs)[real].mean())
    rows_equal = int((ours == theirs).all(axis=1).sum())
    ended = int((ours == EOS).any(axis=1).sum())
    print(
        f"T5 {name}: CTranslate2 greedy agreement {agreement:.4f} over {int(real.sum())} tokens,"
        f" {rows_equal}/{rows} rows equal, {ended} ended"
    )
    assert agreement >= 0.99, agreement
    assert 0 < ended < rows  # both ways of stopping are compared
    assert len({tuple(r) for r in ours}) >= rows // 4  # outputs depend on the source
