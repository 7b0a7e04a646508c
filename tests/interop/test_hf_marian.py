"""Marian checkpoints in and out (flaxformer_lite.interop.hf) against an independent implementation:
Hugging Face ``MarianMTModel`` (transformers + torch), tiny random models built offline from a
``MarianConfig``.

Every model has non-trivial parameters everywhere a mapping mistake could hide: the final
logits bias, LayerNorm scales and biases, attention biases are all drawn at random (the
default initialisation makes several of them zero or one). Batches are padded, rows of
different lengths, with Marian's own ids (pad = decoder start = the last id, EOS 0).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Marian reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="MarianMTModel is the reference (pip install -e '.[test]')"
)

import jax  # noqa: E402

from flaxformer_lite import EncoderDecoder  # noqa: E402
from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.interop import hf

from helpers.hf_models import (  # noqa: E402
    DECODING_QK_GAIN,
    VARIANTS,
    padded_rows,
    random_marian,
)


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(name, HF model, its saved folder, our config, our params), the model with sharp
    attention for the decoding tests."""
    name = request.param
    model = random_marian(name, qk_gain=DECODING_QK_GAIN)
    folder = tmp_path_factory.mktemp(f"marian_{name}")
    model.save_pretrained(folder)
    config, params, tokenizer = hf.load_pretrained(str(folder))
    assert tokenizer is None  # no tokenizer files were written
    return name, model, folder, config, params


def test_config_carries_marian_choices(saved):
    name, model, _, config, _ = saved
    hc = model.config
    assert config.activation == hf.FROM_HF_ACTIVATION[hc.activation_function]
    assert (config.sinusoid_layout, config.layer_norm_epsilon) == ("halves", 1e-5)
    assert config.scale_embeddings == hc.scale_embedding
    assert config.logits_bias
    assert (config.pad_id, config.bos_id, config.eos_id) == (
        hc.pad_token_id,
        hc.decoder_start_token_id,
        hc.eos_token_id,
    )
    # One table only when transformers ties them all; untied, the stacks read their own.
    assert config.share_embeddings == (
        hc.share_encoder_decoder_embeddings and hc.tie_word_embeddings
    )
    assert config.tie_output_embedding == hc.tie_word_embeddings
    assert config.output_vocab_size == hc.decoder_vocab_size


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_marian_mt_model(name, tmp_path):
    """Teacher-forced logits on a padded batch within 1e-5 of MarianMTModel's (float32)."""
    model = random_marian(name, seed=7)
    model.save_pretrained(tmp_path)
    config, params, _ = hf.load_pretrained(str(tmp_path))
    rng = np.random.default_rng(3)
    src = padded_rows(rng, 6, 11, config.vocab_size, config.pad_id)
    tgt = padded_rows(rng, 6, 9, config.output_vocab_size, config.pad_id)
    # HF's decoder inputs: decoder start, then the labels shifted right.
    dec_in = np.concatenate([np.full((6, 1), config.bos_id), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        expected = model(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != config.pad_id),
            decoder_input_ids=torch.from_numpy(dec_in),
        ).logits.numpy()
    ours = jax.jit(EncoderDecoder(config).apply)(
        {"params": params}, src.astype(np.int32), tgt.astype(np.int32)
    )
    real = tgt != config.pad_id
    real[:, 0] = True
    err = np.abs(np.asarray(ours) - expected)[real].max()
    assert err < 1e-5, err
    assert np.abs(expected).max() > 1.0  # the comparison is not between two near-zero arrays


def test_greedy_matches_hf_generate(saved):
    """Greedy tokens identical to ``generate(num_beams=1)`` on 32 padded rows."""
    _, model, _, config, params = saved
    rng = np.random.default_rng(4)
    src = padded_rows(rng, 32, 12, config.vocab_size, config.pad_id)
    max_new = 10
    with torch.no_grad():
        hf_out = model.generate(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != config.pad_id),
            num_beams=1,
            do_sample=False,
            max_new_tokens=max_new,
            min_length=0,
            forced_eos_token_id=None,
            bad_words_ids=None,
        ).numpy()
    ours, _ = generate(params, config, src.astype(np.int32), method="greedy", max_len=max_new)
    ours = np.asarray(ours)
    # HF: decoder start first, then the tokens; after EOS it pads with pad_token_id.
    hf_tokens = np.full((32, max_new), config.pad_id, np.int64)
    hf_tokens[:, : hf_out.shape[1] - 1] = hf_out[:, 1:]
    np.testing.assert_array_equal(ours, hf_tokens)
    # The comparison covers both stopping paths and rows that differ from each other.
    ended = (ours == config.eos_id).any(axis=1)
    assert 0 < ended.sum() < 32, ended.sum()
    assert len({tuple(row) for row in ours}) >= 8


