"""T5's relative position bias (``position="relative"``): bucket ids against the published
formula, padding invariance, cached decoding and greedy generation against the full forward,
the stack-level table under ``scan_layers``, and blockwise attention with the bias.

The float64 NumPy reference agreement (EncoderDecoder, DecoderOnly, EncoderClassifier) is in
tests/models/test_reference.py.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import DecoderOnly, EncoderDecoder, TransformerConfig
from flaxformer_lite.decoding.generate import generate
from flaxformer_lite.models import shift_right, unstack_layers
from flaxformer_lite.ops.positions import relative_position_bucket

ATOL = 1e-5

# ----------------------------------------------------------------------------- bucket ids

# Mesh TensorFlow's _relative_position_bucket (T5), relative = key - query, n = -relative.
# Bidirectional, 32 buckets, max distance 128: 16 buckets per direction, keys after the query
# offset by 16; n < 8 exact; else 8 + floor(8 ln(n/8) / ln(16)), at most 15. By hand:
#   n=15: 8 ln(1.875)/ln 16 = 1.81 -> 9     n=16: 8 * 1/4 = 2 -> 10    n=20: 2.64 -> 10
#   n=31: 3.91 -> 11   n=32: 8 * 2/4 = 4 -> 12   n=64: 8 * 3/4 = 6 -> 14   n=127: 7.98 -> 15
#   n>=128: 8 -> capped at 15.
BIDIRECTIONAL_T5 = {
    0: 0, -1: 1, -7: 7, -8: 8, -15: 9, -16: 10, -20: 10, -31: 11, -32: 12, -64: 14,
    -127: 15, -128: 15, -1000: 15,
    1: 17, 7: 23, 8: 24, 16: 26, 32: 28, 64: 30, 127: 31, 128: 31, 500: 31,
}  # fmt: skip
# Causal, 32 buckets, max distance 128: n < 16 exact; else 16 + floor(16 ln(n/16) / ln(8)),
# at most 31; keys after the query (n < 0) all get bucket 0. By hand:
#   n=20: 16 * 0.107 = 1.72 -> 17   n=32: 16/3 = 5.33 -> 21   n=64: 32/3 = 10.67 -> 26
#   n=127: 15.94 -> 31   n>=128: 16 -> capped at 31.
CAUSAL_T5 = {
    0: 0, -1: 1, -15: 15, -16: 16, -20: 17, -32: 21, -64: 26, -127: 31, -128: 31,
    -4000: 31, 1: 0, 5: 0, 300: 0,
}  # fmt: skip
# Bidirectional, 8 buckets, max distance 7: 4 per direction, n < 2 exact; else
# 2 + floor(2 ln(n/2) / ln(3.5)), at most 3:  n=3: 0.65 -> 2   n=4: 1.11 -> 3 (the cap).
BIDIRECTIONAL_SMALL = {0: 0, -1: 1, -2: 2, -3: 2, -4: 3, -6: 3, -9: 3, 1: 5, 2: 6, 3: 6, 4: 7}


@pytest.mark.parametrize(
    "expected, bidirectional, num_buckets, max_distance",
    [
        (BIDIRECTIONAL_T5, True, 32, 128),
        (CAUSAL_T5, False, 32, 128),
        (BIDIRECTIONAL_SMALL, True, 8, 7),
    ],
    ids=["t5_bidirectional", "t5_causal", "small_bidirectional"],
)
def test_bucket_ids_follow_the_published_formula(
    expected, bidirectional, num_buckets, max_distance
):
    relative = np.array(list(expected), np.int32)
    got = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert got.dtype == jnp.int32 and got.shape == relative.shape
    assert dict(zip(expected, np.asarray(got).tolist(), strict=True)) == expected
    # Any shape: a [query, key] grid of the same distances gives the same ids.
    grid = relative_position_bucket(
        relative.reshape(1, -1), bidirectional, num_buckets, max_distance
    )
    np.testing.assert_array_equal(np.asarray(grid)[0], np.asarray(got))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_buckets=6.0, max_distance=128), "num_buckets must be a positive integer"),
        (dict(num_buckets=7, max_distance=128), "num_buckets must be even and >= 4"),
        (dict(num_buckets=2, max_distance=128), "num_buckets must be even and >= 4"),
        (dict(num_buckets=32, max_distance=16), "max_distance must exceed num_buckets // 2"),
    ],
)
def test_bad_bucket_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        relative_position_bucket(jnp.arange(3), True, **kwargs)


def test_float_relative_positions_raise():
    with pytest.raises(ValueError, match="relative_position must be an integer array"):
        relative_position_bucket(jnp.arange(3.0), True, 32, 128)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(relative_num_buckets=0), "relative_num_buckets must be a positive integer"),
        (dict(relative_num_buckets=9), "relative_num_buckets must be even and >= 4"),
        (dict(relative_max_distance=8, relative_num_buckets=16), "relative_max_distance must"),
        (dict(relative_max_distance=True), "relative_max_distance must be a positive integer"),
    ],
)
def test_config_rejects_bad_relative_settings(changes, match):
    with pytest.raises(ValueError, match=f"TransformerConfig.{match}"):
        TransformerConfig(position="relative", **changes)


# ----------------------------------------------------------------------------- models

TINY = TransformerConfig(
    vocab_size=40,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=16,
    dropout_rate=0.0,
    position="relative",
    relative_num_buckets=8,
    relative_max_distance=6,
)


def tokens(rng: np.random.Generator, lengths, width: int, vocab: int) -> np.ndarray:
    """int32 `[len(lengths), width]`: ids in [3, vocab) (no pad/bos/eos), then padding 0."""
    t = rng.integers(3, vocab, size=(len(lengths), width)).astype(np.int32)
    for row, n in enumerate(lengths):
        t[row, n:] = TINY.pad_id
    return t


def scaled_tables(params):
    """The tables start at N(0, 0.02): scaled up 50x so that the bias matters in every test."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p * 50.0 if "relative_bias" in jax.tree_util.keystr(path) else p, params
    )


