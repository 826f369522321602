"""How time and memory grow with sequence length: full, windowed, sparse and linear attention.

For each length T (= S) of the grid, on the same float32 inputs (B, T, N, H)
in one run, compiles each method ahead of time and records

- the bytes XLA allocates for one call (temporaries and outputs, from the
  compiled program's memory analysis; inputs are the same for every method),
  so memory is known even where a call would not fit, and
- the median milliseconds per call (``ms``), where its allocation fits under
  ``max_bytes`` and the previous length's time, scaled by the method's
  expected growth, stays under ``max_call_seconds``: after a warm-up call and
  one timed call, the median of a block of back-to-back calls (at least
  ``reps``, lasting about ``min_seconds``) after an untimed one, as every
  benchmark here times (``experiments/_timing.py``); a call slower than
  ``once_seconds`` is timed once, after its warm-up call (``calls`` says which).

Methods (``causal`` applies to all of them):

    jax.nn     jax.nn.dot_product_attention (materialised T x S scores)
    xla        jattn.dot_product_attention, implementation="xla"
    blockwise  jattn.dot_product_attention, implementation="blockwise"
    window     blockwise with a sliding window of ``window`` positions each side
    linear     jattn.linear_attention, elu+1 features (causal: chunked scan)

Then it fits the slope of log(time) and log(memory) against log(T) for each
method over the lengths >= ``fit_from`` (about 2 for full attention, about 1
for the window and linear attention), finds the length where linear attention
becomes faster than blockwise softmax attention (interpolated on the log-log
curves), prints each method's time relative to jax.nn at every length where
both ran, and draws ``scaling.png`` (log-log; needs matplotlib).

A second table shows that blockwise attention costs in proportion to the tiles
a sparse mask touches: at ``sparse.length`` it times each pattern of
``sparse.patterns`` and prints the fraction of (query tile, key/value tile)
pairs it visits next to its time relative to the dense blockwise call.

    python -m experiments.bench_scaling --config configs/bench_scaling.yaml
    python -m experiments.bench_scaling --lengths 1024 4096 --methods blockwise linear --no-sparse
    python -m experiments.bench_scaling --config configs/bench_scaling.yaml --causal
    python -m experiments.bench_scaling --quick     # tiny smoke test (CI)

Writes ``runs/scaling-<time>/scaling.json`` and ``scaling.png``. Memory is in MiB
(2**20 bytes), in the tables and in the JSON's ``mem_mb`` alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _config, _timing
from experiments._config import ConfigError, Section, field
from experiments._timing import fmt
from jattn import masks
from jattn.impl import blockwise as _blockwise  # internal: its default tile size

METHODS = ("jax.nn", "xla", "blockwise", "window", "linear")
GROWTH = {"jax.nn": 2, "xla": 2, "blockwise": 2, "window": 1, "linear": 1}  # time ~ T**growth
PATTERNS = ("dense", "causal", "window", "longformer", "bigbird", "strided")


@dataclasses.dataclass(frozen=True)
class SparseConfig(Section):
  """The blockwise path with sparse masks at one length."""

  SECTION: typing.ClassVar[str] = "sparse."
  length: int = field(16384, minimum=1)
  block: int | None = field(None, minimum=1, doc="square tiles; null = the backend's default")
  patterns: list[str] = field(factory=list, choices=PATTERNS, doc="empty = no sparse table")


@dataclasses.dataclass(frozen=True)
class Config(Section):
  """The length grid, its methods and limits, and the sparse-mask table."""

  batch: int = field(1, minimum=1)
  heads: int = field(8, minimum=1)
  head_dim: int = field(64, minimum=1)
  lengths: list[int] = field(factory=lambda: [1024, 2048, 4096, 8192], minimum=1)
  methods: list[str] = field(factory=lambda: list(METHODS), choices=METHODS)
  causal: bool = field(False, doc="causal attention for every method")
  window: int = field(256, minimum=1, doc="the sliding window: positions on each side")
  reps: int = field(3, minimum=1, doc="at least this many timed calls per block")
  min_seconds: float = field(0.5, minimum=0.0, doc="short calls repeat until a block lasts this")
  max_bytes: int = field(8 * 2**30, minimum=0, doc="no call where XLA would allocate more")
  max_call_seconds: float = field(
    150.0, above=0.0, doc="no call where the previous length's time predicts more"
  )
  once_seconds: float = field(
    10.0, above=0.0, doc="a call slower than this is timed once, after its warm-up call"
  )
  fit_from: int = field(4096, minimum=1, doc="slopes over T >= this")
  sparse: SparseConfig = dataclasses.field(default_factory=SparseConfig)
  out_dir: str = field("runs")

  def check(self) -> None:
    if any(a >= b for a, b in zip(self.lengths, self.lengths[1:])):
      raise ConfigError(f"'lengths' must be increasing, got {self.lengths}")


QUICK = dict(
  heads=2,
  head_dim=8,
  lengths=[64, 256],
  reps=1,
  min_seconds=0.0,
  window=16,
  fit_from=64,
  sparse={"length": 256, "block": 32, "patterns": ["dense", "causal", "bigbird"]},
)


def attention_fn(cfg: Config, method: str):
  """(q, k, v) -> output for one method."""
  causal = cfg.causal
  match method:
    case "jax.nn":
      return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    case "xla" | "blockwise":
      return lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=method
      )
    case "window":
      window = (cfg.window, 0 if causal else cfg.window)
      return lambda q, k, v: jattn.dot_product_attention(
        q, k, v, local_window_size=window, implementation="blockwise"
      )
    case "linear":
      return lambda q, k, v: jattn.linear_attention(q, k, v, feature_map="elu+1", is_causal=causal)
    case _:
      raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}")


def inputs(cfg: Config, T: int):
  rng = np.random.default_rng(T)
  shape = (cfg.batch, T, cfg.heads, cfg.head_dim)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(3))


def call_bytes(compiled) -> int | None:
  """Temporaries plus outputs XLA allocates for one call (None if the backend won't say)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def call_ms(compiled, args, cfg: Config) -> tuple[float, int]:
  """Median milliseconds per call of an ahead-of-time compiled function, and how many calls
  that median is of (``_timing.sized_block_ms``: at least ``reps`` calls lasting about
  ``min_seconds``; a call slower than ``once_seconds`` timed once)."""
  return _timing.sized_block_ms(
    compiled, args, min_calls=cfg.reps, min_seconds=cfg.min_seconds, once_seconds=cfg.once_seconds
  )


def measure(cfg: Config, on_row=lambda row: None) -> list[dict]:
  rows: list[dict] = []
  last: dict = {}
  for T in cfg.lengths:
    args = inputs(cfg, T)
    for method in cfg.methods:
      row = dict(method=method, T=T, ms=None, calls=0, mem_mb=None, skipped=None)
      compiled = jax.jit(attention_fn(cfg, method)).lower(*args).compile()
      nbytes = call_bytes(compiled)
      row["mem_mb"] = None if nbytes is None else nbytes / 2**20
      predicted = None
      if method in last:
        prev_T, prev_ms = last[method]
        predicted = prev_ms / 1e3 * (T / prev_T) ** GROWTH[method]
      if nbytes is not None and nbytes > cfg.max_bytes:
        row["skipped"] = f"needs {nbytes / 2**30:.1f} GiB > max_bytes"
      elif predicted is not None and predicted > cfg.max_call_seconds:
        row["skipped"] = f"predicted {predicted:.0f} s > max_call_seconds"
      else:
        row["ms"], row["calls"] = call_ms(compiled, args, cfg)
        last[method] = (T, row["ms"])
      del compiled
      rows.append(row)
      on_row(row)
  return rows


def slope(points: list[tuple[float, float]]) -> float | None:
  """Least-squares slope of log(y) against log(x); None with fewer than two points."""
  points = [(x, y) for x, y in points if y is not None and y > 0]
  if len(points) < 2:
    return None
  x, y = (np.log([p[i] for p in points]) for i in (0, 1))
  return float(np.polyfit(x, y, 1)[0])


def fit(cfg: Config, rows: list[dict]) -> dict:
  out = {}
  for method in cfg.methods:
    mine = [r for r in rows if r["method"] == method and r["T"] >= cfg.fit_from]
    out[method] = dict(
      time_slope=slope([(r["T"], r["ms"]) for r in mine]),
      mem_slope=slope([(r["T"], r["mem_mb"]) for r in mine]),
    )
  return out


def crossover(rows: list[dict], fast: str = "linear", slow: str = "blockwise") -> dict:
  """The length where ``fast`` first takes less time than ``slow``, interpolated between the
  grid's lengths on log-log axes; ``below``/``above`` when it is outside the measured range."""
  times: dict = {}
  for r in rows:
    if r["ms"] is not None and r["method"] in (fast, slow):
      times.setdefault(r["T"], {})[r["method"]] = r["ms"]
  both = sorted((T, t[fast], t[slow]) for T, t in times.items() if len(t) == 2)
  if not both:
    return dict(length=None, note=f"no length where both {fast} and {slow} ran")
  ratios = [(T, math.log(f / s)) for T, f, s in both]  # < 0: fast is faster
  if ratios[0][1] < 0:
    return dict(
      length=None, note=f"{fast} is already faster at the shortest length, T={ratios[0][0]}"
    )
  for (t0, r0), (t1, r1) in zip(ratios, ratios[1:]):
    if r1 < 0:
      frac = r0 / (r0 - r1)
      length = math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0)))
      return dict(length=round(length), note=f"between T={t0} and T={t1}")
  return dict(length=None, note=f"{slow} is still faster at the longest length, T={ratios[-1][0]}")


