"""Hugging Face Llama (and Qwen2): config, parameter names, generation ids.

The Llama 2/3 architecture (TinyLlama, SmolLM, Llama 3.x; Qwen2 adds query/key/value biases)
is a ``DecoderOnly`` with these ``TransformerConfig`` choices, none a special case here:
pre-norm RMSNorm (``norm_type="rmsnorm"``, ``layer_norm_epsilon=rms_norm_eps``) with a final
norm, rotary positions in the half-split layout (``position="rotary"``; ``rope_theta``; Llama
3's ``rope_scaling`` as ``rope_scaling_factor`` and its three bounds), grouped-query
attention (``num_kv_heads``, ``head_dim``), SwiGLU (``activation="swiglu"``: ``silu(gate) *
up``), no biases (``use_bias=False``; Qwen2: ``qkv_bias=True``), unscaled embeddings, a tied
or separate ``lm_head`` and no residual dropout. Parameter names map one to one::

    model.embed_tokens                      ->  embedding/embedding
    model.layers.i.self_attn.{q,k,v}_proj   ->  decoder/layers_i/self_attention/{query,key,value}
    model.layers.i.self_attn.o_proj         ->  decoder/layers_i/self_attention/out
    model.layers.i.mlp.gate_proj / up_proj  ->  decoder/layers_i/mlp/wi / wi_up
    model.layers.i.mlp.down_proj            ->  decoder/layers_i/mlp/wo
    model.layers.i.input_layernorm          ->  decoder/layers_i/self_attention_norm
    model.layers.i.post_attention_layernorm ->  decoder/layers_i/mlp_norm
    model.norm                              ->  decoder/final_norm
    lm_head (tie_word_embeddings=false)     ->  decoder/logits (transposed)

BOS: Hugging Face's tokenizers put ``bos_token_id`` before the text and the model reads the
ids as given. ``DecoderOnly.decode(input_ids)`` does the same (``DecoderOnly(ids)`` shifts
BOS in itself, for training data without it), and ``continue_prompt`` with
``GenerationConfig(prepend_bos=False)`` (what ``GenerationConfig.from_hugging_face`` gives)
continues the ids as given. The folder's tokenizer (``data.hf_tokenizers``, returned by
``hf.load_pretrained``) adds BOS as transformers' does. A config without ``pad_token_id`` pads
with EOS, as transformers' generate does.

Everything in ``config.json`` is either read (``_READ``), checked to have the one value this
architecture computes (``_CHECKED``), or metadata that does not change the function
(``_METADATA``); any other key is refused by name, never ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.interop import fields, naming
from flaxformer_lite.interop.naming import Tensor
from flaxformer_lite.nn.config import TransformerConfig

NAME = "Llama"
MODEL_TYPES = ("llama", "qwen2")
DECODER_ONLY = True

Params = dict[str, Any]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# LlamaConfig's / Qwen2Config's defaults for keys a config.json may leave out.
DEFAULTS = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
QWEN2_DEFAULTS = {**DEFAULTS, "max_position_embeddings": 32768, "bos_token_id": None}
# Keys whose values become TransformerConfig fields.
_READ = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_dropout",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
}
# Keys with the one value this architecture computes (others refused): key -> accepted.
_CHECKED = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "is_encoder_decoder": (False,),
    "partial_rotary_factor": (1.0,),
}
# Keys that do not change what the model computes: bookkeeping, training-time settings,
# generation defaults (read from generation_config.json by decoding.hf_generation), and
# Qwen2's window settings, which apply only with use_sliding_window=true (refused).
_METADATA = {
    "model_type",
    "architectures",
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "pretraining_tp",  # how Llama 2's pretraining split its matmuls: the same function
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "problem_type",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "tokenizer_class",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "bad_words_ids",
    "max_length",
    "max_new_tokens",
    "num_beams",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
}
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ----------------------------------------------------------------------------- configs


def _refuse(key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"config.json has {key}={value!r}; a Llama-family model supports {valid}")


def _one_id(hf: Mapping[str, Any], key: str) -> int | None:
    """An id field: an int, None, or a list of one distinct id (a list of several is refused:
    one ``TransformerConfig`` id)."""
    value = hf.get(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise _refuse(key, value, "one id (TransformerConfig has one eos_id)")
        value = value[0]
    return value


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, llama3 parameters or None)`` from transformers 5's ``rope_parameters`` or
    the older ``rope_theta`` / ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    key = "rope_parameters"
    scaling = hf.get("rope_scaling")
    if scaling is not None and not params:
        params, key = dict(scaling), "rope_scaling"
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(
            key,
            {"rope_type": rope_type, **params},
            f"rope_type {list(ROPE_TYPES)} (Llama 3's scaling or none)",
        )
    factor = params.pop("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise _refuse("partial_rotary_factor", factor, "1.0 (every channel rotated)")
    if rope_type == "default":
        if params:
            raise _refuse(key, params, "no other keys with rope_type 'default'")
        return float(theta), None
    missing = [k for k in LLAMA3_KEYS if k not in params]
    extra = sorted(set(params) - set(LLAMA3_KEYS))
    if missing or extra:
        raise _refuse(
            key,
            {"rope_type": rope_type, **params},
            f"rope_type 'llama3' with exactly {list(LLAMA3_KEYS)}",
        )
    return float(theta), params


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face Llama or Qwen2 ``config.json`` (a dict).

    ``unk_id``: the vocabulary's unknown id (None: 0, Llama's ``<unk>``).

    Raises:
      ValueError: another ``model_type``, a key this module does not know, or a value this
        architecture does not compute (biases, another activation, a sliding window, rope
        scaling other than Llama 3's, several EOS ids), each named in one line.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json has model_type {model_type!r}; this module reads "
            f"{'/'.join(MODEL_TYPES)} checkpoints"
        )
    unknown = sorted(set(hf) - _READ - set(_CHECKED) - _METADATA)
    if unknown:
        raise ValueError(
            f"config.json has keys a {model_type} model here does not support: {unknown} "
            "(an unknown key may change the model; refused rather than ignored)"
        )
    defaults = QWEN2_DEFAULTS if model_type == "qwen2" else DEFAULTS
    for key, accepted in _CHECKED.items():
        if key in hf and hf[key] not in accepted:
            raise _refuse(key, hf[key], f"{key}={accepted[0]!r} only")
    if model_type == "qwen2" and hf.get("layer_types") is not None:
        kinds = sorted(set(hf["layer_types"]))
        if kinds != ["full_attention"]:
            raise _refuse("layer_types", kinds, "'full_attention' layers only")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if hf.get(key) is None:
            raise ValueError(f"config.json has no {key!r}, which a {model_type} model needs")
    if hf.get("num_attention_heads") is None:
        raise ValueError(f"config.json has no 'num_attention_heads', which a {model_type} needs")

    def get(key: str) -> Any:
        return hf[key] if hf.get(key) is not None else defaults[key]

    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, llama3 = _rope(hf)
    eos = _one_id(hf, "eos_token_id") if "eos_token_id" in hf else defaults["eos_token_id"]
    if eos is None:
        raise _refuse("eos_token_id", None, "an EOS id")
    bos = _one_id(hf, "bos_token_id") if "bos_token_id" in hf else defaults["bos_token_id"]
    pad = _one_id(hf, "pad_token_id")
    scaling: dict[str, Any] = {}
    if llama3 is not None:
        scaling = dict(
            rope_scaling_factor=float(llama3["factor"]),
            rope_low_freq_factor=float(llama3["low_freq_factor"]),
            rope_high_freq_factor=float(llama3["high_freq_factor"]),
            rope_original_max_len=int(llama3["original_max_position_embeddings"]),
        )
    return TransformerConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if head_dim * heads == hf["hidden_size"] else head_dim,
        d_ff=hf["intermediate_size"],
        num_encoder_layers=1,  # no encoder: DecoderOnly reads only the decoder's depth
        num_decoder_layers=hf["num_hidden_layers"],
        dropout_rate=0.0,  # Llama has no residual dropout
        attention_dropout_rate=float(get("attention_dropout")),
        max_len=int(get("max_position_embeddings")),
        activation="swiglu",
        norm_position="pre",
        norm_type="rmsnorm",
        layer_norm_epsilon=float(get("rms_norm_eps")),
        position="rotary",
        scale_embeddings=False,
        share_embeddings=True,
        tie_output_embedding=bool(get("tie_word_embeddings")),
        logits_bias=False,
        use_bias=False,
        qkv_bias=model_type == "qwen2",
        pad_id=eos if pad is None else pad,  # transformers' generate pads with EOS then
        bos_id=eos if bos is None else bos,  # Qwen2 has no BOS: its prompts start as given
        eos_id=eos,
        unk_id=0 if unk_id is None else unk_id,
        rope_theta=theta,
        **scaling,
    )


# What save_pretrained does with each TransformerConfig field:
# - written: vocab_size, d_model, num_heads, num_kv_heads, head_dim, d_ff,
#   num_decoder_layers, attention_dropout_rate, max_len, layer_norm_epsilon,
#   tie_output_embedding, pad_id, bos_id, eos_id, rope_theta, rope_scaling_factor,
#   rope_low_freq_factor, rope_high_freq_factor, rope_original_max_len, qkv_bias (the
#   model_type: qwen2 with it, llama without);
# - refused unless Llama's value (``problems``): target_vocab_size, activation,
#   norm_position, norm_type, position, scale_embeddings, logits_bias, use_bias, fused_qkv,
#   num_experts (with moe_every), attention_window, quantization (unless ``dequantize``),
#   T5's scale_attention_logits and scale_decoder_output;
# - not part of the saved function: num_encoder_layers (no encoder), dropout_rate (training
#   only; Llama has none), sinusoid_layout, share_embeddings (one table), relative_*,
#   the classifier's, precision, layout and MoE training fields, unk_id, int8_kernel.
WANTED = {
    "activation": "swiglu",
    "norm_position": "pre",
    "norm_type": "rmsnorm",
    "position": "rotary",
    "scale_embeddings": False,
    "logits_bias": False,
    "use_bias": False,
    "fused_qkv": False,
    "attention_window": None,
    "scale_attention_logits": True,
    "scale_decoder_output": False,
}


def problems(config: TransformerConfig, *, dequantize: bool = False) -> list[str]:
    """What keeps ``config`` from being written as a Llama (or Qwen2) model (empty: nothing)."""
    found = fields.differences(
        config, "Llama", WANTED, activations=None, dequantize=dequantize, decoder_only=True
    )
    if config.output_vocab_size != config.vocab_size:
        found.append(f"target_vocab_size={config.target_vocab_size} (Llama: one vocabulary, None)")
    return found


def config_to_hf(config: TransformerConfig, *, dequantize: bool = False) -> dict[str, Any]:
    """The ``config.json`` dict of ``config``: ``model_type`` "qwen2" when it has
    ``qkv_bias``, else "llama".

    Raises:
      ValueError: ``config`` is not this architecture, listing every field that differs.
    """
    differences = problems(config, dequantize=dequantize)
    if differences:
        raise ValueError(
            "save_pretrained writes Llama models; this TransformerConfig differs in: "
            + "; ".join(differences)
        )
    model_type = "qwen2" if config.qkv_bias else "llama"
    theta = 10000.0 if config.rope_theta is None else float(config.rope_theta)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.num_decoder_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.effective_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_output_embedding,
        "attention_dropout": config.attention_dropout_rate,
        "rope_parameters": rope,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": None if config.pad_id == config.eos_id else config.pad_id,
        "use_cache": True,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(use_sliding_window=False)
    return hf


# ----------------------------------------------------------------------------- parameters


def tensors(config: TransformerConfig) -> list[Tensor]:
    """The name map of a Llama model of ``config`` (see the module docstring)."""
    d, h, kv, hd, ff = (
        config.d_model,
        config.num_heads,
        config.kv_heads,
        config.effective_head_dim,
        config.d_ff,
    )
    rows: list[Tensor] = []
    for i in range(config.num_decoder_layers):
        hf, ours = f"model.layers.{i}", f"decoder/layers_{i}"
        for proj, our_proj, heads in (("q_proj", "query", h), ("k_proj", "key", kv)):
            rows += naming.linear(
                f"{hf}.self_attn.{proj}",
                f"{ours}/self_attention/{our_proj}",
                (d, heads, hd),
                bias=config.qkv_bias,
            )
        rows += naming.linear(
            f"{hf}.self_attn.v_proj", f"{ours}/self_attention/value", (d, kv, hd),
            bias=config.qkv_bias,
        )  # fmt: skip
        rows += naming.linear(
            f"{hf}.self_attn.o_proj", f"{ours}/self_attention/out", (h, hd, d), in_axes=2,
            bias=False,
        )  # fmt: skip
        for proj, our_proj, shape in (
            ("gate_proj", "wi", (d, ff)),
            ("up_proj", "wi_up", (d, ff)),
            ("down_proj", "wo", (ff, d)),
        ):
            rows += naming.linear(f"{hf}.mlp.{proj}", f"{ours}/mlp/{our_proj}", shape, bias=False)
        rows += naming.norm(f"{hf}.input_layernorm", f"{ours}/self_attention_norm", d, bias=False)
        rows += naming.norm(f"{hf}.post_attention_layernorm", f"{ours}/mlp_norm", d, bias=False)
    rows += naming.norm("model.norm", "decoder/final_norm", d, bias=False)
    vocab = config.vocab_size
    names: tuple[str, ...] = ("model.embed_tokens.weight",)
    if config.tie_output_embedding:
        names += ("lm_head.weight",)  # a tied table stored under either name
    rows.append(Tensor(names, "embedding/embedding", (vocab, d)))
    if not config.tie_output_embedding:
        rows.append(Tensor(("lm_head.weight",), "decoder/logits/kernel", (d, vocab), in_axes=1))
    return rows


_DERIVED = re.compile(r".*rotary_emb\.inv_freq$")  # older checkpoints store the frequencies


def _strip_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys as ``model.*`` / ``lm_head.*`` whatever the checkpoint's prefix (a base
    ``LlamaModel`` has no ``model.``)."""
    out = {}
    for key, value in naming.strip_prefixes(state, ("module.",)).items():
        if key.startswith(("layers.", "embed_tokens.", "norm.")):
            key = "model." + key
        out[key] = value
    return out


