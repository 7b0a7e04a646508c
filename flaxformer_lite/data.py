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
import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
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


def _load_local_table(
    path: str,
    data_format: str,
    text_columns: Sequence[str],
    other_columns: Sequence[str] = (),
    *,
    streaming: bool = False,
) -> Any:
    """Loads a local .tsv/.jsonl file with a `datasets` packaged builder (works offline).

    ``text_columns`` are read as strings verbatim; all named columns must exist. With
    ``streaming`` the result is an ``IterableDataset`` read as it is iterated.
    """
    import datasets  # Slow to import: only when a table is actually read.

    if not epath.Path(path).is_file():  # `datasets` itself reads local and gs:// files
        raise FileNotFoundError(f"data file not found: {path}")
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
    lines: "\\r" and U+2028 stay inside their line, as in :func:`_read_lines`)."""
    with epath.Path(path).open("rb") as f:
        for line in f:
            yield line.rstrip(b"\n").decode("utf-8")


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
            pairs = _table_rows(table, [source_column, target_column])
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


# ============================================================================ token cache


class EncodedPairs:
    """Token ids of ``n`` encoded pairs in four flat arrays (a CSR layout, 4 bytes a token).

    Example ``i`` is ``inputs_tokens[inputs_offsets[i]:inputs_offsets[i + 1]]`` (EOS
    included), and the same for targets. The token arrays may be memory-mapped files: reading
    example ``i`` touches only its own bytes, so a host that feeds a share of the rows reads
    only that share from disk. Indexing returns an :data:`Example` dict, so an
    ``EncodedPairs`` goes wherever a list of examples does.

    Attributes:
      inputs_tokens, targets_tokens: int32 [total tokens of that side].
      inputs_offsets, targets_offsets: int64 [n + 1], starting at 0.
    """

    ARRAYS = ("inputs_tokens", "inputs_offsets", "targets_tokens", "targets_offsets")

    def __init__(
        self,
        inputs_tokens: np.ndarray,
        inputs_offsets: np.ndarray,
        targets_tokens: np.ndarray,
        targets_offsets: np.ndarray,
    ) -> None:
        if len(inputs_offsets) != len(targets_offsets) or len(inputs_offsets) < 1:
            raise ValueError(
                f"inputs_offsets [{len(inputs_offsets)}] and targets_offsets "
                f"[{len(targets_offsets)}] must both be [n + 1]"
            )
        self.inputs_tokens, self.inputs_offsets = inputs_tokens, inputs_offsets
        self.targets_tokens, self.targets_offsets = targets_tokens, targets_offsets

    @classmethod
    def from_examples(cls, examples: Sequence[Example]) -> EncodedPairs:
        """Packs a list of examples into the flat layout."""
        arrays = []
        for side in ("inputs", "targets"):
            seqs = [np.asarray(e[side], np.int32) for e in examples]
            offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
            np.cumsum([len(s) for s in seqs], out=offsets[1:])
            tokens = np.concatenate(seqs) if seqs else np.zeros((0,), np.int32)
            arrays += [tokens.astype(np.int32), offsets]
        return cls(*arrays)

    @classmethod
    def concatenate(cls, parts: Sequence[EncodedPairs]) -> EncodedPairs:
        """One ``EncodedPairs`` of several, in order."""
        arrays = []
        for side in ("inputs", "targets"):
            tokens = [getattr(p, f"{side}_tokens") for p in parts]
            offsets, base = [np.zeros((1,), np.int64)], 0
            for p, t in zip(parts, tokens, strict=True):
                offsets.append(getattr(p, f"{side}_offsets")[1:] + base)
                base += len(t)
            arrays += [np.concatenate([np.zeros((0,), np.int32), *tokens]), np.concatenate(offsets)]
        return cls(*arrays)

    def __len__(self) -> int:
        return len(self.inputs_offsets) - 1

    def __getitem__(self, i: int) -> Example:
        a, b = self.inputs_offsets[i], self.inputs_offsets[i + 1]
        c, d = self.targets_offsets[i], self.targets_offsets[i + 1]
        return {
            "inputs": np.asarray(self.inputs_tokens[a:b]),
            "targets": np.asarray(self.targets_tokens[c:d]),
        }

    @property
    def input_lengths(self) -> np.ndarray:
        """int64 [n]."""
        return np.diff(self.inputs_offsets)

    @property
    def target_lengths(self) -> np.ndarray:
        """int64 [n]."""
        return np.diff(self.targets_offsets)


def encode_pairs_to_arrays(
    pairs: Iterable[tuple[str, str]],
    src_tokenizer: Tokenizer,
    tgt_tokenizer: Tokenizer,
    *,
    max_len: int,
    too_long: str = "truncate",
    stats: DataStats | None = None,
    chunk_size: int = 50_000,
) -> EncodedPairs:
    """:func:`encode_pairs` over an iterable of pairs, ``chunk_size`` pairs at a time, into
    flat arrays: only one chunk of strings and Python lists exists at any time."""
    parts = []
    iterator = iter(pairs)
    while chunk := list(itertools.islice(iterator, chunk_size)):
        examples = encode_pairs(
            chunk, src_tokenizer, tgt_tokenizer, max_len=max_len, too_long=too_long, stats=stats
        )
        parts.append(EncodedPairs.from_examples(examples))
    return EncodedPairs.concatenate(parts) if parts else EncodedPairs.from_examples([])


def _is_local(path: Any) -> bool:
    return "://" not in str(path)


def save_token_cache(directory: Any, encoded: EncodedPairs, meta: dict[str, Any]) -> None:
    """Writes ``encoded`` as four ``.npy`` files and ``meta.json`` into ``directory``.

    Every local file goes to a temporary name first and is renamed into place (an object
    store writes objects whole); ``meta.json`` comes last and marks the cache complete, so a
    reader (another host, a resumed run) never sees half a cache, and a crash mid-write
    leaves it to be rebuilt. ``directory`` is a
    local path or any URI ``etils.epath`` reaches (``gs://...``).
    """
    from etils import epath

    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Locally: a temporary name, then an atomic rename. In an object store (gs://) an object
    # only appears once its upload completes, and a rename is a copy: write in place.
    suffix = f".tmp.{os.getpid()}" if _is_local(directory) else ""

    def publish(name: str, write: Callable[[Any], None]) -> None:
        path = directory / f"{name}{suffix}"
        with path.open("wb") as f:
            write(f)
        if suffix:
            path.rename(directory / name)

    for name in EncodedPairs.ARRAYS:
        publish(f"{name}.npy", lambda f, name=name: np.save(f, getattr(encoded, name)))
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    publish("meta.json", lambda f: f.write(text))


def load_token_cache(directory: Any, key: dict[str, Any]) -> tuple[EncodedPairs, dict] | None:
    """The cache in ``directory`` if complete and built for ``key`` (else None).

    Local files are memory-mapped (pages are read when a batch touches them); a remote file
    (``gs://``) is copied once to a local temporary file, memory-mapped, and the copy
    unlinked (the mapping keeps it alive until the process ends).
    """
    from etils import epath

    directory = epath.Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("key") != key:
        return None
    arrays = []
    for name in EncodedPairs.ARRAYS:
        path = directory / f"{name}.npy"
        if _is_local(path):
            arrays.append(np.load(os.fspath(path), mmap_mode="r"))
            continue
        fd, local = tempfile.mkstemp(suffix=".npy")
        os.close(fd)
        try:
            path.copy(epath.Path(local), overwrite=True)
            arrays.append(np.load(local, mmap_mode="r"))
        finally:
            os.unlink(local)
    return EncodedPairs(*arrays), meta


def main_process_first(fn: Callable[[bool], Any], name: str) -> Any:
    """``fn(True)`` on JAX process 0, then, after a barrier, ``fn(False)`` on the others.

    For work whose first call writes a shared file and whose later calls only read it (train
    or load the vocabulary, build or load the token cache): one writer, no race, and the
    readers open the finished file. The barrier is ``multihost_utils.sync_global_devices``.
    With one process it is just ``fn(True)``.
    """
    import jax

    if jax.process_count() == 1:
        return fn(True)
    from jax.experimental import multihost_utils

    result = fn(True) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(f"flaxformer_lite:{name}")
    return fn(False) if jax.process_index() != 0 else result


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


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def _side_lengths(examples: Sequence[Example] | EncodedPairs) -> tuple[np.ndarray, np.ndarray]:
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
    (none: an all-PAD row). A plan costs a few integers per example, so every host can plan
    the whole epoch and read the tokens of its own rows only (:meth:`take`).

    Attributes:
      length: columns of the batch.
      rows: rows of the batch.
      members: int64 [k] example indices, row after row.
      row_splits: int64 [rows + 1] offsets into ``members``.
      packed: several examples per row, with segmentation and position keys.
      with_index: also return ``index`` [rows] (the example of each row, -1 on padding
        rows; one example per row only).
    """

    length: int
    rows: int
    members: np.ndarray
    row_splits: np.ndarray
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
            k: np.zeros((n, self.length), dtype=np.int32) for k in (keys if self.packed else sides)
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


def _plans_from_rows(
    members: np.ndarray, row_splits: np.ndarray, *, length: int, rows: int, **kwargs: Any
) -> list[BatchPlan]:
    """Cuts rows ``row_splits`` (over ``members``) into plans of ``rows`` rows; the last one
    is completed with empty rows."""
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
                **kwargs,
            )
        )
    return plans


