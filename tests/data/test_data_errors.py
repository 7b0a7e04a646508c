"""Bad data through ``tasks.build_task``: one clear DataError naming the file or config field,
raised before any compilation, with the workdir left as it was (no vocabulary, no token cache).

Tiny files written to tmp_path; no network, no model.
"""

import os

# Local `datasets` builders need no network; make sure nothing tries the hub anyway.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flaxformer_lite.data import tasks
from flaxformer_lite.data.reading import DataError  # noqa: E402
from flaxformer_lite.data.tasks import lm as lm_task  # noqa: E402

WORDS = "a the man woman dog cat runs sits on in red blue big small park house".split()


def lines(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(" ".join(rng.choice(WORDS, size=rng.integers(2, 7))) + "\n" for _ in range(n))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes (what "left as it was" compares)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def fails_cleanly(config, workdir: Path, *fragments: str) -> str:
    """Builds the task, expects a DataError whose one-line message holds every fragment, and
    checks the workdir is unchanged. Returns the message."""
    workdir.mkdir(exist_ok=True)
    (workdir / "note.txt").write_text("kept")
    before = snapshot(workdir)
    with pytest.raises(DataError) as error:
        tasks.build_task(config, str(workdir))
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert snapshot(workdir) == before
    return message


# ============================================================================ translation


def translation_config(data_dir: Path, **overrides) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(
        dict(
            task="translation", dataset=None, dataset_config=None, data_dir=str(data_dir),
            data_format="parallel_text", source_lang="en", target_lang="de",
            train_split="train", eval_split="val", local_splits=None, vocab_size=40,
            shared_vocab=True, spm_model_type="char", max_len=16, too_long="truncate",
            tokens_per_batch=64, batch_size_multiple=1, packing=False, seed=0,
        )
    )  # fmt: skip
    config.update(overrides)
    return config


def write_pairs(directory: Path, split: str, en: str, de: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{split}.en").write_text(en, encoding="utf-8")
    (directory / f"{split}.de").write_text(de, encoding="utf-8")


@pytest.mark.parametrize("text", ["", "  \n\n \n"], ids=["no_line", "blank_lines"])
def test_translation_empty_training_split(tmp_path, text):
    data = tmp_path / "data"
    write_pairs(data, "train", text, text)
    write_pairs(data, "val", lines(5), lines(5, 1))
    fails_cleanly(
        translation_config(data),
        tmp_path / "work",
        "empty training split",
        f"{data}/train.en / {data}/train.de",
        "config.train_split",
        f"config.data_dir={str(data)!r}",
    )


def test_translation_empty_eval_split_stops_before_the_vocabulary(tmp_path):
    data = tmp_path / "data"
    write_pairs(data, "train", lines(30), lines(30, 1))
    write_pairs(data, "val", "", "")
    fails_cleanly(
        translation_config(data),
        tmp_path / "work",
        "empty eval split",
        "val.en",
        "config.eval_split",
    )


def test_translation_every_pair_dropped_leaves_no_token_cache(tmp_path):
    # The vocabulary exists (a first run built it); a setting that drops every pair must fail
    # before the new token cache is written.
    data = tmp_path / "data"
    write_pairs(data, "train", lines(30), lines(30, 1))
    write_pairs(data, "val", lines(5), lines(5, 1))
    work = tmp_path / "work"
    tasks.build_task(translation_config(data), str(work))
    caches = sorted(os.listdir(work / "data_cache"))
    fails_cleanly(
        translation_config(data, max_len=4, too_long="drop"),
        work,
        "no training examples left",
        "dropped 0 empty, 30 too long",
        "config.max_len=4",
    )
    assert sorted(os.listdir(work / "data_cache")) == caches


def test_translation_training_line_that_is_not_utf8(tmp_path):
    """A latin-1 byte in line 3 of the training source: the file, line and byte named, as the
    translate CLI names them, not a UnicodeDecodeError."""
    data = tmp_path / "data"
    write_pairs(data, "train", lines(30), lines(30, 1))
    write_pairs(data, "val", lines(5), lines(5, 1))
    text = (data / "train.en").read_bytes().split(b"\n")
    text[2] = b"caf\xe9 " + text[2]  # "cafe" with a latin-1 e-acute: byte 4 of line 3
    (data / "train.en").write_bytes(b"\n".join(text))
    fails_cleanly(
        translation_config(data),
        tmp_path / "work",
        f"{data}/train.en line 3: byte 4 (0xe9) is not UTF-8; convert the file to UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8)",
    )


# ============================================================================ language model


def lm_config(data_file: Path, **overrides) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(
        dict(
            task="lm", dataset=None, train_split="train", data_file=str(data_file),
            eval_fraction=0.2, eval_batches=0, vocab_size=40, spm_model_type="char",
            max_len=8, batch_size=2, seed=0, decode_eval=False, model={},
        )
    )  # fmt: skip
    config.update(overrides)
    return config


def test_lm_empty_training_file(tmp_path):
    (tmp_path / "text.txt").write_text("\n \n")
    fails_cleanly(
        lm_config(tmp_path / "text.txt"),
        tmp_path / "work",
        "empty training split",
        f"config.data_file={str(tmp_path / 'text.txt')!r}",
        "read 2 examples, kept 0",
    )


def test_lm_training_file_line_that_is_not_utf8(tmp_path):
    (tmp_path / "text.txt").write_bytes(lines(6).encode() + b"ok \xff\xfe\n" + lines(4).encode())
    fails_cleanly(
        lm_config(tmp_path / "text.txt"),
        tmp_path / "work",
        f"{tmp_path / 'text.txt'} line 7: byte 4 (0xff) is not UTF-8",
    )


def test_lm_empty_eval_split(tmp_path):
    (tmp_path / "text.txt").write_text(lines(4))
    fails_cleanly(
        lm_config(tmp_path / "text.txt", eval_fraction=0.0),
        tmp_path / "work",
        "empty eval split",
        "config.eval_fraction=0.0",
    )


def test_lm_eval_split_shorter_than_a_window_removes_the_new_vocabulary(tmp_path):
    # 20 lines: the eval split is the last 1 (a few tokens); a 64-token window does not fit.
    (tmp_path / "text.txt").write_text(lines(20))
    fails_cleanly(
        lm_config(tmp_path / "text.txt", eval_fraction=0.05, max_len=64),
        tmp_path / "work",
        "the eval split",
        "fewer than one window of config.max_len=64",
    )


def test_lm_max_len_too_short_for_the_eval_sample(tmp_path):
    (tmp_path / "text.txt").write_text(lines(4))
    prompt = lm_task.PROMPT_LEN
    # train.lm_sample asks for cfg.max_len - prompt_len - 1 new tokens (BOS takes one
    # position), prompt_len = min(PROMPT_LEN, max_len): at least one needs max_len >= 34.
    for max_len in (8, prompt, prompt + 1):
        assert max_len - min(prompt, max_len) - 1 < 1
        fails_cleanly(
            lm_config(tmp_path / "text.txt", max_len=max_len, decode_eval=True),
            tmp_path / "work",
            f"config.max_len={max_len} leaves no room",
            f"config.max_len >= {prompt + 2}",
            "config.decode_eval=False",
        )
    lm_task.check_prompt_fits(lm_config(tmp_path / "t", max_len=prompt + 2, decode_eval=True))
    lm_task.check_prompt_fits(lm_config(tmp_path / "t", max_len=8, decode_eval=False))
    # A longer model than the windows: the prompt is a whole 8-token window.
    lm_task.check_prompt_fits(lm_config(tmp_path / "t", decode_eval=True, model={"max_len": 10}))
    with pytest.raises(DataError, match=r"config.model.max_len=9 .* >= 10"):
        lm_task.check_prompt_fits(lm_config(tmp_path / "t", decode_eval=True, model={"max_len": 9}))


# ============================================================================ classification


def cls_config(data_dir: Path) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            task="classification", dataset=None, dataset_config=None, data_dir=str(data_dir),
            train_split="train", eval_split="validation", local_splits={"validation": "dev"},
            text_column="sentence", label_column="label", vocab_size=40,
            spm_model_type="char", max_len=16, batch_size=4, seed=0,
        )
    )  # fmt: skip


