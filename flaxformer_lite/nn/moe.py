"""Mixture-of-experts feed-forward block: top-k routing with a capacity per expert.

The pure functions do the routing arithmetic; ``MoeBlock`` holds the router and the expert
weights and replaces ``nn.mlp.MlpBlock`` in the layers that ``TransformerConfig.moe_every``
selects.

Routing, for each group of tokens (one sequence of the batch, so groups never span devices):

1. The router (a bias-free `[d_model, experts]` projection, float32) gives probabilities
   p = softmax(router logits) per token; each token picks its ``k`` most probable experts.
   The combine weights are those probabilities renormalised over the k choices (with k = 1,
   the probability itself, as in the Switch Transformer).
2. Capacity: an expert takes at most ``C = ceil(capacity_factor * tokens * k / experts)``
   tokens of a group, ``tokens`` counting the group's *real* tokens only (the ``valid`` mask:
   padding is never routed, never takes a slot and never counts). Assignments fill slots in
   priority order: every real token's first choice, in token order, then every second choice,
   and so on (GShard), so a token loses its first choice only when its expert is full of
   earlier first choices. An assignment beyond ``C`` is dropped: it adds nothing to the
   block's output (the residual connection still carries the token). Without a capacity
   factor (evaluation and decoding) nothing is dropped. So a row's outputs do not depend on
   padding appended to it (or to other rows), in training as in evaluation.
3. Dispatch is a scatter of token vectors into an `[groups, experts, slots, d_model]` buffer
   (``slots``: the capacity of a group of the padded length, an upper bound of every group's
   C) and combine a gather back, by (expert, slot) indices: nothing of size
   `[tokens, experts, C]` (GShard's one-hot dispatch tensor) is ever built.

Auxiliary losses (sown into the ``"losses"`` collection, which the training step makes
mutable and adds to its objective; elsewhere ``sow`` does nothing):

* load balancing (Switch Transformer, eq. 4, over all k choices):
  ``experts * sum_e f_e * P_e``, f_e the fraction of assignments routed to expert e (before
  capacity), P_e the mean router probability of e; 1 when routing is uniform.
* router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.

Also sown: ``moe_dropped``, the fraction of assignments dropped for capacity.

Routing statistics, sown into "losses" too, from which the training step forms the auxiliary
losses of a whole batch (``routing_statistics``; sums, so micro-batches add up): per expert,
``moe_expert_counts`` (assignments of real tokens, before capacity) and ``moe_prob_sums``
(router probabilities summed over real tokens); ``moe_tokens`` (real tokens routed),
``moe_z_sum`` (their logsumexp(router logits)^2 summed) and ``moe_kept`` (assignments kept).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import unfreeze

from flaxformer_lite.core.logical_params import logical_init, read_param
from flaxformer_lite.ops.activations import ACTIVATIONS, GATED

Array = jax.Array


def capacity(tokens: int, num_experts: int, k: int, factor: float | None) -> int:
    """Slots per expert for a group of ``tokens``: ``ceil(factor * tokens * k / experts)``,
    at most ``tokens`` (an expert never gets a token twice); ``tokens`` when ``factor`` is None
    (no limit)."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def group_capacity(
    valid: Array | None, groups: int, tokens: int, num_experts: int, k: int, factor: float | None
) -> Array:
    """Each group's capacity, int32 `[groups]`: ``capacity(real tokens of the group, ...)``,
    the real tokens counted by ``valid`` (bool `[groups, tokens]`; None: all ``tokens``).
    Read from a table of ``capacity`` over 0..tokens, so it is exactly that formula."""
    table = jnp.asarray([capacity(n, num_experts, k, factor) for n in range(tokens + 1)])
    if valid is None:
        return jnp.full((groups,), table[tokens], jnp.int32)
    return table[jnp.sum(valid.astype(jnp.int32), axis=1)].astype(jnp.int32)


