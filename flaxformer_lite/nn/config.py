"""TransformerConfig: every model hyper-parameter, frozen, validated at construction.

Defaults are the paper's base model (Vaswani et al. 2017, Table 3). The config round-trips
through JSON (``to_json`` / ``from_json``) so it is saved beside every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from flaxformer_lite.core.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from flaxformer_lite.ops.activations import ACTIVATIONS as _ACTIVATION_FUNCTIONS
from flaxformer_lite.ops.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from flaxformer_lite.ops.quantize import INT8_KERNELS, QUANTIZATIONS

ACTIVATIONS = tuple(_ACTIVATION_FUNCTIONS)
NORM_POSITIONS = ("post", "pre")
NORM_TYPES = ("layernorm", "rmsnorm")
POSITIONS = ("sinusoidal", "learned", "rotary", "relative", "none")
SINUSOID_LAYOUTS = ("interleaved", "halves")
DTYPES = ("float32", "bfloat16", "float16")
POOLINGS = ("mean", "first", "attention")
ATTENTION_WINDOW_LAYERS = ("both", "encoder", "decoder")
# The dropout rates, each a number in [0, 1) that only training reads.
DROPOUT_RATES = (
    "dropout_rate",
    "attention_dropout_rate",
    "activation_dropout_rate",
    "word_dropout_rate",
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder, decoder-only and encoder-only models.

    Attributes:
      vocab_size: source vocabulary (and target vocabulary unless ``target_vocab_size``).
      target_vocab_size: target vocabulary when it differs from the source one; None = same.
      d_model: width of the residual stream and embeddings.
      num_heads: query heads per attention layer.
      num_kv_heads: key/value heads (None = num_heads; 1 = multi-query; else grouped-query).
      d_ff: hidden width of the position-wise feed-forward block.
      num_encoder_layers, num_decoder_layers: stack depths.
      dropout_rate: residual dropout on every sub-layer output and on the embedding sums.
      attention_dropout_rate: dropout on the attention weights.
      max_len: longest sequence the position encoding supports.
      activation: "relu" (paper), "gelu" (tanh approximation), "gelu_exact" (erf), "silu"
        (swish, Marian's), or gated "swiglu"/"geglu".
      norm_position: "post" (paper: LayerNorm(x + Sublayer(x))) or "pre" (x + Sublayer(LN(x))).
      norm_type: "layernorm" or "rmsnorm".
      layer_norm_epsilon: 1e-6 as in the reference implementation (Marian/BART: 1e-5).
      position: "sinusoidal" (paper), "learned", "rotary" (relative, inside attention),
        "relative" (T5's bucketed relative position bias on the self-attention logits: one
        learned table `[relative_num_buckets, num_heads]` per layer stack shared by its layers,
        bidirectional buckets in the encoder, causal ones in the decoder) or "none".
      sinusoid_layout: channel order of the sinusoids: "interleaved" (the paper: sin on even
        channels, cos on odd ones) or "halves" (Marian/fairseq: the d_model/2 sines, then the
        d_model/2 cosines, same frequencies).
      scale_embeddings: multiply looked-up token embeddings by sqrt(d_model) (the paper, and
        Marian's ``scale_embedding``); False adds positions to the raw embeddings.
      share_embeddings: one embedding table for source and target (needs equal vocabularies).
      tie_output_embedding: the pre-softmax projection is the target embedding transposed.
      logits_bias: a learned bias `[target_vocab]` added to the output logits (Marian's
        ``final_logits_bias``).
      use_bias: biases in the attention and feed-forward projections.
      dtype: compute dtype ("float32", "bfloat16", "float16"); softmax and loss stay float32.
      param_dtype: storage dtype of the parameters.
      attention_implementation: "xla" (reference), "cudnn" (cuDNN flash attention through
        jax.nn.dot_product_attention where the GPU, dtype and shapes allow it, else the
        reference with one warning) or "blockwise" (memory linear in length, future key blocks
        skipped; no attention dropout).
      remat: recompute each layer's activations in the backward pass (jax.checkpoint) instead
        of storing them: less memory for deeper models or longer sequences, ~1/3 more compute.
      scan_layers: build each layer stack with ``flax.linen.scan`` over one layer: the
        parameters of layer i are row i of arrays stacked on a leading axis of size
        num_*_layers (logical axis "layers", ``.../layers/...`` instead of ``layers_{i}``),
        and one compiled layer body replaces N (faster compilation of deep models). Composes
        with ``remat``. Cached decoding runs on the unrolled layout: ``generate`` and the
        translator convert with ``models.unstack_layers``, which gives identical outputs.
      fused_qkv: self-attention projects queries, keys and values with fused kernels instead
        of three: one `[embed, 3, num_heads, head_dim]` kernel (multi-head), or a query kernel
        `[embed, num_heads, head_dim]` and a key/value kernel `[embed, 2, kv_heads, head_dim]`
        (grouped/multi-query); tensor parallelism splits the query heads and the kv heads (or,
        when it does not divide them, the key/value kernel's d_model axis). Cross-attention
        keeps separate query and key/value projections (its keys and values come from the
        encoder output).
      num_classes: labels of the EncoderClassifier head.
      pooling: how the classifier pools the encoder output: "mean" over real tokens, "first"
        (position 0, a classification token) or "attention" (a softmax over real tokens of
        their dot products with a learned query, scaled by 1/sqrt(d_model); the weights are
        sown as ``pooling_weights``).
      pad_id: the padding token id in every input (default ``special_ids.PAD_ID``, what the
        tokenizers and the data pipeline use; ``generate`` pads its outputs with it too).
        Padding is found by this id: a real token must never equal it.
      bos_id: the decoder-start token, the first decoder input (targets are shifted right
        behind it; default ``special_ids.BOS_ID``; ``generate`` starts decoding from it).
        Hugging Face calls it ``decoder_start_token_id``; Marian uses its pad id, which works
        because the decoder's self-attention masks by causality, never by pad id.
      eos_id: the end-of-sequence token every target ends with; decoding stops at it.
      unk_id: the id of out-of-vocabulary pieces.
      num_experts: feed-forward experts of a mixture-of-experts layer (``moe.MoeBlock``);
        0 = every layer is dense.
      num_experts_per_token: experts each token is routed to (top-k).
      expert_capacity_factor: slots per expert = ceil(factor x tokens x k / experts) per
        sequence during training, tokens counting its real (non-pad) tokens only
        (assignments beyond are dropped); None = no limit.
        Evaluation and decoding never drop.
      moe_every: layer i of a stack is a mixture-of-experts layer when (i + 1) % moe_every
        == 0 (1: every layer, 2: every second layer, as in GShard and Switch); must be 1 with
        ``scan_layers`` (one scanned layer body).
      moe_aux_loss_weight: weight of the load-balancing loss (mean over MoE layers) in the
        training objective.
      router_z_loss_weight: weight of the router z-loss (mean over MoE layers).
      attention_window: restricted self-attention (the paper's neighbourhood of size r; None =
        full attention): a query sees the keys within distance r *on each side*, ``|i - j| <= r``
        (``masks.local_mask``), up to 2r + 1 keys; in the decoder, causal as well, a sliding
        window of itself and the r keys before it. Cross-attention is never restricted. With
        "blockwise" attention key blocks outside the window are skipped (work linear in
        length); cuDNN takes the decoder's sliding window and refuses the encoder's (the
        reference runs, with a warning). Cached decoding keeps a ring buffer of the last r
        keys/values per layer, so its memory is constant in the generated length.
      attention_window_layers: which self-attentions use ``attention_window``: "both",
        "encoder" or "decoder" (a decoder-only model's stack is "decoder").
      relative_num_buckets: buckets of ``position="relative"`` (T5: 32); even, >= 4. The
        encoder gives half to keys before the query and half to keys after it.
      relative_max_distance: distances from this on share the last bucket (T5: 128); must
        exceed relative_num_buckets // 2.
      head_dim: width of each attention head (queries, keys and values); None =
        d_model // num_heads (then d_model must be divisible by num_heads). Set apart from
        d_model, the projections are `[d_model, heads, head_dim]` and the output projection
        `[heads, head_dim, d_model]`, so attention is num_heads * head_dim wide inside and
        d_model wide outside. ``effective_head_dim`` is the width in use either way.
      quantization: None (float) or "int8": inference with int8 weights and per-row int8
        activations (``quantize``: the parameters must come from ``quantize.quantize_params``;
        encoder-decoder and decoder-only models; mixture-of-experts blocks stay float).
      int8_kernel: what multiplies the int8 matrices on a CPU: "onednn" (oneDNN's VNNI / AMX
        kernels, ``ops.onednn_int8``: x86-64 Linux, a CPU with VNNI or AMX), "xla" (XLA's
        int8 dot), or "auto" (oneDNN where it loads, for matrices of 512 input rows and
        512 x 512 entries or more, ``quantize.int8_product``; XLA otherwise). The int32
        products are exact either way, so the choice changes speed, never a result; other
        platforms always use XLA's dot.

    BART / mBART (``interop/bart.py``; defaults leave every other model as it was):
      learned_position_offset: rows the learned position table keeps before position 0
        (Hugging Face BART/mBART: 2); inert unless ``position="learned"`` (checked whatever
        the position kind, as the relative buckets are). The table is `[max_len + offset,
        d_model]` and position p reads row p + offset; the first rows are parameters no
        position reads (kept so that a checkpoint round-trips). 0: `[max_len, d_model]`.
      embedding_norm: a norm (``norm_type``) on the embedding sum (tokens + positions) before
        the first layer and its dropout, in every stack (BART's ``layernorm_embedding``).
      activation_dropout_rate: dropout on the hidden units of the dense feed-forward blocks,
        after the activation (BART's ``activation_dropout``; mixture-of-experts blocks have
        none); training only.

    Llama family (``interop/llama.py``; defaults leave every other model as it was):
      rope_theta: the base of the rotary frequencies ``theta^(-2i/head_dim)``: a number > 0
        (Hugging Face's ``rope_theta``: 10000 as RoFormer, Llama 3 500000), the frequencies
        then computed exactly as transformers computes them (``ops.positions.rope_inv_freq``);
        or None, 10000 computed as this library always has (float32 JAX; an ulp apart from
        transformers' in some channels), which keeps earlier models bitwise as they were.
      rope_scaling_factor: Llama 3's ``rope_scaling`` (``rope_type="llama3"``): None (off) or
        a number >= 1 that divides the low rotary frequencies (wavelength above
        ``rope_original_max_len / rope_low_freq_factor``), interpolating smoothly up to the
        high ones (wavelength below ``rope_original_max_len / rope_high_freq_factor``, kept),
        exactly as transformers computes ``inv_freq`` (``ops.positions.rope_inv_freq``).
      rope_low_freq_factor, rope_high_freq_factor: that interpolation's bounds (Llama 3.1: 1
        and 4); numbers > 0 with low < high. Read only with ``rope_scaling_factor``.
      rope_original_max_len: the context length the model was pretrained at (Llama 3.1:
        8192); a positive int. Read only with ``rope_scaling_factor``.
      qkv_bias: biases on the query, key and value projections whatever ``use_bias`` (Qwen2:
        ``use_bias=False, qkv_bias=True``, no bias on the attention output or the MLP).

    T5 (``interop/t5.py``; defaults leave every other model as it was):
      scale_attention_logits: multiply the query-key dot products by 1/sqrt(head_dim) (the
        paper); False leaves them unscaled, as T5 does (its query kernels absorb the scaling).
      scale_decoder_output: multiply the decoder's final output by d_model**-0.5 before the
        output projection (T5 v1.0, whose tied embedding table makes the logits; Hugging Face's
        ``scale_decoder_outputs``). False: the paper's and every other model's logits.
    Low-resource regularization (defaults leave every model as it was):
      word_dropout_rate: word dropout (Gal & Ghahramani 2016; Sennrich & Zhang 2019): each
        input token's whole embedding row zeroed with this probability, the kept rows scaled
        by 1 / (1 - rate), before positions are added, in every stack (the encoder's source
        tokens, the decoder's shifted target tokens); training only.
    """

    vocab_size: int = 37000
    target_vocab_size: int | None = None
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    max_len: int = 256
    activation: str = "relu"
    norm_position: str = "post"
    norm_type: str = "layernorm"
    layer_norm_epsilon: float = 1e-6
    position: str = "sinusoidal"
    share_embeddings: bool = True
    tie_output_embedding: bool = True
    logits_bias: bool = False
    scale_embeddings: bool = True
    sinusoid_layout: str = "interleaved"
    use_bias: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_implementation: str = "xla"
    remat: bool = False
    scan_layers: bool = False
    fused_qkv: bool = False
    num_classes: int = 2
    pooling: str = "mean"
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    unk_id: int = UNK_ID
    num_experts: int = 0
    num_experts_per_token: int = 2
    expert_capacity_factor: float | None = 1.25
    moe_every: int = 1
    moe_aux_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.001
    attention_window: int | None = None
    attention_window_layers: str = "both"
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    head_dim: int | None = None
    quantization: str | None = None
    int8_kernel: str = "auto"
    # BART / mBART (interop/bart.py).
    learned_position_offset: int = 0
    embedding_norm: bool = False
    activation_dropout_rate: float = 0.0
    # Llama family (interop/llama.py).
    rope_theta: float | None = None
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qkv_bias: bool = False
    # T5 (issue 25, interop/t5.py).
    scale_attention_logits: bool = True
    scale_decoder_output: bool = False
    # Low-resource regularization.
    word_dropout_rate: float = 0.0

    def __post_init__(self) -> None:
        # Grouped by concern, each group checking its fields' types before their values; a
        # group may rely on the groups before it (sizes are positive integers by the time the
        # vocabulary, special ids and positions are checked against them). A config with one
        # bad value gets that value's message; with several, the first group's.
        self._check_sizes()
        self._check_flags_and_rates()
        self._check_choices()
        self._check_vocabulary()
        self._check_special_ids()
        self._check_kernels()
        self._check_moe()
        self._check_positions()
        self._check_rope()

    def _check_sizes(self) -> None:
        """Vocabulary, width, head, depth and length sizes: positive integers; d_model splits
        into num_heads heads unless head_dim is set; num_heads is a multiple of the kv heads."""
        positive = (
            "vocab_size d_model num_heads d_ff max_len num_classes"
            " num_encoder_layers num_decoder_layers"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be a positive integer; got {value!r}"
                )
        for name in ("target_vocab_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            bad = not isinstance(value, int) or isinstance(value, bool) or value <= 0
            if value is not None and bad:
                raise ValueError(
                    f"TransformerConfig.{name} must be None or a positive integer; got {value!r}"
                )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"TransformerConfig.d_model ({self.d_model}) must be divisible by "
                f"num_heads ({self.num_heads}) when head_dim is None (head_dim = d_model // "
                "num_heads); or set head_dim"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def _check_flags_and_rates(self) -> None:
        """The on/off switches are bools; dropout rates are numbers in [0, 1); the norm epsilon
        a number > 0."""
        bools = (
            "share_embeddings tie_output_embedding logits_bias scale_embeddings use_bias remat"
            " scan_layers fused_qkv embedding_norm qkv_bias"
            " scale_attention_logits scale_decoder_output"
        )
        for name in bools.split():
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"TransformerConfig.{name} must be a bool; got {value!r}")
        rates = DROPOUT_RATES
        for name in (*rates, "layer_norm_epsilon"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"TransformerConfig.{name} must be a number; got {value!r}")
        for name in rates:
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1); got {value!r}")
        if self.layer_norm_epsilon <= 0:
            raise ValueError(
                f"TransformerConfig.layer_norm_epsilon must be > 0; got {self.layer_norm_epsilon}"
            )

    def _check_choices(self) -> None:
        """Every string option is one of its listed values."""
        choices = {
            "activation": ACTIVATIONS,
            "norm_position": NORM_POSITIONS,
            "norm_type": NORM_TYPES,
            "position": POSITIONS,
            "sinusoid_layout": SINUSOID_LAYOUTS,
            "dtype": DTYPES,
            "param_dtype": DTYPES,
            "attention_implementation": ATTENTION_IMPLEMENTATIONS,
            "pooling": POOLINGS,
            "attention_window_layers": ATTENTION_WINDOW_LAYERS,
            "quantization": QUANTIZATIONS,
            "int8_kernel": INT8_KERNELS,
        }
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"TransformerConfig.{name} must be one of {valid}; got {getattr(self, name)!r}"
                )

    def _check_vocabulary(self) -> None:
        """One shared embedding table needs one vocabulary size on both sides."""
        if self.share_embeddings and self.output_vocab_size != self.vocab_size:
            raise ValueError(
                "TransformerConfig.share_embeddings=True needs target_vocab_size equal to "
                f"vocab_size (or None); got {self.target_vocab_size} vs {self.vocab_size}"
            )

    def _check_special_ids(self) -> None:
        """pad_id, bos_id, eos_id and unk_id are integers inside both vocabularies."""
        for name in ("pad_id", "bos_id", "eos_id", "unk_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"TransformerConfig.{name} must be an integer; got {value!r}")
        for name in ("pad_id", "bos_id", "eos_id", "unk_id"):
            value = getattr(self, name)
            if not 0 <= value < min(self.vocab_size, self.output_vocab_size):
                raise ValueError(
                    f"TransformerConfig.{name} must be in [0, vocab_size); got {value} "
                    f"with vocab_size={self.vocab_size}"
                )

    def _check_kernels(self) -> None:
        """Combinations the compute paths do not implement: attention dropout outside the
        'xla' attention, int8 quantization of scanned layers."""
        if self.attention_implementation != "xla" and self.attention_dropout_rate > 0:
            raise ValueError(
                f"TransformerConfig.attention_dropout_rate must be 0 with "
                f"attention_implementation={self.attention_implementation!r} (only 'xla' "
                f"implements attention dropout); got {self.attention_dropout_rate}"
            )
        if self.quantization is not None and self.scan_layers:
            raise ValueError(
                f"TransformerConfig.quantization={self.quantization!r} needs scan_layers=False: "
                "int8 parameters come from quantize.quantize_params, which takes unrolled "
                "layers (models.unrolled; generate and the Translator unroll a scanned model)"
            )

    def _check_moe(self) -> None:
        """Mixture of experts: counts, loss weights, capacity, top-k within the experts, and
        one layer kind for a scanned stack."""
        for name in ("num_experts", "num_experts_per_token", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be a non-negative integer; got {value!r}"
                )
        for name in ("moe_aux_loss_weight", "router_z_loss_weight"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TransformerConfig.{name} must be a number >= 0; got {value!r}")
        factor = self.expert_capacity_factor
        if factor is not None and (
            not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0
        ):
            raise ValueError(
                f"TransformerConfig.expert_capacity_factor must be None or > 0; got {factor!r}"
            )
        if self.moe_every < 1:
            raise ValueError(f"TransformerConfig.moe_every must be >= 1; got {self.moe_every}")
        if self.num_experts and not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                "TransformerConfig.num_experts_per_token must be in [1, num_experts="
                f"{self.num_experts}]; got {self.num_experts_per_token}"
            )
        if self.num_experts and self.scan_layers and self.moe_every != 1:
            raise ValueError(
                "TransformerConfig.moe_every must be 1 with scan_layers=True (one scanned "
                f"layer body serves every layer); got {self.moe_every}"
            )

    def _check_positions(self) -> None:
        """What the position encoding needs: even widths for sinusoids (d_model) and rotary
        (head_dim); a positive attention window; the relative buckets (checked whatever the
        position kind, so a config stays valid when only ``position`` changes)."""
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(
                f"TransformerConfig.d_model must be even for sinusoidal positions; "
                f"got {self.d_model}"
            )
        if self.position == "rotary" and self.effective_head_dim % 2:
            raise ValueError(
                "TransformerConfig.head_dim must be even for rotary positions (channel pairs "
                f"are rotated); got head_dim={self.head_dim}, effective width "
                f"{self.effective_head_dim} (d_model / num_heads when head_dim is None)"
            )
        offset = self.learned_position_offset
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(
                "TransformerConfig.learned_position_offset must be an integer >= 0 (rows of the "
                f"learned position table before position 0; BART: 2); got {offset!r}"
            )
        window = self.attention_window
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1
        ):
            raise ValueError(
                f"TransformerConfig.attention_window must be None or a positive integer; got "
                f"{window!r}"
            )
        self._check_relative()

    def _check_rope(self) -> None:
        """Rotary frequencies: theta None or > 0; Llama 3 scaling None or a factor >= 1 with
        0 < low < high frequency factors and a positive original length."""

        def number(name: str) -> float:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"TransformerConfig.{name} must be a number > 0; got {value!r}")
            return value

        if self.rope_theta is not None:
            number("rope_theta")
        low, high = number("rope_low_freq_factor"), number("rope_high_freq_factor")
        original = self.rope_original_max_len
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ValueError(
                f"TransformerConfig.rope_original_max_len must be a positive integer; got "
                f"{original!r}"
            )
        factor = self.rope_scaling_factor
        if factor is None:
            return
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor >= 1:
            raise ValueError(
                "TransformerConfig.rope_scaling_factor must be None (no Llama 3 scaling) or a "
                f"number >= 1; got {factor!r}"
            )
        if not low < high:
            raise ValueError(
                f"TransformerConfig.rope_low_freq_factor ({low}) must be below "
                f"rope_high_freq_factor ({high}) with rope_scaling_factor set"
            )

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """Llama 3 scaling as ``(factor, low_freq_factor, high_freq_factor, original_max_len)``
        (what ``ops.positions.rope_inv_freq`` takes), or None."""
        if self.rope_scaling_factor is None:
            return None
        return (
            float(self.rope_scaling_factor),
            float(self.rope_low_freq_factor),
            float(self.rope_high_freq_factor),
            int(self.rope_original_max_len),
        )

    def _check_relative(self) -> None:
        """T5 relative-position buckets: an even count >= 4, and a max distance past half."""
        for name in ("relative_num_buckets", "relative_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be a positive integer; got {value!r}"
                )
        if self.relative_num_buckets < 4 or self.relative_num_buckets % 2:
            raise ValueError(
                "TransformerConfig.relative_num_buckets must be even and >= 4; got "
                f"{self.relative_num_buckets}"
            )
        if self.relative_max_distance <= self.relative_num_buckets // 2:
            raise ValueError(
                "TransformerConfig.relative_max_distance must exceed relative_num_buckets // 2 "
                f"= {self.relative_num_buckets // 2}; got {self.relative_max_distance}"
            )

    def self_attention_window(self, stack: str) -> int | None:
        """``attention_window`` where it applies to ``stack`` ("encoder"/"decoder"), else None."""
        if self.attention_window_layers in ("both", stack):
            return self.attention_window
        return None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (from 0) of a stack has a mixture-of-experts block."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    # Derived sizes.
    @property
    def effective_head_dim(self) -> int:
        """The width of each attention head: ``head_dim``, or d_model // num_heads if None."""
        return self.head_dim or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def output_vocab_size(self) -> int:
        return self.target_vocab_size or self.vocab_size

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    # Presets.
    @classmethod
    def base(cls, **overrides: Any) -> TransformerConfig:
        """The paper's base model: 512 wide, 8 heads, d_ff 2048, 6+6 layers, dropout 0.1."""
        kw: dict[str, Any] = dict(
            d_model=512,
            num_heads=8,
            d_ff=2048,
            num_encoder_layers=6,
            num_decoder_layers=6,
            dropout_rate=0.1,
        )
        return cls(**{**kw, **overrides})

    @classmethod
    def big(cls, **overrides: Any) -> TransformerConfig:
        """The paper's big model: 1024 wide, 16 heads, d_ff 4096, 6+6 layers, dropout 0.3."""
        kw: dict[str, Any] = dict(
            d_model=1024,
            num_heads=16,
            d_ff=4096,
            num_encoder_layers=6,
            num_decoder_layers=6,
            dropout_rate=0.3,
        )
        return cls(**{**kw, **overrides})

    def replace(self, **changes: Any) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields {unknown}; valid: {sorted(fields)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        return cls.from_dict(json.loads(text))
