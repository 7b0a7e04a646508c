"""Hugging Face Llama / Qwen2 checkpoints in and out, against transformers itself.

Tiny random models built offline from ``LlamaConfig`` / ``Qwen2Config``
(``helpers.hf_llama``: every parameter random, so logits depend on the input), saved with
``save_pretrained`` and loaded with our ``hf.load_pretrained`` into ``DecoderOnly``:

* teacher-forced logits within 1e-5 of ``LlamaForCausalLM`` on right-padded batches with an
  attention mask and on left-padded ones, for Llama 2 (untied, GQA, head_dim apart from
  d_model / heads), Llama 3 (tied, rope_theta, ``rope_scaling`` llama3 with all three bands)
  and Qwen2 (q/k/v biases); the rotary frequencies equal transformers' bit for bit;
* greedy and beam continuations of a left-padded prompt batch through the KV cache equal
  ``generate``; sampling with top-k / top-p draws from transformers' filtered distribution;
* load -> our save_pretrained -> ``from_pretrained`` gives bitwise the same logits, and
  CTranslate2 converts the saved folder and agrees on greedy tokens;
* what this architecture cannot compute is refused, one line naming the key.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Llama reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="LlamaForCausalLM is the reference (pip install -e '.[test]')"
)

from flaxformer_lite.decoding.generate import continue_prompt  # noqa: E402
from flaxformer_lite.decoding.generation_config import GenerationConfig  # noqa: E402
from flaxformer_lite.interop import hf, llama  # noqa: E402
from flaxformer_lite.models import DecoderOnly  # noqa: E402
from flaxformer_lite.models.tokens import positions_from_mask  # noqa: E402
from flaxformer_lite.ops.positions import rope_inv_freq, rotary  # noqa: E402

from helpers.hf_llama import (
    BOS,
    DECODING_QK_GAIN,
    EOS,
    VOCAB,
    llama_config,
    prompts,
    random_llama,
    word_tokenizer,
)

# head_dim 12, theta 15000: wavelengths 2 pi 15000^(i/6) = 6.3, 31, 153, ...: with an original
# length of 32, low factor 1 and high factor 4, one each above 32 (divided by the factor),
# below 8 (kept) and in between (interpolated).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 15000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama2": ("llama", {}),
    "llama3_tied": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=50000.0)),
}
ROWS, PROMPT_LEN, MAX_NEW = 12, 9, 8


def build(tmp_path_factory, name: str, qk_gain: float = 1.0, seed: int = 0):
    """(HF model, its folder, our config, our params) of variant ``name``."""
    model_type, overrides = VARIANTS[name]
    model = random_llama(llama_config(model_type, **overrides), seed=seed, qk_gain=qk_gain)
    folder = tmp_path_factory.mktemp(f"{name}_{qk_gain}")
    model.save_pretrained(folder)
    config, params, tokenizer = hf.load_pretrained(str(folder))
    assert tokenizer is None  # the folder has no tokenizer files
    return model, folder, config, params


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return {name: build(tmp_path_factory, name, seed=i) for i, name in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def decoding(tmp_path_factory):
    """The Llama 2 variant with sharper attention (what the searches pick depends on the
    prompt), and a left-padded prompt batch (ids, mask) int64 [ROWS, PROMPT_LEN]."""
    model, folder, config, params = build(tmp_path_factory, "llama2", DECODING_QK_GAIN, seed=7)
    ids, mask = prompts(np.random.default_rng(3), ROWS, PROMPT_LEN, side="left")
    return model, folder, config, params, ids, mask


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.from_numpy(mask)}
        return model(input_ids=torch.from_numpy(ids), **kw).logits.numpy()


def our_logits(config, params, ids, mask):
    positions, segmentation = positions_from_mask(mask)
    logits = DecoderOnly(config).apply(
        {"params": params},
        jnp.asarray(ids),
        decoder_positions=positions,
        segmentation=segmentation,
        method="decode",
    )
    return np.asarray(logits)


# ----------------------------------------------------------------------------- logits


def test_config_reads_each_variant(variants):
    _, _, config, _ = variants["llama2"]
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 12)
    assert (config.activation, config.norm_type, config.position) == ("swiglu", "rmsnorm", "rotary")
    assert not config.tie_output_embedding and not config.qkv_bias
    assert (config.bos_id, config.eos_id, config.pad_id) == (BOS, EOS, EOS)  # no pad: EOS
    _, _, config, _ = variants["llama3_tied"]
    assert config.tie_output_embedding and config.rope_theta == 15000.0
    assert config.rope_scaling == (8.0, 1.0, 4.0, 32)
    _, _, config, _ = variants["qwen2"]
    assert config.qkv_bias and not config.use_bias and config.rope_theta == 50000.0


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_teacher_forced_logits_match_transformers(variants, name, side):
    model, _, config, params = variants[name]
    ids, mask = prompts(np.random.default_rng(11), 6, 10, side=side)
    want = hf_logits(model, ids, mask)
    got = our_logits(config, params, ids, mask)
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 1.0  # logits of a size that tests something
    print(f"{name} {side}-padded: max |logit error| {np.abs(got - want)[real].max():.1e}")
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-5)
    # Each row's logits are those of the row alone, unpadded (the padding changes nothing).
    row = int(np.flatnonzero(mask.sum(1) < 10)[0])
    alone = ids[row][real[row]][None]
    np.testing.assert_allclose(got[row][real[row]], hf_logits(model, alone)[0], rtol=0, atol=1e-5)


def test_rotary_frequencies_equal_transformers(variants):
    """To the ulp of torch's float32 pow, and in the same Llama 3 bands."""
    for name in ("llama2", "llama3_tied", "qwen2"):
        model, _, config, _ = variants[name]
        theirs = model.model.rotary_emb.inv_freq.numpy()
        ours = rope_inv_freq(config.effective_head_dim, config.rope_theta, config.rope_scaling)
        np.testing.assert_allclose(ours, theirs, rtol=2.5e-7, atol=0, err_msg=name)
    # The three Llama 3 bands are all present: divided, interpolated and kept frequencies.
    base = rope_inv_freq(12, 15000.0)
    ratio = rope_inv_freq(12, 15000.0, (8.0, 1.0, 4.0, 32)) / base
    assert ratio[0] == 1.0 and np.isclose(ratio[-1], 1 / 8) and (1 / 8 < ratio[1] < 1)


