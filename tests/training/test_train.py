"""Training end to end on tiny configs: learning, metrics, checkpoints, exact resume, kill."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.core.checkpoints import Checkpointer, finished_steps  # noqa: E402
from flaxformer_lite.training import (
    flops,
    losses,  # noqa: E402
    optim,
)
from flaxformer_lite.training.metrics import read_metrics  # noqa: E402

from helpers import exact_match_reference
from helpers.random_weights import random_params
from helpers.runs import saved_state, train_cmd, wait_for_checkpoint
from helpers.tiny_configs import TINY_OVERRIDES, load_config


def tiny_config(**overrides):
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=6, num_eval=32)
    c.model = dict(
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.1,
    )
    for k, v in {**TINY_OVERRIDES, **overrides}.items():
        setattr(c, k, v)
    return c


def record_decoding(monkeypatch) -> list:
    """Makes train.py's decoding eval also append the tokens it decodes to the list returned."""
    recorded = []
    decode = train.greedy_decode_in_order

    def recording(*args, **kwargs):
        recorded.append(decode(*args, **kwargs))
        return recorded[-1]

    monkeypatch.setattr(train, "greedy_decode_in_order", recording)
    return recorded


def test_default_config_learns_and_writes_metrics_and_checkpoints(tmp_path, monkeypatch):
    recorded = record_decoding(monkeypatch)

    def unwanted(*args, **kwargs):
        raise AssertionError("config.peak_flops is set: the peak must not be measured")

    monkeypatch.setattr(flops, "matmul_peak_flops", unwanted)
    metrics = train.train_and_evaluate(tiny_config(), str(tmp_path))
    lines = read_metrics(str(tmp_path))
    train_losses = [m["train/smoothed_kl"] for m in lines if "train/smoothed_kl" in m]
    assert len(train_losses) == 4
    assert train_losses[-1] < 0.9 * train_losses[0]  # from ln(10) (uniform digits) down
    for key in (
        "train/accuracy",
        "train/perplexity",
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_second",
        "train/mfu",
    ):
        assert key in lines[0]
    evals = [m for m in lines if "eval/exact_match" in m]
    assert [m["step"] for m in evals] == [20, 40]
    # The last evaluation decoded what an independent decoder (uncached, one device) decodes
    # from the last checkpoint, and scored those tokens right.
    # (This tiny run decodes EOS for every row, so its score is 0.)
    task, model, params, decoded = exact_match_reference.naive_decoding(
        tiny_config(), tmp_path, tmp_path / "x"
    )
    exact_match_reference.check_decoding_eval(
        recorded[-len(decoded) :], decoded, metrics["eval/exact_match"]
    )
    # The same decoding eval where every row decodes differently and half of them match.
    exact_match_reference.check_decode_metric_on_diverse_outputs(
        train, recorded, task, model, params
    )
    assert metrics["eval/smoothed_kl"] == evals[-1]["eval/smoothed_kl"]
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 30, 40]  # keep_checkpoints=3
    saved = json.loads((tmp_path / "model_config.json").read_text())
    assert saved["d_model"] == 32 and saved["vocab_size"] == 14  # 4 specials + 10 digits
    assert json.loads((tmp_path / "config.json").read_text())["task"] == "synthetic"
    assert (tmp_path / "vocab.json").exists()
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, optimizer):
    # num_train_steps stays tiny_config's 40 (the cosine schedule's length is part of the
    # compiled train step): the program the test above compiled serves all three runs, which
    # end at step 8 through stop_at (train.py's preemption path: the step, then a checkpoint).
    # Muon's state (momentum, Newton-Schulz coefficients, AdamW's moments) round-trips too.
    decay = 0.1 if optimizer == "muon" else 0.0
    config = tiny_config(
        eval_every=0, checkpoint_every=100, log_every=4, optimizer=optimizer, weight_decay=decay
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.train_and_evaluate(config, str(straight), stop_at=8)
    train.train_and_evaluate(config, str(resumed), stop_at=4)
    state_half, data_half = saved_state(resumed)
    assert int(state_half["step"]) == 4 and data_half["train"] == {"index": 4}
    train.train_and_evaluate(config, str(resumed), stop_at=8)
    a, _ = saved_state(straight)
    b, data = saved_state(resumed)
    assert int(a["step"]) == int(b["step"]) == 8 and data["train"] == {"index": 8}
    leaves_a = jax.tree_util.tree_leaves(a)
    leaves_b = jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # And the second half really moved the parameters (the comparison is not vacuous).
    kernel = lambda s: np.asarray(s["params"]["decoder"]["layers_0"]["mlp"]["wo"]["kernel"])  # noqa: E731
    assert np.abs(kernel(b) - kernel(state_half)).max() > 1e-5


# SIGKILL (no chance to save) is tested in tests/core/test_gcs.py, against a bucket, where the
# resumed run must also end bitwise equal to an uninterrupted one.
def test_sigterm_saves_the_step_it_prints_and_the_rerun_resumes_there(tmp_path):
    workdir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # Constant after warmup: unlike the default cosine schedule, its compiled train step does
    # not depend on num_train_steps, so the rerun loads the first run's program from the
    # compilation cache instead of compiling its own.
    schedule = {"schedule": "constant"}
    proc = subprocess.Popen(
        train_cmd(workdir, 100000, **schedule),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    wait_for_checkpoint(workdir, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    # A preempted run saves the step it names and exits 0: its checkpoint is written.
    assert proc.returncode == 0, out
    assert "final:" not in out
    printed = [int(s) for s in re.findall(r"SIGTERM: saving step (\d+); rerun to resume", out)]
    assert len(printed) == 1, out[-3000:]
    (n,) = printed
    assert finished_steps(workdir / "checkpoints")[-1] == n  # the latest complete one is N
    state, data = saved_state(workdir)
    assert int(state["step"]) == n and data["train"] == {"index": n}  # and it holds step N
    target = n + 7
    done = subprocess.run(
        train_cmd(workdir, target, **schedule),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from step {n} " in done.stdout
    state, data = saved_state(workdir)
    assert int(state["step"]) == target and data["train"] == {"index": target}
    # Train lines every 5 steps and at each run's last step (N: the partial window the
    # preempted run had); the rerun's continue after N.
    logged = [m["step"] for m in read_metrics(str(workdir)) if "train/smoothed_kl" in m]
    every_5 = [s for s in range(1, target + 1) if s % 5 == 0]
    assert logged == sorted(set(every_5) | {n, target})


@pytest.mark.parametrize("warmup, total", [(40, 1000), (0, 300), (10, 11)])
def test_linear_schedule_warms_up_then_decays_straight_to_zero(warmup, total):
    """Update ``count`` (optax counts from 0) gets peak * count / warmup while warming up, then
    peak * (total - count) / (total - warmup): zero at the last step, a straight line between."""
    peak = 4e-3
    schedule = optim.make_schedule(
        "linear", learning_rate=peak, warmup_steps=warmup, total_steps=total, d_model=128
    )
    for count in sorted({0, 1, warmup // 2, warmup, warmup + 1, (warmup + total) // 2, total - 1,
                         total, total + 5}):  # fmt: skip
        if count < warmup:
            expected = peak * count / warmup
        else:
            expected = peak * max(total - count, 0) / (total - warmup)
        # float32: peak - peak * fraction rounds to within a few ulps of peak (~5e-10 here)
        assert float(schedule(count)) == pytest.approx(expected, rel=1e-5, abs=peak * 1e-6), count


def test_noam_schedule_matches_the_paper_formula():
    d_model, warmup = 512, 4000
    schedule = optim.noam_schedule(d_model, warmup)
    for step in (1, 10, 1000, 4000, 4001, 20000, 100000):
        expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-6)
    peak = float(schedule(warmup - 1))
    assert peak == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-6)
    assert float(schedule(warmup - 2)) < peak and float(schedule(warmup)) < peak
    with pytest.raises(ValueError, match="schedule"):
        optim.make_schedule("step", learning_rate=1.0, warmup_steps=1, total_steps=2, d_model=8)
    with pytest.raises(ValueError, match="optimizer"):
        optim.make_optimizer("sgd", schedule)


def test_adamw_decays_matrices_and_embeddings_not_biases_or_norm_scales():
    from flaxformer_lite import EncoderDecoder, TransformerConfig
    from flaxformer_lite.models import param_path

    # A scanned stack: its biases and norm scales carry a leading layer axis (rank 2, as a
    # kernel of one layer), so only their names can tell them apart.
    cfg = TransformerConfig(
        vocab_size=16, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=2,
        num_decoder_layers=2, max_len=8, scan_layers=True,
    )  # fmt: skip
    lr, wd = 0.5, 0.1
    tx = optim.make_optimizer("adamw", optax.constant_schedule(lr), weight_decay=wd)

    @jax.jit  # one program, not an eager op per leaf
    def params_and_updates():
        tokens = jnp.ones((1, 3), jnp.int32)
        params = EncoderDecoder(cfg).init(jax.random.key(0), tokens, tokens)["params"]
        params = jax.tree.map(lambda p: p + 1.0, params)  # no zero bias: each leaf can decay
        zero_grads = jax.tree.map(jnp.zeros_like, params)
        return params, tx.update(zero_grads, tx.init(params), params)[0]

    params, updates = jax.device_get(params_and_updates())  # numpy: no eager op below
    kept, decayed = [], []
    for (path, p), u in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(updates), strict=True
    ):
        name = param_path(path)
        if name.endswith("bias") or name.endswith("/scale"):
            np.testing.assert_array_equal(u, 0.0, err_msg=name)
            kept.append((name, p.ndim))
        else:  # decoupled decay with zero gradients: p <- p - lr * wd * p
            np.testing.assert_allclose(u, -lr * wd * p, rtol=1e-6, err_msg=name)
            decayed.append(name)
    assert any(n.endswith("/scale") for n, _ in kept)
    assert any(n.endswith("bias") and ndim == 2 for n, ndim in kept)  # a stacked bias
    assert any(n.endswith("embedding") for n in decayed) and any("kernel" in n for n in decayed)


@pytest.mark.parametrize("fused_qkv,num_kv_heads", [(False, None), (True, None), (True, 1)])
def test_muon_orthogonalizes_each_projection_matrix_and_leaves_the_rest_to_adamw(
    fused_qkv, num_kv_heads
):
    """Muon's first update of every attention and feed-forward kernel, read as [fan_in,
    fan_out] per layer and per fused query/key/value slice, is -lr * 0.2 * sqrt(max(fan_in,
    fan_out)) * U p(S) V^T for its gradient's float64 SVD U S V^T, where p is five steps of
    Jordan's quintic x -> 3.4445 x - 4.775 x^3 + 2.0315 x^5 on S / ||S||_2 (the Newton-Schulz
    iteration on the singular values), plus decoupled decay; every other parameter gets
    AdamW's update (decay on embeddings only)."""
    from flaxformer_lite import EncoderDecoder, TransformerConfig
    from flaxformer_lite.models import param_path

    cfg = TransformerConfig(
        vocab_size=16, d_model=8, num_heads=2, num_kv_heads=num_kv_heads, d_ff=12,
        num_encoder_layers=2, num_decoder_layers=2, max_len=8, scan_layers=True,
        fused_qkv=fused_qkv, activation="swiglu",
    )  # fmt: skip
    lr, wd = 0.5, 0.1
    schedule = optax.constant_schedule(lr)
    muon = optim.make_optimizer("muon", schedule, weight_decay=wd)
    adamw = optim.make_optimizer("adamw", schedule, weight_decay=wd)

    tokens = np.ones((1, 3), np.int32)
    params = random_params(EncoderDecoder(cfg), tokens, tokens)  # NumPy: nothing compiles
    # Gradients drawn here too, not in the compiled program: with model init and a threefry
    # draw per leaf (about a hundred) in it, that one program took 3.6 s to compile.
    rng = np.random.default_rng(2)
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)

    @jax.jit
    def first_updates(params, grads):
        no_decay = jax.tree.map(jnp.zeros_like, params)  # Muon's matrices without the decay
        muon_no_decay = optim.make_optimizer("muon", schedule)
        return (
            muon.update(grads, muon.init(params), params)[0],
            muon_no_decay.update(grads, muon_no_decay.init(params), no_decay)[0],
            adamw.update(grads, adamw.init(params), params)[0],
        )

    updates, bare, adamw_updates = jax.device_get(first_updates(params, grads))
    flat = lambda tree: jax.tree.leaves(tree)  # noqa: E731
    matrices = set()
    for (path, p), g, u, b, a in zip(
        jax.tree_util.tree_leaves_with_path(params),
        flat(grads), flat(updates), flat(bare), flat(adamw_updates), strict=True,
    ):  # fmt: skip
        name = param_path(path)
        leaf = name.rsplit("/", 2)[-2:]
        if leaf[1] not in ("kernel", "query_kernel", "kv_kernel"):
            np.testing.assert_allclose(u, a, rtol=1e-5, atol=1e-7, err_msg=name)
            continue
        matrices.add("/".join(leaf))
        np.testing.assert_allclose(u - b, -lr * wd * p, rtol=1e-4, atol=1e-6, err_msg=name)
        # [layers, (3 | 2,) fan_in..., fan_out...] -> [slices, fan_in, fan_out]
        if leaf[0] == "out":  # [layers, heads, head_dim, embed]
            fan_in, fan_out = p.shape[1] * p.shape[2], p.shape[3]
        elif leaf[0] in ("wi", "wi_up", "wo"):  # [layers, in, out]
            fan_in, fan_out = p.shape[1:]
        elif leaf[1] in ("kernel", "kv_kernel") and leaf[0] == "qkv":  # [layers, embed, n, h, d]
            fan_in, fan_out = p.shape[1], p.shape[3] * p.shape[4]
            g, b = np.moveaxis(g, 2, 1), np.moveaxis(b, 2, 1)  # the q/k/v axis before embed
        else:  # [layers, embed, heads, head_dim]
            fan_in, fan_out = p.shape[1], p.shape[2] * p.shape[3]
        g64 = np.asarray(g, np.float64).reshape(-1, fan_in, fan_out)
        b64 = np.asarray(b, np.float64).reshape(-1, fan_in, fan_out)
        scale = -lr * 0.2 * np.sqrt(max(fan_in, fan_out))
        for gi, bi in zip(g64, b64, strict=True):
            left, sigma, right = np.linalg.svd(gi, full_matrices=False)
            x = sigma / np.linalg.norm(sigma)
            for _ in range(5):
                x = 3.4445 * x - 4.775 * x**3 + 2.0315 * x**5
            np.testing.assert_allclose(bi / scale, (left * x) @ right, atol=2e-4, err_msg=name)
    kinds = {"out/kernel", "wi/kernel", "wi_up/kernel", "wo/kernel"}
    if fused_qkv:  # the encoder's and decoder's self-attention; cross-attention is unfused
        kinds |= {"qkv/kernel"} if num_kv_heads is None else {"qkv/query_kernel", "qkv/kv_kernel"}
    assert matrices == kinds | {"query/kernel", "key/kernel", "value/kernel"}


