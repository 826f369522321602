"""What the blockwise backward's exact Δ costs: fwd+bwd with it against FlashAttention's Δ.

jattn's blockwise rule sums Δ = rowsum(A ⊙ dA) in a pass of its own over the query
tiles, as jax.nn's materialised softmax does (README, numerics contract).
FlashAttention's identity Δ = rowsum(dY ⊙ Y) saves that pass; jattn still uses it
where a row spans shards (``blockwise.backward``, ring attention's rule). This script
times both as custom_vjp rules on the same inputs, same tiles, same forward:

    exact   jattn.dot_product_attention(implementation="blockwise")
    flash   blockwise.forward + blockwise.backward in a custom_vjp (Δ from the output)

and prints their fwd+bwd milliseconds and the median over rounds of exact / flash,
timed in fair order (experiments/_timing.py), and the max difference of their
gradients (rounding only).

    python -m experiments.bench_delta                       # T=1024 and 4096, full and causal
    python -m experiments.bench_delta --lengths 2048 --causal true
    python -m experiments.bench_delta --quick               # tiny smoke test (CI)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing
from jattn import masks
from jattn.impl import blockwise


def flash_attention(block: int, causal: bool):
  """A blockwise custom_vjp whose backward takes Δ = rowsum(dY ⊙ Y) from the output."""

  def plan_for(q, k):
    return blockwise.plan(
      q,
      k.shape[1],
      mask=masks.causal() if causal else None,
      score_fn=None,
      scale=1 / np.sqrt(q.shape[-1]),
      block_q=block,
      block_kv=block,
    )

  @jax.custom_vjp
  def attend(q, k, v):
    out, _, _ = blockwise.forward(plan_for(q, k), q, k, v)
    return out.astype(q.dtype)

  def fwd(q, k, v):
    out, m, l = blockwise.forward(plan_for(q, k), q, k, v)
    return out.astype(q.dtype), (q, k, v, out, m, l)

  def bwd(res, d_out):
    q, k, v, out, m, l = res
    d_q, d_k, d_v, _, _ = blockwise.backward(
      plan_for(q, k), q, k, v, out, m, l, d_out, jnp.zeros_like(m)
    )
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)

  attend.defvjp(fwd, bwd)
  return attend


def exact_attention(block: int, causal: bool):
  return functools.partial(
    jattn.dot_product_attention,
    implementation="blockwise",
    is_causal=causal,
    block_q=block,
    block_kv=block,
  )


def grads_fn(attend):
  loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(lengths, causals, *, batch, heads, head_dim, block, rounds, min_seconds=0.1) -> list[dict]:
  rows = []
  for T in lengths:
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (batch, T, heads, head_dim), jnp.float32) for x in keys)
    for causal in causals:
      b = min(block, T)
      fns = {
        "exact": (grads_fn(exact_attention(b, causal)), (q, k, v)),
        "flash": (grads_fn(flash_attention(b, causal)), (q, k, v)),
      }
      g_exact, g_flash = (fns[n][0](q, k, v) for n in ("exact", "flash"))
      diff = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(g_exact, g_flash))
      times = _timing.rounds_ms(fns, rounds, min_seconds)
      rows.append(
        dict(
          T=T,
          causal=causal,
          exact_ms=float(np.median(times["exact"])),
          flash_ms=float(np.median(times["flash"])),
          ratio=_timing.median_ratio(times["exact"], times["flash"]),
          max_grad_diff=diff,
        )
      )
  return rows


def main(argv=None) -> list[dict]:
  parser = _cli.parser(
    "bench_delta", __doc__, config=False, quick="tiny shapes, 2 rounds (smoke test)", out_dir=None
  )
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--causal", nargs="+", choices=["true", "false"], default=["false", "true"])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", dest="head_dim", type=int, default=64)
  parser.add_argument("--block", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  min_seconds = 0.1  # each block of calls lasts about this long
  if args.quick:  # blocks of 3 calls: a smoke test times nothing it reports
    args.lengths, args.heads, args.head_dim, args.block, args.rounds = [64], 2, 8, 16, 2
    min_seconds = 0.001
  rows = run(
    args.lengths,
    [c == "true" for c in args.causal],
    batch=args.batch,
    heads=args.heads,
    head_dim=args.head_dim,
    block=args.block,
    rounds=args.rounds,
    min_seconds=min_seconds,
  )
  print(
    f"B={args.batch} N={args.heads} H={args.head_dim} float32, {args.block}² tiles, fwd+bwd, "
    f"{jax.devices()[0].platform}; medians of {args.rounds} rounds in fair order\n"
  )
  print("| T | causal | exact Δ ms | flash Δ ms | exact / flash | max grad diff |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['T']} | {r['causal']} | {r['exact_ms']:.1f} | {r['flash_ms']:.1f} | "
      f"{r['ratio']:.2f} | {r['max_grad_diff']:.1e} |"
    )
  return rows


if __name__ == "__main__":
  main()
