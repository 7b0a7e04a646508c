"""Beam search over a cache that never moves (``beam_cache``) against the reordering search.

The reference is the classic beam search, still reachable as ``generate(beam_cache="reorder")``:
one copy of every cache entry per hypothesis, gathered by parent beam after each step. The
in-place search must give the same tokens (and scores up to float rounding) on random models
of every attention flavour the decoder has: multi-head, grouped-query with rotary positions,
T5 relative position bias, a sliding-window ring buffer; encoder-decoder and decoder-only. The
output projection is scaled up so that the random models' beams diverge and reorder (checked:
a search that does not follow the parents gives other tokens).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding import generate as gen
from flaxformer_lite.decoding.beam import beam_search
from flaxformer_lite.models import BEAM_ANCESTORS, DecoderOnly, EncoderDecoder, reorder_beam_cache
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops import attention, beam_cache

from helpers import hlo as hlo_text
from helpers.random_weights import random_params

BASE = dict(
    vocab_size=24,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=2,
    dropout_rate=0.0,
    max_len=16,
    tie_output_embedding=False,
)
VARIANTS = {
    "mha": {},
    "gqa_rotary": dict(num_kv_heads=2, position="rotary"),
    "relative": dict(position="relative"),
    # A 3-position window in a cache of 10: a ring buffer of 3 slots.
    "window_ring": dict(attention_window=3, attention_window_layers="decoder"),
}
SOURCES = [[5, 9, 7, 1], [12, 4, 6, 20, 8, 11, 1], [17, 1]]
MAX_LEN = 10


def init_params(model, *args, seed: int = 2, scale: float = 4.0) -> dict:
    """``random_params`` of ``model`` with the output projection multiplied by ``scale``."""
    params = random_params(model, *args, seed=seed)
    params["decoder"]["logits"]["kernel"] = params["decoder"]["logits"]["kernel"] * scale
    return params


def padded(rows: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def encoder_decoder(variant: str) -> tuple[TransformerConfig, dict]:
    config = TransformerConfig(**BASE, **VARIANTS[variant])
    tokens = jnp.ones((1, 4), jnp.int32)
    return config, init_params(EncoderDecoder(config), tokens, tokens)


# ----------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_grouped_attention_equals_attention_over_each_rows_gathered_history(kv_heads):
    """Grouped keys, ``history_mask`` and ``group_bias`` around ``dot_product_attention``
    give, row by row, attention over the keys each row's ancestors point to."""
    batch, beam, slots, heads, d = 2, 3, 5, 4, 8
    rows = batch * beam
    rng = np.random.default_rng(0)
    query = rng.normal(size=(rows, 1, heads, d)).astype(np.float32)
    key = rng.normal(size=(rows, slots, kv_heads, d)).astype(np.float32)
    value = rng.normal(size=(rows, slots, kv_heads, d)).astype(np.float32)
    ancestors = rng.integers(0, beam, (rows, slots)).astype(np.int32)
    causal = (np.arange(slots) <= 3)[None, None, None]  # [1, 1, q, slots]: slot 4 not written
    bias = rng.normal(size=(1, heads, 1, slots)).astype(np.float32)

    @jax.jit  # one compiled program each, not every operation compiled eagerly
    def grouped_attention(query, key, value, ancestors, causal, bias):
        mask = beam_cache.history_mask(ancestors, beam, 1, causal)
        grouped = attention.dot_product_attention(
            beam_cache.group_queries(query, beam),
            beam_cache.group_keys(key, beam),
            beam_cache.group_keys(value, beam),
            mask,
            beam_cache.group_bias(bias, rows, beam, 1, slots),
        )
        return beam_cache.ungroup_queries(grouped, beam)

    got = grouped_attention(query, key, value, ancestors, causal, bias)

    source = (np.arange(rows) // beam * beam)[:, None] + ancestors  # [rows, slots]
    gathered_k = key[source, np.arange(slots)[None]]
    gathered_v = value[source, np.arange(slots)[None]]
    reference = jax.jit(attention.dot_product_attention)
    want = reference(query, gathered_k, gathered_v, causal, bias)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The ancestry matters: every row attending its own cache row gives something else.
    own = reference(query, key, value, causal, bias)
    assert not np.allclose(np.asarray(got), np.asarray(own), atol=1e-3)


def test_reorder_moves_histories_only():
    ancestors = jnp.array([[0, 1], [1, 1], [0, 0], [1, 0]], jnp.int32)  # batch 2, beam 2
    parents = jnp.array([1, 1, 2, 2], jnp.int32)
    np.testing.assert_array_equal(
        beam_cache.reorder(ancestors, parents), [[1, 1], [1, 1], [0, 0], [0, 0]]
    )
    cache = {"decoder": {BEAM_ANCESTORS: ancestors, "layers_0": {"cached_key": ancestors}}}
    out = reorder_beam_cache(cache, parents)
    np.testing.assert_array_equal(out["decoder"]["layers_0"]["cached_key"], ancestors)
    np.testing.assert_array_equal(out["decoder"][BEAM_ANCESTORS], [[1, 1], [1, 1], [0, 0], [0, 0]])
    with pytest.raises(ValueError, match="beam_ancestors"):
        reorder_beam_cache({"decoder": {"layers_0": {"cached_key": ancestors}}}, parents)


# ----------------------------------------------------------------------------- the cache


def test_cache_keeps_one_cross_entry_per_source_and_rows_per_hypothesis():
    config, params = encoder_decoder("mha")
    model = EncoderDecoder(config)

    def flat(cache):
        return {"/".join(k): v.shape for k, v in traverse_util.flatten_dict(cache).items()}

    in_place = flat(gen.init_cache(model, params, 3, MAX_LEN, 7, beam_size=4))
    reorder = flat(gen.init_cache(model, params, 12, MAX_LEN, 7))
    layer = "decoder/layers_0"
    # Heads first: [rows, kv_heads, length, head_dim].
    assert in_place[f"{layer}/cross_attention/cross_key"] == (3, 4, 7, 8)
    assert in_place[f"{layer}/cross_attention/cross_value"] == (3, 4, 7, 8)
    assert in_place[f"{layer}/self_attention/cached_key"] == (12, 4, MAX_LEN, 8)
    assert in_place[f"decoder/{BEAM_ANCESTORS}"] == (12, MAX_LEN)
    # The reordering search keeps a cross entry per hypothesis and no ancestry.
    assert reorder[f"{layer}/cross_attention/cross_key"] == (12, 4, 7, 8)
    assert f"decoder/{BEAM_ANCESTORS}" not in reorder


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("q_len", [1, 2])
def test_attend_beams_equals_attention_over_grouped_keys(kv_heads, q_len):
    """``attend_beams`` (each key beam a batch dimension, what the decoder runs) equals the
    reference path over ``group_keys`` with the same history mask and bias, including a query
    that may attend nothing (zeros)."""
    batch, beam, slots, heads, d = 2, 3, 5, 4, 8
    rows = batch * beam
    rng = np.random.default_rng(1)
    query = jnp.asarray(rng.normal(size=(rows, q_len, heads, d)), jnp.float32)
    key = jnp.asarray(rng.normal(size=(rows, slots, kv_heads, d)), jnp.float32)
    value = jnp.asarray(rng.normal(size=(rows, slots, kv_heads, d)), jnp.float32)
    ancestors = jnp.asarray(rng.integers(0, beam, (rows, slots)), jnp.int32)
    causal = rng.random((rows, 1, q_len, slots)) < 0.7
    causal[0, 0, 0] = False  # row 0's first query sees nothing
    mask = beam_cache.history_mask(ancestors, beam, q_len, jnp.asarray(causal))
    bias = beam_cache.group_bias(
        jnp.asarray(rng.normal(size=(1, heads, q_len, slots)), jnp.float32),
        rows,
        beam,
        q_len,
        slots,
    )
    grouped = beam_cache.group_queries(query, beam)
    want = jax.jit(attention.dot_product_attention)(
        grouped, beam_cache.group_keys(key, beam), beam_cache.group_keys(value, beam), mask, bias
    )
    got = jax.jit(beam_cache.attend_beams, static_argnums=5)(grouped, key, value, mask, bias, beam)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got)[0, 0])
    without_bias = beam_cache.attend_beams(grouped, key, value, mask, None, beam)
    assert np.abs(np.asarray(without_bias) - np.asarray(want)).max() > 1e-3  # the bias counts


