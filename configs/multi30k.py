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
    # True: read the hub corpus with `datasets` streaming (nothing downloaded or held whole;
    # process 0 reads it once to tokenize into the workdir's token cache, twice if it must
    # also train the vocabulary), for corpora larger than a host's memory or disk.
    c.streaming = False
    c.source_lang, c.target_lang = "en", "de"
    c.train_split, c.eval_split, c.test_split = "train", "validation", "test"
    c.local_splits = {"train": "train", "validation": "val", "test": "test2016"}
    c.vocab_size = 8000
    c.shared_vocab = True
    c.spm_model_type = "unigram"
    # Packing: rows of 64 tokens hold ~4 sentences each; 5% padding instead of the 25% of
    # length buckets, one compiled shape instead of seven. No training pair is longer.
    c.max_len = 64
    c.too_long = "truncate"
    c.packing = True
    c.tokens_per_batch = 2048
    c.batch_size_multiple = 8

    # A "tiny" Transformer (4+4 layers, d_model 128, d_ff 256) tied and shared embeddings: the
    # size published text-only baselines use on Multi30k, and three times the tokens per
    # second of d_model 256 on a CPU, which buys epochs within the time budget.
    c.model = dict(
        d_model=128,
        num_heads=4,
        d_ff=256,
        num_encoder_layers=4,
        num_decoder_layers=4,
        dropout_rate=0.2,
        attention_dropout_rate=0.1,
        norm_position="pre",
    )
    # A fixed step budget: short warmup, cosine decay to zero at the last step. 3,800 steps
    # (~16 epochs) took 45 min on 2 AVX-512 cores; on a machine half as fast (2 AVX2 cores,
    # 51 min for 1,900 steps) pass --config.num_train_steps=1900 to stay within the hour.
    c.schedule = "cosine"
    c.learning_rate = 4e-3
    c.warmup_steps = 400
    c.num_train_steps = 3800
    c.log_every = 50
    c.eval_every = 250
    c.decode_eval = False  # BLEU with the evaluate CLI afterwards (beam search, sacrebleu)
    c.checkpoint_every = 250
    c.keep_checkpoints = 5
    c.beam_size, c.alpha = 4, 1.0  # selected on val (alpha 0.6 / 1.0 / 1.5 / 2.0)
    return c
