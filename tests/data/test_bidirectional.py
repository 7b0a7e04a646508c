"""Bidirectional training (config.bidirectional_epochs): the first K epochs train every pair
and the same pair reversed, the later ones the pairs as given.

The expected rows come from the corpus files (``load_pairs``) and from the same config with
bidirectional training off, never from the code that reverses the pairs.
"""

import collections

import numpy as np
import pytest

from flaxformer_lite.core.special_ids import EOS_ID, PAD_ID
from flaxformer_lite.data.encoding import EncodedPairs
from flaxformer_lite.data.reading import load_pairs
from flaxformer_lite.data.tasks.translation import build_translation_data
from tests.helpers.translation_data import (
    assert_same_batches,
    take,
    translation_config,
    write_corpus,
)

K = 2  # bidirectional epochs
SAMPLES = 3  # subword segmentations: epoch e reads segmentation e mod 3, both ways or not


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bidirectional")
    write_corpus(root / "data", n_train=120)
    pairs = load_pairs(data_dir=str(root / "data"), split="train", source_lang="en",
                       target_lang="de")  # fmt: skip
    return root, pairs


def config_for(root, **overrides):
    """Packed rows (as configs/multi30k.py) and sampled segmentations."""
    return translation_config(
        root / "data", packing=True, subword_alpha=0.3, subword_samples=SAMPLES, **overrides
    )


@pytest.fixture(scope="module")
def streams(corpus):
    """(bidirectional data, the same config without it), in two workdirs: one vocabulary
    and the same sampled segmentations (both seeded by config.seed)."""
    root, _ = corpus
    return (
        build_translation_data(config_for(root, bidirectional_epochs=K), str(root / "both")),
        build_translation_data(config_for(root), str(root / "plain")),
    )


def epoch_rows(stream, epoch):
    """Every non-padding (inputs, targets) row of ``epoch`` as id tuples, EOS included."""
    stream.restore({"epoch": epoch, "index": 0})
    rows = []
    for batch in stream.epoch_batches():
        for src, tgt, src_seg, tgt_seg in zip(
            batch["inputs"], batch["targets"], batch["inputs_segmentation"],
            batch["targets_segmentation"], strict=True,
        ):  # fmt: skip
            for seg in set(tgt_seg[tgt_seg > 0].tolist()):  # one row holds several pairs
                rows.append(
                    tuple(
                        tuple(side[mask == seg].tolist())
                        for side, mask in ((src, src_seg), (tgt, tgt_seg))
                    )
                )
    return rows


def test_the_first_epochs_train_every_pair_both_ways_then_one_way(corpus, streams):
    _, pairs = corpus
    both, plain = streams
    tokenizer = both.src_tokenizer
    assert tokenizer is both.tgt_tokenizer  # one vocabulary: a reversed pair is valid input
    forward = collections.Counter(pairs)
    backward = collections.Counter((t, s) for s, t in pairs)
    for epoch in range(K + SAMPLES):
        rows = epoch_rows(both.train, epoch)
        assert all(s[-1] == EOS_ID and t[-1] == EOS_ID for s, t in rows)
        texts = collections.Counter((tokenizer.decode(s), tokenizer.decode(t)) for s, t in rows)
        assert texts == (forward + backward if epoch < K else forward), epoch
        # The same segmentation as the one-way run's epoch, and its pairs reversed.
        one_way = collections.Counter(epoch_rows(plain.train, epoch))
        reversed_rows = collections.Counter({(t, s): n for (s, t), n in one_way.items()})
        assert collections.Counter(rows) == (one_way + reversed_rows if epoch < K else one_way)
    # After the bidirectional epochs: the one-way run's batches exactly.
    for epoch in (K, K + 1):
        both.train.restore({"epoch": epoch, "index": 0})
        plain.train.restore({"epoch": epoch, "index": 0})
        assert_same_batches(both.train.epoch_batches(), plain.train.epoch_batches())
    # A bidirectional epoch holds twice the target tokens of a one-way one.
    both.train.restore({"epoch": 0, "index": 0})
    plain.train.restore({"epoch": 0, "index": 0})
    tokens = [
        sum(int(np.sum(b["targets"] != PAD_ID)) for b in s.epoch_batches())
        for s in (both.train, plain.train)
    ]
    src_tokens = sum(int(np.sum(b["inputs"] != PAD_ID)) for b in plain.train.epoch_batches())
    assert tokens[0] == tokens[1] + src_tokens


def test_a_resumed_stream_and_two_hosts_read_the_uninterrupted_batches(corpus, streams):
    root, _ = corpus
    both, _ = streams
    both.train.restore({"epoch": 0, "index": 0})
    per_epoch = len(both.train.epoch_plans())
    uninterrupted = take(both.train, 2 * per_epoch)  # across the switch to one way
    config = config_for(root, bidirectional_epochs=K)
    fresh = build_translation_data(config, str(root / "both")).train
    first = take(fresh, per_epoch + 3)
    resumed = build_translation_data(config, str(root / "both")).train
    resumed.restore(fresh.state())
    assert_same_batches(first + take(resumed, len(uninterrupted) - len(first)), uninterrupted)

    hosts = [
        build_translation_data(config, str(root / "both"), process_index=p, process_count=2).train
        for p in (0, 1)
    ]
    both.train.restore({"epoch": K - 1, "index": 0})
    for stream in hosts:
        stream.restore({"epoch": K - 1, "index": 0})
    for _ in range(len(both.train.epoch_plans()) + 2):  # into epoch K: one way again
        whole = both.train.next()
        halves = [h.next() for h in hosts]
        for key, value in whole.items():
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), value)


def test_swapped_pairs_exchange_the_sides():
    pairs = EncodedPairs.from_examples(
        [{"inputs": [5, 6, 1], "targets": [7, 1]}, {"inputs": [8, 1], "targets": [9, 9, 9, 1]}]
    )
    swapped = pairs.swapped()
    assert [(list(e["inputs"]), list(e["targets"])) for e in swapped] == [
        ([7, 1], [5, 6, 1]),
        ([9, 9, 9, 1], [8, 1]),
    ]
    np.testing.assert_array_equal(swapped.input_lengths, [2, 4])
    np.testing.assert_array_equal(swapped.target_lengths, [3, 2])
