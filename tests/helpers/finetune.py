"""Fine-tuning runs the interop tests share: generated word-for-word pairs, the data folder,
configs/finetune_marian.py with tiny settings, and the eval loss and final parameters of a run."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import jax

import train
from flaxformer_lite.data import tasks
from flaxformer_lite.inference.translator import Translator

ROOT = Path(__file__).resolve().parents[2]
EN = "the a dog cat man woman child runs walks sees big small red old house park".split()
DE = "der die Hund Katze Mann Frau Kind läuft geht sieht groß klein rot alt Haus Park".split()


def generated_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """English-like -> German-like word-for-word pairs: learnable in a few steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 7))]
        out.append((" ".join(EN[i] for i in idx), " ".join(DE[i] for i in idx)))
    return out


def write_data(folder: Path, train_pairs, val_pairs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, pairs in (("train", train_pairs), ("val", val_pairs)):
        (folder / f"{split}.en").write_text("".join(f"{e}\n" for e, _ in pairs))
        (folder / f"{split}.de").write_text("".join(f"{d}\n" for _, d in pairs))


def finetune_config(pretrained: Path, data: Path, steps: int, **overrides):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ft", ROOT / "configs/finetune_marian.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.init_from = str(pretrained)
    c.data_dir = str(data)
    c.max_len = 32
    c.tokens_per_batch = 256
    c.batch_size_multiple = 8
    c.learning_rate = 3e-3
    c.warmup_steps = 5
    c.num_train_steps = steps
    c.eval_every = steps
    c.checkpoint_every = steps
    c.log_every = 10
    c.model = {"dropout_rate": 0.0}
    for key, value in overrides.items():
        c[key] = value
    return c


def eval_loss(config, workdir: Path, params) -> float:
    """Eval-set smoothed KL per token of ``params`` on the run's own eval batches."""
    task = tasks.build_task(config, str(workdir), process_index=0, process_count=1)
    cfg = train.model_config(config, task)
    model = train.build_model(task.kind, cfg)
    step = jax.jit(
        functools.partial(train.eval_step, model=model, kind=task.kind, label_smoothing=0.1)
    )  # as train.py runs it: one program per batch shape, not an eager forward pass
    total, count = 0.0, 0.0
    for batch in task.eval_batches:
        sums = step(params, batch)
        total += float(sums["smoothed_kl"])
        count += float(sums["count"])
    return total / count


def final_params(workdir: Path):
    return Translator.from_workdir(str(workdir)).params