@functools.cache
def seq2seq(cfg: TransformerConfig = TINY):
    """(model, params, jitted apply) of an EncoderDecoder, built once per config."""
    model = EncoderDecoder(cfg)
    x, y = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    params = scaled_tables(nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), x, y)["params"]))
    return model, params, jax.jit(model.apply)


@functools.cache
def decoder_only(cfg: TransformerConfig = TINY):
    model = DecoderOnly(cfg)
    params = scaled_tables(
        nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), jnp.ones((1, 4), jnp.int32))["params"])
    )
    return model, params, jax.jit(model.apply)


def test_tables_are_one_per_stack_per_head():
    _, params, _ = seq2seq()
    params = jax.tree.map(np.asarray, params)
    for stack in ("encoder", "decoder"):
        assert params[stack]["relative_bias"]["embedding"].shape == (8, TINY.num_heads)
        for layer in ("layers_0", "layers_1"):
            assert "relative_bias" not in params[stack][layer]["self_attention"]


def test_relative_bias_changes_the_output():
    """The tables reach the logits: zeroing them changes them (so the tests below see them)."""
    _, params, apply = seq2seq()
    rng = np.random.default_rng(0)
    x, y = tokens(rng, (7, 5), 9, 40), tokens(rng, (6, 3), 7, 40)
    zero = jax.tree_util.tree_map_with_path(
        lambda path, p: p * 0 if "relative_bias" in jax.tree_util.keystr(path) else p, params
    )
    a = np.asarray(apply({"params": params}, x, y))
    b = np.asarray(apply({"params": zero}, x, y))
    assert np.abs(a - b).max() > 1e-2


def test_padding_does_not_change_real_outputs():
    """Appending padding to source and target leaves the logits at real target positions alone:
    padded keys are masked, so their buckets (distances up to the new length) never count."""
    _, params, apply = seq2seq()
    rng = np.random.default_rng(1)
    x, y = tokens(rng, (9, 4, 2), 9, 40), tokens(rng, (7, 5, 1), 7, 40)
    short = np.asarray(apply({"params": params}, x, y))
    long = np.asarray(
        apply({"params": params}, np.pad(x, ((0, 0), (0, 6))), np.pad(y, ((0, 0), (0, 5))))
    )
    real = y != TINY.pad_id
    assert np.abs(long[:, :7] - short)[real].max() < ATOL


