"""Load and run a prompt-continuation artifact written by ``flaxformer_lite.inference.export_lm``
(a decoder-only model such as Llama): ids in, ids out; text in, text out with its tokenizer.

This file is copied into every such artifact (``runtime.py``) and needs only jax, numpy and
flatbuffers (``jax.export``'s deserializer), plus ``tokenizers`` for text; never
``flaxformer_lite``:

    import sys; sys.path.insert(0, "ARTIFACT")
    import runtime
    model = runtime.load("ARTIFACT")
    model.continue_ids([[1, 450, 4996]])        # -> [[new ids, up to EOS]]
    model.complete(["The capital of France is"])  # with the artifact's tokenizer.json

An artifact folder holds ``manifest.json`` (``kind`` "lm", ids, ``max_len`` new tokens,
``max_prompt_len``, ``prepend_bos``, method), ``continue.jax`` (``jax.export`` of
``(params, prompt_ids int32 [batch, prompt_len], left_padding int32 [batch]) -> (tokens int32
[batch, max_len], scores float32 [batch])``, ``batch`` and ``prompt_len`` (>= 2) symbolic: prompts
left-padded, ``left_padding[b]`` pads before row b's first id), ``params.npz`` and, when the
model came with one, ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

try:
    import jax
    import numpy as np
except ImportError as e:  # one line saying what to install
    raise ImportError(f"this serving runtime needs jax and numpy: pip install jax ({e})") from e

BUCKET = 16  # prompt lengths are padded up to a multiple of this: fewer compiled shapes
MANIFEST = "manifest.json"
EXPORTED = "continue.jax"
PARAMS = "params.npz"
TOKENIZER = "tokenizer.json"
KIND = "lm"


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


class ServingLM:
    """A loaded prompt-continuation artifact: the deserialized program, its parameters, its
    tokenizer (None without ``tokenizer.json``)."""

    def __init__(self, root: str) -> None:
        path = os.path.join(root, MANIFEST)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {MANIFEST} in {root}: is it a flaxformer_lite export?")
        with open(path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        if self.manifest.get("kind") != KIND:
            raise ValueError(f"{root} is not a prompt-continuation artifact (kind {KIND!r})")
        with open(os.path.join(root, EXPORTED), "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        with np.load(os.path.join(root, PARAMS)) as flat:
            bits = self.manifest.get("param_bits", {})
            self.params = jax.device_put(unflatten(stored_arrays(flat, bits)))
        ids = self.manifest["ids"]
        self.pad_id, self.eos_id = int(ids["pad"]), int(ids["eos"])
        self.max_len = int(self.manifest["max_len"])
        self.max_prompt_len = int(self.manifest["max_prompt_len"])
        self.tokenizer = None
        if os.path.isfile(os.path.join(root, TOKENIZER)):
            try:
                import tokenizers
            except ImportError:
                tokenizers = None  # ids still work; complete() says what to install
            if tokenizers is not None:
                self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(root, TOKENIZER))

    def __call__(
        self, prompt_ids: np.ndarray, left_padding: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens int32 `[batch, max_len]` (EOS, then PAD) and scores `[batch]` of left-padded
        prompts int32 `[batch, prompt_len]` with ``left_padding`` int32 `[batch]` pads each."""
        prompt_ids = np.asarray(prompt_ids, np.int32)
        if prompt_ids.ndim != 2 or not 2 <= prompt_ids.shape[1] <= self.max_prompt_len:
            raise ValueError(
                f"prompt_ids must be int32 [batch, prompt_len] with 2 <= prompt_len <= "
                f"{self.max_prompt_len}; got shape {prompt_ids.shape}"
            )
        tokens, scores = self.exported.call(
            self.params, prompt_ids, np.asarray(left_padding, np.int32)
        )
        return np.asarray(tokens), np.asarray(scores)

    def continue_ids(
        self, prompts: Sequence[Sequence[int]], *, batch_size: int | None = None
    ) -> list[list[int]]:
        """The new ids of each prompt (its ids as the model reads them, e.g. BOS first from a
        Hugging Face tokenizer), up to EOS (left out). Prompts are decoded ``batch_size``
        rows per call (None: the manifest's), left-padded to a multiple of ``BUCKET``; each
        row continues as it would alone.

        Raises:
          ValueError: an empty prompt, or one longer than ``max_prompt_len``.
        """
        rows = int(self.manifest["batch_size"] if batch_size is None else batch_size)
        prompts = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.max_prompt_len:
                raise ValueError(f"prompt {i} has {len(p)} ids; give 1 to {self.max_prompt_len}")
        outputs: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(prompts), rows):
            chunk = list(range(start, min(start + rows, len(prompts))))
            longest = max(len(prompts[i]) for i in chunk)
            width = min(-(-longest // BUCKET) * BUCKET, self.max_prompt_len)
            width = max(width, 2)  # the program takes 2 columns at least
            ids = np.full((rows, width), self.pad_id, np.int32)
            pads = np.zeros((rows,), np.int32)
            for row, i in enumerate(chunk):
                pads[row] = width - len(prompts[i])
                ids[row, pads[row] :] = prompts[i]
            ids[len(chunk) :], pads[len(chunk) :] = ids[0], pads[0]
            tokens, _ = self(ids, pads)
            for row, i in enumerate(chunk):
                new = [int(t) for t in tokens[row]]
                outputs[i] = new[: new.index(self.eos_id)] if self.eos_id in new else new
        return outputs

    def complete(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[str]:
        """The continuation text of each prompt text, through the artifact's tokenizer (its
        encoding adds BOS as the model's does; the decoding skips special tokens)."""
        if self.tokenizer is None:
            raise ValueError(
                "complete() needs the artifact's tokenizer.json and the tokenizers package "
                "(pip install tokenizers); continue_ids() takes ids"
            )
        prompts = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        new = self.continue_ids(prompts, batch_size=batch_size)
        return self.tokenizer.decode_batch(new, skip_special_tokens=True)


def load(root: str) -> ServingLM:
    """The artifact in folder ``root`` (see the module docstring)."""
    return ServingLM(root)
