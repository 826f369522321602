"""Time and measure jattn's blockwise and xla paths against jax.nn.dot_product_attention.

For every head dimension, sequence length T (= S) and causal setting of the
grid, and every dtype (float32, bfloat16), times the jitted forward pass and
forward+backward (gradients of q, k, v) of each method on the same inputs, in
one run. After a warm-up
call, the methods of one (T, pass), full and causal, take turns for ``reps``
rounds, together with a float32 matmul, so that the machine's drift during the run
hits all of them alike; each turn is an untimed call and then a block of
back-to-back calls lasting about 0.1 s (3 to 200), whose median counts, and
the order of turns rotates from round to round (experiments/_timing.py).
Methods:

    jax.nn     jax.nn.dot_product_attention (materialised, autodiff)
    xla        jattn, implementation="xla" (materialised, autodiff)
    blockwise  jattn, implementation="blockwise" (tiles, custom_vjp)
    auto       jattn, implementation=None (the documented auto rule)
    torch      PyTorch's torch.nn.functional.scaled_dot_product_attention (its fused
               CPU flash kernel), on (B, N, T, H) copies of the same inputs, with
               torch.set_num_threads = the cores JAX uses; only when torch is
               importable (pip install -e ".[bench]"), else its rows say so

Reports the median milliseconds, GFLOP/s (forward 4·B·N·T·S·H,
forward+backward 3.5 times that, both halved for causal), that rate as a
percentage of the matmul's GFLOP/s, and the speedup over jax.nn (jax.nn's
time / the method's time), and with torch in the run the speed over torch
(torch's time / the method's); percentage and speeds are medians of the
per-round ratios, each taken between turns of the same round. Then the peak process memory
(VmHWM) of forward+backward for the ``memory`` grid, each case in a fresh
subprocess so no case sees another's high-water mark. Prints markdown tables
and writes everything as JSON under runs/. Memory is in MiB (2**20 bytes), in the
tables and in the JSON's ``*_mb`` fields alike.

    python -m experiments.bench --config configs/bench.yaml   # README's tables
    python -m experiments.bench --lengths 1024 2048 --causal true --methods jax.nn blockwise
    python -m experiments.bench --quick                        # tiny smoke test (CI)

On a GPU or TPU, ``python -m experiments.bench_gpu`` is the benchmark to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _config, _timing
from experiments._config import ConfigError, Section, field
from experiments._memory import peak_rss_mb
from experiments._timing import fmt

METHODS = ("jax.nn", "xla", "blockwise", "auto", "torch")
MATERIALISING = ("jax.nn", "xla")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class MemoryConfig(Section):
  """The peak-memory cases: forward+backward, each in a fresh process."""

  SECTION: typing.ClassVar[str] = "memory."
  lengths: list[int] = field(factory=list, minimum=1, doc="sequence lengths; empty = none")
  causal: list[bool] = field(factory=lambda: [True])
  methods: list[str] = field(factory=lambda: ["blockwise"], choices=METHODS)


@dataclasses.dataclass(frozen=True)
class Config(Section):
  """The timing grid (every head dim x length x causal x method) and the memory cases."""

  batch: int = field(1, minimum=1)
  heads: int = field(8, minimum=1)
  kv_heads: int = field(8, minimum=1)
  head_dims: list[int] = field(factory=lambda: [64], minimum=1)
  dtypes: list[str] = field(factory=lambda: ["float32"], choices=DTYPES)
  lengths: list[int] = field(factory=lambda: [1024, 4096], minimum=1, doc="empty = none timed")
  causal: list[bool] = field(factory=lambda: [False, True])
  methods: list[str] = field(
    factory=lambda: ["jax.nn", "xla", "blockwise", "auto"], choices=METHODS
  )
  reps: int = field(5, minimum=1, doc="interleaved rounds; each method's block median per round")
  min_calls: int = field(
    3, minimum=1, doc="fewest timed calls in a block (1 suits calls of seconds, T = 16384)"
  )
  min_seconds: float = field(0.1, above=0, doc="each block of calls lasts about this long")
  max_materialised_bytes: int = field(
    2**30, minimum=0, doc="skip jax.nn and xla where their float32 scores exceed this"
  )
  matmul_size: int = field(2048, minimum=1, doc="the reference float32 matmul, size^3")
  memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
  out_dir: str = field("runs")
  record: str = field("bench", doc="the JSON record's file name prefix (runs/<record>-<time>.json)")

  def check(self) -> None:
    if self.heads % self.kv_heads:
      raise ConfigError(
        f"'heads' ({self.heads}) must be a multiple of 'kv_heads' ({self.kv_heads})"
      )


QUICK = dict(
  heads=2,
  kv_heads=2,  # bench_gpu.py --quick's shapes at T=32: a test process compiles them once
  head_dims=[8],
  lengths=[32],
  reps=2,
  min_seconds=0.001,  # blocks of min_calls: a smoke test times nothing it reports
  matmul_size=64,
  memory={"lengths": [64], "causal": [True], "methods": ["jax.nn", "blockwise"]},
)


def attention_fn(method: str, causal: bool):
  """(q, k, v) -> output, for one method (also "jax.nn/cudnn", "splash" and "flex", which
  bench_gpu.py times on a GPU or TPU)."""
  if method in ("jax.nn", "jax.nn/cudnn"):
    implementation: Literal["cudnn", "xla"] = "cudnn" if method == "jax.nn/cudnn" else "xla"
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation=implementation
    )
  names = {"xla": "xla", "blockwise": "blockwise", "splash": "splash", "flex": "flex"}
  impl: str | None = None if method == "auto" else names[method]
  return lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def jitted(attn: Callable, mode: str):
  """``attn(q, k, v)`` jitted: its forward (``mode="fwd"``), or (``"fwd_bwd"``) the gradients
  of q, k, v of its output's float32 sum, as every CPU benchmark here times them."""
  if mode == "fwd":
    return jax.jit(attn)
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), (0, 1, 2)))


