"""Hugging Face ``generate`` semantics in our searches, against ``MarianMTModel.generate``
itself: ``beam_style="hf"`` (its length penalty, candidate and stopping rules), its
``early_stopping`` values, and the token constraints Marian checkpoints switch on
(``forced_eos_token_id``, ``bad_words_ids=[[pad]]``) as ``forced_eos`` / ``banned_ids``.

One tiny random float32 Marian model (test_hf_marian's ``random_marian``: every parameter
random, embeddings and output of std 0.5, sharper attention), saved with ``save_pretrained``
and loaded with our ``hf.load_pretrained``. Logits of size ~3 make the model peaky: near-ties
between hypotheses, which float32 rounding in two implementations could order differently,
are rare. EOS's final logits bias is raised by ``EXTRA_EOS_BIAS`` more, so that at
``MAX_NEW`` tokens some rows end by EOS and others run to the limit (each test asserts both).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Marian reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="MarianMTModel.generate is the reference (pip install -e '.[test]')"
)

from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.interop import hf  # noqa: E402

from helpers.hf_models import CORPUS, DECODING_QK_GAIN, marian_dir, padded_rows, random_marian

ROWS, SRC_LEN, MAX_NEW = 40, 12, 8
EXTRA_EOS_BIAS = 3.0


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """(HF model, our config, our params, padded source rows int64 [ROWS, SRC_LEN])."""
    model = random_marian("opus_mt", seed=0, qk_gain=DECODING_QK_GAIN)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] += EXTRA_EOS_BIAS
    folder = tmp_path_factory.mktemp("marian_generate")
    model.save_pretrained(folder)
    config, params, _ = hf.load_pretrained(str(folder))
    src = padded_rows(np.random.default_rng(5), ROWS, SRC_LEN, config.vocab_size, config.pad_id)
    return model, config, params, src


def hf_generate(model, config, src, **kwargs):
    """``MarianMTModel.generate`` on ``src``: (tokens int64 [rows, MAX_NEW] without the decoder
    start, PAD after EOS, the best beam's ``sequences_scores`` or None)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.from_numpy(src),
            attention_mask=torch.from_numpy(src != config.pad_id),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            min_length=0,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    sequences = out.sequences.numpy()
    assert (sequences[:, 0] == config.bos_id).all()  # the decoder start, then the tokens
    tokens = np.full((len(src), MAX_NEW), config.pad_id, np.int64)
    tokens[:, : sequences.shape[1] - 1] = sequences[:, 1:]
    scores = getattr(out, "sequences_scores", None)
    return tokens, None if scores is None else scores.numpy()


def lengths(tokens, config):
    """Generated tokens per row up to the first EOS (included), or MAX_NEW."""
    eos = tokens == config.eos_id
    return np.where(eos.any(axis=1), eos.argmax(axis=1) + 1, MAX_NEW)


def test_greedy_matches_generate_with_marian_constraints(marian):
    """Greedy with forced EOS at the limit and PAD banned, as opus-mt checkpoints decode."""
    model, config, params, src = marian
    want, _ = hf_generate(
        model,
        config,
        src,
        num_beams=1,
        forced_eos_token_id=config.eos_id,
        bad_words_ids=[[config.pad_id]],
    )
    ours, _ = generate(
        params,
        config,
        src.astype(np.int32),
        method="greedy",
        max_len=MAX_NEW,
        forced_eos=True,
        banned_ids=(config.pad_id,),
    )
    np.testing.assert_array_equal(np.asarray(ours), want)
    # Every row ends with EOS, some forced at the limit, others earlier by the model.
    n = lengths(want, config)
    assert (want[np.arange(ROWS), n - 1] == config.eos_id).all()
    assert 0 < (n == MAX_NEW).sum() < ROWS, n
    assert len({tuple(row) for row in want}) >= 10


# (length_penalty, early_stopping, Marian's constraints on): HF's defaults for opus-mt first.
BEAM_CASES = [
    (1.0, False, True),
    (0.6, True, False),
    (2.0, "never", False),
    (-0.5, False, True),
]


@pytest.mark.parametrize("length_penalty,early_stopping,constrained", BEAM_CASES)
def test_beam_matches_generate(marian, length_penalty, early_stopping, constrained):
    """Beam 4 with ``beam_style="hf"``: the best hypothesis token for token and its score
    within 1e-4 of ``sequences_scores`` on every row."""
    model, config, params, src = marian
    constraints = dict(
        forced_eos_token_id=config.eos_id if constrained else None,
        bad_words_ids=[[config.pad_id]] if constrained else None,
    )
    want, want_scores = hf_generate(
        model,
        config,
        src,
        num_beams=4,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        **constraints,
    )
    ours, scores = generate(
        params,
        config,
        src.astype(np.int32),
        method="beam",
        max_len=MAX_NEW,
        beam_size=4,
        alpha=length_penalty,
        beam_style="hf",
        early_stopping=early_stopping,
        forced_eos=constrained,
        banned_ids=(config.pad_id,) if constrained else (),
    )
    np.testing.assert_array_equal(np.asarray(ours), want)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=0, atol=1e-4)
    # Both ways of ending occur: EOS before the limit, and the limit itself.
    n = lengths(want, config)
    assert 0 < (n == MAX_NEW).sum() < ROWS, n
    assert len({tuple(row) for row in want}) >= 10


