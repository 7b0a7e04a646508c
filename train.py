"""Trains a flaxformer_lite model. The loop reads top to bottom in this one file.

    python train.py --config configs/default.py --workdir runs/default
    python train.py --config configs/multi30k.py --workdir runs/m30k \
        --config.data_dir=../shared/data/multi30k --config.num_train_steps=100
    python train.py --config configs/default.py --workdir gs://BUCKET/run  # everything in GCS

A workdir that already holds checkpoints resumes from the latest one: parameters, optimizer
state, RNG and the position in the data stream, so an interrupted run ends exactly where an
uninterrupted one would. SIGTERM (a preemption notice) to any process, or a first Ctrl-C, makes
every process save the same step and exit 0: the checkpoint is safely written, so rerunning the
command resumes (a second Ctrl-C aborts at once). A second run on a workdir that a live run holds
refuses before any work (training/run_lock.py; --break_lock overrides).
A save that fails (a full disk) stops the run at the next step with one line naming the intact
checkpoints; a newest checkpoint that cannot be read is skipped, loudly, for the newest readable
one (or --config.restore_step=N picks the step).
"""

from __future__ import annotations

import os
import sys


def restart_with_huge_pages() -> None:
    """Re-executes this process (same pid, arguments and interpreter options) with glibc's
    malloc backing its memory with transparent huge pages (``GLIBC_TUNABLES=
    glibc.malloc.hugetlb=1``), before anything heavy is imported. XLA's CPU buffers are
    allocated and freed every step; in 4 KiB pages the kernel faults and zeroes them again and
    again (on the Multi30k config about 250,000 page faults a second, a quarter of the CPU time
    in the kernel), in 2 MiB pages 52 times fewer faults: the step runs 1.35x the tokens
    per second (bench/huge_pages.py). Nothing changes where the C library is not glibc 2.35 or
    newer, where the kernel has transparent huge pages off, or where GLIBC_TUNABLES already
    names glibc.malloc.hugetlb (``glibc.malloc.hugetlb=0`` keeps 4 KiB pages)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return
    try:
        libc, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            enabled = f.read()
    except (AttributeError, ValueError, OSError):  # not Linux, not glibc, no THP
        return
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35) or "[never]" in enabled:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    added = "glibc.malloc.hugetlb=1"
    env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:{added}" if tunables else added}
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:  # carry on in this process, with 4 KiB pages
        pass


if __name__ == "__main__":  # before the imports below: the restart would redo them
    restart_with_huge_pages()

import dataclasses
import functools
import itertools
import json
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxformer_lite.core import paths, sharding
from flaxformer_lite.core.checkpoint_errors import CheckpointError, SaveError
from flaxformer_lite.core.checkpoints import Checkpointer
from flaxformer_lite.data import reading as data
from flaxformer_lite.data import tasks
from flaxformer_lite.data.tasks import lm as lm_task
from flaxformer_lite.decoding.generate import continue_prompt, generate
from flaxformer_lite.decoding.generation_config import GenerationConfig, source_limit
from flaxformer_lite.interop import init_from
from flaxformer_lite.models import DecoderOnly, EncoderClassifier, EncoderDecoder
from flaxformer_lite.nn import moe
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.training import (
    checkpoint_faults,
    flops,
    losses,
    optim,
    preflight,
    run_lock,
    time_budget,
)
from flaxformer_lite.training.metrics import MetricWriter
from flaxformer_lite.training.preemption import Preemption


class TrainState(struct.PyTreeNode):
    """Everything a step changes, and the RNG it derives dropout keys from."""

    step: jax.Array  # int32 scalar: optimizer updates done
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 [2] raw key; dropout at step s uses fold_in(rng, s)


# ----------------------------------------------------------------------------- model and loss


def model_config(config: Any, task: tasks.Task) -> TransformerConfig:
    """The TransformerConfig of a run: config.model plus the sizes and special ids (pad, eos,
    decoder start, unk) the data decided: those of the task's vocabulary, with which every
    batch was built, so a run on a Marian vocabulary gets Marian's ids.

    ``dtype="auto"`` computes in bfloat16 on TPU and GPU (float32 parameters, softmax and
    loss) and in float32 on a CPU, where XLA gains nothing from bfloat16.

    Raises:
      ValueError: ``config.model`` sets a special id other than the vocabulary's.
    """
    fields = dict(config.model)
    special = dict(getattr(task, "special_ids", {}))
    for name, value in special.items():
        if name in fields and fields[name] != value:
            raise ValueError(
                f"config.model.{name}={fields[name]} but the task's vocabulary has "
                f"{name}={value}; drop config.model.{name} (the vocabulary decides it) or use "
                "the vocabulary the model was trained with"
            )
    if fields.get("dtype") == "auto":
        fields["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    data_fields = dict(vocab_size=task.vocab_size, target_vocab_size=task.target_vocab_size)
    data_fields.update(special)
    if config.get("init_from"):  # the pretrained architecture, the data's sizes and ids
        return init_from.model_fields(config.init_from, fields, data_fields)
    fields.update(data_fields)
    fields.setdefault("max_len", task.max_len)
    if task.target_vocab_size is not None:
        fields["share_embeddings"] = False
    return TransformerConfig(**fields)


def make_optimizer(
    config: Any, d_model: int, total_steps: int | None = None
) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """The run's learning-rate schedule and optimizer, as ``config`` names them, ending at
    ``total_steps`` (default ``config.num_train_steps``); parameters matching a
    ``config.freeze`` pattern get no updates (``optim.with_frozen``)."""
    schedule = optim.make_schedule(
        config.schedule,
        learning_rate=config.learning_rate,
        warmup_steps=config.warmup_steps,
        total_steps=config.num_train_steps if total_steps is None else total_steps,
        d_model=d_model,
    )
    tx = optim.make_optimizer(
        config.optimizer,
        schedule,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        grad_clip_norm=config.grad_clip_norm,
    )
    return schedule, optim.with_frozen(tx, tuple(config.get("freeze") or ()))


def build_model(kind: str, cfg: TransformerConfig) -> nn.Module:
    if kind == "lm":
        return DecoderOnly(cfg)
    if kind == "classification":
        return EncoderClassifier(cfg)
    return EncoderDecoder(cfg)


def forward(model: nn.Module, kind: str, params, batch, *, deterministic: bool, rng=None):
    """Logits, labels, weights of one batch, for any of the three models, and the routing
    statistics the model sowed (``moe.routing_statistics``: per mixture-of-experts layer,
    expert counts, router probability sums, real tokens ...; empty for dense models)."""
    rngs = None if deterministic else {"dropout": rng}
    is_moe = model.config.num_experts > 0
    apply_fn = functools.partial(
        model.apply,
        {"params": params},
        deterministic=deterministic,
        rngs=rngs,
        mutable=["losses"] if is_moe else False,
    )
    aux: dict[str, jax.Array] = {}

    def apply(*args, **kwargs):
        if not is_moe:
            return apply_fn(*args, **kwargs)
        out, state = apply_fn(*args, **kwargs)
        aux.update(moe.routing_statistics(state.get("losses", {})))
        return out

    if kind == "classification":
        return apply(batch["inputs"]), batch["label"], batch["weights"], aux
    if kind == "lm":
        logits = apply(
            batch["targets"],
            positions=batch.get("targets_position"),
            segmentation=batch.get("targets_segmentation"),
        )
    else:
        logits = apply(
            batch["inputs"],
            batch["targets"],
            inputs_positions=batch.get("inputs_position"),
            targets_positions=batch.get("targets_position"),
            inputs_segmentation=batch.get("inputs_segmentation"),
            targets_segmentation=batch.get("targets_segmentation"),
        )
    targets = batch["targets"]
    return logits, targets, (targets != model.config.pad_id).astype(jnp.float32), aux


SUM_KEYS = ("smoothed_kl", "nll", "count", "correct")
MOE_KEYS = ("moe_aux_loss", "router_z_loss", "moe_dropped")
RDROP_KEYS = ("rdrop_kl",)


def sum_keys(cfg: TransformerConfig, rdrop: bool = False) -> tuple[str, ...]:
    """The keys ``loss_sums`` returns for a model of ``cfg`` (``rdrop``: a training pass with
    ``rdrop_alpha > 0``)."""
    return SUM_KEYS + (MOE_KEYS if cfg.num_experts > 0 else ()) + (RDROP_KEYS if rdrop else ())


def loss_sums(
    model, kind, label_smoothing, params, batch, *, deterministic, rng=None, totals=None,
    rdrop_alpha=0.0,
):  # fmt: skip
    """(objective sum, aux sums), summed so micro-batches and devices add up exactly.

    The objective is ``losses.smoothed_cross_entropy``: the label-smoothed cross-entropy minus
    the smoothed target's entropy, i.e. the KL divergence from the smoothed target to the
    model (0 for a perfect prediction; the plain cross-entropy when ``label_smoothing`` is 0),
    hence the key ``smoothed_kl``. ``nll`` is the unsmoothed cross-entropy of the labels.

    A mixture-of-experts model adds its weighted auxiliary losses (per token, so x count in
    the sum): ``moe_aux_loss_weight x`` load balancing + ``router_z_loss_weight x`` z-loss,
    each the mean over MoE layers; ``moe_aux_loss``, ``router_z_loss`` and ``moe_dropped``
    are returned x count too. These losses are not sums over tokens (load balancing is a
    product of two batch means), so a micro-batch of a larger batch takes ``totals``, the
    whole batch's ``routing_totals``: then it returns its additive share of the whole batch's
    losses (``moe.batch_auxiliary_losses``; x the whole batch's count), and the shares of the
    micro-batches sum to the whole batch's value and gradient. None: this batch is the whole.

    R-Drop (Liang et al., 2021), when ``rdrop_alpha > 0`` and not ``deterministic``: every row
    is run twice in one forward pass (each row repeated in place, ``[2 x batch, ...]``, so a
    device's rows stay on it), the two copies under different dropout masks. The objective is
    the paper's loss halved, so that it stays on the scale of one pass: the mean of the two
    copies' losses plus ``rdrop_alpha / 2`` x ``rdrop_kl``, the sum over real tokens of
    ``losses.symmetric_kl`` between the copies. The sums are the means of the two copies (one
    copy's ``count``) and ``rdrop_kl``. Not with a mixture of experts (refused).
    """
    rdrop = rdrop_alpha > 0 and not deterministic
    if rdrop:
        if model.config.num_experts > 0:
            raise ValueError("rdrop_alpha > 0 is not supported with num_experts > 0")
        batch = jax.tree_util.tree_map(lambda x: jnp.repeat(x, 2, axis=0), batch)
    logits, labels, weights, stats = forward(
        model, kind, params, batch, deterministic=deterministic, rng=rng
    )
    kl, count = losses.smoothed_cross_entropy(logits, labels, weights, label_smoothing)
    nll, _ = losses.smoothed_cross_entropy(logits, labels, weights, 0.0)
    correct = losses.correct_predictions(logits, labels, weights)
    sums = {"smoothed_kl": kl, "nll": nll, "count": count, "correct": correct}
    objective = kl
    if rdrop:
        pairs = lambda x: x.reshape(x.shape[0] // 2, 2, *x.shape[1:])  # noqa: E731
        logit_pairs, weight_pairs = pairs(logits), pairs(weights)
        sums = {k: v / 2 for k, v in sums.items()}
        sums["rdrop_kl"] = losses.symmetric_kl(
            logit_pairs[:, 0], logit_pairs[:, 1], weight_pairs[:, 0]
        )
        objective = sums["smoothed_kl"] + rdrop_alpha / 2 * sums["rdrop_kl"]
    if stats:
        cfg = model.config
        aux = moe.batch_auxiliary_losses(stats, None if totals is None else totals["routing"])
        total = count if totals is None else totals["count"]
        objective = kl + total * (
            cfg.moe_aux_loss_weight * aux["moe_aux_loss"]
            + cfg.router_z_loss_weight * aux["router_z_loss"]
        )
        sums.update({k: total * v for k, v in aux.items()})
    return objective, sums


def routing_totals(model, kind, params, batch, *, deterministic, rng=None):
    """What ``loss_sums(totals=)`` needs of a batch: its loss-weight ``count`` and its
    ``routing`` statistics (``moe.routing_statistics``); a forward pass, no gradient. Sums:
    the totals of a batch's micro-batches add up to the batch's."""
    _, _, weights, stats = forward(model, kind, params, batch, deterministic=deterministic, rng=rng)
    return {"count": jnp.sum(weights.astype(jnp.float32)), "routing": stats}


# ----------------------------------------------------------------------------- steps


def train_step(
    state: TrainState,
    batch,
    *,
    model,
    kind,
    tx,
    schedule,
    label_smoothing,
    accum_steps: int,
    skip_nonfinite: bool,
    rdrop_alpha: float = 0.0,
):
    """One optimizer update from a batch of ``accum_steps`` micro-batches.

    Gradients of the *summed* loss are accumulated and divided once by the real-token count
    of the whole batch, so accumulation gives the same update as one big batch: the same
    gradients and logged sums (up to float rounding) when the model has no dropout (each
    micro-batch draws its own dropout masks).

    That holds for a mixture of experts too: its auxiliary losses (load balancing, router
    z-loss) and ``moe_dropped`` are those of the whole batch, not a mean of per-micro-batch
    losses. A forward pass over the micro-batches first sums their routing statistics
    (``routing_totals``: tokens and assignments per expert in every MoE layer), then each
    micro-batch's gradient pass takes its additive share of the whole batch's losses
    (``loss_sums(totals=)``); the cost is one more forward pass per step, only for a
    mixture of experts with ``accum_steps > 1``. Capacity binds per group, and a group is a
    batch row, which a micro-batch holds whole: dropping is unchanged by accumulation.
    """
    rng = jax.random.fold_in(state.rng, state.step)
    grad_fn = jax.grad(
        functools.partial(
            loss_sums, model, kind, label_smoothing, deterministic=False, rdrop_alpha=rdrop_alpha
        ),
        has_aux=True,
    )
    if accum_steps == 1:
        grads, sums = grad_fn(state.params, batch, rng=rng)
    else:
        micro = jax.tree_util.tree_map(
            lambda x: x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:]), batch
        )
        totals = None
        if model.config.num_experts > 0:

            def add_totals(carry, inputs):
                i, mb = inputs
                t = routing_totals(
                    model, kind, state.params, mb, deterministic=False,
                    rng=jax.random.fold_in(rng, i),
                )  # fmt: skip
                return jax.tree_util.tree_map(jnp.add, carry, t), None

            first = jax.eval_shape(
                lambda: routing_totals(
                    model, kind, state.params, jax.tree_util.tree_map(lambda x: x[0], micro),
                    deterministic=False, rng=rng,
                )
            )  # fmt: skip
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), first)
            totals, _ = jax.lax.scan(add_totals, zeros, (jnp.arange(accum_steps), micro))

        def body(carry, inputs):
            i, mb = inputs
            g, s = grad_fn(state.params, mb, rng=jax.random.fold_in(rng, i), totals=totals)
            return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

        zeros = jax.tree_util.tree_map(
            jnp.zeros_like,
            (state.params, _zero_sums(sum_keys(model.config, rdrop=rdrop_alpha > 0))),
        )
        (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), micro))
    denom = jnp.maximum(sums["count"], 1.0)
    grads = keep_pad_rows(jax.tree_util.tree_map(lambda g: g / denom, grads), model.config.pad_id)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
    )
    # Finite loss and gradient, and finite new parameters: an overflowing update (a huge
    # learning rate) must not pass as a good step and be checkpointed.
    finite = (
        jnp.isfinite(sums["smoothed_kl"]) & jnp.isfinite(grad_norm) & all_finite(new_state.params)
    )
    if skip_nonfinite:
        new_state = keep_counters_only(finite, new_state, state)
    metrics = {
        **sums,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),  # the rate of this update (count == step)
        "finite": finite,
    }
    return new_state, metrics


def jit_train_step(config: Any, model, kind: str, tx, schedule, state_shardings, mesh: Mesh):
    """``train_step`` jitted for ``mesh`` with the run's loss and optimizer settings: the batch
    split over ("data", "fsdp"), the state keeping its shardings (and donated), the metrics
    replicated. train.py's loop and bench/tpu_aot.py compile this same function."""
    return jax.jit(
        functools.partial(
            train_step,
            model=model,
            kind=kind,
            tx=tx,
            schedule=schedule,
            label_smoothing=config.label_smoothing,
            accum_steps=config.grad_accum_steps,
            skip_nonfinite=config.skip_nonfinite_steps,
            rdrop_alpha=config.get("rdrop_alpha", 0.0),
        ),
        in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )


def keep_pad_rows(grads, pad_id: int):
    """``grads`` with the pad id's row of every token embedding zeroed: the pad embedding is
    never trained (PyTorch's ``padding_idx``), which matters where the pad token is also the
    decoder start (Marian: CTranslate2 starts its decoder from a zero vector there)."""

    def zero(path, g):
        keys = [str(k.key) for k in path if hasattr(k, "key")]
        if len(keys) >= 2 and keys[-1] == "embedding" and keys[-2].endswith("embedding"):
            return g.at[pad_id].set(0.0)
        return g

    return jax.tree_util.tree_map_with_path(zero, grads)


def all_finite(tree) -> jax.Array:
    """Whether every element of every leaf is finite (bool scalar)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(tree)]))


def keep_counters_only(finite: jax.Array, new_state: TrainState, old_state: TrainState):
    """``new_state`` if ``finite``, else ``old_state`` with ``new_state``'s counters.

    Counters are the integer leaves: ``step`` and the optimizer's counts (Adam's bias
    correction, the learning-rate schedule's). A skipped step keeps the parameters and the
    optimizer's moments but advances every counter, as it advances the data stream, so the
    schedule's count stays equal to ``state.step`` and the logged learning rate
    (``schedule(step)``) is the one the next update uses.
    """

    def pick(new, old):
        if jnp.issubdtype(new.dtype, jnp.integer):
            return new
        return jnp.where(finite, new, old)

    return jax.tree_util.tree_map(pick, new_state, old_state)


def _zero_sums(keys: tuple[str, ...] = SUM_KEYS) -> dict[str, jax.Array]:
    return {k: jnp.zeros((), jnp.float32) for k in keys}


def eval_step(params, batch, *, model, kind, label_smoothing):
    _, sums = loss_sums(model, kind, label_smoothing, params, batch, deterministic=True)
    return sums


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """Per-token means from summed counts: ``smoothed_kl`` (the training objective, see
    ``loss_sums``), accuracy, and the perplexity of the unsmoothed cross-entropy."""
    count = max(sums["count"], 1.0)
    out = {
        f"{prefix}/smoothed_kl": sums["smoothed_kl"] / count,
        f"{prefix}/accuracy": sums["correct"] / count,
        f"{prefix}/perplexity": float(np.exp(min(sums["nll"] / count, 50.0))),
    }
    out.update({f"{prefix}/{k}": sums[k] / count for k in (*MOE_KEYS, *RDROP_KEYS) if k in sums})
    return out


def batch_train_flops(kind: str, cfg: TransformerConfig, batch) -> float:
    """Analytic forward + backward matmul FLOPs of one global batch (see flops.py): gated
    feed-forwards, grouped-query key/value heads and head_dim come from ``cfg``."""
    src = batch["inputs"].shape[1] if kind != "lm" else 0
    tgt = batch["targets"].shape[1] if kind != "classification" else 0
    rows = batch["inputs" if kind != "lm" else "targets"].shape[0]
    classes = cfg.num_classes if kind == "classification" else 0
    return flops.train_flops(cfg, rows, src, tgt, num_classes=classes)


# ----------------------------------------------------------------------------- decoding eval


def greedy_decode_in_order(
    params, cfg: TransformerConfig, inputs, mesh, max_len: int, row_max_len=None
):
    """Greedy tokens ``[rows, max_len]`` of the source rows ``inputs`` ``[rows, len]``, in
    the order of ``inputs``, on every process; row ``i`` stops at ``row_max_len[i]`` tokens
    when given (ints ``[rows]``).

    Each process feeds its rows with their global index (``sharding.global_rows_with_ids``);
    the index (and the row's limit) travels with the row through decoding and the gather, so
    the result is in reference order for any device-to-process layout of the mesh.
    """
    rows = {"x": np.asarray(inputs)}
    if row_max_len is not None:
        rows["limit"] = np.asarray(row_max_len, np.int32)
    batch = sharding.global_rows_with_ids(rows, mesh)
    greedy = GenerationConfig(method="greedy", max_len=max_len)
    tokens, _ = generate(params, cfg, batch["x"], greedy, mesh=mesh, row_max_len=batch.get("limit"))
    return sharding.gather_in_row_order(tokens, batch[sharding.ROW_ID])


def decode_metric(task: tasks.Task, params, cfg: TransformerConfig, mesh) -> dict[str, Any]:
    """Greedy-decodes the eval sources: exact match (synthetic) or BLEU (translation).

    Every process decodes its rows; the tokens are gathered, in reference order, so each
    sees the whole set.
    """
    hyps, refs, examples = [], [], []
    for inputs, references in zip(task.decode_inputs, task.decode_references, strict=True):
        limits = None
        if task.metric == "exact_match":
            max_len = references.shape[1]
        else:  # as the Translator (max_len="source"): each source's own limit, not its batch's
            max_len = source_limit(inputs.shape[1], cfg.max_len)
            lengths = np.count_nonzero(np.asarray(inputs) != cfg.pad_id, axis=1)
            limits = source_limit(lengths, max_len)
        tokens = greedy_decode_in_order(params, cfg, inputs, mesh, max_len, limits)
        for row in range(tokens.shape[0]):
            real = task.metric == "bleu" or (np.asarray(references[row]) != cfg.pad_id).any()
            if task.metric == "exact_match":
                if not real:
                    continue  # padding row
                match = losses.exact_match(
                    tokens[row : row + 1], references[row : row + 1], pad_id=cfg.pad_id
                )
                hyps.append(bool(match[0]))
            elif references[row] is not None:
                hyps.append(task.detokenize(tokens[row].tolist()))
                refs.append(references[row])
            if len(examples) < 3 and real and references[row] is not None:
                examples.append(
                    (
                        task.source_detokenize(inputs[row].tolist()),
                        task.detokenize(tokens[row].tolist()),
                        references[row]
                        if task.metric == "bleu"
                        else task.detokenize(references[row].tolist()),
                    )
                )
    if task.metric == "exact_match":
        return {"eval/exact_match": float(np.mean(hyps))}, examples
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    return {"eval/bleu": bleu.score}, examples


def lm_sample(task: tasks.Task, params, cfg: TransformerConfig, step: int, mesh) -> str:
    """A sampled continuation (temperature 0.8) of the first held-out window's opening."""
    prompt = np.asarray(task.eval_batches[0]["targets"][:1, : lm_task.PROMPT_LEN])
    sampling = GenerationConfig(
        method="sample", temperature=0.8, max_len=cfg.max_len - prompt.shape[1] - 1
    )
    tokens, _ = continue_prompt(params, cfg, prompt, sampling, mesh=mesh, rng=jax.random.key(step))
    return (
        task.detokenize(prompt[0].tolist())
        + " || "
        + task.detokenize(np.asarray(tokens)[0].tolist())
    )


# ----------------------------------------------------------------------------- logging window

clock = time.perf_counter  # the loop's timer (seconds); tests substitute a fake one


@dataclasses.dataclass
class PendingStep:
    """A step whose metrics are still on the device (fetched at the next sync point, so the
    loop never waits for the device step by step)."""

    step: int  # steps done after it
    metrics: dict[str, jax.Array]
    flops: float  # analytic model FLOPs of its batch
    timed: bool  # dispatched while the window's clock ran


@dataclasses.dataclass
class LogWindow:
    """The train steps since the last ``train/`` metrics line.

    ``sums``, ``grad_norm_sum`` and ``steps`` cover every step of the window; ``tokens``,
    ``flops`` and ``seconds`` only the timed ones. The loop stops the clock at each of its
    sync points (a log line, an evaluation, a checkpoint save, and around a step whose batch
    shapes are new, i.e. that compiles: a run's first step, a new length bucket) and starts
    it again when that work is done; so throughput and MFU exclude compilation, evaluation
    and saving.
    """

    sums: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(SUM_KEYS, 0.0))
    grad_norm_sum: float = 0.0
    steps: int = 0
    learning_rate: float = math.nan  # of the window's last step
    tokens: float = 0.0  # real (non-padding) target tokens of the timed steps
    flops: float = 0.0
    seconds: float = 0.0
    running_since: float | None = None  # clock() when the clock last started; None: stopped

    def add(self, metrics: dict[str, Any], flops: float, timed: bool) -> None:
        """Adds one step's host metrics (see ``train_step``)."""
        for k in (*SUM_KEYS, *MOE_KEYS, *RDROP_KEYS):  # MoE, R-Drop sums: only in such runs
            if k in metrics:
                self.sums[k] = self.sums.get(k, 0.0) + float(metrics[k])
        self.grad_norm_sum += float(metrics["grad_norm"])
        self.steps += 1
        self.learning_rate = float(metrics["learning_rate"])
        if timed:
            self.tokens += float(metrics["count"])
            self.flops += flops

    def start_clock(self, now: float) -> None:
        self.running_since = now

    def stop_clock(self, now: float) -> None:
        if self.running_since is not None:
            self.seconds += now - self.running_since
            self.running_since = None

    def summary(self, peak_flops: float) -> dict[str, float]:
        """The ``train/`` metrics line: per-token means, the last learning rate, the mean
        gradient norm, and (when some step was timed) tokens per second and MFU."""
        metrics = summarize(self.sums, "train")
        metrics["train/learning_rate"] = self.learning_rate
        metrics["train/grad_norm"] = self.grad_norm_sum / max(self.steps, 1)
        if self.seconds > 0.0:
            metrics["train/tokens_per_second"] = self.tokens / self.seconds
            metrics["train/mfu"] = self.flops / self.seconds / peak_flops
        return metrics


def fetch_into(
    window: LogWindow, pending: list[PendingStep], *, skip_nonfinite: bool, checkpoint_dir: str
) -> None:
    """Waits for the ``pending`` steps, adds their metrics to ``window``; raises
    FloatingPointError at the first non-finite step unless such steps are skipped."""
    for p, metrics in zip(pending, jax.device_get([p.metrics for p in pending]), strict=True):
        if not metrics["finite"] and not skip_nonfinite:
            raise FloatingPointError(
                f"non-finite loss, gradient or parameters at step {p.step}; the last good "
                f"checkpoint in {checkpoint_dir} is kept (set skip_nonfinite_steps=True to skip)"
            )
        window.add(metrics, p.flops, p.timed)


# ----------------------------------------------------------------------------- evaluation, saving


@dataclasses.dataclass(frozen=True)
class Run:
    """The parts of a run that stay fixed while it trains."""

    config: Any
    task: tasks.Task
    cfg: TransformerConfig
    mesh: Mesh
    eval_fn: Callable
    checkpointer: Checkpointer
    writer: MetricWriter
    log: Callable[..., None]


def evaluate(run: Run, params, step: int, *, write: bool = True) -> dict[str, float]:
    """Eval-set metrics (and decoding metrics when the task has them) of ``params``, written
    to ``metrics.jsonl`` (unless ``write`` is False) and logged."""
    totals = dict.fromkeys(sum_keys(run.cfg), 0.0)
    for batch in run.task.eval_batches:
        batch = sharding.host_local_to_global(sharding.process_rows(batch), run.mesh)
        for k, v in jax.device_get(run.eval_fn(params, batch)).items():
            totals[k] += float(v)
    metrics = summarize(totals, "eval")
    if run.task.decode_inputs and run.config.decode_eval:
        decoded, examples = decode_metric(run.task, params, run.cfg, run.mesh)
        metrics.update(decoded)
        for src, hyp, ref in examples:
            run.log(f"  {src!r} -> {hyp!r} (reference {ref!r})")
    if run.task.kind == "lm" and run.config.decode_eval:
        run.log(f"  sample: {lm_sample(run.task, params, run.cfg, step, run.mesh)!r}")
    if write:
        run.writer.write(step, metrics)
    run.log(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def compile_evaluation(run: Run, params) -> None:
    """Runs ``run.eval_fn`` once on the first eval batch of each shape (outputs discarded,
    nothing written), so that evaluations find it compiled. A run whose time budget is not
    decided yet calls it before its first step: the budget measures its pace over the steps up
    to its first evaluation, that evaluation included, and the eval step's one-time
    compilation would count as a cost that recurs every ``eval_every`` steps (9 of the 120
    seconds of the Multi30k hour's first 250 steps, which decided 7,384 steps and ended after
    52 minutes). Decoding metrics (``decode_eval``) still compile at the first evaluation."""
    seen: set[tuple] = set()
    for batch in run.task.eval_batches:
        shapes = tuple((k, np.shape(v)) for k, v in sorted(batch.items()))
        if shapes not in seen:
            seen.add(shapes)
            batch = sharding.host_local_to_global(sharding.process_rows(batch), run.mesh)
            jax.block_until_ready(run.eval_fn(params, batch))


def write_train_line(run: Run, step: int, window: LogWindow, peak_flops: float, bar) -> None:
    """Writes ``window``'s ``train/`` metrics at ``step`` and shows them on the progress bar."""
    metrics = window.summary(peak_flops)
    run.writer.write(step, metrics)
    tok_s = metrics.get("train/tokens_per_second", math.nan)
    mfu = 100 * metrics.get("train/mfu", math.nan)
    bar.set_postfix(kl=f"{metrics['train/smoothed_kl']:.3f}", tok_s=f"{tok_s:.0f}",
                    mfu=f"{mfu:.0f}%")  # fmt: skip


def save_checkpoint(run: Run, step: int, state: TrainState, *, force: bool = False) -> None:
    """Saves ``state`` and the data position as checkpoint ``step`` (asynchronously)."""
    run.checkpointer.save(step, state, {"train": run.task.train.state()}, force=force)


# ----------------------------------------------------------------------------- the loop


def train_and_evaluate(
    config: Any, workdir: str, *, stop_at: int | None = None, break_lock: bool = False
) -> dict[str, float]:
    """Runs (or resumes) training as ``config`` says; returns the last evaluation metrics.

    ``stop_at`` ends the run after that step with a checkpoint, as a preemption would (tests
    and schedulers use it); a later call on the same workdir continues. Both, and SIGTERM or a
    first Ctrl-C (see ``Preemption``), return ``{}`` once the checkpoint is written. A bad
    config or workdir raises ``preflight.ConfigError`` before anything is read, written or
    compiled; a workdir another live run holds raises ``run_lock.WorkdirInUse`` before any work
    (``break_lock`` takes its lock anyway).
    """
    use_cpu_devices(config)  # first: preflight counts the devices, which starts JAX
    preflight.check_run(config, workdir)
    workdir = str(paths.resolve(workdir))  # a local path (made absolute) or a gs:// URI
    created = not paths.resolve(workdir).exists()
    paths.makedirs(workdir)
    lock = run_lock.acquire_on_all_processes(workdir, break_lock=break_lock)
    try:
        return train_in_workdir(config, workdir, stop_at=stop_at)
    except data.DataError:  # nothing written: a workdir this call made goes again
        if lock is not None:
            lock.release()
        if created and jax.process_index() == 0 and not any(paths.resolve(workdir).iterdir()):
            paths.resolve(workdir).rmdir()
        raise
    finally:
        if lock is not None:
            lock.release()


def use_cpu_devices(config: Any) -> None:
    """``config.cpu_devices``: split the host's CPU into that many XLA devices, which the mesh
    then uses for data parallelism (``sharding.use_cpu_devices``). It must come before the
    first JAX computation: a process whose JAX already runs with another count (a caller that
    computed before ``train_and_evaluate``) keeps its devices, with a warning."""
    preflight.check_cpu_devices(config)
    count = config.get("cpu_devices")
    if count is not None and not sharding.use_cpu_devices(count):
        have = len(jax.devices("cpu"))
        print(
            f"warning: config.cpu_devices={count} not applied: JAX already runs with {have} "
            "CPU device(s) in this process (set it before the first JAX computation)",
            file=sys.stderr,
            flush=True,
        )


def train_in_workdir(config: Any, workdir: str, *, stop_at: int | None) -> dict[str, float]:
    """``train_and_evaluate`` in ``workdir`` (resolved; its run lock held)."""
    started = clock()  # a time budget counts from here: data, vocabulary, compiling included
    is_main = jax.process_index() == 0
    log = print if is_main else (lambda *a, **k: None)

    # Data first: the vocabulary sizes decide the model.
    task = tasks.build_task(
        config, workdir, process_index=jax.process_index(), process_count=jax.process_count()
    )
    for line in task.log_lines:
        log(f"data: {line}")
    cfg = model_config(config, task)
    model = build_model(task.kind, cfg)
    if is_main:
        run_json = config.to_json_best_effort(indent=2)
        paths.write_atomic(os.path.join(workdir, "config.json"), run_json)
        paths.write_atomic(os.path.join(workdir, "model_config.json"), cfg.to_json())
        generation_path = os.path.join(workdir, "generation_config.json")
        if config.get("init_from") and not paths.resolve(generation_path).is_file():
            # The pretrained model's decoding defaults, kept for hf.export_workdir.
            generation = init_from.generation_config(config.init_from)
            if generation is not None:
                paths.write_atomic(generation_path, json.dumps(generation, indent=2) + "\n")

    # The step count: config.num_train_steps, or the one a time budget decided (None: the
    # budget decides it at its first evaluation; until then only warmup steps run).
    budget = time_budget.budget_minutes(config)
    decision = shared_decision(time_budget.read(workdir) if is_main else None)
    num_steps = (
        config.num_train_steps
        if budget is None
        else decision.num_train_steps
        if decision is not None
        else None
    )
    # Where training ends: num_steps, or the step a spent budget stopped it at.
    end = num_steps if budget is None or decision is None else decision.last_step
    if decision is not None:
        log(f"{decision.line()}, read from {time_budget.FILE}")

    # Optimizer, mesh, and the train state initialised directly into its shards.
    schedule, tx = make_optimizer(config, cfg.d_model, num_steps)
    mesh = sharding.make_mesh(config.mesh_shape)
    sharding.check_attention_fits_mesh(cfg, mesh)  # before anything is initialised
    example = jax.tree_util.tree_map(lambda x: jnp.asarray(x[:1]), task.eval_batches[0])

    def init_state():
        rng = jax.random.PRNGKey(config.seed)
        init_rng, dropout_rng = jax.random.split(rng)
        args = (
            [example["targets"]]
            if task.kind == "lm"
            else [example["inputs"]]
            if task.kind == "classification"
            else [example["inputs"], example["targets"]]
        )
        params = model.init(init_rng, *args)["params"]
        return TrainState(
            step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_rng
        )

    state, state_shardings = sharding.sharded_init(init_state, mesh)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params))
    log(f"model: {type(model).__name__}, {num_params:,} parameters, mesh {dict(mesh.shape)}")

    # Resume from the latest readable checkpoint (or config.restore_step), if any; else start
    # from pretrained weights if asked.
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints)
    resumed = checkpoint_faults.restore_for_resume(
        checkpointer, state, restore_step=config.get("restore_step"), log=log, warn=warn(is_main)
    )
    if resumed is not None:
        state, data_state = resumed
        task.train.restore(data_state["train"])
        if config.get("init_from"):
            log(f"init_from {config.init_from} ignored: the run resumes from its own checkpoint")
    elif config.get("init_from"):
        # Same model class and architecture: every parameter must be restored, and one that
        # is not (a naming or layout mismatch) is reported loudly.
        same = (
            init_from.same_architecture(init_from.pretrained_config(config.init_from), cfg)
            and init_from.pretrained_model(config.init_from) == type(model).__name__
        )
        params, summary = init_from.restore_into(
            state.params, init_from.pretrained_params(config.init_from), same_architecture=same
        )
        state = state.replace(params=jax.device_put(params, state_shardings.params))
        log(f"init_from {config.init_from}: {summary}")
        if summary.startswith("WARNING") and is_main:
            print(f"init_from {config.init_from}: {summary}", file=sys.stderr, flush=True)
    if config.get("freeze"):
        labels = jax.tree_util.tree_leaves(optim.freeze_labels(state.params, config.freeze))
        sizes = [int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params)]
        frozen = sum(n for n, label in zip(sizes, labels, strict=True) if label == "freeze")
        trained = num_params - frozen
        log(f"freeze {list(config.freeze)}: {frozen:,} parameters frozen, {trained:,} trained")

    # Jitted steps: the batch is split over ("data", "fsdp"); the state keeps its shardings.
    step_fn = jit_train_step(config, model, task.kind, tx, schedule, state_shardings, mesh)
    eval_fn = jax.jit(
        functools.partial(
            eval_step, model=model, kind=task.kind, label_smoothing=config.label_smoothing
        )
    )
    writer = MetricWriter(workdir, active=is_main)
    # Rows past the step this run starts from came from a run that died before its next
    # checkpoint: this run writes those steps again, so they go to a file of their own.
    if moved := writer.set_aside_rows_after(int(state.step)):
        log(moved)
    run = Run(
        config=config,
        task=task,
        cfg=cfg,
        mesh=mesh,
        eval_fn=eval_fn,
        checkpointer=checkpointer,
        writer=writer,
        log=log,
    )

    # MFU: analytic model FLOPs of the timed steps over the run's peak: config.peak_flops, or
    # this machine's measured matmul peak (one device's, times the accelerators; CPU devices of
    # a process share its cores, so config.cpu_devices does not halve the figure).
    peak = flops.run_peak_flops(
        config.get("peak_flops"),
        backend=jax.default_backend(),
        device_count=jax.device_count(),
        process_count=jax.process_count(),
        dtype=cfg.compute_dtype,
    )
    from tqdm import tqdm

    start_step = int(state.step)
    bar = tqdm(
        total=num_steps,
        initial=start_step,
        disable=not is_main,
        dynamic_ncols=True,
        desc="train",
    )
    # Preemption: SIGTERM on any process, or a first Ctrl-C; every process saves the same step
    # and returns.
    preemption = Preemption()
    window, pending = LogWindow(), []
    passes = 2 if config.get("rdrop_alpha", 0.0) > 0 else 1  # R-Drop runs every row twice
    compiled_shapes: set[tuple] = set()  # batch shapes step_fn has been compiled for
    paced_from: tuple[int, float] | None = None  # (step, seconds into the run) once compiled
    eval_metrics: dict[str, float] = {}
    sync = functools.partial(
        fetch_into,
        skip_nonfinite=config.skip_nonfinite_steps,
        checkpoint_dir=checkpointer.directory,
    )

    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_RULES):
            if num_steps is None and config.eval_every:  # the budget decides at an evaluation
                compile_evaluation(run, state.params)
            for step in itertools.count(start_step):
                if end is not None and step >= end:
                    break
                batch = sharding.host_local_to_global(task.train.next(), mesh)
                shapes = tuple((k, v.shape) for k, v in sorted(batch.items()))
                compiles = shapes not in compiled_shapes  # the first step, a new bucket
                if compiles:  # time the steps before it, then leave it (and its compile) out
                    sync(window, pending)
                    pending = []
                    window.stop_clock(clock())
                    compiled_shapes.add(shapes)
                timed = window.running_since is not None
                state, metrics = step_fn(state, batch)
                done = step + 1
                batch_flops = batch_train_flops(task.kind, cfg, batch) * passes
                pending.append(PendingStep(done, metrics, batch_flops, timed))
                bar.update(1)
                log_now = done % config.log_every == 0
                save_now = done % config.checkpoint_every == 0 and done != num_steps
                eval_now = bool(config.eval_every) and done % config.eval_every == 0
                preempted = preemption.reached(done - start_step)  # every step, in order
                stop = preempted or (stop_at is not None and done >= stop_at)
                sync_point = compiles or log_now or save_now or eval_now or stop
                save_failed = checkpoint_faults.save_failed(checkpointer, sync_point=sync_point)
                if not (sync_point or save_failed):
                    continue
                # A sync point: wait for the pending steps (a non-finite one raises before
                # anything is saved after it) and stop the clock while logging, saving and
                # evaluating.
                sync(window, pending)
                pending = []
                now = clock()
                window.stop_clock(now)
                if compiles and paced_from is None:
                    paced_from = (done, clock() - started)
                if save_failed:  # the steps since the last intact checkpoint are lost: no row
                    checkpoint_faults.raise_save_failure(checkpointer, done)
                if log_now or stop:  # a stopped run logs its last, partial window
                    write_train_line(run, done, window, peak, bar)
                    window = LogWindow()
                if preempted:
                    print(preemption.notice(done), flush=True)
                if save_now or stop:
                    try:  # `finally` waits for it
                        save_checkpoint(run, done, state, force=stop)
                    except SaveError:  # the save before it failed, seen while waiting for it
                        checkpoint_faults.raise_save_failure(checkpointer, done)
                if stop:
                    return {}
                if eval_now:
                    eval_metrics = evaluate(run, state.params, done)
                    if num_steps is None and paced_from is not None and done > paced_from[0]:
                        decision = shared_decision(
                            time_budget.decide(
                                minutes=budget,
                                step=done,
                                seconds_spent=clock() - started,
                                since_step=paced_from[0],
                                since_seconds=paced_from[1],
                            )
                        )
                        if is_main:
                            time_budget.write(workdir, decision)
                        log(decision.line())
                        num_steps = end = decision.num_train_steps
                        bar.total = num_steps
                        bar.refresh()
                        # The schedule now ends at num_steps: the next step compiles again.
                        schedule, tx = make_optimizer(config, cfg.d_model, num_steps)
                        step_fn = jit_train_step(
                            config, model, task.kind, tx, schedule, state_shardings, mesh
                        )
                        compiled_shapes.clear()
                elif (
                    budget is not None
                    and decision is not None
                    and done < end
                    and shared_flag(now - started >= 60.0 * decision.minutes)
                ):  # the machine slowed down since the decision: end within the budget
                    end = done
                    decision = dataclasses.replace(decision, stopped_at=done)
                    if is_main:
                        time_budget.write(workdir, decision)
                    log(time_budget.spent_line(decision, float(schedule(done))))
                    bar.total = done
                    bar.refresh()
                window.start_clock(clock())

            final = int(state.step)
            sync(window, pending)
            window.stop_clock(clock())
            if window.steps:  # the last, partial window
                write_train_line(run, final, window, peak, bar)
            if final not in checkpointer.all_steps():
                save_checkpoint(run, final, state, force=True)
            if not eval_metrics or (config.eval_every and final % config.eval_every):
                # A rerun of a finished run trains nothing: it evaluates again for its final
                # line, but its row is written already (unless that run died evaluating).
                again = final == start_step and run.writer.has_row(final, "eval/")
                eval_metrics = evaluate(run, state.params, final, write=not again)
    finally:
        bar.close()
        preemption.close()
        try:
            checkpointer.close()  # waits for the last save; raises a failure it first sees
        finally:
            # After the last save: a run killed before its checkpoints are all written keeps
            # its TensorBoard staging folder for the run that resumes it (MetricWriter).
            run.writer.close()
    return eval_metrics


