"""Tiny random Hugging Face Marian models for the tests that compare with transformers: a
``MarianConfig``, a ``MarianMTModel`` with every parameter random, a saved folder with a Marian
tokenizer, and padded id batches in Marian's layout (pad = decoder start = the last id, EOS 0).

torch and transformers (the test extra) are imported when a builder runs, through
``pytest.importorskip``: a test that builds a model without them is skipped with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

_TORCH = "the Marian reference runs in PyTorch (test extra)"
_TRANSFORMERS = "MarianMTModel is the reference (pip install -e '.[test]')"

# The sentences the tiny SentencePiece vocabularies of marian_dir's folders are trained on.
CORPUS = [
    "a dog runs in the park",
    "the cat sleeps on a red mat",
    "two men ride bikes down the road",
    "a woman reads a book in the sun",
    "children play with a ball near the water",
    "the old man walks his dog",
    "a girl in a blue dress sings",
    "people wait for the bus in the rain",
] * 4

VOCAB = 61
PAD = VOCAB - 1

# name -> MarianConfig overrides: opus-mt's choices (swish, scaled embeddings) and the rest.
VARIANTS = {
    "opus_mt": dict(activation_function="swish", scale_embedding=True),
    "gelu_unscaled": dict(activation_function="gelu", scale_embedding=False),
    "separate_untied": dict(
        activation_function="relu",
        scale_embedding=True,
        share_encoder_decoder_embeddings=False,
        decoder_vocab_size=47,
        tie_word_embeddings=False,
    ),
    # transformers 5 unties all three tables (encoder, decoder, lm_head) with
    # tie_word_embeddings=False even when share_encoder_decoder_embeddings=True, and stores an
    # unused fourth (model.shared); every one is drawn at random, so they all differ.
    "shared_untied": dict(
        activation_function="gelu_new",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=False,
    ),
}


def marian_config(**overrides):
    """A tiny MarianConfig (2+2 layers, d_model 32, 4 heads) with Marian's ids: pad = decoder
    start = the last id of the decoder's vocabulary, EOS 0; ``overrides`` change any field
    (the other test modules that need a tiny Marian model build theirs here)."""
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
        max_position_embeddings=32,
        eos_token_id=0,
        forced_eos_token_id=None,
        dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(overrides)
    pad = (kw.get("decoder_vocab_size") or kw["vocab_size"]) - 1  # inside the decoder's ids
    kw.setdefault("pad_token_id", pad)
    kw.setdefault("decoder_start_token_id", pad)
    return transformers.MarianConfig(**kw)


# Added to EOS's logit so that, greedily, some rows stop early and others run to the limit.
EOS_BIAS = {"opus_mt": 3.0, "gelu_unscaled": 5.0, "separate_untied": 3.0, "shared_untied": 3.0}
EMBED_STD = 0.5
# Query/key kernels this many times larger sharpen attention, so that what greedy and beam
# search pick depends on the source (with gain 1 most rows decode to the same few strings).
# The logits comparison runs at gain 1: logits O(1) as in a trained model, whereas sharp
# attention amplifies float32 rounding beyond 1e-5 in both implementations.
DECODING_QK_GAIN = 3.0


def random_marian(name: str, seed: int = 0, qk_gain: float = 1.0):
    """A float32 MarianMTModel in eval mode with every parameter random (not its init).

    HF's initialisation (std 0.02, zero biases, unit norms) gives logits that hardly depend on
    the input: every row would decode to the same tokens. Here kernels are N(0, 1/fan_in),
    embeddings and lm_head N(0, EMBED_STD^2) (logits of size ~EMBED_STD sqrt(d_model): peaky,
    input-dependent), biases
    and LayerNorm offsets N(0, 0.1^2), LayerNorm scales 1 +- 0.1, the final logits bias
    N(0, 0.5^2) plus ``EOS_BIAS[name]`` on EOS.
    """
    torch = pytest.importorskip("torch", reason=_TORCH)
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(marian_config(**VARIANTS[name])).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "embed_positions" in pname:  # Marian's fixed sinusoids: not a free parameter
                continue
            if "layer_norm" in pname and pname.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in pname or "shared" in pname or "lm_head" in pname:
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:  # Linear [out, in]; sharper attention: input-dependent outputs
                gain = qk_gain if ("q_proj" in pname or "k_proj" in pname) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        bias = 0.5 * torch.randn(model.final_logits_bias.shape, generator=g)
        bias[0, model.config.eos_token_id] += EOS_BIAS[name]
        model.final_logits_bias.copy_(bias)
    return model


def padded_rows(rng, rows: int, length: int, vocab: int, pad: int, min_len: int = 2):
    """int64 `[rows, length]`: real ids in [1, vocab - 1) then EOS 0, then pad."""
    out = np.full((rows, length), pad, np.int64)
    for r in range(rows):
        n = int(rng.integers(min_len, length + 1))
        out[r, : n - 1] = rng.integers(1, vocab - 1, size=n - 1)
        out[r, n - 1] = 0
    return out


def marian_dir(
    root: Path, spm_model: Path, seed: int = 0, eos_bias: float = 3.0, pad_bias: float = 0.0
) -> tuple[Path, int]:
    """A tiny random MarianMTModel saved with a Marian tokenizer (source.spm = target.spm =
    ``spm_model``; vocab.json: </s> 0, <unk> 1, the pieces, <pad> last; the piece "▁d" left
    out so that it maps to <unk>). ``eos_bias`` / ``pad_bias``: added to EOS's / PAD's final
    logits bias. Returns the folder and the missing piece's spm id."""
    torch = pytest.importorskip("torch", reason=_TORCH)
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    pieces = [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
    pieces = [p for p in pieces if p != "\u2581d"]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    size = len(vocab)
    config = transformers.MarianConfig(
        vocab_size=size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        pad_token_id=size - 1,
        decoder_start_token_id=size - 1,
        eos_token_id=0,
        forced_eos_token_id=0,  # opus-mt's generation defaults: the export must follow them
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():  # peaky, input-dependent logits (HF's init decodes every row alike)
        for name, p in model.named_parameters():
            if "embed_positions" in name or p.ndim != 2:
                continue
            if "embed" in name or "shared" in name:
                p.copy_(0.5 * torch.randn(p.shape))
            else:  # Linear [out, in]; sharper attention on queries and keys
                gain = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn(p.shape) / p.shape[1] ** 0.5)
        bias = 0.5 * torch.randn(model.final_logits_bias.shape)
        bias[0, 0] += eos_bias  # EOS: some rows stop early
        bias[0, size - 1] += pad_bias
        model.final_logits_bias.copy_(bias)
    model.save_pretrained(str(root))
    generation = json.loads((root / "generation_config.json").read_text())
    generation["bad_words_ids"] = [[size - 1]]  # as opus-mt folders have it: never <pad>
    (root / "generation_config.json").write_text(json.dumps(generation))
    for name in ("source.spm", "target.spm"):
        (root / name).write_bytes(spm_model.read_bytes())
    (root / "vocab.json").write_text(json.dumps(vocab))
    return root, sp.piece_to_id("\u2581d")
