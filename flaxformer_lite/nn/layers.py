"""Flax linen layers: thin wrappers that hold parameters and call the pure functions.

Every parameter carries logical axis names ("embed", "heads", "kv", "mlp", "vocab"; key/value
projections "kv_embed" and "kv_heads", see ``sharding.LOGICAL_RULES``) through
``nn.with_logical_partitioning``, so sharding rules can place it without touching these layers.
Leaf modules (``MultiHeadAttention``, ``MlpBlock``, ``Embed``) take plain arguments and can be
lifted into other projects alone; the layer stacks take a ``TransformerConfig``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops import beam_cache
from flaxformer_lite.ops import positions as pos_lib
from flaxformer_lite.ops.activations import ACTIVATIONS, GATED
from flaxformer_lite.ops.attention import attention_weights, dot_product_attention
from flaxformer_lite.ops.masks import AttentionMask, combine_masks
from flaxformer_lite.ops.quantize import SCALE_SUFFIX, int8_matmul

Array = jax.Array
Dtype = Any

_xavier = nn.initializers.xavier_uniform()
_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def _param_init(init: Callable, names: tuple[str | None, ...]) -> Callable:
    return nn.with_logical_partitioning(init, names)


def _kernel(
    module: nn.Module,
    name: str,
    init: Callable,
    names: tuple[str | None, ...],
    shape: tuple[int, ...],
    param_dtype: Dtype,
    quantization: str | None,
    in_axes: int = 1,
) -> tuple[Array, Array | None]:
    """A kernel `[in..., out...]` (``in_axes`` input axes) and None; with
    ``quantization="int8"`` an int8 kernel and its per-output-channel scale `[out...]`
    (parameter ``<name>_scale``), as ``quantize.quantize_params`` writes them."""
    if quantization is None:
        return module.param(name, _param_init(init, names), shape, param_dtype), None
    kernel = module.param(name, _param_init(_zeros, names), shape, jnp.int8)
    scale_names, scale_shape = names[in_axes:], shape[in_axes:]
    scale = module.param(
        name + SCALE_SUFFIX, _param_init(_ones, scale_names), scale_shape, jnp.float32
    )
    return kernel, scale


def _matmul(
    subscripts: str, x: Array, kernel: Array, scale: Array | None, dtype: Dtype, in_axes: int = 1
) -> Array:
    """``einsum(subscripts, x, kernel)`` in ``dtype``; with a ``scale`` (an int8 kernel) the
    int8 x int8 -> int32 matmul of ``quantize.int8_matmul`` instead."""
    if scale is None:
        return jnp.einsum(subscripts, x.astype(dtype), kernel.astype(dtype))
    return int8_matmul(x, kernel, scale, in_axes).astype(dtype)


QUERY_AXES = ("embed", "heads", "kv")
# Key/value projections: their heads split over "tensor" when the tensor degree divides them;
# else (multi-query, few kv heads) their input axis does (sharding.LOGICAL_RULES).
KV_AXES = ("kv_embed", "kv_heads", "kv")


class HeadProjection(nn.Module):
    """`[batch, len, features]` -> `[batch, len, heads, head_dim]` with kernel `[embed, heads, kv]`.

    Written out instead of ``nn.DenseGeneral``, which initialises a flattened kernel and so
    cannot carry rank-3 logical axis names through sharding constraints. ``axis_names``: the
    kernel's logical names (``QUERY_AXES``, or ``KV_AXES`` for keys and values).
    """

    heads: int
    head_dim: int
    axis_names: tuple[str, str, str] = QUERY_AXES
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
        shape = (x.shape[-1], self.heads, self.head_dim)
        kernel, scale = _kernel(
            self, "kernel", init, self.axis_names, shape, self.param_dtype, self.quantization
        )
        y = _matmul("bld,dhk->blhk", x, kernel, scale, self.dtype)
        if self.use_bias:
            bias = self.param(
                "bias",
                _param_init(_zeros, self.axis_names[1:]),
                (self.heads, self.head_dim),
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


def _xavier_heads(key: Array, embed: int, heads: int, head_dim: int, dtype: Dtype) -> Array:
    """`[embed, heads, head_dim]` as ``HeadProjection`` initialises it."""
    init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
    return init(key, (embed, heads, head_dim), dtype)


def _fused_mha_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """`[embed, 3, heads, head_dim]`: query, key and value kernels each initialised as a separate
    ``HeadProjection`` would be."""
    embed, _, heads, head_dim = shape
    parts = [_xavier_heads(r, embed, heads, head_dim, dtype) for r in jax.random.split(key, 3)]
    return jnp.stack(parts, axis=1)


def _fused_kv_init(key: Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> Array:
    """`[embed, 2, kv_heads, head_dim]`: key and value kernels as separate projections."""
    embed, _, kv_heads, head_dim = shape
    parts = [_xavier_heads(r, embed, kv_heads, head_dim, dtype) for r in jax.random.split(key, 2)]
    return jnp.stack(parts, axis=1)


class FusedQKVProjection(nn.Module):
    """Self-attention's queries, keys and values with fused kernels.

    `[batch, len, features]` -> query `[batch, len, heads, head_dim]`, key and value
    `[batch, len, kv_heads, head_dim]`. Two layouts, each splitting heads under tensor
    parallelism for any ``num_kv_heads``:

    * multi-head (``kv_heads == heads``): one kernel `[embed, 3, heads, head_dim]` (query, key,
      value stacked on axis 1; logical axes ("embed", None, "heads", "kv")), one matmul: each
      tensor-parallel device holds the query, key and value of its own heads.
    * grouped- and multi-query: ``query_kernel`` `[embed, heads, head_dim]` ("embed", "heads",
      "kv") and ``kv_kernel`` `[embed, 2, kv_heads, head_dim]` ("kv_embed", None, "kv_heads",
      "kv"), two matmuls. Query heads split over "tensor"; the key/value kernel splits its kv
      heads when the tensor degree divides them, else its input axis (each device projects its
      slice of d_model, one all-reduce of the small keys/values): never replicated whole.

    Query head ``h`` uses kv head ``h // (heads // kv_heads)``, the grouping of ``attention``.
    """

    heads: int
    kv_heads: int
    head_dim: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None

    def _project(self, x: Array, name: str, init, names: tuple, shape: tuple) -> Array:
        """x `[b, l, embed]` times kernel `[embed, *shape]` (+ bias `[*shape]`)."""
        kernel, scale = _kernel(
            self,
            f"{name}kernel",
            init,
            names,
            (x.shape[-1], *shape),
            self.param_dtype,
            self.quantization,
        )
        y = _matmul("bld,d...->bl...", x, kernel, scale, self.dtype)
        if self.use_bias:
            bias_init = _param_init(_zeros, names[1:])
            bias = self.param(f"{name}bias", bias_init, shape, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, Array, Array]:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        d = self.head_dim
        if self.kv_heads == self.heads:
            names = ("embed", None, "heads", "kv")
            y = self._project(x, "", _fused_mha_init, names, (3, self.heads, d))
            return y[:, :, 0], y[:, :, 1], y[:, :, 2]
        init = lambda key, shape, dtype=jnp.float32: _xavier_heads(key, *shape, dtype)  # noqa: E731
        query = self._project(x, "query_", init, QUERY_AXES, (self.heads, d))
        names = ("kv_embed", None, "kv_heads", "kv")
        kv = self._project(x, "kv_", _fused_kv_init, names, (2, self.kv_heads, d))
        return query, kv[:, :, 0], kv[:, :, 1]


class OutputProjection(nn.Module):
    """`[batch, len, heads, head_dim]` -> `[batch, len, features]`, kernel `[heads, kv, embed]`."""

    features: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)
        names = ("heads", "kv", "embed")
        shape = (x.shape[-2], x.shape[-1], self.features)
        kernel, scale = _kernel(
            self, "kernel", init, names, shape, self.param_dtype, self.quantization, in_axes=2
        )
        y = _matmul("blhk,hkd->bld", x, kernel, scale, self.dtype, in_axes=2)
        if self.use_bias:
            bias = self.param(
                "bias", _param_init(_zeros, ("embed",)), (self.features,), self.param_dtype
            )
            y = y + bias.astype(self.dtype)
        return y


class MultiHeadAttention(nn.Module):
    """Multi-head attention (the paper's section 3.2.2), self- or cross-attention.

    Queries come from ``inputs_q`` `[batch, q_len, features]`; keys and values from ``inputs_kv``
    `[batch, kv_len, features]` (the encoder output in encoder-decoder attention) or from
    ``inputs_q`` when ``inputs_kv`` is None. With ``cross_attention=True`` and ``decode=True``
    the projected encoder keys/values are cached too, so a decoding step projects only its
    own new position (see ``_cross_cache``).

    Autoregressive decoding (``decode=True``, self-attention only) keeps the projected keys and
    values in the "cache" collection: ``cached_key``/``cached_value`` `[batch, kv_heads,
    max_len, head_dim]` (heads first, the order attention's dots read; see ``heads_first``).
    Calling ``init`` with ``decode=True`` on inputs of length ``max_len`` allocates it. The
    layer keeps no counter: each decode call passes the absolute positions of its ``q_len`` new
    tokens as ``positions_q`` (consecutive, the same in every row; the caller, e.g.
    ``models.Decoder``, counts them), writes their keys/values at cache slots ``positions_q[0]``
    and attends causally to everything cached. One token per step or a whole prompt at once: a
    step projects only its new positions and reads the fixed-size cache under a mask (fixed
    shapes keep one compiled step), instead of re-running the whole prefix. Writing past
    ``max_len`` raises (see ``check_cache_room``) instead of overwriting the last slot.

    ``window`` (restricted self-attention, causal: position p sees p - window .. p) applies to
    decoding only (without a cache the window comes in the ``AttentionMask``). When the cache
    is allocated for at least ``window`` positions it becomes a ring buffer of ``window``
    slots (position p in slot p % window): a step attends to the ring (the ``window`` positions
    before it) followed by its own new keys, then writes them over the oldest slots. The cache
    is then ``[batch, kv_heads, window, head_dim]`` whatever ``max_len``, and decoding may go
    on past ``max_len`` (as far as the positions allow).

    Attention weights `[batch, heads, q_len, kv_len]` (float32) are sown as
    ``intermediates/.../attention_weights`` when the caller makes that collection mutable
    (``apply(..., mutable=["intermediates"])``); otherwise nothing is computed or kept for them.

    ``fused_qkv=True`` projects self-attention queries, keys and values with a
    ``FusedQKVProjection`` (parameters under "qkv" instead of "query"/"key"/"value");
    cross-attention always keeps its separate projections.

    ``quantization="int8"``: every projection holds an int8 kernel and its per-output-channel
    scales (``quantize.quantize_params``) and multiplies in int8 (``quantize.int8_matmul``).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    dropout_rate: float = 0.0
    use_bias: bool = True
    use_rotary: bool = False
    cross_attention: bool = False
    fused_qkv: bool = False
    implementation: str = "xla"
    window: int | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None

    def _project(self, x: Array, heads: int, name: str) -> Array:
        """`[batch, len, features]` -> `[batch, len, heads, head_dim]`."""
        return HeadProjection(
            heads,
            self.head_dim,
            axis_names=QUERY_AXES if name == "query" else KV_AXES,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            name=name,
        )(x)

    def _project_qkv(self, x: Array, kv_heads: int) -> tuple[Array, Array, Array]:
        """`[batch, len, features]` -> query `[batch, len, heads, head_dim]`, key and value
        `[batch, len, kv_heads, head_dim]`, from one fused kernel."""
        return FusedQKVProjection(
            self.num_heads,
            kv_heads,
            self.head_dim,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            name="qkv",
        )(x)

    def _rotate(self, x: Array, positions: Array | None) -> Array:
        """Rotary embedding of queries or keys `[batch, len, heads, head_dim]` at ``positions``
        `[batch|1, len]` (default 0..len-1); the identity without ``use_rotary``."""
        if not self.use_rotary:
            return x
        if positions is None:
            positions = jnp.arange(x.shape[1])[None]
        return pos_lib.rotary(x, positions)

    def _project_kv(self, source: Array, kv_heads: int, positions: Array | None):
        """Keys (rotated at ``positions``) and values `[batch, len, kv_heads, head_dim]`."""
        key = self._project(source, kv_heads, "key")
        return self._rotate(key, positions), self._project(source, kv_heads, "value")

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        mask: Array | None = None,
        bias: Array | None = None,
        *,
        positions_q: Array | None = None,
        positions_kv: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        check_cache: bool = True,
        beam_size: int = 1,
        beam_ancestors: Array | None = None,
    ) -> Array:
        """Returns `[batch, q_len, features]`.

        mask: bool broadcastable to `[batch, heads, q_len, kv_len]`, or a ``masks.AttentionMask``
        (what the models pass: blockwise and cuDNN attention then never build the `[q_len,
        kv_len]` matrix; decoding self-attention takes arrays only). positions_q/positions_kv:
        int `[batch, len]`, used by rotary embeddings (default: 0..len-1; self-attention keys
        default to ``positions_q``). Keys are rotated once, when projected: cached keys are
        stored rotated, so ``decode=True`` and ``decode=False`` agree wherever no cache entry
        from an earlier call is read. check_cache: under ``jit``, check at run time that a
        decode step fits in the cache (``check_cache_room``); callers that size the cache for
        every step they take (``generate``) turn it off.

        beam_size, beam_ancestors (``decode=True`` only; see ``beam_cache``): rows are
        ``batch * beam_size`` hypotheses, beam-major per source. Cross-attention then reads one
        cache entry per source (``cross_key`` `[batch, kv_heads, src_len, ...]`, ``inputs_kv``
        `[batch, src_len, d]`): the queries of a source's beams are grouped onto it.
        Self-attention with ``beam_ancestors`` int `[rows, slots]` (slots: the cache's, the
        ring's plus ``q_len`` for a sliding window) attends, for each row, over the keys of
        every beam of its source masked to the row's history, so the cache is never reordered;
        without it, each row attends over its own cache row (the reordering search).
        """
        features = inputs_q.shape[-1]
        kv_heads = self.num_kv_heads or self.num_heads
        self_attention = inputs_kv is None and not self.cross_attention
        if self_attention and positions_kv is None:
            positions_kv = positions_q
        if self.fused_qkv and self_attention:
            query, key, value = self._project_qkv(inputs_q, kv_heads)
            key = self._rotate(key, positions_kv)
        else:
            query = self._project(inputs_q, self.num_heads, "query")
            if self.cross_attention and decode:
                key, value = self._cross_cache(inputs_kv, kv_heads, positions_kv)
            else:
                if self.cross_attention and inputs_kv is None:
                    raise ValueError("cross-attention needs inputs_kv (the encoder output)")
                kv_source = inputs_q if self_attention else inputs_kv
                key, value = self._project_kv(kv_source, kv_heads, positions_kv)
        query = self._rotate(query, positions_q)

        if decode and self_attention:
            if isinstance(mask, AttentionMask):
                raise ValueError(
                    "decode=True self-attention builds its causal mask over the cache; pass an "
                    "array mask `[batch, heads, q_len, max_len]` (or None), not an AttentionMask"
                )
            key, value, mask = self._update_cache(key, value, mask, positions_q, check_cache)
        beams = decode and beam_size > 1 and (self.cross_attention or beam_ancestors is not None)
        if beams:
            rows, q_len = query.shape[:2]
            query = beam_cache.group_queries(query, beam_size)
        if beams and not self.cross_attention:
            slots = key.shape[1]
            if beam_ancestors.shape != (rows, slots):
                raise ValueError(
                    f"beam_ancestors must be [rows, slots] = ({rows}, {slots}) for this cache; "
                    f"got {beam_ancestors.shape}"
                )
            mask = beam_cache.history_mask(beam_ancestors, beam_size, q_len, mask)
            if bias is not None:
                bias = beam_cache.group_bias(bias, rows, beam_size, q_len, slots)

        dropout_rng = None
        if self.dropout_rate > 0.0 and not deterministic:
            dropout_rng = self.make_rng("dropout")
        # Weights only when someone collects them: sow is a no-op unless "intermediates" is
        # mutable, and then the weights are not computed either.
        want_weights = self.is_mutable_collection("intermediates")
        if beams and not self.cross_attention:
            if self.implementation == "xla" and dropout_rng is None and not want_weights:
                out = beam_cache.attend_beams(query, key, value, mask, bias, beam_size)
                return self._output(beam_cache.ungroup_queries(out, beam_size), features)
            key = beam_cache.group_keys(key, beam_size)
            value = beam_cache.group_keys(value, beam_size)
        out = dot_product_attention(
            query,
            key,
            value,
            mask,
            bias,
            dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            return_weights=want_weights and self.implementation == "xla",
            implementation=self.implementation,
        )
        if want_weights:
            if self.implementation == "xla":
                out, weights = out
            else:  # cuDNN and blockwise never materialise them: the reference computes them
                if isinstance(mask, AttentionMask):
                    mask = mask.dense(query.shape[1], key.shape[1])
                weights = attention_weights(query, key, mask, bias)
            self.sow("intermediates", "attention_weights", weights)
        if beams:
            out = beam_cache.ungroup_queries(out, beam_size)
        return self._output(out, features)

    def _output(self, out: Array, features: int) -> Array:
        """`[batch, len, heads, head_dim]` -> `[batch, len, features]`."""
        return OutputProjection(
            features,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            name="out",
        )(out)

    def _cross_cache(
        self, inputs_kv: Array | None, kv_heads: int, positions_kv: Array | None
    ) -> tuple[Array, Array]:
        """Encoder keys/values for decoding, projected once per batch instead of every step.

        A call with the encoder output (``inputs_kv``) projects and stores them in the cache
        (``cross_key``/``cross_value``, heads first: `[batch, kv_heads, src_len, head_dim]`, see
        ``heads_first``); later calls with ``inputs_kv=None`` read them back. Returns them
        `[batch, src_len, kv_heads, head_dim]`.
        """
        if inputs_kv is not None:
            key, value = self._project_kv(inputs_kv, kv_heads, positions_kv)
            shape = heads_first(key).shape
            cached_key = self.variable("cache", "cross_key", jnp.zeros, shape, key.dtype)
            cached_value = self.variable("cache", "cross_value", jnp.zeros, shape, value.dtype)
            cached_key.value, cached_value.value = heads_first(key), heads_first(value)
            return key, value
        if not self.has_variable("cache", "cross_key"):
            raise ValueError(
                "cross-attention decoding without inputs_kv reads projected encoder keys from "
                "the cache: call it once with the encoder output first"
            )
        cached = self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value")
        return heads_first(cached[0]), heads_first(cached[1])

    def _update_cache(
        self, key: Array, value: Array, mask: Array | None, positions_q: Array | None, check: bool
    ) -> tuple[Array, Array, Array | None]:
        """Writes the new keys/values `[batch, q_len, kv_heads, head_dim]` at cache slots
        ``positions_q[0]``; returns the whole cache `[batch, max_len, kv_heads, head_dim]` and
        its causal mask. The cache is stored heads first (``heads_first``)."""
        initialized = self.has_variable("cache", "cached_key")
        batch, length, kv_heads, head_dim = key.shape
        if self.window is not None and length >= self.window:
            length = self.window  # a ring buffer (see the class docstring)
        shape = (batch, kv_heads, length, head_dim)
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, value.dtype)
        if not initialized:  # the init call only allocates the cache
            return key, value, mask
        q_len, max_len = key.shape[1], cached_key.value.shape[2]
        if self.window is not None and max_len == self.window and q_len:
            if positions_q is None:
                raise ValueError("decode=True self-attention needs positions_q `[batch, q_len]`")
            return self._update_ring(cached_key, cached_value, key, value, mask, positions_q)
        if q_len == 0:  # nothing to write (a call that only fills the cross-attention cache)
            return heads_first(cached_key.value), heads_first(cached_value.value), mask
        if positions_q is None:
            raise ValueError(
                "decode=True self-attention needs positions_q `[batch, q_len]`: the absolute "
                "positions of the new tokens (the first is the cache slot written)"
            )
        positions = positions_q[0].astype(jnp.int32)  # [q_len]
        index = positions[0]
        check_cache_room(index, q_len, max_len, runtime=check)
        zero = jnp.array(0, jnp.int32)
        start = (zero, zero, index, zero)
        cached_key.value = jax.lax.dynamic_update_slice(
            cached_key.value, heads_first(key).astype(cached_key.value.dtype), start
        )
        cached_value.value = jax.lax.dynamic_update_slice(
            cached_value.value, heads_first(value).astype(cached_value.value.dtype), start
        )
        # New query i (absolute position index + i) sees cached positions <= index + i.
        distance = positions[:, None] - jnp.arange(max_len)[None, :]  # [q_len, max_len]
        allowed = distance >= 0
        if self.window is not None:  # a cache shorter than the window: nothing falls out yet
            allowed = allowed & (distance <= self.window)
        mask = combine_masks(mask, allowed[None, None])
        return heads_first(cached_key.value), heads_first(cached_value.value), mask

    def _update_ring(
        self,
        cached_key: Any,
        cached_value: Any,
        key: Array,
        value: Array,
        mask: Array | None,
        positions_q: Array,
    ) -> tuple[Array, Array, Array | None]:
        """Sliding-window decoding from a ring buffer of ``window`` slots.

        cached_key/cached_value: the "cache" variables `[batch, kv_heads, window, head_dim]`,
        slot s holding the newest position p < index with p % window == s. key/value: the new
        `[batch, q_len, kv_heads, head_dim]` at positions index .. index + q_len - 1
        (``positions_q[0]``). Returns keys/values `[batch, window + q_len, ...]` (the ring, then
        the new ones) and the mask `[1, 1, q_len, window + q_len]` (combined with ``mask``) of
        the causal window over them, and writes the new keys over the oldest slots.
        """
        ring = self.window
        positions = positions_q[0].astype(jnp.int32)  # [q_len]
        index, last = positions[0], positions[-1]
        slots = jnp.arange(ring, dtype=jnp.int32)
        key_positions = ring_key_positions(positions, ring)  # [window + q_len]
        distance = positions[:, None] - key_positions[None, :]
        allowed = (key_positions[None, :] >= 0) & (distance >= 0) & (distance <= ring)
        new_key = heads_first(key).astype(cached_key.value.dtype)
        new_value = heads_first(value).astype(cached_value.value.dtype)
        keys = jnp.concatenate([cached_key.value, new_key], axis=2)
        values = jnp.concatenate([cached_value.value, new_value], axis=2)
        # After the write slot s holds the newest position <= last in its residue class: a new
        # one (at ring + its offset in the concatenation) or the one it held.
        newest = last - jnp.mod(last - slots, ring)
        source = jnp.where(newest >= index, ring + newest - index, slots)  # [window]
        cached_key.value = jnp.take(keys, source, axis=2)
        cached_value.value = jnp.take(values, source, axis=2)
        return heads_first(keys), heads_first(values), combine_masks(mask, allowed[None, None])