def route(
    router_logits: Array,
    k: int,
    slots: int,
    valid: Array | None = None,
    limit: Array | None = None,
) -> tuple[Array, Array, Array, Array]:
    """Top-k routing with capacity for groups of tokens.

    Args:
      router_logits: float `[groups, tokens, experts]`.
      k: experts per token.
      slots: slots of each expert per group in the dispatch buffer (static); the capacity
        unless ``limit`` is given.
      valid: optional bool `[groups, tokens]`; False tokens (padding) are not routed, take
        no slot and do not move the real tokens' priority.
      limit: optional int `[groups]`, each group's capacity (at most ``slots``; see
        ``group_capacity``): an assignment at a slot >= its group's limit is dropped.

    Returns:
      expert: int32 `[groups, tokens, k]`, the chosen experts (most probable first);
      slot: int32 `[groups, tokens, k]`, each assignment's slot in its expert, ``slots`` when
      dropped (over capacity, or an invalid token);
      gate: float32 `[groups, tokens, k]`, the combine weights (0 where dropped);
      probs: float32 `[groups, tokens, experts]`, the router probabilities.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_p, expert = jax.lax.top_k(probs, k)  # [g, t, k]
    gate = top_p / jnp.sum(top_p, axis=-1, keepdims=True) if k > 1 else top_p
    chosen = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)  # [g, t, k, e]
    if valid is not None:
        chosen = chosen * valid[:, :, None, None].astype(jnp.int32)
    # Priority order: choice-major (all first choices, then all second ...), token order inside.
    g, t = expert.shape[:2]
    ordered = jnp.swapaxes(chosen, 1, 2).reshape(g, k * t, num_experts)
    position = jnp.cumsum(ordered, axis=1) - ordered  # assignments to e before this one
    position = jnp.swapaxes(position.reshape(g, k, t, num_experts), 1, 2)  # [g, t, k, e]
    slot = jnp.sum(position * chosen, axis=-1)  # [g, t, k]
    cap = slots if limit is None else jnp.minimum(limit, slots)[:, None, None]
    kept = (slot < cap) & (jnp.sum(chosen, axis=-1) > 0)
    slot = jnp.where(kept, slot, slots).astype(jnp.int32)
    return expert.astype(jnp.int32), slot, jnp.where(kept, gate, 0.0), probs


def load_balancing_loss(probs: Array, expert: Array, valid: Array | None = None) -> Array:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e P_e`` over valid tokens.

    probs `[groups, tokens, experts]`, expert int `[groups, tokens, k]` (assignments before
    capacity), valid bool `[groups, tokens]` or None. 1.0 for perfectly uniform routing."""
    num_experts = probs.shape[-1]
    w = jnp.ones(probs.shape[:2], jnp.float32) if valid is None else valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    counts = jnp.sum(jax.nn.one_hot(expert, num_experts) * w[:, :, None, None], axis=(0, 1, 2))
    fraction = counts / (n * expert.shape[-1])
    mean_prob = jnp.sum(probs * w[:, :, None], axis=(0, 1)) / n
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(router_logits: Array, valid: Array | None = None) -> Array:
    """ST-MoE's z-loss: mean over valid tokens of logsumexp(logits)^2 (keeps logits small)."""
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1) ** 2
    if valid is None:
        return jnp.mean(z)
    w = valid.astype(jnp.float32)
    return jnp.sum(z * w) / jnp.maximum(jnp.sum(w), 1.0)


STATISTICS = ("moe_expert_counts", "moe_prob_sums", "moe_tokens", "moe_z_sum", "moe_kept")


def routing_statistics(losses: Any) -> dict[str, Array]:
    """The routing statistics every ``MoeBlock`` of a model sowed into its "losses" collection
    (``apply(..., mutable=["losses"])[1]["losses"]``), one row per mixture-of-experts layer:
    ``moe_expert_counts`` and ``moe_prob_sums`` `[layers, experts]`, ``moe_tokens``,
    ``moe_z_sum`` and ``moe_kept`` `[layers]` (a scanned stack gives one row per layer; the
    order is the collection's, the same on every call of one model). {} when there are none."""
    flat = traverse_util.flatten_dict(unfreeze(losses)) if losses else {}
    out = {}
    for key in STATISTICS:
        values = [v for path, leaf in flat.items() if path[-1] == key for v in leaf]
        if values:
            shape = (-1, values[0].shape[-1]) if key in STATISTICS[:2] else (-1,)
            out[key] = jnp.concatenate([jnp.reshape(v, shape) for v in values])
    return out


