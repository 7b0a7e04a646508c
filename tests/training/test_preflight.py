"""Bad training inputs stop train.py before any data, write or compilation, with one line that
names the field: each case runs ``train.train_and_evaluate`` in process and checks the error,
that nothing was compiled and that the workdir is byte for byte as it was."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402
from flaxformer_lite.training import preflight  # noqa: E402
from flaxformer_lite.training.preflight import ConfigError  # noqa: E402

from helpers.tiny_configs import load_config, two_step_config

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "common")


def snapshot(path: Path) -> dict[str, bytes | None] | None:
    """Every file (bytes) and folder (None) under ``path``; None if ``path`` does not exist."""
    if not path.exists():
        return None
    if path.is_file():
        return {".": path.read_bytes()}
    return {
        str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(path.rglob("*"))
    }


@contextlib.contextmanager
def no_compilation():
    """Fails if JAX traces or compiles anything inside the block."""
    events: list[str] = []

    def listener(event: str, *_, **__) -> None:
        if "/jax/core/compile" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not events, f"compiled before the error: {events}"


def assert_refused(config, workdir: Path, match: str) -> str:
    """train_and_evaluate raises ConfigError matching ``match`` (one line) before it builds
    any data or compiles anything, and leaves ``workdir`` as it was; returns the message."""
    before = snapshot(workdir)
    build_task = train.tasks.build_task

    def no_data(*args, **kwargs):
        raise AssertionError("the data was built before the error")

    train.tasks.build_task = no_data
    try:
        with no_compilation(), pytest.raises(ConfigError, match=match) as info:
            train.train_and_evaluate(config, str(workdir))
    finally:
        train.tasks.build_task = build_task
    assert snapshot(workdir) == before
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real 2-step run of two_step_config(): config.json, model_config.json, checkpoints 1, 2
    (``stop_at`` ends it as a preemption would: saved, no evaluation to compile)."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    train.train_and_evaluate(two_step_config(), str(workdir), stop_at=2)
    assert preflight.latest_saved_step(str(workdir)) == 2
    return workdir


def _set(config, key: str, value):
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    if leaf in node:
        del node[leaf]  # a config file may give any type; ConfigDict would refuse a new one
    node[leaf] = value
    return config


@pytest.mark.parametrize(
    "key, value, match",
    [
        (
            "label_smoothing",
            1.5,
            r"^config\.label_smoothing must be a number in \[0, 1\); got 1\.5$",
        ),
        ("label_smoothing", -0.1, r"config\.label_smoothing must be a number in \[0, 1\)"),
        (
            "rdrop_alpha",
            -1.0,
            r"^config\.rdrop_alpha must be a number in \[0, inf\) \(0 = off\); got -1\.0$",
        ),
        (  # two_step_config's model has no dropout: both R-Drop passes would be equal
            "rdrop_alpha",
            5.0,
            r"^config\.rdrop_alpha=5\.0 needs dropout: with config\.model\.dropout_rate/"
            r"attention_dropout_rate/activation_dropout_rate/word_dropout_rate all 0 "
            r".*config\.rdrop_alpha=0$",
        ),
        ("grad_accum_steps", 0, r"config\.grad_accum_steps must be a positive integer; got 0"),
        (
            "grad_accum_steps",
            3,
            r"config\.grad_accum_steps \(3\) must divide config\.batch_size \(16\)$",
        ),
        ("log_every", 0, r"config\.log_every must be a positive integer; got 0"),
        ("checkpoint_every", 0, r"config\.checkpoint_every must be a positive integer; got 0"),
        ("eval_every", -1, r"config\.eval_every must be an integer >= 0 \(0 = evaluate only"),
        ("keep_checkpoints", 0, r"config\.keep_checkpoints must be a positive integer"),
        (
            "average_checkpoints",
            9,
            r"^config\.average_checkpoints \(9\) must be <= config\.keep_checkpoints \(3\): only",
        ),
        ("average_checkpoints", 0, r"config\.average_checkpoints must be a positive integer"),
        (
            "cpu_devices",
            0,
            r"^config\.cpu_devices must be a positive integer \(None = JAX's default, one CPU "
            r"device\); got 0$",
        ),
        (
            "peak_flops",
            -1.0,
            r"^config\.peak_flops must be a number in \(0, inf\) FLOP/s \(None = measure\); "
            r"got -1\.0$",
        ),
        ("num_train_steps", 0, r"config\.num_train_steps must be a positive integer; got 0"),
        ("batch_size", 0, r"config\.batch_size must be a positive integer; got 0"),
        ("batch_size", -8, r"config\.batch_size must be a positive integer; got -8"),
        ("learning_rate", 0.0, r"config\.learning_rate must be a number in \(0, inf\)"),
        (
            "optimizer",
            "sgd",
            r"config\.optimizer must be one of \('adam', 'adamw', 'muon'\); got 'sgd'",
        ),
        (
            "weight_decay",
            0.1,
            r"^config\.weight_decay \(0\.1\) needs config\.optimizer='adamw' or 'muon'; 'adam' has",
        ),
        ("decode_eval", "yes", r"config\.decode_eval must be True or False"),
        ("task", "vision", r"config\.task must be one of \('synthetic', "),
        ("model.max_len", 0, r"config\.model: TransformerConfig\.max_len must be a positive"),
        ("model.num_heads", 3, r"config\.model: TransformerConfig\.d_model \(16\) must be divis"),
        ("model.use_bias", "no", r"config\.model: TransformerConfig\.use_bias must be a bool"),
        ("model.vocab_size", 99, r"config\.model\.vocab_size is set by the data"),
        ("synthetic.max_len", 0, r"config\.synthetic\.max_len must be a positive integer"),
        ("synthetic.name", "revers", r"config\.synthetic: synthetic task must be one of"),
        ("mesh_shape", None, r"config\.mesh_shape \(\d+, 1, 1\) does not fit this run: .*devices"),
        ("allow_changes", "learning_rte", r"allow_changes names 'learning_rte'.*learning_rate\?"),
        ("allow_changes", "model.d_model", r"cannot allow model\.d_model: it changes the shapes"),
        ("allow_changes", "model.head_dim", r"cannot allow model\.head_dim: it changes the"),
        ("model.head_dim", 0, r"config\.model: TransformerConfig\.head_dim must be None or a"),
        # Misspelt keys (in a config file, or set in code) and a key of another task.
        (
            "num_train_step",
            5,
            r"^config\.num_train_step is not a config key of task 'synthetic'; "
            r"did you mean num_train_steps\?$",
        ),
        (
            "model.d_mdoel",
            5,
            r"^config\.model\.d_mdoel is not a TransformerConfig field; did "
            r"you mean d_model\?$",
        ),
        ("synthetic.num_symbol", 5, r"config\.synthetic\.num_symbol .*did you mean num_symbols\?"),
        (
            "tokens_per_batch",
            2048,
            r"^config\.tokens_per_batch is not a config key of task "
            r"'synthetic'; known keys: allow_changes, average_checkpoints, b1, ",
        ),
    ],
)
def test_bad_value_or_key_is_refused_before_any_work(tmp_path, key, value, match):
    config = two_step_config()
    if key == "mesh_shape":
        value = (jax.device_count() + 1, 1, 1)
    with config.unlocked():
        _set(config, key, value)
    assert_refused(config, tmp_path / "new_run", match)  # not created
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("kept")
    assert_refused(config, tmp_path / "old", match)  # an existing folder, untouched


def test_workdir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "results.txt"
    path.write_text("not a folder")
    assert_refused(two_step_config(), path, r"--workdir .*results\.txt is an existing file")


def test_every_shipped_config_passes_and_every_key_is_known():
    """The configs/*.py files use only known keys with valid values (a key added to a config
    or to configs/common.py without preflight.TASK_KEYS / COMMON_KEYS fails here)."""
    assert set(load_config("default").keys()) >= set(preflight.COMMON_KEYS)
    for name in CONFIGS:
        config = load_config(name)
        assert set(preflight.COMMON_KEYS) <= set(config.keys()), name
        if name == "finetune_marian":  # needs the pretrained model, and says so
            with pytest.raises(ConfigError, match="give --config.init_from=DIR_OR_HUB_ID"):
                preflight.check_config(config, device_count=jax.device_count())
            config.init_from = "Helsinki-NLP/opus-mt-en-de"
            assert config.tokenizer == config.init_from  # the tokenizer follows it
        preflight.check_config(config, device_count=jax.device_count())


def test_init_from_and_freeze_are_checked_before_any_work(tmp_path):
    config = load_config("finetune_marian")
    config.init_from = str(tmp_path / "no" / "such" / "folder")
    with pytest.raises(ConfigError, match="config.init_from=.* is not a folder"):
        preflight.check_config(config, device_count=jax.device_count())
    config.init_from = "Helsinki-NLP/opus-mt-en-de"
    config.freeze = ("encoder/(",)
    with pytest.raises(ConfigError, match=r"config.freeze pattern 'encoder/\(' is not a regex"):
        preflight.check_config(config, device_count=jax.device_count())


def test_translation_accumulation_must_divide_the_rows():
    config = load_config("multi30k")  # packed rows of 64 tokens, 2048 per batch: 32 rows
    config.grad_accum_steps = 5
    with pytest.raises(
        ConfigError, match=r"grad_accum_steps \(5\) must divide the 32 rows of a packed"
    ):
        preflight.check_config(config, device_count=1)
    config.grad_accum_steps = 4
    preflight.check_config(config, device_count=1)
    config.packing = False  # length buckets: rows are multiples of batch_size_multiple (8)
    config.grad_accum_steps = 16
    with pytest.raises(
        ConfigError, match=r"must divide config\.batch_size_multiple \(8; every bucket"
    ):
        preflight.check_config(config, device_count=1)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"subword_alpha": 1.5},
            r"^config\.subword_alpha must be a number in \(0, 1\] \(None = off\); got 1\.5$",
        ),
        ({"subword_alpha": -0.2}, r"^config\.subword_alpha must be a number in \(0, 1\]"),
        (
            {"subword_alpha": 0.5, "subword_samples": 0},
            r"^config\.subword_samples must be a positive integer \(segmentations drawn",
        ),
        (
            {"subword_alpha": 0.5, "spm_model_type": "char"},
            r"^config\.subword_alpha needs config\.spm_model_type 'unigram' or 'bpe'",
        ),
    ],
)
def test_subword_sampling_settings_are_checked(changes, match):
    config = load_config("multi30k")
    config.update(changes)
    with pytest.raises(ConfigError, match=match):
        preflight.check_config(config, device_count=1)


def test_subword_sampling_is_refused_with_a_pretrained_vocabulary():
    config = load_config("finetune_marian")
    config.init_from = "Helsinki-NLP/opus-mt-en-de"
    with config.unlocked():
        config.subword_alpha = 0.5
    with pytest.raises(
        ConfigError, match=r"config\.tokenizer=.* is pretrained: set config\.subword_alpha=None"
    ):
        preflight.check_config(config, device_count=1)
    config.subword_alpha = None
    preflight.check_config(config, device_count=1)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"bidirectional_epochs": -1},
            r"^config\.bidirectional_epochs must be an integer >= 0 \(epochs that also train "
            r"target -> source\); got -1$",
        ),
        (
            {"bidirectional_epochs": 6, "shared_vocab": False},
            r"^config\.bidirectional_epochs trains reversed pairs, which needs one vocabulary "
            r"for both languages: config\.shared_vocab=True and no config\.tokenizer \(got "
            r"shared_vocab=False",
        ),
    ],
)
def test_bidirectional_training_settings_are_checked(changes, match):
    config = load_config("multi30k")
    config.update(changes)
    with pytest.raises(ConfigError, match=match):
        preflight.check_config(config, device_count=1)
    config.update(bidirectional_epochs=6, shared_vocab=True)
    preflight.check_config(config, device_count=1)


def test_bidirectional_training_is_refused_with_a_pretrained_vocabulary():
    config = load_config("finetune_marian")
    config.init_from = "Helsinki-NLP/opus-mt-en-de"
    with config.unlocked():
        config.bidirectional_epochs = 3
    with pytest.raises(ConfigError, match=r"tokenizer='Helsinki-NLP/opus-mt-en-de'\); or set "
                       r"config\.bidirectional_epochs=0$"):  # fmt: skip
        preflight.check_config(config, device_count=1)
    config.bidirectional_epochs = 0
    preflight.check_config(config, device_count=1)


def test_batch_rows_must_split_over_the_data_devices():
    """Without devices to spare: the device count is an argument of the check."""
    config = two_step_config(batch_size=6)
    with pytest.raises(ConfigError, match=r"^config\.batch_size \(6\) must be a multiple of 4, "
                       r"the devices a batch is split over \(data x fsdp of config\.mesh_shape "
                       r"\(4, 1, 1\)\)$"):  # fmt: skip
        preflight.check_config(config, device_count=4)
    config.mesh_shape = (2, 1, 2)  # 2-way data x 2-way tensor: 6 rows split in 2
    preflight.check_config(config, device_count=4)
    with pytest.raises(ConfigError, match=r"config\.mesh_shape \(2, 1, 2\) does not fit .* 8"):
        preflight.check_config(config, device_count=8)


# ----------------------------------------------------------------------------- resume


def test_resume_with_a_changed_optimizer_field_names_it_old_to_new(trained):
    message = assert_refused(
        two_step_config(learning_rate=1e-3, num_train_steps=5),
        trained,
        r"config differs from the run in .* \(checkpoint step 2\): learning_rate 0\.003 -> 0\.001;",
    )
    assert message.endswith("--config.allow_changes=learning_rate")
    assert "num_train_steps" not in message  # always allowed to change


def test_resume_with_a_changed_model_shape_cannot_be_allowed(trained):
    config = two_step_config()
    config.model.d_model = 32
    message = assert_refused(config, trained, r"model\.d_model 16 -> 32; model\.d_model cannot ")
    assert "allow_changes" not in message
    assert_refused(two_step_config(optimizer="adamw"), trained, r"optimizer 'adam' -> 'adamw'")


def test_resume_compares_model_config_json_on_its_own(trained, tmp_path):
    """A workdir whose config.json is gone (or predates a default's change) is still checked
    against model_config.json, the file inference builds the model from."""
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    (copy / "config.json").unlink()
    config = two_step_config()
    config.model.d_ff = 48
    assert_refused(config, copy, r": model\.d_ff 32 -> 48; model\.d_ff cannot change")
    saved = json.loads((copy / "model_config.json").read_text())
    saved["norm_type"] = "rmsnorm"  # as if the default had changed since
    (copy / "model_config.json").write_text(json.dumps(saved))
    assert_refused(two_step_config(), copy, r"model\.norm_type 'rmsnorm' -> 'layernorm'")


def test_a_run_saved_before_a_key_was_added_resumes_with_its_default(trained, tmp_path):
    """config.json of a run older than rdrop_alpha lacks the key: its default (0, off) trains
    as that run did, so resuming is no change; any other value is one."""
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    saved = json.loads((copy / "config.json").read_text())
    del saved["rdrop_alpha"]
    (copy / "config.json").write_text(json.dumps(saved))
    preflight.check_run(two_step_config(num_train_steps=3), str(copy), device_count=1)
    assert preflight.config_changes(saved, {**saved, "rdrop_alpha": 1.0}) == {
        "rdrop_alpha": ("<unset>", 1.0)
    }


def test_num_train_steps_below_the_saved_step_is_refused(trained):
    assert_refused(
        two_step_config(num_train_steps=1),
        trained,
        r"^config\.num_train_steps \(1\) is below the latest checkpoint step 2 in .*checkpoints;",
    )


def test_safe_and_allowed_changes_pass(trained):
    before = snapshot(trained)
    same = two_step_config()
    preflight.check_run(same, str(trained), device_count=1)
    safe = two_step_config(num_train_steps=9, eval_every=3, log_every=2, checkpoint_every=4,
                       keep_checkpoints=1, decode_eval=True, grad_accum_steps=2)  # fmt: skip
    preflight.check_run(safe, str(trained), device_count=1)
    changed = two_step_config(learning_rate=1e-3, label_smoothing=0.2)
    changed.model.dropout_rate = 0.1
    with pytest.raises(ConfigError, match="allow_changes=label_smoothing,learning_rate,model.dro"):
        preflight.check_run(changed, str(trained), device_count=1)
    changed.allow_changes = "learning_rate, label_smoothing,model.dropout_rate"
    preflight.check_run(changed, str(trained), device_count=1)
    assert snapshot(trained) == before


# ----------------------------------------------------------------------------- command line


def test_command_line_prints_one_error_line_and_exits_nonzero(tmp_path):
    workdir = tmp_path / "cli"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
           "--workdir", str(workdir), "--config.label_smoothing=1.5"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    output = (done.stdout + done.stderr).strip().splitlines()
    assert output[-1] == "error: config.label_smoothing must be a number in [0, 1); got 1.5"
    assert "Traceback" not in done.stdout + done.stderr
    assert not workdir.exists()


def _parse(monkeypatch, *overrides: str, config: str = "configs/default.py"):
    """train.py's --config flag (``preflight.define_config_flag``) parsed from a command line."""
    from absl import flags

    argv = ["train.py", "--config", str(ROOT / config), *overrides]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags finds the overrides in sys.argv
    values = flags.FlagValues()
    preflight.define_config_flag(values)
    preflight.parse_flags(argv, flag_values=values)
    return values.config


def test_a_model_field_the_config_file_does_not_list_is_set_from_the_command_line(monkeypatch):
    """configs/multi30k.py's model dict names no dtype or attention_window: the command line
    adds them, read as Python literals, and the keys pass preflight."""
    config = _parse(
        monkeypatch,
        "--config.model.dtype=bfloat16",
        "--config.model.attention_window=8",
        "--config.model.d_ff=512",
        config="configs/multi30k.py",
    )
    assert "dtype" not in load_config("multi30k").model
    assert (config.model.dtype, config.model.attention_window, config.model.d_ff) == (
        "bfloat16",
        8,
        512,
    )
    preflight.check_keys(config)


def test_misspelt_command_line_keys_are_refused_in_one_line(capsys, monkeypatch):
    """A misspelt leaf parses (new keys are allowed) and preflight names it with the nearest
    valid key; a misspelt key on the way to it stops the parser, whose traceback becomes one
    line."""
    config = _parse(monkeypatch, "--config.model.d_mdoel=5")
    with pytest.raises(ConfigError, match=r"^config.model.d_mdoel is not a TransformerConfig "
                       r"field; did you mean d_model\?$"):  # fmt: skip
        preflight.check_keys(config)
    config = _parse(monkeypatch, "--config.lable_smoothing=0.2")
    with pytest.raises(ConfigError, match=r"did you mean label_smoothing\?$"):
        preflight.check_keys(config)

    with pytest.raises(SystemExit) as info:
        _parse(monkeypatch, "--config.modle.dtype=bfloat16")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --config.modle: no such config key; did you mean model?"]
