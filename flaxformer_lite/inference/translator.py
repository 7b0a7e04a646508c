"""Translate strings with a trained workdir: vocabulary, parameters and batched decoding.

    from flaxformer_lite.inference.translator import Translator

    translator = Translator.from_workdir("runs/m30k")  # latest checkpoint
    translator.translate(["A man rides a bike.", ""])  # -> ["Ein Mann ...", ""]
    translator.translate(["A man rides a bike."], method="greedy")  # a field replaced
    translator.generation  # the GenerationConfig it decodes with (the run's beam size ...)
    translator.attention("A man rides a bike.")  # pieces + attention weights, for plots

A workdir written by ``train.py`` (a local folder or a ``gs://`` URI) holds
``model_config.json``, ``config.json``, the vocabulary (``spm_shared.model``, or
``spm_src.model`` + ``spm_tgt.model``, or ``vocab.json`` for the synthetic task) and Orbax
checkpoints in ``checkpoints/<step>/``. Only the parameters are read
from a checkpoint (Orbax partial restore): the optimizer state, twice their size with Adam,
never leaves the disk.

Inputs are sorted by length and cut into batches of one fixed row count per call, padded to
source lengths that are multiples of ``BUCKET``: every batch reuses one of a few compiled
shapes, so ``jax.jit`` compiles once per shape, not once per batch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from flaxformer_lite.core import paths, sharding
from flaxformer_lite.core.checkpoints import average_params, restore_params
from flaxformer_lite.data.tasks.base import vocabulary_ids
from flaxformer_lite.data.tasks.synthetic import SymbolVocabulary  # noqa: E402  (re-exported)
from flaxformer_lite.decoding.generate import default_mesh, generate, place_params
from flaxformer_lite.decoding.generation_config import SOURCE, GenerationConfig, resolve
from flaxformer_lite.models import (
    EncoderDecoder,
    abstract_params,
    attention_weights_per_layer,
    unrolled,
)
from flaxformer_lite.nn.config import TransformerConfig
from flaxformer_lite.ops.quantize import check_quantization, quantize_params

# Source lengths are padded up to a multiple of this: few shapes, little padding.
BUCKET = 16
# How a Translator built from parameters decodes unless told otherwise: beam 4, GNMT's length
# penalty 0.6, each sentence up to min(model max_len, 1.5 x its tokens + 10).
DEFAULT_GENERATION = GenerationConfig(method="beam", max_len=SOURCE)
# The search options of code written before GenerationConfig (Translator.search_options).
_SEARCH_OPTIONS = ("beam_style", "early_stopping", "forced_eos", "banned_ids")
SEQ2SEQ_TASKS = ("synthetic", "translation")

__all__ = [
    "BUCKET",
    "SymbolVocabulary",
    "Translator",
    "Vocabulary",
    "load_vocabularies",
    "restore_params",
]


class Vocabulary(Protocol):
    """What the translator needs from a vocabulary (``tokenizer.Tokenizer``,
    ``synthetic.SymbolVocabulary`` and ``marian_tokenizer.MarianVocabulary`` have all of it).

    ``encode`` gives ids without EOS (the caller appends ``eos_id``); ``decode`` stops at the
    first ``eos_id`` and skips ``pad_id``. A vocabulary may also have ``bos_id`` (the
    decoder start); without one, decoding starts from ``pad_id`` (see
    ``tasks.vocabulary_ids``).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def unk_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def id_to_piece(self, ids: Iterable[int]) -> list[str]: ...


