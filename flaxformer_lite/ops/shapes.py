"""Shape checks shared by every attention kernel (``attention``, ``blockwise``): one place that
says what ``[batch, length, heads, head_dim]`` operands each kernel accepts."""

from __future__ import annotations

import jax

Array = jax.Array


def check_shapes(query: Array, key: Array, value: Array) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, length, heads, head_dim] (rank 4); got shape {x.shape}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes must match; got {key.shape} and {value.shape}")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(
            "query and key must share batch and head_dim; "
            f"got query {query.shape} and key {key.shape}"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"query heads ({query.shape[2]}) must be a multiple of key/value heads ({key.shape[2]})"
        )
