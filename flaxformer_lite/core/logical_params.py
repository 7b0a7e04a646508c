"""The box a parameter's logical axis names travel in, for linen and for Flax NNX.

Every parameter is created through :func:`logical_init`, which boxes it in a
:class:`LogicalParam`: linen's ``nn.LogicallyPartitioned`` (so ``nn.meta.unbox``,
``sharding.logical_shardings`` and ``nn.scan``'s "layers" axis treat it as before) that also
knows how to become an ``nnx.Variable`` (``nnx.bridge.ToNNX``).

Why a subclass: linen's box hands NNX its logical names ("embed", "kv_heads", ...) as the
Variable's ``out_sharding``, and NNX (flax >= 0.12, eager sharding on by default) shards every
new Variable by it at once: outside a mesh that fails ("An auto mesh context or metadata is
required ..."), inside one the names are not mesh axes. NNX's own rule table
(``sharding_rules``) cannot say what ``sharding.LOGICAL_RULES`` says either: a name may fall
back to other mesh axes when the first do not divide the dimension ("kv_embed"), which needs
the parameter's shape. So the box resolves its names itself, with
``sharding.logical_to_spec``, when it becomes a Variable:

- under a mesh (``jax.set_mesh``) with the axes ``sharding.MESH_AXES``, ``out_sharding`` is
  the mesh PartitionSpec linen's sharded initialisation gives the same parameter, and NNX
  places the Variable there (its optimizer state too: ``nnx.Optimizer`` copies the metadata);
- outside any mesh, ``out_sharding`` is None: an ordinary, unsharded Variable.

The logical names stay in the Variable's metadata as ``logical_axes``, and the box comes back
from them when NNX hands the Variable to linen again (every ``ToNNX`` call does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import errors
from jax.sharding import PartitionSpec

from flaxformer_lite.core import sharding

LogicalNames = tuple[str | None, ...]

# The Variable metadata key that keeps the logical names (out_sharding holds mesh axes).
LOGICAL_AXES = "logical_axes"


def _context_mesh() -> jax.sharding.AbstractMesh | None:
    """The (abstract) mesh of the enclosing ``jax.set_mesh``, inside ``jit`` too; None
    without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def nnx_partition_spec(names: LogicalNames, shape: tuple[int, ...], mesh: Any) -> PartitionSpec:
    """The mesh PartitionSpec of a parameter with logical ``names`` and ``shape`` on ``mesh``
    (a Mesh or AbstractMesh), by ``sharding.LOGICAL_RULES``.

    Raises:
      ValueError: ``mesh`` lacks one of ``sharding.MESH_AXES`` (the rules place parameters on
        those axes; ``sharding.make_mesh`` builds such a mesh).
    """
    missing = [a for a in sharding.MESH_AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"the mesh's axes {tuple(mesh.axis_names)} lack {tuple(missing)}: flaxformer_lite "
            f"parameters are sharded over a mesh with axes {sharding.MESH_AXES} (size 1 where "
            "unused; core.sharding.make_mesh builds one)"
        )
    return sharding.logical_to_spec(names, shape, dict(mesh.shape))


class LogicalParam(nn.LogicallyPartitioned):
    """``nn.LogicallyPartitioned`` that becomes a correctly sharded ``nnx.Variable``.

    ``value``: the parameter; ``names``: one logical axis name (or None) per axis. The layers
    never set ``mesh`` or ``rules`` (the rules are ``sharding.LOGICAL_RULES``, applied by
    ``sharding.logical_shardings`` for linen and here for NNX).
    """

    def to_nnx_metadata(self) -> dict[str, Any]:
        """The ``nnx.Variable`` metadata: ``out_sharding`` the mesh PartitionSpec under a
        mesh (None outside one; NNX shards by it against the mesh of the context, so an
        ``nnx.Optimizer`` of these Variables is created under the same ``jax.set_mesh``),
        ``logical_axes`` the names."""
        names = tuple(self.names)
        mesh = _context_mesh()
        spec = None if mesh is None else nnx_partition_spec(names, self.value.shape, mesh)
        return {"value": self.value, "out_sharding": spec, LOGICAL_AXES: names}

    @classmethod
    def from_nnx_metadata(cls, metadata: dict[str, Any]) -> LogicalParam:
        """The box back from a Variable's metadata (``to_nnx_metadata``'s output, as NNX
        kept it): its value and logical names."""
        return cls(value=metadata["value"], names=tuple(metadata[LOGICAL_AXES]))


def logical_init(init: Callable, names: LogicalNames) -> Callable:
    """``init`` whose parameter carries the logical axis ``names`` (one per axis) in a
    :class:`LogicalParam` box (as ``nn.with_logical_partitioning`` does with its own box)."""

    def boxed(*args: Any, **kwargs: Any) -> LogicalParam:
        return LogicalParam(init(*args, **kwargs), tuple(names))

    return boxed


def read_param(
    module: nn.Module, name: str, init_fn: Callable, shape: Any, *init_args: Any, unbox=True
) -> Any:
    """``module.param(name, init_fn, shape, *init_args)``, without flax's cost at every read.

    Linen's ``Module.param`` checks an existing parameter at every read, in ``apply`` as in
    ``init``, by tracing ``init_fn`` under ``jax.eval_shape`` and comparing shapes: about a
    millisecond of Python per parameter each time a model is traced (a jitted train step, a
    decoding loop), most of the time of tracing a small model's ``apply``
    (``bench/trace_time.py``). Every initializer here returns an array of the ``shape`` it is
    given, so an existing parameter's shape is compared with ``shape`` directly, raising
    flax's own ``ScopeParamShapeError``; a parameter that does not exist yet (``init``) is
    made by ``Module.param`` itself. ``shape``: the parameter's shape, the first argument
    after the key that ``init_fn`` takes."""
    if not module.has_variable("params", name):
        return nn.Module.param(module, name, init_fn, shape, *init_args, unbox=unbox)
    value = module.get_variable("params", name)
    array = nn.meta.unbox(value)
    if np.shape(array) != tuple(shape):
        raise errors.ScopeParamShapeError(
            name, module.scope.path_text, np.shape(array), tuple(shape)
        )
    return array if unbox else value


class ReadParams:
    """A mixin for flax's own layers (``nn.Dense``, ``nn.LayerNorm``, ...): their
    ``self.param(name, init_fn, shape, dtype)`` reads an existing parameter through
    :func:`read_param`. Put it first: ``class Dense(ReadParams, nn.Dense)``."""

    def param(self, name: str, init_fn: Callable, *init_args: Any, unbox=True, **init_kwargs):
        if init_kwargs or not init_args or not isinstance(init_args[0], tuple | list):
            return nn.Module.param(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
        return read_param(self, name, init_fn, *init_args, unbox=unbox)
