"""Fine-tuning from a train.py workdir (init_from) across layer layouts, and the architecture
guard.

Two tiny source runs (2 + 2 layers, trained 2 steps), one unrolled and one ``scan_layers``, are
fine-tuned in every direction (scanned -> scanned, scanned -> unrolled, unrolled -> scanned,
unrolled -> unrolled) with every parameter frozen for one step, so the fine-tune's checkpoint
holds exactly what init_from restored. The expected values are the source checkpoint's own
arrays, re-laid out here by plain NumPy indexing (row i of a stacked leaf is ``layers_i``),
never by the code under test. An override of an architecture field is refused by preflight
before the workdir exists; every TransformerConfig field must be classified.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.interop import init_from  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402
from flaxformer_lite.training import preflight
from flaxformer_lite.training.preflight import ConfigError  # noqa: E402

from helpers.layout_reference import flatten, relayout
from helpers.runs import checkpoint_params
from helpers.tiny_configs import load_config

LAYERS = 2  # per stack: stacking order matters only with more than one layer
TINY_MODEL = dict(
    d_model=16, num_heads=2, d_ff=32, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS
)


def tiny_config(seed: int = 0, **model):
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=6, num_eval=8)
    c.model = {**TINY_MODEL, "dropout_rate": 0.0, **model}
    c.update(
        batch_size=8, num_train_steps=2, log_every=1, eval_every=0, checkpoint_every=10,
        warmup_steps=1, learning_rate=3e-3, seed=seed, decode_eval=False,
    )  # fmt: skip
    return c


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[bool, Path]:
    """Two trained tiny runs, keyed by scan_layers."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for scanned in (True, False):
        workdir = root / f"scan_{scanned}"
        train.train_and_evaluate(tiny_config(scan_layers=scanned), str(workdir), stop_at=2)
        out[scanned] = workdir
    return out


@pytest.mark.parametrize("target_scanned", [True, False], ids=["to_scanned", "to_unrolled"])
@pytest.mark.parametrize("source_scanned", [True, False], ids=["scanned", "unrolled"])
def test_every_parameter_is_restored_across_layer_layouts(
    sources, source_scanned, target_scanned, tmp_path, capsys
):
    source = sources[source_scanned]
    source_flat = flatten(checkpoint_params(source))
    layered = [n for n in source_flat if ("/layers/" if source_scanned else "/layers_1/") in n]
    assert len(layered) >= 20  # the source really has the layout under test
    config = tiny_config(seed=1, scan_layers=target_scanned)
    config.init_from = str(source)
    config.freeze = (".*",)  # one step with zero updates: the checkpoint is the restore
    train.train_and_evaluate(config, str(tmp_path / "run"), stop_at=1)
    out = capsys.readouterr()
    line = next(x for x in out.out.splitlines() if x.startswith(f"init_from {source}"))
    assert ", 0 newly initialised, 0 dropped" in line and "WARNING" not in out.err, line

    got = flatten(checkpoint_params(tmp_path / "run"))
    expected = relayout(source_flat, target_scanned, LAYERS)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_newly_initialised_parameter_of_the_same_architecture_is_a_warning():
    fresh = {"layers": {"w": np.zeros((2, 3), np.float32)}, "head": np.zeros(3, np.float32)}
    pretrained = {"layers_0": {"w": np.ones(3)}, "layers_1": {"w": np.full(3, 2.0)}}
    params = jax.tree_util.tree_map(jax.numpy.asarray, fresh)
    out, summary = init_from.restore_into(params, pretrained, same_architecture=True)
    np.testing.assert_array_equal(np.asarray(out["layers"]["w"]), [[1, 1, 1], [2, 2, 2]])
    assert summary.startswith("WARNING: 1 parameters newly initialised") and "head" in summary
    _, summary = init_from.restore_into(params, pretrained)  # another model: a new head is fine
    assert not summary.startswith("WARNING") and "1 newly initialised" in summary
    with pytest.raises(ValueError, match=r"scanned layers/w has 2 layers.*1 of them"):
        init_from.restore_into(params, {"layers_0": {"w": np.ones(3)}})


