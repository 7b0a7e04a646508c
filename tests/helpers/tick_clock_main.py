"""Runs a script as ``__main__`` on a clock that advances a fixed tick at every reading.

    python tick_clock_main.py TICK PYTHON SCRIPT ARGS...

``time.perf_counter`` becomes a clock that moves ``TICK`` seconds each time anything reads
it, so train.py's loop timer (``train.clock``, bound to ``time.perf_counter`` at import) sees
seconds set by the number of readings, not by the machine. ``PYTHON`` (the interpreter a
command line names, as ``helpers.runs.run_train`` builds it after a prefix) is skipped: the
script runs in this interpreter. Two processes of one run on different ticks would decide
different time-budget step counts from their own clocks; tests/training/test_sharding.py
checks that both follow process 0's.
"""

from __future__ import annotations

import runpy
import sys
import time


class TickClock:
    """A clock that advances ``tick`` seconds at every reading: the budget's arithmetic
    sees the same numbers on every machine (also train.clock's stand-in in-process)."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


if __name__ == "__main__":
    tick, script = float(sys.argv[1]), sys.argv[3]
    sys.argv = sys.argv[3:]
    time.perf_counter = TickClock(tick)
    runpy.run_path(script, run_name="__main__")
