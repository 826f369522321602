"""The scripts under experiments/ keep running (smoke tests; nothing about time is asserted)."""

import contextlib
import importlib
import io
import json
import math
import pathlib
import time

import jax
import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _load(name):
  """``experiments.<name>``, imported as ``python -m experiments.<name>`` runs it: the tests
  share one module, and the programs it has compiled."""
  return importlib.import_module(f"experiments.{name}")


# Exhaustive, beside the studies' smoke tests: the whole --quick run, its memory cases each in a
# process of its own (test_bench_names_torch_rows_it_cannot_time runs bench.main by default).
@pytest.mark.exhaustive
def test_bench_quick(tmp_path):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = _load("bench").main(["--quick", "--out-dir", str(tmp_path)])
  rows = record["timings"]
  assert len(rows) == 2 * 4  # (full, causal) x four methods
  assert all(
    r["fwd_speedup"] == 1.0 and r["fwd_bwd_speedup"] == 1.0 for r in rows if r["method"] == "jax.nn"
  )
  assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_pct_matmul"] > 0 for r in rows)
  # Each memory case ran in its own process and reported a peak.
  assert [m["method"] for m in record["memory"]] == ["jax.nn", "blockwise"]
  assert all(m["peak_mb"] >= m["peak_mb_before"] > 0 for m in record["memory"])
  assert "| float32 | 8 | 32 | True | blockwise |" in out.getvalue()
  saved = list(tmp_path.glob("bench-*-quick.json"))
  assert len(saved) == 1 and json.loads(saved[0].read_text())["timings"] == rows
  # On an accelerator (not with --quick) it points at bench_gpu.py; on a CPU it says nothing.
  bench = _load("bench")
  assert "python -m experiments.bench_gpu" in bench.accelerator_note("gpu", quick=False)
  assert bench.accelerator_note("tpu", quick=True) is None
  assert bench.accelerator_note("cpu", quick=False) is None


def test_bench_names_torch_rows_it_cannot_time(tmp_path, monkeypatch):
  """torch is an optional extra: without it the torch rows say how to install it."""
  bench = _load("bench")
  monkeypatch.setattr(bench, "torch_or_none", lambda: None)
  with contextlib.redirect_stdout(io.StringIO()):
    record = bench.main(
      ["--quick", "--lengths", "32", "--causal", "true", "--methods", "jax.nn", "torch"]
      + ["--memory-lengths", "--out-dir", str(tmp_path)]
    )
  jnn, torch = record["timings"]
  assert torch["method"] == "torch" and torch["fwd_ms"] is None and "[bench]" in torch["note"]
  assert jnn["fwd_ms"] > 0 and jnn["fwd_vs_torch"] is None and jnn["dtype"] == "float32"


def test_bench_config_file_is_valid():
  bench = _load("bench")
  cfg = bench.load_config(
    bench.parse_args(["--config", str(EXPERIMENTS.parent / "configs" / "bench.yaml")])
  )
  assert cfg.lengths == [128, 1024, 4096] and cfg.memory["lengths"][-1] == 65536


def test_bench_configs_name_bad_keys_and_values(tmp_path):
  """The benchmarks' configs go through experiments/_config.py like the training config:
  unknown keys (in sections too), choices and cross-field rules stop the CLI naming the key;
  quick settings merge into sections, dotted flags reach into them."""
  bench, scaling, parallel = (_load(n) for n in ("bench", "bench_scaling", "bench_parallel"))
  path = tmp_path / "bad.yaml"
  for text, match in [
    ("lenghts: [64]\n", r"bench: error: unknown key 'lenghts'; valid keys of the config: batch"),
    ("memory: {method: [xla]}\n", r"unknown key 'memory.method'; valid keys of memory: lengths"),
    ("reps: 0\n", r"'reps' must be >= 1, got 0"),
    ("heads: 3\nkv_heads: 2\n", r"'heads' \(3\) must be a multiple of 'kv_heads' \(2\)"),
  ]:
    path.write_text(text)
    with pytest.raises(SystemExit, match=match):
      bench.main(["--config", str(path)])
  with pytest.raises(SystemExit, match=r"'methods' must be one of \['jax.nn', 'xla', 'blockwise'"):
    bench.main(["--methods", "flash"])
  cfg = bench.load_config(
    bench.parse_args(["--quick", "--memory-lengths", "128", "--causal", "false"])
  )
  assert cfg.memory.lengths == [128] and cfg.memory.methods == ["jax.nn", "blockwise"]
  assert cfg.causal == [False] and cfg.heads == bench.QUICK["heads"]
  assert bench._config.from_dict(bench.Config, bench._config.to_dict(cfg)) == cfg  # the child's
  with pytest.raises(SystemExit, match=r"bench_scaling: error: 'lengths' must be increasing"):
    scaling.main(["--lengths", "64", "32"])
  path.write_text("sparse: {patterns: [dense, diagonal]}\n")
  with pytest.raises(SystemExit, match=r"'sparse.patterns' must be one of \['dense', 'causal'"):
    scaling.main(["--config", str(path)])
  assert scaling.load_config(scaling.parse_args(["--quick", "--no-sparse"])).sparse.patterns == []
  with pytest.raises(SystemExit, match=r"'length' \(100\) must split into 8 equal parts for P=4"):
    parallel.main(["--length", "100"])


