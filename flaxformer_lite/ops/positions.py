"""Position information: the paper's sinusoids, learned and rotary embeddings, T5's relative bias.

Absolute schemes (``sinusoidal``, ``LearnedPositions``) are added to the token embeddings and
take explicit ``positions`` `[batch, length]`, so packed rows restart at 0 in every segment and a
cached decoder step asks for its own position. Relative schemes act inside attention instead:
``rotary`` rotates queries and keys (the attention layer calls it), and T5's bucketed bias
(``RelativePositionBias``, ``relative_position_bucket``) enters through the ``bias`` argument of
``dot_product_attention``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.core.logical_params import logical_init, read_param

Array = jax.Array


def sinusoidal(
    length: int, dim: int, max_timescale: float = 10000.0, layout: str = "interleaved"
) -> Array:
    """The paper's table, float32 `[length, dim]`.

    PE(pos, 2i) = sin(pos / 10000^(2i/dim)) and PE(pos, 2i+1) = cos(pos / 10000^(2i/dim)):
    with ``layout="interleaved"`` (the paper) sine on even channels, cosine on odd channels;
    with ``layout="halves"`` (Marian, fairseq) the same sines on channels [0, dim/2) and the
    cosines on [dim/2, dim).
    """
    if layout not in ("interleaved", "halves"):
        raise ValueError(f"layout must be 'interleaved' or 'halves'; got {layout!r}")
    if dim % 2:
        raise ValueError(f"dim must be even for sinusoidal positions; got {dim}")
    pos = np.arange(length, dtype=np.float64)[:, None]
    inv_timescale = max_timescale ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = pos * inv_timescale[None, :]
    table = np.zeros((length, dim), dtype=np.float64)
    if layout == "interleaved":
        table[:, 0::2] = np.sin(angles)
        table[:, 1::2] = np.cos(angles)
    else:
        table[:, : dim // 2] = np.sin(angles)
        table[:, dim // 2 :] = np.cos(angles)
    return jnp.asarray(table, dtype=jnp.float32)


def add_sinusoidal(x: Array, positions: Array, max_len: int, layout: str = "interleaved") -> Array:
    """Adds the sinusoid of each position. x `[batch, length, dim]`, positions `[batch, length]`;
    ``layout`` as in ``sinusoidal``."""
    table = sinusoidal(max_len, x.shape[-1], layout=layout)
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)


class LearnedPositions(nn.Module):
    """Learned absolute position embeddings, `[max_len, dim]` (the paper's Table 3 row E).

    ``offset``: the table is `[offset + max_len, dim]` and position p reads row p + offset
    (Hugging Face BART's ``BartLearnedPositionalEmbedding`` keeps 2 such leading rows).
    """

    max_len: int
    dim: int
    param_dtype: jnp.dtype = jnp.float32
    offset: int = 0

    @nn.compact
    def __call__(self, x: Array, positions: Array) -> Array:
        """x `[batch, length, dim]`, positions int `[batch, length]` -> x + embedding."""
        table = read_param(
            self,
            "embedding",
            logical_init(nn.initializers.normal(0.02), (None, "embed")),
            (self.offset + self.max_len, self.dim),
            self.param_dtype,
        )
        return x + jnp.take(table, positions + self.offset, axis=0).astype(x.dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    scaling: tuple[float, float, float, int] | None = None,
) -> np.ndarray:
    """The rotary frequencies float32 `[head_dim / 2]` of Hugging Face's Llama: ``1 /
    theta^(2i / head_dim)``, then with ``scaling`` = ``(factor, low_freq_factor,
    high_freq_factor, original_max_len)`` Llama 3's ``rope_scaling``: wavelengths ``2 pi /
    freq`` above ``original_max_len / low_freq_factor`` divided by ``factor``, below
    ``original_max_len / high_freq_factor`` kept, in between interpolated by ``s = (original /
    wavelength - low) / (high - low)``: ``(1 - s) freq / factor + s freq``.

    Computed step by step in float32 as ``transformers``' ``_compute_llama3_parameters``
    does (its comparisons decide the same bands), the power correctly rounded (torch's
    float32 ``pow`` may differ by an ulp).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary positions; got {head_dim}")
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    power = np.power(np.float64(theta), exponent.astype(np.float64)).astype(f32)
    inv_freq = (f32(1.0) / power).astype(f32)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    low_wavelen, high_wavelen = original / low, original / high  # Python floats, as HF's
    wavelen = (f32(2 * np.pi) / inv_freq).astype(f32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq).astype(f32)
    smooth = ((f32(original) / wavelen - f32(low)) / f32(high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rotary(
    x: Array, positions: Array, max_timescale: float = 10000.0, inv_freq: Any = None
) -> Array:
    """Rotary position embedding (RoFormer) of x `[batch, length, heads, head_dim]`.

    Channel pairs (i, i + head_dim/2) are rotated by the angle position / 10000^(2i/head_dim),
    so the dot product of a rotated query and key depends only on their distance: Hugging
    Face's ``rotate_half`` layout, ``x * cos + rotate_half(x) * sin``. ``max_timescale`` is
    the base; ``inv_freq`` float `[head_dim / 2]`, when given, the frequencies themselves
    (``rope_inv_freq``: transformers' exactly, Llama 3's scaling included).
    positions: int `[batch, length]`.
    """
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_timescale = max_timescale ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        inv_timescale = jnp.asarray(inv_freq, jnp.float32)
    angles = positions[..., None].astype(jnp.float32) * inv_timescale  # [b, n, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- relative bias


def _check_bucket_args(num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """Validates the bucketing settings; returns max_exact (distances below it get a bucket
    each)."""
    for name, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if num_buckets < 4 or num_buckets % 2:
        raise ValueError(f"num_buckets must be even and >= 4; got {num_buckets}")
    max_exact = num_buckets // (4 if bidirectional else 2)
    if max_distance <= num_buckets // 2:
        raise ValueError(
            f"max_distance must exceed num_buckets // 2 = {num_buckets // 2} (the largest "
            f"distance with a bucket of its own); got {max_distance}"
        )
    return max_exact


def _log_buckets(max_exact: int, log_buckets: int, max_distance: int) -> np.ndarray:
    """int32 `[max_distance + 1]`: for distance n >= max_exact, ``max_exact + floor(log_buckets
    * log(n / max_exact) / log(max_distance / max_exact))``, capped at ``max_exact +
    log_buckets - 1``; entries below max_exact are unused (0).

    The floor is found exactly, in integers: k <= R log(n/e) / log(m/e) iff m^k e^(R-k) <= n^R
    (R = log_buckets, e = max_exact, m = max_distance), so boundaries such as n = 16, 32, 64
    for T5's 32 buckets / 128 do not depend on float rounding.
    """
    table = np.zeros(max_distance + 1, np.int32)
    for n in range(max_exact, max_distance + 1):
        k = 0
        while (
            k + 1 < log_buckets
            and max_distance ** (k + 1) * max_exact ** (log_buckets - k - 1) <= n**log_buckets
        ):
            k += 1
        table[n] = max_exact + k
    return table


def relative_position_bucket(
    relative_position: Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
    """T5's bucket of each relative position (Raffel et al. 2020; Mesh TensorFlow's
    ``_relative_position_bucket``), int32 of the same shape.

    ``relative_position`` = key position - query position (int array, any shape). With
    ``bidirectional`` (encoder) half of the buckets are for keys after the query (offset by
    num_buckets / 2) and half for keys at or before it; otherwise (causal decoder) keys after
    the query all share bucket 0 (they are masked anyway) and every bucket goes to the past.
    Within a direction of B buckets, distance n = ``|relative_position|`` has its own bucket for
    n < B / 2, then ``B/2 + floor((B/2) log(n / (B/2)) / log(max_distance / (B/2)))``
    (logarithmically wider buckets), and every n >= max_distance shares the last bucket B - 1.

    num_buckets: even, >= 4. max_distance: > num_buckets // 2.
    """
    max_exact = _check_bucket_args(num_buckets, max_distance, bidirectional)
    relative_position = jnp.asarray(relative_position)
    if not jnp.issubdtype(relative_position.dtype, jnp.integer):
        raise ValueError(
            f"relative_position must be an integer array; got dtype {relative_position.dtype}"
        )
    n = -relative_position.astype(jnp.int32)  # > 0: the key is before the query
    offset = jnp.zeros_like(n)
    if bidirectional:
        buckets = num_buckets // 2
        offset = jnp.where(n < 0, buckets, 0)
        n = jnp.abs(n)
    else:
        buckets = num_buckets
        n = jnp.maximum(n, 0)
    log_table = jnp.asarray(_log_buckets(max_exact, buckets - max_exact, max_distance))
    large = jnp.take(log_table, jnp.minimum(n, max_distance))
    return offset + jnp.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: one table `[num_buckets, heads]` per layer stack,
    looked up by ``relative_position_bucket`` of every (query, key) pair.

    ``__call__(query_positions [batch|1, q_len], key_positions [batch|1, kv_len])`` -> float32
    bias `[batch|1, heads, q_len, kv_len]` for ``dot_product_attention``'s ``bias``.
    """

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> Array:
        table = read_param(
            self,
            "embedding",
            logical_init(nn.initializers.normal(0.02), (None, "heads")),
            (self.num_buckets, self.num_heads),
            self.param_dtype,
        )
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [b, q, k]
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        bias = jnp.take(jnp.asarray(table, jnp.float32), buckets, axis=0)  # [b, q, k, heads]
        return jnp.transpose(bias, (0, 3, 1, 2))
