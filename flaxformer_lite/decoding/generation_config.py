"""The decoding options as one frozen, validated value: ``GenerationConfig``.

    from flaxformer_lite.decoding.generate import generate
    from flaxformer_lite.decoding.generation_config import GenerationConfig

    beam = GenerationConfig(method="beam", beam_size=4, alpha=0.6)
    tokens, scores = generate(params, config, inputs, beam)
    generate(params, config, inputs, beam, beam_size=8)  # a field replaced for this call
    generate(params, config, inputs, method="beam")      # keywords alone: GenerationConfig()'s rest
    GenerationConfig.from_run(json.loads(Path("runs/m30k/config.json").read_text()), config)
    GenerationConfig.from_hugging_face("opus-mt-en-de/", config)  # as its generate() decodes

The idea of Hugging Face's ``transformers.GenerationConfig`` (``generate(**kwargs)`` replaces
fields of the model's config), with this library's fields. Every check of the fields alone is in
``__post_init__``: a GenerationConfig that exists is valid, and its errors name the field and
the valid values. What also depends on the model (``max_len`` against its positions, banned
ids against its vocabulary and EOS) is :meth:`GenerationConfig.checked_for`, which ``generate``
calls once. Frozen and hashable: the jitted calls take it as one static argument, so each
distinct config compiles once (``canonical`` gives the fields a method ignores fixed values, so
that e.g. greedy decoding does not compile again for another ``beam_size``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from flaxformer_lite.decoding import hf_generation
from flaxformer_lite.decoding.search import BEAM_STYLES, EARLY_STOPPING
from flaxformer_lite.nn.config import TransformerConfig

METHODS = ("greedy", "beam", "sample")
# How beam search treats the key/value cache: "in_place" never moves it (each hypothesis
# follows its history through ``beam_ancestors``, one cross-attention entry per source; see
# ``beam_cache``), "reorder" gathers every cache row by parent beam after each step (the
# classic way; every entry, cross-attention's too, per hypothesis).
BEAM_CACHES = ("in_place", "reorder")
# max_len="source": each row's own limit from its source length (see source_limit).
SOURCE = "source"
# The fields each method reads; canonical() fixes the others.
BEAM_FIELDS = ("beam_size", "alpha", "beam_style", "early_stopping", "renormalize", "beam_cache")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")


def source_limit(source_len: Any, cap: int) -> Any:
    """Tokens a row may generate under ``max_len="source"``: ``int(1.5 * source_len) + 10``
    (``source_len``: its source ids, EOS included), at least 1 and at most ``cap`` (the
    model's ``max_len``, or the output width). ``source_len`` an int gives an int; an int
    array (numpy, or jax inside a jitted call) gives one limit per row.

    The rule of ``train.py``'s BLEU evaluation and of ``Translator.translate`` by default: a
    sentence's limit is a function of its own length, so its translation does not depend on its
    batch-mates. (``inference/serving_runtime.py`` repeats it: it imports nothing of this
    package.)
    """
    limit = source_len * 3 // 2 + 10  # == int(1.5 * source_len) + 10 for ints >= 0
    if isinstance(limit, int | np.integer):
        return max(1, min(cap, int(limit)))
    return limit.clip(1, cap)


def check_decode_len(
    config: TransformerConfig, max_len: Any, prompt_len: int | None = None, *, bos: bool = True
) -> int:
    """The number of tokens to generate, checked against the model's positions.

    ``prompt_len`` None (an EncoderDecoder): the decoder reads BOS and every generated token
    but the last, so ``max_len`` may be up to ``TransformerConfig.max_len``; None = that.
    ``prompt_len`` an int (a DecoderOnly continuing a prompt): the cache holds BOS, the prompt
    and the new tokens, so ``prompt_len + 1 + max_len`` must not exceed
    ``TransformerConfig.max_len``; None = all the positions left. ``bos=False``: the prompt is
    taken as it is (``GenerationConfig.prepend_bos=False``), ``prompt_len + max_len`` then.

    Raises:
      ValueError: ``max_len`` is not a positive int, or the request does not fit (the
        message names the argument and the largest value that fits).
    """
    extra = 1 if bos else 0
    limit = config.max_len if prompt_len is None else config.max_len - prompt_len - extra
    head = "BOS + prompt" if bos else "prompt"
    if prompt_len is not None and limit < 1:
        raise ValueError(
            f"prompt of {prompt_len} tokens leaves no room to generate: {head} + new "
            f"tokens must fit the model's TransformerConfig.max_len={config.max_len}, so the "
            f"prompt may have at most {config.max_len - 1 - extra} tokens"
        )
    if max_len is None:
        return limit
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
        raise ValueError(f"max_len must be a positive int or None; got {max_len!r}")
    if max_len > limit:
        where = (
            ""
            if prompt_len is None
            else f" after {'BOS and ' if bos else ''}a {prompt_len}-token prompt"
        )
        raise ValueError(
            f"max_len={max_len} new tokens do not fit the model's positions{where} "
            f"(TransformerConfig.max_len={config.max_len}): give max_len <= {limit}"
        )
    return int(max_len)


# ----------------------------------------------------------------------------- field checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_choice(name: str, value: Any, valid: tuple) -> None:
    # `True in (1,)` holds in Python: compare types too, so early_stopping=1 is refused.
    if not any(type(value) is type(v) and value == v for v in valid):
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def _token_ids(value: Any) -> tuple[int, ...] | None:
    """``value`` as a sorted tuple of distinct ints >= 0 (NumPy ints too), or None when it is
    not a sequence of such ints (floats, bools, strings, nested sequences, a bare int)."""
    if isinstance(value, str | bytes):
        return None
    try:
        items = list(value)
        if any(isinstance(i, bool | np.bool_) for i in items):
            return None
        ids = [operator.index(i) for i in items]
    except TypeError:
        return None
    return tuple(sorted(set(ids))) if all(i >= 0 for i in ids) else None


# ----------------------------------------------------------------------------- the config


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How ``generate``, ``continue_prompt``, ``Translator`` and the serving export decode.

    Attributes:
      method: "greedy", "beam" (beam search) or "sample" (ancestral sampling; the call needs
        an ``rng``).
      max_len: the most tokens a row generates, EOS included: an int (every row; the output
        width), None (the model's positions: ``TransformerConfig.max_len``, or what a prompt
        leaves) or "source" (each row its own ``min(model max_len, int(1.5 * source ids) +
        10)``, :func:`source_limit`; an EncoderDecoder only: the output width follows the
        padded source length).
      beam_size: beams per row (method "beam"; a positive int).
      alpha: length-penalty exponent (0 = plain log-probability): GNMT's
        ``((5 + length) / 6) ** alpha`` under ``beam_style="gnmt"``, Hugging Face's
        ``length_penalty`` under "hf".
      beam_style: "gnmt" (GNMT's penalty, exact stopping bound) or "hf" (the rules of Hugging
        Face's ``generate(num_beams=...)``), ``search.BEAM_STYLES``.
      early_stopping: False, True or "never" (``search.EARLY_STOPPING``); anything but False
        needs ``beam_style="hf"``.
      renormalize: beam search: log-softmax the constrained log-probs again, as Hugging Face's
        ``renormalize_logits=True`` (greedy and sampled choices do not change with it).
      beam_cache: "in_place" (a key/value cache that never moves, one cross-attention entry
        per source) or "reorder" (every cache row gathered by parent beam after each step):
        the same tokens and scores up to float rounding.
      temperature, top_k, top_p: sampling filters: ``temperature >= 0`` (0 = greedy),
        ``top_k >= 0`` (0 = off), ``top_p`` in ``(0, 1]`` (1 = off).
      forced_eos: a row reaching its limit ends with EOS (Hugging Face's
        ``forced_eos_token_id``, on in Marian configs).
      banned_ids: ids never generated (single-token ``bad_words_ids``, e.g. opus-mt's PAD);
        stored as a sorted tuple of distinct ints.
      prepend_bos: ``continue_prompt`` puts the model's ``bos_id`` before each prompt (True,
        how ``DecoderOnly`` is trained on data without BOS) or feeds the prompt ids as they
        are (False: Hugging Face's ``generate``, whose tokenizers add BOS themselves;
        :meth:`from_hugging_face` sets it). ``generate`` (an EncoderDecoder) ignores it.
      forced_bos_id: every row's first generated token is this id (Hugging Face's
        ``forced_bos_token_id``: ``<s>`` in bart-large, the target language code in mBART-50;
        in beam search it costs 0); None: no token forced. Sources only (``generate``), not
        prompt continuations.
    """

    method: str = "greedy"
    max_len: int | str | None = None
    beam_size: int = 4
    alpha: float = 0.6
    beam_style: str = "gnmt"
    early_stopping: bool | str = False
    renormalize: bool = False
    beam_cache: str = "in_place"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    forced_eos: bool = False
    banned_ids: tuple[int, ...] = ()
    prepend_bos: bool = True
    forced_bos_id: int | None = None

    def __post_init__(self) -> None:
        def store(name: str, value: Any) -> None:  # normalised: equal configs hash alike
            object.__setattr__(self, name, value)

        # The method.
        _check_choice("method", self.method, METHODS)

        # The length.
        if self.max_len is not None and self.max_len != SOURCE:
            if not _is_int(self.max_len) or self.max_len < 1:
                raise ValueError(
                    "max_len must be a positive int or None (the model's positions), or "
                    f"{SOURCE!r} (each row's own limit from its source length); got "
                    f"{self.max_len!r}"
                )
            store("max_len", int(self.max_len))

        # Beam search.
        if not _is_int(self.beam_size) or self.beam_size < 1:
            raise ValueError(f"beam_size must be a positive int; got {self.beam_size!r}")
        store("beam_size", int(self.beam_size))
        if not _is_number(self.alpha) or not math.isfinite(self.alpha):
            raise ValueError(
                f"alpha must be a finite number (the length-penalty exponent, 0 = none); got "
                f"{self.alpha!r}"
            )
        store("alpha", float(self.alpha))
        _check_choice("beam_style", self.beam_style, BEAM_STYLES)
        _check_choice("early_stopping", self.early_stopping, EARLY_STOPPING)
        if self.early_stopping is not False and self.beam_style != "hf":
            raise ValueError(
                f"early_stopping={self.early_stopping!r} is a rule of beam_style='hf'; "
                f"beam_style={self.beam_style!r} stops by its exact bound (leave "
                "early_stopping=False)"
            )
        _check_bool("renormalize", self.renormalize)
        _check_choice("beam_cache", self.beam_cache, BEAM_CACHES)

        # Sampling.
        if not _is_number(self.temperature) or not self.temperature >= 0:  # NaN too
            raise ValueError(
                f"temperature must be a number >= 0 (0 means greedy); got {self.temperature!r}"
            )
        store("temperature", float(self.temperature))
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it); got {self.top_k!r}")
        store("top_k", int(self.top_k))
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"top_p must be a number in (0, 1] (1 disables it); got {self.top_p!r}"
            )
        store("top_p", float(self.top_p))

        # Token constraints.
        _check_bool("forced_eos", self.forced_eos)
        ids = _token_ids(self.banned_ids)
        if ids is None:
            raise ValueError(
                f"banned_ids must be a sequence of token ids (ints >= 0); got {self.banned_ids!r}"
            )
        store("banned_ids", ids)
        _check_bool("prepend_bos", self.prepend_bos)
        if self.forced_bos_id is not None:
            if not _is_int(self.forced_bos_id) or self.forced_bos_id < 0:
                raise ValueError(
                    "forced_bos_id must be None (no forced first token) or a token id (an int "
                    f">= 0); got {self.forced_bos_id!r}"
                )
            store("forced_bos_id", int(self.forced_bos_id))

    # ------------------------------------------------------------------ against a model

    def checked_for(
        self, model_config: TransformerConfig, prompt_len: int | None = None
    ) -> GenerationConfig:
        """This config, after the checks that need the model: ``max_len`` fits its positions
        (after BOS and a ``prompt_len``-token prompt, for a DecoderOnly; "source" needs a
        source), and ``banned_ids`` are ids of its output vocabulary other than its
        ``eos_id``.

        Raises:
          ValueError: naming the field and the valid values.
        """
        if self.max_len == SOURCE:
            if prompt_len is not None:
                raise ValueError(
                    f"max_len={SOURCE!r} derives each row's limit from its source; a prompt "
                    "continuation has none: give an int or None"
                )
        else:
            check_decode_len(model_config, self.max_len, prompt_len, bos=self.prepend_bos)
        vocab = model_config.output_vocab_size
        if self.forced_bos_id is not None:
            if prompt_len is not None:
                raise ValueError(
                    f"forced_bos_id={self.forced_bos_id} forces the first token after the "
                    "decoder start of a source's translation; a prompt continuation has none: "
                    "leave forced_bos_id=None"
                )
            if self.forced_bos_id >= vocab:
                raise ValueError(
                    f"forced_bos_id must be a token id in [0, {vocab}) (the output vocabulary); "
                    f"got {self.forced_bos_id}"
                )
        if any(i >= vocab for i in self.banned_ids):
            raise ValueError(
                f"banned_ids must be a sequence of token ids (ints in [0, {vocab})); got "
                f"{list(self.banned_ids)!r}"
            )
        if model_config.eos_id in self.banned_ids:
            raise ValueError(
                f"banned_ids must not contain eos_id={model_config.eos_id}: no row could end"
            )
        return self

    def decode_len(
        self,
        model_config: TransformerConfig,
        *,
        source_len: int | None = None,
        prompt_len: int | None = None,
    ) -> int:
        """The output width: tokens generated at most, for sources ``source_len`` ids long
        (padded; ``max_len="source"``) or after a ``prompt_len``-token prompt.

        Raises:
          ValueError: ``max_len`` does not fit the model's positions, or is "source" without
            a ``source_len``.
        """
        if self.max_len != SOURCE:
            return check_decode_len(model_config, self.max_len, prompt_len, bos=self.prepend_bos)
        if source_len is None or prompt_len is not None:
            raise ValueError(
                f"max_len={SOURCE!r} derives each row's limit from its source length: "
                "only for sources (generate), not prompts; give an int or None"
            )
        return source_limit(int(source_len), model_config.max_len)

    # ------------------------------------------------------------------ derived configs

    def replace(self, **fields: Any) -> GenerationConfig:
        """A copy with ``fields`` replaced (checked again).

        Raises:
          TypeError: a name that is not a field (the valid ones are listed).
          ValueError: a value that is not valid (see the class).
        """
        unknown = sorted(set(fields) - set(field_names()))
        if unknown:
            raise TypeError(
                f"{', '.join(unknown)}: not a GenerationConfig field; valid: "
                f"{', '.join(field_names())}"
            )
        return dataclasses.replace(self, **fields) if fields else self

    def canonical(self) -> GenerationConfig:
        """The same decoding with the fields its method does not read at fixed values (beam
        search's unless ``method="beam"``: ``beam_size=1``, ``alpha=0.0`` and the defaults;
        sampling's unless ``method="sample"``): configs that decode alike compile once."""
        fixed: dict[str, Any] = {}
        if self.method != "beam":
            fixed.update(
                beam_size=1,
                alpha=0.0,
                beam_style="gnmt",
                early_stopping=False,
                renormalize=False,
                beam_cache="in_place",
            )
        if self.method != "sample":
            fixed.update(temperature=1.0, top_k=0, top_p=1.0)
        return self.replace(**fixed)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (``banned_ids`` a list); :meth:`from_dict` inverts it."""
        values = dataclasses.asdict(self)
        values["banned_ids"] = list(self.banned_ids)
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GenerationConfig:
        """The config of :meth:`to_dict`'s output (missing fields: the defaults).

        Raises:
          ValueError: a key that is not a field (the valid ones are listed), or a bad value.
        """
        if not isinstance(values, Mapping):
            raise ValueError(
                f"a GenerationConfig dict must be a mapping of field -> value; got "
                f"{type(values).__name__}"
            )
        unknown = sorted(set(values) - set(field_names()))
        if unknown:
            raise ValueError(
                f"{', '.join(map(str, unknown))}: not a GenerationConfig field; valid: "
                f"{', '.join(field_names())}"
            )
        return cls(**values)

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_run(cls, run: Mapping[str, Any], model_config: TransformerConfig) -> GenerationConfig:
        """How a ``train.py`` run decodes: beam search with its config.json's ``beam_size``
        (default 4) and ``alpha`` (default 0.6), its search rules where it sets them
        (``beam_style``, ``early_stopping``, ``forced_eos``, ``ban_pad``: the model's
        ``pad_id`` banned; configs/finetune_marian.py sets all four), each row's limit from
        its source (``max_len="source"``).

        Raises:
          ValueError: a value that is not valid, for this model too (see :meth:`checked_for`).
        """
        fields: dict[str, Any] = dict(
            method="beam",
            max_len=SOURCE,
            beam_size=int(run.get("beam_size") or 4),
            alpha=float(0.6 if run.get("alpha") is None else run["alpha"]),
        )
        if run.get("beam_style"):
            fields["beam_style"] = run["beam_style"]
        if run.get("early_stopping") is not None:
            fields["early_stopping"] = run["early_stopping"]
        if run.get("forced_eos"):
            fields["forced_eos"] = True
        if run.get("ban_pad"):
            fields["banned_ids"] = (model_config.pad_id,)
        return cls(**fields).checked_for(model_config)

    @classmethod
    def from_hugging_face(
        cls, folder_or_dict: str | Mapping[str, Any], model_config: TransformerConfig
    ) -> GenerationConfig:
        """How ``MarianMTModel.generate()`` with no arguments decodes a Hugging Face folder (or
        hub id), or a generation config dict (``generation_config.json``'s fields): greedy
        unless ``num_beams`` > 1; Hugging Face's beam rules with ``alpha = length_penalty``
        (default 1.0) and its ``early_stopping``; the first token forced to
        ``forced_bos_token_id`` when set; ``max_new_tokens``, else ``max_length`` - 1,
        else 20 tokens for every row (:func:`hf_generation.generate_new_tokens`); EOS forced at
        the limit when ``forced_eos_token_id`` is the model's EOS; the single-token
        ``bad_words_ids`` banned; ``renormalize_logits``; prompts fed as they are
        (``prepend_bos=False``). A folder is read as transformers
        reads it: ``generation_config.json``, else the generation fields of ``config.json``.

        Raises:
          FileNotFoundError: no such folder or repository.
          ValueError: the config asks for what these searches do not do (sampling, repetition
            penalties, minimum lengths, ...: every such field named), or leaves no token to
            generate.
        """
        if isinstance(folder_or_dict, Mapping):
            values, where = folder_or_dict, "the generation config"
        else:
            values = hf_generation.generation_config(folder_or_dict)
            where = f"the generation config of {folder_or_dict}"
        defaults = hf_generation.set_fields(values)
        problems = hf_generation.unsupported_generation(defaults, model_config)
        if problems:
            raise ValueError(
                f"{where} asks for what flaxformer_lite's searches cannot decode: "
                + "; ".join(problems)
                + " (change generation_config.json, or decode with transformers)"
            )
        single = {int(w[0]) for w in defaults.get("bad_words_ids") or [] if len(w) == 1}
        num_beams = int(defaults.get("num_beams", 1))
        return cls(
            method="beam" if num_beams > 1 else "greedy",
            max_len=hf_generation.generate_new_tokens(defaults, model_config),
            beam_size=num_beams,
            alpha=float(defaults.get("length_penalty", 1.0)),
            beam_style="hf",
            early_stopping=defaults.get("early_stopping", False),
            renormalize=bool(defaults.get("renormalize_logits", False)),
            forced_eos=defaults.get("forced_eos_token_id") == model_config.eos_id,
            banned_ids=tuple(sorted(single - {model_config.eos_id})),
            prepend_bos=False,  # generate() feeds the ids it is given (tokenizers add BOS)
            forced_bos_id=defaults.get("forced_bos_token_id"),
        ).checked_for(model_config)


def field_names() -> tuple[str, ...]:
    """The names of GenerationConfig's fields, in order."""
    return tuple(f.name for f in dataclasses.fields(GenerationConfig))


def resolve(
    generation: GenerationConfig | None,
    overrides: Mapping[str, Any],
    default: GenerationConfig | None = None,
) -> GenerationConfig:
    """``generation`` (None: ``default``, itself None: ``GenerationConfig()``) with the fields
    in ``overrides`` replaced: how ``generate(..., generation, **overrides)`` and the other
    entry points read their arguments.

    Raises:
      TypeError: an override that is not a field (the valid ones are listed).
      ValueError: ``generation`` is not a GenerationConfig, or a value is not valid.
    """
    if generation is None:
        generation = GenerationConfig() if default is None else default
    if not isinstance(generation, GenerationConfig):
        raise ValueError(
            f"generation must be a GenerationConfig or None; got {type(generation).__name__} "
            "(GenerationConfig.from_dict reads a dict)"
        )
    return generation.replace(**overrides)
