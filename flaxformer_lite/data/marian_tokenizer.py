"""Marian's tokenizer through ``sentencepiece``: the ids and text ``MarianTokenizer`` gives.

A Marian (opus-mt) folder holds two SentencePiece models, ``source.spm`` and ``target.spm``,
which only cut text into pieces, and ``vocab.json``, which numbers the pieces of both (so the
ids are not SentencePiece's): ``</s>`` 0, ``<unk>`` 1, ..., ``<pad>`` last. A piece missing from
``vocab.json`` is ``<unk>``. Multilingual models start a source with a language code such as
``>>de<<``, a vocabulary entry that SentencePiece never sees. Models with ``separate_vocabs``
number the target side with ``target_vocab.json``.

    tokenizer = MarianTokenizer.load("opus-mt-en-de/")
    ids = tokenizer.source.encode("A dog runs.")      # without the final </s> (callers add it)
    text = tokenizer.target.decode(output_ids)        # up to </s>, special ids skipped

``tokenizer.source`` and ``tokenizer.target`` are the two sides as vocabularies (the interface
of ``inference.Vocabulary``: ``encode``, ``decode``, ``id_to_piece``, ``vocab_size``, the special
ids; ``bos_id`` is the pad id, Marian's decoder start). Only ``sentencepiece`` and the standard
library are needed; folders may be ``gs://`` URIs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import sentencepiece as spm

from flaxformer_lite.core import paths

SPECIAL_TOKENS = {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}
REQUIRED_FILES = ("source.spm", "target.spm", "vocab.json")
SPIECE_UNDERLINE = "\u2581"


def _split_language_code(text: str) -> tuple[list[str], str]:
    """``">>de<< text"`` -> (``[">>de<<"]``, ``" text"``); text without a leading code as is."""
    if text.startswith(">>"):
        end = text.find("<<")
        if end != -1:
            return [text[: end + 2]], text[end + 2 :]
    return [], text


class MarianVocabulary:
    """One side (source or target) of a Marian tokenizer: pieces from its SentencePiece model,
    ids from its ``vocab.json`` table.

    ``decode_model`` is the SentencePiece model that joins pieces back into text (Marian joins
    with the source model when the vocabulary is shared, as ``MarianTokenizer`` does).
    """

    def __init__(
        self,
        model: spm.SentencePieceProcessor,
        table: dict[str, int],
        decode_model: spm.SentencePieceProcessor | None = None,
    ) -> None:
        self._sp = model
        self._decode_sp = decode_model or model
        self._table = table
        self._pieces = {i: p for p, i in table.items()}
        for role, token in SPECIAL_TOKENS.items():
            if token not in table:
                raise ValueError(f"vocab.json has no {token!r} ({role}); Marian needs it")
        self._special = {table[t] for t in SPECIAL_TOKENS.values()}

    @property
    def vocab_size(self) -> int:
        return len(self._table)

    @property
    def pad_id(self) -> int:
        return self._table[SPECIAL_TOKENS["pad"]]

    @property
    def eos_id(self) -> int:
        return self._table[SPECIAL_TOKENS["eos"]]

    @property
    def unk_id(self) -> int:
        return self._table[SPECIAL_TOKENS["unk"]]

    @property
    def bos_id(self) -> int:
        """Marian's decoder starts from the pad token."""
        return self.pad_id

    def shares_table_with(self, other: Any) -> bool:
        """Whether ``other`` numbers pieces with this side's very table (a shared vocabulary:
        one embedding serves both sides)."""
        return getattr(other, "_table", None) is self._table

    def pieces(self, text: str) -> list[str]:
        """The pieces of ``text``: a leading language code whole, then SentencePiece's pieces.
        Special tokens written in the text (``</s>``, ``<unk>``, ``<pad>``) stay whole too."""
        out: list[str] = []
        for chunk, special in self._split_special(text):
            if special:
                out.append(chunk)
                continue
            code, rest = _split_language_code(chunk) if not out else ([], chunk)
            out += code + self._sp.encode(rest, out_type=str)
        return out

    def _split_special(self, text: str) -> list[tuple[str, bool]]:
        parts: list[tuple[str, bool]] = [(text, False)]
        for token in SPECIAL_TOKENS.values():
            split: list[tuple[str, bool]] = []
            for chunk, special in parts:
                if special or token not in chunk:
                    split.append((chunk, special))
                    continue
                pieces = chunk.split(token)
                for k, piece in enumerate(pieces):
                    if piece.strip():
                        split.append((piece.strip(), False))
                    if k < len(pieces) - 1:
                        split.append((token, True))
            parts = split
        return parts

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the final ``</s>`` (``MarianTokenizer``'s ids minus it)."""
        unk = self.unk_id
        return [self._table.get(p, unk) for p in self.pieces(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """Piece strings of ``ids``; ids outside the table are ``<unk>``."""
        return [self._pieces.get(int(i), SPECIAL_TOKENS["unk"]) for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first ``</s>``, special ids skipped: what
        ``MarianTokenizer.decode(ids, skip_special_tokens=True)`` gives for them."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in self._special or i not in self._pieces:
                continue
            pieces.append(self._pieces[i])
        return self._decode_sp.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()

    def __repr__(self) -> str:
        return f"MarianVocabulary({self.vocab_size} entries)"


class MarianTokenizer:
    """Marian's two SentencePiece models and its vocabulary (see the module docstring)."""

    def __init__(
        self,
        source_model: bytes,
        target_model: bytes,
        vocab: dict[str, int],
        target_vocab: dict[str, int] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self._files = {"source.spm": source_model, "target.spm": target_model}
        self.vocab, self.target_vocab = vocab, target_vocab
        self.config = dict(config or {})
        src = spm.SentencePieceProcessor(model_proto=source_model)
        tgt = spm.SentencePieceProcessor(model_proto=target_model)
        self.separate_vocabs = target_vocab is not None
        self.source = MarianVocabulary(src, vocab)
        # MarianTokenizer joins target pieces with the source model unless the vocabularies
        # are separate.
        self.target = MarianVocabulary(
            tgt,
            target_vocab if self.separate_vocabs else vocab,
            tgt if self.separate_vocabs else src,
        )

    @property
    def pad_id(self) -> int:
        return self.target.pad_id

    @property
    def eos_id(self) -> int:
        return self.target.eos_id

    @property
    def unk_id(self) -> int:
        return self.target.unk_id

    @classmethod
    def load(cls, directory: str) -> MarianTokenizer:
        """Reads ``source.spm``, ``target.spm``, ``vocab.json`` (and ``target_vocab.json`` when
        ``tokenizer_config.json`` says ``separate_vocabs``) from a local or ``gs://`` folder.

        Raises:
          FileNotFoundError: a required file is missing (all missing ones are named).
          ValueError: a vocabulary without ``</s>``, ``<unk>`` or ``<pad>``.
        """
        root = paths.resolve(directory)
        missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        separate = bool(config.get("separate_vocabs", False))
        if separate and not (root / "target_vocab.json").is_file():
            missing.append("target_vocab.json")
        if missing:
            raise FileNotFoundError(
                f"{directory} is not a Marian tokenizer folder: missing {', '.join(missing)} "
                f"(expected {', '.join(REQUIRED_FILES)}"
                + (", target_vocab.json" if separate else "")
                + ")"
            )
        vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
        target_vocab = (
            json.loads((root / "target_vocab.json").read_text(encoding="utf-8"))
            if separate
            else None
        )
        return cls(
            (root / "source.spm").read_bytes(),
            (root / "target.spm").read_bytes(),
            vocab,
            target_vocab,
            config,
        )

    def save(self, directory: str) -> None:
        """Writes the files ``transformers.MarianTokenizer.from_pretrained`` reads (and
        CTranslate2's converter through it): the two models, the vocabularies,
        ``tokenizer_config.json`` and ``special_tokens_map.json``."""
        root = paths.resolve(directory)
        paths.makedirs(root)
        for name, blob in self._files.items():
            paths.write_atomic(os.fspath(root / name), blob)

        def dump(obj: Any) -> str:
            return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"

        paths.write_atomic(os.fspath(root / "vocab.json"), dump(self.vocab))
        if self.separate_vocabs:
            paths.write_atomic(os.fspath(root / "target_vocab.json"), dump(self.target_vocab))
        config = {
            "model_max_length": 512,
            **self.config,
            "tokenizer_class": "MarianTokenizer",
            "separate_vocabs": self.separate_vocabs,
            "eos_token": SPECIAL_TOKENS["eos"],
            "unk_token": SPECIAL_TOKENS["unk"],
            "pad_token": SPECIAL_TOKENS["pad"],
        }
        paths.write_atomic(os.fspath(root / "tokenizer_config.json"), dump(config))
        special = {f"{role}_token": token for role, token in SPECIAL_TOKENS.items()}
        paths.write_atomic(os.fspath(root / "special_tokens_map.json"), dump(special))

    def __repr__(self) -> str:
        kind = "separate vocabularies" if self.separate_vocabs else "one vocabulary"
        return f"MarianTokenizer({self.source.vocab_size} entries, {kind})"
