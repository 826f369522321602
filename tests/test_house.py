"""The house rules of docs/layout.md, read from the source: no module of the library over
450 lines, no test file over 800, no test file importing another, and ``__all__`` set in
the code of every module the API reference documents."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import tiers

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "jattn").rglob("*.py"))
TESTS = sorted((ROOT / "tests").glob("test_*.py"))


def _lines(path: pathlib.Path) -> int:
  return len(path.read_text(encoding="utf-8").splitlines())


def test_the_globs_find_the_code():
  assert len(LIBRARY) > 50 and len(TESTS) > 30


def test_no_library_module_over_450_lines():
  over = {str(p.relative_to(ROOT)): n for p in LIBRARY if (n := _lines(p)) > 450}
  assert not over, f"split these by concept: {over}"


def test_no_test_file_over_800_lines():
  over = {p.name: n for p in TESTS if (n := _lines(p)) > 800}
  assert not over, f"split these by concept: {over}"


def _imported_modules(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      module = node.module or ""
      names |= {module} | {f"{module}.{a.name}".lstrip(".") for a in node.names}
  return names


def test_no_test_file_imports_another():
  """Shared cases and helpers live in modules that are not tests (cases.py, reference.py)."""
  stems = {p.stem for p in TESTS}
  offenders = {
    p.name: sorted(m for m in _imported_modules(p) if set(m.split(".")[:2]) & stems) for p in TESTS
  }
  assert not {k: v for k, v in offenders.items() if v}
  assert set("tests.test_xla.SCORE_FNS".split(".")[:2]) & stems  # what it would catch


# What jattn may import: its runtime dependencies (pyproject's [project] dependencies) and the
# standard library; matplotlib only inside jattn.viz's functions (the viz extra).
RUNTIME = {"jax", "jaxlib", "chex", "numpy", "flax", "jattn"}


def test_the_library_imports_only_its_runtime_dependencies():
  import sys

  found = {}
  for path in LIBRARY:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {n for n in ast.iter_child_nodes(tree) if isinstance(n, ast.Import | ast.ImportFrom)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        roots = {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and not node.level:
        roots = {(node.module or "").split(".")[0]}
      else:
        continue
      lazy_plot = path.name == "viz.py" and node not in top and roots == {"matplotlib"}
      outside = roots - RUNTIME - set(sys.stdlib_module_names) - {"__future__"}
      if outside and not lazy_plot:
        found[str(path.relative_to(ROOT))] = sorted(outside)
  assert not found, f"not runtime dependencies of jattn: {found}"
  pyproject = (ROOT / "pyproject.toml").read_text()
  runtime = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
  assert not {"optax", "pyyaml", "rich"} & set(re.findall(r'"([a-z]+)', runtime))


def _documented_modules() -> list[str]:
  pages = (ROOT / "docs" / "api").glob("*.md")
  found = {m for page in pages for m in re.findall(r"automodule:: (jattn[\w.]*)", page.read_text())}
  return sorted(found)


@pytest.mark.parametrize("module", _documented_modules())
def test_documented_modules_set_all_in_their_code(module):
  parts = module.split(".")
  path = ROOT.joinpath(*parts).with_suffix(".py")
  if not path.exists():
    path = ROOT.joinpath(*parts, "__init__.py")
  tree = ast.parse(path.read_text(encoding="utf-8"))
  assigned = [
    node
    for node in tree.body
    if isinstance(node, ast.Assign)
    and any(getattr(t, "id", None) == "__all__" for t in node.targets)
  ]
  assert assigned, f"{module} sets no __all__"
  names = ast.literal_eval(assigned[0].value)
  defined = {
    getattr(n, "name", None) or getattr(t, "id", None)
    for n in tree.body
    for t in (getattr(n, "targets", None) or [getattr(n, "target", None)])
  }
  defined |= {
    a.asname or a.name
    for n in tree.body
    if isinstance(n, ast.ImportFrom | ast.Import)
    for a in n.names
  }
  missing = [name for name in names if name not in defined]
  assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_every_tiered_sweep_is_a_test_that_exists():
  """tests/tiers.py names sweeps by file and test: a renamed test would leave a stale entry
  (its cases then all run by default; conftest.py checks the case ids)."""
  assert len(tiers.DEFAULT) > 10
  for sweep, kept in tiers.DEFAULT.items():
    file, test = sweep.split("::")
    assert f"\ndef {test}(" in (ROOT / "tests" / file).read_text(encoding="utf-8"), sweep
    assert kept and len(set(kept)) == len(kept), sweep
