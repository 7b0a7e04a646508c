"""Hugging Face Marian (opus-mt): config, parameter names and tokenizer.

A Marian model is the paper's Transformer with a few choices of its own, each a
``TransformerConfig`` field rather than a special case here: swish (``activation="silu"``), the
sinusoids as sine and cosine halves (``sinusoid_layout="halves"``), embeddings scaled or not
(``scale_embeddings``), a final logits bias (``logits_bias``), LayerNorm epsilon 1e-5, tied or
separate embeddings, and its own special ids (pad = decoder start = the last id, EOS 0, UNK 1).
Parameter names map one to one (``tensors``; ``naming`` applies the PyTorch layouts)::

    model.{en,de}coder.layers.i.self_attn.{q,k,v}_proj  ->  .../layers_i/self_attention/{query,...}
    model.{en,de}coder.layers.i.self_attn.out_proj      ->  .../layers_i/self_attention/out
    model.decoder.layers.i.encoder_attn.*               ->  decoder/layers_i/cross_attention/*
    *.self_attn_layer_norm, *.encoder_attn_layer_norm   ->  {self,cross}_attention_norm
    *.fc1 / fc2 / final_layer_norm                      ->  mlp/wi / mlp/wo / mlp_norm
    model.shared (all tied; else encoder.embed_tokens)  ->  source_embedding
    model.decoder.embed_tokens (not all tied)           ->  target_embedding
    lm_head (untied)                                    ->  decoder/logits (transposed)
    final_logits_bias `[1, vocab]`                      ->  decoder/logits_bias `[vocab]`

Marian's sinusoidal position tables are not parameters here (a checkpoint that stores one is
checked against ours).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.interop import fields, naming
from flaxformer_lite.interop.naming import Tensor
from flaxformer_lite.nn.config import TransformerConfig

NAME = "Marian"
MODEL_TYPES = ("marian",)
DECODER_ONLY = False
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")

Params = dict[str, Any]

# Hugging Face ``activation_function`` -> ``TransformerConfig.activation``, and back.
FROM_HF_ACTIVATION = {
    "swish": "silu",
    "silu": "silu",
    "relu": "relu",
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
}
TO_HF_ACTIVATION = {"silu": "swish", "relu": "relu", "gelu_exact": "gelu", "gelu": "gelu_new"}


# ----------------------------------------------------------------------------- configs


def _hf_int(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which a Marian model needs")
    return value


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face Marian ``config.json`` (a dict).

    ``unk_id`` comes from the vocabulary (``<unk>``, 1 in every Marian vocabulary, the default
    for None), which the model config does not record.

    Raises:
      ValueError: not a Marian config, or one this architecture cannot express (different
        encoder/decoder widths or head counts, an unknown activation), naming the key.
    """
    model_type = hf.get("model_type")
    if model_type != "marian":
        raise ValueError(
            f"config.json has model_type {model_type!r}; load_pretrained reads Marian "
            "(model_type 'marian', e.g. Helsinki-NLP/opus-mt-*) checkpoints"
        )
    for enc, dec in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if hf.get(enc) != hf.get(dec):
            raise ValueError(
                f"config.json has {enc}={hf.get(enc)} but {dec}={hf.get(dec)}; "
                "TransformerConfig has one value for both stacks"
            )
    act = hf.get("activation_function", "gelu")
    if act not in FROM_HF_ACTIVATION:
        raise ValueError(
            f"config.json activation_function {act!r} is not supported; "
            f"valid: {sorted(FROM_HF_ACTIVATION)}"
        )
    vocab = _hf_int(hf, "vocab_size")
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    tied = bool(hf.get("tie_word_embeddings", True))
    target_vocab = hf.get("decoder_vocab_size") or vocab
    # transformers 5: tie_word_embeddings=False unties everything, even with shared
    # embeddings: the encoder's and decoder's embed_tokens and lm_head are three tensors (the
    # model's ``shared`` is then unused). That is our separate tables with one vocabulary.
    if shared and not tied and target_vocab != vocab:
        raise ValueError(
            f"config.json has share_encoder_decoder_embeddings=True, tie_word_embeddings=False "
            f"and decoder_vocab_size={target_vocab} != vocab_size={vocab}: the decoder's "
            "embedding and lm_head would have different vocabularies; a Marian model has "
            "decoder_vocab_size equal to vocab_size (or null) there"
        )
    pad = _hf_int(hf, "pad_token_id")
    return TransformerConfig(
        vocab_size=vocab,
        target_vocab_size=None if shared else target_vocab,
        d_model=_hf_int(hf, "d_model"),
        num_heads=_hf_int(hf, "encoder_attention_heads"),
        d_ff=_hf_int(hf, "encoder_ffn_dim"),
        num_encoder_layers=_hf_int(hf, "encoder_layers"),
        num_decoder_layers=_hf_int(hf, "decoder_layers"),
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        activation_dropout_rate=float(hf.get("activation_dropout") or 0.0),
        max_len=_hf_int(hf, "max_position_embeddings"),
        activation=FROM_HF_ACTIVATION[act],
        norm_position="post",
        norm_type="layernorm",
        layer_norm_epsilon=1e-5,  # torch.nn.LayerNorm's default, which Marian keeps
        position="sinusoidal",
        sinusoid_layout="halves",
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        share_embeddings=shared and tied,
        tie_output_embedding=tied,
        logits_bias=True,
        use_bias=True,
        pad_id=pad,
        bos_id=hf.get("decoder_start_token_id", pad),
        eos_id=_hf_int(hf, "eos_token_id"),
        unk_id=1 if unk_id is None else unk_id,
    )


