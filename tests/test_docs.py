"""The documentation stays true: every page's examples run and print what the page says,
and the result tables can be written from the committed run records (or say they are absent)."""

import ast
import contextlib
import importlib
import io
import pathlib
import re

import pytest

from experiments import docs_tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())

# What a page's examples print, as the page shows it in comments.
PRINTED = {
  "attention.md": ["(2, 4, 16, 16) True", "ValueError key and value must have the same shape"],
  "backward.md": [
    "implementation='blockwise' does not support backward='autodiff'",
    "implementation='blockwise' gives reverse-mode derivatives only: its backward rule",
    "implementation='blockwise' gives first-order gradients (and forward-over-reverse",
  ],
  "decoding.md": [
    "[5 3]",
    "[8 6]",
    "[[ 0  1 -1 -1]\n [ 2 -1 -1 -1]]",
    "[1 1 0 1 1 1]",
    "[ 0  1 -1 -1] [5 4]",
    "[ 0 11 11  0]",
  ],
  "flax.md": [
    "(2, 10, 32)",
    "(2, 12, 64) (2, 8, 12, 12)",
    "[9 7]",
    "True",
    "[[ 0  1 -1 -1]\n [ 2  3 -1 -1]]",
    "[3 7] 3",
  ],
  "linear.md": ["(1, 128, 4, 16) favor+ mean |error|", "[0 1 2 3]", "(4, 64)"],
  "masks.md": [
    "[[1 0 0 0]\n [1 1 0 0]\n [1 1 1 0]\n [0 1 1 1]]",
    "(2, 16, 4, 64) [1.         0.31622776 0.1        0.03162277]",
    "[0.25       0.0625     0.015625   0.00390625 0.5        0.125     ]",
    "[[0.    0.    1.    1.   ]\n [0.841 0.01  0.54  1.   ]]",
  ],
  "parallel.md": ["flex", "True"],
  "sinks.md": ["(2, 16, 8, 64) (8,)", "(1, 32, 4, 128)", "(64, 4, 32) (2, 10, 64)"],
}


def _blocks(text, language="python"):
  return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


# The default run keeps the pages of the call itself (attention, implementations; masks.md,
# whose examples reach no line of jattn the rest of the default run leaves unreached, by
# coverage's per-test arcs, is exhaustive with the pages below); the
# pages of what builds on it, whose examples compile the most (flax.md runs Flax's modules and
# jattn's eagerly, parallel.md a ring over 8 devices, decoding.md and sinks.md caches and
# modules, numerics.md its measurements, linear.md linear attention, Hopfield retrieval and an
# NNX layer, each tested by default in its own file), are exhaustive, and so is backward.md,
# whose examples (the rules' gradients agree, forward mode and second derivatives refused by
# name) test_orders.py, test_options.py and test_errors.py check by default.
EXHAUSTIVE_PAGES = {
  "flax.md",
  "parallel.md",
  "decoding.md",
  "sinks.md",
  "numerics.md",
  "linear.md",
  "backward.md",
  "masks.md",
}


@pytest.mark.parametrize(
  "page",
  [
    pytest.param(p, id=p.name, marks=pytest.mark.exhaustive if p.name in EXHAUSTIVE_PAGES else ())
    for p in PAGES
  ],
)
def test_page_examples_run(page):
  namespace = {}
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    for block in _blocks(page.read_text()):
      exec(compile(block, str(page.relative_to(ROOT)), "exec"), namespace)
  for text in PRINTED.get(page.name, []):
    assert text in stdout.getvalue(), f"{page.name} no longer prints {text!r}"


def test_every_page_with_examples_is_checked():
  assert {p.name for p in PAGES} >= set(PRINTED) | EXHAUSTIVE_PAGES