def heads_first(x: Array) -> Array:
    """`[batch, length, heads, head_dim]` <-> `[batch, heads, length, head_dim]` (its own inverse).

    Decoding caches are stored heads first: attention's two dots batch over (batch, heads), and
    XLA's CPU dots want the batch dimensions leading, so a cache stored `[batch, length, heads,
    head_dim]` was copied whole into that order by every layer at every step (about 30% of a
    greedy step at opus-mt size, bench/README.md). Read back through this transpose, the
    stored order is the one the dots use and XLA folds the two transposes away.
    """
    return jnp.swapaxes(x, 1, 2)


def ring_key_positions(positions: Array, ring: int) -> Array:
    """The positions of the keys a ring-buffer decoding step attends over, int32 `[ring +
    q_len]`: slot s of the ring holds the newest position p < index with p % ring == s (< 0:
    empty), then come the new positions ``positions`` `[q_len]` (index, index + 1, ...)."""
    positions = positions.astype(jnp.int32)
    index = positions[0]
    slots = jnp.arange(ring, dtype=jnp.int32)
    held = (index - 1) - jnp.mod(index - 1 - slots, ring)
    return jnp.concatenate([held, positions])


def _raise_cache_full(index: Any, *, q_len: int, max_len: int) -> None:
    raise ValueError(
        f"decode=True writes {q_len} new position(s) from position {int(index)} into a key/value "
        f"cache of max_len={max_len} (positions 0..{max_len - 1}): the cache is full. Allocate "
        "a longer cache (init with longer decoder inputs, up to TransformerConfig.max_len) or "
        "stop decoding earlier."
    )