@functools.cache
def compiled(method: str, causal: bool, mode: str):
  """:func:`jitted` for one method; one per process, so a call for shapes it has already
  compiled (bench_gpu.py's, say) reuses them."""
  return jitted(attention_fn(method, causal), mode)


def torch_or_none():
  """The torch module when it is importable, else None (torch is the optional bench extra)."""
  try:
    import torch
  except ImportError:
    return None
  return torch


def torch_fn(causal: bool, mode: str, q, k, v):
  """PyTorch's SDPA as ``(fn, args)`` for the timing rounds: (B, N, T, H) torch copies of the
  jax inputs made once here, ``torch.set_num_threads`` = the CPU cores JAX runs on."""
  torch = torch_or_none()
  assert torch is not None
  torch.set_num_threads(_cpu_cores())
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(q.dtype)]
  qt, kt, vt = (
    torch.from_numpy(np.array(x, np.float32)).to(dtype).transpose(1, 2).contiguous()
    for x in (q, k, v)
  )
  gqa = dict(enable_gqa=True) if qt.shape[1] != kt.shape[1] else {}
  sdpa = torch.nn.functional.scaled_dot_product_attention
  if mode == "fwd":

    def fwd(q, k, v):
      with torch.no_grad():
        return sdpa(q, k, v, is_causal=causal, **gqa)

    return fwd, (qt, kt, vt)
  leaves = tuple(x.detach().requires_grad_() for x in (qt, kt, vt))

  def fwd_bwd(q, k, v):
    out = sdpa(q, k, v, is_causal=causal, **gqa)
    return torch.autograd.grad(out.float().sum(), (q, k, v))

  return fwd_bwd, leaves


def _cpu_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def inputs(cfg: Config, T: int, H: int, dtype: str = "float32"):
  rng = np.random.default_rng(T + H)
  q = rng.standard_normal((cfg.batch, T, cfg.heads, H), np.float32)
  k, v = (rng.standard_normal((cfg.batch, T, cfg.kv_heads, H), np.float32) for _ in range(2))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def flops(cfg: Config, T: int, H: int, causal: bool, mode: str) -> float:
  f = 4.0 * cfg.batch * cfg.heads * T * T * H * (3.5 if mode == "fwd_bwd" else 1.0)
  return f / 2 if causal else f


def materialises_too_much(cfg: Config, method: str, T: int) -> bool:
  return method in MATERIALISING and 4 * cfg.batch * cfg.heads * T * T > cfg.max_materialised_bytes


