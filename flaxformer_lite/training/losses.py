"""Token losses and metrics as pure functions, summed (not averaged) so that micro-batches,
devices and hosts add up before one division by the real-token count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.argmax import row_argmax

Array = jax.Array


def smoothed_cross_entropy(
    logits: Array, labels: Array, weights: Array, label_smoothing: float = 0.1
) -> tuple[Array, Array]:
    """Label-smoothed cross-entropy, summed over weighted positions.

    The target distribution puts ``1 - label_smoothing`` on the label and spreads
    ``label_smoothing`` uniformly over the other ``vocab - 1`` ids (the paper's epsilon_ls = 0.1).
    The entropy of that distribution is subtracted, so a perfect prediction scores 0 whatever
    the smoothing (values stay comparable across smoothing settings).

    The gradient with respect to the logits is written by hand, ``weight * (softmax - target)``
    in one elementwise pass (``_smoothed_ce_bwd``): autodiff's version builds a one-hot by
    scatter-add, broadcasts the smoothing term to `[..., vocab]` and recomputes the softmax
    for each consumer, over the whole vocabulary (13-18% of a small CPU train step, see
    bench/README.md). The forward pass keeps the row's log-sum-exp, not the log-probs.
    Same value and same gradient up to float rounding.

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
    return _smoothed_ce(logits, labels, weights, float(label_smoothing))


def _smoothing(vocab: int, label_smoothing: float) -> tuple[float, float, float]:
    """(confidence, low, entropy) of the smoothed target over ``vocab`` ids."""
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    return confidence, low, entropy


def _smoothed_ce_fwd(logits, labels, weights, label_smoothing):
    confidence, low, entropy = _smoothing(logits.shape[-1], label_smoothing)
    x = logits.astype(jnp.float32)
    # log p_v = x_v - lse, with lse = log(sum(exp(x))). The log-probs are never written:
    # sum_v log p_v is sum_v x_v - vocab * lse, and the backward pass recomputes
    # p = exp(x - lse) from the logits it keeps anyway: a [..., vocab] float32 array less to
    # write, hold and read (the Multi30k train step 2% shorter, bench/train_variants.py --set
    # loss).
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)
    sum_log_probs = jnp.sum(x, axis=-1, keepdims=True) - x.shape[-1] * lse
    # sum_v q_v log p_v without a one-hot: low * sum(log p) + (conf - low) * log p_y.
    cross = -(confidence - low) * (label_logit - lse) - low * sum_log_probs
    loss = (cross - entropy)[..., 0]
    out = ((loss * weights).sum(), weights.astype(jnp.float32).sum())
    return out, (x, lse, labels, weights, loss, jnp.zeros((), logits.dtype))


def _smoothed_ce_bwd(label_smoothing, residuals, cotangents):
    x, lse, labels, weights, loss, like = residuals
    g_loss, _ = cotangents  # the weight sum does not depend on the logits
    confidence, low, _ = _smoothing(x.shape[-1], label_smoothing)
    ids = jax.lax.broadcasted_iota(labels.dtype, x.shape, x.ndim - 1)
    target = jnp.where(ids == labels[..., None], confidence, low)
    scale = (g_loss * weights).astype(jnp.float32)[..., None]
    d_logits = ((jnp.exp(x - lse) - target) * scale).astype(like.dtype)
    d_weights = (
        (g_loss * loss).astype(weights.dtype)
        if jnp.issubdtype(weights.dtype, jnp.floating)
        else None
    )
    return d_logits, None, d_weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _smoothed_ce(logits, labels, weights, label_smoothing):
    return _smoothed_ce_fwd(logits, labels, weights, label_smoothing)[0]


_smoothed_ce.defvjp(_smoothed_ce_fwd, _smoothed_ce_bwd)


def symmetric_kl(logits_a: Array, logits_b: Array, weights: Array) -> Array:
    """R-Drop's consistency term (Liang et al., 2021): the mean of the two KL divergences
    between two predictions of the same positions, summed over weighted positions.

    Per position ``(KL(p_a || p_b) + KL(p_b || p_a)) / 2 = sum_v (p_a - p_b)(log p_a - log p_b)
    / 2`` over the vocabulary, computed in float32 from log-softmaxes (no log of a rounded-off
    zero probability). 0 where the two logit rows agree up to a constant.

    Args:
      logits_a, logits_b: `[..., vocab]`, any float dtype: two forward passes of one batch
        under different dropout masks.
      weights: `[...]`, 0 on padding, 1 on real tokens.

    Returns:
      The weighted sum, a float32 scalar.
    """
    log_a = jax.nn.log_softmax(logits_a.astype(jnp.float32), axis=-1)
    log_b = jax.nn.log_softmax(logits_b.astype(jnp.float32), axis=-1)
    per_position = 0.5 * jnp.sum((jnp.exp(log_a) - jnp.exp(log_b)) * (log_a - log_b), axis=-1)
    return jnp.sum(per_position * weights.astype(jnp.float32))


def correct_predictions(logits: Array, labels: Array, weights: Array) -> Array:
    """Weighted count of argmax predictions equal to the labels (float32 scalar).

    The argmax is the first index holding the maximum (a NaN counts as the maximum), exactly
    ``jnp.argmax``, computed by :func:`flaxformer_lite.ops.argmax.row_argmax` from block
    maxima: XLA's CPU backend runs ``jnp.argmax``'s (value, index) pair reduction
    unvectorised, and a max then a min over the indices holding it is slower still with
    jaxlib 0.10 (`[2048, 8000]`: 36 and 64 against 8 ms, ``bench/argmax.py``)."""
    hits = (row_argmax(logits) == labels).astype(jnp.float32)
    return (hits * weights).sum()


def exact_match(predictions: Array, targets: Array, pad_id: int = 0) -> Array:
    """Per row, predictions equal targets at every real target position and nothing extra.

    predictions, targets: int `[batch, length]` padded with ``pad_id`` after EOS. Returns bool
    `[batch]`.
    """
    length = max(predictions.shape[1], targets.shape[1])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=pad_id)  # noqa: E731
    return jnp.all(pad(predictions) == pad(targets), axis=1)
