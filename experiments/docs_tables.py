"""The documentation's result tables, written from the run records committed under docs/.

Benchmarks write JSON under runs/ (git-ignored). A run the documentation shows is
copied, unchanged, into a folder of docs/ (``--collect`` does that) and
committed; this script turns those records into Markdown tables under
docs/_generated/, which the pages include. Nothing in a table is typed by hand,
and a record that is absent gives a note saying how to make it instead of a
table. ``docs/conf.py`` runs it on every Sphinx build.

    python -m experiments.docs_tables             # docs/_generated/*.md from docs/<kind>/
    python -m experiments.docs_tables --collect   # first copy the newest full runs from runs/

What each folder of docs/ holds; ``COMMANDS`` below names the command whose run it records:

    docs/bench/             bench-<time>.json: the newest run with timings, the newest with memory;
                            bench_decode-<time>.json: the newest decoding run;
                            bench_torch-<time>.json: the newest run against PyTorch's SDPA;
                            bench_torch_long-<time>.json: its T = 16,384 cells;
                            bench_tiles-<time>.json: the newest tile-size sweep
    docs/accuracy/          accuracy_<backend>.json (from experiments.accuracy --json)
    docs/scaling/           scaling.json and scaling.png
    docs/parallel/          parallel.json
    docs/gpu/               bench_gpu_<device>.json (from experiments.bench_gpu --json) and
                            gpu_probe_<device>*.json (from experiments.gpu_probe)
    docs/compare_backward/  summary.json and the demo's plots
    docs/char_lm/           summary.json and the plots of the character-level language model
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable

from experiments import _cli
from experiments._timing import fmt

ROOT = _cli.ROOT
DOCS = ROOT / "docs"
RECORD_DIRS = ("bench", "accuracy", "scaling", "parallel", "gpu", "compare_backward", "char_lm")
COMMANDS = {
  "bench": "python -m experiments.bench --config configs/bench.yaml",
  "bench_memory": "python -m experiments.bench --lengths --memory-lengths 4096 16384",
  "decode": "python -m experiments.bench_decode --config configs/bench_decode.yaml",
  "vs_torch": "python -m experiments.bench --config configs/bench_torch.yaml",
  "vs_torch_long": "python -m experiments.bench --config configs/bench_torch_long.yaml",
  "tiles": "python -m experiments.bench_tiles --lengths 1024 4096",
  "accuracy": "python -m experiments.accuracy --json runs/accuracy_cpu.json",
  "scaling": "python -m experiments.bench_scaling --config configs/bench_scaling.yaml",
  "parallel": "python -m experiments.bench_parallel --config configs/bench_parallel.yaml",
  "gpu": "python -m experiments.bench_gpu --json runs/bench_gpu_<device>.json",
  "gpu_probe": "python -m experiments.gpu_probe --out runs/gpu_probe_<device>.json",
  "compare_backward": "python -m experiments.train --config configs/compare_backward.yaml",
  "char_lm": "python -m experiments.train --config configs/char_lm.yaml",
}
DEMO_PLOTS = ("loss_curves.png", "length_sweep.png", "attention_layer1.png")
CHAR_LM_PLOTS = ("eval_curves.png", "loss_curves.png", "qk_clip.png", "attention_layer1.png")


# --- reading the records --------------------------------------------------------------------


def _full_runs(paths) -> list[pathlib.Path]:
  """Run records sorted by name (their time stamps), smoke-test (``-quick``) runs left out."""
  return sorted(p for p in paths if "-quick" not in str(p))


def _newest(folder: pathlib.Path, pattern: str) -> pathlib.Path | None:
  """The newest full run record in ``folder`` whose name matches ``pattern``, or None."""
  found = _full_runs(folder.glob(pattern))
  return found[-1] if found else None


def _load(path: pathlib.Path):
  return json.loads(path.read_text())


def _jax(record: dict) -> str:
  """jax's version in a record: ``jax`` (experiments/_cli.facts), ``jax_version`` in the
  scaling and parallel records written before those records took the shared facts."""
  return record.get("jax") or record["jax_version"]


def _source(path: pathlib.Path, docs: pathlib.Path) -> str:
  return f"`docs/{path.relative_to(docs).as_posix()}`"


def _absent(what: str, kind: str) -> str:
  return (
    f"*No run recorded: {what} is not in the repository.* Make it with "
    f"`{COMMANDS[kind]}`, then `python -m experiments.docs_tables --collect`.\n"
  )


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


# --- one renderer per benchmark -------------------------------------------------------------


def bench_timings(docs: pathlib.Path) -> str:
  records = [(p, _load(p)) for p in _full_runs((docs / "bench").glob("bench-*.json"))]
  records = [(p, r) for p, r in records if r["timings"]]
  if not records:
    return _absent("a `bench-*.json` with timings in `docs/bench/`", "bench")
  path, r = records[-1]
  c = r["config"]
  head = (
    f"From {_source(path, docs)}: {r['device']}, jax {r['jax']}, B={c['batch']}, "
    f"N={c['heads']}, K={c['kv_heads']}, float32, medians of {c['reps']} interleaved rounds; "
    f"the float32 {c['matmul_size']}³ matmul ran at {fmt(r['matmul_gflops'], '.0f')} GFLOP/s.\n\n"
  )
  rows = [
    [
      str(t["H"]),
      str(t["T"]),
      "yes" if t["causal"] else "no",
      t["method"],
      fmt(t.get("fwd_ms"), ".1f"),
      fmt(t.get("fwd_gflops"), ".1f"),
      fmt(t.get("fwd_pct_matmul"), ".0f"),
      fmt(t.get("fwd_speedup"), ".2f"),
      fmt(t.get("fwd_bwd_ms"), ".1f"),
      fmt(t.get("fwd_bwd_gflops"), ".1f"),
      fmt(t.get("fwd_bwd_speedup"), ".2f"),
    ]
    for t in r["timings"]
  ]
  header = ["H", "T", "causal", "method", "fwd ms", "fwd GFLOP/s", "% matmul", "fwd speedup"]
  header += ["fwd+bwd ms", "fwd+bwd GFLOP/s", "fwd+bwd speedup"]
  return head + _table(header, rows)


def bench_memory(docs: pathlib.Path) -> str:
  records = [(p, _load(p)) for p in _full_runs((docs / "bench").glob("bench-*.json"))]
  records = [(p, r) for p, r in records if r["memory"]]
  if not records:
    return _absent("a `bench-*.json` with memory cases in `docs/bench/`", "bench_memory")
  path, r = records[-1]
  head = (
    f"From {_source(path, docs)}: {r['device']}, jax {r['jax']}; forward+backward, each case "
    "in a fresh process; peak resident memory (VmHWM), and before the call (Python, JAX "
    "and the inputs).\n\n"
  )
  rows = []
  for m in r["memory"]:
    note = m.get("skipped") or m.get("failed")
    cells = [str(m["T"]), "yes" if m["causal"] else "no", m["method"]]
    if note:
      rows.append(cells + [note, "—", "—"])
    else:
      rows.append(
        cells + [f"{m['seconds']:.1f}", f"{m['peak_mb_before']:.0f}", f"{m['peak_mb']:.0f}"]
      )
  return head + _table(["T", "causal", "method", "seconds", "MiB before", "peak MiB"], rows)


# jattn's targets against PyTorch on a CPU (issue [cpu-speed]).
TORCH_TARGET, SMALL_T_LIMIT, CAUSAL_LIMIT = 1.2, 1.1, 1.15


def vs_torch(docs: pathlib.Path) -> str:
  """jattn (implementation=None) against torch SDPA cell by cell, and the three targets: from
  the newest ``bench_torch`` run, with the T = 16,384 cells of the newest ``bench_torch_long``
  run (seconds a call, so fewer rounds) where there is one."""
  newest = _newest(docs / "bench", "bench_torch-*.json")
  if newest is None:
    return _absent("a `bench_torch-*.json` in `docs/bench/`", "vs_torch")
  runs = [(newest, "vs_torch")]
  if (long := _newest(docs / "bench", "bench_torch_long-*.json")) is not None:
    runs.append((long, "vs_torch_long"))
  rows: dict[tuple, dict] = {}
  out = []
  for path, kind in runs:
    r = _load(path)
    c = r["config"]
    rows |= {(t["dtype"], t["H"], t["T"], t["causal"], t["method"]): t for t in r["timings"]}
    out.append(
      f"From {_source(path, docs)} (`{r.get('command', COMMANDS[kind])}`): {r['device']}, "
      f"jax {r['jax']}, B={c['batch']}, N={c['heads']}, K={c['kv_heads']}, "
      f"T = {', '.join(f'{T:,}' for T in c['lengths'])}, medians of {c['reps']} interleaved "
      f"rounds of blocks of at least {c.get('min_calls', 3)} calls.\n"
    )
  out.append(
    f"× torch = torch's time / jattn's (median of per-round ratios; > 1: jattn faster); the "
    f"target is ≥ {TORCH_TARGET} in every cell.\n"
  )
  cells, misses = [], 0
  for (dtype, H, T, causal, method), a in rows.items():
    if method != "auto" or T < 1024 or (dtype, H, T, causal, "torch") not in rows:
      continue  # the targets are for T >= 1024; shorter sequences are compared with jax.nn
    t = rows[(dtype, H, T, causal, "torch")]
    ratios = [a.get("fwd_vs_torch"), a.get("fwd_bwd_vs_torch")]
    met = all(x is not None and x >= TORCH_TARGET for x in ratios)
    misses += not met
    cells.append(
      [dtype, str(H), str(T), "yes" if causal else "no"]
      + [fmt(a.get("fwd_ms"), ".2f"), fmt(t.get("fwd_ms"), ".2f"), fmt(ratios[0], ".2f")]
      + [fmt(a.get("fwd_bwd_ms"), ".2f"), fmt(t.get("fwd_bwd_ms"), ".2f"), fmt(ratios[1], ".2f")]
      + ["yes" if met else "**no**"]
    )
  header = ["dtype", "H", "T", "causal", "jattn fwd ms", "torch fwd ms", "fwd × torch"]
  header += ["jattn fwd+bwd ms", "torch fwd+bwd ms", "fwd+bwd × torch", "≥ 1.2×"]
  out += [_table(header, cells), f"{misses} of {len(cells)} cells miss the target.\n"]
  small = [
    [dtype, str(H), str(T), "yes" if causal else "no"]
    + [fmt(a.get("fwd_speedup"), ".2f"), fmt(a.get("fwd_bwd_speedup"), ".2f")]
    for (dtype, H, T, causal, method), a in rows.items()
    if method == "auto" and T <= 128
  ]
  if small:
    out += [
      f"Short sequences: jattn's speed over jax.nn (the target: jattn's time at most "
      f"{SMALL_T_LIMIT}× jax.nn's, a speed ≥ {1 / SMALL_T_LIMIT:.2f}):\n",
      _table(["dtype", "H", "T", "causal", "fwd × jax.nn", "fwd+bwd × jax.nn"], small),
    ]
  halves = []
  for (dtype, H, T, causal, method), a in rows.items():
    full = rows.get((dtype, H, T, False, "auto"))
    if method == "auto" and causal and T >= 4096 and full and a.get("fwd_ms") and full["fwd_ms"]:
      # Runs that time full and causal in the same rounds record the per-round ratio.
      ratio = 2 * a["fwd_vs_full"] if a.get("fwd_vs_full") else a["fwd_ms"] / (full["fwd_ms"] / 2)
      halves.append(
        [dtype, str(H), str(T), f"{ratio:.2f}", "yes" if ratio <= CAUSAL_LIMIT else "**no**"]
      )
  if halves:
    out += [
      f"The causal forward against half the full forward (target ≤ {CAUSAL_LIMIT}):\n",
      _table(["dtype", "H", "T", "causal ms / (full ms / 2)", "met"], halves),
    ]
  if r["memory"]:
    out += [
      "Peak process memory (VmHWM) of float32 forward+backward, each case in a fresh process "
      "(targets: at most 1.5 GB at T = 16,384 causal; T = 65,536 completes):\n",
      _table(
        ["H", "T", "causal", "method", "seconds", "peak MiB"],
        [
          [str(m["H"]), f"{m['T']:,}", "yes" if m["causal"] else "no", m["method"]]
          + [f"{m['seconds']:.1f}", f"{m['peak_mb']:.0f}"]
          for m in r["memory"]
          if "peak_mb" in m
        ],
      ),
    ]
  return "\n".join(out)


def tiles(docs: pathlib.Path) -> str:
  """The tile-size sweep: every (block_q, block_kv) per (T, mask, pass), against the default."""
  path = _newest(docs / "bench", "bench_tiles-*.json")
  if path is None:
    return _absent("a `bench_tiles-*.json` in `docs/bench/`", "tiles")
  r = _load(path)
  a = r["args"]
  cells: dict[tuple, list[dict]] = {}
  for row in r["rows"]:
    cells.setdefault((row["T"], row["causal"], row["mode"]), []).append(row)
  sizes = list(dict.fromkeys((row["block_q"], row["block_kv"]) for row in r["rows"]))
  header = ["T", "causal", "pass", "default ms"] + [f"{q}×{k}" for q, k in sizes]
  table = []
  for (T, causal, mode), group in cells.items():
    by = {(row["block_q"], row["block_kv"]): row for row in group}
    best = max(group, key=lambda row: row["vs_default"])
    default = next(row for row in group if row["default"])
    table.append(
      [f"{T:,}", "yes" if causal else "no", mode.replace("_", "+"), f"{default['ms']:.1f}"]
      + [
        "—"
        if (row := by.get(size)) is None
        else (f"**{row['vs_default']:.2f}**" if row is best else f"{row['vs_default']:.2f}")
        for size in sizes
      ]
    )
  return "\n".join(
    [
      f"From {_source(path, docs)} (`{r['meta']['command']}`): B={a['batch']}, "
      f"N={a['heads']}, H={a['head_dim']}, {a['dtype']}, medians of {a['reps']} interleaved "
      "rounds. Each cell is the default tiles' time over that pair's (median of per-round "
      "ratios; > 1: faster than the default), the best of each row in bold; tiles larger "
      "than T are clipped to T, so some pairs repeat at short lengths.\n",
      _table(header, table),
    ]
  )


def decode(docs: pathlib.Path) -> str:
  from experiments import bench_decode  # its cells, shared with the printed tables

  path = _newest(docs / "bench", "bench_decode-*.json")
  if path is None:
    return _absent("a `bench_decode-*.json` in `docs/bench/`", "decode")
  r = _load(path)
  c = r["config"]
  out = [
    f"From {_source(path, docs)} (`{r['command']}`): {r['device']} ({r['machine']}), jax "
    f"{r['jax']}; N={c['heads']}, K={c['kv_heads']}, H={c['head_dim']}, float32 queries, "
    f"pages of {c['page_size']} slots, contiguous caches of context + {c['headroom']} slots.\n"
  ]
  if r["steps"]:
    out += [
      "One jitted decode step (cache donated), medians of "
      f"{c['reps']} interleaved rounds; × jax.nn = jax.nn's time / the method's (median of "
      "per-round ratios); bytes per token held = the bytes the cache reserves (contiguous) or "
      "the bytes of its pages in use (paged) / the tokens it holds:\n",
      _table(*bench_decode.step_table(r["steps"])),
    ]
  if r["quant"]:
    out += [
      "One decode step with quantized pages against the float32 contiguous cache "
      "(relative RMS error = ‖o − o_ref‖ / ‖o_ref‖ of the output):\n",
      _table(*bench_decode.quant_table(r["quant"])),
    ]
  if (s := r["serve"]) is not None:
    v = c["serve"]
    out += [
      f"Continuous batching: {s['requests']} requests (prompts {v['prompt'][0]}–"
      f"{v['prompt'][1]} tokens, outputs {v['output'][0]}–{v['output'][1]}, seed "
      f"{v['seed']}) on {v['batch']} slots of up to {v['max_length']:,} tokens over a float32 "
      f"paged pool, prompts written in chunks of {v['prefill_chunk']}:\n",
      _table(*bench_decode.serve_table(s)),
    ]
  if (g := r.get("ragged")) is not None:
    v = c["ragged"]
    out += [
      f"One continuous-batching step: {g['batch']} requests over float32 pages, "
      f"{v['prefilling']} bringing a prompt chunk of {v['chunk']} tokens and the rest one "
      f"decode token each ({g['tokens']:,} tokens; padded to ({g['batch']}, "
      f"{g['padded_to']}) for decode.attention), rows holding {v['context'][0]:,}–"
      f"{v['context'][1]:,} tokens (seed {v['seed']}), query tiles of {v['block_q']}; "
      f"reading each row once would be {g['needed_mb']:,.1f} MiB; the outputs agree to "
      f"{g['max_abs_diff']:.1e}:\n",
      _table(*bench_decode.ragged_table(g)),
    ]
  return "\n".join(out)


def _scaling_record(docs: pathlib.Path):
  path = docs / "scaling" / "scaling.json"
  return (path, _load(path)) if path.exists() else (path, None)


def scaling(docs: pathlib.Path) -> str:
  path, r = _scaling_record(docs)
  if r is None:
    return _absent("`docs/scaling/scaling.json`", "scaling")
  c = r["config"]
  methods = list(c["methods"])
  lengths = sorted({row["T"] for row in r["rows"]})
  cell = {(row["method"], row["T"]): row for row in r["rows"]}
  ref = {row["T"]: row["ms"] for row in r["rows"] if row["method"] == "jax.nn"}

  def time_cell(method, T):
    row = cell.get((method, T))
    if row is None:
      return "—"
    if row["ms"] is None:
      return "not run"
    ratio = f" ({row['ms'] / ref[T]:.3f})" if ref.get(T) and method != "jax.nn" else ""
    return f"{row['ms']:,.1f}{ratio}"

  def mem_cell(method, T):
    row = cell.get((method, T))
    return "—" if row is None else fmt(row["mem_mb"], ",.1f")

  kind = "causal" if c["causal"] else "non-causal"
  out = [
    f"From {_source(path, docs)}: {r['device']}, jax {_jax(r)}, B={c['batch']}, "
    f"N={c['heads']}, H={c['head_dim']}, float32 {kind} forward; `window` is a sliding "
    f"window of ±{c['window']} positions on the blockwise path, `linear` is "
    "`jattn.linear_attention` (elu+1). Calls that would allocate more than "
    f"{c['max_bytes'] / 2**30:.0f} GiB are not run.\n",
    "Milliseconds per call (in brackets: × jax.nn's time):\n",
    _table(["T", *methods], [[f"{T:,}", *(time_cell(m, T) for m in methods)] for T in lengths]),
    "Megabytes XLA allocates for the call (temporaries and outputs, from the compiled "
    "program, so known where the call was not run):\n",
    _table(["T", *methods], [[f"{T:,}", *(mem_cell(m, T) for m in methods)] for T in lengths]),
    f"Log-log slopes over T ≥ {c['fit_from']:,}:\n",
    _table(
      ["method", "time slope", "memory slope"],
      [[m, fmt(f["time_slope"], ".2f"), fmt(f["mem_slope"], ".2f")] for m, f in r["fits"].items()],
    ),
  ]
  cross = r.get("crossover") or {}
  if cross.get("length"):
    out.append(f"Linear attention overtakes blockwise softmax at T ≈ {cross['length']:,}.\n")
  elif cross.get("note"):
    out.append(f"Where linear attention overtakes blockwise softmax: {cross['note']}.\n")
  return "\n".join(out)


def sparse(docs: pathlib.Path) -> str:
  path, r = _scaling_record(docs)
  if r is None or not r.get("sparse"):
    return _absent("a sparse-mask table in `docs/scaling/scaling.json`", "scaling")
  from experiments.bench_scaling import sparse_mask  # the masks the run was timed with

  first = r["sparse"][0]
  head = (
    f"From {_source(path, docs)}: blockwise forward at T={first['T']:,}, tiles "
    f"{first['block']} × {first['block']}; each pattern's mask is built by `sparse_mask` in "
    "`experiments/bench_scaling.py`.\n\n"
  )
  rows = []
  for s in r["sparse"]:
    mask = sparse_mask(s["pattern"], s["T"], s["block"], r["config"]["window"])
    rows.append(
      [
        s["pattern"],
        "none" if mask is None else f"`{mask!r}`".replace("|", "\\|"),
        f"{s['tiles_visited']:.3f}",
        f"{s['ms']:,.0f}",
        fmt(s["time_vs_dense"], ".3f"),
      ]
    )
  return head + _table(["pattern", "mask", "tiles visited", "ms", "time / dense"], rows)


def parallel(docs: pathlib.Path) -> str:
  path = docs / "parallel" / "parallel.json"
  if not path.exists():
    return _absent("`docs/parallel/parallel.json`", "parallel")
  r = _load(path)
  c = r["config"]
  ref = r["reference"]
  mb = lambda x: fmt(x, ",.4g")
  ratio = lambda a, b: None if a is None or not b else a / b
  out = [
    f"From {_source(path, docs)}: {r['num_devices']} {r['device'].split(':')[0]} devices "
    f"sharing {r['cpu_count']} cores, jax {_jax(r)}; B={c['batch']}, "
    f"N=K={c['heads']}, H={c['head_dim']}, T={c['length']:,}, float32, "
    f"{'causal ' if c['causal'] else ''}training step (value_and_grad in q, k, v), tiles "
    f"{r['blocks'][0]} × {r['blocks'][1]}. jax.nn on one device: {mb(ref['mb'])} MiB, "
    f"{ref['ms']:,.1f} ms.\n",
    "Memory per device and step time against the number of devices P (contiguous layout):\n",
    _table(
      ["P", "MiB per device", "× P / MiB at P=1", "step ms", "× jax.nn ms"],
      [
        [
          str(row["P"]),
          mb(row["mb"]),
          fmt(row["mb_x_P_vs_P1"], ".3f"),
          f"{row['ms']:,.1f}",
          fmt(ratio(row["ms"], ref["ms"]), ".3f"),
        ]
        for row in r["rows"]
      ],
    ),
  ]
  times = {row["layout"]: row for row in r["layouts"]}
  P = r["balance"][0]["P"] if r["balance"] else None
  out += [
    f"Causal work per device at P={P} (max/mean across devices, 1.0 = even) and step time "
    "per layout:\n",
    _table(
      ["layout", "tiles max/mean", "pairs max/mean", "tiles visited", "step ms", "× contiguous"],
      [
        [
          w["layout"],
          f"{w['tiles_max_over_mean']:.3f}",
          f"{w['pairs_max_over_mean']:.3f}",
          f"{w['total_tiles']:.0f}",
          f"{times[w['layout']]['ms']:,.1f}",
          f"{times[w['layout']]['time_vs_contiguous']:.3f}",
        ]
        for w in r["balance"]
      ],
    ),
  ]
  if r.get("strategies"):
    out += [
      f"context_parallel_attention's strategies at P={r['strategies'][0]['P']}: MiB each "
      "device sends per training step, by collective, and how much of it can overlap a whole "
      "loop step of compute (sent inside a step, read only by the next), read from the "
      "compiled program:\n",
      _table(
        [
          "mask",
          "strategy",
          "layout",
          "MiB sent",
          "by collective",
          "can overlap",
          "MiB per device",
          "ms",
        ],
        [
          [
            s["mask"],
            s["strategy"] + (" " + "×".join(map(str, s["mesh"].values())) if s.get("mesh") else ""),
            s["layout"],
            f"{s['sent_total_mb']:,.2f}",
            ", ".join(f"{k} {v:,.2f}" for k, v in s["sent_mb"].items() if v >= 0.005),
            fmt(s.get("overlap_mb"), ",.2f"),
            mb(s["mb"]),
            f"{s['ms']:,.1f}",
          ]
          for s in r["strategies"]
        ],
      ),
    ]
  if r["memory"]:
    out += [
      f"Memory per device at T={c['memory_length']:,} from compilation alone (nothing runs):\n",
      _table(
        ["method", "P", "MiB per device", "× MiB at P/2"],
        [
          [m["method"], str(m["P"]), mb(m["mb"]), fmt(m.get("vs_half_P"), ".3f")]
          for m in r["memory"]
        ],
      ),
    ]
  return "\n".join(out)


def gpu(docs: pathlib.Path) -> str:
  paths = _full_runs((docs / "gpu").glob("bench_gpu*.json"))
  if not paths:
    return _absent("a `bench_gpu` record in `docs/gpu/`", "gpu")
  out = []
  for path in paths:
    rows = _load(path)

    def f(row, key, spec):
      if row.get(key) is not None:
        return format(row[key], spec)
      return row.get(key.rsplit("_", 1)[0] + "_error", "—")

    # Older records have no mask (full or causal), head dim, % of peak, jax.nn's best or
    # auto_runs.
    mask = lambda row: row.get("mask") or ("causal" if row["causal"] else "full")
    head_dim = lambda row: str(row.get("H", "—"))
    peak = any(row.get("fwd_bwd_pct_peak") is not None for row in rows)
    cols = []
    for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
      cols += [(f"{name} ms", f"{mode}_ms", ".2f"), (f"{name} TFLOP/s", f"{mode}_tflops", ".0f")]
      cols += [(f"{name} % peak", f"{mode}_pct_peak", ".1f")] if peak else []
    cols += [("fwd+bwd speedup", "fwd_bwd_speedup", ".2f")]
    if any(row.get("jax_nn_best", "jax.nn") != "jax.nn" for row in rows):
      cols += [("fwd+bwd vs jax.nn's best", "fwd_bwd_vs_best", ".2f")]
    cols += [("fwd+bwd scratch MiB", "fwd_bwd_scratch_mb", ",.0f")]
    if any("fwd_bwd_err" in row for row in rows):
      cols += [("fwd+bwd max err", "fwd_bwd_err", ".1e")]
    # Older records name neither the device nor jax's version in their rows.
    facts = {f"{r['device']}, jax {r['jax']}" for r in rows if "jax" in r}
    where = "".join(f", {x}" for x in sorted(facts))
    out += [
      f"From {_source(path, docs)}{where}; speedup = jax.nn's time / the method's; scratch = "
      "XLA's planned temporary memory; max err = the gradients' largest absolute error against "
      "a float32 evaluation at the highest matmul precision:\n",
      _table(
        ["dtype", "H", "T", "mask", "method"] + [c[0] for c in cols],
        [
          [row["dtype"], head_dim(row), f"{row['T']:,}", mask(row), row["method"]]
          + [f(row, key, spec) for _, key, spec in cols]
          for row in rows
        ],
      ),
    ]
    auto = {
      (r["dtype"], head_dim(r), r["T"], mask(r)): r["auto_runs"] for r in rows if r.get("auto_runs")
    }
    if auto:
      out.append("What auto (`implementation=None`) ran, per `jattn.explain`:\n")
      out += [
        f"- {dtype}, H={H}, T={T:,}, {m}: `{a['implementation']}`: {a['reason']}"
        for (dtype, H, T, m), a in auto.items()
      ]
      out.append("")
  return "\n".join(out)


def accuracy(docs: pathlib.Path) -> str:
  paths = _full_runs((docs / "accuracy").glob("*.json"))
  if not paths:
    return _absent("an accuracy record in `docs/accuracy/`", "accuracy")
  from experiments import accuracy as harness  # jax and jattn: only when there is a record

  out = []
  for path in paths:
    rows = _load(path)
    cells = [r for r in rows if r["rule"] not in harness.PEERS]
    ok = [r for r in cells if all(e["ok"] for e in r["cell"].values())]
    out += [
      f"From {_source(path, docs)}: **{len(ok)} of {len(cells)} cells meet the target**. "
      "A jax.nn row gives its absolute errors; each rule row gives the rule's error divided "
      "by jax.nn's, in bold where it misses the target.\n",
      harness.table(rows) + "\n",
    ]
  return "\n".join(out)


def demo(docs: pathlib.Path) -> str:
  path = docs / "compare_backward" / "summary.json"
  if not path.exists():
    return _absent("`docs/compare_backward/summary.json`", "compare_backward")
  from experiments.toy import report

  s = _load(path)
  c = s["config"]
  t, tr, sw = c["task"], c["training"], c["comparison"]["sweep"]
  return "\n".join(
    [
      f"From {_source(path, docs)}: task `{t['name']}` (sequences of {s['task']['seq_len']} "
      f"tokens, {s['task']['num_answer_tokens']} of them answers), {s['num_params']:,} "
      f"parameters, {tr['steps']} steps of batch {tr['batch_size']}, exact match on "
      f"{tr['eval_samples']} held-out sequences, platform {s['platform']}.\n",
      report.rules_table(s["rules"]) + "\n",
      f"The length sweep: batch {sw['batch_size']}, median of {sw['steps']} train steps, "
      f"each cell a fresh process capped at {sw['memory_limit_mb']:,} MiB of address space; "
      "a cell reads step time, XLA's buffer assignment for the step, and the process's "
      "peak resident memory (RSS).\n",
      report.sweep_table(s["sweep"], list(s["rules"])) + "\n",
    ]
  )


def _char_lm_record(docs: pathlib.Path) -> tuple[pathlib.Path, dict | None]:
  path = docs / "char_lm" / "summary.json"
  return path, (_load(path) if path.exists() else None)


def char_lm(docs: pathlib.Path) -> str:
  """The character-level language model's three rules: held-out loss per character."""
  path, s = _char_lm_record(docs)
  if s is None:
    return _absent("`docs/char_lm/summary.json`", "char_lm")
  from experiments.toy import report

  losses = sorted({f"{r['final_eval_loss']:.4f}" for r in s["rules"].values()})
  bits = sorted({f"{r['final_eval_bits_per_token']:.3f}" for r in s["rules"].values()})
  return "\n".join(
    [
      f"{report.setting(s)} (The record: {_source(path, docs)}, made by "
      f"`{COMMANDS['char_lm']}`.)\n",
      f"After {s['config']['training']['steps']} steps the held-out loss of every rule is "
      f"{' to '.join(sorted({losses[0], losses[-1]}))} nats per character, "
      f"{' to '.join(sorted({bits[0], bits[-1]}))} bits. {report.spread_line(s)}\n",
      report.lm_rules_table(s["rules"]) + "\n",
    ]
  )


