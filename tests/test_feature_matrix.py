"""Model options crossed with every path that consumes a model (issue 23).

Defects hide where two features meet (a scanned model fine-tuned, a MoE model padded, an int8
model saved for Hugging Face), while most tests exercise one feature at a time. This module
crosses them systematically:

* OPTIONS: ten model options (norm position, head sharing, positions, ``head_dim``,
  ``attention_window``, mixture of experts, ``scan_layers``, ``fused_qkv``, int8, bfloat16).
* CELLS: a pairwise covering array of their values, built by ``covering_array`` (a small
  deterministic greedy algorithm, AETG-style): every pair of values of two options occurs in
  at least one cell (``test_every_pair_of_option_values_is_in_a_cell`` checks it), except the
  pairs REFUSED_PAIRS refuses at ``TransformerConfig`` construction, each of which has its own
  refusal test.
* PATHS: what consumes a model, each checked against an independent reference:
    a   forward logits vs the float64 NumPy reference (tests/helpers/numpy_reference.py,
        extended here with a float64 mixture of experts); the training objective's gradient
        (``train.loss_sums``) vs a central difference of the float64 reference's loss
    b   cached greedy decoding (``generate``) vs an uncached recomputation of the whole prefix
        per step (tokens and log-probabilities)
    c   beam search with ``beam_cache="in_place"`` vs the classic reordering search
        (b and c at 8 new tokens and over the written prefix of a 70-slot cache)
    d   the serving export (``export.export_function``, serialized and read back) vs generate
    e   ``hf.save_pretrained`` -> ``transformers.MarianMTModel`` logits vs the float64
        reference (Marian-expressible cells), or one ValueError line naming the field
    f   ``init_from`` a workdir -> the fine-tuned model starts from every pretrained
        parameter bit for bit (scanned and unrolled, both ways)
    g   a checkpoint restored on other meshes (8 simulated CPU devices, a subprocess):
        bitwise, with the target sharding, same logits
    h   padding invariance: pads appended to sources and targets change neither the
        evaluation logits at real positions nor the training objective and gradient; the
        train step with gradient accumulation equals one big batch
    i   an ensemble of two models of the cell (``generate(params=(a, b))``): greedy decoding
        follows the argmax of the mean of the two uncached models' float64 probabilities,
        and its score is that mean's log-probability of its tokens
  Path a runs on every cell; the others on a subset of cells chosen greedily so that every
  option value still meets every path (``path_cells``; checked by
  ``test_every_option_value_meets_every_path``).

REFUSED (the table below, also in README.md) lists the (option, path) combinations that are
refused, where, and why; each refusal is asserted with its message.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import numpy_reference as ref

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the options

# option -> its values; the first value of each is the baseline (a Marian-expressible model).
OPTIONS: dict[str, tuple] = {
    "norm": ("post", "pre"),
    "heads": ("mha", "gqa", "mqa"),
    "position": ("sinusoidal", "learned", "rotary", "relative"),
    "head_dim": (None, 12),
    "window": (None, 2),
    "moe": (0, 4),
    "scan": (False, True),
    "fused": (False, True),
    "quant": (None, "int8"),
    "dtype": ("float32", "bfloat16"),
}

# Pairs of option values refused when the TransformerConfig is built: the generator keeps them
# out of the cells; test_refused_pairs_name_the_field checks each refusal.
REFUSED_PAIRS = {
    (("scan", True), ("quant", "int8")): (
        r"TransformerConfig.quantization='int8' needs scan_layers=False"
    ),
}

# (option value or "*", path) -> where it is refused and why. "*" = every cell on that path.
REFUSED = {
    ("quant=int8", "scan=True"): "TransformerConfig: int8 parameters come from "
    "quantize_params, which takes unrolled layers (generate/Translator unroll first)",
    ("quant=int8", "a:train, h:train, f"): "preflight (config.model.quantization): int8 is "
    "inference only; jax.grad cannot differentiate int8 kernels. Train in float, quantize "
    "when translating",
    ("norm=pre, heads=gqa|mqa, position!=sinusoidal, head_dim=12, fused=True", "e"): (
        "save_pretrained/config_to_hf: Marian has none of these (one line naming each field)"
    ),
    ("window=2, moe=4, quant=int8, layer_norm_epsilon!=1e-5", "e"): (
        "save_pretrained: Marian has no windowed attention, no experts, float weights only and "
        "LayerNorm eps 1e-5"
    ),
}

# The tiny model every cell starts from: Marian's arithmetic (swish, sin|cos halves, final
# logits bias, LayerNorm eps 1e-5) so that the baseline cell can be written for Hugging Face.
BASE = dict(
    vocab_size=24,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=2,
    max_len=16,
    dropout_rate=0.0,
    activation="silu",
    sinusoid_layout="halves",
    layer_norm_epsilon=1e-5,
    logits_bias=True,
    # T5 buckets, small: 8 buckets, max distance 7 (no distance on a bucket boundary).
    relative_num_buckets=8,
    relative_max_distance=7,
)


def config_fields(cell: dict) -> dict:
    """The TransformerConfig fields of a cell (option -> value)."""
    fields = dict(BASE)
    if cell["norm"] == "pre":
        fields["norm_position"] = "pre"
    fields["num_kv_heads"] = {"mha": None, "gqa": 2, "mqa": 1}[cell["heads"]]
    fields["position"] = cell["position"]
    fields["head_dim"] = cell["head_dim"]
    fields["attention_window"] = cell["window"]
    fields["num_experts"] = cell["moe"]
    fields["scan_layers"] = cell["scan"]
    fields["fused_qkv"] = cell["fused"]
    fields["quantization"] = cell["quant"]
    if cell["quant"] == "int8" and ONEDNN:
        # The tiny cells' matrices are below "auto"'s size rule: every path crosses oneDNN's
        # kernel explicitly where it loads (exact int32 products, so the same bounds).
        fields["int8_kernel"] = "onednn"
    fields["dtype"] = cell["dtype"]
    return fields


# ----------------------------------------------------------------------------- covering array


def _pairs_of(row: dict) -> set:
    items = sorted(row.items())
    return {((a, va), (b, vb)) for (a, va), (b, vb) in itertools.combinations(items, 2)}


def _all_pairs(options: dict) -> set:
    names = sorted(options)
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in options[a]
        for vb in options[b]
    }


def _refused(pair) -> bool:
    return pair in REFUSED_PAIRS or (pair[1], pair[0]) in REFUSED_PAIRS


def covering_array(options: dict, seeds: tuple[dict, ...] = ()) -> list[dict]:
    """Rows (option -> value) in which every pair of values of two options occurs, except the
    refused pairs, which occur in none. Deterministic greedy (AETG-like): each new row starts
    from the first uncovered pair, then fixes the other options one by one (in OPTIONS order)
    to the value that covers the most uncovered pairs with the options fixed so far (ties: the
    earlier value), never completing a refused pair. ``seeds`` are rows taken first."""
    names = list(options)
    todo = {p for p in _all_pairs(options) if not _refused(p)}
    rows: list[dict] = []
    for seed in seeds:
        rows.append(dict(seed))
        todo -= _pairs_of(seed)
    while todo:
        (a, va), (b, vb) = min(todo, key=lambda p: (names.index(p[0][0]), repr(p)))
        row = {a: va, b: vb}
        for name in names:
            if name in row:
                continue

            def gain(value, name=name, row=row, todo=todo):
                new = {((name, value), (k, v)) for k, v in row.items()}
                new = {tuple(sorted(p)) for p in new}
                if any(_refused(p) for p in new):
                    return -1
                return len(new & todo)

            row[name] = max(options[name], key=gain)  # max keeps the first of equal gains
        row = {name: row[name] for name in names}
        assert not any(_refused(p) for p in _pairs_of(row)), row
        rows.append(row)
        todo -= _pairs_of(row)
    return rows


BASELINE = {name: values[0] for name, values in OPTIONS.items()}
CELLS = covering_array(OPTIONS, seeds=(BASELINE,))

_SHORT = {
    "norm": lambda v: "pre",
    "heads": str,
    "position": str,
    "head_dim": lambda v: f"hd{v}",
    "window": lambda v: f"win{v}",
    "moe": lambda v: f"moe{v}",
    "scan": lambda v: "scan",
    "fused": lambda v: "fused",
    "quant": str,
    "dtype": lambda v: "bf16",
}


def cell_id(cell: dict) -> str:
    parts = [_SHORT[k](v) for k, v in cell.items() if v != BASELINE[k]]
    return "-".join(parts) or "baseline"


CELL_BY_ID = {cell_id(c): c for c in CELLS}
assert len(CELL_BY_ID) == len(CELLS)

# ----------------------------------------------------------------------------- paths per cell

PATHS = ("a", "b", "c", "d", "e", "f", "g", "h", "i")
EVERY_CELL = ("a",)  # the forward pass: one small compile per cell
# Paths that train (int8 is refused): the training halves of a and h, and the accumulation
# check (on the cells with experts and a dense control only: the two train steps it compiles
# are the module's dearest).
TRAINING = ("a-train", "h-train", "f")

# Why a cell cannot be a Marian model: option -> (its refused value or None = any but the
# baseline's, the TransformerConfig field the one-line refusal must name).
MARIAN_FIELDS = {
    "norm": ("pre", "norm_position"),
    "position": (None, "position"),
    "heads": (None, "num_kv_heads"),
    "head_dim": (12, "head_dim"),
    "fused": (True, "fused_qkv"),
    "window": (2, "attention_window"),
    "moe": (4, "num_experts"),
    "quant": ("int8", "quantization"),
}


def refusing_options(cell: dict, path: str) -> list[str]:
    """The options of ``cell`` for which ``path`` refuses it (see REFUSED)."""
    if path == "e":
        return [
            option
            for option, (value, _) in MARIAN_FIELDS.items()
            if cell[option] != BASELINE[option] and value in (None, cell[option])
        ]
    if path in TRAINING and cell["quant"] == "int8":
        return ["quant"]
    return []


def met_by(cell: dict, path: str) -> set:
    """The (option, value) pairs ``cell`` exercises on ``path``: all of them when the path
    runs it, only the refused ones when the path refuses it."""
    refusing = refusing_options(cell, path)
    if refusing:
        return {(o, cell[o]) for o in refusing}
    return set(cell.items())


def one_at_a_time() -> list[dict]:
    """The baseline with one option changed, for every non-baseline value."""
    return [dict(BASELINE, **{o: v}) for o, values in OPTIONS.items() for v in values[1:]]


def path_cells(path: str, cells: list[dict] = CELLS) -> list[dict]:
    """The cells a path runs on: every cell for the cheap paths; for the others, a greedy
    cover (the cell adding the most (option, value) pairs not yet met on that path, first of
    equals), from the baseline, so that every option value meets the path at least once, run
    where the path takes it and refused where it refuses it. Path e (few cells are Marian
    models) also takes each option's values one at a time from the baseline, so that every
    refusal is seen alone and every expressible value is run."""
    if path in EVERY_CELL:
        return list(cells)
    pool = list(cells) + (one_at_a_time() if path == "e" else [])
    chosen = [pool[0]]
    todo = {(k, v) for k, values in OPTIONS.items() for v in values} - met_by(pool[0], path)
    while todo:
        best = max(pool, key=lambda c: len(met_by(c, path) & todo))
        chosen.append(best)
        todo -= met_by(best, path)
    if path == "e":
        chosen += [c for c in one_at_a_time() if c not in chosen]
    return chosen


def cell_params(path: str) -> list:
    return [pytest.param(c, id=cell_id(c)) for c in path_cells(path)]


def test_every_pair_of_option_values_is_in_a_cell():
    covered = set().union(*(_pairs_of(c) for c in CELLS))
    for pair in _all_pairs(OPTIONS):
        assert (pair in covered) != _refused(pair), pair
    # The generator is deterministic and small: fewer cells than an option-by-option
    # product by far (4 x 3 x 2^8 = 3072), and no duplicates.
    assert len(CELLS) <= 16, len(CELLS)
    assert CELLS == covering_array(OPTIONS, seeds=(BASELINE,))


def test_covering_array_generator_covers_random_option_sets():
    """The generator itself, on option sets unlike OPTIONS: every pair occurs."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        opts = {f"o{i}": tuple(range(int(rng.integers(2, 5)))) for i in range(6)}
        rows = covering_array(opts)
        covered = set().union(*(_pairs_of(r) for r in rows))
        assert _all_pairs(opts) <= covered
        assert len(rows) < np.prod([len(v) for v in opts.values()])


