"""Shared fixtures. Tests build their own small data; ../shared/data is optional.

Test modules sit in folders by the subpackage they test (tests/ops/, tests/training/, ...),
without ``__init__.py``: pytest imports each by its basename (rootdir/prepend mode), so basenames
stay unique across folders (tests/test_layout.py checks). What several modules share lives in
tests/helpers/, never in another test module."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

# The repository root (``import train``) and tests/ (``import helpers``), for every test module
# wherever it sits. Subprocesses that import either get them through PYTHONPATH.
ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# One persistent XLA compilation cache for the whole session: this process, the pytest-xdist
# workers and every train.py / CLI subprocess a test starts (they inherit the environment).
# Many tests compile the same tiny programs in fresh processes; a cache hit loads the same
# executable XLA would have built, so results are unchanged and only compile time is saved.
_JAX_CACHE = ROOT / ".pytest_cache" / "jax_compilation_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_JAX_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite checks numerics and control flow, not speed: XLA's backend optimisation level 0
# compiles the tiny test programs in about half the CPU time (a cold tiny train.py run: 20.6 ->
# 11.8 CPU s) with results equal to float32 rounding. Benchmarks (bench/) and real runs keep
# the default level. Subprocesses inherit it; the ones that add a device count append to it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
# For the same reason, XLA's older elemental emitter for CPU fusions instead of the MLIR
# fusion emitters (jaxlib 0.10's default): their compile passes dominate the compile of these
# tiny programs (a tiny MoE train step: 6.2 -> 1.6 CPU s; a beam search: 2.2 -> 1.2), and the
# two emit the same elementwise arithmetic (the train step's and the beam search's outputs
# came out equal). A caller's own setting of the flag wins.
if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false"
    ).strip()

# Two more compile-time settings with the same results, measured together on
# test_beam_cache + test_attention_modes (cold cache, 2 rounds: 37.7 -> 32.9 CPU s): one LLVM
# module per program instead of several compiled in parallel (the split costs more than it
# saves on programs this small, and the xdist workers already fill the cores), and MLIR
# locations without the Python traceback of every op (deep under pytest; metadata only).
if "--xla_cpu_parallel_codegen_split_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_parallel_codegen_split_count=1"
    ).strip()
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")

# Python's cyclic garbage collector, at its default thresholds (700, 10, 10), ran 31 full
# collections of about 0.36 s each in test_feature_matrix + test_models (one process, cold
# cache): 13.1 of 134.9 CPU s, the heap being large with JAX's caches of traced programs. A
# young generation of 50,000 objects makes full collections rare (2): 4.3 s, the same peak
# memory (1,984 against 1,987 MB). It applies in the pytest processes (each xdist worker
# imports this file); the subprocesses a test starts (train.py) keep Python's defaults.
gc.set_threshold(50_000, 20, 20)

SHARED_DATA = Path(
    os.environ.get("FLAXFORMER_SHARED_DATA", ROOT / ".." / "shared" / "data")
).resolve()


# ----------------------------------------------------------------------------- scheduling
# `pytest -n 2` (pyproject: --dist loadscope --no-loadscope-reorder) hands each test module to
# one worker as a unit, in collection order. Two rules keep the workers busy with distinct
# work and let them finish together:
# 1. A module-scoped fixture is built once, on one worker (with plain `load` both workers
#    often built it: e.g. test_sharding's 2-process run). (`--dist loadgroup` with
#    xdist_group marks would group finer, but pytest-xdist 3.8 renames node ids through an
#    attribute that pytest 9 no longer reads: the marks group nothing.)
# 2. The slowest modules go first (longest-processing-time first): a long unit started last
#    leaves the other worker idle at the end. SLOWEST_FIRST lists node-id prefixes, slowest
#    first (wall seconds of `make test` on the 2-core AVX2 machine before issue 13's cuts);
#    the module of each moves to the front, the rest keep collection order.
#    tests/test_scheduling.py checks that each names a test.
SLOWEST_FIRST = (
    # 3 eight-device runs (45 s each), the 2-process fixture (60-90 s), SIGTERM test (125 s).
    "tests/training/test_sharding.py::test_sigterm_to_one_of_two_processes",
    # 63 s, killed run 60 s, nonfinite 50 s
    "tests/training/test_train.py::test_gradient_accumulation",
    "tests/models/test_models.py::test_three_models_shapes_dtypes_jit_grad",  # 61 s (float32)
    "tests/core/test_gcs.py::test_a_run_in_a_bucket",  # 60-80 s
    "tests/test_feature_matrix.py::test_g_checkpoint_restores_on_other_meshes",  # 3 min module
    "tests/decoding/test_generate.py::test_eight_devices_decode",  # an 8-device subprocess
    "tests/data/test_multihost_data.py::test_two_processes",  # 2 processes, then 1 with 8 devices
    "tests/ops/test_fastpaths.py::test_every_attention_kernel",  # an 8-device subprocess
    "tests/nn/test_scan_fused.py::test_scanned_model_initialises_sharded",  # ditto
    "tests/interop/test_finetune_bart.py::test_the_workdir_holds",  # a 30 s fine-tune fixture
    "tests/interop/test_hf_t5_finetune.py::test_a_t5_folder_fine_tunes",  # ditto
)


def slowest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the modules of SLOWEST_FIRST's tests moved to the front, in that list's
    order; a stable sort, so each module keeps its order and the rest their order."""

    def module(item):
        return item.nodeid.split("::")[0]

    rank: dict[str, int] = {}
    for item in items:
        for i, prefix in enumerate(SLOWEST_FIRST):
            if item.nodeid.startswith(prefix):
                rank[module(item)] = min(rank.get(module(item), i), i)
    return sorted(items, key=lambda item: rank.get(module(item), len(SLOWEST_FIRST)))


