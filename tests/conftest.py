"""Test configuration: 8 simulated CPU devices, strict JAX numerics, a reproducible
hypothesis profile, and test files handed out slowest first by their recorded durations
(tests/durations.json; ``pytest -n 2 --record-durations tests`` records them again), and
``--compile-report``: the XLA programs each file and test compiled, and the seconds spent
tracing, lowering and compiling them (most of the suite's time), and the cases of the largest
sweeps that tests/tiers.py leaves to ``-m exhaustive`` marked so."""

import collections
import gc
import importlib.metadata
import json
import math
import os
import pathlib

# Sharding tests (test_parallel.py) run on 8 simulated CPU devices. XLA reads the
# flag when JAX starts its CPU backend, so it is set before anything imports JAX.
# Single-device tests still run on device 0 and are no slower for it.
#
# The tests' arrays are tiny, so their time is XLA compiling hundreds of small programs,
# most of it in LLVM's optimisation passes. Turning those down (the HLO passes, which fuse
# and schedule the program and decide its buffers, still run) cut test_blockwise.py from
# 175 s to 127 s and four numerics-heavy files by a third, every test still passing.
# XLA:CPU's newer MLIR fusion emitters take twice as long to compile as the classic LLVM IR
# emitters (the same HLO fusions, code generated another way), and splitting each program's
# LLVM module for parallel compilation only adds work on a small machine: without either,
# a blockwise forward and backward compiles in half the time.
# Set JATTN_TEST_OPTIMIZE=1 to test the code as users compile it.
# The flags below are set only where the installed XLA knows them: an unknown flag in
# XLA_FLAGS aborts the process (read from jaxlib's version, before JAX starts).
_JAXLIB = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
_TEST_FLAGS = {
  "xla_force_host_platform_device_count": "8",
  **(
    {}
    if os.environ.get("JATTN_TEST_OPTIMIZE") == "1"
    else {
      "xla_backend_optimization_level": "0",
      "xla_llvm_disable_expensive_passes": "true",
      # XLA 0.12 removed the classic emitters and aborts on the flag it no longer knows.
      **({"xla_cpu_use_fusion_emitters": "false"} if _JAXLIB < (0, 12) else {}),
      "xla_cpu_parallel_codegen_split_count": "1",
    }
  ),
}
for _name, _value in _TEST_FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
import tiers  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Tracing allocates millions of short-lived objects, and Python's default collector
# thresholds walk the young generations every 700 allocations: the suite spends 5-10 % of
# its time there. Objects alive after the imports are frozen out of collections, and the
# young generation is collected about 300 times less often (memory still freed by refcounting).
gc.freeze()
gc.set_threshold(200_000, 20, 50)

# Implicit rank promotion hides shape bugs; jattn never relies on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Lowering gives every operation a source location: by default the Python stack of the
# line that traced it, up to 100 frames. The suite lowers about 6,000 programs, and no test
# reads their locations (errors raised while tracing keep their tracebacks). Without full
# tracebacks each operation keeps its one user frame (for debugging; the frame limit,
# jax_traceback_in_locations_limit, applies only to full tracebacks): in alternating runs
# that saved 1-5 % of test_masks.py and test_docs.py.
jax.config.update("jax_include_full_tracebacks_in_locations", False)

settings.register_profile(
  "jattn",
  max_examples=15,
  deadline=None,
  derandomize=True,
  print_blob=True,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("jattn")


@pytest.fixture
def x64():
  """Run a test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield


# pytest-xdist's --dist loadfile hands each worker one test file at a time, in the order of
# the collection; by default it first sorts the files by their number of tests, which sent
# the files with a few long tests (experiments, README examples, a training run) last and
# left one worker running them alone at the end. Files go out slowest first instead, so the
# last files are short and both workers finish together (pyproject.toml passes
# --no-loadscope-reorder to keep this order). Each file's time is its serial seconds (every
# test's setup, call and teardown, summed) recorded in tests/durations.json; files not in it
# go first, their time unknown. After adding or splitting a test file, or moving slow tests,
# record them again with the whole suite on the 2-core machine:
#   .venv/bin/python -m pytest -n 2 --record-durations tests
# which rewrites the entries of the files that ran and keeps the others.
_DURATIONS = pathlib.Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
  parser.addoption(
    "--record-durations",
    action="store_true",
    help="write each test file's seconds to tests/durations.json (orders files slowest first)",
  )
  parser.addoption(
    "--compile-report",
    action="store_true",
    help="after the run, the XLA programs each test file and test compiled and the seconds "
    "spent tracing, lowering and compiling them",
  )


class _RecordDurations:
  """Sums each file's test durations (xdist forwards the workers' reports) and writes them."""

  def __init__(self):
    self.seconds = collections.defaultdict(float)

  def pytest_runtest_logreport(self, report):
    self.seconds[pathlib.Path(report.nodeid.split("::")[0]).name] += report.duration

  def pytest_sessionfinish(self, session):
    recorded = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
    recorded.update({name: round(s, 1) for name, s in self.seconds.items()})
    _DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=2) + "\n")


# The suite's time is mostly JAX tracing, lowering and compiling thousands of programs, not
# running them. --compile-report counts them per test: each process (an xdist worker, or the
# one process with -n 0) listens to jax.monitoring's compile events and attaches what each
# test phase compiled to its report, which xdist forwards; the main process sums and prints.
_STAGES = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}


class _CountCompiles:
  """In each test process: the programs compiled (backend compiles) and the seconds of each
  stage since the last test phase, attached to that phase's report."""

  def __init__(self):
    self.now = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self.listen)

  def listen(self, event, duration, **kwargs):
    if stage := _STAGES.get(event):
      self.now[stage] += duration
      self.now["programs"] += stage == "compile"

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_makereport(self, item, call):
    report = (yield).get_result()
    report.user_properties.append(("jattn_compiles", dict(self.now)))
    self.now.clear()


