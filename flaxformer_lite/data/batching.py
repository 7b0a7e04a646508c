"""Batching: examples to fixed-shape int32 batches, planned from lengths alone.

Every batch is a dict of numpy int32 arrays padded with the vocabulary's pad id (every
builder takes ``pad_id``: 0 for the project's vocabularies, 58100 for a Marian one), in a
small fixed set of shapes (one per length bucket) so a jitted train step compiles once per bucket. A
:class:`BatchPlan` says which examples fill each row without holding their tokens, so every
host can plan the whole epoch and read the tokens of its own rows only. Length buckets
(translation), windows of a token stream (language model) and one row per sentence
(classification) are here; several examples per row is ``packing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flaxformer_lite.data.encoding import EncodedPairs, Example

Batch = dict[str, np.ndarray]


def _round_up(value: float, multiple: int) -> int:
    return int(-(-int(np.ceil(value)) // multiple) * multiple)


def bucket_boundaries(max_len: int, min_len: int = 8, growth: float = 1.5) -> list[int]:
    """Sorted bucket lengths: multiples of 8 growing by ``growth``, the last is ``max_len``.

    E.g. max_len=128 -> [8, 16, 24, 40, 64, 96, 128]; max_len=256 -> [8, 16, 24, 40, 64,
    96, 144, 256]. Each boundary is one batch shape, hence one compilation: few buckets
    compile fast, more buckets pad less. A last intermediate bucket that would sit within
    half a growth step of ``max_len`` is merged into it (no near-duplicate shapes).
    """
    if growth <= 1.0:
        raise ValueError(f"growth must be > 1; got {growth}")
    if min_len < 1 or max_len < 1:
        raise ValueError(f"min_len and max_len must be >= 1; got {min_len}, {max_len}")
    bounds = []
    length = _round_up(min_len, 8)
    while length < max_len:
        bounds.append(length)
        length = max(length + 8, _round_up(length * growth, 8))
    if bounds and bounds[-1] * (1 + (growth - 1) / 2) > max_len:
        bounds.pop()
    return [*bounds, max_len]


def rows_for_length(length: int, tokens_per_batch: int, batch_size_multiple: int = 1) -> int:
    """Rows of a ``length``-column batch: ``tokens_per_batch // length`` rounded down to a
    multiple of ``batch_size_multiple`` (at least one multiple)."""
    rows = (tokens_per_batch // length) // batch_size_multiple * batch_size_multiple
    return max(batch_size_multiple, rows)


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The RNG of one epoch's shuffle: a pure function of ``(seed, epoch)``, so every host
    draws the same order and a resumed run the same batches."""
    return np.random.default_rng([seed, epoch])


def side_lengths(examples: Sequence[Example] | EncodedPairs) -> tuple[np.ndarray, np.ndarray]:
    """(inputs lengths [n], targets lengths [n]) int64, from offsets when available."""
    if isinstance(examples, EncodedPairs):
        return examples.input_lengths, examples.target_lengths
    in_len = np.fromiter((len(e["inputs"]) for e in examples), np.int64, count=len(examples))
    tgt_len = np.fromiter((len(e["targets"]) for e in examples), np.int64, count=len(examples))
    return in_len, tgt_len


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Which examples fill each row of one ``[rows, length]`` batch, without their tokens.

    Row ``r`` holds examples ``members[row_splits[r]:row_splits[r + 1]]`` in segment order
    (none: an all-``pad_id`` row). A plan costs a few integers per example, so every host can plan
    the whole epoch and read the tokens of its own rows only (:meth:`take`).

    Attributes:
      length: columns of the batch.
      rows: rows of the batch.
      members: int64 [k] example indices, row after row.
      row_splits: int64 [rows + 1] offsets into ``members``.
      pad_id: the id that fills ``inputs`` and ``targets`` after the examples.
      packed: several examples per row, with segmentation and position keys.
      with_index: also return ``index`` [rows] (the example of each row, -1 on padding
        rows; one example per row only).
    """

    length: int
    rows: int
    members: np.ndarray
    row_splits: np.ndarray
    pad_id: int
    packed: bool = False
    with_index: bool = False

    def take(
        self, examples: Sequence[Example] | EncodedPairs, start: int = 0, stop: int | None = None
    ) -> Batch:
        """Rows ``[start, stop)`` of the batch (default: all), read from ``examples``."""
        stop = self.rows if stop is None else stop
        n = stop - start
        sides = ("inputs", "targets")
        keys = [f"{s}{x}" for s in sides for x in (("", "_segmentation", "_position"))]
        batch = {
            k: np.full((n, self.length), self.pad_id if k in sides else 0, dtype=np.int32)
            for k in (keys if self.packed else sides)
        }
        if self.with_index:
            batch["index"] = np.full((n,), -1, dtype=np.int32)
        splits = self.row_splits
        for r in range(n):
            lo, hi = int(splits[start + r]), int(splits[start + r + 1])
            row = [examples[i] for i in self.members[lo:hi].tolist()]
            if self.with_index and row:
                batch["index"][r] = self.members[lo]
            for side in sides:
                offset = 0
                for segment, example in enumerate(row, start=1):
                    seq = example[side]
                    end = offset + len(seq)
                    batch[side][r, offset:end] = seq
                    if self.packed:
                        batch[f"{side}_segmentation"][r, offset:end] = segment
                        batch[f"{side}_position"][r, offset:end] = np.arange(len(seq))
                    offset = end
        return batch

    def target_tokens(self, target_lengths: np.ndarray) -> int:
        """Real (non-PAD) target positions of the batch, from the examples' lengths."""
        return int(target_lengths[self.members].sum())


