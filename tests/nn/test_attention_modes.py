"""MultiHeadAttention's modes one at a time (nn/attention.py), each against an independent NumPy
reference: the cache's pure functions (ops/kv_cache.py: the full cache, the ring buffer of a
sliding window), fused against separate projections on the same weights, cached decoding with
rotary positions (full cache and ring buffer) against the float64 forward pass of
tests/helpers/numpy_reference.py, and beam search's two modes (a source's beams sharing its encoder
keys; self-attention over a cache that is never reordered). A single layer with 8 features,
4 heads of 4: nothing here builds a model.
"""

from __future__ import annotations

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.nn.attention import MultiHeadAttention
from flaxformer_lite.ops import kv_cache

from helpers import numpy_reference as ref

FEATURES, HEADS, HEAD_DIM = 8, 4, 4
# What numpy_reference.multi_head_attention reads of a config.
REF_CFG = types.SimpleNamespace(num_heads=HEADS, head_dim=HEAD_DIM, d_model=FEATURES)
ATOL = 1e-5


def random_params(layer: nn.Module, *inputs, seed: int = 0, **kwargs) -> dict:
    """float32 NumPy parameters over ``layer.init``'s shapes (no compile): kernels
    N(0, features^-1/2), biases N(0, 0.1^2) (non-zero, so a dropped one shows)."""
    shapes = jax.eval_shape(layer.init, jax.random.key(0), *inputs, **kwargs)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        std = 0.1 if "bias" in path[-1].key else FEATURES**-0.5
        return (std * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, nn.meta.unbox(shapes))


def features(seed: int, batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, length, FEATURES)).astype(np.float32)


def fuse(params: dict, kv_heads: int) -> dict:
    """The separate "query"/"key"/"value" kernels and biases in the layout of
    ``FusedQKVProjection`` ("qkv"), written from its docstring."""
    q, k, v = params["query"], params["key"], params["value"]
    if kv_heads == HEADS:
        qkv = {
            "kernel": np.stack([q["kernel"], k["kernel"], v["kernel"]], axis=1),
            "bias": np.stack([q["bias"], k["bias"], v["bias"]], axis=0),
        }
    else:
        qkv = {
            "query_kernel": q["kernel"],
            "query_bias": q["bias"],
            "kv_kernel": np.stack([k["kernel"], v["kernel"]], axis=1),
            "kv_bias": np.stack([k["bias"], v["bias"]], axis=0),
        }
    return {"qkv": qkv, "out": params["out"]}


# ----------------------------------------------------------------------------- the cache


def numpy_ring_steps(ring: int, q_lens: list[int], seed: int = 0):
    """A ring buffer of ``ring`` slots written one position at a time in Python: yields per
    step (positions, new [b, q, kv_heads, d], ring before [b, kv_heads, ring, d], key
    positions of the ring then the new keys (-1: empty slot), visibility [q, ring + q], ring
    after)."""
    rng = np.random.default_rng(seed)
    held = np.zeros((2, 1, ring, 3), np.float32)
    held_at = [-1] * ring
    start = 0
    for q_len in q_lens:
        positions = np.arange(start, start + q_len)
        new = rng.integers(1, 100, (2, q_len, 1, 3)).astype(np.float32)
        before = held.copy()
        key_at = np.array(held_at + list(positions))
        visible = np.array(
            [[k >= 0 and 0 <= p - k <= ring for k in key_at] for p in positions], dtype=bool
        )
        for i, p in enumerate(positions):  # position p into slot p % ring, in order
            held[:, :, p % ring] = new[:, i]
            held_at[p % ring] = p
        yield positions, new, before, key_at, visible, held.copy()
        start += q_len


@pytest.mark.parametrize(
    "ring, q_lens",
    [(3, [1] * 8), (3, [2, 1, 3, 1, 1, 4, 2]), (4, [5, 1, 2, 1])],
    ids=["one_at_a_time", "several_per_step", "prompt_longer_than_the_ring"],
)
def test_ring_update_matches_a_numpy_ring(ring, q_lens):
    """``ring_update`` (what a step attends over; the ring after its write), ``ring_key_positions``
    and ``ring_mask`` equal a ring buffer written one position at a time."""
    for positions, new, before, key_at, visible, after in numpy_ring_steps(ring, q_lens):
        attended, written = kv_cache.ring_update(jnp.asarray(before), new, jnp.asarray(positions))
        np.testing.assert_array_equal(
            attended, np.concatenate([before, new.transpose(0, 2, 1, 3)], axis=2)
        )
        np.testing.assert_array_equal(written, after)
        got_at = np.asarray(kv_cache.ring_key_positions(jnp.asarray(positions), ring))
        np.testing.assert_array_equal(got_at < 0, key_at < 0)  # empty slots
        np.testing.assert_array_equal(got_at[key_at >= 0], key_at[key_at >= 0])
        np.testing.assert_array_equal(kv_cache.ring_mask(jnp.asarray(positions), ring), visible)