# What save_pretrained does with each TransformerConfig field (tests/interop/test_hf_marian.py walks
# every field of the dataclass against its own copy of this classification):
# - written to config.json: vocab_size, target_vocab_size, d_model, num_heads, d_ff,
#   num_encoder_layers, num_decoder_layers, dropout_rate, attention_dropout_rate,
#   activation_dropout_rate, max_len,
#   activation, scale_embeddings, share_embeddings, tie_output_embedding, pad_id, bos_id,
#   eos_id; logits_bias=False is written as a zero final_logits_bias;
# - refused where Marian cannot express the value (``problems``): num_kv_heads,
#   head_dim, activation (gated), norm_position, norm_type, layer_norm_epsilon, position,
#   sinusoid_layout, use_bias, fused_qkv, num_experts (with moe_every), attention_window,
#   quantization (unless ``dequantize``), learned_position_offset, embedding_norm,
#   scale_attention_logits, scale_decoder_output;
# - irrelevant to the saved model (precision, memory, layout, training or the classifier
#   head, or inert because a refused field is off): dtype, param_dtype,
#   attention_implementation, remat, scan_layers, num_classes, pooling, unk_id (the
#   vocabulary's), num_experts_per_token, expert_capacity_factor, moe_aux_loss_weight,
#   router_z_loss_weight, attention_window_layers, relative_num_buckets,
#   relative_max_distance; the Llama family's rope_theta, rope_scaling_factor,
#   rope_low_freq_factor, rope_high_freq_factor, rope_original_max_len (rotary only, which
#   is refused) and qkv_bias (inert: Marian has use_bias=True); word_dropout_rate (training
#   only; Marian's config has no field for it); int8_kernel (what multiplies int8 weights,
#   the same integer products either way).
MARIAN_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default; MarianConfig has no field


def problems(config: TransformerConfig, *, dequantize: bool = False) -> list[str]:
    """What keeps ``config`` from being written as a Marian model (empty when nothing)."""
    wanted = {
        "norm_position": "post",
        "norm_type": "layernorm",
        "position": "sinusoidal",
        "sinusoid_layout": "halves",
        "use_bias": True,
        "fused_qkv": False,
        "layer_norm_epsilon": MARIAN_LAYER_NORM_EPSILON,
        "attention_window": None,
        "learned_position_offset": 0,
        "embedding_norm": False,
        "scale_attention_logits": True,
        "scale_decoder_output": False,
    }
    found = fields.differences(
        config, "Marian", wanted, activations=TO_HF_ACTIVATION, dequantize=dequantize
    )
    if config.kv_heads != config.num_heads:
        found.append(f"num_kv_heads={config.num_kv_heads} (Marian: multi-head, None)")
    if config.effective_head_dim * config.num_heads != config.d_model:
        found.append(
            f"head_dim={config.head_dim} (Marian: d_model / num_heads = "
            f"{config.d_model / config.num_heads:g}, or None)"
        )
    return found