def test_every_option_value_meets_every_path():
    for path in (*PATHS, *TRAINING[:-1]):
        met = set().union(*(met_by(c, path) for c in path_cells(path)))
        assert met == {(k, v) for k, values in OPTIONS.items() for v in values}, path


# ----------------------------------------------------------------------------- models

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flaxformer_lite import EncoderDecoder, TransformerConfig  # noqa: E402
from flaxformer_lite.ops import onednn_int8  # noqa: E402
from flaxformer_lite.ops.quantize import quantize_params  # noqa: E402

# int8 cells multiply with oneDNN's kernel where it loads (``config_fields``).
ONEDNN = onednn_int8.available() and jax.default_backend() == "cpu"

SRC_LENGTHS, TGT_LENGTHS = (9, 6, 3), (7, 4, 2)
SRC_LEN, TGT_LEN, EXTRA_PADS = 10, 8, 3
DECODE_LEN = 8
# A cache of 70 slots in a model of 80 positions: decoding attends over the written prefix
# (ops.kv_cache.over_written_prefix: a conditional per layer, 32 slots, 64, then all 70).
LONG_DECODE_LEN = 70


def decode_config(cell: dict, decode_len: int) -> TransformerConfig:
    cfg = config_of(cell)
    return cfg if decode_len == DECODE_LEN else cfg.replace(max_len=LONG_DECODE_LEN + 10)


