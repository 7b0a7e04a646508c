"""A run sized to a wall-clock budget (config.time_budget_minutes, training/time_budget.py):
the step count it decides from its pace, a schedule that anneals to zero there, updates
equal to a fixed-step run's, and a resumed run that keeps the decision."""

from __future__ import annotations

import json
import math
import sys

import jax
import numpy as np
import pytest

import train
from flaxformer_lite.training import preflight, time_budget
from flaxformer_lite.training.metrics import read_metrics

from helpers.runs import saved_state
from helpers.tick_clock_main import TickClock
from helpers.tiny_configs import ROOT, load_config

EVAL_EVERY = 6  # the decision comes after this step's evaluation (== warmup_steps)


def tiny_config(**overrides):
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=6, num_eval=16)
    c.model = dict(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    c.update(
        batch_size=16, schedule="cosine", learning_rate=3e-3, warmup_steps=EVAL_EVERY,
        eval_every=EVAL_EVERY, log_every=1, checkpoint_every=100, decode_eval=False,
    )  # fmt: skip
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def flat(workdir) -> list[np.ndarray]:
    state, _ = saved_state(workdir)
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    """A 1-minute budget on a clock of 1 s per reading. Also records, in order, each trace of
    the eval step (what jit runs when it compiles it for a new shape) and each evaluation."""
    workdir = tmp_path_factory.mktemp("budget")
    events = []

    def eval_step(*args, **kwargs):
        events.append("trace eval_step")
        return real_eval_step(*args, **kwargs)

    def evaluate(*args, **kwargs):
        events.append("evaluate")
        return real_evaluate(*args, **kwargs)

    real_eval_step, real_evaluate = train.eval_step, train.evaluate
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "clock", TickClock(1.0))
        patch.setattr(train, "eval_step", eval_step)
        patch.setattr(train, "evaluate", evaluate)
        train.train_and_evaluate(tiny_config(time_budget_minutes=1.0), str(workdir))
    return workdir, json.loads((workdir / time_budget.FILE).read_text()), events


def test_steps_within_the_budget_by_hand():
    # 600 s budget, 100 s spent at step 20, 0.5 s per step: 500 s left buy 1,000 steps.
    assert (
        time_budget.steps_within(
            budget_seconds=600, seconds_spent=100, step=20, seconds_per_step=0.5
        )
        == 1020
    )
    # 499.9 s left at 0.5 s per step: 999 whole steps, not 1,000.
    assert (
        time_budget.steps_within(
            budget_seconds=600, seconds_spent=100.1, step=20, seconds_per_step=0.5
        )
        == 1019
    )
    # A budget already spent ends the run at the step it is at.
    assert (
        time_budget.steps_within(
            budget_seconds=60, seconds_spent=100, step=20, seconds_per_step=0.5
        )
        == 20
    )
    with pytest.raises(ValueError, match="seconds_per_step must be a positive number"):
        time_budget.steps_within(budget_seconds=60, seconds_spent=1, step=1, seconds_per_step=0)


def test_decide_measures_the_pace_after_compilation():
    # Step 1 (compiled) done 5 s in; step 20 done 100 s in: 95 s / 19 steps = 5 s per step;
    # 10 minutes leave 500 s = 100 more steps.
    d = time_budget.decide(minutes=10, step=20, seconds_spent=100, since_step=1, since_seconds=5)
    assert (d.num_train_steps, d.seconds_per_step, d.decided_at) == (120, 5.0, 20)
    with pytest.raises(ValueError, match="must come after since_step"):
        time_budget.decide(minutes=1, step=3, seconds_spent=9, since_step=3, since_seconds=1)


