"""What a run does when a checkpoint fails it, with the same answer on every process.

* A save that failed (a full disk): ``save_failed`` answers at every step boundary whether
  to stop; the loop then raises the ``SaveError`` (one line: the step, the directory, the
  cause, the intact checkpoints) without saving or logging the steps the failed save held.
* A checkpoint that cannot be read (a truncated file): ``restore_for_resume`` says so in one
  line, falls back to the newest readable step with one WARNING line, or restores the step
  the user names (``config.restore_step``); the newer steps are set aside, not deleted, so
  the run can write them again.

Multi-host: a save failure is agreed at the loop's sync points (every process stops at the
same step), and every process checks a checkpoint before any restores it, taking the newest
step that all of them can read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flaxformer_lite.core.checkpoint_errors import CheckpointError, SaveError, UnreadableCheckpoint
from flaxformer_lite.core.checkpoints import Checkpointer, check_readable

SET_ASIDE = "checkpoints-set-aside"  # next to checkpoints/: steps a resume went back before


def _processes_where_false(flag: bool) -> list[int]:
    """The indices of the processes where ``flag`` does not hold (a collective when there
    are several)."""
    if jax.process_count() == 1:
        return [] if flag else [0]
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.int32(flag))).reshape(-1)
    return [int(i) for i in np.flatnonzero(flags == 0)]


def _all_processes(flag: bool) -> bool:
    """Whether ``flag`` holds on every process (a collective when there are several)."""
    return not _processes_where_false(flag)


def save_failed(checkpointer: Checkpointer, *, sync_point: bool) -> bool:
    """Whether a checkpoint save of this run has failed, so the run must stop now.

    One process asks without waiting at every step. Several processes ask only at the loop's
    sync points (the same steps on every process), where they agree: a save that failed on
    any of them stops all of them at that step.
    """
    if jax.process_count() == 1:
        return checkpointer.save_failure() is not None
    if not sync_point:
        return False
    return not _all_processes(checkpointer.save_failure() is None)


def raise_save_failure(checkpointer: Checkpointer, step: int) -> None:
    """Raises this run's SaveError (on a process whose own saves succeeded: the other's),
    saying that the run stopped at ``step``, the step boundary where the loop saw it."""
    failure = checkpointer.save_failure()
    if failure is None:
        failure = SaveError(
            None, checkpointer.directory, "it failed on another process", checkpointer.all_steps()
        )
    raise SaveError(
        failure.step, failure.directory, failure.cause, failure.intact, stopped_at=step
    ) from None


def restore_for_resume(
    checkpointer: Checkpointer,
    abstract_state: Any,
    *,
    restore_step: int | None,
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> tuple[Any, dict] | None:
    """(state, data state) of the step to resume from; None when there is no checkpoint.

    The newest step that can be read, or ``restore_step`` when given. Each unreadable step is
    ``warn``-ed in one line naming its file; resuming from an older step than the newest is
    ``warn``-ed in one WARNING line; the newer steps move to ``checkpoints-set-aside/``.

    Raises:
      ValueError: ``restore_step`` is not one of the steps kept (the message lists them).
      CheckpointError: the step named, or every step kept, cannot be read.
    """
    steps = checkpointer.all_steps()
    if not steps:
        return None
    directory = checkpointer.directory
    if restore_step is not None and restore_step not in steps:
        raise ValueError(
            f"config.restore_step={restore_step}: no checkpoint of that step in {directory}; "
            f"valid steps: {', '.join(map(str, steps))}"
        )
    candidates = [restore_step] if restore_step is not None else sorted(steps, reverse=True)
    for step in candidates:
        try:
            restored = _restore_everywhere(checkpointer, abstract_state, step)
        except UnreadableCheckpoint as e:
            warn(str(e))
            if restore_step is not None:
                others = ", ".join(str(s) for s in steps if s != step) or "none"
                raise CheckpointError(
                    f"config.restore_step={step} cannot be read; the other steps kept: {others}"
                ) from None
            continue
        newer = [s for s in steps if s > step]
        if newer:
            folder = os.path.join(os.path.dirname(directory.rstrip("/")), SET_ASIDE)
            checkpointer.set_aside(newer, folder)
            why = "as config.restore_step asks" if restore_step is not None else "the newest"
            if restore_step is None:
                why += " readable checkpoint"
            warn(
                f"WARNING: resuming from step {step} ({why}), not from step {steps[-1]}: steps "
                f"{step + 1}-{steps[-1]} are trained again; checkpoints "
                f"{', '.join(map(str, newer))} moved to {folder}"
            )
        log(f"resumed from step {step} ({directory})")
        return restored
    raise CheckpointError(
        f"no checkpoint in {directory} can be read (steps {', '.join(map(str, steps))}); "
        "restore them, or move the folder aside to start again from step 0"
    )


def _restore_everywhere(checkpointer: Checkpointer, abstract_state: Any, step: int):
    """Restores ``step``. Several processes first check that each of them can read it and
    agree (Orbax's restore ends in a barrier that a process which failed would never reach)."""
    if jax.process_count() > 1:
        problem = check_readable(checkpointer.directory, step)
        unable = _processes_where_false(problem is None)
        if unable:  # a process's own finding names the file; the others name the processes
            where = "process" + ("es " if len(unable) > 1 else " ") + ", ".join(map(str, unable))
            raise problem or UnreadableCheckpoint(
                step,
                os.path.join(checkpointer.directory, str(step)),
                f"unreadable on {where} of {jax.process_count()}",
            )
    return checkpointer.restore(abstract_state, step=step)
