"""Tune the flex kernel's tiles on a GPU: time each (block_q, block_kv) candidate.

For each head dim H and dtype, times ``implementation="flex"``'s jitted forward and
forward+backward (gradients of q, k, v) on causal inputs of length T for every candidate
tile pair, the candidates taking turns in every round (``experiments._timing.rounds_ms``),
and prints the median milliseconds of each, the table's current pick (``default``: the
call without ``block_q``/``block_kv``) among them, and the fastest pair by forward+backward
time: the blocks to put in ``TILES`` of ``jattn/impl/flex/__init__.py`` for this GPU's generation
(its warps and stages stay the table's). Candidates that fail to compile on the GPU (shared
memory, registers) are reported as such and skipped.

    python -m experiments.tune_flex                          # H 64 and 128, bf16, T 4096
    python -m experiments.tune_flex --head-dims 128 --dtypes bfloat16 float32 --length 8192
    python -m experiments.tune_flex --quick                  # tiny shapes, interpret mode on CPU
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing
from experiments._timing import fmt

CANDIDATES = (16, 32, 64, 128)  # per axis; pairs above 128 x 128 leave the registers


def step(block_q: int | None, block_kv: int | None, backward: bool) -> Any:
  """The jitted forward (or forward+backward) of a causal flex call with these tiles."""

  def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation="flex", block_q=block_q, block_kv=block_kv
    )

  if not backward:
    return jax.jit(attend)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1, 2)))


def _name(pair: tuple[int | None, int | None], backward: bool) -> str:
  return f"{pair[0]}x{pair[1]} {'fwd+bwd' if backward else 'fwd'}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  p = _cli.parser(
    "tune_flex", __doc__, config=False, quick="tiny shapes, interpret mode on CPU", out_dir=None
  )
  p.add_argument("--head-dims", dest="head_dims", type=int, nargs="+", default=[64, 128])
  p.add_argument("--dtypes", nargs="+", default=["bfloat16"])
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--blocks", type=int, nargs="+", default=list(CANDIDATES))
  p.add_argument("--reps", type=int, default=5)
  args = p.parse_args(argv)
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  min_seconds = 0.1
  interpret: Any = contextlib.nullcontext()
  if args.quick:  # a smoke test: it times nothing it reports
    args.head_dims, args.length, args.heads, args.blocks, args.reps = [8], 32, 2, [16], 1
    args.dtypes, min_seconds = ["float32"], 0.001
  if backend != "gpu":
    if not args.quick:
      p.error("flex runs on an NVIDIA GPU; on another backend only --quick runs (interpreted)")
    interpret = jattn.testing.interpret_kernels()
  B, N, T = args.batch, args.heads, args.length
  print(f"{kind} ({backend}), jax {jax.__version__}, B={B} N={N} T={T}, causal")
  print("| dtype | H | block_q | block_kv | fwd ms | fwd+bwd ms | |")
  print("|---|---|---|---|---|---|---|")
  rows = []
  with interpret:
    for dtype, H in itertools.product(args.dtypes, args.head_dims):
      rng = np.random.default_rng(H)
      q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(3))
      pairs: list[tuple[int | None, int | None]] = [(None, None)]
      pairs += list(itertools.product(args.blocks, args.blocks))
      calls: dict[str, tuple[Any, tuple[jax.Array, ...]]] = {}
      failed: dict[tuple[int | None, int | None], str] = {}
      for pair in pairs:
        for backward in (False, True):
          fn = step(*pair, backward)
          try:
            jax.block_until_ready(fn(q, k, v))  # compiles; the untimed first call
          except Exception as e:  # noqa: BLE001  # a GPU refusing a tile size is a result
            failed[pair] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            break
          calls[_name(pair, backward)] = (fn, (q, k, v))
      ms = _timing.rounds_ms(calls, args.reps, min_seconds)
      timed = [pair for pair in pairs if pair not in failed]
      best = min(timed, key=lambda pair: np.median(ms[_name(pair, True)]))
      for pair in pairs:
        row: dict[str, Any] = dict(dtype=dtype, H=H, block_q=pair[0], block_kv=pair[1])
        if pair in failed:
          row["error"] = failed[pair]
          note = f"failed: {failed[pair]}"
        else:
          row["fwd_ms"] = float(np.median(ms[_name(pair, False)]))
          row["fwd_bwd_ms"] = float(np.median(ms[_name(pair, True)]))
          note = ("default; " if pair == (None, None) else "") + ("fastest" if pair == best else "")
        rows.append(row)
        name = ("table", "table") if pair == (None, None) else pair
        print(
          f"| {dtype} | {H} | {name[0]} | {name[1]} | {fmt(row.get('fwd_ms'), '.3f')} | "
          f"{fmt(row.get('fwd_bwd_ms'), '.3f')} | {note.strip('; ')} |"
        )
  return rows


if __name__ == "__main__":
  main()
