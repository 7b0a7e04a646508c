"""Input pipeline: reading, encoding, length-bucketed batching, packing, resumable streams.

Every batch is a dict of numpy int32 arrays padded with ``PAD_ID`` (0). A translation
example is ``dict(inputs=[src_len], targets=[tgt_len])`` with EOS appended to both and no
BOS (the model shifts the targets right itself). Batches come in a small fixed set of
shapes (one per length bucket) so a jitted train step compiles once per bucket.

Reading keeps honest counts in :class:`DataStats` (what was read, dropped, truncated),
printed once at the start of training.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite import paths
from flaxformer_lite.tokenizer import EOS_ID, PAD_ID, Tokenizer, load_or_train

DATA_FORMATS = ("parallel_text", "tsv", "jsonl")
TOO_LONG_POLICIES = ("truncate", "drop")

Example = dict[str, np.ndarray]
Batch = dict[str, np.ndarray]


# ============================================================================ statistics


@dataclasses.dataclass
class DataStats:
    """Counts of what the reader and encoder did to the data.

    Attributes:
      num_read: examples (lines / rows / pairs) read from the source.
      num_empty_dropped: dropped because a side was empty or whitespace-only.
      num_truncated: kept but cut to ``max_len`` (EOS kept last).
      num_too_long_dropped: dropped because a side exceeded ``max_len``.
    """

    num_read: int = 0
    num_empty_dropped: int = 0
    num_truncated: int = 0
    num_too_long_dropped: int = 0

    @property
    def num_kept(self) -> int:
        """Examples left after all drops."""
        return self.num_read - self.num_empty_dropped - self.num_too_long_dropped

    def merge(self, other: DataStats) -> DataStats:
        """Field-wise sum of two stats (a new object)."""
        return DataStats(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def summary(self) -> str:
        """One line for the training log."""
        return (
            f"read {self.num_read} examples, kept {self.num_kept}; "
            f"dropped {self.num_empty_dropped} empty, {self.num_too_long_dropped} too long; "
            f"truncated {self.num_truncated}"
        )


# ============================================================================ reading


def normalize(text: str) -> str:
    """Collapses every whitespace run (tabs, U+00A0 non-breaking spaces, ...) to one space.

    ``str.split()`` with no argument splits on all Unicode whitespace, U+00A0 included,
    and drops leading/trailing blanks, so this one line is the whole normalizer.
    """
    return " ".join(text.split())


def _read_lines(path: str) -> list[str]:
    """Lines of a local or ``gs://`` text file, without their newline."""
    file = epath.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    # Split on "\n" only. Universal newlines (and str.splitlines) would also split on "\r",
    # U+2028, U+0085, ... inside a line and break the source/target alignment.
    lines = file.read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":  # the final newline ends the last line; it does not start a new one
        lines.pop()
    return lines


def read_parallel_files(
    source_path: str, target_path: str, stats: DataStats | None = None
) -> list[tuple[str, str]]:
    """Reads aligned ``source_path``/``target_path`` (line i of one translates line i of the other).

    Lines are normalized (:func:`normalize`); a pair with an empty side is dropped and
    counted in ``stats.num_empty_dropped``.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: the files have different line counts (both paths and counts named).
    """
    sources = _read_lines(source_path)
    targets = _read_lines(target_path)
    if len(sources) != len(targets):
        raise ValueError(
            f"parallel files have different line counts: {source_path} has {len(sources)} "
            f"lines, {target_path} has {len(targets)} lines"
        )
    return _clean_pairs(zip(sources, targets, strict=True), stats)


def _clean_pairs(
    pairs: Iterable[tuple[str, str]], stats: DataStats | None
) -> list[tuple[str, str]]:
    stats = stats if stats is not None else DataStats()
    out = []
    for source, target in pairs:
        stats.num_read += 1
        source, target = normalize(source or ""), normalize(target or "")
        if not source or not target:
            stats.num_empty_dropped += 1
            continue
        out.append((source, target))
    return out