def plan_by_tokens(
    lengths: np.ndarray,
    *,
    tokens_per_batch: int,
    boundaries: Sequence[int],
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
    rng = _rng(seed, epoch)
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    plans = []
    for b, length in enumerate(boundaries):
        members = order[bucket_of[order] == b]
        if shuffle:
            members = members[np.argsort(lengths[members], kind="stable")]
        rows = rows_for_length(length, tokens_per_batch, batch_size_multiple)
        plans += _plans_from_rows(
            members.astype(np.int64),
            np.arange(len(members) + 1, dtype=np.int64),
            length=length,
            rows=rows,
            with_index=with_index,
        )
    if shuffle:
        plans = [plans[i] for i in rng.permutation(len(plans))]
    return plans


def first_fit_rows(in_len: np.ndarray, tgt_len: np.ndarray, length: int) -> np.ndarray:
    """Row of each example under first-fit packing of two sides into rows of ``length``.

    Example ``k`` (in the given order) goes to the lowest-numbered row where both its
    ``in_len[k]`` and ``tgt_len[k]`` still fit. Rooms only shrink, so the first row that
    fits a given ``(inputs, targets)`` size never moves left: one pointer per distinct size
    remembers it and only moves right, past rows that no longer fit that size (a short
    Python scan, then a vectorized numpy scan with doubling windows for long jumps). Each
    example costs O(1) plus its pointer's advance, and a pointer crosses each row at most
    once: O(examples + sizes x rows) in the worst case (``sizes`` <= ``length``^2 distinct
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
    order = _rng(seed, epoch).permutation(n) if shuffle else np.arange(n)
    row_of = first_fit_rows(in_len[order], tgt_len[order], length)
    # Row after row, each row's examples in arrival order (a stable sort keeps it).
    by_row = np.argsort(row_of, kind="stable")
    counts = np.bincount(row_of, minlength=int(row_of.max()) + 1 if n else 0)
    row_splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return _plans_from_rows(
        order[by_row].astype(np.int64),
        row_splits,
        length=length,
        rows=rows_per_batch,
        packed=True,
    )


def batch_by_tokens(
    examples: Sequence[Example] | EncodedPairs,
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
    lengths = np.maximum(*_side_lengths(examples))
    plans = plan_by_tokens(
        lengths,
        tokens_per_batch=tokens_per_batch,
        boundaries=boundaries,
        batch_size_multiple=batch_size_multiple,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        with_index=with_index,
    )
    return [plan.take(examples) for plan in plans]


def padding_fraction(batches: Iterable[Batch]) -> float:
    """Share of PAD among all target positions of ``batches`` (0.0 for no batches)."""
    pads = total = 0
    for batch in batches:
        targets = batch["targets"]
        pads += int(np.count_nonzero(targets == PAD_ID))
        total += targets.size
    return pads / total if total else 0.0


def pack_examples(
    examples: Sequence[Example] | EncodedPairs,
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
    in_len, tgt_len = _side_lengths(examples)
    plans = plan_packing(
        in_len,
        tgt_len,
        length=length,
        rows_per_batch=rows_per_batch,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
    )
    return [plan.take(examples) for plan in plans]


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
    every host: same data, same seed): either batches, or :class:`BatchPlan` s read from
    ``examples``, in which case each host reads the tokens of its own rows only. Process
    ``p`` of ``P`` receives rows ``[p*R/P, (p+1)*R/P)`` of each ``R``-row global batch. The
    position is ``(epoch, index)``: :meth:`state` after ``n`` calls to :meth:`next` and a
    :meth:`restore` of it yields the same following batches as an uninterrupted stream.
    """

    def __init__(
        self,
        make_batches: Callable[[int], list[Batch]] | Callable[[int], list[BatchPlan]],
        *,
        process_index: int = 0,
        process_count: int = 1,
        examples: Sequence[Example] | EncodedPairs | None = None,
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

    def _global(self, item: Batch | BatchPlan) -> Batch:
        return item.take(self._examples) if isinstance(item, BatchPlan) else item

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
            return batch.take(self._examples, *self._rows(batch.rows))
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
      cache_dir: the token cache of the training split (see :func:`save_token_cache`).
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
    cache_dir: str | None = None


CACHE_DIR = "data_cache"
_CACHE_FORMAT = 1


def _file_digest(path: str) -> str:
    from etils import epath

    return hashlib.sha256(epath.Path(path).read_bytes()).hexdigest()


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
    seed (optional: source_column, target_column, streaming).

    Several hosts: JAX process 0 does the one-off work and the others wait for it
    (:func:`main_process_first`). It trains the SentencePiece models on the training split
    when the workdir has none (``spm_shared.model``, or ``spm_src.model`` and
    ``spm_tgt.model``), then tokenizes the training split once into a token cache,
    ``{workdir}/data_cache/{split}-{hash}/`` (:func:`save_token_cache`; the hash covers the
    data source, ``max_len``, ``too_long`` and the vocabulary bytes). Every process then
    loads the vocabulary and memory-maps the cache; a resumed run reads neither the corpus
    nor the tokenizer again. Each process plans every batch from the examples' lengths (a few
    bytes each) and reads the tokens of its own rows only. ``streaming=True`` reads the
    corpus through ``datasets`` streaming (see :func:`iter_pairs`); process 0 then reads it
    twice when it has to train the vocabulary (once for that, once to tokenize).

    Eval pairs are read and encoded by every process (an eval split is small); they are
    always truncated, never dropped, so the eval set is complete.
    """
    import jax

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
    streaming = bool(getattr(config, "streaming", False) or False)

    def train_pairs(stats: DataStats | None = None) -> Iterator[tuple[str, str]]:
        return iter_pairs(split=config.train_split, streaming=streaming, stats=stats, **source)

    paths.makedirs(workdir)
    spm_kwargs = {"model_type": config.spm_model_type, "seed": config.seed}
    names = ["spm_shared.model"] if config.shared_vocab else ["spm_src.model", "spm_tgt.model"]
    vocab_paths = [os.path.join(workdir, name) for name in names]
    corpus_sides = [
        lambda: (text for pair in train_pairs() for text in pair),
        lambda: (s for s, _ in train_pairs()),
        lambda: (t for _, t in train_pairs()),
    ][0 if config.shared_vocab else 1 :]

    def vocabularies(writer: bool) -> list[Tokenizer]:
        if not writer:
            return [Tokenizer.load(path) for path in vocab_paths]
        return [
            load_or_train(path, texts, config.vocab_size, **spm_kwargs)
            for path, texts in zip(vocab_paths, corpus_sides, strict=False)
        ]

    tokenizers = main_process_first(vocabularies, "vocabulary")
    src_tokenizer, tgt_tokenizer = tokenizers[0], tokenizers[-1]

    max_len = config.max_len
    key = {
        "format": _CACHE_FORMAT,
        "source": source,
        "split": config.train_split,
        "max_len": max_len,
        "too_long": config.too_long,
        "vocabulary": [_file_digest(path) for path in vocab_paths],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = os.path.join(workdir, CACHE_DIR, f"{config.train_split}-{digest}")

    def token_cache(writer: bool) -> tuple[EncodedPairs, dict]:
        loaded = load_token_cache(cache_dir, key)
        if loaded is not None:
            return loaded
        if not writer:
            raise FileNotFoundError(
                f"process {jax.process_index()}: no complete token cache in {cache_dir} after "
                "process 0 built it (is the workdir shared by every host?)"
            )
        stats = DataStats()
        encoded = encode_pairs_to_arrays(
            train_pairs(stats),
            src_tokenizer,
            tgt_tokenizer,
            max_len=max_len,
            too_long=config.too_long,
            stats=stats,
        )
        save_token_cache(cache_dir, encoded, {"key": key, "stats": dataclasses.asdict(stats)})
        return load_token_cache(cache_dir, key)

    train_examples, meta = main_process_first(token_cache, "token cache")
    stats = DataStats(**meta["stats"])
    if not len(train_examples):
        raise ValueError(f"no training examples left: {stats.summary()}")

    eval_stats = DataStats()
    eval_pairs = list(
        iter_pairs(split=config.eval_split, streaming=streaming, stats=eval_stats, **source)
    )
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
    in_len, tgt_len = train_examples.input_lengths, train_examples.target_lengths
    if config.packing:
        rows = rows_for_length(max_len, tokens_per_batch, multiple)

        def make_plans(epoch: int) -> list[BatchPlan]:
            return plan_packing(
                in_len, tgt_len, length=max_len, rows_per_batch=rows, seed=seed, epoch=epoch
            )
    else:
        lengths = np.maximum(in_len, tgt_len)

        def make_plans(epoch: int) -> list[BatchPlan]:
            return plan_by_tokens(
                lengths,
                tokens_per_batch=tokens_per_batch,
                boundaries=boundaries,
                batch_size_multiple=multiple,
                seed=seed,
                epoch=epoch,
            )

    train = BatchStream(
        make_plans,
        process_index=process_index,
        process_count=process_count,
        examples=train_examples,
    )
    plans = train.epoch_plans()
    positions = sum(plan.rows * plan.length for plan in plans)
    real = sum(plan.target_tokens(tgt_len) for plan in plans)
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
        padding_fraction=1.0 - real / positions,
        eval_stats=eval_stats,
        boundaries=list(boundaries) if not config.packing else [max_len],
        cache_dir=cache_dir,
    )
