"""T5 checkpoints in and out (flaxformer_lite.interop.t5, through hf) against an independent
implementation: Hugging Face ``T5ForConditionalGeneration`` (transformers + torch), tiny random
models built offline from a ``T5Config`` (tests/helpers/hf_t5.py), one per variant: T5 v1.0
(ReLU, tied and scaled output) and v1.1 / Flan-T5 (gated GELU, untied lm_head, heads of
d_kv = 12 != d_model / heads; for the logits, also 3 decoder layers against 2 encoder layers).

Every parameter is drawn at random (norm scales too, the relative bias tables of both stacks);
batches are padded, rows of different lengths, with T5's ids (pad = decoder start = 0, EOS 1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the T5 reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="T5ForConditionalGeneration is the reference (pip install -e '.[test]')"
)

import jax  # noqa: E402

from flaxformer_lite import EncoderDecoder  # noqa: E402
from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.decoding.generation_config import GenerationConfig  # noqa: E402
from flaxformer_lite.interop import hf, t5  # noqa: E402

from helpers.hf_t5 import EOS, PAD, VARIANTS, padded_rows, random_t5, t5_config  # noqa: E402

ROWS, SRC_LEN, MAX_NEW = 32, 12, 10


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(name, HF model, its saved folder, our config, our params): sharp attention (T5's
    unscaled logits at gain 1), for decoding."""
    name = request.param
    model = random_t5(name, seed=0)
    folder = tmp_path_factory.mktemp(f"t5_{name}")
    model.save_pretrained(folder)
    config, params, tokenizer = hf.load_pretrained(str(folder))
    assert tokenizer is None  # no tokenizer files were written
    return name, model, folder, config, params


def test_config_carries_t5_choices(saved):
    name, model, _, config, _ = saved
    hc = model.config
    assert (config.norm_position, config.norm_type, config.position) == (
        "pre",
        "rmsnorm",
        "relative",
    )
    assert config.layer_norm_epsilon == hc.layer_norm_epsilon == 1e-6
    assert not (config.use_bias or config.logits_bias or config.scale_embeddings)
    assert not config.scale_attention_logits
    assert (config.relative_num_buckets, config.relative_max_distance) == (8, 20)
    assert config.effective_head_dim == hc.d_kv
    assert (config.num_encoder_layers, config.num_decoder_layers) == (
        hc.num_layers,
        hc.num_decoder_layers,
    )
    assert (config.pad_id, config.bos_id, config.eos_id, config.unk_id) == (0, 0, 1, 2)
    v1_0 = name == "v1_0"
    assert config.activation == ("relu" if v1_0 else "geglu")
    # transformers 5 says tie_word_embeddings=True for both; the weights untie v1.1's head.
    assert config.tie_output_embedding == v1_0 == hc.scale_decoder_outputs
    assert config.scale_decoder_output == v1_0
    # T5's one dropout rate: residual, attention weights and feed-forward hidden units.
    written = json.loads((saved[2] / "config.json").read_text())
    dropped = t5.config_from_hf({**written, "dropout_rate": 0.1})
    rates = (dropped.dropout_rate, dropped.attention_dropout_rate, dropped.activation_dropout_rate)
    assert rates == (0.1, 0.1, 0.1)


@pytest.mark.parametrize(
    "name,overrides", [("v1_0", {}), ("v1_1", {}), ("v1_1", {"num_decoder_layers": 3})]
)
def test_logits_match_t5_for_conditional_generation(name, overrides, tmp_path):
    """Teacher-forced logits on a padded batch within 1e-5 of transformers' (float32, eval);
    also with more decoder than encoder layers."""
    d_kv = t5_config(name).d_kv
    model = random_t5(name, seed=7, qk_gain=d_kv**-0.25, **overrides)  # logits O(1)
    model.save_pretrained(tmp_path)
    config, params, _ = hf.load_pretrained(str(tmp_path))
    rng = np.random.default_rng(3)
    src = padded_rows(rng, 6, 11)
    tgt = padded_rows(rng, 6, 9)
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
    real = tgt != PAD
    real[:, 0] = True
    err = np.abs(np.asarray(ours) - expected)[real].max()
    top = np.abs(expected).max()
    print(f"T5 {name} {overrides}: max logit error {err:.2e}, |logits| <= {top:.1f}")
    assert err < 1e-5, err
    assert np.abs(expected).max() > 1.0  # not two near-zero arrays


