"""Token losses and metrics as pure functions, summed (not averaged) so that micro-batches,
devices and hosts add up before one division by the real-token count."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def smoothed_cross_entropy(
    logits: Array, labels: Array, weights: Array, label_smoothing: float = 0.1
) -> tuple[Array, Array]:
    """Label-smoothed cross-entropy, summed over weighted positions.

    The target distribution puts ``1 - label_smoothing`` on the label and spreads
    ``label_smoothing`` uniformly over the other ``vocab - 1`` ids (the paper's epsilon_ls = 0.1).
    The entropy of that distribution is subtracted, so a perfect prediction scores 0 whatever
    the smoothing (values stay comparable across smoothing settings).

    Args:
      logits: `[..., vocab]`, any float dtype (computed in float32).
      labels: int `[...]`.
      weights: `[...]`, 0 on padding, 1 on real tokens.
      label_smoothing: in [0, 1).

    Returns:
      (sum of weighted losses, sum of weights), both float32 scalars.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    vocab = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    # sum_v q_v log p_v without a one-hot: low * sum(log p) + (conf - low) * log p_y.
    label_log_prob = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    cross = -(confidence - low) * label_log_prob - low * log_probs.sum(axis=-1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = (cross - entropy) * weights
    return loss.sum(), weights.astype(jnp.float32).sum()


def correct_predictions(logits: Array, labels: Array, weights: Array) -> Array:
    """Weighted count of argmax predictions equal to the labels (float32 scalar)."""
    hits = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (hits * weights).sum()


def exact_match(predictions: Array, targets: Array, pad_id: int = 0) -> Array:
    """Per row, predictions equal targets at every real target position and nothing extra.

    predictions, targets: int `[batch, length]` padded with ``pad_id`` after EOS. Returns bool
    `[batch]`.
    """
    length = max(predictions.shape[1], targets.shape[1])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=pad_id)  # noqa: E731
    return jnp.all(pad(predictions) == pad(targets), axis=1)
