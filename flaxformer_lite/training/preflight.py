"""Checks a training run's config and workdir before any data is read or anything compiled.

``check_run(config, workdir)`` is the first thing ``train.train_and_evaluate`` does. It reads
(never writes) the workdir and raises :class:`ConfigError` with one line naming the config
field or argument and what would be valid:

  * a key no part of the run reads (a typo), with difflib's "did you mean ...?";
  * a value out of range (``label_smoothing`` outside [0, 1), ``log_every`` 0,
    ``grad_accum_steps`` not dividing the batch, a ``mesh_shape`` that does not fit the devices,
    an invalid ``model`` field, ...);
  * a ``--workdir`` that is an existing file;
  * a fine-tune (``init_from``) whose ``model`` changes a field of the pretrained architecture;
  * a resume whose config differs from the one the workdir's checkpoints were trained with
    (``config.json`` and ``model_config.json``), except in :data:`SAFE_CHANGES` or the fields
    listed in ``config.allow_changes``; and a ``num_train_steps`` below the latest saved step.

``parse_flags`` is train.py's absl flag parser: a misspelt ``--config.KEY`` override becomes the
same one line instead of ml_collections' traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from flaxformer_lite.core import paths
from flaxformer_lite.nn.config import DROPOUT_RATES, TransformerConfig
from flaxformer_lite.training import optim, time_budget


class ConfigError(ValueError):
    """A config value, config key or workdir that train.py refuses before doing any work; the
    message is one line naming the field and what would be valid."""


# ----------------------------------------------------------------------------- known keys

# Every key of configs/common.py's base_config(): each task reads all of them.
COMMON_KEYS = (
    "task seed optimizer schedule learning_rate warmup_steps b1 b2 eps weight_decay"
    " grad_clip_norm grad_accum_steps label_smoothing rdrop_alpha skip_nonfinite_steps"
    " num_train_steps"
    " log_every eval_every checkpoint_every keep_checkpoints decode_eval mesh_shape model"
    " allow_changes restore_step"
).split()

# Keys any run may add: start from pretrained weights (train.py workdir, Hugging Face Marian
# folder or hub id; flaxformer_lite/interop/init_from.py), parameter-name patterns to freeze,
# a wall-clock budget (training/time_budget.py), how many last checkpoints the inference
# CLIs and Translator.from_workdir average by default, and how many XLA devices to split the
# host's CPU into (core/sharding.py: use_cpu_devices), and one device's peak FLOP/s for MFU
# (training/flops.py: run_peak_flops).
OPTIONAL_KEYS = (
    "init_from",
    "freeze",
    "time_budget_minutes",
    "average_checkpoints",
    "cpu_devices",
    "peak_flops",
)

# The further keys each task reads (flaxformer_lite/data/tasks/, build_translation_data) or
# that the inference CLIs read from the run's config.json (beam_size, alpha).
TASK_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": ("synthetic", "batch_size"),
    "translation": tuple(
        (
            "dataset dataset_config data_dir data_format streaming source_lang target_lang"
            " source_column target_column train_split eval_split test_split local_splits"
            " vocab_size shared_vocab spm_model_type max_len too_long packing tokens_per_batch"
            " batch_size_multiple beam_size alpha tokenizer tokenizer_src_lang tokenizer_tgt_lang"
            " beam_style early_stopping forced_eos ban_pad subword_alpha subword_samples"
            " bidirectional_epochs"
        ).split()
    ),
    "lm": tuple(
        (
            "dataset train_split data_file eval_fraction eval_batches vocab_size"
            " spm_model_type max_len batch_size"
        ).split()
    ),
    "classification": tuple(
        (
            "dataset dataset_config data_dir train_split eval_split local_splits text_column"
            " label_column vocab_size spm_model_type max_len batch_size"
        ).split()
    ),
}

# Keys a task reads unconditionally (the rest are optional or have a fallback).
REQUIRED_TASK_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": ("synthetic", "batch_size"),
    "translation": tuple(
        (
            "dataset dataset_config data_dir data_format source_lang target_lang train_split"
            " eval_split vocab_size shared_vocab spm_model_type max_len too_long packing"
            " tokens_per_batch batch_size_multiple"
        ).split()
    ),
    "lm": (
        "train_split",
        "eval_fraction",
        "eval_batches",
        "vocab_size",
        "spm_model_type",
        "max_len",
        "batch_size",
    ),  # fmt: skip
    "classification": (
        "train_split",
        "eval_split",
        "text_column",
        "label_column",
        "vocab_size",
        "spm_model_type",
        "max_len",
        "batch_size",
    ),  # fmt: skip
}

SYNTHETIC_KEYS = ("name", "min_len", "max_len", "num_symbols", "num_eval")
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(TransformerConfig))
# Model fields the data decides (train.model_config overwrites them).
DATA_MODEL_KEYS = ("vocab_size", "target_vocab_size")
FREE_FORM_KEYS = ("local_splits",)  # a mapping whose keys are the user's split names

# ----------------------------------------------------------------------------- resume rules

# Fields a resumed run may always change: the loop's cadence, what it logs, how the same
# global batch is spread over devices (mesh, micro-batches) and inference defaults. None
# changes the parameters, the optimizer state or the data stream a checkpoint holds.
SAFE_CHANGES = (
    "num_train_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "decode_eval",
    "skip_nonfinite_steps",
    "allow_changes",
    "restore_step",
    "mesh_shape",
    "grad_accum_steps",
    "beam_size",
    "alpha",
    "average_checkpoints",
    "cpu_devices",
    "peak_flops",
)

# Fields whose change alters the shapes of the checkpoint's parameters or optimizer state, so
# that restoring fails: ``allow_changes`` cannot allow them (train in a new workdir instead).
# tests/interop/test_init_from.py checks that every model field which changes the parameter tree
# (paths, shapes or dtypes) is listed.
SHAPE_FIELDS = (
    "task",
    "optimizer",
    "model.vocab_size",
    "model.target_vocab_size",
    "model.d_model",
    "model.num_heads",
    "model.num_kv_heads",
    "model.d_ff",
    "model.num_encoder_layers",
    "model.num_decoder_layers",
    "model.activation",
    "model.norm_position",
    "model.norm_type",
    "model.position",
    "model.share_embeddings",
    "model.tie_output_embedding",
    "model.use_bias",
    "model.param_dtype",
    "model.scan_layers",
    "model.fused_qkv",
    "model.num_classes",
    "model.head_dim",
    "model.max_len",
    "model.logits_bias",
    "model.pooling",
    "model.num_experts",
    "model.moe_every",
    "model.relative_num_buckets",
    "model.quantization",
    "model.learned_position_offset",  # BART / mBART: the learned table's rows
    "model.embedding_norm",
)


# ----------------------------------------------------------------------------- entry points


def check_run(config: Any, workdir: str, *, device_count: int | None = None) -> None:
    """Raises ConfigError if ``config`` or ``workdir`` would fail the run; reads, never writes.

    ``device_count`` defaults to ``jax.device_count()`` (the mesh must use every device).
    """
    check_workdir_is_folder(workdir)
    check_config(config, device_count=device_count)
    check_init_from_overrides(config)
    check_resume(config, workdir)


def check_workdir_is_folder(workdir: str) -> None:
    if not isinstance(workdir, str | os.PathLike) or not os.fspath(workdir):
        raise ConfigError(f"--workdir must be a folder path or gs:// URI; got {workdir!r}")
    root = paths.resolve(workdir)
    if root.exists() and not root.is_dir():
        raise ConfigError(
            f"--workdir {root} is an existing file; give a new folder or a train.py run's folder"
        )


def check_config(config: Any, *, device_count: int | None = None) -> None:
    """The config's keys and values, without the workdir (see the module docstring)."""
    task = config.get("task")
    valid_tasks = tuple(TASK_KEYS)
    if task not in valid_tasks:
        raise ConfigError(f"config.task must be one of {valid_tasks}; got {task!r}")
    check_keys(config)
    check_values(config, device_count=device_count)


