"""Hugging Face Marian (opus-mt) checkpoints in and out of flaxformer_lite.

    config, params, tokenizer = load_pretrained("Helsinki-NLP/opus-mt-en-de")  # or a local folder
    save_pretrained("out/", config, params, tokenizer)  # MarianMTModel / CTranslate2 read it

A Marian model is the paper's Transformer with a few choices of its own, each a
``TransformerConfig`` field rather than a special case here: swish (``activation="silu"``), the
sinusoids as sine and cosine halves (``sinusoid_layout="halves"``), embeddings scaled or not
(``scale_embeddings``), a final logits bias (``logits_bias``), LayerNorm epsilon 1e-5, tied or
separate embeddings, and its own special ids (pad = decoder start = the last id, EOS 0, UNK 1).

Reading needs neither torch nor transformers: ``config.json`` is JSON, ``model.safetensors``
reads into NumPy (a ``pytorch_model.bin`` needs torch). Parameter names map one to one::

    model.{en,de}coder.layers.i.self_attn.{q,k,v}_proj  ->  .../layers_i/self_attention/{query,...}
    model.{en,de}coder.layers.i.self_attn.out_proj      ->  .../layers_i/self_attention/out
    model.decoder.layers.i.encoder_attn.*               ->  decoder/layers_i/cross_attention/*
    *.self_attn_layer_norm, *.encoder_attn_layer_norm   ->  {self,cross}_attention_norm
    *.fc1 / fc2 / final_layer_norm                      ->  mlp/wi / mlp/wo / mlp_norm
    model.shared (all tied; else encoder.embed_tokens)  ->  source_embedding
    model.decoder.embed_tokens (not all tied)           ->  target_embedding
    lm_head (untied)                                    ->  decoder/logits (transposed)
    final_logits_bias `[1, vocab]`                      ->  decoder/logits_bias `[vocab]`

PyTorch ``Linear`` weights are `[out, in]`; ours are `[in, heads, head_dim]` (queries, keys,
values), `[heads, head_dim, out]` (attention output) and `[in, out]` (feed-forward). Marian's
sinusoidal position tables are not parameters here (a checkpoint that stores one is checked
against ours).

A folder's generation config (how its ``generate()`` decodes) is read by
``decoding.hf_generation``, whose names are re-exported here, and becomes the options of our
searches through ``GenerationConfig.from_hugging_face``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from flaxformer_lite.core import paths
from flaxformer_lite.core.hub import resolve
from flaxformer_lite.decoding.hf_generation import (  # noqa: F401  (defined here before)
    GENERATION_DEFAULT_MAX_LENGTH,
    GENERATION_KEYS,
    generate_new_tokens,
    generation_config,
    generation_defaults,
    unsupported_generation,
)
from flaxformer_lite.nn.config import TransformerConfig

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

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")

Params = dict[str, Any]


# ----------------------------------------------------------------------------- configs


def _hf_int(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which a Marian model needs")
    return value


def config_from_hf(hf: Mapping[str, Any], *, unk_id: int = 1) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face Marian ``config.json`` (a dict).

    ``unk_id`` comes from the vocabulary (``<unk>``, 1 in every Marian vocabulary), which the
    model config does not record.

    Raises:
      ValueError: not a Marian config, or one this architecture cannot express (different
        encoder/decoder widths or head counts, an unknown activation, activation dropout),
        naming the key.
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
    if float(hf.get("activation_dropout") or 0.0) > 0:
        raise ValueError(
            f"config.json activation_dropout={hf['activation_dropout']}: dropout inside the "
            "feed-forward block is not part of TransformerConfig; set it to 0.0"
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
        unk_id=unk_id,
    )


# What save_pretrained does with each TransformerConfig field (tests/interop/test_hf_marian.py walks
# every field of the dataclass against its own copy of this classification):
# - written to config.json: vocab_size, target_vocab_size, d_model, num_heads, d_ff,
#   num_encoder_layers, num_decoder_layers, dropout_rate, attention_dropout_rate, max_len,
#   activation, scale_embeddings, share_embeddings, tie_output_embedding, pad_id, bos_id,
#   eos_id; logits_bias=False is written as a zero final_logits_bias;
# - refused where Marian cannot express the value (``_marian_problems``): num_kv_heads,
#   head_dim, activation (gated), norm_position, norm_type, layer_norm_epsilon, position,
#   sinusoid_layout, use_bias, fused_qkv, num_experts (with moe_every), attention_window,
#   quantization (unless ``dequantize``);
# - irrelevant to the saved model (precision, memory, layout, training or the classifier
#   head, or inert because a refused field is off): dtype, param_dtype,
#   attention_implementation, remat, scan_layers, num_classes, pooling, unk_id (the
#   vocabulary's), num_experts_per_token, expert_capacity_factor, moe_aux_loss_weight,
#   router_z_loss_weight, attention_window_layers, relative_num_buckets,
#   relative_max_distance.
MARIAN_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default; MarianConfig has no field


def _marian_problems(config: TransformerConfig, *, dequantize: bool = False) -> list[str]:
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
    }
    problems = [
        f"{name}={getattr(config, name)!r} (Marian: {value!r})"
        for name, value in wanted.items()
        if getattr(config, name) != value
    ]
    if config.activation not in TO_HF_ACTIVATION:
        problems.append(
            f"activation={config.activation!r} (Marian: one of {list(TO_HF_ACTIVATION)})"
        )
    if config.kv_heads != config.num_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} (Marian: multi-head, None)")
    if config.effective_head_dim * config.num_heads != config.d_model:
        problems.append(
            f"head_dim={config.head_dim} (Marian: d_model / num_heads = "
            f"{config.d_model / config.num_heads:g}, or None)"
        )
    layers = max(config.num_encoder_layers, config.num_decoder_layers)
    if any(config.is_moe_layer(i) for i in range(layers)):
        problems.append(
            f"num_experts={config.num_experts} with moe_every={config.moe_every} (Marian: "
            "dense feed-forward layers, num_experts=0)"
        )
    if config.quantization is not None and not dequantize:
        problems.append(
            f"quantization={config.quantization!r} (Marian: float weights, None; "
            "dequantize=True, or --dequantize, writes the int8 weights as float32 q * scale)"
        )
    return problems


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
    problems = _marian_problems(config, dequantize=dequantize)
    if problems:
        raise ValueError(
            "save_pretrained writes Marian models; this TransformerConfig differs in: "
            + "; ".join(problems)
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
        "activation_dropout": 0.0,
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


def _stack_names(config: TransformerConfig) -> list[tuple[str, str, int]]:
    return [
        ("encoder", "model.encoder", config.num_encoder_layers),
        ("decoder", "model.decoder", config.num_decoder_layers),
    ]


def _layer_map(stack: str) -> list[tuple[str, str]]:
    """(HF module, our module) pairs inside one layer of ``stack``."""
    pairs = [("self_attn", "self_attention"), ("self_attn_layer_norm", "self_attention_norm")]
    if stack == "decoder":
        pairs += [
            ("encoder_attn", "cross_attention"),
            ("encoder_attn_layer_norm", "cross_attention_norm"),
        ]
    pairs += [("fc1", "mlp/wi"), ("fc2", "mlp/wo"), ("final_layer_norm", "mlp_norm")]
    return pairs


_PROJECTIONS = (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out"))


def _strip_prefix(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keys as ``model.*`` / ``lm_head.*`` / ``final_logits_bias`` whatever the checkpoint's
    prefix (some store ``marian.model.*``; base-model checkpoints have no ``model.``)."""
    out = {}
    for key, value in state.items():
        for prefix in ("marian.", "module."):
            key = key.removeprefix(prefix)
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
    used: set[str] = set()
    d, h, hd = config.d_model, config.num_heads, config.effective_head_dim

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state:
            raise ValueError(f"the checkpoint has no tensor {name!r} (expected shape {shape})")
        value = np.asarray(state[name], dtype=np.float32)
        if value.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {value.shape}; the config (config.json) implies {shape}"
            )
        used.add(name)
        return value

    def first(names: list[str], shape: tuple[int, ...]) -> np.ndarray:
        for name in names:
            if name in state:
                return take(name, shape)
        raise ValueError(f"the checkpoint has none of {names} (expected shape {shape})")

    params: Params = {}
    for stack, prefix, layers in _stack_names(config):
        for i in range(layers):
            layer: Params = {}
            for hf_module, ours in _layer_map(stack):
                base = f"{prefix}.layers.{i}.{hf_module}"
                if hf_module.endswith("attn"):
                    block: Params = {}
                    for hf_proj, our_proj in _PROJECTIONS:
                        w = take(f"{base}.{hf_proj}.weight", (d, d))
                        b = take(f"{base}.{hf_proj}.bias", (d,))
                        if our_proj == "out":  # [d_out, h*hd] -> [h, hd, d_out]
                            block[our_proj] = {"kernel": w.T.reshape(h, hd, d), "bias": b}
                        else:  # [h*hd, d_in] -> [d_in, h, hd]
                            block[our_proj] = {
                                "kernel": w.T.reshape(d, h, hd),
                                "bias": b.reshape(h, hd),
                            }
                    layer[ours] = block
                elif hf_module.endswith("layer_norm"):
                    layer[ours] = {
                        "scale": take(f"{base}.weight", (d,)),
                        "bias": take(f"{base}.bias", (d,)),
                    }
                else:  # fc1 [d_ff, d] -> wi [d, d_ff]; fc2 [d, d_ff] -> wo [d_ff, d]
                    shape = (config.d_ff, d) if hf_module == "fc1" else (d, config.d_ff)
                    group, name = ours.split("/")
                    layer.setdefault(group, {})[name] = {
                        "kernel": take(f"{base}.weight", shape).T,
                        "bias": take(f"{base}.bias", (shape[0],)),
                    }
            params.setdefault(stack, {})[f"layers_{i}"] = layer

    vocab, target_vocab = config.vocab_size, config.output_vocab_size
    if config.share_embeddings:  # one table, stored under any of its tied names
        names = ["model.shared.weight", "model.encoder.embed_tokens.weight"]
        names += ["model.decoder.embed_tokens.weight", "lm_head.weight"]
        params["source_embedding"] = {"embedding": first(names, (vocab, d))}
    else:  # the tables each stack reads (``model.shared``, if any, is not one of them)
        params["source_embedding"] = {
            "embedding": take("model.encoder.embed_tokens.weight", (vocab, d))
        }
        names = ["model.decoder.embed_tokens.weight"]
        names += ["lm_head.weight"] if config.tie_output_embedding else []
        params["target_embedding"] = {"embedding": first(names, (target_vocab, d))}
    if not config.tie_output_embedding:
        params["decoder"]["logits"] = {"kernel": take("lm_head.weight", (target_vocab, d)).T}
    bias = state.get("final_logits_bias")
    params["decoder"]["logits_bias"] = (
        np.zeros((target_vocab,), np.float32)
        if bias is None
        else take("final_logits_bias", (1, target_vocab))[0]
    )
    _check_positions(state, config)
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
    left = sorted(set(state) - used - redundant)
    if left:
        raise ValueError(f"the checkpoint has tensors this Marian mapping does not use: {left}")
    return params


