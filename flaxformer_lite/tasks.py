"""What each kind of run feeds the train loop: data streams, eval sets and vocabularies.

``build_task`` turns a training config into a ``Task``: the endless training stream, fixed
evaluation batches, the vocabulary sizes the model needs, and what to decode for exact-match or
BLEU. Four kinds, chosen by ``config.task``:

  "synthetic"       generated seq2seq problems (the embedded default; no download)
  "translation"     parallel text from the hub or local files (Multi30k, WMT14)
  "lm"              a plain-text file for a decoder-only language model (Tiny Shakespeare)
  "classification"  labelled sentences in TSV for the encoder classifier (SST-2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite import data as data_lib
from flaxformer_lite import paths, synthetic
from flaxformer_lite.tokenizer import Tokenizer, load_or_train

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
    log_lines: list[str] = dataclasses.field(default_factory=list)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _synthetic(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    s = config.synthetic
    gen = synthetic.SyntheticTask(
        s.name, min_len=s.min_len, max_len=s.max_len, num_symbols=s.num_symbols
    )
    held_out = gen.eval_batch(s.num_eval, seed=config.seed)
    stream = synthetic.SyntheticStream(
        gen,
        batch_size=config.batch_size,
        seed=config.seed,
        exclude=held_out["inputs"],
        process_index=process_index,
        process_count=process_count,
    )
    if process_index == 0:  # one writer: the workdir is shared (and an object store limits
        # how often one object may be rewritten)
        paths.write_atomic(
            os.path.join(workdir, "vocab.json"),
            json.dumps({"task": s.name, "symbols": gen.vocab.symbols}),
        )
    rows = config.batch_size
    evals = []
    for sl in _chunks(s.num_eval, rows):
        batch = {k: np.zeros((rows, v.shape[1]), np.int32) for k, v in held_out.items()}
        for k, v in held_out.items():
            batch[k][: sl.stop - sl.start] = v[sl]
        evals.append(batch)
    return Task(
        kind="synthetic",
        train=stream,
        eval_batches=evals,
        vocab_size=gen.vocab.vocab_size,
        target_vocab_size=None,
        max_len=max(gen.input_len, gen.target_len),
        decode_inputs=[b["inputs"] for b in evals],
        decode_references=[b["targets"] for b in evals],
        detokenize=gen.vocab.decode,
        source_detokenize=gen.vocab.decode,
        metric="exact_match",
        log_lines=[
            f"synthetic task {s.name!r}: lengths {s.min_len}-{s.max_len}, "
            f"{s.num_symbols} symbols, {s.num_eval} held-out examples"
        ],
    )


def local_split(config: Any, split: str) -> str:
    """Hub split names ("validation") map to local file names ("val") by ``local_splits``."""
    if config.get("data_dir") and config.get("local_splits"):
        return dict(config.local_splits).get(split, split)
    return split


def _translation(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    resolved = types.SimpleNamespace(**config.to_dict())
    resolved.train_split = local_split(config, config.train_split)
    resolved.eval_split = local_split(config, config.eval_split)
    d = data_lib.build_translation_data(
        resolved, workdir, process_index=process_index, process_count=process_count
    )
    inputs, refs = [], []
    for batch in d.eval_batches:
        idx = batch["index"]
        inputs.append(batch["inputs"])
        refs.append([d.eval_pairs[i][1] if i >= 0 else None for i in idx])
    shared = d.src_tokenizer is d.tgt_tokenizer
    return Task(
        kind="translation",
        train=d.train,
        eval_batches=[{k: v for k, v in b.items() if k != "index"} for b in d.eval_batches],
        vocab_size=d.src_tokenizer.vocab_size,
        target_vocab_size=None if shared else d.tgt_tokenizer.vocab_size,
        max_len=config.max_len,
        decode_inputs=inputs,
        decode_references=refs,
        detokenize=d.tgt_tokenizer.decode,
        source_detokenize=d.src_tokenizer.decode,
        metric="bleu",
        log_lines=[
            f"train: {d.stats.summary()}",
            f"eval: {d.eval_stats.summary()}",
            f"vocabulary: {d.src_tokenizer.vocab_size} ({'shared' if shared else 'source'}), "
            f"buckets {d.boundaries}, padding share of target positions "
            f"{100 * d.padding_fraction:.1f}%",
        ],
    )


def _vocabulary(path: str, texts_fn: Any, config: Any) -> Tokenizer:
    """The SentencePiece model at ``path``: trained by process 0 if missing, then loaded by
    the others (no two hosts write the same file)."""

    def get(writer: bool) -> Tokenizer:
        if not writer:
            return Tokenizer.load(path)
        return load_or_train(
            path, texts_fn, config.vocab_size, model_type=config.spm_model_type, seed=config.seed
        )

    return data_lib.main_process_first(get, "vocabulary")


def _lm(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    stats = data_lib.DataStats()
    if config.get("data_file"):
        lines = data_lib.load_text(config.data_file, stats)
    else:
        import datasets  # the hub copy; slow to import, so only here

        rows = datasets.load_dataset(config.dataset, split=config.train_split)["text"]
        lines = [data_lib.normalize(t) for r in rows for t in r.splitlines()]
        stats.num_read = len(lines)
        lines = [t for t in lines if t]
        stats.num_empty_dropped = stats.num_read - len(lines)
    split = int(len(lines) * (1 - config.eval_fraction))
    train_lines, eval_lines = lines[:split], lines[split:]
    tokenizer = _vocabulary(
        os.path.join(workdir, "spm_lm.model"),
        lambda: iter(train_lines),
        config,
    )
    train_tokens = data_lib.lm_token_stream(train_lines, tokenizer)
    eval_tokens = data_lib.lm_token_stream(eval_lines, tokenizer)
    seq_len, rows = config.max_len, config.batch_size

    def make_batches(epoch: int) -> list[dict[str, np.ndarray]]:
        return data_lib.lm_batches(
            train_tokens, seq_len=seq_len, batch_size=rows, seed=config.seed, epoch=epoch
        )

    stream = data_lib.BatchStream(
        make_batches, process_index=process_index, process_count=process_count
    )
    evals = data_lib.lm_batches(eval_tokens, seq_len=seq_len, batch_size=rows, seed=0, epoch=0)
    return Task(
        kind="lm",
        train=stream,
        eval_batches=evals[: config.eval_batches] if config.eval_batches else evals,
        vocab_size=tokenizer.vocab_size,
        target_vocab_size=None,
        max_len=seq_len,
        detokenize=tokenizer.decode_lines,  # EOS marks line ends in the LM stream
        metric="perplexity",
        log_lines=[
            f"{stats.summary()}; {len(train_tokens)} training and {len(eval_tokens)} held-out "
            f"tokens, vocabulary {tokenizer.vocab_size}"
        ],
    )


def _classification(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    stats, eval_stats = data_lib.DataStats(), data_lib.DataStats()

    def load(split: str, split_stats: data_lib.DataStats) -> list[tuple[str, int]]:
        if config.get("data_dir"):
            path = os.path.join(config.data_dir, f"{local_split(config, split)}.tsv")
            return data_lib.load_labeled(path, config.text_column, config.label_column, split_stats)
        import datasets  # the hub copy (e.g. glue/sst2)

        table = datasets.load_dataset(config.dataset, config.dataset_config, split=split)
        out = []
        for text, label in zip(table[config.text_column], table[config.label_column], strict=True):
            split_stats.num_read += 1
            text = data_lib.normalize(text)
            if text:
                out.append((text, int(label)))
            else:
                split_stats.num_empty_dropped += 1
        return out

    train = load(config.train_split, stats)
    dev = load(config.eval_split, eval_stats)
    tokenizer = _vocabulary(
        os.path.join(workdir, "spm_cls.model"),
        lambda: (t for t, _ in train),
        config,
    )
    train_ex = data_lib.encode_labeled(train, tokenizer, max_len=config.max_len, stats=stats)
    dev_ex = data_lib.encode_labeled(dev, tokenizer, max_len=config.max_len, stats=eval_stats)

    def make_batches(epoch: int) -> list[dict[str, np.ndarray]]:
        return data_lib.classification_batches(
            train_ex,
            max_len=config.max_len,
            batch_size=config.batch_size,
            seed=config.seed,
            epoch=epoch,
        )

    stream = data_lib.BatchStream(
        make_batches, process_index=process_index, process_count=process_count
    )
    evals = data_lib.classification_batches(
        dev_ex, max_len=config.max_len, batch_size=config.batch_size, shuffle=False
    )
    return Task(
        kind="classification",
        train=stream,
        eval_batches=evals,
        vocab_size=tokenizer.vocab_size,
        target_vocab_size=None,
        max_len=config.max_len,
        metric="accuracy",
        log_lines=[f"train: {stats.summary()}", f"eval: {eval_stats.summary()}"],
    )


def build_task(
    config: Any, workdir: str, *, process_index: int = 0, process_count: int = 1
) -> Task:
    """The data side of a run, as described by ``config.task``. ``workdir`` (where vocabularies
    are saved) and local data paths in ``config`` may be ``gs://`` URIs."""
    builders = {
        "synthetic": _synthetic,
        "translation": _translation,
        "lm": _lm,
        "classification": _classification,
    }
    if config.task not in builders:
        raise ValueError(f"config.task must be one of {TASKS}; got {config.task!r}")
    paths.makedirs(workdir)
    return builders[config.task](config, workdir, process_index, process_count)


def load_tokenizer(workdir: str) -> Tokenizer | None:
    """The target-side SentencePiece model saved in a workdir, if any."""
    for name in ("spm_shared.model", "spm_tgt.model", "spm_lm.model", "spm_cls.model"):
        path = os.path.join(workdir, name)
        if epath.Path(path).is_file():
            return Tokenizer.load(path)
    return None