def check_keys(config: Any) -> None:
    """Rejects keys no part of a ``config.task`` run reads, and missing required keys."""
    task = config.task
    known = (*COMMON_KEYS, *TASK_KEYS[task], *OPTIONAL_KEYS)
    _reject_unknown("config", config.keys(), known, f"a config key of task {task!r}")
    for key in (*COMMON_KEYS, *REQUIRED_TASK_KEYS[task]):
        if key not in config:
            raise ConfigError(f"config.{key} is missing; task {task!r} needs it")
    model = config.model
    if not isinstance(model, Mapping) and not hasattr(model, "keys"):
        raise ConfigError(f"config.model must be a dict of TransformerConfig fields; got {model!r}")
    _reject_unknown("config.model", model.keys(), MODEL_KEYS, "a TransformerConfig field")
    for key in DATA_MODEL_KEYS:
        if key in model:
            raise ConfigError(
                f"config.model.{key} is set by the data (the tokenizer's size); remove it "
                f"(config.vocab_size sets the size of a trained vocabulary)"
            )
    if task == "synthetic":
        what = "a synthetic task setting"
        _reject_unknown("config.synthetic", config.synthetic.keys(), SYNTHETIC_KEYS, what)
        for key in SYNTHETIC_KEYS:
            if key not in config.synthetic:
                raise ConfigError(f"config.synthetic.{key} is missing")


