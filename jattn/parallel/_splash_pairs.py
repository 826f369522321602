"""Ring attention's shard pairs through splash: one fused kernel per (query shard, key shard).

Ring attention (:mod:`jattn.parallel`) attends each device's query shard to every key/value
shard in turn. On a TPU each such pair can run splash's fused kernel instead of blockwise
loops. Splash takes its masks as static tables, while a pair's mask depends on which shards
meet (device i's queries against device j's keys). So the mask is tabulated for every pair
(i, j) of the ring when the call is traced, identical tables share one kernel, pairs whose
table is empty run nothing, and each ring step picks its pair's kernel with ``lax.switch``
on the device and step indices. Segment ids travel as splash segment ids.

A pair always returns its log-sum-exp, so :func:`pair_spec` is the call splash's row of the
selection table checks for a ring (jattn.parallel): it refuses a logit soft cap, whose
log-sum-exp gradient the kernel cannot give, and such rings run blockwise pairs.

A pair's result is its normalised output and log-sum-exp; the ring merges them with the
online-softmax rule. Its backward, given the merged output ``O`` and log-sum-exp ``L``,
differentiates each pair through the kernel: with weights ``w = exp(lse_p - L)``, the
pair's output receives ``w · dO`` and its log-sum-exp ``w · (dO · (O_p - O) + dL)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import masks, scores, testing
from jattn.impl import splash
from jattn.impl.contract import CallSpec
from jattn.impl.splash import static_masks
from jattn.masks import core, kinds
from jattn.parallel import _kernel_pairs


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Static: which kernel each (query shard, key shard) pair of a ring runs."""

  table: tuple[tuple[int, ...], ...]  # [i][j]: index into tables, or -1 (nothing to attend)
  tables: tuple[Any, ...]  # static_masks.StaticMask per distinct pair mask (None: every position)
  block_q: int
  block_kv: int
  interpret: bool


def reason(mask: masks.Mask | None) -> str | None:
  """Why a ring's mask cannot go through splash per pair; None when it can."""
  for part in core.conjuncts(mask):
    if isinstance(part, kinds.Lengths):
      return "lengths (pass them as segment ids to ring attention with splash)"
    if part.extents[0] is not None or part.extents[1] is not None:
      return f"mask {part!r} varies over batch rows or heads"
    if why := static_masks.mask_reason(part):
      return why
  return None


def plan(
  mask: masks.Mask | None,
  *,
  layout: str,
  size: int,
  q_len: int,
  kv_len: int,
  positions: Callable[[str, int, int, int], jax.Array],
) -> Pairs:
  """Tabulate ``mask`` (checked by :func:`reason`) for every pair of ``size`` shards."""
  t, s = q_len // size, kv_len // size
  dense: dict[bytes, int] = {}
  tables: list = []
  table = []
  with jax.ensure_compile_time_eval():  # ring_attention may be traced inside jit
    q_pos = [np.asarray(positions(layout, q_len, size, i)) for i in range(size)]
    kv_pos = [np.asarray(positions(layout, kv_len, size, j)) for j in range(size)]
  for i in range(size):
    row = []
    for j in range(size):
      allowed = np.ones((t, s), bool)
      if mask is not None:
        with jax.ensure_compile_time_eval():
          grid = masks.index_grid(1, 1, t, s)
          got = masks.reindex(mask, q=q_pos[i], kv=kv_pos[j]).on_grid(grid)
        allowed = np.broadcast_to(np.asarray(got)[0, 0], (t, s)).copy()
      if not allowed.any():
        row.append(-1)
        continue
      digest = allowed.tobytes() if not allowed.all() else b"all"
      if digest not in dense:
        dense[digest] = len(tables)
        tables.append(
          None if digest == b"all" else static_masks.StaticMask([masks.from_array(allowed)])
        )
      row.append(dense[digest])
    table.append(tuple(row))
  bq, bkv = splash.resolve_blocks(None, None, t, s)
  return Pairs(tuple(table), tuple(tables), bq, bkv, testing.interpreting())


def pair_spec(
  *,
  shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
  segments: masks.Mask | None,
  scale: float,
  soft_cap: float | None,
  block_q: int,
  block_kv: int,
  interpret: bool,
  static_mask: static_masks.StaticMask | None = None,
) -> CallSpec:
  """The splash call one shard pair makes: query, key and value of ``shapes`` (a device's
  shards), ``segments`` (the pair's segment ids, or None) and the ring's scale and soft cap.

  It always returns the log-sum-exp, which the ring merges and differentiates, so
  ``implementation='splash'``'s table row (:func:`jattn.impl.select.why_not`) checks a
  ring's pairs on this spec as it checks a one-device call.
  """
  from jattn.impl.contract import CallSpec  # the spec's home imports this module's callers

  (B, T, N, H), (_, S, K, _), (*_, Hv) = shapes
  return CallSpec(
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    unbatched=False,
    bias=None,
    mask=segments,
    score_fn=None if soft_cap is None else scores.soft_cap(soft_cap),
    dropout_rng=None,
    scale=scale,
    dropout_rate=0.0,
    broadcast_dropout=False,
    implementation="splash",
    backward=None,
    block_q=block_q,
    block_kv=block_kv,
    return_residual=True,
    interpret=interpret,
    static_mask=static_mask,
  )


def attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  *,
  pairs: Pairs,
  here: jax.Array,
  source: jax.Array,
  scale: float,
  soft_cap: float | None,
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` of this device's queries against the key shard of ``source`` (float32
  out; lse -inf where a row has nothing to attend to)."""
  B, T, N, _ = query.shape
  Hv = value.shape[-1]

  def empty(
    q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array | None, kv_ids: jax.Array | None
  ) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((B, T, N, Hv), jnp.float32), jnp.full((B, T, N), -jnp.inf, jnp.float32)

  def kernel(table: static_masks.StaticMask | None) -> Callable[..., tuple[jax.Array, jax.Array]]:
    def run(
      q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array | None, kv_ids: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
      spec = pair_spec(
        shapes=(q.shape, k.shape, v.shape),
        segments=None if q_ids is None else masks.segments(q_ids, kv_ids),
        scale=scale,
        soft_cap=soft_cap,
        block_q=pairs.block_q,
        block_kv=pairs.block_kv,
        interpret=pairs.interpret,
        static_mask=table,
      )
      out, lse = splash.attention(q, k, v, spec)
      return out.astype(jnp.float32), lse

    return run

  branches = [kernel(t) for t in pairs.tables] + [empty]
  index = jnp.asarray(np.asarray(pairs.table, np.int32))[here, source]
  index = jnp.where(index < 0, len(pairs.tables), index)
  return jax.lax.switch(index, branches, query, key, value, q_ids, kv_ids)


def as_partial(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A pair's ``(out, lse)`` as the ring's ``(out, m, l)`` (m = 0, l = 0 where empty)."""
  live = jnp.isfinite(lse)
  return out, jnp.where(live, lse, 0.0), live.astype(lse.dtype)


def grads(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  out: jax.Array,
  lse: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
  **settings: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The pair's (dq, dk, dv) given the ring's merged ``out`` and ``lse`` and their
  cotangents (see the module docstring), by the rule of :func:`_kernel_pairs.grads`."""

  def pair(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    return attend(q, k, v, q_ids, kv_ids, **settings)

  return _kernel_pairs.grads(pair, (query, key, value), out, lse, d_out, d_lse)
