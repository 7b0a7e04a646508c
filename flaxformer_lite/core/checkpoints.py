"""Orbax checkpoints of the train state plus the data position, atomic and resumable.

Orbax writes each step into a temporary directory and renames it when complete (on ``gs://``,
which has no rename, it writes ``commit_success.txt`` last instead), so a run killed mid-save
leaves the previous checkpoint intact; the unfinished step is ignored on restart. Saving is
asynchronous: training continues while the arrays are written. The directory may be local or a
``gs://`` URI (tensorstore writes the arrays there directly). ``choose_steps`` finds the
steps a reader loads: the latest finished one, a given one, or the last few for averaging.

A failed save (a full disk) is raised as one ``checkpoint_errors.SaveError`` at the next
``save``, ``wait`` or ``close`` (or seen without waiting through ``save_failure``), and its
partial directory is removed; a checkpoint that cannot be read raises ``UnreadableCheckpoint``
naming the step and the file.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.core.checkpoint_errors import (
    QuietOrbaxFailures,
    SaveError,
    UnreadableCheckpoint,
    cause_of,
    quiet_failed_save_leftovers,
    unreadable,
)
from flaxformer_lite.core.save_barrier import SaveBarrier


class _Manager(ocp.CheckpointManager):
    """A CheckpointManager that leaves the preemption sync point to the train loop.

    Orbax asks ``multihost_utils.reached_preemption_sync_point`` itself, from ``save`` and from
    the background thread that finalizes an asynchronous save (primary host only), passing the
    checkpoint's step. The runtime keeps only the last value passed per process and reports it
    when a preemption notice arrives; these calls would overwrite the train loop's counter at
    moments that differ between processes, so the processes could disagree on the sync point.
    """

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


class Checkpointer:
    """Keeps the last ``keep`` checkpoints of ``{"state": pytree, "data": json dict}`` in
    ``directory``; all processes of a multi-host run call every method."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True) -> None:
        self.directory = str(paths.resolve(directory))  # local: absolute; gs://: as is
        paths.refresh(self.directory)  # see the steps other processes wrote until now
        # Several processes: a barrier that a process whose write failed does not leave the
        # others waiting at for Orbax's 20-minute timeout (save_barrier.py).
        async_options = None
        if jax.process_count() > 1:
            async_options = ocp.AsyncOptions(barrier_sync_fn=SaveBarrier.for_this_run())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            async_options=async_options,
        )
        self._manager = _Manager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
            },
        )
        self._last_saved: int | None = None
        self._failure: SaveError | None = None
        self._quiet = QuietOrbaxFailures()  # a failed save is raised once, as one SaveError
        logging.getLogger("absl").addFilter(self._quiet)
        quiet_failed_save_leftovers()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Saves ``step`` unless it is already saved (or being saved); returns whether it did.

        Raises:
          SaveError: this save, or the asynchronous one before it, failed.
        """
        self._finish()  # a failure of the save in flight belongs to its step, not this one
        if step == self._last_saved or step in self.all_steps():
            return False
        self._last_saved = step
        try:
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
                ),
                force=force,
            )
        except Exception as e:
            raise self._failed(step, e) from e

    def save_failure(self) -> SaveError | None:
        """The failure of this checkpointer's saves, if one has ended in failure; never waits
        (a save still being written is not asked), so the train loop asks at every step."""
        if self._failure is None:
            # Orbax's background thread that writes and then commits an asynchronous save.
            thread = self._manager._finalize_thread.get()  # noqa: SLF001
            if thread is not None and not thread.is_alive() and thread.exception is not None:
                with contextlib.suppress(SaveError):
                    self._finish()
        return self._failure

    def _finish(self) -> None:
        """Waits for the save in flight; raises SaveError if it (or an earlier one) failed."""
        if self._failure is not None:
            raise self._failure
        thread = self._manager._finalize_thread.get()  # noqa: SLF001
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed(thread.step() if thread else self._last_saved, e) from e

    def _failed(self, step: int | None, error: BaseException) -> SaveError:
        self._manager.reload()  # the failed step is not one of the steps kept
        steps = [s for s in self.all_steps() if s != step]
        self._failure = SaveError(step, self.directory, cause_of(error), steps)
        return self._failure

    def _remove_partial(self, step: int | None) -> None:
        """Removes what a failed save of ``step`` left: Orbax's temporary directory (local) or
        the step's uncommitted directory (``gs://``); process 0 only."""
        if step is None or jax.process_index() != 0:
            return
        root = paths.resolve(self.directory)
        partial = list(root.glob(f"{step}.orbax-checkpoint-tmp*"))
        if (root / str(step)).exists() and step not in finished_steps(self.directory):
            partial.append(root / str(step))
        for path in partial:
            if paths.is_uri(path):
                path.rmtree(missing_ok=True)
            else:
                shutil.rmtree(os.fspath(path), ignore_errors=True)

    def restore(self, abstract_state: Any = None, step: int | None = None) -> tuple[Any, dict]:
        """Restores into the shapes, dtypes and shardings of ``abstract_state`` (a tree of
        ``jax.ShapeDtypeStruct`` with shardings, or of arrays); None restores the saved tree
        (nested dicts of arrays) onto this process's first device.

        Raises:
          FileNotFoundError: no checkpoint (at ``step``).
          UnreadableCheckpoint: a file of the checkpoint cannot be read (truncated, missing).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        try:
            if abstract_state is None:
                # Whatever topology wrote it (8 devices, 2 hosts), read it onto one local device.
                device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                metadata = self._manager.item_metadata(step)["state"]
                target = jax.tree_util.tree_map(
                    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata
                )
            else:
                target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
                ),
            )
        except FileNotFoundError:
            raise
        except Exception as e:
            quiet_failed_save_leftovers()  # the restore's other reads end later, unretrieved
            raise unreadable(step, os.path.join(self.directory, str(step)), e) from e
        return restored["state"], dict(restored["data"])

    def set_aside(self, steps: Sequence[int], folder: str) -> list[str]:
        """Moves the checkpoints of ``steps`` into ``folder`` (a resume from an older step
        writes those steps again; nothing is deleted); returns where each went. Process 0
        moves; every process sees the steps gone."""
        moved = []
        root, target = paths.resolve(self.directory), paths.resolve(folder)
        for step in steps:
            destination = target / str(step)
            suffix = 1
            while destination.exists():  # set aside before: keep both
                destination, suffix = target / f"{step}.{suffix}", suffix + 1
            if jax.process_index() == 0:
                target.mkdir(parents=True, exist_ok=True)
                (root / str(step)).rename(destination)
            moved.append(str(destination))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("checkpoints set aside")
        paths.refresh(self.directory)
        self._manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until an asynchronous save is on disk; raises SaveError if it failed."""
        self._finish()

    def close(self) -> None:
        """Waits for the save in flight and closes; a failed save's partial directory is
        removed, and the failure raised unless it was raised before."""
        raised_before = self._failure is not None
        try:
            with contextlib.suppress(SaveError):
                self._finish()
            with contextlib.suppress(Exception) if self._failure else contextlib.nullcontext():
                self._manager.close()
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)
        if self._failure is not None:
            self._remove_partial(self._failure.step)
            if not raised_before:
                raise self._failure