def plans_from_rows(
    members: np.ndarray,
    row_splits: np.ndarray,
    *,
    length: int,
    rows: int,
    pad_id: int,
    **kwargs: Any,
) -> list[BatchPlan]:
    """Cuts rows ``row_splits`` (over ``members``) into plans of ``rows`` rows; the last one
    is completed with empty rows (all ``pad_id``)."""
    num_rows = len(row_splits) - 1
    plans = []
    for first in range(0, num_rows, rows):
        splits = row_splits[first : first + rows + 1]
        splits = np.concatenate([splits, np.full(rows + 1 - len(splits), splits[-1])])
        plans.append(
            BatchPlan(
                length=length,
                rows=rows,
                members=members[splits[0] : splits[-1]],
                row_splits=splits - splits[0],
                pad_id=pad_id,
                **kwargs,
            )
        )
    return plans


def plan_by_tokens(
    lengths: np.ndarray,
    *,
    tokens_per_batch: int,
    boundaries: Sequence[int],
    pad_id: int,
    batch_size_multiple: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    with_index: bool = False,
) -> list[BatchPlan]:
    """The plans of :func:`batch_by_tokens` from example lengths ``[n]`` alone."""
    boundaries = sorted(boundaries)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > boundaries[-1]:
        worst = int(np.argmax(lengths))
        raise ValueError(
            f"example {worst} has length {lengths[worst]} > largest bucket {boundaries[-1]}; "
            "encode with max_len <= the largest boundary"
        )
    bucket_of = np.searchsorted(np.asarray(boundaries), lengths, side="left")
    rng = epoch_rng(seed, epoch)
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    plans = []
    for b, length in enumerate(boundaries):
        members = order[bucket_of[order] == b]
        if shuffle:
            members = members[np.argsort(lengths[members], kind="stable")]
        rows = rows_for_length(length, tokens_per_batch, batch_size_multiple)
        plans += plans_from_rows(
            members.astype(np.int64),
            np.arange(len(members) + 1, dtype=np.int64),
            length=length,
            rows=rows,
            pad_id=pad_id,
            with_index=with_index,
        )
    if shuffle:
        plans = [plans[i] for i in rng.permutation(len(plans))]
    return plans


