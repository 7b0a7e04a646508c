"""Hugging Face BART and mBART (``model_type`` "bart" / "mbart"): config, parameter names.

Both are the paper's Transformer with fairseq's choices, each a ``TransformerConfig`` field:
learned positions whose table keeps 2 rows before position 0
(``position="learned"``, ``learned_position_offset=2``: ``BartLearnedPositionalEmbedding``
reads row p + 2), a LayerNorm on the embedding sum in both stacks (``embedding_norm``,
``layernorm_embedding``), embeddings scaled or not (``scale_embeddings``), GELU (exact erf:
``activation="gelu_exact"``), LayerNorm epsilon 1e-5, one table for the encoder, the decoder
and the output (tied) plus ``final_logits_bias`` (``logits_bias``). BART is post-LN; mBART is
pre-LN (``norm_position="pre"``) with a final LayerNorm per stack (our ``final_norm``); the
norm position alone tells which ``model_type`` ``config_to_hf`` writes. Ids: ``<s>`` 0, pad 1,
``</s>`` 2 (EOS, and BART's decoder start), ``<unk>`` 3. Positions count 0 .. n - 1 in every
row whatever its padding, as ours do. Parameter names (``naming`` applies the layouts)::

    model.{en,de}coder.layers.i.*                       ->  as Marian's (``marian`` module)
    model.{en,de}coder.embed_positions `[max + 2, d]`   ->  {en,de}coder/embedder/positions
    model.{en,de}coder.layernorm_embedding              ->  {en,de}coder/embedder/embedding_norm
    model.{en,de}coder.layer_norm (mBART)               ->  {en,de}coder/final_norm
    model.shared (= embed_tokens = lm_head)             ->  source_embedding
    final_logits_bias `[1, vocab]`                      ->  decoder/logits_bias `[vocab]`

Tokenizer: ``data.hf_tokenizers.load_hf_tokenizer`` (``load_tokenizer``). Decoding:
``forced_bos_token_id`` (the first generated token: ``<s>`` in bart-large, the
target language code in mBART-50) and ``forced_eos_token_id`` are ``GenerationConfig``'s
``forced_bos_id`` and ``forced_eos``, read from the folder's generation config.

``activation_dropout`` (bart-base/large: 0.1) is ``activation_dropout_rate``. Refused (one
line naming the key): encoder and decoder that differ in head count or feed-forward width, an
activation other than GELU/ReLU/swish, layer drop, untied embeddings
(``tie_word_embeddings=false``), and fairseq's legacy keys
(``normalize_before``, ``add_final_layer_norm``, ``normalize_embedding``,
``static_position_embeddings``, ``add_bias_logits``, ``extra_pos_embeddings``) where they
describe another model than the one transformers builds for the ``model_type``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.interop import fields, marian, naming
from flaxformer_lite.interop.naming import Tensor
from flaxformer_lite.nn.config import TransformerConfig

NAME = "BART"
MODEL_TYPES = ("bart", "mbart")
DECODER_ONLY = False
POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding.offset
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default; BartConfig has no field
FAIRSEQ_UNK = 3  # <unk> in every fairseq dictionary (BART's and mBART's)

Params = dict[str, Any]

FROM_HF_ACTIVATION = marian.FROM_HF_ACTIVATION
TO_HF_ACTIVATION = marian.TO_HF_ACTIVATION
ARCHITECTURES = {"bart": "BartForConditionalGeneration", "mbart": "MBartForConditionalGeneration"}


# ----------------------------------------------------------------------------- configs


def _legacy_keys(model_type: str) -> dict[str, Any]:
    """fairseq's keys that old config.json files carry (transformers ignores them and builds the
    model of ``model_type``), with the values that describe that model. CTranslate2's converter
    reads ``normalize_before`` and ``normalize_embedding``, so ``config_to_hf`` writes them."""
    pre = model_type == "mbart"
    return {
        "normalize_before": pre,
        "add_final_layer_norm": pre,
        "normalize_embedding": True,
        "static_position_embeddings": False,
        "add_bias_logits": False,
        "extra_pos_embeddings": POSITION_OFFSET,
    }


def _required(hf: Mapping[str, Any], key: str) -> Any:
    value = hf.get(key)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which a BART model needs")
    return value


def hf_problems(hf: Mapping[str, Any]) -> list[str]:
    """The keys of a BART/mBART ``config.json`` dict that ``TransformerConfig`` cannot express,
    each as ``key=value (what would be valid)``; empty when there are none."""
    model_type = hf.get("model_type")
    found = []
    for enc, dec in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if hf.get(enc) != hf.get(dec):
            found.append(f"{enc}={hf.get(enc)} but {dec}={hf.get(dec)} (one value for both stacks)")
    act = hf.get("activation_function", "gelu")
    if act not in FROM_HF_ACTIVATION:
        found.append(f"activation_function={act!r} (valid: {sorted(FROM_HF_ACTIVATION)})")
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if float(hf.get(key) or 0.0) > 0:
            found.append(f"{key}={hf[key]} (not part of TransformerConfig; valid: 0.0)")
    if hf.get("tie_word_embeddings", True) is not True:
        found.append(
            f"tie_word_embeddings={hf['tie_word_embeddings']!r} (valid: true: one table for "
            "both stacks and the output)"
        )
    for key, value in _legacy_keys(model_type).items():
        if key in hf and hf[key] != value:
            found.append(f"{key}={hf[key]!r} (model_type {model_type!r}: {value!r} or absent)")
    return found


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face BART or mBART ``config.json`` (a dict).

    ``unk_id``: the vocabulary's ``<unk>`` (None: 3, fairseq's). The decoder start is
    ``decoder_start_token_id``, else ``bos_token_id`` (what transformers' generate uses then).

    Raises:
      ValueError: not a BART/mBART config, or one this architecture cannot express (every
        such key named, see ``hf_problems``).
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json has model_type {model_type!r}; this module reads BART and mBART "
            f"(model_type {' / '.join(map(repr, MODEL_TYPES))})"
        )
    found = hf_problems(hf)
    if found:
        raise ValueError(
            f"config.json (model_type {model_type!r}) has what TransformerConfig cannot "
            "express: " + "; ".join(found)
        )
    start = hf.get("decoder_start_token_id")
    if start is None:
        start = _required(hf, "bos_token_id")
    return TransformerConfig(
        vocab_size=_required(hf, "vocab_size"),
        d_model=_required(hf, "d_model"),
        num_heads=_required(hf, "encoder_attention_heads"),
        d_ff=_required(hf, "encoder_ffn_dim"),
        num_encoder_layers=_required(hf, "encoder_layers"),
        num_decoder_layers=_required(hf, "decoder_layers"),
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        activation_dropout_rate=float(hf.get("activation_dropout") or 0.0),
        max_len=_required(hf, "max_position_embeddings"),
        activation=FROM_HF_ACTIVATION[hf.get("activation_function", "gelu")],
        norm_position="pre" if model_type == "mbart" else "post",
        norm_type="layernorm",
        layer_norm_epsilon=LAYER_NORM_EPSILON,
        position="learned",
        learned_position_offset=POSITION_OFFSET,
        embedding_norm=True,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        share_embeddings=True,
        tie_output_embedding=True,
        logits_bias=True,
        use_bias=True,
        pad_id=_required(hf, "pad_token_id"),
        bos_id=start,
        eos_id=_required(hf, "eos_token_id"),
        unk_id=FAIRSEQ_UNK if unk_id is None else unk_id,
    )


# What save_pretrained does with each TransformerConfig field, as marian's comment says for
# Marian: written: vocab_size, d_model, num_heads, d_ff, num_*_layers, dropout_rate,
# attention_dropout_rate, activation_dropout_rate, max_len, activation, norm_position (which
# model_type), scale_embeddings, pad_id, bos_id, eos_id (logits_bias=False: a zero
# final_logits_bias);
# refused unless BART's value (``problems``): target_vocab_size, share_embeddings,
# tie_output_embedding, num_kv_heads, head_dim, norm_type, layer_norm_epsilon, position,
# learned_position_offset, embedding_norm, use_bias, fused_qkv, num_experts, attention_window,
# quantization (unless ``dequantize``), T5's scale_attention_logits and scale_decoder_output;
# irrelevant: the rest (Marian's irrelevant fields).
def problems(config: TransformerConfig, *, dequantize: bool = False) -> list[str]:
    """What keeps ``config`` from being written as a BART/mBART model (empty when nothing)."""
    wanted = {
        "norm_type": "layernorm",
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "position": "learned",
        "learned_position_offset": POSITION_OFFSET,
        "embedding_norm": True,
        "share_embeddings": True,
        "tie_output_embedding": True,
        "target_vocab_size": None,
        "use_bias": True,
        "fused_qkv": False,
        "attention_window": None,
        "scale_attention_logits": True,
        "scale_decoder_output": False,
    }
    found = fields.differences(
        config, "BART", wanted, activations=TO_HF_ACTIVATION, dequantize=dequantize
    )
    if config.kv_heads != config.num_heads:
        found.append(f"num_kv_heads={config.num_kv_heads} (BART: multi-head, None)")
    if config.effective_head_dim * config.num_heads != config.d_model:
        found.append(
            f"head_dim={config.head_dim} (BART: d_model / num_heads = "
            f"{config.d_model / config.num_heads:g}, or None)"
        )
    return found


def model_type_of(config: TransformerConfig) -> str:
    """The model_type of ``config``: "mbart" when pre-LN, "bart" when post-LN."""
    return "mbart" if config.norm_position == "pre" else "bart"


def config_to_hf(config: TransformerConfig, *, dequantize: bool = False) -> dict[str, Any]:
    """The BART (post-LN) or mBART (pre-LN) ``config.json`` dict of ``config``.

    Raises:
      ValueError: ``config`` is not a BART architecture, listing every field that differs.
    """
    differences = problems(config, dequantize=dequantize)
    if differences:
        raise ValueError(
            "save_pretrained writes BART/mBART models; this TransformerConfig differs in: "
            + "; ".join(differences)
        )
    model_type = model_type_of(config)
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": True,
        "d_model": config.d_model,
        "encoder_layers": config.num_encoder_layers,
        "decoder_layers": config.num_decoder_layers,
        "encoder_attention_heads": config.num_heads,
        "decoder_attention_heads": config.num_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": TO_HF_ACTIVATION[config.activation],
        "dropout": config.dropout_rate,
        "attention_dropout": config.attention_dropout_rate,
        "activation_dropout": config.activation_dropout_rate,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "forced_eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "is_encoder_decoder": True,
        "use_cache": True,
        **_legacy_keys(model_type),
    }


# ----------------------------------------------------------------------------- parameters


def tensors(config: TransformerConfig) -> list[Tensor]:
    """The name map of a BART/mBART model of ``config`` (see the module docstring)."""
    d, vocab = config.d_model, config.vocab_size
    rows = [
        row
        for row in marian.tensors(config)
        if not row.ours.startswith(("source_embedding", "target_embedding"))
    ]
    for stack in ("encoder", "decoder"):
        hf, ours = f"model.{stack}", f"{stack}/embedder"
        rows.append(
            Tensor(
                (f"{hf}.embed_positions.weight",),
                f"{ours}/positions/embedding",
                (config.learned_position_offset + config.max_len, d),
            )
        )
        rows += naming.norm(f"{hf}.layernorm_embedding", f"{ours}/embedding_norm", d)
        if config.norm_position == "pre":
            rows += naming.norm(f"{hf}.layer_norm", f"{stack}/final_norm", d)
    names = ("model.shared.weight", "model.encoder.embed_tokens.weight")
    names += ("model.decoder.embed_tokens.weight", "lm_head.weight")
    rows.append(Tensor(names, "source_embedding/embedding", (vocab, d)))
    return rows


def _strip_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys as ``model.*`` / ``lm_head.*`` / ``final_logits_bias`` whatever the checkpoint's
    prefix (a base ``BartModel`` has no ``model.``)."""
    out = {}
    for key, value in naming.strip_prefixes(state, ("module.",)).items():
        if key.startswith(("encoder.", "decoder.", "shared.")):
            key = "model." + key
        out[key] = value
    return out


