"""Local paths and ``gs://`` URIs behind one type, ``etils.epath.Path`` (what Orbax itself uses).

Every file the project reads or writes goes through here or through ``epath.Path`` directly, so a
workdir, a data folder or a CLI's input/output may be a local path or a URI of any fsspec
filesystem (``gs://`` needs ``gcsfs``, a dependency of this package). Three things differ from
a local disk and are handled here rather than at each call:

  * ``os.path.abspath`` would turn ``gs://bucket/run`` into ``./gs:/bucket/run``: :func:`resolve`
    makes only local paths absolute.
  * Object stores have no directories: :func:`makedirs` is a no-op for a URI (an object's
    "folder" exists as soon as the object does).
  * There is no rename: :func:`write_atomic` writes a local file through a temporary file and
    ``os.replace``; an object upload is already all-or-nothing (readers see the old object or
    the new one, never half of it).
"""

from __future__ import annotations

import os

from etils import epath

PathLike = str | os.PathLike


def is_uri(path: PathLike) -> bool:
    """Whether ``path`` names a remote object (``gs://...``, ``s3://...``), not a local file."""
    return "://" in os.fspath(path)


def resolve(path: PathLike) -> epath.Path:
    """``epath.Path`` of ``path``: a local path made absolute (as before), a URI kept as is."""
    path = os.fspath(path)
    return epath.Path(path if is_uri(path) else os.path.abspath(path))


def makedirs(path: PathLike) -> None:
    """Creates a local folder and its parents (no-op if present, or for a URI)."""
    if not is_uri(path):
        os.makedirs(os.fspath(path), exist_ok=True)


def write_atomic(path: PathLike, data: bytes | str) -> None:
    """Writes ``data`` (str as UTF-8) so that a concurrent reader or a crash never sees half.

    Local: a temporary file beside ``path``, then ``os.replace``. URI: one upload, which object
    stores commit atomically.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if is_uri(path):
        epath.Path(os.fspath(path)).write_bytes(payload)
        return
    path = os.fspath(path)
    makedirs(os.path.dirname(os.path.abspath(path)))
    tmp_path = f"{path}.tmp.{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(payload)
    os.replace(tmp_path, path)


def refresh(path: PathLike) -> None:
    """Forgets this process's cached listings of a URI's filesystem (gcsfs keeps every listing
    for the life of the process), so the next listing sees what other processes wrote since:
    e.g. checkpoints a running training job added. No-op for a local path."""
    if is_uri(path):
        from etils.epath import backend  # the filesystem instance epath.Path itself uses

        backend.fsspec_backend.fs(os.fspath(path)).invalidate_cache()
