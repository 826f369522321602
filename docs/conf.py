"""Sphinx configuration: MyST pages, API reference from docstrings, benchmark tables from runs.

Build:  sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # jattn and experiments, installed or not

from experiments import docs_tables  # noqa: E402

project = "jattn"
author = "the jattn authors"
copyright = "the jattn authors"
release = version = importlib.import_module("jattn").__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Run records (JSON, plots) and the tables written from them are data, not pages.
exclude_patterns = ["_build", "_generated", *docs_tables.RECORD_DIRS]

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links, as on GitHub

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list: NamedTuple fields are not described twice

html_theme = "furo"
html_title = f"jattn {release}"

# Modules whose members are documented with ``automodule``: each says what it exports in
# its own ``__all__`` (the build refuses one that does not).
API_MODULES = (
  "jattn.masks",
  "jattn.scores",
  "jattn.decode",
  "jattn.parallel",
  "jattn.linen",
  "jattn.nnx",
  "jattn.linear",
  "jattn.hopfield",
  "jattn.positional",
  "jattn.dropout",
  "jattn.viz",
)


def _check_module_members() -> None:
  for name in API_MODULES:
    if not hasattr(importlib.import_module(name), "__all__"):
      raise RuntimeError(f"{name} declares no __all__: say in the module what it exports")


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  """NamedTuple fields document themselves as "Alias for field number i"; the class's
  Attributes section says what they hold."""
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  _check_module_members()
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
  docs_tables.write_tables(DOCS, DOCS / "_generated")
