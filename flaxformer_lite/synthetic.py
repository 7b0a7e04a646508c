"""The embedded default task: sequence-to-sequence problems generated on the fly.

"reverse": 3 1 4 1 5 -> 5 1 4 1 3;  "sort": 3 1 4 1 5 -> 1 1 3 4 5;
"add": 1 2 3 + 4 5 -> 1 6 8 (multi-digit addition, digits most significant first).

Token ids follow the project's vocabulary layout (0 pad, 1 EOS, 2 BOS, 3 unknown), symbols from
4 on. Every batch has the same shape, so the train step compiles once. Batch ``i`` is a pure
function of (seed, i): the stream's position is one integer, which makes resuming exact.
Held-out examples are drawn from another seed and removed from training.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from flaxformer_lite.special_ids import EOS_ID, SPECIAL_PIECES, UNK_ID

TASKS = ("reverse", "sort", "add")
FIRST_SYMBOL = len(SPECIAL_PIECES)  # after pad, EOS, BOS, UNK


ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


class SymbolVocabulary:
    """The synthetic task's vocabulary: one character per symbol, ids from 4 on.

    Built from the ``symbols`` string saved in ``vocab.json`` (so the ids are exactly the
    training ones). ``encode`` skips whitespace ("3 1 4" and "314" are the same input) and maps
    characters outside the vocabulary to UNK, as SentencePiece does.
    """

    def __init__(self, symbols: str) -> None:
        if not symbols or len(set(symbols)) != len(symbols):
            raise ValueError(f"symbols must be distinct characters; got {symbols!r}")
        self.symbols = symbols
        self._ids = {c: FIRST_SYMBOL + i for i, c in enumerate(symbols)}

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + len(self.symbols)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, UNK_ID) for c in text if not c.isspace()]

    def decode(self, ids: Iterable[int]) -> str:
        """Symbols up to the first EOS; PAD, BOS and UNK print nothing."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
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
                pieces.append(SPECIAL_PIECES[UNK_ID])
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
        inputs = np.zeros((len(pairs), self.input_len), np.int32)
        targets = np.zeros((len(pairs), self.target_len), np.int32)
        for i, (x, y) in enumerate(pairs):
            inputs[i, : len(x) + 1] = [*x, EOS_ID]
            targets[i, : len(y) + 1] = [*y, EOS_ID]
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
    the global batch. Same interface as ``data.BatchStream`` (next / state / restore).
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
        self.exclude = set() if exclude is None else {tuple(r[r > 0]) for r in exclude}
        self.process_index, self.process_count = process_index, process_count
        self.index = 0

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        pairs = []
        while len(pairs) < self.batch_size:
            x, y = self.task.example(rng)
            if (*x, EOS_ID) not in self.exclude:
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
