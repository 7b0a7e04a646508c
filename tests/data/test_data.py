"""Tests of the input pipeline on small files written to tmp_path (never ../shared, no network)."""

import os

# Local `datasets` builders need no network; make sure nothing tries the hub anyway.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import sentencepiece as spm  # noqa: E402

from flaxformer_lite.core.special_ids import EOS_ID, PAD_ID  # noqa: E402
from flaxformer_lite.data.batching import (  # noqa: E402
    batch_by_tokens,
    bucket_boundaries,
    classification_batches,
    lm_batches,
    padding_fraction,
    rows_for_length,
)
from flaxformer_lite.data.encoding import EncodedPairs, encode_labeled, encode_pairs  # noqa: E402
from flaxformer_lite.data.packing import first_fit_rows, pack_examples  # noqa: E402
from flaxformer_lite.data.reading import (  # noqa: E402
    DataStats,
    load_labeled,
    load_pairs,
    load_text,
    normalize,
    read_parallel_files,
)
from flaxformer_lite.data.stream import BatchStream  # noqa: E402
from flaxformer_lite.data.tasks import translation  # noqa: E402
from flaxformer_lite.data.tasks.translation import build_translation_data  # noqa: E402
from tests.helpers.translation_data import (  # noqa: E402
    EN,
    assert_same_batches,
    take,
    translation_config,
    write,
    write_corpus,
)


class DigitTokenizer:
    """Stand-in tokenizer: "5 6 7" -> [5, 6, 7], so expected ids are written by hand."""

    pad_id, eos_id = PAD_ID, EOS_ID

    def encode_batch(self, texts):
        return [[int(w) for w in t.split()] for t in texts]


def random_examples(n: int, seed: int = 0, max_len: int = 24) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        src = rng.integers(4, 50, size=rng.integers(1, max_len)).tolist() + [EOS_ID]
        tgt = rng.integers(4, 50, size=rng.integers(1, max_len)).tolist() + [EOS_ID]
        out.append({"inputs": np.asarray(src, np.int32), "targets": np.asarray(tgt, np.int32)})
    return out


# ============================================================================ reading


def test_normalize_collapses_whitespace_and_nbsp():
    assert normalize("  Nummer\xa028 \t ist  hier \n") == "Nummer 28 ist hier"
    assert normalize(" \xa0 ") == ""


def test_mismatched_line_counts_name_both_paths_and_counts(tmp_path):
    src = write(tmp_path / "train.en", "a\nb\nc\n")
    tgt = write(tmp_path / "train.de", "x\ny\n")
    with pytest.raises(ValueError) as err:
        read_parallel_files(src, tgt)
    message = str(err.value)
    assert src in message and tgt in message
    assert "has 3 lines" in message and "has 2 lines" in message


def test_empty_and_whitespace_lines_dropped_and_counted(tmp_path):
    src = write(tmp_path / "s.en", "a\n\n   \nb\xa0 c \nd\ne\n")
    tgt = write(tmp_path / "s.de", "x\ny\nz\n w\n\t\nv")  # no final newline: still 6 lines
    stats = DataStats()
    pairs = read_parallel_files(src, tgt, stats)
    assert pairs == [("a", "x"), ("b c", "w"), ("e", "v")]
    assert (stats.num_read, stats.num_empty_dropped) == (6, 3)
    assert stats.num_kept == 3
    assert "read 6" in stats.summary() and "dropped 3 empty" in stats.summary()


def test_lines_split_on_newline_only(tmp_path):
    # U+2028 and a lone \r are not line breaks of the corpus (str.splitlines would split
    # there and misalign the sides); inside a line they are whitespace for normalize().
    src = write(tmp_path / "s.en", "a\u2028b\nc\rd\n")
    tgt = write(tmp_path / "s.de", "x\ny\n")
    assert read_parallel_files(src, tgt) == [("a b", "x"), ("c d", "y")]


def test_stats_merge():
    a = DataStats(num_read=5, num_empty_dropped=1, num_truncated=2, num_too_long_dropped=0)
    b = DataStats(num_read=3, num_empty_dropped=0, num_truncated=1, num_too_long_dropped=2)
    assert a.merge(b) == DataStats(8, 1, 3, 2)


def test_load_pairs_parallel_text_layout(tmp_path):
    write(tmp_path / "val.en", "one\ntwo\n")
    write(tmp_path / "val.de", "eins\nzwei\n")
    pairs = load_pairs(data_dir=str(tmp_path), split="val", source_lang="de", target_lang="en")
    assert pairs == [("eins", "one"), ("zwei", "two")]


