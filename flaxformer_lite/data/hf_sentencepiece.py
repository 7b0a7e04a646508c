"""T5's, Llama 2's and mBART's tokenizers from their SentencePiece models, through
``sentencepiece``: the ids and text that ``transformers``' tokenizer of the folder gives.

SentencePiece cuts the text into pieces; what each family adds around it is here:

- **T5** (``spiece.model``): ids are SentencePiece's (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), then
  ``extra_ids`` sentinels at the top, ``<extra_id_0>`` last; every text ends with ``</s>``.
- **Llama 2** (``tokenizer.model``, BPE with byte fallback): ids are SentencePiece's; ``<s>``
  first when the config says ``add_bos_token`` (default true, Llama 2's setting). As in
  transformers 5, a text that starts with a space gets no second dummy-prefix space, and text after
  a special token gets none unless the config says ``legacy``.
- **mBART** (``sentencepiece.bpe.model``): fairseq's ids, SentencePiece's shifted by one after
  ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, then the 25 language codes and ``<mask>``; a
  source ends with ``</s>`` and its ``src_lang`` code, a target with ``</s>`` and ``tgt_lang``'s.
  transformers 5.25 (the version tested) scores mBART's pieces as a unigram model over
  whitespace-split words after the model's own normalizer (nmt_nfkc, as fairseq), and so does
  this (the model's type is overridden to match; earlier 5.x releases normalized nothing).

Special tokens written in the text (``</s>``, ``<extra_id_3>``, ``en_XX``, ...) are matched whole,
as transformers matches its added tokens; ``decode`` skips them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

import sentencepiece as spm

from flaxformer_lite.data.hf_json_tokenizer import MBART_LANGUAGE_CODES, mbart_languages
from flaxformer_lite.data.hf_tokenizer_base import HFTokenizer, extra_special_tokens, token_content

SPIECE_UNDERLINE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")

# Rust's char::is_whitespace, which the `tokenizers` WhitespaceSplit pre-tokenizer splits on
# (Python's str.split also splits on \x1c-\x1f, which Rust does not).
_WHITESPACE = re.compile(
    "[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+"
)


def _bytes_text(run: bytes) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def edited_model(model: bytes, unigram: bool = False, **normalizer: object) -> bytes:
    """The serialized SentencePiece ``model`` with ``normalizer`` fields overridden (and, with
    ``unigram``, scored as a unigram model)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    for field, value in normalizer.items():
        setattr(proto.normalizer_spec, field, value)
    if unigram:
        proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.UNIGRAM
    return proto.SerializeToString()


