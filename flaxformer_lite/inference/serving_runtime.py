"""Load and run a serving artifact written by ``flaxformer_lite.inference.export``: strings in,
strings out.

This file is copied into every artifact (``runtime.py``) and needs only the packages in
``REQUIREMENTS`` (jax and the packages jax itself imports, sentencepiece, and flatbuffers, which
``jax.export.deserialize`` needs but jax does not install; the artifact's ``manifest.json``
pins them under ``requirements`` and its ``README.md`` gives the pip line), never
``flaxformer_lite``. Without one of them, loading fails with one line saying what to install:

    import sys; sys.path.insert(0, "ARTIFACT")
    import runtime
    model = runtime.load("ARTIFACT")
    model.translate(["A dog runs.", ""])  # -> ["...", ""]

An artifact folder holds::

  ``manifest.json``   ids (pad, eos), ``max_len`` (the output width), ``per_row_limit``,
                      method, vocabulary kind, ``max_source_len``, the default row count per
                      call, versions, ``requirements`` (pip names pinned), and
                      ``generation`` (the exporter's GenerationConfig as a dict; this
                      runtime reads ``max_len`` and ``per_row_limit`` only, so artifacts
                      exported before that key existed load alike).
  ``translate.jax``   ``jax.export.Exported.serialize()`` of
                      ``(params, source_ids int32 [batch, src_len], row_max_len int32 [batch])
                      -> (tokens int32 [batch, max_len], scores float32 [batch])``, with
                      ``batch`` and ``src_len`` symbolic (``1 <= src_len <= max_source_len``).
  ``params.npz``      the parameters, one array per ``/``-joined path (``decoder/logits/kernel``).
  vocabulary files    ``spm_shared.model`` or ``spm_src.model`` + ``spm_tgt.model`` (kind
                      "spm": ids are SentencePiece ids), or ``source.spm`` + ``target.spm`` +
                      ``vocab.json`` (kind "marian": pieces map to ``vocab.json`` ids, unknown
                      pieces to ``<unk>``, as Hugging Face's ``MarianTokenizer`` maps them), or
                      ``tokenizer.json`` (kind "hf": a BART-like model's own tokenizer through
                      the ``tokenizers`` package, the manifest's ``hf_tokenizer`` giving the
                      ids around each source).

The exported program runs on any batch size and source length without tracing the model again,
but XLA compiles a program for each concrete input shape it sees. :meth:`ServingModel.translate`
therefore pads every call to one row count and its source length up to a multiple of
``BUCKET``: all calls with sources up to 16 tokens share one compiled program.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

# pip name -> import name of every package this runtime imports: jax and what jax imports
# (typing_extensions through jaxlib's MLIR bindings), sentencepiece, and flatbuffers, which
# jax.export's deserializer imports but jax does not install.
REQUIREMENTS = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "ml_dtypes": "ml_dtypes",
    "numpy": "numpy",
    "opt_einsum": "opt_einsum",
    "scipy": "scipy",
    "typing_extensions": "typing_extensions",
    "sentencepiece": "sentencepiece",
    "flatbuffers": "flatbuffers",
}


def missing_requirements(pinned: Sequence[str] = ()) -> str | None:
    """One line naming what to install (``pinned``: the manifest's ``name==version``
    requirements, used where they name a missing package), or None when nothing is missing."""
    missing = []
    for name, module in REQUIREMENTS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(next((p for p in pinned if p.split("==")[0] == name), name))
    if not missing:
        return None
    names = ", ".join(m.split("==")[0] for m in missing)
    return f"this serving runtime needs {names}, which cannot be imported: pip install " + " ".join(
        missing
    )


try:
    import jax
    import numpy as np
    import sentencepiece as spm
except ImportError as e:  # one line saying what to install, not jax's or numpy's own
    raise ImportError(missing_requirements() or str(e)) from e

# Source lengths are padded up to a multiple of this (as flaxformer_lite.inference.translator).
BUCKET = 16
MANIFEST = "manifest.json"
EXPORTED = "translate.jax"
PARAMS = "params.npz"
_LANGUAGE_CODE = re.compile(r"^>>[^<>]+<<")  # a multilingual Marian target tag, e.g. ">>de<<"


def _processor(path: str) -> spm.SentencePieceProcessor:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SentencePiece model not found: {path}")
    return spm.SentencePieceProcessor(model_file=path)


class SpmVocabulary:
    """A SentencePiece model whose ids are the model's token ids (``train.py`` workdirs)."""

    def __init__(self, path: str) -> None:
        self.processor = _processor(path)

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))


