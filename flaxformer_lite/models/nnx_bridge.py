"""The models from Flax NNX: ``to_nnx`` (one jitted initialisation) and ``linen_params``.

The linen models are the one implementation; NNX code uses them through flax's bridge,
``nnx.bridge.ToNNX``. That works as it stands, outside or inside a mesh, because every
parameter's logical-axis box resolves itself into a mesh sharding when it becomes an
``nnx.Variable`` (``core.logical_params``)::

    model = nnx.bridge.ToNNX(EncoderDecoder(config), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, inputs, targets)     # under jax.set_mesh(mesh): sharded
    logits = model(inputs, targets)                  # [batch, tgt_len, vocab]

``lazy_init`` runs linen's ``init`` eagerly, one operation at a time, and under a mesh first
builds each parameter whole; :func:`to_nnx` does the same in one ``nnx.jit`` call, so each
device creates only its shards (as ``core.sharding.sharded_init`` does for linen).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
from jax.sharding import Mesh

from flaxformer_lite.core import sharding

if TYPE_CHECKING:  # flax.nnx imports optax: only when NNX is used
    from flax import nnx


def to_nnx(
    module: nn.Module,
    *example_inputs: Any,
    rngs: nnx.Rngs | None = None,
    mesh: Mesh | None = None,
    **example_kwargs: Any,
) -> nnx.bridge.ToNNX:
    """``module`` (a linen model: EncoderDecoder, DecoderOnly, EncoderClassifier) as an NNX
    module, its variables initialised by one jitted ``lazy_init`` on ``example_inputs``.

    Args:
      module: the linen module; its ``config`` is checked against ``mesh`` when it has one.
      *example_inputs: what ``module.init`` takes after the rng (int token arrays
        `[batch, length]`; only their shapes matter).
      rngs: the NNX rngs (default ``nnx.Rngs(0)``); a ``dropout`` stream is needed to train
        with dropout (``nnx.Rngs(params=0, dropout=1)``), as linen's ``rngs={"dropout": ...}``.
      mesh: None: unsharded parameters. A mesh with axes ``sharding.MESH_AXES``
        (``sharding.make_mesh``): every parameter is created directly in the shards
        ``sharding.LOGICAL_RULES`` give it, as linen's ``sharding.sharded_init`` places the
        same parameter.
      **example_kwargs: keyword arguments of ``module.init`` (e.g. ``deterministic=True``).

    Returns:
      The ``nnx.bridge.ToNNX`` module: call it as the linen module's ``apply`` (``model(inputs,
      targets)``, ``model.decode(..., mutable=["cache"])``); its parameters are
      ``nnx.state(model, nnx.Param)``.

    Raises:
      ValueError: ``mesh`` lacks one of ``sharding.MESH_AXES``, or cannot split the model's
        attention heads (``sharding.check_attention_fits_mesh``).
    """
    from flax import nnx  # here: flax.nnx imports optax, which the package import avoids

    if not isinstance(module, nn.Module):
        raise ValueError(
            f"module must be a flax.linen Module (EncoderDecoder, DecoderOnly, "
            f"EncoderClassifier); got {type(module).__name__}"
        )
    if mesh is not None:
        missing = [a for a in sharding.MESH_AXES if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"mesh must have the axes {sharding.MESH_AXES} (sharding.make_mesh); its axes "
                f"{tuple(mesh.axis_names)} lack {tuple(missing)}"
            )
        if hasattr(module, "config"):
            sharding.check_attention_fits_mesh(module.config, mesh)
    rngs = nnx.Rngs(0) if rngs is None else rngs

    @nnx.jit
    def create(rngs: nnx.Rngs, *inputs: Any) -> nnx.bridge.ToNNX:
        model = nnx.bridge.ToNNX(module, rngs=rngs)
        nnx.bridge.lazy_init(model, *inputs, **example_kwargs)
        return model

    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return create(rngs, *example_inputs)


def linen_params(model: nnx.Module) -> dict:
    """The linen ``params`` tree of an NNX-wrapped model (``{"encoder": ..., "decoder":
    ...}``, plain arrays, kept where they are sharded): what ``model.apply({"params": ...})``,
    ``decoding.generate`` and the checkpoints take."""
    from flax import nnx  # here: flax.nnx imports optax, which the package import avoids

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