def _reject_unknown(prefix: str, keys: Any, known: Sequence[str], what: str) -> None:
    for key in sorted(keys):
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(sorted(known))}"
        raise ConfigError(f"{prefix}.{key} is not {what}; {hint}")


# ----------------------------------------------------------------------------- values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(config: Any, key: str, low: int, meaning: str = "") -> int:
    value = config.get(key)
    if not _is_int(value) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"config.{key} must be {what}{meaning}; got {value!r}")
    return value


def _number_in(
    config: Any, key: str, low: float, high: float | None, interval: str, *, open_low: bool = False
) -> None:
    """config[key] is a finite number >= low (> low if ``open_low``) and < high (if given)."""
    value = config.get(key)
    ok = _is_number(value) and (value > low if open_low else value >= low)
    if not ok or (high is not None and value >= high):
        raise ConfigError(f"config.{key} must be a number in {interval}; got {value!r}")


def _bool(config: Any, key: str) -> None:
    if not isinstance(config.get(key), bool):
        raise ConfigError(f"config.{key} must be True or False; got {config.get(key)!r}")


def _check_init_from(config: Any) -> None:
    """``init_from``: a folder that exists, a ``gs://`` URI or a hub id ("owner/name");
    ``freeze``: a sequence of valid regular expressions."""
    source = config.get("init_from")
    if "tokenizer" in config and not config.get("tokenizer"):
        raise ConfigError(
            "config.tokenizer is not set (configs/finetune_marian.py takes it from "
            "config.init_from): give --config.init_from=DIR_OR_HUB_ID, the pretrained model"
        )
    if source:
        local = not paths.is_uri(source) and (
            source.startswith((".", "/", "~")) or source.count("/") > 1
        )
        if local and not paths.resolve(source).is_dir():
            raise ConfigError(
                f"config.init_from={source!r} is not a folder; give a train.py workdir, a "
                "Hugging Face model folder, or a hub id such as 'Helsinki-NLP/opus-mt-en-de'"
            )
    freeze = config.get("freeze") or ()
    if isinstance(freeze, str):
        raise ConfigError(
            f"config.freeze must be a tuple of regular expressions; got the string {freeze!r} "
            f"(write ({freeze!r},))"
        )
    import re

    for pattern in freeze:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ConfigError(f"config.freeze pattern {pattern!r} is not a regex: {e}") from e


def check_init_from_overrides(config: Any) -> None:
    """With ``config.init_from``: its config is readable and ``config.model`` changes no field
    of its architecture (``init_from.check_overrides``; a Hugging Face hub id is resolved,
    which the run needs anyway)."""
    source = config.get("init_from")
    if not source:
        return
    from flaxformer_lite.interop import init_from

    try:
        init_from.check_overrides(source, dict(config.model))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None


