"""What bounds the blockwise path on this CPU: its matmuls without the softmax.

Times, on the same float32 inputs and in interleaved rounds (see
experiments._timing.rounds_ms), the non-causal forward pass, or with
``--pass fwd_bwd`` the forward+backward (gradients of q, k, v), of

    jax.nn        jax.nn.dot_product_attention
    blockwise     jattn, implementation="blockwise"
    blockwise, masked
                  the same with a mask that keeps every position but, made with
                  masks.from_fn, leaves every tile PARTIAL: the cost of a masked tile's
                  mask arithmetic (a causal mask's diagonal tiles pay it)
    matmuls only  the same tile loops with the softmax taken out, at the same tile
                  sizes and layouts as the blockwise kernel. Forward: for every query
                  tile and key/value tile, s = q kᵀ then acc += s v. Forward+backward:
                  that loop, then jattn's backward's loops: a pass over the tiles for
                  Δ (s = q kᵀ, dp = dY vᵀ), and the gradient pass, key/value tiles
                  outside and query tiles inside (s, dp, dV += sᵀ dY, dQ += ds k,
                  dK += dsᵀ q): nine matmuls per tile pair
    matmuls, 7    forward+backward only: the same without the Δ pass, seven matmuls
                  per tile pair, as FlashAttention-2 and PyTorch's kernel do
    matmuls, q outside
                  forward+backward only: "matmuls only" with the gradient pass's loops
                  swapped, query tiles outside (the other loop order)
    matmul        one float32 matmul of size³, the machine's reference rate
    torch         PyTorch's fused CPU attention (scaled_dot_product_attention), when torch
                  is importable (the bench extra): the peer the cpu-speed targets name

and prints each one's GFLOP/s (4·B·N·T²·H for the attention rows, 3.5 times that
for forward+backward), that rate as a percentage of the matmul's, and the speedup
over jax.nn. "matmuls only" is the ceiling of any kernel written with XLA
operations that keeps these tiles: the softmax can only add to it. A torch row
faster than "matmuls only" means no kernel of XLA operations with these tiles can
catch PyTorch's.

    python -m experiments.bench_ceiling                 # T=4096, B=1, N=8, H=64
    python -m experiments.bench_ceiling --pass fwd_bwd --length 1024
    python -m experiments.bench_ceiling --length 1024 --block 256
    python -m experiments.bench_ceiling --quick         # tiny smoke test (CI)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing, bench
from jattn.impl import blockwise  # internal: its default tile size

KEEP_ALL = jattn.masks.from_fn(lambda b, h, q, kv: kv >= 0)


def seq_tiles(x, block: int):
  """(B, L, N, H) -> (ceil(L / block), B, N, block, H), zero-padded along L: the blockwise
  kernel's tiles of a sequence (as ``jattn.impl.tiling.seq_tiles``)."""
  B, L, N, H = x.shape
  n = -(-L // block)
  x = jnp.pad(x, ((0, 0), (0, n * block - L), (0, 0), (0, 0)))
  return x.reshape(B, n, block, N, H).transpose(1, 0, 3, 2, 4)


def tile_matmuls(block: int):
  """The blockwise forward's two matmuls per tile pair, with nothing between them."""

  def run(query, key, value):
    # The kernel's own tiling: (num_tiles, B, N, block, H), zero-padded.
    q_tiles, k_tiles, v_tiles = (seq_tiles(x, block) for x in (query, key, value))
    n = k_tiles.shape[0]

    def query_tile(q_tile):
      def body(j, acc):
        s = jnp.einsum("BNqH,BNkH->BNqk", q_tile, k_tiles[j])
        return acc + jnp.einsum("BNqk,BNkH->BNqH", s, v_tiles[j])

      return jax.lax.fori_loop(0, n, body, jnp.zeros_like(q_tile))

    return jax.lax.map(query_tile, q_tiles)

  return run


def tile_matmuls_grad(block: int, delta_pass: bool = True, kv_outside: bool = True):
  """:func:`tile_matmuls`, then the blockwise backward's matmuls with nothing between them:
  a Δ pass over the query tiles (when ``delta_pass``, as jattn's exact rule makes) and the
  gradient pass, with the layouts of blockwise._backward (dK and dV accumulate as (H, block)
  per head). ``kv_outside``: key/value tiles in the outer loop, as jattn and
  FlashAttention-2 run it (dK, dV in the inner carry, dQ added into its tile); else query
  tiles outside (dQ in the inner carry, dK and dV added into theirs)."""
  forward = tile_matmuls(block)

  def run(query, key, value, d_out):
    out = forward(query, key, value)
    q_tiles, k_tiles, v_tiles, do_tiles = (seq_tiles(x, block) for x in (query, key, value, d_out))
    n = k_tiles.shape[0]
    delta = jnp.sum(out * do_tiles, axis=-1, keepdims=True)
    if delta_pass:

      def delta_row(args):
        q_tile, do_tile = args

        def body(j, acc):
          s = jnp.einsum("BNqH,BNkH->BNqk", q_tile, k_tiles[j])
          dp = jnp.einsum("BNqH,BNkH->BNqk", do_tile, v_tiles[j])
          return acc + jnp.einsum("BNqk,BNqk->BNq", s, dp)[..., None]

        return jax.lax.fori_loop(0, n, body, jnp.zeros(q_tile.shape[:-1] + (1,), q_tile.dtype))

      delta = delta + jax.lax.map(delta_row, (q_tiles, do_tiles))

    def pair(i, j):
      """One tile pair's five matmuls: (dQ part (B, N, bq, H), dK and dV parts (B, N, H, bk))."""
      s = jnp.einsum("BNqH,BNkH->BNqk", q_tiles[i], k_tiles[j])
      dp = jnp.einsum("BNqH,BNkH->BNqk", do_tiles[i], v_tiles[j])
      d_v = jnp.einsum("BNqk,BNqH->BNHk", s, do_tiles[i])
      ds = s * (dp - delta[i])
      d_q = jnp.einsum("BNqk,BNkH->BNqH", ds, k_tiles[j])
      return d_q, jnp.einsum("BNqk,BNqH->BNHk", ds, q_tiles[i]), d_v

    kv_grads = jnp.zeros(k_tiles.shape[:3] + k_tiles.shape[:2:-1], k_tiles.dtype)  # (n,B,N,H,bk)
    if kv_outside:

      def kv_tile(d_q, j):
        def body(i, carry):
          d_k, d_v, d_q = carry
          dq_part, dk_part, dv_part = pair(i, j)
          return d_k + dk_part, d_v + dv_part, d_q.at[i].add(dq_part)

        d_k, d_v, d_q = jax.lax.fori_loop(0, n, body, (kv_grads[0], kv_grads[0], d_q))
        return d_q, (d_k, d_v)

      d_q, (d_k, d_v) = jax.lax.scan(kv_tile, jnp.zeros_like(q_tiles), jnp.arange(n))
      return d_q, d_k, d_v

    def q_tile(carry, i):
      def body(j, inner):
        d_q, d_k, d_v = inner
        dq_part, dk_part, dv_part = pair(i, j)
        return d_q + dq_part, d_k.at[j].add(dk_part), d_v.at[j].add(dv_part)

      d_q, d_k, d_v = jax.lax.fori_loop(0, n, body, (jnp.zeros_like(q_tiles[0]), *carry))
      return (d_k, d_v), d_q

    (d_k, d_v), d_q = jax.lax.scan(q_tile, (kv_grads, kv_grads), jnp.arange(n))
    return d_q, d_k, d_v

  return run


def main(argv=None) -> list[dict]:
  parser = _cli.parser(
    "bench_ceiling", __doc__, config=False, quick="tiny shapes, 2 rounds (smoke test)", out_dir=None
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
  parser.add_argument(
    "--pass", dest="mode", choices=("fwd", "fwd_bwd"), default="fwd", help="what to time"
  )
  args = parser.parse_args(argv)
  min_seconds = 0.1  # each block of calls lasts about this long
  if args.quick:  # blocks of 3 calls: a smoke test times nothing it reports
    args.length, args.heads, args.head_dim, args.block, args.matmul_size, args.reps = (
      48,
      2,
      8,
      16,
      64,
      2,
    )
    min_seconds = 0.001
  block = args.block or blockwise.default_blocks("cpu")[0]
  if args.length < 1 or block < 1:
    raise SystemExit(f"--length and --block must be positive, got {args.length} and {block}")
  block = min(block, args.length)

  rng = np.random.default_rng(0)
  shape = (args.batch, args.length, args.heads, args.head_dim)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(3))
  a = jnp.asarray(rng.standard_normal((args.matmul_size,) * 2, np.float32))
  attend: dict[str, Callable] = {
    "jax.nn": jax.nn.dot_product_attention,
    "blockwise": lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="blockwise", block_q=block, block_kv=block
    ),
    # Every position kept, but a from_fn mask's tiles are all PARTIAL: the same work plus
    # the mask arithmetic of a masked tile (what a causal mask's diagonal tiles pay).
    "blockwise, masked": lambda q, k, v: jattn.dot_product_attention(
      q, k, v, mask=KEEP_ALL, implementation="blockwise", block_q=block, block_kv=block
    ),
  }
  fns: dict[str, tuple[Callable, tuple]] = {
    name: (bench.jitted(f, args.mode), (q, k, v)) for name, f in attend.items()
  }
  if args.mode == "fwd":
    fns["matmuls only"] = (jax.jit(tile_matmuls(block)), (q, k, v))
  else:  # gradients of q, k, v of the output's sum, as experiments/bench.py times them
    ones = jnp.ones_like(q)
    fns["matmuls only"] = (jax.jit(tile_matmuls_grad(block)), (q, k, v, ones))
    fns["matmuls, 7"] = (jax.jit(tile_matmuls_grad(block, delta_pass=False)), (q, k, v, ones))
    fns["matmuls, q outside"] = (
      jax.jit(tile_matmuls_grad(block, kv_outside=False)),
      (q, k, v, ones),
    )
  fns["matmul"] = (jax.jit(lambda a: a @ a), (a,))
  if bench.torch_or_none() is not None:
    fns["torch"] = bench.torch_fn(False, args.mode, q, k, v)
  times = _timing.rounds_ms(fns, args.reps, min_seconds)
  work = 4.0 * args.batch * args.heads * args.length**2 * args.head_dim
  work *= 3.5 if args.mode == "fwd_bwd" else 1.0
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
    f"{'forward+backward' if args.mode == 'fwd_bwd' else 'forward'}, non-causal, "
    f"B={args.batch} T=S={args.length} N={args.heads} "
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
