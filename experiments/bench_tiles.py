"""Which tile sizes make the blockwise path fastest, per length, mask, pass and dtype.

For every dtype, sequence length T (= S), causal setting and pass (forward, or
forward+backward: gradients of q, k, v), times ``jattn.dot_product_attention``
with ``implementation="blockwise"`` at each (block_q, block_kv) of ``--tiles``
on the same inputs, in interleaved rounds (experiments/_timing.py: an untimed
call, then a block of back-to-back calls, the turns' order rotating from round
to round), and prints each tile pair's milliseconds and its speed over the
default tiles (the default's time / its time, the median of per-round ratios;
> 1: faster than the default). This is the experiment behind blockwise's
DEFAULT_BLOCKS and the "Tile sizes" section of docs/benchmarks.md.

    python -m experiments.bench_tiles                           # T=1024 and 4096, float32
    python -m experiments.bench_tiles --dtype bfloat16 --head-dim 128 --lengths 4096
    python -m experiments.bench_tiles --tiles 256x256 512x512 1024x512 --causal true
    python -m experiments.bench_tiles --quick                   # tiny smoke test (CI)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing, bench
from jattn.impl import blockwise  # internal: its default tile size

TILES = ("256x256", "256x512", "512x256", "512x512", "512x1024", "1024x512", "1024x1024")


def parse_tiles(text: str) -> tuple[int, int]:
  """ "QxK" -> (block_q, block_kv), both positive."""
  try:
    bq, bk = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"--tiles takes QxK pairs like 512x256, got {text!r}"
    ) from None
  if bq < 1 or bk < 1:
    raise argparse.ArgumentTypeError(f"--tiles sizes must be positive, got {text!r}")
  return bq, bk


def attention_fn(causal: bool, mode: str, block_q: int, block_kv: int):
  """The jitted forward, or the gradients of q, k, v of the output's float32 sum."""

  def attn(q, k, v):
    return jattn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="blockwise", block_q=block_q, block_kv=block_kv
    )

  return bench.jitted(attn, mode)


def main(argv=None) -> list[dict]:
  parser = _cli.parser(
    "bench_tiles",
    __doc__,
    config=False,
    quick="tiny shapes, 2 rounds (smoke test)",
    out_dir="where the JSON goes (default runs/; not written with --quick)",
    out_dir_default="runs",
  )
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="T = S")
  parser.add_argument("--causal", choices=("false", "true"), nargs="+", default=["false", "true"])
  parser.add_argument("--modes", choices=("fwd", "fwd_bwd"), nargs="+", default=["fwd", "fwd_bwd"])
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", dest="head_dim", type=int, default=64)
  parser.add_argument("--tiles", type=parse_tiles, nargs="+", default=None, help="QxK pairs")
  parser.add_argument("--reps", type=int, default=3, help="interleaved rounds")
  args = parser.parse_args(argv)
  default = blockwise.default_blocks("cpu")
  tiles = args.tiles or [parse_tiles(t) for t in TILES]
  min_seconds = 0.1  # each block of calls lasts about this long
  if args.quick:  # blocks of 3 calls: a smoke test times nothing it reports
    args.lengths, args.heads, args.head_dim, args.reps, min_seconds = [48], 2, 8, 2, 0.001
    default, tiles = (16, 16), [(16, 16), (16, 32), (32, 16)]
  if min(args.lengths) < 1:
    raise SystemExit(f"--lengths must be positive, got {args.lengths}")
  if default not in tiles:
    tiles = [default, *tiles]
  name = lambda t: f"{t[0]}x{t[1]}"

  rows = []
  for T in args.lengths:
    rng = np.random.default_rng(T)
    shape = (args.batch, T, args.heads, args.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), args.dtype) for _ in range(3))
    # Tiles larger than T are clipped to T: keep one of each distinct clipped pair.
    distinct = list(dict.fromkeys((min(bq, T), min(bk, T)) for bq, bk in tiles))
    base = (min(default[0], T), min(default[1], T))
    for causal in (c == "true" for c in args.causal):
      for mode in args.modes:
        fns = {name(t): (attention_fn(causal, mode, *t), (q, k, v)) for t in distinct}
        times = _timing.rounds_ms(fns, args.reps, min_seconds)
        cell = [
          dict(
            dtype=args.dtype,
            H=args.head_dim,
            T=T,
            causal=causal,
            mode=mode,
            block_q=t[0],
            block_kv=t[1],
            default=t == base,
            ms=float(np.median(times[name(t)])),
            vs_default=_timing.median_ratio(times[name(base)], times[name(t)]),
          )
          for t in distinct
        ]
        fastest = max(cell, key=lambda r: r["vs_default"])
        rows += [dict(r, best=r is fastest) for r in cell]

  print(
    f"blockwise, B={args.batch} N={args.heads} H={args.head_dim} {args.dtype}, "
    f"{jax.devices()[0].platform}, medians of {args.reps} interleaved rounds; "
    f"× default = the default {name(default)} tiles' time / these tiles' (> 1: faster)\n"
  )
  print("| T | causal | pass | tiles | ms | × default | best |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['T']} | {r['causal']} | {r['mode']} | {r['block_q']}x{r['block_kv']}"
      f"{' (default)' if r['default'] else ''} | {r['ms']:.1f} | {r['vs_default']:.2f} | "
      f"{'**best**' if r['best'] else ''} |"
    )
  if not args.quick:
    meta = _cli.facts("bench_tiles", argv)
    record = dict(meta=meta, args=vars(args) | {"tiles": tiles}, rows=rows)
    _cli.write_record(_cli.record_path(args.out_dir, "bench_tiles", quick=False), record)
  return rows


if __name__ == "__main__":
  main()
