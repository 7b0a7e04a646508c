"""Starting a run from pretrained weights: a Hugging Face Marian model or another train.py run.

``train.py`` with ``--config.init_from=DIR_OR_ID`` builds its model from the pretrained model's
``TransformerConfig`` (``pretrained_config``), initialises its parameters as usual, then
overwrites them with the pretrained ones (``restore_into``) when the workdir has no checkpoint
of its own; from its first checkpoint on, the run resumes from itself and ``init_from`` is not
read again.

The restore is partial where it has to be: a parameter whose path and shape match is copied;
one whose shape differs only in its first axis (a vocabulary that grew or shrank: embedding
rows, logits bias) gets the overlapping rows copied and keeps its fresh initialisation for the
rest; one the pretrained model lacks (a new head) keeps its initialisation; a pretrained one
the model lacks is dropped. Every case is counted in the message ``restore_into`` returns.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from flaxformer_lite import paths
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.optim import param_path


def is_workdir(source: str) -> bool:
    """Whether ``source`` is a train.py workdir (it has ``model_config.json``)."""
    root = paths.resolve(source)
    return (root / "model_config.json").is_file()


def pretrained_config(source: str) -> TransformerConfig:
    """The ``TransformerConfig`` of a train.py workdir or a Hugging Face Marian folder / hub
    id, without reading its weights."""
    if is_workdir(source):
        root = paths.resolve(source)
        return TransformerConfig.from_json((root / "model_config.json").read_text())
    from flaxformer_lite import hf

    root = hf.resolve(source)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"config.init_from={source!r}: neither a train.py workdir (model_config.json) nor "
            "a Hugging Face model folder (config.json)"
        )
    return hf.config_from_hf(json.loads(config_path.read_text()))


def generation_config(source: str) -> dict[str, Any] | None:
    """The generation config of ``source`` (``hf.generation_config`` of a Hugging Face folder,
    or a workdir's own ``generation_config.json``), None when it has none. train.py copies it
    into a fine-tuned run's workdir, so that the run's export decodes as ``source`` did."""
    if is_workdir(source):
        path = paths.resolve(source) / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    from flaxformer_lite import hf

    return hf.generation_config(source) or None


def pretrained_params(source: str) -> dict[str, Any]:
    """The parameters (plain nested dicts, unrolled layers) of ``source``: a workdir's latest
    checkpoint, or a Hugging Face Marian model."""
    if is_workdir(source):
        from flaxformer_lite.checkpoints import choose_steps
        from flaxformer_lite.inference import Translator, average_params
        from flaxformer_lite.models import unrolled

        config = pretrained_config(source)
        checkpoints = str(paths.resolve(source) / "checkpoints")
        params = average_params(
            checkpoints, choose_steps(checkpoints), Translator.abstract_params(config)
        )
        return unrolled(params, config)[0]
    from flaxformer_lite import hf

    return hf.load_pretrained(source)[1]


def model_fields(source: str, overrides: dict[str, Any], data_fields: dict[str, Any]):
    """The fine-tuned model's ``TransformerConfig``: the pretrained one, with the vocabulary
    sizes and special ids the data decided (``data_fields``) and the run's ``config.model``
    ``overrides`` (dropout, dtype, remat ...).

    Raises:
      ValueError: an override changes the architecture (a field that decides parameter
        shapes), naming it.
    """
    base = pretrained_config(source)
    shape_fields = (
        "d_model num_heads num_kv_heads d_ff num_encoder_layers num_decoder_layers activation"
        " norm_position norm_type position sinusoid_layout share_embeddings"
        " tie_output_embedding logits_bias use_bias fused_qkv max_len"
    ).split()
    changed = [k for k in shape_fields if k in overrides and overrides[k] != getattr(base, k, None)]
    if changed:
        raise ValueError(
            f"config.model sets {changed} differently from the pretrained model "
            f"{source!r} ({', '.join(f'{k}={getattr(base, k)!r}' for k in changed)}); "
            "fine-tuning keeps its architecture: drop them from config.model"
        )
    fields = base.to_dict()
    fields.update({k: v for k, v in overrides.items() if k not in shape_fields})
    fields.update(data_fields)
    # Separate vocabularies that happen to be the same size keep the pretrained choice.
    if base.share_embeddings and fields.get("target_vocab_size") in (None, fields["vocab_size"]):
        fields["target_vocab_size"] = None
        fields["share_embeddings"] = True
    return TransformerConfig(**fields)


def restore_into(params: Any, pretrained: dict[str, Any]) -> tuple[Any, str]:
    """``params`` (initialised; boxed or plain) with the pretrained values copied in, and a
    one-line summary of what was restored, partially restored, new or dropped."""
    flat = {
        param_path(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(pretrained)
    }
    seen: set[str] = set()
    counts = {"restored": 0, "partially restored": 0, "newly initialised": 0}
    partial, new = [], []

    def take(path, leaf):
        name = param_path(path)
        source = flat.get(name)
        if source is None:
            counts["newly initialised"] += 1
            new.append(name)
            return leaf
        seen.add(name)
        if source.shape == leaf.shape:
            counts["restored"] += 1
            return jax.numpy.asarray(source, leaf.dtype)
        if source.ndim == leaf.ndim and source.shape[1:] == leaf.shape[1:]:
            rows = min(source.shape[0], leaf.shape[0])
            counts["partially restored"] += 1
            partial.append(f"{name} ({rows} of {leaf.shape[0]} rows)")
            return leaf.at[:rows].set(jax.numpy.asarray(source[:rows], leaf.dtype))
        raise ValueError(
            f"pretrained {name} has shape {source.shape}, the model's is {leaf.shape}: only a "
            "first (vocabulary) axis may differ"
        )

    out = jax.tree_util.tree_map_with_path(take, params)
    dropped = sorted(set(flat) - seen)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) + f", {len(dropped)} dropped"
    details = [f"partial: {partial}" if partial else "", f"new: {new[:8]}" if new else ""]
    details.append(f"dropped: {dropped[:8]}" if dropped else "")
    return out, "; ".join([summary, *[d for d in details if d]])
