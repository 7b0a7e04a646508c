"""Multi30k English->German (task 1): 29k training pairs of image captions.

Hub copy by default (bentrevett/multi30k); a local folder with train/val/test2016.{en,de} by
override: --config.data_dir=../shared/data/multi30k. The model is sized for a CPU: the paper's
base model overfits 29k sentences.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "translation"
    c.dataset = "bentrevett/multi30k"
    c.dataset_config = placeholder(str)
    c.data_dir = placeholder(str)  # local folder overrides the hub
    c.data_format = "parallel_text"
    c.source_lang, c.target_lang = "en", "de"
    c.train_split, c.eval_split, c.test_split = "train", "validation", "test"
    c.local_splits = {"train": "train", "validation": "val", "test": "test2016"}
    c.vocab_size = 8000
    c.shared_vocab = True
    c.spm_model_type = "unigram"
    c.max_len = 128
    c.too_long = "truncate"
    c.tokens_per_batch = 4096
    c.batch_size_multiple = 8
    c.packing = False

    c.model = dict(
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=3,
        num_decoder_layers=3,
        dropout_rate=0.3,
        attention_dropout_rate=0.1,
        norm_position="pre",
    )
    c.schedule = "noam"
    c.learning_rate = 2.0
    c.warmup_steps = 1000
    c.num_train_steps = 3000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    c.beam_size, c.alpha = 4, 0.6
    return c
