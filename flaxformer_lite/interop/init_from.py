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

The layer layout may differ: either side may be unrolled (``layers_0`` ... ``layers_{N-1}``) or
``scan_layers`` (one ``layers`` subtree stacked on a leading axis `[N, ...]`); ``restore_into``
unstacks the pretrained tree and stacks layer i into row i where the model scans.

Fine-tuning keeps the pretrained architecture. Every ``TransformerConfig`` field is in exactly
one of three groups: :data:`ARCHITECTURE_FIELDS` (they decide the parameter tree or the function
the same parameters compute: ``config.model`` may repeat the pretrained value, never change it;
``check_overrides`` refuses it, through preflight before any work), :data:`TRAINING_FIELDS` (how
the same function is trained, stored or executed: ``config.model`` may change them) and
:data:`DATA_FIELDS` (the fine-tuning data's vocabulary decides them).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from flaxformer_lite.core import paths
from flaxformer_lite.models import param_path
from flaxformer_lite.nn.config import TransformerConfig

# Fields that decide the parameter tree (structure, shapes) or the function the same parameters
# compute. Fine-tuning keeps the pretrained values.
ARCHITECTURE_FIELDS = (
    "d_model num_heads num_kv_heads d_ff num_encoder_layers num_decoder_layers max_len activation"
    " norm_position norm_type layer_norm_epsilon position sinusoid_layout scale_embeddings"
    " share_embeddings tie_output_embedding logits_bias use_bias fused_qkv num_classes pooling"
    " num_experts num_experts_per_token moe_every attention_window attention_window_layers"
    " relative_num_buckets relative_max_distance head_dim quantization"
    # Llama family (interop/llama.py).
    " rope_theta rope_scaling_factor rope_low_freq_factor rope_high_freq_factor"
    " rope_original_max_len qkv_bias"
    " learned_position_offset embedding_norm"  # BART / mBART
    # T5 (interop/t5.py).
    " scale_attention_logits scale_decoder_output"
).split()
# Fields of training, storage or execution: the same parameters compute the same function
# (up to the precision of dtype / param_dtype) whatever their values, and evaluation and
# decoding ignore the training-only ones (dropout, expert capacity, auxiliary loss weights).
TRAINING_FIELDS = (
    "dropout_rate attention_dropout_rate dtype param_dtype attention_implementation remat"
    " scan_layers expert_capacity_factor moe_aux_loss_weight router_z_loss_weight"
    " activation_dropout_rate"  # BART / mBART
    " word_dropout_rate int8_kernel"
).split()
# Fields the fine-tuning data's vocabulary decides (train.model_config): its sizes (a grown or
# shrunk vocabulary is partially restored) and its special ids.
DATA_FIELDS = ("vocab_size", "target_vocab_size", "pad_id", "bos_id", "eos_id", "unk_id")


def is_workdir(source: str) -> bool:
    """Whether ``source`` is a train.py workdir (it has ``model_config.json``)."""
    root = paths.resolve(source)
    return (root / "model_config.json").is_file()


def pretrained_config(source: str) -> TransformerConfig:
    """The ``TransformerConfig`` of a train.py workdir or a Hugging Face folder / hub id of a
    supported family (Marian, Llama, T5; ``hf.load_config``: config.json, and the weights
    only where the family leaves a choice to them, e.g. T5's untied ``lm_head``)."""
    if is_workdir(source):
        root = paths.resolve(source)
        return TransformerConfig.from_json((root / "model_config.json").read_text())
    from flaxformer_lite.interop import hf

    root = hf.resolve(source)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"config.init_from={source!r}: neither a train.py workdir (model_config.json) nor "
            "a Hugging Face model folder (config.json)"
        )
    return hf.load_config(source)


def generation_config(source: str) -> dict[str, Any] | None:
    """The generation config of ``source`` (``hf.generation_config`` of a Hugging Face folder,
    or a workdir's own ``generation_config.json``), None when it has none. train.py copies it
    into a fine-tuned run's workdir, so that the run's export decodes as ``source`` did."""
    if is_workdir(source):
        path = paths.resolve(source) / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    from flaxformer_lite.interop import hf

    return hf.generation_config(source) or None


def pretrained_params(source: str) -> dict[str, Any]:
    """The parameters (plain nested dicts, unrolled layers) of ``source``: a workdir's latest
    checkpoint, or a Hugging Face model of a supported family."""
    if is_workdir(source):
        from flaxformer_lite.core.checkpoints import average_params, choose_steps
        from flaxformer_lite.models import abstract_params, unrolled

        config = pretrained_config(source)
        checkpoints = str(paths.resolve(source) / "checkpoints")
        params = average_params(checkpoints, choose_steps(checkpoints), abstract_params(config))
        return unrolled(params, config)[0]
    from flaxformer_lite.interop import hf

    return hf.load_pretrained(source)[1]


def pretrained_model(source: str) -> str:
    """The model class a pretrained ``source`` trained: ``"DecoderOnly"`` for a language-model
    workdir or a Hugging Face decoder-only family (Llama), ``"EncoderClassifier"`` for a
    classification workdir, else ``"EncoderDecoder"`` (translation and synthetic workdirs,
    Hugging Face Marian)."""
    if is_workdir(source):
        run = paths.resolve(source) / "config.json"
        task = json.loads(run.read_text()).get("task") if run.is_file() else None
        return {"lm": "DecoderOnly", "classification": "EncoderClassifier"}.get(
            task, "EncoderDecoder"
        )
    from flaxformer_lite.interop import hf

    root = hf.resolve(source)
    family = hf.family_of(json.loads((root / "config.json").read_text()))
    return "DecoderOnly" if family.DECODER_ONLY else "EncoderDecoder"


