"""The embedded default task: sequence-to-sequence problems generated on the fly.

"reverse": 3 1 4 1 5 -> 5 1 4 1 3;  "sort": 3 1 4 1 5 -> 1 1 3 4 5;
"add": 1 2 3 + 4 5 -> 1 6 8 (multi-digit addition, digits most significant first).

Token ids follow the project's vocabulary layout (0 pad, 1 EOS, 2 BOS, 3 unknown), symbols from
4 on. Every batch has the same shape, so the train step compiles once. Batch ``i`` is a pure
function of (seed, i): the stream's position is one integer, which makes resuming exact.
Held-out examples are drawn from another seed and removed from training. :func:`build` makes
the :class:`~flaxformer_lite.data.tasks.Task` of a run (``config.task = "synthetic"``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from flaxformer_lite.core import paths
from flaxformer_lite.core.special_ids import BOS_ID, EOS_ID, PAD_ID, SPECIAL_PIECES, UNK_ID
from flaxformer_lite.data.reading import DataError
from flaxformer_lite.data.tasks.base import Task, vocabulary_ids

TASKS = ("reverse", "sort", "add")
FIRST_SYMBOL = len(SPECIAL_PIECES)  # after pad, EOS, BOS, UNK


ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


class SymbolVocabulary:
    """The synthetic task's vocabulary: one character per symbol, ids from 4 on.

    Built from the ``symbols`` string saved in ``vocab.json`` (so the ids are exactly the
    training ones). ``encode`` skips whitespace ("3 1 4" and "314" are the same input) and maps
    characters outside the vocabulary to UNK, as SentencePiece does.
    """

    # The project's layout (``special_ids``): the ids every synthetic run is trained with.
    pad_id, eos_id, bos_id, unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID

    def __init__(self, symbols: str) -> None:
        if not symbols or len(set(symbols)) != len(symbols):
            raise ValueError(f"symbols must be distinct characters; got {symbols!r}")
        self.symbols = symbols
        self._ids = {c: FIRST_SYMBOL + i for i, c in enumerate(symbols)}

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + len(self.symbols)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk_id) for c in text if not c.isspace()]

    def decode(self, ids: Iterable[int]) -> str:
        """Symbols up to the first EOS; PAD, BOS and UNK print nothing."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if FIRST_SYMBOL <= i < self.vocab_size:
                out.append(self.symbols[i - FIRST_SYMBOL])
        return "".join(out)

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        pieces = []
        for i in ids:
            i = int(i)
            if 0 <= i < FIRST_SYMBOL:
                pieces.append(SPECIAL_PIECES[i])
            elif i < self.vocab_size:
                pieces.append(self.symbols[i - FIRST_SYMBOL])
            else:
                pieces.append(SPECIAL_PIECES[self.unk_id])
        return pieces

    def __repr__(self) -> str:
        return f"SymbolVocabulary(symbols={self.symbols!r})"


class SyntheticTask:
    """Generator of (inputs, targets) pairs and fixed-shape batches for one task."""

    def __init__(self, task: str, *, min_len: int, max_len: int, num_symbols: int = 10) -> None:
        if task not in TASKS:
            raise ValueError(f"synthetic task must be one of {TASKS}; got {task!r}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len; got {min_len}, {max_len}")
        if task == "add" and num_symbols != 10:
            raise ValueError("the 'add' task uses num_symbols=10 (decimal digits)")
        self.task, self.min_len, self.max_len = task, min_len, max_len
        self.num_symbols = num_symbols
        if num_symbols > len(ALPHABET):
            raise ValueError(f"num_symbols must be <= {len(ALPHABET)}; got {num_symbols}")
        self.vocab = SymbolVocabulary(ALPHABET[:num_symbols] + ("+" if task == "add" else ""))
        # Lengths include EOS. Addition: a + b has at most max_len + 1 digits.
        self.input_len = (2 * max_len + 1 if task == "add" else max_len) + 1
        self.target_len = (max_len + 1 if task == "add" else max_len) + 1

    def num_inputs(self) -> int:
        """How many distinct inputs the task can draw (an exact Python int)."""
        lengths = range(self.min_len, self.max_len + 1)
        if self.task == "add":  # a + b, each a number of n digits without a leading zero
            numbers = sum(10 if n == 1 else 9 * 10 ** (n - 1) for n in lengths)
            return numbers**2
        return sum(self.num_symbols**n for n in lengths)

    def example(self, rng: np.random.Generator) -> tuple[list[int], list[int]]:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        if self.task == "add":
            m = int(rng.integers(self.min_len, self.max_len + 1))
            a = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10**n))
            b = int(rng.integers(10 ** (m - 1) if m > 1 else 0, 10**m))
            return self.vocab.encode(f"{a}+{b}"), self.vocab.encode(str(a + b))
        seq = (rng.integers(0, self.num_symbols, size=n) + FIRST_SYMBOL).tolist()
        target = seq[::-1] if self.task == "reverse" else sorted(seq)
        return seq, target

    def _pack(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, np.ndarray]:
        """``inputs`` [n, input_len] and ``targets`` [n, target_len]: each sequence, then the
        vocabulary's EOS, then its PAD."""
        eos, pad = self.vocab.eos_id, self.vocab.pad_id
        inputs = np.full((len(pairs), self.input_len), pad, np.int32)
        targets = np.full((len(pairs), self.target_len), pad, np.int32)
        for i, (x, y) in enumerate(pairs):
            inputs[i, : len(x) + 1] = [*x, eos]
            targets[i, : len(y) + 1] = [*y, eos]
        return {"inputs": inputs, "targets": targets}

    def eval_batch(self, num_examples: int, seed: int) -> dict[str, np.ndarray]:
        """Held-out examples (distinct inputs) drawn with ``seed``."""
        rng = np.random.default_rng([seed, 2**31 - 1])
        seen: set[tuple[int, ...]] = set()
        pairs = []
        for _ in range(100 * num_examples):
            x, y = self.example(rng)
            if tuple(x) not in seen:
                seen.add(tuple(x))
                pairs.append((x, y))
            if len(pairs) == num_examples:
                break
        return self._pack(pairs)