def check_values(config: Any, *, device_count: int | None = None) -> None:
    """Every value the loop, optimizer, mesh and model read, each against its valid range."""
    task = config.task
    _check_init_from(config)
    _int_at_least(config, "seed", 0)
    if config.optimizer not in optim.OPTIMIZERS:
        raise ConfigError(
            f"config.optimizer must be one of {optim.OPTIMIZERS}; got {config.optimizer!r}"
        )
    if config.schedule not in optim.SCHEDULES:
        raise ConfigError(
            f"config.schedule must be one of {optim.SCHEDULES}; got {config.schedule!r}"
        )
    _number_in(config, "learning_rate", 0.0, None, "(0, inf)", open_low=True)
    noam = config.schedule == "noam"
    _int_at_least(config, "warmup_steps", 1 if noam else 0, " (noam divides by it)" if noam else "")
    _number_in(config, "b1", 0.0, 1.0, "[0, 1)")
    _number_in(config, "b2", 0.0, 1.0, "[0, 1)")
    _number_in(config, "eps", 0.0, None, "[0, inf)")
    _number_in(config, "weight_decay", 0.0, None, "[0, inf)")
    if config.weight_decay and config.optimizer == "adam":
        raise ConfigError(
            f"config.weight_decay ({config.weight_decay}) needs config.optimizer='adamw' or "
            f"'muon'; 'adam' has no weight decay (or set config.weight_decay=0)"
        )
    _number_in(config, "grad_clip_norm", 0.0, None, "[0, inf) (0 = off)")
    _number_in(config, "label_smoothing", 0.0, 1.0, "[0, 1)")
    _number_in(config, "rdrop_alpha", 0.0, None, "[0, inf) (0 = off)")
    _bool(config, "skip_nonfinite_steps")
    _bool(config, "decode_eval")
    _int_at_least(config, "num_train_steps", 1)
    _check_time_budget(config)
    if config.get("average_checkpoints") is not None:
        average = _int_at_least(config, "average_checkpoints", 1, " (1 = the last alone)")
        if average > config.keep_checkpoints:
            raise ConfigError(
                f"config.average_checkpoints ({average}) must be <= config.keep_checkpoints "
                f"({config.keep_checkpoints}): only the kept checkpoints can be averaged"
            )
    check_cpu_devices(config)
    if config.get("peak_flops") is not None:
        _number_in(
            config, "peak_flops", 0.0, None, "(0, inf) FLOP/s (None = measure)", open_low=True
        )
    _int_at_least(config, "log_every", 1)
    _int_at_least(config, "eval_every", 0, " (0 = evaluate only at the end)")
    _int_at_least(config, "checkpoint_every", 1)
    _int_at_least(config, "keep_checkpoints", 1)
    accum = _int_at_least(config, "grad_accum_steps", 1)
    mesh = _check_mesh(config.mesh_shape, device_count)
    _check_allow_changes(config)
    if config.get("restore_step") is not None:
        _int_at_least(config, "restore_step", 1, " (None: the newest readable checkpoint)")

    if task == "synthetic":
        max_len, vocab_size = _check_synthetic(config)
    else:
        max_len = _int_at_least(config, "max_len", 1)
        vocab_size = _int_at_least(config, "vocab_size", 1)
    # The rows of every global batch are a multiple of `rows`: split into `accum` micro-batches
    # and over the data x fsdp devices.
    if task == "translation":
        tokens = _int_at_least(config, "tokens_per_batch", 1)
        multiple = _int_at_least(config, "batch_size_multiple", 1)
        if config.packing:
            from flaxformer_lite.data.batching import rows_for_length

            rows = rows_for_length(max_len, tokens, multiple)
            subject = f"the {rows} rows of a packed batch (config.tokens_per_batch // max_len)"
        else:
            rows = multiple
            subject = f"config.batch_size_multiple ({rows}; every bucket's rows are a multiple)"
    else:
        rows = _int_at_least(config, "batch_size", 1)
        subject = f"config.batch_size ({rows})"
    if task == "translation":
        _check_subword_sampling(config)
        _check_bidirectional(config)
    if task == "lm":
        _number_in(config, "eval_fraction", 0.0, 1.0, "(0, 1)", open_low=True)
        _int_at_least(config, "eval_batches", 0, " (0 = all)")
    if rows % accum:
        raise ConfigError(f"config.grad_accum_steps ({accum}) must divide {subject}")
    split = mesh[0] * mesh[1]
    if rows % split:
        raise ConfigError(
            f"{subject} must be a multiple of {split}, the devices a batch is split over "
            f"(data x fsdp of config.mesh_shape {mesh})"
        )
    _check_model(config, vocab_size, max_len)


def _check_subword_sampling(config: Any) -> None:
    """``subword_alpha``: None or 0 (off), else in (0, 1] with a vocabulary the run trains
    itself (unigram or bpe); ``subword_samples``: None (8) or a positive integer."""
    if config.get("subword_samples") is not None:
        _int_at_least(config, "subword_samples", 1, " (segmentations drawn per sentence)")
    if not config.get("subword_alpha"):
        return
    alpha = config.subword_alpha
    if not _is_number(alpha) or not 0.0 < alpha <= 1.0:
        raise ConfigError(
            f"config.subword_alpha must be a number in (0, 1] (None = off); got {alpha!r}"
        )
    if config.get("tokenizer"):
        raise ConfigError(
            f"config.subword_alpha samples segmentations of a vocabulary the run trains; "
            f"config.tokenizer={config.tokenizer!r} is pretrained: set config.subword_alpha=None"
        )
    if config.spm_model_type not in ("unigram", "bpe"):
        raise ConfigError(
            f"config.subword_alpha needs config.spm_model_type 'unigram' or 'bpe' (a 'char' "
            f"model has one segmentation); got {config.spm_model_type!r}"
        )