def batch_auxiliary_losses(
    statistics: dict[str, Array], totals: dict[str, Array] | None = None
) -> dict[str, Array]:
    """The auxiliary losses, each the mean over mixture-of-experts layers, of the batch whose
    routing ``totals`` are given (``routing_statistics`` of that batch, or the sums of those of
    its parts; None: ``statistics`` themselves), as this part's additive share.

    Per layer, with C_e the batch's assignments to expert e before capacity, A = sum_e C_e
    (its real tokens x k), N its real tokens, and this part's router probabilities summed per
    expert P_e, z-losses summed Z and kept assignments K:

    * ``moe_aux_loss``: ``experts * sum_e (C_e / A) (P_e / N)`` (Switch Transformer eq. 4);
    * ``router_z_loss``: ``Z / N``;
    * ``moe_dropped``: ``(A_part - K) / A``, A_part this part's assignments.

    Each is linear in the part's statistics given the batch's C, A and N, which carry no
    gradient (assignments are an argmax; stopped here too): the shares of a batch's parts sum
    to the losses of the whole batch, in value and in gradient, so that gradient accumulation
    gives the update of one big batch (``train.train_step``). With ``totals`` None this is
    ``load_balancing_loss``, ``router_z_loss`` and the block's ``moe_dropped``, layer-averaged.
    """
    totals = statistics if totals is None else totals
    counts = jax.lax.stop_gradient(totals["moe_expert_counts"])  # [layers, experts]
    assigned = jnp.maximum(jnp.sum(counts, axis=-1), 1.0)  # [layers]
    tokens = jnp.maximum(jax.lax.stop_gradient(totals["moe_tokens"]), 1.0)
    num_experts = counts.shape[-1]
    fraction = counts / assigned[:, None]
    balance = num_experts * jnp.sum(fraction * statistics["moe_prob_sums"], -1) / tokens
    own = jnp.sum(statistics["moe_expert_counts"], axis=-1)
    return {
        "moe_aux_loss": jnp.mean(balance),
        "router_z_loss": jnp.mean(statistics["moe_z_sum"] / tokens),
        "moe_dropped": jnp.mean((own - statistics["moe_kept"]) / assigned),
    }


def dispatch(x: Array, expert: Array, slot: Array, num_experts: int, slots: int) -> Array:
    """Token vectors x `[groups, tokens, d]` into expert buffers `[groups, experts, slots, d]`
    at (expert, slot); dropped assignments (slot == ``slots``) go nowhere."""
    g, t, k = expert.shape
    buffer = jnp.zeros((g, num_experts, slots, x.shape[-1]), x.dtype)
    rows = jnp.broadcast_to(jnp.arange(g)[:, None, None], (g, t, k))
    values = jnp.broadcast_to(x[:, :, None, :], (g, t, k, x.shape[-1]))
    return buffer.at[rows, expert, slot].set(values, mode="drop")


def combine(y: Array, expert: Array, slot: Array, gate: Array) -> Array:
    """Expert outputs y `[groups, experts, slots, d]` back to tokens `[groups, tokens, d]`:
    the gate-weighted sum over each token's kept assignments."""
    g, t, k = expert.shape
    rows = jnp.broadcast_to(jnp.arange(g)[:, None, None], (g, t, k))
    picked = y.at[rows, expert, slot].get(mode="fill", fill_value=0)  # [g, t, k, d]
    return jnp.einsum("gtkd,gtk->gtd", picked, gate.astype(picked.dtype))