def test_tables_from_the_committed_records(tmp_path):
  written = docs_tables.write_tables(DOCS, tmp_path)
  assert {p.stem for p in written} == set(docs_tables.TABLES)
  text = {p.stem: p.read_text() for p in written}
  names = ("bench", "bench_memory", "scaling", "sparse", "accuracy", "demo", "tiles", "gpu_probe")
  names += ("char_lm", "char_lm_clip")
  for name in names:
    assert "No run recorded" not in text[name] and "\n|---|" in text[name], name
  assert "165 of 165 cells meet the target" in text["accuracy"]
  # The probe's records: cuDNN's rows are 1.00 of themselves; flex's rows carry a ratio.
  assert "NVIDIA H200" in text["gpu_probe"] and "| baseline | cudnn |" in text["gpu_probe"]


def test_absent_records_are_named_with_the_command_that_makes_them(tmp_path):
  for path in docs_tables.write_tables(tmp_path / "empty", tmp_path / "out"):
    if path.stem in docs_tables.LIBRARY_TABLES:
      continue
    assert "No run recorded" in path.read_text() and "python -m experiments." in path.read_text()


def test_the_implementations_page_is_the_selection_table():
  """docs/implementations.md's table is written from TABLE: a row per implementation, its
  backends and rules, what it refuses and why, and an opt-in said as one."""
  from jattn.impl import select

  text = docs_tables.implementations(docs_tables.DOCS)
  rows = text.split("What each does not express")[0]
  lines = {line.split(" | ")[0]: line for line in rows.splitlines() if line.startswith("| `'")}
  assert set(lines) == {f"| `{name!r}`" for name in select.TABLE}
  for name, row in select.TABLE.items():
    line = lines[f"| `{name!r}`"]
    assert all(backend.upper() in line for backend in row.runs_on)
    assert all(repr(rule) in line for rule in row.backwards)
    assert (row.opt_in is not None) == ("opt-in" in line), name
  assert "bias: splash adds no bias" in text
  assert "_generated/implementations.md" in (ROOT / "docs" / "implementations.md").read_text()


def test_collect_copies_the_newest_full_runs(tmp_path):
  runs, docs = tmp_path / "runs", tmp_path / "docs"
  runs.mkdir()
  record = '{"timings": [1], "memory": []}'
  for name in ("bench-20260101-000000.json", "bench-20260102-000000.json"):
    (runs / name).write_text(record)
  (runs / "bench-20260103-000000-quick.json").write_text(record)
  copied = docs_tables.collect(runs, docs)
  assert [p.name for p in copied] == ["bench-20260102-000000.json"]


_NAME = re.compile(r"(?<![\w/.])jattn(?:\.[A-Za-z_]\w*)+")


def _resolves(name: str) -> bool:
  """Whether ``name`` (dotted) is a module of jattn, or an attribute reached from one."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
      break
    except ImportError:
      continue
  for part in parts[i:]:
    if not hasattr(obj, part):
      return False
    obj = getattr(obj, part)
  return True


def _written_names() -> dict[str, set[str]]:
  """Every ``jattn.<name>`` written in docs/, README.md and the library's docstrings, with
  where it is written."""
  texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.glob("docs/**/*.md"))]
  texts = [(w, t) for w, t in texts if not w.startswith(("docs/_generated", "docs/_build"))]
  texts.append(("README.md", (ROOT / "README.md").read_text()))
  for path in sorted((ROOT / "jattn").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
        doc = ast.get_docstring(node)
        if doc:
          texts.append((f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')}", doc))
  found: dict[str, set[str]] = {}
  for where, text in texts:
    for match in _NAME.finditer(text):
      found.setdefault(match.group(0).rstrip("."), set()).add(where)
  return found


def test_every_jattn_name_the_docs_write_exists():
  names = _written_names()
  assert len(names) > 100 and "jattn.dot_product_attention" in names
  missing = {name: sorted(where) for name, where in names.items() if not _resolves(name)}
  assert not missing, f"names written in the docs that jattn does not have: {missing}"
  assert not _resolves("jattn.impl._base.CallSpec") and not _resolves("jattn.nope")
