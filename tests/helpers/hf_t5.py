"""Tiny random Hugging Face T5 models for the T5 family's tests (tests/interop/test_hf_t5.py):
a ``T5Config`` of each variant, a ``T5ForConditionalGeneration`` with every parameter random,
and padded id batches in T5's layout (pad = decoder start = 0, EOS 1, UNK 2).

torch and transformers (the test extra) are imported when a builder runs, through
``pytest.importorskip``.
"""

from __future__ import annotations

import numpy as np
import pytest

_TORCH = "the T5 reference runs in PyTorch (test extra)"
_TRANSFORMERS = "T5ForConditionalGeneration is the reference (pip install -e '.[test]')"

VOCAB = 53
PAD, EOS = 0, 1

# name -> T5Config overrides. v1_0: t5-small's choices (ReLU, lm_head tied to the shared table,
# output scaled by d_model^-1/2); v1_1: Flan-T5's (gated tanh GELU, its own lm_head, no
# scaling), with heads 12 wide (d_kv * num_heads = 48 != d_model = 32). (transformers 5's
# generate() fails on num_decoder_layers != num_layers, its cache sized by num_layers: the
# logits test covers that shape.)
VARIANTS = {
    "v1_0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=12),
}
# The shared table is small next to what the sub-layers add (a token's own embedding would
# otherwise dominate the residual stream and every source decode alike); the decoder's final
# norm scales are FINAL_NORM_GAIN larger, giving logits of a few units.
EMBED_STD = {"v1_0": 0.2, "v1_1": 0.2}
FINAL_NORM_GAIN = {"v1_0": 10.0, "v1_1": 1.0}
LM_HEAD_STD = 0.3  # v1_1: logits ~ 0.3 sqrt(d_model), O(1) as in a trained model
EOS_GAIN = 2.0  # EOS's output row this many times larger: some rows end early, others do not


def t5_config(name: str, **overrides):
    """A tiny T5Config (2 encoder layers, d_model 32, 4 heads of 8, d_ff 64, 8 buckets up to
    distance 20) of variant ``name``; ``overrides`` change any field."""
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    kw = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    kw.update(VARIANTS[name])
    kw.update(overrides)
    return transformers.T5Config(**kw)


def random_t5(name: str, seed: int = 0, qk_gain: float = 1.0, **overrides):
    """A float32 T5ForConditionalGeneration in eval mode with every parameter random.

    Kernels N(0, 1/fan_in), norm scales 1 +- 0.1 (the decoder's final one times
    FINAL_NORM_GAIN), relative bias tables N(0, 1), the shared table N(0, EMBED_STD^2) and
    an untied lm_head N(0, LM_HEAD_STD^2), EOS's output row scaled by EOS_GAIN.

    ``qk_gain`` multiplies the query and key kernels: T5's logits q.k are not divided by
    sqrt(d_kv), so at gain 1 attention is sharp (the decoding tests: what greedy and beam
    search pick depends on the source); the logits comparison takes d_kv^-1/4 each (the
    paper's 1/sqrt(d_kv) overall), as sharp attention amplifies float32 rounding in both
    implementations beyond 1e-5. An untied lm_head is a Parameter of its own (transformers 5
    builds every T5 with lm_head tied to the shared table; it saves and loads a differing pair
    untied).
    """
    torch = pytest.importorskip("torch", reason=_TORCH)
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    torch.manual_seed(seed)
    config = t5_config(name, **overrides)
    model = transformers.T5ForConditionalGeneration(config).eval()
    untied = VARIANTS[name].get("tie_word_embeddings") is False
    if untied:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "layer_norm" in pname:
                gain = FINAL_NORM_GAIN[name] if pname == "decoder.final_layer_norm.weight" else 1
                p.copy_(gain * (1.0 + 0.1 * torch.randn(p.shape, generator=g)))
            elif "relative_attention_bias" in pname:
                p.copy_(torch.randn(p.shape, generator=g))
            elif pname == "shared.weight":
                p.copy_(EMBED_STD[name] * torch.randn(p.shape, generator=g))
            elif pname == "lm_head.weight":
                p.copy_(LM_HEAD_STD * torch.randn(p.shape, generator=g))
            else:  # Linear [out, in]
                gain = qk_gain if pname.endswith((".q.weight", ".k.weight")) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        head = model.lm_head.weight if untied else model.shared.weight
        head[EOS] *= EOS_GAIN
    return model


def padded_rows(rng, rows: int, length: int, vocab: int = VOCAB, min_len: int = 2):
    """int64 `[rows, length]`: real ids in [2, vocab), then EOS 1, then pad 0."""
    out = np.full((rows, length), PAD, np.int64)
    for r in range(rows):
        n = int(rng.integers(min_len, length + 1))
        out[r, : n - 1] = rng.integers(2, vocab, size=n - 1)
        out[r, n - 1] = EOS
    return out


TOKENIZER_WORDS = "the a cat dog house tree river green small old runs sees under over and with"


def t5_tokenizer(folder, vocab_size: int = 34, seed: int = 0, words: str = TOKENIZER_WORDS):
    """A ``transformers.T5Tokenizer`` (pad 0, EOS 1, UNK 2, then the pieces; no extra ids) of
    a unigram SentencePiece model of ``vocab_size`` pieces trained in ``folder`` on random
    sentences of ``words`` (space-separated)."""
    import random

    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    words = words.split()
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(folder / "spm"),
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)