def shared_decision(decision: time_budget.Decision | None) -> time_budget.Decision | None:
    """Process 0's time-budget decision on every process (each measured its own clock; the
    step count must be one)."""
    if jax.process_count() == 1:
        return decision
    from jax.experimental import multihost_utils

    mine = [-1, -1] if decision is None else [decision.num_train_steps, decision.stopped_at or -1]
    steps, stopped = (int(x) for x in multihost_utils.broadcast_one_to_all(np.int64(mine)))
    if steps < 0:
        return None
    stopped_at = None if stopped < 0 else stopped
    if decision is None:  # only process 0 reads the workdir's file
        return time_budget.Decision(math.nan, -1, math.nan, math.nan, steps, stopped_at)
    return dataclasses.replace(decision, num_train_steps=steps, stopped_at=stopped_at)


def shared_flag(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a decision from its clock, which all must
    follow at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def warn(is_main: bool) -> Callable[[str], None]:
    """Prints a line to stderr on process 0 (a fault the user must see among the progress)."""
    return (lambda line: print(line, file=sys.stderr, flush=True)) if is_main else (lambda _: None)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    config = _CONFIG.value
    try:
        use_cpu_devices(config)  # before JAX starts: jax.distributed too
    except preflight.ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    sharding.initialize_distributed(
        _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, auto=_MULTIHOST.value
    )
    try:
        metrics = train_and_evaluate(config, _WORKDIR.value, break_lock=_BREAK_LOCK.value)
    except (preflight.ConfigError, data.DataError, CheckpointError, run_lock.WorkdirInUse) as e:
        if isinstance(e, CheckpointError):
            # A failed save can leave Orbax's fragment writes as coroutines nobody awaits; their
            # "never awaited" warning at interpreter exit would print after the one line that
            # names the failure (seen once, in a fresh-clone CI's 2-process full-disk test).
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the loop): nothing more saved
        print("Ctrl-C: aborted; rerun to resume from the latest checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    if metrics and jax.process_index() == 0:  # empty: preempted, checkpoint written, exit 0
        print("final: " + json.dumps({k: round(v, 4) for k, v in metrics.items()}))


if __name__ == "__main__":
    from absl import app, flags, logging

    _CONFIG = preflight.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and logs.")
    _MULTIHOST = flags.DEFINE_bool(
        "multihost", False, "Auto-detect a multi-host run (TPU VM pod slice, SLURM)."
    )
    _COORDINATOR = flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0 for a multi-process run."
    )
    _NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
    _PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
    _BREAK_LOCK = flags.DEFINE_bool(
        "break_lock",
        False,
        "Take the workdir's run lock even from a run that looks alive (you know it is gone).",
    )
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=preflight.parse_flags)
