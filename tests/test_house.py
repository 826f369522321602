"""The house rules of docs/layout.md, read from the source: imports flow one way through
jattn (no circle, counting every import: inside functions and under TYPE_CHECKING too), the
top level holds the public modules and at most three private ones, an underscore module or
name is used only inside its own package, the library imports only
its runtime dependencies, no test file imports another, and every public module says what it
exports in ``__all__``."""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "jattn").rglob("*.py"))
TESTS = sorted((ROOT / "tests").glob("test_*.py"))


def test_the_globs_find_the_code():
  assert len(LIBRARY) > 50 and len(TESTS) > 30


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """module -> the jattn modules it imports (``from jattn.x import y`` names the module
  jattn.x.y when that is a module, else jattn.x), read from every import statement."""
  graph: dict[str, set[str]] = {}
  for name, path in files.items():
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        found = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
      else:
        continue
      for target in found:
        while target and target not in files:
          target = target.rpartition(".")[0]
        if target and target != name:
          targets.add(target)
    graph[name] = targets
  return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  circles = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 10 * len(graph)))
  try:
    for v in graph:
      if v not in index:
        visit(v)
  finally:
    sys.setrecursionlimit(limit)
  return circles


def test_imports_flow_one_way_through_the_library():
  files = {_module_name(p): p for p in LIBRARY}
  graph = _import_graph(files)
  circles = _circles(graph)
  detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in circles]
  assert not circles, f"import circles (module -> what it imports within the circle): {detail}"
  # What the check catches: a circle made of two modules that import each other.
  assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
  base = {"jattn.masks", "jattn.scores", "jattn._compat"}
  assert graph["jattn.impl.contract"] <= base, graph["jattn.impl.contract"]
  assert graph["jattn._compat"] == set(), graph["jattn._compat"]
  # Each implementation's row checks its own options and tiles: Options asks the table.
  from jattn.impl import select

  rows = {f"jattn.impl.{name}" for name in select.TABLE}
  assert rows <= set(graph) and not graph["jattn._validate.options"] & rows


