"""A small file that is created only where none exists, and replaced or removed only where it
is unchanged since it was read: compare-and-swap on a local disk and in a ``gs://`` bucket.

A run lock (``training/run_lock.py``) is such a file. Two writers racing for it must not both
win, so every write states what it expects to find:

  * ``gs://``: the object's generation, as a precondition of the request
    (``ifGenerationMatch=0``: the object must not exist; ``=G``: it must still be generation G).
    GCS answers 412 and changes nothing when the precondition fails.
  * A local path (also an NFS mount): the whole file written aside, then ``os.link`` to the
    name (atomic, and fails if the name exists: ``O_EXCL`` without a half-written window). To
    replace (``replace_if``) or remove, the current file is first renamed aside (atomic:
    exactly one of several writers gets it), its bytes are compared with those read, and only
    then is the new file linked in or the old one dropped; a file that changed is put back.
    While it is aside the name is free, so ``replace_if`` suits taking a file over from a
    writer that is gone; its one live owner rewrites it with ``rewrite_if``, which compares and
    then ``os.replace``-s, so the name is never free. The version of a local file is its bytes
    (a lock's content carries a unique token).

Other URI schemes (``s3://`` ...) are refused: their stores offer no such precondition here.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from flaxformer_lite.core import paths

Version = Any  # a local file's bytes, or a GCS object's generation (str)


def _gcs(path: str):
    """(gcsfs filesystem epath itself uses, bucket, object name) of a ``gs://`` URI."""
    from etils.epath import backend

    if not path.startswith("gs://"):
        raise ValueError(
            f"{path}: exclusive files need a local path or a gs:// URI (no precondition for "
            f"{path.split('://')[0]}://)"
        )
    fs = backend.fsspec_backend.fs(path)
    bucket, _, name = path[len("gs://") :].partition("/")
    return fs, bucket, name


def _gcs_upload(path: str, data: bytes, generation: str) -> Version | None:
    """Uploads ``data`` if the object's generation is ``generation`` ("0": absent); its new
    generation, or None when the precondition failed."""
    fs, bucket, name = _gcs(path)
    try:
        obj = fs.call(
            "POST",
            f"{fs._location}/upload/storage/v1/b/{bucket}/o",
            uploadType="media",
            name=name,
            ifGenerationMatch=generation,
            headers={"Content-Type": "application/octet-stream"},
            data=data,
            json_out=True,
        )
    except FileExistsError:  # gcsfs's name for 412 Precondition Failed
        return None
    finally:
        fs.invalidate_cache(path)  # gcsfs's cached listings would miss the change
    return str(obj["generation"])


def read(path: paths.PathLike) -> tuple[bytes, Version] | None:
    """(bytes, version) of the file at ``path``, or None if there is none."""
    path = os.fspath(path)
    if paths.is_uri(path):
        fs, bucket, name = _gcs(path)
        try:
            headers, data = fs.call("GET", "b/{}/o/{}", bucket, name, alt="media")
        except FileNotFoundError:
            return None
        return data, str(headers["x-goog-generation"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data, data


def create_new(path: paths.PathLike, data: bytes) -> Version | None:
    """Creates ``path`` holding ``data`` if no such file exists; its version, else None."""
    path = os.fspath(path)
    if paths.is_uri(path):
        return _gcs_upload(path, data, "0")
    tmp = _write_beside(path, data)
    try:
        os.link(tmp, path)  # atomic, and fails if the name exists: O_EXCL with whole content
    except FileExistsError:
        return None
    finally:
        os.unlink(tmp)
    return data


def replace_if(path: paths.PathLike, data: bytes, version: Version) -> Version | None:
    """Replaces ``path`` with ``data`` if it is still at ``version``; the new version, or None
    (it changed or is gone; then it is left as another writer made it)."""
    path = os.fspath(path)
    if paths.is_uri(path):
        return _gcs_upload(path, data, version)
    aside = _take_aside(path, version)
    if aside is None:
        return None
    created = create_new(path, data)
    os.unlink(aside)
    return created


def rewrite_if(path: paths.PathLike, data: bytes, version: Version) -> Version | None:
    """``replace_if`` for the file's one live owner: locally the name never goes free (so no
    other writer can create it meanwhile), but two writers of the same version could both
    succeed; on ``gs://`` the same precondition as ``replace_if``."""
    path = os.fspath(path)
    if paths.is_uri(path):
        return _gcs_upload(path, data, version)
    found = read(path)
    if found is None or found[1] != version:
        return None
    os.replace(_write_beside(path, data), path)
    return data


def remove_if(path: paths.PathLike, version: Version) -> bool:
    """Removes ``path`` if it is still at ``version``; whether it did."""
    path = os.fspath(path)
    if paths.is_uri(path):
        fs, bucket, name = _gcs(path)
        try:
            fs.call("DELETE", "b/{}/o/{}", bucket, name, ifGenerationMatch=version)
        except (FileNotFoundError, FileExistsError):
            return False
        finally:
            fs.invalidate_cache(path)
        return True
    aside = _take_aside(path, version)
    if aside is None:
        return False
    os.unlink(aside)
    return True


def _write_beside(path: str, data: bytes) -> str:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _take_aside(path: str, version: Version) -> str | None:
    """Renames ``path`` to a private name if it holds ``version`` (that name), else leaves it
    (None). The rename is what makes the check and the change one step: of two writers, one
    gets the file and the other a FileNotFoundError."""
    aside = f"{path}.{uuid.uuid4().hex}.old"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    with open(aside, "rb") as f:
        if f.read() == version:
            return aside
    try:  # another writer's file: put it back unless yet another one took the name
        os.link(aside, path)
    except FileExistsError:
        pass
    os.unlink(aside)
    return None