def test_save_load_bitwise_and_hf_reads_ours(saved, tmp_path):
    """load -> save -> load gives bitwise the same parameters and config, and MarianMTModel
    loads our folder to the same logits as the original."""
    _, model, _, config, params = saved
    hf.save_pretrained(str(tmp_path), config, params)
    config2, params2, _ = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    flat = jax.tree_util.tree_leaves_with_path(params)
    flat2 = dict(jax.tree_util.tree_leaves_with_path(params2))
    assert len(flat) == len(flat2)
    for path, leaf in flat:
        assert leaf.dtype == flat2[path].dtype and leaf.shape == flat2[path].shape
        assert np.array_equal(leaf.view(np.uint32), flat2[path].view(np.uint32)), path
    reloaded = transformers.MarianMTModel.from_pretrained(str(tmp_path)).eval()
    src = torch.tensor([[5, 6, 7, 0], [8, 9, 0, config.pad_id]])
    dec = torch.tensor([[config.bos_id, 3, 4], [config.bos_id, 5, 0]])
    with torch.no_grad():
        a = model(input_ids=src, attention_mask=src != config.pad_id, decoder_input_ids=dec)
        b = reloaded(input_ids=src, attention_mask=src != config.pad_id, decoder_input_ids=dec)
    np.testing.assert_array_equal(a.logits.numpy(), b.logits.numpy())


