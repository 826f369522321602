"""Time jattn's paths against jax.nn's XLA and cuDNN kernels on a GPU.

For each dtype, sequence length T (= S) and causal setting, times the jitted
forward pass and forward+backward (gradients of q, k, v) of each method on the
same inputs, the methods taking turns in every round (``experiments._timing.rounds_ms``),
and reports the median milliseconds, TFLOP/s (forward 4·B·N·T·S·H,
forward+backward 3.5 times that, halved when causal) and the speedup over
jax.nn's XLA path (median of per-round ratios). Also the scratch memory XLA
plans for each compiled program (``memory_analysis().temp_size_in_bytes``),
which on a GPU is the activation memory the method needs beyond its inputs and
outputs, in MiB (2**20 bytes; the rows' ``*_scratch_mb``). Methods:

    jax.nn        jax.nn.dot_product_attention(implementation="xla")
    jax.nn/cudnn  jax.nn.dot_product_attention(implementation="cudnn") (bf16/f16 only)
    xla           jattn, implementation="xla" (materialised, autodiff)
    blockwise     jattn, implementation="blockwise" (tiles, custom_vjp)
    auto          jattn, implementation=None

    python -m experiments.bench_gpu                      # the grid below, on the default backend
    python -m experiments.bench_gpu --lengths 1024 --dtypes bfloat16 --reps 3
    python -m experiments.bench_gpu --quick              # tiny shapes, any backend (smoke test)
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _timing
from experiments._timing import fmt
from experiments.bench import compiled

METHODS = ("jax.nn", "jax.nn/cudnn", "xla", "blockwise", "auto")


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(
    prog="python -m experiments.bench_gpu", description=__doc__.splitlines()[0]
  )
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", dest="head_dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--methods", nargs="+", default=list(METHODS))
  p.add_argument(
    "--max-scores-gib",
    dest="max_scores_gib",
    type=float,
    default=16.0,
    help="skip materialising methods whose float32 scores exceed this many GiB (2**30 bytes)",
  )
  p.add_argument("--quick", action="store_true")
  p.add_argument("--json", help="also write the rows here")
  args = p.parse_args(argv)
  if args.quick:
    args.lengths, args.heads, args.head_dim, args.reps = [32], 2, 8, 2
    args.dtypes = args.dtypes if jax.default_backend() == "gpu" else ["float32"]
  gpu = jax.default_backend() == "gpu"
  B, N, H = args.batch, args.heads, args.head_dim
  print(
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}, B={B} N={N} H={H}, "
    f"medians of {args.reps} interleaved rounds\n"
  )
  print(
    "| dtype | T | causal | method | fwd ms | fwd TFLOP/s | fwd speedup | fwd scratch MiB "
    "| fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd speedup | fwd+bwd scratch MiB |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for dtype in args.dtypes:
    for T in args.lengths:
      rng = np.random.default_rng(T)
      q, k, v = (
        jnp.asarray(rng.standard_normal((B, T, N, H), np.float32), dtype) for _ in range(3)
      )
      for causal in (False, True):
        methods = [
          m
          for m in args.methods
          if (m != "jax.nn/cudnn" or (gpu and dtype in ("bfloat16", "float16")))
          and not (m in ("jax.nn", "xla") and 4 * B * N * T * T > args.max_scores_gib * 2**30)
        ]
        group = {m: dict(dtype=dtype, T=T, causal=causal, method=m) for m in methods}
        for mode in ("fwd", "fwd_bwd"):
          fns = {}
          for m in methods:
            try:  # compiled once: the program whose memory is read is the one timed
              fn = compiled(m, causal, mode).lower(q, k, v).compile()
            except Exception as e:  # noqa: BLE001 -- a method the backend cannot run
              group[m][f"{mode}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
              continue
            group[m][f"{mode}_scratch_mb"] = fn.memory_analysis().temp_size_in_bytes / 2**20
            fns[m] = (fn, (q, k, v))
          times = _timing.rounds_ms(fns, args.reps)
          work = (
            4.0 * B * N * T * T * H * (3.5 if mode == "fwd_bwd" else 1.0) / (2 if causal else 1)
          )
          for m, ms in times.items():
            group[m][f"{mode}_ms"] = float(np.median(ms))
            group[m][f"{mode}_tflops"] = work / float(np.median(ms)) / 1e9
            if "jax.nn" in times:
              group[m][f"{mode}_speedup"] = _timing.median_ratio(times["jax.nn"], ms)
        for r in group.values():
          f = lambda key, spec: (  # a missing cell shows why: its pass's error, if any
            fmt(r[key], spec) if key in r else r.get(key.rsplit("_", 1)[0] + "_error", "—")
          )
          print(
            f"| {dtype} | {T} | {causal} | {r['method']} | {f('fwd_ms', '.2f')} | "
            f"{f('fwd_tflops', '.0f')} | {f('fwd_speedup', '.2f')} | "
            f"{f('fwd_scratch_mb', '.0f')} | {f('fwd_bwd_ms', '.2f')} | "
            f"{f('fwd_bwd_tflops', '.0f')} | {f('fwd_bwd_speedup', '.2f')} | "
            f"{f('fwd_bwd_scratch_mb', '.0f')} |",
            flush=True,
          )
          rows.append(r)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