def write_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))


@pytest.mark.parametrize("split", ["train", "dev"])
def test_classification_empty_split(tmp_path, split):
    rows = [("a red dog", 1), ("the small cat", 0)]
    write_tsv(tmp_path / "data" / "train.tsv", [] if split == "train" else rows)
    write_tsv(tmp_path / "data" / "dev.tsv", [] if split == "dev" else rows)
    name, field = ("training", "train_split") if split == "train" else ("eval", "eval_split")
    fails_cleanly(
        cls_config(tmp_path / "data"),
        tmp_path / "work",
        f"empty {name} split",
        str(tmp_path / "data" / f"{split}.tsv"),
        f"config.{field}",
    )


# ============================================================================ synthetic


def synthetic_config(**synthetic) -> ml_collections.ConfigDict:
    fields = dict(name="reverse", min_len=1, max_len=1, num_symbols=2, num_eval=2)
    fields.update(synthetic)
    return ml_collections.ConfigDict(dict(task="synthetic", seed=0, batch_size=4, synthetic=fields))


@pytest.mark.parametrize("num_eval", [2, 3, 0])
def test_synthetic_every_input_held_out(tmp_path, num_eval):
    # "reverse" of 1 symbol out of 2 has 2 distinct inputs: holding out both (or more) left
    # the training stream looking for an input forever.
    fails_cleanly(
        synthetic_config(num_eval=num_eval),
        tmp_path / "work",
        f"config.synthetic.num_eval={num_eval} must be in [1, 2)",
        "the 2 distinct inputs of 'reverse' with lengths 1-1 over 2 symbols",
    )


def test_synthetic_one_input_left_trains_on_it_only(tmp_path):
    task = tasks.build_task(synthetic_config(num_eval=1), str(tmp_path / "work"))
    held_out = task.eval_batches[0]["inputs"][0]
    batch = task.train.next()
    assert batch["inputs"].shape == (4, 2)
    assert (batch["inputs"][:, 1] == 1).all()  # one symbol, then EOS
    assert len({int(x) for x in batch["inputs"][:, 0]}) == 1
    assert batch["inputs"][0, 0] != held_out[0]


def test_train_leaves_no_workdir_behind_when_the_data_is_refused(tmp_path):
    """Through train.py's loop: the DataError comes out, and the workdir it had to create for
    the vocabulary and token cache is gone again (an existing one stays, as it was)."""
    import train

    from helpers.tiny_configs import two_step_config

    config = two_step_config()
    config.synthetic.update(min_len=1, max_len=1, num_symbols=2, num_eval=2)
    with pytest.raises(DataError, match=r"config\.synthetic\.num_eval=2 must be in \[1, 2\)"):
        train.train_and_evaluate(config, str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    fails_cleanly(config, tmp_path / "old", "config.synthetic.num_eval=2")
    with pytest.raises(DataError):
        train.train_and_evaluate(config, str(tmp_path / "old"))
    assert snapshot(tmp_path / "old") == {"note.txt": b"kept"}