# ----------------------------------------------------------------------------- generate


def run_both(config, params, inputs, **options):
    got = gen.generate(params, config, inputs, method="beam", beam_cache="in_place", **options)
    want = gen.generate(params, config, inputs, method="beam", beam_cache="reorder", **options)
    return [np.asarray(x) for x in (*got, *want)]


def ignoring_parents(config, params, inputs, beam, max_len):
    """The in-place search with ``beam_ancestors`` never reordered (each row reads only what
    it wrote itself): tokens `[batch, beam, max_len]`."""
    model = EncoderDecoder(config)
    rows = inputs.shape[0]

    @jax.jit
    def search(params, inputs):
        encoded = model.apply({"params": params}, inputs, method=model.encode)
        cache = gen.init_cache(model, params, rows, max_len, inputs.shape[1], beam_size=beam)
        prime = gen._decoder_call(model, params, encoded, inputs, beam_size=beam)
        _, cache = prime(jnp.zeros((rows * beam, 0), jnp.int32), cache)
        step = gen._decoder_call(model, params, None, inputs, beam_size=beam)
        return beam_search(
            step,
            cache,
            reorder_cache=lambda cache, parents: cache,
            batch_size=rows,
            beam_size=beam,
            max_len=max_len,
            bos_id=config.bos_id,
        )[0]

    return np.asarray(search(params, jnp.asarray(inputs)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_in_place_beam_search_equals_the_reordering_one(variant):
    """Same tokens and scores; and the search that does not follow the parents gives other
    tokens (the random model reorders its beams: the equality is not vacuous)."""
    config, params = encoder_decoder(variant)
    inputs = padded(SOURCES)  # padded sources of three lengths
    tokens, scores, want_tokens, want_scores = run_both(
        config, params, inputs, beam_size=4, max_len=MAX_LEN
    )
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    assert (ignoring_parents(config, params, inputs, 4, MAX_LEN)[:, 0] != want_tokens).any()


@pytest.mark.parametrize("batch", [1, 2])
def test_in_place_beam_search_other_batches_beams_and_rules(batch):
    config, params = encoder_decoder("gqa_rotary")
    options = dict(beam_size=3, max_len=8, alpha=1.0, beam_style="hf", forced_eos=True)
    tokens, scores, want_tokens, want_scores = run_both(
        config, params, padded(SOURCES[-batch:]), **options
    )
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["mha", "window_ring"])
def test_continue_prompt_in_place_equals_the_reordering_one(variant):
    """A decoder-only model: the prompt is prefilled once per row, then tiled to the beams
    (a 4-slot ring buffer is already full and wrapping when the search starts)."""
    overrides = dict(attention_window=4) if variant == "window_ring" else {}
    config = TransformerConfig(**{**BASE, "num_encoder_layers": 1}, **overrides)
    params = init_params(DecoderOnly(config), jnp.ones((1, 4), jnp.int32))
    prompts = np.array([[5, 9, 7, 3, 2], [12, 4, 6, 20, 8]], np.int32)
    options = dict(method="beam", beam_size=4, max_len=8)
    tokens, scores = gen.continue_prompt(params, config, prompts, beam_cache="in_place", **options)
    want, want_scores = gen.continue_prompt(
        params, config, prompts, beam_cache="reorder", **options
    )
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=1e-5, atol=1e-5)