def char_lm_clip(docs: pathlib.Path) -> str:
  """The character-level language model with and without QK-clip."""
  path, s = _char_lm_record(docs)
  if s is None or not s.get("qk_clip"):
    return _absent("`docs/char_lm/summary.json` with a QK-clip run", "char_lm")
  from experiments.toy import report

  return "\n".join(
    [
      f"{report.clip_line(s['qk_clip'])} (The record: {_source(path, docs)}.)\n",
      report.clip_table(s["qk_clip"]) + "\n",
    ]
  )


def gpu_probe(docs: pathlib.Path) -> str:
  """The GPU probes' records (``python -m experiments.gpu_probe``): each configuration's
  times, TFLOP/s, ratio to cuDNN on the same shape in the same run, and relative errors."""
  paths = _full_runs((docs / "gpu").glob("gpu_probe*.json"))
  if not paths:
    return _absent("a `gpu_probe` record in `docs/gpu/`", "gpu_probe")
  out = []
  for path in paths:
    record = _load(path)
    rows = record["rows"]
    cudnn: dict[tuple, dict] = {}
    for r in rows:  # cuDNN's row of the same section first, else of any section
      if r["method"] == "cudnn" and "error" not in r:
        cudnn.setdefault((r["H"], r["T"], r["causal"]), r)
        cudnn[r["section"], r["H"], r["T"], r["causal"]] = r

    def vs(row: dict, key: str) -> str:
      shape = (row["H"], row["T"], row["causal"])
      base = cudnn.get((row["section"], *shape), cudnn.get(shape, {})).get(key)
      return f"{base / row[key]:.2f}" if base and row.get(key) else "—"

    def cell(row: dict, key: str, spec: str) -> str:
      return format(row[key], spec) if row.get(key) is not None else "—"

    def err(row: dict, key: str) -> str:
      return f"{row[key]['rel']:.1e}" if key in row else "—"

    tiles = lambda row: " / ".join(_tiles(t) for t in _tile_list(row)) or "—"
    out += [
      f"From {_source(path, docs)}, {record['device']}, jax {record['jax']}, "
      f"{record['dtype']}, B={record['batch']}, N={record['heads']}, {record['seconds']:.0f} s; "
      "tiles: block_q x block_kv per pass (forward / dQ / dK/dV in a baseline row; the pass "
      "timed in a candidate row); × cuDNN = cuDNN's time / the row's, same shape, same run; "
      "errors ‖x − ref‖ / ‖ref‖ against float32 at the highest precision:\n",
      _table(
        ["section", "method", "H", "T", "causal", "tiles", "fwd ms", "fwd TF/s", "fwd × cuDNN"]
        + ["bwd ms", "bwd TF/s", "bwd × cuDNN", "fwd+bwd ms", "fwd+bwd × cuDNN"]
        + ["err out", "err dq", "err dk", "err dv"],
        [
          [r["section"], _probe_method(r)]
          + [str(r["H"]), f"{r['T']:,}", str(r["causal"]), tiles(r)]
          + [cell(r, "fwd_ms", ".3f"), cell(r, "fwd_tflops", ".0f"), vs(r, "fwd_ms")]
          + [cell(r, "bwd_ms", ".3f"), cell(r, "bwd_tflops", ".0f"), vs(r, "bwd_ms")]
          + [cell(r, "fwd_bwd_ms", ".3f"), vs(r, "fwd_bwd_ms")]
          + [err(r, "err_out"), err(r, "err_dq"), err(r, "err_dk"), err(r, "err_dv")]
          for r in rows
          if "error" not in r
        ],
      ),
    ]
    failed = [r for r in rows if "error" in r]
    out += [
      f"- {r['method']}, H={r['H']}, T={r['T']:,}, causal={r['causal']}: {r['error'][:120]}"
      for r in failed
    ]
    if record.get("skipped"):
      out.append("- skipped for time: " + "; ".join(record["skipped"]))
    out.append("")
  return "\n".join(out)


