"""R-Drop (config.rdrop_alpha): the consistency term against a float64 reference, the objective
against one computed by hand from the same forward pass, no change at all without dropout, a
run that logs the term and learns, and the settings it refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from flaxformer_lite import DecoderOnly, EncoderClassifier, EncoderDecoder, TransformerConfig
from flaxformer_lite.training import losses, preflight
from flaxformer_lite.training.metrics import read_metrics

from helpers.tiny_configs import TINY_OVERRIDES, load_config, two_step_config

VOCAB = 13


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def symmetric_kl64(a, b, weights) -> float:
    """sum over weighted positions of (KL(p_a || p_b) + KL(p_b || p_a)) / 2, as two KLs."""
    la, lb = log_softmax64(a), log_softmax64(b)
    pa, pb = np.exp(la), np.exp(lb)
    kl_ab, kl_ba = (pa * (la - lb)).sum(-1), (pb * (lb - la)).sum(-1)
    return float((0.5 * (kl_ab + kl_ba) * np.asarray(weights, np.float64)).sum())


def smoothed_kl64(logits, labels, weights, smoothing: float) -> float:
    """KL from the label-smoothed target to the model, summed over weighted positions."""
    logp = log_softmax64(logits)
    vocab = logp.shape[-1]
    target = np.full(logp.shape, smoothing / (vocab - 1))
    np.put_along_axis(target, np.asarray(labels)[..., None], 1.0 - smoothing, axis=-1)
    per_token = (target * (np.log(target) - logp)).sum(-1)
    return float((per_token * np.asarray(weights, np.float64)).sum())


def test_symmetric_kl_matches_float64_reference():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    b = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    weights = (rng.random((3, 5)) > 0.3).astype(np.float32)
    got = float(losses.symmetric_kl(jnp.asarray(a), jnp.asarray(b), jnp.asarray(weights)))
    want = symmetric_kl64(a, b, weights)
    assert want > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Symmetric, and 0 for logits equal up to a constant per position.
    np.testing.assert_allclose(float(losses.symmetric_kl(b, a, weights)), got, rtol=1e-6)
    shifted = a + rng.normal(size=(3, 5, 1)).astype(np.float32)
    assert abs(float(losses.symmetric_kl(a, shifted, weights))) < 1e-5
    # bfloat16 logits are computed in float32.
    got16 = losses.symmetric_kl(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), weights)
    assert got16.dtype == jnp.float32


def model_and_batch(kind="translation", **rates):
    cfg = TransformerConfig(
        vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
        num_decoder_layers=1, max_len=8, num_classes=3, **rates,
    )  # fmt: skip
    inputs = jnp.array([[5, 6, 7, 2, 0, 0], [8, 9, 2, 0, 0, 0], [3, 4, 5, 6, 7, 2]], jnp.int32)
    targets = jnp.array([[4, 5, 2, 0, 0], [6, 7, 8, 9, 2], [10, 2, 0, 0, 0]], jnp.int32)
    if kind == "lm":
        model, args, batch = DecoderOnly(cfg), (targets,), {"targets": targets}
    elif kind == "classification":
        model, args = EncoderClassifier(cfg), (inputs,)
        batch = {"inputs": inputs, "label": jnp.array([0, 2, 1]), "weights": jnp.ones(3)}
    else:
        model, args = EncoderDecoder(cfg), (inputs, targets)
        batch = {"inputs": inputs, "targets": targets}
    # Jitted, as train.py runs it (so are the tests' losses): one program instead of every op
    # compiled on its own.
    params = jax.jit(model.init)(jax.random.key(1), *args)["params"]
    return model, params, batch


def test_the_objective_is_the_mean_loss_of_two_passes_plus_half_alpha_times_their_kl():
    model, params, batch = model_and_batch(dropout_rate=0.3, attention_dropout_rate=0.2)
    rng, alpha, smoothing = jax.random.key(7), 5.0, 0.1
    objective, sums = jax.jit(
        lambda p, b: train.loss_sums(
            model, "translation", smoothing, p, b, deterministic=False, rng=rng,
            rdrop_alpha=alpha,
        )
    )(params, batch)  # fmt: skip
    # The same forward pass by hand: every row twice in place, one dropout key.
    doubled = {k: np.repeat(np.asarray(v), 2, axis=0) for k, v in batch.items()}
    logits, labels, weights, _ = jax.jit(
        lambda p, b: train.forward(model, "translation", p, b, deterministic=False, rng=rng)
    )(params, doubled)
    logits, labels, weights = (np.asarray(x) for x in (logits, labels, weights))
    a, b = logits[0::2], logits[1::2]
    assert np.abs(a - b).max() > 0.1  # the copies saw different dropout masks
    tokens = float((np.asarray(batch["targets"]) != 0).sum())
    mean_kl = smoothed_kl64(logits, labels, weights, smoothing) / 2
    consistency = symmetric_kl64(a, b, weights[0::2])
    assert consistency > 0.01
    np.testing.assert_allclose(float(sums["count"]), tokens)
    np.testing.assert_allclose(float(sums["smoothed_kl"]), mean_kl, rtol=1e-5)
    np.testing.assert_allclose(float(sums["rdrop_kl"]), consistency, rtol=1e-4)
    np.testing.assert_allclose(float(objective), mean_kl + alpha / 2 * consistency, rtol=1e-5)
    # Evaluation (deterministic) runs each row once and has no term.
    _, eval_sums = jax.jit(
        lambda p, b: train.loss_sums(
            model, "translation", smoothing, p, b, deterministic=True, rdrop_alpha=alpha
        )
    )(params, batch)
    assert "rdrop_kl" not in eval_sums and float(eval_sums["count"]) == tokens


@pytest.mark.parametrize("kind", ["translation", "lm", "classification"])
def test_without_dropout_the_term_is_zero_and_the_gradient_unchanged(kind):
    model, params, batch = model_and_batch(kind, dropout_rate=0.0)

    def grad(alpha):
        fn = jax.grad(
            lambda p: train.loss_sums(
                model, kind, 0.1, p, batch, deterministic=False,
                rng=jax.random.key(3), rdrop_alpha=alpha,
            ),
            has_aux=True,
        )  # fmt: skip
        return jax.jit(fn)(params)

    (plain, plain_sums), (rdrop, rdrop_sums) = grad(0.0), grad(5.0)
    assert abs(float(rdrop_sums["rdrop_kl"])) < 1e-6
    for k in train.SUM_KEYS:
        np.testing.assert_allclose(float(rdrop_sums[k]), float(plain_sums[k]), rtol=1e-6)
    leaves = jax.tree_util.tree_leaves(plain)
    assert len(leaves) > 10
    for x, y in zip(leaves, jax.tree_util.tree_leaves(rdrop), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)


def test_a_run_logs_the_term_and_learns(tmp_path):
    """A tiny synthetic run with R-Drop and 2 micro-batches: every train line carries the
    term, positive and finite, and the loss falls as in test_train's run without it."""
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=6, num_eval=32)
    c.model = dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                   num_decoder_layers=1, dropout_rate=0.1)  # fmt: skip
    for k, v in {**TINY_OVERRIDES, "rdrop_alpha": 1.0, "grad_accum_steps": 2}.items():
        setattr(c, k, v)
    c.decode_eval = False
    train.train_and_evaluate(c, str(tmp_path))
    lines = [m for m in read_metrics(str(tmp_path)) if "train/smoothed_kl" in m]
    assert len(lines) == 4
    assert all(0.0 < m["train/rdrop_kl"] < 10.0 for m in lines), lines
    assert lines[-1]["train/smoothed_kl"] < 0.9 * lines[0]["train/smoothed_kl"]
    eval_lines = [m for m in read_metrics(str(tmp_path)) if "eval/smoothed_kl" in m]
    assert eval_lines and not any("eval/rdrop_kl" in m for m in eval_lines)


def test_a_mixture_of_experts_is_refused():
    config = two_step_config(rdrop_alpha=5.0)
    config.model.update(dropout_rate=0.1, num_experts=2)
    refused = (
        r"^config\.rdrop_alpha=5\.0 is not supported with config\.model\.num_experts=2; "
        r"set config\.rdrop_alpha=0$"
    )
    with pytest.raises(preflight.ConfigError, match=refused):
        preflight.check_config(config, device_count=1)
    model, params, batch = model_and_batch(dropout_rate=0.1, num_experts=2)
    with pytest.raises(ValueError, match="rdrop_alpha > 0 is not supported with num_experts"):
        train.loss_sums(model, "translation", 0.1, params, batch, deterministic=False,
                        rng=jax.random.key(0), rdrop_alpha=1.0)  # fmt: skip
