"""train.py configs for tests: ``load_config`` reads configs/NAME.py, and the tiny runs that
several test modules train on top of configs/default.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The overrides of test_train's tiny synthetic runs (and of runs.train_cmd's subprocess runs).
TINY_OVERRIDES = dict(
    batch_size=16,
    num_train_steps=40,
    log_every=10,
    eval_every=20,
    checkpoint_every=10,
    warmup_steps=10,
    learning_rate=3e-3,
    # MFU against a fixed peak: the start-up matmul measurement (about half a second of CPU at
    # every train.py start) is left to the tests of MFU (test_train_loop, test_flops).
    peak_flops=1e11,
)


def load_config(name: str):
    """configs/``name``.py's ``get_config()`` (a fresh ConfigDict each call)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def two_step_config(**overrides):
    """The default config cut to 2 steps of a d_model 16, 1 + 1 layer model, no dropout, a
    checkpoint every step and no decoding eval: for what a run writes, checks or refuses, not
    what it learns. ``overrides`` set top-level fields."""
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=4, num_eval=16)
    c.model = dict(
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
    )
    base = dict(
        batch_size=16,
        num_train_steps=2,
        log_every=1,
        eval_every=0,
        checkpoint_every=1,
        warmup_steps=1,
        learning_rate=3e-3,
        decode_eval=False,
    )
    for k, v in {**base, **overrides}.items():
        setattr(c, k, v)
    return c


def translator_config(steps: int = 40):
    """The default config with a d_model 32, 1 + 1 layer model trained ``steps`` steps at a
    high learning rate (it learns the synthetic task enough for its translations to differ),
    checkpoints at steps 20 and 40, no decoding eval during training: a run for the
    Translator and the command-line tools to load."""
    c = load_config("default")
    c.synthetic.update(min_len=2, max_len=6, num_eval=16)
    c.model = dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1)
    c.batch_size = 16
    c.num_train_steps = steps
    c.learning_rate = 1e-2
    c.warmup_steps = 10
    c.log_every = 20
    c.eval_every = 0
    c.checkpoint_every = 20  # two checkpoints: steps 20 and 40
    c.decode_eval = False  # no decoding compile during training: the tests decode
    return c
