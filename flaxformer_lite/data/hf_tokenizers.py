"""The tokenizer of a Hugging Face model folder, for the model families of ``interop/``: T5 /
Flan-T5, the Llama family (Llama 2 and 3, SmolLM, TinyLlama, Qwen2), BART and mBART.

    tokenizer = load_hf_tokenizer("flan-t5-small/", "t5")   # None: the folder has no tokenizer
    ids = tokenizer.encode(["A dog runs."])                 # [[..., 1]]: T5 appends </s>
    text = tokenizer.decode(output_ids)                     # special tokens skipped
    tokenizer.save("out/")                                  # transformers reads it back

Which files serve (the first present):

====================  ================================================================
``model_type``        files
====================  ================================================================
``t5``                ``tokenizer.json``; ``spiece.model`` (sentencepiece)
``llama``             ``tokenizer.json`` (Llama 3, SmolLM); ``tokenizer.model`` (Llama 2)
``qwen2``             ``tokenizer.json``
``bart``              ``tokenizer.json``; ``vocab.json`` + ``merges.txt`` (byte-level BPE)
``mbart``             ``tokenizer.json``; ``sentencepiece.bpe.model`` (sentencepiece)
====================  ================================================================

``tokenizer.json`` goes through the ``tokenizers`` library (``hf_json_tokenizer``), SentencePiece
models through ``sentencepiece`` (``hf_sentencepiece``); ``tokenizer_config.json`` and
``special_tokens_map.json`` give the special tokens and ``add_bos_token`` / ``add_eos_token``.
Ids and decoded text are those of ``transformers``' tokenizer for the folder (the tests check
thousands of sentences per family). Callers resolve hub ids to a local folder first.
"""

from __future__ import annotations

from flaxformer_lite.data.hf_json_tokenizer import JsonTokenizer
from flaxformer_lite.data.hf_sentencepiece import (
    LlamaSentencePiece,
    MBartSentencePiece,
    T5SentencePiece,
)
from flaxformer_lite.data.hf_tokenizer_base import HFTokenizer, read_tokenizer_files

# model_type -> (the family's conventional special tokens, its files other than tokenizer.json).
FAMILIES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "t5": ({"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}, ("spiece.model",)),
    "llama": ({"bos": "<s>", "eos": "</s>", "unk": "<unk>"}, ("tokenizer.model",)),
    "qwen2": ({}, ()),
    "bart": (
        {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>", "mask": "<mask>"},
        ("vocab.json", "merges.txt"),
    ),
    "mbart": (
        {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>", "mask": "<mask>"},
        ("sentencepiece.bpe.model",),
    ),
}
MODEL_TYPES = tuple(FAMILIES)

__all__ = ["FAMILIES", "MODEL_TYPES", "HFTokenizer", "load_hf_tokenizer"]


def load_hf_tokenizer(
    folder: str,
    model_type: str,
    *,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> HFTokenizer | None:
    """The tokenizer in a local or ``gs://`` model ``folder`` for ``config.json``'s
    ``model_type``; None when the folder holds no tokenizer file at all.

    ``src_lang`` / ``tgt_lang``: mBART's language codes (default: the config's, else ``en_XX``).

    Raises:
      ValueError: an unknown ``model_type``; a folder that is not a directory, or whose tokenizer
        files are not the ones ``model_type`` reads (the message names what would serve).
    """
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} has no tokenizer here; supported: {', '.join(MODEL_TYPES)}"
        )
    if (src_lang or tgt_lang) and model_type != "mbart":
        raise ValueError(f"src_lang/tgt_lang apply to model_type 'mbart' only, not {model_type!r}")
    files = read_tokenizer_files(folder)
    if not files:
        return None
    defaults, own_files = FAMILIES[model_type]
    if "tokenizer.json" in files:
        return JsonTokenizer.from_files(model_type, files, defaults, src_lang, tgt_lang)
    if own_files and all(name in files for name in own_files):
        if model_type == "t5":
            return T5SentencePiece(files)
        if model_type == "llama":
            return LlamaSentencePiece(files)
        if model_type == "mbart":
            return MBartSentencePiece(files, src_lang=src_lang, tgt_lang=tgt_lang)
        return JsonTokenizer.from_files(model_type, files, defaults)  # bart's vocab + merges
    wanted = " or ".join(
        ["tokenizer.json", " + ".join(own_files)] if own_files else ["tokenizer.json"]
    )
    raise ValueError(
        f"{folder} has tokenizer files ({', '.join(sorted(files))}) but none that a "
        f"{model_type!r} tokenizer reads: expected {wanted}"
    )