def time_grid(cfg: Config) -> tuple[list[dict], float | None]:
  """The timing rows, and the matmul's GFLOP/s over the whole run (median of its turns)."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((cfg.matmul_size,) * 2, np.float32))
  matmul = (jax.jit(lambda a: a @ a), (a,))
  matmul_flops = 2.0 * cfg.matmul_size**3
  rows: list[dict] = []
  matmul_ms: list[float] = []
  have_torch = torch_or_none() is not None
  for dtype in cfg.dtypes:
    for H in cfg.head_dims:
      for T in cfg.lengths:
        q, k, v = inputs(cfg, T, H, dtype)
        # Full and causal calls share their rounds, so that the causal call's time over the
        # full one's (the causal target) is a ratio within each round as well.
        group: dict[tuple[bool, str], dict[str, Any]] = {
          (c, m): dict(dtype=dtype, H=H, T=T, causal=c, method=m)
          for c in cfg.causal
          for m in cfg.methods
        }
        for mode in ("fwd", "fwd_bwd"):
          fns: dict[str, tuple[Callable, tuple]] = {"matmul": matmul}
          for causal, m in group:
            if m == "torch":
              if have_torch:
                fns[f"{m} {causal}"] = torch_fn(causal, mode, q, k, v)
            elif not materialises_too_much(cfg, m, T):
              fns[f"{m} {causal}"] = (compiled(m, causal, mode), (q, k, v))
          times = _timing.rounds_ms(fns, cfg.reps, cfg.min_seconds, cfg.min_calls)
          matmul_ms.extend(times["matmul"])
          for (causal, m), row in group.items():
            ms = times.get(f"{m} {causal}")
            if ms is None:
              row.update({f"{mode}_ms": None, f"{mode}_speedup": None})
              if m == "torch" and not have_torch:
                row["note"] = "torch not installed (pip install -e '.[bench]')"
              continue
            ref, torch_ms = times.get(f"jax.nn {causal}"), times.get(f"torch {causal}")
            full_ms = times.get(f"{m} False") if causal else None
            work, median = flops(cfg, T, H, causal, mode), float(np.median(ms))
            row.update(
              {
                f"{mode}_ms": median,
                f"{mode}_gflops": work / median / 1e6,
                f"{mode}_pct_matmul": 100.0
                * float(np.median((work / ms) / (matmul_flops / times["matmul"]))),
                f"{mode}_speedup": None if ref is None else _timing.median_ratio(ref, ms),
                f"{mode}_vs_torch": None
                if torch_ms is None
                else _timing.median_ratio(torch_ms, ms),
                # causal time / full time, per round; the causal target is 2x this ≤ 1.15
                f"{mode}_vs_full": None if full_ms is None else _timing.median_ratio(ms, full_ms),
              }
            )
        rows.extend(group.values())
  if not matmul_ms:  # no lengths to time: only the memory cases
    return rows, None
  return rows, matmul_flops / float(np.median(matmul_ms)) / 1e6


def memory_case(cfg: Config, method: str, T: int, H: int, causal: bool) -> dict:
  """Runs in a fresh process: forward+backward once, peak RSS before and after."""
  q, k, v = inputs(cfg, T, H)
  jax.block_until_ready((q, k, v))
  before = peak_rss_mb()
  start = time.perf_counter()
  jax.block_until_ready(compiled(method, causal, "fwd_bwd")(q, k, v))
  seconds = time.perf_counter() - start
  peak = peak_rss_mb()
  return dict(
    method=method, T=T, H=H, causal=causal, seconds=seconds, peak_mb_before=before, peak_mb=peak
  )


def memory_grid(cfg: Config) -> list[dict]:
  """The ``memory`` cases, each in a child process given the resolved config."""
  rows = []
  for H in cfg.head_dims:
    for T in cfg.memory.lengths:
      for causal in cfg.memory.causal:
        for method in cfg.memory.methods:
          row = dict(method=method, T=T, H=H, causal=causal)
          if materialises_too_much(cfg, method, T):
            rows.append({**row, "skipped": "materialised scores exceed max_materialised_bytes"})
            continue
          case = json.dumps(dict(case=row, config=_config.to_dict(cfg)))
          cmd = [sys.executable, "-m", "experiments.bench", "--memory-case", case]
          proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=_cli.ROOT)
          if proc.returncode:
            rows.append({**row, "failed": proc.stderr.strip().splitlines()[-1:]})
          else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  return rows


def print_tables(cfg: Config, matmul: float, rows: list[dict], memory: list[dict]) -> None:
  print(
    f"B={cfg.batch} N={cfg.heads} K={cfg.kv_heads} {'/'.join(cfg.dtypes)}, "
    f"{jax.devices()[0].platform}, "
    f"medians of {cfg.reps} interleaved rounds; float32 matmul {cfg.matmul_size}³: "
    f"{fmt(matmul, '.1f')} GFLOP/s\n"
  )
  torch = "torch" in cfg.methods
  extra = " | fwd × torch | fwd+bwd × torch" if torch else ""
  print(
    "| dtype | H | T | causal | method | fwd ms | fwd GFLOP/s | % matmul | fwd speedup "
    f"| fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd speedup{extra} |"
  )
  print("|---" * (12 + 2 * torch) + "|")
  for r in rows:
    cells = (
      f"| {r.get('dtype', 'float32')} | {r['H']} | {r['T']} | {r['causal']} | {r['method']} | "
      f"{fmt(r.get('fwd_ms'), '.1f')} | {fmt(r.get('fwd_gflops'), '.1f')} | "
      f"{fmt(r.get('fwd_pct_matmul'), '.0f')} | {fmt(r.get('fwd_speedup'), '.2f')} | "
      f"{fmt(r.get('fwd_bwd_ms'), '.1f')} | {fmt(r.get('fwd_bwd_gflops'), '.1f')} | "
      f"{fmt(r.get('fwd_bwd_speedup'), '.2f')} |"
    )
    if torch:
      cells += f" {fmt(r.get('fwd_vs_torch'), '.2f')} | {fmt(r.get('fwd_bwd_vs_torch'), '.2f')} |"
    print(cells)
  if memory:
    print("\nforward+backward, one fresh process per case: peak process memory (VmHWM)\n")
    print("| H | T | causal | method | seconds | peak MiB before | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in memory:
      note = r.get("skipped") or r.get("failed")
      if note:
        print(f"| {r['H']} | {r['T']} | {r['causal']} | {r['method']} | {note} | — | — |")
        continue
      print(
        f"| {r['H']} | {r['T']} | {r['causal']} | {r['method']} | {r['seconds']:.1f} | "
        f"{r['peak_mb_before']:.0f} | {r['peak_mb']:.0f} |"
      )


def load_config(args) -> Config:
  """configs/…yaml (``--config``), the ``--quick`` settings, then the flags given."""
  causal = None if args.causal is None else [c == "true" for c in args.causal]
  return _cli.load_config(
    Config, args, QUICK, causal=causal, **{"memory.lengths": args.memory_lengths}
  )


def parse_args(argv=None) -> argparse.Namespace:
  parser = _cli.parser("bench", __doc__, quick="tiny shapes, 2 reps (smoke test)")
  parser.add_argument(
    "--lengths", type=int, nargs="*", help="sequence lengths to time (none: only the memory cases)"
  )
  parser.add_argument("--head-dims", dest="head_dims", type=int, nargs="+")
  parser.add_argument("--dtypes", nargs="+", help="float32 and/or bfloat16")
  parser.add_argument("--causal", nargs="+", choices=["true", "false"])
  parser.add_argument("--methods", nargs="+")
  parser.add_argument("--reps", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", dest="kv_heads", type=int)
  parser.add_argument(
    "--memory-lengths",
    type=int,
    nargs="*",
    help="sequence lengths for the peak-memory cases (none: skip them)",
  )
  parser.add_argument("--memory-case", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def accelerator_note(backend: str, quick: bool) -> str | None:
  """The line that points a GPU or TPU user at bench_gpu.py (not for --quick)."""
  if backend == "cpu" or quick:
    return None
  return (
    f"On a {backend.upper()}, run `python -m experiments.bench_gpu` for the accelerator table "
    "(cuDNN or splash, bf16 and f32, TFLOP/s and % of peak); this one is sized for a CPU."
  )


def main(argv=None):
  args = parse_args(argv)
  if args.memory_case:  # the child process of memory_grid
    given = json.loads(args.memory_case)
    case, cfg = given["case"], _config.from_dict(Config, given["config"])
    print(json.dumps(memory_case(cfg, case["method"], case["T"], case["H"], case["causal"])))
    return None
  cfg = _cli.config_or_exit("bench", load_config, args)
  if note := accelerator_note(jax.default_backend(), args.quick):
    print(note + "\n")

  rows, matmul = time_grid(cfg)
  memory = memory_grid(cfg)
  print_tables(cfg, matmul, rows, memory)
  record = dict(
    **_cli.facts("bench", argv),
    config=_config.to_dict(cfg),
    matmul_gflops=matmul,
    timings=rows,
    memory=memory,
  )
  _cli.write_record(_cli.record_path(cfg.out_dir, cfg.record, args.quick), record)
  return record


if __name__ == "__main__":
  main()