def _plain(
    params: Any, config: TransformerConfig, dequantize: bool = False
) -> tuple[Params, TransformerConfig]:
    """Unboxed, unrolled, float32 NumPy parameters (int8 ones dequantized if ``dequantize``)
    and the float, unrolled config they belong to."""
    import flax.linen as nn
    import jax

    from flaxformer_lite.models import unrolled
    from flaxformer_lite.ops.quantize import dequantize_params

    params, config = unrolled(nn.meta.unbox(params), config)
    if config.quantization is not None:
        if not dequantize:
            raise ValueError(
                f"config.quantization={config.quantization!r}: a Marian model has float "
                "weights; pass dequantize=True to write the int8 weights as float32"
            )
        params, config = dequantize_params(params), config.replace(quantization=None)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if np.issubdtype(np.asarray(leaf).dtype, np.integer):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {np.asarray(leaf).dtype}, but "
                f"config.quantization is {config.quantization!r}: pass the config the "
                "parameters were quantized for (quantization='int8') and dequantize=True"
            )
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float32), params)
    return params, config


def state_dict_from_params(
    params: Any, config: TransformerConfig, *, dequantize: bool = False
) -> dict[str, np.ndarray]:
    """The Marian state dict (Hugging Face names -> float32 NumPy arrays) of our parameters,
    the inverse of ``params_from_state_dict``: boxed or plain, scanned or unrolled.

    ``dequantize``: ``config.quantization="int8"`` parameters (``quantize.quantize_params``)
    are written as float32 ``q * scale`` (``quantize.dequantize_params``); without it they are
    refused (ValueError), as are integer parameters under a float config."""
    params, config = _plain(params, config, dequantize)
    d = config.d_model
    state: dict[str, np.ndarray] = {}
    for stack, prefix, layers in _stack_names(config):
        for i in range(layers):
            layer = params[stack][f"layers_{i}"]
            for hf_module, ours in _layer_map(stack):
                base = f"{prefix}.layers.{i}.{hf_module}"
                block = layer
                for part in ours.split("/"):
                    block = block[part]
                if hf_module.endswith("attn"):
                    for hf_proj, our_proj in _PROJECTIONS:
                        kernel, bias = block[our_proj]["kernel"], block[our_proj]["bias"]
                        if our_proj == "out":
                            state[f"{base}.{hf_proj}.weight"] = kernel.reshape(d, d).T
                            state[f"{base}.{hf_proj}.bias"] = bias
                        else:
                            state[f"{base}.{hf_proj}.weight"] = kernel.reshape(d, d).T
                            state[f"{base}.{hf_proj}.bias"] = bias.reshape(d)
                elif hf_module.endswith("layer_norm"):
                    state[f"{base}.weight"] = block["scale"]
                    state[f"{base}.bias"] = block["bias"]
                else:
                    state[f"{base}.weight"] = block["kernel"].T
                    state[f"{base}.bias"] = block["bias"]
    source = params["source_embedding"]["embedding"]
    if config.share_embeddings and config.tie_output_embedding:
        state["model.shared.weight"] = source  # the tied copies are not stored
    else:
        target = source if config.share_embeddings else params["target_embedding"]["embedding"]
        if _hf_shared(config):
            # transformers 5 stores (and never reads) ``model.shared`` when the tables are
            # untied; the same names as its own save_pretrained, so nothing is reported missing.
            state["model.shared.weight"] = source
        state["model.encoder.embed_tokens.weight"] = source
        state["model.decoder.embed_tokens.weight"] = target
    if not config.tie_output_embedding:
        state["lm_head.weight"] = params["decoder"]["logits"]["kernel"].T
    bias = params["decoder"].get("logits_bias")
    if bias is None:
        bias = np.zeros((config.output_vocab_size,), np.float32)
    state["final_logits_bias"] = bias[None, :]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