class SyntheticStream:
    """Endless training batches `[batch_size, length]`; batch i depends only on (seed, i).

    ``exclude`` holds held-out inputs never to train on. Each process takes its own rows of
    the global batch. Same interface as ``batch_stream.BatchStream`` (next / state / restore).
    """

    def __init__(
        self,
        task: SyntheticTask,
        *,
        batch_size: int,
        seed: int,
        exclude: np.ndarray | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if batch_size % process_count:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by the process count "
                f"({process_count})"
            )
        self.task, self.batch_size, self.seed = task, batch_size, seed
        pad = task.vocab.pad_id
        self.exclude = set() if exclude is None else {tuple(r[r != pad]) for r in exclude}
        self.process_index, self.process_count = process_index, process_count
        self.index = 0

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        pairs = []
        while len(pairs) < self.batch_size:
            x, y = self.task.example(rng)
            if (*x, self.task.vocab.eos_id) not in self.exclude:
                pairs.append((x, y))
        full = self.task._pack(pairs)
        rows = self.batch_size // self.process_count
        lo = self.process_index * rows
        return {k: v[lo : lo + rows] for k, v in full.items()}

    def next(self) -> dict[str, np.ndarray]:
        out = self.batch(self.index)
        self.index += 1
        return out

    def state(self) -> dict[str, int]:
        return {"index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def held_out_examples(gen: SyntheticTask, num_eval: int, seed: int) -> dict[str, np.ndarray]:
    """``gen.eval_batch(num_eval, seed)``, checked to leave inputs to train on.

    Raises:
      DataError: ``num_eval`` is below 1 or holds out every input the task can draw (the
        training stream, which skips held-out inputs, would never fill a batch).
    """
    total = gen.num_inputs()
    what = (
        f"the {total} distinct inputs of {gen.task!r} with lengths {gen.min_len}-{gen.max_len} "
        f"over {gen.num_symbols} symbols"
    )
    if not 1 <= num_eval < total:
        raise DataError(
            f"config.synthetic.num_eval={num_eval} must be in [1, {total}): {what} minus the "
            "held-out ones are the training set; lower num_eval or raise "
            "config.synthetic.max_len / num_symbols"
        )
    held_out = gen.eval_batch(num_eval, seed=seed)
    if len(held_out["inputs"]) < num_eval:
        raise DataError(
            f"config.synthetic.num_eval={num_eval}: only {len(held_out['inputs'])} distinct "
            f"inputs came up in {100 * num_eval} draws from {what}; lower num_eval or raise "
            "config.synthetic.max_len / num_symbols"
        )
    return held_out


def build(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    """The synthetic :class:`Task`: ``config.synthetic`` (name, min_len, max_len,
    num_symbols, num_eval) names the problem; exact match of greedy decoding on
    ``num_eval`` held-out examples scores it. Writes ``vocab.json`` (the symbols) to
    ``workdir``."""
    s = config.synthetic
    gen = SyntheticTask(s.name, min_len=s.min_len, max_len=s.max_len, num_symbols=s.num_symbols)
    held_out = held_out_examples(gen, s.num_eval, config.seed)
    stream = SyntheticStream(
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
        batch = {
            k: np.full((rows, v.shape[1]), gen.vocab.pad_id, np.int32) for k, v in held_out.items()
        }
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
        special_ids=vocabulary_ids(gen.vocab),
        metric="exact_match",
        log_lines=[
            f"synthetic task {s.name!r}: lengths {s.min_len}-{s.max_len}, "
            f"{s.num_symbols} symbols, {s.num_eval} held-out examples"
        ],
    )
