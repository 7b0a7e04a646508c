"""Scaled dot-product attention as pure functions: no Flax state, safe under jit, vmap and grad.

Shapes, everywhere in this module::

  query  `[batch, q_len, heads, head_dim]`
  key    `[batch, kv_len, kv_heads, head_dim]`   (``heads`` a multiple of ``kv_heads``)
  value  `[batch, kv_len, kv_heads, head_dim]`
  mask   bool, broadcastable to `[batch, heads, q_len, kv_len]`, True where attention is allowed;
         or a ``masks.AttentionMask`` (causal flag, query/key validity, segment ids: O(length))
  bias   float, broadcastable to `[batch, heads, q_len, kv_len]`, added to the logits

``kv_heads < heads`` is multi-query (``kv_heads == 1``) or grouped-query attention: each group of
``heads // kv_heads`` query heads shares one key/value head. The grouping is done by reshaping the
query, never by materialising repeated keys.

The ``implementation`` switch is the one place a faster kernel plugs in::

  "xla"   the plain reference: einsum, masked float32 softmax, einsum (default, all backends);
  "cudnn" ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN flash attention, where
          ``cudnn_unsupported_reason`` finds nothing against it (an NVIDIA GPU, float16/bfloat16,
          head_dim a multiple of 8 up to 128, or 256 from Hopper on, ...); an ``AttentionMask``
          goes to cuDNN as ``is_causal``, sequence lengths and a causal sliding window (a window
          without causal is refused with the warning), not as a matrix. Anywhere else it
          runs the "xla" reference after one warning that says why;
  "blockwise" ``blockwise.blockwise_attention``: online softmax over key blocks in pure JAX with
          a recomputing backward, memory linear in sequence length (long sequences); an
          ``AttentionMask`` is applied block by block; future key blocks and key blocks outside its
          window are skipped.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.blockwise import blockwise_attention
from flaxformer_lite.ops.masks import AttentionMask
from flaxformer_lite.ops.shapes import check_shapes

Array = jax.Array
MaskLike = Array | AttentionMask | None
Implementation = Literal["xla", "cudnn", "blockwise"]
# The one list of implementations (TransformerConfig.attention_implementation is checked on it).
IMPLEMENTATIONS = ("xla", "cudnn", "blockwise")


def logits_scale(head_dim: int, scale: float | None = None) -> float:
    """The factor on ``q . k``: ``scale``, or 1/sqrt(head_dim) (the paper's) when None.

    Raises:
      ValueError: ``scale`` is not a number > 0.
    """
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be None (1/sqrt(head_dim)) or a number > 0; got {scale!r}")
    return float(scale)


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
    scale: float | None = None,
) -> Array:
    """Softmax attention probabilities, `[batch, heads, q_len, kv_len]`, in float32.

    Logits are ``q . k * scale`` plus ``bias`` (``scale`` None: 1/sqrt(head_dim), the paper's;
    T5 uses 1.0, see ``logits_scale``); disallowed positions get the most negative
    finite float32 (a literal like -1e9 overflows in float16 and is not exact in bfloat16). A query
    row with nothing allowed gets all-zero weights, so its output is zero and its gradient finite.
    """
    check_shapes(query, key, key)
    heads, kv_heads = query.shape[2], key.shape[2]
    q = _group_heads(query, kv_heads)  # [b, q, kvh, g, d]
    scale = jnp.asarray(logits_scale(query.shape[-1], scale), query.dtype)
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


def _as_dense_mask(mask) -> Array | None:
    """A boolean array mask of any rank <= 4, as `[b|1, h|1, q|1, k|1]`."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
    if mask.ndim > 4:
        raise ValueError(
            f"mask must broadcast to [batch, heads, q_len, kv_len] (rank <= 4); got {mask.shape}"
        )
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


# ----------------------------------------------------------------------------- cuDNN dispatch

CUDNN_DTYPES = ("float16", "bfloat16")


def cudnn_unsupported_reason(
    *,
    backend: str,
    dtypes: Sequence[str],
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    dense_mask_or_bias: bool,
    segments: bool = False,
    compute_capability: tuple[int, int] | None = None,
    window: int | None = None,
    causal: bool = False,
) -> str | None:
    """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` cannot take this call, or
    None when it can. Pure: the same answer for the same description, on any machine.

    Args:
      backend: "cuda", "rocm", "cpu", "tpu" (``current_backend()``).
      dtypes: the dtype names of query, key and value.
      query_shape: `[batch, q_len, heads, head_dim]`; key_shape `[batch, kv_len, kv_heads, d]`.
      dense_mask_or_bias: an array mask or a bias goes to cuDNN (as an additive bias; an
        ``AttentionMask`` without segment ids does not, it becomes ``is_causal``/lengths).
      segments: an ``AttentionMask`` with segment ids (cuDNN gets them as a dense mask).
      compute_capability: the GPU's (major, minor); Hopper (9, 0) on allows head_dim 256.
      window, causal: an ``AttentionMask``'s local window and causal flag. cuDNN takes a window
        only as a causal sliding window (jax passes it as ``sliding_window`` and refuses a
        window to the right of the diagonal), so a window without ``causal`` is refused.

    The limits are jax 0.10's own checks (``jax._src.cudnn.fused_attention_stablehlo``:
    ``check_layout``, ``check_is_flash_attention``) for the non-FP8 flash kernel.
    """
    if backend != "cuda":
        return f"the backend is {backend!r}; cuDNN attention needs an NVIDIA GPU ('cuda')"
    if window is not None and not causal:
        return (
            f"a bidirectional local window (window {window} without causal): cuDNN supports "
            "only a causal sliding window (TransformerConfig.attention_window_layers='decoder' "
            "keeps it off the encoder)"
        )
    if len(set(dtypes)) != 1:
        return f"query, key and value dtypes differ ({', '.join(dtypes)})"
    if dtypes[0] not in CUDNN_DTYPES:
        return (
            f"dtype {dtypes[0]}: cuDNN flash attention takes {' or '.join(CUDNN_DTYPES)} "
            "(TransformerConfig.dtype)"
        )
    _, q_len, _, head_dim = query_shape
    kv_len = key_shape[1]
    if q_len == 0 or kv_len == 0:
        return f"an empty sequence (q_len {q_len}, kv_len {kv_len})"
    max_dim = 256 if compute_capability is not None and tuple(compute_capability) >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_dim:
        return (
            f"head_dim {head_dim}: cuDNN needs a multiple of 8 up to {max_dim} "
            f"(compute capability {compute_capability})"
        )
    if (dense_mask_or_bias or segments) and (q_len % 2 or kv_len % 2):
        return (
            f"a mask/bias matrix with odd lengths (q_len {q_len}, kv_len {kv_len}): cuDNN's "
            "backward with a bias needs even ones"
        )
    return None


def current_backend() -> str:
    """ "cuda" or "rocm" for GPUs, else jax's backend name ("cpu", "tpu")."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = jax.extend.backend.get_backend().platform_version.lower()
        return "cuda" if "cuda" in version else "rocm"
    return backend


def _compute_capability() -> tuple[int, int] | None:
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return major, minor


@functools.cache
def warn_cudnn_fallback(reason: str) -> None:
    """One RuntimeWarning per distinct reason per process (``cache_clear()`` re-arms it)."""
    warnings.warn(
        f"attention_implementation='cudnn' runs the XLA reference instead: {reason}",
        RuntimeWarning,
        stacklevel=4,
    )


def _cudnn_attention(
    query: Array, key: Array, value: Array, mask, bias, scale: float | None = None
) -> Array | None:
    """cuDNN flash attention with our contract (zeros for rows with nothing allowed), or None
    (after one warning) where cuDNN cannot run it."""
    structured = isinstance(mask, AttentionMask)
    segments = structured and mask.query_segment_ids is not None
    dense_mask = None if structured else mask
    reason = cudnn_unsupported_reason(
        backend=current_backend(),
        dtypes=[str(x.dtype) for x in (query, key, value)],
        query_shape=query.shape,
        key_shape=key.shape,
        dense_mask_or_bias=dense_mask is not None or bias is not None,
        segments=segments,
        compute_capability=_compute_capability(),
        window=mask.window if structured else None,
        causal=structured and mask.causal,
    )
    if reason is not None:
        warn_cudnn_fallback(reason)
        return None
    b, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
    kw: dict = {}
    guards = []  # [b|1, q_len|1, heads|1] bool: rows whose output is kept (else zero)
    if structured:
        kw["is_causal"] = mask.causal
        if mask.window is not None:  # causal here (see cudnn_unsupported_reason): j >= i - window
            kw["local_window_size"] = (mask.window, 0)
        lengths = {}
        for name, valid, length in (
            ("query_seq_lengths", mask.query_valid, q_len),
            ("key_value_seq_lengths", mask.key_valid, kv_len),
        ):
            if valid is None:
                continue
            valid = jnp.broadcast_to(valid, (b, length))
            n = jnp.sum(valid, axis=1, dtype=jnp.int32)
            kw[name] = lengths[name] = n
            # cuDNN takes lengths: exact when the padding is trailing (every batch here pads at
            # the end). Rows that pad elsewhere would be silently wrong, so they come out NaN.
            trailing = jnp.all(valid == (jnp.arange(length)[None] < n[:, None]), axis=1)
            guards.append(jnp.where(trailing, True, jnp.nan)[:, None, None])
        if segments:
            dense_mask = AttentionMask(
                query_segment_ids=mask.query_segment_ids, key_segment_ids=mask.key_segment_ids
            ).dense(q_len, kv_len)
        row_ok = jnp.ones((1, q_len), bool)
        if mask.query_valid is not None:
            row_ok = row_ok & jnp.asarray(mask.query_valid)
        if "key_value_seq_lengths" in lengths:
            row_ok = row_ok & (lengths["key_value_seq_lengths"] > 0)[:, None]
        guards.append(row_ok[:, :, None])
    if dense_mask is not None:
        dense_mask = jnp.broadcast_to(dense_mask, (*dense_mask.shape[:2], q_len, kv_len))
        guards.append(jnp.swapaxes(jnp.any(dense_mask, axis=-1), 1, 2))  # [b|1, q, h|1]
    if bias is not None:
        bias = jnp.asarray(bias)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        bias = jnp.broadcast_to(bias, (*bias.shape[:2], q_len, kv_len)).astype(query.dtype)
    try:
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=dense_mask, implementation="cudnn",
            scale=logits_scale(query.shape[-1], scale), **kw,
        )  # fmt: skip
    except (NotImplementedError, ValueError, RuntimeError) as err:  # jax's own checks
        warn_cudnn_fallback(f"jax.nn.dot_product_attention refused it ({err})")
        return None
    for keep in guards:
        if keep.dtype == jnp.bool_:
            # jax.nn leaves fully masked rows as the mean of the values; our contract is zeros.
            out = jnp.where(keep[..., None], out, 0)
        else:
            out = out * keep[..., None].astype(out.dtype)
    return out


def _blockwise(query, key, value, mask, bias, scale: float | None = None) -> Array:
    if not isinstance(mask, AttentionMask):
        return blockwise_attention(query, key, value, mask, bias, scale=scale)
    out = blockwise_attention(
        query,
        key,
        value,
        None,
        bias,
        causal=mask.causal,
        window=mask.window,
        key_padding=mask.key_valid,
        query_segment_ids=mask.query_segment_ids,
        key_segment_ids=mask.key_segment_ids,
        scale=scale,
    )
    if mask.query_valid is not None:  # padded query rows attend to nothing: zeros
        out = jnp.where(jnp.asarray(mask.query_valid)[:, :, None, None], out, 0)
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
    scale: float | None = None,
) -> Array | tuple[Array, Array]:
    """softmax(q k^T / sqrt(head_dim) + bias, masked) v, as in the paper's equation (1).

    Args:
      query: `[batch, q_len, heads, head_dim]`.
      key: `[batch, kv_len, kv_heads, head_dim]`, ``heads % kv_heads == 0``.
      value: `[batch, kv_len, kv_heads, head_dim]`.
      mask: bool, broadcastable to `[batch, heads, q_len, kv_len]` (any rank <= 4); True = may
        attend. Or a ``masks.AttentionMask``, which "blockwise" and "cudnn" use without ever
        building the `[q_len, kv_len]` matrix (the reference path builds it).
      bias: broadcastable to `[batch, heads, q_len, kv_len]`; added to the logits (relative
        position schemes such as T5's bucketed bias enter here).
      dropout_rate: dropout on the attention weights (the paper's attention dropout).
      dropout_rng: PRNG key, required when dropout is active.
      deterministic: disables dropout.
      return_weights: also return the weights `[batch, heads, q_len, kv_len]` (float32).
      implementation: "xla" (reference, default), "cudnn" (cuDNN flash attention where
        ``cudnn_unsupported_reason`` allows it, else the reference with one warning) or
        "blockwise" (memory-efficient); the last two take no dropout and return no weights.
      scale: the factor on ``q k^T`` (None: 1/sqrt(head_dim); T5: 1.0, its query kernels
        absorb the scaling), the same in every implementation.

    Returns:
      `[batch, q_len, heads, head_dim]` in the dtype of ``value``; and the weights when asked.
      Query rows with no allowed key return zeros (and finite gradients).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1); got {dropout_rate}")
    check_shapes(query, key, value)
    logits_scale(query.shape[-1], scale)  # a bad scale fails here, whatever the path
    use_dropout = dropout_rate > 0.0 and not deterministic
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False")
    if isinstance(mask, AttentionMask):
        mask.check()
    else:
        mask = _as_dense_mask(mask)

    if implementation in ("cudnn", "blockwise"):
        if use_dropout or return_weights:
            raise ValueError(
                f"implementation={implementation!r} supports neither attention dropout nor "
                "return_weights; use implementation='xla'"
            )
        if implementation == "blockwise":
            return _blockwise(query, key, value, mask, bias, scale)
        out = _cudnn_attention(query, key, value, mask, bias, scale)
        if out is not None:
            return out
    if isinstance(mask, AttentionMask):
        mask = mask.dense(query.shape[1], key.shape[1])

    weights = attention_weights(query, key, mask, bias, scale)
    if use_dropout:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights_used = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    else:
        weights_used = weights
    out = apply_attention_weights(weights_used, value)
    return (out, weights) if return_weights else out
