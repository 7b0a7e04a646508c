"""The documentation stays true to the code: the site builds without a warning, and every module,
object and file that README.md and docs/ name exists at the path they give.

Old flat module paths (``flaxformer_lite.translate``) still import through
``flaxformer_lite/_moved.py`` for one release, so "it imports" is not enough: a module named in the
docs must be a file or package of its own under ``flaxformer_lite/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flaxformer_lite"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def doc_files() -> list[Path]:
    """README.md and every Markdown page of the site (docs/_build left out)."""
    pages = [p for p in DOCS.rglob("*.md") if "_build" not in p.parts]
    return [README, *sorted(pages)]


def doc_texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in doc_files()}


# `python -m flaxformer_lite.cli.translate`, also wrapped after `-m` in prose.
RUN_MODULE = re.compile(r"python\s+-m\s+(flaxformer_lite(?:\.\w+)*)")
# `from flaxformer_lite.interop.hf import a, b` or `... import (a, b)` over several lines.
FROM_IMPORT = re.compile(r"from\s+(flaxformer_lite(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n`]+)")
# Any dotted name under the package (`flaxformer_lite.decoding.generate.continue_prompt`).
DOTTED = re.compile(r"\bflaxformer_lite(?:\.\w+)+")
# Source files named by path: flaxformer_lite/ops/quantize.py, tests/test_hf_*.py, bench/x.py.
FILE_PATH = re.compile(r"\b((?:flaxformer_lite|tests|configs|bench)/[\w/*.-]*\.py)\b")


def module_on_disk(name: str) -> bool:
    """Whether ``name`` (``flaxformer_lite.a.b``) is a module file or package directory of its
    own, not an alias that another module installs."""
    parts = name.split(".")[1:]
    if not parts:
        return True
    base = PACKAGE.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module on disk, or an object reachable by attributes from the
    longest such module prefix; otherwise why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if module_on_disk(module_name):
            break
    else:  # unreachable: "flaxformer_lite" itself is on disk
        return f"{dotted}: no module"
    obj = importlib.import_module(module_name)
    for i, attr in enumerate(parts[cut:], start=cut):
        if not hasattr(obj, attr):
            return f"{dotted}: {'.'.join(parts[:i])} has no attribute {attr!r}"
        obj = getattr(obj, attr)
    if cut < len(parts) and isinstance(obj, type(sys)):
        # An attribute that is a module: the docs must name it by its own path.
        if not module_on_disk(obj.__name__) or obj.__name__ != dotted:
            return f"{dotted}: is module {obj.__name__}; name it by that path"
    return None


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES} (reference goes in docs/)"
    )


def test_every_python_m_command_names_a_module_on_disk():
    commands = [(f, m) for f, text in doc_texts().items() for m in RUN_MODULE.findall(text)]
    assert commands, "no `python -m flaxformer_lite...` found: the pattern is broken"
    problems = [
        f"{f}: python -m {m}"
        for f, m in commands
        if not module_on_disk(m) or importlib.util.find_spec(m) is None
    ]
    assert not problems, "modules that do not exist at these paths:\n" + "\n".join(problems)


def from_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from flaxformer_lite... import ...`` in ``text``."""
    pairs = []
    for module, names in FROM_IMPORT.findall(text):
        names = names.split("#")[0] if not names.startswith("(") else names
        for item in names.strip("()").replace("\n", " ").split(","):
            item = item.split("#")[0].strip().strip("`").split(" as ")[0].strip()
            if item:
                pairs.append((module, item))
    return pairs


def test_every_from_import_resolves():
    pairs = [(f, m, n) for f, text in doc_texts().items() for m, n in from_imports(text)]
    assert len(pairs) > 5, "few `from flaxformer_lite... import` found: the pattern is broken"
    problems = []
    for f, module, name in pairs:
        if not module_on_disk(module):
            problems.append(f"{f}: from {module} import {name}: no module {module}")
            continue
        mod = importlib.import_module(module)
        submodule = f"{module}.{name}"
        if not hasattr(mod, name) and not module_on_disk(submodule):
            problems.append(f"{f}: from {module} import {name}: no such name")
    assert not problems, "\n".join(problems)


def test_every_dotted_name_resolves():
    names = sorted({(f, d) for f, text in doc_texts().items() for d in DOTTED.findall(text)})
    assert names, "no dotted flaxformer_lite name found: the pattern is broken"
    problems = [f"{f}: {why}" for f, d in names if (why := resolve(d))]
    assert not problems, "\n".join(problems)


def test_every_source_file_named_exists():
    paths = sorted({(f, p) for f, text in doc_texts().items() for p in FILE_PATH.findall(text)})
    assert paths, "no source path found: the pattern is broken"
    missing = [f"{f}: {p}" for f, p in paths if not any(ROOT.glob(p))]
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_api_reference_documents_every_module():
    """Every public module of the package has an ``automodule`` on one of docs/api/*.md."""
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^\.\. automodule:: (\S+)$", page.read_text(), re.M))
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if any(p.startswith("_") for p in parts) or len(parts) == 1:
            continue  # private modules (_moved.py) and the top-level __init__
        modules.add(".".join(parts))
    assert modules, "no module found under flaxformer_lite/"
    assert not modules - documented, f"not in docs/api: {sorted(modules - documented)}"
    assert not documented - modules, f"no such module: {sorted(documented - modules)}"


def test_site_builds_without_warnings(tmp_path):
    for module in ("sphinx", "myst_parser", "sphinx_book_theme"):
        pytest.importorskip(module, reason=f"{module} is in the dev and docs extras")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
        + ["-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    log = f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    assert result.returncode == 0, f"sphinx-build failed:\n{log}"
    assert (tmp_path / "html" / "index.html").is_file()
    assert (tmp_path / "html" / "api" / "index.html").is_file()