class SentencePieceTokenizer(HFTokenizer):
    """A SentencePiece model with a family's ids and special tokens around it (subclasses: one per
    family). ``_to_id`` / ``_to_piece_id`` map between SentencePiece's and the family's ids;
    ``_added`` holds the special tokens matched whole in text."""

    def __init__(self, model_type: str, files: dict[str, bytes], model_file: str) -> None:
        super().__init__(model_type, files, {})
        self._model = files[model_file]
        self._sp = spm.SentencePieceProcessor(model_proto=self._model)
        self._added: dict[str, int] = {}
        self._prefix: list[int] = []
        self._suffix: list[int] = []

    def _finish(self, special: Iterable[str]) -> None:
        """Registers the special tokens (those in the vocabulary) once the subclass set its ids."""
        for token in special:
            token_id = self.token_to_id(token)
            if token_id is not None:
                self._added[token] = token_id
        self._skipped = set(self._added.values())
        self._added_by_id = {i: token for token, i in self._added.items()}
        alternatives = sorted(self._added, key=len, reverse=True)  # longest match first
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def _config_special(self) -> list[str]:
        tokens = [
            token_content(self.config.get(f"{r}_token")) for r in ("bos", "eos", "unk", "pad")
        ]
        tokens += [token_content(t) for t in extra_special_tokens(self.config)]
        return [t for t in tokens if t]

    # SentencePiece id <-> family id (the identity but for mBART).
    def _to_id(self, piece_id: int) -> int:
        return piece_id

    def _to_piece_id(self, token_id: int) -> int | None:
        return token_id if 0 <= token_id < self._sp.get_piece_size() else None

    def _encode_segment(self, text: str, start: int) -> list[int]:
        """Ids of text between special tokens (``start``: its offset in the whole text)."""
        return [self._to_id(i) for i in self._sp.encode(text)]

    def _encode_one(self, text: str, suffix: list[int]) -> list[int]:
        ids = list(self._prefix)
        position = 0
        matches = list(self._pattern.finditer(text)) if self._pattern else []
        for match in matches:
            if match.start() > position:
                ids += self._encode_segment(text[position : match.start()], position)
            ids.append(self._added[match.group()])
            position = match.end()
        if position < len(text):
            ids += self._encode_segment(text[position:], position)
        return ids + suffix

    def encode(self, texts: Sequence[str], *, target: bool = False) -> list[list[int]]:
        self._check_texts(texts)
        suffix = self._target_suffix() if target else self._suffix
        return [self._encode_one(text, suffix) for text in texts]

    def _target_suffix(self) -> list[int]:
        return self._suffix

    def decode_batch(self, batch: Sequence[Iterable[int]]) -> list[str]:
        out = []
        for ids in batch:
            pieces = []
            for i in ids:
                i = int(i)
                piece_id = None if i in self._skipped else self._to_piece_id(i)
                if piece_id is not None:
                    pieces.append(self._sp.id_to_piece(piece_id))
            out.append(self._clean_up(self._join(pieces)))
        return out

    def _join(self, pieces: list[str]) -> str:
        """Text of the pieces, as transformers' Metaspace decoder joins them (``▁`` is a space,
        the first piece's leading one dropped). SentencePiece's own decode differs: it also drops
        spaces that pieces of skipped special tokens leave around them."""
        text = "".join(pieces).replace(SPIECE_UNDERLINE, " ")
        return text[1:] if pieces and pieces[0].startswith(SPIECE_UNDERLINE) else text

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        piece_id = self._sp.piece_to_id(token)
        # piece_to_id answers unk's id for a piece it lacks.
        if piece_id == self._sp.unk_id() and token != self._sp.id_to_piece(piece_id):
            return None
        return self._to_id(piece_id)

    def id_to_token(self, token_id: int) -> str | None:
        if int(token_id) in self._added_by_id:
            return self._added_by_id[int(token_id)]
        piece_id = self._to_piece_id(int(token_id))
        return None if piece_id is None else self._sp.id_to_piece(piece_id)


class T5SentencePiece(SentencePieceTokenizer):
    """T5's ``spiece.model``: SentencePiece's ids, sentinels at the top, ``</s>`` at the end."""

    def __init__(self, files: dict[str, bytes], model_type: str = "t5") -> None:
        super().__init__(model_type, files, "spiece.model")
        self._default_tokens = {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}
        extra = [token_content(t) or "" for t in extra_special_tokens(self.config)]
        sentinels = [t for t in extra if re.fullmatch(r"<extra_id_\d+>", t)]
        self.extra_ids = int(self.config.get("extra_ids", len(sentinels) or 100))
        self._base = self._sp.get_piece_size()
        # <extra_id_0> is the last id: transformers appends the sentinels in reverse.
        self._sentinels = {
            f"<extra_id_{k}>": self._base + self.extra_ids - 1 - k for k in range(self.extra_ids)
        }
        self._finish([*self._sentinels, *self._config_special(), "</s>", "<unk>", "<pad>"])
        self._suffix = [self._added[self.special_token("eos")]]

    def token_to_id(self, token: str) -> int | None:
        if token in self._sentinels:
            return self._sentinels[token]
        return super().token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._base + self.extra_ids


class LlamaSentencePiece(SentencePieceTokenizer):
    """Llama 2's ``tokenizer.model``: SentencePiece's ids, ``<s>`` first (``add_bos_token``)."""

    def __init__(self, files: dict[str, bytes], model_type: str = "llama") -> None:
        super().__init__(model_type, files, "tokenizer.model")
        self._default_tokens = {"bos": "<s>", "eos": "</s>", "unk": "<unk>"}
        # A second processor without the dummy prefix: transformers 5 adds the prefix space only
        # where the text does not start with one, and (unless legacy) only at the very start.
        self._sp_bare = spm.SentencePieceProcessor(
            model_proto=edited_model(self._model, add_dummy_prefix=False)
        )
        add_prefix_space = self.config.get("add_prefix_space")
        if add_prefix_space is False:
            self._prepend = "never"
        else:
            self._prepend = "always" if self.config.get("legacy", False) else "first"
        self._finish([*self._config_special(), "<s>", "</s>", "<unk>"])
        if self.config.get("add_bos_token", True):
            self._prefix = [self._required(self.special_token("bos"), "add_bos_token")]
        if self.config.get("add_eos_token", False):
            self._suffix = [self._required(self.special_token("eos"), "add_eos_token")]

    def _required(self, token: str | None, flag: str) -> int:
        token_id = None if token is None else self.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer_config.json sets {flag} but the vocabulary lacks {token!r}"
            )
        return token_id

    def _join(self, pieces: list[str]) -> str:
        """transformers 5's Llama decoder: ``▁`` is a space, runs of byte pieces (``<0xE6>``) are
        UTF-8 (each byte of an invalid run one U+FFFD), and the leading space goes."""
        parts: list[str] = []
        run = bytearray()
        for piece in pieces:
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte:
                run.append(int(byte.group(1), 16))
                continue
            parts.append(_bytes_text(run))
            run.clear()
            parts.append(piece.replace(SPIECE_UNDERLINE, " "))
        parts.append(_bytes_text(run))
        text = "".join(parts)
        return text[1:] if self._prepend != "never" and text.startswith(" ") else text

    def _encode_segment(self, text: str, start: int) -> list[int]:
        prefix = self._prepend == "always" or (self._prepend == "first" and start == 0)
        sp = self._sp if prefix and not text.startswith(" ") else self._sp_bare
        return sp.encode(text)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()


