"""One name map between a Hugging Face (PyTorch) state dict and our parameter tree, both ways.

Every family module (``marian``, and the others beside it) describes its checkpoint as a list
of :class:`Tensor` rows, one per parameter: the Hugging Face name(s), the path in our tree, our
shape and how the two arrays differ. :func:`params_from_state` and :func:`state_from_params`
walk that list in either direction, so a name is written once and loading and saving cannot
disagree. The rules are the ones PyTorch imposes:

* ``nn.Linear`` weights are `[out, in]`; our kernels are `[in..., out...]` with the
  attention heads as their own axes: queries/keys/values `[d_model, heads, head_dim]` (one
  leading "in" axis), the attention output `[heads, head_dim, d_model]` (two), feed-forward
  `[d_model, d_ff]` (one). ``in_axes`` says how many of our leading axes are the "in" side;
  the Hugging Face array is ``ours.reshape(prod(in), prod(out)).T``.
* everything else (biases, norms, embeddings, bias tables) differs at most by a reshape
  (`[heads * head_dim]` vs `[heads, head_dim]`; Marian's `[1, vocab]` logits bias vs
  `[vocab]`): ``hf_shape``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter of a checkpoint.

    Attributes:
      hf: its Hugging Face state-dict names. Reading takes the first one present (a tied table
        stored under any of its names); writing writes the first.
      ours: its path in our ``params`` tree, "/"-joined (``"decoder/layers_0/mlp/wi/kernel"``).
      shape: our shape.
      in_axes: a PyTorch ``Linear`` weight: how many leading axes of ``shape`` are its input
        (``[out, in]`` there); None: not a Linear weight, the arrays differ by a reshape only.
      hf_shape: the Hugging Face shape of a non-Linear tensor when it is not ``shape``.
    """

    hf: tuple[str, ...]
    ours: str
    shape: tuple[int, ...]
    in_axes: int | None = None
    hf_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if self.in_axes is not None and not 0 < self.in_axes < len(self.shape):
            raise ValueError(
                f"Tensor {self.ours}: in_axes={self.in_axes} must split shape {self.shape} "
                "into non-empty input and output axes"
            )

    @property
    def expected_hf_shape(self) -> tuple[int, ...]:
        """The shape of the Hugging Face array."""
        if self.in_axes is None:
            return self.hf_shape or self.shape
        k = self.in_axes
        return (math.prod(self.shape[k:]), math.prod(self.shape[:k]))

    def to_ours(self, value: np.ndarray) -> np.ndarray:
        value = np.asarray(value)
        if self.in_axes is not None:
            value = value.T
        return value.reshape(self.shape)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        value = np.asarray(value)
        if value.shape != self.shape:
            raise ValueError(f"params/{self.ours} has shape {value.shape}; expected {self.shape}")
        if self.in_axes is None:
            return value.reshape(self.expected_hf_shape)
        k = self.in_axes
        return value.reshape(math.prod(self.shape[:k]), math.prod(self.shape[k:])).T


def linear(
    hf_prefix: str, ours: str, shape: Sequence[int], *, in_axes: int = 1, bias: bool = True
) -> list[Tensor]:
    """A PyTorch ``Linear`` ``{hf_prefix}.weight`` (and ``.bias``) as our ``{ours}/kernel`` of
    ``shape`` (and ``{ours}/bias``, shaped as the kernel's output axes)."""
    shape = tuple(shape)
    rows = [Tensor((f"{hf_prefix}.weight",), f"{ours}/kernel", shape, in_axes=in_axes)]
    if bias:
        out = shape[in_axes:]
        rows.append(Tensor((f"{hf_prefix}.bias",), f"{ours}/bias", out, hf_shape=(math.prod(out),)))
    return rows


def norm(hf_prefix: str, ours: str, width: int, *, bias: bool = True) -> list[Tensor]:
    """A LayerNorm (``weight`` and ``bias``) or an RMS norm (``weight`` only) as our
    ``{ours}/scale`` (and ``{ours}/bias``)."""
    rows = [Tensor((f"{hf_prefix}.weight",), f"{ours}/scale", (width,))]
    if bias:
        rows.append(Tensor((f"{hf_prefix}.bias",), f"{ours}/bias", (width,)))
    return rows


def strip_prefixes(
    state: Mapping[str, np.ndarray], prefixes: Iterable[str]
) -> dict[str, np.ndarray]:
    """``state`` with each name's leading ``prefixes`` removed (in order, each at most once)."""
    prefixes = tuple(prefixes)
    out = {}
    for key, value in state.items():
        for prefix in prefixes:
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def _set(tree: Params, path: str, value: Any) -> None:
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _get(tree: Mapping[str, Any], path: str) -> Any:
    for part in path.split("/"):
        if not isinstance(tree, Mapping) or part not in tree:
            raise ValueError(f"the parameters have no params/{path} (at {part!r})")
        tree = tree[part]
    return tree


def params_from_state(
    state: Mapping[str, np.ndarray],
    tensors: Sequence[Tensor],
    *,
    ignore: Iterable[str] = (),
    family: str = "Hugging Face",
) -> Params:
    """Our ``params`` (nested dicts of float32 NumPy arrays) from a state dict.

    Args:
      state: Hugging Face names -> arrays (``read_state_dict``), prefixes already stripped.
      tensors: the family's rows for the model's config.
      ignore: names that carry nothing the rows do not (tied copies, fixed tables the family
        checks itself); not reported as left over.
      family: the family's name in error messages.

    Raises:
      ValueError: a row's tensor is missing or has another shape (named, with the shape the
        config implies), or the state has tensors no row and no ``ignore`` name accounts for.
    """
    params: Params = {}
    used: set[str] = set()
    for row in tensors:
        name = next((n for n in row.hf if n in state), None)
        expected = row.expected_hf_shape
        if name is None:
            names = row.hf[0] if len(row.hf) == 1 else f"any of {list(row.hf)}"
            raise ValueError(f"the checkpoint has no tensor {names} (expected shape {expected})")
        value = np.asarray(state[name], dtype=np.float32)
        if value.shape != expected:
            raise ValueError(
                f"tensor {name!r} has shape {value.shape}; the config (config.json) implies "
                f"{expected}"
            )
        used.add(name)
        _set(params, row.ours, row.to_ours(value))
    left = sorted(set(state) - used - set(ignore))
    if left:
        raise ValueError(f"the checkpoint has tensors this {family} mapping does not use: {left}")
    return params


def state_from_params(
    params: Mapping[str, Any], tensors: Sequence[Tensor]
) -> dict[str, np.ndarray]:
    """The state dict (first Hugging Face name of each row -> contiguous float32 array) of
    plain, unrolled parameters; the inverse of :func:`params_from_state`."""
    state = {}
    for row in tensors:
        value = np.asarray(_get(params, row.ours), dtype=np.float32)
        state[row.hf[0]] = np.ascontiguousarray(row.to_hf(value))
    return state