# A study's smoke test, as those below; the decode paths it times are tested by default in
# test_decode, test_paged and the Flax cache files.
@pytest.mark.exhaustive
def test_bench_decode_quick(tmp_path):
  """Every method times a step of the one (B, context) cell; bytes per token follow from the
  shapes; quantized pages err by about their rounding; the serving loop generates every
  requested token, reuses released pages, ends with an empty pool and traces each call once;
  the record renders as the docs' tables."""
  bench = _load("bench_decode")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = bench.main(["--quick", "--out-dir", str(tmp_path)])
  assert [(r["B"], r["context"], r["method"]) for r in record["steps"]] == [
    (2, 40, m) for m in bench.METHODS
  ]
  for r in record["steps"]:
    assert r["ms"] > 0 and math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    assert math.isfinite(r["vs_jax_nn"]) and r["vs_jax_nn"] > 0
  rows = {r["method"]: r for r in record["steps"]}
  assert rows["jax.nn"]["vs_jax_nn"] == 1.0
  # K=2, H=16: 2 * 2 * 16 float32 = 256 bytes a token; int8 80 with its four float32 scales.
  assert [rows[m]["storage_bytes_per_token"] for m in bench.METHODS] == [256, 256, 256, 80]
  # Contiguous caches reserve 40 + 16 slots for 40 tokens; paged ones hold 3 pages of 16
  # (41 tokens after the step's write) a row.
  assert rows["contiguous"]["bytes_per_token"] == rows["jax.nn"]["bytes_per_token"] == 256 * 56 / 40
  assert rows["paged"]["pages_in_use"] == rows["paged-int8"]["pages_in_use"] == 2 * 3
  assert rows["paged"]["bytes_per_token"] == 256 * 48 / 40
  assert rows["paged-int8"]["bytes_per_token"] == 80 * 48 / 40
  errors = {q["method"]: q for q in record["quant"]}
  assert list(errors) == ["paged", "paged-int8", "paged-float8"]
  assert errors["paged"]["rel_rms_error"] < 1e-5
  assert 0 < errors["paged-int8"]["rel_rms_error"] < errors["paged-float8"]["rel_rms_error"] < 0.1
  s = record["serve"]
  prompts, outputs = bench.requests(bench.load_config(bench.parse_args(["--quick"])).serve)
  assert s["generated_tokens"] == outputs.sum() and s["prompt_tokens"] == prompts.sum()
  assert s["generated_per_s"] > 0 and s["seconds"] > 0
  assert 0 < s["peak_pages"] <= s["pool_pages"] == 6 and s["free_pages_at_end"] == 6
  assert s["lengths_at_end"] == [0, 0, 0] and 0 < s["pages_reused"] < s["page_allocations"]
  assert s["traces"] == {"t=16": 1, "t=1": 1}
  assert s["contiguous_mb"] > s["pool_mb"]
  # The ragged step: 5 requests, 2 with chunks of 12 and 3 decoding: 27 tokens, padded to
  # (5, 12); query tiles of 4: at most ceil(27 / 4) + 5 = 12 of them, 48 query rows.
  r = record["ragged"]
  assert (r["batch"], r["tokens"], r["padded_to"]) == (5, 27, 12)
  steps = {x["method"]: x for x in r["rows"]}
  assert steps["padded"]["query_rows"] == 60 and steps["ragged"]["query_rows"] == 48
  assert steps["padded"]["vs_padded"] == 1.0 and steps["ragged"]["vs_padded"] > 0
  assert r["max_abs_diff"] < 1e-5  # the two steps give the same outputs
  assert steps["ragged"]["cache_read_mb"] > steps["padded"]["cache_read_mb"] > r["needed_mb"]
  text = out.getvalue()
  assert "paged-int8" in text and "peak pages in use / pool" in text
  assert "One continuous-batching step" in text
  saved = list(tmp_path.glob("bench_decode-*-quick.json"))
  assert len(saved) == 1 and json.loads(saved[0].read_text()) == record
  # --collect copies a full run's record (not a -quick one) into docs/bench/, and the docs'
  # renderer makes its tables.
  from experiments import docs_tables

  assert docs_tables.collect(tmp_path, tmp_path / "docs") == []
  saved[0].rename(tmp_path / "bench_decode-20260101-000000.json")
  copied = docs_tables.collect(tmp_path, tmp_path / "docs")
  assert [p.relative_to(tmp_path).as_posix() for p in copied] == [
    "docs/bench/bench_decode-20260101-000000.json"
  ]
  table = docs_tables.decode(tmp_path / "docs")
  assert "| 2 | 40 | paged-int8 |" in table and "| peak pages in use / pool | " in table
  assert "| ragged | " in table and "query tiles of 4" in table


