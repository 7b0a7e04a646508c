"""The classification task: labelled sentences (TSV or a hub dataset) to one row per sentence,
scored by accuracy."""

from __future__ import annotations

import os
from typing import Any

from flaxformer_lite.data.batching import Batch, classification_batches
from flaxformer_lite.data.encoding import encode_labeled
from flaxformer_lite.data.reading import DataError, DataStats, load_labeled, normalize
from flaxformer_lite.data.stream import BatchStream
from flaxformer_lite.data.tasks.base import Task, local_split, vocabulary_ids
from flaxformer_lite.data.workdir import vocabulary


def _source(config: Any, split: str) -> str:
    """Where ``split`` is read from: ``{data_dir}/{split}.tsv`` or the hub dataset."""
    if config.get("data_dir"):
        return os.path.join(config.data_dir, f"{local_split(config, split)}.tsv")
    return f"hub dataset {config.dataset!r} ({config.dataset_config!r}) split {split!r}"


def _load(config: Any, split: str, stats: DataStats) -> list[tuple[str, int]]:
    """(normalized text, label) rows of ``split``; rows with empty text are counted and
    dropped."""
    if config.get("data_dir"):
        return load_labeled(_source(config, split), config.text_column, config.label_column, stats)
    import datasets  # the hub copy (e.g. glue/sst2)

    table = datasets.load_dataset(config.dataset, config.dataset_config, split=split)
    out = []
    for text, label in zip(table[config.text_column], table[config.label_column], strict=True):
        stats.num_read += 1
        text = normalize(text)
        if text:
            out.append((text, int(label)))
        else:
            stats.num_empty_dropped += 1
    return out


def build(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    """The classification :class:`Task`. Both splits are read, and checked to hold a row with
    text, before the vocabulary is trained."""
    stats, eval_stats = DataStats(), DataStats()
    splits = []
    for name, field, split_stats in (
        ("training", "train_split", stats),
        ("eval", "eval_split", eval_stats),
    ):
        rows = _load(config, config[field], split_stats)
        if not rows:
            raise DataError(
                f"empty {name} split: {_source(config, config[field])} has no row with text in "
                f"column {config.text_column!r} ({split_stats.summary()}); config.{field} must "
                "name a split with at least one"
            )
        splits.append(rows)
    train, dev = splits
    tokenizer = vocabulary(
        os.path.join(workdir, "spm_cls.model"), lambda: (t for t, _ in train), config
    )
    train_ex = encode_labeled(train, tokenizer, max_len=config.max_len, stats=stats)
    dev_ex = encode_labeled(dev, tokenizer, max_len=config.max_len, stats=eval_stats)

    def make_batches(epoch: int) -> list[Batch]:
        return classification_batches(
            train_ex,
            max_len=config.max_len,
            batch_size=config.batch_size,
            pad_id=tokenizer.pad_id,
            seed=config.seed,
            epoch=epoch,
        )

    stream = BatchStream(make_batches, process_index=process_index, process_count=process_count)
    evals = classification_batches(
        dev_ex,
        max_len=config.max_len,
        batch_size=config.batch_size,
        pad_id=tokenizer.pad_id,
        shuffle=False,
    )
    return Task(
        kind="classification",
        train=stream,
        eval_batches=evals,
        vocab_size=tokenizer.vocab_size,
        target_vocab_size=None,
        max_len=config.max_len,
        special_ids=vocabulary_ids(tokenizer),
        metric="accuracy",
        log_lines=[f"train: {stats.summary()}", f"eval: {eval_stats.summary()}"],
    )
