"""IMDB movie-review sentiment: EncoderClassifier on long inputs with attention pooling.

Hub copy by default (stanfordnlp/imdb: 25,000 train / 25,000 test reviews); a local folder with
train.tsv and dev.tsv (a header, columns ``text`` and ``label``, as the SST-2 folder has) by
override: --config.data_dir=DIR. Reviews are cut at 512 tokens; self-attention is restricted to
64 tokens on either side (blockwise, linear in length); attention pooling weighs the tokens by
a learned query, and the weights of one review are drawn with

    python -m flaxformer_lite.cli.attention_maps --workdir W --text "review ..." --out maps/
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "classification"
    c.dataset, c.dataset_config = "stanfordnlp/imdb", placeholder(str)
    c.data_dir = placeholder(str)
    c.train_split, c.eval_split = "train", "test"
    c.local_splits = {"test": "dev"}
    c.text_column, c.label_column = "text", "label"
    c.vocab_size = 16000
    c.spm_model_type = "unigram"
    c.max_len = 512
    c.batch_size = 32
    c.model = dict(
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=4,
        num_decoder_layers=1,
        dropout_rate=0.1,
        num_classes=2,
        pooling="attention",
        # Restricted self-attention (the paper's neighbourhood r): each token sees the 64 on
        # either side, so cost grows linearly in length with the blockwise implementation.
        attention_window=64,
        attention_implementation="blockwise",
    )
    c.schedule = "cosine"
    c.learning_rate = 5e-4
    c.warmup_steps = 500
    c.num_train_steps = 8000
    c.log_every = 100
    c.eval_every = 2000
    c.checkpoint_every = 2000
    c.decode_eval = False
    return c