def batch_by_tokens(
    examples: Sequence[Example] | EncodedPairs,
    *,
    tokens_per_batch: int,
    boundaries: Sequence[int],
    pad_id: int,
    batch_size_multiple: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    with_index: bool = False,
) -> list[Batch]:
    """Groups examples into fixed-shape batches of about ``tokens_per_batch`` tokens.

    Each example goes to the smallest bucket ``L`` in ``boundaries`` holding
    ``max(len(inputs), len(targets))``. A bucket's batches are exactly
    ``[rows_for_length(L, tokens_per_batch, batch_size_multiple), L]``; its last partial
    batch is completed with all-``pad_id`` rows (zero loss weight).

    With ``shuffle``, examples are shuffled then stably sorted by length inside each bucket
    (length-homogeneous batches), and the batch list is shuffled, all with an RNG seeded by
    ``(seed, epoch)``. Without it, examples keep their order and batches come bucket by
    bucket (evaluation).

    Args:
      examples: dicts with 1-D int ``inputs`` and ``targets``.
      pad_id: the vocabulary's padding id, filling every row after its example.
      with_index: also return ``index`` [rows] int32: position of each row's example in
        ``examples`` (-1 on padding rows), to match predictions with references.

    Returns:
      Dicts with ``inputs`` and ``targets`` [rows, L] int32 (plus ``index`` [rows]).

    Raises:
      ValueError: an example is longer than ``boundaries[-1]``.
    """
    lengths = np.maximum(*side_lengths(examples))
    plans = plan_by_tokens(
        lengths,
        tokens_per_batch=tokens_per_batch,
        boundaries=boundaries,
        pad_id=pad_id,
        batch_size_multiple=batch_size_multiple,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        with_index=with_index,
    )
    return [plan.take(examples) for plan in plans]


def padding_fraction(batches: Iterable[Batch], pad_id: int) -> float:
    """Share of ``pad_id`` among all target positions of ``batches`` (0.0 for no batches)."""
    pads = total = 0
    for batch in batches:
        targets = batch["targets"]
        pads += int(np.count_nonzero(targets == pad_id))
        total += targets.size
    return pads / total if total else 0.0


def lm_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    pad_id: int,
    seed: int = 0,
    epoch: int = 0,
) -> list[Batch]:
    """Language-model batches ``dict(targets=[batch_size, seq_len])`` of a token stream.

    The stream is cut, from a random offset in ``[0, seq_len)``, into non-overlapping
    windows of ``seq_len`` tokens, so each epoch sees different window borders; windows are
    shuffled and grouped by ``batch_size``, the last batch completed with all-``pad_id`` rows.
    RNG seeded by ``(seed, epoch)``.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 1 or len(tokens) < seq_len:
        raise ValueError(
            f"tokens must be a 1-D stream of at least seq_len={seq_len} tokens; "
            f"got shape {tokens.shape}"
        )
    rng = epoch_rng(seed, epoch)
    offset = int(rng.integers(0, min(seq_len, len(tokens) - seq_len + 1)))
    num_windows = (len(tokens) - offset) // seq_len
    windows = tokens[offset : offset + num_windows * seq_len].reshape(num_windows, seq_len)
    windows = windows[rng.permutation(num_windows)]
    batches = []
    for start in range(0, num_windows, batch_size):
        chunk = windows[start : start + batch_size]
        targets = np.full((batch_size, seq_len), pad_id, dtype=np.int32)
        targets[: len(chunk)] = chunk
        batches.append({"targets": targets})
    return batches


def classification_batches(
    examples: Sequence[tuple[np.ndarray, int]],
    *,
    max_len: int,
    batch_size: int,
    pad_id: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[Batch]:
    """Classification batches: ``inputs`` [B, max_len], ``label`` [B], ``weights`` [B].

    ``inputs`` is filled with ``pad_id`` after each example. ``weights`` is 1 for real rows
    and 0 for the all-``pad_id`` rows completing the last batch
    (their ``label`` is 0), so they drop out of loss and accuracy.

    Raises:
      ValueError: an example has more than ``max_len`` ids (use ``encoding.encode_labeled``).
    """
    order = epoch_rng(seed, epoch).permutation(len(examples)) if shuffle else range(len(examples))
    order = list(order)
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        inputs = np.full((batch_size, max_len), pad_id, dtype=np.int32)
        label = np.zeros((batch_size,), dtype=np.int32)
        weights = np.zeros((batch_size,), dtype=np.int32)
        for r, i in enumerate(chunk):
            ids, y = examples[i]
            if len(ids) > max_len:
                raise ValueError(f"example {i} has {len(ids)} ids > max_len={max_len}")
            inputs[r, : len(ids)] = ids
            label[r] = y
            weights[r] = 1
        batches.append({"inputs": inputs, "label": label, "weights": weights})
    return batches
