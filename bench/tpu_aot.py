"""Compiles the ``wmt14_base`` train step for a TPU topology on a machine without a TPU.

    pip install "libtpu==0.0.42.*"     # the version jax 0.10.2's [tpu] extra pins
    python bench/tpu_aot.py                        # v5e:2x2, mesh (4,1,1), bucket 256
    python bench/tpu_aot.py --topology v5e:2x2 --mesh_shape 2,1,2 --lengths 64,256

``jax.experimental.topologies.get_topology_desc`` asks libtpu for the devices of a topology
without opening any (libtpu's compiler runs on the host); the train step of ``train.py`` is
then lowered and compiled ahead of time exactly as ``train.py`` jits it (same ``train_step``,
``TrainState``, optimizer, logical axis rules, in/out shardings and donation), on abstract
arguments only: ``jax.eval_shape`` of the state initialiser, shardings from
``sharding.logical_shardings``, ``jax.ShapeDtypeStruct`` batches of one bucket shape. Nothing
is allocated or run. The executable's ``memory_analysis()`` (per chip) and
``cost_analysis()`` are written to ``bench/results/tpu_aot.json`` and ``.md``.

The data would decide two sizes; they are set here as WMT14's shared BPE vocabulary gives
them: 37,000 entries, sources and targets up to 256 tokens. ``dtype="auto"`` is bfloat16, as
``train.model_config`` picks on a TPU. A batch is one bucket of ``tokens_per_batch`` (25,000)
target tokens: ``batching.rows_for_length`` rows of the bucket length (96 rows of 256 tokens).
Not run by the tests (libtpu is not a dependency, and a compile takes minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no TPU here: nothing may open one

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from flaxformer_lite.core import sharding
from flaxformer_lite.data import batching  # noqa: E402
from flaxformer_lite.training import flops

RESULTS = ROOT / "bench" / "results"
VOCAB_SIZE = 37_000  # what the wmt14_base SentencePiece BPE vocabulary gives (shared)


def load_config():
    spec = importlib.util.spec_from_file_location("wmt14_base", ROOT / "configs/wmt14_base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def compile_step(
    topology: str, mesh_shape: tuple[int, ...], length: int, model_overrides: dict | None = None
) -> dict:
    """Lowers and compiles one train step of ``length``-token buckets; returns the figures."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology, "tpu")
    devices = topo.devices
    mesh = sharding.make_mesh(mesh_shape, devices)
    config = load_config()
    # The sizes the data would decide (train.model_config reads them from the task).
    sizes = types.SimpleNamespace(
        vocab_size=VOCAB_SIZE, target_vocab_size=None, max_len=config.max_len
    )
    config.model["dtype"] = "bfloat16"  # what "auto" resolves to on a TPU
    config.model.update(model_overrides or {})
    cfg = train.model_config(config, sizes)
    model = train.build_model("translation", cfg)
    schedule, tx = train.make_optimizer(config, cfg.d_model)
    rows = batching.rows_for_length(length, config.tokens_per_batch, config.batch_size_multiple)
    example = jnp.ones((1, length), jnp.int32)

    def init_state():  # as train.py's, on one example row
        init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
        params = model.init(init_rng, example, example)["params"]
        return train.TrainState(
            step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_rng
        )

    boxed = jax.eval_shape(init_state)  # shapes only: nothing is initialised
    state_shardings = sharding.logical_shardings(boxed, mesh)
    state = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        nn.meta.unbox(boxed),
        state_shardings,
    )
    batch_sharding = sharding.batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=batch_sharding)
        for k in ("inputs", "targets")
    }
    step_fn = train.jit_train_step(
        config, model, "translation", tx, schedule, state_shardings, mesh
    )
    start = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_RULES):
        lowered = step_fn.lower(state, batch)
    lower_s = time.perf_counter() - start
    print(f"lowered in {lower_s:.1f} s; compiling for {topology} ...", flush=True)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start

    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(state.params))
    analytic = flops.train_flops(cfg, rows, length, length)
    mib = 2.0**20
    return {
        "topology": topology,
        "model_overrides": model_overrides or {},
        "device_kind": devices[0].device_kind,
        "chips": len(devices),
        "mesh": dict(mesh.shape),
        "batch": [rows, length],
        "parameters": num_params,
        "dtype": cfg.dtype,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        "memory_per_chip_mib": {
            "arguments": round(memory.argument_size_in_bytes / mib, 1),
            "outputs": round(memory.output_size_in_bytes / mib, 1),
            "aliased": round(memory.alias_size_in_bytes / mib, 1),
            "temporaries": round(memory.temp_size_in_bytes / mib, 1),
            "code": round(memory.generated_code_size_in_bytes / mib, 1),
            "peak_estimate": round(
                (
                    memory.argument_size_in_bytes
                    + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes
                    + memory.temp_size_in_bytes
                )
                / mib,
                1,
            ),
        },
        "xla_flops": float(cost.get("flops", float("nan"))),
        "xla_bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "analytic_matmul_flops_global": analytic,
        "analytic_matmul_flops_per_chip": analytic / len(devices),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | topology | mesh (data, fsdp, tensor) | batch | per-chip args / temps / peak MiB "
        "| XLA FLOPs per chip | analytic matmul FLOPs per chip | compile s |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["memory_per_chip_mib"]
        mesh = tuple(r["mesh"].values())
        model = ", ".join(f"{k}={v}" for k, v in r.get("model_overrides", {}).items())
        lines.append(
            f"| wmt14_base {model} ({r['parameters'] / 1e6:.1f} M) | {r['topology']} "
            f"({r['device_kind']}) | {mesh} | {r['batch'][0]} x "
            f"{r['batch'][1]} | {m['arguments']:,.0f} / {m['temporaries']:,.0f} / "
            f"{m['peak_estimate']:,.0f} | {r['xla_flops'] / 1e12:.2f} T | "
            f"{r['analytic_matmul_flops_per_chip'] / 1e12:.2f} T | {r['compile_s']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:2x2", help='e.g. "v5e:2x2", "v4:2x2x1"')
    parser.add_argument("--mesh_shape", default="-1,1,1", help="data,fsdp,tensor (-1: fill)")
    parser.add_argument("--lengths", default="256", help="bucket lengths to compile, comma-sep")
    parser.add_argument("--out", default=str(RESULTS / "tpu_aot"), help="path stem (.json/.md)")
    parser.add_argument(
        "--model",
        default="",
        help='overrides of config.model, e.g. "num_encoder_layers=1,num_decoder_layers=1"',
    )
    args = parser.parse_args(argv)
    mesh_shape = tuple(int(x) for x in args.mesh_shape.split(","))
    overrides = {k: int(v) for k, v in (item.split("=") for item in args.model.split(",") if item)}
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        row = compile_step(args.topology, mesh_shape, length, overrides)
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    import libtpu

    record = {
        "jax": jax.__version__,
        "libtpu": getattr(libtpu, "__version__", "?"),
        "host": platform.processor() or platform.machine(),
        "results": rows,
    }
    path = Path(args.out).with_suffix(".json")  # runs accumulate: one record per command
    records = [*(json.loads(path.read_text()) if path.exists() else []), record]
    path.write_text(json.dumps(records, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown([r for rec in records for r in rec["results"]]))
    print(markdown(rows))


if __name__ == "__main__":
    main()