def finished_steps(directory: str) -> list[int]:
    """Sorted steps of the complete checkpoints in ``directory`` (local or ``gs://``); [] if it
    does not exist. A step Orbax is still writing, or that a killed run left half written, is
    not listed (Orbax's own test: no temporary name locally, ``commit_success.txt`` on GCS)."""
    paths.refresh(directory)  # another process (a training job) may have added steps
    return sorted(ocp.utils.checkpoint_steps(paths.resolve(directory)))


def check_readable(directory: str, step: int) -> UnreadableCheckpoint | None:
    """Why checkpoint ``step`` of ``directory`` cannot be read, or None: reads every value of
    its arrays' database and its JSON files, as a restore would, on this process alone (no
    barrier; a multi-host resume checks on every process before any restores)."""
    import json

    import tensorstore as ts

    step_dir = paths.resolve(directory) / str(step)
    state = os.fspath(step_dir / "state")
    base = state if paths.is_uri(state) else "file://" + state
    try:
        for name in ("_CHECKPOINT_METADATA", "state/_METADATA", "data/metadata"):
            json.loads((step_dir / name).read_text())
        store = ts.KvStore.open({"driver": "ocdbt", "base": base.rstrip("/") + "/"}).result()
        for key in store.list().result():
            store.read(key).result()
    except Exception as e:
        return unreadable(step, os.fspath(step_dir), e)
    return None


def state_steps(directory: str) -> list[int]:
    """Sorted finished steps of ``directory`` that hold a train state (``finished_steps``
    with a ``state`` item), so a step still being written, or left half written by a killed
    run, is never read."""
    root = paths.resolve(directory)
    return [s for s in finished_steps(directory) if (root / str(s) / "state").is_dir()]


