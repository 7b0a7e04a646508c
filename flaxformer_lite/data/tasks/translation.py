"""The translation task: parallel text to a training stream, eval batches and BLEU references.

:func:`build_translation_data` does the data side (vocabularies, token cache, batch plans,
eval batches); :func:`build` turns it into the :class:`~flaxformer_lite.data.tasks.Task` the train
loop reads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.data.batching import (
    Batch,
    BatchPlan,
    batch_by_tokens,
    bucket_boundaries,
    plan_by_tokens,
    rows_for_length,
)
from flaxformer_lite.data.encoding import (
    EncodedPairs,
    check_too_long,
    encode_pairs,
    encode_pairs_to_arrays,
)
from flaxformer_lite.data.packing import plan_packing
from flaxformer_lite.data.reading import DataError, DataStats, describe_pairs_source, iter_pairs
from flaxformer_lite.data.stream import BatchStream
from flaxformer_lite.data.tasks.base import Task, local_split, vocabulary_ids
from flaxformer_lite.data.tokenizer import SubwordSampler, Tokenizer
from flaxformer_lite.data.workdir import (
    CACHE_DIR,
    load_token_cache,
    main_process_first,
    save_token_cache,
    vocabulary,
)


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


_CACHE_FORMAT = 1
# Segmentations drawn per training sentence with config.subword_alpha and no
# config.subword_samples: epoch e reads segmentation e mod 8.
DEFAULT_SUBWORD_SAMPLES = 8


def subword_sampling(config: Any) -> tuple[float, int] | None:
    """``(alpha, samples)`` of subword regularization, or None when ``config.subword_alpha``
    is absent, None or 0 (off)."""
    alpha = getattr(config, "subword_alpha", None)
    if not alpha:
        return None
    samples = getattr(config, "subword_samples", None) or DEFAULT_SUBWORD_SAMPLES
    return float(alpha), int(samples)


def _file_digest(path: str) -> str:
    return hashlib.sha256(epath.Path(path).read_bytes()).hexdigest()


def _location_fields(config: Any) -> str:
    """The config fields that locate a split, for error messages."""
    if config.data_dir is not None:
        return f"under config.data_dir={config.data_dir!r}"
    return f"of config.dataset={config.dataset!r}"


def pretrained_vocabulary(
    source: str, workdir: str, *, src_lang: str | None = None, tgt_lang: str | None = None
) -> tuple[Any, Any, list[str]]:
    """(source side, target side, file paths) of the tokenizer of the Hugging Face model
    ``source`` (a folder or hub id, see ``core.hub.resolve``), copied into ``workdir`` by
    process 0 when it has none and read from there by every process, on resume and by the
    Translator.

    A Marian folder gives its ``source.spm``, ``target.spm`` and ``vocab.json``; any other
    family with a tokenizer (``config.json``'s ``model_type`` in ``data.hf_tokenizers``:
    BART, mBART, T5 ...) its own files and ``hf_tokenizer.json``, and the two sides are
    ``hf_vocabulary.HFVocabulary``: the model's vocabulary size (every embedding row restored)
    and decoder start, the family's special tokens around each text. ``src_lang`` /
    ``tgt_lang``: mBART's language codes (``config.tokenizer_src_lang`` / ``_tgt_lang``), else
    the folder's tokenizer config's.

    Raises:
      ValueError: the folder's family has no tokenizer here, or it has no tokenizer files, or
        (mBART) a language code is missing (the config field named).
    """
    from flaxformer_lite.data import hf_vocabulary
    from flaxformer_lite.data.marian_tokenizer import REQUIRED_FILES, MarianTokenizer

    root = paths.resolve(workdir)

    def model_folder() -> tuple[str, dict[str, Any]]:
        from flaxformer_lite.core.hub import resolve

        folder = resolve(source)
        config_path = folder / "config.json"
        hf_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return str(folder), hf_config

    def get(writer: bool) -> Any:
        hf_copy = (root / hf_vocabulary.MARKER).is_file()  # written after the files
        marian_copy = all((root / name).is_file() for name in REQUIRED_FILES)
        if writer and not (hf_copy or marian_copy):
            folder, hf_config = model_folder()
            if hf_config.get("model_type", "marian") == "marian":
                MarianTokenizer.load(folder).save(workdir)
            else:
                hf_vocabulary.copy_to_workdir(
                    folder, hf_config, workdir, src_lang=src_lang, tgt_lang=tgt_lang
                )
        if (root / hf_vocabulary.MARKER).is_file():
            return hf_vocabulary.load_workdir_vocabularies(workdir)
        marian = MarianTokenizer.load(workdir)
        return marian.source, marian.target

    source_side, target_side = main_process_first(get, "vocabulary")
    if isinstance(source_side, hf_vocabulary.HFVocabulary):
        names = [hf_vocabulary.MARKER, *sorted(source_side.tokenizer.saved_files())]
    else:
        names = list(REQUIRED_FILES)
    return source_side, target_side, [os.path.join(workdir, name) for name in names]


@dataclasses.dataclass(frozen=True)
class _TrainingSplit:
    """The training split ``config`` names, read lazily and as often as a step needs it: to
    train the vocabulary, to fill the token cache, or not at all when both exist."""

    config: Any
    source: dict[str, Any]  # iter_pairs' keyword arguments that locate the corpus
    streaming: bool

    def pairs(self, stats: DataStats | None = None) -> Iterator[tuple[str, str]]:
        return iter_pairs(
            split=self.config.train_split, streaming=self.streaming, stats=stats, **self.source
        )

    def empty_error(self, stats: DataStats) -> DataError:
        return DataError(
            "empty training split: "
            f"{describe_pairs_source(split=self.config.train_split, **self.source)}"
            f" has no pair with both sides non-empty ({stats.summary()}); config.train_split "
            f"({_location_fields(self.config)}) must name a split with at least one pair"
        )

    def texts(self, sides: slice) -> Iterator[str]:
        """The training split's sentences for the vocabulary, ``pair[sides]`` of each pair;
        an empty split raises here, before SentencePiece runs or any file is written."""
        stats = DataStats()
        pairs = self.pairs(stats)
        first = next(pairs, None)
        if first is None:
            raise self.empty_error(stats)
        return (text for pair in itertools.chain([first], pairs) for text in pair[sides])


class _Splits(NamedTuple):
    """What reading gives: the eval split in memory (with its counts), the training split as a
    reader."""

    eval_pairs: list[tuple[str, str]]
    eval_stats: DataStats
    train: _TrainingSplit


class _Vocabulary(NamedTuple):
    src_tokenizer: Tokenizer
    tgt_tokenizer: Tokenizer
    paths: list[str]  # the files the token cache's key hashes
    pad_id: int


class _Encoded(NamedTuple):
    # The training split, memory-mapped from the token cache: one segmentation, or with
    # subword sampling several (epoch e reads train_variants[e % len]).
    train_variants: list[EncodedPairs]
    stats: DataStats  # of the training split (its first segmentation), as counted when cached
    eval_examples: EncodedPairs
    cache_dir: str


class _Batches(NamedTuple):
    train: BatchStream
    eval_batches: list[Batch]
    padding_fraction: float  # share of PAD target positions in the epoch-0 training batches
    boundaries: list[int]


def _check_batching(config: Any, process_count: int) -> None:
    """The options checked before any reading: rows split evenly over the hosts, a known
    ``too_long``."""
    if config.batch_size_multiple % process_count:
        raise ValueError(
            f"batch_size_multiple ({config.batch_size_multiple}) must be a multiple of "
            f"process_count ({process_count}) so every host gets the same number of rows"
        )
    check_too_long(config.too_long)


def _read_splits(config: Any) -> _Splits:
    """Step 1, reading: the eval split into memory (every process; it is small) and a reader of
    the training split.

    Raises:
      DataError: the eval split has no pair with both sides non-empty. Raised before anything
        is written to the workdir.
    """
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

    # The eval split first: it is small, every process reads it, and an empty one must stop
    # the run before anything is written to the workdir.
    eval_stats = DataStats()
    eval_pairs = list(
        iter_pairs(split=config.eval_split, streaming=streaming, stats=eval_stats, **source)
    )
    if not eval_pairs:
        raise DataError(
            f"empty eval split: {describe_pairs_source(split=config.eval_split, **source)} has "
            f"no pair with both sides non-empty ({eval_stats.summary()}); config.eval_split "
            f"({_location_fields(config)}) must name a split with at least one pair"
        )
    return _Splits(eval_pairs, eval_stats, _TrainingSplit(config, source, streaming))


def _build_vocabulary(config: Any, workdir: str, train: _TrainingSplit) -> _Vocabulary:
    """Step 2, vocabulary: a pretrained model's tokenizer (``config.tokenizer``) or the
    SentencePiece model(s) in the workdir, trained on ``train`` by process 0 when missing and
    loaded by every process (:func:`main_process_first`).

    Raises:
      DataError: the training split is empty (before SentencePiece runs).
      ValueError: the source and target vocabularies disagree on a special id.
    """
    paths.makedirs(workdir)
    if getattr(config, "tokenizer", None):  # a pretrained model's own tokenizer
        src_tokenizer, tgt_tokenizer, vocab_paths = pretrained_vocabulary(
            config.tokenizer,
            workdir,
            src_lang=getattr(config, "tokenizer_src_lang", None),
            tgt_lang=getattr(config, "tokenizer_tgt_lang", None),
        )
    else:
        names = ["spm_shared.model"] if config.shared_vocab else ["spm_src.model", "spm_tgt.model"]
        vocab_paths = [os.path.join(workdir, name) for name in names]
        sides = [slice(0, 2)] if config.shared_vocab else [slice(0, 1), slice(1, 2)]
        tokenizers = [
            vocabulary(path, functools.partial(train.texts, side), config)
            for path, side in zip(vocab_paths, sides, strict=True)
        ]
        src_tokenizer, tgt_tokenizer = tokenizers[0], tokenizers[-1]
    pad_id = vocabulary_ids(src_tokenizer, tgt_tokenizer)["pad_id"]
    return _Vocabulary(src_tokenizer, tgt_tokenizer, vocab_paths, pad_id)


def _token_cache_dir(
    config: Any, workdir: str, train: _TrainingSplit, vocab: _Vocabulary, sample: int | None
) -> tuple[str, dict[str, Any]]:
    """The training split's token cache folder and the key it is valid for: a hash of the data
    source, ``max_len``, ``too_long``, the vocabulary files' bytes and, for segmentation
    ``sample`` of subword sampling, alpha, seed and ``sample`` (any change: a new cache)."""
    key: dict[str, Any] = {
        "format": _CACHE_FORMAT,
        "source": train.source,
        "split": config.train_split,
        "max_len": config.max_len,
        "too_long": config.too_long,
        "vocabulary": [_file_digest(path) for path in vocab.paths],
    }
    if sample is not None:
        alpha, _ = subword_sampling(config)
        key["subword"] = {"alpha": alpha, "seed": config.seed, "sample": sample}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(workdir, CACHE_DIR, f"{config.train_split}-{digest}"), key


def _samplers(config: Any, vocab: _Vocabulary) -> tuple[SubwordSampler, SubwordSampler]:
    """The (source, target) samplers of ``config.subword_samples`` segmentations (one sampler
    for a shared vocabulary), seeded by ``config.seed`` and the side."""
    if not isinstance(vocab.src_tokenizer, Tokenizer) or not isinstance(
        vocab.tgt_tokenizer, Tokenizer
    ):
        raise ValueError(
            "config.subword_alpha samples segmentations of the project's SentencePiece "
            f"vocabulary; this run uses a pretrained one ({type(vocab.src_tokenizer).__name__}): "
            "set config.subword_alpha=None"
        )
    alpha, samples = subword_sampling(config)
    seeds = np.random.SeedSequence(config.seed).generate_state(2)
    src = SubwordSampler(vocab.src_tokenizer, alpha, int(seeds[0]), samples)
    if vocab.tgt_tokenizer is vocab.src_tokenizer:
        return src, src
    return src, SubwordSampler(vocab.tgt_tokenizer, alpha, int(seeds[1]), samples)


def _encode_training_split(
    config: Any,
    workdir: str,
    train: _TrainingSplit,
    vocab: _Vocabulary,
    sample: int | None = None,
    samplers: tuple[SubwordSampler, SubwordSampler] | None = None,
) -> tuple[EncodedPairs, DataStats, str]:
    """The training split's tokens: process 0 encodes the split into the token cache unless a
    complete one exists; every process then memory-maps it (:func:`main_process_first`).
    ``sample``: the index of a sampled segmentation (subword regularization) instead of the
    most likely one, drawn by ``samplers`` (source, target).

    Returns (examples, the split's counts, cache folder).

    Raises:
      DataError: before the cache is written, when the split is empty or ``too_long="drop"``
        drops every pair.
      FileNotFoundError: on a process other than 0 that finds no complete cache after
        process 0 built it (a workdir not shared by every host).
    """
    import jax

    max_len = config.max_len
    cache_dir, key = _token_cache_dir(config, workdir, train, vocab, sample)

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
        if sample is None:
            src_tokenizer, tgt_tokenizer = vocab.src_tokenizer, vocab.tgt_tokenizer
        else:
            src_tokenizer, tgt_tokenizer = (s.sample(sample) for s in samplers)
        encoded = encode_pairs_to_arrays(
            train.pairs(stats),
            src_tokenizer,
            tgt_tokenizer,
            max_len=max_len,
            too_long=config.too_long,
            stats=stats,
        )
        if not len(encoded):  # checked before the cache is written: no empty cache is left
            if stats.num_read == stats.num_empty_dropped:
                raise train.empty_error(stats)
            raise DataError(
                f"no training examples left in "
                f"{describe_pairs_source(split=config.train_split, **train.source)}: "
                f"{stats.summary()}; raise config.max_len={max_len} or set "
                f"config.too_long='truncate'"
            )
        save_token_cache(cache_dir, encoded, {"key": key, "stats": dataclasses.asdict(stats)})
        return load_token_cache(cache_dir, key)

    train_examples, meta = main_process_first(token_cache, "token cache")
    return train_examples, DataStats(**meta["stats"]), cache_dir


def _encode_splits(config: Any, workdir: str, splits: _Splits, vocab: _Vocabulary) -> _Encoded:
    """Step 3, encoding: the training split through the token cache (with subword sampling,
    ``config.subword_samples`` segmentations of it, each its own cache), then the eval pairs by
    every process with the most likely segmentation, truncated and never dropped (the eval set
    stays complete); their counts add to ``splits.eval_stats``."""
    sampling = subword_sampling(config)
    samples = [None] if sampling is None else list(range(sampling[1]))
    samplers = None if sampling is None else _samplers(config, vocab)
    encoded = [
        _encode_training_split(config, workdir, splits.train, vocab, k, samplers) for k in samples
    ]
    (_, stats, cache_dir) = encoded[0]
    eval_examples = encode_pairs(
        splits.eval_pairs,
        vocab.src_tokenizer,
        vocab.tgt_tokenizer,
        max_len=config.max_len,
        too_long="truncate",
        stats=splits.eval_stats,
    )
    return _Encoded([examples for examples, _, _ in encoded], stats, eval_examples, cache_dir)


def _batch(
    config: Any, encoded: _Encoded, pad_id: int, *, process_index: int, process_count: int
) -> _Batches:
    """Step 4, batching: the training stream (packed rows of ``max_len``, or length buckets
    of about ``tokens_per_batch`` tokens; every process plans every batch from the lengths and
    reads its own rows) and the eval batches (bucketed, not shuffled, with an ``index`` key)."""
    max_len = config.max_len
    boundaries = bucket_boundaries(max_len)
    tokens_per_batch, multiple, seed = (
        config.tokens_per_batch,
        config.batch_size_multiple,
        config.seed,
    )
    variants = encoded.train_variants
    bidirectional_epochs = getattr(config, "bidirectional_epochs", None) or 0

    @functools.cache
    def variant(index: int, both_ways: bool) -> EncodedPairs:
        """Segmentation ``index``; ``both_ways``: its pairs followed by the same pairs
        reversed (target -> source), in memory."""
        pairs = variants[index]
        return EncodedPairs.concatenate([pairs, pairs.swapped()]) if both_ways else pairs

    def examples(epoch: int) -> EncodedPairs:
        return variant(epoch % len(variants), epoch < bidirectional_epochs)

    @functools.cache
    def lengths(index: int, both_ways: bool) -> tuple[np.ndarray, np.ndarray]:  # [examples] each
        pairs = variant(index, both_ways)
        return pairs.input_lengths, pairs.target_lengths

    def epoch_lengths(epoch: int) -> tuple[np.ndarray, np.ndarray]:
        return lengths(epoch % len(variants), epoch < bidirectional_epochs)

    if config.packing:
        rows = rows_for_length(max_len, tokens_per_batch, multiple)

        def make_plans(epoch: int) -> list[BatchPlan]:
            in_len, tgt_len = epoch_lengths(epoch)
            return plan_packing(
                in_len,
                tgt_len,
                length=max_len,
                rows_per_batch=rows,
                pad_id=pad_id,
                seed=seed,
                epoch=epoch,
            )
    else:

        def make_plans(epoch: int) -> list[BatchPlan]:
            return plan_by_tokens(
                np.maximum(*epoch_lengths(epoch)),
                tokens_per_batch=tokens_per_batch,
                boundaries=boundaries,
                pad_id=pad_id,
                batch_size_multiple=multiple,
                seed=seed,
                epoch=epoch,
            )

    train = BatchStream(
        make_plans,
        process_index=process_index,
        process_count=process_count,
        examples=examples if len(variants) > 1 or bidirectional_epochs else variants[0],
    )
    plans = train.epoch_plans()
    tgt_len = epoch_lengths(0)[1]
    positions = sum(plan.rows * plan.length for plan in plans)
    real = sum(plan.target_tokens(tgt_len) for plan in plans)
    eval_batches = batch_by_tokens(
        encoded.eval_examples,
        tokens_per_batch=tokens_per_batch,
        boundaries=boundaries,
        pad_id=pad_id,
        batch_size_multiple=multiple,
        shuffle=False,
        with_index=True,
    )
    return _Batches(
        train=train,
        eval_batches=eval_batches,
        padding_fraction=1.0 - real / positions,
        boundaries=list(boundaries) if not config.packing else [max_len],
    )


def build_translation_data(
    config: Any,
    workdir: str,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> TranslationData:
    """Loads, tokenizes and batches a translation corpus as described by ``config``.

    Four steps, after the batching options are checked: reading (:func:`_read_splits`),
    vocabulary (:func:`_build_vocabulary`), encoding (:func:`_encode_splits`, through the token
    cache) and batching (:func:`_batch`).

    ``config`` needs the attributes: dataset, dataset_config, data_dir, data_format,
    source_lang, target_lang, train_split, eval_split, vocab_size, shared_vocab,
    spm_model_type, max_len, too_long, tokens_per_batch, batch_size_multiple, packing,
    seed (optional: source_column, target_column, streaming, subword_alpha, subword_samples,
    bidirectional_epochs).

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
    ``subword_alpha`` (subword regularization, :class:`SubwordSampler`): process 0 encodes
    ``subword_samples`` sampled segmentations of the training split instead of the most likely
    one, each its own token cache (the corpus is read once per segmentation), and epoch ``e``
    reads segmentation ``e % subword_samples``. ``bidirectional_epochs`` = K > 0: epochs
    ``0 .. K - 1`` train on every pair and on the same pair reversed (target -> source, one
    vocabulary), each such epoch twice as long; later epochs on the pairs as given
    (bidirectional training, Ding et al. 2021).

    Eval pairs are read first and encoded by every process (an eval split is small); they are
    always truncated, never dropped, so the eval set is complete.

    Raises:
      DataError: before anything is written to the workdir, when the eval split, or the
        training split the vocabulary or the token cache would be built from, has no pair
        with both sides non-empty, or when ``too_long="drop"`` drops every training pair.
    """
    _check_batching(config, process_count)
    splits = _read_splits(config)
    vocab = _build_vocabulary(config, workdir, splits.train)
    encoded = _encode_splits(config, workdir, splits, vocab)
    batches = _batch(
        config, encoded, vocab.pad_id, process_index=process_index, process_count=process_count
    )
    return TranslationData(
        train=batches.train,
        eval_batches=batches.eval_batches,
        eval_pairs=splits.eval_pairs,
        src_tokenizer=vocab.src_tokenizer,
        tgt_tokenizer=vocab.tgt_tokenizer,
        stats=encoded.stats,
        padding_fraction=batches.padding_fraction,
        eval_stats=splits.eval_stats,
        boundaries=batches.boundaries,
        cache_dir=encoded.cache_dir,
    )


def build(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    """The translation :class:`Task`: BLEU of greedy decoding against the eval references.

    Hub split names ("validation") map to local file names ("val") by ``config.local_splits``.
    """
    resolved = types.SimpleNamespace(**config.to_dict())
    resolved.train_split = local_split(config, config.train_split)
    resolved.eval_split = local_split(config, config.eval_split)
    d = build_translation_data(
        resolved, workdir, process_index=process_index, process_count=process_count
    )
    inputs, refs = [], []
    for batch in d.eval_batches:
        idx = batch["index"]
        inputs.append(batch["inputs"])
        refs.append([d.eval_pairs[i][1] if i >= 0 else None for i in idx])
    # One vocabulary: the same tokenizer, or a pretrained tokenizer's two sides over one table.
    shared = d.src_tokenizer is d.tgt_tokenizer or (
        d.src_tokenizer.vocab_size == d.tgt_tokenizer.vocab_size
        and getattr(d.tgt_tokenizer, "shares_table_with", lambda _: False)(d.src_tokenizer)
    )
    sizes = (
        f"{d.src_tokenizer.vocab_size} shared"
        if shared
        else f"{d.src_tokenizer.vocab_size} source, {d.tgt_tokenizer.vocab_size} target"
    )
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
        special_ids=vocabulary_ids(d.src_tokenizer, d.tgt_tokenizer),
        metric="bleu",
        log_lines=[
            f"train: {d.stats.summary()}",
            f"eval: {d.eval_stats.summary()}",
            f"vocabulary: {sizes}, buckets {d.boundaries}, padding share of target positions "
            f"{100 * d.padding_fraction:.1f}%",
            *(
                [
                    f"subword sampling: alpha {sampling[0]}, {sampling[1]} segmentations of "
                    f"the training split, epoch e reads segmentation e mod {sampling[1]}"
                ]
                if (sampling := subword_sampling(config))
                else []
            ),
            *(
                [
                    f"bidirectional training: epochs 0-{k - 1} also train every pair reversed "
                    f"({config.target_lang} -> {config.source_lang})"
                ]
                if (k := config.get("bidirectional_epochs"))
                else []
            ),
        ],
    )
