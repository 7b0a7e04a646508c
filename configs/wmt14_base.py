"""The paper's base setup on WMT14 English->German from the Hugging Face hub.

Shared vocabulary of about 37k subwords, batches of about 25k target tokens, Adam with the
warmup/inverse-square-root schedule (4000 warmup steps), 100k steps, dropout 0.1, label
smoothing 0.1. Sized for accelerators; on a CPU use it only to check the wiring.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "translation"
    c.dataset = "wmt14"
    c.dataset_config = "de-en"
    c.data_dir = placeholder(str)
    c.data_format = "parallel_text"
    # True: read the hub corpus with `datasets` streaming (nothing downloaded or held whole;
    # process 0 reads it once to tokenize into the workdir's token cache, twice if it must
    # also train the vocabulary), for corpora larger than a host's memory or disk.
    c.streaming = False
    c.source_lang, c.target_lang = "en", "de"
    c.train_split, c.eval_split, c.test_split = "train", "validation", "test"
    c.local_splits = {}
    c.vocab_size = 37000
    c.shared_vocab = True
    c.spm_model_type = "bpe"
    c.max_len = 256
    c.too_long = "drop"
    c.tokens_per_batch = 25000
    c.batch_size_multiple = 8
    c.packing = False
    c.model = dict(
        d_model=512,
        num_heads=8,
        d_ff=2048,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout_rate=0.1,
        dtype="auto",  # bfloat16 compute on TPU/GPU, float32 on CPU
    )
    c.schedule = "noam"
    c.learning_rate = 1.0
    c.warmup_steps = 4000
    c.num_train_steps = 100_000
    c.log_every = 100
    c.eval_every = 5000
    c.checkpoint_every = 2000
    c.beam_size, c.alpha = 4, 0.6
    return c
