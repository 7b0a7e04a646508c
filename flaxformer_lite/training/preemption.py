"""Stopping a run at a step boundary with a checkpoint: a preemption notice (SIGTERM) or the
user's first Ctrl-C (SIGINT), with the same answer on every process of the run.

train.py asks ``Preemption.reached`` after every step; when it answers True, the loop prints
``notice(step)``, saves that step and returns, and the process exits 0: the checkpoint is
safely written, so rerunning the command resumes. A second Ctrl-C raises KeyboardInterrupt
at once (train.py turns it into one line and exit status 130).
"""

from __future__ import annotations

import os
import signal
import threading

import jax


class Preemption:
    """Answers, at each step boundary, whether a preemption notice (SIGTERM) or a first Ctrl-C
    means "save this step and stop", with the same answer on every process of the run.

    Under ``jax.distributed`` the runtime decides. ``jax.distributed.initialize`` installs a C++
    SIGTERM handler on every process (its preemption notifier); a notice on any one process
    goes through the coordination service to all of them, each reports the last counter it
    passed to ``multihost_utils.reached_preemption_sync_point``, and the sync point is the
    largest plus one, which every process then reaches at the same step. Asking is a local
    lock and compare (0.65 us a call measured on a CPU; no collective), so the loop asks at
    every step. The counter is the number of steps this run has done (1, 2, ...): the runtime
    starts every process at 0, so a notice that arrives before the first step (data loading,
    compilation) stops the run after its first step rather than at a step a resumed run has
    already passed. Orbax's own calls are switched off (``checkpoints._Manager``).

    A Python ``signal.signal(SIGTERM, ...)`` would replace that C++ handler (only the signalled
    process would ever know), so none is installed then, and none is restored at the end.
    Without ``jax.distributed`` (one process), a Python handler sets a flag instead.

    Ctrl-C joins the same path: the first SIGINT is turned into this process's own SIGTERM
    (under ``jax.distributed``: the runtime's notifier sees it and every process stops at the
    same sync point) or sets the same flag; a second SIGINT raises KeyboardInterrupt. Where
    SIGTERM cannot stop the run cleanly (the preemption service switched off on several
    processes), Ctrl-C keeps Python's default.
    """

    def __init__(self) -> None:
        from jax.experimental import multihost_utils

        self._sync = multihost_utils.reached_preemption_sync_point
        self._signalled = False
        self._interrupts = 0  # SIGINTs received
        self._previous = None
        self._previous_sigint = None
        self.synced = jax.distributed.is_initialized()
        if self.synced:
            try:
                self._sync(0)  # the runtime's initial counter: nothing done yet
            except RuntimeError as e:  # jax_enable_preemption_service=False
                self.synced = False
                if jax.process_count() > 1:
                    print(f"warning: {e}; SIGTERM will end this process without a checkpoint")
                    return
        if not self.synced:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, *_) -> None:
        self._signalled = True

    def _on_sigint(self, *_) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        if self.synced:
            os.kill(os.getpid(), signal.SIGTERM)  # the runtime's notifier: every process stops
        else:
            self._signalled = True

    def reached(self, steps_done: int) -> bool:
        """Whether to save and stop after this run's ``steps_done``-th step (every process
        must ask at every step, in order)."""
        return self._sync(steps_done) if self.synced else self._signalled

    def notice(self, step: int) -> str:
        """The line the loop prints when it stops to save ``step``."""
        if self._interrupts:
            return f"Ctrl-C: saving step {step}; rerun to resume (Ctrl-C again to abort)"
        return f"SIGTERM: saving step {step}; rerun to resume"

    def close(self) -> None:
        """Restores the handlers it replaced (a Ctrl-C while the last save is written then
        aborts, as the second one would)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None