def choose_steps(directory: str, *, step: int | None = None, average: int = 1) -> list[int]:
    """The checkpoint steps of a ``train.py`` run's ``checkpoints/`` folder to load: ``step``
    (None: the latest) and the ``average - 1`` finished steps before it, oldest first.

    Raises:
      FileNotFoundError: no checkpoint in ``directory``, or none at ``step`` (the message
        names the folder and the available steps).
      ValueError: ``average`` is not a positive int, or fewer than ``average`` steps are kept
        up to ``step``.
    """
    steps = state_steps(directory)
    if not steps:
        workdir = paths.resolve(directory).parent
        raise FileNotFoundError(
            f"no checkpoint in {directory}: train first (train.py --workdir {workdir})"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(
            f"no checkpoint for step {step} in {directory}; available steps: {steps}"
        )
    if isinstance(average, bool) or not isinstance(average, int) or average < 1:
        raise ValueError(f"average must be a positive int; got {average!r}")
    chosen = [s for s in steps if s <= step][-average:]
    if len(chosen) < average:
        raise ValueError(
            f"average={average} needs {average} checkpoints up to step {step} in "
            f"{directory}; there are {len(chosen)}: {chosen} (raise keep_checkpoints)"
        )
    return chosen


# ------------------------------------------------ reading parameters alone (inference, fine-tuning)


def average_params(
    checkpoint_dir: str,
    steps: Sequence[int],
    expected: Any,
    weights: Sequence[float] | None = None,
) -> Any:
    """Element-wise mean of the parameters saved at ``steps`` (checkpoint averaging), each read
    and checked as by :func:`restore_params`; summed in float64, returned in the saved dtypes.

    ``weights``: one non-negative weight per step (normalised to sum 1), e.g. an exponential
    moving average sampled at the checkpoints; None = the plain mean.

    Raises:
      ValueError: no step, or ``weights`` is not one finite non-negative number per step
        with a positive sum.
    """
    if not steps:
        raise ValueError("average_params needs at least one step")
    if weights is None:
        weights = [1.0] * len(steps)
    weights = [float(w) for w in weights]
    if len(weights) != len(steps) or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(
            f"weights must be one finite non-negative number per step ({len(steps)} steps "
            f"{list(steps)}); got {weights}"
        )
    if sum(weights) <= 0:
        raise ValueError(f"weights must have a positive sum; got {weights}")
    total = None
    for step, weight in zip(steps, weights, strict=True):
        params = restore_params(checkpoint_dir, step, expected)
        as64 = jax.tree_util.tree_map(lambda x, w=weight: np.asarray(x, np.float64) * w, params)
        total = as64 if total is None else jax.tree_util.tree_map(np.add, total, as64)
    norm = sum(weights)
    return jax.tree_util.tree_map(lambda t, e: (t / norm).astype(e.dtype), total, expected)


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Orbax warns through absl that the item folder has no step metadata (it lives one level
    up); restoring the item directly is still correct, so keep that out of the CLI output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(p): (tuple(leaf.shape), leaf.dtype) for p, leaf in leaves}


def restore_params(checkpoint_dir: str, step: int, expected: Any) -> Any:
    """Reads only ``state["params"]`` of ``checkpoint_dir/<step>`` as numpy arrays.

    ``expected`` is the parameter tree the model config implies (arrays or
    ``jax.ShapeDtypeStruct``). Shapes are compared with the checkpoint's metadata *before*
    restoring, because Orbax restores a mismatched target silently in the saved shape.

    Raises:
      ValueError: the checkpoint has no params, or its parameter names or shapes differ from
        ``expected`` (every difference is listed, up to ten).
    """
    item = epath.Path(checkpoint_dir) / str(step) / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    with _quiet_absl():
        metadata = checkpointer.metadata(item)
    tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    if not isinstance(tree, dict) or "params" not in tree:
        raise ValueError(f"checkpoint {item} holds no 'params' (keys: {list(tree or {})})")
    saved, wanted = _shapes(tree["params"]), _shapes(expected)
    problems = [
        f"missing from the checkpoint: {k} {wanted[k][0]}" for k in wanted if k not in saved
    ]
    problems += [f"not in the model: {k} {saved[k][0]}" for k in saved if k not in wanted]
    problems += [
        f"{k}: checkpoint shape {saved[k][0]}, model_config shape {wanted[k][0]}"
        for k in wanted
        if k in saved and saved[k][0] != wanted[k][0]
    ]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(
            f"checkpoint {item} does not match model_config.json of its workdir: "
            + "; ".join(problems[:10])
            + more
        )
    target = {"params": jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), expected)}
    restore_args = jax.tree_util.tree_map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target
    )
    with _quiet_absl():
        restored = checkpointer.restore(
            item,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            ),
        )
    return jax.tree_util.tree_map(
        lambda x, s: np.asarray(x, dtype=s.dtype), restored["params"], expected
    )