LOGITS_ATOL = 1e-4  # float32 model vs float64 reference (test_reference: 1e-5 on 2+2 dense)
BF16_U = 2.0**-8


def config_of(cell: dict) -> TransformerConfig:
    return TransformerConfig(**config_fields(cell))


def float_config(cfg: TransformerConfig) -> TransformerConfig:
    return cfg.replace(quantization=None)


def padded_tokens(seed: int, lengths, length: int, vocab: int, pad: int = 0) -> np.ndarray:
    """int32 `[rows, length]`: ids in [4, vocab) (no special id), then ``pad``."""
    t = np.random.default_rng(seed).integers(4, vocab, size=(len(lengths), length))
    t = t.astype(np.int32)
    for row, n in enumerate(lengths):
        t[row, n:] = pad
    return t


SRC = padded_tokens(0, SRC_LENGTHS, SRC_LEN, BASE["vocab_size"])
TGT = padded_tokens(1, TGT_LENGTHS, TGT_LEN, BASE["vocab_size"])


@functools.cache
def float_params(cfg: TransformerConfig, seed: int = 1):
    """float32 NumPy parameters of ``cfg``'s model (float, scanned as the config says), drawn
    away from the initialisation as tests/models/test_reference.py draws them: biases non-zero, norm
    scales 1 +- 0.1, kernels N(0, 1/d_model); router kernels N(0, 1)-ish so routing depends on
    the token. Shapes come from ``jax.eval_shape``: nothing is compiled. Another ``seed``:
    another model of the same config (path i's second ensemble member)."""
    model = EncoderDecoder(float_config(cfg))
    t = jnp.ones((1, 4), jnp.int32)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), t, t)["params"])
    rng = np.random.default_rng(seed)
    std = cfg.d_model**-0.5

    def draw(path, leaf):
        name = path[-1].key
        if name == "scale":
            x = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif "bias" in name:
            x = 0.1 * rng.standard_normal(leaf.shape)
        elif name == "router" and cfg.dtype == "bfloat16":
            # bfloat16 routing is discontinuous in rounding: a near tie between the k-th and
            # the next expert may legitimately go either way, far beyond any rounding bound.
            # A zero router ties every expert exactly in any precision: experts 0 .. k-1,
            # gates 1/k, as the reference's stable sort picks them.
            x = np.zeros(leaf.shape)
        elif name == "router":
            x = 1.5 * std * rng.standard_normal(leaf.shape)
        else:
            x = std * rng.standard_normal(leaf.shape)
        return x.astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.cache
def model_params(cfg: TransformerConfig, seed: int = 1):
    """The parameters ``cfg``'s model runs on: the float ones, or ``quantize_params`` of them."""
    params = float_params(cfg, seed)
    if cfg.quantization is None:
        return params
    return quantize_params(params, float_config(cfg))


# ----------------------------------------------------------------------------- reference


def _moe_float64(cfg, p, x):
    """float64 top-k mixture (no capacity: evaluation routing): softmax router, the k most
    probable experts, gates renormalised over them (k > 1), sum of expert FFNs."""
    logits = x @ p["router"]
    probs = ref.softmax(logits)
    act = {"silu": ref.silu, "relu": lambda z: np.maximum(z, 0.0)}[cfg.activation]
    out = np.zeros_like(x)
    k = cfg.num_experts_per_token
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            top = np.argsort(-probs[b, t], kind="stable")[:k]
            w = probs[b, t, top] / (probs[b, t, top].sum() if k > 1 else 1.0)
            for e, we in zip(top, w, strict=True):
                h = act(x[b, t] @ p["wi"][e] + p["wi_bias"][e])
                out[b, t] += we * (h @ p["wo"][e] + p["wo_bias"][e])
    return out


def reference_logits(cfg: TransformerConfig, params, src, tgt) -> np.ndarray:
    """float64 logits `[b, t, vocab]` of numpy_reference, its feed-forward extended with the
    mixture of experts (layers with ``moe`` parameters)."""
    plain = ref.feed_forward

    def feed_forward(c, p, h):
        return _moe_float64(c, p["moe"], h) if "moe" in p else plain(c, p, h)

    def relabel(tree):  # a MoE layer's block is "moe" where the reference reads "mlp"
        if isinstance(tree, dict):
            out = {k: relabel(v) for k, v in tree.items()}
            if "moe" in out and "mlp" not in out:
                out["mlp"] = {"moe": out["moe"]}
            return out
        return tree

    ref.feed_forward = feed_forward
    try:
        return ref.encoder_decoder_logits(cfg, relabel(ref.to_float64(params)), src, tgt)
    finally:
        ref.feed_forward = plain


def reference_loss(cfg, params, src, tgt) -> float:
    """Sum over real target positions of -log p(target), float64."""
    logits = reference_logits(cfg, params, src, tgt)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, tgt[..., None].astype(np.int64), -1)[..., 0]
    return float(-(picked * (tgt != 0)).sum())


@functools.cache
def jitted_apply(cfg: TransformerConfig):
    return jax.jit(EncoderDecoder(cfg).apply)


def int8_bound(cfg: TransformerConfig) -> float:
    """Relative bound of the int8 model's logits error (tests/ops/test_quantize.py's analysis):
    each quantized matmul errs by at most 1/254 + 1/254 of |x|_1 max|w| (0.79%), and to first
    order the relative errors of the matmuls in sequence add: per encoder layer 4 (self q/k/v,
    out, wi, wo), per decoder layer 7 (self q/k/v, out, cross q, cross k/v, out, wi, wo),
    the logits 1; mixture-of-experts blocks stay float (2 fewer per layer)."""
    moe = 2 if cfg.num_experts else 0
    n = cfg.num_encoder_layers * (4 - moe) + cfg.num_decoder_layers * (7 - moe) + 1
    return n * 0.0079


