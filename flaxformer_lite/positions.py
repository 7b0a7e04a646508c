"""Position information: the paper's sinusoids, learned embeddings and rotary embeddings.

Absolute schemes (``sinusoidal``, ``LearnedPositions``) are added to the token embeddings and
take explicit ``positions`` `[batch, length]`, so packed rows restart at 0 in every segment and a
cached decoder step asks for its own position. Relative schemes act inside attention instead:
``rotary`` rotates queries and keys (the attention layer calls it), and an additive bias such as
T5's enters through the ``bias`` argument of ``dot_product_attention``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
    """Learned absolute position embeddings, `[max_len, dim]` (the paper's Table 3 row E)."""

    max_len: int
    dim: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array) -> Array:
        """x `[batch, length, dim]`, positions int `[batch, length]` -> x + embedding."""
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (self.max_len, self.dim),
            self.param_dtype,
        )
        return x + jnp.take(table, positions, axis=0).astype(x.dtype)


def rotary(x: Array, positions: Array, max_timescale: float = 10000.0) -> Array:
    """Rotary position embedding (RoFormer) of x `[batch, length, heads, head_dim]`.

    Channel pairs (i, i + head_dim/2) are rotated by the angle position / 10000^(2i/head_dim),
    so the dot product of a rotated query and key depends only on their distance.
    positions: int `[batch, length]`.
    """
    half = x.shape[-1] // 2
    inv_timescale = max_timescale ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * inv_timescale  # [b, n, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