def hf_generate(model, src, **kwargs):
    """``generate`` of the HF model with its own generation defaults (T5's: decoder start 0,
    EOS 1, pad 0, no forced tokens) and ``kwargs``: int64 `[rows, MAX_NEW]` without the decoder
    start, pad after the first EOS (transformers 5's beam search fills a finished row with EOS
    where its greedy search and ours put pad)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != PAD),
            max_new_tokens=MAX_NEW,
            **kwargs,
        ).numpy()
    assert (out[:, 0] == PAD).all()  # the decoder start
    tokens = np.full((len(src), MAX_NEW), PAD, np.int64)
    tokens[:, : out.shape[1] - 1] = out[:, 1:]
    after_eos = np.cumsum(tokens == EOS, axis=1) - (tokens == EOS) > 0
    return np.where(after_eos, PAD, tokens)


@pytest.mark.parametrize("beams", [1, 4])
def test_greedy_and_beam_match_hf_generate(saved, beams):
    """Greedy and beam 4 tokens equal ``generate(num_beams=...)`` on 32 padded rows, decoding
    with the folder's generation config as ``GenerationConfig.from_hugging_face`` reads it."""
    name, model, folder, config, params = saved
    src = padded_rows(np.random.default_rng(4), ROWS, SRC_LEN)
    want = hf_generate(model, src, num_beams=beams)
    generation = GenerationConfig.from_hugging_face(str(folder), config).replace(max_len=MAX_NEW)
    assert generation.method == "greedy" and not generation.forced_eos
    if beams > 1:
        generation = generation.replace(method="beam", beam_size=beams)
    ours, _ = generate(params, config, src.astype(np.int32), generation)
    ours = np.asarray(ours)
    agree = int((ours == want).all(axis=1).sum())
    print(f"T5 {name} num_beams={beams}: {agree}/{ROWS} rows equal to transformers")
    np.testing.assert_array_equal(ours, want)
    ended = (ours == EOS).any(axis=1)
    assert 0 < ended.sum() < ROWS, ended.sum()  # both ways of stopping
    assert len({tuple(row) for row in ours}) >= ROWS // 4  # outputs depend on the source