def check_cache_room(index: Array, q_len: int, max_len: int, *, runtime: bool = True) -> None:
    """Raises ValueError unless positions ``index .. index + q_len - 1`` fit in a cache of
    ``max_len`` slots (``dynamic_update_slice`` would otherwise clamp the write onto the last
    slots and decoding would go on with corrupted keys).

    ``q_len`` and ``max_len`` are static: ``q_len > max_len`` raises while tracing. A concrete
    ``index`` (eager ``apply``) is checked in Python. A traced one (under ``jit``) is checked on
    the device, and only where the write would overflow does a ``jax.debug.callback`` raise
    (surfacing as a ``JaxRuntimeError`` carrying this message when the result is used); with
    ``runtime=False`` that check is left out (the caller guarantees the room statically: a
    ``lax.cond`` per layer and step costs a host synchronisation on GPUs).
    """
    if q_len > max_len:
        _raise_cache_full(0, q_len=q_len, max_len=max_len)
    try:
        concrete = int(index)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        concrete = None
    if concrete is not None:
        if concrete + q_len > max_len:
            _raise_cache_full(concrete, q_len=q_len, max_len=max_len)
        return
    if runtime:
        raise_full = functools.partial(_raise_cache_full, q_len=q_len, max_len=max_len)
        jax.lax.cond(
            index + q_len > max_len,
            lambda: jax.debug.callback(raise_full, index),
            lambda: None,
        )