def _check_bidirectional(config: Any) -> None:
    """``bidirectional_epochs``: None or 0 (off), else a positive integer, with one vocabulary
    the run trains itself (a reversed pair feeds target ids to the encoder)."""
    if not config.get("bidirectional_epochs"):
        return
    _int_at_least(config, "bidirectional_epochs", 0, " (epochs that also train target -> source)")
    if not config.shared_vocab or config.get("tokenizer"):
        raise ConfigError(
            "config.bidirectional_epochs trains reversed pairs, which needs one vocabulary for "
            "both languages: config.shared_vocab=True and no config.tokenizer (got shared_vocab="
            f"{config.shared_vocab!r}, tokenizer={config.get('tokenizer')!r}); or set "
            "config.bidirectional_epochs=0"
        )


def check_cpu_devices(config: Any) -> None:
    """``cpu_devices``: None (JAX's default, one CPU device) or a positive integer. train.py
    checks it before anything else, as it must be applied before JAX starts."""
    if config.get("cpu_devices") is not None:
        _int_at_least(config, "cpu_devices", 1, " (None = JAX's default, one CPU device)")


def _check_time_budget(config: Any) -> None:
    """A time budget decides the step count at the first evaluation (training/time_budget.py):
    there must be one, and for a schedule that decays to its last step (cosine, linear) it
    must come while the rate still warms up (the decay depends on the step count)."""
    if time_budget.budget_minutes(config) is None:
        return
    _number_in(
        config, "time_budget_minutes", 0.0, None, "(0, inf) (None or 0 = off)", open_low=True
    )
    if not config.eval_every:
        raise ConfigError(
            "config.eval_every must be a positive integer with config.time_budget_minutes: "
            "the step count is decided after the first evaluation; got 0"
        )
    if config.schedule in optim.DECAY_TO_END and config.eval_every > config.warmup_steps:
        raise ConfigError(
            f"config.eval_every ({config.eval_every}) must be <= config.warmup_steps "
            f"({config.warmup_steps}) with config.time_budget_minutes and the "
            f"{config.schedule} schedule: "
            f"the step count, which the decay depends on, is decided at the first evaluation"
        )


def _check_mesh(shape: Any, device_count: int | None) -> tuple[int, ...]:
    """The (data, fsdp, tensor) sizes ``shape`` resolves to on ``device_count`` devices."""
    from flaxformer_lite.core.sharding import mesh_shape

    if device_count is None:
        import jax

        device_count = jax.device_count()
    try:
        return mesh_shape(tuple(shape), device_count)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.mesh_shape {shape!r} does not fit this run: {e}") from None


def _check_synthetic(config: Any) -> tuple[int, int]:
    from flaxformer_lite.data.tasks.synthetic import SyntheticTask

    s = config.synthetic
    for key in ("min_len", "max_len", "num_symbols", "num_eval"):
        if not _is_int(s[key]) or s[key] < 1:
            raise ConfigError(f"config.synthetic.{key} must be a positive integer; got {s[key]!r}")
    try:
        gen = SyntheticTask(s.name, min_len=s.min_len, max_len=s.max_len, num_symbols=s.num_symbols)
    except ValueError as e:
        raise ConfigError(f"config.synthetic: {e}") from None
    return max(gen.input_len, gen.target_len), gen.vocab.vocab_size


def _check_model(config: Any, vocab_size: int, max_len: int) -> None:
    """Builds the TransformerConfig the run will build (vocabulary sizes from the config's
    request; the data may give a few fewer) so that its own validation names the field."""
    quantization = dict(config.model).get("quantization")
    if quantization is not None:
        raise ConfigError(
            f"config.model.quantization={quantization!r}: int8 is for inference only (its "
            "kernels cannot be trained); train in float, then quantize when translating "
            "(Translator(quantize='int8'), translate.py --quantize int8): drop "
            "config.model.quantization"
        )
    try:
        cfg = TransformerConfig(**expected_model_fields(config, vocab_size, max_len))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.model: {e}") from None
    if config.get("rdrop_alpha", 0.0) > 0:
        rates = DROPOUT_RATES
        if not any(getattr(cfg, r) > 0 for r in rates):
            raise ConfigError(
                f"config.rdrop_alpha={config.rdrop_alpha} needs dropout: with "
                f"config.model.{'/'.join(rates)} all 0 the two passes are equal and the term "
                "is 0 at twice the cost; set a rate > 0 or config.rdrop_alpha=0"
            )
        if cfg.num_experts > 0:
            raise ConfigError(
                f"config.rdrop_alpha={config.rdrop_alpha} is not supported with "
                f"config.model.num_experts={cfg.num_experts}; set config.rdrop_alpha=0"
            )