def load_vocabularies(workdir: str) -> tuple[Vocabulary, Vocabulary]:
    """(source, target) vocabularies saved in ``workdir`` by ``train.py`` (one object if shared):
    a Hugging Face model's tokenizer (``hf_tokenizer.json`` beside its files), Marian's, the
    run's SentencePiece models or the synthetic task's symbols.

    Raises:
      FileNotFoundError: none of the vocabulary files is there (their names are listed).
    """
    from flaxformer_lite.data import hf_vocabulary
    from flaxformer_lite.data.tokenizer import Tokenizer  # sentencepiece: only when needed

    root = epath.Path(workdir)
    if (root / hf_vocabulary.MARKER).is_file():  # fine-tuned from a BART, mBART, T5 ... folder
        return hf_vocabulary.load_workdir_vocabularies(workdir)
    if all((root / name).is_file() for name in ("source.spm", "target.spm", "vocab.json")):
        from flaxformer_lite.data.marian_tokenizer import MarianTokenizer  # a fine-tuned Marian run

        marian = MarianTokenizer.load(str(root))
        return marian.source, marian.target
    spm = {name: root / f"spm_{name}.model" for name in ("shared", "src", "tgt")}
    if spm["shared"].is_file():
        shared = Tokenizer.load(str(spm["shared"]))
        return shared, shared
    if spm["src"].is_file() and spm["tgt"].is_file():
        return Tokenizer.load(str(spm["src"])), Tokenizer.load(str(spm["tgt"]))
    if (root / "vocab.json").is_file():
        vocab = SymbolVocabulary(json.loads((root / "vocab.json").read_text())["symbols"])
        return vocab, vocab
    raise FileNotFoundError(
        f"no vocabulary in {workdir}: expected spm_shared.model, spm_src.model + spm_tgt.model "
        "(translation runs) or vocab.json (synthetic runs)"
    )


# ----------------------------------------------------------------------------- translator

DECODE_DTYPES = ("float32", "bfloat16")