def test_unknown_beam_cache_names_the_argument():
    config, params = encoder_decoder("mha")
    with pytest.raises(ValueError, match="beam_cache"):
        gen.generate(params, config, padded(SOURCES), method="beam", beam_cache="gather")


def test_attend_beams_takes_the_logits_scale():
    """``attend_beams(scale=1.0)`` (T5's unscaled logits) equals the reference path with the
    same scale."""
    batch, beam, slots, heads, d = 2, 2, 4, 2, 8
    rows = batch * beam
    rng = np.random.default_rng(2)
    query = jnp.asarray(rng.normal(size=(rows, 1, heads, d)), jnp.float32)
    key = jnp.asarray(rng.normal(size=(rows, slots, heads, d)), jnp.float32)
    value = jnp.asarray(rng.normal(size=(rows, slots, heads, d)), jnp.float32)
    ancestors = jnp.asarray(rng.integers(0, beam, (rows, slots)), jnp.int32)
    mask = beam_cache.history_mask(ancestors, beam, 1, None)
    grouped = beam_cache.group_queries(query, beam)
    keys, values = beam_cache.group_keys(key, beam), beam_cache.group_keys(value, beam)
    want = attention.dot_product_attention(grouped, keys, values, mask, scale=1.0)
    got = beam_cache.attend_beams(grouped, key, value, mask, None, beam, scale=1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    default = attention.dot_product_attention(grouped, keys, values, mask)
    assert np.abs(np.asarray(default) - np.asarray(want)).max() > 1e-3


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU backend's layouts")
@pytest.mark.parametrize("slots", [7, 70])
def test_the_beam_search_loop_writes_the_cache_and_copies_none_of_it(slots):
    """The compiled in-place beam search (the ``generate_jit`` program) touches each layer's
    self-attention keys and values once per step, with the in-place write of the step's
    entries: no other instruction of the loop body (outside fusion bodies) outputs an array of
    the cache's size. With the rows split into (batch, key beam) as batch dimensions of the
    attention dots, XLA's CPU backend copied every layer's keys and values at every step (a
    transpose for the dots: 18% of the beam step at opus-mt size, bench/profile_ops.py). A
    cache of 70 slots attends over its written prefix (``kv_cache.over_written_prefix``: a
    conditional per layer); with the cache passed to it in another layout than stored, XLA
    wrote each layer's cache twice, into two full copies, at every step."""
    config, params = encoder_decoder("mha")
    config = config.replace(max_len=max(config.max_len, slots))
    batch, beam = 3, 3  # cache [9 rows, 4 heads, slots, 8]: 2,016 elements for 7 slots
    cache_size = batch * beam * config.num_heads * slots * (config.d_model // config.num_heads)
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    program = gen.generate_jit.lower(
        params, config, padded(SOURCES[:batch]), mesh=mesh, method="beam", max_len=slots,
        beam_size=beam, alpha=0.0, beam_cache="in_place",
    ).compile().as_text()  # fmt: skip
    bodies = hlo_text.loop_bodies(program)
    in_loop = [
        i
        for i in hlo_text.unfused(program)
        if i.computation in bodies
        and int(np.prod(i.dims)) == cache_size
        and i.opcode not in hlo_text.NOT_A_COPY
    ]
    writes = [i for i in in_loop if "dynamic-update-slice" in i.name]
    assert len(writes) == 2 * config.num_decoder_layers, in_loop  # keys and values per layer
    assert [i.line for i in in_loop if i not in writes] == []
    # The prefix's conditionals (tuple-shaped, not in unfused()): one per layer, out of the
    # attention's `[batch, beam * q_len, heads, head_dim]`.
    prefixes = re.findall(r"= \(f32\[3,3,4,8\]\S*\) conditional\(", program)
    assert len(prefixes) == (config.num_decoder_layers if slots == 70 else 0), prefixes
