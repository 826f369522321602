"""``implementation="splash"``: jattn calls compiled into JAX's splash attention TPU kernel.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is a Pallas kernel
with a fused backward that skips the (query block, key/value block) pairs a mask empties.
It takes a static mask per head (analysed when the kernel is built), segment ids, a logit
soft cap, GQA/MQA and per-head sink logits. This module compiles a :class:`CallSpec`
into those arguments:

* the mask's conjuncts that are the same for every batch row and hold known values
  (causal with any static offset, sliding windows, chunks, dense arrays, per-head arrays,
  global tokens, strides, block-sparse layouts, and ``&``/``|``/``~`` of those) become one
  splash mask per head. Causal, windows and chunked-causal map onto splash's own
  ``CausalMask``/``LocalMask``/``ChunkedCausalMask``, which the kernel computes from
  indices; the rest are tabulated block by block from the jattn mask's index function;
* :func:`jattn.masks.segments`, :func:`jattn.masks.lengths` and the padding of lengths that
  are not whole blocks become splash segment ids: a padded or out-of-length position gets an
  id no other position has;
* the scale multiplies the query; ``logits_soft_cap`` is the kernel's own soft cap; K == 1
  runs the MQA kernel, other K the grouped MHA kernel.

jattn's numerics contract (a row that may attend to nothing returns zeros, its
log-sum-exp is -inf and its gradients are zero) does not hold for the kernel alone, which
averages the values of such a row or divides 0 by 0. Every call therefore passes each head
a sink logit far below any real logit and far above the kernel's mask value: a row with a
key to attend to is unchanged (the sink's weight ``exp(sink - max)`` is exactly 0), while
an empty row gets weight 1 on the sink, so its output is exactly 0, its log-sum-exp is the
sink (mapped to -inf here) and the backward's probabilities ``exp(mask_value - sink)`` are
exactly 0.

``return_residual`` uses the kernel's residual-saving forward, which JAX cannot
differentiate; a ``custom_vjp`` here differentiates the output through the kernel's own
backward and the log-sum-exp through two identities: d lse / d q = softmax · K (one more
forward with the keys as values) and d lse / d K = the value-gradient of that forward.

:mod:`jattn.impl.splash.static_masks` analyses and builds the masks; this module's table row
(:data:`IMPLEMENTATION`) says what splash cannot express. Nothing here validates
arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.impl import contract, orders, sharded
from jattn.impl.contract import CallSpec
from jattn.impl.splash import static_masks
from jattn.masks import core, kinds
from jattn.scores import ScoreFn, SoftCap

__all__ = [
  "IMPLEMENTATION",
  "LANES",
  "DEFAULT_BLOCK",
  "resolve_blocks",
  "blocks_reason",
  "soft_cap_of",
  "attention",
]

LANES = 128  # splash's block sizes must be multiples of the TPU's lane count
DEFAULT_BLOCK = 512  # per side; capped to the padded length
BACKWARDS: tuple[str, ...] = ()  # splash has its own fused backward

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # splash's DEFAULT_MASK_VALUE
_SINK = 0.5 * _MASK_VALUE  # below every real logit, above every masked one
_EMPTY_BELOW = 0.5 * _SINK  # a log-sum-exp below this belongs to a row with nothing to attend


# --- block geometry ---------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def resolve_blocks(block_q: int | None, block_kv: int | None, T: int, S: int) -> tuple[int, int]:
  """(block_q, block_kv): the given sizes, else DEFAULT_BLOCK capped to the padded lengths."""
  bq = min(DEFAULT_BLOCK, _round_up(max(T, 1), LANES)) if block_q is None else block_q
  bkv = min(DEFAULT_BLOCK, _round_up(max(S, 1), LANES)) if block_kv is None else block_kv
  return bq, bkv


def blocks_reason(block_q: int, block_kv: int) -> str | None:
  bad = [f"{n}={b}" for n, b in (("block_q", block_q), ("block_kv", block_kv)) if b % LANES]
  return f"{' and '.join(bad)} not a multiple of {LANES}" if bad else None


# --- the kernel's arguments ------------------------------------------------------


def _segment_ids(
  dynamic: Sequence[core.Mask], B: int, T: int, S: int, Tp: int, Sp: int
) -> tuple[jax.Array, jax.Array] | None:
  """(q ids (B, Tp), kv ids (B, Sp)) int32 carrying segments, lengths and padding; None when
  nothing needs them. Real ids are renumbered 0, 1, ... (:func:`_dense`); a position that
  may not take part gets -1 (queries) or -2 (keys), so it matches nothing, not even another."""
  segments = next((p for p in dynamic if isinstance(p, kinds.Segments)), None)
  lengths = next((p for p in dynamic if isinstance(p, kinds.Lengths)), None)
  if segments is None and lengths is None and (Tp, Sp) == (T, S):
    return None
  ids, ok = [], []
  for axis, (n, padded) in enumerate(((T, Tp), (S, Sp))):
    if segments is None:
      x = jnp.zeros((B, n), jnp.int32)
    else:
      x = (segments.q_segment_ids, segments.kv_segment_ids)[axis]
      x = jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape(-1, n), (B, n))
    ids.append(jnp.pad(x, ((0, 0), (0, padded - n))))
    valid = jnp.broadcast_to(jnp.arange(padded) < n, (B, padded))
    limit = None if lengths is None else (lengths.q_lengths, lengths.kv_lengths)[axis]
    if limit is not None:
      limit = jnp.broadcast_to(jnp.asarray(limit), (B,))[:, None]
      valid = valid & (jnp.arange(padded)[None, :] < limit)
    ok.append(valid)
  q_ids, kv_ids = _dense(ids[0], ids[1])
  return jnp.where(ok[0], q_ids, -1), jnp.where(ok[1], kv_ids, -2)


def _dense(q_ids: jax.Array, kv_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ids renumbered per batch row as ranks 0, 1, ... among that row's distinct ids.

  Only equality reaches the kernel, and ranks keep it while leaving every negative id
  free: any int32 id works, including ids at int32's ends, where ``min(ids) - 1`` would
  wrap onto a real one."""
  both = jnp.concatenate([q_ids, kv_ids], axis=1)
  order = jnp.argsort(both, axis=1)
  ordered = jnp.take_along_axis(both, order, axis=1)
  new = jnp.concatenate([ordered[:, :1] != ordered[:, :1], ordered[:, 1:] != ordered[:, :-1]], 1)
  rank = jnp.cumsum(new, axis=1, dtype=jnp.int32)
  rows = jnp.arange(both.shape[0])[:, None]
  dense = jnp.zeros_like(rank).at[rows, order].set(rank)
  return dense[:, : q_ids.shape[1]], dense[:, q_ids.shape[1] :]