def test_rotary_is_hugging_face_rotate_half():
    """Our rotation of queries equals transformers' ``apply_rotary_pos_emb`` with its own
    cos/sin tables (rotate_half: channel i pairs with i + head_dim / 2), with Llama 3's
    scaling and without, to float32 rounding of sin and cos."""
    from transformers.models.llama import modeling_llama

    x = np.random.default_rng(0).normal(size=(2, 40, 3, 12)).astype(np.float32)
    positions = np.stack([np.arange(40), np.arange(40) + 17])
    xt = torch.from_numpy(x).transpose(1, 2)  # [batch, heads, length, head_dim]
    default = {"rope_type": "default", "rope_theta": 10000.0}
    for rope, scaling in ((LLAMA3_ROPE, (8.0, 1.0, 4.0, 32)), (default, None)):
        config = llama_config("llama", rope_parameters=dict(rope))
        cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(xt, torch.from_numpy(positions))
        want, _ = modeling_llama.apply_rotary_pos_emb(xt, xt, cos, sin)
        inv_freq = rope_inv_freq(12, rope["rope_theta"], scaling)
        got = rotary(jnp.asarray(x), jnp.asarray(positions), inv_freq=inv_freq)
        np.testing.assert_allclose(
            np.asarray(got), want.transpose(1, 2).numpy(), rtol=0, atol=1e-6, err_msg=str(rope)
        )


# ----------------------------------------------------------------------------- decoding