def _load_local_table(
    path: str, data_format: str, text_columns: Sequence[str], other_columns: Sequence[str] = ()
) -> Any:
    """Loads a local .tsv/.jsonl file with a `datasets` packaged builder (works offline).

    ``text_columns`` are read as strings verbatim; all named columns must exist.
    """
    import datasets  # Slow to import: only when a table is actually read.

    if not epath.Path(path).is_file():  # `datasets` itself reads local and gs:// files
        raise FileNotFoundError(f"data file not found: {path}")
    if data_format == "tsv":
        table = datasets.load_dataset(
            "csv",
            data_files={"data": path},
            split="data",
            delimiter="\t",
            # Text is not quoted in these files: an apostrophe or quote is a literal.
            quoting=csv.QUOTE_NONE,
            # Keep "NA", "null", "" ... as text, and keep digit-only text as text.
            keep_default_na=False,
            na_filter=False,
            converters={c: str for c in text_columns},
        )
    else:
        table = datasets.load_dataset("json", data_files={"data": path}, split="data")
    missing = [c for c in (*text_columns, *other_columns) if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing}; its columns are {table.column_names}")
    return table


def load_pairs(
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    data_dir: str | None = None,
    split: str,
    source_lang: str,
    target_lang: str,
    data_format: str = "parallel_text",
    source_column: str | None = None,
    target_column: str | None = None,
    stats: DataStats | None = None,
) -> list[tuple[str, str]]:
    """Loads normalized (source, target) sentence pairs of one split.

    With ``data_dir`` set, reads local files:
      * "parallel_text": ``{data_dir}/{split}.{source_lang}`` and ``.{target_lang}``;
      * "tsv" / "jsonl": ``{data_dir}/{split}.tsv`` / ``.jsonl`` with columns
        ``source_column``/``target_column`` (default: the language codes).
    Without ``data_dir``, loads ``dataset`` (``dataset_config``) from the Hugging Face hub:
    either a ``translation`` dict column (wmt14 style) or one column per language
    (bentrevett/multi30k style).
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}; got {data_format!r}")
    if data_dir is not None:
        if data_format == "parallel_text":
            return read_parallel_files(
                os.path.join(data_dir, f"{split}.{source_lang}"),
                os.path.join(data_dir, f"{split}.{target_lang}"),
                stats,
            )
        source_column = source_column or source_lang
        target_column = target_column or target_lang
        path = os.path.join(data_dir, f"{split}.{data_format}")
        table = _load_local_table(path, data_format, [source_column, target_column])
        return _clean_pairs(zip(table[source_column], table[target_column], strict=True), stats)

    if dataset is None:
        raise ValueError("load_pairs needs either data_dir (local files) or dataset (hub name)")
    import datasets  # Slow to import: only when the hub is actually used.

    table = datasets.load_dataset(dataset, dataset_config, split=split)
    if "translation" in table.column_names:
        rows = table["translation"]
        pairs = ((row[source_lang], row[target_lang]) for row in rows)
    else:
        source_column = source_column or source_lang
        target_column = target_column or target_lang
        missing = [c for c in (source_column, target_column) if c not in table.column_names]
        if missing:
            raise ValueError(
                f"dataset {dataset!r} split {split!r} has no 'translation' column and no "
                f"column(s) {missing}; its columns are {table.column_names}"
            )
        pairs = zip(table[source_column], table[target_column], strict=True)
    return _clean_pairs(pairs, stats)


def load_text(path: str, stats: DataStats | None = None) -> list[str]:
    """Normalized non-empty lines of a text file (language modelling); empties are counted."""
    stats = stats if stats is not None else DataStats()
    out = []
    for line in _read_lines(path):
        stats.num_read += 1
        line = normalize(line)
        if line:
            out.append(line)
        else:
            stats.num_empty_dropped += 1
    return out


def load_labeled(
    path_tsv: str,
    text_column: str = "sentence",
    label_column: str = "label",
    stats: DataStats | None = None,
) -> list[tuple[str, int]]:
    """(normalized text, int label) rows of a TSV with a header (e.g. GLUE SST-2).

    Rows with empty text are dropped and counted.
    """
    stats = stats if stats is not None else DataStats()
    table = _load_local_table(path_tsv, "tsv", [text_column], [label_column])
    out = []
    for text, label in zip(table[text_column], table[label_column], strict=True):
        stats.num_read += 1
        text = normalize(text)
        if not text:
            stats.num_empty_dropped += 1
            continue
        out.append((text, int(label)))
    return out


# ============================================================================ encoding


def _fit(ids: Sequence[int], max_len: int) -> tuple[np.ndarray, bool]:
    """``ids + [EOS]`` as int32, cut to ``max_len`` keeping EOS last; also says if cut."""
    cut = len(ids) + 1 > max_len
    body = list(ids[: max_len - 1]) if cut else list(ids)
    return np.asarray([*body, EOS_ID], dtype=np.int32), cut


def _check_too_long(too_long: str) -> None:
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"too_long must be one of {TOO_LONG_POLICIES}; got {too_long!r}")


def encode_pairs(
    pairs: Sequence[tuple[str, str]],
    src_tokenizer: Tokenizer,
    tgt_tokenizer: Tokenizer,
    *,
    max_len: int,
    too_long: str = "truncate",
    stats: DataStats | None = None,
) -> list[Example]:
    """Tokenizes pairs into ``dict(inputs=[src_len], targets=[tgt_len])`` int32 examples.

    EOS is appended to both sides. A pair with a side longer than ``max_len`` (EOS
    included) is truncated (EOS kept last; ``stats.num_truncated``) or dropped
    (``stats.num_too_long_dropped``) according to ``too_long``.
    """
    _check_too_long(too_long)
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one token plus EOS); got {max_len}")
    stats = stats if stats is not None else DataStats()
    sources = src_tokenizer.encode_batch([s for s, _ in pairs])
    targets = tgt_tokenizer.encode_batch([t for _, t in pairs])
    out = []
    for src_ids, tgt_ids in zip(sources, targets, strict=True):
        if max(len(src_ids), len(tgt_ids)) + 1 > max_len:
            if too_long == "drop":
                stats.num_too_long_dropped += 1
                continue
            stats.num_truncated += 1
        inputs, _ = _fit(src_ids, max_len)
        targets_, _ = _fit(tgt_ids, max_len)
        out.append({"inputs": inputs, "targets": targets_})
    return out


def encode_labeled(
    examples: Sequence[tuple[str, int]],
    tokenizer: Tokenizer,
    *,
    max_len: int,
    stats: DataStats | None = None,
) -> list[tuple[np.ndarray, int]]:
    """(ids + EOS as int32 [len <= max_len], label) for classification; cuts are counted."""
    stats = stats if stats is not None else DataStats()
    encoded = tokenizer.encode_batch([text for text, _ in examples])
    out = []
    for ids, (_, label) in zip(encoded, examples, strict=True):
        fitted, cut = _fit(ids, max_len)
        stats.num_truncated += int(cut)
        out.append((fitted, int(label)))
    return out


def lm_token_stream(lines: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """One int32 stream ``[num_tokens]`` of all lines, each followed by EOS (a line break)."""
    encoded = tokenizer.encode_batch(list(lines))
    return np.fromiter(
        (i for ids in encoded for i in (*ids, EOS_ID)),
        dtype=np.int32,
        count=sum(len(ids) + 1 for ids in encoded),
    )


# ============================================================================ batching


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


def _example_length(example: Example) -> int:
    return max(len(example["inputs"]), len(example["targets"]))


def _pad_rows(sequences: Sequence[np.ndarray], rows: int, length: int) -> np.ndarray:
    out = np.full((rows, length), PAD_ID, dtype=np.int32)
    for r, seq in enumerate(sequences):
        out[r, : len(seq)] = seq
    return out


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def batch_by_tokens(
    examples: Sequence[Example],
    *,
    tokens_per_batch: int,
    boundaries: Sequence[int],
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
    batch is completed with all-PAD rows (zero loss weight).

    With ``shuffle``, examples are shuffled then stably sorted by length inside each bucket
    (length-homogeneous batches), and the batch list is shuffled, all with an RNG seeded by
    ``(seed, epoch)``. Without it, examples keep their order and batches come bucket by
    bucket (evaluation).

    Args:
      examples: dicts with 1-D int ``inputs`` and ``targets``.
      with_index: also return ``index`` [rows] int32: position of each row's example in
        ``examples`` (-1 on padding rows), to match predictions with references.

    Returns:
      Dicts with ``inputs`` and ``targets`` [rows, L] int32 (plus ``index`` [rows]).

    Raises:
      ValueError: an example is longer than ``boundaries[-1]``.
    """
    boundaries = sorted(boundaries)
    lengths = np.asarray([_example_length(e) for e in examples], dtype=np.int64)
    if len(lengths) and lengths.max() > boundaries[-1]:
        worst = int(np.argmax(lengths))
        raise ValueError(
            f"example {worst} has length {lengths[worst]} > largest bucket {boundaries[-1]}; "
            "encode with max_len <= the largest boundary"
        )
    bucket_of = np.searchsorted(np.asarray(boundaries), lengths, side="left")
    rng = _rng(seed, epoch)
    order = rng.permutation(len(examples)) if shuffle else np.arange(len(examples))
    batches = []
    for b, length in enumerate(boundaries):
        members = order[bucket_of[order] == b]
        if shuffle:
            members = members[np.argsort(lengths[members], kind="stable")]
        rows = rows_for_length(length, tokens_per_batch, batch_size_multiple)
        for start in range(0, len(members), rows):
            chunk = members[start : start + rows]
            batch = {
                "inputs": _pad_rows([examples[i]["inputs"] for i in chunk], rows, length),
                "targets": _pad_rows([examples[i]["targets"] for i in chunk], rows, length),
            }
            if with_index:
                index = np.full((rows,), -1, dtype=np.int32)
                index[: len(chunk)] = chunk
                batch["index"] = index
            batches.append(batch)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def padding_fraction(batches: Iterable[Batch]) -> float:
    """Share of PAD among all target positions of ``batches`` (0.0 for no batches)."""
    pads = total = 0
    for batch in batches:
        targets = batch["targets"]
        pads += int(np.count_nonzero(targets == PAD_ID))
        total += targets.size
    return pads / total if total else 0.0