def _hf_shared(config: TransformerConfig) -> bool:
    """Marian's ``share_encoder_decoder_embeddings`` for ``config``: True for one table, and
    for separate tables of one vocabulary with an untied output (transformers 5 unties all
    three tables then; ``config_from_hf`` reads that back as separate tables)."""
    if config.share_embeddings:
        return True
    return not config.tie_output_embedding and config.target_vocab_size is None


def config_to_hf(config: TransformerConfig, *, dequantize: bool = False) -> dict[str, Any]:
    """The Marian ``config.json`` dict of ``config``.

    ``dequantize``: accept ``quantization="int8"`` (the weights are then written as float32;
    see ``save_pretrained``).

    Raises:
      ValueError: ``config`` is not a Marian architecture (e.g. pre-LN, rotary, interleaved
        sinusoids, grouped-query attention, LayerNorm epsilon other than 1e-5, a local
        attention window, mixture-of-experts layers, int8 weights), listing every field that
        differs.
    """
    differences = problems(config, dequantize=dequantize)
    if differences:
        raise ValueError(
            "save_pretrained writes Marian models; this TransformerConfig differs in: "
            + "; ".join(differences)
        )
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": config.vocab_size,
        "decoder_vocab_size": config.output_vocab_size,
        "share_encoder_decoder_embeddings": _hf_shared(config),
        "tie_word_embeddings": config.tie_output_embedding,
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
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "forced_eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "is_encoder_decoder": True,
        "use_cache": True,
    }


# ----------------------------------------------------------------------------- parameters


def _layer_modules(stack: str) -> list[tuple[str, str]]:
    """(HF module, our module) pairs inside one layer of ``stack``."""
    pairs = [("self_attn", "self_attention"), ("self_attn_layer_norm", "self_attention_norm")]
    if stack == "decoder":
        pairs += [
            ("encoder_attn", "cross_attention"),
            ("encoder_attn_layer_norm", "cross_attention_norm"),
        ]
    pairs += [("fc1", "mlp/wi"), ("fc2", "mlp/wo"), ("final_layer_norm", "mlp_norm")]
    return pairs


def tensors(config: TransformerConfig) -> list[Tensor]:
    """The name map of a Marian model of ``config`` (see the module docstring)."""
    d, h, hd, ff = config.d_model, config.num_heads, config.effective_head_dim, config.d_ff
    rows: list[Tensor] = []
    for stack, layers in (
        ("encoder", config.num_encoder_layers),
        ("decoder", config.num_decoder_layers),
    ):
        for i in range(layers):
            for hf_module, ours in _layer_modules(stack):
                hf_name = f"model.{stack}.layers.{i}.{hf_module}"
                our_name = f"{stack}/layers_{i}/{ours}"
                if hf_module.endswith("attn"):
                    for proj, our_proj in (
                        ("q_proj", "query"),
                        ("k_proj", "key"),
                        ("v_proj", "value"),
                    ):
                        rows += naming.linear(
                            f"{hf_name}.{proj}", f"{our_name}/{our_proj}", (d, h, hd)
                        )
                    rows += naming.linear(
                        f"{hf_name}.out_proj", f"{our_name}/out", (h, hd, d), in_axes=2
                    )
                elif hf_module.endswith("layer_norm"):
                    rows += naming.norm(hf_name, our_name, d)
                else:
                    shape = (d, ff) if hf_module == "fc1" else (ff, d)
                    rows += naming.linear(hf_name, our_name, shape)
    vocab, target_vocab = config.vocab_size, config.output_vocab_size
    if config.share_embeddings:  # one table, stored under any of its tied names
        names = ("model.shared.weight", "model.encoder.embed_tokens.weight")
        names += ("model.decoder.embed_tokens.weight", "lm_head.weight")
        rows.append(Tensor(names, "source_embedding/embedding", (vocab, d)))
    else:  # the tables each stack reads (``model.shared``, if any, is not one of them)
        rows.append(
            Tensor(("model.encoder.embed_tokens.weight",), "source_embedding/embedding", (vocab, d))
        )
        names = ("model.decoder.embed_tokens.weight",)
        names += ("lm_head.weight",) if config.tie_output_embedding else ()
        rows.append(Tensor(names, "target_embedding/embedding", (target_vocab, d)))
    if not config.tie_output_embedding:
        rows.append(
            Tensor(("lm_head.weight",), "decoder/logits/kernel", (d, target_vocab), in_axes=1)
        )
    rows.append(
        Tensor(
            ("final_logits_bias",), "decoder/logits_bias", (target_vocab,),
            hf_shape=(1, target_vocab),
        )
    )  # fmt: skip
    return rows