def test_load_pairs_tsv_via_datasets(tmp_path):
    write(
        tmp_path / "train.tsv",
        "src\ttgt\textra\n"
        'it\'s "quoted"\tNA\t1\n'  # quotes are literal, "NA" is text, not a missing value
        "007\t  \t2\n"  # digit-only text stays text; empty target -> dropped
        "a\xa0b\tc\t3\n",
    )
    stats = DataStats()
    pairs = load_pairs(
        data_dir=str(tmp_path),
        split="train",
        source_lang="en",
        target_lang="de",
        data_format="tsv",
        source_column="src",
        target_column="tgt",
        stats=stats,
    )
    assert pairs == [('it\'s "quoted"', "NA"), ("a b", "c")]
    assert (stats.num_read, stats.num_empty_dropped) == (3, 1)


def test_load_pairs_jsonl_via_datasets(tmp_path):
    rows = [{"en": "hello", "de": "hallo"}, {"en": "", "de": "leer"}, {"en": "x", "de": "y"}]
    write(tmp_path / "test.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    stats = DataStats()
    pairs = load_pairs(
        data_dir=str(tmp_path),
        split="test",
        source_lang="en",
        target_lang="de",
        data_format="jsonl",
        stats=stats,
    )
    assert pairs == [("hello", "hallo"), ("x", "y")]
    assert (stats.num_read, stats.num_empty_dropped) == (3, 1)


def test_load_pairs_errors(tmp_path):
    common = {"data_dir": str(tmp_path), "split": "train", "source_lang": "en", "target_lang": "de"}
    with pytest.raises(ValueError, match=r"data_format.*parallel_text.*tsv.*jsonl.*'xml'"):
        load_pairs(data_format="xml", **common)
    with pytest.raises(FileNotFoundError, match="train.en"):
        load_pairs(**common)
    with pytest.raises(FileNotFoundError, match="train.tsv"):
        load_pairs(data_format="tsv", **common)
    write(tmp_path / "train.tsv", "en\tfr\na\tb\n")
    with pytest.raises(ValueError, match=r"\['de'\]"):
        load_pairs(data_format="tsv", **common)


@pytest.mark.parametrize("layout", ["translation", "columns"])
def test_load_pairs_hub_layouts(monkeypatch, layout):
    import datasets

    if layout == "translation":  # wmt14 style
        table = {"translation": [{"en": "a ", "de": "b"}, {"en": "c", "de": ""}]}
    else:  # bentrevett/multi30k style
        table = {"en": ["a ", "c"], "de": ["b", ""]}
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict(table)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    stats = DataStats()
    pairs = load_pairs(
        dataset="some/hub-set",
        dataset_config="de-en",
        split="validation",
        source_lang="en",
        target_lang="de",
        stats=stats,
    )
    assert calls == [("some/hub-set", "de-en", "validation")]
    assert pairs == [("a", "b")]
    assert (stats.num_read, stats.num_empty_dropped) == (2, 1)


def test_load_text_and_labeled(tmp_path):
    stats = DataStats()
    lines = load_text(write(tmp_path / "t.txt", "First line\n\n  second  \n"), stats)
    assert lines == ["First line", "second"]
    assert (stats.num_read, stats.num_empty_dropped) == (3, 1)

    path = write(
        tmp_path / "dev.tsv",
        "sentence\tlabel\nit 's good \t1\n \t0\nnot \" great \t0\nnull \t1\n",
    )
    stats = DataStats()
    rows = load_labeled(path, stats=stats)
    assert rows == [("it 's good", 1), ('not " great', 0), ("null", 1)]
    assert (stats.num_read, stats.num_empty_dropped) == (4, 1)


# ============================================================================ encoding


def test_encode_pairs_truncate_keeps_eos_last():
    pairs = [("5 6 7 8", "9"), ("5", "6 7"), ("4 4", "8 8 8 8 8")]
    stats = DataStats()
    out = encode_pairs(pairs, DigitTokenizer(), DigitTokenizer(), max_len=3, stats=stats)
    expected = [([5, 6, 1], [9, 1]), ([5, 1], [6, 7, 1]), ([4, 4, 1], [8, 8, 1])]
    assert [(e["inputs"].tolist(), e["targets"].tolist()) for e in out] == expected
    assert all(e["inputs"].dtype == np.int32 and e["targets"].dtype == np.int32 for e in out)
    assert (stats.num_truncated, stats.num_too_long_dropped) == (2, 0)


def test_encode_pairs_drop():
    pairs = [("5 6 7 8", "9"), ("5", "6 7"), ("4 4", "8 8 8 8 8")]
    stats = DataStats()
    out = encode_pairs(
        pairs, DigitTokenizer(), DigitTokenizer(), max_len=3, too_long="drop", stats=stats
    )
    assert [(e["inputs"].tolist(), e["targets"].tolist()) for e in out] == [([5, 1], [6, 7, 1])]
    assert (stats.num_truncated, stats.num_too_long_dropped) == (0, 2)


class SuffixDigitTokenizer(DigitTokenizer):
    """DigitTokenizer whose sequences end with EOS and a language code 40 (mBART's source)."""

    suffix_ids = (EOS_ID, 40)


def test_encode_pairs_keeps_a_tokenizers_suffix_whole_and_last():
    pairs = [("5 6 7 8", "9"), ("5", "6 7 8 9")]
    stats = DataStats()
    out = encode_pairs(pairs, SuffixDigitTokenizer(), DigitTokenizer(), max_len=4, stats=stats)
    expected = [([5, 6, 1, 40], [9, 1]), ([5, 1, 40], [6, 7, 8, 1])]
    assert [(e["inputs"].tolist(), e["targets"].tolist()) for e in out] == expected
    assert stats.num_truncated == 2
    dropped = encode_pairs(
        [("5 6 7", "9"), ("5 6", "9")], SuffixDigitTokenizer(), DigitTokenizer(), max_len=4,
        too_long="drop",
    )  # fmt: skip
    assert [e["inputs"].tolist() for e in dropped] == [[5, 6, 1, 40]]
    with pytest.raises(ValueError, match=r"max_len must be >= 3 .*got 2"):
        encode_pairs(pairs, SuffixDigitTokenizer(), DigitTokenizer(), max_len=2)


def test_encode_pairs_invalid_policy():
    with pytest.raises(ValueError, match=r"too_long.*truncate.*drop.*'cut'"):
        encode_pairs([("5", "6")], DigitTokenizer(), DigitTokenizer(), max_len=4, too_long="cut")


def test_encode_labeled_truncates_and_counts():
    stats = DataStats()
    out = encode_labeled([("5 6 7", 1), ("8", 0)], DigitTokenizer(), max_len=3, stats=stats)
    assert [(ids.tolist(), y) for ids, y in out] == [([5, 6, 1], 1), ([8, 1], 0)]
    assert stats.num_truncated == 1


# ============================================================================ bucketing


def test_bucket_boundaries():
    assert bucket_boundaries(128) == [8, 16, 24, 40, 64, 96, 128]
    assert bucket_boundaries(256) == [8, 16, 24, 40, 64, 96, 144, 256]
    assert bucket_boundaries(64) == [8, 16, 24, 40, 64]
    assert bucket_boundaries(8) == [8]
    for max_len in (32, 64, 128, 256):
        bounds = bucket_boundaries(max_len)
        assert bounds == sorted(set(bounds)) and bounds[-1] == max_len
        assert all(b % 8 == 0 for b in bounds)


def test_rows_for_length():
    assert rows_for_length(16, 100) == 6
    assert rows_for_length(16, 100, 4) == 4
    assert rows_for_length(64, 100, 4) == 4  # never fewer than one multiple


BOUNDS = [8, 16, 24]
SHAPES = {(8, 8), (4, 16), (2, 24)}  # rows_for_length(L, 64, 2) for each L


def bucketed(examples, **kw):
    args = {
        "tokens_per_batch": 64,
        "boundaries": BOUNDS,
        "batch_size_multiple": 2,
        "pad_id": PAD_ID,
    }
    return batch_by_tokens(examples, **{**args, **kw})


def test_bucketing_shapes_and_every_example_once():
    examples = random_examples(100)
    batches = bucketed(examples, with_index=True)
    assert {b["targets"].shape for b in batches} == SHAPES
    seen = []
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape and b["inputs"].dtype == np.int32
        length = b["targets"].shape[1]
        for row, i in enumerate(b["index"]):
            if i < 0:  # padding row: nothing but PAD
                assert not b["inputs"][row].any() and not b["targets"][row].any()
                continue
            seen.append(int(i))
            ex = examples[i]
            n_src, n_tgt = len(ex["inputs"]), len(ex["targets"])
            # The smallest bucket holding the example.
            assert length == min(L for L in BOUNDS if L >= max(n_src, n_tgt))
            np.testing.assert_array_equal(b["inputs"][row, :n_src], ex["inputs"])
            np.testing.assert_array_equal(b["targets"][row, :n_tgt], ex["targets"])
            assert not b["inputs"][row, n_src:].any() and not b["targets"][row, n_tgt:].any()
    assert sorted(seen) == list(range(100))


def test_bucketing_padding_rows_are_all_pad():
    examples = random_examples(5, max_len=6)  # all in the 8-bucket: one batch of 8 rows
    (batch,) = bucketed(examples)
    assert batch["targets"].shape == (8, 8)
    row_used = batch["targets"].any(axis=1)
    assert row_used.tolist() == [True] * 5 + [False] * 3  # sorted by length, pads last
    assert not batch["inputs"][5:].any()


def test_bucketing_deterministic_and_epoch_dependent():
    examples = random_examples(200)
    a, b = bucketed(examples, seed=3, epoch=1), bucketed(examples, seed=3, epoch=1)
    c = bucketed(examples, seed=3, epoch=2)
    assert len(a) == len(b) == len(c)
    widths = [x["targets"].shape[1] for x in a]
    assert widths != sorted(widths)  # the batch list is shuffled across buckets
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert any(
        x["targets"].shape != z["targets"].shape or not np.array_equal(x["targets"], z["targets"])
        for x, z in zip(a, c, strict=True)
    )


def test_bucketing_without_shuffle_keeps_order():
    examples = random_examples(30, max_len=6)
    (first, *_) = bucketed(examples, shuffle=False, with_index=True)
    assert first["index"].tolist() == list(range(8))


def test_bucketing_rejects_too_long_example():
    examples = random_examples(3) + [
        {"inputs": np.ones(25, np.int32), "targets": np.ones(2, np.int32)}
    ]
    with pytest.raises(ValueError, match="length 25 > largest bucket 24"):
        bucketed(examples)


def test_padding_fraction():
    batches = [
        {"targets": np.asarray([[5, 1], [0, 0]], np.int32)},
        {"targets": np.asarray([[5, 6, 7, 1]], np.int32)},
    ]
    assert padding_fraction(batches, PAD_ID) == pytest.approx(2 / 8)
    assert padding_fraction([], PAD_ID) == 0.0


# ============================================================================ packing


def ex(inputs, targets):
    return {"inputs": np.asarray(inputs, np.int32), "targets": np.asarray(targets, np.int32)}


def test_packing_hand_written_case():
    examples = [
        ex([5, 6, 1], [7, 1]),  # -> row 0
        ex([8, 1], [9, 9, 1]),  # -> row 0
        ex([4, 4, 4, 4, 1], [3, 1]),  # too long for row 0 -> row 1
        ex([12, 1], [13, 1]),  # first fit: back to row 0, which it fills exactly
        ex([14, 15, 1], [16, 1]),  # fits neither -> row 2 (second batch)
    ]
    batches = pack_examples(examples, length=7, rows_per_batch=2, pad_id=PAD_ID, shuffle=False)
    assert len(batches) == 2
    expected_0 = {
        "inputs": [[5, 6, 1, 8, 1, 12, 1], [4, 4, 4, 4, 1, 0, 0]],
        "inputs_segmentation": [[1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 0, 0]],
        "inputs_position": [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 0, 0]],
        "targets": [[7, 1, 9, 9, 1, 13, 1], [3, 1, 0, 0, 0, 0, 0]],
        "targets_segmentation": [[1, 1, 2, 2, 2, 3, 3], [1, 1, 0, 0, 0, 0, 0]],
        "targets_position": [[0, 1, 0, 1, 2, 0, 1], [0, 1, 0, 0, 0, 0, 0]],
    }
    zeros = [0] * 7
    expected_1 = {
        "inputs": [[14, 15, 1, 0, 0, 0, 0], zeros],
        "inputs_segmentation": [[1, 1, 1, 0, 0, 0, 0], zeros],
        "inputs_position": [[0, 1, 2, 0, 0, 0, 0], zeros],
        "targets": [[16, 1, 0, 0, 0, 0, 0], zeros],
        "targets_segmentation": [[1, 1, 0, 0, 0, 0, 0], zeros],
        "targets_position": [[0, 1, 0, 0, 0, 0, 0], zeros],
    }
    for batch, expected in ((batches[0], expected_0), (batches[1], expected_1)):
        assert set(batch) == set(expected)
        for key, value in expected.items():
            assert batch[key].dtype == np.int32, key
            np.testing.assert_array_equal(batch[key], np.asarray(value), err_msg=key)


