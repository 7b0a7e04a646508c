"""Where a pretrained model's files are: a local (or ``gs://``) folder as is, or a Hugging Face hub
id downloaded once into the hub cache. The one place that talks to the hub; the converters
(``interop.hf``) and the tokenizer of a fine-tuning run (``data.tasks.translation``) both call
it."""

from __future__ import annotations

import os

from etils import epath

from flaxformer_lite.core import paths

# What a download fetches: the config, the generation defaults, the weights and the tokenizer.
_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "*.spm",
    "*vocab.json",
    "tokenizer_config.json",
]


def resolve(path_or_repo_id: str) -> epath.Path:
    """The local (or ``gs://``) folder of ``path_or_repo_id``: an existing folder as is, else a
    Hugging Face hub id downloaded once into the hub cache (``huggingface_hub``).

    Raises:
      FileNotFoundError: neither an existing folder nor a downloadable repository.
    """
    path = os.fspath(path_or_repo_id)
    root = paths.resolve(path)
    if paths.is_uri(path) or root.is_dir():
        if not root.is_dir():
            raise FileNotFoundError(f"no folder {path}")
        return root
    looks_like_id = path.count("/") <= 1 and not path.startswith((".", "/", "~"))
    if not looks_like_id:
        raise FileNotFoundError(f"no folder {path} (and it is not a hub id like 'owner/name')")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id=path, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, unknown repository, gated, ...
        raise FileNotFoundError(
            f"{path!r} is not a local folder and could not be fetched from the Hugging Face "
            f"hub: {type(e).__name__}: {e}"
        ) from e
    return epath.Path(local)
