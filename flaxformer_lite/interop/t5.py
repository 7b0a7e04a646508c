"""Hugging Face T5 (T5 v1.0, T5 v1.1 / Flan-T5): config, parameter names and tokenizer.

Every T5 choice is a ``TransformerConfig`` field, not a special case here: pre-LN
(``norm_position="pre"``) with T5's RMS norm (``norm_type="rmsnorm"``: no mean, no bias,
epsilon ``layer_norm_epsilon``) and final encoder/decoder norms; no biases (``use_bias=False``);
no position embeddings but the bucketed relative bias (``position="relative"``: one table per
stack, computed once and shared by its layers, bidirectional in the encoder, causal in the
decoder, none on cross-attention); unscaled embeddings; attention logits q.k without
1/sqrt(d_kv) (``scale_attention_logits=False``); heads ``d_kv`` wide (``head_dim`` when
d_kv * num_heads != d_model). T5 v1.0 (``feed_forward_proj="relu"``) ties the output to the
shared embedding and scales the decoder output by d_model**-0.5 first
(``scale_decoder_output``); v1.1 / Flan-T5 (``"gated-gelu"``: tanh GELU of ``wi_0`` times
``wi_1``, our ``"geglu"``'s ``wi`` and ``wi_up``) has its own ``lm_head`` and no scaling.
Special ids: pad = decoder start = 0, EOS 1, UNK 2.

Parameter names (``tensors``; ``naming`` applies the PyTorch layouts)::

    shared (= {en,de}coder.embed_tokens; = lm_head when tied)  ->  source_embedding
    lm_head (untied)                                          ->  decoder/logits (transposed)
    {en,de}coder.block.0.layer.0.SelfAttention.relative_attention_bias
                                                              ->  {en,de}coder/relative_bias
    {en,de}coder.block.i.layer.0.SelfAttention.{q,k,v,o}      ->  .../layers_i/self_attention/*
    {en,de}coder.block.i.layer.0.layer_norm                   ->  .../self_attention_norm
    decoder.block.i.layer.1.EncDecAttention.{q,k,v,o}         ->  .../cross_attention/*
    decoder.block.i.layer.1.layer_norm                        ->  .../cross_attention_norm
    *.layer.-1.DenseReluDense.{wi | wi_0, wi_1; wo}           ->  .../mlp/{wi | wi, wi_up; wo}
    *.layer.-1.layer_norm                                     ->  .../mlp_norm
    {en,de}coder.final_layer_norm                             ->  {en,de}coder/final_norm

Whether ``lm_head`` is tied is the checkpoint's to say: transformers 5 writes
``tie_word_embeddings: true`` for every T5 (its ``scale_decoder_outputs`` keeps v1.1's "no
scaling") and stores ``lm_head.weight`` only when it differs from ``shared.weight``; so a
stored ``lm_head.weight`` unlike ``shared.weight`` unties it (``config_from_state``), as
transformers itself loads it. T5's one ``dropout_rate`` is our residual, attention and
feed-forward (``activation_dropout_rate``) dropout, as T5 applies it in training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.interop import fields, naming
from flaxformer_lite.interop.naming import Tensor
from flaxformer_lite.nn.config import TransformerConfig

NAME = "T5"
MODEL_TYPES = ("t5",)
DECODER_ONLY = False

Params = dict[str, Any]

# ``feed_forward_proj`` -> ``TransformerConfig.activation``. transformers reads "gated-gelu" as
# gated ``gelu_new`` (the tanh approximation, our "gelu"/"geglu"); a plain "gelu" is the erf one.
FROM_HF_FEED_FORWARD = {
    "relu": "relu",
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "silu": "silu",
    "swish": "silu",
    "gated-gelu": "geglu",
    "gated-gelu_new": "geglu",
    "gated-gelu_pytorch_tanh": "geglu",
    "gated-silu": "swiglu",
    "gated-swish": "swiglu",
}
TO_HF_FEED_FORWARD = {
    "relu": "relu",
    "gelu_exact": "gelu",
    "gelu": "gelu_new",
    "silu": "silu",
    "geglu": "gated-gelu",
    "swiglu": "gated-silu",
}
DEFAULT_UNK_ID = 2  # T5's SentencePiece vocabulary: <pad> 0, </s> 1, <unk> 2

# config.json keys whose non-default value changes the model in a way T5's mapping cannot
# express: key -> (the values accepted, what it would mean).
_REFUSED_VALUES = {
    "is_encoder_decoder": ((True, None), "a T5 model is an encoder-decoder"),
    "is_decoder": ((False, None), "a decoder alone (T5's stack) is not a T5 model here"),
    "tie_encoder_decoder": ((False, None), "the encoder's and decoder's weights tied"),
    "pruned_heads": (({}, None), "heads pruned from some layers"),
    "add_cross_attention": ((False, None), "an extra cross-attention"),
    "quantization_config": ((None,), "quantized weights (bitsandbytes, GPTQ ...)"),
}


# ----------------------------------------------------------------------------- configs


def _required(hf: Mapping[str, Any], key: str) -> Any:
    value = hf.get(key)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which a T5 model needs")
    return value


def _single_id(hf: Mapping[str, Any], key: str, default: int) -> int:
    value = hf.get(key, default)
    if value is None:
        return default
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(
                f"config.json has {key}={value}: a T5 model here takes one id there (a list of "
                "one, or an integer)"
            )
        value = value[0]
    return int(value)


def refusals(hf: Mapping[str, Any]) -> list[str]:
    """Each ``config.json`` key with a value this mapping cannot express, as one phrase
    (``key=value (valid: ...)``); empty for a supported T5 config."""
    found = []
    for key, (valid, meaning) in _REFUSED_VALUES.items():
        if key in hf and hf[key] not in valid:
            found.append(f"{key}={hf[key]!r} ({meaning}; valid: {' or '.join(map(repr, valid))})")
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FROM_HF_FEED_FORWARD:
        found.append(f"feed_forward_proj={proj!r} (valid: {sorted(FROM_HF_FEED_FORWARD)})")
    buckets = hf.get("relative_attention_num_buckets", 32)
    if not isinstance(buckets, int) or buckets < 4 or buckets % 2:
        found.append(f"relative_attention_num_buckets={buckets!r} (valid: an even number >= 4)")
    else:
        distance = hf.get("relative_attention_max_distance", 128)
        if not isinstance(distance, int) or distance <= buckets // 2:
            found.append(
                f"relative_attention_max_distance={distance!r} (valid: an integer more than "
                f"relative_attention_num_buckets // 2 = {buckets // 2})"
            )
    return found


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face T5 ``config.json`` (a dict).

    ``unk_id`` comes from the vocabulary (``<unk>``, 2 in T5's, the default for None). Whether
    ``lm_head`` is tied follows ``tie_word_embeddings`` here; ``config_from_state`` corrects it
    from the weights (see the module docstring). The output scaling is
    ``scale_decoder_outputs`` where config.json has it (transformers 5), else
    ``tie_word_embeddings`` (transformers 4: v1.0 tied and scaled, v1.1 neither).

    Raises:
      ValueError: not a T5 config, a missing size, or keys this mapping cannot express (each
        named with its valid values, all in one line).
    """
    if hf.get("model_type") != "t5":
        raise ValueError(
            f"config.json has model_type {hf.get('model_type')!r}; the T5 family reads "
            "model_type 't5' (t5-small, google/t5-v1_1-*, google/flan-t5-*)"
        )
    found = refusals(hf)
    if found:
        raise ValueError("config.json is not a T5 model this library runs: " + "; ".join(found))
    d_model, heads = _required(hf, "d_model"), _required(hf, "num_heads")
    d_kv = hf.get("d_kv", 64)
    layers = _required(hf, "num_layers")
    tied = hf.get("tie_word_embeddings", True) is not False
    scale = hf.get("scale_decoder_outputs")
    pad = _single_id(hf, "pad_token_id", 0)
    rate = float(hf.get("dropout_rate", 0.1))
    return TransformerConfig(
        vocab_size=_required(hf, "vocab_size"),
        d_model=d_model,
        num_heads=heads,
        head_dim=None if d_kv * heads == d_model else d_kv,
        d_ff=_required(hf, "d_ff"),
        num_encoder_layers=layers,
        num_decoder_layers=hf.get("num_decoder_layers") or layers,
        dropout_rate=rate,
        attention_dropout_rate=rate,  # T5 drops attention weights at the same rate,
        activation_dropout_rate=rate,  # and the feed-forward hidden units
        max_len=int(hf.get("n_positions") or 512),  # a hint only: relative positions
        activation=FROM_HF_FEED_FORWARD[hf.get("feed_forward_proj", "relu")],
        norm_position="pre",
        norm_type="rmsnorm",
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-6)),
        position="relative",
        relative_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        scale_embeddings=False,
        share_embeddings=True,
        tie_output_embedding=tied,
        logits_bias=False,
        use_bias=False,
        scale_attention_logits=False,
        scale_decoder_output=tied if scale is None else bool(scale),
        pad_id=pad,
        bos_id=_single_id(hf, "decoder_start_token_id", pad),
        eos_id=_single_id(hf, "eos_token_id", 1),
        unk_id=DEFAULT_UNK_ID if unk_id is None else unk_id,
    )