def _private_crossings(sources: dict[str, tuple[str, bool]]) -> list[str]:
  """``importer -> name`` for every import of an underscore module or name of another
  package, and every ``module._name`` read through an imported module of another package.

  ``sources`` maps a dotted module name to (its source, whether it is a package's
  ``__init__``). A name ``_x`` belongs to the package that holds it: ``a.b._x`` (a module,
  or a name in ``a.b``'s ``__init__``) is ``a.b``'s, ``_y`` in the module ``a.b.m`` is
  ``a.b``'s too; any module inside that package (its subpackages included) may use it. So
  the private modules at the top of ``jattn/`` serve the whole library, and their own
  underscore parts only themselves."""

  def package_of(module: str) -> str:
    return module if sources[module][1] else module.rpartition(".")[0]

  def owner(dotted: str) -> str | None:
    parts = dotted.split(".")
    for i, part in enumerate(parts):
      if part.startswith("_") and not part.startswith("__"):
        held = ".".join(parts[:i])
        return package_of(held) if held in sources else held
    return None

  roots = {name.split(".")[0] for name in sources}
  found = []
  for name, (text, is_package) in sources.items():
    here = name if is_package else name.rpartition(".")[0]
    inside = lambda pkg: here == pkg or here.startswith(pkg + ".")
    aliases: dict[str, str] = {}  # local name -> the jattn module it names
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Import):
        targets = [(a.name, a.asname) for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = here.split(".")
          base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        targets = [(f"{base}.{a.name}", a.asname or a.name) for a in node.names]
      elif (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
      ):
        module = aliases[node.value.id]
        if not inside(package_of(module)):
          found.append(f"{name} -> {module}.{node.attr}")
        continue
      else:
        continue
      for target, alias in targets:
        if target.split(".")[0] not in roots:
          continue
        if target in sources and alias:
          aliases[alias] = target
        held = owner(target)
        if held is not None and not inside(held):
          found.append(f"{name} -> {target}")
  return sorted(set(found))


def test_underscore_names_stay_in_their_package():
  sources = {
    _module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in LIBRARY
  }
  crossings = _private_crossings(sources)
  assert not crossings, (
    "underscore modules and names used outside their package (name it as the package's "
    f"contract, without an underscore, or keep it home): {crossings}"
  )
  # What the check catches, and what it lets through.
  fake = {
    "j": ("", True),
    "j._shared": ("", False),
    "j.a": ("", True),
    "j.a._x": ("def _h(): ...\ndef ok(): ...", False),
    "j.a.sub": ("from j.a import _x\nfrom j import _shared", False),
    "j.b": ("", True),
    "j.b.m": (
      "from j.a import _x\nfrom j.a._x import ok\nfrom j.a import sub\nsub._y()\n"
      "from j import _shared\nfrom j.a.sub import _z",
      False,
    ),
  }
  assert _private_crossings(fake) == [
    "j.b.m -> j.a._x",
    "j.b.m -> j.a._x.ok",
    "j.b.m -> j.a.sub._y",
    "j.b.m -> j.a.sub._z",
  ]


def test_the_calls_keywords_are_listed_once():
  """jattn._validate.keywords lists the call's keywords once. dot_product_attention spells
  out jax.nn's signature for help() and IDEs: its keywords are the list's, with its defaults;
  every other front end takes groups of the list as ``**keywords`` and refuses any other name
  as Python refuses an unexpected keyword argument."""
  import inspect

  import jax.numpy as jnp

  import jattn
  import jattn.linen
  import jattn.nnx
  from jattn import decode, parallel
  from jattn._validate import keywords as kw

  params = inspect.signature(jattn.dot_product_attention).parameters
  only = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
  assert set(only) == set(kw.names(kw.Keywords))
  assert only == {n: kw.DEFAULTS.get(n) for n in only}  # type: ignore[misc]
  groups = (kw.Scoring, kw.Masking, kw.Dropout, kw.Outputs, kw.Routing)
  listed = [n for g in groups for n in kw.names(g)]
  assert len(listed) == len(set(listed)) and set(listed) == set(only)  # each name in one group

  q = jnp.ones((1, 4, 2, 8))
  mesh = jax.make_mesh((1,), ("sp",))
  front_ends = {
    "attention_weights": (jattn.attention_weights, (q, q), "Weights"),
    "explain": (jattn.explain, (q, q, q), "Keywords"),
    "attention": (decode.attention, (q, q, q, decode.init(1, 8, 2, 8)), "Decoding"),
    "ragged_attention": (
      decode.ragged_attention,
      (q[0], q[0], q[0], decode.init(1, 8, 2, 8), jnp.array([0, 4])),
      "Decoding",
    ),
    "context_parallel_attention": (
      functools.partial(parallel.context_parallel_attention, mesh=mesh, axis_name="sp"),
      (q, q, q),
      "Keywords",
    ),
    "ring_attention": (
      functools.partial(parallel.ring_attention, mesh=mesh, axis_name="sp"),
      (q, q, q),
      "Keywords",
    ),
    "attention_fn": (jattn.nnx.attention_fn, (q, q, q), "Adapted"),
  }
  for who, (fn, arrays, group) in front_ends.items():
    target = fn.func if isinstance(fn, functools.partial) else fn
    var = [p for p in inspect.signature(target).parameters.values() if p.kind is p.VAR_KEYWORD]
    assert [str(p.annotation) for p in var] == [f"Unpack[{group}]"], who
    with pytest.raises(TypeError, match=rf"^{who}\(\) got an unexpected keyword argument 'nope'$"):
      fn(*arrays, nope=1)
  assert jattn.linen.attention_fn(q, q, q, sinks=None).shape == q.shape


def _long_functions(text: str, limit: int) -> list[tuple[str, int]]:
  """(name, lines) of every function (nested ones too) whose body, its docstring aside,
  spans more than ``limit`` lines."""
  found = []
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      body = node.body
      if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
      if body and (n := body[-1].end_lineno - body[0].lineno + 1) > limit:
        found.append((node.name, n))
  return found


def test_few_functions_are_long():
  """At most 8 functions of the library have bodies over 80 lines (the Pallas kernels,
  whose bodies are one program each); the rest are split where a reader gains."""
  long = {
    f"{p.relative_to(ROOT)}:{name}": n
    for p in LIBRARY
    for name, n in _long_functions(p.read_text(encoding="utf-8"), 80)
  }
  assert len(long) <= 8, f"{len(long)} functions with bodies over 80 lines: {long}"
  text = 'def f():\n  "doc"\n' + "  x = 1\n" * 81 + "def g():\n  return 1\n"
  assert _long_functions(text, 80) == [("f", 81)]


def test_every_pytree_class_is_registered_so_its_treedef_names_its_class():
  # jax.tree_util.register_dataclass makes treedefs whose equality ignores the class (two mask
  # kinds with equal settings compare equal, and jit's cache may run one's program for the
  # other): jattn registers its pytree classes through _compat.register_dataclass only.
  found = {}
  for path in LIBRARY:
    if path.name == "_compat.py":
      continue
    pattern = r"tree_util\.register_\w+|tree_util import[^\n]*register_\w+"
    calls = re.findall(pattern, path.read_text())
    if calls:
      found[str(path.relative_to(ROOT))] = calls
  assert not found, f"register pytree classes with jattn._compat.register_dataclass: {found}"
  from jattn import _compat

  @_compat.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class One:
    x: int
    n: int = dataclasses.field(default=1, metadata={"static": True})

  @_compat.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class Other:
    y: int
    n: int = dataclasses.field(default=1, metadata={"static": True})

  one, other = jax.tree_util.tree_structure(One(0)), jax.tree_util.tree_structure(Other(0))
  assert one != other and one == jax.tree_util.tree_structure(One(5))
  assert one != jax.tree_util.tree_structure(One(0, n=2))
  paths, _ = jax.tree_util.tree_flatten_with_path(One(3, n=4))
  assert paths == [((jax.tree_util.GetAttrKey("x"),), 3)]
  assert jax.tree_util.tree_unflatten(one, [7]) == One(7)


def test_the_top_level_holds_public_modules_and_at_most_three_private_ones():
  top = ROOT / "jattn"
  private = sorted(
    p.name
    for p in top.iterdir()
    if p.name.startswith("_") and p.name != "__init__.py"
    if p.suffix == ".py" or (p / "__init__.py").exists()
  )
  assert len(private) <= 3, f"private modules at the top of jattn/: {private}"


def _listed_modules() -> set[str]:
  """The files of jattn/ that docs/layout.md's library listing names: a line starting
  ``jattn/...`` names a file, or opens a folder whose indented lines name its files."""
  text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
  block = text.split("## The library", 1)[1].split("```text", 1)[1].split("```", 1)[0]
  listed: set[str] = set()
  folders: list[tuple[int, str]] = []  # (indent, path) of the open folders
  for line in block.splitlines():
    name = line.split()[0] if line.strip() else ""
    indent = len(line) - len(line.lstrip())
    if not (name.endswith(".py") or name.endswith("/")) or name == "...":
      continue
    while folders and folders[-1][0] >= indent:
      folders.pop()
    path = name if indent == 0 else folders[-1][1] + name
    if name.endswith("/"):
      folders.append((indent, path))
    else:
      listed.add(path)
  return listed


def test_the_layout_page_lists_every_module_of_the_library():
  listed = _listed_modules()
  actual = {str(p.relative_to(ROOT)) for p in LIBRARY}
  assert listed == actual, (
    f"docs/layout.md names modules that do not exist: {sorted(listed - actual)}; "
    f"and does not name: {sorted(actual - listed)}"
  )


def _public_modules() -> list[str]:
  """Every module of jattn whose dotted name has no part starting with an underscore."""
  names = (_module_name(p) for p in LIBRARY)
  return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


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


@pytest.mark.parametrize("module", sorted(set(_documented_modules()) | set(_public_modules())))
def test_public_modules_set_all_in_their_code(module):
  parts = module.split(".")
  path = ROOT.joinpath(*parts).with_suffix(".py")
  if not path.exists():
    path = ROOT.joinpath(*parts, "__init__.py")
  tree = ast.parse(path.read_text(encoding="utf-8"))
  assigned = [
    node
    for node in tree.body
    if isinstance(node, ast.Assign | ast.AnnAssign)
    and any(
      getattr(t, "id", None) == "__all__"
      for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    )
  ]
  assert assigned, f"{module} sets no __all__"
  names = ast.literal_eval(assigned[0].value)
  defined = {
    getattr(n, "name", None) or getattr(t, "id", None)
    for n in tree.body
    for target in (getattr(n, "targets", None) or [getattr(n, "target", None)])
    for t in (target.elts if isinstance(target, ast.Tuple) else [target])  # a, b = ...
  }
  defined |= {
    a.asname or a.name
    for n in tree.body
    if isinstance(n, ast.ImportFrom | ast.Import)
    for a in n.names
  }
  missing = [name for name in names if name not in defined]
  assert not missing, f"{module}.__all__ names what it does not define: {missing}"
