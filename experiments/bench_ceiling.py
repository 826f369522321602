"""What bounds the blockwise forward pass on this CPU: its matmuls without the softmax.

Times, on the same float32 inputs and in interleaved rounds (see
experiments._timing.rounds_ms), the non-causal forward pass of

    jax.nn        jax.nn.dot_product_attention
    blockwise     jattn, implementation="blockwise"
    matmuls only  the same tile loop with the softmax taken out: for every query
                  tile and key/value tile, s = q kᵀ then acc += s v, at the
                  same tile sizes and layouts as the blockwise kernel
    matmul        one float32 matmul of size³, the machine's reference rate
    torch         PyTorch's fused CPU attention (scaled_dot_product_attention), when torch
                  is importable (the bench extra): the peer the cpu-speed targets name

and prints each one's GFLOP/s (4·B·N·T²·H for the attention rows), that rate as
a percentage of the matmul's, and the speedup over jax.nn. "matmuls only" is
the ceiling of any kernel written with XLA operations that keeps these tiles:
the softmax can only add to it. A torch row faster than "matmuls only" means no
kernel of XLA operations with these tiles can catch PyTorch's.

    python -m experiments.bench_ceiling                 # T=4096, B=1, N=8, H=64
    python -m experiments.bench_ceiling --length 1024 --block 256
    python -m experiments.bench_ceiling --quick         # tiny smoke test (CI)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _timing, bench
from jattn.impl import _tiling, blockwise


def tile_matmuls(block: int):
  """The blockwise forward's two matmuls per tile pair, with nothing between them."""

  def run(query, key, value):
    # The kernel's own tiling: (num_tiles, B, N, block, H), zero-padded.
    q_tiles, k_tiles, v_tiles = (_tiling.seq_tiles(x, block) for x in (query, key, value))
    n = k_tiles.shape[0]

    def query_tile(q_tile):
      def body(j, acc):
        s = jnp.einsum("BNqH,BNkH->BNqk", q_tile, k_tiles[j])
        return acc + jnp.einsum("BNqk,BNkH->BNqH", s, v_tiles[j])

      return jax.lax.fori_loop(0, n, body, jnp.zeros_like(q_tile))

    return jax.lax.map(query_tile, q_tiles)

  return run


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(
    prog="python -m experiments.bench_ceiling", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--length", type=int, default=4096, help="T = S")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", dest="head_dim", type=int, default=64)
  parser.add_argument(
    "--block",
    type=int,
    default=None,
    help="tile size for both the blockwise call and the matmul loop "
    "(default: blockwise's CPU default)",
  )
  parser.add_argument("--matmul-size", dest="matmul_size", type=int, default=2048)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (smoke test)")
  args = parser.parse_args(argv)
  if args.quick:
    args.length, args.heads, args.head_dim, args.block, args.matmul_size, args.reps = (
      48,
      2,
      8,
      16,
      64,
      2,
    )
  block = args.block or blockwise.default_blocks("cpu")[0]
  if args.length < 1 or block < 1:
    raise SystemExit(f"--length and --block must be positive, got {args.length} and {block}")
  block = min(block, args.length)

  rng = np.random.default_rng(0)
  shape = (args.batch, args.length, args.heads, args.head_dim)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(3))
  a = jnp.asarray(rng.standard_normal((args.matmul_size,) * 2, np.float32))
  fns = {
    "jax.nn": (jax.jit(jax.nn.dot_product_attention), (q, k, v)),
    "blockwise": (
      jax.jit(
        lambda q, k, v: jattn.dot_product_attention(
          q, k, v, implementation="blockwise", block_q=block, block_kv=block
        )
      ),
      (q, k, v),
    ),
    "matmuls only": (jax.jit(tile_matmuls(block)), (q, k, v)),
    "matmul": (jax.jit(lambda a: a @ a), (a,)),
  }
  if bench.torch_or_none() is not None:
    fns["torch"] = bench.torch_fn(False, "fwd", q, k, v)
  times = _timing.rounds_ms(fns, args.reps)
  work = 4.0 * args.batch * args.heads * args.length**2 * args.head_dim
  rate = lambda name: (2.0 * args.matmul_size**3 if name == "matmul" else work) / times[name]
  rows = [
    dict(
      method=name,
      ms=float(np.median(times[name])),
      gflops=float(np.median(rate(name))) / 1e6,
      pct_matmul=float(np.median(100.0 * rate(name) / rate("matmul"))),
      speedup=None if name == "matmul" else _timing.median_ratio(times["jax.nn"], times[name]),
    )
    for name in fns
  ]

  print(
    f"forward, non-causal, B={args.batch} T=S={args.length} N={args.heads} "
    f"H={args.head_dim} float32, tiles {block}x{block}, {jax.devices()[0].platform}, "
    f"medians of {args.reps} interleaved rounds\n"
  )
  print("| method | ms | GFLOP/s | % matmul | speedup over jax.nn |")
  print("|---|---|---|---|---|")
  for r in rows:
    speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}"
    print(
      f"| {r['method']} | {r['ms']:.1f} | {r['gflops']:.1f} | {r['pct_matmul']:.0f} | {speedup} |"
    )
  return rows


if __name__ == "__main__":
  main()