def test_bench_decode_config(tmp_path):
  bench = _load("bench_decode")
  cfg = bench.load_config(
    bench.parse_args(["--config", str(EXPERIMENTS.parent / "configs" / "bench_decode.yaml")])
  )
  assert cfg == bench.Config()  # the file spells out the defaults
  assert cfg.batches == [1, 16] and cfg.contexts == [1024, 8192, 32768]
  assert (cfg.heads, cfg.kv_heads, cfg.head_dim) == (8, 2, 128)
  path = tmp_path / "bad.yaml"
  for text, match in [
    ("serve: {prompts: [1, 2]}\n", r"unknown key 'serve.prompts'; valid keys of serve: batch"),
    ("serve: {prompt: [9, 3]}\n", r"'serve.prompt' must be \[min, max\] with min <= max"),
    ("serve: {max_length: 100}\n", r"'serve.max_length' \(100\) must hold the longest request"),
    ("quant: {dtypes: [int4]}\n", r"'quant.dtypes' must be one of \['int8', 'float8_e4m3fn'\]"),
    ("heads: 3\n", r"'heads' \(3\) must be a multiple of 'kv_heads' \(2\)"),
    ("ragged: {context: [9, 3]}\n", r"'ragged.context' must be \[low, high\]"),
    ("ragged: {prefilling: 99}\n", r"'ragged.prefilling' \(99\) must be at most"),
  ]:
    path.write_text(text)
    with pytest.raises(SystemExit, match=r"bench_decode: error: " + match):
      bench.main(["--config", str(path)])
  with pytest.raises(SystemExit, match=r"'methods' must be one of \['jax.nn', 'contiguous'"):
    bench.main(["--methods", "flash"])
  with pytest.raises(SystemExit, match=r"'serve.pool_fraction' must be > 0"):
    bench.main(["--set", "serve.pool_fraction=0"])
  cfg = bench.load_config(bench.parse_args(["--quick", "--contexts", "--requests", "0"]))
  assert cfg.contexts == [] and cfg.serve.requests == 0 and cfg.serve.batch == 3


@pytest.mark.exhaustive  # the tour calls the public API that every other file tests
def test_quickstart_runs():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    _load("quickstart").main()
  assert "output all zero True" in out.getvalue()


# Exhaustive, as the other studies' smoke tests: the default run smoke-tests bench.py, the
# benchmark against jax.nn (each study compiles its own programs).
@pytest.mark.exhaustive
def test_bench_scaling_quick(tmp_path):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = _load("bench_scaling").main(["--quick", "--out-dir", str(tmp_path)])
  rows = record["rows"]
  assert len(rows) == 2 * 5  # two lengths x five methods, every one timed
  assert all(r["ms"] > 0 and r["mem_mb"] > 0 and r["skipped"] is None for r in rows)
  assert all(r["calls"] >= 1 for r in rows)  # the quick run's reps=1
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
  rows = [
    dict(method=m, T=T, ms=ms)
    for m, T, ms in [
      ("blockwise", 1024, 10.0),
      ("linear", 1024, 40.0),
      ("blockwise", 2048, 40.0),
      ("linear", 2048, 80.0),
      ("blockwise", 4096, 160.0),
      ("linear", 4096, 160.0 / 4),
    ]
  ]
  cross = bench.crossover(rows)
  # log ratios +log 2 at 2048 and -log 4 at 4096: a third of the way, 2048 * 2^(1/3)
  assert cross["length"] == round(2048 * 2 ** (1 / 3)) and "T=2048 and T=4096" in cross["note"]
  assert bench.crossover(rows[:2])["length"] is None


