"""TransformerConfig: presets, JSON round trip, and every validation error naming its field."""

import pytest

from flaxformer_lite import TransformerConfig


def test_paper_defaults_and_presets():
    base = TransformerConfig.base()
    assert (base.d_model, base.num_heads, base.d_ff) == (512, 8, 2048)
    assert (base.num_encoder_layers, base.num_decoder_layers, base.dropout_rate) == (6, 6, 0.1)
    assert base.norm_position == "post" and base.position == "sinusoidal"
    assert base.activation == "relu" and base.layer_norm_epsilon == 1e-6
    big = TransformerConfig.big(vocab_size=100)
    assert (big.d_model, big.num_heads, big.d_ff, big.dropout_rate) == (1024, 16, 4096, 0.3)
    assert big.vocab_size == 100
    assert TransformerConfig() == base


def test_json_round_trip():
    cfg = TransformerConfig(
        vocab_size=99,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        target_vocab_size=None,
        activation="swiglu",
        dtype="bfloat16",
    )
    assert TransformerConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown TransformerConfig fields"):
        TransformerConfig.from_dict({"d_model": 8, "typo": 1})


def test_frozen():
    with pytest.raises(AttributeError):
        TransformerConfig().d_model = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=100, num_heads=8), "d_model"),
        (dict(d_model=0), "d_model"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(num_heads=0), "num_heads"),
        (dict(d_ff=0), "d_ff"),
        (dict(num_encoder_layers=0), "num_encoder_layers"),
        (dict(max_len=0), "max_len"),
        (dict(num_kv_heads=3), "num_heads"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(dropout_rate=1.0), "dropout_rate"),
        (dict(dropout_rate=-0.1), "dropout_rate"),
        (dict(attention_dropout_rate=1.5), "attention_dropout_rate"),
        (dict(activation="tanh"), "activation"),
        (dict(norm_position="middle"), "norm_position"),
        (dict(norm_type="batchnorm"), "norm_type"),
        (dict(position="alibi"), "position"),
        (dict(dtype="float8"), "dtype"),
        (dict(attention_implementation="flash"), "attention_implementation"),
        (dict(pooling="max"), "pooling"),
        (
            dict(attention_implementation="blockwise", attention_dropout_rate=0.1),
            "attention_dropout_rate",
        ),
        (dict(target_vocab_size=10, share_embeddings=True), "share_embeddings"),
        (dict(pad_id=40000), "pad_id"),
        (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
        (dict(position="learned", learned_position_offset=-1), "learned_position_offset"),
        (dict(position="learned", learned_position_offset=2.0), "learned_position_offset"),
        (dict(embedding_norm=1), "embedding_norm"),
        (dict(activation_dropout_rate=1.0), "activation_dropout_rate"),
        (dict(activation_dropout_rate="0.1"), "activation_dropout_rate"),
        (dict(scale_attention_logits=0), "scale_attention_logits must be a bool"),
        (dict(scale_decoder_output="yes"), "scale_decoder_output must be a bool"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**kwargs)


def test_error_lists_valid_choices():
    with pytest.raises(ValueError, match="relu"):
        TransformerConfig(activation="tanh")


# One bad value per validation group of TransformerConfig.__post_init__, with its message word
# for word: each group is reached and reports its own field.
CHECK_GROUPS = {
    "sizes": (
        dict(num_kv_heads=3),
        "TransformerConfig.num_heads (8) must be a multiple of num_kv_heads (3)",
    ),
    "flags_and_rates": (dict(remat="yes"), "TransformerConfig.remat must be a bool; got 'yes'"),
    "choices": (
        dict(sinusoid_layout="mixed"),
        "TransformerConfig.sinusoid_layout must be one of ('interleaved', 'halves'); got 'mixed'",
    ),
    "vocabulary": (
        dict(target_vocab_size=10),
        "TransformerConfig.share_embeddings=True needs target_vocab_size equal to vocab_size "
        "(or None); got 10 vs 37000",
    ),
    "special_ids": (dict(eos_id=1.0), "TransformerConfig.eos_id must be an integer; got 1.0"),
    "kernels": (
        dict(quantization="int8", scan_layers=True),
        "TransformerConfig.quantization='int8' needs scan_layers=False: int8 parameters come "
        "from quantize.quantize_params, which takes unrolled layers (models.unrolled; generate "
        "and the Translator unroll a scanned model)",
    ),
    "moe": (
        dict(num_experts=2, num_experts_per_token=3),
        "TransformerConfig.num_experts_per_token must be in [1, num_experts=2]; got 3",
    ),
    "positions": (
        dict(attention_window=0),
        "TransformerConfig.attention_window must be None or a positive integer; got 0",
    ),
    "positions_relative": (
        dict(relative_num_buckets=5),
        "TransformerConfig.relative_num_buckets must be even and >= 4; got 5",
    ),
}


@pytest.mark.parametrize("group", list(CHECK_GROUPS))
def test_each_check_group_reports_its_own_field(group):
    kwargs, message = CHECK_GROUPS[group]
    with pytest.raises(ValueError) as error:
        TransformerConfig(**kwargs)
    assert str(error.value) == message