def test_train_warns_on_stderr_when_a_same_architecture_fine_tune_initialises_anything(
    sources, tmp_path, monkeypatch, capsys
):
    """A pretrained parameter that goes missing (a naming or layout mismatch) is a WARNING on
    stderr naming it; the run is stopped right after the restore (no train step compiled)."""
    source = sources[False]
    real = init_from.pretrained_params
    victim = next(n for n in flatten(real(str(source))) if n.startswith("decoder/layers_1/"))

    def missing_one(src):
        params = real(src)
        *parents, leaf = victim.split("/")
        node = params
        for key in parents:
            node = node[key]
        del node[leaf]
        return params

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(init_from, "pretrained_params", missing_one)
    monkeypatch.setattr(train, "jit_train_step", stop)
    config = tiny_config(seed=1)
    config.init_from = str(source)
    # As the unrolled fine-tunes above (every parameter frozen, seed 1): the same initial-state
    # program, already compiled (the seed and the optimizer state are part of it). The warning
    # comes from the restore, before the freeze is applied.
    config.freeze = (".*",)
    with pytest.raises(Stop):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert "WARNING: 1 parameters newly initialised" in err and victim in err, err


def test_every_config_field_is_classified_for_fine_tuning():
    """A new TransformerConfig field must be put in exactly one group of init_from."""
    groups = {
        "architecture": set(init_from.ARCHITECTURE_FIELDS),
        "training": set(init_from.TRAINING_FIELDS),
        "data": set(init_from.DATA_FIELDS),
    }
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in sorted(fields):
        owners = [g for g, members in groups.items() if name in members]
        assert len(owners) == 1, f"TransformerConfig.{name} is in {owners or 'no group'}"
    assert set().union(*groups.values()) == fields  # no stale names
    assert sum(map(len, groups.values())) == len(fields)  # no duplicates within a group


# A value other than the default for every training field (the test below checks the keys).
TRAINING_ALTERNATIVES = dict(
    dropout_rate=0.3, attention_dropout_rate=0.2, dtype="bfloat16", param_dtype="bfloat16",
    attention_implementation="blockwise", remat=True, scan_layers=True,
    expert_capacity_factor=None, moe_aux_loss_weight=0.5, router_z_loss_weight=0.5,
    activation_dropout_rate=0.1, word_dropout_rate=0.1, int8_kernel="xla",
)  # fmt: skip


@functools.cache
def abstract_params(config: TransformerConfig):
    """The parameter tree of ``config``'s model as ``eval_shape`` gives it (nothing runs):
    shapes and dtypes. Cached: the two tests below trace nine of the same configs (the base
    model and eight training fields), and a trace is their whole cost."""
    import flax.linen as nn

    from flaxformer_lite import EncoderDecoder

    tokens = jax.numpy.ones((1, 4), jax.numpy.int32)
    abstract = jax.eval_shape(
        lambda: EncoderDecoder(config).init(jax.random.key(0), tokens, tokens)["params"]
    )
    return nn.meta.unbox(abstract)


