"""Fine-tuning a pretrained Marian (opus-mt) translator on Multi30k English->German.

    python train.py --config configs/finetune_marian.py \\
        --config.init_from=Helsinki-NLP/opus-mt-en-de --workdir runs/ft \\
        --config.data_dir=../shared/data/multi30k

``init_from`` is a Hugging Face Marian folder or hub id (or another train.py workdir): the
model takes its architecture and weights (flaxformer_lite/interop/init_from.py), the data its
tokenizer (copied into the workdir: source.spm, target.spm, vocab.json), so nothing is
trained from scratch. A BART or mBART folder works the same way with its own tokenizer (mBART:
``--config.tokenizer_src_lang=en_XX --config.tokenizer_tgt_lang=de_DE`` unless its
tokenizer_config.json names them; docs/hf_families.md). ``config.model`` may change only the
training fields (``init_from.TRAINING_FIELDS``: dropout, precision, remat, scan_layers ...);
an architecture field set to another value than the pretrained one is refused by name before
any work.
``freeze`` names parameters to keep as they are, by regular expressions over their paths,
e.g. ``--config.freeze='("encoder/.*", "source_embedding/.*")'`` to train the decoder only.
Decoding follows Hugging Face's rules for these models (beam 4, length penalty 1.0, EOS
forced at the limit, pad never generated), and ``python -m flaxformer_lite.interop.hf --workdir
runs/ft --out DIR`` writes the result back for Transformers and CTranslate2.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from ml_collections.config_dict import placeholder  # noqa: E402


def get_config():
    c = base_config()
    c.task = "translation"
    c.init_from = placeholder(str)  # required: the pretrained model
    c.tokenizer = c.get_ref("init_from")  # its own tokenizer (follows init_from)
    c.freeze = ()
    c.dataset = "bentrevett/multi30k"
    c.dataset_config = placeholder(str)
    c.data_dir = placeholder(str)
    c.data_format = "parallel_text"
    c.source_lang, c.target_lang = "en", "de"
    c.train_split, c.eval_split, c.test_split = "train", "validation", "test"
    c.local_splits = {"train": "train", "validation": "val", "test": "test2016"}
    c.vocab_size = 8000  # unused: the pretrained tokenizer decides the vocabulary
    c.shared_vocab = True
    c.spm_model_type = "unigram"
    c.max_len = 128
    c.too_long = "truncate"
    c.packing = False
    c.tokens_per_batch = 2048
    c.batch_size_multiple = 8
    # Only training fields (init_from.TRAINING_FIELDS) may differ from the pretrained model.
    c.model = dict(dropout_rate=0.1)
    # A gentle constant rate after a short warmup: the weights are already good.
    c.optimizer = "adam"
    c.schedule = "cosine"
    c.learning_rate = 5e-5
    c.warmup_steps = 100
    c.label_smoothing = 0.1
    c.num_train_steps = 1000
    c.log_every = 50
    c.eval_every = 250
    c.checkpoint_every = 250
    c.decode_eval = False  # BLEU with the evaluate CLI afterwards
    c.beam_size, c.alpha = 4, 1.0
    c.beam_style, c.early_stopping, c.forced_eos, c.ban_pad = "hf", False, True, True
    return c
