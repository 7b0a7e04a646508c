"""An independent float64 NumPy forward pass of the three models, written from the paper.

Vaswani et al. 2017, "Attention Is All You Need": token embeddings multiplied by sqrt(d_model)
(section 3.4) plus the sinusoids of section 3.5, scaled dot-product attention
softmax(QK^T / sqrt(d_k)) V (equation 1) over h heads (section 3.2.2), residual sub-layers
LayerNorm(x + Sublayer(x)) (section 3.1; "pre" is the pre-LN variant x + Sublayer(LN(x)) with a
final norm), the feed-forward max(0, xW1 + b1)W2 + b2 (equation 2) and the pre-softmax
projection tied to the embedding (section 3.4). Options beyond the paper follow their own
papers: gated FFNs act(xW) * (xV) W2 (Shazeer 2020, GELU in its tanh form as in T5/GPT-2),
RMSNorm (Zhang & Sennrich 2019), rotary embeddings (RoFormer, Su et al. 2021), T5's bucketed
relative position bias (Raffel et al. 2020) and grouped-query attention (Ainslie et al. 2023:
query head h reads key/value head h // (heads / kv_heads)). T5's own choices: logits QK^T
without the 1/sqrt(d_k) (``scale_attention_logits=False``) and, in T5 v1.0, the decoder output
multiplied by d_model^-1/2 before the tied projection (``scale_decoder_output``).
Restricted self-attention (the paper's Table 1, neighbourhood r = ``attention_window``): query i
sees keys j with |i - j| <= r, in the stacks ``attention_window_layers`` names. Heads are
d_k = d_v = ``head_dim`` wide when the config sets it (the paper: d_model / h), so attention
is h * d_k wide between its projections and d_model wide outside them.

Nothing here imports flaxformer_lite or jax. The inputs are a nested mapping of parameters (the
``params`` collection; leaves may be boxed, anything with ``.value``), the config (read only
through its fields) and int token arrays `[batch, length]`. Every sequence is processed with
explicit masks built here: encoder padding keys (found by the pad id) are never attended to,
decoders are causal, and only real query positions are meaningful (callers compare those).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

Params = Mapping[str, Any]


# ----------------------------------------------------------------------------- parameters


def to_float64(tree: Any) -> Any:
    """Nested mapping of (possibly boxed) arrays -> the same nesting of float64 NumPy arrays."""
    if isinstance(tree, Mapping):
        return {k: to_float64(v) for k, v in tree.items()}
    return np.asarray(getattr(tree, "value", tree), dtype=np.float64)


def _row(tree: Any, i: int) -> Any:
    if isinstance(tree, Mapping):
        return {k: _row(v, i) for k, v in tree.items()}
    return tree[i]


def layer_params(stack: Params, num_layers: int) -> list[Params]:
    """Per-layer parameters of a stack: ``layers_0..layers_{N-1}``, or row i of every leaf of
    a scanned ``layers`` subtree (leaves stacked `[num_layers, ...]`)."""
    if "layers" in stack:
        return [_row(stack["layers"], i) for i in range(num_layers)]
    return [stack[f"layers_{i}"] for i in range(num_layers)]


# ----------------------------------------------------------------------------- positions


def sinusoid_table(length: int, dim: int, layout: str = "interleaved") -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i / dim)), PE(pos, 2i+1) = cos(same), `[length, dim]`.

    ``layout="halves"`` (Marian's): the sine of frequency i in channel i and its cosine in
    channel dim/2 + i."""
    table = np.zeros((length, dim))
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / 10000.0 ** (2 * i / dim)
            sin_at, cos_at = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, dim // 2 + i)
            table[pos, sin_at] = math.sin(angle)
            table[pos, cos_at] = math.cos(angle)
    return table