def assert_close_to_reference(cfg, got: np.ndarray, want: np.ndarray, real: np.ndarray):
    got, want = np.asarray(got, np.float64)[real], want[real]
    error = got - want
    scale = float(np.sqrt(np.mean(want**2)))
    assert scale > 0.3, scale  # logits of size O(1), not near zero
    if cfg.quantization == "int8":
        assert np.abs(error).max() <= int8_bound(cfg) * np.abs(want).max()
        assert np.abs(error).max() > 0  # the int8 path ran
    elif cfg.dtype == "bfloat16":
        # tests/models/test_reference.py's bfloat16 bound (RMS 8u, max 32u of the logits' RMS).
        assert float(np.sqrt(np.mean(error**2))) < 8 * BF16_U * scale
        assert float(np.abs(error).max()) < 32 * BF16_U * scale
        assert float(np.abs(error).max()) > 0.5 * BF16_U * scale  # bfloat16 really ran
    else:
        assert np.abs(error).max() < LOGITS_ATOL, np.abs(error).max()


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("pair", list(REFUSED_PAIRS), ids=lambda p: f"{p[0]}-{p[1]}")
def test_refused_pairs_name_the_field(pair):
    cell = dict(BASELINE, **dict(pair))
    with pytest.raises(ValueError, match=REFUSED_PAIRS[pair]) as e:
        config_of(cell)
    assert "\n" not in str(e.value)


def train_refusal(cfg: TransformerConfig):
    """The preflight refusal of training ``cfg`` (an int8 model): a ConfigError naming
    config.model.quantization, one line."""
    from flaxformer_lite.training import preflight

    spec = __import__("importlib.util").util.spec_from_file_location(
        "default_config", ROOT / "configs" / "default.py"
    )
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    fields = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in ("vocab_size", "target_vocab_size", "pad_id", "bos_id", "eos_id", "unk_id")
    }
    fields.pop("max_len")
    c.synthetic.update(min_len=2, max_len=4, num_eval=16)
    c.model = fields
    with pytest.raises(ValueError, match=r"config\.model\.quantization") as e:
        preflight.check_config(c, device_count=1)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- a: forward


@pytest.mark.parametrize("cell", cell_params("a"))
def test_a_forward_matches_float64_reference(cell):
    cfg = config_of(cell)
    logits = jitted_apply(cfg)({"params": model_params(cfg)}, SRC, TGT)
    want = reference_logits(cfg, float_params(cfg), SRC, TGT)
    assert logits.shape == want.shape == (3, TGT_LEN, cfg.vocab_size)
    assert_close_to_reference(cfg, np.asarray(logits), want, TGT != 0)


@functools.cache
def loss_grad(cfg: TransformerConfig, deterministic: bool, key: str = "objective"):
    """jit: (params, batch) -> ((loss, sums), gradient of the loss) through train.loss_sums,
    the training loss (label smoothing 0: the objective is the summed cross-entropy, plus the
    weighted auxiliary losses of a mixture of experts; ``key="nll"``: the cross-entropy
    alone). One compile per (config, mode, key), shared by the paths that train."""
    import train

    model = EncoderDecoder(cfg)

    def loss(params, batch):
        objective, sums = train.loss_sums(
            model,
            "translation",
            0.0,
            params,
            batch,
            deterministic=deterministic,
            rng=jax.random.key(0),
        )
        return (objective if key == "objective" else sums[key]), sums

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def training_mode(cfg: TransformerConfig) -> bool:
    """``deterministic`` for the padding test: a train step's (False) where it differs from
    evaluation (expert capacity); with dropout 0 a dense model computes the same either way,
    so it shares the compile of the gradient test."""
    return not cfg.num_experts


@pytest.mark.parametrize("cell", cell_params("a-train"))
def test_a_training_gradient_matches_float64_central_difference(cell):
    """The directional derivative of the training loss (``train.loss_sums``' nll, summed over
    real targets) along a random direction v: <grad, v> from JAX against a central difference
    (L(p + eps v) - L(p - eps v)) / 2 eps of the float64 reference's loss."""
    cfg = config_of(cell)
    if cfg.quantization == "int8":
        return train_refusal(cfg)
    params = float_params(cfg)
    key = "nll" if cfg.num_experts else "objective"  # the reference has no auxiliary loss
    (loss, _), grads = loss_grad(cfg, True, key)(params, {"inputs": SRC, "targets": TGT})
    rng = np.random.default_rng(5)
    v = jax.tree_util.tree_map(lambda x: rng.standard_normal(x.shape) * 0.1, params)
    if cfg.num_experts and cfg.dtype == "bfloat16":  # the zero router's exact tie must hold
        v = jax.tree_util.tree_map_with_path(lambda path, d: d * (path[-1].key != "router"), v)
    eps = 1e-4
    shifted = [
        jax.tree_util.tree_map(lambda p, d, s=s: p.astype(np.float64) + s * eps * d, params, v)
        for s in (1.0, -1.0)
    ]
    plus, minus = (reference_loss(cfg, p, SRC, TGT) for p in shifted)
    want = (plus - minus) / (2 * eps)
    got = sum(
        float(np.sum(np.asarray(g, np.float64) * d))
        for g, d in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(v), strict=True)
    )
    assert abs(want) > 1.0, want  # a direction the loss really changes along
    assert abs(float(loss) - reference_loss(cfg, params, SRC, TGT)) < (
        0.05 if cfg.dtype == "bfloat16" else 1e-3
    )
    # float32: rounding of ~1e-6 relative per op; bfloat16 (u = 2^-8) gradients: a few u.
    tol = 8 * BF16_U if cfg.dtype == "bfloat16" else 1e-3
    assert abs(got - want) <= tol * abs(want), (got, want)


# ----------------------------------------------------------------------------- b: cached


@functools.cache
def full_logits_fn(cfg: TransformerConfig):
    model = EncoderDecoder(cfg)
    return jax.jit(
        lambda params, x, y: model.apply(
            {"params": params}, x, y, method=lambda m, x, y: m.decode(m.encode(x), x, y)
        )
    )