def test_bench_scaling_times_blocks_and_slow_calls_once():
  """ms is a block median from _timing.block_ms: at least reps calls after the warm-up and
  untimed calls, or the one timed call after the warm-up when a call is slower than
  once_seconds."""
  bench = _load("bench_scaling")
  calls = []
  fn = lambda: calls.append(time.sleep(0.01))
  ms, timed = bench.call_ms(fn, (), bench.Config(reps=4, min_seconds=0.0))
  assert timed == 4 and len(calls) == 1 + 1 + 1 + 4 and ms >= 10
  calls.clear()
  ms, timed = bench.call_ms(fn, (), bench.Config(once_seconds=0.001))
  assert timed == 1 and len(calls) == 2 and ms >= 10


def test_bench_scaling_config_file_is_valid():
  bench = _load("bench_scaling")
  cfg = bench.load_config(
    bench.parse_args(["--config", str(EXPERIMENTS.parent / "configs" / "bench_scaling.yaml")])
  )
  assert cfg.lengths[0] == 128 and cfg.lengths[-1] == 65536 and cfg.methods == list(bench.METHODS)


@pytest.mark.exhaustive  # a study's smoke test, as above
def test_bench_parallel_quick(tmp_path):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    record = _load("bench_parallel").main(["--quick", "--out-dir", str(tmp_path)])
  rows = record["rows"]
  assert [r["P"] for r in rows] == [1, 2, 4]
  assert all(r["layout"] == "contiguous" and r["ms"] > 0 and r["mb"] > 0 for r in rows)
  # Per-device memory falls as the sequence is split over more devices.
  mb = {r["P"]: r["mb"] for r in rows}
  assert mb[4] < mb[2] < mb[1] and rows[0]["mb_x_P_vs_P1"] == 1.0
  assert record["reference"]["ms"] > 0 and record["reference"]["mb"] > 0
  layouts = {r["layout"]: r for r in record["layouts"]}
  assert list(layouts) == ["contiguous", "zigzag", "striped"]
  assert all(r["P"] == 4 and r["ms"] > 0 for r in layouts.values())
  assert layouts["contiguous"]["time_vs_contiguous"] == 1.0
  balance = {w["layout"]: w for w in record["balance"]}
  assert balance["zigzag"]["pairs_max_over_mean"] == 1.0
  assert balance["contiguous"]["pairs_max_over_mean"] > 1.5
  assert "| 4 |" in out.getvalue() and "| zigzag | 1.000 | 1.000 |" in out.getvalue()
  saved = list(tmp_path.glob("parallel-*-quick/parallel.json"))
  assert len(saved) == 1 and str(saved[0]) == record["path"]
  assert json.loads(saved[0].read_text())["rows"] == rows
  # The compile-only memory table: one-device references, then the ring at every P.
  memory = record["memory"]
  assert [(m["method"], m["P"]) for m in memory] == [
    ("jax.nn", 1),
    ("blockwise", 1),
    ("ring", 1),
    ("ring", 2),
    ("ring", 4),
  ]
  ring = {m["P"]: m["mb"] for m in memory if m["method"] == "ring"}
  assert ring[4] < ring[2] < ring[1] and memory[-1]["vs_half_P"] == ring[4] / ring[2]
  # The strategies: what each sends, and what of it can overlap a whole step (the ring's).
  strategies = {s["strategy"]: s for s in record["strategies"]}
  assert set(strategies) == {"ring", "all_gather", "ulysses", "usp"}
  assert 0 < strategies["ring"]["overlap_mb"] < strategies["ring"]["sent_total_mb"]
  assert strategies["all_gather"]["overlap_mb"] == strategies["ulysses"]["overlap_mb"] == 0
  # USP over (2, 2): all-to-alls within each pair, its ring's hops across them (a ring of
  # two steps has no loop left in the program to overlap: tests/test_context_parallel.py
  # checks the overlap on a ring of four).
  usp = strategies["usp"]
  assert usp["mesh"] == {"sp": 2, "uly": 2}
  assert usp["sent_mb"]["all-to-all"] > 0 and usp["sent_mb"]["collective-permute"] > 0
  assert "| documents | usp 2×2 | zigzag |" in out.getvalue()