class _CompileReport:
  """In the main process: sums the compile counts by test file and test, and prints them."""

  def __init__(self):
    self.files = collections.defaultdict(collections.Counter)
    self.tests = collections.defaultdict(collections.Counter)

  def pytest_runtest_logreport(self, report):
    for name, counts in report.user_properties:
      if name == "jattn_compiles":
        self.files[report.nodeid.split("::")[0]].update(counts)
        self.tests[report.nodeid].update(counts)

  def pytest_terminal_summary(self, terminalreporter):
    write = terminalreporter.write_line
    total = sum(self.files.values(), collections.Counter())
    columns = ("programs", "trace", "lower", "compile")
    row = lambda c: f"{c['programs']:7.0f} " + " ".join(f"{c[k]:7.1f}" for k in columns[1:])  # noqa: E731
    terminalreporter.section("XLA programs compiled (seconds of each stage, all processes)")
    write(f"{'programs':>7} {'trace':>7} {'lower':>7} {'compile':>7}")
    write(f"{row(total)}  all tests")
    for title, table in (("test files", self.files), ("tests", self.tests)):
      write(f"-- the 15 {title} that spent longest")
      ranked = sorted(table.items(), key=lambda kv: -sum(kv[1][k] for k in columns[1:]))
      for name, counts in ranked[:15]:
        write(f"{row(counts)}  {name}")


class _ExhaustiveCount:
  """How many exhaustive cases -m left out, counted where the tests are collected (each xdist
  worker collects all of them) and said once at the end: with xdist pytest's own summary has
  no "deselected"."""

  def __init__(self):
    self.left_out = 0

  def pytest_deselected(self, items):
    self.left_out += sum(1 for item in items if item.get_closest_marker("exhaustive"))

  def pytest_collection_finish(self, session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: sent to the main process
      session.config.workeroutput["jattn_exhaustive"] = self.left_out

  @pytest.hookimpl(optionalhook=True)
  def pytest_testnodedown(self, node, error):
    self.left_out = max(self.left_out, getattr(node, "workeroutput", {}).get("jattn_exhaustive", 0))

  @pytest.hookimpl(trylast=True)  # after the durations, above pytest's last line
  def pytest_terminal_summary(self, terminalreporter):
    if self.left_out:
      terminalreporter.write_line(
        f"{self.left_out} cases of the sweeps in tests/tiers.py are the exhaustive tier, not run "
        "here: pytest -m exhaustive runs them"
      )


def pytest_configure(config):
  config.pluginmanager.register(_ExhaustiveCount(), "jattn-exhaustive-count")
  if config.getoption("record_durations") and not hasattr(config, "workerinput"):
    config.pluginmanager.register(_RecordDurations(), "jattn-record-durations")
  if config.getoption("compile_report"):
    if config.getoption("numprocesses", None) in (None, 0) or hasattr(config, "workerinput"):
      config.pluginmanager.register(_CountCompiles(), "jattn-count-compiles")
    if not hasattr(config, "workerinput"):
      config.pluginmanager.register(_CompileReport(), "jattn-compile-report")


@pytest.hookimpl(tryfirst=True)  # marks the exhaustive cases before -m deselects them
def pytest_collection_modifyitems(config, items):
  _mark_exhaustive(config, items)
  seconds = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
  # Slowest first, unknown files before all; the sort is stable, so each file's order is kept.
  items.sort(key=lambda item: -seconds.get(item.path.name, math.inf))


def _mark_exhaustive(config, items):
  """Marks ``exhaustive`` the cases of tests/tiers.py's sweeps that it does not keep for the
  default run (pyproject.toml's ``-m "not exhaustive"`` deselects them). A sweep named on the
  command line (``file::test`` or ``file::test[case]``) runs as named."""
  named = set()
  for arg in config.args:
    path, _, rest = arg.partition("::")
    if rest:
      named.add(f"{pathlib.Path(path).name}::{rest.split('[')[0]}")
  collected = collections.defaultdict(list)
  for item in items:
    sweep = f"{item.path.name}::{item.originalname}"
    if sweep in tiers.DEFAULT and sweep not in named and hasattr(item, "callspec"):
      collected[sweep].append(item)
  for sweep, cases in collected.items():
    kept = tiers.DEFAULT[sweep]
    ids = {item.callspec.id for item in cases}
    if not ids >= set(kept):
      raise pytest.UsageError(
        f"tests/tiers.py keeps cases {sorted(set(kept) - ids)} that {sweep} no longer has"
      )
    for item in cases:
      if item.callspec.id not in kept:
        item.add_marker(pytest.mark.exhaustive)