def test_full_cache_write_and_mask_match_numpy():
    """``write_cache`` puts position p in slot p (heads first); ``cache_mask``: query at p sees
    slots p - window .. p (all slots <= p without a window)."""
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((2, 2, 6, 3)).astype(np.float32)
    new = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)  # positions 2, 3, 4
    expected = cache.copy()
    expected[:, :, 2:5] = new.transpose(0, 2, 1, 3)
    written = kv_cache.write_cache(jnp.asarray(cache), new, jnp.int32(2))
    np.testing.assert_array_equal(written, expected)
    positions = np.array([2, 3, 4])
    for window in (None, 1):
        want = np.array(
            [[s <= p and (window is None or p - s <= window) for s in range(6)] for p in positions]
        )
        np.testing.assert_array_equal(kv_cache.cache_mask(jnp.asarray(positions), 6, window), want)
    with pytest.raises(ValueError, match="max_len=6"):
        kv_cache.check_cache_room(4, 3, 6)


# ----------------------------------------------------------------------------- projections


@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1], ids=["multi_head", "grouped", "multi_query"])
def test_fused_projections_equal_separate_ones_on_the_same_weights(kv_heads):
    """One kernel "qkv" assembled from the separate query/key/value kernels gives the separate
    layer's output, and both give the float64 reference's (causal self-attention, rotary)."""
    x = features(2, 2, 5)
    separate = MultiHeadAttention(HEADS, HEAD_DIM, num_kv_heads=kv_heads, use_rotary=True)
    fused = separate.clone(fused_qkv=True)
    params = random_params(separate, x)
    causal = np.tril(np.ones((5, 5), bool))
    out_separate = separate.apply({"params": params}, x, None, causal[None, None])
    out_fused = fused.apply({"params": fuse(params, kv_heads)}, x, None, causal[None, None])
    np.testing.assert_allclose(out_fused, out_separate, atol=1e-6, rtol=0)
    expected = ref.multi_head_attention(
        REF_CFG, ref.to_float64(params), x.astype(np.float64), x.astype(np.float64),
        np.broadcast_to(causal, (2, 5, 5)), rotary_positions=np.broadcast_to(np.arange(5), (2, 5)),
    )  # fmt: skip
    np.testing.assert_allclose(out_separate, expected, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- decoding

LENGTH = 8
DECODE_MODES = {
    # name: (layer attributes, cache slots, new positions per call)
    "rotary_full_cache": (dict(num_kv_heads=2, use_rotary=True), LENGTH, [3, 1, 1, 2, 1]),
    "rotary_fused_full_cache": (
        dict(num_kv_heads=2, use_rotary=True, fused_qkv=True),
        LENGTH,
        [3, 1, 1, 2, 1],
    ),
    "rotary_ring_buffer": (dict(num_kv_heads=2, use_rotary=True, window=3), 3, [1, 2, 1, 3, 1]),
}


@pytest.mark.parametrize("mode", list(DECODE_MODES))
def test_cached_decoding_with_rotary_equals_the_float64_forward(mode):
    """decode=True, a prompt then a few positions per call (absolute ``positions_q``): every
    output equals the float64 reference's causal (windowed) forward pass over the whole
    sequence, keys and queries rotated at their own positions; so does decode=False."""
    attributes, slots, q_lens = DECODE_MODES[mode]
    layer = MultiHeadAttention(HEADS, HEAD_DIM, **attributes)
    x = features(3, 2, LENGTH)
    params = random_params(layer, x)
    window = attributes.get("window")
    at = np.arange(LENGTH)
    allowed = (at[None, :] <= at[:, None]) & (
        True if window is None else at[:, None] - at[None, :] <= window
    )
    expected = ref.multi_head_attention(
        REF_CFG, ref.to_float64(params), x.astype(np.float64), x.astype(np.float64),
        np.broadcast_to(allowed, (2, LENGTH, LENGTH)),
        rotary_positions=np.broadcast_to(at, (2, LENGTH)),
    )  # fmt: skip

    # The allocating call: LENGTH positions, or a ring of ``window`` slots.
    allocate = functools.partial(layer.init, decode=True)
    shapes = jax.eval_shape(allocate, jax.random.key(0), x)["cache"]
    assert shapes["cached_key"].shape == (2, 2, slots, HEAD_DIM)
    cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    # Jitted as a decoder runs it: one program per query length, not every op on its own.
    step = jax.jit(functools.partial(layer.apply, decode=True, mutable=["cache"]))
    outputs, start = [], 0
    for q_len in q_lens:
        positions = np.broadcast_to(np.arange(start, start + q_len), (2, q_len))
        out, state = step(
            {"params": params, "cache": cache}, x[:, start : start + q_len], positions_q=positions
        )
        cache, start = state["cache"], start + q_len
        outputs.append(out)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, atol=ATOL, rtol=0)
    uncached = layer.apply({"params": params}, x, None, allowed[None, None])
    np.testing.assert_allclose(uncached, expected, atol=ATOL, rtol=0)