def test_packing_never_splits_examples():
    examples = random_examples(120, seed=5, max_len=12)
    batches = pack_examples(examples, length=32, rows_per_batch=4, pad_id=PAD_ID, seed=1, epoch=2)
    recovered = []
    for b in batches:
        assert all(v.shape == (4, 32) for v in b.values())
        for r in range(4):
            segments = sorted(set(b["inputs_segmentation"][r].tolist()) - {0})
            assert segments == sorted(set(b["targets_segmentation"][r].tolist()) - {0})
            assert segments == list(range(1, len(segments) + 1))
            for s in segments:
                src = b["inputs"][r][b["inputs_segmentation"][r] == s]
                tgt = b["targets"][r][b["targets_segmentation"][r] == s]
                pos = b["inputs_position"][r][b["inputs_segmentation"][r] == s]
                np.testing.assert_array_equal(pos, np.arange(len(src)))
                recovered.append((tuple(src.tolist()), tuple(tgt.tolist())))
    original = [(tuple(e["inputs"].tolist()), tuple(e["targets"].tolist())) for e in examples]
    assert sorted(recovered) == sorted(original)
    assert padding_fraction(batches, PAD_ID) < 0.2  # packs much tighter than one example per row


def old_pack_examples(examples, *, length, rows_per_batch, seed=0, epoch=0, shuffle=True):
    """The scan-every-open-row packer this project had before (O(examples x rows)): the
    independent reference for the linear-time one."""
    n = len(examples)
    in_len = np.asarray([len(e["inputs"]) for e in examples], dtype=np.int64)
    tgt_len = np.asarray([len(e["targets"]) for e in examples], dtype=np.int64)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    in_fill = np.zeros(n, dtype=np.int64)
    tgt_fill = np.zeros(n, dtype=np.int64)
    row_members = []
    for i in order:
        open_rows = len(row_members)
        fits = (in_fill[:open_rows] + in_len[i] <= length) & (
            tgt_fill[:open_rows] + tgt_len[i] <= length
        )
        row = int(np.argmax(fits)) if fits.any() else open_rows
        if row == open_rows:
            row_members.append([])
        row_members[row].append(int(i))
        in_fill[row] += in_len[i]
        tgt_fill[row] += tgt_len[i]
    batches = []
    for start in range(0, len(row_members), rows_per_batch):
        batch = {
            f"{side}{suffix}": np.zeros((rows_per_batch, length), dtype=np.int32)
            for side in ("inputs", "targets")
            for suffix in ("", "_segmentation", "_position")
        }
        for r, members in enumerate(row_members[start : start + rows_per_batch]):
            for side in ("inputs", "targets"):
                offset = 0
                for segment, i in enumerate(members, start=1):
                    seq = examples[i][side]
                    end = offset + len(seq)
                    batch[side][r, offset:end] = seq
                    batch[f"{side}_segmentation"][r, offset:end] = segment
                    batch[f"{side}_position"][r, offset:end] = np.arange(len(seq))
                    offset = end
        batches.append(batch)
    return batches