class MlpBlock(nn.Module):
    """Position-wise feed-forward network: `[..., features]` -> `[..., features]`.

    "relu" is the paper's max(0, xW1 + b1)W2 + b2; "gelu" swaps the non-linearity; "swiglu" and
    "geglu" are the gated variants act(xW_gate) * (xW_up) W_down (Shazeer 2020). The names are
    ``activations.ACTIVATIONS``. No dropout inside: the paper's residual dropout follows the
    block (``residual``). ``quantization="int8"``: ``Int8Dense`` layers instead of ``nn.Dense``.
    """

    d_ff: int
    activation: str = "relu"
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        def dense(features: int, names: tuple[str, str], name: str) -> nn.Module:
            if self.quantization is not None:
                return Int8Dense(features, names, self.use_bias, self.dtype, name=name)
            return nn.Dense(
                features,
                use_bias=self.use_bias,
                kernel_init=_param_init(_xavier, names),
                bias_init=_param_init(_zeros, (names[1],)),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=name,
            )

        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}; got {self.activation!r}"
            )
        h = ACTIVATIONS[self.activation](dense(self.d_ff, ("embed", "mlp"), "wi")(x))
        if self.activation in GATED:
            h = h * dense(self.d_ff, ("embed", "mlp"), "wi_up")(x)
        return dense(x.shape[-1], ("mlp", "embed"), "wo")(h)


