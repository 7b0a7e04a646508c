"""The attention-pooling classifier of configs/imdb.py, end to end on reviews the test writes.

Each review is neutral filler with one sentiment word somewhere in it; the label is that word's
polarity. The classifier, trained through train.py on a local folder in the SST-2 layout,
classifies held-out reviews; its pooling weights over a review are a distribution over the
review's pieces and their figure is written by the attention_maps CLI. (The weights need not
peak on the sentiment word: self-attention spreads it over the sequence first.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import EncoderClassifier, TransformerConfig
from flaxformer_lite.cli import attention_maps
from flaxformer_lite.cli.attention_maps import classifier_pooling

ROOT = Path(__file__).resolve().parents[2]

import train  # noqa: E402

FILLER = (
    "the movie story actor scene film plot camera music role director script screen "
    "character audience night ending start cast minute"
).split()
POSITIVE = ["wonderful", "excellent", "brilliant", "delightful"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful"]


def reviews(rng: np.random.Generator, n: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        words = list(rng.choice(FILLER, size=int(rng.integers(8, 30))))
        label = int(rng.integers(0, 2))
        word = rng.choice(POSITIVE if label else NEGATIVE)
        words.insert(int(rng.integers(0, len(words) + 1)), word)
        out.append((" ".join(words), label))
    return out


def write_tsv(path: Path, rows) -> None:
    path.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("imdb")
    rng = np.random.default_rng(0)
    write_tsv(root / "train.tsv", reviews(rng, 600))
    write_tsv(root / "dev.tsv", reviews(rng, 100))
    workdir = root / "run"
    # train.py's own train_and_evaluate in this process (a train.py subprocess proved nothing
    # more and paid a Python, JAX and data-stack start-up), configs/imdb.py with the overrides
    # the command line gave it.
    spec = importlib.util.spec_from_file_location("imdb_config", ROOT / "configs/imdb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.update(
        data_dir=str(root),
        vocab_size=64,
        max_len=48,
        batch_size=32,
        num_train_steps=120,
        warmup_steps=10,
        learning_rate=3e-3,
        eval_every=120,
        checkpoint_every=120,
        log_every=40,
    )
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, dropout_rate=0.0)
    train.train_and_evaluate(config, str(workdir))
    return root, workdir


def test_training_learns_and_the_pooling_looks_at_the_sentiment_word(trained, tmp_path):
    root, workdir = trained
    import json

    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [m for m in lines if "eval/accuracy" in m][-1]["eval/accuracy"]
    assert accuracy >= 0.9, accuracy

    text = "the film story brilliant the camera music scene night"
    result = classifier_pooling(str(workdir), text)
    weights, pieces = result["weights"], result["pieces"]
    assert len(weights) == len(pieces) >= 10 and pieces[-1] == "</s>"
    assert float(np.sum(weights)) == pytest.approx(1.0, abs=1e-5)
    assert float(np.max(weights)) > 1.5 / len(weights)  # not uniform: the query was learned
    assert result["label"] == 1
    assert classifier_pooling(str(workdir), "awful the movie plot role director")["label"] == 0

    # The attention_maps CLI's main, in this process (a subprocess proved nothing more).
    out = tmp_path / "maps"
    assert attention_maps.main(["--workdir", str(workdir), "--text", text, "--out", str(out)]) == 0
    png = out / "pooling_attention.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pooling_weights_ignore_padding_and_sum_to_one():
    cfg = TransformerConfig(
        vocab_size=30,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_len=12,
        pooling="attention",
        num_classes=3,
    )
    model = EncoderClassifier(cfg)
    x = jnp.array([[5, 6, 7, 8, 1, 0, 0], [9, 10, 1, 0, 0, 0, 0]], jnp.int32)
    # Jitted: eagerly, init and apply dispatch (and compile) op by op, several times the CPU.
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    apply = jax.jit(model.apply, static_argnames="mutable")
    logits, state = apply({"params": params}, x, mutable=("intermediates",))
    weights = np.asarray(state["intermediates"]["pooling_weights"][0])
    np.testing.assert_allclose(weights.sum(-1), [1.0, 1.0], rtol=1e-6)
    assert np.all(weights[np.asarray(x) == cfg.pad_id] == 0.0)
    # More padding changes nothing.
    longer = jnp.pad(x, ((0, 0), (0, 4)))
    np.testing.assert_allclose(apply({"params": params}, longer), logits, atol=1e-6)


def test_pooling_figure_refuses_a_mean_pooled_run(tmp_path):
    (tmp_path / "model_config.json").write_text(
        TransformerConfig(vocab_size=10, num_classes=2).to_json()
    )
    with pytest.raises(ValueError, match="pooling=attention"):
        classifier_pooling(str(tmp_path), "a text")