def _probe_method(row: dict) -> str:
  """A probe row's method, with its dtype where not bf16, its stressed inputs' case and its
  variant of flex's table (``flex, one_part_ds``)."""
  extra = [row[k] for k in ("dtype", "case", "variant") if k in row]
  return row["method"] + (f" ({', '.join(extra)})" if extra else "")


def _tiles(t: list[int]) -> str:
  """[block_q, block_kv, warps, stages] as ``128x64 w8 s3``."""
  return f"{t[0]}x{t[1]} w{t[2]} s{t[3]}"


def _tile_list(row: dict) -> list[list[int]]:
  """A probe row's tiles as a list of [block_q, block_kv, warps, stages]."""
  t = row.get("tiles") or []
  return [t] if t and isinstance(t[0], int) else t


# --- tables read from the library itself ----------------------------------------------------


def _summary(module_doc: str) -> str:
  """The first sentence of an implementation module's docstring, without its name."""
  first = " ".join((module_doc or "").split("\n\n")[0].split())
  if first.startswith("``implementation="):
    first = first.split(":", 1)[1].strip()
  return first


def implementations(docs: pathlib.Path) -> str:
  """The selection table's rows (jattn.impl.select.TABLE): what each implementation is,
  where it runs, its backward rules, the masks it expresses and how implementation=None
  reaches it; then, per row, the features it does not express and why."""
  del docs
  import importlib

  from jattn.impl import select

  rows, limits = [], []
  for name, row in select.TABLE.items():
    module = importlib.import_module(f"jattn.impl.{name}")  # each row's own module
    rules = ", ".join(f"`{b!r}`" for b in row.backwards) or "its own (`backward=None`)"
    if row.opt_in is not None:
      auto = f"never: an explicit opt-in ({row.opt_in})"
    elif row.fused:
      auto = "where it expresses the call, in table order"
    else:
      auto = "without a fused kernel, by the size of the scores"
    where = ", ".join(b.upper() for b in row.runs_on)
    cells = [f"`{name!r}`", _summary(module.__doc__ or ""), where, rules, row.masks, auto]
    rows.append([c.replace("|", "\\|") for c in cells])
    features = (
      ("bias", row.bias),
      ("score_fn", row.score_fn),
      ("logits_soft_cap", row.soft_cap),
      ("dropout", row.dropout),
      ("return_residual", row.residual),
      ("return_max_logit", row.max_logit),
      ("sinks", row.sinks),
    )
    missing = [f"{feature}: {why}" for feature, why in features if why is not None]
    if row.dtypes is not None:
      missing.append(f"dtypes: {', '.join(row.dtypes)} only")
    limits.append([f"`{name!r}`", "; ".join(missing) or "nothing"])
  header = ["`implementation`", "what it is", "where", "`backward`", "masks", "`None` picks it"]
  return (
    _table(header, rows)
    + "\nWhat each does not express (an explicit call raises with the reason):\n\n"
    + _table(["`implementation`", "does not take"], limits)
  )


