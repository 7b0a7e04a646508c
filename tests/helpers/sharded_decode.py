"""Decodes on 8 simulated devices; run by tests/decoding/test_generate.py in a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/sharded_decode.py OUT

Writes ``OUT/results.npz`` (tokens and scores per mesh and method, one device included, of
one model and of a two-model ensemble) and
``OUT/facts.json`` (compile counts, shardings, Translator outputs); the test compares them.
A tiny random EncoderDecoder with 4 heads and a vocabulary of 24, so that a tensor axis of 4
splits heads, MLP units and the vocabulary; 5 source rows, which neither 8 nor 2
data-parallel devices divide.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

from flaxformer_lite.core import sharding
from flaxformer_lite.decoding import generate as gen
from flaxformer_lite.inference.translator import SymbolVocabulary, Translator
from flaxformer_lite.models import DecoderOnly, EncoderDecoder
from flaxformer_lite.nn.config import TransformerConfig

CONFIG = TransformerConfig(
    vocab_size=24,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_len=16,
    tie_output_embedding=False,
)
SOURCES = [[5, 9, 7, 1], [12, 4, 6, 20, 8, 11, 1], [17, 1], [3, 3, 4, 1], [8, 10, 1]]
PROMPTS = [[5, 9, 7], [12, 4, 6], [17, 3, 8]]
MESHES = {"8x1x1": (8, 1, 1), "2x1x4": (2, 1, 4)}
METHODS = {"greedy": {}, "beam": dict(beam_size=4, alpha=0.6)}
MAX_LEN = 10
LONG_MAX_LEN = 70
SEED = 13
SYMBOLS = "abcdefghijklmnopqrst"  # ids 4 to 23


def init(model, *args, seed: int = SEED, scale: float = 8.0) -> dict:
    """Random parameters drawn with numpy as the layers' initialisers draw them (Xavier-uniform
    kernels, N(0, 1 / d_model) embeddings, zero biases, unit LayerNorm scales): a jitted
    ``model.init`` would compile for seconds. The output projection is scaled up so that
    top-1 logits stand clear of the rest (no near-ties for float rounding to flip)."""
    rng = np.random.default_rng(seed)
    abstract = nn.meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), *args)))

    def draw(path, leaf):
        name, shape = jax.tree_util.keystr(path), leaf.shape
        if name.endswith("['scale']") or name.endswith("['bias']"):
            return np.full(shape, float(name.endswith("['scale']")), leaf.dtype)
        if name.endswith("['embedding']"):
            return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(leaf.dtype)
        split = 2 if len(shape) == 3 and "['out']" in name else 1  # [heads, kv, embed]
        fan_in, fan_out = np.prod(shape[:split]), np.prod(shape[split:])
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape).astype(leaf.dtype)

    params = jax.tree_util.tree_map_with_path(draw, abstract["params"])
    params["decoder"]["logits"]["kernel"] *= scale
    return params


def main(out: Path) -> None:
    assert jax.device_count() == 8, jax.devices()
    one = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    meshes = {"one": one, **{k: sharding.make_mesh(v) for k, v in MESHES.items()}}
    tokens = np.ones((1, 4), np.int32)
    params = init(EncoderDecoder(CONFIG), tokens, tokens)
    inputs = np.zeros((len(SOURCES), 8), np.int32)
    for i, row in enumerate(SOURCES):
        inputs[i, : len(row)] = row

    results, facts = {}, {"out_specs": {}}
    for name, mesh in meshes.items():
        for method, options in METHODS.items():
            t, s = gen.generate(
                params, CONFIG, inputs, mesh=mesh, method=method, max_len=MAX_LEN, **options
            )
            results[f"{name}/{method}/tokens"] = np.asarray(t)
            results[f"{name}/{method}/scores"] = np.asarray(s)
            facts["out_specs"][f"{name}/{method}"] = repr(tuple(t.sharding.spec))
    facts["compiles"] = gen.generate_jit._cache_size()
    # Other sources of the same shape reuse the compiled call (one per padded shape).
    gen.generate(params, CONFIG, inputs[::-1].copy(), mesh=meshes["2x1x4"], max_len=MAX_LEN)
    facts["compiles_after_same_shape"] = gen.generate_jit._cache_size()
    placed = gen.place_params(params, EncoderDecoder, CONFIG, meshes["2x1x4"])
    query = placed["decoder"]["layers_0"]["self_attention"]["query"]["kernel"]
    facts["query_kernel_spec"] = list(query.sharding.spec)

    # continue_prompt: a DecoderOnly language model, 3 prompts on 2 x 4.
    lm = init(DecoderOnly(CONFIG), tokens)
    prompts = np.asarray(PROMPTS, np.int32)
    for name in ("one", "2x1x4"):
        t, _ = gen.continue_prompt(
            lm, CONFIG, prompts, mesh=meshes[name], method="greedy", max_len=6
        )
        results[f"{name}/lm/tokens"] = np.asarray(t)

    # A cache of 70 slots (positions up to 80): each step attends over the prefix holding the
    # slots written (kv_cache.over_written_prefix: a conditional per layer), heads over
    # "tensor" on 2 x 4; seed 7's rows run past both prefixes (32, 64) or end early.
    long = CONFIG.replace(max_len=80)
    long_params = init(EncoderDecoder(long), tokens, tokens, seed=7, scale=4.0)
    for name in ("one", "2x1x4"):
        for method, options in METHODS.items():
            t, s = gen.generate(
                long_params, long, inputs, mesh=meshes[name], method=method,
                max_len=LONG_MAX_LEN, **options,
            )  # fmt: skip
            results[f"{name}/{method}_long/tokens"] = np.asarray(t)
            results[f"{name}/{method}_long/scores"] = np.asarray(s)

    # An ensemble (the model and another, seed 29; each its own cache) on 2 x 4 against one
    # device: batch, heads and vocabulary split as for one model.
    other = init(EncoderDecoder(CONFIG), tokens, tokens, seed=29)
    for name in ("one", "2x1x4"):
        for method, options in METHODS.items():
            t, s = gen.generate(
                (params, other), CONFIG, inputs, mesh=meshes[name], method=method,
                max_len=MAX_LEN, **options,
            )  # fmt: skip
            results[f"{name}/ensemble_{method}/tokens"] = np.asarray(t)
            results[f"{name}/ensemble_{method}/scores"] = np.asarray(s)

    # The Translator (what the CLIs build) on its default mesh, every device: the sources as
    # text (id 3 is UNK, written "?"); the test compares with the one-device greedy tokens.
    vocab = SymbolVocabulary(SYMBOLS)
    translator = Translator(params, CONFIG, vocab)
    texts = ["".join("?" if i == 3 else SYMBOLS[i - 4] for i in row[:-1]) for row in SOURCES]
    assert [vocab.encode(t) + [1] for t in texts] == SOURCES
    facts["translator_devices"] = int(translator.mesh.devices.size)
    facts["translator"] = translator.translate(texts, method="greedy", max_len=MAX_LEN)
    facts["one_greedy_decoded"] = [
        vocab.decode(row) for row in results["one/greedy/tokens"].tolist()
    ]
    np.savez(out / "results.npz", **results)
    (out / "facts.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