def test_bench_parallel_work_balance():
  bench = _load("bench_parallel")
  T, P, block = 64, 4, 4
  L = T // P
  work = {
    layout: bench.work_per_device(layout, T, P, block, block) for layout in bench.parallel.LAYOUTS
  }
  for layout, w in work.items():
    # Device i's exact causal work: each of its query rows at position p sees p + 1 keys.
    pos = bench.parallel.positions(layout, T, P).reshape(P, L)
    assert w.pairs.tolist() == (pos + 1).sum(axis=1).tolist(), layout
    assert w.pairs.sum() == T * (T + 1) // 2
  contiguous, zigzag, striped = work["contiguous"], work["zigzag"], work["striped"]
  assert zigzag.pairs.min() == zigzag.pairs.max()
  assert striped.pairs.max() / striped.pairs.mean() < 1.05
  expected = [sum(p + 1 for p in range(i * L, (i + 1) * L)) for i in range(P)]  # 136 ... 904
  ratio = contiguous.pairs.max() / contiguous.pairs.mean()
  assert ratio == max(expected) / (sum(expected) / P)
  # 904 / 520 = 1.738: near the T/P >> 1 limit (2P - 1) / P = 1.75. In whole shards (ring
  # steps with any work: 4 on the last device, 2.5 on average) it would be 2P / (P + 1) = 1.6.
  assert abs(ratio - (2 * P - 1) / P) < 0.02
  # Tiles of 4: device i sees i whole shards (16 tiles each) and the triangle of its own
  # (10 tiles); zig-zag's chunks are whole tiles, so it visits 136 / 4 = 34 on every device.
  assert contiguous.tiles.tolist() == [16 * i + 10 for i in range(P)]
  assert zigzag.tiles.tolist() == [34] * P
  # Striped shards map tiles to strided positions: classified conservatively, never fewer.
  assert striped.tiles.sum() >= zigzag.tiles.sum()
  assert (
    bench.work_per_device("contiguous", T, P, block, block, causal=False).pairs.tolist()
    == [L * T] * P
  )


def test_bench_parallel_config_file_is_valid():
  bench = _load("bench_parallel")
  cfg = bench.load_config(
    bench.parse_args(["--config", str(EXPERIMENTS.parent / "configs" / "bench_parallel.yaml")])
  )
  assert cfg.devices == [1, 2, 4, 8] and cfg.causal and cfg.reps == 3
  assert cfg.layouts == list(bench.parallel.LAYOUTS) and cfg.block_q is None
  assert cfg.length % (2 * max(cfg.devices)) == 0 and cfg.memory_length == 65536


@pytest.mark.exhaustive  # a study's smoke test, as above
def test_bench_ceiling_quick(monkeypatch):
  # Its torch row needs the optional bench extra, which the tests do not install.
  monkeypatch.setattr(_load("bench"), "torch_or_none", lambda: None)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rows = _load("bench_ceiling").main(["--quick"])
  assert [r["method"] for r in rows] == [
    "jax.nn",
    "blockwise",
    "blockwise, masked",
    "matmuls only",
    "matmul",
  ]
  assert rows[0]["speedup"] == 1.0 and rows[-1]["speedup"] is None
  assert all(r["ms"] > 0 and r["gflops"] > 0 and r["pct_matmul"] > 0 for r in rows)
  assert "| matmuls only |" in out.getvalue()
  with contextlib.redirect_stdout(out):
    rows = _load("bench_ceiling").main(["--quick", "--pass", "fwd_bwd"])
  assert [r["method"] for r in rows] == [
    "jax.nn",
    "blockwise",
    "blockwise, masked",
    "matmuls only",
    "matmuls, 7",
    "matmuls, q outside",
    "matmul",
  ]
  assert all(r["ms"] > 0 and r["gflops"] > 0 for r in rows)
  assert "forward+backward, non-causal" in out.getvalue()
  with pytest.raises(SystemExit, match="positive"):
    _load("bench_ceiling").main(["--length", "0"])


