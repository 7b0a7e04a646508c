"""Fine-tuning a Hugging Face Llama folder with train.py (``--config.init_from``), and the
result back as a Llama folder transformers reads.

The "pretrained" model is a tiny random ``LlamaForCausalLM`` (``helpers.hf_llama``) whose
vocabulary is the run's own: the language-model task's character SentencePiece model
(trained in the workdir first) and its special ids (pad 0, EOS 1, BOS 2), so every parameter
is restored. Checked: the held-out loss falls from the pretrained start within a few steps,
and ``hf.export_workdir`` writes the fine-tuned run as a folder ``LlamaForCausalLM`` reads
with our logits.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the pretrained model is built with PyTorch")
transformers = pytest.importorskip("transformers", reason="LlamaForCausalLM (test extra)")

import train  # noqa: E402
from flaxformer_lite.core.special_ids import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from flaxformer_lite.data import tasks  # noqa: E402
from flaxformer_lite.interop import hf, init_from  # noqa: E402
from flaxformer_lite.models import DecoderOnly  # noqa: E402

from helpers.hf_llama import llama_config, random_llama
from helpers.runs import checkpoint_params

ROOT = Path(__file__).resolve().parents[2]
WORDS = "ab ba abc cab bca aa bb cc acb".split()
STEPS = 30


def lm_config(data_file: Path, init: Path):
    spec = importlib.util.spec_from_file_location("lm", ROOT / "configs/lm_tinyshakespeare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.data_file = str(data_file)
    c.init_from = str(init)
    c.model = {"dropout_rate": 0.0}  # only training fields: the architecture is Llama's
    c.vocab_size = 16
    c.max_len = 24
    c.batch_size = 8
    c.eval_batches = 2
    c.learning_rate = 3e-3
    c.warmup_steps = 5
    c.num_train_steps = c.eval_every = c.checkpoint_every = STEPS
    c.log_every = 10
    c.decode_eval = False
    return c


def eval_loss(config, workdir: Path, params) -> float:
    """Held-out cross-entropy per token of ``params`` on the run's own eval batches."""
    task = tasks.build_task(config, str(workdir), process_index=0, process_count=1)
    model = train.build_model(task.kind, train.model_config(config, task))
    total = count = 0.0
    for batch in task.eval_batches:
        sums = train.eval_step(params, batch, model=model, kind=task.kind, label_smoothing=0.0)
        total += float(sums["smoothed_kl"])
        count += float(sums["count"])
    return total / count


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_llama")
    rng = random.Random(0)
    data = root / "text.txt"
    data.write_text("".join(" ".join(rng.choices(WORDS, k=8)) + "\n" for _ in range(300)))
    pretrained, workdir = root / "pretrained", root / "run"
    config = lm_config(data, pretrained)
    # The task's vocabulary first (trained into the workdir, which train.py then reuses), so
    # that the pretrained model is built for it.
    vocab_size = tasks.build_task(config, str(workdir), process_index=0, process_count=1).vocab_size
    hf_config = llama_config(
        vocab_size=vocab_size,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        max_position_embeddings=32,
    )
    random_llama(hf_config, seed=3).save_pretrained(pretrained)
    assert init_from.pretrained_model(str(pretrained)) == "DecoderOnly"
    train.train_and_evaluate(config, str(workdir))
    return config, pretrained, workdir


def test_eval_loss_falls_from_the_pretrained_llama(run):
    config, pretrained, workdir = run
    _, start, _ = hf.load_pretrained(str(pretrained))
    end = checkpoint_params(str(workdir))
    before, after = eval_loss(config, workdir, start), eval_loss(config, workdir, end)
    print(f"Llama fine-tune: eval loss {before:.3f} (pretrained) -> {after:.3f} ({STEPS} steps)")
    assert after < 0.7 * before, (before, after)


def test_the_run_exports_to_a_folder_transformers_reads(run, tmp_path):
    _, _, workdir = run
    out = tmp_path / "exported"
    config = hf.export_workdir(str(workdir), str(out))
    params = checkpoint_params(str(workdir))
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = np.array([[BOS_ID] + [4 + i % (config.vocab_size - 4) for i in range(7)]], np.int64)
    with torch.no_grad():
        want = theirs(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = DecoderOnly(config).apply({"params": params}, jnp.asarray(ids), method="decode")
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    _, back, _ = hf.load_pretrained(str(out))
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, jax.device_get(params))
