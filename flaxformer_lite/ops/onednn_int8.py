"""Exact int8 x int8 -> int32 matrix products on the CPU through oneDNN's VNNI / AMX kernels.

XLA's CPU backend multiplies int8 matrices at about its float32 rate, and a single row at a
tenth of it (``quantize.MIN_INT8_ROWS``); oneDNN's matmul, a library CTranslate2 runs its int8
models on, reaches the CPU's int8 rate (docs/benchmarks.md, "int8 through oneDNN").

Two XLA FFI custom calls (``csrc/onednn_int8.cc``), both pure functions of their operands:

* ``pack(q)``: int8 weights `[k, n]` -> uint8 `[packed_bytes]`, reordered into the blocked
  layout oneDNN's kernels read. In a decoding loop its operand does not change from step to
  step, so XLA hoists it out of the loop: the weights are packed once per call, not per step.
* ``matmul(xq, packed, n)``: int8 activations `[m, k]` -> int32 `[m, n]`, the exact product
  (int8 values are shifted to uint8 for the kernel and the shift is undone inside), so a model
  multiplies bitwise as with XLA's int8 dot.

``int8_product(xq, q)`` combines them. The kernel is compiled at first use (``g++``, oneDNN's
headers and library from the ``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp`` wheels, XLA's
FFI headers from jaxlib) into ``$XDG_CACHE_HOME/flaxformer_lite`` (``~/.cache`` by default;
``FLAXFORMER_LITE_CACHE`` overrides), once per source, compiler and jaxlib. It is refused on a
CPU without VNNI or AMX, where oneDNN's int8 sums saturate at 16 bits (not exact).
``available()`` says whether it loads here; ``unavailable_reason()`` says why not. The custom
calls exist on the CPU only: ``quantize.int8_matmul`` picks them per platform when lowering.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

SOURCE = Path(__file__).with_name("csrc") / "onednn_int8.cc"
PACK_TARGET = "flaxformer_lite_onednn_int8_pack"
MATMUL_TARGET = "flaxformer_lite_onednn_int8_matmul"
ZERO_POINT = 128  # int8 activations + 128 = the uint8 ones oneDNN's kernels take


class OnednnUnavailable(RuntimeError):
    """The oneDNN kernel cannot be built or loaded on this machine; the message says why."""


class OnednnUnsupported(OnednnUnavailable):
    """This machine is not one the kernel is for (not x86-64 Linux, or a CPU without VNNI or
    AMX): nothing to install or fix."""


def _prefix() -> Path:
    """Where pip put the onednn wheels' ``lib/`` and ``include/`` (the environment's root)."""
    return Path(sysconfig.get_paths()["data"])


def _cache_dir() -> Path:
    root = os.environ.get("FLAXFORMER_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flaxformer_lite"
    )
    return Path(root) / "onednn_int8"


def _build(compiler: str, include: Path, lib: Path) -> Path:
    """Compiles ``SOURCE`` into the cache (once per source, compiler and jaxlib) and returns
    the shared library's path. Written under a temporary name and renamed into place, so
    processes building at once never load a half-written file."""
    ffi_include = Path(jax.ffi.include_dir())
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), jax.__version__.encode(), str(lib)):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = _cache_dir() / f"onednn_int8_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [
        compiler, "-O2", "-std=c++17", "-shared", "-fPIC", str(SOURCE),
        f"-I{include}", f"-I{ffi_include}", f"-L{lib}", "-ldnnl", f"-Wl,-rpath,{lib}",
        "-o", tmp,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise OnednnUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, target)
    return target


def _load() -> ctypes.CDLL:
    """Builds (at first use), loads and registers the kernel; OnednnUnavailable says why not."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OnednnUnsupported(
            f"built for x86-64 Linux only, not {sys.platform} {platform.machine()}"
        )
    prefix = _prefix()
    include, lib = prefix / "include", prefix / "lib"
    if not (include / "dnnl.hpp").exists() or not (lib / "libdnnl.so").exists():
        raise OnednnUnavailable(
            f"oneDNN not found under {prefix} (include/dnnl.hpp, lib/libdnnl.so): "
            "pip install onednn-cpu-gomp onednn-devel-cpu-gomp"
        )
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise OnednnUnavailable(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    library = ctypes.CDLL(str(_build(compiler, include, lib)))
    library.onednn_int8_exact_isa.restype = ctypes.c_int
    if not library.onednn_int8_exact_isa():
        raise OnednnUnsupported(
            "this CPU has no VNNI or AMX: oneDNN's int8 kernel would saturate its 16-bit sums"
        )
    library.onednn_int8_packed_bytes.restype = ctypes.c_int64
    library.onednn_int8_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    jax.ffi.register_ffi_target(
        PACK_TARGET, jax.ffi.pycapsule(library.OnednnInt8Pack), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        MATMUL_TARGET, jax.ffi.pycapsule(library.OnednnInt8Matmul), platform="cpu"
    )
    return library


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None, bool]:
    """``_load()`` once per process: (the library, None, False) or (None, why not, whether it
    is something to fix here: an install or build problem, not the platform)."""
    try:
        return _load(), None, False
    except OnednnUnsupported as e:
        return None, str(e), False
    except (OnednnUnavailable, OSError) as e:
        return None, str(e), True


def _library() -> ctypes.CDLL:
    library, reason, _ = _loaded()
    if library is None:
        raise OnednnUnavailable(reason)
    return library


def unavailable_reason() -> str | None:
    """None when the kernel loads here, else why it does not (one message)."""
    return _loaded()[1]


def fixable() -> bool:
    """Whether the kernel is missing for a reason an install could fix (the onednn wheels, a
    compiler, a failed build) rather than the platform or the CPU."""
    return _loaded()[2]


def available() -> bool:
    """Whether the oneDNN kernel builds and loads on this machine."""
    return unavailable_reason() is None


def packed_bytes(k: int, n: int) -> int:
    """Bytes of the packed layout of a `[k, n]` int8 matrix."""
    size = int(_library().onednn_int8_packed_bytes(k, n))
    if size < 0:
        raise OnednnUnavailable(f"oneDNN has no int8 matmul for [?, {k}] x [{k}, {n}] here")
    return size


def pack(q: Array) -> Array:
    """int8 `[k, n]` -> uint8 `[packed_bytes(k, n)]`: ``q`` in oneDNN's blocked layout."""
    k, n = q.shape
    out = jax.ShapeDtypeStruct((packed_bytes(k, n),), jnp.uint8)
    return jax.ffi.ffi_call(PACK_TARGET, out)(q.astype(jnp.int8))


def matmul(xq: Array, packed: Array, n: int) -> Array:
    """int8 `[m, k]` x a packed `[k, n]` int8 matrix -> the exact int32 product `[m, n]`."""
    shifted = (xq.astype(jnp.int16) + ZERO_POINT).astype(jnp.uint8)
    out = jax.ShapeDtypeStruct((xq.shape[0], n), jnp.int32)
    return jax.ffi.ffi_call(MATMUL_TARGET, out)(shifted, packed, n=np.int64(n))


def int8_product(xq: Array, q: Array) -> Array:
    """int8 `[m, k]` x int8 `[k, n]` -> int32 `[m, n]`, exactly ``xq @ q`` in integers."""
    if xq.ndim != 2 or q.ndim != 2 or xq.shape[1] != q.shape[0]:
        raise ValueError(f"int8_product takes [m, k] x [k, n]; got {xq.shape} x {q.shape}")
    return matmul(xq, pack(q), q.shape[1])