def test_cross_attention_beams_read_their_sources_encoder_keys():
    """Beam search, cross-attention: 2 sources x 3 beams of queries against the cached encoder
    keys of the 2 sources (stored once per source); each beam's output is the float64
    reference's attention over its own source (padding hidden)."""
    beam = 3
    layer = MultiHeadAttention(HEADS, HEAD_DIM, cross_attention=True)
    encoded, queries = features(4, 2, 5), features(5, 2 * beam, 1)
    source_valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    params = random_params(layer, queries[:2], encoded)
    cache = layer.apply(
        {"params": params}, queries[:2, :0], encoded, decode=True, mutable=["cache"]
    )[1]["cache"]
    assert cache["cross_key"].shape == (2, HEADS, 5, HEAD_DIM)  # one row per source
    mask = source_valid[:, None, None, :]  # [batch, 1, 1, src_len]
    out, _ = layer.apply(
        {"params": params, "cache": cache}, queries, None, mask, decode=True, beam_size=beam,
        mutable=["cache"],
    )  # fmt: skip
    rows_source = np.arange(2 * beam) // beam
    expected = ref.multi_head_attention(
        REF_CFG, ref.to_float64(params), queries.astype(np.float64),
        encoded[rows_source].astype(np.float64), source_valid[rows_source][:, None, :],
    )  # fmt: skip
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)