def test_packed_rows_equal_separate_examples():
    """Two examples packed in one row (positions restarting at 0, segment ids) give the logits
    each gets alone: the bias depends on distances only, the same inside a segment as alone,
    and pairs across segments are masked."""
    _, params, apply = seq2seq()
    rng = np.random.default_rng(8)
    src = [rng.integers(3, 40, n).astype(np.int32) for n in (5, 4)]
    tgt = [rng.integers(3, 40, n).astype(np.int32) for n in (4, 3)]

    def pack(parts, width):
        row = np.zeros((1, width), np.int32)
        seg, pos = np.zeros_like(row), np.zeros_like(row)
        start = 0
        for i, part in enumerate(parts):
            row[0, start : start + len(part)] = part
            seg[0, start : start + len(part)] = i + 1
            pos[0, start : start + len(part)] = np.arange(len(part))
            start += len(part)
        return row, seg, pos

    (x, xs, xp), (y, ys, yp) = pack(src, 10), pack(tgt, 8)
    packed = np.asarray(
        apply(
            {"params": params}, x, y, inputs_positions=xp, targets_positions=yp,
            inputs_segmentation=xs, targets_segmentation=ys,
        )
    )  # fmt: skip
    start = 0
    for s_, t_ in zip(src, tgt, strict=True):
        alone = np.asarray(apply({"params": params}, s_[None], t_[None]))
        assert np.abs(packed[0, start : start + len(t_)] - alone[0]).max() < ATOL
        start += len(t_)


def _step_by_step(model, params, step_inputs, chunks, *context):
    """Logits of ``step_inputs`` `[b, t]` fed to the cache in ``chunks`` (lengths summing to
    t), after an allocation call of the full width. Jitted (one compile per chunk length):
    cold, op-by-op eager dispatch cost more CPU than the compiles."""
    _, cache = jax.jit(
        lambda context, inputs: model.apply(
            {"params": params}, *context, inputs, decode=True, mutable=["cache"],
            method=model.decode,
        )
    )(context, jnp.zeros_like(step_inputs))  # fmt: skip
    cache = jax.tree.map(jnp.zeros_like, cache["cache"])
    step = jax.jit(
        lambda cache, context, inputs: model.apply(
            {"params": params, "cache": cache}, *context, inputs, decode=True,
            mutable=["cache"], method=model.decode,
        )
    )  # fmt: skip
    out, start = [], 0
    for n in chunks:
        logits, vars_ = step(cache, context, step_inputs[:, start : start + n])
        cache, start = vars_["cache"], start + n
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def test_cached_decoding_equals_full_forward_encoder_decoder():
    model, params, apply = seq2seq()
    rng = np.random.default_rng(2)
    x, y = tokens(rng, (8, 5), 8, 40), tokens(rng, (9, 9), 9, 40)
    full = np.asarray(apply({"params": params}, x, y))
    encoded = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode))(params, x)
    # a 3-token prompt at once, then one token per step (distances up to 8 > max_distance 6)
    cached = _step_by_step(
        model, params, shift_right(jnp.asarray(y), TINY.bos_id), (3, 1, 1, 1, 1, 1, 1), encoded, x
    )
    assert np.abs(cached - full).max() < ATOL


def test_cached_decoding_equals_full_forward_decoder_only():
    model, params, apply = decoder_only()
    t = tokens(np.random.default_rng(3), (12, 12), 12, 40)
    full = np.asarray(apply({"params": params}, t))
    cached = _step_by_step(model, params, shift_right(jnp.asarray(t), TINY.bos_id), (1,) * 12)
    assert np.abs(cached - full).max() < ATOL


