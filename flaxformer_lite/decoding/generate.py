"""Batch inference: one jitted call from token ids to generated token ids.

``generate`` binds a model to the pure searches of ``decoding``: the encoder runs once per
batch, the decoder runs one position per step against its key/value cache. A ``scan_layers``
model decodes as its unrolled equivalent (``models.unrolled``): the cache is one array per
layer with the batch on axis 0. Beam search keeps that cache in place: each hypothesis writes
its own row and follows its history through the small ``beam_ancestors`` array, the only
thing reordered by parent beam, and cross-attention keeps one entry per source
(``beam_cache``; ``beam_cache="reorder"`` gathers every row instead, the classic search).

Every decoding option is a field of one frozen ``GenerationConfig`` (``generation_config``):
``generate(params, config, inputs, generation, **overrides)``, the overrides replacing its
fields for one call as Hugging Face's ``generate(**kwargs)`` does (``generate(params, config,
inputs, method="beam", beam_size=4)``). The jitted calls take it as one static argument.

Both run on a ``jax.sharding.Mesh`` (default: every device, ``sharding.make_mesh()``): the
batch is split over its ``data`` and ``fsdp`` axes, the parameters are placed by the logical
axis rules of ``sharding.py`` (heads, MLP units and vocabulary over ``tensor``), and the
key/value cache keeps its batch on ``data`` x ``fsdp`` and its kv heads on ``tensor``
(``sharding.cache_sharding``). A batch whose rows the data axes do not divide is padded with
copies of its first row, which are dropped from the result inside the same jitted call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxformer_lite import models
from flaxformer_lite.core import sharding
from flaxformer_lite.decoding import beam, search
from flaxformer_lite.decoding.generation_config import (  # noqa: F401  (re-exported)
    BEAM_CACHES,
    METHODS,
    SOURCE,
    GenerationConfig,
    check_decode_len,
    field_names,
    resolve,
    source_limit,
)
from flaxformer_lite.models import DecoderOnly, EncoderDecoder, unrolled
from flaxformer_lite.nn.config import TransformerConfig

# Shapes and Python-level choices: each distinct value compiles once (the GenerationConfig is
# frozen and hashable: one static argument for every decoding option).
STATIC_ARGNAMES = ("config", "generation", "mesh", "rows")
# What the jitted entry points take besides GenerationConfig field overrides.
_JIT_KEYWORDS = ("generation", "mesh", "rows", "rng", "row_max_len", "left_padding")


def init_cache(
    model: Any,
    params: Any,
    batch_size: int,
    max_len: int,
    src_len: int | None = None,
    *,
    beam_size: int = 1,
) -> Any:
    """A zero key/value cache for ``batch_size`` rows and ``max_len`` decoder positions.

    Only shapes are traced (``jax.eval_shape`` of a decoding call with ``params``): nothing
    is computed and no parameter is initialised. For a ``scan_layers`` model the cache is that
    of its unrolled equivalent (``models.unrolled``), the model that decodes with it.

    ``beam_size > 1``: the cache of beam search in place for ``batch_size`` sources: the
    self-attention entries and ``beam_ancestors`` have ``batch_size * beam_size`` rows, the
    cross-attention entries ``batch_size`` (``models.EncoderDecoder.decode``).
    """
    params, config = unrolled(params, model.config)
    if config is not model.config:
        model = type(model)(config)
    tokens = jnp.zeros((batch_size * beam_size, max_len), jnp.int32)
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
                beam_size=beam_size,
                mutable=["cache"],
                method=model.decode,
            )
    else:

        def run(p):
            return model.apply(
                {"params": p},
                tokens,
                decode=True,
                beam_size=beam_size,
                mutable=["cache"],
                method=model.decode,
            )

    shapes = jax.eval_shape(run, params)[1]["cache"]
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _decoder_call(
    model: Any, params: Any, *context: Any, beam_size: int = 1, left_padding: Any = None
):
    """``tokens, cache -> (logits of the last position, new cache)`` through ``model.decode``
    with ``decode=True``; ``context`` goes before the tokens (encoder output and source for an
    EncoderDecoder, nothing for a DecoderOnly). Zero-length tokens only update the cache.
    ``beam_size > 1``: tokens are beam search's ``rows * beam_size`` hypotheses over a cache
    that stays in place (``init_cache(beam_size=)``), ``context`` one row per source.
    ``left_padding``: int `[rows]` (a DecoderOnly's left-padded prompts, one value per row the
    call decodes), passed to every call (``models.Decoder``)."""
    extra = {} if left_padding is None else {"left_padding": left_padding}

    def call(tokens: jax.Array, cache: Any) -> tuple[jax.Array | None, Any]:
        logits, updated = model.apply(
            {"params": params, "cache": cache},
            *context,
            tokens,
            decode=True,
            # init_cache sizes the cache for every position the search writes: no run-time
            # overflow check (a lax.cond per layer and step) in the decoding loop.
            check_cache=False,
            beam_size=beam_size,
            mutable=["cache"],
            method=model.decode,
            **extra,
        )
        return (logits[:, -1] if tokens.shape[1] else None), updated["cache"]

    return call


def _search(
    generation: GenerationConfig,
    tokens_to_logits,
    cache,
    batch_size: int,
    max_len: int,
    *,
    rng,
    initial_tokens,
    row_max_len,
    config: TransformerConfig,
    reorder_cache=None,
):
    """The search ``generation.method`` names over ``tokens_to_logits``, with its options;
    ``max_len`` the output width (resolved from ``generation.max_len``)."""
    g = generation
    # The model's own ids: decoding starts from the decoder-start token it was trained behind,
    # stops at its EOS and pads with its PAD (all default to special_ids).
    ids = dict(
        bos_id=config.bos_id,
        eos_id=config.eos_id,
        pad_id=config.pad_id,
        row_max_len=row_max_len,
        forced_eos=g.forced_eos,
        banned_ids=g.banned_ids,
        forced_bos_id=g.forced_bos_id,
    )
    if g.method == "greedy":
        return search.greedy_search(
            tokens_to_logits,
            cache,
            batch_size=batch_size,
            max_len=max_len,
            initial_tokens=initial_tokens,
            **ids,
        )
    if g.method == "sample":
        if rng is None:
            raise ValueError("method='sample' needs an explicit rng (a jax.random key)")
        return search.sample(
            tokens_to_logits,
            cache,
            rng,
            batch_size=batch_size,
            max_len=max_len,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            initial_tokens=initial_tokens,
            **ids,
        )
    sequences, scores = beam.beam_search(
        tokens_to_logits,
        cache,
        batch_size=batch_size,
        beam_size=g.beam_size,
        max_len=max_len,
        alpha=g.alpha,
        beam_style=g.beam_style,
        early_stopping=g.early_stopping,
        initial_tokens=initial_tokens,
        reorder_cache=reorder_cache,
        renormalize=g.renormalize,
        **ids,
    )
    return sequences[:, 0], scores[:, 0]


# ----------------------------------------------------------------------------- placement


@functools.lru_cache(maxsize=8)
def _default_mesh(devices: tuple) -> Mesh:
    return sharding.make_mesh((-1, 1, 1), devices)


def default_mesh() -> Mesh:
    """Every device, the batch split over all of them: ``sharding.make_mesh((-1, 1, 1))``."""
    return _default_mesh(tuple(jax.devices()))


@functools.lru_cache(maxsize=32)
def param_shardings(model_cls: type, config: TransformerConfig, mesh: Mesh) -> Any:
    """NamedShardings of ``model_cls(config)``'s parameter tree on ``mesh``, from the logical
    axis names its layers give their parameters (``sharding.LOGICAL_RULES``); only shapes
    are traced. A prefix of boxed parameter trees too (one sharding per box)."""
    model = model_cls(config)
    tokens = jnp.ones((1, 1), jnp.int32)
    args = (tokens, tokens) if model_cls is EncoderDecoder else (tokens,)
    # No rules in force while tracing: under the caller's (train.py's loop) unboxing would
    # constrain the shape-only leaves.
    with nn.logical_axis_rules(()):
        abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
        return sharding.logical_shardings(abstract, mesh)


def place_params(params: Any, model_cls: type, config: TransformerConfig, mesh: Mesh) -> Any:
    """``params`` on ``mesh`` as :func:`param_shardings` says (no copy where already there)."""
    return jax.tree_util.tree_map(
        lambda sh, p: jax.device_put(p, sh), param_shardings(model_cls, config, mesh), params
    )


def place_rows(tokens: Any, mesh: Mesh, name: str = "inputs") -> tuple[jax.Array, int]:
    """Token ids `[rows, length]` as a global array with its rows split over the data axes.

    Rows that ``sharding.batch_parallelism(mesh)`` does not divide are padded with copies of
    row 0 (they end when it does, so they never keep the decoding loop running longer).
    Returns the placed `[padded_rows, length]` array and the real row count.

    Raises:
      ValueError: ``tokens`` (``name`` in the message) is not rank 2, or is a multi-process
        array whose rows the data axes do not divide (each process holds only its part:
        padding it is the caller's).
    """
    if not hasattr(tokens, "shape"):  # nested lists
        tokens = np.asarray(tokens, np.int32)
    if len(tokens.shape) != 2:
        raise ValueError(f"{name} must be [batch, length] token ids; got shape {tokens.shape}")
    rows = int(tokens.shape[0])
    split = sharding.batch_parallelism(mesh)
    padded = -(-rows // split) * split
    target = sharding.batch_sharding(mesh)
    global_input = isinstance(tokens, jax.Array) and not tokens.is_fully_addressable
    if (
        isinstance(tokens, jax.Array)
        and padded == rows
        and (global_input or target.is_fully_addressable)
    ):
        return jax.device_put(tokens, target), rows
    if global_input:
        raise ValueError(
            f"{name}: a multi-process batch of {rows} rows cannot be split over the mesh's "
            f"data x fsdp axes ({split} devices): give a multiple of {split} rows"
        )
    host = np.asarray(tokens)
    if padded != rows:
        host = np.concatenate([host, np.repeat(host[:1], padded - rows, axis=0)])
    # From the host value on every process: also right when the mesh spans several hosts.
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index]), rows


def _replicated(x: jax.Array | None, mesh: Mesh) -> jax.Array | None:
    return None if x is None else jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def _constrain_params(params: Any, model_cls: type, config: TransformerConfig, mesh: Mesh):
    return jax.tree_util.tree_map(
        lambda sh, p: jax.lax.with_sharding_constraint(p, sh),
        param_shardings(model_cls, config, mesh),
        params,
    )


def _constrain_cache(cache: Any, mesh: Mesh) -> Any:
    return jax.lax.with_sharding_constraint(cache, sharding.cache_shardings(cache, mesh))


def _sharded_step(step, mesh: Mesh):
    """``step`` whose returned cache keeps :func:`sharding.cache_shardings` (the while loop's
    carry then stays in place instead of being gathered)."""

    def call(tokens, cache):
        logits, cache = step(tokens, cache)
        return logits, _constrain_cache(cache, mesh)

    return call


def _unpad(outputs: Any, rows: int | None, mesh: Mesh) -> Any:
    """The first ``rows`` rows of each output: still split over the data axes when nothing
    was padded, replicated otherwise (a row count the data axes do not divide)."""
    if rows is None or rows == jax.tree_util.tree_leaves(outputs)[0].shape[0]:
        return jax.lax.with_sharding_constraint(outputs, sharding.batch_sharding(mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(
        lambda x: jax.lax.with_sharding_constraint(x[:rows], replicated), outputs
    )


def check_search_options(
    config: TransformerConfig,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: Any = (),
) -> tuple[int, ...]:
    """The checks of ``GenerationConfig(beam_style=..., early_stopping=..., forced_eos=...,
    banned_ids=...).checked_for(config)``, for code written before GenerationConfig: returns
    ``banned_ids`` as the sorted tuple of distinct ids.

    Raises:
      ValueError: naming the argument and the valid values.
    """
    generation = GenerationConfig(
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
    )
    return generation.checked_for(config).banned_ids


def _place_row_max_len(row_max_len: Any, rows: int, padded: int, mesh: Mesh, max_len: int):
    """``row_max_len`` (ints `[rows]`) as a `[padded]` int32 global array split like the
    input rows, padded as :func:`place_rows` pads them (copies of row 0's limit).

    Host values must lie in ``[1, max_len]``. A multi-process global array (e.g. from
    ``sharding.global_rows_with_ids``, its rows following the inputs') is taken as it is:
    its values are clipped to that range inside the search.
    """
    if row_max_len is None:
        return None
    shape, dtype = getattr(row_max_len, "shape", None), getattr(row_max_len, "dtype", None)
    if shape is None:
        row_max_len = np.asarray(row_max_len)
        shape, dtype = row_max_len.shape, row_max_len.dtype
    if tuple(shape) != (rows,) or not np.issubdtype(dtype, np.integer):
        raise ValueError(
            f"row_max_len must be ints [batch] = ({rows},), one limit per input row; got "
            f"{dtype} {tuple(shape)}"
        )
    target = sharding.batch_sharding(mesh)
    if isinstance(row_max_len, jax.Array) and not row_max_len.is_fully_addressable:
        if padded != rows:
            raise ValueError(
                f"row_max_len: a multi-process array of {rows} rows cannot be padded to the "
                f"{padded} rows of the inputs: give a multiple of the data x fsdp devices"
            )
        return jax.device_put(row_max_len.astype(jnp.int32), target)
    limits = np.asarray(row_max_len)
    if rows and not (limits.min() >= 1 and limits.max() <= max_len):
        raise ValueError(
            f"row_max_len values must be in [1, max_len={max_len}]; got {limits.min()} .. "
            f"{limits.max()}"
        )
    host = np.concatenate([limits, np.repeat(limits[:1], padded - rows)]).astype(np.int32)
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


# ----------------------------------------------------------------------------- jitted calls


class _OptionsJit:
    """A jitted decoding call whose GenerationConfig may also come as keyword overrides, as
    :func:`generate`'s (``method="beam", beam_size=4``): calls, ``.lower`` (ahead-of-time
    compilation) and ``._cache_size`` as ``jax.jit``'s. The resolved config is one static
    argument, so each distinct decoding compiles once."""

    def __init__(self, fn: Any) -> None:
        self.jitted = jax.jit(fn, static_argnames=STATIC_ARGNAMES)
        functools.update_wrapper(self, fn)

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        fields = set(field_names())
        unknown = sorted(set(kwargs) - fields - set(_JIT_KEYWORDS))
        if unknown:
            raise TypeError(
                f"{self.__name__}() got unexpected keyword arguments {unknown}; valid: "
                f"{', '.join(_JIT_KEYWORDS)} and the GenerationConfig fields "
                f"{', '.join(sorted(fields))}"
            )
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        generation = args[3] if len(args) > 3 else kwargs.pop("generation", None)
        kwargs["generation"] = resolve(generation, overrides)
        return args[:3], kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        args, kwargs = self._arguments(args, kwargs)
        return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._arguments(args, kwargs)
        return self.jitted.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def _source_row_limits(inputs: jax.Array, config: TransformerConfig, max_len: int) -> jax.Array:
    """int32 `[rows]`: each source row's own limit under ``max_len="source"``, from its ids
    that are not ``config.pad_id`` (EOS included), at most ``max_len``."""
    lengths = jnp.count_nonzero(inputs != config.pad_id, axis=1).astype(jnp.int32)
    return source_limit(lengths, max_len)


@_OptionsJit
def generate_jit(
    params: Any,
    config: TransformerConfig,
    inputs: jax.Array,
    generation: GenerationConfig,
    *,
    mesh: Mesh,
    rows: int | None = None,
    rng: jax.Array | None = None,
    row_max_len: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The one jitted call of :func:`generate` (``params`` one model's, or a tuple of several
    models' for an ensemble): ``inputs`` `[padded_rows, src_len]` (a multiple
    of the data axes) and optional ``row_max_len`` `[padded_rows]` (None under
    ``max_len="source"``: each row's limit from its own source ids), the first ``rows`` of the
    results returned (None: all of them). ``generation`` (None: ``GenerationConfig()``) and
    keyword overrides of its fields as in :func:`generate`. Called directly (``.lower`` for
    ahead-of-time compilation), it places nothing itself: arguments on other shardings are
    moved inside the call."""
    max_len = generation.decode_len(config, source_len=inputs.shape[1])
    members = params if isinstance(params, tuple) else (params,)
    inputs = jax.lax.with_sharding_constraint(inputs, sharding.batch_sharding(mesh))
    if row_max_len is None and generation.max_len == SOURCE:
        row_max_len = _source_row_limits(inputs, config, max_len)
    if row_max_len is not None:
        row_max_len = jax.lax.with_sharding_constraint(row_max_len, sharding.batch_sharding(mesh))
    method, beam_size = generation.method, generation.beam_size
    in_place = method == "beam" and generation.beam_cache == "in_place" and beam_size > 1
    batch_size = inputs.shape[0]
    # The models' own activation constraints (``models.stack.constrain_residual``) follow the
    # same rules.
    with (
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        nn.logical_axis_rules(sharding.LOGICAL_RULES),
    ):
        primed = []
        for member in members:
            member = _constrain_params(member, EncoderDecoder, config, mesh)
            step, cache, decode_config = _primed_decoder(
                member, config, inputs, generation, max_len, in_place=in_place, mesh=mesh
            )
            primed.append((step, cache))
        step, cache = _combined(primed)
        tokens, scores = _search(
            generation,
            step,
            cache,
            batch_size,
            max_len,
            rng=rng,
            initial_tokens=None,
            row_max_len=row_max_len,
            config=decode_config,
            # Every member's beam_ancestors, wherever they sit in the (nested) cache.
            reorder_cache=models.reorder_beam_cache if in_place else None,
        )
    return _unpad((tokens, scores), rows, mesh)


def _primed_decoder(
    params: Any,
    config: TransformerConfig,
    inputs: jax.Array,
    generation: GenerationConfig,
    max_len: int,
    *,
    in_place: bool,
    mesh: Mesh,
) -> tuple[Any, Any, TransformerConfig]:
    """One EncoderDecoder's decoding step ``tokens, cache -> (logits, cache)`` and its cache
    with the encoder keys/values of ``inputs`` `[rows, src_len]` already projected, for the
    search ``generation`` names (beam search in place: one source row per ``beam_size``
    hypotheses; reordering: the source repeated per beam), and the config it decodes with
    (a ``scan_layers`` model's unrolled one)."""
    params, config = unrolled(params, config)
    model = EncoderDecoder(config)
    beam_size = generation.beam_size
    encoded = model.apply({"params": params}, inputs, method=model.encode)
    if generation.method == "beam" and not in_place:  # one copy of the source per beam
        encoded, inputs = search.expand_to_beams((encoded, inputs), beam_size)
    beams = beam_size if in_place else 1  # in place: the source's rows stay one each
    beam_rows = inputs.shape[0] * beams
    cache = _constrain_cache(
        init_cache(model, params, inputs.shape[0], max_len, inputs.shape[1], beam_size=beams),
        mesh,
    )
    # A zero-length decoder call projects the encoder keys/values of every layer into the
    # cache once; the steps pass encoded=None and project only their new position.
    prime = _sharded_step(_decoder_call(model, params, encoded, inputs, beam_size=beams), mesh)
    _, cache = prime(jnp.zeros((beam_rows, 0), jnp.int32), cache)
    step = _sharded_step(_decoder_call(model, params, None, inputs, beam_size=beams), mesh)
    return step, cache, config


def _combined(primed: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
    """One model's ``(step, cache)`` as it is; several models' as one: ``ensemble_step`` over
    the cache ``{"member_i": cache_i}``."""
    if len(primed) == 1:
        return primed[0]
    steps, caches = zip(*primed, strict=True)
    return ensemble_step(steps), {f"member_{i}": c for i, c in enumerate(caches)}


def ensemble_step(steps: Sequence[Any]) -> Any:
    """Several models' decoding steps as one: ``tokens, {"member_i": cache_i} -> (log of the
    mean of their next-token probabilities `[rows, vocab]`, float32; the updated caches)``.

    The mean of probabilities (not of logits) is the ensemble of Marian and fairseq; it is a
    normalised log-distribution, so the searches' own log-softmax leaves it as it is."""

    def call(tokens: jax.Array, cache: Any) -> tuple[jax.Array | None, Any]:
        log_probs, updated = [], {}
        for i, step in enumerate(steps):
            logits, updated[f"member_{i}"] = step(tokens, cache[f"member_{i}"])
            if logits is not None:
                log_probs.append(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        if not log_probs:  # a zero-length call only fills the caches
            return None, updated
        stacked = jnp.stack(log_probs)
        return jax.nn.logsumexp(stacked, axis=0) - jnp.log(float(len(steps))), updated

    return call


def prompt_context(
    prompt: jax.Array, left_padding: jax.Array | None, config: TransformerConfig, bos: bool
) -> jax.Array:
    """What the decoder reads before generating: the prompt `[batch, prompt_len]`, or with
    ``bos`` `[batch, prompt_len + 1]`: ``config.bos_id`` just before each row's first real
    token (a left-padded row, ``left_padding`` int `[batch]` pads: its pads, BOS, its ids)."""
    prompt = prompt.astype(jnp.int32)
    if not bos:
        return prompt
    batch = prompt.shape[0]
    context = jnp.concatenate([jnp.full((batch, 1), config.bos_id, jnp.int32), prompt], axis=1)
    if left_padding is None:
        return context
    # Left-padded rows: the pad ids shift one column right; BOS lands where the first real
    # token was, just before it.
    shifted = jnp.concatenate([prompt[:, :1], prompt], axis=1)
    column = jnp.arange(context.shape[1])[None, :]
    return jnp.where(column == left_padding[:, None], config.bos_id, shifted)


@_OptionsJit
def continue_prompt_jit(
    params: Any,
    config: TransformerConfig,
    prompt: jax.Array,
    generation: GenerationConfig,
    *,
    mesh: Mesh,
    rows: int | None = None,
    rng: jax.Array | None = None,
    left_padding: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The one jitted call of :func:`continue_prompt` (see :func:`generate_jit`; ``params``
    one model's, or a tuple of several models' for an ensemble); ``left_padding`` int
    `[padded_rows]`: each row's left pads (None: none)."""
    members = params if isinstance(params, tuple) else (params,)
    prompt = jax.lax.with_sharding_constraint(prompt, sharding.batch_sharding(mesh))
    if left_padding is not None:
        left_padding = jax.lax.with_sharding_constraint(
            left_padding.astype(jnp.int32), sharding.batch_sharding(mesh)
        )
    batch_size, prompt_len = prompt.shape
    max_len = generation.decode_len(config, prompt_len=prompt_len)
    method, beam_size = generation.method, generation.beam_size
    in_place = method == "beam" and generation.beam_cache == "in_place" and beam_size > 1
    context = prompt_context(prompt, left_padding, config, generation.prepend_bos)
    with (
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        nn.logical_axis_rules(sharding.LOGICAL_RULES),
    ):
        primed = []
        for member in members:
            member = _constrain_params(member, DecoderOnly, config, mesh)
            step, cache, decode_config = _primed_continuation(
                member, config, context, left_padding, generation, max_len,
                in_place=in_place, mesh=mesh,
            )  # fmt: skip
            primed.append((step, cache))
        step, cache = _combined(primed)
        tokens, scores = _search(
            generation,
            step,
            cache,
            batch_size,
            max_len,
            rng=rng,
            initial_tokens=context[:, -1],
            row_max_len=None,
            config=decode_config,
            reorder_cache=models.reorder_beam_cache if in_place else None,
        )
    return _unpad((tokens, scores), rows, mesh)


def _primed_continuation(
    params: Any,
    config: TransformerConfig,
    context: jax.Array,
    left_padding: jax.Array | None,
    generation: GenerationConfig,
    max_len: int,
    *,
    in_place: bool,
    mesh: Mesh,
) -> tuple[Any, Any, TransformerConfig]:
    """One DecoderOnly's decoding step ``tokens, cache -> (logits, cache)`` and its cache with
    ``context`` `[rows, context_len]` but its last id already written (prefill), laid out for
    the search ``generation`` names (beam search in place: the prompt once per row, its beams
    copies of it; reordering: one row per hypothesis), and the config it decodes with (a
    ``scan_layers`` model's unrolled one)."""
    params, config = unrolled(params, config)
    model = DecoderOnly(config)
    batch_size = context.shape[0]
    beam_size = generation.beam_size
    cache = init_cache(model, params, batch_size, context.shape[1] + max_len)
    cache = _constrain_cache(cache, mesh)
    step = _sharded_step(_decoder_call(model, params, left_padding=left_padding), mesh)
    _, cache = step(context[:, :-1], cache)  # prefill the prompt
    # Beam search decodes batch * beam_size rows, each with its source's padding.
    beam_padding = left_padding
    if left_padding is not None and generation.method == "beam":
        beam_padding = search.expand_to_beams(left_padding, beam_size)
        if not in_place:
            step = _sharded_step(_decoder_call(model, params, left_padding=beam_padding), mesh)
    if in_place:
        # The prompt was written once per row; its beams start as copies of it. A
        # zero-length call adds the beams' ancestry (zeros: every slot from beam 0).
        cache = _constrain_cache(search.expand_to_beams(cache, beam_size), mesh)
        step = _sharded_step(
            _decoder_call(model, params, beam_size=beam_size, left_padding=beam_padding), mesh
        )
        _, cache = step(jnp.zeros((batch_size * beam_size, 0), jnp.int32), cache)
    return step, cache, config


def left_padding_of(prompt_mask: Any, prompt_shape: tuple[int, ...]) -> np.ndarray:
    """int32 `[batch]`: the pads at the start of each row of a left-padded prompt, from its
    attention mask `[batch, prompt_len]` (1 or True on real tokens; Hugging Face's
    ``attention_mask`` of a tokenizer with ``padding_side="left"``).

    Raises:
      ValueError: ``prompt_mask`` is not the prompt's shape, holds other values than 0/1, or
        a row is not left-padded (a 1 before a 0) or has no real token.
    """
    mask = np.asarray(prompt_mask)
    if mask.shape != tuple(prompt_shape):
        raise ValueError(
            f"prompt_mask must have the prompt's shape {tuple(prompt_shape)}; got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        if not np.issubdtype(mask.dtype, np.integer) or not np.isin(mask, (0, 1)).all():
            raise ValueError("prompt_mask must hold 0/1 (or bools): 1 on real tokens, 0 on pads")
        mask = mask.astype(bool)
    real = mask.sum(axis=1)
    if mask.size and (real == 0).any():
        raise ValueError(
            f"prompt_mask rows {np.flatnonzero(real == 0).tolist()} have no real token"
        )
    pads = mask.shape[1] - real
    left_padded = mask == (np.arange(mask.shape[1])[None, :] >= pads[:, None])
    if not left_padded.all():
        raise ValueError(
            f"prompt_mask rows {np.flatnonzero(~left_padded.all(axis=1)).tolist()} are not "
            "left-padded (pads, then real tokens): pad prompts on the left (a Hugging Face "
            "tokenizer's padding_side='left')"
        )
    return pads.astype(np.int32)


# ----------------------------------------------------------------------------- entry points


def _checked_rng(generation: GenerationConfig, rng: jax.Array | None, mesh: Mesh):
    """``rng`` replicated on ``mesh`` for sampling, None for the other methods (which do not
    read it: one compile whatever key is passed)."""
    if generation.method != "sample":
        return None
    if rng is None:
        raise ValueError("method='sample' needs an explicit rng (a jax.random key)")
    return _replicated(rng, mesh)


def _placed(params: Any, model_class: type, config: TransformerConfig, mesh: Mesh) -> Any:
    """``place_params`` of one model's parameters, or of each of a tuple (or list) of several
    models' (an ensemble; one element: that model alone)."""
    if not isinstance(params, (list, tuple)):
        return place_params(params, model_class, config, mesh)
    if not params:
        raise ValueError("params: an empty sequence; give one model's parameters or a "
                         "tuple of several models' (an ensemble)")  # fmt: skip
    placed = tuple(place_params(p, model_class, config, mesh) for p in params)
    return placed[0] if len(placed) == 1 else placed


def generate(
    params: Any,
    config: TransformerConfig,
    inputs: Any,
    generation: GenerationConfig | None = None,
    *,
    mesh: Mesh | None = None,
    rng: jax.Array | None = None,
    row_max_len: Any = None,
    **overrides: Any,
) -> tuple[jax.Array, jax.Array]:
    """Translates a batch of source token ids with an ``EncoderDecoder``.

    Args:
      params: the model parameters (``variables["params"]``, boxed or not; stacked ones of a
        ``scan_layers`` model are unstacked inside the call), or a tuple (or list) of several
        models' of the same ``config``: an ensemble, whose next-token distribution at every
        step is the mean of theirs (``ensemble_step``; each model keeps its own cache).
      config: the model's TransformerConfig.
      inputs: int `[batch, src_len]`, padded with ``config.pad_id``; rows may have different
        lengths (numpy, or a jax array; a multi-process global array needs rows the data
        axes divide).
      generation: the decoding options (:class:`GenerationConfig`: method, ``max_len``, beam
        and sampling options, token constraints); None = ``GenerationConfig()``, greedy up to
        ``config.max_len`` tokens.
      mesh: the devices to run on (axes data, fsdp, tensor); None = every device, the batch
        split over all of them. Parameters already placed on it are not copied.
      rng: a ``jax.random`` key, needed by ``method="sample"`` (ignored by the others).
      row_max_len: optional ints `[batch]`, each in ``[1, max_len]``: row ``b`` generates
        at most ``row_max_len[b]`` tokens (PAD after them), so its output does not depend on
        the limits of the other rows; ``max_len`` is then the output width. Host values, or
        a global array whose rows follow those of ``inputs`` (multi-process). A traced
        argument: other limits do not compile again. None under ``max_len="source"``: each
        row's limit from its own source ids.
      **overrides: GenerationConfig fields replacing ``generation``'s for this call, as
        Hugging Face's ``generate(**kwargs)``: ``generate(params, config, inputs,
        method="beam", beam_size=4)``.

    Returns:
      tokens int32 `[batch, max_len]` (EOS-terminated, PAD after EOS, no BOS) and scores
      float32 `[batch]` (log-probability; length-normalised for beam search). The same
      tokens on any mesh (up to float rounding between different reduction orders).

    Raises:
      TypeError: an override that is not a GenerationConfig field (the valid ones listed).
      ValueError: an option that is not valid (the field named: see GenerationConfig), a
        ``max_len`` beyond ``config.max_len`` or banned ids outside its vocabulary
        (``GenerationConfig.checked_for``), sampling without ``rng``, ``inputs`` not rank 2,
        ``row_max_len`` of another shape or out of ``[1, max_len]``; all before anything is
        traced.
    """
    generation = resolve(generation, overrides).checked_for(config)
    mesh = default_mesh() if mesh is None else mesh
    rng = _checked_rng(generation, rng, mesh)
    if not hasattr(inputs, "shape"):  # nested lists
        inputs = np.asarray(inputs, np.int32)
    inputs, rows = place_rows(inputs, mesh)
    max_len = generation.decode_len(config, source_len=inputs.shape[1])
    limits = _place_row_max_len(row_max_len, rows, inputs.shape[0], mesh, max_len)
    return generate_jit(
        _placed(params, EncoderDecoder, config, mesh),
        config,
        inputs,
        generation.canonical(),
        mesh=mesh,
        rows=rows,
        rng=rng,
        row_max_len=limits,
    )


def continue_prompt(
    params: Any,
    config: TransformerConfig,
    prompt: Any,
    generation: GenerationConfig | None = None,
    *,
    mesh: Mesh | None = None,
    rng: jax.Array | None = None,
    prompt_mask: Any = None,
    **overrides: Any,
) -> tuple[jax.Array, jax.Array]:
    """Continues prompts with a ``DecoderOnly`` language model, or with an ensemble of several
    (``params`` a tuple of their parameter trees, one ``config``: as :func:`generate`).

    prompt: int `[batch, prompt_len]`; without ``prompt_mask`` every id is real. BOS is
    prepended here unless ``generation.prepend_bos`` is False (Hugging Face's ``generate``:
    the ids as given, its tokenizer having added BOS). The prompt is written into the cache
    in one call (prefill); then up to ``max_len`` tokens are generated (None: as many as
    ``config.max_len`` leaves after BOS and the prompt; "source" does not apply).
    prompt_mask: None, or the attention mask `[batch, prompt_len]` of left-padded prompts (1
    on real ids, 0 on the pads before them; a Hugging Face tokenizer's ``padding_side=
    "left"``): the pads are hidden from every query and each row's positions count its real
    tokens only (``cumsum(mask) - 1``, as transformers' generate), so a row continues as it
    would alone. ``generation``, ``mesh``, ``rng`` and ``overrides`` as in :func:`generate`.
    Returns the continuation `[batch, max_len]` and scores `[batch]`.

    Raises:
      ValueError: BOS + prompt + ``max_len`` new tokens exceed ``config.max_len`` (the cache
        and positions), an empty prompt without BOS, a ``prompt_mask`` that is not a
        left-padding mask of the prompt's shape (named), a ``prompt_mask`` with a
        sliding-window model (``attention_window``), or the arguments of :func:`generate`
        are wrong (before tracing).
    """
    generation = resolve(generation, overrides)
    if not hasattr(prompt, "shape"):  # nested lists
        prompt = np.asarray(prompt, np.int32)
    # A prompt of another rank: place_rows below names the argument.
    prompt_len = int(prompt.shape[1]) if len(prompt.shape) == 2 else 0
    generation.checked_for(config, prompt_len=prompt_len)
    if len(prompt.shape) == 2 and not generation.prepend_bos and prompt_len == 0:
        raise ValueError(
            "prompt has no tokens and prepend_bos=False: give at least one id per row "
            "(e.g. the tokenizer's BOS), or prepend_bos=True"
        )
    left_padding = None
    if prompt_mask is not None:
        if config.self_attention_window("decoder") is not None:
            raise ValueError(
                "prompt_mask (left-padded prompts) needs the full key/value cache; "
                f"TransformerConfig.attention_window={config.attention_window} decodes from "
                "a ring buffer: continue unpadded prompts instead"
            )
        left_padding = left_padding_of(prompt_mask, tuple(prompt.shape))
    mesh = default_mesh() if mesh is None else mesh
    rng = _checked_rng(generation, rng, mesh)
    prompt, rows = place_rows(prompt, mesh, "prompt")
    if left_padding is not None:  # split and padded (copies of row 0) like the prompt rows
        left_padding = place_rows(left_padding[:, None], mesh, "prompt_mask")[0][:, 0]
    return continue_prompt_jit(
        _placed(params, DecoderOnly, config, mesh),
        config,
        prompt,
        generation.canonical(),
        mesh=mesh,
        rows=rows,
        rng=rng,
        left_padding=left_padding,
    )
