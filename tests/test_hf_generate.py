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

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Marian reference runs in PyTorch (test extra)")
transformers = pytest.importorskip(
    "transformers", reason="MarianMTModel.generate is the reference (pip install -e '.[test]')"
)

from test_hf_marian import DECODING_QK_GAIN, padded_rows, random_marian  # noqa: E402

from flaxformer_lite import hf  # noqa: E402
from flaxformer_lite.generate import generate  # noqa: E402

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