def expected_model_fields(config: Any, vocab_size: int, max_len: int) -> dict[str, Any]:
    """The TransformerConfig fields of ``config`` as train.model_config resolves them."""
    fields = dict(config.model)
    if fields.get("dtype") == "auto":
        import jax

        fields["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    fields["vocab_size"] = vocab_size
    fields.setdefault("max_len", max_len)
    if config.task == "translation" and not config.shared_vocab:
        fields.update(target_vocab_size=vocab_size, share_embeddings=False)
    return fields


def _allowed(config: Any) -> list[str]:
    value = config.get("allow_changes") or ""
    names = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in names if n.strip()]


def _check_allow_changes(config: Any) -> None:
    value = config.get("allow_changes")
    if value is not None and not isinstance(value, str | list | tuple):
        raise ConfigError(
            f"config.allow_changes must be a comma-separated string of fields; got {value!r}"
        )
    known = (
        *COMMON_KEYS,
        *{k for keys in TASK_KEYS.values() for k in keys},
        *(f"model.{k}" for k in MODEL_KEYS),
        *(f"synthetic.{k}" for k in SYNTHETIC_KEYS),
    )
    for name in _allowed(config):
        if name not in known and not name.startswith("local_splits."):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "use a name a resume error lists"
            raise ConfigError(f"config.allow_changes names {name!r}, not a config field; {hint}")
        if name in SHAPE_FIELDS:
            raise ConfigError(
                f"config.allow_changes cannot allow {name}: it changes the shapes of the "
                f"checkpoint's parameters or optimizer state; train in a new --workdir"
            )


# ----------------------------------------------------------------------------- resume


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


_UNSET = "<unset>"

# Keys added to base_config after runs were saved without them, at the value that trains as
# those runs did: resuming such a run is no change.
ADDED_KEY_DEFAULTS = {"rdrop_alpha": 0.0}


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted.field: (old, new)}`` for every leaf of two nested JSON dicts that differs."""
    a, b = _flatten(old), _flatten(new)
    changes = {}
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, _UNSET), b.get(key, _UNSET)
        if x == _UNSET and key in ADDED_KEY_DEFAULTS and y == ADDED_KEY_DEFAULTS[key]:
            continue
        if x != y:
            changes[key] = (x, y)
    return changes


def _model_changes(config: Any, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields of the workdir's model_config.json the new run would write differently; the
    data-derived ones (vocabulary sizes, and max_len / share_embeddings / the special ids when
    the data sets them) are left to the data keys of config.json."""
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    if config.get("init_from"):
        # The pretrained architecture (the one the run saved), with config.model's overrides.
        from flaxformer_lite.interop.init_from import pretrained_config

        defaults = {**defaults, **pretrained_config(config.init_from).to_dict()}
    new = {**defaults, **expected_model_fields(config, 1, 1)}
    derived = set(DATA_MODEL_KEYS)
    if "max_len" not in config.model:
        derived.add("max_len")
    if "share_embeddings" not in config.model:
        derived.add("share_embeddings")
    # The special ids are the vocabulary's (train.model_config), and a resumed run reuses the
    # vocabulary of its workdir.
    derived.update(k for k in ("pad_id", "eos_id", "bos_id", "unk_id") if k not in config.model)
    changes = {}
    for key in sorted(set(saved) | set(new)):
        if key in derived:
            continue
        x, y = saved.get(key, _UNSET), new.get(key, _UNSET)
        if x != y:
            changes[f"model.{key}"] = (x, y)
    return changes


def latest_saved_step(workdir: str) -> int | None:
    """The latest complete checkpoint step of a train.py workdir (None: none), from the
    directory listing only (no restore)."""
    from flaxformer_lite.core.checkpoints import finished_steps

    steps = finished_steps(os.path.join(os.fspath(paths.resolve(workdir)), "checkpoints"))
    return steps[-1] if steps else None


