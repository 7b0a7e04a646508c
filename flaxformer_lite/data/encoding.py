"""Encoding: normalized strings to int32 token ids, with EOS appended and lengths capped.

The EOS appended is the vocabulary's own (``tokenizer.eos_id``: 1 for the project's
SentencePiece models, 0 for Marian's). A translation example is
``dict(inputs=[src_len], targets=[tgt_len])`` with EOS appended to both and no BOS (the
model shifts the targets right itself); a classification example is
``(ids [len], label)``; a language-model corpus is one token stream. :class:`EncodedPairs`
holds many translation examples in four flat arrays (what the token cache stores).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from flaxformer_lite.data.reading import DataStats
from flaxformer_lite.data.tokenizer import Tokenizer

TOO_LONG_POLICIES = ("truncate", "drop")

Example = dict[str, np.ndarray]


def _fit(ids: Sequence[int], max_len: int, suffix: Sequence[int]) -> tuple[np.ndarray, bool]:
    """``ids + suffix`` as int32, cut to ``max_len`` keeping the suffix (EOS, ...) last; also
    says if cut."""
    cut = len(ids) + len(suffix) > max_len
    body = list(ids[: max_len - len(suffix)]) if cut else list(ids)
    return np.asarray([*body, *suffix], dtype=np.int32), cut


def suffix_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """What ends each of ``tokenizer``'s sequences: its ``suffix_ids`` (a Hugging Face
    tokenizer's, e.g. mBART's ``</s>`` and language code, see ``hf_vocabulary``), else its EOS."""
    return tuple(getattr(tokenizer, "suffix_ids", None) or (tokenizer.eos_id,))


def check_too_long(too_long: str) -> None:
    """Raises ValueError unless ``too_long`` is one of :data:`TOO_LONG_POLICIES`."""
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

    Each side's tokenizer's EOS (its :func:`suffix_ids`) is appended to it. A pair with a side
    longer than ``max_len`` (EOS included) is truncated (EOS kept last; ``stats.num_truncated``)
    or dropped (``stats.num_too_long_dropped``) according to ``too_long``.
    """
    check_too_long(too_long)
    src_suffix, tgt_suffix = suffix_ids(src_tokenizer), suffix_ids(tgt_tokenizer)
    longest = max(len(src_suffix), len(tgt_suffix))
    if max_len < longest + 1:
        raise ValueError(
            f"max_len must be >= {longest + 1} (one token plus EOS{', ...' * (longest > 1)}); "
            f"got {max_len}"
        )
    stats = stats if stats is not None else DataStats()
    sources = src_tokenizer.encode_batch([s for s, _ in pairs])
    targets = tgt_tokenizer.encode_batch([t for _, t in pairs])
    out = []
    for src_ids, tgt_ids in zip(sources, targets, strict=True):
        if len(src_ids) + len(src_suffix) > max_len or len(tgt_ids) + len(tgt_suffix) > max_len:
            if too_long == "drop":
                stats.num_too_long_dropped += 1
                continue
            stats.num_truncated += 1
        inputs, _ = _fit(src_ids, max_len, src_suffix)
        targets_, _ = _fit(tgt_ids, max_len, tgt_suffix)
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
        fitted, cut = _fit(ids, max_len, (tokenizer.eos_id,))
        stats.num_truncated += int(cut)
        out.append((fitted, int(label)))
    return out


def lm_token_stream(lines: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """One int32 stream ``[num_tokens]`` of all lines, each followed by the tokenizer's EOS
    (a line break)."""
    encoded = tokenizer.encode_batch(list(lines))
    eos = tokenizer.eos_id
    return np.fromiter(
        (i for ids in encoded for i in (*ids, eos)),
        dtype=np.int32,
        count=sum(len(ids) + 1 for ids in encoded),
    )


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

    def swapped(self) -> EncodedPairs:
        """The same pairs the other way round: example ``i``'s targets as inputs and its
        inputs as targets (the arrays shared, not copied)."""
        return EncodedPairs(
            self.targets_tokens, self.targets_offsets, self.inputs_tokens, self.inputs_offsets
        )

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
