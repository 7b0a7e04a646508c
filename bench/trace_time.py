"""How long JAX takes to trace and lower a model's programs, with the parameters read as this
package reads them against linen's ``Module.param``.

Linen's ``Module.param`` checks an existing parameter at every read (``apply``, not only
``init``) by tracing its initializer under ``jax.eval_shape``; ``core.logical_params.read_param``
(and ``nn.flax_layers``, flax's own layers reading through it) compares the shape directly.
Tracing is paid at every new shape of a jitted step, every decoding call with other options,
every export, and in the test suite thousands of times. Variants, swapped in this process
only:

  read_param  the library as it is
  linen       every ``read_param`` call site and ``ReadParams.param`` restored to
              ``nn.Module.param`` (the library before)

Programs, each traced and lowered to StableHLO (``jax.jit(...).lower``, what every first call
does before XLA compiles; compilation itself is unchanged), at two model sizes (the Multi30k
config's model, opus-mt's):

  apply   the model's forward pass on a batch of 8 x 24 tokens
  grad    the gradient of the token cross-entropy of that forward pass (a train step's core)
  beam    ``generate_jit``: beam search, 4 beams, 32 new tokens, batch 8

Each (variant, program, model) is lowered anew in every round after ``jax.clear_caches()``,
after one untimed warm-up of each; rounds alternate the variants' order; medians of CPU seconds
(process time) are reported, with the ratio linen / read_param.

    .venv/bin/python bench/trace_time.py --rounds 5 --out bench/results/trace_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_breakdown import OPUS_MT  # noqa: E402
from translate_speed import cpu_flags  # noqa: E402

from flaxformer_lite.core import logical_params, sharding  # noqa: E402
from flaxformer_lite.decoding.generate import generate_jit  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

# The modules that call read_param by name (a module-level import each).
CALLERS = (
    "flaxformer_lite.ops.positions",
    "flaxformer_lite.nn.projections",
    "flaxformer_lite.nn.dense",
    "flaxformer_lite.nn.moe",
    "flaxformer_lite.nn.embed",
    "flaxformer_lite.models.decoder",
    "flaxformer_lite.models.classifier",
)


def multi30k_fields() -> dict:
    """configs/multi30k.py's model (and vocabulary size), as the config file sets it."""
    spec = importlib.util.spec_from_file_location("multi30k", ROOT / "configs" / "multi30k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    return dict(vocab_size=config.vocab_size, **config.model)


MODELS = {"multi30k": multi30k_fields, "opus-mt": lambda: OPUS_MT}
BATCH, SRC_LEN = 8, 24


def linen_param(module, name, init_fn, shape, *init_args, unbox=True):
    """``read_param`` as it was before it: linen's own ``Module.param``."""
    return nn.Module.param(module, name, init_fn, shape, *init_args, unbox=unbox)


def linen_mixin_param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
    return nn.Module.param(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)


@contextlib.contextmanager
def variant(name: str):
    """The library as it is (``read_param``), or with linen's ``Module.param`` swapped in."""
    if name == "read_param":
        yield
        return
    modules = [importlib.import_module(m) for m in CALLERS]
    saved = [m.read_param for m in modules], logical_params.ReadParams.param
    for m in modules:
        m.read_param = linen_param
    logical_params.ReadParams.param = linen_mixin_param
    try:
        yield
    finally:
        for m, fn in zip(modules, saved[0], strict=True):
            m.read_param = fn
        logical_params.ReadParams.param = saved[1]


def programs(fields: dict) -> dict:
    """name -> a function that traces and lowers that program once."""
    config = TransformerConfig(max_len=64, **fields)
    model = EncoderDecoder(config)
    rng = np.random.default_rng(0)
    src = rng.integers(3, config.vocab_size - 1, (BATCH, SRC_LEN)).astype(np.int32)
    src[:, -1] = config.eos_id
    tgt = src.copy()
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), src, tgt)))
    params = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), params["params"])
    mesh = sharding.make_mesh(devices=jax.devices()[:1])

    def loss(p, s, t):
        logits = model.apply({"params": p}, s, t)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], -1))

    return {
        "apply": lambda: jax.jit(lambda p, s, t: model.apply({"params": p}, s, t)).lower(
            params, src, tgt
        ),
        "grad": lambda: jax.jit(jax.grad(loss)).lower(params, src, tgt),
        "beam": lambda: generate_jit.lower(
            params, config, src, mesh=mesh, method="beam", beam_size=4, max_len=32
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/trace_time.json")
    args = parser.parse_args()

    variants = ["read_param", "linen"]
    seconds = {}  # (model, program, variant) -> CPU seconds per round
    for model_name in args.models:
        lowerers = programs(MODELS[model_name]())
        for lower in lowerers.values():  # warm-up: first-use costs (imports, caches) paid once
            for v in variants:
                with variant(v):
                    lower()
        for r in range(args.rounds):
            for program, lower in lowerers.items():
                for v in variants if r % 2 == 0 else variants[::-1]:
                    with variant(v):
                        jax.clear_caches()
                        start = time.process_time()
                        lower()
                        spent = time.process_time() - start
                    seconds.setdefault((model_name, program, v), []).append(spent)
            print(f"{model_name}: round {r + 1} of {args.rounds}", flush=True)

    rows = []
    print(f"\n{'model':>9} {'program':>7} {'read_param s':>12} {'linen s':>8} {'linen / read':>12}")
    for model_name in args.models:
        for program in ("apply", "grad", "beam"):
            ours = statistics.median(seconds[(model_name, program, "read_param")])
            theirs = statistics.median(seconds[(model_name, program, "linen")])
            rows.append(
                dict(
                    model=model_name,
                    program=program,
                    read_param_cpu_seconds=round(ours, 4),
                    linen_cpu_seconds=round(theirs, 4),
                    ratio=round(theirs / ours, 2),
                    rounds={
                        v: [round(s, 4) for s in seconds[(model_name, program, v)]]
                        for v in variants
                    },  # fmt: skip
                )
            )
            print(f"{model_name:>9} {program:>7} {ours:12.3f} {theirs:8.3f} {theirs / ours:12.2f}")
    result = dict(
        cpu=cpu_flags(),
        jax=jax.__version__,
        flax=importlib.metadata.version("flax"),
        batch=BATCH,
        src_len=SRC_LEN,
        rounds=args.rounds,
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