class MBartSentencePiece(SentencePieceTokenizer):
    """mBART's ``sentencepiece.bpe.model`` with fairseq's ids and the language codes."""

    FAIRSEQ_SPECIAL = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3

    def __init__(
        self,
        files: dict[str, bytes],
        model_type: str = "mbart",
        src_lang: str | None = None,
        tgt_lang: str | None = None,
    ) -> None:
        super().__init__(model_type, files, "sentencepiece.bpe.model")
        tokenizer_class = str(self.config.get("tokenizer_class", "MBartTokenizer"))
        if tokenizer_class.startswith("MBart50"):
            raise ValueError(
                f"tokenizer_class {tokenizer_class} (mBART-50: the language code first) is not "
                "supported from sentencepiece.bpe.model; only MBartTokenizer's layout is"
            )
        self._default_tokens = {
            "bos": "<s>",
            "eos": "</s>",
            "unk": "<unk>",
            "pad": "<pad>",
            "mask": "<mask>",
        }
        # transformers 5.25 (as fairseq) scores the pieces as a unigram model after the model's
        # own normalizer (nmt_nfkc: full-width "ｆｕｌｌ" reads "full").
        self._sp = spm.SentencePieceProcessor(model_proto=edited_model(self._model, unigram=True))
        self._base = self._sp.get_piece_size() + 1  # the first id after the pieces
        codes = {code: self._base + k for k, code in enumerate(MBART_LANGUAGE_CODES)}
        self._fixed = {t: i for i, t in enumerate(self.FAIRSEQ_SPECIAL)}
        self._fixed |= codes | {"<mask>": self._base + len(codes)}
        self._finish([*self._fixed, *self._config_special()])
        self.src_lang, self.tgt_lang = mbart_languages(self.config, src_lang, tgt_lang)
        for code in (self.src_lang, self.tgt_lang):
            if code not in codes:
                raise ValueError(
                    f"language code {code!r} is not one of mBART's: {', '.join(codes)}"
                )
        self._suffix = [self._fixed["</s>"], codes[self.src_lang]]
        self._target = [self._fixed["</s>"], codes[self.tgt_lang]]

    def _target_suffix(self) -> list[int]:
        return self._target

    def token_to_id(self, token: str) -> int | None:
        if token in self._fixed:
            return self._fixed[token]
        return super().token_to_id(token)

    def _to_id(self, piece_id: int) -> int:
        # SentencePiece's <unk> 0, <s> 1, </s> 2 are fairseq's 3, 0, 2; the pieces shift by one.
        return {0: 3, 1: 0, 2: 2}.get(piece_id, piece_id + 1)

    def _to_piece_id(self, token_id: int) -> int | None:
        return token_id - 1 if 4 <= token_id < self._base else None

    def _encode_segment(self, text: str, start: int) -> list[int]:
        # Whitespace-split words, each with its own dummy prefix (transformers' pre-tokenizer).
        ids: list[int] = []
        for word in _WHITESPACE.split(text):
            if word:
                ids += [self._to_id(i) for i in self._sp.encode(word)]
        return ids

    @property
    def vocab_size(self) -> int:
        return self._base + len(MBART_LANGUAGE_CODES) + 1

    def saved_files(self) -> dict[str, bytes]:
        files = super().saved_files()
        config = json.loads(files.get("tokenizer_config.json", b"{}").decode("utf-8"))
        config.update(src_lang=self.src_lang, tgt_lang=self.tgt_lang)
        files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode("utf-8")
        return files
