"""Learning-rate schedules, the optimizer, and frozen parameters, built from Optax parts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.models import param_path

SCHEDULES = ("noam", "cosine", "linear", "constant")
# Schedules whose decay depends on where the run ends (total_steps): a time budget must decide
# the step count before the decay starts (preflight, training/time_budget.py).
DECAY_TO_END = ("cosine", "linear")
OPTIMIZERS = ("adam", "adamw", "muon")
MUON_MOMENTUM = 0.95  # Jordan et al. 2024; Liu et al. 2025
MUON_RMS = 0.2  # Muon updates scaled to about this RMS, near AdamW's (Liu et al. 2025)


def noam_schedule(d_model: int, warmup_steps: int = 4000, scale: float = 1.0) -> optax.Schedule:
    """The paper's schedule, lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    ``step`` counts optimizer updates from 1 (optax passes count 0 for the first update).
    """
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive; got {warmup_steps}")

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def make_schedule(
    name: str,
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    d_model: int,
) -> optax.Schedule:
    """ "noam" (learning_rate is the multiplier of the paper's formula), "cosine" (linear warmup
    to learning_rate, cosine decay to 0 at total_steps), "linear" (linear warmup, then linear
    decay to 0 at total_steps: Bergsma et al. 2025, "Straight to Zero") or "constant" (linear
    warmup)."""
    if name == "noam":
        return noam_schedule(d_model, warmup_steps, learning_rate)
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1)
        )
    if name == "linear":
        decay_steps = max(total_steps - warmup_steps, 1)
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, warmup_steps),
                optax.linear_schedule(learning_rate, 0.0, decay_steps),
            ],
            [warmup_steps],
        )
    if name == "constant":
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, warmup_steps),
                optax.constant_schedule(learning_rate),
            ],
            [warmup_steps],
        )
    raise ValueError(f"schedule must be one of {SCHEDULES}; got {name!r}")


def make_optimizer(
    name: str,
    schedule: optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-9,
    weight_decay: float = 0.0,
    grad_clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """Adam with the paper's betas and epsilon, AdamW, or Muon, after optional global-norm
    clipping.

    AdamW decays the weight matrices and embeddings only (``decayed``): a bias or a norm's
    scale pulled towards zero is a constraint, not a regularizer. Muon (Jordan et al., 2024)
    updates the attention and feed-forward projection matrices (``muon_dimensions``) by their
    momentum orthogonalized with Newton-Schulz iterations, scaled to AdamW's update RMS so that
    both share ``schedule`` and ``weight_decay`` (Liu et al., 2025, "Muon is Scalable for LLM
    Training"); every other parameter (embeddings, the output layer, biases, norms, relative
    position tables, a mixture of experts' router and weights) keeps AdamW."""
    if name == "adam":
        opt: Any = optax.adam(schedule, b1=b1, b2=b2, eps=eps)
    elif name == "adamw":
        opt = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decayed)
    elif name == "muon":
        matrices = optax.contrib.muon(
            schedule,
            beta=MUON_MOMENTUM,
            weight_decay=weight_decay,
            consistent_rms=MUON_RMS,
            muon_weight_dimension_numbers=muon_dimensions,
        )
        rest = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decayed)
        opt = optax.partition({"muon": matrices, "adamw": rest}, muon_labels)
    else:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {name!r}")
    if grad_clip_norm:
        opt = optax.chain(optax.clip_by_global_norm(grad_clip_norm), opt)
    return opt


def decayed(params: Any) -> Any:
    """The tree of ``params`` with False for the parameters weight decay leaves alone: biases
    (names ending in ``bias``) and norm scales (``scale``), else True. By name, not by rank:
    a scanned layer stack gives its biases a leading layer axis."""

    def decay(path, _):
        name = param_path(path).rsplit("/", 1)[-1]
        return not (name.endswith("bias") or name == "scale")

    return jax.tree_util.tree_map_with_path(decay, params)


# Muon's matrices by parameter name, with their (reduction, output) axes counted from the end:
# leading axes (a scanned stack's layers, a fused kernel's query/key/value) are batch axes,
# each slice orthogonalized on its own. A head's query, key or value projection is one
# [embed, heads * head_dim] matrix, the output projection one [heads * head_dim, embed].
_MUON_AXES = (
    (re.compile(r".*attention/((query|key|value)/kernel|qkv/query_kernel)"), -3, (-2, -1)),
    (re.compile(r".*attention/qkv/(kernel|kv_kernel)"), -4, (-2, -1)),
    (re.compile(r".*attention/out/kernel"), (-3, -2), -1),
    (re.compile(r".*/mlp/(wi|wi_up|wo)/kernel"), -2, -1),
)


def _muon_axes(path) -> optax.contrib.MuonDimensionNumbers | None:
    name = param_path(path)
    for regex, reduction, output in _MUON_AXES:
        if regex.fullmatch(name):
            return optax.contrib.MuonDimensionNumbers(reduction, output)
    return None


def muon_dimensions(params: Any) -> Any:
    """The tree of ``params`` with Muon's ``MuonDimensionNumbers`` for the attention and
    feed-forward projection kernels and None for the parameters AdamW updates."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _muon_axes(path), params)


def muon_labels(params: Any) -> Any:
    """The tree of ``params`` with "muon" for Muon's matrices (``muon_dimensions``), else
    "adamw"."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adamw" if _muon_axes(path) is None else "muon", params
    )


# ----------------------------------------------------------------------------- freezing


def freeze_labels(params: Any, patterns: Sequence[str]) -> Any:
    """The tree of ``params`` with ``"freeze"`` where a parameter's path fully matches one of
    the regular expressions ``patterns``, else ``"train"``.

    Raises:
      ValueError: a pattern matches no parameter (it is named, with some of the paths).
    """
    compiled = [(p, re.compile(p)) for p in patterns]
    used: set[str] = set()

    def label(path, _):
        name = param_path(path)
        for pattern, regex in compiled:
            if regex.fullmatch(name):
                used.add(pattern)
                return "freeze"
        return "train"

    labels = jax.tree_util.tree_map_with_path(label, params)
    unused = [p for p, _ in compiled if p not in used]
    if unused:
        names = [param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        raise ValueError(
            f"config.freeze pattern(s) {unused} match no parameter; patterns are regular "
            f"expressions over '/'-joined paths such as {names[:6]} (of {len(names)})"
        )
    return labels


def with_frozen(tx: optax.GradientTransformation, patterns: Sequence[str]):
    """``tx`` for the parameters ``patterns`` (see ``freeze_labels``) leave alone; the frozen
    ones get zero updates through ``optax.multi_transform`` and no optimizer state (their
    gradients never reach ``tx``, so clipping and Adam see the trained parameters only).
    No patterns: ``tx`` itself."""
    if not patterns:
        return tx
    return optax.multi_transform(
        {"train": tx, "freeze": optax.set_to_zero()},
        lambda params: freeze_labels(params, patterns),
    )
