"""What the Hugging Face tokenizers of ``data/hf_tokenizers.py`` share: the folder's files, its
special tokens, and the interface the model families use.

A tokenizer keeps the bytes of every tokenizer file it was read from, so that ``save`` writes them
back unchanged (``transformers`` reads the copy as it read the original), and takes its special
tokens from ``tokenizer_config.json`` and ``special_tokens_map.json`` (a token is a string or a
``{"content": ...}`` object), falling back to the family's conventional tokens.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from flaxformer_lite.core import paths

# Every file a Hugging Face tokenizer folder may hold; a folder with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
)
SPECIAL_ROLES = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")

# transformers' ``clean_up_tokenization``: the spaces a word-piece tokenizer leaves before
# punctuation and English contractions.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """``"a , b ."`` -> ``"a, b."``: what ``clean_up_tokenization_spaces`` does in transformers."""
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


def token_content(value: Any) -> str | None:
    """A special token as the config writes it (``"</s>"`` or ``{"content": "</s>", ...}``)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def token_flags(value: Any) -> dict[str, bool]:
    """The ``AddedToken`` flags (``lstrip``, ``rstrip``, ...) a config object gives a token."""
    keys = ("single_word", "lstrip", "rstrip", "normalized")
    return {k: bool(value[k]) for k in keys if isinstance(value, dict) and k in value}


def read_tokenizer_files(folder: str) -> dict[str, bytes]:
    """The bytes of the tokenizer files present in a local or ``gs://`` ``folder``.

    Raises:
      ValueError: ``folder`` is not a directory.
    """
    root = paths.resolve(folder)
    if not root.is_dir():
        raise ValueError(f"tokenizer folder {folder!r} is not a directory")
    return {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}


def read_config(files: dict[str, bytes]) -> dict[str, Any]:
    """``tokenizer_config.json`` with ``special_tokens_map.json``'s tokens over it (as transformers
    reads them); ``{}`` when neither file is there."""
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if name in files:
            loaded = json.loads(files[name].decode("utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"{name} holds {type(loaded).__name__}, expected a JSON object")
            config.update(loaded)
    return config


def extra_special_tokens(config: dict[str, Any]) -> list[Any]:
    """The config's extra special tokens (transformers 5's ``extra_special_tokens``, a list or a
    name -> token map, and 4's ``additional_special_tokens``), as written."""
    out: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key) or []
        out += list(value.values()) if isinstance(value, dict) else list(value)
    return out


class HFTokenizer(abc.ABC):
    """The tokenizer of a Hugging Face model folder, as its model family uses it.

    ``encode(texts)`` gives each text's ids with the family's special tokens (T5: ``</s>`` after;
    Llama: ``<s>`` before, as ``tokenizer.json``'s post-processor or (``tokenizer.model``) the
    config's ``add_bos_token`` says; BART: ``<s>`` ... ``</s>``;
    mBART: ... ``</s>`` and the language code), ``decode(ids)`` the text with special tokens
    skipped, as ``transformers``' tokenizer of that folder gives them. Special ids are ``None``
    where the tokenizer has no such token (T5 has no BOS, Llama no pad).
    """

    def __init__(
        self,
        model_type: str,
        files: dict[str, bytes],
        default_tokens: dict[str, str] | None = None,
    ) -> None:
        self.model_type = model_type
        self.files = dict(files)
        self.config = read_config(files)
        self._default_tokens = dict(default_tokens or {})

    # The backend: a tokenizer library's encode/decode and its table of tokens.

    @abc.abstractmethod
    def encode(self, texts: Sequence[str], *, target: bool = False) -> list[list[int]]:
        """Ids of each text, with the family's special tokens. ``target``: encode as decoder
        targets (only mBART differs: the target language code ends the ids)."""

    @abc.abstractmethod
    def decode_batch(self, batch: Sequence[Iterable[int]]) -> list[str]:
        """Text of each id sequence, special tokens skipped."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``; None when the vocabulary has no such token."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id``; None outside the vocabulary."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Every id the tokenizer can give, added tokens included (``len(hf_tokenizer)``)."""

    # Shared.

    def decode(self, ids: Iterable[int]) -> str:
        """Text of one id sequence, special tokens skipped (``tokenizer.decode(ids,
        skip_special_tokens=True)``); the caller cuts it at EOS if it should end there."""
        return self.decode_batch([ids])[0]

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """Token strings of ``ids`` (``MarianVocabulary``'s name); unknown ids give ``""``."""
        return [self.id_to_token(int(i)) or "" for i in ids]

    def special_token(self, role: str) -> str | None:
        """The string of a special token (``role``: one of ``SPECIAL_ROLES``)."""
        if role not in SPECIAL_ROLES:
            raise ValueError(f"role must be one of {', '.join(SPECIAL_ROLES)}; got {role!r}")
        key = f"{role}_token"
        if key in self.config:  # an explicit null means the tokenizer has none
            return token_content(self.config[key])
        return self._default_tokens.get(role)

    def special_id(self, role: str) -> int | None:
        token = self.special_token(role)
        return None if token is None else self.token_to_id(token)

    @property
    def pad_id(self) -> int | None:
        return self.special_id("pad")

    @property
    def eos_id(self) -> int | None:
        return self.special_id("eos")

    @property
    def bos_id(self) -> int | None:
        return self.special_id("bos")

    @property
    def unk_id(self) -> int | None:
        return self.special_id("unk")

    def _check_texts(self, texts: Sequence[str]) -> None:
        if isinstance(texts, str):
            raise ValueError("texts must be a sequence of strings, not one str: pass [text]")
        for k, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{k}] is {type(text).__name__}; texts must be strings")

    def _clean_up(self, text: str) -> str:
        return (
            clean_up_tokenization(text) if self.config.get("clean_up_tokenization_spaces") else text
        )

    def saved_files(self) -> dict[str, bytes]:
        """The files ``save`` writes (name -> bytes): those the tokenizer was read from."""
        return dict(self.files)

    def save(self, folder: str) -> None:
        """Writes the tokenizer files to a local or ``gs://`` ``folder``, so that
        ``transformers.AutoTokenizer.from_pretrained(folder)`` reads this tokenizer back."""
        root = paths.resolve(folder)
        paths.makedirs(root)
        for name, blob in self.saved_files().items():
            paths.write_atomic(os.fspath(root / name), blob)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type}, {self.vocab_size} ids)"