def test_save_load_bitwise_and_hf_reads_ours(saved, tmp_path):
    """load -> save -> load gives bitwise the same parameters and config, and transformers
    loads our folder to bitwise the same logits as the original."""
    name, model, _, config, params = saved
    hf.save_pretrained(str(tmp_path), config, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["tie_word_embeddings"] == written["scale_decoder_outputs"] == (name == "v1_0")
    config2, params2, _ = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    flat = jax.tree_util.tree_leaves_with_path(params)
    flat2 = dict(jax.tree_util.tree_leaves_with_path(params2))
    assert len(flat) == len(flat2)
    for path, leaf in flat:
        assert leaf.dtype == flat2[path].dtype and leaf.shape == flat2[path].shape
        assert np.array_equal(leaf.view(np.uint32), flat2[path].view(np.uint32)), path
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    dec = torch.tensor([[PAD, 3, 4], [PAD, 5, EOS]])
    with torch.no_grad():
        a = model(input_ids=src, attention_mask=src != PAD, decoder_input_ids=dec).logits
        b = reloaded(input_ids=src, attention_mask=src != PAD, decoder_input_ids=dec).logits
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "decoder_start_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def test_a_checkpoint_with_every_tied_copy_loads_the_same(saved, tmp_path):
    """An older checkpoint (``pytorch_model.bin`` with every tied copy, the unused
    cross-attention relative bias of old T5 checkpoints, transformers 4's config without
    ``scale_decoder_outputs``) loads to the same config and parameters."""
    name, model, folder, config, params = saved
    state = {k: v.clone() for k, v in model.state_dict().items()}  # tied copies included
    assert "encoder.embed_tokens.weight" in state and "lm_head.weight" in state
    unused = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
    state[unused] = torch.randn(8, 4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    old = json.loads((folder / "config.json").read_text())
    old.pop("scale_decoder_outputs")
    old["tie_word_embeddings"] = name == "v1_0"  # transformers 4 wrote the real one
    (tmp_path / "config.json").write_text(json.dumps(old))
    config2, params2, _ = hf.load_pretrained(str(tmp_path))
    assert config2 == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


# One kind of refusal each: config.json key -> a value T5's mapping cannot express.
REFUSALS = {
    "feed_forward_proj": "gated-relu",
    "is_encoder_decoder": False,
    "tie_encoder_decoder": True,
    "pruned_heads": {"0": [1]},
    "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True},
    "relative_attention_num_buckets": 7,
    "relative_attention_max_distance": 4,
    "eos_token_id": [1, 2],
}


@pytest.mark.parametrize("key", list(REFUSALS))
def test_unsupported_config_fields_are_refused_in_one_line(saved, key, tmp_path):
    _, _, folder, _, _ = saved
    bad = json.loads((folder / "config.json").read_text())
    bad[key] = REFUSALS[key]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=key) as raised:
        hf.load_pretrained(str(tmp_path))
    assert "\n" not in str(raised.value)


def test_a_differing_lm_head_unties_whatever_config_json_says(saved):
    """transformers 5 writes ``tie_word_embeddings: true`` for every T5; a stored lm_head
    unlike the shared table is untied (as transformers loads it), an equal one is tied, and a
    tied config meeting a differing one in ``params_from_state_dict`` says so."""
    name, model, _, config, _ = saved
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tied_cfg = config.replace(tie_output_embedding=True)
    assert t5.config_from_state(tied_cfg, state).tie_output_embedding == (name == "v1_0")
    same = {**state, "lm_head.weight": state["shared.weight"]}
    assert t5.config_from_state(config, same).tie_output_embedding
    if name == "v1_1":
        with pytest.raises(ValueError, match="lm_head.weight differs from shared.weight"):
            t5.params_from_state_dict(state, tied_cfg)


def test_what_t5_cannot_express_is_refused_before_writing(saved, tmp_path):
    _, _, _, config, params = saved
    for changes in (
        {"scale_attention_logits": True},
        {"use_bias": True},
        {"norm_type": "layernorm"},
        {"num_kv_heads": 2},
        {"position": "rotary"},
        {"logits_bias": True},
        {"qkv_bias": True},  # the Llama family's (Qwen2): T5 has no biases
        {"embedding_norm": True},  # BART's layernorm_embedding
    ):
        field = next(iter(changes))
        with pytest.raises(ValueError, match=f"{field}="):
            hf.save_pretrained(str(tmp_path / "out"), config.replace(**changes), params)
    assert not (tmp_path / "out").exists()
    assert hf.family_for(config) is t5  # a T5 config is T5's alone
    # T5's options keep a config from the other families (none drops them silently).
    for other in ("marian", "bart", "llama"):
        with pytest.raises(ValueError, match="scale_attention_logits=False"):
            hf.config_to_hf(config, model_type=other)


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20), (16, 64)])
def test_relative_buckets_equal_transformers(buckets, max_distance):
    """``ops.positions.relative_position_bucket`` gives T5Attention's buckets, both
    directions, for every relative position in [-300, 300] (past max_distance too)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    from flaxformer_lite.ops.positions import relative_position_bucket

    relative = np.arange(-300, 301)
    for bidirectional in (True, False):
        want = T5Attention._relative_position_bucket(
            torch.from_numpy(relative), bidirectional, buckets, max_distance
        ).numpy()
        got = np.asarray(relative_position_bucket(relative, bidirectional, buckets, max_distance))
        np.testing.assert_array_equal(got, want)
