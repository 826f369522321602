"""The scripts under experiments/ keep running (smoke tests; nothing about time is asserted)."""

import contextlib
import importlib.util
import io
import json
import pathlib
import sys

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_bench_quick(tmp_path):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = _load("bench").main(["--quick", "--out-dir", str(tmp_path)])
  rows = record["timings"]
  assert len(rows) == 2 * 2 * 4  # two lengths x (full, causal) x four methods
  assert all(r["fwd_speedup"] == 1.0 and r["fwd_bwd_speedup"] == 1.0
             for r in rows if r["method"] == "jax.nn")
  assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_pct_matmul"] > 0 for r in rows)
  # Each memory case ran in its own process and reported a peak.
  assert [m["method"] for m in record["memory"]] == ["jax.nn", "blockwise"]
  assert all(m["peak_mb"] >= m["peak_mb_before"] > 0 for m in record["memory"])
  assert "| 8 | 48 | True | blockwise |" in out.getvalue()
  saved = list(tmp_path.glob("bench-*-quick.json"))
  assert len(saved) == 1 and json.loads(saved[0].read_text())["timings"] == rows


def test_bench_config_file_is_valid():
  bench = _load("bench")
  cfg = bench.load_config(bench.parse_args(
      ["--config", str(EXPERIMENTS.parent / "configs" / "bench.yaml")]))
  assert cfg.lengths == [128, 1024, 4096] and cfg.memory["lengths"][-1] == 65536


def test_quickstart_runs():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    _load("quickstart").main()
  assert "output all zero True" in out.getvalue()
