"""The asyncio records a failed Orbax save leaves behind are kept off the terminal, and nothing
else is: a write future's OSError names no library in its message, only its traceback does."""

from __future__ import annotations

import logging
import os
import sys

from flaxformer_lite.core.checkpoint_errors import _QuietOrphans


def _raised_in(filename: str) -> tuple:
    """exc_info of an OSError raised by code compiled as ``filename``, while handling another
    (as Orbax's write re-raises the ENOSPC of ``write_text``)."""
    code = compile(
        "def write():\n"
        "    try:\n"
        "        raise OSError(28, 'No space left on device')\n"
        "    except OSError:\n"
        "        raise OSError(28, 'No space left on device')\n",
        filename,
        "exec",
    )
    scope: dict = {}
    exec(code, scope)
    try:
        scope["write"]()
    except OSError:
        return sys.exc_info()
    raise AssertionError("write() did not raise")


def _record(message: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, message, (), exc_info)


ORPHAN = "Future exception was never retrieved\nfuture: <Future finished exception=OSError(28)>"
ORBAX_FILE = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "async_path.py")


def test_an_orphaned_write_future_of_orbax_is_dropped():
    assert not _QuietOrphans().filter(_record(ORPHAN, _raised_in(ORBAX_FILE)))


def test_the_same_record_from_other_code_is_kept():
    assert _QuietOrphans().filter(_record(ORPHAN, _raised_in("/work/app/writer.py")))
    assert _QuietOrphans().filter(_record(ORPHAN))


def test_orbax_records_that_are_not_orphans_are_kept():
    error = _raised_in(ORBAX_FILE)
    assert _QuietOrphans().filter(_record("Unhandled error in save", error))


def test_an_orphan_named_by_its_message_is_dropped_without_a_traceback():
    message = "Task was destroyed but it is pending!\ntask: <Task pending coro=<_write() OCDBT>>"
    assert not _QuietOrphans().filter(_record(message))