def config_from_state(
    config: TransformerConfig, state: Mapping[str, np.ndarray]
) -> TransformerConfig:
    """``config`` with ``tie_output_embedding`` as the weights have it: a stored
    ``lm_head.weight`` unlike ``shared.weight`` is a separate output kernel (transformers 5
    writes ``tie_word_embeddings: true`` for every T5 and loads such a pair untied); one equal
    to it, or none, is the tied table."""
    state = _strip_prefix(state)
    head, shared = state.get("lm_head.weight"), state.get("shared.weight")
    if head is None:
        return config.replace(tie_output_embedding=True) if shared is not None else config
    untied = shared is None or head.shape != shared.shape or not np.array_equal(head, shared)
    return config.replace(tie_output_embedding=not untied)


# What save_pretrained does with each TransformerConfig field for T5:
# - written to config.json: vocab_size, d_model, num_heads, head_dim (d_kv), d_ff,
#   num_encoder_layers, num_decoder_layers, dropout_rate, max_len (n_positions), activation
#   (feed_forward_proj), layer_norm_epsilon, relative_num_buckets, relative_max_distance,
#   tie_output_embedding, scale_decoder_output, pad_id, bos_id, eos_id;
# - refused where T5 cannot express the value (``problems``): target_vocab_size,
#   num_kv_heads, norm_position, norm_type, position, scale_embeddings, share_embeddings,
#   logits_bias, use_bias, qkv_bias, embedding_norm, fused_qkv, num_experts,
#   attention_window, scale_attention_logits, quantization (unless ``dequantize``);
# - irrelevant: attention_dropout_rate and activation_dropout_rate (T5 has one rate,
#   dropout_rate's, for all three; training only), learned_position_offset (learned
#   positions are refused), dtype, param_dtype, attention_implementation, remat, scan_layers,
#   num_classes, pooling, unk_id, sinusoid_layout (no sinusoids), the MoE sizes and weights,
#   attention_window_layers, the Llama family's rope_* (rotary only, which is refused),
#   word_dropout_rate (training only), int8_kernel (the same integer products either way).
def problems(config: TransformerConfig, *, dequantize: bool = False) -> list[str]:
    """What keeps ``config`` from being written as a T5 model (empty when nothing)."""
    wanted = {
        "norm_position": "pre",
        "norm_type": "rmsnorm",
        "position": "relative",
        "scale_embeddings": False,
        "share_embeddings": True,
        "target_vocab_size": None,
        "logits_bias": False,
        "use_bias": False,
        "fused_qkv": False,
        "attention_window": None,
        "scale_attention_logits": False,
        "num_kv_heads": None,
        "qkv_bias": False,
        "embedding_norm": False,
    }
    return fields.differences(
        config, "T5", wanted, activations=TO_HF_FEED_FORWARD, dequantize=dequantize
    )