class Int8Dense(nn.Module):
    """``nn.Dense`` with an int8 kernel: `[..., in]` -> `[..., features]`.

    Parameters as ``nn.Dense``'s (``kernel`` `[in, features]`, int8 here, and ``bias``) plus
    ``kernel_scale`` `[features]`; ``names``: the kernel's logical axes.
    """

    features: int
    names: tuple[str, str]
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (x.shape[-1], self.features)
        kernel, scale = _kernel(self, "kernel", _zeros, self.names, shape, jnp.int8, "int8")
        y = int8_matmul(x, kernel, scale).astype(self.dtype)
        if self.use_bias:
            bias = self.param("bias", _param_init(_zeros, self.names[1:]), (self.features,))
            y = y + bias.astype(self.dtype)
        return y


class Embed(nn.Module):
    """Token embedding `[vocab, features]` with ``attend`` for tied pre-softmax logits.

    Initialised N(0, features^-1/2): multiplied by sqrt(features) on lookup (the paper's scaling),
    the embedded tokens have unit variance, the scale of the sinusoids they are added to.
    ``scale=False`` looks tokens up unscaled (Marian models with ``scale_embedding=False``).
    ``int8_attend``: ``attend`` multiplies in int8 by ``attend_kernel`` int8 `[features, vocab]`
    (the table transposed, quantized per vocabulary entry, with ``attend_kernel_scale``
    `[vocab]`; ``quantize.quantize_params``), while lookups keep reading the float table.
    """

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scale: bool = True
    int8_attend: bool = False

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            _param_init(nn.initializers.normal(self.features**-0.5), ("vocab", "embed")),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )
        if self.int8_attend:
            shape = (self.features, self.num_embeddings)
            self.attend_kernel, self.attend_scale = _kernel(
                self, "attend_kernel", _zeros, ("embed", "vocab"), shape, jnp.int8, "int8"
            )

    def __call__(self, tokens: Array) -> Array:
        """int `[batch, length]` -> `[batch, length, features]`, scaled by sqrt(features)
        when ``scale``."""
        table = jnp.asarray(self.embedding, self.dtype)
        x = jnp.take(table, tokens, axis=0)
        return x * jnp.asarray(self.features**0.5, self.dtype) if self.scale else x

    def attend(self, x: Array) -> Array:
        """`[batch, length, features]` -> logits `[batch, length, vocab]` (x times table^T)."""
        if self.int8_attend:
            return int8_matmul(x, self.attend_kernel, self.attend_scale).astype(self.dtype)
        table = jnp.asarray(self.embedding, self.dtype)
        return tied_logits(x.astype(self.dtype), table)


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """`[..., features]` x `[vocab, features]` -> `[..., vocab]`: ``x @ table.T``.

    The gradient of ``table`` is taken as ``(x^T @ g)^T``: the `[features, vocab]` product,
    then its transpose. Autodiff's ``g^T @ x`` makes XLA's CPU backend (its YNNPACK dots take
    row-major operands only) copy the logits' gradient `[tokens, vocab]` into a transposed
    layout first, the largest array of the step (64 MB at 2,048 tokens x 8,192 ids); here
    only ``x`` (`[tokens, features]`) and the result (`[features, vocab]`) are transposed.
    An ``optimization_barrier`` keeps XLA from folding the transpose back into the dot.
    """
    return jnp.einsum("...d,vd->...v", x, table)