def uncached_greedy(cfg, params, src, steps: int):
    """Greedy decoding recomputing encoder and decoder over the whole prefix at each step
    (no cache): tokens `[b, steps]` (EOS then PAD), log-prob sums `[b]`, the smallest
    top-1 / top-2 logit margin met."""
    from flaxformer_lite.models import unrolled

    params, cfg = unrolled(params, cfg)
    full_logits = full_logits_fn(cfg)  # one compiled program for every step
    return naive_greedy(cfg, lambda dec_in: full_logits(params, src, dec_in), src.shape[0], steps)


def naive_greedy(cfg, next_scores, rows: int, steps: int):
    """Greedy search that recomputes every step from the whole prefix: ``next_scores(dec_in)``
    gives `[rows, steps, vocab]` scores (logits, or normalised log-probabilities) of the
    padded decoder input `[rows, steps]` (BOS, then the tokens so far); the argmax of
    position t is token t. Tokens `[rows, steps]` (EOS then PAD), sums `[rows]` of the
    chosen tokens' log-softmax, the smallest top-1 / top-2 margin of the scores met."""
    dec_in = np.full((rows, steps), cfg.pad_id, np.int32)
    dec_in[:, 0] = cfg.bos_id
    tokens = np.full((rows, steps), cfg.pad_id, np.int32)
    scores = np.zeros(rows)
    done = np.zeros(rows, bool)
    margin = np.inf
    for t in range(steps):
        logits = np.asarray(next_scores(dec_in), np.float64)[:, t]
        top2 = np.sort(logits, -1)[:, -2:]
        margin = min(margin, float((top2[:, 1] - top2[:, 0])[~done].min()))
        logp = log_softmax64(logits)
        nxt = logits.argmax(-1)
        scores += np.where(done, 0.0, logp[np.arange(rows), nxt])
        nxt = np.where(done, cfg.pad_id, nxt).astype(np.int32)
        tokens[:, t] = nxt
        done |= nxt == cfg.eos_id
        if done.all():
            break
        if t + 1 < steps:
            dec_in[:, t + 1] = nxt
    return tokens, scores, margin


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def decode_tolerance(cfg) -> float:
    """Cached and uncached runs differ by float rounding: a few ulps in float32; in bfloat16
    each is within 32u of the logits' RMS (tests/models/test_reference.py's bound), so two runs
    within twice that."""
    return 64 * BF16_U if cfg.dtype == "bfloat16" else 1e-4


@pytest.mark.parametrize("decode_len", [DECODE_LEN, LONG_DECODE_LEN])
@pytest.mark.parametrize("cell", cell_params("b"))
def test_b_cached_greedy_equals_uncached(cell, decode_len):
    """Cached greedy decoding (``generate``) against the uncached model: every token it
    picks is the uncached model's argmax given the same prefix (within the rounding bound in
    bfloat16: no other token more than ``decode_tolerance`` above it), and its score is the
    uncached log-probability of its tokens. In float32, also the tokens of an uncached greedy
    search, run independently. ``LONG_DECODE_LEN``: over the written prefix of a 70-slot
    cache."""
    from flaxformer_lite.decoding.generate import generate
    from flaxformer_lite.models import unrolled

    cfg = decode_config(cell, decode_len)
    params = model_params(cfg)
    tokens, scores = generate(params, cfg, SRC, method="greedy", max_len=decode_len)
    tokens = np.asarray(tokens)
    uparams, ucfg = unrolled(params, cfg)
    dec_in = np.concatenate([np.full((3, 1), cfg.bos_id, np.int32), tokens[:, :-1]], axis=1)
    logits = np.asarray(full_logits_fn(ucfg)(uparams, SRC, dec_in), np.float64)
    scale = float(np.sqrt(np.mean(logits**2)))
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    tol = decode_tolerance(cfg) * scale
    steps = 0
    for row in range(3):
        live = np.cumsum(tokens[row] == cfg.eos_id) - (tokens[row] == cfg.eos_id) == 0
        chosen = logits[row, live, tokens[row, live]]
        assert np.all(chosen >= logits[row, live].max(-1) - tol), (row, tokens[row])
        want = logp[row, live, tokens[row, live]].sum()
        # Each step's log-probability within 2 x the logit bound (log-softmax is 2-Lipschitz
        # in the max norm).
        assert abs(float(scores[row]) - want) <= 2 * tol * live.sum(), (row, scores[row], want)
        steps += live.sum()
    assert steps >= 6  # rows really decoded
    if cfg.dtype == "float32":
        want, want_scores, margin = uncached_greedy(cfg, params, SRC, decode_len)
        assert margin > 10 * tol, f"top-2 margin {margin}: pick another seed"
        np.testing.assert_array_equal(tokens, want)
        np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=0, atol=tol * decode_len)


# ----------------------------------------------------------------------------- c: beams


@pytest.mark.parametrize("decode_len", [DECODE_LEN, LONG_DECODE_LEN])
@pytest.mark.parametrize("cell", cell_params("c"))
def test_c_beam_in_place_equals_reordering_beam(cell, decode_len):
    from flaxformer_lite.decoding.generate import generate

    cfg = decode_config(cell, decode_len)
    params = model_params(cfg)
    runs = {
        how: generate(
            params, cfg, SRC, method="beam", beam_size=3, max_len=decode_len, beam_cache=how
        )
        for how in ("reorder", "in_place")
    }
    (t_ref, s_ref), (t_in, s_in) = runs["reorder"], runs["in_place"]
    np.testing.assert_array_equal(np.asarray(t_in), np.asarray(t_ref))
    # The same search over differently laid out attention: float rounding apart (bfloat16:
    # a few of its units, u = 2^-8, relative).
    rtol, atol = (8 * BF16_U, 0.0) if cfg.dtype == "bfloat16" else (0.0, 1e-3)
    np.testing.assert_allclose(np.asarray(s_in), np.asarray(s_ref), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- d: export


@pytest.mark.parametrize("cell", cell_params("d"))
def test_d_serving_export_decodes_as_generate(cell):
    """``export_function`` serialized and deserialized (what runtime.py loads), called with
    the same parameters, against ``generate``: the same tokens and scores."""
    from flaxformer_lite.decoding.generate import generate
    from flaxformer_lite.inference.export import export_function
    from flaxformer_lite.models import unrolled

    cfg = config_of(cell)
    params, ucfg = unrolled(model_params(cfg), cfg)  # export takes unrolled parameters
    params = jax.tree_util.tree_map(np.asarray, params)
    method = "beam" if cell["position"] in ("rotary", "relative") else "greedy"
    exported = export_function(params, ucfg, method=method, beam_size=3, max_len=DECODE_LEN)
    loaded = jax.export.deserialize(exported.serialize())
    limits = np.full((SRC.shape[0],), DECODE_LEN, np.int32)
    tokens, scores = loaded.call(params, SRC, limits)
    want, want_scores = generate(
        model_params(cfg), cfg, SRC, method=method, beam_size=3, max_len=DECODE_LEN
    )  # the compile of path b or c
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- e: HF Marian


def e_params():
    out = []
    for c in path_cells("e"):
        only = c in one_at_a_time() and c not in CELLS
        out.append(pytest.param(c, id=("only-" if only else "") + cell_id(c)))
    return out


def hf_logits(folder: Path, src, tgt, bos: int) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.MarianMTModel.from_pretrained(folder).eval()
    dec_in = np.concatenate([np.full((src.shape[0], 1), bos), tgt[:, :-1]], axis=1)
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(src.astype(np.int64)),
            attention_mask=torch.from_numpy(src != 0),
            decoder_input_ids=torch.from_numpy(dec_in.astype(np.int64)),
        ).logits.numpy()


