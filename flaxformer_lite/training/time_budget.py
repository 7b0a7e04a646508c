"""A run sized to a wall-clock budget instead of a step count (``config.time_budget_minutes``).

The learning-rate schedule must know where it ends (cosine decays to zero at the last step),
so the run decides its step count once, early, from its own measured pace:

1. It trains with the configured schedule until its first evaluation after the first
   (compiling) step. Only warmup steps may come before that point (``preflight`` requires
   ``eval_every <= warmup_steps`` for the cosine and linear schedules), and warmup does not
   depend on the last step: those updates are bit for bit those of a fixed-step run.
2. There it measures the seconds per step since the first step compiled, evaluations,
   logging and checkpoint saves included (they recur at the same cadence; train.py compiles
   the eval step before the first step, so that its one-time compilation is not counted as a
   recurring cost), and the seconds already spent since the run started (data, vocabulary,
   compilation), and sets ``num_train_steps = step + (budget - spent) // seconds_per_step``.
3. The decision is written to ``time_budget.json`` in the workdir; a resumed run reads it
   back, so an interrupted run ends at the same step, and its updates equal those of an
   uninterrupted run (and of a fixed-step run with that ``num_train_steps``).

A slower machine therefore trains fewer steps but still anneals to zero at the end of the
hour. Time spent before the decision in an earlier, interrupted process is not counted.

4. A machine that slows down after the decision (other work, thermal limits, a shared host:
   one hour run here measured 0.444 s/step at step 250 and averaged 0.471) would overrun the
   budget. At every later sync point (log, checkpoint, evaluation) the run compares its clock
   with the budget; once it is spent, training ends at that step (checkpoint and final
   evaluation as usual) and ``stopped_at`` is recorded, so a rerun trains no further. The
   schedule is left as decided: the rate is then already near zero (cosine: under 1% of
   its peak in the last 5% of the steps), and every update up to the stop equals a fixed-step
   run's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from flaxformer_lite.core import paths

FILE = "time_budget.json"


def budget_minutes(config) -> float | None:
    """``config.time_budget_minutes``, or None when the run has no budget: the field unset
    (None) or 0, which is how a command line turns it off (``--config.time_budget_minutes=0``:
    ml_collections cannot set a float field to None from a flag)."""
    minutes = config.get("time_budget_minutes")
    return None if minutes is None or minutes == 0 else minutes


@dataclasses.dataclass(frozen=True)
class Decision:
    """The step count a budgeted run chose, and the measurements it chose it from."""

    minutes: float  # config.time_budget_minutes
    decided_at: int  # the step after whose evaluation it was decided
    seconds_spent: float  # since the run (this process) started, at that point
    seconds_per_step: float  # measured since the first step compiled, overheads included
    num_train_steps: int
    stopped_at: int | None = None  # the budget ran out at this step, before num_train_steps

    @property
    def last_step(self) -> int:
        """The step training ends at: ``stopped_at`` if the budget ran out first."""
        return self.num_train_steps if self.stopped_at is None else self.stopped_at

    def line(self) -> str:
        return (
            f"time budget {self.minutes:g} min: {self.num_train_steps} steps "
            f"({self.seconds_per_step:.3f} s/step measured up to step {self.decided_at}, "
            f"{self.seconds_spent:.0f} s spent by then)"
        )


def spent_line(decision: Decision, learning_rate: float) -> str:
    """What the run prints when the budget runs out before the decided last step."""
    return (
        f"time budget {decision.minutes:g} min spent at step {decision.stopped_at} of "
        f"{decision.num_train_steps}: training ends here (learning rate {learning_rate:.3g})"
    )


def steps_within(
    *, budget_seconds: float, seconds_spent: float, step: int, seconds_per_step: float
) -> int:
    """The last step a run at ``step`` after ``seconds_spent`` seconds reaches within
    ``budget_seconds`` at ``seconds_per_step`` (never below ``step``: a budget already
    spent ends the run at once)."""
    if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
        raise ValueError(f"seconds_per_step must be a positive number; got {seconds_per_step!r}")
    left = budget_seconds - seconds_spent
    return step + max(0, math.floor(left / seconds_per_step))


def decide(
    *,
    minutes: float,
    step: int,
    seconds_spent: float,
    since_step: int,
    since_seconds: float,
) -> Decision:
    """The decision at ``step`` (after its evaluation), ``seconds_spent`` into the run, with
    the pace measured from ``since_step`` reached at ``since_seconds`` into the run."""
    if step <= since_step:
        raise ValueError(f"step ({step}) must come after since_step ({since_step})")
    per_step = (seconds_spent - since_seconds) / (step - since_step)
    total = steps_within(
        budget_seconds=60.0 * minutes,
        seconds_spent=seconds_spent,
        step=step,
        seconds_per_step=per_step,
    )
    return Decision(minutes, step, seconds_spent, per_step, total)


def read(workdir: str) -> Decision | None:
    """The workdir's decision (None: not decided yet)."""
    path = paths.resolve(os.path.join(workdir, FILE))
    if not path.is_file():
        return None
    return Decision(**json.loads(path.read_text()))


def write(workdir: str, decision: Decision) -> None:
    """Writes ``decision`` atomically (a crash leaves the old file or none)."""
    text = json.dumps(dataclasses.asdict(decision), indent=2) + "\n"
    paths.write_atomic(os.path.join(workdir, FILE), text)
