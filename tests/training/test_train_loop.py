"""The train loop's bookkeeping: which lines metrics.jsonl gets, what tokens/s times, how a
skipped non-finite step moves the counters, and which checkpoint steps a workdir offers."""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite import DecoderOnly, TransformerConfig  # noqa: E402
from flaxformer_lite.core import checkpoints
from flaxformer_lite.training import optim
from flaxformer_lite.training.metrics import read_metrics  # noqa: E402

SLOW = 1e6  # fake seconds that each compilation, evaluation and checkpoint save takes


class FakeClock:
    """``time.perf_counter`` plus ``SLOW`` seconds for every ``slow`` event so far."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.events: list[str] = []

    def __call__(self) -> float:
        return time.perf_counter() + self.offset

    def slow(self, what: str) -> None:
        self.offset += SLOW
        self.events.append(what)


def tiny_config(**overrides):
    spec = importlib.util.spec_from_file_location("default", ROOT / "configs" / "default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.synthetic.update(min_len=2, max_len=6, num_eval=16)
    c.model = dict(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    """A 12-step run with lines every 4 steps, checkpoints every 3 and evaluations every 6,
    whose compilations, evaluations and checkpoint saves each take ``SLOW`` fake seconds."""
    workdir = tmp_path_factory.mktemp("slow_run")
    config = tiny_config(
        batch_size=16, num_train_steps=12, log_every=4, checkpoint_every=3, eval_every=6,
        warmup_steps=2, learning_rate=3e-3, decode_eval=False,
    )  # fmt: skip
    clock = FakeClock()
    step, evaluate, save = train.train_step, train.evaluate, train.save_checkpoint

    def traced_step(*args, **kwargs):  # Python runs the body only while jit traces it
        clock.slow("compile")
        return step(*args, **kwargs)

    def slow_evaluate(*args, **kwargs):
        clock.slow("evaluate")
        return evaluate(*args, **kwargs)

    def slow_save(*args, **kwargs):
        clock.slow("save")
        return save(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "clock", clock)
        patch.setattr(train, "train_step", traced_step)
        patch.setattr(train, "evaluate", slow_evaluate)
        patch.setattr(train, "save_checkpoint", slow_save)
        train.train_and_evaluate(config, str(workdir))
    return workdir, clock, read_metrics(str(workdir))


def test_lines_come_at_log_steps_and_evaluations_only(slow_run):
    workdir, clock, lines = slow_run
    assert sorted(clock.events) == ["compile"] + ["evaluate"] * 2 + ["save"] * 4
    # Checkpoints at 3, 6, 9 and the last step (the last 3 kept) add no line of their own.
    assert checkpoints.finished_steps(workdir / "checkpoints") == [6, 9, 12]
    assert [m["step"] for m in lines if "train/smoothed_kl" in m] == [4, 8, 12]
    assert [m["step"] for m in lines if "eval/smoothed_kl" in m] == [6, 12]
    assert len(lines) == 5  # nothing else
    for m in lines:
        assert "train/loss" not in m and "eval/loss" not in m  # named for what they are


def test_tokens_per_second_excludes_compilation_evaluation_and_saving(slow_run):
    _, _, lines = slow_run
    train_lines = [m for m in lines if "train/smoothed_kl" in m]
    for m in train_lines:
        # A window holds at most 4 steps of 16 rows of at most 7 tokens (448 tokens), so one
        # slow event inside its timing would bring it under 448 / SLOW < 0.001 tokens/s.
        assert m["train/tokens_per_second"] > 1.0, m
        assert 0.0 < m["train/mfu"] < 1.0, m


def _lm_setup():
    cfg = TransformerConfig(
        vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1, max_len=8,
        dropout_rate=0.0,
    )  # fmt: skip
    model = DecoderOnly(cfg)
    batch = {"targets": jnp.asarray(np.random.default_rng(0).integers(3, 16, (4, 6)), jnp.int32)}
    params = model.init(jax.random.key(0), batch["targets"])["params"]
    return model, batch, params


def test_a_skipped_step_keeps_the_values_and_advances_every_counter():
    model, batch, params = _lm_setup()
    # The update at count 1 has an infinite rate: loss and gradient are finite, the new
    # parameters are not, so the step is skipped.
    schedule = lambda count: jnp.where(count == 1, jnp.inf, 1e-2 * (count + 1.0))  # noqa: E731
    tx = optim.make_optimizer("adam", schedule, grad_clip_norm=1.0)
    step = jax.jit(
        functools.partial(
            train.train_step, model=model, kind="lm", tx=tx, schedule=schedule,
            label_smoothing=0.1, accum_steps=1, skip_nonfinite=True,
        )
    )  # fmt: skip
    states = [
        train.TrainState(
            step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
            rng=jax.random.PRNGKey(0),
        )
    ]  # fmt: skip
    logged = []
    for _ in range(3):
        new, metrics = step(states[-1], batch)
        states.append(new)
        logged.append(jax.device_get(metrics))
    assert [bool(m["finite"]) for m in logged] == [True, False, True]
    # Step 2's loss and gradient were finite: its new parameters made it non-finite.
    assert np.isfinite(logged[1]["smoothed_kl"]) and np.isfinite(logged[1]["grad_norm"])
    assert bool(train.all_finite(params)) and not bool(train.all_finite([jnp.array([1, np.nan])]))

    def split(state):
        leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
        ints = [int(x) for x in leaves if jnp.issubdtype(x.dtype, jnp.integer)]
        return ints, [np.asarray(x) for x in leaves if not jnp.issubdtype(x.dtype, jnp.integer)]

    for k, state in enumerate(states):
        counts, _ = split(state)
        # Adam's count and the schedule's count: both equal the state's step.
        assert int(state.step) == k and counts == [k, k], (k, counts)
    _, before = split(states[1])
    _, after_skip = split(states[2])
    for x, y in zip(before, after_skip, strict=True):  # parameters and moments kept
        np.testing.assert_array_equal(x, y)
    _, after = split(states[3])
    assert max(np.abs(x - y).max() for x, y in zip(after_skip, after, strict=True)) > 1e-4
    # The logged rate is the one each update used: schedule(step) with count == step.
    assert [float(m["learning_rate"]) for m in logged] == [
        float(schedule(jnp.float32(k))) for k in range(3)
    ]


def test_choose_steps_finds_the_latest_a_given_and_averaged_steps(tmp_path):
    directory = tmp_path / "checkpoints"
    ckpt = checkpoints.Checkpointer(str(directory), keep=5, async_save=False)
    for s in (10, 20, 30):
        ckpt.save(s, {"w": jnp.full((2,), float(s))}, {"train": {"index": s}})
    ckpt.close()
    (directory / "40.orbax-checkpoint-tmp-1").mkdir()  # a save a killed run left unfinished
    assert checkpoints.choose_steps(str(directory)) == [30]
    assert checkpoints.choose_steps(str(directory), step=20) == [20]
    assert checkpoints.choose_steps(str(directory), average=2) == [20, 30]
    assert checkpoints.choose_steps(str(directory), step=20, average=2) == [10, 20]
    with pytest.raises(FileNotFoundError, match=r"step 25 .*\[10, 20, 30\]"):
        checkpoints.choose_steps(str(directory), step=25)
    with pytest.raises(ValueError, match=r"average=3 needs 3 checkpoints .*\[10, 20\]"):
        checkpoints.choose_steps(str(directory), step=20, average=3)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="average must be a positive int"):
            checkpoints.choose_steps(str(directory), average=bad)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {tmp_path / 'none'}"):
        checkpoints.choose_steps(str(tmp_path / "none"))
