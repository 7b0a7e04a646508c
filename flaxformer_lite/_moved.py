"""The flat module paths of releases up to 0.1 (``flaxformer_lite.hf``, ``flaxformer_lite.layers``,
...) for one more release: importing one warns (``DeprecationWarning``) and gives the module at
its new place, the same module object, so ``python -m flaxformer_lite.translate`` and
``monkeypatch.setattr("flaxformer_lite.hf.X", ...)`` keep working. CHANGELOG.md lists the moves.

``flaxformer_lite.models``, ``.data``, ``.decoding`` and ``.inference`` are packages now and
re-export their old names themselves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# old module name (under flaxformer_lite.) -> new module name (under flaxformer_lite.)
MOVED = {
    "paths": "core.paths",
    "special_ids": "core.special_ids",
    "sharding": "core.sharding",
    "checkpoints": "core.checkpoints",
    "activations": "ops.activations",
    "masks": "ops.masks",
    "positions": "ops.positions",
    "attention": "ops.attention",
    "blockwise": "ops.blockwise",
    "quantize": "ops.quantize",
    "beam_cache": "ops.beam_cache",
    "config": "nn.config",
    "layers": "nn.layers",
    "moe": "nn.moe",
    "generate": "decoding.generate",
    "tokenizer": "data.tokenizer",
    "marian_tokenizer": "data.marian_tokenizer",
    "encoding": "data.encoding",
    "batching": "data.batching",
    "packing": "data.packing",
    "batch_stream": "data.stream",
    "workdir_data": "data.workdir",
    "tasks": "data.tasks",
    "translation_task": "data.tasks.translation",
    "lm_task": "data.tasks.lm",
    "classification_task": "data.tasks.classification",
    "synthetic": "data.tasks.synthetic",
    "hf": "interop.hf",
    "init_from": "interop.init_from",
    "optim": "training.optim",
    "losses": "training.losses",
    "metrics": "training.metrics",
    "flops": "training.flops",
    "preflight": "training.preflight",
    "export": "inference.export",
    "serving_runtime": "inference.serving_runtime",
    "translate": "cli.translate",
    "evaluate": "cli.evaluate",
    "attention_maps": "cli.attention_maps",
    "plot_metrics": "cli.plot_metrics",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new place (one module object for both)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import system sets the old name's spec on it next
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec

    def get_code(self, fullname: str):  # `python -m OLD` runs the new module's code
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "flaxformer_lite" or old not in MOVED:
            return None
        new = f"flaxformer_lite.{MOVED[old]}"
        warnings.warn(
            f"{fullname} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
