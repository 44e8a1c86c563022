"""Sphinx configuration of the sparse_jax documentation: ``python -m sphinx -W -b html docs
docs/_build`` (``pip install ".[docs]"``). Pages are Markdown (MyST); the API reference is
generated from the docstrings (autodoc, Google style through napoleon)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

project = "sparse_jax"
author = "the sparse_jax developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # `[...](page.md#a-heading)` links resolve
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = "sparse_jax"