def rotation_matrix(position: int, dim: int, base: float = 10000.0) -> np.ndarray:
    """RoFormer's block rotation `[dim, dim]` at one position, in the half-split layout:
    channel pair (i, i + dim/2) is rotated by the angle position * theta_i,
    theta_i = base^(-2i / dim), i = 0 .. dim/2 - 1."""
    half = dim // 2
    r = np.zeros((dim, dim))
    for i in range(half):
        a = position * base ** (-2.0 * i / dim)
        c, s = math.cos(a), math.sin(a)
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def rotate(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """x `[batch, length, heads, head_dim]`, positions int `[batch, length]` -> x rotated:
    each head vector at position p is multiplied by ``rotation_matrix(p)``."""
    out = np.empty_like(x)
    b, n, _, d = x.shape
    for bi in range(b):
        for t in range(n):
            r = rotation_matrix(int(positions[bi, t]), d, base)
            out[bi, t] = x[bi, t] @ r.T
    return out


def relative_bucket(relative: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one relative position (key - query), as written in Mesh TensorFlow's
    ``_relative_position_bucket``: exact buckets for small distances, logarithmic ones up to
    max_distance, half of the buckets for each direction when bidirectional."""
    n = -relative
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            bucket += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    scaled = math.log(n / max_exact) / math.log(max_distance / max_exact)
    return bucket + min(max_exact + int(scaled * (num_buckets - max_exact)), num_buckets - 1)


def relative_bias(cfg: Any, table: np.ndarray, length: int, bidirectional: bool) -> np.ndarray:
    """`[heads, length, length]`: entry (h, i, j) is table[bucket(j - i), h]."""
    out = np.zeros((table.shape[1], length, length))
    for i in range(length):
        for j in range(length):
            bucket = relative_bucket(
                j - i, bidirectional, cfg.relative_num_buckets, cfg.relative_max_distance
            )
            out[:, i, j] = table[bucket]
    return out


# ----------------------------------------------------------------------------- sub-layers


def layer_norm(x: np.ndarray, p: Params, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm(x: np.ndarray, p: Params, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * p["scale"]


def norm(cfg: Any, p: Params, x: np.ndarray) -> np.ndarray:
    if cfg.norm_type == "rmsnorm":
        return rms_norm(x, p, cfg.layer_norm_epsilon)
    return layer_norm(x, p, cfg.layer_norm_epsilon)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def dense(p: Params, x: np.ndarray) -> np.ndarray:
    """x `[..., in]` @ kernel `[in, out]` (+ bias `[out]` when present)."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def feed_forward(cfg: Any, p: Params, x: np.ndarray) -> np.ndarray:
    """Equation (2), or its GELU / gated variants. `[b, n, d]` -> `[b, n, d]`."""
    act = {
        "relu": lambda z: np.maximum(z, 0.0),
        "gelu": gelu_tanh,
        "gelu_exact": gelu_erf,
        "silu": silu,
        "swiglu": silu,
        "geglu": gelu_tanh,
    }[cfg.activation]
    h = act(dense(p["wi"], x))
    if cfg.activation in ("swiglu", "geglu"):
        h = h * dense(p["wi_up"], x)
    return dense(p["wo"], h)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def scaled_dot_product_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    allowed: np.ndarray,
    bias: np.ndarray | None = None,
    scaled: bool = True,
) -> np.ndarray:
    """Equation (1) per head. q `[b, m, h, dk]`, k and v `[b, n, hkv, dk]`, allowed bool
    `[b, m, n]`, bias `[h, m, n]` added to the logits -> `[b, m, h, dk]`. Query head i reads
    key/value head i // (h // hkv). A query with no allowed key gets zeros. ``scaled=False``:
    T5's logits QK^T, not divided by sqrt(d_k)."""
    b, m, h, dk = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for head in range(h):
        kh, vh = k[:, :, head // group], v[:, :, head // group]  # [b, n, dk]
        logits = np.einsum("bmd,bnd->bmn", q[:, :, head], kh)
        if scaled:
            logits = logits / math.sqrt(dk)
        if bias is not None:
            logits = logits + bias[head][None]
        logits = np.where(allowed, logits, -np.inf)
        rows = allowed.any(-1)  # [b, m]
        weights = softmax(np.where(rows[..., None], logits, 0.0)) * rows[..., None]
        out[:, :, head] = np.einsum("bmn,bnd->bmd", np.where(allowed, weights, 0.0), vh)
    return out


def _heads(p: Params, x: np.ndarray) -> np.ndarray:
    """x `[b, n, d]` @ kernel `[d, heads, dk]` (+ bias `[heads, dk]`)."""
    y = np.einsum("bnd,dhk->bnhk", x, p["kernel"])
    return y + p["bias"] if "bias" in p else y


def _qkv(p: Params, x_q: np.ndarray, x_kv: np.ndarray):
    """Queries from x_q, keys and values from x_kv, from separate or fused kernels."""
    if "qkv" not in p:
        return _heads(p["query"], x_q), _heads(p["key"], x_kv), _heads(p["value"], x_kv)
    f = p["qkv"]
    if "kernel" in f:  # [d, 3, heads, dk]: query, key, value
        kernels = [f["kernel"][:, j] for j in range(3)]
        biases = [f["bias"][j] for j in range(3)] if "bias" in f else [None] * 3
    else:  # query_kernel [d, heads, dk], kv_kernel [d, 2, kv_heads, dk]
        kernels = [f["query_kernel"], f["kv_kernel"][:, 0], f["kv_kernel"][:, 1]]
        biases = (
            [f["query_bias"], f["kv_bias"][0], f["kv_bias"][1]] if "query_bias" in f else [None] * 3
        )
    out = []
    for x, kernel, bias in zip((x_q, x_kv, x_kv), kernels, biases, strict=True):
        out.append(
            _heads({"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}, x)
        )
    return tuple(out)


def head_width(cfg: Any) -> int:
    """d_k = d_v of the paper's section 3.2.2: ``cfg.head_dim`` when set, else d_model / h."""
    return cfg.head_dim or cfg.d_model // cfg.num_heads


def multi_head_attention(
    cfg: Any,
    p: Params,
    x_q: np.ndarray,
    x_kv: np.ndarray,
    allowed: np.ndarray,
    *,
    rotary_positions: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O. x_q `[b, m, d]`, x_kv `[b, n, d]`,
    allowed `[b, m, n]`; rotary_positions `[b, m]` (self-attention only, m == n); bias
    `[h, m, n]` on the logits (T5's relative position bias). Heads are ``head_width(cfg)``
    wide: the projections must have that shape."""
    q, k, v = _qkv(p, x_q, x_kv)
    want = (cfg.num_heads, head_width(cfg))
    if q.shape[2:] != want or k.shape[3] != want[1] or p["out"]["kernel"].shape[:2] != want:
        raise ValueError(
            f"attention parameters do not have heads x head_dim {want}: query {q.shape[2:]}, "
            f"key {k.shape[2:]}, output kernel {p['out']['kernel'].shape}"
        )
    if rotary_positions is not None:
        q, k = rotate(q, rotary_positions), rotate(k, rotary_positions)
    scaled = getattr(cfg, "scale_attention_logits", True)
    heads = scaled_dot_product_attention(q, k, v, allowed, bias, scaled)
    out = np.einsum("bnhk,hkd->bnd", heads, p["out"]["kernel"])
    return out + p["out"]["bias"] if "bias" in p["out"] else out


def sub_layer(cfg: Any, norm_p: Params, x: np.ndarray, f) -> np.ndarray:
    """Post-LN LayerNorm(x + f(x)) (the paper) or pre-LN x + f(LayerNorm(x))."""
    if cfg.norm_position == "pre":
        return x + f(norm(cfg, norm_p, x))
    return norm(cfg, norm_p, x + f(x))


# ----------------------------------------------------------------------------- stacks


def embed(cfg: Any, table: np.ndarray, stack: Params, tokens: np.ndarray) -> np.ndarray:
    """Section 3.4/3.5: E[token] * sqrt(d_model) (unless scale_embeddings=False) + absolute
    position (rotary/none add none)."""
    d = table.shape[1]
    x = table[tokens] * (math.sqrt(d) if cfg.scale_embeddings else 1.0)
    n = tokens.shape[1]
    if cfg.position == "sinusoidal":
        x = x + sinusoid_table(n, d, cfg.sinusoid_layout)[None]
    elif cfg.position == "learned":
        x = x + stack["embedder"]["positions"]["embedding"][:n][None]
    return x


def _positions(tokens: np.ndarray) -> np.ndarray:
    return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)


def _window(cfg: Any, stack: str, n: int) -> np.ndarray:
    """bool `[1, n, n]`: |i - j| <= r where ``stack``'s self-attention is restricted, else all."""
    r = getattr(cfg, "attention_window", None)
    if r is None or getattr(cfg, "attention_window_layers", "both") not in ("both", stack):
        return np.ones((1, n, n), bool)
    i = np.arange(n)
    return (np.abs(i[:, None] - i[None, :]) <= r)[None]


def encoder(cfg: Any, p: Params, table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """int `[b, s]` -> `[b, s, d_model]`; padding keys are masked out."""
    real = tokens != cfg.pad_id
    allowed = real[:, None, :] & real[:, :, None] & _window(cfg, "encoder", tokens.shape[1])
    rot = _positions(tokens) if cfg.position == "rotary" else None
    bias = None
    if cfg.position == "relative":  # one table for the whole stack, both directions
        bias = relative_bias(cfg, p["relative_bias"]["embedding"], tokens.shape[1], True)
    x = embed(cfg, table, p, tokens)
    for lp in layer_params(p, cfg.num_encoder_layers):
        x = sub_layer(
            cfg,
            lp["self_attention_norm"],
            x,
            lambda h, lp=lp: multi_head_attention(
                cfg, lp["self_attention"], h, h, allowed, rotary_positions=rot, bias=bias
            ),
        )
        x = sub_layer(cfg, lp["mlp_norm"], x, lambda h, lp=lp: feed_forward(cfg, lp["mlp"], h))
    if cfg.norm_position == "pre":
        x = norm(cfg, p["final_norm"], x)
    return x


def decoder(
    cfg: Any,
    p: Params,
    table: np.ndarray,
    decoder_inputs: np.ndarray,
    encoded: np.ndarray | None = None,
    source: np.ndarray | None = None,
) -> np.ndarray:
    """Shifted decoder inputs int `[b, t]` (+ encoder output `[b, s, d]` and source tokens
    `[b, s]`) -> final hidden states `[b, t, d_model]`. Self-attention is causal (which alone
    keeps real positions off padding); encoder-decoder attention skips padded source positions."""
    n = decoder_inputs.shape[1]
    causal = np.tril(np.ones((n, n), bool))[None] & _window(cfg, "decoder", n)
    # Causal only: every key at or before a real position is real (or the decoder-start token,
    # which Marian makes the pad id), as in Hugging Face's decoders.
    self_allowed = np.broadcast_to(causal, (decoder_inputs.shape[0], n, n))
    rot = _positions(decoder_inputs) if cfg.position == "rotary" else None
    bias = None
    if cfg.position == "relative":  # one table for the whole stack, causal buckets
        bias = relative_bias(cfg, p["relative_bias"]["embedding"], n, False)
    cross_allowed = None
    if encoded is not None:
        cross_allowed = np.broadcast_to(
            (source != cfg.pad_id)[:, None, :], (source.shape[0], n, source.shape[1])
        )
    x = embed(cfg, table, p, decoder_inputs)
    for lp in layer_params(p, cfg.num_decoder_layers):
        x = sub_layer(
            cfg,
            lp["self_attention_norm"],
            x,
            lambda h, lp=lp: multi_head_attention(
                cfg, lp["self_attention"], h, h, self_allowed, rotary_positions=rot, bias=bias
            ),
        )
        if encoded is not None:
            x = sub_layer(
                cfg,
                lp["cross_attention_norm"],
                x,
                lambda h, lp=lp: multi_head_attention(
                    cfg, lp["cross_attention"], h, encoded, cross_allowed
                ),
            )
        x = sub_layer(cfg, lp["mlp_norm"], x, lambda h, lp=lp: feed_forward(cfg, lp["mlp"], h))
    if cfg.norm_position == "pre":
        x = norm(cfg, p["final_norm"], x)
    return x


def output_logits(cfg: Any, p: Params, table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Section 3.4: the pre-softmax projection is the embedding transposed (tied), else its own
    kernel `[d_model, vocab]`; plus Marian's final logits bias when the config has one. T5 v1.0
    (``scale_decoder_output``) first multiplies x by d_model^-1/2."""
    if getattr(cfg, "scale_decoder_output", False):
        x = x / math.sqrt(x.shape[-1])
    logits = x @ table.T if cfg.tie_output_embedding else x @ p["logits"]["kernel"]
    return logits + p["logits_bias"] if cfg.logits_bias else logits


def shift_right(targets: np.ndarray, bos_id: int) -> np.ndarray:
    """Decoder inputs: BOS, then targets[:, :-1]."""
    out = np.full_like(targets, bos_id)
    out[:, 1:] = targets[:, :-1]
    return out


# ----------------------------------------------------------------------------- models


def encoder_decoder_logits(
    cfg: Any, params: Params, inputs: np.ndarray, targets: np.ndarray
) -> np.ndarray:
    """EncoderDecoder: source `[b, s]`, unshifted targets `[b, t]` -> logits `[b, t, vocab]`."""
    p = to_float64(params)
    source_table = p["source_embedding"]["embedding"]
    target_table = source_table if cfg.share_embeddings else p["target_embedding"]["embedding"]
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    encoded = encoder(cfg, p["encoder"], source_table, inputs)
    x = decoder(cfg, p["decoder"], target_table, shift_right(targets, cfg.bos_id), encoded, inputs)
    return output_logits(cfg, p["decoder"], target_table, x)


def decoder_only_logits(cfg: Any, params: Params, tokens: np.ndarray) -> np.ndarray:
    """DecoderOnly: tokens `[b, n]` -> logits `[b, n, vocab]` (position t predicts tokens[t])."""
    p = to_float64(params)
    table = p["embedding"]["embedding"]
    x = decoder(cfg, p["decoder"], table, shift_right(np.asarray(tokens), cfg.bos_id))
    return output_logits(cfg, p["decoder"], table, x)


def classifier_logits(cfg: Any, params: Params, inputs: np.ndarray) -> np.ndarray:
    """EncoderClassifier: tokens `[b, n]` -> class logits `[b, classes]`; "mean" pools over the
    real (non-pad) tokens only, "first" takes position 0, "attention" weighs the real tokens by
    softmax_t(h_t . q / sqrt(d)) with the learned query q."""
    p = to_float64(params)
    inputs = np.asarray(inputs)
    encoded = encoder(cfg, p["encoder"], p["embedding"]["embedding"], inputs)
    if cfg.pooling == "first":
        pooled = encoded[:, 0]
    elif cfg.pooling == "attention":
        rows = []
        for b in range(inputs.shape[0]):
            h = encoded[b, inputs[b] != cfg.pad_id]  # real tokens only
            scores = h @ p["pooling_query"] / math.sqrt(h.shape[-1])
            rows.append(softmax(scores) @ h)
        pooled = np.stack(rows)
    else:
        pooled = np.stack(
            [encoded[b, inputs[b] != cfg.pad_id].mean(0) for b in range(inputs.shape[0])]
        )
    return dense(p["head"], pooled)
