"""A Hugging Face tokenizer through the ``tokenizers`` library: a ``tokenizer.json`` (any family:
Llama 3, SmolLM, Qwen2, BART, T5, ...) or BART's byte-level BPE files ``vocab.json`` +
``merges.txt``.

``tokenizer.json`` holds the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
decoder), so it is used as written; the config adjusts it as ``transformers`` does:

- the special tokens it names (``bos_token``, ..., ``extra_special_tokens``) are added as special
  tokens where the file lacks them (matched whole in text, skipped by ``decode``);
- the file's post-processor adds the special tokens around the ids: transformers 5 ignores the
  config's ``add_bos_token`` / ``add_eos_token`` when a ``tokenizer.json`` is there (they apply to
  BART's ``vocab.json`` + ``merges.txt``, where they replace ``<s>`` ... ``</s>``);
- mBART ends a source with ``</s>`` and the ``src_lang`` code, a target with ``</s>`` and the
  ``tgt_lang`` code;
- ``clean_up_tokenization_spaces`` applies to decoded text unless the model is a BPE (transformers
  skips it there: it would corrupt the text).

BART's ``vocab.json`` + ``merges.txt`` build what ``transformers.BartTokenizer`` (RoBERTa's) builds:
a byte-level BPE that wraps each text in ``<s>`` ... ``</s>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers, processors

from flaxformer_lite.data.hf_tokenizer_base import (
    SPECIAL_ROLES,
    HFTokenizer,
    extra_special_tokens,
    read_config,
    token_content,
    token_flags,
)

# The language codes of mBART (cc25), in its vocabulary's order after the SentencePiece pieces.
MBART_LANGUAGE_CODES = (
    "ar_AR cs_CZ de_DE en_XX es_XX et_EE fi_FI fr_XX gu_IN hi_IN it_IT ja_XX kk_KZ ko_KR lt_LT "
    "lv_LV my_MM ne_NP nl_XX ro_RO ru_RU si_LK tr_TR vi_VN zh_CN"
).split()


def mbart_languages(
    config: dict[str, Any], src_lang: str | None, tgt_lang: str | None
) -> tuple[str, str]:
    """(source, target) language codes: the arguments, else the config's, else ``en_XX`` (a
    target defaults to the source, as in transformers)."""
    src = src_lang or config.get("src_lang") or "en_XX"
    tgt = tgt_lang or config.get("tgt_lang") or src
    return src, tgt


def read_merges(text: str) -> list[tuple[str, str]]:
    """``merges.txt`` -> its merge pairs (a ``#version`` header line skipped)."""
    merges = []
    for k, line in enumerate(text.splitlines()):
        if (k == 0 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"merges.txt line {k + 1} is {line!r}; expected two space-separated tokens"
            )
        merges.append((parts[0], parts[1]))
    return merges


def byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], config: dict[str, Any]
) -> tokenizers.Tokenizer:
    """BART's (RoBERTa's) tokenizer from its vocabulary and merges, as transformers builds it."""
    add_prefix_space = bool(config.get("add_prefix_space", False))
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    sep = token_content(config.get("sep_token", "</s>"))
    cls = token_content(config.get("cls_token", "<s>"))
    for name, token in (("sep_token", sep), ("cls_token", cls)):
        if token not in vocab:
            raise ValueError(f"vocab.json has no {name} {token!r}; BART's tokenizer needs it")
    tok.post_processor = processors.RobertaProcessing(
        (sep, vocab[sep]),
        (cls, vocab[cls]),
        trim_offsets=bool(config.get("trim_offsets", True)),
        add_prefix_space=add_prefix_space,
    )
    return tok