def params_from_state_dict(state: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
    """Our ``params`` (nested dicts of float32 NumPy arrays, unrolled layers: the params of
    ``DecoderOnly(config)``) from a Llama / Qwen2 state dict.

    Raises:
      ValueError: a tensor the config needs is missing or has another shape (named), or
        tensors are left over that this mapping does not know (named).
    """
    state = _strip_prefix(state)
    ignore = {k for k in state if _DERIVED.match(k)}
    if config.tie_output_embedding:
        ignore |= {"lm_head.weight", "model.embed_tokens.weight"}  # the copy not read
    return naming.params_from_state(state, tensors(config), ignore=ignore, family=NAME)


def state_dict_from_params(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
    """The Llama state dict of plain, unrolled float parameters (``hf.plain_params``), the
    inverse of ``params_from_state_dict`` (a tied table stored once, as transformers does)."""
    return naming.state_from_params(params, tensors(config))


# ----------------------------------------------------------------------------- generation


def generation_ids(config: TransformerConfig) -> dict[str, int]:
    """The special ids a Llama ``generation_config.json`` names (no PAD when it is EOS)."""
    ids = {"bos_token_id": config.bos_id, "eos_token_id": config.eos_id}
    if config.pad_id != config.eos_id:
        ids["pad_token_id"] = config.pad_id
    return ids


def default_generation(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json`` when none is given: the ids (greedy, transformers'
    defaults for the rest)."""
    return generation_ids(config)


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(root: epath.Path) -> Any:
    """The tokenizer in ``root`` (``data.hf_tokenizers``: ``tokenizer.json``, or Llama 2's
    ``tokenizer.model``; its ``encode`` puts BOS first as transformers' does), read for
    ``config.json``'s ``model_type`` (``llama`` where there is none, e.g. a train.py
    workdir); None when ``root`` has no tokenizer file."""
    from flaxformer_lite.data.hf_tokenizers import load_hf_tokenizer

    config = root / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return load_hf_tokenizer(str(root), model_type if model_type in MODEL_TYPES else "llama")