def params_from_state_dict(state: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
    """Our ``params`` (nested dicts of float32 NumPy arrays, unrolled layers) from a BART or
    mBART state dict.

    Raises:
      ValueError: a tensor the config needs is missing or has another shape (named), or
        tensors are left over that this mapping does not know (named).
    """
    state = _strip_prefix(state)
    if "final_logits_bias" not in state:  # a checkpoint without one has a zero bias
        state["final_logits_bias"] = np.zeros((1, config.vocab_size), np.float32)
    tied = {
        "model.shared.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "lm_head.weight",
    }
    # fairseq's checkpoints carry a version buffer per stack; transformers ignores it too.
    ignored = tied | {"model.encoder.version", "model.decoder.version"}
    return naming.params_from_state(state, tensors(config), ignore=ignored, family=NAME)


def state_dict_from_params(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The BART/mBART state dict of plain, unrolled float parameters (``hf.plain_params``),
    the inverse of ``params_from_state_dict``; the tied copies are not stored (as
    transformers' own save_pretrained)."""
    params = dict(params)
    decoder = dict(params["decoder"])
    if decoder.get("logits_bias") is None:
        decoder["logits_bias"] = np.zeros((config.vocab_size,), np.float32)
    params["decoder"] = decoder
    return naming.state_from_params(params, tensors(config))


# ----------------------------------------------------------------------------- generation


generation_ids = fields.seq2seq_generation_ids  # the special ids generation_config.json names


def default_generation(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json`` when none is given: the ids and the forced EOS
    (transformers' defaults for the rest: greedy, 20 tokens)."""
    return {**generation_ids(config), "forced_eos_token_id": config.eos_id}


# ----------------------------------------------------------------------------- tokenizer


def _model_type_in(root: epath.Path) -> str | None:
    """The model_type of a Hugging Face folder (its ``config.json``) or of a train.py workdir
    (its ``model_config.json``: pre-LN is mBART); None when neither is there."""
    config_path = root / "config.json"
    if config_path.is_file():
        model_type = json.loads(config_path.read_text()).get("model_type")
        if model_type is not None:
            return model_type
    # A workdir's config.json is train.py's run config, without a model_type.
    workdir_config = root / "model_config.json"
    if workdir_config.is_file():
        return model_type_of(TransformerConfig.from_json(workdir_config.read_text()))
    return None


def load_tokenizer(root: epath.Path) -> Any:
    """The tokenizer in ``root`` (``data.hf_tokenizers``: BART's byte-level BPE, mBART's
    SentencePiece, or a ``tokenizer.json``), or None when its files are absent."""
    model_type = _model_type_in(root)
    if model_type not in MODEL_TYPES:
        return None
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    return load_hf_tokenizer(str(root), model_type)
