"""Parameter trees flattened to ``{"a/b/c": array}`` and re-laid out between the unrolled
(``layers_i``) and the scanned (``layers``, rows stacked on axis 0) layouts by string edits and
NumPy indexing only: the expected values of the fine-tuning tests, never computed by the code
under test."""

from __future__ import annotations

import numpy as np


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """``tree`` (nested dicts) as ``{"path/to/leaf": NumPy array}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value)
    return out


def relayout(flat: dict[str, np.ndarray], scanned: bool, layers: int) -> dict[str, np.ndarray]:
    """``flat`` (either layout, ``layers`` layers per stack) in the unrolled (``layers_i``) or
    scanned (``layers``, rows stacked on axis 0) layout, by string edits and NumPy indexing
    only."""
    unrolled = {}
    for name, value in flat.items():
        parts = name.split("/")
        if "layers" in parts:
            k = parts.index("layers")
            assert value.shape[0] == layers, name
            for i in range(layers):
                unrolled["/".join([*parts[:k], f"layers_{i}", *parts[k + 1 :]])] = value[i]
        else:
            unrolled[name] = value
    if not scanned:
        return unrolled
    out: dict[str, list] = {}
    for name, value in unrolled.items():
        parts = name.split("/")
        k = next((j for j, p in enumerate(parts) if p.startswith("layers_")), None)
        if k is None:
            out[name] = value
            continue
        key = "/".join([*parts[:k], "layers", *parts[k + 1 :]])
        out.setdefault(key, [None] * layers)[int(parts[k][len("layers_") :])] = value
    return {k: np.stack(v) if isinstance(v, list) else v for k, v in out.items()}