def pack_examples(
    examples: Sequence[Example],
    *,
    length: int,
    rows_per_batch: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[Batch]:
    """Packs several examples per row, first fit, into ``[rows_per_batch, length]`` batches.

    Examples (shuffled with the ``(seed, epoch)`` RNG) go, whole, to the first row where
    both their inputs and their targets still fit. Keys of each batch, all
    ``[rows_per_batch, length]`` int32:
      inputs, targets: concatenated token ids, PAD after the last segment;
      inputs_segmentation, targets_segmentation: 1..n for the n examples of a row (the same
        id on both sides, so target segment k attends input segment k), 0 on padding;
      inputs_position, targets_position: position inside the segment (restarts at 0), 0 on
        padding.
    The last batch is completed with empty rows.

    Raises:
      ValueError: an example side is longer than ``length``.
    """
    n = len(examples)
    in_len = np.asarray([len(e["inputs"]) for e in examples], dtype=np.int64)
    tgt_len = np.asarray([len(e["targets"]) for e in examples], dtype=np.int64)
    too_long = np.flatnonzero((in_len > length) | (tgt_len > length))
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(
            f"example {i} (inputs {in_len[i]}, targets {tgt_len[i]} tokens) is longer than the "
            f"packing length {length}"
        )
    order = _rng(seed, epoch).permutation(n) if shuffle else np.arange(n)
    # Fill levels of the rows opened so far; vectorized first-fit keeps this O(n * rows) in
    # numpy instead of Python (fine for corpora of ~1e5 sentences).
    in_fill = np.zeros(n, dtype=np.int64)
    tgt_fill = np.zeros(n, dtype=np.int64)
    row_members: list[list[int]] = []
    for i in order:
        open_rows = len(row_members)
        fits = (in_fill[:open_rows] + in_len[i] <= length) & (
            tgt_fill[:open_rows] + tgt_len[i] <= length
        )
        row = int(np.argmax(fits)) if fits.any() else open_rows
        if row == open_rows:
            row_members.append([])
        row_members[row].append(int(i))
        in_fill[row] += in_len[i]
        tgt_fill[row] += tgt_len[i]

    batches = []
    for start in range(0, len(row_members), rows_per_batch):
        batch = {
            f"{side}{suffix}": np.zeros((rows_per_batch, length), dtype=np.int32)
            for side in ("inputs", "targets")
            for suffix in ("", "_segmentation", "_position")
        }
        for r, members in enumerate(row_members[start : start + rows_per_batch]):
            for side in ("inputs", "targets"):
                offset = 0
                for segment, i in enumerate(members, start=1):
                    seq = examples[i][side]
                    end = offset + len(seq)
                    batch[side][r, offset:end] = seq
                    batch[f"{side}_segmentation"][r, offset:end] = segment
                    batch[f"{side}_position"][r, offset:end] = np.arange(len(seq))
                    offset = end
        batches.append(batch)
    return batches


def lm_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
) -> list[Batch]:
    """Language-model batches ``dict(targets=[batch_size, seq_len])`` of a token stream.

    The stream is cut, from a random offset in ``[0, seq_len)``, into non-overlapping
    windows of ``seq_len`` tokens, so each epoch sees different window borders; windows are
    shuffled and grouped by ``batch_size``, the last batch completed with all-PAD rows.
    RNG seeded by ``(seed, epoch)``.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 1 or len(tokens) < seq_len:
        raise ValueError(
            f"tokens must be a 1-D stream of at least seq_len={seq_len} tokens; "
            f"got shape {tokens.shape}"
        )
    rng = _rng(seed, epoch)
    offset = int(rng.integers(0, min(seq_len, len(tokens) - seq_len + 1)))
    num_windows = (len(tokens) - offset) // seq_len
    windows = tokens[offset : offset + num_windows * seq_len].reshape(num_windows, seq_len)
    windows = windows[rng.permutation(num_windows)]
    batches = []
    for start in range(0, num_windows, batch_size):
        chunk = windows[start : start + batch_size]
        targets = np.full((batch_size, seq_len), PAD_ID, dtype=np.int32)
        targets[: len(chunk)] = chunk
        batches.append({"targets": targets})
    return batches


def classification_batches(
    examples: Sequence[tuple[np.ndarray, int]],
    *,
    max_len: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[Batch]:
    """Classification batches: ``inputs`` [B, max_len], ``label`` [B], ``weights`` [B].

    ``weights`` is 1 for real rows and 0 for the all-PAD rows completing the last batch
    (their ``label`` is 0), so they drop out of loss and accuracy.

    Raises:
      ValueError: an example has more than ``max_len`` ids (use :func:`encode_labeled`).
    """
    order = _rng(seed, epoch).permutation(len(examples)) if shuffle else range(len(examples))
    order = list(order)
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        inputs = np.full((batch_size, max_len), PAD_ID, dtype=np.int32)
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


# ============================================================================ streaming


class BatchStream:
    """Endless, resumable, host-sharded iterator over epochs of batches.

    ``make_batches(epoch)`` returns that epoch's global batch list (built the same way on
    every host: same data, same seed). Process ``p`` of ``P`` receives rows
    ``[p*R/P, (p+1)*R/P)`` of each ``R``-row global batch. The position is
    ``(epoch, index)``: :meth:`state` after ``n`` calls to :meth:`next` and a
    :meth:`restore` of it yields the same following batches as an uninterrupted stream.
    """

    def __init__(
        self,
        make_batches: Callable[[int], list[Batch]],
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must be in [0, process_count={process_count}); got {process_index}"
            )
        self._make_batches = make_batches
        self.process_index = process_index
        self.process_count = process_count
        self._epoch = 0
        self._index = 0
        self._cached_epoch: int | None = None
        self._cached: list[Batch] = []

    def epoch_batches(self) -> list[Batch]:
        """Global (unsharded) batches of the current epoch, built once and cached."""
        if self._cached_epoch != self._epoch:
            self._cached = self._make_batches(self._epoch)
            self._cached_epoch = self._epoch
            if not self._cached:
                raise ValueError(f"make_batches({self._epoch}) returned no batches")
        return self._cached

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

    def shard(self, batch: Batch) -> Batch:
        """This process's contiguous slice of rows of a global batch."""
        out = {}
        for key, value in batch.items():
            rows = value.shape[0]
            if rows % self.process_count:
                raise ValueError(
                    f"batch rows ({rows}) are not divisible by process_count "
                    f"({self.process_count}); make batch_size_multiple a multiple of it"
                )
            per = rows // self.process_count
            out[key] = value[self.process_index * per : (self.process_index + 1) * per]
        return out

    def next(self) -> Batch:
        """This process's part of the next batch; rolls over to the next epoch at the end."""
        if self._index >= len(self.epoch_batches()):
            self._epoch += 1
            self._index = 0
        batch = self.epoch_batches()[self._index]
        self._index += 1
        return self.shard(batch)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        return self.next()