@pytest.mark.parametrize("cell", e_params())
def test_e_save_pretrained_is_read_by_marian_mt_model_or_refused(cell, tmp_path):
    from flaxformer_lite.interop import hf

    cfg = config_of(cell)
    folder = tmp_path / "hf"
    refusals = [MARIAN_FIELDS[o][1] for o in refusing_options(cell, "e")]
    if refusals:
        with pytest.raises(ValueError) as e:
            hf.save_pretrained(str(folder), cfg, model_params(cfg))
        message = str(e.value)
        assert "\n" not in message
        for field in refusals:
            assert field in message, (field, message)
        assert not folder.exists()  # refused before anything is written
        return
    hf.save_pretrained(str(folder), cfg, model_params(cfg))
    want = reference_logits(cfg, float_params(cfg), SRC, TGT)
    got = hf_logits(folder, SRC, TGT, cfg.bos_id)
    assert_close_to_reference(float_config(cfg).replace(dtype="float32"), got, want, TGT != 0)


@pytest.mark.parametrize(
    "shared",
    [
        pytest.param(True, id="shared"),
        pytest.param(False, id="separate"),
    ],
)
def test_e_untied_output_projection_round_trips_through_marian(shared, tmp_path):
    """tie_word_embeddings=False (our tie_output_embedding=False), with a shared vocabulary
    or separate ones: the saved folder's MarianMTModel logits, and the model load_pretrained
    reads back from it, both against the float64 reference."""
    from flaxformer_lite.interop import hf

    cfg = config_of(BASELINE).replace(tie_output_embedding=False)
    if not shared:
        cfg = cfg.replace(share_embeddings=False, target_vocab_size=20)
    params = float_params(cfg)
    folder = tmp_path / "hf"
    hf.save_pretrained(str(folder), cfg, params)
    tgt = np.where(TGT < 20, TGT, 5).astype(np.int32)
    want = reference_logits(cfg, params, SRC, tgt)
    assert_close_to_reference(cfg, hf_logits(folder, SRC, tgt, cfg.bos_id), want, tgt != 0)
    loaded_cfg, loaded, _ = hf.load_pretrained(str(folder))
    assert not loaded_cfg.tie_output_embedding
    got = np.asarray(jitted_apply(loaded_cfg)({"params": loaded}, SRC, tgt))
    assert_close_to_reference(cfg, got, want, tgt != 0)


def test_e_layer_norm_epsilon_other_than_marian_is_refused(tmp_path):
    from flaxformer_lite.interop import hf

    cfg = config_of(BASELINE).replace(layer_norm_epsilon=1e-6)
    with pytest.raises(ValueError, match="layer_norm_epsilon"):
        hf.save_pretrained(str(tmp_path / "hf"), cfg, float_params(config_of(BASELINE)))


# ----------------------------------------------------------------------------- f: init_from


def write_workdir(folder: Path, cfg: TransformerConfig, params) -> None:
    """A train.py workdir as init_from reads it: model_config.json and one checkpoint whose
    state holds the parameters."""
    from flaxformer_lite.core.checkpoints import Checkpointer

    folder.mkdir(parents=True)
    (folder / "model_config.json").write_text(cfg.to_json())
    ckpt = Checkpointer(str(folder / "checkpoints"), async_save=False)
    ckpt.save(7, {"params": params}, {"train": {}}, force=True)
    ckpt.close()


def stacked(params, cfg: TransformerConfig):
    """Unrolled ``layers_i`` -> one ``layers`` subtree with leaves stacked on axis 0 (the
    scan_layers layout), written here independently of models.py."""
    out = {}
    for name, sub in params.items():
        if isinstance(sub, dict) and "layers_0" in sub:
            n = sum(k.startswith("layers_") for k in sub)
            rest = {k: v for k, v in sub.items() if not k.startswith("layers_")}
            rows = [sub[f"layers_{i}"] for i in range(n)]
            rest["layers"] = jax.tree_util.tree_map(lambda *x: np.stack(x), *rows)
            out[name] = rest
        elif isinstance(sub, dict):
            out[name] = stacked(sub, cfg)
        else:
            out[name] = sub
    return out


def f_params():
    out = []
    for c in path_cells("f"):
        for target_scan in (False, True):
            direction = (
                f"{'scan' if c['scan'] else 'unrolled'}->{'scan' if target_scan else 'unrolled'}"
            )
            out.append(pytest.param(c, target_scan, id=f"{cell_id(c)}-{direction}"))
    return out


@pytest.fixture(scope="module")
def pretrained_workdir(tmp_path_factory):
    """cell -> its workdir (written once per cell, read by both fine-tuning directions)."""
    made: dict[str, Path] = {}

    def get(cell: dict) -> Path:
        cid = cell_id(cell)
        if cid not in made:
            cfg = config_of(cell)
            made[cid] = tmp_path_factory.mktemp("pretrained") / cid
            write_workdir(made[cid], cfg, float_params(cfg))
        return made[cid]

    return get


