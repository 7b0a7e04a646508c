"""Subword regularization for unigram models, drawn by NumPy: the same draws in every process.

Kudo (2018) samples a segmentation ``x`` of a sentence with probability
``p(x) ** alpha / Z``, over every segmentation of it into the model's pieces (``p(x)``: the
product of the pieces' unigram probabilities), by forward filtering and backward sampling
over the sentence's lattice. SentencePiece does exactly this (``enable_sampling=True,
nbest_size=-1``), but version 0.2.3 draws other segmentations for the same
``set_random_generator_seed`` in every new process (measured on 2026-11-28/29: two processes,
one seed, 300 sentences; a single short sentence repeats, longer ones do not), so a run
from scratch with a given seed could not be replayed.

This module runs the same algorithm on the model's own pieces and scores, with the caller's
``numpy.random.Generator``: a draw is a pure function of the model, the text and the
generator's state. The lattice follows SentencePiece's unigram model: every piece of type
NORMAL (user-defined pieces always win there and are refused here), and for a character no
one-character piece covers, an unknown node of that character scoring the lowest piece
score minus 10 (with ``byte_fallback``, that character's UTF-8 byte pieces are emitted).

Shapes are Python lists: a sentence's lattice is ``ends[e]``, the nodes ``(start, id,
score)`` of the pieces ending at character ``e`` of the normalized text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

__all__ = ["NotUnigram", "PieceTable", "lattice", "normalized_text", "sample", "sample_batch"]

# SentencePiece's unigram model: an unknown character scores the lowest piece score minus this.
UNK_PENALTY = 10.0


class NotUnigram(ValueError):
    """The model is not a unigram model (BPE, char, word): it has no lattice to sample."""


@dataclasses.dataclass(frozen=True)
class PieceTable:
    """A unigram model's pieces as the lattice needs them.

    ``pieces``: piece string -> (id, log-probability score), NORMAL pieces only;
    ``prefixes``: every prefix of a piece -> that piece's (id, score) if the prefix is a
    piece itself, else None (the lattice stops extending a match where no piece goes on);
    ``unk_id``/``unk_score``: the node of an uncovered character;
    ``byte_ids``: byte value -> id of its ``<0xXX>`` piece when the model has byte fallback,
    else empty.
    """

    pieces: dict[str, tuple[int, float]]
    prefixes: dict[str, tuple[int, float] | None]
    unk_id: int
    unk_score: float
    byte_ids: dict[int, int]

    @classmethod
    def from_processor(cls, processor: spm.SentencePieceProcessor) -> PieceTable:
        """The table of a loaded unigram model; other model types and user-defined pieces are
        refused (their sampling is not Kudo's lattice)."""
        from sentencepiece import sentencepiece_model_pb2 as model_pb2

        proto = model_pb2.ModelProto.FromString(processor.serialized_model_proto())
        if proto.trainer_spec.model_type != model_pb2.TrainerSpec.UNIGRAM:
            kind = model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
            raise NotUnigram(f"lattice sampling needs a unigram model; this one is {kind}")
        kinds = model_pb2.ModelProto.SentencePiece
        pieces: dict[str, tuple[int, float]] = {}
        byte_ids: dict[int, int] = {}
        for i, piece in enumerate(proto.pieces):
            if piece.type == kinds.NORMAL:
                pieces[piece.piece] = (i, float(piece.score))
            elif piece.type == kinds.BYTE:
                byte_ids[int(piece.piece[3:5], 16)] = i
            elif piece.type == kinds.USER_DEFINED:
                raise ValueError(
                    f"user-defined piece {piece.piece!r}: lattice sampling covers models "
                    "without user-defined symbols"
                )
        if not pieces:
            raise ValueError("the model has no NORMAL pieces to segment with")
        prefixes: dict[str, tuple[int, float] | None] = {}
        for piece in pieces:
            for end in range(1, len(piece)):
                prefixes.setdefault(piece[:end], None)
        prefixes.update(pieces)
        return cls(
            pieces=pieces,
            prefixes=prefixes,
            unk_id=processor.unk_id(),
            unk_score=min(score for _, score in pieces.values()) - UNK_PENALTY,
            byte_ids=byte_ids if proto.trainer_spec.byte_fallback else {},
        )


def lattice(normalized: str, table: PieceTable) -> list[list[tuple[int, int, float]]]:
    """``ends[e]``, e in 0..len(normalized): the nodes ``(start, id, score)`` of every piece
    ``normalized[start:e]``, plus an unknown node ``(e - 1, unk_id, unk_score)`` where no
    one-character piece covers character ``e - 1``."""
    n = len(normalized)
    ends: list[list[tuple[int, int, float]]] = [[] for _ in range(n + 1)]
    prefixes, missing = table.prefixes, ()
    for start in range(n):
        for end in range(start + 1, n + 1):
            hit = prefixes.get(normalized[start:end], missing)
            if hit is missing:  # no piece starts with normalized[start:end]
                break
            if hit is not None:
                ends[end].append((start, hit[0], hit[1]))
        if not ends[start + 1] or ends[start + 1][-1][0] != start:
            ends[start + 1].append((start, table.unk_id, table.unk_score))
    return ends


def sample(
    normalized: str, table: PieceTable, alpha: float, rngs: Sequence[np.random.Generator]
) -> list[list[int]]:
    """One segmentation (piece ids) of ``normalized`` per generator in ``rngs``, each drawn
    with probability ``p(x) ** alpha / Z``: the lattice and its forward pass are built once,
    then each generator samples backward from the end. Adjacent unknown characters come out
    as one unknown id, as SentencePiece writes them."""
    ends = lattice(normalized, table)
    n = len(normalized)
    # Forward: log of the alpha-weighted sum over every segmentation of normalized[:e]; a
    # node's probability of being the last piece of normalized[:e] is exp(w - forward[e]).
    forward = [0.0] * (n + 1)
    probs: list[list[float]] = [[] for _ in range(n + 1)]
    for e in range(1, n + 1):
        w = [forward[start] + alpha * score for start, _, score in ends[e]]
        top = max(w)
        forward[e] = top + math.log(sum(math.exp(x - top) for x in w))
        probs[e] = [math.exp(x - forward[e]) for x in w]
    draws = []
    for rng in rngs:
        uniforms = rng.random(n).tolist()  # at most n pieces
        e, ids, after_unk = n, [], False
        while e > 0:
            threshold, total, chosen = uniforms[e - 1], 0.0, ends[e][-1]
            for node, p in zip(ends[e], probs[e], strict=True):
                total += p
                if threshold < total:
                    chosen = node
                    break
            start, piece_id, _ = chosen
            if piece_id != table.unk_id:
                ids.append(piece_id)
            elif table.byte_ids:
                ids.extend(table.byte_ids[b] for b in reversed(normalized[start:e].encode()))
            elif not after_unk:
                ids.append(piece_id)
            after_unk = piece_id == table.unk_id
            e = start
        draws.append(ids[::-1])
    return draws


def sample_batch(
    processor: spm.SentencePieceProcessor,
    table: PieceTable,
    texts: Sequence[str],
    alpha: float,
    rngs: Sequence[np.random.Generator],
) -> list[list[list[int]]]:
    """``[len(rngs)][len(texts)]`` segmentations: for each generator, one drawn segmentation
    of each text, the texts taken in order (generator k's draws do not depend on the others).
    The texts are normalized by the model itself (its most likely segmentation's pieces,
    joined: NFKC, the word-boundary mark ``▁``, its whitespace rules)."""
    draws: list[list[list[int]]] = [[] for _ in rngs]
    for proto in processor.encode(list(texts), return_type="proto"):
        for k, ids in enumerate(sample(normalized_text(processor, proto), table, alpha, rngs)):
            draws[k].append(ids)
    return draws


def normalized_text(processor: spm.SentencePieceProcessor, proto) -> str:
    """The normalized text of an encoded ``proto`` (a ``SentencePieceText``): its pieces
    joined, with an unknown character's own text where byte fallback spelt it in bytes."""
    parts = []
    for piece in proto.pieces:
        parts.append(piece.surface if processor.is_byte(piece.id) else piece.piece)
    return "".join(parts)
