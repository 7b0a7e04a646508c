"""Batch inference: one jitted call from token ids to generated token ids.

``generate`` binds a model to the pure searches of ``decoding``: the encoder runs once per
batch, the decoder runs one position per step against its key/value cache. A ``scan_layers``
model decodes as its unrolled equivalent (``models.unrolled``): the cache is one array per
layer with the batch on axis 0, which beam search expands and gathers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from flaxformer_lite import decoding
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models import DecoderOnly, EncoderDecoder, unrolled

METHODS = ("greedy", "beam", "sample")
# Shapes and Python-level choices: each distinct value compiles once.
STATIC_ARGNAMES = (
    "config",
    "method",
    "max_len",
    "beam_size",
    "alpha",
    "temperature",
    "top_k",
    "top_p",
)


def init_cache(
    model: Any, params: Any, batch_size: int, max_len: int, src_len: int | None = None
) -> Any:
    """A zero key/value cache for ``batch_size`` rows and ``max_len`` decoder positions.

    Only shapes are traced (``jax.eval_shape`` of a decoding call with ``params``): nothing
    is computed and no parameter is initialised. For a ``scan_layers`` model the cache is that
    of its unrolled equivalent (``models.unrolled``), the model that decodes with it.
    """
    params, config = unrolled(params, model.config)
    if config is not model.config:
        model = type(model)(config)
    tokens = jnp.zeros((batch_size, max_len), jnp.int32)
    if isinstance(model, EncoderDecoder):
        encoded = jnp.zeros((batch_size, src_len or 1, model.config.d_model), model.config.dtype)
        src = jnp.ones((batch_size, src_len or 1), jnp.int32)

        def run(p):
            return model.apply(
                {"params": p},
                encoded,
                src,
                tokens,
                decode=True,
                mutable=["cache"],
                method=model.decode,
            )
    else:

        def run(p):
            return model.apply(
                {"params": p}, tokens, decode=True, mutable=["cache"], method=model.decode
            )

    shapes = jax.eval_shape(run, params)[1]["cache"]
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _decoder_call(model: Any, params: Any, *context: Any):
    """``tokens, cache -> (logits of the last position, new cache)`` through ``model.decode``
    with ``decode=True``; ``context`` goes before the tokens (encoder output and source for an
    EncoderDecoder, nothing for a DecoderOnly). Zero-length tokens only update the cache."""

    def call(tokens: jax.Array, cache: Any) -> tuple[jax.Array | None, Any]:
        logits, updated = model.apply(
            {"params": params, "cache": cache},
            *context,
            tokens,
            decode=True,
            mutable=["cache"],
            method=model.decode,
        )
        return (logits[:, -1] if tokens.shape[1] else None), updated["cache"]

    return call


def _search(
    method,
    tokens_to_logits,
    cache,
    batch_size,
    max_len,
    *,
    beam_size,
    alpha,
    temperature,
    top_k,
    top_p,
    rng,
    initial_tokens,
):
    if method == "greedy":
        return decoding.greedy_search(
            tokens_to_logits,
            cache,
            batch_size=batch_size,
            max_len=max_len,
            initial_tokens=initial_tokens,
        )
    if method == "sample":
        if rng is None:
            raise ValueError("method='sample' needs an explicit rng (a jax.random key)")
        return decoding.sample(
            tokens_to_logits,
            cache,
            rng,
            batch_size=batch_size,
            max_len=max_len,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            initial_tokens=initial_tokens,
        )
    sequences, scores = decoding.beam_search(
        tokens_to_logits,
        cache,
        batch_size=batch_size,
        beam_size=beam_size,
        max_len=max_len,
        alpha=alpha,
        initial_tokens=initial_tokens,
    )
    return sequences[:, 0], scores[:, 0]


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def generate(
    params: Any,
    config: TransformerConfig,
    inputs: jax.Array,
    *,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Translates a batch of source token ids with an ``EncoderDecoder``.

    Args:
      params: the model parameters (``variables["params"]``, boxed or not; stacked ones of a
        ``scan_layers`` model are unstacked here).
      config: the model's TransformerConfig.
      inputs: int `[batch, src_len]`, padded with 0; rows may have different lengths.
      method: "greedy", "beam" (beam search, GNMT length penalty ``alpha``) or "sample"
        (temperature, top-k, top-p; needs ``rng``).
      max_len: tokens to generate at most (EOS included); None = ``config.max_len``.

    Returns:
      tokens int32 `[batch, max_len]` (EOS-terminated, PAD after EOS, no BOS) and scores
      float32 `[batch]` (log-probability; length-normalised for beam search).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    params, config = unrolled(params, config)
    max_len = config.max_len if max_len is None else max_len
    options = dict(
        beam_size=beam_size, alpha=alpha, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng
    )
    model = EncoderDecoder(config)
    batch_size = inputs.shape[0]
    encoded = model.apply({"params": params}, inputs, method=model.encode)
    if method == "beam":  # beams of one source share its encoding: expand before priming
        encoded, inputs = decoding.expand_to_beams((encoded, inputs), beam_size)
    rows = inputs.shape[0]
    cache = init_cache(model, params, rows, max_len, inputs.shape[1])
    # A zero-length decoder call projects the encoder keys/values of every layer into the
    # cache once; the steps below pass encoded=None and project only their new position.
    _, cache = _decoder_call(model, params, encoded, inputs)(jnp.zeros((rows, 0), jnp.int32), cache)
    step = _decoder_call(model, params, None, inputs)
    return _search(method, step, cache, batch_size, max_len, initial_tokens=None, **options)


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def continue_prompt(
    params: Any,
    config: TransformerConfig,
    prompt: jax.Array,
    *,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Continues prompts with a ``DecoderOnly`` language model.

    prompt: int `[batch, prompt_len]` without padding (BOS is prepended here). The prompt is
    written into the cache in one call (prefill); then up to ``max_len`` tokens are generated
    (None: as many as ``config.max_len`` leaves after BOS and the prompt).
    Returns the continuation `[batch, max_len]` and scores `[batch]`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    params, config = unrolled(params, config)
    model = DecoderOnly(config)
    batch_size, prompt_len = prompt.shape
    max_len = config.max_len - prompt_len - 1 if max_len is None else max_len
    options = dict(
        beam_size=beam_size, alpha=alpha, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng
    )
    bos = jnp.full((batch_size, 1), config.bos_id, jnp.int32)
    context = jnp.concatenate([bos, prompt.astype(jnp.int32)], axis=1)
    cache = init_cache(model, params, batch_size, prompt_len + 1 + max_len)
    _, cache = _decoder_call(model, params)(context[:, :-1], cache)  # prefill the prompt
    step = _decoder_call(model, params)
    return _search(
        method, step, cache, batch_size, max_len, initial_tokens=context[:, -1], **options
    )
