"""Shared fixtures. Tests build their own small data; ../shared/data is optional."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