@pytest.mark.parametrize("cell,target_scan", f_params())
def test_f_init_from_workdir_restores_every_parameter_bitwise(
    cell, target_scan, pretrained_workdir
):
    """What train.py does with --config.init_from=WORKDIR (model_fields, init, restore_into)
    gives the fine-tuned model every pretrained parameter bit for bit, whether the pretrained
    run and the fine-tuning run scan their layers or not."""
    from flaxformer_lite.interop import init_from
    from flaxformer_lite.models import unstack_layers

    cfg = config_of(cell)
    if cfg.quantization == "int8":
        return train_refusal(cfg)
    params = float_params(cfg)
    source = pretrained_workdir(cell)
    data = dict(vocab_size=cfg.vocab_size, target_vocab_size=None)
    fine = init_from.model_fields(str(source), {"scan_layers": target_scan}, data)
    assert fine.scan_layers == target_scan
    model = EncoderDecoder(fine)
    t = jnp.ones((1, 4), jnp.int32)
    # restore_into reads only the shapes and dtypes of the fresh parameters (and returns a
    # leaf it does not restore as it is): abstract ones serve, nothing is compiled.
    fresh = jax.eval_shape(model.init, jax.random.key(3), t, t)["params"]
    restored, summary = init_from.restore_into(fresh, init_from.pretrained_params(str(source)))
    restored = nn.meta.unbox(restored)
    unrolled_params = (
        jax.tree_util.tree_map(np.asarray, unstack_layers(params)) if cfg.scan_layers else params
    )
    want = stacked(unrolled_params, fine) if target_scan else unrolled_params
    n = len(jax.tree_util.tree_leaves(want))
    assert summary.startswith(f"{n} restored, 0 partially restored, 0 newly initialised, 0 dropped")
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    flat_got = dict(jax.tree_util.tree_leaves_with_path(restored))
    assert set(flat_got) == set(flat_want)
    for path, w in flat_want.items():
        np.testing.assert_array_equal(np.asarray(flat_got[path]), w, err_msg=str(path))


# ----------------------------------------------------------------------------- h: padding


def with_extra_pads(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x, np.zeros((x.shape[0], EXTRA_PADS), x.dtype)], axis=1)


def padding_tolerance(cfg) -> float:
    if cfg.dtype == "bfloat16":
        return 4 * BF16_U
    return 1e-5 if cfg.quantization is None else 1e-4


@pytest.mark.parametrize("cell", cell_params("h"))
def test_h_evaluation_logits_ignore_appended_padding(cell):
    cfg = config_of(cell)
    apply = jitted_apply(cfg)
    params = model_params(cfg)
    short = np.asarray(apply({"params": params}, SRC, TGT), np.float64)
    long = np.asarray(apply({"params": params}, with_extra_pads(SRC), with_extra_pads(TGT)))
    real = TGT != 0
    scale = np.abs(short[real]).max()
    err = np.abs(long[:, :TGT_LEN][real] - short[real]).max()
    assert err <= padding_tolerance(cfg) * scale, err


def h_train_params():
    out = []
    for c in path_cells("h-train"):
        out.append(pytest.param(c, id=cell_id(c)))
    return out


@pytest.mark.parametrize("cell", h_train_params())
def test_h_training_objective_and_gradient_ignore_appended_padding(cell):
    cfg = config_of(cell)
    if cfg.quantization == "int8":
        return train_refusal(cfg)
    params = float_params(cfg)
    fn = loss_grad(cfg, training_mode(cfg))
    (obj, sums), grads = fn(params, {"inputs": SRC, "targets": TGT})
    padded = {"inputs": with_extra_pads(SRC), "targets": with_extra_pads(TGT)}
    (obj_p, sums_p), grads_p = fn(params, padded)
    tol = 4 * BF16_U if cfg.dtype == "bfloat16" else 1e-5
    assert float(sums_p["count"]) == float(sums["count"]) == sum(TGT_LENGTHS)
    assert abs(float(obj_p) - float(obj)) <= tol * abs(float(obj))
    leaves = [np.asarray(g, np.float64) for g in jax.tree_util.tree_leaves(grads)]
    scale = max(np.abs(g).max() for g in leaves)
    for path_g, g in zip(jax.tree_util.tree_leaves_with_path(grads_p), leaves, strict=True):
        path, gp = path_g
        err = np.abs(np.asarray(gp, np.float64) - g).max()
        assert err <= tol * scale, (jax.tree_util.keystr(path), err, scale)


def accum_params():
    out = []
    # Dense accumulation: tests/training/test_train.py::test_gradient_accumulation.
    moe = [c for c in CELLS if c["moe"] and c["quant"] is None and c["dtype"] == "float32"]
    for c in moe[:1]:
        out.append(pytest.param(c, id=cell_id(c)))
    return out


@pytest.mark.parametrize("cell", accum_params())
def test_h_train_step_with_accumulation_equals_one_batch(cell):
    """train.train_step on 4 rows with grad_accum 2 (two micro-batches of 2) against 1: the
    same updated parameters (SGD, learning rate 1: the update is the gradient)."""
    import optax

    import train

    cfg = config_of(cell)
    if cfg.quantization == "int8":
        return train_refusal(cfg)
    params = float_params(cfg)
    src = np.concatenate([SRC, SRC[1:2]])
    tgt = np.concatenate([TGT, TGT[2:3]])
    tx = optax.sgd(1.0)
    state = train.TrainState(
        step=jnp.array(0, jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key(0),
    )
    new = {}
    for accum in (1, 2):
        step = jax.jit(
            functools.partial(
                train.train_step,
                model=EncoderDecoder(cfg),
                kind="translation",
                tx=tx,
                schedule=lambda s: 1.0,
                label_smoothing=0.0,
                accum_steps=accum,
                skip_nonfinite=False,
            )
        )
        new[accum], _ = step(state, {"inputs": src, "targets": tgt})
    one, two = (
        [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(new[k].params)]
        for k in (1, 2)
    )
    start = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(params)]
    moved = max(np.abs(a - p).max() for a, p in zip(one, start, strict=True))
    assert moved > 1e-4  # the step really moved the parameters
    tol = 4 * BF16_U if cfg.dtype == "bfloat16" else 1e-5
    for a, b in zip(one, two, strict=True):
        assert np.abs(a - b).max() <= tol * moved, (np.abs(a - b).max(), moved)


# ----------------------------------------------------------------------------- i: ensembles


