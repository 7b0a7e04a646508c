"""Reading: text from local files, ``gs://`` or the Hugging Face hub, normalized and counted.

One job: strings in, strings out. Translation pairs (parallel text files, TSV, JSONL, hub
datasets, optionally streamed), plain text lines (language modelling) and labelled sentences
(classification). Every reader keeps honest counts in :class:`DataStats` (what was read,
dropped, truncated), printed once at the start of training. Tokenizing is in
``encoding.py``, batching in ``batching.py`` / ``packing.py``, each task's assembly in its
``*_task.py`` module.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from etils import epath

DATA_FORMATS = ("parallel_text", "tsv", "jsonl")


class DataError(ValueError):
    """Input data (or the config naming it) that a run cannot use: an empty split, a
    synthetic task with nothing left to train on, a length too short for what the run does
    with it. The message is one line naming the config field or file and what would be valid.
    """


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


def decode_utf8(data: bytes, path: str, first_line: int = 1) -> str:
    """``data`` (lines of ``path`` from line ``first_line`` on) decoded as UTF-8.

    Raises:
      DataError: a byte that is not UTF-8; the message names the file, the line (1-based,
        counting "\\n") and the byte's position in it (1-based), as the translate CLI does.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - data.rfind(b"\n", 0, e.start)  # rfind: -1 on the first line
        raise DataError(
            f"{path} line {line}: byte {column} (0x{data[e.start]:02x}) is not UTF-8; convert "
            "the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _read_lines(path: str) -> list[str]:
    """Lines of a local or ``gs://`` text file, without their newline (DataError: a line that
    is not UTF-8)."""
    file = epath.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    # Split on "\n" only. Universal newlines (and str.splitlines) would also split on "\r",
    # U+2028, U+0085, ... inside a line and break the source/target alignment.
    lines = decode_utf8(file.read_bytes(), path).split("\n")
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


def _clean_pairs_iter(
    pairs: Iterable[tuple[str, str]], stats: DataStats | None
) -> Iterator[tuple[str, str]]:
    stats = stats if stats is not None else DataStats()
    for source, target in pairs:
        stats.num_read += 1
        source, target = normalize(source or ""), normalize(target or "")
        if not source or not target:
            stats.num_empty_dropped += 1
            continue
        yield source, target


def _clean_pairs(
    pairs: Iterable[tuple[str, str]], stats: DataStats | None
) -> list[tuple[str, str]]:
    return list(_clean_pairs_iter(pairs, stats))


def _has_rows(path: str, data_format: str) -> bool:
    """Whether a .tsv file holds a line after its header, or a .jsonl file a line at all.

    `datasets` fails on a file without one ('Instruction "data" corresponds to no data!')
    rather than returning no rows; reads at most the first two non-blank lines.
    """
    needed = 2 if data_format == "tsv" else 1
    with epath.Path(path).open("rb") as f:
        for line in f:
            needed -= bool(line.strip())
            if not needed:
                return True
    return False


def _load_local_table(
    path: str,
    data_format: str,
    text_columns: Sequence[str],
    other_columns: Sequence[str] = (),
    *,
    streaming: bool = False,
) -> Any | None:
    """Loads a local .tsv/.jsonl file with a `datasets` packaged builder (works offline).

    ``text_columns`` are read as strings verbatim; all named columns must exist. With
    ``streaming`` the result is an ``IterableDataset`` read as it is iterated. None when the
    file holds no data row (:func:`_has_rows`).
    """
    if not epath.Path(path).is_file():  # `datasets` itself reads local and gs:// files
        raise FileNotFoundError(f"data file not found: {path}")
    if not _has_rows(path, data_format):
        return None
    import datasets  # Slow to import: only when a table is actually read.

    kwargs = {"streaming": True} if streaming else {}
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
            **kwargs,
        )
    else:
        table = datasets.load_dataset("json", data_files={"data": path}, split="data", **kwargs)
    names = table.column_names
    if names is None:  # a stream whose features are unknown until read
        names = list(next(iter(table), {}).keys())
    missing = [c for c in (*text_columns, *other_columns) if c not in names]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing}; its columns are {names}")
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
    streaming: bool = False,
    stats: DataStats | None = None,
) -> list[tuple[str, str]]:
    """Loads normalized (source, target) sentence pairs of one split.

    With ``data_dir`` set, reads local files:
      * "parallel_text": ``{data_dir}/{split}.{source_lang}`` and ``.{target_lang}``;
      * "tsv" / "jsonl": ``{data_dir}/{split}.tsv`` / ``.jsonl`` with columns
        ``source_column``/``target_column`` (default: the language codes).

    Without ``data_dir``, loads ``dataset`` (``dataset_config``) from the Hugging Face hub:
    either a ``translation`` dict column (wmt14 style) or one column per language
    (bentrevett/multi30k style). :func:`iter_pairs` yields the same pairs one at a time.
    """
    return list(
        iter_pairs(
            dataset=dataset,
            dataset_config=dataset_config,
            data_dir=data_dir,
            split=split,
            source_lang=source_lang,
            target_lang=target_lang,
            data_format=data_format,
            source_column=source_column,
            target_column=target_column,
            streaming=streaming,
            stats=stats,
        )
    )


