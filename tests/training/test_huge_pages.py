"""train.py restarts itself with glibc's malloc on transparent huge pages: same pid, arguments
and interpreter options, the tunable added to any the user set, the user's own choice kept; and
the restarted process does get 2 MiB pages for a large allocation where 4 KiB pages were all
it got before. Each case runs in a fresh interpreter (the restart replaces the process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Prints its pid, GLIBC_TUNABLES and -X options on every pass, then restarts (once); after the
# restart, 256 MiB from malloc written through (not a NumPy array: NumPy asks for huge pages
# itself): how much of it the kernel gave in huge pages.
PROBE = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
def report(tag):
    print(tag, os.getpid(), os.environ.get("GLIBC_TUNABLES"), sorted(sys._xoptions), flush=True)
report("start")
import train
train.restart_with_huge_pages()
report("after")
def huge_kib():
    text = open("/proc/self/smaps_rollup").read()
    return int(text.split("AnonHugePages:")[1].split()[0])
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
before = huge_kib()
size = 256 * 2**20
ctypes.memset(libc.malloc(size), 1, size)
print("huge", huge_kib() - before, flush=True)
"""


def probe(tunables: str | None) -> tuple[list[tuple[str, int, str, str]], int]:
    """The probe's pass lines ``(tag, pid, tunables, xoptions)`` and its huge-page KiB."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, "-X", "faulthandler", "-c", PROBE]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    passes = re.findall(r"^(start|after) (\d+) (.*) (\[.*\])$", done.stdout, re.M)
    huge = int(re.search(r"^huge (-?\d+)$", done.stdout, re.M)[1])
    return [(tag, int(pid), t, x) for tag, pid, t, x in passes], huge


def restarts_here() -> bool:
    try:
        libc, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        enabled = THP.read_text()
    except (AttributeError, ValueError, OSError):
        return False
    return (
        libc == "glibc"
        and tuple(map(int, version.split(".")[:2])) >= (2, 35)
        and ("[never]" not in enabled)
    )


needs_thp = pytest.mark.skipif(
    not restarts_here(), reason="needs Linux, glibc >= 2.35 and transparent huge pages on"
)


@needs_thp
def test_the_restart_keeps_the_pid_and_options_and_adds_the_tunable():
    passes, _ = probe("glibc.malloc.check=0")
    pid = passes[0][1]
    added = "glibc.malloc.check=0:glibc.malloc.hugetlb=1"
    assert passes == [
        ("start", pid, "glibc.malloc.check=0", "['faulthandler']"),
        ("start", pid, added, "['faulthandler']"),
        ("after", pid, added, "['faulthandler']"),
    ]


@needs_thp
def test_the_users_own_setting_is_kept_and_nothing_restarts():
    passes, _ = probe("glibc.malloc.hugetlb=0")
    pid = passes[0][1]
    assert passes == [
        ("start", pid, "glibc.malloc.hugetlb=0", "['faulthandler']"),
        ("after", pid, "glibc.malloc.hugetlb=0", "['faulthandler']"),
    ]


@pytest.mark.skipif(
    not restarts_here() or "[madvise]" not in THP.read_text(),
    reason="needs transparent huge pages in madvise mode (with 'always' every process has them)",
)
def test_the_restarted_process_gets_huge_pages_where_4_kib_pages_were_all_it_had():
    _, without = probe("glibc.malloc.hugetlb=0")
    passes, with_ = probe(None)
    assert [p[0] for p in passes] == ["start", "start", "after"]
    assert without < 4 * 1024  # KiB: none of the 256 MiB
    assert with_ >= 128 * 1024  # at least half of it in 2 MiB pages
