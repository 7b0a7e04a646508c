"""Subword tokenizer: a thin wrapper around a SentencePiece model with fixed special ids.

The special ids are the project's (``special_ids``, re-exported here): ``PAD_ID=0``
(padding, zero loss weight), ``EOS_ID=1`` (appended to every sequence), ``BOS_ID=2`` (the
first decoder input) and ``UNK_ID=3``. A :class:`Tokenizer` exposes them as ``pad_id``,
``eos_id``, ``bos_id`` and ``unk_id``, which is what the data pipeline and the translator
read (another vocabulary, e.g. Marian's, has other ids).
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.core.special_ids import BOS_ID, EOS_ID, PAD_ID, SPECIAL_PIECES, UNK_ID
from flaxformer_lite.data import unigram_sampling

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MODEL_TYPES",
    "PAD_ID",
    "UNK_ID",
    "SubwordSampler",
    "Tokenizer",
    "load_or_train",
]

MODEL_TYPES = ("unigram", "bpe", "char")

_SPECIAL_IDS = {"pad": PAD_ID, "eos": EOS_ID, "bos": BOS_ID, "unk": UNK_ID}


class Tokenizer:
    """A SentencePiece model plus the project's id conventions.

    ``encode`` never adds BOS/EOS (the data pipeline appends EOS itself, so the rule lives
    in one place); ``decode`` is the inverse for model outputs: it stops at the first EOS
    and ignores PAD/BOS.
    """

    def __init__(self, processor: spm.SentencePieceProcessor, path: str) -> None:
        self._sp = processor
        self._path = path
        actual = {
            "pad": processor.pad_id(),
            "eos": processor.eos_id(),
            "bos": processor.bos_id(),
            "unk": processor.unk_id(),
        }
        if actual != _SPECIAL_IDS:
            raise ValueError(
                f"SentencePiece model {path!r} has special ids {actual}; this project needs "
                f"{_SPECIAL_IDS} (train it with Tokenizer.train)"
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """Loads a model written by :meth:`train` (a local path or a ``gs://`` URI)."""
        file = epath.Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        # Read as bytes so any epath filesystem works (SentencePiece only opens local files).
        return cls(spm.SentencePieceProcessor(model_proto=file.read_bytes()), path)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        model_path: str,
        vocab_size: int,
        *,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
        max_sentences: int = 2_000_000,
        seed: int = 0,
        byte_fallback: bool = False,
        num_threads: int | None = None,
    ) -> Tokenizer:
        """Trains a SentencePiece model on ``texts`` and writes it to ``model_path``.

        Args:
          texts: training sentences (one string each); consumed once.
          model_path: output file (local or ``gs://``); written atomically
            (:func:`paths.write_atomic`) so a concurrent reader or a crash never sees half a
            model.
          vocab_size: requested vocabulary size including the 4 special pieces. It is a soft
            limit (``hard_vocab_limit=False``): a corpus too small for it yields a smaller
            vocabulary instead of an error, so always read :attr:`vocab_size` afterwards.
          model_type: "unigram", "bpe" or "char".
          character_coverage: share of characters covered by the vocabulary (1.0 keeps every
            character; unseen ones map to UNK).
          max_sentences: at most this many sentences are sampled for training.
          seed: seed of SentencePiece's sentence sampling.
          byte_fallback: decompose unknown characters into byte pieces instead of UNK
            (adds 256 pieces, so it needs a large enough ``vocab_size``).
          num_threads: trainer threads (default: all CPU cores).
        """
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}; got {model_type!r}")
        if vocab_size <= len(_SPECIAL_IDS):
            raise ValueError(f"vocab_size must be > {len(_SPECIAL_IDS)}; got {vocab_size}")
        # SentencePiece's sentence sampling uses a process-global generator.
        spm.set_random_generator_seed(seed)
        model = io.BytesIO()
        failed: list[Exception] = []

        def sentences():
            try:
                yield from (t for t in texts if t and not t.isspace())
            except Exception as e:  # e.g. a DataError of the reader, which SentencePiece
                failed.append(e)  # would turn into a RuntimeError("INTERNAL: ...")
                raise

        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                hard_vocab_limit=False,
                # nmt_nfkc maps U+00A0 and other odd spaces to plain spaces, among others.
                normalization_rule_name="nmt_nfkc",
                byte_fallback=byte_fallback,
                pad_id=PAD_ID,
                eos_id=EOS_ID,
                bos_id=BOS_ID,
                unk_id=UNK_ID,
                pad_piece=SPECIAL_PIECES[PAD_ID],
                eos_piece=SPECIAL_PIECES[EOS_ID],
                bos_piece=SPECIAL_PIECES[BOS_ID],
                unk_piece=SPECIAL_PIECES[UNK_ID],
                num_threads=num_threads or os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError:
            if failed:
                raise failed[0] from None
            raise
        paths.write_atomic(model_path, model.getvalue())
        return cls.load(model_path)

    # ------------------------------------------------------------------ properties

    @property
    def path(self) -> str:
        """File the model was loaded from."""
        return self._path

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special ones included (may be below the requested size)."""
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        """Padding id (``special_ids.PAD_ID``: the SentencePiece model was trained with it)."""
        return self._sp.pad_id()

    @property
    def eos_id(self) -> int:
        """End-of-sequence id, appended to every sequence by the data pipeline."""
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        """The decoder-start id (the first decoder input)."""
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        """Id of pieces outside the vocabulary."""
        return self._sp.unk_id()

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS or EOS."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (SentencePiece encodes them on several threads)."""
        return self._sp.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: stops at the first EOS, skips PAD and BOS.

        Ids outside the vocabulary (e.g. from an output layer padded to a round size)
        decode as UNK rather than raising.
        """
        size = self.vocab_size
        kept = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            kept.append(i if 0 <= i < size else self.unk_id)
        return self._sp.decode(kept)

    def decode_lines(self, ids: Iterable[int]) -> str:
        """Text of a language-model stream where EOS separates lines (see
        ``encoding.lm_token_stream``): every EOS becomes a newline instead of ending the text.
        PAD and BOS are skipped.
        """
        lines: list[list[int]] = [[]]
        for i in ids:
            if int(i) == self.eos_id:
                lines.append([])
            else:
                lines[-1].append(int(i))
        return "\n".join(self.decode(line) for line in lines)

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """Piece strings of ``ids`` (e.g. attention-map axis labels); out of range -> UNK."""
        size = self.vocab_size
        unk = self.unk_id
        return [self._sp.id_to_piece(int(i) if 0 <= int(i) < size else unk) for i in ids]

    def __repr__(self) -> str:
        return f"Tokenizer(path={self._path!r}, vocab_size={self.vocab_size})"


class SubwordSampler:
    """Subword regularization (Kudo, 2018): ``samples`` segmentations of each text drawn
    instead of the most likely one, sample ``k`` read through :meth:`sample` (sample 0 also
    through :meth:`encode_batch`).

    A unigram model samples from all segmentations with probabilities ``p(x) ** alpha``
    (smaller ``alpha``: flatter, more and shorter pieces; 1.0: the model's own
    distribution); a BPE model drops each merge with probability ``alpha`` (BPE-dropout).
    Decoding is unchanged: every segmentation decodes to the same text.

    Unigram models are sampled by :mod:`~flaxformer_lite.data.unigram_sampling` with NumPy
    generators (sample ``k``: ``numpy.random.default_rng([seed, k])``, over the texts in the
    order given): the draws are a pure function of ``(model, alpha, seed, k, texts)`` in every
    process, so a run from scratch with the same seed trains on the same segmentations. All
    samples of a list of texts are drawn in one pass (the lattice of each text is built
    once) and kept for the last two lists given (a translation pair's two sides).
    BPE-dropout is SentencePiece's own (``set_random_generator_seed`` per sample), which
    SentencePiece 0.2.3 does not reproduce across processes (it draws other segmentations for
    the same seed in every new process); a run's token caches keep its draws
    (``data.tasks.translation``).
    """

    def __init__(self, tokenizer: Tokenizer, alpha: float, seed: int, samples: int = 1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1]; got {alpha!r}")
        if samples < 1:
            raise ValueError(f"samples must be >= 1; got {samples!r}")
        self.tokenizer = tokenizer
        self.alpha = alpha
        self.seed = seed
        self.samples = samples
        try:
            self._table = unigram_sampling.PieceTable.from_processor(tokenizer._sp)
        except unigram_sampling.NotUnigram:
            self._table = None  # BPE: SentencePiece's dropout
        # texts -> per sample, (flat ids [total], offsets [len(texts) + 1])
        self._drawn: dict[tuple[str, ...], list[tuple[np.ndarray, np.ndarray]]] = {}

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Sample 0: one drawn segmentation (ids, no BOS/EOS) of each text, in order."""
        return self.sample(0).encode_batch(texts)

    def sample(self, k: int) -> _Sample:
        """A tokenizer whose ``encode_batch`` gives sample ``k`` of the texts."""
        if not 0 <= k < self.samples:
            raise ValueError(f"sample must be in [0, {self.samples}); got {k!r}")
        return _Sample(self, k)

    def draws(self, texts: Sequence[str], k: int) -> list[list[int]]:
        """Sample ``k`` of ``texts``: drawn with every other sample on the first request."""
        key = tuple(texts)
        if key not in self._drawn:
            if len(self._drawn) == 2:
                del self._drawn[next(iter(self._drawn))]
            self._drawn[key] = [_flat(d) for d in self._draw_all(key)]
        flat, offsets = self._drawn[key][k]
        return [flat[a:b].tolist() for a, b in itertools.pairwise(offsets)]

    def _draw_all(self, texts: Sequence[str]) -> list[list[list[int]]]:
        if self._table is not None:
            rngs = [np.random.default_rng([self.seed, k]) for k in range(self.samples)]
            return unigram_sampling.sample_batch(
                self.tokenizer._sp, self._table, texts, self.alpha, rngs
            )
        draws = []
        for k in range(self.samples):
            seed = np.random.SeedSequence([self.seed, k]).generate_state(1)[0]
            spm.set_random_generator_seed(int(seed))
            draws.append(
                self.tokenizer._sp.encode(
                    list(texts),
                    out_type=int,
                    enable_sampling=True,
                    alpha=self.alpha,
                    num_threads=1,
                )
            )
        return draws


class _Sample:
    """Sample ``k`` of a :class:`SubwordSampler`, used where a tokenizer encodes."""

    def __init__(self, sampler: SubwordSampler, k: int) -> None:
        self._sampler, self._k = sampler, k

    @property
    def eos_id(self) -> int:
        return self._sampler.eos_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sampler.draws(texts, self._k)


def _flat(draws: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(draws) + 1, np.int64)
    np.cumsum([len(d) for d in draws], out=offsets[1:])
    return np.fromiter(itertools.chain.from_iterable(draws), np.int32, offsets[-1]), offsets


def load_or_train(
    path: str,
    texts_fn: Callable[[], Iterable[str]],
    vocab_size: int,
    **train_kwargs: Any,
) -> Tokenizer:
    """Loads the model at ``path`` if it exists, else trains it on ``texts_fn()``.

    Reusing the file means a resumed run and inference see exactly the vocabulary the
    checkpoint was trained with. ``texts_fn`` is a function so the corpus is only read
    when training is needed.
    """
    if epath.Path(path).is_file():
        return Tokenizer.load(path)
    return Tokenizer.train(texts_fn(), path, vocab_size, **train_kwargs)