# ----------------------------------------------------------------------------- files


def read_state_dict(root: epath.Path) -> dict[str, np.ndarray]:
    """Name -> NumPy array of the weights in ``root``: ``model.safetensors`` (sharded through
    ``model.safetensors.index.json`` too) with safetensors alone, else ``pytorch_model.bin``
    through torch.

    Raises:
      FileNotFoundError: none of ``WEIGHT_FILES`` in ``root``.
    """
    from safetensors.numpy import load as load_safetensors

    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return dict(load_safetensors(single.read_bytes()))
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, np.ndarray] = {}
        for name in files:
            state.update(load_safetensors((root / name).read_bytes()))
        return state
    binary = root / "pytorch_model.bin"
    if binary.is_file():
        try:
            import torch
        except ImportError as e:
            raise ImportError(
                f"{binary} is a PyTorch pickle, which needs torch to read "
                "(pip install torch), or convert it to model.safetensors"
            ) from e
        with binary.open("rb") as f:
            state_t = torch.load(f, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state_t.items()}
    raise FileNotFoundError(f"no weights in {root}: expected one of {list(WEIGHT_FILES)}")


def _load_tokenizer(root: epath.Path) -> Any:
    """The Marian tokenizer in ``root``, or None when its files are absent."""
    if not all((root / name).is_file() for name in ("source.spm", "target.spm", "vocab.json")):
        return None
    from flaxformer_lite.data.marian_tokenizer import MarianTokenizer

    return MarianTokenizer.load(str(root))