def hf_generate(model, ids, mask, **kwargs):
    """``generate``'s new tokens int64 [rows, MAX_NEW] (EOS = pad after a row ends)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=MAX_NEW,
            min_length=0,
            pad_token_id=EOS,
            **kwargs,
        )
    new = out[:, ids.shape[1] :].numpy()
    tokens = np.full((len(ids), MAX_NEW), EOS, np.int64)
    tokens[:, : new.shape[1]] = new
    return tokens


def ended_rows(tokens):
    return int((tokens[:, :-1] == EOS).any(axis=1).sum())


def test_greedy_continuation_of_left_padded_prompts_matches_generate(decoding):
    model, folder, config, params, ids, mask = decoding
    want = hf_generate(model, ids, mask, do_sample=False, num_beams=1)
    generation = GenerationConfig.from_hugging_face(str(folder), config).replace(max_len=MAX_NEW)
    assert generation.method == "greedy" and not generation.prepend_bos
    got, _ = continue_prompt(params, config, ids, generation, prompt_mask=mask)
    got = np.asarray(got)
    agree = int((got == want).all(axis=1).sum())
    print(f"greedy: {agree}/{ROWS} rows equal generate's")
    assert agree == ROWS, (got, want)
    assert 0 < ended_rows(want) < ROWS  # some rows end by EOS, others run to the limit
    assert len({tuple(r) for r in want}) > ROWS // 2  # the prompt decides the continuation


def test_beam_continuation_of_left_padded_prompts_matches_generate(decoding):
    model, folder, config, params, ids, mask = decoding
    want = hf_generate(model, ids, mask, do_sample=False, num_beams=4)
    generation = GenerationConfig.from_hugging_face(
        {"num_beams": 4, "max_new_tokens": MAX_NEW}, config
    )
    assert (generation.beam_style, generation.alpha) == ("hf", 1.0)
    for cache in ("in_place", "reorder"):
        got, _ = continue_prompt(
            params, config, ids, generation.replace(beam_cache=cache), prompt_mask=mask
        )
        got = np.asarray(got)
        agree = int((got == want).all(axis=1).sum())
        print(f"beam 4 ({cache}): {agree}/{ROWS} rows equal generate's")
        assert agree == ROWS, (cache, got, want)


def test_sampling_draws_from_transformers_filtered_distribution(decoding):
    """The first sampled token of one prompt, 4000 times with top_k=5, top_p=0.9 and
    temperature 1.5: never outside the support transformers' logits processors leave, and
    within total variation 0.05 of their probabilities. The prompt: the one (of the full
    rows' prefixes) whose filtered distribution keeps the most tokens."""
    model, _, config, params, ids, _ = decoding
    processors = transformers.LogitsProcessorList(
        [
            transformers.TemperatureLogitsWarper(1.5),
            transformers.TopKLogitsWarper(5),
            transformers.TopPLogitsWarper(0.9),
        ]
    )
    candidates = [ids[:1, :n] for n in range(2, PROMPT_LEN + 1)]
    filtered = []
    for prompt in candidates:
        logits = torch.from_numpy(hf_logits(model, prompt)[:, -1])
        probs = torch.softmax(processors(torch.from_numpy(prompt), logits), -1)[0].numpy()
        filtered.append(probs)
    best = int(np.argmax([(p > 0).sum() for p in filtered]))
    prompt, want = candidates[best], filtered[best]
    assert 3 <= (want > 0).sum() <= 5  # the filters leave a few tokens, not one
    draws = 4000
    generation = GenerationConfig(
        method="sample", temperature=1.5, top_k=5, top_p=0.9, max_len=1, prepend_bos=False
    )
    got, _ = continue_prompt(
        params, config, np.repeat(prompt, draws, 0), generation, rng=jax.random.key(0)
    )
    counts = np.bincount(np.asarray(got)[:, 0], minlength=VOCAB) / draws
    assert not counts[want == 0].any()
    assert 0.5 * np.abs(counts - want).sum() < 0.05


def test_left_padding_changes_no_row_of_our_own_continuation(decoding):
    """With BOS prepended by continue_prompt (ids without it), a left-padded row continues as
    it does alone (the rows' positions count their own tokens)."""
    _, _, config, params, ids, mask = decoding
    short = int(np.argmin(mask.sum(1)))
    body, body_mask = ids[[0, short], 1:], mask[[0, short], 1:]  # BOS dropped: it is added
    generation = GenerationConfig(max_len=4)
    padded, _ = continue_prompt(params, config, body, generation, prompt_mask=body_mask)
    alone, _ = continue_prompt(params, config, body[1:][body_mask[1:] == 1][None], generation)
    np.testing.assert_array_equal(np.asarray(padded)[1], np.asarray(alone)[0])


def test_an_ensemble_continues_left_padded_rows_as_each_alone(decoding):
    """The folder's model and a perturbed copy as one ensemble (``continue_prompt(params=(a,
    b))``, each model its own prefilled cache) over left-padded prompts: with beam 4, the
    cache in place and reordered (each member's beams carry their row's padding), a padded
    row (the one whose continuation varies most) continues as it does unpadded and alone, and
    the ensemble's tokens are not the first model's."""
    _, _, config, params, ids, mask = decoding
    rng = np.random.default_rng(0)
    other = jax.tree_util.tree_map(
        lambda x: (np.asarray(x) * (1.0 + 0.5 * rng.standard_normal(np.shape(x)))).astype(
            np.asarray(x).dtype
        ),
        params,
    )
    body, body_mask = ids[:, 1:], mask[:, 1:]  # BOS dropped: continue_prompt adds it
    members = (params, other)
    beams = {
        cache: GenerationConfig(method="beam", beam_size=4, max_len=MAX_NEW, beam_cache=cache)
        for cache in ("in_place", "reorder")
    }
    padded = {
        cache: np.asarray(
            continue_prompt(members, config, body, generation, prompt_mask=body_mask)[0]
        )
        for cache, generation in beams.items()
    }
    # The padded row whose continuation varies most (random tiny models often repeat one id).
    rows = np.flatnonzero((body_mask == 0).any(axis=1))
    row = int(rows[np.argmax([len(set(padded["in_place"][r])) for r in rows])])
    assert len(set(padded["in_place"][row])) >= 3, padded["in_place"][row]
    alone_ids = body[row][body_mask[row] == 1][None]
    for cache, generation in beams.items():
        alone, _ = continue_prompt(members, config, alone_ids, generation)
        np.testing.assert_array_equal(padded[cache][row], np.asarray(alone)[0], err_msg=cache)
    first, _ = continue_prompt(params, config, body, beams["in_place"], prompt_mask=body_mask)
    assert not np.array_equal(np.asarray(first), padded["in_place"])


@pytest.mark.parametrize(
    "mask,message",
    [
        (np.array([[1, 1, 0]]), r"prompt_mask rows \[0\] are not left-padded"),
        (np.array([[0, 0, 0]]), r"prompt_mask rows \[0\] have no real token"),
        (np.array([[0, 2, 1]]), "prompt_mask must hold 0/1"),
        (np.array([[1, 1]]), r"prompt_mask must have the prompt's shape \(1, 3\)"),
    ],
)
def test_a_bad_prompt_mask_is_refused(variants, mask, message):
    _, _, config, params = variants["llama2"]
    with pytest.raises(ValueError, match=message):
        continue_prompt(params, config, np.array([[5, 6, 7]]), prompt_mask=mask)


# ----------------------------------------------------------------------------- save


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_then_transformers_gives_bitwise_the_same_logits(variants, name, tmp_path):
    model, folder, config, params = variants[name]
    hf.save_pretrained(str(tmp_path), config, params)
    cls = type(model)
    theirs = cls.from_pretrained(str(tmp_path)).eval()
    ids, mask = prompts(np.random.default_rng(5), 4, 10, side="left")
    want, got = hf_logits(model, ids, mask), hf_logits(theirs, ids, mask)
    assert np.array_equal(want, got)
    config_back, params_back, _ = hf.load_pretrained(str(tmp_path))
    assert config_back == config
    jax.tree_util.tree_map(np.testing.assert_array_equal, params_back, params)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == VARIANTS[name][0]


def test_ctranslate2_converts_the_saved_folder_and_agrees_on_greedy_tokens(decoding, tmp_path):
    """CTranslate2 4.8's Llama converter ignores ``head_dim`` (it assumes d_model / heads):
    this model has the width it assumes, the decoding prompts and sharper attention."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is the reference")
    *_, ids, mask = decoding
    model = random_llama(llama_config(head_dim=8), seed=9, qk_gain=DECODING_QK_GAIN)
    model.save_pretrained(tmp_path / "original")
    config, params, _ = hf.load_pretrained(str(tmp_path / "original"))
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved), config, params)
    # The converter reads the vocabulary from a tokenizer: a word-level one naming each id.
    vocab = word_tokenizer(saved)
    converted = tmp_path / "ct2"
    ctranslate2.converters.TransformersConverter(str(saved)).convert(str(converted))
    generator = ctranslate2.Generator(str(converted), device="cpu")
    names = {i: k for k, i in vocab.items()}
    rows = [[names[int(t)] for t in r[m == 1]] for r, m in zip(ids, mask, strict=True)]
    # One prompt per call: a batch of prompts of different lengths is not decoded as they
    # are alone by CTranslate2 4.8 (include_prompt_in_result=False forwards only the shortest
    # length at once), whereas each one alone is.
    results = [
        generator.generate_batch(
            [row], max_length=MAX_NEW, sampling_topk=1, include_prompt_in_result=False
        )[0]
        for row in rows
    ]
    ours, _ = continue_prompt(
        params, config, ids, GenerationConfig(max_len=MAX_NEW, prepend_bos=False), prompt_mask=mask
    )
    ours = np.asarray(ours)
    agree = total = 0
    for row, result in zip(ours, results, strict=True):
        theirs = [vocab[t] for t in result.sequences[0]]
        mine = list(row[: (list(row).index(EOS) + 1) if EOS in row else MAX_NEW])
        mine = mine[:-1] if mine and mine[-1] == EOS else mine  # CTranslate2 drops the EOS
        total += max(len(mine), len(theirs))
        agree += sum(a == b for a, b in zip(mine, theirs, strict=False))
    print(f"CTranslate2: {agree}/{total} greedy tokens equal ours")
    assert agree == total


def test_the_folder_tokenizer_comes_back_and_adds_bos_as_transformers(variants, tmp_path):
    """load_pretrained returns the folder's tokenizer (``data.hf_tokenizers``): its ids, BOS
    first, are transformers' and so what the model reads; save_pretrained writes it back."""
    _, folder, config, params = variants["llama2"]
    source = tmp_path / "source"
    hf.save_pretrained(str(source), config, params)
    word_tokenizer(source)
    _, _, tokenizer = hf.load_pretrained(str(source))
    texts = ["t5 t6 t7", "t40 t3", "t66 unknown t9 t9"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    want = [theirs(t)["input_ids"] for t in texts]
    assert tokenizer.encode(texts) == want and all(ids[0] == BOS for ids in want)
    hf.save_pretrained(str(tmp_path / "out"), config, params, tokenizer)
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert [again(t)["input_ids"] for t in texts] == want


# ----------------------------------------------------------------------------- refusals


def _base_config(model_type="llama") -> dict:
    return json.loads(llama_config(model_type).to_json_string())


@pytest.mark.parametrize(
    "model_type,changes,message",
    [
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'yarn'|'rope_type': 'yarn'",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}},
            r"rope_type 'llama3' with exactly",
        ),
        ("llama", {"eos_token_id": [2, 3]}, r"eos_token_id=\[2, 3\]"),
        ("llama", {"quantization_config": {"bits": 4}}, r"\['quantization_config'\]"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("qwen2", {"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ],
)
def test_unsupported_config_is_refused_in_one_line(model_type, changes, message):
    hf_config = {**_base_config(model_type), **changes}
    with pytest.raises(ValueError, match=message) as error:
        hf.config_from_hf(hf_config)
    assert "\n" not in str(error.value)
    assert next(iter(changes)) in str(error.value)  # the key is named


def test_what_llama_cannot_express_is_refused_before_writing(variants, tmp_path):
    _, _, config, params = variants["llama2"]
    for changes in (
        {"norm_position": "post"},
        {"use_bias": True},
        {"position": "learned"},
        {"fused_qkv": True},
        {"logits_bias": True},
    ):
        field = next(iter(changes))
        with pytest.raises(ValueError, match=rf"{field}=.*\(Llama: "):
            hf.save_pretrained(
                str(tmp_path / field), config.replace(**changes), params, model_type="llama"
            )
        assert not (tmp_path / field).exists()
    assert llama.problems(config) == []


def test_older_config_json_rope_fields_read_alike():
    """transformers 4's config.json keeps ``rope_theta`` and ``rope_scaling`` at the top
    level; transformers 5 writes ``rope_parameters``: the same config either way."""
    new = _base_config()
    new["rope_parameters"] = dict(LLAMA3_ROPE)
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    old.update(rope_theta=LLAMA3_ROPE["rope_theta"], rope_scaling=scaling)
    assert hf.config_from_hf(old) == hf.config_from_hf(new)
    assert hf.config_from_hf(new).rope_scaling == (8.0, 1.0, 4.0, 32)
