"""BART and mBART checkpoints in and out (``interop.bart`` through ``interop.hf``) against the
independent implementation: transformers' ``BartForConditionalGeneration`` /
``MBartForConditionalGeneration`` (PyTorch), tiny random models built offline from a
``BartConfig`` / ``MBartConfig`` (tests/helpers/hf_bart.py), and CTranslate2's converter and
translator.

Every parameter is drawn at random, the two unused leading rows of the position tables too, so
that a wrong offset, a missing embedding LayerNorm or final norm, or a swapped name shows. The
batches are padded rows of different lengths in fairseq's ids (pad 1, EOS 2). The folders'
generation configs are each family's: BART forces ``<s>`` first (bart-large's
``forced_bos_token_id=0``), mBART a "language code" (the last id), both force EOS at the limit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the BART reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="BartForConditionalGeneration is the reference (test extra)"
)

import jax  # noqa: E402

from flaxformer_lite import EncoderDecoder  # noqa: E402
from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.decoding.generation_config import GenerationConfig  # noqa: E402
from flaxformer_lite.interop import bart, hf  # noqa: E402

from helpers.hf_bart import (  # noqa: E402
    BOS,
    DECODING_QK_GAIN,
    EOS,
    PAD,
    VARIANTS,
    VOCAB,
    padded_rows,
    random_bart,
    tokens,
    write_tokenizer,
)

ROWS, SRC_LEN, MAX_LENGTH = 32, 10, 9  # max_length counts the decoder start: 8 new tokens
FORCED_BOS = {"bart": BOS, "mbart": VOCAB - 1}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(name, HF model, its folder, our config, our params): sharp attention (the decoding
    tests), the family's generation config written beside it."""
    name = request.param
    model = random_bart(name, seed=1, qk_gain=DECODING_QK_GAIN)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(
        forced_bos_token_id=FORCED_BOS[name],
        forced_eos_token_id=EOS,
        max_length=MAX_LENGTH,
        num_beams=4,
        length_penalty=1.0,
        early_stopping=True,
    )
    (folder / "generation_config.json").write_text(json.dumps(generation))
    config, params, tokenizer = hf.load_pretrained(str(folder))
    assert tokenizer is None  # no data.hf_tokenizers on this branch yet
    return name, model, folder, config, params


