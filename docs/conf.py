"""Sphinx configuration: MyST Markdown pages and an autodoc API reference.

Build: `make docs`, i.e. `sphinx-build -W --keep-going -b html docs docs/_build/html`.
"""

import os
import sys

# This checkout's package first: an editable install in the virtualenv may point elsewhere.
sys.path.insert(0, os.path.abspath(".."))

import flaxformer_lite  # noqa: E402

project = "flaxformer_lite"
author = "flaxformer_lite authors"
copyright = "flaxformer_lite authors"
release = version = flaxformer_lite.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the Google-style "Args:/Returns:/Raises:" docstrings
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# GitHub-style anchors (`training.md#preemption`), so that links work on GitHub and here alike.
myst_heading_anchors = 3

autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "flaxformer_lite"
# The sidebar expands the current page's branch only: expanding all of them on each of the
# 117 pages (26 guides and API pages, 91 source pages) took a third of the build's CPU time
# (sphinx-build 25.7 -> 16.8 CPU s, which the docs test pays in every suite run).
html_theme_options = {"show_toc_level": 2, "collapse_navbar": True}
