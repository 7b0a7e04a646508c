"""A small tmpfs for a real ENOSPC: mounted on a folder for the length of a ``with`` block,
with room for a few checkpoints and no more (``room_for`` sizes it from one the same run
saved); skips the test where mounting is not permitted (not root, a container without
CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def room_for(checkpoint: Path, count: float) -> str:
    """A tmpfs size (``mount -o size=``) of ``count`` times the blocks that the files of the
    saved ``checkpoint`` folder take. Orbax's OCDBT files differ from save to save by up to
    about 200 KB (how writes were batched, more under load): the tests' checkpoints are
    megabytes, so that 2.5 copies hold two saves and never three."""
    blocks = sum(p.stat().st_blocks for p in checkpoint.rglob("*") if p.is_file())
    return f"{int(count * blocks * 512 / 1024)}k"


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Callable[[], None]]:
    """Mounts a tmpfs of ``size`` (``mount -o size=``: ``room_for``'s, or e.g. "1100k") on
    ``mount`` (made if missing); yields ``grow()``, which gives it room (64 MB); unmounts at
    the end."""
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
