"""A checkpoint that could not be saved or read, said in one line: the step, the file, the cause.

Orbax reports a failed asynchronous save from its background threads by logging each layer's
traceback (five of them, hundreds of lines, for one full disk) before the failure reaches the
caller; :class:`QuietOrbaxFailures` keeps those records off the terminal while a
``Checkpointer`` turns the failure into one :class:`SaveError` instead.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint save or restore that failed; ``str()`` is one line for the user."""


class SaveError(CheckpointError):
    """Saving checkpoint ``step`` in ``directory`` failed (``cause``: e.g. "No space left on
    device"); ``intact`` are the finished steps there, the newest of which a rerun resumes;
    ``stopped_at``: the step boundary where the run stopped, when the train loop knows it."""

    def __init__(
        self,
        step: int | None,
        directory: str,
        cause: str,
        intact: Sequence[int],
        *,
        stopped_at: int | None = None,
    ):
        self.step, self.directory, self.cause, self.intact = step, directory, cause, list(intact)
        self.stopped_at = stopped_at
        which = "a checkpoint" if step is None else f"checkpoint {step}"
        if self.intact:
            kept = ", ".join(map(str, self.intact))
            after = f"intact checkpoints: {kept}; rerun to resume from step {self.intact[-1]}"
        else:
            after = "no checkpoint is intact; rerun to start again from step 0"
        at = "" if stopped_at is None else f" at step {stopped_at}"
        super().__init__(
            f"saving {which} in {directory} failed: {cause}; the run stopped{at}; {after}"
            " (once the cause is fixed)"
        )


class UnreadableCheckpoint(CheckpointError):
    """Checkpoint ``step`` cannot be read: ``file`` (the damaged file, or the folder that holds
    it) and ``cause``."""

    def __init__(self, step: int, file: str, cause: str):
        self.step, self.file, self.cause = step, file, cause
        super().__init__(f"checkpoint {step} cannot be read: {file}: {cause}")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from, outermost first."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def cause_of(error: BaseException) -> str:
    """The short cause of a failed write: the OS error's text where tensorstore names one
    (``[os_error_code='28']`` -> "No space left on device"), else the innermost message's
    first line."""
    for e in _chain(error):
        code = re.search(r"os_error_code='(\d+)'", str(e))
        if code:
            return os.strerror(int(code.group(1)))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
    line = (str(_chain(error)[-1]).strip().splitlines() or [type(error).__name__])[0]
    return line[:300]


def unreadable(step: int, step_dir: str, error: BaseException) -> UnreadableCheckpoint:
    """The :class:`UnreadableCheckpoint` of a restore of ``step_dir`` that raised ``error``.

    Tensorstore names the database folder and the array, not the data file; when it says the
    file is shorter than the range it needs ("not valid for value of size N"), the file of that
    size under the folder is the damaged one.
    """
    messages = [str(e) for e in _chain(error)]
    where = next((m for m in messages if "Error reading" in m or "value of size" in m), None)
    text = where or (messages[-1].strip().splitlines() or [type(error).__name__])[0]
    folder = re.search(r'at local file "([^"]+)"', text)
    size = re.search(r"value of size (\d+)", text)
    file = folder.group(1) if folder else step_dir
    if size and "://" not in file:  # a local folder: cheap to list
        matches = [
            os.path.join(parent, name)
            for parent, _, names in os.walk(file)
            for name in names
            if os.path.getsize(os.path.join(parent, name)) == int(size.group(1))
        ]
        if len(matches) == 1:
            file = matches[0]
    cause = text.rsplit(": ", 1)[-1] if where else text
    if size:
        cause = f"truncated ({cause})"
    return UnreadableCheckpoint(step, file.rstrip("/"), cause[:300])


class QuietOrbaxFailures(logging.Filter):
    """Drops Orbax's error records that carry a traceback (those of a failed background save
    or restore), which the ``Checkpointer`` raises as one :class:`CheckpointError` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
        return not (from_orbax and record.levelno >= logging.ERROR and record.exc_info)


class _QuietOrphans(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records of Orbax's write tasks that a
    failed save left behind (logged when they are garbage collected, up to the exit), and its
    "Task was destroyed but it is pending!" records of those a failed save left waiting (on a
    process of a multi-host run, for the folder another process could not create)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        orphan = any(
            what in message
            for what in ("exception was never retrieved", "Task was destroyed but it is pending")
        )
        return not (orphan and _from_orbax(message, record.exc_info))


def _from_orbax(message: str, exc_info: Any) -> bool:
    """Whether an asyncio record concerns Orbax's work: its message names it, or its exception
    (or one that exception was raised while handling) went through an Orbax file - a write
    future's ``OSError(28, 'No space left on device')`` names no library in its message."""
    if any(w in message for w in ("OCDBT", "orbax", "tensorstore")):
        return True
    error = exc_info[1] if isinstance(exc_info, tuple) else None
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame, _ in traceback.walk_tb(error.__traceback__):
            if f"{os.sep}orbax{os.sep}" in frame.f_code.co_filename:
                return True
        error = error.__cause__ or error.__context__
    return False


def _closed_loop(kind: type, value: BaseException | None) -> bool:
    return kind is RuntimeError and str(value) == "Event loop is closed"


def _orbax_coroutine(unraisable: Any) -> bool:
    """An exception of an Orbax read or write coroutine, garbage collected after the failure it
    belongs to was raised (e.g. the other array reads of a restore that met a truncated file)."""
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and "orbax" in code.co_filename


def quiet_failed_save_leftovers() -> None:
    """Keeps the leftovers of a failed save off the terminal for the rest of the process (the
    failure itself is raised as one SaveError): asyncio's records of Orbax's orphaned write
    tasks, and the "Event loop is closed" RuntimeError that tensorstore reports (as an
    unraisable exception or through ``sys.excepthook``) when a write completes after Orbax
    closed its event loop, or that an Orbax coroutine of a failed save or restore reports when
    it is garbage collected. Idempotent."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietOrphans) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_QuietOrphans())
    if not getattr(sys.excepthook, "quiets_closed_loop", False):
        previous_hook = sys.excepthook

        def excepthook(kind, value, traceback):
            if not _closed_loop(kind, value):
                previous_hook(kind, value, traceback)

        excepthook.quiets_closed_loop = True
        sys.excepthook = excepthook
    if not getattr(sys.unraisablehook, "quiets_closed_loop", False):
        previous_unraisable = sys.unraisablehook

        def unraisablehook(unraisable):
            leftover = _closed_loop(unraisable.exc_type, unraisable.exc_value)
            if not (leftover or _orbax_coroutine(unraisable)):
                previous_unraisable(unraisable)

        unraisablehook.quiets_closed_loop = True
        sys.unraisablehook = unraisablehook
