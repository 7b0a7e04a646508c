"""SaveBarrier on an in-memory key-value store with the client's interface, two processes as
two threads: a barrier both reach returns on both; a process that goes from its save's start
straight to the save's end (its write failed) releases the other from the barrier after the
write at once, where Orbax's barrier would wait out its timeout; a process that never comes
times out."""

from __future__ import annotations

import threading
import time

import pytest

from flaxformer_lite.core.save_barrier import SAVE_END, SaveBarrier, SkippedBarrier

WRITE_DONE_KEY = "async_write_complete.18.orbax-checkpoint-tmp-1"


class Store:
    """``key_value_set`` / ``key_value_try_get`` as jax.distributed's client has them."""

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def in_thread(fn):
    """Runs ``fn`` in a thread; returns a callable giving (result or exception, seconds)."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            out["result"] = fn()
        except Exception as e:
            out["result"] = e
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    return lambda: (thread.join(10), out["result"], out["seconds"])[1:]


def barriers():
    store = Store()
    return [SaveBarrier(store, i, 2, "test", poll_s=0.001) for i in range(2)]


def test_a_barrier_both_reach_returns_on_both_each_time():
    zero, one = barriers()
    for key in (SAVE_END, SAVE_END, WRITE_DONE_KEY):  # a key used twice is two barriers
        results = [in_thread(lambda b=b, key=key: b(key=key, timeout_ms=5000)) for b in (zero, one)]
        assert [r()[0] for r in results] == [None, None]


def test_a_process_that_skipped_the_write_barrier_releases_the_other_at_once():
    zero, one = barriers()
    starts = [in_thread(lambda b=b: b(key=SAVE_END, timeout_ms=5000)) for b in (zero, one)]
    assert [s()[0] for s in starts] == [None, None]  # the save's start, on both
    # Process 1 wrote and waits for process 0, whose write failed: it goes to the save's end.
    waiting = in_thread(lambda: one(key=WRITE_DONE_KEY, timeout_ms=60_000))
    time.sleep(0.05)
    ending = in_thread(lambda: zero(key=SAVE_END, timeout_ms=5000))
    error, seconds = waiting()
    assert isinstance(error, SkippedBarrier) and str(error) == "the save failed on process 0"
    assert seconds < 5  # not the 60 s timeout
    # Process 1 goes to the save's end too: both leave it.
    assert one(key=SAVE_END, timeout_ms=5000) is None
    assert ending()[0] is None


def test_a_process_that_never_comes_times_out_naming_it():
    zero, _ = barriers()
    with pytest.raises(TimeoutError, match=r"barrier x: process 1 did not arrive within 0 s"):
        zero(key="x", timeout_ms=50)
