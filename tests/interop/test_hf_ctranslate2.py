"""A folder written by ``hf.save_pretrained`` is what CTranslate2 users need: its converter
(``ct2-transformers-converter``, here its Python API) accepts it, and CTranslate2's greedy
translations agree with ours token for token on at least 99% of the tokens.

The model is a tiny random Marian model whose vocabulary comes from SentencePiece models trained
here (the converter reads the tokenizer to build its vocabulary). As in every opus-mt model, the
pad row of the embedding is zero (CTranslate2 starts the decoder from a zero vector where
Transformers looks up the decoder-start = pad embedding) and pad is never generated
(CTranslate2 drops it from the vocabulary; the hub models ban it through ``bad_words_ids``).
"""

from __future__ import annotations

import json
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

from helpers.hf_models import marian_config

WORDS = "the a cat dog house tree river green small old runs sees under over and with".split()


def train_spm(prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=prefix,
        vocab_size=34,
        model_type="unigram",
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(our saved folder, the CTranslate2 model folder, config, params, vocabulary list)."""
    root = tmp_path_factory.mktemp("ct2")
    train_spm(str(root / "source"), 0)
    train_spm(str(root / "target"), 1)
    pieces = []
    for side in ("source", "target"):
        sp = spm.SentencePieceProcessor(model_file=str(root / f"{side}.model"))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    # Marian's layout: </s> 0, <unk> 1, the pieces of both models, <pad> last.
    vocab = ["</s>", "<unk>"]
    vocab += sorted({p for p in pieces if p not in ("</s>", "<unk>", "<s>")})
    vocab.append("<pad>")
    tok_dir, src_dir = root / "tokenizer", root / "hf"
    tok_dir.mkdir()
    for side in ("source", "target"):
        (tok_dir / f"{side}.spm").write_bytes((root / f"{side}.model").read_bytes())
    (tok_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    pad = len(vocab) - 1
    config = marian_config(
        vocab_size=len(vocab),
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        forced_eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the initialisation, so that outputs depend on the source
        for name, p in model.named_parameters():
            if "embed_positions" in name:
                continue
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "shared" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
                p[pad] = 0.0
            elif p.ndim == 2:
                gain = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        bias = 0.5 * torch.randn(model.final_logits_bias.shape, generator=g)
        bias[0, 0] += 3.0  # EOS: some rows end early
        bias[0, pad] = -1e4  # pad is never generated
        model.final_logits_bias.copy_(bias)
    model.save_pretrained(src_dir)
    ours_cfg, params, _ = hf.load_pretrained(str(src_dir))

    saved = root / "ours"
    hf.save_pretrained(str(saved), ours_cfg, params)
    tokenizer = transformers.MarianTokenizer(
        str(tok_dir / "source.spm"), str(tok_dir / "target.spm"), str(tok_dir / "vocab.json")
    )
    tokenizer.save_pretrained(str(saved))
    ct2_dir = root / "ct2"
    ctranslate2.converters.TransformersConverter(str(saved)).convert(str(ct2_dir), force=True)
    return saved, ct2_dir, ours_cfg, params, vocab


def test_ctranslate2_converts_and_agrees_with_greedy(folders):
    saved, ct2_dir, config, params, vocab = folders
    rng = np.random.default_rng(5)
    rows, length, max_new = 64, 12, 12
    src = np.full((rows, length), config.pad_id, np.int32)
    for r in range(rows):
        n = int(rng.integers(3, length + 1))
        src[r, : n - 1] = rng.integers(2, config.pad_id, size=n - 1)
        src[r, n - 1] = config.eos_id
    ours, _ = generate(params, config, src, method="greedy", max_len=max_new)
    ours = np.asarray(ours)

    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32")
    batch = [[vocab[i] for i in row if i != config.pad_id] for row in src]
    results = translator.translate_batch(
        batch,
        beam_size=1,
        max_decoding_length=max_new,
        min_decoding_length=0,  # CTranslate2's default 1 forbids EOS first; ours allows it
        return_end_token=True,
    )
    theirs = np.full_like(ours, config.pad_id)
    for r, result in enumerate(results):
        ids = [vocab.index(t) for t in result.hypotheses[0]][:max_new]
        theirs[r, : len(ids)] = ids
    real = (ours != config.pad_id) | (theirs != config.pad_id)
    agreement = float((ours == theirs)[real].mean())
    ended = int((ours == config.eos_id).any(axis=1).sum())
    print(f"CTranslate2 greedy agreement {agreement:.4f}, {int(real.sum())} tokens, {ended} ended")
    assert agreement >= 0.99, agreement
    assert 0 < ended < rows  # both ways of stopping are compared
    assert len({tuple(r) for r in ours}) >= rows // 4  # outputs depend on the source