def test_the_hf_rules_matter_on_these_rows(marian):
    """GNMT's rules (the default) choose differently on some rows at the same alpha, so the
    agreement above is not one any beam search would reach."""
    model, config, params, src = marian
    want, _ = hf_generate(model, config, src, num_beams=4, length_penalty=1.0)
    gnmt, _ = generate(
        params, config, src.astype(np.int32), method="beam", max_len=MAX_NEW, alpha=1.0
    )
    assert (np.asarray(gnmt) != want).any(axis=1).sum() >= 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beam_style": "marian"}, "beam_style must be one of"),
        ({"early_stopping": "never"}, "is a rule of beam_style='hf'"),
        ({"banned_ids": (0,)}, "must not contain eos_id=0"),
        ({"banned_ids": [61]}, r"ints in \[0, 61\)"),
    ],
)
def test_generate_refuses_bad_search_options(marian, kwargs, message):
    _, config, params, src = marian
    with pytest.raises(ValueError, match=message):
        generate(params, config, src.astype(np.int32), method="beam", max_len=MAX_NEW, **kwargs)


# ----------------------------------------------------------------------------- folder defaults
# Translator.from_pretrained and save_pretrained against MarianMTModel.from_pretrained(folder)
# .generate() with no arguments: what the folder's generation_config.json asks for, nothing
# else. One tiny random model with a Marian tokenizer (helpers.hf_models.marian_dir; PAD's logits
# bias raised so that banning it, and renormalising after the ban, change beam choices), copied
# into folders that differ in generation_config.json alone.

TEXTS = [
    "a dog runs in the park",
    "the cat sleeps",
    "two men ride bikes down the road",
    "a woman reads",
    "children play with a ball near the water",
    "the old man walks his dog",
    "a girl sings",
    "people wait for the bus in the rain",
    "red bikes",
    "the cat sleeps on a red mat in the sun",
    "a man",
    "two women walk",
]
PAD = "<pad id>"  # replaced by the model's pad id
GENERATION_CASES = {
    # Nothing set: transformers' defaults (greedy, 20 new tokens, PAD allowed, no forced EOS).
    "unset": {},
    # As opus-mt folders: beam 4, EOS forced at max_length, PAD banned, renormalised.
    "opus_mt": dict(
        num_beams=4,
        max_length=9,
        forced_eos_token_id=0,
        bad_words_ids=[[PAD]],
        renormalize_logits=True,
    ),
    "opus_mt_no_renormalize": dict(
        num_beams=4, max_length=9, forced_eos_token_id=0, bad_words_ids=[[PAD]]
    ),
    # Greedy cut short by max_length, EOS forced there, PAD banned.
    "short_greedy": dict(max_length=6, forced_eos_token_id=0, bad_words_ids=[[PAD]]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """({case: Hugging Face folder}, transformers.MarianTokenizer, pad id)."""
    import shutil

    from flaxformer_lite.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("generation_cases")
    spm_model = root / "spm.model"
    Tokenizer.train(CORPUS, str(spm_model), 60, num_threads=1)
    base, _ = marian_dir(root / "base", spm_model, seed=2, eos_bias=2.0, pad_bias=5.5)
    written = json.loads((base / "generation_config.json").read_text())
    pad = written["pad_token_id"]
    ids = {k: written[k] for k in ("decoder_start_token_id", "eos_token_id", "pad_token_id")}
    out = {}
    for case, fields in GENERATION_CASES.items():
        folder = root / case
        shutil.copytree(base, folder)
        text = json.dumps({**ids, **fields}).replace(json.dumps(PAD), str(pad))
        (folder / "generation_config.json").write_text(text)
        out[case] = folder
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(base / "source.spm"),
        target_spm=str(base / "target.spm"),
        vocab=str(base / "vocab.json"),
    )
    return out, tokenizer, pad


_REFERENCE: dict = {}


def folder_generate(folder, tokenizer):
    """(tokens int64 [rows, n] without the decoder start, strings) of
    ``MarianMTModel.from_pretrained(folder).generate`` on TEXTS with no decoding arguments."""
    key = str(folder)
    if key not in _REFERENCE:
        model = transformers.MarianMTModel.from_pretrained(str(folder)).eval()
        batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch).numpy()
        strings = tokenizer.batch_decode(out, skip_special_tokens=True)
        _REFERENCE[key] = out[:, 1:], [" ".join(s.split()) for s in strings]
    return _REFERENCE[key]