@pytest.mark.exhaustive  # a study's smoke test, as above
def test_bench_tiles_quick():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rows = _load("bench_tiles").main(["--quick"])
  # One length x (full, causal) x (fwd, fwd+bwd) x three tile pairs, the default among them.
  assert len(rows) == 2 * 2 * 3
  assert {(r["block_q"], r["block_kv"]) for r in rows} == {(16, 16), (16, 32), (32, 16)}
  assert all(r["vs_default"] == 1.0 for r in rows if r["default"])
  assert all(r["ms"] > 0 and r["vs_default"] > 0 for r in rows)
  assert "| 48 | True | fwd_bwd | 16x16 (default) |" in out.getvalue()
  assert _load("bench_tiles").parse_tiles("1024X256") == (1024, 256)
  for bad in ("512", "0x64", "ax4"):
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
      _load("bench_tiles").main(["--tiles", bad])
    assert "--tiles" in err.getvalue()


def test_vs_torch_table_adds_the_long_run_and_the_per_round_causal_ratio(tmp_path):
  """docs_tables.vs_torch reads the newest bench_torch run and the newest bench_torch_long
  run's T = 16,384 cells; the causal target reads each run's per-round causal/full ratio."""
  from experiments import docs_tables

  def record(T, reps, vs_full):
    timings = []
    for causal in (False, True):
      for method, ms in (("auto", 10.0), ("torch", 5.0)):
        timings.append(
          dict(dtype="float32", H=64, T=T, causal=causal, method=method)
          | dict(fwd_ms=ms / (1 + causal), fwd_bwd_ms=3 * ms, fwd_vs_torch=0.5)
          | dict(fwd_bwd_vs_torch=0.5 if T < 16384 else 1.25)
          | dict(fwd_vs_full=vs_full if causal else None)
        )
    config = dict(batch=1, heads=8, kv_heads=8, lengths=[T], reps=reps, min_calls=1)
    return dict(command="cmd", config=config, device="cpu:0", jax="0", timings=timings, memory=[])

  bench = tmp_path / "bench"
  bench.mkdir()
  (bench / "bench_torch-20260101-000000.json").write_text(json.dumps(record(4096, 3, 0.55)))
  text = docs_tables.vs_torch(tmp_path)
  assert "16,384" not in text and "| float32 | 64 | 4096 | 1.10 | yes |" in text
  (bench / "bench_torch_long-20260101-000000.json").write_text(json.dumps(record(16384, 2, 0.6)))
  text = docs_tables.vs_torch(tmp_path)
  assert "bench_torch_long-20260101-000000.json" in text and "medians of 2 interleaved" in text
  assert "| float32 | 64 | 16384 | yes | 5.00 | 2.50 | 0.50 | 30.00 | 15.00 | 1.25 | **no** |" in (
    text
  )
  assert "| float32 | 64 | 16384 | 1.20 | **no** |" in text
  assert "4 of 4 cells miss the target." in text