# --- sparse patterns ------------------------------------------------------------------


def sparse_mask(name: str, T: int, block: int, window: int):
  match name:
    case "dense":
      return None
    case "causal":
      return masks.causal()
    case "window":
      return masks.sliding_window(window, window)
    case "longformer":
      return masks.longformer(window // 2, num_global=block // 4, dilation=2)
    case "bigbird":
      return masks.bigbird(T, block_size=block, num_global_blocks=1, num_random_blocks=2, seed=0)
    case "strided":
      return masks.strided(8)
    case _:
      raise ValueError(f"unknown sparse pattern {name!r}")


def tiles_visited(mask, cfg: Config, T: int, block: int) -> float:
  """The fraction of (query tile, key/value tile) pairs the blockwise kernel visits: those
  not EMPTY for some batch row and head (``Mask.block_view``)."""
  if mask is None:
    return 1.0
  view = mask.block_view(
    T, T, block_q=block, block_kv=block, batch_size=cfg.batch, num_heads=cfg.heads
  )
  return float(np.mean(np.any(np.asarray(view) != masks.EMPTY, axis=(0, 1))))


def sparse_table(cfg: Config) -> list[dict]:
  """Blockwise time of each pattern at one length, next to the fraction of tiles it visits."""
  sp = cfg.sparse
  if not sp.patterns:
    return []
  T = sp.length
  block = sp.block or _blockwise.default_blocks(jax.default_backend())[0]
  args = inputs(cfg, T)
  rows: list[dict[str, Any]] = []
  for name in sp.patterns:
    mask = sparse_mask(name, T, block, cfg.window)
    visited = tiles_visited(mask, cfg, T, block)
    fn = jax.jit(
      lambda q, k, v, mask=mask: jattn.dot_product_attention(
        q, k, v, mask=mask, implementation="blockwise", block_q=block, block_kv=block
      )
    )
    ms, calls = call_ms(fn.lower(*args).compile(), args, cfg)
    rows.append(dict(pattern=name, T=T, block=block, tiles_visited=visited, ms=ms, calls=calls))
  dense = next((r["ms"] for r in rows if r["pattern"] == "dense"), None)
  for r in rows:
    r["time_vs_dense"] = None if dense is None else r["ms"] / dense
  return rows


# --- output -------------------------------------------------------------------------


def print_tables(cfg: Config, rows, fits, cross, sparse) -> None:
  kind = "causal" if cfg.causal else "non-causal"
  print(
    f"\nB={cfg.batch} N={cfg.heads} H={cfg.head_dim} float32 {kind} forward, "
    f"{jax.devices()[0].platform}; window ±{cfg.window}\n"
  )
  print("| T | method | ms | × jax.nn time | MiB allocated | note |")
  print("|---|---|---|---|---|---|")
  ref = {r["T"]: r["ms"] for r in rows if r["method"] == "jax.nn"}
  for r in rows:
    ratio = r["ms"] / ref[r["T"]] if r["ms"] and ref.get(r["T"]) else None
    print(
      f"| {r['T']} | {r['method']} | {fmt(r['ms'], '.1f')} | {fmt(ratio, '.3f')} "
      f"| {fmt(r['mem_mb'], '.1f')} | {r['skipped'] or ''} |"
    )
  print(f"\nlog-log slopes over T >= {cfg.fit_from}:\n")
  print("| method | time slope | memory slope |")
  print("|---|---|---|")
  for method, f in fits.items():
    print(f"| {method} | {fmt(f['time_slope'], '.2f')} | {fmt(f['mem_slope'], '.2f')} |")
  print(
    f"\nlinear attention overtakes blockwise softmax at T ≈ {fmt(cross['length'], 'd')} "
    f"({cross['note']})"
  )
  if sparse:
    print(
      f"\nblockwise with sparse masks at T={sparse[0]['T']}, tiles "
      f"{sparse[0]['block']}x{sparse[0]['block']}:\n"
    )
    print("| pattern | tiles visited | ms | time / dense |")
    print("|---|---|---|---|")
    for r in sparse:
      print(
        f"| {r['pattern']} | {r['tiles_visited']:.3f} | {r['ms']:.1f} "
        f"| {fmt(r['time_vs_dense'], '.3f')} |"
      )


def plot(cfg: Config, rows, fits, path: pathlib.Path) -> pathlib.Path | None:
  try:
    from matplotlib.figure import Figure
  except ImportError:
    print("matplotlib is not installed: no plot (pip install -e '.[viz]')")
    return None
  fig = Figure(figsize=(11, 4.2), layout="constrained")
  axes = fig.subplots(1, 2)
  for ax, key, what in (
    (axes[0], "ms", "forward time (ms)"),
    (axes[1], "mem_mb", "memory XLA allocates (MiB)"),
  ):
    for method in cfg.methods:
      pts = [(r["T"], r[key]) for r in rows if r["method"] == method and r[key]]
      if not pts:
        continue
      s = fits[method]["time_slope" if key == "ms" else "mem_slope"]
      label = method if s is None else f"{method} (slope {s:.2f})"
      ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(what)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  kind = "causal" if cfg.causal else "non-causal"
  fig.suptitle(
    f"attention cost against length: B={cfg.batch}, N={cfg.heads}, "
    f"H={cfg.head_dim}, {kind}, {jax.devices()[0].platform}"
  )
  fig.savefig(path, dpi=110)
  return path


def load_config(args) -> Config:
  """configs/…yaml (``--config``), the ``--quick`` settings, then the flags given."""
  return _cli.load_config(
    Config, args, QUICK, **{"sparse.patterns": [] if args.no_sparse else None}
  )


def parse_args(argv=None) -> argparse.Namespace:
  parser = _cli.parser("bench_scaling", __doc__, out_dir="parent of the run folder (default runs/)")
  parser.add_argument("--lengths", type=int, nargs="+")
  parser.add_argument("--methods", nargs="+")
  parser.add_argument("--reps", type=int)
  parser.add_argument(
    "--causal", action="store_true", default=None, help="causal attention for every method"
  )
  parser.add_argument(
    "--no-sparse", dest="no_sparse", action="store_true", help="skip the sparse-mask table"
  )
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = _cli.config_or_exit("bench_scaling", load_config, args)
  path = _cli.record_path(cfg.out_dir, "scaling", args.quick, "scaling.json")
  rows = measure(
    cfg,
    on_row=lambda r: print(
      f"T={r['T']:>6} {r['method']:>9}: {fmt(r['ms'], '10.1f')} ms "
      f"{fmt(r['mem_mb'], '10.1f')} MiB {r['skipped'] or ''}",
      flush=True,
    ),
  )
  fits = fit(cfg, rows)
  cross = (
    crossover(rows)
    if {"linear", "blockwise"} <= set(cfg.methods)
    else dict(length=None, note="needs both linear and blockwise")
  )
  sparse = sparse_table(cfg)
  print_tables(cfg, rows, fits, cross, sparse)
  png = plot(cfg, rows, fits, path.parent / "scaling.png")
  record: dict = dict(
    **_cli.facts("bench_scaling", argv),
    config=_config.to_dict(cfg),
    rows=rows,
    fits=fits,
    crossover=cross,
    sparse=sparse,
    plot=None if png is None else str(png),
  )
  _cli.write_record(path, record, f" and {png}" if png else "")
  return record


if __name__ == "__main__":
  main()