class MarianVocabulary:
    """SentencePiece pieces mapped through Marian's ``vocab.json`` (piece -> id).

    ``encode``: an optional leading language code (``>>de<<``) is kept as one token, the rest
    split into pieces by ``spm_path``, and each token is looked up in ``vocab`` (``unk_id``
    when absent). ``decode``: ids -> pieces (``special_ids`` dropped) -> the text, joined by
    ``join_path`` (None: ``spm_path``), as ``MarianTokenizer`` joins target pieces with the
    source model unless the vocabularies are separate.
    """

    def __init__(
        self,
        spm_path: str,
        vocab: dict[str, int],
        unk_id: int,
        special_ids: Sequence[int],
        join_path: str | None = None,
    ) -> None:
        self.processor = _processor(spm_path)
        self.joiner = self.processor if join_path is None else _processor(join_path)
        self.vocab = vocab
        self.pieces = {i: piece for piece, i in vocab.items()}
        self.unk_id = unk_id
        self.special_ids = frozenset(special_ids)

    def encode(self, text: str) -> list[int]:
        code = _LANGUAGE_CODE.match(text)
        tokens = [code.group(0)] if code else []
        tokens += self.processor.encode(text[code.end() :] if code else text, out_type=str)
        return [self.vocab.get(token, self.unk_id) for token in tokens]

    def decode(self, ids: Sequence[int]) -> str:
        pieces = [self.pieces[i] for i in ids if i not in self.special_ids and i in self.pieces]
        return self.joiner.decode_pieces(pieces).replace("\u2581", " ").strip()


# transformers' clean_up_tokenization (as flaxformer_lite.data.hf_tokenizer_base, repeated here).
_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