@pytest.mark.parametrize(
    "n, max_len, length, shuffle",
    [(1, 4, 4, True), (40, 8, 8, False), (700, 12, 16, True), (1200, 24, 32, True)],
)
def test_packing_equals_the_old_first_fit_on_random_input(n, max_len, length, shuffle):
    # Uncorrelated source and target lengths: the case where first fit on two sides is hardest.
    examples = random_examples(n, seed=n, max_len=max_len)
    kw = {"length": length, "rows_per_batch": 8, "seed": 3, "epoch": 1, "shuffle": shuffle}
    assert_same_batches(
        pack_examples(examples, **kw, pad_id=PAD_ID), old_pack_examples(examples, **kw)
    )
    # The same plan from the flat cache layout (what training reads).
    assert_same_batches(
        pack_examples(EncodedPairs.from_examples(examples), **kw, pad_id=PAD_ID),
        old_pack_examples(examples, **kw),
    )


def test_first_fit_rows_matches_a_scan_with_one_long_pointer_jump():
    # Many rows that fit small inputs but not the long target: the pointer of the last size
    # has to cross thousands of rows (the vectorized branch).
    in_len = np.asarray([1] * 3000 + [1], dtype=np.int64)
    tgt_len = np.asarray([7] * 3000 + [8], dtype=np.int64)
    rows = first_fit_rows(in_len, tgt_len, 8)
    assert rows[:3000].tolist() == list(range(3000)) and rows[-1] == 3000


