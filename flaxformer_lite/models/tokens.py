"""The models' token inputs: checked, shifted right for the decoder, default positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.nn.config import TransformerConfig

Array = jax.Array


def check_tokens(name: str, tokens: Array, config: TransformerConfig) -> None:
    """Fails on tokens that would otherwise broadcast or clamp silently."""
    shape = getattr(tokens, "shape", None)
    dtype = getattr(tokens, "dtype", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"{name} must be int tokens [batch, length]; got shape {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{name} must have an integer dtype (token ids); got {dtype}, shape {shape}"
        )
    if config.position in ("sinusoidal", "learned") and shape[1] > config.max_len:
        raise ValueError(
            f"{name} has length {shape[1]} > TransformerConfig.max_len={config.max_len} "
            f"(position={config.position!r}); shape {shape}. Raise max_len or truncate the input."
        )


def shift_right(targets: Array, bos_id: int, positions: Array | None = None) -> Array:
    """Decoder inputs: BOS then the targets shifted one step right.

    With packing, every example in the row starts with BOS (where its position is 0).
    targets `[batch, length]` -> `[batch, length]`.
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if positions is not None:
        shifted = jnp.where(positions == 0, bos_id, shifted)
    return shifted.astype(targets.dtype)


def default_positions(tokens: Array) -> Array:
    """0 .. length - 1 in every row: int `[batch, length]` for tokens `[batch, length]`."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


def positions_from_mask(attention_mask: Array) -> tuple[Array, Array]:
    """Positions and segmentation of a padded batch given as Hugging Face does: an attention
    mask `[batch, length]` (1 real, 0 pad; left- or right-padded).

    Returns int32 ``(positions, segmentation)`` `[batch, length]`: positions count the real
    tokens before each one (``cumsum(mask) - 1``, as transformers' generate computes them;
    0 on padding) and the segmentation is the mask itself (pad queries see no key, real ones
    no pad key): ``DecoderOnly.decode(ids, decoder_positions=..., segmentation=...)``.
    """
    mask = jnp.asarray(attention_mask).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask
    return positions.astype(jnp.int32), mask
