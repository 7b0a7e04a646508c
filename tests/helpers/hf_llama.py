"""Tiny random Hugging Face Llama / Qwen2 models for the tests that compare with transformers:
a ``LlamaConfig`` (GQA, an explicit head_dim, untied or tied ``lm_head``), a
``LlamaForCausalLM`` in eval mode with every parameter random, and padded prompt batches.

torch and transformers (the test extra) are imported when a builder runs, through
``pytest.importorskip``: a test that builds a model without them is skipped with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

_TORCH = "the Llama reference runs in PyTorch (test extra)"
_TRANSFORMERS = "LlamaForCausalLM is the reference (pip install -e '.[test]')"

VOCAB = 67
BOS, EOS = 1, 2
EMBED_STD = 0.5
# Query/key kernels this many times larger sharpen attention, so that what the searches pick
# depends on the prompt; the logits comparisons run at gain 1 (as tests/helpers/hf_models.py).
DECODING_QK_GAIN = 3.0
EOS_BIAS = 2.0  # added to EOS's lm_head row norm: some rows stop early


def llama_config(model_type: str = "llama", **overrides):
    """A tiny LlamaConfig / Qwen2Config: 2 layers, d_model 32, 4 query heads over 2 kv heads
    of width 12 (head_dim apart from d_model / heads), SwiGLU 48 wide; ``overrides`` change any
    field."""
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    cls = transformers.Qwen2Config if model_type == "qwen2" else transformers.LlamaConfig
    return cls(**kw)


def random_llama(config, seed: int = 0, qk_gain: float = 1.0):
    """A float32 causal LM of ``config`` in eval mode with every parameter random: Linear
    kernels N(0, 1/fan_in) (queries and keys times ``qk_gain``), embeddings and lm_head
    N(0, EMBED_STD^2), RMSNorm weights 1 +- 0.1, biases N(0, 0.1^2); EOS's output row scaled
    up by ``EOS_BIAS`` so that some rows end early."""
    torch = pytest.importorskip("torch", reason=_TORCH)
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    torch.manual_seed(seed)
    cls = (
        transformers.Qwen2ForCausalLM
        if config.model_type == "qwen2"
        else transformers.LlamaForCausalLM
    )
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=g))
            else:  # Linear [out, in]
                gain = qk_gain if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        head = model.get_output_embeddings().weight
        head[EOS] = head[EOS] * EOS_BIAS
    return model


def prompts(rng, rows: int, length: int, *, min_len: int = 1, side: str = "left"):
    """``(ids, mask)`` int64 `[rows, length]`: BOS then random ids in [3, VOCAB) (as a Llama
    tokenizer gives them), padded with EOS on ``side`` ("left" or "right"); rows of random
    real lengths in [min_len, length], the first row full."""
    ids = np.full((rows, length), EOS, np.int64)
    mask = np.zeros((rows, length), np.int64)
    for r in range(rows):
        n = length if r == 0 else int(rng.integers(min_len, length + 1))
        real = np.concatenate([[BOS], rng.integers(3, VOCAB, size=n - 1)])
        where = slice(length - n, length) if side == "left" else slice(0, n)
        ids[r, where], mask[r, where] = real, 1
    return ids, mask


def word_tokenizer(folder) -> dict[str, int]:
    """Writes a word-level ``tokenizer.json`` (+ config) into ``folder``, one word per id:
    ``<unk>`` 0, ``<s>`` BOS, ``</s>`` EOS, ``t{i}`` for the others, split on whitespace and
    BOS put first, as a Llama tokenizer does. Returns its vocabulary (word -> id)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers", reason=_TRANSFORMERS)
    vocab = {f"t{i}": i for i in range(VOCAB) if i not in (0, BOS, EOS)}
    vocab |= {"<unk>": 0, "<s>": BOS, "</s>": EOS}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    word_level.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    word_level.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins with spaces
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(folder))
    return vocab