def parameter_shapes(config: TransformerConfig) -> dict[str, tuple]:
    """Every parameter's shape in the unrolled layout (a scanned ``layers`` leaf `[N, ...]`
    counted as N ``layers_i`` leaves of its row shape), from ``eval_shape`` (nothing runs)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(config)):
        parts = [str(k.key) for k in path if hasattr(k, "key")]
        if "layers" in parts:
            k = parts.index("layers")
            for i in range(leaf.shape[0]):
                out["/".join([*parts[:k], f"layers_{i}", *parts[k + 1 :]])] = leaf.shape[1:]
        else:
            out["/".join(parts)] = leaf.shape
    return out


def test_a_training_field_leaves_the_parameter_tree_alone():
    """What the classification promises for the fields config.model may change on fine-tune:
    the pretrained tree (paths and shapes, layout aside) fits the model whatever their values
    (in a mixture-of-experts model, where the expert fields matter)."""
    assert sorted(TRAINING_ALTERNATIVES) == sorted(init_from.TRAINING_FIELDS)
    base = TransformerConfig(vocab_size=12, max_len=8, **TINY_MODEL, num_experts=2)
    expected = parameter_shapes(base)
    assert any("/layers_1/" in n for n in expected) and any("/moe/router" in n for n in expected)
    for field, value in TRAINING_ALTERNATIVES.items():
        assert value != getattr(base, field), field
        changed = base.replace(**{field: value})
        if field == "attention_implementation":  # blockwise has no attention dropout
            changed = changed.replace(attention_dropout_rate=0.0)
        assert parameter_shapes(changed) == expected, field


# A valid value other than the tiny source's for every architecture field (a new architecture
# field needs one here: the test below checks the keys).
ALTERNATIVES = dict(
    d_model=32, num_heads=4, num_kv_heads=1, d_ff=64, num_encoder_layers=1, num_decoder_layers=3,
    max_len=16, activation="gelu", norm_position="pre", norm_type="rmsnorm",
    layer_norm_epsilon=1e-5, position="learned", sinusoid_layout="halves",
    scale_embeddings=False, share_embeddings=False, tie_output_embedding=False, logits_bias=True,
    use_bias=False, fused_qkv=True, num_classes=3, pooling="first", num_experts=2,
    num_experts_per_token=1, moe_every=2, attention_window=2, attention_window_layers="encoder",
    relative_num_buckets=8, relative_max_distance=20, head_dim=4, quantization="int8",
    # Llama family.
    rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=2.0,
    rope_high_freq_factor=8.0, rope_original_max_len=1024, qkv_bias=True,
    # BART / mBART.
    learned_position_offset=2, embedding_norm=True,
    # T5.
    scale_attention_logits=False, scale_decoder_output=True,
)  # fmt: skip


def test_an_architecture_override_is_refused_before_the_workdir_is_written(sources, tmp_path):
    source = sources[False]
    pretrained = init_from.pretrained_config(str(source))
    assert sorted(ALTERNATIVES) == sorted(init_from.ARCHITECTURE_FIELDS)
    for field, value in ALTERNATIVES.items():
        assert value != getattr(pretrained, field), field
        message = rf"config\.model\.{field}={value!r} \(pretrained"
        with pytest.raises(ValueError, match=message):
            init_from.check_overrides(str(source), {field: value})
        config = tiny_config(**{field: value})
        config.init_from = str(source)
        if field == "quantization":  # int8 cannot be trained at all: preflight says that first
            message = r"config\.model\.quantization='int8': int8 is for inference only"
        with pytest.raises(ConfigError, match=message):
            preflight.check_run(config, str(tmp_path / "run"), device_count=1)
    # Through train.py: refused before anything is read or written.
    config = tiny_config(num_experts=2, attention_window=3)
    config.init_from = str(source)
    with pytest.raises(ConfigError, match=r"config\.model\.num_experts=2 .*attention_window=3"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    # Repeating the pretrained value, or changing a training field, is accepted.
    config = tiny_config(num_experts=0, d_model=16, scan_layers=True, remat=True, dtype="bfloat16")
    config.init_from = str(source)
    preflight.check_run(config, str(tmp_path / "run"), device_count=1)


def parameter_tree(config: TransformerConfig) -> dict[str, tuple]:
    """Every parameter's path, shape and dtype as initialised (``eval_shape``: nothing runs)."""
    return {
        jax.tree_util.keystr(path): (leaf.shape, str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(config))
    }


def test_resume_cannot_allow_a_field_that_changes_the_parameter_tree():
    """preflight.SHAPE_FIELDS (what ``allow_changes`` may never allow on resume) holds every
    model field whose change alters the checkpoint's parameter tree: checked field by field
    with eval_shape against the tiny MoE model, so a new shape-changing field cannot be
    forgotten there (a change it missed would be allowed and then fail inside the restore)."""
    base = TransformerConfig(vocab_size=12, max_len=8, **TINY_MODEL, num_experts=2)
    expected = parameter_tree(base)
    alternatives = {
        **ALTERNATIVES,
        **TRAINING_ALTERNATIVES,
        "num_experts": 3,
        "pooling": "attention",
    }
    missing = []
    for field, value in alternatives.items():
        if f"model.{field}" in preflight.SHAPE_FIELDS:
            continue  # listed: only an unlisted field can be a miss
        changed = base.replace(**{field: value})
        if field == "attention_implementation":
            changed = changed.replace(attention_dropout_rate=0.0)
        if parameter_tree(changed) != expected:
            missing.append(field)
    assert not missing, f"change the parameter tree but resume may allow them: {missing}"
