"""An export artifact's ``params.npz``: the parameter tree flattened to ``"a/b/c"`` names, each
leaf stored so that NumPy reads it back as numbers.

NumPy writes a bfloat16 array (``ml_dtypes``) to ``.npz`` as raw 2-byte voids, which read back
as bytes, not numbers: a bfloat16 ``Translator`` (``dtype="bfloat16"``) would export weights
the runtime cannot use. Such leaves are stored as their unsigned-integer bits, and the
manifest's ``param_bits`` (``{name: dtype}``) tells the runtime what to view them as
(``serving_runtime`` / ``lm_runtime``, which import nothing of flaxformer_lite).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np


def flatten_params(params: Any) -> dict[str, np.ndarray]:
    """``{"a": {"b": x}}`` -> ``{"a/b": x}`` as NumPy arrays (the runtimes' ``unflatten``
    inverts it)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    flat = {}
    for path, leaf in leaves:
        keys = [str(getattr(k, "key", k)) for k in path]
        if any("/" in key for key in keys):
            raise ValueError(f"parameter path {keys} has a '/' in a key: it would not unflatten")
        flat["/".join(keys)] = np.asarray(leaf)
    return flat


def save_params(path: Path, params: Any) -> dict[str, str]:
    """Writes ``params`` to the ``.npz`` file ``path``; returns ``{name: dtype}`` of the leaves
    stored as bits (dtypes NumPy has no ``.npz`` form for, e.g. bfloat16), for the manifest."""
    flat = flatten_params(params)
    bits = {name: x.dtype.name for name, x in flat.items() if x.dtype.kind == "V"}
    stored = {
        name: x.view(np.dtype(f"u{x.dtype.itemsize}")) if name in bits else x
        for name, x in flat.items()
    }
    np.savez(path, **stored)
    return bits
