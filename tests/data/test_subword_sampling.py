"""Subword regularization: sampled segmentations of the training split, one per epoch.

The reference for "the same text" is SentencePiece's own most likely segmentation decoded;
the sampler is only trusted to draw other segmentations of it.
"""

import collections
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flaxformer_lite.core.special_ids import EOS_ID, PAD_ID
from flaxformer_lite.data.reading import load_pairs
from flaxformer_lite.data.tasks.translation import build_translation_data
from flaxformer_lite.data.tokenizer import SubwordSampler, Tokenizer
from tests.helpers.translation_data import (
    assert_same_batches,
    take,
    translation_config,
    write_corpus,
)

SAMPLES = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("subword")
    write_corpus(root / "data", n_train=200)
    pairs = load_pairs(data_dir=str(root / "data"), split="train", source_lang="en",
                       target_lang="de")  # fmt: skip
    return root, pairs


@pytest.fixture(scope="module")
def sampled(corpus):
    root, _ = corpus
    config = translation_config(root / "data", subword_alpha=0.3, subword_samples=SAMPLES)
    return config, build_translation_data(config, str(root / "work"))


def epoch_rows(stream, epoch):
    """Every non-padding (inputs, targets) row of ``epoch``, as id tuples up to EOS."""
    stream.restore({"epoch": epoch, "index": 0})
    rows = []
    for batch in stream.epoch_batches():
        for src, tgt in zip(batch["inputs"], batch["targets"], strict=True):
            if tgt.any():
                rows.append(
                    tuple(tuple(int(i) for i in side if i != PAD_ID) for side in (src, tgt))
                )
    return rows


def test_the_sampler_draws_other_segmentations_of_the_same_text(corpus, sampled):
    _, pairs = corpus
    _, td = sampled
    tokenizer = td.src_tokenizer
    assert isinstance(tokenizer, Tokenizer)
    texts = [t for pair in pairs for t in pair]
    best = tokenizer.encode_batch(texts)
    draws = SubwordSampler(tokenizer, 0.3, seed=7).encode_batch(texts)
    again = SubwordSampler(tokenizer, 0.3, seed=7).encode_batch(texts)
    other = SubwordSampler(tokenizer, 0.3, seed=8).encode_batch(texts)
    assert draws == again  # a pure function of the seed
    assert draws != other
    changed = sum(d != b for d, b in zip(draws, best, strict=True))
    assert changed > len(texts) // 10  # not the most likely segmentation in disguise
    for d, b in zip(draws, best, strict=True):
        assert tokenizer.decode(d) == tokenizer.decode(b)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]; got 0"):
        SubwordSampler(tokenizer, 0.0, seed=0)


