"""What a run keeps of its data in the workdir: written once by JAX process 0, read by all.

The SentencePiece vocabularies (``spm_*.model``) and the token cache of the training split
(``data_cache/{split}-{hash}/``). :func:`main_process_first` orders the work: process 0 trains
or tokenizes while the others wait at a barrier, then they read the finished files. A resumed
run, and the inference tools, reuse the files instead of reading the corpus again.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.data.encoding import EncodedPairs
from flaxformer_lite.data.tokenizer import Tokenizer, load_or_train

CACHE_DIR = "data_cache"
VOCABULARY_FILES = ("spm_shared.model", "spm_tgt.model", "spm_lm.model", "spm_cls.model")


def main_process_first(fn: Callable[[bool], Any], name: str) -> Any:
    """``fn(True)`` on JAX process 0, then, after a barrier, ``fn(False)`` on the others.

    For work whose first call writes a shared file and whose later calls only read it (train
    or load the vocabulary, build or load the token cache): one writer, no race, and the
    readers open the finished file. The barrier is ``multihost_utils.sync_global_devices``.
    With one process it is just ``fn(True)``.
    """
    import jax

    if jax.process_count() == 1:
        return fn(True)
    from jax.experimental import multihost_utils

    result = fn(True) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(f"flaxformer_lite:{name}")
    return fn(False) if jax.process_index() != 0 else result


def vocabulary(path: str, texts_fn: Callable[[], Iterable[str]], config: Any) -> Tokenizer:
    """The SentencePiece model at ``path``: trained by process 0 on ``texts_fn()`` if missing
    (``config.vocab_size``, ``config.spm_model_type``, ``config.seed``), then loaded by the
    others (no two hosts write the same file)."""

    def get(writer: bool) -> Tokenizer:
        if not writer:
            return Tokenizer.load(path)
        return load_or_train(
            path, texts_fn, config.vocab_size, model_type=config.spm_model_type, seed=config.seed
        )

    return main_process_first(get, "vocabulary")


def load_tokenizer(workdir: str) -> Tokenizer | None:
    """The target-side SentencePiece model saved in a workdir, if any."""
    for name in VOCABULARY_FILES:
        path = os.path.join(workdir, name)
        if epath.Path(path).is_file():
            return Tokenizer.load(path)
    return None


def save_token_cache(directory: Any, encoded: EncodedPairs, meta: dict[str, Any]) -> None:
    """Writes ``encoded`` as four ``.npy`` files and ``meta.json`` into ``directory``.

    Every local file goes to a temporary name first and is renamed into place (an object
    store writes objects whole); ``meta.json`` comes last and marks the cache complete, so a
    reader (another host, a resumed run) never sees half a cache, and a crash mid-write
    leaves it to be rebuilt. ``directory`` is a
    local path or any URI ``etils.epath`` reaches (``gs://...``).
    """
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Locally: a temporary name, then an atomic rename. In an object store (gs://) an object
    # only appears once its upload completes, and a rename is a copy: write in place.
    suffix = f".tmp.{os.getpid()}" if not paths.is_uri(str(directory)) else ""

    def publish(name: str, write: Callable[[Any], None]) -> None:
        path = directory / f"{name}{suffix}"
        with path.open("wb") as f:
            write(f)
        if suffix:
            path.rename(directory / name)

    for name in EncodedPairs.ARRAYS:
        publish(f"{name}.npy", lambda f, name=name: np.save(f, getattr(encoded, name)))
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    publish("meta.json", lambda f: f.write(text))


def load_token_cache(directory: Any, key: dict[str, Any]) -> tuple[EncodedPairs, dict] | None:
    """The cache in ``directory`` if complete and built for ``key`` (else None).

    Local files are memory-mapped (pages are read when a batch touches them); a remote file
    (``gs://``) is copied once to a local temporary file, memory-mapped, and the copy
    unlinked (the mapping keeps it alive until the process ends).
    """
    directory = epath.Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("key") != key:
        return None
    arrays = []
    for name in EncodedPairs.ARRAYS:
        path = directory / f"{name}.npy"
        if not paths.is_uri(str(path)):
            arrays.append(np.load(os.fspath(path), mmap_mode="r"))
            continue
        fd, local = tempfile.mkstemp(suffix=".npy")
        os.close(fd)
        try:
            path.copy(epath.Path(local), overwrite=True)
            arrays.append(np.load(local, mmap_mode="r"))
        finally:
            os.unlink(local)
    return EncodedPairs(*arrays), meta