def test_packing_rejects_example_longer_than_row():
    with pytest.raises(ValueError, match="longer than the packing length 4"):
        pack_examples([ex([5, 1], [6, 6, 6, 6, 1])], length=4, rows_per_batch=2, pad_id=PAD_ID)


# ============================================================================ streaming


def make_epoch_fn(examples, calls=None):
    def make(epoch):
        if calls is not None:
            calls.append(epoch)
        return bucketed(examples, seed=7, epoch=epoch)

    return make


def test_batch_stream_resume_equals_uninterrupted():
    examples = random_examples(60)
    calls = []
    full = BatchStream(make_epoch_fn(examples, calls))
    per_epoch = len(full.epoch_batches())
    total = 2 * per_epoch + 3  # runs into the third epoch
    reference = take(full, total)
    assert calls == [0, 1, 2]  # each epoch's batches built once, not per step
    assert full.state() == {"epoch": 2, "index": 3}

    for cut in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        first = BatchStream(make_epoch_fn(examples))
        head = take(first, cut)
        saved = dict(first.state())
        resumed = BatchStream(make_epoch_fn(examples))
        resumed.restore(saved)
        assert_same_batches(head + take(resumed, total - cut), reference)


def test_batch_stream_epochs_differ():
    stream = BatchStream(make_epoch_fn(random_examples(60)))
    n = len(stream.epoch_batches())
    epoch0, epoch1 = take(stream, n), take(stream, n)
    assert stream.epoch == 1
    assert any(
        a["targets"].shape != b["targets"].shape or not np.array_equal(a["targets"], b["targets"])
        for a, b in zip(epoch0, epoch1, strict=True)
    )