def soft_cap_of(score_fn: ScoreFn | None) -> float | None:
  """The cap when ``score_fn`` is exactly ``logits_soft_cap`` (checked by the table)."""
  if score_fn is None:
    return None
  assert isinstance(score_fn, SoftCap), f"the table lets only a soft cap through: {score_fn!r}"
  return float(score_fn.cap)


def _block_sizes(kernel_lib: Any, bq: int, bkv: int) -> Any:
  """Splash's BlockSizes: every pass (forward, dK/dV, dQ) on ``bq`` x ``bkv`` tiles."""
  return kernel_lib.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )


def attention(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array]:
  """``(out (B, T, N, H) in query's dtype, lse (B, T, N) float32)`` through splash.

  Reads the masks (``spec.static_mask`` and ``spec.mask``, see :func:`split`), the soft
  cap, the scale, the tiles and ``interpret`` from ``spec``.
  """
  kernel_lib, _ = static_masks.splash_modules()
  B, T, S, N, K = spec.B, spec.T, spec.S, spec.N, spec.K
  bq, bkv = spec.block_q, spec.block_kv
  assert bq is not None and bkv is not None, "tiles are set by _prepare"
  Tp, Sp = _round_up(T, bq), _round_up(S, bkv)
  dynamic = core.conjuncts(spec.mask)  # segments and lengths (see split)
  static = [] if spec.static_mask is None else list(spec.static_mask.parts)
  mask = static_masks.splash_mask(static, N, T, S, (Tp, Sp))
  make = kernel_lib.make_splash_mqa if K == 1 else kernel_lib.make_splash_mha
  settings: dict[str, Any] = dict(
    block_sizes=_block_sizes(kernel_lib, bq, bkv),
    attn_logits_soft_cap=soft_cap_of(spec.score_fn),
    head_shards=1,
    q_seq_shards=1,
    interpret=spec.interpret,
  )
  ids = _segment_ids(dynamic, B, T, S, Tp, Sp)

  # (B, T, N, H) -> (B, N, Tp, H), the query scaled in float32 and cast back.
  q = (query.astype(jnp.float32) * spec.scale).astype(query.dtype)
  q = jnp.pad(q.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
  pad_kv = ((0, 0), (0, 0), (0, Sp - S), (0, 0))
  k, v = (jnp.pad(x.transpose(0, 2, 1, 3), pad_kv) for x in (key, value))
  if K == 1:
    k, v = k[:, 0], v[:, 0]

  # The user's sinks, or the one that keeps empty rows at zero; never below _SINK, so an
  # empty row's weight goes to the sink rather than to the kernel's masked logits.
  # One row of sinks per batch row ((N,) or (B, N) given): the kernel runs per batch row.
  sinks = jnp.full((B, N), _SINK, jnp.float32)
  if spec.sinks is not None:
    given = jnp.broadcast_to(spec.sinks.astype(jnp.float32), (B, N))
    sinks = jnp.maximum(given, _SINK)

  def run(
    save_residuals: bool,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ids: tuple[jax.Array, jax.Array] | None,
    sinks: jax.Array,
  ) -> Any:
    # The kernel (its mask tables are arrays) is made where it is used: a custom_vjp's
    # backward is traced apart from its forward and may not close over the forward's values.
    kernel = make(mask, save_residuals=save_residuals, **settings)

    def one(
      q: jax.Array,
      k: jax.Array,
      v: jax.Array,
      ids: tuple[jax.Array, jax.Array] | None,
      sinks: jax.Array,
    ) -> Any:
      segment_ids = None if ids is None else kernel_lib.SegmentIds(*ids)
      return kernel(q, k, v, segment_ids, sinks=sinks)

    return jax.vmap(one)(q, k, v, ids, sinks)

  if spec.return_residual:
    run_plain, run_residual = functools.partial(run, False), functools.partial(run, True)
    out, lse = _with_lse(run_plain, run_residual, q, k, v, ids, sinks)
  else:
    plain = orders.reverse_once(functools.partial(run, False), _WHO, orders.FUSED)
    out, lse = plain(q, k, v, ids, sinks), None
  out = out[:, :, :T].transpose(0, 2, 1, 3)
  if lse is None:
    lse = jnp.zeros((B, T, N), jnp.float32)  # not returned (return_residual=False)
  else:
    lse = lse[:, :, :T].transpose(0, 2, 1)
    lse = jnp.where(lse < _EMPTY_BELOW, -jnp.inf, lse)  # no sink (or a sink of about -inf)
  return out, lse


_WHO = "implementation='splash'"


_Ids = tuple[jax.Array, jax.Array] | None
"""Splash's (q, kv) segment ids, or None."""

_LseResiduals = tuple[jax.Array, jax.Array, jax.Array, _Ids, jax.Array, jax.Array]
"""(q, k, v, ids, sinks, lse)."""


def _with_lse(
  run: Callable[..., jax.Array],
  run_residual: Callable[..., tuple[jax.Array, tuple[jax.Array]]],
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  ids: _Ids,
  sinks: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """``run_residual(q, k, v, ids, sinks) -> (out, (lse,))`` made differentiable in both
  outputs."""

  @functools.partial(orders.reverse_only, who=_WHO, rule=orders.KERNEL_RULE)
  def f(
    q: jax.Array, k: jax.Array, v: jax.Array, ids: _Ids, sinks: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    out, (lse,) = run_residual(q, k, v, ids, sinks)
    return out, lse

  def fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, ids: _Ids, sinks: jax.Array
  ) -> tuple[tuple[jax.Array, jax.Array], _LseResiduals]:
    out, lse = f(q, k, v, ids, sinks)
    return (out, lse), (q, k, v, ids, sinks, lse)

  def bwd(res: _LseResiduals, cotangents: tuple[jax.Array, jax.Array]) -> Any:
    return orders.first_order(grads, _WHO, orders.FUSED, forward=False)(res, cotangents)

  def grads(
    res: _LseResiduals, cotangents: tuple[jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array, jax.Array, None, jax.Array]:
    q, k, v, ids, sinks, lse = res
    d_out, d_lse = cotangents
    _, vjp = jax.vjp(lambda q, k, v, sinks: run(q, k, v, ids, sinks), q, k, v, sinks)
    dq, dk, dv, d_sinks = vjp(d_out)
    # lse_i = log(sum_j exp(q_i . k_j) + exp(sink)): d/dq_i = sum_j p_ij k_j (attention with
    # the keys as values), d/dk_j = sum_i p_ij q_i d_lse_i (that attention's value-gradient),
    # d/dsink = exp(sink - lse_i).
    d_lse = d_lse.astype(jnp.float32)
    k_as_v, vjp_v = jax.vjp(lambda kv: run(q, k, kv, ids, sinks), k)
    dq = dq + (d_lse[..., None] * k_as_v.astype(jnp.float32)).astype(dq.dtype)
    (dk_lse,) = vjp_v((d_lse[..., None] * q.astype(jnp.float32)).astype(q.dtype))
    p_sink = jnp.exp(sinks[:, :, None] - lse.astype(jnp.float32))  # (B, N, Tp)
    d_sinks = d_sinks + (d_lse * p_sink).sum(axis=2)
    return dq, dk + dk_lse, dv, None, d_sinks

  f.defvjp(fwd, bwd)
  return f(q, k, v, ids, sinks)


# --- the table's row ---------------------------------------------------------------


def _check(call: contract.Call) -> str | None:
  s = call.spec
  if reason := static_masks.mask_reason(s.mask):
    return reason
  if s.return_residual and s.score_fn is not None:
    return (
      "return_residual with logits_soft_cap (the log-sum-exp's gradient through the cap "
      "needs the capped logits, which the kernel does not return)"
    )
  if call.blocks_named:
    return blocks_reason(*resolve_blocks(s.block_q, s.block_kv, s.T, s.S))
  return None


def _prepare(spec: CallSpec, blocks: tuple[int | None, int | None], backend: str) -> CallSpec:
  del backend  # splash's tiles depend on the lengths alone
  block_q, block_kv = resolve_blocks(blocks[0], blocks[1], spec.T, spec.S)
  static_mask, rest = static_masks.split(spec.mask)
  return dataclasses.replace(
    spec, mask=rest, static_mask=static_mask, block_q=block_q, block_kv=block_kv
  )


def _run(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  whole = static_masks.varies_by_head(spec)
  return sharded.per_shard(_no_max, query, key, value, spec, heads_whole=whole)


def _no_max(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  return (*attention(query, key, value, spec), None)  # the table refuses return_max_logit


IMPLEMENTATION = contract.Implementation(
  name="splash",
  runs_on=("tpu",),
  backwards=BACKWARDS,
  masks=(
    "masks the same for every batch row with known values (causal with any offset, "
    "windows, chunks, arrays, per-head arrays, global tokens, strides, block-sparse "
    "layouts, and their & | ~), segment ids, lengths"
  ),
  run=_run,
  prepare=_prepare,
  dtypes=("float32", "bfloat16"),
  bias="splash adds no bias",
  score_fn="splash has no score function (logits_soft_cap it has)",
  dropout="splash has no dropout",
  max_logit="splash's kernel keeps its running max to itself",
  tiles=True,
  # A size not given takes splash's default, a multiple of its lanes.
  tile_rule=lambda bq, bk: blocks_reason(LANES if bq is None else bq, LANES if bk is None else bk),
  static_masks=True,
  fused=True,
  takes_sinks=True,
  interpretable=True,
  check=_check,
)