def config_to_hf(config: TransformerConfig, *, dequantize: bool = False) -> dict[str, Any]:
    """The T5 ``config.json`` dict of ``config``: both conventions for the output scaling
    (``tie_word_embeddings`` for transformers 4 and CTranslate2, ``scale_decoder_outputs`` for
    transformers 5), which agree for T5 v1.0 (tied, scaled) and v1.1 (untied, unscaled).

    Raises:
      ValueError: ``config`` is not a T5 architecture, listing every field that differs.
    """
    differences = problems(config, dequantize=dequantize)
    if differences:
        raise ValueError(
            "save_pretrained writes T5 models; this TransformerConfig differs in: "
            + "; ".join(differences)
        )
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": config.vocab_size,
        "d_model": config.d_model,
        "d_kv": config.effective_head_dim,
        "d_ff": config.d_ff,
        "num_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_num_buckets,
        "relative_attention_max_distance": config.relative_max_distance,
        "dropout_rate": config.dropout_rate,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "feed_forward_proj": TO_HF_FEED_FORWARD[config.activation],
        "n_positions": config.max_len,
        "tie_word_embeddings": config.tie_output_embedding,
        "scale_decoder_outputs": config.scale_decoder_output,
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "is_encoder_decoder": True,
        "use_cache": True,
    }


# ----------------------------------------------------------------------------- parameters


def _attention_rows(hf_prefix: str, ours: str, config: TransformerConfig) -> list[Tensor]:
    d, h, hd = config.d_model, config.num_heads, config.effective_head_dim
    rows = []
    for proj, our_proj in (("q", "query"), ("k", "key"), ("v", "value")):
        rows += naming.linear(f"{hf_prefix}.{proj}", f"{ours}/{our_proj}", (d, h, hd), bias=False)
    rows += naming.linear(f"{hf_prefix}.o", f"{ours}/out", (h, hd, d), in_axes=2, bias=False)
    return rows