def test_batch_stream_host_sharding():
    examples = random_examples(60)
    single = take(BatchStream(make_epoch_fn(examples)), 12)
    hosts = [
        take(BatchStream(make_epoch_fn(examples), process_index=p, process_count=2), 12)
        for p in range(2)
    ]
    for step, global_batch in enumerate(single):
        for key in global_batch:
            rows = global_batch[key].shape[0]
            assert hosts[0][step][key].shape[0] == rows // 2
            np.testing.assert_array_equal(
                np.concatenate([hosts[0][step][key], hosts[1][step][key]]), global_batch[key]
            )


def test_batch_stream_rejects_uneven_rows():
    stream = BatchStream(make_epoch_fn(random_examples(20)), process_index=0, process_count=3)
    with pytest.raises(ValueError, match="process_count"):
        stream.next()
    with pytest.raises(ValueError, match="process_index"):
        BatchStream(make_epoch_fn([]), process_index=2, process_count=2)


# ============================================================================ LM / classification


def test_lm_batches_windows():
    tokens = np.arange(1, 104, dtype=np.int32)  # 103 tokens
    batches = lm_batches(tokens, seq_len=10, batch_size=4, pad_id=PAD_ID, seed=0, epoch=0)
    assert all(b["targets"].shape == (4, 10) and b["targets"].dtype == np.int32 for b in batches)
    rows = np.concatenate([b["targets"] for b in batches])
    real = rows[rows.any(axis=1)]
    assert len(rows) == 4 * len(batches) and len(rows) - len(real) < 4  # only the last is padded
    assert (np.diff(real, axis=1) == 1).all()  # contiguous windows
    starts = real[:, 0]
    offset = int(starts.min()) - 1
    assert 0 <= offset < 10
    assert sorted(starts.tolist()) == list(range(offset + 1, offset + 1 + 10 * len(real), 10))
    assert len(real) == (103 - offset) // 10  # non-overlapping, as many as fit

    again = lm_batches(tokens, seq_len=10, batch_size=4, pad_id=PAD_ID, seed=0, epoch=0)
    assert all(
        np.array_equal(a["targets"], b["targets"]) for a, b in zip(batches, again, strict=True)
    )
    other = [
        lm_batches(tokens, seq_len=10, batch_size=4, pad_id=PAD_ID, seed=0, epoch=e) for e in (1, 2)
    ]
    assert any(not np.array_equal(np.concatenate([b["targets"] for b in o]), rows) for o in other)