def load_pretrained(path_or_repo_id: str) -> tuple[TransformerConfig, Params, Any]:
    """``(config, params, tokenizer)`` of a Hugging Face Marian model.

    Args:
      path_or_repo_id: a folder (local or ``gs://``) with ``config.json``, the weights
        (``model.safetensors`` or ``pytorch_model.bin``) and optionally the tokenizer
        (``source.spm``, ``target.spm``, ``vocab.json``), or a hub id such as
        ``"Helsinki-NLP/opus-mt-en-de"`` (downloaded once into the hub cache).

    Returns:
      the ``TransformerConfig``, the parameters (nested dicts of float32 NumPy arrays, the
      ``params`` collection of ``EncoderDecoder(config)``), and a
      ``marian_tokenizer.MarianTokenizer`` (None when the tokenizer files are absent).

    Raises:
      FileNotFoundError: no such folder or repository, no config.json, no weights.
      ValueError: not a Marian model, or weights that do not match its config (named).
    """
    root = resolve(path_or_repo_id)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {root}: is it a Hugging Face model folder?")
    hf = json.loads(config_path.read_text())
    tokenizer = _load_tokenizer(root)
    config = config_from_hf(hf, unk_id=tokenizer.unk_id if tokenizer is not None else 1)
    params = params_from_state_dict(read_state_dict(root), config)
    return config, params, tokenizer


