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


def test_bench_scaling_quick(tmp_path):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = _load("bench_scaling").main(["--quick", "--out-dir", str(tmp_path)])
  rows = record["rows"]
  assert len(rows) == 2 * 5  # two lengths x five methods, every one timed
  assert all(r["ms"] > 0 and r["mem_mb"] > 0 and r["skipped"] is None for r in rows)
  # XLA's allocations are exact: materialised scores grow as T^2, linear attention as T.
  fits = record["fits"]
  assert 1.8 < fits["jax.nn"]["mem_slope"] < 2.1 and 1.8 < fits["xla"]["mem_slope"] < 2.1
  assert 0.9 < fits["linear"]["mem_slope"] < 1.1
  sparse = {r["pattern"]: r for r in record["sparse"]}
  assert sparse["dense"]["tiles_visited"] == 1.0 and sparse["dense"]["time_vs_dense"] == 1.0
  assert sparse["causal"]["tiles_visited"] == 36 / 64  # 8 x 8 tiles, the lower triangle
  assert "| 256 | linear |" in out.getvalue()
  run = pathlib.Path(record["plot"]).parent
  assert (run / "scaling.png").stat().st_size > 0
  assert json.loads((run / "scaling.json").read_text())["fits"] == fits


def test_bench_scaling_slopes_and_crossover():
  bench = _load("bench_scaling")
  assert abs(bench.slope([(1, 3.0), (2, 12.0), (4, 48.0)]) - 2.0) < 1e-12
  assert bench.slope([(1, 3.0), (2, None)]) is None
  rows = [dict(method=m, T=T, ms=ms) for m, T, ms in [
      ("blockwise", 1024, 10.0), ("linear", 1024, 40.0),
      ("blockwise", 2048, 40.0), ("linear", 2048, 80.0),
      ("blockwise", 4096, 160.0), ("linear", 4096, 160.0 / 4)]]
  cross = bench.crossover(rows)
  # log ratios +log 2 at 2048 and -log 4 at 4096: a third of the way, 2048 * 2^(1/3)
  assert cross["length"] == round(2048 * 2 ** (1 / 3)) and "T=2048 and T=4096" in cross["note"]
  assert bench.crossover(rows[:2])["length"] is None


def test_bench_scaling_config_file_is_valid():
  bench = _load("bench_scaling")
  cfg = bench.load_config(bench.parse_args(
      ["--config", str(EXPERIMENTS.parent / "configs" / "bench_scaling.yaml")]))
  assert cfg.lengths[0] == 128 and cfg.lengths[-1] == 65536 and cfg.methods == list(bench.METHODS)
