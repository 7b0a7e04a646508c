"""Storage anywhere: runs, vocabularies, metrics and CLI files in a ``gs://`` bucket, served by a
real GCS server on localhost (the ``gcs`` fixture of conftest.py: gcp-storage-emulator)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

import jax
import numpy as np
import pytest
from etils import epath

from flaxformer_lite.cli import attention_maps, evaluate, plot_metrics, translate
from flaxformer_lite.core import paths
from flaxformer_lite.core.checkpoints import finished_steps
from flaxformer_lite.data import reading as data
from flaxformer_lite.data.tokenizer import Tokenizer, load_or_train
from flaxformer_lite.inference.translator import load_vocabularies
from flaxformer_lite.training.metrics import MetricWriter, read_metrics

from helpers.runs import ROOT, saved_state, train_cmd, wait_for_checkpoint
from helpers.tensorboard import tensorboard_scalars

STEPS = 20  # room for the kill to land mid-run: saves 10, 15 and 20 each wait for the one before
SOURCES = ["31415", "2718", "1414", "57721", "6"]


def test_a_run_in_a_bucket_is_killed_resumes_bitwise_and_serves_translate_and_evaluate(
    gcs, tmp_path, monkeypatch
):
    """The default config (tiny) trains into gs://bucket/run, is SIGKILLed after its first
    checkpoint, resumes from the bucket and ends bitwise equal to an uninterrupted local run;
    translate and evaluate then read that workdir and write their outputs into the bucket.
    Every process runs in an empty folder that must stay empty. The killed run's local
    TensorBoard staging folder is emptied and removed by the run that resumes."""
    run = "gs://bucket/run"
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    staging = lambda: sorted(p.name for p in tmp.glob("flaxformer_tensorboard_*"))  # noqa: E731
    cmd = lambda workdir: train_cmd(workdir, STEPS, decode_eval=False)  # noqa: E731
    popen = dict(cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    killed = subprocess.Popen(cmd(run), **popen)
    first = wait_for_checkpoint(run, killed)
    killed.send_signal(signal.SIGKILL)
    out, _ = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, out  # killed mid-run, not after it ended
    saved = finished_steps(f"{run}/checkpoints")
    assert saved and first <= saved[-1] < STEPS
    left = staging()
    # Events not yet cleaned up: the writer closes only after the last save (train.py), and
    # the last checkpoint is not finished.
    assert len(left) == 1 and any((tmp / left[0]).iterdir())

    # The uninterrupted reference (local) runs beside the resumed one; both start after the
    # killed run compiled the step, so they load it from the persistent compilation cache.
    reference_log = tmp_path / "reference.log"
    with open(reference_log, "w") as log:
        reference = subprocess.Popen(
            cmd(tmp_path / "reference"), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    resumed = subprocess.run(
        cmd(run), timeout=300, capture_output=True, text=True, cwd=cwd, env=env
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {saved[-1]} ({run}/checkpoints)" in resumed.stdout
    # The killed run's lock (same host, its pid gone) is taken over at once, saying so.
    host = socket.gethostname()
    assert f"run lock: took {run}/run.lock over from host {host}, pid {killed.pid}," in (
        resumed.stdout
    )
    assert reference.wait(timeout=300) == 0, reference_log.read_text()
    assert staging() == []

    # The whole train state (parameters, Adam moments, step, RNG) and the data position.
    (a, data_a), (b, data_b) = saved_state(tmp_path / "reference"), saved_state(run)
    assert int(b["step"]) == STEPS and data_a == data_b == {"train": {"index": STEPS}}
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # metrics.jsonl grew line by line across the kill (no append on GCS): the killed run's
    # lines, then the resumed run's, each equal to the reference's line of that step.
    def losses(workdir: str) -> tuple[list[tuple[int, float]], dict[str, float]]:
        lines = read_metrics(workdir)
        train = [(m["step"], m["train/smoothed_kl"]) for m in lines if "train/smoothed_kl" in m]
        (final,) = [m for m in lines if "eval/smoothed_kl" in m]
        assert final["step"] == STEPS
        return train, {k: v for k, v in final.items() if k.startswith("eval/")}

    expected, expected_eval = losses(str(tmp_path / "reference"))
    train, final_eval = losses(run)
    assert [s for s, _ in expected] == list(range(5, STEPS + 1, 5))
    assert set(train) == set(expected) and final_eval == expected_eval
    assert train == expected  # one row per step: the killed run's rows past its checkpoint moved
    assert len(train) > len([s for s, _ in expected if s > saved[-1]])  # pre-kill lines kept
    scalars = tensorboard_scalars(f"{run}/tensorboard")
    expected_scalars = {("train/smoothed_kl", s) for s, _ in expected}
    assert expected_scalars | {("eval/smoothed_kl", STEPS)} <= scalars
    for name in ("config.json", "model_config.json", "vocab.json"):
        assert (epath.Path(run) / name).read_text() == (tmp_path / "reference" / name).read_text()

    # The CLIs (in this process, from the empty folder): workdir, inputs, outputs in the bucket.
    test = epath.Path("gs://bucket/test")
    (test / "src.txt").write_text("".join(s + "\n" for s in SOURCES))
    (test / "ref.txt").write_text("".join(s[::-1] + "\n" for s in SOURCES))
    decode = ["--workdir", run, "--method", "greedy"]
    monkeypatch.chdir(cwd)
    assert (
        translate.main([*decode, "--input", f"{test}/src.txt", "--output", f"{test}/translate.hyp"])
        == 0
    )
    assert evaluate.main(
        [*decode, "--source", f"{test}/src.txt", "--reference", f"{test}/ref.txt",
         "--output", f"{test}/evaluate.hyp", "--report", f"{test}/report.json"]
    ) == 0  # fmt: skip
    text = (test / "translate.hyp").read_text()
    hyps = text.split("\n")[:-1]
    assert len(hyps) == len(SOURCES) and text.endswith("\n")  # one line per source
    assert (test / "evaluate.hyp").read_text() == (test / "translate.hyp").read_text()
    report = json.loads((test / "report.json").read_text())
    assert report["num_sentences"] == len(SOURCES) and report["workdir"] == run
    assert report["checkpoint"] == f"{run} (step {STEPS})"
    assert report["exact_match"] == sum(
        h == s[::-1] for h, s in zip(hyps, SOURCES, strict=True)
    ) / len(SOURCES)

    assert list(cwd.iterdir()) == []  # nothing written under the current directory


def test_vocabulary_data_metrics_and_figures_in_a_bucket(gcs, tmp_path):
    """The pieces the run above does not exercise: a SentencePiece model, data files, a
    resumed metrics file, and the figure writers of plot_metrics and attention_maps."""
    root = epath.Path("gs://bucket/unit")
    # SentencePiece: trained into the bucket, loaded back from it (as bytes), not retrained.
    texts = ["a man rides a bike", "a dog runs on the beach", "two men ride bikes"] * 20
    trained = Tokenizer.train(texts, str(root / "spm_shared.model"), 40, model_type="char")
    assert trained.vocab_size > 20

    def fail():
        raise AssertionError("retrained although the model is in the bucket")

    again = load_or_train(str(root / "spm_shared.model"), fail, 40)
    source, target = load_vocabularies(str(root))
    assert source is target
    for tokenizer in (again, source):
        assert tokenizer.encode("a dog rides") == trained.encode("a dog rides")

    # Data files: split on "\n" only, as locally ("\r" and U+2028 stay inside their line).
    (root / "train.en").write_text("a b\r c\nd\u2028e\n\nf\n")
    (root / "train.de").write_text("1\n2\n3\n4\n")
    local = tmp_path / "data"
    local.mkdir()
    for name in ("train.en", "train.de"):
        (local / name).write_bytes((root / name).read_bytes())
    remote = data.load_pairs(data_dir=str(root), split="train", source_lang="en", target_lang="de")
    assert remote == data.load_pairs(
        data_dir=str(local), split="train", source_lang="en", target_lang="de"
    )
    assert len(remote) == 3  # the empty line's pair is dropped
    with pytest.raises(FileNotFoundError, match="gs://bucket/unit/missing.en"):
        data.read_parallel_files(str(root / "missing.en"), str(root / "train.de"))

    # metrics.jsonl: a second writer (a resumed run) keeps the first one's lines.
    for steps in ([10, 20], [30]):
        writer = MetricWriter(str(root))
        for step in steps:
            writer.write(step, {"train/perplexity": 2.0 + step, "eval/perplexity": 3.0})
        writer.close()
    assert [m["step"] for m in read_metrics(str(root))] == [10, 20, 30]
    assert ("train/perplexity", 30) in tensorboard_scalars(str(root / "tensorboard"))
    # A third run resumes from step 20 (the one that wrote step 30 died before checkpointing
    # it): row 30 goes to an object of its own, and the new rows follow step 20.
    writer = MetricWriter(str(root))
    line = writer.set_aside_rows_after(20, now=lambda: 0.0)
    aside = root / "metrics.orphaned-19700101T000000Z.jsonl"
    assert line.startswith(
        f"metrics: moved 1 line of step 30 from {root}/metrics.jsonl to {aside}:"
    )
    writer.write(25, {"train/perplexity": 27.0, "eval/perplexity": 3.0})
    writer.close()
    assert [m["step"] for m in read_metrics(str(root))] == [10, 20, 25]
    assert [json.loads(x)["step"] for x in aside.read_text().splitlines()] == [30]

    # Figures straight into the bucket.
    assert plot_metrics.main(["--workdir", str(root), "--output", str(root / "loss.png")]) == 0
    pieces = ["a", "b", "c"]
    maps = {
        "encoder_self": [np.full((2, 3, 3), 1 / 3)],
        "decoder_self": [np.full((2, 3, 3), 1 / 3)],
        "encoder_decoder": [np.full((2, 3, 3), 1 / 3)],
        "source_pieces": pieces,
        "target_pieces": pieces,
        "decoder_input_pieces": pieces,
    }
    written = attention_maps.write_maps(maps, str(root / "maps"))
    assert len(written) == 3
    for png in [str(root / "loss.png"), *written]:
        assert epath.Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert paths.is_uri(written[0]) and not paths.is_uri(tmp_path)
