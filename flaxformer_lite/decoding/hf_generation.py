"""A Hugging Face model folder's generation config, read as ``transformers`` reads it.

``MarianMTModel.generate()`` called with no arguments decodes as the folder's
``generation_config.json`` says (older checkpoints keep those fields in ``config.json``). This
module reads those fields and answers the two questions ``GenerationConfig.from_hugging_face``
asks of them: how many tokens ``generate`` produces (:func:`generate_new_tokens`) and which
fields ask for something our searches do not do (:func:`unsupported_generation`). Plain JSON:
neither torch nor transformers is imported. ``interop.hf`` re-exports every name here (they
were defined there before ``GenerationConfig``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flaxformer_lite.core.hub import resolve
from flaxformer_lite.nn.config import TransformerConfig

# The fields of a generation config (transformers.GenerationConfig) that decide which tokens
# MarianMTModel.generate returns; older checkpoints keep them in config.json.
GENERATION_KEYS = (
    "num_beams",
    "length_penalty",
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "early_stopping",
    "bad_words_ids",
    "forced_eos_token_id",
    "forced_bos_token_id",
    "renormalize_logits",
    "do_sample",
    "num_beam_groups",
    "diversity_penalty",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "remove_invalid_values",
)
# What transformers' generate uses where a folder sets nothing (GenerationConfig's defaults).
GENERATION_DEFAULT_MAX_LENGTH = 20
GENERATION_IDS = ("decoder_start_token_id", "eos_token_id", "pad_token_id")


def generation_config(path_or_repo_id: str) -> dict[str, Any]:
    """The generation config of a Hugging Face model folder, every field as it is written:
    its ``generation_config.json``, or, for a folder without one, the generation fields of
    its ``config.json`` (``GENERATION_KEYS`` and the ids). ``hf.save_pretrained(...,
    generation=generation_config(folder))`` writes it back unchanged.

    Raises:
      FileNotFoundError: no such folder or repository.
    """
    root = resolve(path_or_repo_id)
    path = root / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    config_path = root / "config.json"
    if not config_path.is_file():
        return {}
    values = json.loads(config_path.read_text())
    keys = (*GENERATION_IDS, *GENERATION_KEYS)
    return {k: values[k] for k in keys if values.get(k) is not None}


def set_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``GENERATION_KEYS`` of a generation config (a dict as :func:`generation_config`
    returns) that are set (not None): the decoding defaults ``generate`` follows."""
    return {k: values[k] for k in GENERATION_KEYS if values.get(k) is not None}


def generation_defaults(path_or_repo_id: str) -> dict[str, Any]:
    """The decoding defaults of a Hugging Face model folder: the ``GENERATION_KEYS`` its
    generation config sets (not None). As transformers reads them: ``generation_config.json``
    alone when the folder has one (``config.json``'s copies are then ignored), else
    ``config.json`` (see :func:`generation_config`)."""
    return set_fields(generation_config(path_or_repo_id))


def generate_new_tokens(defaults: Mapping[str, Any], config: TransformerConfig) -> int:
    """The most tokens ``MarianMTModel.generate`` produces (EOS included, the decoder start
    not) under the generation ``defaults`` (see :func:`generation_defaults`):
    ``max_new_tokens``, else ``max_length`` - 1 (it counts the decoder start), else
    transformers' default ``max_length`` of 20 new tokens, at most the positions
    (``max_position_embeddings`` - 1). Never more than ``config.max_len``, which the decoder's
    positions allow.

    Raises:
      ValueError: ``max_new_tokens`` / ``max_length`` leave no token to generate.
    """
    if defaults.get("max_new_tokens") is not None:
        name, n = "max_new_tokens", int(defaults["max_new_tokens"])
    elif defaults.get("max_length") is not None:
        name, n = "max_length", int(defaults["max_length"]) - 1
    else:
        name = "max_length"
        n = min(GENERATION_DEFAULT_MAX_LENGTH + 1, config.max_len) - 1
    if n < 1:
        raise ValueError(
            f"generation config {name}={defaults.get(name)} leaves no token to generate; "
            "valid: max_new_tokens >= 1 or max_length >= 2"
        )
    return min(n, config.max_len)


def unsupported_generation(defaults: Mapping[str, Any], config: TransformerConfig) -> list[str]:
    """The generation ``defaults`` that our searches cannot follow (empty when none): sampling,
    group beam search, repetition penalties and n-gram bans, minimum lengths, multi-token
    ``bad_words_ids``, token suppression, sequence biases, an exponential length decay, and a
    forced EOS other than the model's (a forced first token, ``forced_bos_token_id``, is
    ``GenerationConfig.forced_bos_id``)."""
    neutral = {
        "do_sample": (False,),
        "num_beam_groups": (1,),
        "diversity_penalty": (0.0,),
        "repetition_penalty": (1.0,),
        "encoder_repetition_penalty": (1.0,),
        "no_repeat_ngram_size": (0,),
        "encoder_no_repeat_ngram_size": (0,),
        "min_length": (0, 1),
        "min_new_tokens": (0,),
        "suppress_tokens": ([],),
        "begin_suppress_tokens": ([],),
        "sequence_bias": ({},),
    }
    problems = [
        f"{k}={defaults[k]!r} (supported: {list(v)} or unset)"
        for k, v in neutral.items()
        if defaults.get(k) is not None and defaults[k] not in v
    ]
    if defaults.get("exponential_decay_length_penalty") is not None:
        value = defaults["exponential_decay_length_penalty"]
        problems.append(f"exponential_decay_length_penalty={value!r} (supported: unset)")
    forced = defaults.get("forced_eos_token_id")
    if forced is not None and forced != config.eos_id:
        problems.append(f"forced_eos_token_id={forced!r} (supported: eos_id={config.eos_id})")
    long_words = [w for w in defaults.get("bad_words_ids") or [] if len(w) != 1]
    if long_words:
        problems.append(f"bad_words_ids with multi-token entries {long_words} (supported: [[id]])")
    return problems
