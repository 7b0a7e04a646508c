"""SST-2 sentiment with the EncoderClassifier (mean-pooled encoder + linear head); accuracy.

Hub copy by default (glue/sst2); a local folder with train.tsv/dev.tsv by override:
--config.data_dir=../shared/data/sst2
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "classification"
    c.dataset, c.dataset_config = "glue", "sst2"
    c.data_dir = placeholder(str)
    c.train_split, c.eval_split = "train", "validation"
    c.local_splits = {"validation": "dev"}
    c.text_column, c.label_column = "sentence", "label"
    c.vocab_size = 8000
    c.spm_model_type = "unigram"
    c.max_len = 64
    c.batch_size = 64
    c.model = dict(
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dropout_rate=0.2,
        num_classes=2,
    )
    c.schedule = "cosine"
    c.learning_rate = 5e-4
    c.warmup_steps = 200
    c.num_train_steps = 2000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 1000
    c.decode_eval = False
    return c
