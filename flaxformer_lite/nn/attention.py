"""``MultiHeadAttention``: the paper's attention layer, in every mode the models run it.

One layer serves self-attention and cross-attention, training and cached decoding, with
separate or fused projections, rotary positions, a sliding window and beam search. Each mode
has its own method, named for when it runs, and ``__call__`` only picks them:

  projections     ``_self_attention_qkv`` (separate or fused kernels, rotary at the queries'
                  and keys' positions), ``_cross_attention_kv`` (the encoder's keys and values,
                  from the cache when decoding: ``_cross_cache``)
  the cache       ``_self_attention_cache`` (decode=True self-attention) allocates, then
                  ``_write_full_cache`` (position p in slot p) or ``_write_ring_buffer``
                  (a sliding window: position p in slot p % window)
  the attention   ``_attend`` (every mode), ``_attend_cross_beams`` (beam search: a source's
                  beams share its encoder keys), ``_attend_beams_in_place`` (beam search over
                  a self-attention cache that is never reordered, ``ops.beam_cache``)

The pure pieces are in ``ops`` (``attention``, ``kv_cache``, ``beam_cache``, ``positions``); the
projections in ``nn.projections``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.nn.projections import (
    KV_AXES,
    QUERY_AXES,
    FusedQKVProjection,
    HeadProjection,
    OutputProjection,
)
from flaxformer_lite.ops import beam_cache, kv_cache
from flaxformer_lite.ops import positions as pos_lib
from flaxformer_lite.ops.attention import attention_weights, dot_product_attention
from flaxformer_lite.ops.kv_cache import heads_first
from flaxformer_lite.ops.masks import AttentionMask, combine_masks

Array = jax.Array
Dtype = Any


class MultiHeadAttention(nn.Module):
    """Multi-head attention (the paper's section 3.2.2), self- or cross-attention.

    Queries come from ``inputs_q`` `[batch, q_len, features]`; keys and values from ``inputs_kv``
    `[batch, kv_len, features]` (the encoder output in encoder-decoder attention) or from
    ``inputs_q`` when ``inputs_kv`` is None. With ``cross_attention=True`` and ``decode=True``
    the projected encoder keys/values are cached too, so a decoding step projects only its
    own new position (see ``_cross_cache``).

    Autoregressive decoding (``decode=True``, self-attention only) keeps the projected keys and
    values in the "cache" collection: ``cached_key``/``cached_value`` `[batch, kv_heads,
    max_len, head_dim]` (heads first, the order attention's dots read; see
    ``kv_cache.heads_first``). Calling ``init`` with ``decode=True`` on inputs of length
    ``max_len`` allocates it. The layer keeps no counter: each decode call passes the absolute
    positions of its ``q_len`` new tokens as ``positions_q`` (consecutive, the same in every
    row; the caller, e.g. ``models.Decoder``, counts them), writes their keys/values at cache
    slots ``positions_q[0]`` and attends causally to everything cached. One token per step or
    a whole prompt at once: a step projects only its new positions and reads the fixed-size
    cache under a mask (fixed shapes keep one compiled step), instead of re-running the whole
    prefix; without dropout or collected weights only the cache's prefix that holds the
    written slots is read (``kv_cache.over_written_prefix``). Writing past ``max_len`` raises
    (see ``kv_cache.check_cache_room``) instead of overwriting the last slot.

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

    ``rope_theta`` / ``rope_scaling``: the rotary frequencies (``TransformerConfig``'s; both
    None: ``positions.rotary``'s own, else ``positions.rope_inv_freq``).
    ``qkv_bias``: biases on the query, key and value projections (None: ``use_bias``; the
    output projection follows ``use_bias`` alone).

    ``quantization="int8"``: every projection holds an int8 kernel and its per-output-channel
    scales (``quantize.quantize_params``) and multiplies in int8 (``quantize.int8_matmul``).

    ``logits_scale``: the factor on the query-key dot products, None for the paper's
    1/sqrt(head_dim); T5 takes 1.0 (its query kernels absorb the scaling).
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
    int8_kernel: str = "auto"  # with an int8 kernel: what multiplies it (quantize.int8_product)
    rope_theta: float | None = None
    rope_scaling: tuple[float, float, float, int] | None = None
    qkv_bias: bool | None = None
    logits_scale: float | None = None

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
        left_padding: Array | None = None,
    ) -> Array:
        """Returns `[batch, q_len, features]`.

        mask: bool broadcastable to `[batch, heads, q_len, kv_len]`, or a ``masks.AttentionMask``
        (what the models pass: blockwise and cuDNN attention then never build the `[q_len,
        kv_len]` matrix; decoding self-attention takes arrays only). positions_q/positions_kv:
        int `[batch, len]`, used by rotary embeddings (default: 0..len-1; self-attention keys
        default to ``positions_q``). Keys are rotated once, when projected: cached keys are
        stored rotated, so ``decode=True`` and ``decode=False`` agree wherever no cache entry
        from an earlier call is read. check_cache: under ``jit``, check at run time that a
        decode step fits in the cache (``kv_cache.check_cache_room``); callers that size the
        cache for every step they take (``generate``) turn it off.

        beam_size, beam_ancestors (``decode=True`` only; see ``beam_cache``): rows are
        ``batch * beam_size`` hypotheses, beam-major per source. Cross-attention then reads one
        cache entry per source (``cross_key`` `[batch, kv_heads, src_len, ...]`, ``inputs_kv``
        `[batch, src_len, d]`): the queries of a source's beams are grouped onto it.
        Self-attention with ``beam_ancestors`` int `[rows, slots]` (slots: the cache's, the
        ring's plus ``q_len`` for a sliding window) attends, for each row, over the keys of
        every beam of its source masked to the row's history, so the cache is never reordered;
        without it, each row attends over its own cache row (the reordering search).

        left_padding (``decode=True`` self-attention over the full cache only): int `[batch]`,
        how many slots each row's left-padded prompt starts with. Those slots are hidden from
        every query and slot s is rotated as position ``s - left_padding`` (what Hugging
        Face's generate does with an attention mask: positions ``cumsum(mask) - 1``), while
        ``positions_q`` still names the slots written.
        """
        self_attention = inputs_kv is None and not self.cross_attention
        written = None  # the full decoding cache's slots in use (kv_cache.over_written_prefix)
        if left_padding is not None:
            if not (decode and self_attention):
                raise ValueError(
                    "left_padding applies to decode=True self-attention (a left-padded prompt "
                    "in the key/value cache); without a cache pass positions and a mask"
                )
            if positions_q is None:
                raise ValueError("decode=True self-attention needs positions_q `[batch, q_len]`")
            rotary_positions = positions_q - left_padding[:, None].astype(positions_q.dtype)
            query, key, value = self._self_attention_qkv(inputs_q, rotary_positions, None)
            key, value, mask, written = self._self_attention_cache(
                key, value, mask, positions_q, check_cache, left_padding
            )
        elif self_attention:
            query, key, value = self._self_attention_qkv(inputs_q, positions_q, positions_kv)
        else:
            query = self._rotate(self._project(inputs_q, self.num_heads, "query"), positions_q)
            key, value = self._cross_attention_kv(inputs_kv, positions_kv, decode=decode)
        if decode and self_attention and left_padding is None:
            key, value, mask, written = self._self_attention_cache(
                key, value, mask, positions_q, check_cache
            )

        dropout_rng = None
        if self.dropout_rate > 0.0 and not deterministic:
            dropout_rng = self.make_rng("dropout")
        if decode and beam_size > 1 and self.cross_attention:
            out = self._attend_cross_beams(
                query, key, value, mask, bias, dropout_rng, deterministic, beam_size
            )
        elif decode and beam_size > 1 and beam_ancestors is not None:
            out = self._attend_beams_in_place(
                query, key, value, mask, bias, dropout_rng, deterministic, beam_size,
                beam_ancestors, written,
            )  # fmt: skip
        else:
            out = self._attend(query, key, value, mask, bias, dropout_rng, deterministic, written)
        return self._output(out, inputs_q.shape[-1])

    # ------------------------------------------------------------------------- projections

    @property
    def _kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def _qkv_bias(self) -> bool:
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

    def _project(self, x: Array, heads: int, name: str) -> Array:
        """`[batch, len, features]` -> `[batch, len, heads, head_dim]`."""
        return HeadProjection(
            heads,
            self.head_dim,
            axis_names=QUERY_AXES if name == "query" else KV_AXES,
            use_bias=self._qkv_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            int8_kernel=self.int8_kernel,
            name=name,
        )(x)

    def _project_fused_qkv(self, x: Array) -> tuple[Array, Array, Array]:
        """`[batch, len, features]` -> query `[batch, len, heads, head_dim]`, key and value
        `[batch, len, kv_heads, head_dim]`, from one fused kernel."""
        return FusedQKVProjection(
            self.num_heads,
            self._kv_heads,
            self.head_dim,
            use_bias=self._qkv_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            int8_kernel=self.int8_kernel,
            name="qkv",
        )(x)

    def _rotate(self, x: Array, positions: Array | None) -> Array:
        """Rotary embedding of queries or keys `[batch, len, heads, head_dim]` at ``positions``
        `[batch|1, len]` (default 0..len-1); the identity without ``use_rotary``."""
        if not self.use_rotary:
            return x
        if positions is None:
            positions = jnp.arange(x.shape[1])[None]
        if self.rope_theta is None and self.rope_scaling is None:
            return pos_lib.rotary(x, positions)
        theta = 10000.0 if self.rope_theta is None else self.rope_theta
        inv_freq = pos_lib.rope_inv_freq(x.shape[-1], theta, self.rope_scaling)
        return pos_lib.rotary(x, positions, inv_freq=inv_freq)

    def _project_kv(self, source: Array, positions: Array | None) -> tuple[Array, Array]:
        """Keys (rotated at ``positions``) and values `[batch, len, kv_heads, head_dim]`."""
        key = self._project(source, self._kv_heads, "key")
        return self._rotate(key, positions), self._project(source, self._kv_heads, "value")

    def _self_attention_qkv(
        self, x: Array, positions_q: Array | None, positions_kv: Array | None
    ) -> tuple[Array, Array, Array]:
        """Self-attention: queries, keys and values of x `[batch, len, features]`, with
        separate kernels ("query", "key", "value") or one fused ("qkv"). Rotary: queries at
        ``positions_q``, keys at ``positions_kv`` (default: ``positions_q``; decoding passes
        the new tokens' absolute positions, so the cache holds keys rotated where they are)."""
        if positions_kv is None:
            positions_kv = positions_q
        if self.fused_qkv:
            query, key, value = self._project_fused_qkv(x)
            key = self._rotate(key, positions_kv)
        else:
            query = self._project(x, self.num_heads, "query")
            key, value = self._project_kv(x, positions_kv)
        return self._rotate(query, positions_q), key, value

    def _cross_attention_kv(
        self, inputs_kv: Array | None, positions_kv: Array | None, *, decode: bool
    ) -> tuple[Array, Array]:
        """Keys and values `[batch, kv_len, kv_heads, head_dim]` of another sequence: the
        encoder output (``cross_attention``; cached when decoding) or ``inputs_kv`` given to a
        self-attention layer."""
        if self.cross_attention and decode:
            return self._cross_cache(inputs_kv, positions_kv)
        if inputs_kv is None:
            raise ValueError("cross-attention needs inputs_kv (the encoder output)")
        return self._project_kv(inputs_kv, positions_kv)

    def _cross_cache(
        self, inputs_kv: Array | None, positions_kv: Array | None
    ) -> tuple[Array, Array]:
        """Encoder keys/values for decoding, projected once per batch instead of every step.

        A call with the encoder output (``inputs_kv``) projects and stores them in the cache
        (``cross_key``/``cross_value``, heads first: `[batch, kv_heads, src_len, head_dim]`, see
        ``heads_first``); later calls with ``inputs_kv=None`` read them back. Returns them
        `[batch, src_len, kv_heads, head_dim]`.
        """
        if inputs_kv is not None:
            key, value = self._project_kv(inputs_kv, positions_kv)
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

    def _output(self, out: Array, features: int) -> Array:
        """`[batch, len, heads, head_dim]` -> `[batch, len, features]`."""
        return OutputProjection(
            features,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            quantization=self.quantization,
            int8_kernel=self.int8_kernel,
            name="out",
        )(out)

    # ------------------------------------------------------------------------- the cache

    def _self_attention_cache(
        self,
        key: Array,
        value: Array,
        mask: Any,
        positions_q: Array | None,
        check: bool,
        left_padding: Array | None = None,
    ) -> tuple[Array, Array, Array | None, Array | None]:
        """decode=True self-attention: the new keys/values `[batch, q_len, kv_heads, head_dim]`
        go into the cache; returns the keys/values to attend over `[batch, slots, kv_heads,
        head_dim]`, their causal mask and, for the full cache, the slots in use after the write
        (int scalar: the last new position + 1, for ``kv_cache.over_written_prefix``; None for
        the ring buffer or without new positions).

        The first call (``init``, or the one that allocates) creates ``cached_key`` and
        ``cached_value`` for ``q_len`` positions, or a ring buffer of ``window`` slots when
        ``q_len >= window``, and attends without them. Later calls write the full cache or
        the ring buffer; a call without new positions only reads the cache.
        """
        if isinstance(mask, AttentionMask):
            raise ValueError(
                "decode=True self-attention builds its causal mask over the cache; pass an "
                "array mask `[batch, heads, q_len, max_len]` (or None), not an AttentionMask"
            )
        initialized = self.has_variable("cache", "cached_key")
        batch, length, kv_heads, head_dim = key.shape
        if self.window is not None and length >= self.window:
            length = self.window  # a ring buffer (see the class docstring)
        shape = (batch, kv_heads, length, head_dim)
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, value.dtype)
        if not initialized:  # the init call only allocates the cache
            return key, value, mask, None
        q_len, slots = key.shape[1], cached_key.value.shape[2]
        if self.window is not None and slots == self.window and q_len:
            if left_padding is not None:
                raise ValueError(
                    "left_padding (a left-padded prompt) needs the full key/value cache, not "
                    f"the sliding window's ring buffer of {self.window} slots"
                )
            if positions_q is None:
                raise ValueError("decode=True self-attention needs positions_q `[batch, q_len]`")
            return (
                *self._write_ring_buffer(cached_key, cached_value, key, value, mask, positions_q),
                None,
            )
        if q_len == 0:  # nothing to write (a call that only fills the cross-attention cache)
            return heads_first(cached_key.value), heads_first(cached_value.value), mask, None
        if positions_q is None:
            raise ValueError(
                "decode=True self-attention needs positions_q `[batch, q_len]`: the absolute "
                "positions of the new tokens (the first is the cache slot written)"
            )
        if left_padding is not None:  # the prompts' padding slots: hidden from every query
            real = jnp.arange(slots)[None, :] >= left_padding[:, None]  # [batch, slots]
            mask = combine_masks(mask, real[:, None, None, :])
        key, value, mask = self._write_full_cache(
            cached_key, cached_value, key, value, mask, positions_q, check
        )
        return key, value, mask, positions_q[0, -1].astype(jnp.int32) + 1

    def _write_full_cache(
        self,
        cached_key: Any,
        cached_value: Any,
        key: Array,
        value: Array,
        mask: Array | None,
        positions_q: Array,
        check: bool,
    ) -> tuple[Array, Array, Array | None]:
        """Decoding into the full cache (position p in slot p): writes the new keys/values
        `[batch, q_len, kv_heads, head_dim]` at slots ``positions_q[0]``; returns the whole
        cache `[batch, max_len, kv_heads, head_dim]` and its causal mask (within ``window``
        when one is set) combined with ``mask``."""
        positions = positions_q[0].astype(jnp.int32)  # [q_len]
        q_len, max_len = key.shape[1], cached_key.value.shape[2]
        kv_cache.check_cache_room(positions[0], q_len, max_len, runtime=check)
        cached_key.value = kv_cache.write_cache(cached_key.value, key, positions[0])
        cached_value.value = kv_cache.write_cache(cached_value.value, value, positions[0])
        allowed = kv_cache.cache_mask(positions, max_len, self.window)
        mask = combine_masks(mask, allowed[None, None])
        return heads_first(cached_key.value), heads_first(cached_value.value), mask

    def _write_ring_buffer(
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
        positions = positions_q[0].astype(jnp.int32)  # [q_len]
        keys, cached_key.value = kv_cache.ring_update(cached_key.value, key, positions)
        values, cached_value.value = kv_cache.ring_update(cached_value.value, value, positions)
        allowed = kv_cache.ring_mask(positions, self.window)
        return heads_first(keys), heads_first(values), combine_masks(mask, allowed[None, None])

    # ------------------------------------------------------------------------- the attention

    def _attend(
        self,
        query: Array,
        key: Array,
        value: Array,
        mask: Any,
        bias: Array | None,
        dropout_rng: Array | None,
        deterministic: bool,
        written: Array | None = None,
    ) -> Array:
        """The attention call of every mode: query `[batch, q_len, heads, head_dim]` over
        key/value `[batch, kv_len, kv_heads, head_dim]` -> `[batch, q_len, heads, head_dim]`.
        Sows the weights `[batch, heads, q_len, kv_len]` when "intermediates" is mutable.
        ``written`` (the full decoding cache's slots in use, or None): without dropout or
        weights to sow, only the written prefix of the cache is read
        (``kv_cache.over_written_prefix``)."""
        # Weights only when someone collects them: sow is a no-op unless "intermediates" is
        # mutable, and then the weights are not computed either.
        want_weights = self.is_mutable_collection("intermediates")
        if written is not None and dropout_rng is None and not want_weights:

            def attend(key, value, mask, bias):
                return dot_product_attention(
                    query,
                    heads_first(key),
                    heads_first(value),
                    mask,
                    bias,
                    implementation=self.implementation,
                    scale=self.logits_scale,
                )

            # The cache as stored (heads first): a transposed view as the switch's operand had
            # XLA write each layer's cache twice, into two copies of it, at every step.
            operands = ((heads_first(key), 2), (heads_first(value), 2), (mask, -1), (bias, -1))
            return kv_cache.over_written_prefix(attend, written, key.shape[1], operands)
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
            scale=self.logits_scale,
        )
        if want_weights:
            if self.implementation == "xla":
                out, weights = out
            else:  # cuDNN and blockwise never materialise them: the reference computes them
                if isinstance(mask, AttentionMask):
                    mask = mask.dense(query.shape[1], key.shape[1])
                weights = attention_weights(query, key, mask, bias, self.logits_scale)
            self.sow("intermediates", "attention_weights", weights)
        return out

    def _attend_cross_beams(
        self,
        query: Array,
        key: Array,
        value: Array,
        mask: Any,
        bias: Array | None,
        dropout_rng: Array | None,
        deterministic: bool,
        beam_size: int,
    ) -> Array:
        """Beam-search decoding, cross-attention: the queries `[batch * beam_size, q_len,
        heads, head_dim]` of a source's beams grouped onto its one row of encoder keys/values
        `[batch, src_len, kv_heads, head_dim]`."""
        query = beam_cache.group_queries(query, beam_size)
        out = self._attend(query, key, value, mask, bias, dropout_rng, deterministic)
        return beam_cache.ungroup_queries(out, beam_size)

    def _attend_beams_in_place(
        self,
        query: Array,
        key: Array,
        value: Array,
        mask: Array | None,
        bias: Array | None,
        dropout_rng: Array | None,
        deterministic: bool,
        beam_size: int,
        beam_ancestors: Array,
        written: Array | None = None,
    ) -> Array:
        """Beam-search decoding, self-attention over a cache that is never reordered
        (``ops.beam_cache``): each row `[rows = batch * beam_size]` attends over the keys
        `[rows, slots, kv_heads, head_dim]` of every beam of its source, masked to its own
        history (``beam_ancestors`` int `[rows, slots]`). ``written``: as for ``_attend``."""
        rows, q_len = query.shape[:2]
        slots = key.shape[1]
        if beam_ancestors.shape != (rows, slots):
            raise ValueError(
                f"beam_ancestors must be [rows, slots] = ({rows}, {slots}) for this cache; "
                f"got {beam_ancestors.shape}"
            )
        query = beam_cache.group_queries(query, beam_size)
        want_weights = self.is_mutable_collection("intermediates")
        if self.implementation == "xla" and dropout_rng is None and not want_weights:

            def attend(key, value, mask, bias, ancestors):
                key, value = heads_first(key), heads_first(value)
                slots = key.shape[1]
                mask = beam_cache.history_mask(ancestors, beam_size, q_len, mask)
                if bias is not None:
                    bias = beam_cache.group_bias(bias, rows, beam_size, q_len, slots)
                return beam_cache.attend_beams(
                    query, key, value, mask, bias, beam_size, self.logits_scale
                )

            operands = (
                (heads_first(key), 2),
                (heads_first(value), 2),
                (mask, -1),
                (bias, -1),
                (beam_ancestors, 1),
            )
            out = kv_cache.over_written_prefix(attend, written, slots, operands)
            return beam_cache.ungroup_queries(out, beam_size)
        mask = beam_cache.history_mask(beam_ancestors, beam_size, q_len, mask)
        if bias is not None:
            bias = beam_cache.group_bias(bias, rows, beam_size, q_len, slots)
        # The general path (dropout, weights to sow, another implementation): every beam's
        # keys on one axis.
        key = beam_cache.group_keys(key, beam_size)
        value = beam_cache.group_keys(value, beam_size)
        out = self._attend(query, key, value, mask, bias, dropout_rng, deterministic)
        return beam_cache.ungroup_queries(out, beam_size)
