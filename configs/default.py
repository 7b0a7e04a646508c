"""The embedded default: learn to reverse random digit strings, no download needed.

A small EncoderDecoder trains end to end on generated examples and is scored by exact match of
greedy decoding on held-out strings. A few minutes on 2 CPU cores.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402


def get_config():
    c = base_config()
    c.task = "synthetic"
    c.synthetic = dict(name="reverse", min_len=4, max_len=16, num_symbols=10, num_eval=512)
    c.batch_size = 64
    c.model = dict(
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
        # Listed so that the command line can override them (--config.model.use_bias=False).
        attention_dropout_rate=0.0,
        norm_position="post",
        position="sinusoidal",
        activation="relu",
        use_bias=True,
        dtype="float32",
        # Mixture of experts (0 = dense): --config.model.num_experts=4 makes every layer's
        # feed-forward block 4 experts, each token routed to num_experts_per_token of them.
        num_experts=0,
        num_experts_per_token=2,
        expert_capacity_factor=1.25,
        moe_every=1,
    )
    c.schedule = "cosine"
    c.learning_rate = 2e-3
    c.warmup_steps = 200
    c.num_train_steps = 1500
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    return c