class HFVocabulary:
    """A Hugging Face tokenizer's ``tokenizer.json`` through ``tokenizers`` (kind "hf"):
    ``encode`` gives ``prefix`` and the text's ids (the caller appends the source suffix),
    ``decode`` the text with special tokens skipped, cleaned up as transformers does when
    ``clean_up``."""

    def __init__(self, path: str, prefix: Sequence[int], clean_up: bool) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(
                "this artifact's vocabulary needs the tokenizers package: pip install tokenizers"
            ) from e
        self.tokenizer = tokenizers.Tokenizer.from_file(path)
        self.prefix = [int(i) for i in prefix]
        self.clean_up = bool(clean_up)

    def encode(self, text: str) -> list[int]:
        return [*self.prefix, *self.tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
        if self.clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text


def load_vocabularies(root: str, manifest: dict[str, Any]) -> tuple[Any, Any]:
    """(source, target) vocabularies of the artifact in ``root`` as ``manifest`` names them."""
    files = manifest["vocabulary_files"]
    if manifest["vocabulary"] == "spm":
        source = SpmVocabulary(os.path.join(root, files["source"]))
        same = files["target"] == files["source"]
        return source, source if same else SpmVocabulary(os.path.join(root, files["target"]))
    if manifest["vocabulary"] == "hf":
        hf = manifest["hf_tokenizer"]
        vocab = HFVocabulary(
            os.path.join(root, files["source"]), hf["source_prefix"], hf["clean_up"]
        )
        return vocab, vocab
    if manifest["vocabulary"] == "marian":
        vocabs = {}
        for role in ("vocab", "target_vocab"):
            if role in files:
                with open(os.path.join(root, files[role]), encoding="utf-8") as f:
                    vocabs[role] = json.load(f)
        separate = "target_vocab" in vocabs
        ids = manifest["ids"]
        special = (ids["pad"], ids["eos"], ids["unk"])
        source_spm = os.path.join(root, files["source"])
        target_vocab = vocabs["target_vocab" if separate else "vocab"]
        return (
            MarianVocabulary(
                source_spm, vocabs["vocab"], vocabs["vocab"].get("<unk>", ids["unk"]), special
            ),
            MarianVocabulary(
                os.path.join(root, files["target"]),
                target_vocab,
                target_vocab.get("<unk>", ids["unk"]),
                special,
                join_path=None if separate else source_spm,
            ),
        )
    raise ValueError(
        f"manifest vocabulary must be 'spm', 'marian' or 'hf'; got {manifest['vocabulary']!r}"
    )


def stored_arrays(flat: Any, bits: dict[str, str]) -> dict[str, np.ndarray]:
    """The arrays of an opened ``params.npz``, those the export stored as bits (the manifest's
    ``param_bits``, ``{name: dtype}``: bfloat16, which .npz cannot hold) viewed back as
    their dtype."""
    return {
        name: flat[name].view(jax.numpy.dtype(bits[name])) if name in bits else flat[name]
        for name in flat.files
    }


def unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """``{"a/b/c": x}`` -> ``{"a": {"b": {"c": x}}}`` (the inverse of the export's naming)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ServingModel:
    """A loaded artifact: the deserialized program, its parameters and vocabularies."""

    def __init__(self, root: str) -> None:
        manifest_path = os.path.join(root, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"no {MANIFEST} in {root}: is it a flaxformer_lite export?")
        with open(manifest_path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        problem = missing_requirements(self.manifest.get("requirements", ()))
        if problem:  # e.g. flatbuffers, which only the deserializer below imports
            raise ImportError(problem)
        with open(os.path.join(root, EXPORTED), "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        with np.load(os.path.join(root, PARAMS)) as flat:
            host = unflatten(stored_arrays(flat, self.manifest.get("param_bits", {})))
        self.params = jax.device_put(host)  # on the device once, not at every call
        self.source_vocab, self.target_vocab = load_vocabularies(root, self.manifest)
        ids = self.manifest["ids"]
        self.pad_id, self.eos_id = int(ids["pad"]), int(ids["eos"])
        self.decoder_start_id = int(ids["decoder_start"])
        self.max_len = int(self.manifest["max_len"])
        self.per_row_limit = bool(self.manifest.get("per_row_limit", True))
        self.max_source_len = int(self.manifest["max_source_len"])
        # What ends a source: EOS, or a Hugging Face family's suffix (mBART: EOS, language).
        hf = self.manifest.get("hf_tokenizer") or {}
        self.source_suffix = [int(i) for i in hf.get("source_suffix", [self.eos_id])]
        self._prefix_len = len(hf.get("source_prefix", ()))

    def __call__(
        self, source_ids: np.ndarray, row_max_len: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens int32 `[batch, max_len]` (EOS, then PAD) and scores `[batch]` for source ids
        int32 `[batch, src_len]` (EOS-terminated, padded with the manifest's pad id). Row
        ``b`` generates at most ``row_max_len[b]`` tokens (None: ``max_len``). Each new
        ``(batch, src_len)`` shape compiles once (XLA); nothing is traced again."""
        source_ids = np.asarray(source_ids, np.int32)
        if source_ids.ndim != 2 or not 1 <= source_ids.shape[1] <= self.max_source_len:
            raise ValueError(
                f"source_ids must be int32 [batch, src_len] with 1 <= src_len <= "
                f"{self.max_source_len}; got shape {source_ids.shape}"
            )
        if row_max_len is None:
            row_max_len = np.full((source_ids.shape[0],), self.max_len, np.int32)
        tokens, scores = self.exported.call(
            self.params, source_ids, np.asarray(row_max_len, np.int32)
        )
        return np.asarray(tokens), np.asarray(scores)

    def decode_len(self, source_len: int) -> int:
        """Tokens to generate for a source of ``source_len`` ids (EOS included): with the
        manifest's ``per_row_limit``, 1.5 times the source plus 10, at most ``max_len``
        (a workdir's ``Translator``: ``GenerationConfig(max_len="source")``'s rule, repeated
        here as this file imports nothing of flaxformer_lite); without, ``max_len`` (a
        Hugging Face folder's ``max_length``, as its ``generate``)."""
        if not self.per_row_limit:
            return self.max_len
        return max(1, min(self.max_len, int(source_len * 1.5) + 10))

    def encode(self, text: str) -> list[int] | None:
        """Source ids with EOS (``source_suffix``) appended (truncated to ``max_source_len``);
        None when empty. Runs of whitespace become one space first, as in training."""
        text = " ".join(str(text).split())
        ids = self.source_vocab.encode(text) if text else []
        if len(ids) <= self._prefix_len:
            return None
        suffix = self.source_suffix
        return [*ids[: self.max_source_len - len(suffix)], *suffix]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of generated ids: up to the first EOS, PAD and the decoder start dropped
        (as ``tokenizer.Tokenizer.decode``), runs of whitespace made one space."""
        tokens = [int(t) for t in tokens]
        if self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id)]
        dropped = (self.pad_id, self.decoder_start_id)
        return " ".join(self.target_vocab.decode([t for t in tokens if t not in dropped]).split())

    def translate(self, sentences: Sequence[str], *, batch_size: int | None = None) -> list[str]:
        """Translates ``sentences`` (the i-th output translates the i-th input; "" for empty).

        Sentences are sorted by length and decoded ``batch_size`` rows per call (None: the
        manifest's ``batch_size``; short calls are padded with copies of their first row) with
        sources padded to a multiple of ``BUCKET`` tokens, so calls share compiled programs.
        Each row stops after ``decode_len`` tokens (of its own length): a sentence's
        translation does not depend on its batch-mates.
        """
        rows = int(self.manifest["batch_size"] if batch_size is None else batch_size)
        if rows < 1:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        ids = [self.encode(text) for text in sentences]
        outputs = [""] * len(ids)
        order = sorted((i for i, x in enumerate(ids) if x is not None), key=lambda i: -len(ids[i]))
        for start in range(0, len(order), rows):
            chunk = order[start : start + rows]
            width = min(_round_up(max(len(ids[i]) for i in chunk), BUCKET), self.max_source_len)
            source = np.full((rows, width), self.pad_id, np.int32)
            limits = np.zeros((rows,), np.int32)
            for row, i in enumerate(chunk):
                source[row, : len(ids[i])] = ids[i]
                limits[row] = self.decode_len(len(ids[i]))
            source[len(chunk) :], limits[len(chunk) :] = source[0], limits[0]
            tokens, _ = self(source, limits)
            for row, i in enumerate(chunk):
                outputs[i] = self.detokenize(tokens[row])
        return outputs


def load(root: str) -> ServingModel:
    """The artifact in folder ``root`` (see the module docstring)."""
    return ServingModel(root)
