"""A Hugging Face encoder-decoder's own tokenizer as the translation pipeline's two vocabularies.

The data pipeline and the Translator read a vocabulary that encodes a text *without* its end
(``encode``) and puts ``suffix_ids`` after it (``eos_id`` alone for the project's and Marian's
vocabularies). A Hugging Face tokenizer (``data.hf_tokenizers``) gives whole sequences with the
family's special tokens; :class:`HFVocabulary` splits them by what it gives for an empty text:
what comes before its EOS is kept in front of every text (BART's ``<s>``), the EOS and what
follows it is the suffix (T5 and BART: ``</s>``; mBART's source: ``</s>`` and the language code).

    source:  prefix + text + suffix            BART  <s> X </s>     mBART  X </s> en_XX
    target:  prefix + text + EOS               BART  <s> Y </s>     mBART  Y </s>

Targets end at EOS (decoding stops there); the decoder starts from ``decoder_start_id``, the
model config's (``decoder_start_token_id``, else ``bos_token_id``: BART's ``</s>``, T5's pad,
an mBART's target language code when its config says so): with BART this is exactly the
fine-tuning layout of transformers (labels ``<s> Y </s>``, decoder inputs ``</s> <s> Y``).

A workdir fine-tuned from such a folder holds the tokenizer files and ``hf_tokenizer.json``
(:data:`MARKER`: the model type, the model's vocabulary size and decoder start, mBART's
language codes), from which :func:`load_workdir_vocabularies` reads the pair back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flaxformer_lite.core import paths
from flaxformer_lite.data.hf_tokenizers import MODEL_TYPES, load_hf_tokenizer

MARKER = "hf_tokenizer.json"  # in a workdir: which family's tokenizer the files beside it are


class HFVocabulary:
    """One side (source or target) of a Hugging Face tokenizer with the model's sizes and ids.

    Args:
      tokenizer: an ``hf_tokenizers.HFTokenizer``.
      target: the target side (mBART encodes targets with the target language code).
      vocab_size: the model's vocabulary (``config.json``'s ``vocab_size``; T5's is larger than
        the tokenizer's, which never gives the extra ids).
      decoder_start_id: the model's decoder start (``bos_id`` here).

    Raises:
      ValueError: the tokenizer has no EOS or pad token, gives no EOS for an empty text, or
        has more ids than the model's ``vocab_size``.
    """

    def __init__(
        self, tokenizer: Any, *, target: bool, vocab_size: int, decoder_start_id: int
    ) -> None:
        family = tokenizer.model_type
        for role in ("eos", "pad"):
            if getattr(tokenizer, f"{role}_id") is None:
                raise ValueError(f"the {family} tokenizer has no {role} token; a seq2seq needs one")
        if tokenizer.vocab_size > vocab_size:
            # The ids past the model's table would index nothing (an added <mask>, say).
            extra = [
                f"{i}={tokenizer.id_to_token(i)!r}"
                for i in range(vocab_size, min(tokenizer.vocab_size, vocab_size + 3))
            ]
            raise ValueError(
                f"the {family} tokenizer has {tokenizer.vocab_size} ids but the model's "
                f"vocab_size is {vocab_size} (ids {', '.join(extra)} ... have no embedding "
                "row); use the tokenizer saved with the model"
            )
        self.tokenizer = tokenizer
        self.target = target
        self._vocab_size = int(vocab_size)
        self._bos_id = int(decoder_start_id)
        empty = tokenizer.encode([""], target=target)[0]
        eos = tokenizer.eos_id
        if eos not in empty:
            raise ValueError(
                f"the {family} tokenizer does not end a text with EOS ({eos}); it gives "
                f"{empty} for an empty one"
            )
        cut = empty.index(eos)
        self.prefix_ids: tuple[int, ...] = tuple(empty[:cut])
        self.suffix_ids: tuple[int, ...] = (eos,) if target else tuple(empty[cut:])
        self._full_suffix = tuple(empty[cut:])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def unk_id(self) -> int:
        unk = self.tokenizer.unk_id
        return self.pad_id if unk is None else int(unk)

    @property
    def bos_id(self) -> int:
        """The decoder start (the model config's)."""
        return self._bos_id

    def shares_table_with(self, other: Any) -> bool:
        """Both sides number tokens with one table (always, for one tokenizer)."""
        return getattr(other, "tokenizer", None) is self.tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text with the family's prefix and without its suffix (``suffix_ids``
        goes after them)."""
        out = []
        n = len(self._full_suffix)
        encoded = self.tokenizer.encode(list(texts), target=self.target)
        for text, ids in zip(texts, encoded, strict=True):
            if tuple(ids[len(ids) - n :]) != self._full_suffix:
                raise ValueError(
                    f"the {self.tokenizer.model_type} tokenizer ended {text!r} with "
                    f"{ids[-n:]}, not {list(self._full_suffix)} as it ends an empty text"
                )
            out.append(list(ids[: len(ids) - n]))
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first EOS, special tokens skipped (the tokenizer's
        ``decode``: transformers' ``decode(ids, skip_special_tokens=True)``)."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids)

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        return self.tokenizer.id_to_piece(ids)

    def __repr__(self) -> str:
        side = "target" if self.target else "source"
        return f"HFVocabulary({self.tokenizer.model_type} {side}, {self.vocab_size} ids)"


def vocabularies(
    tokenizer: Any, *, vocab_size: int, decoder_start_id: int
) -> tuple[HFVocabulary, HFVocabulary]:
    """(source, target) sides of one Hugging Face tokenizer (see :class:`HFVocabulary`)."""
    kw = dict(vocab_size=vocab_size, decoder_start_id=decoder_start_id)
    return HFVocabulary(tokenizer, target=False, **kw), HFVocabulary(tokenizer, target=True, **kw)


def decoder_start_of(hf_config: Mapping[str, Any]) -> int:
    """A ``config.json``'s decoder start: ``decoder_start_token_id``, else ``bos_token_id``
    (what transformers' ``generate`` starts from then).

    Raises:
      ValueError: the config has neither.
    """
    for key in ("decoder_start_token_id", "bos_token_id"):
        if hf_config.get(key) is not None:
            return int(hf_config[key])
    raise ValueError(
        "config.json has neither decoder_start_token_id nor bos_token_id: the decoder start "
        "of its model is unknown"
    )


def copy_to_workdir(
    folder: str,
    hf_config: Mapping[str, Any],
    workdir: str,
    *,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> None:
    """Writes the tokenizer of a Hugging Face model ``folder`` (its ``config.json`` dict is
    ``hf_config``) and :data:`MARKER` into ``workdir``.

    ``src_lang`` / ``tgt_lang``: mBART's language codes; else the tokenizer config's.

    Raises:
      ValueError: ``model_type`` has no tokenizer here, the folder has none, or (mBART) a
        language code is given neither here nor in its ``tokenizer_config.json``.
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{folder}: model_type {model_type!r} has no tokenizer here; supported: "
            f"{', '.join(MODEL_TYPES)}"
        )
    langs = {}
    if model_type == "mbart":
        config_path = paths.resolve(folder) / "tokenizer_config.json"
        saved = json.loads(config_path.read_text()) if config_path.is_file() else {}
        for key, value, field in (
            ("src_lang", src_lang, "tokenizer_src_lang"),
            ("tgt_lang", tgt_lang, "tokenizer_tgt_lang"),
        ):
            langs[key] = value or saved.get(key)
            if not langs[key]:
                raise ValueError(
                    f"config.{field} is not set and {folder}'s tokenizer_config.json has no "
                    f"{key}: give mBART's language code, e.g. --config.{field}=en_XX"
                )
    tokenizer = load_hf_tokenizer(folder, model_type, **langs)
    if tokenizer is None:
        raise ValueError(
            f"{folder} has no tokenizer files; fine-tuning a {model_type!r} model with its own "
            "vocabulary needs them (tokenizer.json, or the family's own files)"
        )
    vocabularies(  # the checks, before anything is written
        tokenizer,
        vocab_size=int(hf_config["vocab_size"]),
        decoder_start_id=decoder_start_of(hf_config),
    )
    tokenizer.save(workdir)
    marker = {
        "model_type": model_type,
        "vocab_size": int(hf_config["vocab_size"]),
        "decoder_start_id": decoder_start_of(hf_config),
        **langs,
    }
    paths.write_atomic(os.path.join(workdir, MARKER), json.dumps(marker, indent=2) + "\n")


def load_workdir_vocabularies(workdir: str) -> tuple[HFVocabulary, HFVocabulary]:
    """(source, target) vocabularies of the Hugging Face tokenizer that
    :func:`copy_to_workdir` wrote into ``workdir``.

    Raises:
      FileNotFoundError: ``workdir`` has no :data:`MARKER`.
    """
    root = paths.resolve(workdir)
    if not (root / MARKER).is_file():
        raise FileNotFoundError(f"no {MARKER} in {workdir}: no Hugging Face tokenizer there")
    marker = json.loads((root / MARKER).read_text())
    langs = {k: marker[k] for k in ("src_lang", "tgt_lang") if marker.get(k)}
    tokenizer = load_hf_tokenizer(str(root), marker["model_type"], **langs)
    if tokenizer is None:
        raise FileNotFoundError(f"{workdir} has {MARKER} but no tokenizer files beside it")
    return vocabularies(
        tokenizer, vocab_size=marker["vocab_size"], decoder_start_id=marker["decoder_start_id"]
    )
