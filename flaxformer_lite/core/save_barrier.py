"""The barrier of Orbax's asynchronous multi-host saves, given up when a process skipped it.

Orbax's own barrier waits for every process up to its timeout (20 minutes). A process whose
write fails (a full disk) skips the barrier that follows the write (``async_write_complete``)
and goes on to the one that ends the save (``set_value_start`` of ``set(False)``): without
this, the processes whose writes succeeded wait there the whole timeout before anyone says
that the save failed. This barrier, on the same key-value store, sees it: a process waiting
after its write while another already stands at the end of that save raises at once, so every
process ends the save failed within moments, and the train loop stops them all at one step.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

WRITE_DONE = "async_write_complete"  # after a process's writes, before the commit
SAVE_END = "ThreadSaveMultiHostValueHolder:set_value_start"  # save start, and its end

_instances = itertools.count()  # one namespace per Checkpointer, the same on every process


class SkippedBarrier(RuntimeError):
    """Another process ended the save without reaching the barrier after its write: its
    write failed."""


class SaveBarrier:
    """``AsyncOptions.barrier_sync_fn``: ``barrier(key=..., timeout_ms=...)`` returns once
    every process has called it with ``key`` as many times.

    Raises:
      SkippedBarrier: waiting at a ``WRITE_DONE`` barrier, another process has reached the
        ``SAVE_END`` barrier of that save.
      TimeoutError: a process did not arrive within ``timeout_ms``.
    """

    def __init__(
        self, client: Any, process_index: int, process_count: int, namespace: str, poll_s=0.02
    ):
        self._client, self._index, self._count = client, process_index, process_count
        self._namespace = namespace  # the same on every process, its own per barrier
        self._calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # the main thread and Orbax's finalize thread call it
        self._poll_s = poll_s

    @classmethod
    def for_this_run(cls) -> SaveBarrier:
        """The barrier on ``jax.distributed``'s key-value store."""
        import jax
        from jax._src import distributed

        client, namespace = distributed.global_state.client, f"save_barrier/{next(_instances)}"
        return cls(client, jax.process_index(), jax.process_count(), namespace)

    def _arrived(self, key: str, process: int) -> bool:
        try:
            self._client.key_value_try_get(f"{key}/{process}")
        except Exception:  # not there yet (NOT_FOUND)
            return False
        return True

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        with self._lock:
            self._calls[key] += 1
            here = f"{self._namespace}/{key}/{self._calls[key]}"
            # A process at this save's end has called SAVE_END once more than this one has.
            end = f"{self._namespace}/{SAVE_END}/{self._calls[SAVE_END] + 1}"
        self._client.key_value_set(f"{here}/{self._index}", "1")
        deadline = time.monotonic() + timeout_ms / 1000
        waiting = [p for p in range(self._count) if p != self._index]
        while True:
            waiting = [p for p in waiting if not self._arrived(here, p)]
            if not waiting:
                return
            if key.endswith(WRITE_DONE) or f"{WRITE_DONE}." in key:
                skipped = [p for p in waiting if self._arrived(end, p)]
                if skipped:
                    raise SkippedBarrier(
                        f"the save failed on process {', '.join(map(str, skipped))}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"barrier {key}: process {', '.join(map(str, waiting))} did not arrive "
                    f"within {timeout_ms / 1000:.0f} s"
                )
            time.sleep(self._poll_s)