def test_classification_batches():
    examples = [(np.asarray([5, 6, 1], np.int32), 1), (np.asarray([7, 1], np.int32), 0)] * 2
    examples.append((np.asarray([8, 1], np.int32), 1))
    batches = classification_batches(
        examples, max_len=4, batch_size=2, pad_id=PAD_ID, shuffle=False
    )
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[0]["inputs"], [[5, 6, 1, 0], [7, 1, 0, 0]])
    np.testing.assert_array_equal(batches[0]["label"], [1, 0])
    np.testing.assert_array_equal(batches[2]["inputs"], [[8, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batches[2]["weights"], [1, 0])
    assert sum(int(b["weights"].sum()) for b in batches) == 5
    shuffled = classification_batches(
        examples, max_len=4, batch_size=2, pad_id=PAD_ID, seed=1, epoch=0
    )
    labels = sorted(
        int(y) for b in shuffled for y, w in zip(b["label"], b["weights"], strict=True) if w
    )
    assert labels == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="max_len=2"):
        classification_batches(examples, max_len=2, batch_size=2, pad_id=PAD_ID)


# ============================================================================ end to end


def test_build_translation_data_end_to_end(tmp_path):
    write_corpus(tmp_path / "data")
    workdir = tmp_path / "work"
    config = translation_config(tmp_path / "data")
    td = build_translation_data(config, str(workdir))

    assert td.stats.num_read == 200 and td.stats.num_empty_dropped == 1
    assert td.eval_stats.num_read == 30 and len(td.eval_pairs) == 30
    assert td.src_tokenizer is td.tgt_tokenizer
    assert (workdir / "spm_shared.model").is_file()
    assert 4 < td.src_tokenizer.vocab_size <= 60
    assert td.boundaries == [8, 16, 24]

    allowed = {(rows_for_length(L, 256, 2), L) for L in td.boundaries}
    epoch0 = td.train.epoch_batches()
    assert {b["targets"].shape for b in epoch0} <= allowed
    assert td.padding_fraction == pytest.approx(padding_fraction(epoch0, PAD_ID))
    assert 0.0 < td.padding_fraction < 1.0
    assert sum(int(b["targets"].any(axis=1).sum()) for b in epoch0) == 199
    batch = td.train.next()
    assert set(batch) == {"inputs", "targets"} and batch["targets"].shape in allowed

    # Eval batches: fixed shapes, and `index` maps each row back to its reference string.
    assert {b["targets"].shape for b in td.eval_batches} <= allowed
    seen = []
    for b in td.eval_batches:
        for row, i in enumerate(b["index"]):
            if i >= 0:
                seen.append(int(i))
                src, ref = td.eval_pairs[i]
                assert td.tgt_tokenizer.decode(b["targets"][row]) == ref
                assert td.src_tokenizer.decode(b["inputs"][row]) == src
    assert sorted(seen) == list(range(30))

    # The training split was tokenized once into the cache, which holds exactly its examples.
    cache = Path(td.cache_dir)
    assert cache.parent == workdir / "data_cache"
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["meta.json", *(f"{name}.npy" for name in EncodedPairs.ARRAYS)]
    )
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["stats"] == {
        "num_read": 200, "num_empty_dropped": 1, "num_truncated": 0, "num_too_long_dropped": 0
    }  # fmt: skip
    pairs = load_pairs(data_dir=str(tmp_path / "data"), split="train", source_lang="en",
                       target_lang="de")  # fmt: skip
    expected = encode_pairs(pairs, td.src_tokenizer, td.tgt_tokenizer, max_len=24)
    cached = EncodedPairs(*(np.load(cache / f"{name}.npy") for name in EncodedPairs.ARRAYS))
    assert len(cached) == len(expected) == 199
    for i in (0, 57, 198):
        for side in ("inputs", "targets"):
            np.testing.assert_array_equal(cached[i][side], expected[i][side])

    # A second build (resumed run) reuses the vocabulary and the cache untouched, and does
    # not read the training files (removed here).
    mtimes = {p: os.stat(p).st_mtime_ns for p in [workdir / "spm_shared.model", *cache.iterdir()]}
    for name in ("train.en", "train.de"):
        (tmp_path / "data" / name).unlink()
    again = build_translation_data(config, str(workdir))
    assert {p: os.stat(p).st_mtime_ns for p in mtimes} == mtimes
    assert again.src_tokenizer.vocab_size == td.src_tokenizer.vocab_size
    assert_same_batches(again.train.epoch_batches(), epoch0)
    # The task's log line gives the one vocabulary's size, as its model file holds it.
    task = translation.build(config, str(workdir), process_index=0, process_count=1)
    size = spm.SentencePieceProcessor(model_file=str(workdir / "spm_shared.model")).get_piece_size()
    assert any(line.startswith(f"vocabulary: {size} shared, buckets") for line in task.log_lines)
    # A setting the tokens depend on names another cache (and needs the corpus again).
    with pytest.raises(FileNotFoundError, match="train.en"):
        build_translation_data(translation_config(tmp_path / "data", max_len=16), str(workdir))


