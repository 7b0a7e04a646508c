"""Shared fixtures. Tests build their own small data; ../shared/data is optional."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One persistent XLA compilation cache for the whole session: this process, the pytest-xdist
# workers and every train.py / CLI subprocess a test starts (they inherit the environment).
# Many tests compile the same tiny programs in fresh processes; a cache hit loads the same
# executable XLA would have built, so results are unchanged and only compile time is saved.
_JAX_CACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax_compilation_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_JAX_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

SHARED_DATA = Path(
    os.environ.get(
        "FLAXFORMER_SHARED_DATA", Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
    )
).resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (override with FLAXFORMER_SHARED_DATA); skips the test when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (set FLAXFORMER_SHARED_DATA)")
    return SHARED_DATA
