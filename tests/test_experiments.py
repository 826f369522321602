"""The scripts under experiments/ keep running (smoke tests; nothing about time is asserted)."""

import contextlib
import importlib.util
import io
import pathlib

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_xla_quick():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rows = _load("bench_xla").main(["--quick"])
  assert len(rows) == 6  # one length x (full, causal) x three implementations
  assert all(r[5] == 1.0 and r[6] == 1.0 for r in rows if r[2] == "jax.nn")
  assert "| 32 | True | jattn custom_vjp |" in out.getvalue()


def test_quickstart_runs():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    _load("quickstart").main()
  assert "output all zero True" in out.getvalue()
