"""A small tmpfs for a real ENOSPC: mounted on a folder for the length of a ``with`` block,
with room for a few tiny checkpoints and no more; skips the test where mounting is not
permitted (not root, a container without CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Callable[[], None]]:
    """Mounts a tmpfs of ``size`` (``mount -o size=``, e.g. "1100k") on ``mount`` (made if
    missing); yields ``grow()``, which gives it room (64 MB); unmounts at the end."""
    mount.mkdir(parents=True, exist_ok=True)
    name = f"f27-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", name, str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for a real ENOSPC: {made.stderr.strip()}")

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)

    try:
        yield grow
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
