"""The training stream: endless, resumable, host-sharded iteration over epochs of batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flaxformer_lite.data.batching import Batch, BatchPlan
from flaxformer_lite.data.encoding import EncodedPairs, Example


class BatchStream:
    """Endless, resumable, host-sharded iterator over epochs of batches.

    ``make_batches(epoch)`` returns that epoch's global batch list (built the same way on
    every host: same data, same seed): either batches, or :class:`BatchPlan` s read from
    ``examples``, in which case each host reads the tokens of its own rows only. Process
    ``p`` of ``P`` receives rows ``[p*R/P, (p+1)*R/P)`` of each ``R``-row global batch.
    ``examples`` may also be a function of the epoch (e.g. another sampled segmentation of the
    corpus each epoch, see ``tasks/translation.py``); the plans of an epoch index into its
    examples. The
    position is ``(epoch, index)``: :meth:`state` after ``n`` calls to :meth:`next` and a
    :meth:`restore` of it yields the same following batches as an uninterrupted stream.
    """

    def __init__(
        self,
        make_batches: Callable[[int], list[Batch]] | Callable[[int], list[BatchPlan]],
        *,
        process_index: int = 0,
        process_count: int = 1,
        examples: Sequence[Example]
        | EncodedPairs
        | Callable[[int], Sequence[Example] | EncodedPairs]
        | None = None,
    ) -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must be in [0, process_count={process_count}); got {process_index}"
            )
        self._make_batches = make_batches
        self._examples = examples
        self.process_index = process_index
        self.process_count = process_count
        self._epoch = 0
        self._index = 0
        self._cached_epoch: int | None = None
        self._cached: list[Batch] | list[BatchPlan] = []

    def epoch_plans(self) -> list[Batch] | list[BatchPlan]:
        """What ``make_batches`` returned for the current epoch, built once and cached."""
        if self._cached_epoch != self._epoch:
            self._cached = self._make_batches(self._epoch)
            self._cached_epoch = self._epoch
            if not self._cached:
                raise ValueError(f"make_batches({self._epoch}) returned no batches")
        return self._cached

    def epoch_batches(self) -> list[Batch]:
        """Global (unsharded) batches of the current epoch (plans are read whole: for
        inspection; :meth:`next` reads only this process's rows)."""
        return [self._global(b) for b in self.epoch_plans()]

    def _epoch_examples(self) -> Sequence[Example] | EncodedPairs | None:
        examples = self._examples
        return examples(self._epoch) if callable(examples) else examples

    def _global(self, item: Batch | BatchPlan) -> Batch:
        return item.take(self._epoch_examples()) if isinstance(item, BatchPlan) else item

    def state(self) -> dict[str, int]:
        """Position of the next batch: ``dict(epoch=..., index=...)``."""
        return {"epoch": self._epoch, "index": self._index}

    def restore(self, state: dict[str, int]) -> None:
        """Continues from a :meth:`state` (e.g. loaded with a checkpoint)."""
        self._epoch = int(state["epoch"])
        self._index = int(state["index"])

    @property
    def epoch(self) -> int:
        return self._epoch

    def _rows(self, rows: int) -> tuple[int, int]:
        if rows % self.process_count:
            raise ValueError(
                f"batch rows ({rows}) are not divisible by process_count "
                f"({self.process_count}); make batch_size_multiple a multiple of it"
            )
        per = rows // self.process_count
        return self.process_index * per, (self.process_index + 1) * per

    def shard(self, batch: Batch | BatchPlan) -> Batch:
        """This process's contiguous slice of rows of a global batch (or plan)."""
        if isinstance(batch, BatchPlan):
            return batch.take(self._epoch_examples(), *self._rows(batch.rows))
        out = {}
        for key, value in batch.items():
            start, stop = self._rows(value.shape[0])
            out[key] = value[start:stop]
        return out

    def next(self) -> Batch:
        """This process's part of the next batch; rolls over to the next epoch at the end."""
        if self._index >= len(self.epoch_plans()):
            self._epoch += 1
            self._index = 0
        batch = self.epoch_plans()[self._index]
        self._index += 1
        return self.shard(batch)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        return self.next()