def test_the_run_decides_after_its_first_evaluation_and_stops_there(budget_run):
    workdir, decision, _ = budget_run
    assert decision["decided_at"] == EVAL_EVERY and decision["minutes"] == 1.0
    steps = decision["num_train_steps"]
    # Recompute the count from the recorded measurements by hand: 60 s budget.
    left = 60.0 - decision["seconds_spent"]
    assert steps == EVAL_EVERY + int(left // decision["seconds_per_step"])
    assert EVAL_EVERY + 5 <= steps <= 60, decision  # several steps after warmup, not runaway
    state, _ = saved_state(workdir)
    assert int(state["step"]) == steps
    lines = read_metrics(str(workdir))
    rates = {m["step"]: m["train/learning_rate"] for m in lines if "train/learning_rate" in m}
    assert sorted(rates) == list(range(1, steps + 1))
    # Warmup to the peak at step 6, then cosine decay to zero at the decided last step.
    assert rates[EVAL_EVERY + 1] == pytest.approx(3e-3)
    # optax's cosine over the decay's k = steps - 6 updates; the last update is the k-th.
    k = steps - EVAL_EVERY
    last = 3e-3 * 0.5 * (1 + math.cos(math.pi * (k - 1) / k))
    assert rates[steps] == pytest.approx(last, rel=1e-5)  # optax computes it in float32
    assert all(rates[s + 1] < rates[s] for s in range(EVAL_EVERY + 1, steps))


def test_the_eval_step_compiles_before_the_steps_the_budget_times(budget_run):
    # The pace is measured over the steps up to the first evaluation, that evaluation
    # included: its compilation must come before, with the start-up, or the decision would
    # count a one-time cost as one of every eval_every steps.
    _, _, events = budget_run
    assert "trace eval_step" in events and events.count("evaluate") >= 2, events
    first = events.index("evaluate")
    assert "trace eval_step" not in events[first:], events


def test_a_budgeted_run_equals_a_fixed_step_run_of_its_length(budget_run, tmp_path):
    workdir, decision, _ = budget_run
    fixed = tmp_path / "fixed"
    train.train_and_evaluate(tiny_config(num_train_steps=decision["num_train_steps"]), str(fixed))
    a, b = flat(workdir), flat(fixed)
    assert len(a) == len(b) > 10
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_resumed_run_keeps_the_decided_step_count(budget_run, tmp_path, monkeypatch):
    workdir, decision, _ = budget_run
    steps = decision["num_train_steps"]
    resumed = tmp_path / "resumed"
    config = tiny_config(time_budget_minutes=1.0)
    monkeypatch.setattr(train, "clock", TickClock(1.0))
    train.train_and_evaluate(config, str(resumed), stop_at=EVAL_EVERY + 2)
    assert json.loads((resumed / time_budget.FILE).read_text()) == decision
    # The rerun's clock is ten times faster: deciding again would give a longer run.
    monkeypatch.setattr(train, "clock", TickClock(0.1))
    train.train_and_evaluate(config, str(resumed))
    assert int(saved_state(resumed)[0]["step"]) == steps
    for x, y in zip(flat(workdir), flat(resumed), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_machine_that_slows_after_the_decision_stops_at_the_budget(tmp_path, monkeypatch, capsys):
    """The clock runs three times slower once the step count is decided (a shared host that
    got busy): the run ends where the budget is spent, before the decided step, records it,
    and its updates up to there are a fixed-step run's; a rerun trains no further."""
    clock = TickClock(1.0)
    decide = time_budget.decide

    def deciding(**kwargs):
        decision = decide(**kwargs)
        clock.tick = 3.0
        return decision

    monkeypatch.setattr(train, "clock", clock)
    monkeypatch.setattr(time_budget, "decide", deciding)
    workdir = tmp_path / "slowed"
    config = tiny_config(time_budget_minutes=1.0)
    train.train_and_evaluate(config, str(workdir))
    recorded = json.loads((workdir / time_budget.FILE).read_text())
    stopped, steps = recorded["stopped_at"], recorded["num_train_steps"]
    assert EVAL_EVERY < stopped < steps, recorded
    assert f"time budget 1 min spent at step {stopped} of {steps}: training ends here" in (
        capsys.readouterr().out
    )
    assert int(saved_state(workdir)[0]["step"]) == stopped
    lines = read_metrics(str(workdir))
    assert max(m["step"] for m in lines if "train/learning_rate" in m) == stopped
    assert any(m["step"] == stopped and "eval/smoothed_kl" in m for m in lines)

    # The same updates as the fixed-step run of the decided length, interrupted there.
    fixed = tmp_path / "fixed"
    train.train_and_evaluate(tiny_config(num_train_steps=steps), str(fixed), stop_at=stopped)
    for x, y in zip(flat(workdir), flat(fixed), strict=True):
        np.testing.assert_array_equal(x, y)

    # A rerun on a fast clock: nothing more to train, the record unchanged.
    monkeypatch.setattr(train, "clock", TickClock(0.01))
    train.train_and_evaluate(config, str(workdir))
    assert int(saved_state(workdir)[0]["step"]) == stopped
    assert json.loads((workdir / time_budget.FILE).read_text()) == recorded


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(time_budget_minutes=-1.0),
            r"config.time_budget_minutes must be a number in \(0, inf\) \(None or 0 = off\); "
            r"got -1.0",
        ),
        (
            dict(time_budget_minutes=5.0, eval_every=0),
            "config.eval_every must be a positive integer with config.time_budget_minutes",
        ),
        (
            dict(time_budget_minutes=5.0, eval_every=50, warmup_steps=10),
            r"config.eval_every \(50\) must be <= config.warmup_steps \(10\) with "
            r"config.time_budget_minutes and the cosine schedule",
        ),
        (
            dict(time_budget_minutes=5.0, eval_every=50, warmup_steps=10, schedule="linear"),
            r"config.eval_every \(50\) must be <= config.warmup_steps \(10\) with "
            r"config.time_budget_minutes and the linear schedule",
        ),
    ],
)
def test_bad_budget_settings_name_the_field(overrides, message):
    with pytest.raises(preflight.ConfigError, match=message):
        preflight.check_config(tiny_config(**overrides))


def test_noam_and_constant_schedules_take_any_evaluation_cadence():
    for schedule in ("noam", "constant"):
        preflight.check_config(
            tiny_config(time_budget_minutes=5.0, schedule=schedule, eval_every=50, warmup_steps=10)
        )


def test_zero_on_the_command_line_turns_the_budget_off(tmp_path):
    """configs/multi30k.py has a budget; the documented way to train a fixed step count
    instead is --config.time_budget_minutes=0 (a flag cannot write None). Parsed by the
    flag parser train.py uses, it trains exactly num_train_steps and decides nothing."""
    from absl import flags
    from ml_collections import config_flags

    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values)
    argv = ["train.py", "--config", str(ROOT / "configs" / "multi30k.py"),
            "--config.time_budget_minutes=0", "--config.num_train_steps=3800"]  # fmt: skip
    saved_argv, sys.argv = sys.argv, argv  # config_flags finds the overrides in sys.argv
    try:
        preflight.parse_flags(argv, values)
    finally:
        sys.argv = saved_argv
    assert values.config.time_budget_minutes == 0.0
    assert time_budget.budget_minutes(values.config) is None
    preflight.check_config(values.config)  # also: eval_every unconstrained without a budget

    config = tiny_config(time_budget_minutes=0.0, num_train_steps=EVAL_EVERY + 3)
    train.train_and_evaluate(config, str(tmp_path))
    assert int(saved_state(tmp_path)[0]["step"]) == EVAL_EVERY + 3
    assert not (tmp_path / time_budget.FILE).exists()