# Tables read from the library's code, not from run records.
LIBRARY_TABLES: dict[str, Callable[[pathlib.Path], str]] = {"implementations": implementations}

TABLES: dict[str, Callable[[pathlib.Path], str]] = {
  **LIBRARY_TABLES,
  "bench": bench_timings,
  "bench_memory": bench_memory,
  "decode": decode,
  "vs_torch": vs_torch,
  "tiles": tiles,
  "scaling": scaling,
  "sparse": sparse,
  "parallel": parallel,
  "gpu": gpu,
  "gpu_probe": gpu_probe,
  "accuracy": accuracy,
  "demo": demo,
  "char_lm": char_lm,
  "char_lm_clip": char_lm_clip,
}


def write_tables(docs: pathlib.Path = DOCS, out: pathlib.Path | None = None) -> list[pathlib.Path]:
  """Write ``<name>.md`` under ``out`` (default docs/_generated) for every table."""
  out = out or docs / "_generated"
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, render in TABLES.items():
    path = out / f"{name}.md"
    text = "<!-- Written by python -m experiments.docs_tables; do not edit. -->\n\n" + render(docs)
    if not path.exists() or path.read_text() != text:  # unchanged files keep Sphinx's cache
      path.write_text(text)
    written.append(path)
  return written


# --- collecting runs ------------------------------------------------------------------------


