"""Scaled dot-product attention as pure functions: no Flax state, safe under jit, vmap and grad.

Shapes, everywhere in this module:
  query  `[batch, q_len, heads, head_dim]`
  key    `[batch, kv_len, kv_heads, head_dim]`   (``heads`` a multiple of ``kv_heads``)
  value  `[batch, kv_len, kv_heads, head_dim]`
  mask   bool, broadcastable to `[batch, heads, q_len, kv_len]`, True where attention is allowed
  bias   float, broadcastable to `[batch, heads, q_len, kv_len]`, added to the logits

``kv_heads < heads`` is multi-query (``kv_heads == 1``) or grouped-query attention: each group of
``heads // kv_heads`` query heads shares one key/value head. The grouping is done by reshaping the
query, never by materialising repeated keys.

The ``implementation`` switch is the one place a faster kernel plugs in:
  "xla"   the plain reference: einsum, masked float32 softmax, einsum (default, all backends);
  "cudnn" ``jax.nn.dot_product_attention`` (XLA's fused kernel; cuDNN flash attention on GPU);
  "blockwise" ``blockwise.blockwise_attention``: online softmax over key blocks in pure JAX with
          a recomputing backward, memory linear in sequence length (long sequences).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
Implementation = Literal["xla", "cudnn", "blockwise"]
IMPLEMENTATIONS = ("xla", "cudnn", "blockwise")


def check_shapes(query: Array, key: Array, value: Array) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, length, heads, head_dim] (rank 4); got shape {x.shape}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes must match; got {key.shape} and {value.shape}")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(
            "query and key must share batch and head_dim; "
            f"got query {query.shape} and key {key.shape}"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"query heads ({query.shape[2]}) must be a multiple of key/value heads ({key.shape[2]})"
        )


def _group_heads(x: Array, kv_heads: int) -> Array:
    """`[batch, len, heads, d]` -> `[batch, len, kv_heads, heads // kv_heads, d]`."""
    b, n, h, d = x.shape
    return x.reshape(b, n, kv_heads, h // kv_heads, d)


def _grouped(x: Array | None, kv_heads: int, heads: int) -> Array | None:
    """Broadcastable `[b|1, heads|1, q, k]` -> `[b|1, kv_heads|1, groups|1, q, k]`."""
    if x is None:
        return None
    x = jnp.asarray(x)
    while x.ndim < 4:
        x = x[None]
    if x.shape[1] == 1:
        return x[:, :, None]
    if x.shape[1] != heads:
        raise ValueError(f"mask/bias head axis must be 1 or {heads}; got shape {x.shape}")
    return x.reshape(x.shape[0], kv_heads, heads // kv_heads, *x.shape[2:])


def attention_weights(
    query: Array,
    key: Array,
    mask: Array | None = None,
    bias: Array | None = None,
) -> Array:
    """Softmax attention probabilities, `[batch, heads, q_len, kv_len]`, in float32.

    Logits are ``q . k / sqrt(head_dim)`` plus ``bias``; disallowed positions get the most negative
    finite float32 (a literal like -1e9 overflows in float16 and is not exact in bfloat16). A query
    row with nothing allowed gets all-zero weights, so its output is zero and its gradient finite.
    """
    check_shapes(query, key, key)
    heads, kv_heads = query.shape[2], key.shape[2]
    q = _group_heads(query, kv_heads)  # [b, q, kvh, g, d]
    scale = jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
    # Low-precision inputs multiply in their own dtype (fast on TPU/GPU) and accumulate in float32.
    logits = jnp.einsum(
        "bqhgd,bkhd->bhgqk", q * scale, key, preferred_element_type=jnp.float32
    )  # [b, kvh, g, q, k]
    if bias is not None:
        logits = logits + _grouped(bias, kv_heads, heads).astype(jnp.float32)
    grouped_mask = _grouped(mask, kv_heads, heads)
    if grouped_mask is not None:
        logits = jnp.where(grouped_mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if grouped_mask is not None:
        # softmax of an all-masked row is uniform; zero it so "nothing to attend to" means zero.
        weights = jnp.where(grouped_mask, weights, 0.0)
    b, kvh, g, ql, kl = weights.shape
    return weights.reshape(b, kvh * g, ql, kl)


def apply_attention_weights(weights: Array, value: Array) -> Array:
    """Weighted sum of values.

    weights `[batch, heads, q_len, kv_len]`, value `[batch, kv_len, kv_heads, d]`
    -> `[batch, q_len, heads, d]`.
    """
    b, h, ql, kl = weights.shape
    kv_heads = value.shape[2]
    w = weights.reshape(b, kv_heads, h // kv_heads, ql, kl).astype(value.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", w, value)
    return out.reshape(b, ql, h, value.shape[-1])


def _cudnn_attention(query: Array, key: Array, value: Array, mask: Array | None, bias) -> Array:
    out = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask)
    if mask is not None:
        # jax.nn leaves fully masked rows as the mean of the values; our contract is zeros.
        any_allowed = jnp.any(jnp.broadcast_to(mask, mask.shape[:3] + (key.shape[1],)), axis=-1)
        out = jnp.where(jnp.swapaxes(any_allowed, 1, 2)[..., None], out, 0)
    return out


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    bias: Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    implementation: Implementation = "xla",
) -> Array | tuple[Array, Array]:
    """softmax(q k^T / sqrt(head_dim) + bias, masked) v, as in the paper's equation (1).

    Args:
      query: `[batch, q_len, heads, head_dim]`.
      key: `[batch, kv_len, kv_heads, head_dim]`, ``heads % kv_heads == 0``.
      value: `[batch, kv_len, kv_heads, head_dim]`.
      mask: bool, broadcastable to `[batch, heads, q_len, kv_len]`; True = may attend.
      bias: broadcastable to `[batch, heads, q_len, kv_len]`; added to the logits (relative
        position schemes such as T5's bucketed bias enter here).
      dropout_rate: dropout on the attention weights (the paper's attention dropout).
      dropout_rng: PRNG key, required when dropout is active.
      deterministic: disables dropout.
      return_weights: also return the weights `[batch, heads, q_len, kv_len]` (float32).
      implementation: "xla" (reference, default), "cudnn" (``jax.nn.dot_product_attention``)
        or "blockwise" (memory-efficient); the last two take no dropout and return no weights.

    Returns:
      `[batch, q_len, heads, head_dim]` in the dtype of ``value``; and the weights when asked.
      Query rows with no allowed key return zeros (and finite gradients).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1); got {dropout_rate}")
    check_shapes(query, key, value)
    use_dropout = dropout_rate > 0.0 and not deterministic
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")

    if implementation in ("cudnn", "blockwise"):
        if use_dropout or return_weights:
            raise ValueError(
                f"implementation={implementation!r} supports neither attention dropout nor "
                "return_weights; use implementation='xla'"
            )
        if implementation == "blockwise":
            # Imported here: blockwise.py reuses this module's shape checks.
            from flaxformer_lite.blockwise import blockwise_attention

            return blockwise_attention(query, key, value, mask, bias)
        return _cudnn_attention(query, key, value, mask, bias)

    weights = attention_weights(query, key, mask, bias)
    if use_dropout:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights_used = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    else:
        weights_used = weights
    out = apply_attention_weights(weights_used, value)
    return (out, weights) if return_weights else out
