"""The embedded default task: examples are right, batches deterministic, held-out kept out."""

import numpy as np
import pytest

from flaxformer_lite.data.tasks.synthetic import SymbolVocabulary, SyntheticStream, SyntheticTask


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_examples_solve_their_task(name):
    task = SyntheticTask(name, min_len=1, max_len=5)
    rng = np.random.default_rng(0)
    for _ in range(50):
        x, y = task.example(rng)
        src, tgt = task.vocab.decode(x), task.vocab.decode(y)
        if name == "reverse":
            assert tgt == src[::-1]
        elif name == "sort":
            assert tgt == "".join(sorted(src))
        else:
            a, b = src.split("+")
            assert int(tgt) == int(a) + int(b)
        assert len(x) + 1 <= task.input_len and len(y) + 1 <= task.target_len


def test_stream_is_a_function_of_seed_and_index_and_skips_held_out():
    task = SyntheticTask("reverse", min_len=1, max_len=3, num_symbols=3)
    held = task.eval_batch(20, seed=0)
    stream = SyntheticStream(task, batch_size=32, seed=0, exclude=held["inputs"])
    first, second = stream.next(), stream.next()
    again = SyntheticStream(task, batch_size=32, seed=0, exclude=held["inputs"])
    again.restore({"index": 1})
    np.testing.assert_array_equal(again.next()["inputs"], second["inputs"])
    assert not np.array_equal(first["inputs"], second["inputs"])
    held_rows = {tuple(r) for r in held["inputs"]}
    for _ in range(20):
        for row in stream.next()["inputs"]:
            assert tuple(row) not in held_rows
    # Two processes' rows make up the global batch.
    halves = [SyntheticStream(task, batch_size=32, seed=0, process_index=i, process_count=2)
              for i in range(2)]  # fmt: skip
    whole = SyntheticStream(task, batch_size=32, seed=0).next()["inputs"]
    np.testing.assert_array_equal(np.concatenate([h.next()["inputs"] for h in halves]), whole)


def test_vocabulary_round_trip_and_errors():
    vocab = SymbolVocabulary("0123456789+")
    assert vocab.decode(vocab.encode("12+7") + [1, 5]) == "12+7"
    with pytest.raises(ValueError, match="synthetic task"):
        SyntheticTask("copy", min_len=1, max_len=2)
    with pytest.raises(ValueError, match="min_len"):
        SyntheticTask("sort", min_len=3, max_len=2)


@pytest.mark.parametrize(
    "name, min_len, max_len, num_symbols",
    [("reverse", 1, 3, 3), ("sort", 2, 2, 4), ("add", 1, 1, 10)],
)
def test_num_inputs_equals_the_distinct_inputs_drawn(name, min_len, max_len, num_symbols):
    # 2000 draws see every one of the at most 100 inputs (seeded: the same draws every run).
    gen = SyntheticTask(name, min_len=min_len, max_len=max_len, num_symbols=num_symbols)
    rng = np.random.default_rng(0)
    drawn = {tuple(gen.example(rng)[0]) for _ in range(2000)}
    assert len(drawn) == gen.num_inputs()