# ============================================================================ entry point


@dataclasses.dataclass
class TranslationData:
    """Everything a translation run needs from the data side.

    Attributes:
      train: endless stream of this process's training batches.
      eval_batches: global evaluation batches (fixed shapes, not shuffled) with an
        ``index`` [rows] key pointing into ``eval_pairs`` (-1 on padding rows).
      eval_pairs: normalized (source, reference) strings of the eval split (BLEU).
      src_tokenizer, tgt_tokenizer: the same object when the vocabulary is shared.
      stats: counts of the training split; eval_stats: of the eval split.
      padding_fraction: share of PAD target positions in the epoch-0 training batches.
      boundaries: the bucket lengths (one compiled shape each).
    """

    train: BatchStream
    eval_batches: list[Batch]
    eval_pairs: list[tuple[str, str]]
    src_tokenizer: Tokenizer
    tgt_tokenizer: Tokenizer
    stats: DataStats
    padding_fraction: float
    eval_stats: DataStats = dataclasses.field(default_factory=DataStats)
    boundaries: list[int] = dataclasses.field(default_factory=list)


def build_translation_data(
    config: Any,
    workdir: str,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> TranslationData:
    """Loads, tokenizes and batches a translation corpus as described by ``config``.

    ``config`` needs the attributes: dataset, dataset_config, data_dir, data_format,
    source_lang, target_lang, train_split, eval_split, vocab_size, shared_vocab,
    spm_model_type, max_len, too_long, tokens_per_batch, batch_size_multiple, packing,
    seed (optional: source_column, target_column). SentencePiece models are trained on the
    training split only and saved in ``workdir`` (``spm_shared.model``, or ``spm_src.model``
    and ``spm_tgt.model``); an existing file is reused. Eval pairs are always truncated,
    never dropped, so the eval set is complete.
    """
    if config.batch_size_multiple % process_count:
        raise ValueError(
            f"batch_size_multiple ({config.batch_size_multiple}) must be a multiple of "
            f"process_count ({process_count}) so every host gets the same number of rows"
        )
    _check_too_long(config.too_long)
    source = {
        "dataset": config.dataset,
        "dataset_config": config.dataset_config,
        "data_dir": config.data_dir,
        "data_format": config.data_format,
        "source_lang": config.source_lang,
        "target_lang": config.target_lang,
        "source_column": getattr(config, "source_column", None),
        "target_column": getattr(config, "target_column", None),
    }
    stats, eval_stats = DataStats(), DataStats()
    train_pairs = load_pairs(split=config.train_split, stats=stats, **source)
    eval_pairs = load_pairs(split=config.eval_split, stats=eval_stats, **source)

    paths.makedirs(workdir)
    spm_kwargs = {"model_type": config.spm_model_type, "seed": config.seed}
    if config.shared_vocab:
        src_tokenizer = tgt_tokenizer = load_or_train(
            os.path.join(workdir, "spm_shared.model"),
            lambda: (text for pair in train_pairs for text in pair),
            config.vocab_size,
            **spm_kwargs,
        )
    else:
        src_tokenizer = load_or_train(
            os.path.join(workdir, "spm_src.model"),
            lambda: (s for s, _ in train_pairs),
            config.vocab_size,
            **spm_kwargs,
        )
        tgt_tokenizer = load_or_train(
            os.path.join(workdir, "spm_tgt.model"),
            lambda: (t for _, t in train_pairs),
            config.vocab_size,
            **spm_kwargs,
        )

    max_len = config.max_len
    train_examples = encode_pairs(
        train_pairs,
        src_tokenizer,
        tgt_tokenizer,
        max_len=max_len,
        too_long=config.too_long,
        stats=stats,
    )
    if not train_examples:
        raise ValueError(f"no training examples left: {stats.summary()}")
    eval_examples = encode_pairs(
        eval_pairs,
        src_tokenizer,
        tgt_tokenizer,
        max_len=max_len,
        too_long="truncate",
        stats=eval_stats,
    )
    boundaries = bucket_boundaries(max_len)
    tokens_per_batch, multiple, seed = (
        config.tokens_per_batch,
        config.batch_size_multiple,
        config.seed,
    )
    if config.packing:
        rows = rows_for_length(max_len, tokens_per_batch, multiple)

        def make_batches(epoch: int) -> list[Batch]:
            return pack_examples(
                train_examples, length=max_len, rows_per_batch=rows, seed=seed, epoch=epoch
            )
    else:

        def make_batches(epoch: int) -> list[Batch]:
            return batch_by_tokens(
                train_examples,
                tokens_per_batch=tokens_per_batch,
                boundaries=boundaries,
                batch_size_multiple=multiple,
                seed=seed,
                epoch=epoch,
            )

    train = BatchStream(make_batches, process_index=process_index, process_count=process_count)
    eval_batches = batch_by_tokens(
        eval_examples,
        tokens_per_batch=tokens_per_batch,
        boundaries=boundaries,
        batch_size_multiple=multiple,
        shuffle=False,
        with_index=True,
    )
    return TranslationData(
        train=train,
        eval_batches=eval_batches,
        eval_pairs=eval_pairs,
        src_tokenizer=src_tokenizer,
        tgt_tokenizer=tgt_tokenizer,
        stats=stats,
        padding_fraction=padding_fraction(train.epoch_batches()),
        eval_stats=eval_stats,
        boundaries=list(boundaries) if not config.packing else [max_len],
    )