def test_config_carries_the_family_choices(saved):
    name, model, _, config, _ = saved
    hc = model.config
    assert config.norm_position == ("pre" if name == "mbart" else "post")
    assert (config.position, config.learned_position_offset) == ("learned", 2)
    assert config.embedding_norm and config.logits_bias and config.share_embeddings
    assert (config.activation, config.layer_norm_epsilon) == ("gelu_exact", 1e-5)
    assert config.scale_embeddings == hc.scale_embedding
    assert (config.pad_id, config.bos_id, config.eos_id, config.unk_id) == (PAD, EOS, EOS, 3)
    assert config.max_len == hc.max_position_embeddings


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_on_padded_batches(name, tmp_path):
    """Teacher-forced logits within 1e-5 of transformers' (float32, eval mode)."""
    model = random_bart(name, seed=7)
    model.save_pretrained(tmp_path)
    config, params, _ = hf.load_pretrained(str(tmp_path))
    rng = np.random.default_rng(3)
    src, tgt = padded_rows(rng, 6, 11), padded_rows(rng, 6, 9)
    dec_in = np.concatenate([np.full((6, 1), config.bos_id), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        expected = model(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != PAD),
            decoder_input_ids=torch.from_numpy(dec_in),
        ).logits.numpy()
    ours = jax.jit(EncoderDecoder(config).apply)(
        {"params": params}, src.astype(np.int32), tgt.astype(np.int32)
    )
    real = dec_in != PAD
    err = np.abs(np.asarray(ours) - expected)[real].max()
    assert err < 1e-5, err
    assert np.abs(expected).max() > 1.0  # not two near-zero arrays
    assert (src == PAD).any() and (tgt == PAD).any()  # padded rows on both sides


def hf_generate(model, src, **kwargs):
    """transformers' ``generate`` with the folder's generation defaults (``kwargs`` replace
    some): tokens int64 `[rows, MAX_LENGTH - 1]` without the decoder start, PAD after EOS."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != PAD),
            **kwargs,
        ).numpy()
    assert (out[:, 0] == EOS).all()  # BART's decoder start, then the tokens
    want = np.full((len(src), MAX_LENGTH - 1), PAD, np.int64)
    want[:, : out.shape[1] - 1] = out[:, 1:]
    return want


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_generate_matches_transformers_with_the_family_defaults(saved, method):
    """Greedy and beam 4 (the folder's generation config: forced BOS and EOS, max_length,
    length_penalty, early_stopping, read by GenerationConfig.from_hugging_face) give
    transformers' tokens on every row."""
    name, model, folder, config, params = saved
    model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
    src = padded_rows(np.random.default_rng(4), ROWS, SRC_LEN)
    generation = GenerationConfig.from_hugging_face(str(folder), config)
    assert generation.forced_bos_id == FORCED_BOS[name] and generation.forced_eos
    num_beams = 4 if method == "beam" else 1
    want = hf_generate(model, src, num_beams=num_beams)
    ours, _ = generate(params, config, src.astype(np.int32), generation, method=method)
    ours = np.asarray(ours)
    agree = (ours == want).all(axis=1).sum()
    print(f"{name} {method}: {agree}/{ROWS} rows equal to transformers' generate")
    np.testing.assert_array_equal(ours, want)
    # Rows that end by the model's EOS and rows forced at the limit; rows that differ.
    assert (ours[:, 0] == FORCED_BOS[name]).all()
    ended_early = (ours[:, :-1] == EOS).any(axis=1)
    assert 0 < ended_early.sum() < ROWS, ended_early.sum()
    assert len({tuple(row) for row in ours}) >= 8


def test_save_then_transformers_gives_bitwise_the_same_logits(saved, tmp_path):
    """load -> our save_pretrained -> transformers' from_pretrained: bitwise the logits of the
    original model; our load of the saved folder: the same config and parameters bitwise."""
    name, model, _, config, params = saved
    hf.save_pretrained(str(tmp_path), config, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == name
    config2, params2, _ = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    flat, flat2 = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (params, params2))
    assert flat.keys() == flat2.keys()
    for key, value in flat.items():
        np.testing.assert_array_equal(flat2[key], value)
    cls = type(model)
    reloaded = cls.from_pretrained(str(tmp_path)).eval()
    src = padded_rows(np.random.default_rng(6), 4, 7)
    dec = padded_rows(np.random.default_rng(7), 4, 5)
    with torch.no_grad():
        a = model(input_ids=torch.from_numpy(src), decoder_input_ids=torch.from_numpy(dec))
        b = reloaded(input_ids=torch.from_numpy(src), decoder_input_ids=torch.from_numpy(dec))
    np.testing.assert_array_equal(a.logits.numpy(), b.logits.numpy())


def test_ctranslate2_converts_the_saved_folder_and_agrees_on_greedy(saved, tmp_path):
    """A folder with a BartTokenizer's files loads with our tokenizer (transformers' ids);
    CTranslate2's converter reads what save_pretrained writes of model and tokenizer, and its
    greedy tokens equal ours on every row (no forced EOS, which CTranslate2
    does not have; the forced first token is its target prefix)."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is the reference")
    name, model, _, config, params = saved
    with_tokenizer = tmp_path / "hf"
    model.save_pretrained(with_tokenizer)
    write_tokenizer(with_tokenizer)
    config2, params2, tokenizer = hf.load_pretrained(str(with_tokenizer))
    assert config2 == config and tokenizer is not None and tokenizer.unk_id == 3
    if name == "bart":  # (a BartTokenizer's files under model_type mbart: no MBartTokenizer)
        reference = transformers.AutoTokenizer.from_pretrained(str(with_tokenizer))
        texts = ["abc dEf", "xyz 123 q"]
        assert tokenizer.encode(texts) == reference(texts)["input_ids"]
    out = tmp_path / "ours"
    hf.save_pretrained(str(out), config, params, tokenizer)  # the converter reads its files
    ct2_dir = tmp_path / "ct2"
    ctranslate2.converters.TransformersConverter(str(out)).convert(str(ct2_dir), force=True)
    src = padded_rows(np.random.default_rng(8), ROWS, SRC_LEN)
    max_new = MAX_LENGTH - 1
    ours, _ = generate(
        params, config, src.astype(np.int32), method="greedy", max_len=max_new,
        forced_bos_id=FORCED_BOS[name],
    )  # fmt: skip
    ours = np.asarray(ours)
    vocab = tokens()
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32")
    batch = [[vocab[i] for i in row if i != PAD] for row in src]
    # The forced first token as the target prefix; CTranslate2's mBART (no decoder start in
    # its config, as mBART-25 has the language code there) starts from the prefix's first
    # token, so EOS, BART's decoder start, goes before it. Hypotheses hold the rest.
    prefix = [vocab[FORCED_BOS[name]]]
    start = 1 if name == "mbart" else 0
    if start:
        prefix = [vocab[EOS], *prefix]
    results = translator.translate_batch(
        batch,
        target_prefix=[prefix] * ROWS,
        beam_size=1,
        max_decoding_length=max_new + start,
        min_decoding_length=0,
        return_end_token=True,
    )
    theirs = np.full_like(ours, PAD)
    for r, result in enumerate(results):
        ids = [vocab.index(t) for t in result.hypotheses[0]][:max_new]
        theirs[r, : len(ids)] = ids
    agree = (ours == theirs).all(axis=1).sum()
    print(f"{name}: CTranslate2 greedy equal on {agree}/{ROWS} rows")
    assert agree == ROWS, (ours, theirs)


# ----------------------------------------------------------------------------- refusals

REFUSED_HF = {
    "heads": ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 but decoder_attention"),
    "ffn": ({"decoder_ffn_dim": 32}, "encoder_ffn_dim=64 but decoder_ffn_dim=32"),
    "activation": ({"activation_function": "tanh"}, "activation_function='tanh'"),
    "layerdrop": ({"encoder_layerdrop": 0.2}, "encoder_layerdrop=0.2"),
    "untied": ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    # fairseq's pre-LN flag, the other value than the model_type's (BART False, mBART True)
    "normalize_before": ({"normalize_before": "flip"}, "normalize_before="),
    "static_positions": (
        {"static_position_embeddings": True},
        "static_position_embeddings=True",
    ),
    "missing": ({"d_model": None}, "config.json has no 'd_model'"),
}


@pytest.mark.parametrize("kind", list(REFUSED_HF))
def test_what_transformers_config_says_and_we_cannot_express_is_refused(saved, kind, tmp_path):
    """One line naming the key, before any weight is read."""
    name, _, folder, _, _ = saved
    changes, message = REFUSED_HF[kind]
    if changes == {"normalize_before": "flip"}:
        changes = {"normalize_before": name == "bart"}
        message += f"{name == 'bart'} .model_type '{name}': {name == 'mbart'}"
    hc = json.loads((folder / "config.json").read_text())
    hc.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(hc))  # no weights: refused before
    with pytest.raises(ValueError, match=message) as error:
        hf.load_pretrained(str(tmp_path))
    assert "\n" not in str(error.value)


def test_legacy_keys_that_describe_the_model_load(saved, tmp_path):
    """fairseq's keys with the values of the model_type (bart-large's and mbart-large's
    config.json carry them) are accepted, and written back by save_pretrained."""
    name, _, folder, config, params = saved
    hc = json.loads((folder / "config.json").read_text())
    legacy = {"normalize_before": name == "mbart", "add_final_layer_norm": name == "mbart"}
    legacy.update(normalize_embedding=True, static_position_embeddings=False)
    assert bart.config_from_hf({**hc, **legacy}) == config
    hf.save_pretrained(str(tmp_path), config, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written[k] for k in legacy} == legacy


@pytest.mark.parametrize(
    "changes",
    [
        {"norm_type": "rmsnorm"},
        {"embedding_norm": False},
        {"learned_position_offset": 0},
        {"position": "sinusoidal", "learned_position_offset": 0},
        {"share_embeddings": False},
        {"tie_output_embedding": False},
        {"num_kv_heads": 2},
        {"activation": "swiglu"},
        {"layer_norm_epsilon": 1e-6},
    ],
    ids=lambda c: ",".join(c),
)
def test_configs_bart_cannot_express_are_refused_before_writing(saved, changes, tmp_path):
    _, _, _, config, params = saved
    bad = config.replace(**changes)
    field = next(iter(changes))
    with pytest.raises(ValueError, match=f"{field}={getattr(bad, field)!r}"):
        hf.save_pretrained(str(tmp_path / "out"), bad, params, model_type="bart")
    assert not (tmp_path / "out").exists()


def test_activation_dropout_is_read_and_written(saved, tmp_path):
    """bart-base/large's ``activation_dropout=0.1`` is ``activation_dropout_rate``, both ways
    (transformers reads the value we write)."""
    name, model, folder, config, params = saved
    hc = json.loads((folder / "config.json").read_text())
    assert bart.config_from_hf({**hc, "activation_dropout": 0.1}).activation_dropout_rate == 0.1
    hf.save_pretrained(str(tmp_path), config.replace(activation_dropout_rate=0.1), params)
    assert json.loads((tmp_path / "config.json").read_text())["activation_dropout"] == 0.1
    assert type(model.config).from_pretrained(str(tmp_path)).activation_dropout == 0.1