def test_beam_search_in_place_attends_over_each_rows_history():
    """Beam search over a self-attention cache that never moves: row r's key at slot t lives in
    row ``source * beam + beam_ancestors[r, t]``. Both attention paths (the fast one, and the
    general one taken when the weights are collected) equal the float64 reference over the
    history gathered row by row; a ``beam_ancestors`` of the wrong shape is refused."""
    beam, slots, index = 2, 4, 3
    layer = MultiHeadAttention(HEADS, HEAD_DIM, num_kv_heads=2)
    x = features(6, 2 * beam, 1)  # 2 sources x 2 beams, one new position each
    params = random_params(layer, x)
    rng = np.random.default_rng(7)
    cached_key = rng.standard_normal((2 * beam, 2, slots, HEAD_DIM)).astype(np.float32)
    cached_value = rng.standard_normal((2 * beam, 2, slots, HEAD_DIM)).astype(np.float32)
    cache = {"cached_key": cached_key, "cached_value": cached_value}
    # Slots 0..2 from earlier steps, from either beam; slot 3 (this step) each row's own.
    ancestors = np.array([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1]], np.int32)
    positions = np.full((2 * beam, 1), index)

    def call(ancestors, mutable):
        return layer.apply(
            {"params": params, "cache": cache}, x, positions_q=positions, decode=True,
            beam_size=beam, beam_ancestors=jnp.asarray(ancestors), mutable=mutable,
        )[0]  # fmt: skip

    p = ref.to_float64(params)
    project = lambda name: np.einsum("bnd,dhk->bnhk", x, p[name]["kernel"]) + p[name]["bias"]  # noqa: E731
    query, new_key, new_value = project("query"), project("key"), project("value")
    keys = cached_key.transpose(0, 2, 1, 3).astype(np.float64)  # [rows, slots, kv_heads, d]
    values = cached_value.transpose(0, 2, 1, 3).astype(np.float64)
    keys[:, index], values[:, index] = new_key[:, 0], new_value[:, 0]
    rows = np.arange(2 * beam)
    owner = (rows // beam * beam)[:, None] + ancestors  # [rows, slots]: the row holding each
    history_k, history_v = keys[owner, np.arange(slots)], values[owner, np.arange(slots)]
    heads = ref.scaled_dot_product_attention(
        query, history_k, history_v, np.ones((2 * beam, 1, slots), bool)
    )
    expected = np.einsum("bnhk,hkd->bnd", heads, p["out"]["kernel"]) + p["out"]["bias"]

    np.testing.assert_allclose(call(ancestors, ["cache"]), expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        call(ancestors, ["cache", "intermediates"]), expected, atol=ATOL, rtol=0
    )
    with pytest.raises(ValueError, match="beam_ancestors must be"):
        call(ancestors[:, :3], ["cache"])


# ----------------------------------------------------------------------------- the written prefix


def test_prefix_widths_double_from_32_up_to_half_the_cache():
    assert kv_cache.prefix_widths(16) == (16,)
    assert kv_cache.prefix_widths(63) == (63,)
    assert kv_cache.prefix_widths(64) == (32, 64)
    assert kv_cache.prefix_widths(128) == (32, 64, 128)
    assert kv_cache.prefix_widths(511) == (32, 64, 128, 511)


@pytest.mark.parametrize("position", [5, 40, 100])
@pytest.mark.parametrize("path", ["one_row_each", "beams_in_place"])
def test_a_decoding_step_reads_only_the_written_prefix_of_a_long_cache(path, position):
    """A cache of 130 slots (prefixes of 32 and 64 slots, then the whole cache): a step at
    ``position`` equals the float64 reference over slots 0..position, although every slot
    past the prefix that holds the written ones is NaN (a step that read it would return NaN:
    0 x NaN in the value product). Without beams: each row its own cache row; with
    ``beam_size=2``: the in-place beam attention, slot t of row r held by row
    ``source * beam + ancestors[r, t]``."""
    slots = 130
    prefix = next(w for w in kv_cache.prefix_widths(slots) if w > position)
    beam = 2 if path == "beams_in_place" else 1
    layer = MultiHeadAttention(HEADS, HEAD_DIM, num_kv_heads=2)
    x = features(8, 2 * beam, 1)
    params = random_params(layer, x)
    rng = np.random.default_rng(9)
    cached = rng.standard_normal((2, 2 * beam, 2, slots, HEAD_DIM)).astype(np.float32)
    cached[:, :, :, prefix:] = np.nan  # never read
    cache = {"cached_key": cached[0], "cached_value": cached[1]}
    ancestors = rng.integers(0, beam, (2 * beam, slots)).astype(np.int32)
    ancestors[:, position] = np.arange(2 * beam) % beam  # this step's slot: each row's own
    extra = dict(beam_size=beam, beam_ancestors=jnp.asarray(ancestors)) if beam > 1 else {}
    # The position traced, as in a decoding loop (a constant one lets XLA slice the dots).
    out, _ = jax.jit(
        lambda p, c, x, at: layer.apply(
            {"params": p, "cache": c}, x, positions_q=at, decode=True, mutable=["cache"],
            **extra,
        )
    )(params, cache, x, jnp.full((2 * beam, 1), position))  # fmt: skip

    p = ref.to_float64(params)
    project = lambda name: np.einsum("bnd,dhk->bnhk", x, p[name]["kernel"]) + p[name]["bias"]  # noqa: E731
    query, new_key, new_value = project("query"), project("key"), project("value")
    keys = cached[0].transpose(0, 2, 1, 3).astype(np.float64)[:, : position + 1]
    values = cached[1].transpose(0, 2, 1, 3).astype(np.float64)[:, : position + 1]
    keys[:, position], values[:, position] = new_key[:, 0], new_value[:, 0]
    rows, held = np.arange(2 * beam), np.arange(position + 1)
    owner = (rows // beam * beam)[:, None] + ancestors[:, : position + 1]
    history_k, history_v = keys[owner, held], values[owner, held]
    heads = ref.scaled_dot_product_attention(
        query, history_k, history_v, np.ones((2 * beam, 1, position + 1), bool)
    )
    expected = np.einsum("bnhk,hkd->bnd", heads, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(np.asarray(out), expected, atol=ATOL, rtol=0)