def check_resume(config: Any, workdir: str) -> None:
    """A workdir with checkpoints is resumed: its saved config must match ``config`` except
    in SAFE_CHANGES and ``config.allow_changes``, and ``num_train_steps`` must reach its
    latest step."""
    root = paths.resolve(workdir)
    step = latest_saved_step(workdir) if root.is_dir() else None
    _check_restore_step(config, root)
    if step is None:
        return
    if time_budget.budget_minutes(config) is None and config.num_train_steps < step:
        raise ConfigError(
            f"config.num_train_steps ({config.num_train_steps}) is below the latest checkpoint "
            f"step {step} in {root / 'checkpoints'}; set it >= {step} to resume, or use a new "
            f"--workdir"
        )
    changes: dict[str, tuple[Any, Any]] = {}
    run_path = root / "config.json"
    if run_path.is_file():
        saved = json.loads(run_path.read_text())
        changes.update(config_changes(saved, json.loads(config.to_json_best_effort())))
    model_path = root / "model_config.json"
    if model_path.is_file():
        changes.update(_model_changes(config, json.loads(model_path.read_text())))
    allowed = set(_allowed(config))
    blocked = {k: v for k, v in changes.items() if k not in SAFE_CHANGES and k not in allowed}
    if not blocked:
        return
    listed = ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in blocked.items())
    shape = [k for k in blocked if k in SHAPE_FIELDS]
    if shape:
        advice = (
            f"{', '.join(shape)} cannot change on resume (the checkpoint's shapes depend on "
            f"it); use a new --workdir"
        )
    else:
        advice = (
            f"use a new --workdir, or resume anyway with --config.allow_changes={','.join(blocked)}"
        )
    raise ConfigError(
        f"config differs from the run in {root} (checkpoint step {step}): {listed}; {advice}"
    )


def _check_restore_step(config: Any, root: Any) -> None:
    """``config.restore_step`` names a finished checkpoint of the workdir."""
    wanted = config.get("restore_step")
    if wanted is None:
        return
    from flaxformer_lite.core.checkpoints import finished_steps

    steps = finished_steps(os.fspath(root / "checkpoints")) if root.is_dir() else []
    if wanted not in steps:
        valid = ", ".join(map(str, steps)) if steps else "none (nothing to resume: omit it)"
        raise ConfigError(
            f"config.restore_step={wanted}: no checkpoint of that step in "
            f"{root / 'checkpoints'}; valid steps: {valid}"
        )


# ----------------------------------------------------------------------------- CLI flags


def define_config_flag(flag_values: Any = None) -> Any:
    """train.py's ``--config`` flag (in ``flag_values``; default: absl's global flags): a Python
    config file whose fields ``--config.KEY=VALUE`` overrides, keys the file does not list
    included (``--config.model.dtype=bfloat16`` on a config whose ``model`` dict has no
    ``dtype``; the value is read as a Python literal, else kept as a string). A misspelt key
    therefore parses, and :func:`check_keys` refuses it before any work with the key and the
    nearest valid one. Returns absl's flag holder."""
    from ml_collections import config_flags

    kwargs = {} if flag_values is None else {"flag_values": flag_values}
    return config_flags.DEFINE_config_file(
        "config",
        None,
        "Python config file.",
        lock_config=False,  # ml_collections: new keys need an unlocked config
        accept_new_attributes=True,
        **kwargs,
    )


def parse_flags(argv: list[str], flag_values: Any = None) -> list[str]:
    """absl's flag parser (of ``flag_values``; default: absl's global flags, as ``app.run``),
    with a misspelt ``--config.KEY=...`` override reported as one line (``error: ...``, exit
    status 2) instead of ml_collections' traceback."""
    from absl import app

    parse = app.parse_flags_with_usage if flag_values is None else flag_values
    try:
        return parse(argv)
    except (AttributeError, KeyError) as e:
        text = str(e).replace("\\n", " ").replace("\\'", "'")
        match = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
        if match:
            flag = next(
                (a.split("=")[0] for a in argv if a.split("=")[0].endswith(f".{match[2]}")),
                f"--config.{match[2]}",
            )
            message = f"{flag}: no such config key; did you mean {match[1]}?"
        else:
            message = "unknown --config key: " + " ".join(text.strip("'\" ").split())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
