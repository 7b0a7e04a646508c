"""A character-level DecoderOnly language model on Tiny Shakespeare.

Hub copy by default; a local file by override:
--config.data_file=../shared/data/tinyshakespeare/input.txt
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "lm"
    c.dataset = "karpathy/tiny_shakespeare"
    c.train_split = "train"
    c.data_file = placeholder(str)  # a local text file overrides the hub
    c.eval_fraction = 0.1  # the last 10% of lines are held out
    c.eval_batches = 8
    c.vocab_size = 96
    c.spm_model_type = "char"
    c.max_len = 128
    c.batch_size = 32
    c.model = dict(
        d_model=192,
        num_heads=6,
        d_ff=768,
        num_encoder_layers=1,
        num_decoder_layers=4,
        dropout_rate=0.1,
        norm_position="pre",
        position="learned",
    )
    c.schedule = "cosine"
    c.learning_rate = 1e-3
    c.warmup_steps = 100
    c.num_train_steps = 2000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    c.decode_eval = True  # print a sampled continuation at each evaluation
    c.label_smoothing = 0.0  # perplexity is the metric of a language model
    return c
