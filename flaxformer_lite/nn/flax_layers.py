"""Flax's own layers, reading their parameters as this package's layers do.

``nn.Dense``, ``nn.DenseGeneral``, ``nn.LayerNorm`` and ``nn.RMSNorm`` unchanged but for
``self.param``, which reads an existing parameter through ``logical_params.read_param``
instead of tracing its initializer under ``jax.eval_shape`` at every read (linen's check,
paid each time a model is traced). Same class names, so the same default module names,
parameters and arithmetic."""

from __future__ import annotations

import flax.linen as nn

from flaxformer_lite.core.logical_params import ReadParams


class Dense(ReadParams, nn.Dense):
    """``nn.Dense``: `[..., in]` -> `[..., features]`."""


class DenseGeneral(ReadParams, nn.DenseGeneral):
    """``nn.DenseGeneral``."""


class LayerNorm(ReadParams, nn.LayerNorm):
    """``nn.LayerNorm``."""


class RMSNorm(ReadParams, nn.RMSNorm):
    """``nn.RMSNorm``."""