def _feed_forward_rows(hf_prefix: str, ours: str, config: TransformerConfig) -> list[Tensor]:
    d, ff = config.d_model, config.d_ff
    if config.activation in ("geglu", "swiglu"):  # act(wi_0 x) * wi_1 x
        inputs = [("wi_0", "wi"), ("wi_1", "wi_up")]
    else:
        inputs = [("wi", "wi")]
    rows = []
    for hf_name, our_name in inputs:
        rows += naming.linear(f"{hf_prefix}.{hf_name}", f"{ours}/{our_name}", (d, ff), bias=False)
    return rows + naming.linear(f"{hf_prefix}.wo", f"{ours}/wo", (ff, d), bias=False)


def tensors(config: TransformerConfig) -> list[Tensor]:
    """The name map of a T5 model of ``config`` (see the module docstring)."""
    d = config.d_model
    rows: list[Tensor] = []
    for stack, layers in (
        ("encoder", config.num_encoder_layers),
        ("decoder", config.num_decoder_layers),
    ):
        rows.append(
            Tensor(
                (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",),
                f"{stack}/relative_bias/embedding",
                (config.relative_num_buckets, config.num_heads),
            )
        )
        for i in range(layers):
            block, ours = f"{stack}.block.{i}.layer", f"{stack}/layers_{i}"
            rows += _attention_rows(f"{block}.0.SelfAttention", f"{ours}/self_attention", config)
            rows += naming.norm(
                f"{block}.0.layer_norm", f"{ours}/self_attention_norm", d, bias=False
            )
            ff = 1
            if stack == "decoder":
                rows += _attention_rows(
                    f"{block}.1.EncDecAttention", f"{ours}/cross_attention", config
                )
                rows += naming.norm(
                    f"{block}.1.layer_norm", f"{ours}/cross_attention_norm", d, bias=False
                )
                ff = 2
            rows += _feed_forward_rows(f"{block}.{ff}.DenseReluDense", f"{ours}/mlp", config)
            rows += naming.norm(f"{block}.{ff}.layer_norm", f"{ours}/mlp_norm", d, bias=False)
        rows += naming.norm(f"{stack}.final_layer_norm", f"{stack}/final_norm", d, bias=False)
    names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    names += ("lm_head.weight",) if config.tie_output_embedding else ()
    rows.append(Tensor(names, "source_embedding/embedding", (config.vocab_size, d)))
    if not config.tie_output_embedding:
        rows.append(
            Tensor(("lm_head.weight",), "decoder/logits/kernel", (d, config.vocab_size), in_axes=1)
        )
    return rows


def _strip_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys as ``shared.*`` / ``encoder.*`` / ``decoder.*`` / ``lm_head.*`` (some checkpoints
    store ``transformer.`` or ``module.`` before them)."""
    return naming.strip_prefixes(state, ("module.", "transformer."))


def params_from_state_dict(state: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
    """Our ``params`` (nested dicts of float32 NumPy arrays, unrolled layers) from a T5 state
    dict (names -> arrays, as in ``model.safetensors``).

    Raises:
      ValueError: a tensor the config needs is missing or has another shape (named), tensors
        are left over that this mapping does not know (named), or ``lm_head.weight`` differs
        from ``shared.weight`` under a tied config (``config_from_state`` unties it).
    """
    state = _strip_prefix(state)
    # The tied copies carry nothing new; old checkpoints also store an unused relative bias
    # for the first cross-attention (transformers ignores it too).
    redundant = {
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
    }
    if config.tie_output_embedding:
        head, shared = state.get("lm_head.weight"), state.get("shared.weight")
        if head is not None and shared is not None and not np.array_equal(head, shared):
            raise ValueError(
                "lm_head.weight differs from shared.weight but the config ties them "
                "(tie_output_embedding=True): load with hf.load_pretrained, which unties them "
                "(t5.config_from_state)"
            )
        redundant.add("lm_head.weight")
    return naming.params_from_state(state, tensors(config), ignore=redundant, family=NAME)


def state_dict_from_params(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The T5 state dict of plain, unrolled float parameters (``hf.plain_params``), the
    inverse of ``params_from_state_dict``: ``shared.weight`` once (transformers ties the
    encoder's and decoder's tables, and ``lm_head`` when tied, to it), ``lm_head.weight``
    when untied."""
    return naming.state_from_params(params, tensors(config))


# ----------------------------------------------------------------------------- generation


generation_ids = fields.seq2seq_generation_ids  # the special ids generation_config.json names


def default_generation(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json`` when none is given: the ids, as transformers derives it from
    a T5 model config (greedy, 20 tokens; no forced tokens)."""
    return generation_ids(config)


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(root: epath.Path) -> Any:
    """The T5 tokenizer in ``root`` (``tokenizer.json`` or ``spiece.model``, read by
    ``data.hf_tokenizers``), or None when the folder has no tokenizer files."""
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    return load_hf_tokenizer(str(root), "t5")