def collect(runs: pathlib.Path, docs: pathlib.Path = DOCS) -> list[pathlib.Path]:
  """Copy the newest full run of each benchmark from ``runs`` into its folder of docs/."""
  copied: list[pathlib.Path] = []

  def copy(src: pathlib.Path, folder: str) -> None:
    dest = docs / folder / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    if dest not in copied:
      copied.append(dest)

  bench = _full_runs(runs.glob("bench-*.json"))
  for part in ("timings", "memory"):  # the newest run of each table: they may differ
    with_part = [p for p in bench if _load(p)[part]]
    if with_part:
      copy(with_part[-1], "bench")
  for prefix in ("bench_decode", "bench_torch", "bench_torch_long", "bench_tiles"):
    if (run := _newest(runs, f"{prefix}-*.json")) is not None:
      copy(run, "bench")
  for p in _full_runs(runs.glob("accuracy*.json")):
    copy(p, "accuracy")
  for p in _full_runs([*runs.glob("bench_gpu*.json"), *runs.glob("gpu_probe*.json")]):
    copy(p, "gpu")
  if (scaling_run := _newest(runs, "scaling-*/scaling.json")) is not None:
    copy(scaling_run, "scaling")
    if (scaling_run.parent / "scaling.png").exists():
      copy(scaling_run.parent / "scaling.png", "scaling")
  if (parallel_run := _newest(runs, "parallel-*/parallel.json")) is not None:
    copy(parallel_run, "parallel")
  for folder, plots in (("compare_backward", DEMO_PLOTS), ("char_lm", CHAR_LM_PLOTS)):
    run = runs / folder  # the run's directory: the config's output_dir/name
    if (run / "summary.json").exists():
      for name in ("summary.json", *plots):
        if (run / name).exists():
          copy(run / name, folder)
  return copied


def main(argv=None) -> None:
  parser = _cli.parser("docs_tables", __doc__, config=False, quick=None, out_dir=None)
  parser.add_argument(
    "--collect",
    nargs="?",
    const=str(ROOT / "runs"),
    metavar="RUNS",
    help="first copy the newest full run of each benchmark from RUNS (default runs/) into docs/",
  )
  args = parser.parse_args(argv)
  if args.collect:
    for path in collect(pathlib.Path(args.collect)):
      print(f"copied {path.relative_to(ROOT)}")
  for path in write_tables():
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