def _count_lines(path: str) -> int:
    """Lines of ``path`` (local or ``gs://``) as :func:`_read_lines` splits them ("\\n" only),
    read in binary."""
    count, last = 0, b"\n"
    with epath.Path(path).open("rb") as f:
        while chunk := f.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _iter_lines(path: str) -> Iterator[str]:
    """Lines of a local or ``gs://`` text file, one at a time, split on "\\n" only (binary
    lines: "\\r" and U+2028 stay inside their line, as in :func:`_read_lines`); DataError at
    a line that is not UTF-8."""
    with epath.Path(path).open("rb") as f:
        for number, line in enumerate(f, start=1):
            yield decode_utf8(line.rstrip(b"\n"), path, number)


def _table_rows(table: Any, columns: Sequence[str], batch_size: int = 10_000) -> Iterator[tuple]:
    """Rows (tuples of ``columns``) of a `datasets` Dataset or IterableDataset, read in chunks
    (never a whole column as one Python list)."""
    for chunk in table.iter(batch_size=batch_size):
        yield from zip(*(chunk[c] for c in columns), strict=True)


def iter_pairs(
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
    streaming: bool = False,
    stats: DataStats | None = None,
) -> Iterator[tuple[str, str]]:
    """Normalized (source, target) pairs of one split, one at a time (see :func:`load_pairs`).

    Nothing is held in memory beyond a chunk: local parallel files are read line by line,
    tables chunk by chunk. ``streaming=True`` reads hub datasets (and local tsv/jsonl files)
    through ``datasets.load_dataset(..., streaming=True)``: nothing is downloaded or cached
    first, which suits corpora larger than the disk or memory of a host.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}; got {data_format!r}")
    source_column = source_column or source_lang
    target_column = target_column or target_lang
    if data_dir is not None:
        if data_format == "parallel_text":
            source_path = os.path.join(data_dir, f"{split}.{source_lang}")
            target_path = os.path.join(data_dir, f"{split}.{target_lang}")
            for path in (source_path, target_path):
                if not epath.Path(path).is_file():
                    raise FileNotFoundError(f"data file not found: {path}")
            num_source, num_target = _count_lines(source_path), _count_lines(target_path)
            if num_source != num_target:
                raise ValueError(
                    f"parallel files have different line counts: {source_path} has "
                    f"{num_source} lines, {target_path} has {num_target} lines"
                )
            pairs = zip(_iter_lines(source_path), _iter_lines(target_path), strict=True)
        else:
            path = os.path.join(data_dir, f"{split}.{data_format}")
            table = _load_local_table(
                path, data_format, [source_column, target_column], streaming=streaming
            )
            pairs = () if table is None else _table_rows(table, [source_column, target_column])
        yield from _clean_pairs_iter(pairs, stats)
        return

    if dataset is None:
        raise ValueError("load_pairs needs either data_dir (local files) or dataset (hub name)")
    import datasets  # Slow to import: only when the hub is actually used.

    kwargs = {"streaming": True} if streaming else {}
    table = datasets.load_dataset(dataset, dataset_config, split=split, **kwargs)
    names = table.column_names
    if names is None:  # a stream whose features are unknown until read
        names = list(next(iter(table)).keys())
    if "translation" in names:
        pairs = (
            (row[source_lang], row[target_lang]) for (row,) in _table_rows(table, ["translation"])
        )
    else:
        missing = [c for c in (source_column, target_column) if c not in names]
        if missing:
            raise ValueError(
                f"dataset {dataset!r} split {split!r} has no 'translation' column and no "
                f"column(s) {missing}; its columns are {names}"
            )
        pairs = _table_rows(table, [source_column, target_column])
    yield from _clean_pairs_iter(pairs, stats)


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
    if table is None:  # a header and no row
        return []
    out = []
    for text, label in zip(table[text_column], table[label_column], strict=True):
        stats.num_read += 1
        text = normalize(text)
        if not text:
            stats.num_empty_dropped += 1
            continue
        out.append((text, int(label)))
    return out


def describe_pairs_source(
    *,
    split: str,
    source_lang: str,
    target_lang: str,
    dataset: str | None = None,
    dataset_config: str | None = None,
    data_dir: str | None = None,
    data_format: str = "parallel_text",
    **unused: Any,
) -> str:
    """Where :func:`iter_pairs` reads ``split`` from, in words, for error messages: the
    local file(s) under ``data_dir``, else the hub dataset (same arguments as
    :func:`iter_pairs`; others are ignored)."""
    if data_dir is not None:
        if data_format == "parallel_text":
            base = os.path.join(data_dir, split)
            return f"{base}.{source_lang} / {base}.{target_lang}"
        return os.path.join(data_dir, f"{split}.{data_format}")
    config = f" (config {dataset_config!r})" if dataset_config else ""
    return f"hub dataset {dataset!r}{config} split {split!r}"
