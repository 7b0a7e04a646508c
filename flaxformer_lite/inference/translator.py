"""Translate strings with a trained workdir: vocabulary, parameters and batched decoding.

    from flaxformer_lite.inference.translator import Translator

    translator = Translator.from_workdir("runs/m30k")  # latest checkpoint
    translator.translate(["A man rides a bike.", ""], method="beam")  # -> ["Ein Mann ...", ""]
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
from flaxformer_lite.decoding.generate import (
    METHODS,
    check_decode_len,
    check_search_options,
    default_mesh,
    generate,
    place_params,
)
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


def _run_search_options(run: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """generate()'s search options a run's config.json asks for (configs/finetune_marian.py
    sets them: Hugging Face's beam rules, forced EOS, the pad id banned)."""
    options: dict[str, Any] = {}
    if run.get("beam_style"):
        options["beam_style"] = run["beam_style"]
    if run.get("early_stopping") is not None:
        options["early_stopping"] = run["early_stopping"]
    if run.get("forced_eos"):
        options["forced_eos"] = True
    if run.get("ban_pad"):
        options["banned_ids"] = (config.pad_id,)
    return options


def load_vocabularies(workdir: str) -> tuple[Vocabulary, Vocabulary]:
    """(source, target) vocabularies saved in ``workdir`` by ``train.py`` (one object if shared).

    Raises:
      FileNotFoundError: none of the vocabulary files is there (their names are listed).
    """
    from flaxformer_lite.data.tokenizer import Tokenizer  # sentencepiece: only when needed

    root = epath.Path(workdir)
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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Translator:
    """An ``EncoderDecoder`` with its parameters and vocabularies: strings in, strings out.

    Args:
      params: the model parameters (unboxed; numpy or jax arrays).
      config: the model's ``TransformerConfig``.
      source_vocab, target_vocab: vocabularies (the same object when shared).
      beam_size, alpha: defaults of :meth:`translate` (``from_workdir`` reads them from the
        run's ``config.json`` when it has them).
      method: the default method of :meth:`translate` ("beam"; ``from_pretrained`` of a
        Hugging Face folder: "greedy" unless it sets ``num_beams`` > 1, as ``generate``).
      max_len: the default ``max_len`` of :meth:`translate`: None = each row's own limit,
        ``min(model max_len, 1.5 * source + 10)``; an int = that many tokens for every row
        (``from_pretrained``: the folder's ``max_length`` / ``max_new_tokens``).
      search_options: generate()'s ``beam_style``, ``early_stopping``, ``forced_eos``,
        ``banned_ids`` and ``renormalize`` (checked here; the beam rules and
        ``renormalize`` apply to beam search only).
      name: where the model came from, for messages.
      mesh: the devices that decode (a ``sharding.make_mesh`` mesh: batch over ``data`` x
        ``fsdp``, heads over ``tensor``); None = every device, the batch split over all.
      quantize: None, or "int8": decode with int8 weights and activations (the float
        ``params`` are quantized here by ``quantize.quantize_params``; ``config`` then has
        ``quantization="int8"``).

    A ``scan_layers`` model is converted once, here, to its unrolled equivalent
    (``models.unrolled``: same outputs), which ``config`` and ``params`` then hold.

    The special ids come from ``config`` (``pad_id`` pads the sources, ``eos_id`` ends them
    and the outputs, ``bos_id`` starts decoding): the vocabularies must have the same ones.

    Raises:
      ValueError: a vocabulary's pad, eos or decoder-start id differs from ``config``'s.
    """

    def __init__(
        self,
        params: Any,
        config: TransformerConfig,
        source_vocab: Vocabulary,
        target_vocab: Vocabulary | None = None,
        *,
        beam_size: int = 4,
        alpha: float = 0.6,
        name: str = "",
        mesh: jax.sharding.Mesh | None = None,
        search_options: dict[str, Any] | None = None,
        quantize: str | None = None,
        method: str = "beam",
        max_len: int | None = None,
    ) -> None:
        check_quantization(quantize, "quantize")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {method!r}")
        params, config = unrolled(params, config)
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
        self.beam_size = beam_size
        self.alpha = alpha
        # generate()'s beam_style / early_stopping / forced_eos / banned_ids (checked here).
        self.search_options = dict(search_options or {})
        renormalize = self.search_options.get("renormalize", False)
        if not isinstance(renormalize, bool):
            raise ValueError(
                f"search_options renormalize must be True or False; got {renormalize!r}"
            )
        check_search_options(
            config, **{k: v for k, v in self.search_options.items() if k != "renormalize"}
        )
        self.method = method
        self.max_len = None if max_len is None else check_decode_len(config, max_len)
        self.name = name
        self.mesh = default_mesh() if mesh is None else mesh
        # On the devices once, in their shards, not at every call.
        self.params = place_params(params, EncoderDecoder, config, self.mesh)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_workdir(
        cls,
        workdir: str,
        *,
        step: int | None = None,
        average: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        quantize: str | None = None,
    ) -> Translator:
        """Loads the model config, vocabulary and parameters of a ``train.py`` workdir.

        Args:
          workdir: the run's folder (local or a ``gs://`` URI).
          step: checkpoint step to load; None = the latest.
          average: use the mean parameters of the ``average`` last checkpoints up to ``step``
            (checkpoint averaging; 1 = that checkpoint alone).
          mesh: the devices that decode (see the class); None = every device.
          quantize: None or "int8" (see the class).

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

        chosen = choose_steps(checkpoint_dir, step=step, average=average)
        step = chosen[-1]
        expected = cls.abstract_params(config)
        params = average_params(checkpoint_dir, chosen, expected)
        label = f"step {step}" if average == 1 else f"mean of steps {chosen}"
        return cls(
            params,
            config,
            source_vocab,
            target_vocab,
            beam_size=int(run.get("beam_size") or 4),
            alpha=float(0.6 if run.get("alpha") is None else run["alpha"]),
            name=f"{workdir} ({label})",
            mesh=mesh,
            search_options=_run_search_options(run, config),
            quantize=quantize,
        )

    @classmethod
    def from_pretrained(
        cls,
        source: str,
        *,
        mesh: jax.sharding.Mesh | None = None,
        quantize: str | None = None,
        per_row_max_len: bool = False,
        **workdir_kwargs: Any,
    ) -> Translator:
        """A train.py workdir (``from_workdir``, e.g. a fine-tuned one) or a Hugging Face
        Marian folder / hub id (``hf.load_pretrained`` with its tokenizer), decoding as that
        model's ``generate`` does with its generation config and nothing else: greedy unless
        it sets ``num_beams`` > 1 (transformers' default is 1); ``length_penalty`` (here
        ``alpha``, with Hugging Face's beam rules, default 1.0) and ``early_stopping``; every
        row's limit ``max_new_tokens``, else ``max_length`` - 1, else 20 tokens
        (``hf.generate_new_tokens``); the EOS forced at that limit when it sets
        ``forced_eos_token_id``; its single-token ``bad_words_ids`` never generated (opus-mt
        bans the pad token); ``renormalize_logits``.

        Args:
          source: a workdir, a Hugging Face folder or a hub id.
          mesh, quantize: as in the class.
          per_row_max_len: a Hugging Face folder: give each row this library's own limit,
            ``min(max_len, 1.5 * source + 10)`` tokens, instead of the folder's
            ``max_length`` (a deliberate departure from ``generate``: a short sentence stops
            sooner when the model never emits EOS).
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
            return cls.from_workdir(source, mesh=mesh, quantize=quantize, **workdir_kwargs)
        gen = hf.generation_defaults(source)
        base = pretrained_config(source)  # config.json alone: checks before the weights
        problems = hf.unsupported_generation(gen, base)
        if problems:
            raise ValueError(
                f"the generation config of {source} asks for what Translator cannot decode: "
                + "; ".join(problems)
                + " (change generation_config.json, or decode with transformers)"
            )
        max_len = None if per_row_max_len else hf.generate_new_tokens(gen, base)
        config, params, tokenizer = hf.load_pretrained(source)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{source} has no tokenizer (source.spm, target.spm, vocab.json); the "
                "Translator needs one"
            )
        banned = sorted(
            {int(w[0]) for w in gen.get("bad_words_ids") or [] if len(w) == 1} - {config.eos_id}
        )
        options = dict(
            beam_style="hf",
            early_stopping=gen.get("early_stopping", False),
            forced_eos=gen.get("forced_eos_token_id") == config.eos_id,
            banned_ids=tuple(banned),
            renormalize=bool(gen.get("renormalize_logits", False)),
        )
        num_beams = int(gen.get("num_beams", 1))
        return cls(
            params,
            config,
            tokenizer.source,
            tokenizer.target,
            beam_size=num_beams,
            alpha=float(gen.get("length_penalty", 1.0)),
            name=str(source),
            mesh=mesh,
            search_options=options,
            quantize=quantize,
            method="beam" if num_beams > 1 else "greedy",
            max_len=max_len,
        )

    abstract_params = staticmethod(abstract_params)

    # ------------------------------------------------------------------ encoding

    @property
    def max_source_len(self) -> int:
        """Longest source the model takes, EOS included (inputs are truncated to it)."""
        return self.config.max_len

    def _decode_len(self, source_len: int, max_len: int | None) -> int:
        """Tokens to generate for a source of ``source_len`` tokens (EOS included).

        Default as in ``train.py``'s BLEU evaluation: 1.5 times the source plus 10, never more
        than the model's positions cover (decoding stops earlier once every row has EOS).
        It is a function of one source alone: ``translate`` gives each row its own limit.

        Raises:
          ValueError: ``max_len`` is not a positive int or exceeds the model's ``max_len``.
        """
        if max_len is None:
            return max(1, min(self.config.max_len, int(source_len * 1.5) + 10))
        return check_decode_len(self.config, max_len)

    def encode(self, sentences: Sequence[str]) -> tuple[list[list[int] | None], int]:
        """Source ids (``config.eos_id`` appended, truncated to ``max_source_len``) or None for
        empty lines.

        Returns the ids and how many lines were truncated. Whitespace is normalised as in
        training (runs of any whitespace become one space).
        """
        ids: list[list[int] | None] = []
        truncated = 0
        for text in sentences:
            text = " ".join(str(text).split())
            tokens = self.source_vocab.encode(text) if text else []
            if not tokens:
                ids.append(None)
                continue
            if len(tokens) + 1 > self.max_source_len:
                tokens = tokens[: self.max_source_len - 1]
                truncated += 1
            ids.append([*tokens, self.config.eos_id])
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
        *,
        method: str | None = None,
        beam_size: int | None = None,
        alpha: float | None = None,
        batch_size: int = 64,
        max_len: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        progress: bool = False,
    ) -> list[str]:
        """Translates ``sentences``; the i-th output translates the i-th input.

        Args:
          sentences: source strings. An empty (or whitespace-only) one gives "" without being
            decoded; one longer than the model's ``max_len`` is truncated, and one warning per
            call counts such lines.
          method: "beam", "greedy" or "sample"; None = the translator's (``method``).
          beam_size, alpha: beam search width and GNMT length penalty; None = the
            translator's defaults (the run's ``config.json``, else 4 and 0.6).
          batch_size: most sentences per decoding call. Every call of one ``translate`` uses
            the same row count: ``batch_size``, or the next power of two at or above the number
            of sentences when there are fewer (so one short input does not pay for 64 rows),
            rounded up to a multiple of the devices the batch is split over.
          max_len: most tokens to generate; None = the translator's ``max_len``, and where
            that is None too, ``min(model max_len, 1.5 * source + 10)`` with ``source`` the
            sentence's own token count (EOS included): a sentence gets the same translation
            whatever its batch-mates.
          temperature, top_k, top_p: sampling filters (method="sample").
          seed: sampling key (batch i uses ``fold_in(key(seed), i)``): same seed, same output.
          progress: show a tqdm bar on stderr.

        Raises:
          ValueError: unknown ``method``, a ``beam_size``, ``batch_size`` or ``max_len``
            that is not a positive int, or a ``max_len`` above the model's ``max_len``.
        """
        method = self.method if method is None else method
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {method!r}")
        max_len = self.max_len if max_len is None else max_len
        beam_size = self.beam_size if beam_size is None else beam_size
        alpha = self.alpha if alpha is None else alpha
        for name, value in (("beam_size", beam_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        self._decode_len(1, max_len)  # validates max_len before any work
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
                source_len = min(
                    _round_up(max(len(ids[i]) for i in chunk), BUCKET), self.max_source_len
                )
                inputs = np.full((rows, source_len), self.config.pad_id, np.int32)
                # Each row stops at its own limit (a function of its own length); the padded
                # source length only sets the output width, so that few shapes compile.
                limits = np.zeros((rows,), np.int32)
                for row, i in enumerate(chunk):
                    inputs[row, : len(ids[i])] = ids[i]
                    limits[row] = self._decode_len(len(ids[i]), max_len)
                # Padding rows copy a real row: they finish when it does, so they never keep
                # the decoding loop (which stops once all rows have EOS) running longer.
                inputs[len(chunk) :] = inputs[0]
                limits[len(chunk) :] = limits[0]
                tokens = self._generate(
                    inputs,
                    method=method,
                    max_len=self._decode_len(source_len, max_len),
                    row_max_len=limits,
                    beam_size=beam_size,
                    alpha=alpha,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    rng=jax.random.fold_in(jax.random.key(seed), batch_index)
                    if method == "sample"
                    else None,
                )
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
        self,
        inputs: np.ndarray,
        *,
        method: str,
        max_len: int,
        beam_size: int = 1,
        alpha: float = 0.0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        rng: jax.Array | None = None,
        row_max_len: np.ndarray | None = None,
    ) -> np.ndarray:
        """Token ids `[rows, max_len]` (``config.eos_id``, then ``config.pad_id``) for source
        ids `[rows, src_len]`; row ``r`` generates at most ``row_max_len[r]`` tokens (None:
        ``max_len``)."""
        # The options are static jit arguments: give the ones a method ignores fixed values,
        # so that e.g. greedy with another beam_size does not compile again.
        if method != "beam":
            beam_size, alpha = 1, 0.0
        if method != "sample":
            temperature, top_k, top_p, rng = 1.0, 0, 1.0, None
        search = dict(self.search_options)
        if method != "beam":  # beam rules do not apply; constraints do
            search.pop("beam_style", None)
            search.pop("early_stopping", None)
            search.pop("renormalize", None)  # changes no greedy or sampled choice
        tokens, _ = generate(
            self.params,
            self.config,
            inputs,
            mesh=self.mesh,
            method=method,
            **search,
            max_len=max_len,
            beam_size=beam_size,
            alpha=float(alpha),
            temperature=float(temperature),
            top_k=top_k,
            top_p=float(top_p),
            rng=rng,
            row_max_len=row_max_len,
        )
        return np.asarray(tokens)

    # ------------------------------------------------------------------ attention

    def attention(self, text: str, *, max_len: int | None = None) -> dict[str, Any]:
        """Attention weights of the greedy translation of ``text``, for plotting.

        The translation is decoded greedily, then run once more teacher-forced (same tokens)
        with the "intermediates" collection mutable, where every attention layer sows its
        weights.

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
          ValueError: ``text`` is empty.
        """
        ids, truncated = self.encode([text])
        self._warn_truncated(truncated, 1)
        if ids[0] is None:
            raise ValueError("attention() needs a non-empty text")
        source = np.asarray([ids[0]], np.int32)
        max_len = self.max_len if max_len is None else max_len
        tokens = self._generate(
            source, method="greedy", max_len=self._decode_len(source.shape[1], max_len)
        )[0]
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