def _tied_logits_fwd(x, table):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g):
    x, table = residuals
    d_x = jnp.einsum("...v,vd->...d", g, table)
    flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    d_table_t = jax.lax.optimization_barrier(flat_x.T @ flat_g)  # [features, vocab]
    return d_x, d_table_t.T.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


def make_norm(config: TransformerConfig, name: str) -> nn.Module:
    kw = dict(
        epsilon=config.layer_norm_epsilon,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        scale_init=_param_init(nn.initializers.ones_init(), ("embed",)),
        name=name,
    )
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(**kw)
    return nn.LayerNorm(bias_init=_param_init(_zeros, ("embed",)), **kw)


def residual(
    x: Array,
    sublayer: Callable[[Array], Array],
    norm: nn.Module,
    dropout: nn.Dropout,
    *,
    pre_norm: bool,
    deterministic: bool,
) -> Array:
    """Post-LN LayerNorm(x + Dropout(f(x))) (the paper) or pre-LN x + Dropout(f(LN(x)))."""
    y = dropout(sublayer(norm(x) if pre_norm else x), deterministic=deterministic)
    return x + y if pre_norm else norm(x + y)


def _attention(
    config: TransformerConfig, name: str, *, cross: bool = False, window: int | None = None
) -> MultiHeadAttention:
    return MultiHeadAttention(
        num_heads=config.num_heads,
        head_dim=config.effective_head_dim,
        num_kv_heads=config.num_kv_heads,
        dropout_rate=config.attention_dropout_rate,
        use_bias=config.use_bias,
        # Rotary encodes distances within one sequence; queries and keys of cross-attention
        # live in different sequences, so it applies to self-attention only.
        use_rotary=config.position == "rotary" and not cross,
        cross_attention=cross,
        fused_qkv=config.fused_qkv and not cross,
        implementation=config.attention_implementation,
        window=window,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        quantization=config.quantization,
        name=name,
    )