def test_bad_inputs_name_the_problem(tmp_path, saved):
    _, _, folder, config, params = saved
    with pytest.raises(FileNotFoundError, match="no folder"):
        hf.load_pretrained(str(tmp_path / "missing" / "deeper" / "x"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load_pretrained(str(tmp_path / "empty"))
    other = json.loads((folder / "config.json").read_text())
    other["model_type"] = "pegasus"
    (tmp_path / "pegasus").mkdir()
    (tmp_path / "pegasus" / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="model_type 'pegasus'"):
        hf.load_pretrained(str(tmp_path / "pegasus"))
    with pytest.raises(ValueError, match="norm_position='pre'"):
        hf.save_pretrained(str(tmp_path / "out"), config.replace(norm_position="pre"), params)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_pytorch_bin_weights_load_like_safetensors(saved, tmp_path):
    """An older checkpoint (``pytorch_model.bin``, every tied copy and the position tables
    stored, as the opus-mt repositories have them) loads to the same parameters."""
    _, model, folder, config, params = saved
    state = {k: v.clone() for k, v in model.state_dict().items()}  # tied copies included
    assert "model.encoder.embed_positions.weight" in state
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    config2, params2, _ = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def test_a_hub_id_that_cannot_be_fetched_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network in tests
    with pytest.raises(FileNotFoundError, match="could not be fetched from the Hugging Face hub"):
        hf.load_pretrained("flaxformer-lite-tests/no-such-model")


def test_save_and_load_through_a_bucket(saved, gcs):
    """``gs://`` folders both ways (a real GCS server on localhost: the ``gcs`` fixture)."""
    _, _, _, config, params = saved
    uri = f"gs://bucket/marian-{config.activation}-{config.output_vocab_size}"
    hf.save_pretrained(uri, config, params)
    config2, params2, _ = hf.load_pretrained(uri)
    assert config2 == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def test_exporting_a_workdir_of_another_architecture_fails_before_reading_it(tmp_path, capsys):
    """The paper's own configuration (interleaved sinusoids) is not a Marian model: the CLI
    says which fields differ and writes nothing."""
    from flaxformer_lite.nn.config import TransformerConfig

    (tmp_path / "model_config.json").write_text(TransformerConfig(vocab_size=10).to_json())
    assert hf.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "sinusoid_layout='interleaved'" in err
    assert not (tmp_path / "out").exists()
    assert hf.main(["--workdir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no model_config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- untied tables


def test_saved_tensor_names_are_transformers_own(saved, tmp_path):
    """Our folder holds the tensors MarianMTModel.save_pretrained writes, under its names; with
    tie_word_embeddings=False those are three different tables (and, with shared embeddings,
    a fourth that the model never reads)."""
    from safetensors.numpy import load_file

    name, _, folder, config, params = saved
    theirs = load_file(folder / "model.safetensors")
    hf.save_pretrained(str(tmp_path), config, params)
    assert set(load_file(tmp_path / "model.safetensors")) == set(theirs)
    tables = {k for k in theirs if "embed_tokens" in k or "lm_head" in k or "shared" in k}
    expected = {
        "opus_mt": {"model.shared.weight"},
        "gelu_unscaled": {"model.shared.weight"},
        "separate_untied": {
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
            "lm_head.weight",
        },
        "shared_untied": {
            "model.shared.weight",
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
            "lm_head.weight",
        },
    }[name]
    assert tables == expected
    if "lm_head.weight" in tables:  # untied: the tables the model reads all differ
        read = [theirs[k] for k in sorted(tables - {"model.shared.weight"})]
        assert all(
            a.shape != b.shape or np.abs(a - b).min() > 0 for a in read for b in read if a is not b
        )


def test_one_table_with_an_untied_output_saves_as_transformers_reads_it(tmp_path):
    """Our share_embeddings=True, tie_output_embedding=False (one input table, its own output
    projection) is written as shared embeddings with tie_word_embeddings=False: MarianMTModel
    reads the same table for both stacks, our output kernel as lm_head, and gives our logits;
    reading the folder back gives the two (equal) tables transformers holds."""
    model = random_marian("shared_untied", seed=11)
    model.save_pretrained(tmp_path / "hf")
    config, params, _ = hf.load_pretrained(str(tmp_path / "hf"))
    one = config.replace(share_embeddings=True)
    params = {k: v for k, v in params.items() if k != "target_embedding"}
    hf.save_pretrained(str(tmp_path / "ours"), one, params)
    theirs = transformers.MarianMTModel.from_pretrained(str(tmp_path / "ours")).eval()
    table = params["source_embedding"]["embedding"]
    for module in (theirs.model.encoder.embed_tokens, theirs.model.decoder.embed_tokens):
        np.testing.assert_array_equal(module.weight.detach().numpy(), table)
    np.testing.assert_array_equal(
        theirs.lm_head.weight.detach().numpy(), params["decoder"]["logits"]["kernel"].T
    )
    rng = np.random.default_rng(5)
    src = padded_rows(rng, 4, 9, one.vocab_size, one.pad_id)
    tgt = padded_rows(rng, 4, 7, one.vocab_size, one.pad_id)
    dec_in = np.concatenate([np.full((4, 1), one.bos_id), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        expected = theirs(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != one.pad_id),
            decoder_input_ids=torch.from_numpy(dec_in),
        ).logits.numpy()
    ours = EncoderDecoder(one).apply({"params": params}, src.astype(np.int32), tgt.astype(np.int32))
    real = tgt != one.pad_id
    real[:, 0] = True
    assert np.abs(np.asarray(ours) - expected)[real].max() < 1e-5
    config2, params2, _ = hf.load_pretrained(str(tmp_path / "ours"))
    assert config2 == one.replace(share_embeddings=False)
    np.testing.assert_array_equal(params2["source_embedding"]["embedding"], table)
    np.testing.assert_array_equal(params2["target_embedding"]["embedding"], table)


def test_shared_untied_with_another_decoder_vocabulary_is_refused(opus, tmp_path):
    """transformers would build a decoder table and lm_head of different vocabularies."""
    _, folder, _, _ = opus
    bad = json.loads((folder / "config.json").read_text())
    bad.update(
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=False,
        decoder_vocab_size=bad["vocab_size"] - 3,
    )
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="decoder_vocab_size"):
        hf.load_pretrained(str(tmp_path))


# ----------------------------------------------------------------------------- config fields

# Every TransformerConfig field, by what save_pretrained does with it, starting from the opus-mt
# variant's config. WRITTEN: a change carried into config.json, read back by transformers'
# MarianConfig as {attribute: value} (None: checked by its own test below). REFUSED: values
# Marian cannot express, each refused with a ValueError naming the field before anything is
# written. IRRELEVANT: changes that leave the saved folder byte for byte the same (precision,
# memory, parameter layout, training-only or classifier fields, fields inert while a refused
# one is off). A field missing here fails test_every_config_field_is_classified.
WRITTEN = {
    "vocab_size": ({"vocab_size": 67}, {"vocab_size": 67, "decoder_vocab_size": 67}),
    "target_vocab_size": (
        {"target_vocab_size": 47, "share_embeddings": False, "pad_id": 46, "bos_id": 46},
        {"decoder_vocab_size": 47, "share_encoder_decoder_embeddings": False},
    ),
    "d_model": ({"d_model": 48}, {"d_model": 48}),
    "num_heads": ({"num_heads": 8}, {"encoder_attention_heads": 8, "decoder_attention_heads": 8}),
    "d_ff": ({"d_ff": 96}, {"encoder_ffn_dim": 96, "decoder_ffn_dim": 96}),
    "num_encoder_layers": ({"num_encoder_layers": 3}, {"encoder_layers": 3}),
    "num_decoder_layers": ({"num_decoder_layers": 1}, {"decoder_layers": 1}),
    "dropout_rate": ({"dropout_rate": 0.2}, {"dropout": 0.2}),
    "attention_dropout_rate": ({"attention_dropout_rate": 0.3}, {"attention_dropout": 0.3}),
    "activation_dropout_rate": ({"activation_dropout_rate": 0.2}, {"activation_dropout": 0.2}),
    "max_len": ({"max_len": 40}, {"max_position_embeddings": 40}),
    "activation": ({"activation": "gelu"}, {"activation_function": "gelu_new"}),
    "scale_embeddings": ({"scale_embeddings": False}, {"scale_embedding": False}),
    "share_embeddings": (
        {"share_embeddings": False},
        {"share_encoder_decoder_embeddings": False, "tie_word_embeddings": True},
    ),
    "tie_output_embedding": (
        {"tie_output_embedding": False},
        {"share_encoder_decoder_embeddings": True, "tie_word_embeddings": False},
    ),
    "pad_id": ({"pad_id": 5}, {"pad_token_id": 5}),
    "bos_id": ({"bos_id": 7}, {"decoder_start_token_id": 7}),
    "eos_id": ({"eos_id": 2}, {"eos_token_id": 2}),
    "logits_bias": None,  # a zero final_logits_bias: test_no_logits_bias_is_a_zero_one
}
REFUSED = {
    "num_kv_heads": [{"num_kv_heads": 2}, {"num_kv_heads": 1}],
    "head_dim": [{"head_dim": 16}],
    "activation": [{"activation": "swiglu"}, {"activation": "geglu"}],
    "norm_position": [{"norm_position": "pre"}],
    "norm_type": [{"norm_type": "rmsnorm"}],
    "layer_norm_epsilon": [{"layer_norm_epsilon": 1e-6}, {"layer_norm_epsilon": 1e-3}],
    "position": [{"position": p} for p in ("learned", "rotary", "relative", "none")],
    "sinusoid_layout": [{"sinusoid_layout": "interleaved"}],
    "use_bias": [{"use_bias": False}],
    "fused_qkv": [{"fused_qkv": True}],
    "num_experts": [{"num_experts": 2}, {"num_experts": 4, "moe_every": 2}],
    "attention_window": [
        {"attention_window": 3, "attention_window_layers": layers}
        for layers in ("both", "encoder", "decoder")
    ],
    "quantization": [{"quantization": "int8"}],
    "learned_position_offset": [{"learned_position_offset": 2, "position": "learned"}],
    "embedding_norm": [{"embedding_norm": True}],
    "scale_attention_logits": [{"scale_attention_logits": False}],
    "scale_decoder_output": [{"scale_decoder_output": True}],
}
IRRELEVANT = {
    "dtype": {"dtype": "bfloat16"},
    "param_dtype": {"param_dtype": "bfloat16"},
    "attention_implementation": {"attention_implementation": "blockwise"},
    "remat": {"remat": True},
    "scan_layers": {"scan_layers": True},  # the same parameters, stacked
    "num_classes": {"num_classes": 5},
    "pooling": {"pooling": "attention"},
    "unk_id": {"unk_id": 3},  # the vocabulary's; config.json has no field for it
    "num_experts_per_token": {"num_experts_per_token": 1},
    "expert_capacity_factor": {"expert_capacity_factor": None},
    "moe_every": {"moe_every": 2},
    "moe_aux_loss_weight": {"moe_aux_loss_weight": 0.5},
    "router_z_loss_weight": {"router_z_loss_weight": 0.5},
    "word_dropout_rate": {"word_dropout_rate": 0.1},  # training only
    "int8_kernel": {"int8_kernel": "xla"},  # what multiplies int8 weights: the same products
    # 3 MoE layers every 3rd layer of 2-layer stacks: no layer has one, the model is dense.
    "num_experts+moe_every": {"num_experts": 3, "moe_every": 3},
    "attention_window_layers": {"attention_window_layers": "encoder"},
    "relative_num_buckets": {"relative_num_buckets": 8},
    "relative_max_distance": {"relative_max_distance": 64},
    # Llama family: rotary settings (Marian's positions are sinusoids) and query/key/value
    # biases (Marian has every bias already).
    "rope_theta": {"rope_theta": 500000.0},
    "rope_scaling_factor": {"rope_scaling_factor": 8.0},
    "rope_low_freq_factor": {"rope_low_freq_factor": 2.0},
    "rope_high_freq_factor": {"rope_high_freq_factor": 8.0},
    "rope_original_max_len": {"rope_original_max_len": 1024},
    "qkv_bias": {"qkv_bias": True},
}


def test_every_config_field_is_classified():
    import dataclasses

    from flaxformer_lite.nn.config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    irrelevant = {name for name in IRRELEVANT if "+" not in name}
    assert set(WRITTEN) | set(REFUSED) | irrelevant == fields
    assert not irrelevant & (set(WRITTEN) | set(REFUSED))
    for name, changes in IRRELEVANT.items():  # each entry changes what it names
        assert set(changes) == set(name.split("+"))
    for name, cases in REFUSED.items():
        assert all(name in changes for changes in cases)


@pytest.fixture(scope="module")
def opus(tmp_path_factory):
    """(HF model, its folder, our config, our params) of the opus-mt variant."""
    model = random_marian("opus_mt", seed=2)
    folder = tmp_path_factory.mktemp("opus")
    model.save_pretrained(folder)
    config, params, _ = hf.load_pretrained(str(folder))
    return model, folder, config, params


@pytest.mark.parametrize(
    "changes",
    [changes for cases in REFUSED.values() for changes in cases],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_what_marian_cannot_express_is_refused_before_writing(opus, changes, tmp_path):
    _, _, config, params = opus
    bad = config.replace(**changes)
    field = next(iter(changes))
    absent, empty = tmp_path / "absent", tmp_path / "empty"
    empty.mkdir()
    for out in (absent, empty):
        with pytest.raises(ValueError, match=f"{field}={getattr(bad, field)!r}"):
            hf.save_pretrained(str(out), bad, params)
    assert not absent.exists() and not any(empty.iterdir())


def _stacked(params):
    """A scan_layers tree of unrolled ``params``: each stack's layers_i stacked on axis 0."""
    out = dict(params)
    for stack in ("encoder", "decoder"):
        layers = [v for k, v in sorted(params[stack].items()) if k.startswith("layers_")]
        rest = {k: v for k, v in params[stack].items() if not k.startswith("layers_")}
        out[stack] = {**rest, "layers": jax.tree_util.tree_map(lambda *x: np.stack(x), *layers)}
    return out


@pytest.mark.parametrize("name", list(IRRELEVANT))
def test_irrelevant_fields_do_not_change_the_saved_folder(opus, name, tmp_path):
    _, _, config, params = opus
    changes = IRRELEVANT[name]
    other = config.replace(**changes)
    assert other != config
    hf.save_pretrained(str(tmp_path / "base"), config, params)
    hf.save_pretrained(
        str(tmp_path / "other"), other, _stacked(params) if other.scan_layers else params
    )
    files = sorted(p.name for p in (tmp_path / "base").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "other").iterdir())
    for file in files:
        assert (tmp_path / "base" / file).read_bytes() == (tmp_path / "other" / file).read_bytes()


@pytest.mark.parametrize("name", [name for name, entry in WRITTEN.items() if entry is not None])
def test_written_fields_reach_marian_config(opus, name, tmp_path):
    """config.json carries the field: transformers' MarianConfig reads the changed value (and
    the unchanged config gives another)."""
    _, folder, config, _ = opus
    changes, expected = WRITTEN[name]
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(config.replace(**changes))))
    theirs = transformers.MarianConfig.from_pretrained(str(tmp_path))
    base = transformers.MarianConfig.from_pretrained(str(folder))
    for attribute, value in expected.items():
        assert getattr(theirs, attribute) == value, attribute
    assert any(getattr(base, attribute) != value for attribute, value in expected.items())


def test_no_logits_bias_is_a_zero_final_logits_bias(opus, tmp_path):
    model, _, config, params = opus
    assert model.final_logits_bias.abs().max() > 0
    params = {
        **params,
        "decoder": {k: v for k, v in params["decoder"].items() if k != "logits_bias"},
    }
    hf.save_pretrained(str(tmp_path), config.replace(logits_bias=False), params)
    theirs = transformers.MarianMTModel.from_pretrained(str(tmp_path))
    assert theirs.final_logits_bias.shape == (1, config.vocab_size)
    assert not theirs.final_logits_bias.any()


# ----------------------------------------------------------------------------- int8 models


def dequantized(tree):
    """Float32 ``q * scale`` of a quantize_params tree, computed here: each int8 leaf times its
    ``<name>_scale`` sibling (broadcast over the leading input axes); the tied embedding's
    int8 copy for the logits (``attend_kernel``) dropped."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = dequantized(value)
        elif np.asarray(value).dtype == np.int8:
            if key != "attend_kernel":
                scale = np.asarray(tree[key + "_scale"], np.float32)
                out[key] = np.asarray(value).astype(np.float32) * scale
        elif not key.endswith("_scale"):
            out[key] = value
    return out


@pytest.mark.parametrize("name", ["opus_mt", "shared_untied"])
def test_int8_model_is_refused_or_written_dequantized(name, tmp_path):
    """Marian has no int8 weights: an int8 model is refused (nothing written) unless
    ``dequantize=True``; then MarianMTModel reads exactly the dequantized weights and gives the
    logits of our float model run on them (within 1e-5). Tied (the int8 logits copy dropped)
    and untied (lm_head itself quantized) output."""
    from flaxformer_lite.ops.quantize import quantize_params

    model = random_marian(name, seed=5)
    model.save_pretrained(tmp_path / "hf")
    config, params, _ = hf.load_pretrained(str(tmp_path / "hf"))
    config_q = config.replace(quantization="int8")
    params_q = quantize_params(params, config)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"quantization='int8'.*dequantize=True"):
        hf.save_pretrained(str(out), config_q, params_q)
    with pytest.raises(ValueError, match=r"is int8, but config.quantization is None"):
        hf.save_pretrained(str(out), config, params_q)  # int8 parameters, float config
    assert not out.exists()
    hf.save_pretrained(str(out), config_q, params_q, dequantize=True)
    expected = dequantized(params_q)
    config2, params2, _ = hf.load_pretrained(str(out))
    assert config2 == config  # a float Marian model
    flat = dict(jax.tree_util.tree_leaves_with_path(params2))
    assert len(flat) == len(jax.tree_util.tree_leaves(expected))
    for path, leaf in jax.tree_util.tree_leaves_with_path(expected):
        np.testing.assert_array_equal(flat[path], leaf)
    # Not the float weights: the int8 rounding is in what was written.
    kernel = ("decoder", "layers_0", "mlp", "wi", "kernel")
    a, b = params, expected
    for key in kernel:
        a, b = a[key], b[key]
    assert np.abs(a - b).max() > 0
    theirs = transformers.MarianMTModel.from_pretrained(str(out)).eval()
    rng = np.random.default_rng(6)
    src = padded_rows(rng, 4, 9, config.vocab_size, config.pad_id)
    tgt = padded_rows(rng, 4, 7, config.output_vocab_size, config.pad_id)
    dec_in = np.concatenate([np.full((4, 1), config.bos_id), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        hf_logits = theirs(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != config.pad_id),
            decoder_input_ids=torch.from_numpy(dec_in),
        ).logits.numpy()
    ours = EncoderDecoder(config).apply(
        {"params": expected}, src.astype(np.int32), tgt.astype(np.int32)
    )
    real = tgt != config.pad_id
    real[:, 0] = True
    assert np.abs(np.asarray(ours) - hf_logits)[real].max() < 1e-5


def test_cli_dequantize_flag_exports_an_int8_workdir(opus, tmp_path, capsys):
    """``python -m flaxformer_lite.interop.hf`` on a workdir whose model is int8: refused (exit 2,
    nothing written) without --dequantize, and with --average > 1; with it, the folder holds the
    dequantized weights."""
    from flaxformer_lite.core.checkpoints import Checkpointer
    from flaxformer_lite.ops.quantize import quantize_params

    _, _, config, params = opus
    config_q = config.replace(quantization="int8")
    params_q = quantize_params(params, config)
    (tmp_path / "model_config.json").write_text(config_q.to_json())
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    checkpointer.save(1, {"step": np.int32(1), "params": params_q, "opt_state": {}}, {}, force=True)
    checkpointer.close()
    out = tmp_path / "out"
    assert hf.main(["--workdir", str(tmp_path), "--out", str(out)]) == 2
    assert "quantization='int8'" in capsys.readouterr().err
    args = ["--workdir", str(tmp_path), "--out", str(out), "--dequantize"]
    assert hf.main([*args, "--average", "2"]) == 2
    assert "average=2" in capsys.readouterr().err
    assert not out.exists()
    assert hf.main(args) == 0
    config2, params2, _ = hf.load_pretrained(str(out))
    assert config2 == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, dequantized(params_q))