def _generation_to_save(
    config: TransformerConfig, generation: Mapping[str, Any] | None
) -> dict[str, Any]:
    """generation_config.json's content for ``save_pretrained`` (see its ``generation``)."""
    ids = {
        "decoder_start_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
    }
    if generation is None:
        return {**ids, "forced_eos_token_id": config.eos_id}
    if not isinstance(generation, Mapping):
        raise ValueError(
            f"generation must be a dict (a generation config, e.g. hf.generation_config(folder))"
            f" or None; got {type(generation).__name__}"
        )
    wrong = [
        f"{k}={generation[k]!r} (config: {v!r})"
        for k, v in ids.items()
        if generation.get(k) is not None and generation[k] not in (v, [v])
    ]
    if wrong:
        raise ValueError(
            "generation names other special ids than the model config: " + "; ".join(wrong)
        )
    return {**ids, **generation}


def save_pretrained(
    directory: str,
    config: TransformerConfig,
    params: Any,
    tokenizer: Any = None,
    *,
    generation: Mapping[str, Any] | None = None,
    dequantize: bool = False,
) -> None:
    """Writes a Hugging Face Marian folder: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (float32) and, when given, the tokenizer's files.

    ``transformers.MarianMTModel.from_pretrained`` and CTranslate2's
    ``ct2-transformers-converter`` read the result (the converter needs the tokenizer);
    ``load_pretrained`` gives back bitwise the same parameters (one shared table with an untied
    output comes back as two equal tables: Marian unties all three then).

    Args:
      directory: the output folder (local or ``gs://``), created when missing.
      config: a Marian-architecture ``TransformerConfig`` (see ``config_to_hf``).
      params: its parameters (boxed or plain, scanned or unrolled, any float dtype).
      tokenizer: a ``marian_tokenizer.MarianTokenizer`` (its ``save`` writes source.spm,
        target.spm, vocab.json, tokenizer_config.json), or None.
      generation: the generation config, written to generation_config.json as it is, every
        field kept (e.g. :func:`generation_config` of the folder the model came from: then
        ``MarianMTModel.generate`` decodes the saved folder as it decoded that one); the ids
        it lacks are added from ``config``. None: the ids and the forced EOS alone
        (transformers' defaults for the rest: greedy, 20 tokens).
      dequantize: write an int8 model (``config.quantization="int8"``, parameters from
        ``quantize.quantize_params``) as the float32 model of its dequantized weights
        (``q * scale``; a tied embedding's int8 copy is dropped, its float table kept):
        Marian has no int8 weights, so without this flag such a model is refused. No effect
        on a float model.

    Raises:
      ValueError: ``config`` is not a Marian architecture, or is int8 without ``dequantize``
        (the differing fields are named), or ``generation`` is not a dict or names other
        special ids than ``config``; nothing is written then.
    """
    from safetensors.numpy import save as save_safetensors

    hf = config_to_hf(config, dequantize=dequantize)  # fails before anything is written
    gen = _generation_to_save(config, generation)
    state = state_dict_from_params(params, config, dequantize=dequantize)
    root = paths.resolve(directory)
    paths.makedirs(root)
    paths.write_atomic(root / "config.json", json.dumps(hf, indent=2, sort_keys=True) + "\n")
    paths.write_atomic(
        root / "generation_config.json", json.dumps(gen, indent=2, sort_keys=True) + "\n"
    )
    blob = save_safetensors(state, metadata={"format": "pt"})
    paths.write_atomic(root / "model.safetensors", blob)
    if tokenizer is not None:
        tokenizer.save(str(root))


