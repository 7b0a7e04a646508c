"""A small parallel corpus on disk, its translation config and batch-stream comparisons,
shared by the input-pipeline tests."""

import random

import ml_collections
import numpy as np


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def take(stream, n):
    return [stream.next() for _ in range(n)]


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


EN = "a the man woman dog cat runs sits on in red blue big small park house".split()
DE = "ein der mann frau hund katze läuft sitzt auf im rot blau groß klein park haus".split()


def write_corpus(directory, n_train=200, n_val=30, seed=0):
    rng = random.Random(seed)
    directory.mkdir()

    def sentences(n):
        src, tgt = [], []
        for _ in range(n):
            idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 8))]
            src.append(" ".join(EN[i] for i in idx))
            tgt.append(" ".join(DE[i] for i in idx))
        return src, tgt

    src, tgt = sentences(n_train)
    src[10] = "   "  # one empty pair in the training data
    write(directory / "train.en", "\n".join(src) + "\n")
    write(directory / "train.de", "\n".join(tgt) + "\n")
    src, tgt = sentences(n_val)
    write(directory / "val.en", "\n".join(src) + "\n")
    write(directory / "val.de", "\n".join(tgt) + "\n")


def translation_config(data_dir, **overrides):
    config = ml_collections.ConfigDict(
        {
            "dataset": None,
            "dataset_config": None,
            "data_dir": str(data_dir),
            "data_format": "parallel_text",
            "source_lang": "en",
            "target_lang": "de",
            "train_split": "train",
            "eval_split": "val",
            "vocab_size": 60,
            "shared_vocab": True,
            "spm_model_type": "unigram",
            "max_len": 24,
            "too_long": "truncate",
            "tokens_per_batch": 256,
            "batch_size_multiple": 2,
            "packing": False,
            "seed": 0,
        }
    )
    config.update(overrides)
    return config