def test_label_smoothed_loss_against_hand_computed_value():
    logits = jnp.array([[[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]])
    labels = jnp.array([[0, 3]])
    weights = jnp.array([[1.0, 0.0]])  # the second position is padding
    loss, count = losses.smoothed_cross_entropy(logits, labels, weights, label_smoothing=0.1)
    p = np.exp([2.0, 1.0, 0.0, -1.0])
    logp = np.log(p / p.sum())
    q = np.array([0.9, 0.1 / 3, 0.1 / 3, 0.1 / 3])
    hand = -(q * logp).sum() + (q * np.log(q)).sum()  # cross-entropy minus target entropy
    assert float(count) == 1.0
    assert float(loss) == pytest.approx(hand, rel=1e-6)
    plain, _ = losses.smoothed_cross_entropy(logits, labels, weights, label_smoothing=0.0)
    assert float(plain) == pytest.approx(-logp[0], rel=1e-6)
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.smoothed_cross_entropy(logits, labels, weights, label_smoothing=1.0)


def test_label_smoothed_loss_gradient_against_float64_finite_differences():
    """The hand-written gradient (softmax - smoothed target, times the weight) is the
    derivative of the loss: central differences of a float64 one-hot formula agree."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (2, 3, 7))
    labels = rng.integers(0, 7, (2, 3))
    weights = np.array([[1.0, 1.0, 0.0], [1.0, 0.5, 1.0]])

    def reference(z, ls):
        q = np.where(np.arange(7) == labels[..., None], 1 - ls, ls / 6)
        logp = z - z.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        return ((-(q * logp).sum(-1) + (q * np.log(np.maximum(q, 1e-300))).sum(-1)) * weights).sum()

    for ls in (0.0, 0.1, 0.3):
        fn = lambda z, ls=ls: losses.smoothed_cross_entropy(z, labels, weights, ls)[0]  # noqa: E731
        grad = np.asarray(jax.grad(fn)(jnp.asarray(logits, jnp.float32)))
        numeric = np.zeros_like(logits)
        for i in np.ndindex(logits.shape):
            step = np.zeros_like(logits)
            step[i] = 1e-6
            numeric[i] = (reference(logits + step, ls) - reference(logits - step, ls)) / 2e-6
        np.testing.assert_allclose(grad, numeric, atol=2e-6)
        assert float(fn(jnp.asarray(logits, jnp.float32))) == pytest.approx(
            reference(logits, ls), rel=1e-5
        )
    # The gradient keeps the logits' dtype; the weights get d loss / d weight.
    grad16 = jax.grad(fn)(jnp.asarray(logits, jnp.bfloat16))
    assert grad16.dtype == jnp.bfloat16
    d_weights = jax.grad(lambda w: losses.smoothed_cross_entropy(logits, labels, w, 0.1)[0])(
        jnp.asarray(weights, jnp.float32)
    )
    per_position = jax.vmap(jax.vmap(lambda z, y: losses.smoothed_cross_entropy(
        z, y, jnp.float32(1.0), 0.1)[0]))(jnp.asarray(logits, jnp.float32), labels)  # fmt: skip
    np.testing.assert_allclose(d_weights, per_position, rtol=1e-6)


def test_correct_predictions_is_first_index_argmax_with_ties_and_nan():
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 3, (40, 6)).astype(np.float32)  # many ties
    logits[3, 2] = np.nan
    logits[4] = np.nan
    logits[5, 5] = np.inf
    logits[6] = -np.inf
    weights = rng.integers(0, 2, 40).astype(np.float32)
    for label in range(6):
        labels = np.full(40, label, np.int32)
        expected = ((np.asarray(jnp.argmax(jnp.asarray(logits), -1)) == label) * weights).sum()
        assert float(losses.correct_predictions(jnp.asarray(logits), labels, weights)) == expected


def test_gradient_accumulation_equals_one_big_batch():
    """k micro-batches give the update of one batch: same summed loss, same gradient step."""
    import flax.linen
    import optax

    from flaxformer_lite import EncoderDecoder, TransformerConfig

    cfg = TransformerConfig(
        vocab_size=20,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        max_len=8,
    )
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(3, 20, (8, 6)), "targets": rng.integers(3, 20, (8, 5))}
    batch["targets"][::3, 3:] = 0  # unequal real-token counts across micro-batches
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    # Any parameter values serve; drawn with numpy on eval_shape's shapes, because an eager
    # model.init dispatches (and compiles) op by op: 9 of this test's 30 CPU seconds.
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"], batch["targets"])
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype),
        flax.linen.meta.unbox(shapes["params"]),
    )
    tx = optax.sgd(1.0)
    state = train.TrainState(
        step=jnp.array(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0)
    )
    results = {}
    for k in (1, 2, 4):
        step = jax.jit(
            functools.partial(
                train.train_step,
                model=model,
                kind="translation",
                tx=tx,
                schedule=lambda s: 1.0,
                label_smoothing=0.1,
                accum_steps=k,
                skip_nonfinite=False,
            )
        )
        new, metrics = step(state, batch)
        results[k] = (new, metrics)
    for k in (2, 4):
        assert float(results[k][1]["count"]) == float(results[1][1]["count"]) == 8 * 5 - 3 * 2
        assert float(results[k][1]["smoothed_kl"]) == pytest.approx(
            float(results[1][1]["smoothed_kl"]), rel=1e-6
        )
        for x, y in zip(
            jax.tree_util.tree_leaves(results[k][0].params),
            jax.tree_util.tree_leaves(results[1][0].params),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(
            jax.tree_util.tree_leaves(results[1][0].params),
            jax.tree_util.tree_leaves(params),
            strict=True,
        )
    ]
    assert max(moved) > 1e-3


def test_nonfinite_loss_stops_with_the_step_and_keeps_last_good_checkpoint(tmp_path):
    config = tiny_config(
        schedule="constant",
        learning_rate=1e30,
        warmup_steps=1,
        log_every=1,
        checkpoint_every=1,
        num_train_steps=30,
        eval_every=0,
    )
    with pytest.raises(FloatingPointError, match=r"at step \d+") as error:
        train.train_and_evaluate(config, str(tmp_path / "stop"))
    failing = int(re.search(r"at step (\d+)", str(error.value)).group(1))
    lines = read_metrics(str(tmp_path / "stop"))
    assert all(np.isfinite(m["train/smoothed_kl"]) for m in lines)
    assert lines and all(m["step"] < failing for m in lines)
    # The checkpoints it keeps: all before the failing step, all with finite parameters and
    # optimizer state (the step of each is the one its directory names).
    kept = finished_steps(tmp_path / "stop" / "checkpoints")
    assert kept and all(s < failing for s in kept), (kept, failing)
    ckpt = Checkpointer(str(tmp_path / "stop" / "checkpoints"), async_save=False)
    for s in kept:
        state, _ = ckpt.restore(step=s)
        assert int(state["step"]) == s
        for leaf in jax.tree_util.tree_leaves((state["params"], state["opt_state"])):
            assert np.isfinite(np.asarray(leaf)).all(), s
    ckpt.close()
    config.skip_nonfinite_steps = True
    config.num_train_steps = 4
    train.train_and_evaluate(config, str(tmp_path / "skip"))
    state, _ = saved_state(tmp_path / "skip")
    assert int(state["step"]) == 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state["params"]))


def test_bad_config_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="task"):
        train.train_and_evaluate(tiny_config(task="vision"), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="mesh_shape"):
        train.train_and_evaluate(tiny_config(mesh_shape=(3, 1, 1)), str(tmp_path / "b"))
    bad_model = tiny_config()
    bad_model.model["num_heads"] = 3
    with pytest.raises(ValueError, match="d_model"):
        train.train_and_evaluate(bad_model, str(tmp_path / "c"))


def test_auto_dtype_resolves_by_backend():
    from flaxformer_lite.data.tasks import Task

    task = Task(kind="synthetic", train=None, eval_batches=[], vocab_size=20,
                target_vocab_size=None, max_len=8)  # fmt: skip
    config = tiny_config()
    config.model["dtype"] = "auto"
    cfg = train.model_config(config, task)
    assert cfg.dtype == ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    assert cfg.param_dtype == "float32" and cfg.vocab_size == 20