@pytest.mark.parametrize("cell", cell_params("i"))
def test_i_ensemble_greedy_follows_the_mean_of_the_uncached_models(cell):
    """Two models of the cell (parameter seeds 1 and 2) decoded as one (``generate(params=
    (a, b))``, each with its own cache): every token the cached search picks is, given the
    same prefix, the argmax of log((p_a + p_b) / 2) of the two uncached models in float64,
    and its score is that mean's log-probability of its tokens. Each model's logits are
    within path b's rounding bound ``tol`` of its uncached ones, so each log-probability
    within 2 tol (log-softmax is 2-Lipschitz in the max norm), and so is their mean's log:
    the chosen token within 4 tol of the best. In float32 also the tokens of an uncached
    greedy search over the mean, run independently. The two models disagree on some token
    (asserted): a search that drops a member, or takes the mean of log-probabilities, fails
    the float32 and int8 cells (in bfloat16 the rounding bound is wider than the difference;
    there the cells check the ensemble's cache and search within it)."""
    from flaxformer_lite.decoding.generate import generate
    from flaxformer_lite.models import unrolled

    cfg = config_of(cell)
    members = (model_params(cfg), model_params(cfg, 2))
    tokens, scores = generate(members, cfg, SRC, method="greedy", max_len=DECODE_LEN)
    tokens = np.asarray(tokens)
    unrolled_members = [unrolled(p, cfg) for p in members]
    full_logits = full_logits_fn(unrolled_members[0][1])

    def mean_log_probs(dec_in: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], float]:
        logits = [np.asarray(full_logits(p, SRC, dec_in), np.float64) for p, _ in unrolled_members]
        logps = [log_softmax64(x) for x in logits]
        scale = max(float(np.sqrt(np.mean(x**2))) for x in logits)
        return np.logaddexp(*logps) - np.log(2.0), logps, scale

    dec_in = np.concatenate([np.full((3, 1), cfg.bos_id, np.int32), tokens[:, :-1]], axis=1)
    mean, logps, scale = mean_log_probs(dec_in)
    tol = decode_tolerance(cfg) * scale
    steps, disagree = 0, False
    for row in range(3):
        live = np.cumsum(tokens[row] == cfg.eos_id) - (tokens[row] == cfg.eos_id) == 0
        chosen = mean[row, live, tokens[row, live]]
        assert np.all(chosen >= mean[row, live].max(-1) - 4 * tol), (row, tokens[row])
        want = chosen.sum()
        assert abs(float(scores[row]) - want) <= 2 * tol * live.sum(), (row, scores[row], want)
        disagree |= bool(np.any(logps[0][row, live].argmax(-1) != logps[1][row, live].argmax(-1)))
        steps += live.sum()
    assert steps >= 6  # rows really decoded
    assert disagree, "the two models agree on every token: another seed for the second"
    if cfg.dtype == "float32":
        want_tokens, _, margin = naive_greedy(
            cfg, lambda dec_in: mean_log_probs(dec_in)[0], 3, DECODE_LEN
        )
        assert margin > 10 * tol, f"top-2 margin {margin}: pick another seed"
        np.testing.assert_array_equal(tokens, want_tokens)


# ----------------------------------------------------------------------------- g: meshes

MESHES = ((2, 2, 2),)  # (1, 8, 1) and the way back: tests/training/test_mesh_restore.py (dense)


def _mesh_worker(out: Path, ids: list[str]) -> None:
    """8 simulated devices: per cell, the parameters saved from one device are restored on
    each of MESHES with the shardings train.py gives them there; writes, per cell and mesh,
    whether every leaf is bitwise equal, carries the target sharding and is split, and the
    restored model's logits (``logits.npz``), which ``mesh_results`` compares with the
    one-device model's (computed there, in the parent: the compile path a already made)."""
    from flaxformer_lite.core import sharding
    from flaxformer_lite.core.checkpoints import Checkpointer

    assert jax.device_count() == 8, jax.devices()
    results, mesh_logits = {}, {}
    for cid in ids:
        cfg = config_of(CELL_BY_ID[cid])
        params = model_params(cfg)
        directory = out / cid
        ckpt = Checkpointer(str(directory), async_save=False)
        ckpt.save(1, {"params": params}, {"train": {}}, force=True)
        ckpt.close()
        t = jnp.ones((1, 4), jnp.int32)
        init = EncoderDecoder(cfg).init
        abstract = jax.eval_shape(
            lambda init=init, t=t: {"params": init(jax.random.key(0), t, t)["params"]}
        )
        for shape in MESHES:
            mesh = sharding.make_mesh(shape, jax.devices()[: int(np.prod(shape))])
            shardings = sharding.logical_shardings(abstract, mesh)
            wanted = jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                nn.meta.unbox(abstract),
                shardings,
            )
            ckpt = Checkpointer(str(directory), async_save=False)
            restored, _ = ckpt.restore(wanted)
            ckpt.close()
            pairs = zip(
                jax.tree_util.tree_leaves(restored["params"]),
                jax.tree_util.tree_leaves(params),
                jax.tree_util.tree_leaves(shardings["params"]),
                strict=True,
            )
            bitwise, sharded, split = True, True, 0
            for leaf, want, s in pairs:
                got = np.asarray(jax.device_get(leaf))
                bitwise &= got.dtype == want.dtype and np.array_equal(got, want)
                sharded &= leaf.sharding.is_equivalent_to(s, leaf.ndim)
                split += leaf.addressable_shards[0].data.shape != leaf.shape
            mesh_logits[f"{cid}@{shape}"] = np.asarray(jitted_apply(cfg)(restored, SRC, TGT))
            results[f"{cid}@{shape}"] = {
                "bitwise": bool(bitwise),
                "sharded": bool(sharded),
                "split": int(split),
                "leaves": len(jax.tree_util.tree_leaves(params)),
            }
    np.savez(out / "logits.npz", **mesh_logits)
    (out / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix_meshes")
    ids = [cell_id(c) for c in path_cells("g")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, str(out), *ids],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    mesh_logits = np.load(out / "logits.npz")
    for key, r in results.items():
        # The one-device model: the same parameters, drawn here as in the worker, on this
        # process's single device (path a's compile of the same program and shapes).
        cfg = config_of(CELL_BY_ID[key.split("@")[0]])
        one = np.asarray(jitted_apply(cfg)({"params": model_params(cfg)}, SRC, TGT))
        r["logit_diff"] = float(np.abs(mesh_logits[key] - one)[TGT != 0].max())
        r["scale"] = float(np.abs(one).max())
    return results


@pytest.mark.parametrize("cell", cell_params("g"))
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_g_checkpoint_restores_on_other_meshes(mesh_results, cell, shape):
    cfg = config_of(cell)
    r = mesh_results[f"{cell_id(cell)}@{shape}"]
    assert r["bitwise"] and r["sharded"], r
    assert r["split"] > r["leaves"] // 3, r  # the mesh really splits the parameters
    tol = 4 * BF16_U if cfg.dtype == "bfloat16" else 1e-5
    assert r["logit_diff"] <= tol * r["scale"], r


if __name__ == "__main__":
    _mesh_worker(Path(sys.argv[1]), sys.argv[2:])
