"""Autoregressive decoding.

``search`` is pure functions over one model callback, ``tokens_to_logits(tokens, cache) ->
(logits, new_cache)``: greedy, beam and sampling inside ``lax.while_loop`` (t5x style).
``generate`` binds them to the models: it builds the cache, shards rows over the mesh and jits
one call per batch. ``generation_config.GenerationConfig`` holds every decoding option (method,
lengths, beam and sampling options, token constraints) as one frozen, validated value;
``hf_generation`` reads a Hugging Face folder's generation config for it.

The search names are re-exported here: they were ``flaxformer_lite.decoding`` before the package
had subfolders.
"""

from flaxformer_lite.decoding.beam import beam_search
from flaxformer_lite.decoding.search import (
    BEAM_STYLES,
    BOS_ID,
    EARLY_STOPPING,
    EOS_ID,
    PAD_ID,
    check_search_options,
    expand_to_beams,
    flatten_beams,
    greedy_search,
    length_penalty,
    sample,
    unflatten_beams,
)

__all__ = [  # as flaxformer_lite.decoding.search's
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "BEAM_STYLES",
    "EARLY_STOPPING",
    "beam_search",
    "check_search_options",
    "expand_to_beams",
    "flatten_beams",
    "greedy_search",
    "length_penalty",
    "sample",
    "unflatten_beams",
]
