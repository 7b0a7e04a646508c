"""One process of the multi-host input tests (run by tests/data/test_multihost_data.py, not
collected by pytest): builds the translation task on a shared workdir, writes what this
process got, and decodes the eval sources on a mesh with a permuted device order.

    python tests/helpers/multihost_worker.py OUT WORKDIR DATA_DIR PROCESS_ID NUM_PROCESSES ADDRESS
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Run by path, this script has only its own folder on sys.path: add the repository root
# (flaxformer_lite) and tests/ (helpers), as tests/conftest.py does for the test modules.
ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from flaxformer_lite.core import sharding  # noqa: E402
from flaxformer_lite.data import tasks
from flaxformer_lite.data import workdir as workdir_data
from flaxformer_lite.decoding.generate import generate  # noqa: E402
from flaxformer_lite.models import EncoderDecoder  # noqa: E402
from flaxformer_lite.nn.config import TransformerConfig  # noqa: E402

from helpers.sharded_decode import init as init_params
from helpers.translation_data import translation_config as small_corpus_config

SENTENCES = ["a man runs in the park", "the red dog sits on a big house"]


def translation_config(data_dir: str) -> ml_collections.ConfigDict:
    return small_corpus_config(
        data_dir,
        task="translation",
        local_splits=None,
        max_len=16,
        batch_size_multiple=8,
        streaming=False,
    )


def permuted_mesh() -> Mesh:
    """Data axis over all devices in an order that interleaves processes (and, with one
    process, scrambles device ids): no process owns a contiguous block of rows."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    if jax.process_count() > 1:
        by_process = [[d for d in devices if d.process_index == p] for p in range(2)]
        order = [d for pair in zip(*by_process, strict=True) for d in pair]
    else:
        order = [devices[i] for i in np.random.default_rng(1).permutation(len(devices))]
    return Mesh(np.asarray(order).reshape(len(order), 1, 1), sharding.MESH_AXES)


def main(out: str, workdir: str, data_dir: str, process_id: int, num_processes: int, address):
    start = time.time()
    sharding.initialize_distributed(address, num_processes, process_id)
    pid, count = jax.process_index(), jax.process_count()
    task = tasks.build_task(
        translation_config(data_dir), workdir, process_index=pid, process_count=count
    )
    tokenizer = workdir_data.load_tokenizer(workdir)
    train = [task.train.next() for _ in range(3)]

    cfg = TransformerConfig(
        vocab_size=task.vocab_size, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=32, dropout_rate=0.0, dtype="float32",
        tie_output_embedding=False,  # init_params scales the logits kernel: no near-ties
    )  # fmt: skip
    first = task.decode_inputs[0]
    inputs = first[first.any(axis=1)][:16]  # 16 real source rows, 2 per device
    # Drawn with numpy, the same on every process (a jitted init would compile on each).
    params = init_params(EncoderDecoder(cfg), inputs[:1], inputs[:1, :4])
    from train import greedy_decode_in_order

    mesh = permuted_mesh()
    t0 = time.time()
    sharded = greedy_decode_in_order(params, cfg, inputs, mesh, max_len=12)
    t1 = time.time()
    single = np.zeros_like(sharded)
    if pid == 0:  # the 1-device reference, on one device of process 0
        one_device = jax.local_devices()[0]
        local_params = jax.device_put(params, one_device)
        single, _ = generate(
            local_params,
            cfg,
            jax.device_put(inputs, one_device),
            mesh=sharding.make_mesh((1, 1, 1), [one_device]),
            method="greedy",
            max_len=12,
        )
    print(f"process {pid}: data {t0 - start:.1f} s, sharded {t1 - t0:.1f} s, "
          f"single {time.time() - t1:.1f} s")  # fmt: skip
    np.savez(
        os.path.join(out, f"process{pid}.npz"),
        **{f"ids{i}": np.asarray(tokenizer.encode(s)) for i, s in enumerate(SENTENCES)},
        vocab_size=task.vocab_size,
        **{f"train{i}_{k}": v for i, b in enumerate(train) for k, v in b.items()},
        sharded=sharded,
        single=np.asarray(single),
        inputs=inputs,
        mesh_order=np.asarray([d.id for d in mesh.devices.flat]),
        mesh_process=np.asarray([d.process_index for d in mesh.devices.flat]),
    )
    print(f"process {pid} done: {task.log_lines}")


if __name__ == "__main__":
    out_, workdir_, data_dir_, pid_, num_, address_ = sys.argv[1:]
    main(out_, workdir_, data_dir_, int(pid_), int(num_), address_)