def _strip_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys as ``model.*`` / ``lm_head.*`` / ``final_logits_bias`` whatever the checkpoint's
    prefix (some store ``marian.model.*``; base-model checkpoints have no ``model.``)."""
    out = {}
    for key, value in naming.strip_prefixes(state, ("marian.", "module.")).items():
        if key.startswith(("encoder.", "decoder.", "shared.")):
            key = "model." + key
        out[key] = value
    return out


def _check_positions(state: Mapping[str, np.ndarray], config: TransformerConfig) -> None:
    from flaxformer_lite.ops.positions import sinusoidal

    table = None
    for stack in ("encoder", "decoder"):
        stored = state.get(f"model.{stack}.embed_positions.weight")
        if stored is None:
            continue
        if table is None:
            table = np.asarray(sinusoidal(config.max_len, config.d_model, layout="halves"))
        if stored.shape != table.shape or not np.allclose(stored, table, atol=1e-4):
            raise ValueError(
                f"model.{stack}.embed_positions.weight is not Marian's sinusoid table "
                f"[{config.max_len}, {config.d_model}] (sin | cos halves); learned or other "
                "positions are not a Marian model"
            )


def params_from_state_dict(state: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
    """Our ``params`` (nested dicts of float32 NumPy arrays, unrolled layers) from a Marian
    state dict (names -> arrays, as in ``model.safetensors``).

    Raises:
      ValueError: a tensor the config needs is missing or has another shape (named), or
        tensors are left over that this mapping does not know (named).
    """
    state = _strip_prefix(state)
    if "final_logits_bias" not in state:  # a checkpoint without one has a zero bias
        state["final_logits_bias"] = np.zeros((1, config.output_vocab_size), np.float32)
    # Tied copies of the embedding and the position tables carry nothing new; with separate
    # tables, MarianMTModel does not read ``model.shared`` (share_encoder_decoder_embeddings
    # with tie_word_embeddings=False still stores it).
    redundant = {
        "model.shared.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "model.encoder.embed_positions.weight",
        "model.decoder.embed_positions.weight",
    }
    if config.tie_output_embedding:
        redundant.add("lm_head.weight")
    params = naming.params_from_state(state, tensors(config), ignore=redundant, family=NAME)
    _check_positions(state, config)
    return params


def state_dict_from_params(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The Marian state dict of plain, unrolled float parameters (``hf.plain_params``), the
    inverse of ``params_from_state_dict``."""
    params = dict(params)
    decoder = dict(params["decoder"])
    if decoder.get("logits_bias") is None:
        decoder["logits_bias"] = np.zeros((config.output_vocab_size,), np.float32)
    params["decoder"] = decoder
    state = naming.state_from_params(params, tensors(config))
    source = state.pop("model.shared.weight", None)
    if config.share_embeddings and config.tie_output_embedding:
        state["model.shared.weight"] = source  # the tied copies are not stored
    else:
        source = np.asarray(params["source_embedding"]["embedding"], np.float32)
        target = (
            source
            if config.share_embeddings
            else np.asarray(params["target_embedding"]["embedding"], np.float32)
        )
        if _hf_shared(config):
            # transformers 5 stores (and never reads) ``model.shared`` when the tables are
            # untied; the same names as its own save_pretrained, so nothing is reported missing.
            state["model.shared.weight"] = source
        state["model.encoder.embed_tokens.weight"] = source
        state["model.decoder.embed_tokens.weight"] = target
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


# ----------------------------------------------------------------------------- generation


generation_ids = fields.seq2seq_generation_ids  # the special ids generation_config.json names


def default_generation(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json`` when none is given: the ids and the forced EOS
    (transformers' defaults for the rest: greedy, 20 tokens)."""
    return {**generation_ids(config), "forced_eos_token_id": config.eos_id}


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(root: epath.Path) -> Any:
    """The Marian tokenizer in ``root``, or None when its files are absent."""
    if not all((root / name).is_file() for name in ("source.spm", "target.spm", "vocab.json")):
        return None
    from flaxformer_lite.data.marian_tokenizer import MarianTokenizer

    return MarianTokenizer.load(str(root))
