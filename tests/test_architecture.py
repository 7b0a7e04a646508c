"""The package's architecture holds: subpackages import only downward and no modules import each
other in a circle (import-linter's contracts in pyproject.toml, as `make lint` runs them), and the
flat module paths of 0.1 still import, as the same module objects, with a DeprecationWarning."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flaxformer_lite import _moved

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_import_contracts_are_kept():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, planted, broken",
    [
        # ops/masks.py importing the CLI runs up six layers.
        ("ops/masks.py", "from flaxformer_lite.cli import translate", "import only downward"),
        # masks <-> attention inside ops: a circle, though no layer is crossed.
        ("ops/masks.py", "from flaxformer_lite.ops import attention", "no import circles"),
    ],
)
def test_a_planted_import_breaks_a_contract(tmp_path, module, planted, broken):
    """The contracts can fail: a copy of the package with one bad import is refused."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "flaxformer_lite", copy / "flaxformer_lite")
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    target = copy / "flaxformer_lite" / module
    target.write_text(target.read_text() + f"\n{planted}  # planted\n")
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_module_path_imports_as_the_moved_module(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop(f"flaxformer_lite.{old}", None)
        module = importlib.import_module(f"flaxformer_lite.{old}")
    assert module is importlib.import_module(f"flaxformer_lite.{new}")
    assert module.__spec__.name == f"flaxformer_lite.{new}"  # the moved module's own spec
    assert any(
        issubclass(w.category, DeprecationWarning) and f"flaxformer_lite.{new}" in str(w.message)
        for w in caught
    )


def test_python_dash_m_on_an_old_path_runs_the_moved_cli():
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "flaxformer_lite.translate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--workdir" in result.stdout


# The 44 modules of 0.1's flat layout (git ls-tree of flaxformer_lite/ before the move).
FLAT_01 = (
    "activations",
    "attention",
    "attention_maps",
    "batch_stream",
    "batching",
    "beam_cache",
    "blockwise",
    "checkpoints",
    "classification_task",
    "config",
    "data",
    "decoding",
    "encoding",
    "evaluate",
    "export",
    "flops",
    "generate",
    "hf",
    "inference",
    "init_from",
    "layers",
    "lm_task",
    "losses",
    "marian_tokenizer",
    "masks",
    "metrics",
    "models",
    "moe",
    "optim",
    "packing",
    "paths",
    "plot_metrics",
    "positions",
    "preflight",
    "quantize",
    "serving_runtime",
    "sharding",
    "special_ids",
    "synthetic",
    "tasks",
    "tokenizer",
    "translate",
    "translation_task",
    "workdir_data",
)


def test_every_old_module_path_is_mapped():
    """Each module of 0.1 imports today: moved (and aliased), or a package of that name."""
    assert set(_moved.MOVED) | {"models", "data", "decoding", "inference"} == set(FLAT_01)
    for name in FLAT_01:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(f"flaxformer_lite.{name}")
