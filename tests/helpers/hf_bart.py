"""Tiny random Hugging Face BART and mBART models for the tests that compare with transformers:
a ``BartConfig`` / ``MBartConfig``, a model with every parameter random, padded id batches in
fairseq's layout (``<s>`` 0, pad 1, ``</s>`` 2, ``<unk>`` 3), and a byte-level BPE tokenizer
folder written by hand (CTranslate2's converter reads the vocabulary from it).

torch and transformers (the test extra) are imported when a builder runs, through
``pytest.importorskip``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

_TORCH = "the BART reference runs in PyTorch (test extra)"
_TRANSFORMERS = "BartForConditionalGeneration is the reference (pip install -e '.[test]')"

VOCAB = 64
BOS, PAD, EOS, UNK = 0, 1, 2, 3
FIRST_REAL = 4  # ids below are special
EMBED_STD = 0.5
EOS_BIAS = 3.0  # added to EOS's final logits bias: some rows stop early, others run on
# Sharper attention for the decoding tests (see hf_models.DECODING_QK_GAIN).
DECODING_QK_GAIN = 3.0

# name -> (model_type, config overrides). Scaled embeddings in the post-LN model (bart-large's
# choice is False, mbart-large's True): in the pre-LN one, sqrt(d_model) times embeddings of
# std 0.5 swamp the residual stream and greedy rows collapse onto a few strings.
VARIANTS = {
    "bart": ("bart", dict(activation_function="gelu", scale_embedding=True)),
    "mbart": ("mbart", dict(activation_function="gelu", scale_embedding=False)),
}


def bart_config(model_type: str, **overrides):
    """A tiny BartConfig / MBartConfig (2+2 layers, d_model 32, 4 heads, 40 positions) with
    fairseq's ids; decoder start = EOS (BART's; given explicitly for mBART, whose default is
    None)."""
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    kw = dict(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=40,
        bos_token_id=BOS,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        forced_eos_token_id=EOS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    kw.update(overrides)
    cls = transformers.MBartConfig if model_type == "mbart" else transformers.BartConfig
    return cls(**kw)


def random_bart(name: str, seed: int = 0, qk_gain: float = 1.0):
    """A float32 BART/mBART ``*ForConditionalGeneration`` in eval mode, every parameter random:
    kernels N(0, 1/fan_in) (queries and keys times ``qk_gain``), the tied embedding
    N(0, EMBED_STD^2), position tables N(0, 0.3^2) (all rows, the 2 offset rows too), biases
    and LayerNorm offsets N(0, 0.1^2), LayerNorm scales 1 +- 0.1, the final logits bias
    N(0, 0.5^2) plus EOS_BIAS on EOS."""
    torch = pytest.importorskip("torch", reason=_TORCH)
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    model_type, overrides = VARIANTS[name]
    cls = (
        transformers.MBartForConditionalGeneration
        if model_type == "mbart"
        else transformers.BartForConditionalGeneration
    )
    torch.manual_seed(seed)
    model = cls(bart_config(model_type, **overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ("layer_norm" in pname or "layernorm" in pname) and pname.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_positions" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in pname or "shared" in pname or "lm_head" in pname:
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:  # Linear [out, in]
                gain = qk_gain if ("q_proj" in pname or "k_proj" in pname) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        bias = 0.5 * torch.randn(model.final_logits_bias.shape, generator=g)
        bias[0, EOS] += EOS_BIAS
        model.final_logits_bias.copy_(bias)
    return model


def padded_rows(rng, rows: int, length: int, min_len: int = 2) -> np.ndarray:
    """int64 `[rows, length]`: real ids in [FIRST_REAL, VOCAB) then EOS, then PAD."""
    out = np.full((rows, length), PAD, np.int64)
    for r in range(rows):
        n = int(rng.integers(min_len, length + 1))
        out[r, : n - 1] = rng.integers(FIRST_REAL, VOCAB, size=n - 1)
        out[r, n - 1] = EOS
    return out


LANGUAGE_CODE = "en_XX"  # mBART's tokenizer needs its source and target codes in the vocabulary


def tokens() -> list[str]:
    """The tokenizer's vocabulary by id: fairseq's four specials, single byte-level characters
    (no merges), and an mBART language code as the last id; VOCAB in all."""
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    chars += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += [str(d) for d in range(10)]
    real = chars[: VOCAB - FIRST_REAL - 1]
    return ["<s>", "<pad>", "</s>", "<unk>", *real, LANGUAGE_CODE]


def write_tokenizer(folder: Path) -> None:
    """A BartTokenizer's files (byte-level BPE with no merges, the ids of :func:`tokens`; its
    ``<mask>`` is added after them) in ``folder``."""
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    vocab = {t: i for i, t in enumerate(tokens())}
    tok = transformers.BartTokenizer(vocab=vocab, merges=[])
    tok.save_pretrained(str(folder))


def model_sized_tokens() -> list[str]:
    """A vocabulary by id that fits the model's VOCAB rows with ``<mask>`` in it: fairseq's four
    specials, single characters, ``Ġ`` (byte-level BPE's space, so words split), the mBART
    language code and ``<mask>`` last."""
    base = tokens()
    real = base[FIRST_REAL : VOCAB - 3]
    return [*base[:FIRST_REAL], *real, "\u0120", LANGUAGE_CODE, "<mask>"]


def write_model_sized_tokenizer(folder: Path) -> None:
    """A BartTokenizer's files (:func:`model_sized_tokens`, no merges) in ``folder``: exactly
    VOCAB ids, so every one has an embedding row (as in bart-base, whose 50,265 include
    ``<mask>``)."""
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    vocab = {t: i for i, t in enumerate(model_sized_tokens())}
    assert len(vocab) == VOCAB
    tok = transformers.BartTokenizer(vocab=vocab, merges=[])
    tok.save_pretrained(str(folder))