# ----------------------------------------------------------------------------- workdirs


def export_workdir(
    workdir: str,
    directory: str,
    *,
    step: int | None = None,
    average: int = 1,
    dequantize: bool = False,
) -> TransformerConfig:
    """Writes a train.py workdir (e.g. a Marian model fine-tuned with
    configs/finetune_marian.py) as a Hugging Face Marian folder: its ``model_config.json``, the
    parameters of checkpoint ``step`` (default the latest; ``average`` > 1: the mean of that
    many last checkpoints) and, when the workdir holds them, its Marian tokenizer and the
    ``generation_config.json`` of the folder it was fine-tuned from (every field kept).
    ``dequantize``: an int8 model is written dequantized (see ``save_pretrained``).

    Raises:
      FileNotFoundError: no workdir, model_config.json or checkpoint.
      ValueError: the model is not a Marian architecture, or int8 without ``dequantize``, or
        int8 with ``average`` > 1 (the differing fields are named).
    """
    from flaxformer_lite.core.checkpoints import average_params, choose_steps
    from flaxformer_lite.models import abstract_params

    root = paths.resolve(workdir)
    config_path = root / "model_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no model_config.json in {workdir}: is it a train.py workdir?")
    config = TransformerConfig.from_json(config_path.read_text())
    # A non-Marian model fails here, before the checkpoint is read.
    config_to_hf(config, dequantize=dequantize)
    if config.quantization is not None and average != 1:
        raise ValueError(
            f"average={average} with quantization={config.quantization!r}: int8 values with "
            "different scales cannot be averaged; export one checkpoint (average=1)"
        )
    checkpoints = str(root / "checkpoints")
    steps = choose_steps(checkpoints, step=step, average=average)
    params = average_params(checkpoints, steps, abstract_params(config))
    # A run fine-tuned from a Hugging Face folder keeps that folder's generation config
    # (train.py copies it into the workdir): the export decodes as the original did.
    generation_path = root / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    save_pretrained(
        directory, config, params, _load_tokenizer(root),
        generation=generation, dequantize=dequantize,
    )  # fmt: skip
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m flaxformer_lite.interop.hf --workdir W --out DIR``: a workdir to a Hugging Face
    Marian folder (then ``ct2-transformers-converter --model DIR`` for CTranslate2)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m flaxformer_lite.interop.hf",
        description="Write a train.py workdir as a Hugging Face Marian model folder.",
    )
    parser.add_argument("--workdir", required=True, help="train.py workdir (local or gs://)")
    parser.add_argument("--out", required=True, help="output folder (local or gs://)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--average", type=int, default=1, help="average the last N checkpoints")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write an int8 model (quantization='int8') as float32 q * scale weights "
        "(Marian has no int8 weights; without this flag an int8 model is refused)",
    )
    args = parser.parse_args(argv)
    if args.average < 1:
        parser.error(f"argument --average: must be >= 1; got {args.average}")
    out = paths.resolve(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {args.out} is a file; give a folder")
    try:
        config = export_workdir(
            args.workdir, args.out, step=args.step, average=args.average, dequantize=args.dequantize
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: Marian model, vocabulary {config.vocab_size}, "
        f"{config.num_encoder_layers}+{config.num_decoder_layers} layers"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
