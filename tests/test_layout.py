"""The layout of tests/: no test module imports another test module (what several share lives
in tests/helpers/), and test module basenames are unique across the folders (pytest's default
rootdir/prepend import mode imports each by its basename; two alike would collide)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> list[str]:
    """The modules named test_* (at any depth of a dotted name: ``test_x``, ``tests.test_x``,
    ``from tests.ops import test_x``) that ``source`` imports, anywhere in it (function
    bodies included), as ``"line N: name"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if any(part.startswith("test_") for part in name.split(".")):
                found.append(f"line {node.lineno}: {name}")
                break
    return found


def python_files() -> list[Path]:
    """Every test module and helper under tests/."""
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_import_check_finds_a_planted_import_of_a_test_module():
    planted = """
import os
from helpers.runs import free_port
import test_train
from tests.test_inference import tiny_config
from tests.training import test_sharding


def f():
    from test_hf_marian import marian_config
"""
    assert imported_test_modules(planted) == [
        "line 4: test_train",
        "line 5: tests.test_inference",
        "line 6: tests.training.test_sharding",
        "line 10: test_hf_marian",
    ]


def test_no_module_under_tests_imports_a_test_module():
    files = python_files()
    assert len([p for p in files if p.name.startswith("test_")]) > 40  # the walk finds them
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in files
        if (found := imported_test_modules(path.read_text()))
    }
    assert offenders == {}, "move what they share into tests/helpers/"


def test_test_module_basenames_are_unique_across_folders():
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