def same_architecture(a: TransformerConfig, b: TransformerConfig) -> bool:
    """Whether ``a`` and ``b`` agree in every field of :data:`ARCHITECTURE_FIELDS`."""
    return all(getattr(a, k) == getattr(b, k) for k in ARCHITECTURE_FIELDS)


def check_overrides(
    source: str, overrides: dict[str, Any], base: TransformerConfig | None = None
) -> TransformerConfig:
    """The pretrained config of ``source`` (``base`` if given) after checking that the run's
    ``config.model`` ``overrides`` keep its architecture.

    Raises:
      ValueError: an override of an :data:`ARCHITECTURE_FIELDS` field differs from the
        pretrained value, naming the field, both values and the fields that may change.
    """
    base = pretrained_config(source) if base is None else base
    changed = [
        k for k in ARCHITECTURE_FIELDS if k in overrides and overrides[k] != getattr(base, k)
    ]
    if changed:
        listed = ", ".join(
            f"config.model.{k}={overrides[k]!r} (pretrained {k}={getattr(base, k)!r})"
            for k in changed
        )
        raise ValueError(
            f"{listed}: fine-tuning from config.init_from={source!r} keeps the pretrained "
            f"architecture; drop {', '.join(changed)} from config.model (it may change only "
            f"{', '.join(TRAINING_FIELDS)})"
        )
    return base


def model_fields(source: str, overrides: dict[str, Any], data_fields: dict[str, Any]):
    """The fine-tuned model's ``TransformerConfig``: the pretrained one, with the vocabulary
    sizes and special ids the data decided (``data_fields``) and the run's ``config.model``
    ``overrides`` (dropout, dtype, remat, scan_layers ...).

    Raises:
      ValueError: an override changes the architecture (``check_overrides``), naming it.
    """
    base = check_overrides(source, overrides)
    fields = base.to_dict()
    fields.update({k: v for k, v in overrides.items() if k not in ARCHITECTURE_FIELDS})
    fields.update(data_fields)
    # Separate vocabularies that happen to be the same size keep the pretrained choice.
    if base.share_embeddings and fields.get("target_vocab_size") in (None, fields["vocab_size"]):
        fields["target_vocab_size"] = None
        fields["share_embeddings"] = True
    return TransformerConfig(**fields)


def _layer_names(name: str, num_layers: int) -> list[str] | None:
    """The unrolled names of the rows of a scanned parameter ``.../layers/...`` (``layers_i``
    for i < ``num_layers``); None for a parameter outside a scanned stack."""
    parts = name.split("/")
    if "layers" not in parts:
        return None
    k = parts.index("layers")
    return ["/".join([*parts[:k], f"layers_{i}", *parts[k + 1 :]]) for i in range(num_layers)]


def restore_into(
    params: Any, pretrained: dict[str, Any], *, same_architecture: bool = False
) -> tuple[Any, str]:
    """``params`` (initialised; boxed or plain) with the pretrained values copied in, and a
    one-line summary of what was restored, partially restored, new or dropped.

    Either tree may have unrolled layers (``layers_i``) or scanned ones (``layers``, stacked
    `[num_layers, ...]`): the pretrained tree is unstacked, and a scanned parameter of
    ``params`` gets row i from the pretrained ``layers_i`` (all of its layers, or an error).
    ``same_architecture``: the pretrained model is the same model class with the same
    :data:`ARCHITECTURE_FIELDS`, so every parameter should be restored; then a newly
    initialised one starts the summary with ``WARNING:`` and is listed in full.

    Raises:
      ValueError: a pretrained parameter's shape differs in more than the first
        (vocabulary) axis, or a pretrained stack has some but not all of a scanned stack's
        layers.
    """
    from flaxformer_lite.models import unstack_layers

    flat = {
        param_path(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(unstack_layers(pretrained))
    }
    seen: set[str] = set()
    counts = {"restored": 0, "partially restored": 0, "newly initialised": 0}
    partial, new = [], []

    def source_of(name: str, leaf: Any) -> np.ndarray | None:
        rows = _layer_names(name, leaf.shape[0]) if leaf.ndim else None
        if rows is None or name in flat:
            if name in flat:
                seen.add(name)
            return flat.get(name)
        present = [r for r in rows if r in flat]
        if not present:
            return None
        if len(present) < len(rows):
            raise ValueError(
                f"the model's scanned {name} has {len(rows)} layers; the pretrained model has "
                f"{len(present)} of them ({present[:3]}...): a layer count must match"
            )
        seen.update(rows)
        return np.stack([flat[r] for r in rows])

    def take(path, leaf):
        name = param_path(path)
        source = source_of(name, leaf)
        if source is None:
            counts["newly initialised"] += 1
            new.append(name)
            return leaf
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
    warn = same_architecture and bool(new)
    details = [f"partial: {partial}" if partial else ""]
    details.append(f"new: {new if warn else new[:8]}" if new else "")
    details.append(f"dropped: {dropped[:8]}" if dropped else "")
    line = "; ".join([summary, *[d for d in details if d]])
    if warn:
        line = (
            f"WARNING: {len(new)} parameters newly initialised (random) although the pretrained "
            f"model has the same architecture, so every one should have been restored; {line}"
        )
    return out, line