def test_cached_sliding_window_decoding_equals_full_forward():
    """With a decoder attention_window the cache is a ring buffer of ``window`` slots; the bias
    follows the positions the slots hold (a prompt chunk, then steps past the window)."""
    cfg = TINY.replace(attention_window=3)
    model, params, apply = decoder_only(cfg)
    t = tokens(np.random.default_rng(7), (12, 12), 12, 40)
    full = np.asarray(apply({"params": params}, t))
    cached = _step_by_step(model, params, shift_right(jnp.asarray(t), cfg.bos_id), (2,) + (1,) * 10)
    assert np.abs(cached - full).max() < ATOL


def test_greedy_generate_equals_argmax_of_full_forward():
    """generate() (its cache sized by init_cache, then one token per step) picks, at every step,
    the argmax of the full forward over the tokens it chose so far."""
    _, params, apply = seq2seq()
    x = tokens(np.random.default_rng(4), (8, 3), 8, 40)
    width = 10
    out, _ = generate(params, TINY, x, method="greedy", max_len=width)
    out = np.asarray(out)
    chosen = np.zeros((2, width), np.int32)
    for t in range(width):
        logits = np.asarray(apply({"params": params}, x, chosen))
        chosen[:, t] = logits[:, t].argmax(-1)
    for row in range(2):
        eos = np.flatnonzero(chosen[row] == TINY.eos_id)
        n = eos[0] + 1 if eos.size else width
        np.testing.assert_array_equal(out[row, :n], chosen[row, :n])


def test_scan_layers_keeps_one_unstacked_table_per_stack():
    """With scan_layers the table lives beside the scanned ``layers`` (not stacked per layer);
    logits and the table's gradient equal those of the unrolled model."""
    cfg = TINY.replace(scan_layers=True)
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(5)
    x, y = tokens(rng, (8, 5), 8, 40), tokens(rng, (6, 4), 6, 40)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(2), x, y)["params"])
    for stack in ("encoder", "decoder"):
        assert np.shape(params[stack]["relative_bias"]["embedding"]) == (8, cfg.num_heads)
        assert "relative_bias" not in params[stack]["layers"]["self_attention"]
    unrolled_params = unstack_layers(params)
    unrolled = EncoderDecoder(TINY)

    def loss(m, p):
        return jnp.sum(jnp.sin(m.apply({"params": p}, x, y)))

    (l_scan, g_scan), (l_unrolled, g_unrolled) = (
        jax.jit(jax.value_and_grad(functools.partial(loss, m)))(p)
        for m, p in ((model, params), (unrolled, unrolled_params))
    )
    assert abs(float(l_scan) - float(l_unrolled)) < 1e-4
    for stack in ("encoder", "decoder"):
        a = np.asarray(g_scan[stack]["relative_bias"]["embedding"])
        b = np.asarray(g_unrolled[stack]["relative_bias"]["embedding"])
        assert np.abs(a).max() > 0 and np.abs(a - b).max() < 1e-5


def test_blockwise_attention_takes_the_bias():
    """attention_implementation='blockwise' applies the same bias block by block: logits and the
    tables' gradients equal the reference ('xla') implementation's."""
    model, params, _ = seq2seq()
    blockwise = EncoderDecoder(TINY.replace(attention_implementation="blockwise"))
    rng = np.random.default_rng(6)
    x, y = tokens(rng, (9, 6), 9, 40), tokens(rng, (7, 3), 7, 40)
    real = jnp.asarray(y != TINY.pad_id)[..., None]

    def loss(m, p):
        return jnp.sum(jnp.where(real, jnp.sin(m.apply({"params": p}, x, y)), 0.0))

    results = [
        jax.jit(jax.value_and_grad(functools.partial(loss, m)))(params) for m in (model, blockwise)
    ]
    (l_ref, g_ref), (l_blk, g_blk) = results
    assert abs(float(l_ref) - float(l_blk)) < 1e-4
    for stack in ("encoder", "decoder"):
        a = np.asarray(g_ref[stack]["relative_bias"]["embedding"])
        b = np.asarray(g_blk[stack]["relative_bias"]["embedding"])
        assert np.abs(a).max() > 0 and np.abs(a - b).max() < 1e-5