@pytest.hookimpl(trylast=True)  # after pytest orders tests by parametrized module fixtures
def pytest_collection_modifyitems(items):
    items[:] = slowest_first(items)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (override with FLAXFORMER_SHARED_DATA); skips the test when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (set FLAXFORMER_SHARED_DATA)")
    return SHARED_DATA


def honour_generation_preconditions():
    """Teaches gcp-storage-emulator what real GCS does and tensorstore relies on: the
    ``x-goog-generation`` header on downloads, ``ifGenerationNotMatch`` (304 Not Modified) and
    ``ifGenerationMatch`` (412 Precondition Failed) on downloads, uploads and deletes (the run
    lock, training/run_lock.py, relies on the last two). Without them
    tensorstore's OCDBT driver (Orbax's checkpoint format) fails on a tree of more than a few
    dozen arrays with "Malformed StorageGeneration". Returns a function that undoes it."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def failed(request, storage, bucket, name):
        """(status the preconditions give, current generation; "0" = no such object)."""
        keys = ("ifGenerationMatch", "ifGenerationNotMatch")
        match, not_match = (request.query.get(k, [None])[0] for k in keys)
        if match is None and not_match is None:
            return None, None
        try:
            current = storage.get_file_obj(bucket, name)["generation"]
        except NotFound:
            current = "0"
        if match is not None and match != current:
            return HTTPStatus.PRECONDITION_FAILED, current
        if not_match is not None and not_match == current:
            return HTTPStatus.NOT_MODIFIED, current
        return None, current

    download, insert, delete = objects.download, objects.insert, objects.delete

    def checked_download(request, response, storage, *args, **kwargs):
        bucket, name = request.params["bucket_name"], request.params["object_id"]
        status, current = failed(request, storage, bucket, name)
        if status is not None and current != "0":
            response.status = status
            response["x-goog-generation"] = current
            return
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(bucket, name)
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj.get("metageneration", "1")

    def checked_insert(request, response, storage, *args, **kwargs):
        name = request.query.get("name", [None])[0]
        if name is not None and failed(request, storage, request.params["bucket_name"], name)[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return
        insert(request, response, storage, *args, **kwargs)

    def checked_delete(request, response, storage, *args, **kwargs):
        bucket, name = request.params["bucket_name"], request.params["object_id"]
        if failed(request, storage, bucket, name)[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return
        delete(request, response, storage, *args, **kwargs)

    swaps = {download: checked_download, insert: checked_insert, delete: checked_delete}

    def swap(table: dict) -> None:
        for _, handlers in server.HANDLERS:
            for method, handler in handlers.items():
                handlers[method] = table.get(handler, handler)

    objects.download, objects.insert = checked_download, checked_insert  # objects.get calls it
    objects.delete = checked_delete
    swap(swaps)

    def undo() -> None:
        objects.download, objects.insert, objects.delete = download, insert, delete
        swap({new: old for old, new in swaps.items()})

    return undo


@pytest.fixture(scope="session")
def gcs(tmp_path_factory) -> dict[str, str]:
    """A real GCS JSON API server on localhost (gcp-storage-emulator, in memory, in a thread of
    this process) with one bucket, ``gs://bucket``, for the session.

    Returns the environment that points every client at it, anonymously; it is also set in
    ``os.environ`` for in-process calls (subprocesses: ``env={**os.environ, ...}``) and restored
    afterwards:
      STORAGE_EMULATOR_HOST              gcsfs (epath's gs://) and google-cloud-storage
                                         (tensorboardX's gs:// writer)
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT  "false": else every gcsfs call first waits 60 s on a
                                         gRPC probe the emulator does not answer
      FSSPEC_GS_TOKEN                    "anon": gcsfs sends no credentials
      TENSORSTORE_GCS_HTTP_URL           tensorstore (Orbax's array writer)
      CLOUDSDK_CONFIG, GCE_METADATA_ROOT an empty gcloud folder and a closed port: tensorstore
                                         finds no credentials (no user's, no VM's) and goes
                                         anonymous
    """
    from helpers.runs import free_port

    server = pytest.importorskip("gcp_storage_emulator.server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "FSSPEC_GS_TOKEN": "anon",
        "TENSORSTORE_GCS_HTTP_URL": url,
        "CLOUDSDK_CONFIG": str(tmp_path_factory.mktemp("gcloud")),
        "GCE_METADATA_ROOT": f"127.0.0.1:{free_port()}",
    }
    saved = {k: os.environ.get(k) for k in (*env, "GOOGLE_APPLICATION_CREDENTIALS")}
    os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    os.environ.update(env)
    import fsspec.config

    # fsspec reads FSSPEC_* when first imported, which may have been before this fixture.
    saved_conf = fsspec.config.conf.get("gs")
    fsspec.config.conf["gs"] = {**(saved_conf or {}), "token": "anon"}
    undo = honour_generation_preconditions()
    emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket="bucket")
    emulator.start()
    try:
        yield env
    finally:
        emulator.stop()
        undo()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved_conf