@pytest.mark.exhaustive  # a study's smoke test, as above
def test_bench_delta_quick():
  """Both Δ rules run as custom_vjps on the same inputs, give the same gradients up to
  rounding, and each gets a time and a ratio."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rows = _load("bench_delta").main(["--quick"])
  assert [(r["T"], r["causal"]) for r in rows] == [(64, False), (64, True)]
  for r in rows:
    assert r["exact_ms"] > 0 and r["flash_ms"] > 0 and math.isfinite(r["ratio"])
    assert r["max_grad_diff"] < 1e-4, r
  assert "| exact / flash |" in out.getvalue()


@pytest.mark.exhaustive  # a study's smoke test, as above
def test_bench_gpu_quick(tmp_path):
  """The accelerator benchmark's smoke test runs on any backend: every method the backend
  runs timed in both passes for full, causal and packed documents, jax.nn's speedup over
  itself 1, scratch memory read from each compiled program, % of peak where the device is
  known, and what auto runs (jattn.explain) recorded in every row."""
  from experiments import bench_gpu, docs_tables

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rows = bench_gpu.main(["--quick", "--json", str(tmp_path / "rows.json")])
  backend = jax.default_backend()
  methods = {r["method"] for r in rows}
  assert {"jax.nn", "xla", "blockwise", "auto"} <= methods
  assert ("jax.nn/cudnn" in methods) == (backend == "gpu")
  assert ("splash" in methods) == (backend == "tpu")
  assert {r["mask"] for r in rows} == {"full", "causal", "packed"}
  peak = bench_gpu.peak_tflops(jax.devices()[0].device_kind, "float32")
  for r in rows:
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_scratch_mb"] >= 0
    assert r["causal"] == (r["mask"] != "full")
    if r["method"] == "jax.nn":
      assert r["fwd_speedup"] == 1.0 and r["fwd_bwd_speedup"] == 1.0
    assert "fwd_pct_peak" in r and "fwd_bwd_pct_peak" in r
    if r["dtype"] == "float32":
      assert (r["fwd_bwd_pct_peak"] is None) == (peak is None)
    assert r["auto_runs"]["implementation"] in ("xla", "blockwise", "splash", "cudnn")
    assert r["auto_runs"]["reason"]
    if r["mask"] == "packed":  # the quick run's 3 documents per row, lengths summing to T
      assert [len(d) for d in r["doc_lengths"]] == [3] and sum(r["doc_lengths"][0]) == r["T"]
  assert json.loads((tmp_path / "rows.json").read_text()) == rows
  text = out.getvalue()
  assert "| float32 | 8 | 32 | causal | blockwise |" in text
  assert "| float32 | 8 | 32 | packed | auto |" in text
  assert f"- float32, H=8, T=32, packed: {rows[-1]['auto_runs']['implementation']} (" in text
  # The docs page renders a record of it (here the quick one, copied as a full run's name).
  docs = tmp_path / "docs"
  (docs / "gpu").mkdir(parents=True)
  (docs / "gpu" / "bench_gpu_cpu.json").write_text(json.dumps(rows))
  page = docs_tables.gpu(docs)
  assert "| float32 | 8 | 32 | packed | auto |" in page and "fwd TFLOP/s" in page
  assert "- float32, H=8, T=32, packed: `" in page
  if backend == "cpu":
    assert "note: skipping jax.nn/cudnn: it runs on GPU only" in text and "% peak" not in text
  # The peak table: first match wins, unknown devices get None.
  assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
  assert bench_gpu.peak_tflops("NVIDIA H200", "float32") == 494.7
  assert bench_gpu.peak_tflops("NVIDIA A100-SXM4-40GB", "float32") == 156.0
  assert bench_gpu.peak_tflops("TPU v5 lite", "bfloat16") == 197.0
  assert bench_gpu.peak_tflops("TPU v5", "bfloat16") == 459.0
  assert bench_gpu.peak_tflops("TPU v4 lite", "bfloat16") is None
  assert bench_gpu.peak_tflops("cpu", "float32") is None


def test_bench_gpu_gives_jax_nn_each_mask_written_out():
  """Each mask or score function of the accelerator benchmark, as jattn takes it and as
  jax.nn gets it written out densely (soft cap: jax.nn has none, the float64 formula
  instead), is the same attention, and its work counts the pairs the mask allows."""
  import jax.numpy as jnp
  import numpy as np

  import jattn
  from experiments import bench_gpu

  B, N, T, H, window, prefix = 2, 2, 24, 8, 5, 6
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in "qkv")
  seg = bench_gpu.segment_ids(B, T, 3, seed=1)
  pos = np.arange(T)
  causal = pos[None, :] <= pos[:, None]
  allowed = {
    "full": np.ones((T, T), bool),
    "causal": causal,
    "window": causal & (pos[None, :] >= pos[:, None] - window),
    "prefix": causal | (pos[None, :] < prefix),
  }
  cases = {m: bench_gpu.case(m, B, N, T, seg, window, prefix, jnp.float32) for m in bench_gpu.MASKS}

  def attend(q, k, v):  # every mask's two calls as one program (eagerly, each op compiles)
    return {
      mask: (
        jattn.dot_product_attention(
          q, k, v, **c.jattn_arrays, **dict(c.jattn_static), implementation="xla"
        ),
        None
        if c.jax_nn_static is None
        else jax.nn.dot_product_attention(q, k, v, **c.jax_nn_arrays, **dict(c.jax_nn_static)),
      )
      for mask, c in cases.items()
    }

  results = jax.jit(attend)(q, k, v)
  for mask in bench_gpu.MASKS:
    c = cases[mask]
    got, want = results[mask]  # want: jax.nn's, or None
    if c.jax_nn_static is None:
      assert mask == "softcap"
      s = np.einsum("btnh,bsnh->bnts", q, k, dtype=np.float64) / np.sqrt(H)
      s = np.where(causal, 30 * np.tanh(s / 30), -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=mask)
    if mask in allowed and mask != "prefix":  # exact counts (causal: T²/2, as FLOP counts go)
      want_pairs = B * allowed[mask].sum() if mask in ("full", "window") else B * T * T / 2
      assert c.pairs == want_pairs, mask
  assert bench_gpu.case("prefix", B, N, T, seg, window, prefix, jnp.float32).pairs == (
    B * (T * T + prefix * prefix) / 2
  )


def test_collectives_counts_each_devices_bytes_by_kind_and_loop():
  """A hand-written per-device HLO: each collective's bytes on the wire by the bandwidth-
  optimal counts, a collective in a while body once per known iteration, an async start's
  result (its last shape) counted once, and the group size read from each of XLA's spellings."""
  hlo = """
HloModule m

%body (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %cp = f32[2,4]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (a: f32[2,4]) -> f32[8,4] {
  %w = (s32[], f32[2,4]) while(%t), condition=%cond, body=%body, backend_config={TRIPS}
  %ag = f32[8,4]{1,0} all-gather(%a), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2,4]{1,0} reduce-scatter(%ag), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %a2a = bf16[4,4]{1,0} all-to-all(%b), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  %ar = f32[4]{0} all-reduce(%c), channel_id=5, replica_groups={{0,1}}, to_apply=%add
  %s = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%a), channel_id=6, replica_groups={{0,1,2,3}}
  %m = (f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(%x,%y), replica_groups=mesh['sp'=4,'uly'=2] {'uly'}
  %mr = f32[4]{0} all-reduce(%c), replica_groups=mesh['sp'=4,'uly'=2] {'sp','uly'}
}
"""
  hlo = hlo.replace("{TRIPS}", '{"known_trip_count":{"n":"3"}}')
  got = _load("_collectives").traffic(hlo)
  assert got == {
    "collective-permute": 3 * 32,  # 2 x 4 float32, three iterations
    "all-gather": 2 * 3 / 4 * 128,  # the sync one and the async start's result
    "reduce-scatter": 3 * 32,  # (G - 1) results
    "all-to-all": 3 / 4 * 32 + 1 / 2 * 64,  # a tuple's arrays both; newer XLA's mesh groups
    "all-reduce": 2 * 1 / 2 * 16 + 2 * 7 / 8 * 16,
  }


