"""Batch inference: one jitted call from token ids to generated token ids.

``generate`` binds a model to the pure searches of ``decoding``: the encoder runs once per
batch, the decoder runs one position per step against its key/value cache. A ``scan_layers``
model decodes as its unrolled equivalent (``models.unrolled``): the cache is one array per
layer with the batch on axis 0. Beam search keeps that cache in place: each hypothesis writes
its own row and follows its history through the small ``beam_ancestors`` array, the only
thing reordered by parent beam, and cross-attention keeps one entry per source
(``beam_cache``; ``beam_cache="reorder"`` gathers every row instead, the classic search).

Both run on a ``jax.sharding.Mesh`` (default: every device, ``sharding.make_mesh()``): the
batch is split over its ``data`` and ``fsdp`` axes, the parameters are placed by the logical
axis rules of ``sharding.py`` (heads, MLP units and vocabulary over ``tensor``), and the
key/value cache keeps its batch on ``data`` x ``fsdp`` and its kv heads on ``tensor``
(``sharding.cache_sharding``). A batch whose rows the data axes do not divide is padded with
copies of its first row, which are dropped from the result inside the same jitted call.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxformer_lite import models
from flaxformer_lite.core import sharding
from flaxformer_lite.decoding import search as decoding
from flaxformer_lite.models import DecoderOnly, EncoderDecoder, unrolled
from flaxformer_lite.nn.config import TransformerConfig

METHODS = ("greedy", "beam", "sample")
# How beam search treats the key/value cache: "in_place" never moves it (each hypothesis
# follows its history through ``beam_ancestors``, one cross-attention entry per source; see
# ``beam_cache``), "reorder" gathers every cache row by parent beam after each step (the
# classic way; every entry, cross-attention's too, per hypothesis).
BEAM_CACHES = ("in_place", "reorder")
# Shapes and Python-level choices: each distinct value compiles once.
STATIC_ARGNAMES = (
    "config",
    "method",
    "max_len",
    "beam_size",
    "alpha",
    "beam_style",
    "beam_cache",
    "early_stopping",
    "forced_eos",
    "banned_ids",
    "renormalize",
    "temperature",
    "top_k",
    "top_p",
    "mesh",
    "rows",
)


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


def _decoder_call(model: Any, params: Any, *context: Any, beam_size: int = 1):
    """``tokens, cache -> (logits of the last position, new cache)`` through ``model.decode``
    with ``decode=True``; ``context`` goes before the tokens (encoder output and source for an
    EncoderDecoder, nothing for a DecoderOnly). Zero-length tokens only update the cache.
    ``beam_size > 1``: tokens are beam search's ``rows * beam_size`` hypotheses over a cache
    that stays in place (``init_cache(beam_size=)``), ``context`` one row per source."""

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
    beam_style,
    early_stopping,
    forced_eos,
    banned_ids,
    temperature,
    top_k,
    top_p,
    rng,
    initial_tokens,
    row_max_len,
    config,
    reorder_cache=None,
    renormalize=False,
):
    # The model's own ids: decoding starts from the decoder-start token it was trained behind,
    # stops at its EOS and pads with its PAD (all default to special_ids).
    ids = dict(
        bos_id=config.bos_id,
        eos_id=config.eos_id,
        pad_id=config.pad_id,
        row_max_len=row_max_len,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
    )
    if method == "greedy":
        return decoding.greedy_search(
            tokens_to_logits,
            cache,
            batch_size=batch_size,
            max_len=max_len,
            initial_tokens=initial_tokens,
            **ids,
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
            **ids,
        )
    sequences, scores = decoding.beam_search(
        tokens_to_logits,
        cache,
        batch_size=batch_size,
        beam_size=beam_size,
        max_len=max_len,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
        initial_tokens=initial_tokens,
        reorder_cache=reorder_cache,
        renormalize=renormalize,
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


def _check_method(method: str, beam_cache: str = "in_place") -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if beam_cache not in BEAM_CACHES:
        raise ValueError(f"beam_cache must be one of {BEAM_CACHES}; got {beam_cache!r}")


def check_search_options(
    config: TransformerConfig,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: Any = (),
) -> tuple[int, ...]:
    """``decoding.check_search_options`` against the model: ``banned_ids`` (returned as the
    sorted tuple the jitted calls take as a static argument) must be ids of its output
    vocabulary, and not its ``eos_id``.

    Raises:
      ValueError: naming the argument and the valid values.
    """
    return decoding.check_search_options(
        beam_style,
        early_stopping,
        forced_eos,
        banned_ids,
        eos_id=config.eos_id,
        vocab_size=config.output_vocab_size,
    )


def check_decode_len(config: TransformerConfig, max_len: Any, prompt_len: int | None = None) -> int:
    """The number of tokens to generate, checked against the model's positions.

    ``prompt_len`` None (an EncoderDecoder): the decoder reads BOS and every generated token
    but the last, so ``max_len`` may be up to ``TransformerConfig.max_len``; None = that.
    ``prompt_len`` an int (a DecoderOnly continuing a prompt): the cache holds BOS, the prompt
    and the new tokens, so ``prompt_len + 1 + max_len`` must not exceed
    ``TransformerConfig.max_len``; None = all the positions left.

    Raises:
      ValueError: ``max_len`` is not a positive int, or the request does not fit (the
        message names the argument and the largest value that fits).
    """
    limit = config.max_len if prompt_len is None else config.max_len - prompt_len - 1
    if prompt_len is not None and limit < 1:
        raise ValueError(
            f"prompt of {prompt_len} tokens leaves no room to generate: BOS + prompt + new "
            f"tokens must fit the model's TransformerConfig.max_len={config.max_len}, so the "
            f"prompt may have at most {config.max_len - 2} tokens"
        )
    if max_len is None:
        return limit
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
        raise ValueError(f"max_len must be a positive int or None; got {max_len!r}")
    if max_len > limit:
        where = "" if prompt_len is None else f" after BOS and a {prompt_len}-token prompt"
        raise ValueError(
            f"max_len={max_len} new tokens do not fit the model's positions{where} "
            f"(TransformerConfig.max_len={config.max_len}): give max_len <= {limit}"
        )
    return int(max_len)


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


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def generate_jit(
    params: Any,
    config: TransformerConfig,
    inputs: jax.Array,
    *,
    mesh: Mesh,
    rows: int | None = None,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    row_max_len: jax.Array | None = None,
    beam_cache: str = "in_place",
    renormalize: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The one jitted call of :func:`generate`: ``inputs`` `[padded_rows, src_len]` (a multiple
    of the data axes) and optional ``row_max_len`` `[padded_rows]`, the first ``rows`` of the
    results returned (None: all of them). Called directly (``.lower`` for ahead-of-time
    compilation), it places nothing itself: arguments on other shardings are moved inside the
    call; ``banned_ids`` must then be a tuple (a static argument; :func:`generate` makes it
    one)."""
    _check_method(method, beam_cache)
    max_len = check_decode_len(config, max_len)
    params = _constrain_params(params, EncoderDecoder, config, mesh)
    inputs = jax.lax.with_sharding_constraint(inputs, sharding.batch_sharding(mesh))
    if row_max_len is not None:
        row_max_len = jax.lax.with_sharding_constraint(row_max_len, sharding.batch_sharding(mesh))
    params, config = unrolled(params, config)
    options = dict(
        beam_size=beam_size,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=rng,
        renormalize=renormalize,
    )
    model = EncoderDecoder(config)
    batch_size = inputs.shape[0]
    # The models' own activation constraints (``models._constrain``) follow the same rules.
    with (
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        nn.logical_axis_rules(sharding.LOGICAL_RULES),
    ):
        encoded = model.apply({"params": params}, inputs, method=model.encode)
        in_place = method == "beam" and beam_cache == "in_place" and beam_size > 1
        if method == "beam" and not in_place:  # one copy of the source per beam, reordered
            encoded, inputs = decoding.expand_to_beams((encoded, inputs), beam_size)
        beams = beam_size if in_place else 1  # in place: the source's rows stay one each
        beam_rows = inputs.shape[0] * beams
        cache = _constrain_cache(
            init_cache(model, params, inputs.shape[0], max_len, inputs.shape[1], beam_size=beams),
            mesh,
        )
        # A zero-length decoder call projects the encoder keys/values of every layer into the
        # cache once; the steps below pass encoded=None and project only their new position.
        prime = _sharded_step(_decoder_call(model, params, encoded, inputs, beam_size=beams), mesh)
        _, cache = prime(jnp.zeros((beam_rows, 0), jnp.int32), cache)
        step = _sharded_step(_decoder_call(model, params, None, inputs, beam_size=beams), mesh)
        tokens, scores = _search(
            method,
            step,
            cache,
            batch_size,
            max_len,
            initial_tokens=None,
            row_max_len=row_max_len,
            config=config,
            reorder_cache=models.reorder_beam_cache if in_place else None,
            **options,
        )
    return _unpad((tokens, scores), rows, mesh)


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def continue_prompt_jit(
    params: Any,
    config: TransformerConfig,
    prompt: jax.Array,
    *,
    mesh: Mesh,
    rows: int | None = None,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    beam_cache: str = "in_place",
    renormalize: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The one jitted call of :func:`continue_prompt` (see :func:`generate_jit`)."""
    _check_method(method, beam_cache)
    params = _constrain_params(params, DecoderOnly, config, mesh)
    prompt = jax.lax.with_sharding_constraint(prompt, sharding.batch_sharding(mesh))
    params, config = unrolled(params, config)
    model = DecoderOnly(config)
    batch_size, prompt_len = prompt.shape
    max_len = check_decode_len(config, max_len, prompt_len)
    options = dict(
        beam_size=beam_size,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=rng,
        renormalize=renormalize,
    )
    bos = jnp.full((batch_size, 1), config.bos_id, jnp.int32)
    context = jnp.concatenate([bos, prompt.astype(jnp.int32)], axis=1)
    with (
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        nn.logical_axis_rules(sharding.LOGICAL_RULES),
    ):
        cache = _constrain_cache(
            init_cache(model, params, batch_size, prompt_len + 1 + max_len), mesh
        )
        step = _sharded_step(_decoder_call(model, params), mesh)
        _, cache = step(context[:, :-1], cache)  # prefill the prompt
        in_place = method == "beam" and beam_cache == "in_place" and beam_size > 1
        if in_place:
            # The prompt was written once per row; its beams start as copies of it. A
            # zero-length call adds the beams' ancestry (zeros: every slot from beam 0).
            cache = _constrain_cache(decoding.expand_to_beams(cache, beam_size), mesh)
            step = _sharded_step(_decoder_call(model, params, beam_size=beam_size), mesh)
            _, cache = step(jnp.zeros((batch_size * beam_size, 0), jnp.int32), cache)
        tokens, scores = _search(
            method,
            step,
            cache,
            batch_size,
            max_len,
            initial_tokens=context[:, -1],
            row_max_len=None,
            config=config,
            reorder_cache=models.reorder_beam_cache if in_place else None,
            **options,
        )
    return _unpad((tokens, scores), rows, mesh)


# ----------------------------------------------------------------------------- entry points


def generate(
    params: Any,
    config: TransformerConfig,
    inputs: Any,
    *,
    mesh: Mesh | None = None,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    row_max_len: Any = None,
    beam_cache: str = "in_place",
    renormalize: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Translates a batch of source token ids with an ``EncoderDecoder``.

    Args:
      params: the model parameters (``variables["params"]``, boxed or not; stacked ones of a
        ``scan_layers`` model are unstacked inside the call).
      config: the model's TransformerConfig.
      inputs: int `[batch, src_len]`, padded with 0; rows may have different lengths (numpy,
        or a jax array; a multi-process global array needs rows the data axes divide).
      mesh: the devices to run on (axes data, fsdp, tensor); None = every device, the batch
        split over all of them. Parameters already placed on it are not copied.
      method: "greedy", "beam" (beam search, length penalty ``alpha``) or "sample"
        (temperature, top-k, top-p; needs ``rng``).
      max_len: tokens to generate at most (EOS included), at most ``config.max_len`` (the
        decoder's positions); None = ``config.max_len``.
      beam_style, early_stopping: the beam-search rules, ``decoding.BEAM_STYLES`` and
        ``decoding.EARLY_STOPPING``: "gnmt" (default) or "hf", which with
        ``alpha=length_penalty`` reproduces Hugging Face's
        ``generate(num_beams=beam_size, length_penalty=..., early_stopping=...)``.
      forced_eos: a row reaching ``max_len`` (or its ``row_max_len``) ends with EOS
        (Hugging Face's ``forced_eos_token_id``, on in Marian configs).
      banned_ids: ids never generated, e.g. ``(config.pad_id,)`` as opus-mt's
        ``bad_words_ids``; any sequence of ints of the output vocabulary, not ``eos_id``.
      row_max_len: optional ints `[batch]`, each in ``[1, max_len]``: row ``b`` generates
        at most ``row_max_len[b]`` tokens (PAD after them), so its output does not depend on
        the limits of the other rows; ``max_len`` is then the output width. Host values, or
        a global array whose rows follow those of ``inputs`` (multi-process). A traced
        argument: other limits do not compile again.
      renormalize: beam search only: log-softmax the constrained log-probs again, as Hugging
        Face's ``renormalize_logits=True`` (``decoding.beam_search``); greedy and sampling
        choices do not change with it.
      beam_cache: one of :data:`BEAM_CACHES`: "in_place" (default) decodes beams over a cache
        that never moves and one cross-attention entry per source (``beam_cache`` module,
        sliding windows and relative positions included); "reorder" gathers every cache row
        by parent beam after each step (the classic search; the same tokens and scores up to
        float rounding).

    Returns:
      tokens int32 `[batch, max_len]` (EOS-terminated, PAD after EOS, no BOS) and scores
      float32 `[batch]` (log-probability; length-normalised for beam search). The same
      tokens on any mesh (up to float rounding between different reduction orders).

    Raises:
      ValueError: unknown ``method``, ``max_len`` not a positive int or more than
        ``config.max_len``, ``row_max_len`` of another shape or out of ``[1, max_len]``,
        ``inputs`` not rank 2, a search option not valid (:func:`check_search_options`),
        all before anything is traced.
    """
    _check_method(method, beam_cache)
    max_len = check_decode_len(config, max_len)
    banned_ids = check_search_options(config, beam_style, early_stopping, forced_eos, banned_ids)
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be True or False; got {renormalize!r}")
    mesh = default_mesh() if mesh is None else mesh
    if not hasattr(inputs, "shape"):  # nested lists
        inputs = np.asarray(inputs, np.int32)
    inputs, rows = place_rows(inputs, mesh)
    limits = _place_row_max_len(row_max_len, rows, inputs.shape[0], mesh, max_len)
    return generate_jit(
        place_params(params, EncoderDecoder, config, mesh),
        config,
        inputs,
        mesh=mesh,
        rows=rows,
        method=method,
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=_replicated(rng, mesh),
        row_max_len=limits,
        beam_cache=beam_cache,
        renormalize=renormalize,
    )


def continue_prompt(
    params: Any,
    config: TransformerConfig,
    prompt: Any,
    *,
    mesh: Mesh | None = None,
    method: str = "greedy",
    max_len: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    beam_style: str = "gnmt",
    early_stopping: bool | str = False,
    forced_eos: bool = False,
    banned_ids: tuple[int, ...] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    beam_cache: str = "in_place",
) -> tuple[jax.Array, jax.Array]:
    """Continues prompts with a ``DecoderOnly`` language model.

    prompt: int `[batch, prompt_len]` without padding (BOS is prepended here). The prompt is
    written into the cache in one call (prefill); then up to ``max_len`` tokens are generated
    (None: as many as ``config.max_len`` leaves after BOS and the prompt). ``mesh`` and the
    other options as in :func:`generate`.
    Returns the continuation `[batch, max_len]` and scores `[batch]`.

    Raises:
      ValueError: BOS + prompt + ``max_len`` new tokens exceed ``config.max_len`` (the cache
        and positions), or the arguments of :func:`generate` are wrong (before tracing).
    """
    _check_method(method, beam_cache)
    banned_ids = check_search_options(config, beam_style, early_stopping, forced_eos, banned_ids)
    if not hasattr(prompt, "shape"):  # nested lists
        prompt = np.asarray(prompt, np.int32)
    if len(prompt.shape) == 2:  # else place_rows names the argument
        check_decode_len(config, max_len, int(prompt.shape[1]))
    mesh = default_mesh() if mesh is None else mesh
    prompt, rows = place_rows(prompt, mesh, "prompt")
    return continue_prompt_jit(
        place_params(params, DecoderOnly, config, mesh),
        config,
        prompt,
        mesh=mesh,
        rows=rows,
        method=method,
        max_len=max_len,
        beam_size=beam_size,
        alpha=alpha,
        beam_style=beam_style,
        early_stopping=early_stopping,
        forced_eos=forced_eos,
        banned_ids=banned_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=_replicated(rng, mesh),
        beam_cache=beam_cache,
    )
