"""GenerationConfig: one frozen, validated value for every decoding option.

Each bad value is refused with a ValueError that starts with the field's name (every field
has such a case: a field added without a check fails ``test_every_field_has_a_bad_value``);
model-dependent checks name the field and the model's limit. ``from_hugging_face`` reads
folders that ``transformers.GenerationConfig.save_pretrained`` writes and is compared with what
transformers itself reads back; ``from_run`` with hand-written config.json dicts. One tiny
random EncoderDecoder (NumPy draws, two compiled programs) checks that ``generate`` with a
config, with keyword overrides and with the fields its method ignores changed decodes the
same through ONE compiled call, and that ``max_len="source"`` stops each row at the limit its
own source length gives. The CLIs' flags and the serving export's output width are checked
as pure functions (nothing loads or compiles).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from flaxformer_lite.decoding import generate as gen
from flaxformer_lite.decoding.generation_config import (
    GenerationConfig,
    field_names,
    resolve,
    source_limit,
)
from flaxformer_lite.models import abstract_params
from flaxformer_lite.nn.config import TransformerConfig

# A Marian-like model: EOS 0, PAD = decoder start = the last id.
VOCAB, PAD, EOS = 12, 11, 0
MARIAN = TransformerConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=32,
    pad_id=PAD,
    bos_id=PAD,
    eos_id=EOS,
    unk_id=1,
    tie_output_embedding=False,
)

# ----------------------------------------------------------------------------- validation

BAD_VALUES = [
    ("method", "nucleus", r"method must be one of \('greedy', 'beam', 'sample'\)"),
    ("method", None, "method must be one of"),
    ("max_len", 0, "max_len must be a positive int or None"),
    ("max_len", 2.0, "max_len must be a positive int or None"),
    ("max_len", True, "max_len must be a positive int or None"),
    ("max_len", "src", "max_len must be .*'source'"),
    ("beam_size", 0, "beam_size must be a positive int"),
    ("beam_size", 2.5, "beam_size must be a positive int"),
    ("beam_size", True, "beam_size must be a positive int"),
    ("alpha", float("nan"), "alpha must be a finite number"),
    ("alpha", float("inf"), "alpha must be a finite number"),
    ("alpha", "0.6", "alpha must be a finite number"),
    ("beam_style", "t5", r"beam_style must be one of \('gnmt', 'hf'\)"),
    ("early_stopping", "always", "early_stopping must be one of"),
    ("early_stopping", 1, "early_stopping must be one of"),  # 1 == True, but not a bool
    ("renormalize", 1, "renormalize must be True or False"),
    ("beam_cache", "gather", r"beam_cache must be one of \('in_place', 'reorder'\)"),
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("temperature", float("nan"), "temperature must be a number >= 0"),
    ("top_k", -1, "top_k must be an int >= 0"),
    ("top_k", 1.5, "top_k must be an int >= 0"),
    ("top_p", 0.0, r"top_p must be a number in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be a number in \(0, 1\]"),
    ("forced_eos", 1, "forced_eos must be True or False"),
    ("banned_ids", 3, "banned_ids must be a sequence of token ids"),
    ("banned_ids", (3.0,), "banned_ids must be a sequence of token ids"),
    ("banned_ids", (-1,), "banned_ids must be a sequence of token ids"),
    ("banned_ids", ((1,),), "banned_ids must be a sequence of token ids"),
    ("banned_ids", (True,), "banned_ids must be a sequence of token ids"),
    ("banned_ids", "12", "banned_ids must be a sequence of token ids"),
    ("prepend_bos", 0, "prepend_bos must be True or False"),
    ("forced_bos_id", -1, "forced_bos_id must be None .* or a token id"),
    ("forced_bos_id", 2.0, "forced_bos_id must be None .* or a token id"),
    ("forced_bos_id", True, "forced_bos_id must be None .* or a token id"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_a_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}") as error:
        GenerationConfig(**{field: value})
    assert str(error.value).endswith(repr(value))  # the value given, as written
    # replace() checks again: no invalid config can be derived from a valid one.
    with pytest.raises(ValueError, match=f"^{message}"):
        GenerationConfig().replace(**{field: value})


def test_every_field_has_a_bad_value():
    assert {field for field, _, _ in BAD_VALUES} == set(field_names())


def test_early_stopping_is_a_rule_of_the_hf_beam_style():
    with pytest.raises(ValueError, match="^early_stopping=True is a rule of beam_style='hf'"):
        GenerationConfig(early_stopping=True)
    for value in (True, "never", False):
        assert GenerationConfig(beam_style="hf", early_stopping=value).early_stopping is value


def test_values_are_normalised_so_that_equal_configs_hash_alike():
    g = GenerationConfig(
        max_len=np.int64(7), beam_size=np.int32(3), alpha=1, banned_ids=[5, np.int64(3), 5]
    )
    assert (g.max_len, g.beam_size, g.alpha, g.banned_ids) == (7, 3, 1.0, (3, 5))
    assert [type(v) for v in (g.max_len, g.beam_size, g.alpha)] == [int, int, float]
    same = GenerationConfig(max_len=7, beam_size=3, alpha=1.0, banned_ids=(3, 5))
    assert g == same and hash(g) == hash(same)


# ----------------------------------------------------------------------------- against a model


def test_model_dependent_checks_name_the_field_and_the_limit():
    with pytest.raises(ValueError, match=r"^max_len=33 .*TransformerConfig.max_len=32\)"):
        GenerationConfig(max_len=33).checked_for(MARIAN)
    with pytest.raises(ValueError, match=r"^banned_ids .*ints in \[0, 12\)\); got \[12\]"):
        GenerationConfig(banned_ids=(VOCAB,)).checked_for(MARIAN)
    with pytest.raises(ValueError, match="^banned_ids must not contain eos_id=0"):
        GenerationConfig(banned_ids=(PAD, EOS)).checked_for(MARIAN)
    with pytest.raises(ValueError, match="^max_len=29 .*5-token prompt.*give max_len <= 26$"):
        GenerationConfig(max_len=29).checked_for(MARIAN, prompt_len=5)
    with pytest.raises(ValueError, match="^max_len='source' derives each row's limit"):
        GenerationConfig(max_len="source").checked_for(MARIAN, prompt_len=5)
    with pytest.raises(ValueError, match=r"^forced_bos_id must be a token id in \[0, 12\)"):
        GenerationConfig(forced_bos_id=VOCAB).checked_for(MARIAN)
    with pytest.raises(ValueError, match="^forced_bos_id=3 forces the first token .* prompt"):
        GenerationConfig(forced_bos_id=3).checked_for(MARIAN, prompt_len=5)
    ok = GenerationConfig(max_len=32, banned_ids=(PAD,), forced_bos_id=VOCAB - 1)
    assert ok.checked_for(MARIAN) is ok


def test_decode_len_is_the_output_width():
    assert GenerationConfig().decode_len(MARIAN) == 32  # the model's positions
    assert GenerationConfig().decode_len(MARIAN, prompt_len=5) == 26  # 32 - BOS - 5
    # prepend_bos=False: the prompt as given, no BOS position.
    assert GenerationConfig(prepend_bos=False).decode_len(MARIAN, prompt_len=5) == 27
    GenerationConfig(max_len=27, prepend_bos=False).checked_for(MARIAN, prompt_len=5)
    with pytest.raises(ValueError, match="^max_len=28 .* after a 5-token prompt.*<= 27$"):
        GenerationConfig(max_len=28, prepend_bos=False).checked_for(MARIAN, prompt_len=5)
    assert GenerationConfig(max_len=9).decode_len(MARIAN) == 9
    # "source": min(32, int(1.5 * padded source) + 10).
    assert GenerationConfig(max_len="source").decode_len(MARIAN, source_len=8) == 22
    assert GenerationConfig(max_len="source").decode_len(MARIAN, source_len=16) == 32
    with pytest.raises(ValueError, match="only for sources"):
        GenerationConfig(max_len="source").decode_len(MARIAN)


def test_source_limit_of_ints_and_arrays():
    # int(1.5 * n) + 10, at least 1, at most the cap.
    assert [source_limit(n, 48) for n in (0, 1, 4, 25, 31)] == [10, 11, 16, 47, 48]
    assert source_limit(4, 5) == 5
    got = source_limit(np.array([1, 4, 7, 30]), 20)
    np.testing.assert_array_equal(got, [11, 16, 20, 20])


# ----------------------------------------------------------------------------- derived configs


def test_replace_gives_a_new_config_and_names_unknown_fields():
    g = GenerationConfig(method="beam", beam_size=4)
    wider = g.replace(beam_size=8, alpha=1.0)
    assert (wider.beam_size, wider.alpha, wider.method) == (8, 1.0, "beam")
    assert (g.beam_size, g.alpha) == (4, 0.6)  # unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.beam_size = 2
    with pytest.raises(TypeError, match="^num_beams: not a GenerationConfig field; valid: method"):
        g.replace(num_beams=8)
    # resolve: what generate(..., generation, **overrides) does with its arguments.
    assert resolve(None, {"method": "beam"}) == GenerationConfig(method="beam")
    assert resolve(g, {}, GenerationConfig()) is g
    assert resolve(None, {}, wider) is wider
    with pytest.raises(ValueError, match="^generation must be a GenerationConfig or None"):
        resolve({"method": "beam"}, {})


def test_canonical_fixes_what_the_method_does_not_read():
    beam_options = dict(beam_size=8, alpha=1.0, beam_style="hf", early_stopping=True)
    sampling = dict(temperature=0.5, top_k=3, top_p=0.9)
    constraints = dict(max_len=9, forced_eos=True, banned_ids=(PAD,))
    every = dict(**beam_options, **sampling, **constraints, renormalize=True)
    every["beam_cache"] = "reorder"
    greedy = GenerationConfig(method="greedy", **every).canonical()
    assert greedy == GenerationConfig(method="greedy", beam_size=1, alpha=0.0, **constraints)
    sample = GenerationConfig(method="sample", **every).canonical()
    assert sample == GenerationConfig(
        method="sample", beam_size=1, alpha=0.0, **sampling, **constraints
    )
    beam = GenerationConfig(method="beam", **every)
    assert beam.canonical() == beam.replace(temperature=1.0, top_k=0, top_p=1.0)


# ----------------------------------------------------------------------------- JSON, hashing


def test_json_round_trip():
    g = GenerationConfig(
        method="beam",
        max_len="source",
        beam_size=5,
        alpha=1.5,
        beam_style="hf",
        early_stopping="never",
        renormalize=True,
        beam_cache="reorder",
        temperature=0.7,
        top_k=4,
        top_p=0.8,
        forced_eos=True,
        banned_ids=(11, 3),
        prepend_bos=False,
        forced_bos_id=5,
    )
    text = json.dumps(g.to_dict())
    assert json.loads(text) == {
        "method": "beam",
        "max_len": "source",
        "beam_size": 5,
        "alpha": 1.5,
        "beam_style": "hf",
        "early_stopping": "never",
        "renormalize": True,
        "beam_cache": "reorder",
        "temperature": 0.7,
        "top_k": 4,
        "top_p": 0.8,
        "forced_eos": True,
        "banned_ids": [3, 11],
        "prepend_bos": False,
        "forced_bos_id": 5,
    }
    assert GenerationConfig.from_dict(json.loads(text)) == g
    assert GenerationConfig.from_dict({}) == GenerationConfig()
    assert GenerationConfig.from_dict({"max_len": None}).max_len is None
    with pytest.raises(ValueError, match="^num_beams: not a GenerationConfig field"):
        GenerationConfig.from_dict({"num_beams": 4})
    with pytest.raises(ValueError, match="^top_k must be an int >= 0"):
        GenerationConfig.from_dict({"top_k": "4"})


def test_a_config_is_a_static_jit_argument_compiled_once_per_distinct_value():
    f = jax.jit(lambda x, g: x * g.beam_size + g.alpha, static_argnames="g")
    x = np.ones((2,), np.float32)
    a, b = GenerationConfig(beam_size=3), GenerationConfig(beam_size=3, banned_ids=[2, 1])
    np.testing.assert_allclose(f(x, a), 3.6)
    f(x, GenerationConfig(beam_size=3))  # an equal config: the same program
    assert f._cache_size() == 1
    np.testing.assert_allclose(f(x, b), 3.6)  # banned_ids differ: another static value
    np.testing.assert_allclose(f(x, a.replace(beam_size=2)), 2.6)
    assert f._cache_size() == 3
    assert len({a, GenerationConfig(beam_size=3), b}) == 2


# ----------------------------------------------------------------------------- train.py runs


def test_from_run_reads_a_train_config_json():
    finetune = {  # configs/finetune_marian.py's decoding fields
        "task": "translation",
        "max_len": 128,  # the model's positions, not a decoding option
        "beam_size": 4,
        "alpha": 1.0,
        "beam_style": "hf",
        "early_stopping": False,
        "forced_eos": True,
        "ban_pad": True,
    }
    assert GenerationConfig.from_run(finetune, MARIAN) == GenerationConfig(
        method="beam",
        max_len="source",
        beam_size=4,
        alpha=1.0,
        beam_style="hf",
        forced_eos=True,
        banned_ids=(PAD,),
    )
    plain = GenerationConfig(method="beam", max_len="source", beam_size=4, alpha=0.6)
    assert GenerationConfig.from_run({"task": "translation"}, MARIAN) == plain
    assert GenerationConfig.from_run({"beam_size": None, "alpha": None}, MARIAN) == plain
    assert GenerationConfig.from_run({"alpha": 0.0}, MARIAN).alpha == 0.0  # not the default
    with pytest.raises(ValueError, match="^beam_style must be one of"):
        GenerationConfig.from_run({"beam_style": "marian"}, MARIAN)


# ----------------------------------------------------------------------------- Hugging Face


def test_from_hugging_face_reads_what_transformers_writes(tmp_path):
    transformers = pytest.importorskip("transformers", reason="writes the folders (test extra)")
    ids = dict(decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD)
    cases = {  # opus-mt's fields; and max_new_tokens with HF's other early_stopping value
        "opus_mt": dict(
            num_beams=4,
            length_penalty=0.8,
            max_length=9,
            early_stopping=True,
            forced_eos_token_id=EOS,
            bad_words_ids=[[PAD]],
            renormalize_logits=True,
        ),
        "new_tokens": dict(
            num_beams=2,
            length_penalty=-0.5,
            max_new_tokens=5,
            early_stopping="never",
            bad_words_ids=[[3], [4]],
            forced_bos_token_id=5,  # mBART-50's target language code, say
        ),  # fmt: skip
    }
    for name, fields in cases.items():
        folder = tmp_path / name
        transformers.GenerationConfig(**ids, **fields).save_pretrained(str(folder))
        read = transformers.GenerationConfig.from_pretrained(str(folder))
        ours = GenerationConfig.from_hugging_face(str(folder), MARIAN)
        # What transformers reads, in our fields (max_length counts the decoder start; an
        # unset field reads None, generate's default then applies).
        new_tokens = read.max_new_tokens or read.max_length - 1
        assert ours == GenerationConfig(
            method="beam" if read.num_beams > 1 else "greedy",
            max_len=new_tokens,
            beam_size=read.num_beams,
            alpha=read.length_penalty,
            beam_style="hf",
            early_stopping=read.early_stopping,
            renormalize=bool(read.renormalize_logits),
            forced_eos=read.forced_eos_token_id == EOS,
            banned_ids=tuple(w[0] for w in read.bad_words_ids),
            prepend_bos=False,  # generate() feeds the ids as given
            forced_bos_id=read.forced_bos_token_id,
        ), name
        written = json.loads((folder / "generation_config.json").read_text())
        assert GenerationConfig.from_hugging_face(written, MARIAN) == ours
    opus = GenerationConfig.from_hugging_face(str(tmp_path / "opus_mt"), MARIAN)
    assert (opus.method, opus.beam_size, opus.max_len, opus.banned_ids) == ("beam", 4, 8, (PAD,))


def test_from_hugging_face_defaults_and_old_config_json(tmp_path):
    transformers = pytest.importorskip("transformers", reason="writes the folders (test extra)")
    unset = tmp_path / "unset"
    transformers.GenerationConfig(decoder_start_token_id=PAD, eos_token_id=EOS).save_pretrained(
        str(unset)
    )
    # transformers' defaults: greedy, max_length 20 counted after the decoder start of an
    # encoder-decoder (20 new tokens), no constraints, length_penalty 1.0.
    assert GenerationConfig.from_hugging_face(str(unset), MARIAN) == GenerationConfig(
        method="greedy", max_len=20, beam_size=1, alpha=1.0, beam_style="hf", prepend_bos=False
    )
    # An older checkpoint: the generation fields in config.json, no generation_config.json.
    old = tmp_path / "old"
    old.mkdir()
    fields = dict(num_beams=3, max_length=7, bad_words_ids=[[PAD]], forced_eos_token_id=EOS)
    (old / "config.json").write_text(json.dumps({"model_type": "marian", **fields}))
    assert GenerationConfig.from_hugging_face(str(old), MARIAN) == GenerationConfig(
        method="beam",
        max_len=6,
        beam_size=3,
        alpha=1.0,
        beam_style="hf",
        forced_eos=True,
        banned_ids=(PAD,),
        prepend_bos=False,
    )


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"do_sample": True}, r"do_sample=True \(supported: \[False\] or unset\)"),
        ({"repetition_penalty": 1.2}, r"repetition_penalty=1.2"),
        ({"forced_eos_token_id": 3}, r"forced_eos_token_id=3 \(supported: eos_id=0\)"),
        ({"bad_words_ids": [[3, 4]]}, r"bad_words_ids with multi-token entries \[\[3, 4\]\]"),
        ({"max_length": 1}, "max_length=1 leaves no token to generate"),
    ],
)
def test_from_hugging_face_refuses_what_the_searches_do_not_do(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig.from_hugging_face(fields, MARIAN)


# ----------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def endless():
    """(params, inputs): MARIAN with NumPy-drawn parameters whose output projection gives the
    special ids (PAD, EOS, UNK) logit 0 and the others scaled-up logits, so that no row ever
    ends by EOS: every row runs to its limit. Sources of 2, 3 and 5 ids (EOS included),
    padded to 6."""
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda s: rng.normal(0.0, 0.3, s.shape).astype(s.dtype), abstract_params(MARIAN)
    )
    kernel = params["decoder"]["logits"]["kernel"] * 8.0
    kernel[:, [EOS, 1, PAD]] = 0.0
    params["decoder"]["logits"]["kernel"] = kernel
    inputs = np.full((3, 6), PAD, np.int32)
    for row, length in enumerate((2, 3, 5)):
        inputs[row, : length - 1] = rng.integers(2, PAD, length - 1)
        inputs[row, length - 1] = EOS
    return params, inputs


def test_generate_with_a_config_equals_generate_with_its_keywords(endless):
    params, inputs = endless
    beam = GenerationConfig(method="beam", beam_size=2, alpha=0.6, max_len=6)
    before = gen.generate_jit._cache_size()
    by_config = gen.generate(params, MARIAN, inputs, beam)
    by_keywords = gen.generate(params, MARIAN, inputs, method="beam", beam_size=2, max_len=6)
    # Overrides replace the given config's fields; the sampling fields beam search ignores
    # take fixed values: the same decoding, the same compiled call.
    overridden = gen.generate(
        params, MARIAN, inputs, beam.replace(beam_size=5, temperature=0.3), beam_size=2
    )
    assert gen.generate_jit._cache_size() - before == 1
    for other in (by_keywords, overridden):
        np.testing.assert_array_equal(np.asarray(other[0]), np.asarray(by_config[0]))
        np.testing.assert_array_equal(np.asarray(other[1]), np.asarray(by_config[1]))
    assert np.asarray(by_config[0]).shape == (3, 6)
    with pytest.raises(TypeError, match="num_beams: not a GenerationConfig field"):
        gen.generate(params, MARIAN, inputs, num_beams=2)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['num_beams'\\]"):
        gen.generate_jit(params, MARIAN, inputs, mesh=gen.default_mesh(), num_beams=2)


def test_source_max_len_stops_each_row_at_its_own_limit(endless):
    params, inputs = endless
    tokens, _ = gen.generate(params, MARIAN, inputs, GenerationConfig(max_len="source"))
    tokens = np.asarray(tokens)
    # Width min(32, int(1.5 * 6) + 10) = 19; rows of 2, 3, 5 ids: 13, 14 and 17 tokens,
    # every one of them an ordinary id (the model cannot end a row), PAD after them.
    assert tokens.shape == (3, 19)
    lengths = (tokens != PAD).sum(axis=1)
    assert lengths.tolist() == [13, 14, 17]
    for row, n in zip(tokens, lengths, strict=True):
        assert ((row[:n] >= 2) & (row[:n] < PAD)).all() and (row[n:] == PAD).all(), row
    with pytest.raises(ValueError, match="^max_len='source' derives each row's limit"):
        gen.continue_prompt(params, MARIAN, inputs, max_len="source")


def test_forced_bos_id_is_every_rows_first_token_and_decoding_goes_on_from_it(endless):
    """Greedy, beam and sampled rows all start with the forced id; greedy's later tokens are
    the argmax of the teacher-forced logits behind it (the full, uncached forward)."""
    from flaxformer_lite import EncoderDecoder

    params, inputs = endless
    forced = 3
    free, _ = gen.generate(params, MARIAN, inputs, method="greedy", max_len=6)
    assert not (np.asarray(free)[:, 0] == forced).all()  # forcing changes something
    rng = jax.random.key(0)
    for method in ("greedy", "beam", "sample"):
        tokens, _ = gen.generate(
            params, MARIAN, inputs, method=method, max_len=6, forced_bos_id=forced, rng=rng
        )
        assert (np.asarray(tokens)[:, 0] == forced).all(), method
    tokens, _ = gen.generate(
        params, MARIAN, inputs, method="greedy", max_len=6, forced_bos_id=forced
    )
    tokens = np.asarray(tokens)
    logits = EncoderDecoder(MARIAN).apply({"params": params}, inputs, tokens)
    np.testing.assert_array_equal(tokens[:, 1:], np.asarray(logits).argmax(-1)[:, 1:])


# ----------------------------------------------------------------------------- CLI flags, export


def test_cli_flags_replace_only_what_they_set():
    from flaxformer_lite.cli import translate

    run = GenerationConfig.from_run({"beam_size": 6, "alpha": 1.0, "ban_pad": True}, MARIAN)
    unset = translate.parse_args(["--workdir", "run"])
    assert translate.generation_from_flags(unset, run) == run  # flag defaults change nothing
    argv = ["--workdir", "run", "--method", "sample", "--max_len", "7", "--top_k", "3"]
    got = translate.generation_from_flags(translate.parse_args(argv), run)
    assert got == run.replace(method="sample", max_len=7, top_k=3)
    argv = ["--workdir", "run", "--beam_size", "2", "--alpha", "0.0", "--temperature", "0.5"]
    got = translate.generation_from_flags(translate.parse_args(argv), run)
    assert got == run.replace(beam_size=2, alpha=0.0, temperature=0.5)


def test_the_export_fixes_the_output_width():
    from flaxformer_lite.inference.export import exported_generation

    per_row = GenerationConfig(method="beam", max_len="source", temperature=0.5)
    # "source": the program's width is the model's positions; the runtime cuts each row.
    assert exported_generation(per_row, MARIAN) == (
        GenerationConfig(method="beam", max_len=32),
        True,
    )
    greedy = GenerationConfig(method="greedy", max_len=9, beam_size=3, forced_eos=True)
    assert exported_generation(greedy, MARIAN) == (
        GenerationConfig(method="greedy", max_len=9, beam_size=1, alpha=0.0, forced_eos=True),
        False,
    )
    assert exported_generation(GenerationConfig(), MARIAN)[0].max_len == 32
    with pytest.raises(ValueError, match=r"^method must be one of \('beam', 'greedy'\)"):
        exported_generation(GenerationConfig(method="sample"), MARIAN)
    with pytest.raises(ValueError, match="^max_len=40 "):
        exported_generation(GenerationConfig(max_len=40), MARIAN)