def with_dtype(params: Any, config: TransformerConfig, dtype: str) -> tuple[Any, TransformerConfig]:
    """``params`` (floating leaves) cast to ``dtype`` and ``config`` computing and storing
    parameters in it.

    Raises:
      ValueError: ``dtype`` is not one of :data:`DECODE_DTYPES`.
    """
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"dtype must be one of {DECODE_DTYPES} (None: the model's); got {dtype!r}")
    target = jnp.dtype(dtype)

    def cast(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map(cast, params), config.replace(dtype=dtype, param_dtype=dtype)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Translator:
    """An ``EncoderDecoder`` with its parameters and vocabularies: strings in, strings out.

    Args:
      params: the model parameters (unboxed; numpy or jax arrays).
      config: the model's ``TransformerConfig``.
      source_vocab, target_vocab: vocabularies (the same object when shared).
      generation: how :meth:`translate` decodes by default (a ``GenerationConfig``, checked
        against ``config`` here); None = :data:`DEFAULT_GENERATION`: beam 4, alpha 0.6, each
        sentence up to ``min(model max_len, 1.5 * its tokens + 10)`` (``max_len="source"``).
        ``from_workdir`` builds it from the run's ``config.json``
        (``GenerationConfig.from_run``), ``from_pretrained`` of a Hugging Face folder from its
        generation config (``GenerationConfig.from_hugging_face``).
      name: where the model came from, for messages.
      mesh: the devices that decode (a ``sharding.make_mesh`` mesh: batch over ``data`` x
        ``fsdp``, heads over ``tensor``); None = every device, the batch split over all.
      quantize: None, or "int8": decode with int8 weights and activations (the float
        ``params`` are quantized here by ``quantize.quantize_params``; ``config`` then has
        ``quantization="int8"``).
      dtype: None (the model's), or one of :data:`DECODE_DTYPES`: decode with the parameters
        stored and the matmuls computed in that dtype (``config`` then has it as ``dtype``
        and ``param_dtype``; softmax, layer norms' statistics and the search's scores stay
        float32). "bfloat16" halves the weights' memory traffic; with ``quantize`` it is the
        dtype of everything but the int8 matmuls.
      **overrides: GenerationConfig fields replacing ``generation``'s, e.g. ``beam_size=2``.

    A ``scan_layers`` model is converted once, here, to its unrolled equivalent
    (``models.unrolled``: same outputs), which ``config`` and ``params`` then hold.

    The special ids come from ``config`` (``pad_id`` pads the sources, ``eos_id`` ends them
    and the outputs, ``bos_id`` starts decoding): the vocabularies must have the same ones.

    Raises:
      ValueError: a vocabulary's pad, eos or decoder-start id differs from ``config``'s, or a
        decoding option is not valid for this model (the field named).
      TypeError: an override that is not a GenerationConfig field.
    """

    # The workdir checkpoint steps whose (mean) parameters it holds (from_workdir); () else.
    checkpoint_steps: tuple[int, ...] = ()

    def __init__(
        self,
        params: Any,
        config: TransformerConfig,
        source_vocab: Vocabulary,
        target_vocab: Vocabulary | None = None,
        *,
        generation: GenerationConfig | None = None,
        name: str = "",
        mesh: jax.sharding.Mesh | None = None,
        quantize: str | None = None,
        dtype: str | None = None,
        **overrides: Any,
    ) -> None:
        check_quantization(quantize, "quantize")
        generation = resolve(generation, overrides, DEFAULT_GENERATION)
        params, config = unrolled(params, config)
        if dtype is not None:
            params, config = with_dtype(params, config, dtype)
        if quantize is not None and config.quantization is None:
            params = quantize_params(params, config)
            config = config.replace(quantization=quantize)
        self.config = config
        self.source_vocab = source_vocab
        self.target_vocab = source_vocab if target_vocab is None else target_vocab
        used = ("pad_id", "eos_id", "bos_id")  # what encoding, decoding and trimming read
        wanted = {name: getattr(config, name) for name in used}
        for side, vocab in (("source", self.source_vocab), ("target", self.target_vocab)):
            have = {name: vocabulary_ids(vocab)[name] for name in used}
            if have != wanted:
                raise ValueError(
                    f"the {side} vocabulary has special ids {have} but the model config has "
                    f"{wanted}; use the vocabulary the model was trained with"
                )
        self.generation = generation.checked_for(config)
        self.name = name
        self.mesh = default_mesh() if mesh is None else mesh
        # On the devices once, in their shards, not at every call.
        self.params = place_params(params, EncoderDecoder, config, self.mesh)

    # The defaults of code written before GenerationConfig, read from ``generation``.

    @property
    def method(self) -> str:
        return self.generation.method

    @property
    def beam_size(self) -> int:
        return self.generation.beam_size

    @property
    def alpha(self) -> float:
        return self.generation.alpha

    @property
    def max_len(self) -> int | None:
        """An int: every row's limit; None: each row's own (``max_len="source"``) or the
        model's positions."""
        return None if self.generation.max_len == SOURCE else self.generation.max_len

    @property
    def search_options(self) -> dict[str, Any]:
        """``beam_style``, ``early_stopping``, ``forced_eos`` and ``banned_ids`` of
        ``generation`` (and ``renormalize`` when it is on), as a dict."""
        options = {k: getattr(self.generation, k) for k in _SEARCH_OPTIONS}
        if self.generation.renormalize:
            options["renormalize"] = True
        return options

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_workdir(
        cls,
        workdir: str,
        *,
        step: int | None = None,
        average: int | None = None,
        mesh: jax.sharding.Mesh | None = None,
        quantize: str | None = None,
        dtype: str | None = None,
    ) -> Translator:
        """Loads the model config, vocabulary and parameters of a ``train.py`` workdir.

        Args:
          workdir: the run's folder (local or a ``gs://`` URI).
          step: checkpoint step to load; None = the latest.
          average: use the mean parameters of the ``average`` last checkpoints up to ``step``
            (checkpoint averaging; 1 = that checkpoint alone); None = the run's
            ``average_checkpoints`` (its recipe's choice), else 1.
          mesh: the devices that decode (see the class); None = every device.
          quantize: None or "int8" (see the class).
          dtype: None (the run's) or "bfloat16" / "float32" (see the class).

        Raises:
          FileNotFoundError: no such workdir, no ``model_config.json``, no vocabulary, no
            checkpoint, or no checkpoint at ``step`` (the message names the folder and what
            is missing).
          ValueError: the run is not a sequence-to-sequence one, or the vocabulary or the
            checkpoint does not match ``model_config.json``.
        """
        root = paths.resolve(workdir)  # local: absolute; gs://: as is
        workdir = str(root)
        if not root.is_dir():
            raise FileNotFoundError(f"workdir {workdir} does not exist")
        config_path = root / "model_config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no model_config.json in {workdir}: is it a train.py workdir?")
        try:
            config = TransformerConfig.from_json(config_path.read_text())
        except ValueError as e:  # also json.JSONDecodeError
            raise ValueError(f"invalid {config_path}: {e}") from e
        run: dict[str, Any] = {}
        run_path = root / "config.json"
        if run_path.is_file():
            run = json.loads(run_path.read_text())
        task = run.get("task", "translation")
        if task not in SEQ2SEQ_TASKS:
            raise ValueError(
                f"{workdir} was trained with task {task!r}; the translator needs an "
                f"encoder-decoder run (task one of {SEQ2SEQ_TASKS})"
            )
        try:  # before any weight is read
            generation = GenerationConfig.from_run(run, config)
        except ValueError as e:
            raise ValueError(f"the decoding options of {run_path}: {e}") from e

        source_vocab, target_vocab = load_vocabularies(workdir)
        for side, vocab, size in (
            ("source", source_vocab, config.vocab_size),
            ("target", target_vocab, config.output_vocab_size),
        ):
            if vocab.vocab_size != size:
                raise ValueError(
                    f"{side} vocabulary of {workdir} has {vocab.vocab_size} entries but "
                    f"model_config.json says {size}"
                )

        checkpoint_dir = str(root / "checkpoints")
        from flaxformer_lite.core.checkpoints import choose_steps  # orbax: only when needed

        if average is None:
            average = run.get("average_checkpoints") or 1
        chosen = choose_steps(checkpoint_dir, step=step, average=average)
        step = chosen[-1]
        expected = cls.abstract_params(config)
        params = average_params(checkpoint_dir, chosen, expected)
        label = f"step {step}" if average == 1 else f"mean of steps {chosen}"
        translator = cls(
            params,
            config,
            source_vocab,
            target_vocab,
            generation=generation,
            name=f"{workdir} ({label})",
            mesh=mesh,
            quantize=quantize,
            dtype=dtype,
        )
        translator.checkpoint_steps = tuple(chosen)
        return translator

    @classmethod
    def from_pretrained(
        cls,
        source: str,
        *,
        mesh: jax.sharding.Mesh | None = None,
        quantize: str | None = None,
        dtype: str | None = None,
        per_row_max_len: bool = False,
        **workdir_kwargs: Any,
    ) -> Translator:
        """A train.py workdir (``from_workdir``, e.g. a fine-tuned one) or a Hugging Face
        Marian folder / hub id (``hf.load_pretrained`` with its tokenizer), decoding as that
        model's ``generate`` does with its generation config and nothing else
        (``GenerationConfig.from_hugging_face``): greedy unless it sets ``num_beams`` > 1
        (transformers' default is 1); ``length_penalty`` (here ``alpha``, with Hugging Face's
        beam rules, default 1.0) and ``early_stopping``; every row's limit
        ``max_new_tokens``, else ``max_length`` - 1, else 20 tokens; the EOS forced at that
        limit when it sets ``forced_eos_token_id``; its single-token ``bad_words_ids`` never
        generated (opus-mt bans the pad token); ``renormalize_logits``.

        Args:
          source: a workdir, a Hugging Face folder or a hub id.
          mesh, quantize, dtype: as in the class.
          per_row_max_len: a Hugging Face folder: give each row this library's own limit,
            ``min(max_len, 1.5 * source + 10)`` tokens (``max_len="source"``), instead of the
            folder's ``max_length`` (a deliberate departure from ``generate``: a short
            sentence stops sooner when the model never emits EOS).
          workdir_kwargs: ``from_workdir``'s ``step`` and ``average`` (workdirs only).

        Raises:
          FileNotFoundError: neither a workdir nor a model folder, or no tokenizer files.
          ValueError: the folder's generation config asks for what these searches do not do
            (sampling, repetition penalties, minimum lengths, ...: every such field named),
            or ``per_row_max_len`` is not a bool; before the weights are read.
        """
        from flaxformer_lite.interop import hf
        from flaxformer_lite.interop.init_from import is_workdir, pretrained_config

        if not isinstance(per_row_max_len, bool):
            raise ValueError(f"per_row_max_len must be True or False; got {per_row_max_len!r}")
        if is_workdir(source):
            return cls.from_workdir(
                source, mesh=mesh, quantize=quantize, dtype=dtype, **workdir_kwargs
            )
        base = pretrained_config(source)  # config.json alone: checks before the weights
        generation = GenerationConfig.from_hugging_face(source, base)
        if per_row_max_len:
            generation = generation.replace(max_len=SOURCE)
        config, params, tokenizer = hf.load_pretrained(source)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{source} has no tokenizer (Marian: source.spm, target.spm, vocab.json; "
                "others: tokenizer.json or the family's files); the Translator needs one"
            )
        if hasattr(tokenizer, "source"):  # Marian's: two sides over one vocab.json
            source_vocab, target_vocab = tokenizer.source, tokenizer.target
        else:  # a BART, mBART, T5 ... tokenizer: the model's sizes and decoder start
            from flaxformer_lite.data.hf_vocabulary import vocabularies

            source_vocab, target_vocab = vocabularies(
                tokenizer, vocab_size=config.vocab_size, decoder_start_id=config.bos_id
            )
        return cls(
            params,
            config,
            source_vocab,
            target_vocab,
            generation=generation,
            name=str(source),
            mesh=mesh,
            dtype=dtype,
            quantize=quantize,
        )

    abstract_params = staticmethod(abstract_params)

    @classmethod
    def ensemble(cls, members: Sequence[Translator]) -> Translator:
        """One translator that decodes with several models at once: at every step the search
        follows the mean of their next-token probabilities (``decoding.generate``'s
        ensembles), e.g. runs of one recipe with other seeds. The models must share the
        architecture (``config``), the vocabularies and the devices; the decoding options,
        mesh and vocabularies are the first member's.

        Raises:
          ValueError: fewer than two members, or members whose configs or vocabularies
            differ (the first difference named).
        """
        members = list(members)
        if len(members) < 2:
            raise ValueError(
                f"members: an ensemble needs 2 or more translators; got {len(members)}"
            )
        for i, member in enumerate(members):
            if isinstance(member.params, tuple):
                raise ValueError(f"members[{i}] is already an ensemble; list its members instead")
        first = members[0]
        for i, other in enumerate(members[1:], 1):
            if other.config != first.config:
                pairs = [
                    (f.name, getattr(first.config, f.name), getattr(other.config, f.name))
                    for f in dataclasses.fields(first.config)
                ]
                fields = [f"{name}={a!r} / {b!r}" for name, a, b in pairs if a != b]
                raise ValueError(
                    f"members[0] ({first.name}) and members[{i}] ({other.name}) have different "
                    f"model configs ({'; '.join(fields[:3])}): an ensemble needs one architecture"
                )
            for side in ("source_vocab", "target_vocab"):
                a, b = getattr(first, side), getattr(other, side)
                ids = list(range(first.config.vocab_size))
                if a.vocab_size != b.vocab_size or a.id_to_piece(ids) != b.id_to_piece(ids):
                    raise ValueError(
                        f"members[0] ({first.name}) and members[{i}] ({other.name}) have "
                        f"different {side.replace('_vocab', '')} vocabularies: an ensemble "
                        "needs one (train the runs with the same vocabulary)"
                    )
        ensemble = copy.copy(first)  # its vocabularies, mesh and decoding options
        ensemble.params = tuple(
            place_params(m.params, EncoderDecoder, first.config, first.mesh) for m in members
        )
        ensemble.name = " + ".join(m.name for m in members)
        ensemble.checkpoint_steps = ()
        return ensemble

    # ------------------------------------------------------------------ encoding

    @property
    def max_source_len(self) -> int:
        """Longest source the model takes, EOS included (inputs are truncated to it)."""
        return self.config.max_len

    def encode(self, sentences: Sequence[str]) -> tuple[list[list[int] | None], int]:
        """Source ids (``config.eos_id`` appended, or the source vocabulary's ``suffix_ids``,
        e.g. mBART's EOS and language code; truncated to ``max_source_len``) or None for empty
        lines.

        Returns the ids and how many lines were truncated. Whitespace is normalised as in
        training (runs of any whitespace become one space).
        """
        ids: list[list[int] | None] = []
        truncated = 0
        suffix = list(getattr(self.source_vocab, "suffix_ids", None) or [self.config.eos_id])
        # A text's own ids: what a prefix (BART's <s>) leaves of an empty text's are none.
        prefix = len(getattr(self.source_vocab, "prefix_ids", ()))
        for text in sentences:
            text = " ".join(str(text).split())
            tokens = self.source_vocab.encode(text) if text else []
            if len(tokens) <= prefix:
                ids.append(None)
                continue
            if len(tokens) + len(suffix) > self.max_source_len:
                tokens = tokens[: self.max_source_len - len(suffix)]
                truncated += 1
            ids.append([*tokens, *suffix])
        return ids, truncated

    def _warn_truncated(self, truncated: int, total: int) -> None:
        if truncated:
            warnings.warn(
                f"{truncated} of {total} input lines are longer than the model's max_len "
                f"({self.max_source_len} tokens with EOS) and were truncated",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ translation

    def translate(
        self,
        sentences: Sequence[str],
        generation: GenerationConfig | None = None,
        *,
        batch_size: int = 64,
        seed: int = 0,
        progress: bool = False,
        **overrides: Any,
    ) -> list[str]:
        """Translates ``sentences``; the i-th output translates the i-th input.

        Args:
          sentences: source strings. An empty (or whitespace-only) one gives "" without being
            decoded; one longer than the model's ``max_len`` is truncated, and one warning per
            call counts such lines.
          generation: how to decode (a ``GenerationConfig``); None = the translator's
            (``self.generation``). Its ``max_len``: an int is every sentence's limit;
            "source" gives each sentence ``min(model max_len, 1.5 * source + 10)`` tokens with
            ``source`` its own token count (EOS included): a sentence gets the same
            translation whatever its batch-mates.
          batch_size: most sentences per decoding call. Every call of one ``translate`` uses
            the same row count: ``batch_size``, or the next power of two at or above the number
            of sentences when there are fewer (so one short input does not pay for 64 rows),
            rounded up to a multiple of the devices the batch is split over.
          seed: sampling key (batch i uses ``fold_in(key(seed), i)``): same seed, same output.
          progress: show a tqdm bar on stderr.
          **overrides: GenerationConfig fields replacing those of ``generation`` for this
            call: ``method`` ("beam", "greedy" or "sample"), ``beam_size``, ``alpha``,
            ``max_len``, ``temperature``, ``top_k``, ``top_p``, ...

        Raises:
          ValueError: a decoding option that is not valid (e.g. an unknown ``method``, a
            ``beam_size`` that is not a positive int, a ``max_len`` above the model's
            ``max_len``: the field named), or a ``batch_size`` that is not a positive int.
          TypeError: an override that is not a GenerationConfig field.
        """
        generation = resolve(generation, overrides, self.generation).checked_for(self.config)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        sentences = list(sentences)
        ids, truncated = self.encode(sentences)
        self._warn_truncated(truncated, len(sentences))
        outputs = [""] * len(sentences)
        # Longest first: a batch holds sentences of similar length, so little padding.
        order = sorted((i for i, x in enumerate(ids) if x is not None), key=lambda i: -len(ids[i]))
        if not order:
            return outputs
        rows = min(batch_size, 1 << (len(order) - 1).bit_length())
        rows = _round_up(rows, sharding.batch_parallelism(self.mesh))  # no padding in generate
        from tqdm import tqdm

        with tqdm(total=len(order), disable=not progress, unit="sent", desc="translate") as bar:
            for batch_index, start in enumerate(range(0, len(order), rows)):
                chunk = order[start : start + rows]
                # Padded to few lengths, that few shapes compile. Under max_len="source" each
                # row stops at its own limit (a function of its own length): the padded
                # length only sets the output width.
                source_len = min(
                    _round_up(max(len(ids[i]) for i in chunk), BUCKET), self.max_source_len
                )
                inputs = np.full((rows, source_len), self.config.pad_id, np.int32)
                for row, i in enumerate(chunk):
                    inputs[row, : len(ids[i])] = ids[i]
                # Padding rows copy a real row: they finish when it does, so they never keep
                # the decoding loop (which stops once all rows have EOS) running longer.
                inputs[len(chunk) :] = inputs[0]
                rng = None
                if generation.method == "sample":
                    rng = jax.random.fold_in(jax.random.key(seed), batch_index)
                tokens = self._generate(inputs, generation, rng)
                for row, i in enumerate(chunk):
                    text = self.target_vocab.decode(self._until_eos(tokens[row]))
                    outputs[i] = " ".join(text.split())
                bar.update(len(chunk))
        return outputs

    def _until_eos(self, tokens: np.ndarray) -> list[int]:
        """The ids of one output row ``[max_len]`` before its first ``config.eos_id`` (all of
        them when it has none): what :meth:`translate` decodes. Everything else, the
        decoder-start id included when it equals ``pad_id``, goes to the vocabulary as is."""
        tokens = np.asarray(tokens).tolist()
        eos = self.config.eos_id
        return tokens[: tokens.index(eos)] if eos in tokens else tokens

    def _generate(
        self, inputs: np.ndarray, generation: GenerationConfig, rng: jax.Array | None = None
    ) -> np.ndarray:
        """Token ids `[rows, width]` (``config.eos_id``, then ``config.pad_id``) for source
        ids `[rows, src_len]` (padded with ``config.pad_id``), decoded as ``generation``
        says (``generate`` gives the fields its method ignores fixed values: e.g. greedy with
        another ``beam_size`` does not compile again)."""
        tokens, _ = generate(self.params, self.config, inputs, generation, mesh=self.mesh, rng=rng)
        return np.asarray(tokens)

    # ------------------------------------------------------------------ attention

    def attention(
        self, text: str, generation: GenerationConfig | None = None, **overrides: Any
    ) -> dict[str, Any]:
        """Attention weights of the greedy translation of ``text``, for plotting.

        The translation is decoded greedily (``generation``, None = the translator's, with
        ``overrides`` such as ``max_len`` replacing its fields and ``method="greedy"``), then
        run once more teacher-forced (same tokens) with the "intermediates" collection
        mutable, where every attention layer sows its weights.

        Returns a dict::

          ``translation``: the output string.
          ``source_pieces``: `[src_len]` pieces of the source, EOS included.
          ``target_pieces``: `[tgt_len]` generated pieces, EOS included when generated. Row
            ``t`` of the decoder weights is the position that predicted ``target_pieces[t]``.
          ``decoder_input_pieces``: `[tgt_len]` what the decoder read: BOS then the targets
            shifted right (the keys of decoder self-attention).
          ``encoder_self``: float32 `[enc_layers, heads, src_len, src_len]`.
          ``decoder_self``: float32 `[dec_layers, heads, tgt_len, tgt_len]`.
          ``encoder_decoder``: float32 `[dec_layers, heads, tgt_len, src_len]`.

        Raises:
          ValueError: ``text`` is empty, or a decoding option is not valid.
        """
        if isinstance(self.params, tuple):
            raise ValueError(
                "attention() of an ensemble: its models attend differently; call it on one "
                "member translator"
            )
        generation = resolve(generation, overrides, self.generation).replace(method="greedy")
        generation.checked_for(self.config)
        ids, truncated = self.encode([text])
        self._warn_truncated(truncated, 1)
        if ids[0] is None:
            raise ValueError("attention() needs a non-empty text")
        source = np.asarray([ids[0]], np.int32)
        tokens = self._generate(source, generation)[0]
        eos = np.flatnonzero(tokens == self.config.eos_id)
        target = tokens[: eos[0] + 1] if eos.size else tokens
        decoder_inputs = np.concatenate([[self.config.bos_id], target[:-1]]).astype(np.int32)
        enc, dec = _attention_weights(
            self.params, self.config, jnp.asarray(source), jnp.asarray(decoder_inputs[None])
        )
        return {
            "translation": self.target_vocab.decode(target.tolist()),
            "source_pieces": self.source_vocab.id_to_piece(ids[0]),
            "target_pieces": self.target_vocab.id_to_piece(target.tolist()),
            "decoder_input_pieces": self.target_vocab.id_to_piece(decoder_inputs.tolist()),
            "encoder_self": np.stack([np.asarray(w["self"][0]) for w in enc]),
            "decoder_self": np.stack([np.asarray(w["self"][0]) for w in dec]),
            "encoder_decoder": np.stack([np.asarray(w["cross"][0]) for w in dec]),
        }

    def __repr__(self) -> str:
        return f"Translator({self.name or self.config})"


@functools.partial(jax.jit, static_argnames=("config",))
def _attention_weights(
    params: Any, config: TransformerConfig, inputs: jax.Array, decoder_inputs: jax.Array
) -> tuple[list[dict[str, jax.Array]], list[dict[str, jax.Array]]]:
    """Encoder weights (per layer ``{"self": [b, h, s, s]}``) and decoder weights (per layer
    ``{"self": [b, h, t, t], "cross": [b, h, t, s]}``) of one teacher-forced pass."""
    model = EncoderDecoder(config)
    variables = {"params": params}
    encoded, enc = model.apply(variables, inputs, method=model.encode, mutable=["intermediates"])
    _, dec = model.apply(
        variables, encoded, inputs, decoder_inputs, method=model.decode, mutable=["intermediates"]
    )
    return (
        attention_weights_per_layer(enc["intermediates"]["encoder"]),
        attention_weights_per_layer(dec["intermediates"]["decoder"]),
    )