def _feed_forward(
    config: TransformerConfig, moe: bool, deterministic: bool, valid: Array | None = None
) -> Callable[[Array], Array]:
    """The layer's feed-forward sub-layer: ``MlpBlock``, or ``moe.MoeBlock`` in a
    mixture-of-experts layer (routing only the ``valid`` `[batch, length]` tokens)."""
    if not moe:
        return _mlp(config)
    from flaxformer_lite.nn.moe import MoeBlock

    block = MoeBlock(
        num_experts=config.num_experts,
        k=config.num_experts_per_token,
        d_ff=config.d_ff,
        capacity_factor=config.expert_capacity_factor,
        activation=config.activation,
        use_bias=config.use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        name="moe",
    )
    return lambda h: block(h, valid, deterministic=deterministic)


def _mlp(config: TransformerConfig) -> MlpBlock:
    return MlpBlock(
        d_ff=config.d_ff,
        activation=config.activation,
        use_bias=config.use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.parameter_dtype,
        quantization=config.quantization,
        name="mlp",
    )


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual sub-layer. `[b, s, d]` -> `[b, s, d]`.

    Only arrays are call arguments (the flags are attributes), so ``nn.remat`` and ``nn.scan``
    take the layer as it is (``models.layer_stack``). ``moe``: the feed-forward block is a
    mixture of experts (``moe.MoeBlock``, routing the real tokens of ``mask.query_valid``).
    """

    config: TransformerConfig
    deterministic: bool = True
    moe: bool = False

    @nn.compact
    def __call__(
        self, x: Array, mask: Any, positions: Array | None = None, bias: Array | None = None
    ) -> Array:
        """bias: added to the self-attention logits, `[batch|1, heads, len, len]` (the stack's
        relative position bias)."""
        cfg = self.config
        kw = dict(pre_norm=cfg.norm_position == "pre", deterministic=self.deterministic)
        dropout = nn.Dropout(cfg.dropout_rate)
        attn = _attention(cfg, "self_attention")

        def self_attention(h: Array) -> Array:
            return attn(
                h, None, mask, bias, positions_q=positions, deterministic=self.deterministic
            )

        x = residual(x, self_attention, make_norm(cfg, "self_attention_norm"), dropout, **kw)
        valid = getattr(mask, "query_valid", None)
        ffn = _feed_forward(cfg, self.moe, self.deterministic, valid)
        return residual(x, ffn, make_norm(cfg, "mlp_norm"), dropout, **kw)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward; each a residual sub-layer.

    `[b, t, d]` -> `[b, t, d]`. With ``cross_attention=False`` (decoder-only models) the middle
    sub-layer is absent. ``decode=True`` runs the self-attention from its key/value cache
    (``positions`` are then the new tokens' absolute positions, see ``MultiHeadAttention``), and
    the encoder-decoder attention from cached encoder keys/values when ``encoded`` is None.
    ``check_cache``: see ``MultiHeadAttention``. Only arrays are call arguments. ``moe``: the
    feed-forward block is a mixture of experts (``moe.MoeBlock``, routing the positions that
    ``valid`` marks, every position when it is None).
    ``beam_size`` (with ``decode=True``): rows are ``batch * beam_size`` beam-search
    hypotheses; the cross-attention cache and ``encoded`` have ``batch`` rows, and
    ``beam_ancestors`` (when given) makes self-attention follow each row's history through an
    unmoved cache (``MultiHeadAttention``, ``beam_cache``).
    """

    config: TransformerConfig
    cross_attention: bool = True
    deterministic: bool = True
    decode: bool = False
    check_cache: bool = True
    moe: bool = False
    beam_size: int = 1

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array | None,
        self_mask: Any,
        cross_mask: Any,
        positions: Array | None = None,
        bias: Array | None = None,
        beam_ancestors: Array | None = None,
        valid: Array | None = None,
    ) -> Array:
        """bias: added to the self-attention logits, `[batch|1, heads, len, kv_len]` (the
        stack's relative position bias; with ``decode=True`` kv_len is the cache length).
        beam_ancestors: int `[batch * beam_size, slots]`, see ``beam_cache``. valid: bool
        `[batch, len]`, the real positions (padding is not routed by a mixture of experts)."""
        cfg = self.config
        kw = dict(pre_norm=cfg.norm_position == "pre", deterministic=self.deterministic)
        dropout = nn.Dropout(cfg.dropout_rate)
        self_attn = _attention(cfg, "self_attention", window=cfg.self_attention_window("decoder"))

        def self_attention(h: Array) -> Array:
            return self_attn(
                h,
                None,
                self_mask,
                bias,
                positions_q=positions,
                deterministic=self.deterministic,
                decode=self.decode,
                check_cache=self.check_cache,
                beam_size=self.beam_size,
                beam_ancestors=beam_ancestors,
            )

        x = residual(x, self_attention, make_norm(cfg, "self_attention_norm"), dropout, **kw)
        if self.cross_attention:
            cross_attn = _attention(cfg, "cross_attention", cross=True)

            def cross_attention(h: Array) -> Array:
                return cross_attn(
                    h,
                    encoded,
                    cross_mask,
                    deterministic=self.deterministic,
                    decode=self.decode,
                    beam_size=self.beam_size if self.decode else 1,
                )

            x = residual(x, cross_attention, make_norm(cfg, "cross_attention_norm"), dropout, **kw)
        ffn = _feed_forward(cfg, self.moe, self.deterministic, valid)
        return residual(x, ffn, make_norm(cfg, "mlp_norm"), dropout, **kw)