def test_each_epoch_reads_one_segmentation_of_every_pair(corpus, sampled):
    root, pairs = corpus
    config, td = sampled
    tokenizer = td.src_tokenizer
    caches = sorted(os.listdir(root / "work" / "data_cache"))
    assert len(caches) == SAMPLES  # one token cache per segmentation, no unsampled one

    expected = collections.Counter(pairs)
    epochs = [epoch_rows(td.train, e) for e in range(SAMPLES + 1)]
    for rows in epochs:  # every pair once per epoch, whatever its segmentation
        texts = [(tokenizer.decode((*s, EOS_ID)), tokenizer.decode((*t, EOS_ID))) for s, t in rows]
        assert collections.Counter(texts) == expected
    as_sets = [collections.Counter(rows) for rows in epochs]
    assert as_sets[0] != as_sets[1] and as_sets[1] != as_sets[2]
    assert as_sets[SAMPLES] == as_sets[0]  # epoch e reads segmentation e mod SAMPLES
    best = tokenizer.encode_batch([t for _, t in pairs])
    best_rows = collections.Counter(tuple(ids) + (EOS_ID,) for ids in best)
    assert collections.Counter(t for _, t in epochs[1]) != best_rows

    # The eval set keeps the most likely segmentation.
    for batch in td.eval_batches:
        for row, i in enumerate(batch["index"]):
            if i >= 0:
                ids = [int(x) for x in batch["targets"][row] if x not in (PAD_ID, EOS_ID)]
                assert ids == tokenizer.encode(td.eval_pairs[i][1])

    # Another workdir draws the same segmentations (seeded by config.seed; in a new process
    # too: the next test), and a stream restored mid-epoch continues as the uninterrupted one.
    fresh = build_translation_data(config, str(root / "elsewhere"))
    assert epoch_rows(fresh.train, 1) == epochs[1]
    td.train.restore({"epoch": 0, "index": 0})
    uninterrupted = take(td.train, 3 * len(td.train.epoch_plans()) // 2)
    fresh.train.restore({"epoch": 0, "index": 0})
    first = take(fresh.train, len(uninterrupted) // 2)
    resumed = build_translation_data(config, str(root / "elsewhere")).train
    resumed.restore(fresh.train.state())
    assert_same_batches(first + take(resumed, len(uninterrupted) - len(first)), uninterrupted)


# Epoch 1's batches (segmentation 1) of a workdir, hashed, in a fresh process.
EPOCH_HASH = """
import hashlib, sys
import numpy as np
from flaxformer_lite.data.tasks.translation import build_translation_data
from tests.helpers.translation_data import translation_config

data, work, samples = sys.argv[1:]
config = translation_config(data, subword_alpha=0.3, subword_samples=int(samples))
train = build_translation_data(config, work).train
train.restore({"epoch": 1, "index": 0})
digest = hashlib.sha256()
for batch in train.epoch_batches():
    for name in ("inputs", "targets"):
        digest.update(np.ascontiguousarray(batch[name]).tobytes())
print(digest.hexdigest())
"""


def test_a_new_process_draws_the_same_segmentations_in_its_workdir_and_in_a_new_one(
    corpus, sampled
):
    """A resumed run or another host reads the workdir's token caches; a run from scratch in
    a new workdir, in a new process, draws them again from the seed: both see the batches
    this process built. (SentencePiece 0.2.3's own sampler draws other segmentations for the
    same seed in every new process: the unigram sampler is NumPy's, unigram_sampling.)"""
    root, _ = corpus
    _, td = sampled
    td.train.restore({"epoch": 1, "index": 0})
    here = hashlib.sha256()
    for batch in td.train.epoch_batches():
        for name in ("inputs", "targets"):
            here.update(np.ascontiguousarray(batch[name]).tobytes())
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    for work in (root / "work", root / "from_scratch"):
        done = subprocess.run(
            [sys.executable, "-c", EPOCH_HASH, str(root / "data"), str(work), str(SAMPLES)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == here.hexdigest(), work
    assert len(os.listdir(root / "from_scratch" / "data_cache")) == SAMPLES  # drawn there


def test_packed_rows_hold_each_sampled_pair_once(corpus):
    root, pairs = corpus
    config = translation_config(
        root / "data", packing=True, subword_alpha=0.3, subword_samples=2, seed=1
    )
    td = build_translation_data(config, str(root / "packed"))
    tokens = []
    for epoch in (0, 1):
        td.train.restore({"epoch": epoch, "index": 0})
        batches = td.train.epoch_batches()
        assert sum(int(np.sum(b["targets"] == EOS_ID)) for b in batches) == len(pairs)
        tokens.append(sorted(int(i) for b in batches for i in b["targets"].ravel() if i))
    assert tokens[0] != tokens[1]  # the second epoch reads the second segmentation

    # Two hosts: each reads its half of the rows of every batch, from that epoch's segmentation.
    hosts = [
        build_translation_data(config, str(root / "packed"), process_index=p, process_count=2).train
        for p in (0, 1)
    ]
    for stream in (*hosts, td.train):
        stream.restore({"epoch": 1, "index": 0})
    for _ in range(len(td.train.epoch_plans()) + 1):  # into epoch 2: segmentation 0 again
        whole = td.train.next()
        halves = [h.next() for h in hosts]
        for key, value in whole.items():
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), value)
