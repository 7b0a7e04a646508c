"""What every kind of run feeds the train loop: the :class:`Task` record and the helpers that
the task modules share (vocabulary ids, local split names). The registry that picks a task
module for ``config.task`` is the package, ``flaxformer_lite.data.tasks``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

TASKS = ("synthetic", "translation", "lm", "classification")


@dataclasses.dataclass
class Task:
    """Attributes:
    kind: one of TASKS.
    train: stream with ``next() -> batch`` (this process's rows), ``state()``, ``restore()``.
    eval_batches: global evaluation batches (fixed shapes); padding rows carry no weight.
    vocab_size: source (or only) vocabulary; target_vocab_size: target vocabulary if separate.
    max_len: longest sequence the model must encode.
    decode_inputs / decode_references: for seq2seq, source batches `[rows, len]` to decode and
    what to compare against (token arrays for exact match, strings for BLEU).
    detokenize: ids -> string of the target side (None for classification).
    special_ids: the TransformerConfig fields ``pad_id``, ``eos_id``, ``bos_id``, ``unk_id``
    of the task's vocabulary (:func:`vocabulary_ids`), with which every batch was built;
    ``train.model_config`` copies them into the model. Empty: the config's own.
    log_lines: what the data pipeline counted, printed at start.
    """

    kind: str
    train: Any
    eval_batches: list[dict[str, np.ndarray]]
    vocab_size: int
    target_vocab_size: int | None
    max_len: int
    decode_inputs: list[np.ndarray] = dataclasses.field(default_factory=list)
    decode_references: list[Any] = dataclasses.field(default_factory=list)
    detokenize: Any = None
    source_detokenize: Any = None
    metric: str = "exact_match"
    special_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    log_lines: list[str] = dataclasses.field(default_factory=list)


def vocabulary_ids(*vocabs: Any) -> dict[str, int]:
    """``{"pad_id", "eos_id", "bos_id", "unk_id"}`` of a vocabulary (an object with those
    attributes, e.g. ``tokenizer.Tokenizer``), for ``TransformerConfig``.

    A vocabulary without ``bos_id`` (Marian's) starts decoding from its pad id, as Hugging
    Face's ``decoder_start_token_id`` does for it. Several vocabularies (source and target)
    feed one model, so they must agree on every id.

    Raises:
      ValueError: the vocabularies disagree on an id (each one's ids are named).
    """
    found = []
    for vocab in vocabs:
        ids = {name: int(getattr(vocab, name)) for name in ("pad_id", "eos_id", "unk_id")}
        bos = getattr(vocab, "bos_id", None)
        ids["bos_id"] = ids["pad_id"] if bos is None else int(bos)
        found.append(ids)
    if any(ids != found[0] for ids in found):
        raise ValueError(
            "the source and target vocabularies must share the special ids (one model reads "
            f"both); got {found}"
        )
    return found[0]


def local_split(config: Any, split: str) -> str:
    """Hub split names ("validation") map to local file names ("val") by ``local_splits``."""
    if config.get("data_dir") and config.get("local_splits"):
        return dict(config.local_splits).get(split, split)
    return split