def test_collectives_finds_what_can_overlap_a_loop_step():
  """A hand-written per-device HLO: in a loop body, a collective-permute whose result only
  leaves the body (carried to the next iteration) can overlap the step, counted per
  iteration; one whose result the step's dot reads cannot; nor can collectives outside a
  loop (an async all-gather whose result a dot needs, an all-to-all of that dot's result)."""
  hlo = """
HloModule m

%body (p: (s32[], f32[2,4], f32[2,4])) -> (s32[], f32[2,4], f32[2,4]) {
  %kv = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %q = f32[2,4]{1,0} get-tuple-element(%p), index=2
  %cp = f32[2,4]{1,0} collective-permute(%kv), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %used = f32[2,4]{1,0} collective-permute(%q), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %d = f32[2,2]{1,0} dot(%used, %kv), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %t = (s32[], f32[2,4], f32[2,4]) tuple(%i, %cp, %q)
}

ENTRY %main (a: f32[2,4]) -> f32[4,4] {
  %s = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%a), channel_id=2, replica_groups={{0,1,2,3}}
  %g = f32[8,4]{1,0} all-gather-done(%s)
  %d = f32[8,8]{1,0} dot(%g, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %o = f32[8,8]{1,0} all-to-all(%d), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %w = (s32[], f32[2,4], f32[2,4]) while(%o), condition=%c, body=%body, backend_config={TRIPS}
}
"""
  hlo = hlo.replace("{TRIPS}", '{"known_trip_count":{"n":"3"}}')
  collectives = _load("_collectives")
  assert collectives.traffic(hlo)["collective-permute"] == 2 * 3 * 32
  assert collectives.overlappable(hlo) == {"collective-permute": 3 * 32}
