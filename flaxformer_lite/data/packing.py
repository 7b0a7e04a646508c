"""Packing: several examples per row, first fit in linear time, with segment ids.

A packed batch holds whole examples back to back in each ``[rows, length]`` row, with
``*_segmentation`` (which example) and ``*_position`` (position inside it) keys so attention
stays within an example and positions restart. Plans come from the side lengths alone, as in
``batching.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flaxformer_lite.data.batching import (
    Batch,
    BatchPlan,
    epoch_rng,
    plans_from_rows,
    side_lengths,
)
from flaxformer_lite.data.encoding import EncodedPairs, Example


def first_fit_rows(in_len: np.ndarray, tgt_len: np.ndarray, length: int) -> np.ndarray:
    """Row of each example under first-fit packing of two sides into rows of ``length``.

    Example ``k`` (in the given order) goes to the lowest-numbered row where both its
    ``in_len[k]`` and ``tgt_len[k]`` still fit. Rooms only shrink, so the first row that
    fits a given ``(inputs, targets)`` size never moves left: one pointer per distinct size
    remembers it and only moves right, past rows that no longer fit that size (a short
    Python scan, then a vectorized numpy scan with doubling windows for long jumps). Each
    example costs O(1) plus its pointer's advance, and a pointer crosses each row at most
    once: O(examples + sizes x rows) in the worst case (``sizes`` <= ``length ** 2`` distinct
    length pairs, the rows crossed by numpy vectors), against O(examples x rows) for the old
    scan of every open row per example. On translation-like lengths (rows of 64, sentences of
    2-30 tokens) a pointer moves a few dozen rows per example: 100k examples in about a second
    on a loaded 2-core machine, where the old scan took about 40 s.

    Returns:
      int64 [n]: row of each example; rows are numbered in opening order.
    """
    n = len(in_len)
    # Rooms of rows not opened yet are whole rows: the first of them fits any example. Kept
    # twice: Python lists for the short scans, numpy arrays for the long ones.
    in_room = np.full(n + 1, length, dtype=np.int64)
    tgt_room = np.full(n + 1, length, dtype=np.int64)
    in_list = [length] * (n + 1)
    tgt_list = [length] * (n + 1)
    first: dict[tuple[int, int], int] = {}
    rows = [0] * n
    for k, size in enumerate(zip(in_len.tolist(), tgt_len.tolist(), strict=True)):
        a, b = size
        row = first.get(size, 0)
        stop = row + 48
        while (in_list[row] < a or tgt_list[row] < b) and row < stop:
            row += 1
        if row == stop and (in_list[row] < a or tgt_list[row] < b):
            window = 256
            while True:
                fits = (in_room[row : row + window] >= a) & (tgt_room[row : row + window] >= b)
                hit = int(fits.argmax())
                if fits[hit]:
                    row += hit
                    break
                row += window
                window *= 2
        first[size] = row
        rows[k] = row
        in_list[row] -= a
        tgt_list[row] -= b
        in_room[row] -= a
        tgt_room[row] -= b
    return np.asarray(rows, dtype=np.int64)


def plan_packing(
    in_len: np.ndarray,
    tgt_len: np.ndarray,
    *,
    length: int,
    rows_per_batch: int,
    pad_id: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[BatchPlan]:
    """The plans of :func:`pack_examples` from the side lengths ``[n]`` alone."""
    in_len = np.asarray(in_len, dtype=np.int64)
    tgt_len = np.asarray(tgt_len, dtype=np.int64)
    too_long = np.flatnonzero((in_len > length) | (tgt_len > length))
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(
            f"example {i} (inputs {in_len[i]}, targets {tgt_len[i]} tokens) is longer than the "
            f"packing length {length}"
        )
    n = len(in_len)
    order = epoch_rng(seed, epoch).permutation(n) if shuffle else np.arange(n)
    row_of = first_fit_rows(in_len[order], tgt_len[order], length)
    # Row after row, each row's examples in arrival order (a stable sort keeps it).
    by_row = np.argsort(row_of, kind="stable")
    counts = np.bincount(row_of, minlength=int(row_of.max()) + 1 if n else 0)
    row_splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return plans_from_rows(
        order[by_row].astype(np.int64),
        row_splits,
        length=length,
        rows=rows_per_batch,
        pad_id=pad_id,
        packed=True,
    )


def pack_examples(
    examples: Sequence[Example] | EncodedPairs,
    *,
    length: int,
    rows_per_batch: int,
    pad_id: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[Batch]:
    """Packs several examples per row, first fit, into ``[rows_per_batch, length]`` batches.

    Examples (shuffled with the ``(seed, epoch)`` RNG) go, whole, to the first row where
    both their inputs and their targets still fit. Keys of each batch, all
    ``[rows_per_batch, length]`` int32::

      inputs, targets: concatenated token ids, ``pad_id`` after the last segment;
      inputs_segmentation, targets_segmentation: 1..n for the n examples of a row (the same
        id on both sides, so target segment k attends input segment k), 0 on padding;
      inputs_position, targets_position: position inside the segment (restarts at 0), 0 on
        padding.

    The last batch is completed with empty rows.

    Raises:
      ValueError: an example side is longer than ``length``.
    """
    in_len, tgt_len = side_lengths(examples)
    plans = plan_packing(
        in_len,
        tgt_len,
        length=length,
        rows_per_batch=rows_per_batch,
        pad_id=pad_id,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
    )
    return [plan.take(examples) for plan in plans]