class JsonTokenizer(HFTokenizer):
    """A ``tokenizers.Tokenizer`` with a folder's config over it (see the module docstring).

    ``src_lang`` / ``tgt_lang`` (mBART only) override the config's language codes.
    """

    def __init__(
        self,
        model_type: str,
        files: dict[str, bytes],
        tokenizer: tokenizers.Tokenizer,
        default_tokens: dict[str, str] | None = None,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
    ) -> None:
        super().__init__(model_type, files, default_tokens)
        self._tok = tokenizer
        self._add_config_special_tokens()
        self._prefix: list[int] | None = None
        self._suffix: list[int] | None = None
        self._target_suffix: list[int] | None = None
        if model_type == "mbart":
            self.src_lang, self.tgt_lang = mbart_languages(self.config, src_lang, tgt_lang)
            self._prefix = []
            self._suffix = [self._required_id(self.special_token("eos")), self._lang(self.src_lang)]
            self._target_suffix = [self._suffix[0], self._lang(self.tgt_lang)]
        elif "tokenizer.json" not in files and (
            "add_bos_token" in self.config or "add_eos_token" in self.config
        ):
            # Without a tokenizer.json, transformers rebuilds the post-processor from these two
            # flags when the config has either: [bos] $A [eos].
            bos, eos = self.special_token("bos"), self.special_token("eos")
            self._prefix = [self._required_id(bos)] if self.config.get("add_bos_token") else []
            self._suffix = [self._required_id(eos)] if self.config.get("add_eos_token") else []

    @classmethod
    def from_files(
        cls,
        model_type: str,
        files: dict[str, bytes],
        default_tokens: dict[str, str] | None = None,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
    ) -> JsonTokenizer:
        """From ``tokenizer.json``, else (BART) ``vocab.json`` + ``merges.txt``."""
        if "tokenizer.json" in files:
            tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        else:
            vocab = json.loads(files["vocab.json"].decode("utf-8"))
            merges = read_merges(files["merges.txt"].decode("utf-8"))
            tok = byte_level_bpe(vocab, merges, read_config(files))
        return cls(model_type, files, tok, default_tokens, src_lang, tgt_lang)

    def _add_config_special_tokens(self) -> None:
        """Adds the config's special tokens that the file does not already have as added tokens,
        as transformers does when it loads the folder."""
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        values = [self.config.get(f"{role}_token") for role in SPECIAL_ROLES]
        if "tokenizer.json" not in self.files:
            # BART's class supplies its default tokens where the config names none.
            values = [
                self.config[f"{role}_token"]
                if f"{role}_token" in self.config
                else self._default_tokens.get(role)
                for role in SPECIAL_ROLES
            ]
        new = []
        for value in values + extra_special_tokens(self.config):
            content = token_content(value)
            if content is None or content in added:
                continue
            flags = {"normalized": False, **token_flags(value)}
            new.append(AddedToken(content, special=True, **flags))
            added.add(content)
        if new:
            self._tok.add_special_tokens(new)

    def _required_id(self, token: str | None) -> int:
        token_id = None if token is None else self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"the {self.model_type} tokenizer's vocabulary has no special token {token!r} "
                "that its config asks to add; set its *_token in tokenizer_config.json"
            )
        return token_id

    def _lang(self, code: str) -> int:
        token_id = self._tok.token_to_id(code)
        if token_id is None:
            raise ValueError(
                f"language code {code!r} is not in the mBART vocabulary; valid codes include "
                f"{', '.join(MBART_LANGUAGE_CODES)}"
            )
        return token_id

    def encode(self, texts: Sequence[str], *, target: bool = False) -> list[list[int]]:
        self._check_texts(texts)
        if self._suffix is None:  # the file's own post-processor
            return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]
        suffix = self._target_suffix if target and self._target_suffix is not None else self._suffix
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [self._prefix + e.ids + suffix for e in encodings]

    def decode_batch(self, batch: Sequence[Iterable[int]]) -> list[str]:
        texts = self._tok.decode_batch([[int(i) for i in ids] for ids in batch], True)
        if not self.cleans_up:  # transformers never cleans up BPE text
            return texts
        return [self._clean_up(t) for t in texts]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def cleans_up(self) -> bool:
        """Whether ``decode`` applies ``clean_up_tokenization`` (never to a BPE's text)."""
        is_bpe = type(self._tok.model).__name__ == "BPE"
        return not is_bpe and bool(self.config.get("clean_up_tokenization_spaces"))

    def backend_json(self) -> str:
        """The ``tokenizers`` pipeline as ``decode`` and (without special tokens) ``encode``
        use it, config tokens added: a ``tokenizer.json`` that ``tokenizers`` alone reads
        (a serving artifact's)."""
        return self._tok.to_str()

    def saved_files(self) -> dict[str, bytes]:
        files = super().saved_files()
        if self.model_type == "mbart" and "tokenizer_config.json" in files:
            config = json.loads(files["tokenizer_config.json"].decode("utf-8"))
            config.update(src_lang=self.src_lang, tgt_lang=self.tgt_lang)
            files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode("utf-8")
        return files
