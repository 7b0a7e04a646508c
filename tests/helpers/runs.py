"""train.py runs in subprocesses for tests (a one-device run also in this process:
``train_here``), and what they leave behind: the command lines, waiting for a checkpoint, the
saved state, its files' digests, the metrics rows and the last smoothed loss; a free
localhost port for multi-process runs and local servers."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from flaxformer_lite.core.checkpoints import Checkpointer, finished_steps
from flaxformer_lite.training.metrics import read_metrics

from helpers.tiny_configs import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]

# The tiny run of the sharding tests: identical parameters on any mesh and process count.
SHARDING_FLAGS = [
    "--config.batch_size=16",
    "--config.num_train_steps=6",
    "--config.log_every=3",
    "--config.eval_every=0",
    "--config.checkpoint_every=100",
    "--config.warmup_steps=2",
    "--config.learning_rate=0.003",
    # Constant after warmup, so step 6 of the 24-step 2-process run is the 6-step run's end.
    "--config.schedule=constant",
    "--config.synthetic.max_len=6",
    "--config.synthetic.min_len=2",
    "--config.synthetic.num_eval=32",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    # Wide enough for checkpoints of megabytes: test_sharding's full disk holds 2.5 of them,
    # room for two whatever OCDBT's save-to-save differences (up to about 200 KB).
    "--config.model.d_ff=2048",
    "--config.model.num_encoder_layers=1",
    "--config.model.num_decoder_layers=1",
    "--config.model.dropout_rate=0.1",
    # The key bias has a zero gradient in exact arithmetic (softmax ignores a constant per
    # query); Adam would turn its rounding noise into full-size steps that differ by layout.
    "--config.model.use_bias=False",
    # These tests compare checkpoints and losses; the final evaluation decodes nothing (decoding
    # on meshes and on 2 processes: test_generate, test_multihost_data).
    "--config.decode_eval=False",
    "--config.peak_flops=1e11",  # no start-up matmul measurement (tiny_configs.TINY_OVERRIDES)
]


def free_port() -> int:
    """A TCP port nobody listens on right now (for a localhost server or coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(workdir: Path | str, steps: int, **config) -> list[str]:
    """``python train.py`` on the default config with tiny overrides (and ``config``'s, which
    may name model fields: ``**{"model.d_ff": 4096}``)."""
    overrides = {
        **TINY_OVERRIDES,
        "num_train_steps": steps,
        "checkpoint_every": 5,
        "eval_every": 0,
        "log_every": 5,
        **config,
    }
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs/default.py"),
        "--workdir",
        str(workdir),
    ]
    cmd += [
        "--config.synthetic.max_len=6",
        "--config.synthetic.min_len=2",
        "--config.synthetic.num_eval=32",
        "--config.model.d_model=32",
        "--config.model.num_heads=2",
        "--config.model.d_ff=64",
        "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=1",
    ]
    # After the tiny model's flags, so that a caller's {"model.d_ff": 4096} replaces its own.
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    return cmd


def wait_for_checkpoint(workdir: Path | str, proc: subprocess.Popen, timeout: float = 240) -> int:
    """The latest complete checkpoint step once one exists in ``workdir`` (local or gs://)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = finished_steps(os.path.join(workdir, "checkpoints"))
        if steps:
            return max(steps)
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no checkpoint appeared in time")


def run_train(workdir: Path, *extra: str, devices: int = 1, env_extra=None, wait=True, prefix=()):
    """train.py with SHARDING_FLAGS (and ``extra``) on ``devices`` simulated CPU devices;
    ``wait=False``: the running Popen (stdout and stderr together), else the finished run,
    asserted successful. ``prefix``: a command that runs the command line after it (e.g.
    ``unshare``)."""
    # faulthandler: a SIGABRT (a test's timeout) prints where every thread of the run stands
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1"}
    if devices > 1:
        env["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        )
    env.update(env_extra or {})
    cmd = [
        *prefix,
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs/default.py"),
        "--workdir",
        str(workdir),
        *SHARDING_FLAGS,
        *extra,
    ]
    if not wait:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def train_here(workdir: Path, *extra: str) -> dict:
    """What ``run_train(workdir, *extra)`` runs on one device, in this process: the same
    command-line flags through the same parser (absl, ml_collections' config file flag,
    preflight.parse_flags) on fresh flag values, then ``train.train_and_evaluate``; returns
    its final metrics. For a one-device reference run, where a subprocess would only add the
    start of a Python with JAX (the runs on several devices or processes stay subprocesses)."""
    from absl import flags
    from ml_collections import config_flags

    import train
    from flaxformer_lite.training import preflight

    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "Python config file.", flag_values=values)
    argv = ["train.py", "--config", str(ROOT / "configs/default.py"), *SHARDING_FLAGS, *extra]
    saved_argv, sys.argv = sys.argv, argv  # config_flags finds the overrides in sys.argv
    try:
        preflight.parse_flags(argv, values)
    finally:
        sys.argv = saved_argv
    return train.train_and_evaluate(values.config, str(workdir))


def saved_state(workdir: Path | str, step: int | None = None):
    """(train state, data state) of ``workdir``'s checkpoint at ``step`` (None: the latest);
    ``workdir`` local or gs://."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    state, data = ckpt.restore(step=step)
    ckpt.close()
    return state, data


def checkpoint_params(workdir: Path) -> dict:
    """The latest checkpoint's parameters as saved (nested dicts of NumPy arrays)."""
    state, _ = saved_state(workdir)
    return jax.tree_util.tree_map(np.asarray, state["params"])


def digests(step_dir: Path) -> dict[str, str]:
    """sha256 of every file under a checkpoint step's directory, by relative path."""
    return {
        str(p.relative_to(step_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    }


def assert_one_row_per_step_and_kind(workdir: Path) -> None:
    """``workdir``'s metrics.jsonl has train and eval rows, at most one per step of each."""
    rows = read_metrics(str(workdir))
    for kind in ("train/smoothed_kl", "eval/smoothed_kl"):
        steps = [m["step"] for m in rows if kind in m]
        assert steps and len(steps) == len(set(steps)), (kind, steps)


def final_loss(workdir: Path) -> float:
    """The last ``train/smoothed_kl`` in ``workdir``'s metrics.jsonl."""
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "train/smoothed_kl" in m][-1]["train/smoothed_kl"]