def test_build_translation_data_separate_vocab_packing_sharded(tmp_path):
    write_corpus(tmp_path / "data")
    config = translation_config(
        tmp_path / "data", shared_vocab=False, packing=True, spm_model_type="char"
    )
    td = build_translation_data(config, str(tmp_path / "w"), process_index=1, process_count=2)
    assert sorted(os.listdir(tmp_path / "w")) == ["data_cache", "spm_src.model", "spm_tgt.model"]
    assert "ä" in td.tgt_tokenizer.id_to_piece(range(td.tgt_tokenizer.vocab_size))
    assert "ä" not in td.src_tokenizer.id_to_piece(range(td.src_tokenizer.vocab_size))
    # The task's log line names both vocabularies' sizes, as the two model files hold them.
    task = translation.build(config, str(tmp_path / "w"), process_index=1, process_count=2)
    src, tgt = (
        spm.SentencePieceProcessor(model_file=str(tmp_path / "w" / name)).get_piece_size()
        for name in ("spm_src.model", "spm_tgt.model")
    )
    assert src != tgt
    sizes = f"{src} source, {tgt} target"
    assert any(line.startswith(f"vocabulary: {sizes}, buckets") for line in task.log_lines)
    rows = rows_for_length(24, 256, 2)
    batch = td.train.next()
    assert set(batch) == {
        "inputs",
        "targets",
        "inputs_segmentation",
        "targets_segmentation",
        "inputs_position",
        "targets_position",
    }
    assert all(v.shape == (rows // 2, 24) for v in batch.values())

    with pytest.raises(ValueError, match=r"batch_size_multiple \(3\).*process_count \(2\)"):
        build_translation_data(
            translation_config(tmp_path / "data", batch_size_multiple=3),
            str(tmp_path / "w2"),
            process_count=2,
        )


DATA_MODULES = (
    "data",
    "encoding",
    "batching",
    "packing",
    "batch_stream",
    "workdir_data",
    "tasks",
    "synthetic",
    "translation_task",
    "lm_task",
    "classification_task",
)


def test_importing_data_modules_does_not_import_datasets():
    # `datasets` is slow to import: the modules must import it only inside functions.
    modules = ", ".join(f"flaxformer_lite.{name}" for name in DATA_MODULES)
    code = f"import sys, {modules}; print('datasets' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_streaming_jsonl_gives_the_same_data_as_the_text_files(tmp_path):
    # The `datasets` streaming path (what `streaming=True` does for a hub corpus), on local
    # jsonl files holding the same pairs as parallel text files: same cache contents, same
    # batches, same eval set.
    write_corpus(tmp_path / "text")
    data = tmp_path / "jsonl"
    data.mkdir()
    for split in ("train", "val"):
        en = (tmp_path / "text" / f"{split}.en").read_text(encoding="utf-8").splitlines()
        de = (tmp_path / "text" / f"{split}.de").read_text(encoding="utf-8").splitlines()
        rows = "".join(json.dumps({"en": e, "de": d}) + "\n" for e, d in zip(en, de, strict=True))
        write(data / f"{split}.jsonl", rows)
    text = build_translation_data(translation_config(tmp_path / "text", packing=True),
                                  str(tmp_path / "w_text"))  # fmt: skip
    config = translation_config(data, data_format="jsonl", streaming=True, packing=True)
    streamed = build_translation_data(config, str(tmp_path / "w_streamed"))
    assert streamed.stats == text.stats and streamed.stats.num_kept == 199
    assert streamed.eval_pairs == text.eval_pairs
    assert_same_batches(streamed.train.epoch_batches(), text.train.epoch_batches())


def test_build_task_lm_windows_and_classification_rows(tmp_path):
    from flaxformer_lite.data import tasks
    from flaxformer_lite.data.tokenizer import Tokenizer

    rng = random.Random(0)
    text = [" ".join(rng.choice(EN) for _ in range(rng.randint(2, 6))) for _ in range(50)]
    write(tmp_path / "text.txt", "\n".join(text) + "\n")
    lm = tasks.build_task(
        ml_collections.ConfigDict(
            dict(task="lm", dataset=None, train_split="train", data_file=str(tmp_path / "text.txt"),
                 eval_fraction=0.2, eval_batches=0, vocab_size=40, spm_model_type="char",
                 max_len=8, batch_size=2, seed=0, decode_eval=False, model={})
        ),
        str(tmp_path / "lm"),
    )  # fmt: skip
    assert lm.kind == "lm" and lm.train.next()["targets"].shape == (2, 8)
    # Eval windows: the held-out last 10 lines, each line's ids then EOS, as one stream cut
    # into 8-token windows from one offset in [0, 8) (then shuffled).
    tokenizer = Tokenizer.load(str(tmp_path / "lm" / "spm_lm.model"))
    stream = [i for line in text[40:] for i in (*tokenizer.encode(line), EOS_ID)]
    windows = sorted(tuple(w) for b in lm.eval_batches for w in b["targets"].tolist() if any(w))
    assert lm.vocab_size == tokenizer.vocab_size and len(windows[0]) == 8
    cuts = [
        sorted(tuple(stream[s : s + 8]) for s in range(offset, len(stream) - 7, 8))
        for offset in range(8)
    ]
    assert windows in cuts

    data = tmp_path / "sst"
    data.mkdir()
    rows = [(text[i], i % 2) for i in range(13)]
    for name, part in (("train", rows[:10]), ("dev", rows[10:])):
        write(data / f"{name}.tsv", "sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in part))
    cls = tasks.build_task(
        ml_collections.ConfigDict(
            dict(task="classification", dataset=None, dataset_config=None, data_dir=str(data),
                 train_split="train", eval_split="validation", local_splits={"validation": "dev"},
                 text_column="sentence", label_column="label", vocab_size=40,
                 spm_model_type="char", max_len=64, batch_size=4, seed=0)
        ),
        str(tmp_path / "cls"),
    )  # fmt: skip
    (dev,) = cls.eval_batches  # 3 rows and one padding row, in file order
    assert dev["weights"].tolist() == [1, 1, 1, 0] and dev["label"].tolist() == [0, 1, 0, 0]
    tokenizer = Tokenizer.load(str(tmp_path / "cls" / "spm_cls.model"))
    assert tokenizer.decode(dev["inputs"][1]) == text[11]
    assert cls.train.next()["inputs"].shape == (4, 64)
