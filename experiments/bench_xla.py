"""Time jattn's materialised path against jax.nn.dot_product_attention, in one run.

For each sequence length and causal setting, times the jitted forward pass and
forward+backward (gradients of q, k, v) of jax.nn, jattn with
backward="autodiff" and jattn with backward="custom_vjp", on the same inputs:
warm-up, then the median of --reps runs. Prints a markdown table with
milliseconds and each time as a ratio of jax.nn's (below 1 is faster).

    python experiments/bench_xla.py                 # B=1, N=8, H=64, T=512,1024,2048
    python experiments/bench_xla.py --quick         # tiny shapes, a smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

import jattn


def _time(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def _candidates(causal: bool):
  return {
      "jax.nn": functools.partial(jax.nn.dot_product_attention, is_causal=causal),
      "jattn autodiff": functools.partial(jattn.dot_product_attention, is_causal=causal,
                                          backward="autodiff"),
      "jattn custom_vjp": functools.partial(jattn.dot_product_attention, is_causal=causal,
                                            backward="custom_vjp"),
  }


def run(lengths, *, batch: int, heads: int, kv_heads: int, head_dim: int, reps: int):
  rows = []
  for T in lengths:
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (batch, T, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, T, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, T, kv_heads, head_dim))
    for causal in (False, True):
      base = {}
      for name, attn in _candidates(causal).items():
        fwd = jax.jit(attn)
        fwd_bwd = jax.jit(jax.grad(lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v)), (0, 1, 2)))
        times = (_time(fwd, q, k, v, reps=reps), _time(fwd_bwd, q, k, v, reps=reps))
        base.setdefault("t", times)
        rows.append((T, causal, name, *times, *(t / b for t, b in zip(times, base["t"]))))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 reps (smoke test)")
  args = parser.parse_args(argv)
  if args.quick:
    args.lengths, args.heads, args.kv_heads, args.head_dim, args.reps = [32], 2, 1, 8, 2
  rows = run(args.lengths, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
             head_dim=args.head_dim, reps=args.reps)
  print(f"B={args.batch} N={args.heads} K={args.kv_heads} H={args.head_dim} float32, "
        f"{jax.devices()[0].platform}, median of {args.reps}\n")
  print("| T | causal | implementation | fwd ms | fwd+bwd ms | fwd / jax.nn | fwd+bwd / jax.nn |")
  print("|---|---|---|---|---|---|---|")
  for T, causal, name, fwd, fwd_bwd, r_fwd, r_fwd_bwd in rows:
    print(f"| {T} | {causal} | {name} | {fwd:.1f} | {fwd_bwd:.1f} | {r_fwd:.2f} | "
          f"{r_fwd_bwd:.2f} |")
  return rows


if __name__ == "__main__":
  main()