class MoeBlock(nn.Module):
    """``num_experts`` feed-forward experts (``MlpBlock``'s arithmetic, one weight set per
    expert), top-``k`` routed. `[batch, length, d_model]` -> same; each batch row is a group.

    ``capacity_factor`` applies when ``deterministic`` is False (training), per group to its
    real tokens (``valid``, bool `[batch, length]`; None: every position is real); evaluation
    and decoding route every token to its k experts (no capacity, nothing dropped), so cached
    decoding computes what the full forward does.
    """

    num_experts: int
    k: int
    d_ff: int
    capacity_factor: float | None = 1.25
    activation: str = "relu"
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, valid: Array | None = None, *, deterministic: bool = True):
        e, d = self.num_experts, x.shape[-1]
        router = read_param(
            self,
            "router",
            logical_init(nn.initializers.normal(0.02), ("embed", None)),
            (d, e),
            self.param_dtype,
        )
        logits = jnp.einsum("gtd,de->gte", x.astype(jnp.float32), router.astype(jnp.float32))
        factor = None if deterministic else self.capacity_factor
        g, t = x.shape[:2]
        slots = capacity(t, e, self.k, factor)  # the buffer: every group's capacity fits
        # Without a capacity factor (evaluation, decoding) no group can exceed its slots: an
        # expert takes each real token at most once. No per-group limit then, and none of
        # group_capacity's table over 0..t, which a symbolic length (jax.export) cannot build.
        limit = None if factor is None else group_capacity(valid, g, t, e, self.k, factor)
        expert, slot, gate, probs = route(logits, self.k, slots, valid, limit)
        self.sow("losses", "moe_aux_loss", load_balancing_loss(probs, expert, valid))
        self.sow("losses", "router_z_loss", router_z_loss(logits, valid))
        w = jnp.ones((g, t), jnp.float32) if valid is None else valid.astype(jnp.float32)
        tokens = jnp.sum(w)
        kept = jnp.sum(slot < slots).astype(jnp.float32)
        self.sow("losses", "moe_dropped", 1.0 - kept / jnp.maximum(tokens * self.k, 1.0))
        if self.is_mutable_collection("losses"):  # the statistics of ``routing_statistics``
            counts = jax.nn.one_hot(expert, e, dtype=jnp.float32) * w[:, :, None, None]
            z = jax.nn.logsumexp(logits, axis=-1) ** 2
            self.sow("losses", "moe_expert_counts", jnp.sum(counts, axis=(0, 1, 2)))
            self.sow("losses", "moe_prob_sums", jnp.sum(probs * w[:, :, None], axis=(0, 1)))
            self.sow("losses", "moe_tokens", tokens)
            self.sow("losses", "moe_z_sum", jnp.sum(z * w))
            self.sow("losses", "moe_kept", kept)

        def weights(name: str, shape: tuple[int, ...], names: tuple[str | None, ...], init):
            return read_param(
                self, name, logical_init(init, names), shape, self.param_dtype
            ).astype(self.dtype)

        kernel_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", batch_axis=(0,))
        zeros = nn.initializers.zeros_init()
        h_in = dispatch(x.astype(self.dtype), expert, slot, e, slots)  # [g, e, c, d]
        # Plain einsums here, not ops.precision.einsum_in: XLA's CPU fallback dot (DotThunk)
        # has no bfloat16 x bfloat16 -> float32 for this expert-batched layout.
        wi = weights("wi", (e, d, self.d_ff), ("expert", "embed", "mlp"), kernel_init)
        h = jnp.einsum("gecd,edf->gecf", h_in, wi)
        if self.use_bias:
            h = h + weights("wi_bias", (e, self.d_ff), ("expert", "mlp"), zeros)[None, :, None]
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}; got {self.activation!r}"
            )
        h = ACTIVATIONS[self.activation](h)
        if self.activation in GATED:
            up = weights("wi_up", (e, d, self.d_ff), ("expert", "embed", "mlp"), kernel_init)
            u = jnp.einsum("gecd,edf->gecf", h_in, up)
            if self.use_bias:
                u = (
                    u
                    + weights("wi_up_bias", (e, self.d_ff), ("expert", "mlp"), zeros)[None, :, None]
                )
            h = h * u
        wo = weights("wo", (e, self.d_ff, d), ("expert", "mlp", "embed"), kernel_init)
        y = jnp.einsum("gecf,efd->gecd", h, wo)
        if self.use_bias:
            y = y + weights("wo_bias", (e, d), ("expert", "embed"), zeros)[None, :, None]
        return combine(y, expert, slot, gate).astype(self.dtype)
