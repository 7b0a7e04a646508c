"""Multi-host input: one vocabulary and one token cache written by process 0 and read by
every process, each host's rows of every batch, and evaluation decoding in reference order
whatever the device-to-process layout (2 jax.distributed processes on localhost, and 8
simulated devices in one process)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flaxformer_lite.data.tasks.translation import build_translation_data

ROOT = Path(__file__).resolve().parents[2]

from helpers.multihost_worker import SENTENCES, translation_config
from helpers.runs import free_port

EN = "a the man woman dog cat runs sits on in red blue big small park house".split()
DE = "ein der mann frau hund katze läuft sitzt auf im rot blau groß klein park haus".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for split, n in (("train", 300), ("val", 24)):
        src, tgt = [], []
        for _ in range(n):
            idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 8))]
            src.append(" ".join(EN[i] for i in idx))
            tgt.append(" ".join(DE[i] for i in idx))
        (directory / f"{split}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
        (directory / f"{split}.de").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return directory


def run_workers(out: Path, workdir: Path, data_dir: Path, num_processes: int, devices: int):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests/helpers/multihost_worker.py"),
                str(out),
                str(workdir),
                str(data_dir),
                str(i),
                str(num_processes),
                address,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(num_processes)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outs, strict=True):
        assert p.returncode == 0, text[-4000:]
    return [np.load(out / f"process{i}.npz") for i in range(num_processes)]


def test_two_processes_one_vocabulary_one_cache_own_rows_and_ordered_decoding(tmp_path, corpus):
    data_dir, workdir = tmp_path / "data", tmp_path / "work"
    shutil.copytree(corpus, data_dir)
    p0, p1 = run_workers(tmp_path, workdir, data_dir, num_processes=2, devices=4)

    # One vocabulary, written once (no temporary files of a second writer), same ids.
    assert sorted(p.name for p in workdir.glob("spm*")) == ["spm_shared.model"]
    for i in range(len(SENTENCES)):
        np.testing.assert_array_equal(p0[f"ids{i}"], p1[f"ids{i}"])
        assert len(p0[f"ids{i}"]) > 0
    assert int(p0["vocab_size"]) == int(p1["vocab_size"])
    # One token cache, complete.
    caches = list((workdir / "data_cache").iterdir())
    assert len(caches) == 1 and (caches[0] / "meta.json").is_file()
    assert not list(caches[0].glob("*.tmp.*"))

    # Each process got its half of every global batch of a 1-process run, which reuses the
    # cache: the training files are not read again (here: not even there any more).
    for name in ("train.en", "train.de"):
        (data_dir / name).unlink()
    one = build_translation_data(translation_config(str(data_dir)), str(workdir))
    for i in range(3):
        global_batch = one.train.next()
        for key, value in global_batch.items():
            np.testing.assert_array_equal(
                np.concatenate([p0[f"train{i}_{key}"], p1[f"train{i}_{key}"]]), value
            )

    # The mesh interleaves the two processes' devices, so rows of a process are not one
    # contiguous block; hypotheses still come back in reference order, equal to one device.
    assert p0["mesh_process"].tolist() == [0, 1] * 4
    assert len(set(map(tuple, p0["inputs"].tolist()))) == len(p0["inputs"])  # distinct rows
    for p in (p0, p1):
        np.testing.assert_array_equal(p["sharded"], p0["single"])


def test_eight_permuted_devices_decode_in_reference_order(tmp_path, corpus):
    (p,) = run_workers(tmp_path, tmp_path / "work", corpus, num_processes=1, devices=8)
    assert p["mesh_order"].tolist() != sorted(p["mesh_order"].tolist())
    np.testing.assert_array_equal(p["sharded"], p["single"])


GCS_ROUND_TRIP = """
import numpy as np
from etils import epath
from flaxformer_lite.data.encoding import EncodedPairs
from flaxformer_lite.data.workdir import load_token_cache, save_token_cache
examples = [{"inputs": np.array([5, 6, 1], np.int32), "targets": np.array([7, 1], np.int32)},
            {"inputs": np.array([8, 1], np.int32), "targets": np.array([9, 9, 9, 1], np.int32)}]
cache = "gs://bucket/run/data_cache/train-x"
save_token_cache(cache, EncodedPairs.from_examples(examples), {"key": {"a": 1}, "stats": {}})
got, meta = load_token_cache(cache, {"a": 1})
assert isinstance(got.inputs_tokens, np.memmap)  # copied to local disk, then mapped
for i, e in enumerate(examples):
    for side in ("inputs", "targets"):
        assert got[i][side].tolist() == e[side].tolist()
assert load_token_cache(cache, {"a": 2}) is None  # another key: not this cache
names = sorted(p.name for p in epath.Path(cache).iterdir())
assert names == ["inputs_offsets.npy", "inputs_tokens.npy", "meta.json",
                 "targets_offsets.npy", "targets_tokens.npy"], names
print("ok")
"""


def test_token_cache_round_trip_through_a_local_gcs_server(tmp_path, gcs):
    env = {**os.environ, **gcs, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", GCS_ROUND_TRIP], env=env, capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # nothing written under the current directory