def generated_lengths(tokens, eos_id=0):
    """Tokens per row up to the first EOS (included), or the row's width."""
    eos = tokens == eos_id
    return np.where(eos.any(axis=1), eos.argmax(axis=1) + 1, tokens.shape[1])


@pytest.mark.parametrize("case", list(GENERATION_CASES))
def test_translator_decodes_as_the_folders_generate(folders, case):
    from flaxformer_lite.inference.translator import Translator

    cases, tokenizer, _ = folders
    want_tokens, want = folder_generate(cases[case], tokenizer)
    got = Translator.from_pretrained(str(cases[case])).translate(TEXTS)
    print(case, "lengths", generated_lengths(want_tokens).tolist(), want)
    assert got == want
    assert len(set(want)) >= 5, "the random model must not translate every row alike"


def test_the_generation_cases_differ_where_it_matters(folders):
    """What makes the cases above able to fail: the default 20 tokens cut rows that
    ``1.5 * source + 10`` would cut sooner; max_length 9 cuts rows with a forced EOS; the
    renormalisation after the PAD ban changes beam choices."""
    cases, tokenizer, pad = folders
    source_lens = np.array([len(tokenizer(t)["input_ids"]) for t in TEXTS])
    unset, _ = folder_generate(cases["unset"], tokenizer)
    n = generated_lengths(unset)
    assert (n > (1.5 * source_lens + 10).astype(int)).any(), (n, source_lens)
    opus, opus_strings = folder_generate(cases["opus_mt"], tokenizer)
    assert opus.shape[1] == 8 and ((generated_lengths(opus) == 8) & (opus[:, -1] == 0)).any()
    plain, plain_strings = folder_generate(cases["opus_mt_no_renormalize"], tokenizer)
    assert (opus != plain).any(axis=1).sum() >= 2
    greedy, _ = folder_generate(cases["short_greedy"], tokenizer)
    assert greedy.shape[1] == 5 and (greedy[:, -1] == 0).sum() >= 3


def test_save_pretrained_keeps_the_generation_config(folders, tmp_path):
    """load -> save: the same generation_config.json fields, the same GenerationConfig, and
    generate() on the re-saved folder gives the original's tokens."""
    cases, tokenizer, _ = folders
    for case in ("opus_mt", "unset"):
        folder = cases[case]
        config, params, tok = hf.load_pretrained(str(folder))
        out = tmp_path / case
        hf.save_pretrained(str(out), config, params, tok, generation=hf.generation_config(folder))
        original = json.loads((folder / "generation_config.json").read_text())
        assert json.loads((out / "generation_config.json").read_text()) == original
        read = transformers.GenerationConfig.from_pretrained(str(out)).to_diff_dict()
        want = transformers.GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
        assert read == want and (case == "unset" or read["num_beams"] == 4)
        np.testing.assert_array_equal(
            folder_generate(out, tokenizer)[0], folder_generate(folder, tokenizer)[0]
        )


def test_bad_generation_configs_are_refused(folders, tmp_path):
    import shutil

    from flaxformer_lite.inference.translator import Translator

    cases, _, _ = folders
    config, params, tok = hf.load_pretrained(str(cases["unset"]))
    with pytest.raises(ValueError, match=r"eos_token_id=5 \(config: 0\)"):
        hf.save_pretrained(str(tmp_path / "x"), config, params, generation={"eos_token_id": 5})
    assert not (tmp_path / "x").exists()
    folder = tmp_path / "sampling"
    shutil.copytree(cases["unset"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    with pytest.raises(ValueError, match=r"do_sample=True"):
        Translator.from_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"max_length": 1}))
    with pytest.raises(ValueError, match=r"max_length=1 leaves no token"):
        Translator.from_pretrained(str(folder))
    with pytest.raises(ValueError, match="per_row_max_len must be True or False"):
        Translator.from_pretrained(str(cases["unset"]), per_row_max_len="yes")
