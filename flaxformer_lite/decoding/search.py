"""Pure, jit-compatible autoregressive decoding over a single model callback (t5x style).

Every search in this module talks to the model only through::

    tokens_to_logits(tokens, cache) -> (logits, new_cache)

``tokens``
    int32 ``[batch, 1]``: the last token of every row (BOS, or a caller-given
    ``initial_tokens``, on the first call).
``cache``
    an arbitrary pytree (typically a flax ``'cache'`` collection). Leaves with ``ndim > 0``
    have the (decoding) batch as leading axis; 0-d leaves (e.g. a ``cache_index`` counter
    shared by the whole batch) are passed through untouched: never tiled, never gathered.
``logits``
    float ``[batch, vocab]``: unnormalised scores of the next token.

All functions use static Python ints for shapes (``batch_size``, ``max_len``, ``beam_size``,
``top_k`` ...), a ``lax.while_loop`` over decoding steps and fixed-shape state, so they can be
traced once under ``jax.jit`` and run on any backend.

Output token arrays never contain the initial (BOS) token: position ``t`` holds the token
generated at step ``t``. After a row (or beam) has emitted EOS, the remaining positions are
PAD.

Every search also takes an optional ``row_max_len``, int ``[batch]``: row ``b`` generates at
most ``row_max_len[b]`` tokens (PAD after them), so what a row gets never depends on the
limits of its batch-mates; ``max_len`` is then only the static width of the output.

Two static token constraints, Hugging Face's default logits processors for Marian models, are
shared by every search: ``forced_eos`` (``forced_eos_token_id``: the last token a row may
generate, at its limit, is EOS) and ``banned_ids`` (single-token ``bad_words_ids``: ids never
generated, e.g. PAD).

Beam search lives in :mod:`flaxformer_lite.decoding.beam`, on the same helpers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from flaxformer_lite.core.special_ids import BOS_ID, EOS_ID, PAD_ID  # re-exported: the defaults
from flaxformer_lite.ops.argmax import row_argmax

PyTree = Any
TokensToLogits = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]

# Beam-search rules: "gnmt" (GNMT length penalty, exact stopping bound) or "hf" (those of
# Hugging Face's generate(num_beams=k)); early_stopping values of the "hf" rules.
BEAM_STYLES = ("gnmt", "hf")
EARLY_STOPPING = (False, True, "never")

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "BEAM_STYLES",
    "EARLY_STOPPING",
    "check_search_options",
    "expand_to_beams",
    "flatten_beams",
    "greedy_search",
    "length_penalty",
    "sample",
    "unflatten_beams",
]


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _map_batched(fn: Callable[[jax.Array], jax.Array], tree: PyTree) -> PyTree:
    """Applies ``fn`` to every leaf with ``ndim > 0``; 0-d leaves are returned unchanged.

    0-d leaves (such as flax's ``cache_index``) are shared by all rows, so they have no batch
    axis to tile or gather.
    """
    return jax.tree.map(lambda x: fn(x) if jnp.ndim(x) > 0 else x, tree)


def _check_positive_int(name: str, value: int) -> int:
    """``value`` if it is a Python int >= 1 or a ``jax.export`` symbolic dimension (a batch
    size exported for any number of rows: symbolic dimensions are >= 1)."""
    if jax.export.is_symbolic_dim(value):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive Python int (>= 1), got {value!r}.")
    return value


def _float_dtype(logits: jax.Array) -> jnp.dtype:
    """Working dtype for scores: at least float32 (bf16/fp16 logits lose too much precision
    once they are accumulated over many steps), float64 kept when x64 is enabled."""
    return jnp.promote_types(logits.dtype, jnp.float32)


def _checked_logits(logits: jax.Array, rows: int) -> jax.Array:
    """Checks the callback's logits are ``[rows, vocab]`` and casts them to the working dtype.

    Runs at trace time, so a model returning ``[batch, 1, vocab]`` fails with a clear message.
    """
    if logits.ndim != 2 or logits.shape[0] != rows:
        raise ValueError(
            f"tokens_to_logits must return logits of shape [{rows}, vocab], got {logits.shape}."
        )
    return logits.astype(_float_dtype(logits))


def _initial_tokens(initial_tokens: jax.Array | None, batch_size: int, bos_id: int) -> jax.Array:
    """Returns int32 ``[batch_size]`` first inputs: ``initial_tokens`` or BOS."""
    if initial_tokens is None:
        return jnp.full((batch_size,), bos_id, dtype=jnp.int32)
    initial_tokens = jnp.asarray(initial_tokens)
    if initial_tokens.shape != (batch_size,):
        raise ValueError(
            f"initial_tokens must have shape [batch_size] = ({batch_size},), "
            f"got {initial_tokens.shape}."
        )
    return initial_tokens.astype(jnp.int32)


def _row_limits(row_max_len: jax.Array | None, batch_size: int, max_len: int) -> jax.Array:
    """int32 ``[batch_size]`` per-row token limits: ``row_max_len`` clipped to ``[1, max_len]``
    (every row generates at least one token; ``max_len`` is the static width), or ``max_len``
    for every row when it is None."""
    if row_max_len is None:
        return jnp.full((batch_size,), max_len, jnp.int32)
    row_max_len = jnp.asarray(row_max_len)
    if row_max_len.shape != (batch_size,):
        raise ValueError(
            f"row_max_len must have shape [batch_size] = ({batch_size},), got {row_max_len.shape}."
        )
    return jnp.clip(row_max_len.astype(jnp.int32), 1, max_len)


def length_penalty(length: jax.Array | int | float, alpha: float, style: str = "gnmt") -> jax.Array:
    """Length penalty: GNMT's ``((5 + length) / 6) ** alpha`` (Wu et al., 2016) or, with
    ``style="hf"``, Hugging Face's ``length ** alpha`` (its ``length_penalty`` is ``alpha``).

    Args:
      length: number of generated tokens (EOS included, BOS / decoder start excluded); any
        shape.
      alpha: strength; 0 disables the penalty (returns 1).
      style: one of :data:`BEAM_STYLES`.

    Returns:
      float32 array with the shape of ``length``. Beam scores are ``log_prob / penalty``.
    """
    _check_choice("style", style, BEAM_STYLES)
    length = jnp.asarray(length, dtype=jnp.float32)
    base = (5.0 + length) / 6.0 if style == "gnmt" else length
    return base**alpha


def _check_choice(name: str, value: Any, valid: tuple) -> None:
    # `True in (1,)` holds in Python: compare types too, so early_stopping=1 is refused.
    if not any(type(value) is type(v) and value == v for v in valid):
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")


def check_search_options(
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: Any = (),
    *,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> tuple[int, ...]:
    """Validates the static search options; returns ``banned_ids`` as a sorted tuple of ints.

    Args:
      beam_style: one of :data:`BEAM_STYLES`.
      early_stopping: one of :data:`EARLY_STOPPING`; anything but False needs
        ``beam_style="hf"`` (GNMT's rule stops by an exact bound).
      forced_eos: a bool.
      banned_ids: ints, each in ``[0, vocab_size)`` (when given) and none ``eos_id``.

    Raises:
      ValueError: naming the argument and the valid values.
    """
    _check_choice("beam_style", beam_style, BEAM_STYLES)
    _check_choice("early_stopping", early_stopping, EARLY_STOPPING)
    if early_stopping is not False and beam_style != "hf":
        raise ValueError(
            f"early_stopping={early_stopping!r} is a rule of beam_style='hf'; beam_style="
            f"{beam_style!r} stops by its exact bound (leave early_stopping=False)"
        )
    if not isinstance(forced_eos, bool):
        raise ValueError(f"forced_eos must be True or False; got {forced_eos!r}")
    try:  # ints only (NumPy's too): no floats, bools, strings or nested sequences
        ids = [_token_id(i) for i in banned_ids]
    except TypeError:
        ids = None
    limit = float("inf") if vocab_size is None else vocab_size
    if ids is None or not all(0 <= i < limit for i in ids):
        valid = "ints >= 0" if vocab_size is None else f"ints in [0, {vocab_size})"
        raise ValueError(
            f"banned_ids must be a sequence of token ids ({valid}); got {banned_ids!r}"
        )
    ids = tuple(sorted(set(ids)))
    if eos_id is not None and eos_id in ids:
        raise ValueError(f"banned_ids must not contain eos_id={eos_id}: no row could end")
    return ids


def _token_id(value: Any) -> int:
    """``value`` as a Python int if it is an int (NumPy's too) and not a bool; else TypeError."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


def _banned_mask(banned_ids: tuple[int, ...], vocab: int) -> jax.Array | None:
    """bool ``[vocab]``, True at the banned ids (None when there are none); checked against
    the logits' vocabulary at trace time."""
    if not banned_ids:
        return None
    check_search_options(banned_ids=banned_ids, vocab_size=vocab)
    return jnp.zeros((vocab,), bool).at[jnp.array(banned_ids)].set(True)


# ---------------------------------------------------------------------------
# Beam layout helpers (shared with the model-side glue)
# ---------------------------------------------------------------------------


def expand_to_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Tiles every batched leaf ``[batch, ...]`` to ``[batch * beam_size, ...]``.

    Row ``b * beam_size + j`` is beam ``j`` of batch element ``b`` (all beams start as copies).
    0-d leaves are returned unchanged. Use it for anything the model callback needs per beam,
    e.g. encoder outputs and their padding mask.

    Args:
      tree: pytree of arrays ``[batch, ...]`` (and/or 0-d arrays).
      beam_size: static number of beams.

    Returns:
      pytree with leaves ``[batch * beam_size, ...]`` (0-d leaves unchanged).
    """
    _check_positive_int("beam_size", beam_size)
    return _map_batched(lambda x: jnp.repeat(x, beam_size, axis=0), tree)


def flatten_beams(tree: PyTree) -> PyTree:
    """Merges the two leading axes: ``[batch, beam, ...]`` -> ``[batch * beam, ...]``.

    0-d leaves are returned unchanged (1-d leaves are not allowed: they have no beam axis).
    """

    def flat(x):
        if x.ndim < 2:
            raise ValueError(f"flatten_beams needs leaves [batch, beam, ...], got {x.shape}.")
        return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    return _map_batched(flat, tree)


def unflatten_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Splits the leading axis: ``[batch * beam_size, ...]`` -> ``[batch, beam_size, ...]``.

    0-d leaves are returned unchanged. Inverse of :func:`flatten_beams`.
    """
    _check_positive_int("beam_size", beam_size)

    def unflat(x):
        if x.shape[0] % beam_size:
            raise ValueError(
                f"leading axis {x.shape[0]} is not divisible by beam_size={beam_size}."
            )
        return x.reshape((x.shape[0] // beam_size, beam_size) + x.shape[1:])

    return _map_batched(unflat, tree)


# ---------------------------------------------------------------------------
# Greedy search and sampling (one shared loop)
# ---------------------------------------------------------------------------


def _decode_loop(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    choose: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    batch_size: int,
    max_len: int,
    eos_id: int,
    pad_id: int,
    bos_id: int,
    initial_tokens: jax.Array | None,
    row_max_len: jax.Array | None,
    forced_eos: bool,
    banned_ids: tuple[int, ...],
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Single-hypothesis decoding loop shared by greedy search and sampling.

    ``choose(logits, step) -> int32 [batch]`` picks the next token from float logits
    ``[batch, vocab]`` (already cast to the working dtype, ``banned_ids`` at the dtype's
    lowest value); with ``forced_bos_id`` every row's first token is that id, and with
    ``forced_eos`` a row's token at its limit is EOS whatever it picks (EOS wins when both
    fall on one step, as in Hugging Face's processor order).
    Returns tokens ``[batch, max_len]`` and the summed model log-probs ``[batch]``.
    """
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("max_len", max_len)
    banned_ids = check_search_options(forced_eos=forced_eos, banned_ids=banned_ids, eos_id=eos_id)
    first = _initial_tokens(initial_tokens, batch_size, bos_id)
    limits = _row_limits(row_max_len, batch_size, max_len)

    def cond(state):
        step, _, _, _, finished, _ = state
        # Stop early once every row has emitted EOS or reached its limit: further steps would
        # only append PAD.
        return (step < max_len) & ~jnp.all(finished | (step >= limits))

    def body(state):
        step, last, tokens, log_probs, finished, cache = state
        finished = finished | (step >= limits)  # a row at its limit only appends PAD
        logits, new_cache = tokens_to_logits(last[:, None], cache)
        logits = _checked_logits(logits, batch_size)
        # Scores are reported under the model's own distribution (no temperature / filtering),
        # so every decoding method is scored on the same scale.
        logp = jax.nn.log_softmax(logits, axis=-1)
        banned = _banned_mask(banned_ids, logits.shape[-1])
        if banned is not None:  # finfo.min, not -inf: a sampling row never becomes all -inf
            logits = jnp.where(banned, jnp.finfo(logits.dtype).min, logits)
        nxt = choose(logits, step).astype(jnp.int32)
        if forced_bos_id is not None:
            nxt = jnp.where(step == 0, forced_bos_id, nxt)
        if forced_eos:
            nxt = jnp.where(step == limits - 1, eos_id, nxt)
        nxt = jnp.where(finished, pad_id, nxt)
        tok_logp = jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0]
        log_probs = log_probs + jnp.where(finished, 0.0, tok_logp).astype(log_probs.dtype)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None], (0, step))
        finished = finished | (nxt == eos_id)
        return step + 1, nxt, tokens, log_probs, finished, new_cache

    state = (
        jnp.array(0, jnp.int32),
        first,
        jnp.full((batch_size, max_len), pad_id, dtype=jnp.int32),
        jnp.zeros((batch_size,), jnp.float32),
        jnp.zeros((batch_size,), bool),
        cache,
    )
    _, _, tokens, log_probs, _, _ = lax.while_loop(cond, body, state)
    return tokens, log_probs


def greedy_search(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    *,
    batch_size: int,
    max_len: int,
    eos_id: int = EOS_ID,
    initial_tokens: jax.Array | None = None,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    row_max_len: jax.Array | None = None,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Greedy (argmax) decoding.

    Args:
      tokens_to_logits: model callback, see the module docstring.
      cache: initial cache pytree, batched leaves ``[batch_size, ...]``.
      batch_size: static batch size.
      max_len: static number of tokens to generate (BOS not counted).
      eos_id: end-of-sequence id; a row that emitted it emits ``pad_id`` afterwards.
      initial_tokens: optional int32 ``[batch_size]`` first inputs (default: ``bos_id``).
      pad_id: id written after EOS.
      bos_id: default first input.
      row_max_len: optional int ``[batch_size]``: row ``b`` generates at most
        ``row_max_len[b]`` tokens (clipped to ``[1, max_len]``), PAD after them (default:
        ``max_len`` for every row).
      forced_eos: a row that reaches its limit without EOS gets EOS as its last token
        (Hugging Face's ``forced_eos_token_id``).
      banned_ids: static ids never generated (single-token ``bad_words_ids``); not
        ``eos_id``.
      forced_bos_id: static; every row's first generated token is this id (Hugging Face's
        ``forced_bos_token_id``: mBART's target language code); None: none forced.

    Returns:
      ``(tokens, log_probs)``: int32 ``[batch_size, max_len]`` generated tokens (EOS
      included, PAD after it) and float32 ``[batch_size]`` sum of the model's log-probs of
      the generated tokens up to and including EOS (a forced EOS too: its log-prob under the
      model). The loop stops as soon as every row is done.

    Raises:
      ValueError: a size is not a positive int, or ``banned_ids`` / ``forced_eos`` are not
        valid (see :func:`check_search_options`).
    """
    return _decode_loop(
        tokens_to_logits,
        cache,
        lambda logits, step: row_argmax(logits),  # jnp.argmax, bitwise, vectorised
        batch_size=batch_size,
        max_len=max_len,
        eos_id=eos_id,
        pad_id=pad_id,
        bos_id=bos_id,
        initial_tokens=initial_tokens,
        row_max_len=row_max_len,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        forced_bos_id=forced_bos_id,
    )


def _scatter_mask(shape, rows_index: jax.Array, values: jax.Array) -> jax.Array:
    """Boolean ``[batch, vocab]`` mask with ``values`` ([batch, n], bool) written at
    ``rows_index`` ([batch, n] vocabulary ids)."""
    rows = jnp.arange(shape[0])[:, None]
    return jnp.zeros(shape, bool).at[rows, rows_index].set(values)


def _filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering of float logits ``[batch, vocab]``.

    Excluded entries are set to the dtype's most negative finite value rather than -inf, so
    that a row can never end up with only -inf (which would give NaN probabilities).
    Exactly ``top_k`` tokens are kept (ties broken by lower id, as ``argmax`` does), and the
    nucleus keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p``
    (at least one token), so ``top_k=1`` and a tiny ``top_p`` both reduce to argmax.
    """
    neg = jnp.finfo(logits.dtype).min
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        _, idx = lax.top_k(logits, top_k)
        keep = _scatter_mask(logits.shape, idx, jnp.ones(idx.shape, bool))
        logits = jnp.where(keep, logits, neg)
    if top_p < 1.0:
        # Stable descending sort: equal logits keep ascending ids, consistent with argmax.
        order = jnp.argsort(-logits, axis=-1, stable=True)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Mass strictly before each token: keep it while that mass is still below top_p, so the
        # first token (mass 0) is always kept.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = _scatter_mask(logits.shape, order, mass_before < top_p)
        logits = jnp.where(keep, logits, neg)
    return logits


def sample(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    rng: jax.Array,
    *,
    batch_size: int,
    max_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int = EOS_ID,
    initial_tokens: jax.Array | None = None,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    row_max_len: jax.Array | None = None,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    forced_bos_id: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ancestral sampling with temperature, top-k and nucleus (top-p) filtering.

    At step ``t`` the key ``jax.random.fold_in(rng, t)`` is used, so results depend only on
    ``rng`` (same key -> same tokens). Logits are divided by ``temperature``, then restricted
    to the ``top_k`` most likely tokens (``0`` = off), then to the nucleus of mass ``top_p``
    (``1.0`` = off). ``temperature == 0`` is exactly greedy (argmax, no randomness).

    Args:
      tokens_to_logits: model callback, see the module docstring.
      cache: initial cache pytree, batched leaves ``[batch_size, ...]``.
      rng: PRNG key (raw ``uint32[2]`` or typed key).
      batch_size: static batch size.
      max_len: static number of tokens to generate (BOS not counted).
      temperature: static float ``>= 0``.
      top_k: static int ``>= 0``; 0 disables (values ``>= vocab`` too).
      top_p: static float in ``(0, 1]``; 1 disables.
      eos_id: end-of-sequence id; a row that emitted it emits ``pad_id`` afterwards.
      initial_tokens: optional int32 ``[batch_size]`` first inputs (default: ``bos_id``).
      pad_id: id written after EOS.
      bos_id: default first input.
      row_max_len: optional int ``[batch_size]`` per-row limits, as in :func:`greedy_search`.
      forced_eos, banned_ids, forced_bos_id: token constraints, as in :func:`greedy_search`
        (banned ids are never sampled).

    Returns:
      ``(tokens, log_probs)``: int32 ``[batch_size, max_len]`` and float32 ``[batch_size]``
      sum of the log-probs of the sampled tokens under the *unmodified* model distribution
      (no temperature, filtering or constraints), up to and including EOS.

    Raises:
      ValueError: ``temperature < 0``, ``top_k < 0``, ``top_p`` outside ``(0, 1]``, or
        invalid ``forced_eos`` / ``banned_ids``.
    """
    # The arguments are static: validating them here (in Python) gives clear errors at trace
    # time instead of silent NaNs.
    temperature = float(temperature)
    top_p = float(top_p)
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in the range (0, 1] (1 disables it), got {top_p}.")

    def choose(logits, step):
        if temperature == 0.0:
            return row_argmax(logits)
        # Clamp: masked logits (finfo.min) divided by a small temperature would overflow to
        # -inf, and an all -inf row has no distribution.
        scaled = jnp.maximum(logits / temperature, jnp.finfo(logits.dtype).min)
        logits = _filter_logits(scaled, top_k, top_p)
        return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)

    return _decode_loop(
        tokens_to_logits,
        cache,
        choose,
        batch_size=batch_size,
        max_len=max_len,
        eos_id=eos_id,
        pad_id=pad_id,
        bos_id=bos_id,
        initial_tokens=initial_tokens,
        row_max_len=row_max_len,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        forced_bos_id=forced_bos_id,
    )
