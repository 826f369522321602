"""The flex kernel's backward pass: two Pallas kernels, as in FlashAttention-2, each
recomputing the probabilities of a tile in base 2, ``P = exp2((t − m) − log2 l)`` from each
row's max ``m`` and log-sum ``log2 l`` the forward pass saved apart (not from their sum,
whose rounding at large ``|m|`` would swamp ``log2 l``), through the forward pass's own
:class:`Scorer`:

- dQ: one program per (query tile, batch row, query head), walking the tile schedule's row
  (FULL tiles, then PARTIAL ones); ``dq = scale · Σ dS K``;
- dK, dV: one program per (key/value tile, batch row, key/value head), walking the
  schedule's column for each of the head's G query heads, so GQA accumulates its group's
  gradients in one program with no atomics; ``dv = Σ Pᵀ dO``, ``dk = scale · Σ dSᵀ Q``,
  computed in the transposed domain (``Sᵀ = K Qᵀ``, ``dPᵀ = V dOᵀ``: the held key tile's
  rows are every product's M, and Pᵀ and dSᵀ are never transposed in registers);

with ``dS = P ⊙ (dO Vᵀ − Δ) ⊙ score_fn'`` and ``Δ = rowsum(O ⊙ dO)`` (computed by XLA).
The score function acts elementwise on the scores; its derivative comes from a JVP in the
kernel. Rows with nothing to attend to (m −inf) have zero gradients. A bias is added to
the scaled scores, so its gradient is dS itself: when the bias is differentiated, the dQ
kernel writes each visited tile's dS into a zeroed (B, N, T, S) float32 buffer (EMPTY tiles
stay zero), which XLA sums over the bias's broadcast axes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn.impl import common, tiling
from jattn.impl.flex._kernels import (
  Counts,
  Scorer,
  Settings,
  bias_row_spec,
  bias_tile,
  global_index,
  in_tile_order,
  pow2,
  schedule_specs,
  split_refs,
  whole_specs,
)
from jattn.impl.tiling import pad_to, tile_of
from jattn.impl.tiling import padded_bias as pad_bias


def backward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  d_out: jax.Array,
  row_stats: tuple[jax.Array, jax.Array],
  delta: jax.Array,
  rows: tiling.Schedule,
  cols: tiling.Schedule,
  scalars: jax.Array,
  mask_arrays: tuple[jax.Array, ...],
  score_arrays: tuple[jax.Array, ...],
  jaxprs: tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]],
  settings: tuple[Settings, Settings],
  bias: jax.Array | None = None,
  wants_ds: bool = False,
  before_score: bool = False,
  position_arrays: tuple[jax.Array, ...] = (),
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """``(dq, dk, dv, dS)``: dS (B, N, Tp, Sp) float32, the scores' gradient, only where
  ``wants_ds`` (else None): the gradient of the score function's output with
  ``before_score``, else of its input (what the bias adds to). ``row_stats``: the forward's
  ``(m, log2 l)`` per row, (B, T, N). ``rows`` (dQ's) and ``cols`` (dK/dV's) are the two
  kernels' schedules, ``jaxprs`` their (mask, score function, dropout's positions) and
  ``settings`` their launch settings, each at its own tiles; ``position_arrays`` what the
  positions read."""
  B, T, N, H = query.shape
  S, K, Hv = key.shape[1], key.shape[2], value.shape[-1]
  G = N // K
  f = common.stats_dtype(query.dtype)
  dq_settings, dkv_settings = settings
  bq, bk = dq_settings.block_q, dkv_settings.block_kv  # dQ's query tiles, dK/dV's key tiles
  nq, nk = rows.order.shape[0], cols.order.shape[0]
  # Lengths padded to whole tiles of every pass (powers of two: the larger tile's multiple).
  Tp = math.ceil(T / max(bq, dkv_settings.block_q)) * max(bq, dkv_settings.block_q)
  Sp = math.ceil(S / max(bk, dq_settings.block_kv)) * max(bk, dq_settings.block_kv)
  Hp, Hvp = pow2(H), pow2(Hv)
  q, do = pad_to(query, Tp, Hp), pad_to(d_out, Tp, Hvp)
  k, v = pad_to(key, Sp, Hp), pad_to(value, Sp, Hvp)
  # (B, N, T) row statistics, padded rows empty (m -inf: zero probabilities).
  m, log_l = row_stats
  stats = [
    jnp.pad(x.transpose(0, 2, 1), ((0, 0), (0, 0), (0, Tp - T)), constant_values=c)
    for x, c in ((m.astype(f), -jnp.inf), (log_l.astype(f), 0.0), (delta.astype(f), 0.0))
  ]
  arrays = [*mask_arrays, *score_arrays, *position_arrays]
  whole = whole_specs(arrays)
  counts = (len(mask_arrays), len(score_arrays), len(position_arrays), bias is not None)
  row_bias: list[Any] = []
  col_bias: list[Any] = []
  ds_out: list[Any] = []
  if bias is not None:
    padded = pad_bias(bias, Tp, Sp)
    Bb, Nb, Tb, Sb = padded.shape
    row_bias = [bias_row_spec(padded.shape, bq)]
    # dK/dV programs (key tile, b, key/value head): every query head's column of tiles.
    col_bias = [
      pl.BlockSpec(
        (None, Nb, Tb, bk if Sb > 1 else 1),
        lambda j, b, h: (b if Bb > 1 else 0, 0, 0, j if Sb > 1 else 0),
      )
    ]
  if wants_ds:
    ds_out = [jnp.zeros((B, N, Tp, Sp), f)]
  params = lambda x: plgpu.CompilerParams(num_warps=x.num_warps, num_stages=x.num_stages)
  by_rows = functools.partial(in_tile_order, count=nq, from_last=dq_settings.from_last)
  by_cols = functools.partial(in_tile_order, count=nk, from_last=dkv_settings.from_last)

  ds_spec = pl.BlockSpec((None, None, bq, Sp), lambda i, b, n: (b, n, i, 0))
  n_in = 11 + len(arrays) + len(row_bias)  # the zeroed dS buffer's place among the inputs
  dq, *ds = pl.pallas_call(
    functools.partial(
      _dq_kernel,
      settings=dq_settings,
      counts=counts,
      jaxprs=jaxprs[0],
      before_score=before_score,
    ),
    grid=(nq, B, N),
    in_specs=by_rows(
      [
        pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hvp), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, bq, None, Hvp), lambda i, b, n: (b, i, n, 0)),
        *[pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))] * 3,
        *schedule_specs(rows),
        *whole,
        *row_bias,
        *[ds_spec for _ in ds_out],
      ]
    ),
    out_specs=by_rows(
      [
        pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
        *[ds_spec for _ in ds_out],
      ]
    ),
    out_shape=[
      jax.ShapeDtypeStruct((B, Tp, N, Hp), f),
      *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ds_out],
    ],
    input_output_aliases={n_in: 1} if ds_out else {},
    compiler_params=params(dq_settings),
    interpret=dq_settings.interpret,
    name="jattn_flex_dq",
  )(
    q,
    k,
    v,
    do,
    *stats,
    rows.order,
    rows.num_full,
    rows.num_partial,
    scalars,
    *arrays,
    *([padded] if bias is not None else []),
    *ds_out,
  )

  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, settings=dkv_settings, counts=counts, jaxprs=jaxprs[1], group=G),
    grid=(nk, B, K),
    in_specs=by_cols(
      [
        pl.BlockSpec((None, Tp, G, Hp), lambda j, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, Hvp), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, Tp, G, Hvp), lambda j, b, h: (b, 0, h, 0)),
        *[pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0))] * 3,
        *schedule_specs(cols),
        *whole,
        *col_bias,
      ]
    ),
    out_specs=by_cols(
      [
        pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, Hvp), lambda j, b, h: (b, j, h, 0)),
      ]
    ),
    out_shape=[
      jax.ShapeDtypeStruct((B, Sp, K, Hp), f),
      jax.ShapeDtypeStruct((B, Sp, K, Hvp), f),
    ],
    compiler_params=params(dkv_settings),
    interpret=dkv_settings.interpret,
    name="jattn_flex_dkv",
  )(
    q,
    k,
    v,
    do,
    *stats,
    cols.order,
    cols.num_full,
    cols.num_partial,
    scalars,
    *arrays,
    *([padded] if bias is not None else []),
  )
  return (
    dq[:, :T, :, :H].astype(query.dtype),
    dk[:, :S, :, :H].astype(key.dtype),
    dv[:, :S, :, :Hv].astype(value.dtype),
    ds[0] if ds else None,
  )


def _probabilities_and_ds(
  scorer: Scorer,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  m: jax.Array,
  log_l: jax.Array,
  delta: jax.Array,
  q_idx: jax.Array,
  kv_idx: jax.Array,
  batch: jax.Array,
  head: jax.Array,
  masked: bool,
  bias: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(P after dropout, dS, dS before the score function's derivative)`` of one tile, (bq, bk)
  in the statistics dtype: dS is the gradient of the scores the bias adds to, the last that
  of the score function's output."""
  t, slope = scorer(q, k, q_idx, kv_idx, batch, head, masked, derivative=True, bias=bias)
  # exp2((t - m) - log2 l): exact near the row's max however large |m| is. Empty rows: P = 0.
  shift = jnp.where(jnp.isneginf(m), jnp.inf, m)
  p = jnp.exp2((t - shift[:, None]) - log_l[:, None])
  # Y = (P ⊙ D) V with D the kept weights' 1 / (1 − rate): dP = (dY Vᵀ) ⊙ D, and
  # Δ = rowsum(Y ⊙ dY) = rowsum(P ⊙ dP) still.
  dp = scorer.dropped(jnp.dot(do, v.T, preferred_element_type=t.dtype), q_idx, kv_idx, batch, head)
  d_post = p * (dp - delta[:, None])
  ds = d_post if slope is None else d_post * slope
  return scorer.dropped(p, q_idx, kv_idx, batch, head), ds, d_post


def _dq_kernel(
  q_ref: Any,
  k_ref: Any,
  v_ref: Any,
  do_ref: Any,
  m_ref: Any,
  log_l_ref: Any,
  delta_ref: Any,
  order_ref: Any,
  num_full_ref: Any,
  num_partial_ref: Any,
  scalars_ref: Any,
  *refs: Any,
  settings: Settings,
  counts: Counts,
  jaxprs: tuple[Any, Any, Any],
  before_score: bool,
) -> None:
  mask_refs, score_refs, position_refs, bias_ref, rest = split_refs(refs, counts)
  # With a differentiated bias: the zeroed dS buffer, its input and output refs (aliased).
  dq_ref, ds_ref = rest[-1], None
  if len(rest) == 3:
    _, dq_ref, ds_ref = rest
  scorer = Scorer(settings, jaxprs, mask_refs, score_refs, scalars_ref, position_refs)
  bq, bk = settings.block_q, settings.block_kv
  i = tile_of(pl.program_id(0), order_ref.shape[0], settings.from_last)
  b, n = pl.program_id(1), pl.program_id(2)
  q, do, m, log_l, delta = q_ref[...], do_ref[...], m_ref[...], log_l_ref[...], delta_ref[...]
  q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
  batch, head = global_index(scalars_ref, b, n)

  def body(t: jax.Array, dq: jax.Array, masked: bool) -> jax.Array:
    j = order_ref[i, t]
    kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    bias = bias_tile(bias_ref, slice(None), pl.ds(j * bk, bk))
    _, ds, d_post = _probabilities_and_ds(
      scorer, q, k, v, do, m, log_l, delta, q_idx, kv_idx, batch, head, masked, bias
    )
    if ds_ref is not None:
      ds_ref[:, pl.ds(j * bk, bk)] = (d_post if before_score else ds).astype(ds_ref.dtype)
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=dq.dtype)

  dq = jnp.zeros(dq_ref.shape, dq_ref.dtype)
  n_full, n_partial = num_full_ref[i], num_partial_ref[i]
  dq = jax.lax.fori_loop(0, n_full, lambda t, c: body(t, c, False), dq)
  dq = jax.lax.fori_loop(n_full, n_full + n_partial, lambda t, c: body(t, c, True), dq)
  dq_ref[...] = dq * settings.scale


def _dkv_kernel(
  q_ref: Any,
  k_ref: Any,
  v_ref: Any,
  do_ref: Any,
  m_ref: Any,
  log_l_ref: Any,
  delta_ref: Any,
  order_ref: Any,
  num_full_ref: Any,
  num_partial_ref: Any,
  scalars_ref: Any,
  *refs: Any,
  settings: Settings,
  counts: Counts,
  jaxprs: tuple[Any, Any, Any],
  group: int,
) -> None:
  mask_refs, score_refs, position_refs, bias_ref, (dk_ref, dv_ref) = split_refs(refs, counts)
  scorer = Scorer(settings, jaxprs, mask_refs, score_refs, scalars_ref, position_refs)
  bq, bk = settings.block_q, settings.block_kv
  j = tile_of(pl.program_id(0), order_ref.shape[0], settings.from_last)
  b, h = pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
  n_full, n_partial = num_full_ref[j], num_partial_ref[j]
  dk = jnp.zeros(dk_ref.shape, dk_ref.dtype)
  dv = jnp.zeros(dv_ref.shape, dv_ref.dtype)
  for g in range(group):  # the G query heads of key/value head h
    batch, head = global_index(scalars_ref, b, h * group + g)

    def body(t: jax.Array, carry: tuple[Any, Any], masked: bool, g: int = g) -> Any:
      dk, dv = carry
      i = order_ref[j, t]
      rows = pl.ds(i * bq, bq)
      q, do = q_ref[rows, g, :], do_ref[rows, g, :]
      m, log_l, delta = m_ref[g, rows], log_l_ref[g, rows], delta_ref[g, rows]
      q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
      bias = None
      if bias_ref is not None:  # (Nb, Tb, bk or 1): this head's plane, then the query tile
        Nb, Tb, _ = bias_ref.shape
        bias = bias_ref[h * group + g if Nb > 1 else 0, rows if Tb > 1 else slice(None), :]
      # In the transposed domain, (bk, bq): every product has the held key tile's rows as
      # its M, and P and dS are born in the orientation dV and dK multiply them in.
      t_t, slope_t = scorer.transposed(
        k, q, q_idx, kv_idx, batch, head, masked, derivative=True, bias=bias
      )
      shift = jnp.where(jnp.isneginf(m), jnp.inf, m)
      p_t = jnp.exp2((t_t - shift[None, :]) - log_l[None, :])
      dp_t = jnp.dot(v, do.T, preferred_element_type=t_t.dtype)
      kept_t = p_t
      if settings.dropout_rate:  # the pattern is drawn in the call's orientation
        dp_t = scorer.dropped(dp_t.T, q_idx, kv_idx, batch, head).T
        kept_t = scorer.dropped(p_t.T, q_idx, kv_idx, batch, head).T
      ds_t = p_t * (dp_t - delta[None, :])
      if slope_t is not None:
        ds_t = ds_t * slope_t
      dv = dv + jnp.dot(kept_t.astype(do.dtype), do, preferred_element_type=dv.dtype)
      # dS in two parts in a narrow input dtype, hi + lo: dS rounded to bfloat16 alone gave
      # dK 3.8x jax.nn's error (which sums float32 dS) at scale 1e3 (experiments/accuracy.py).
      # Where a GPU's row of SPLIT_DS says so, one part, as cuDNN and FlashAttention do.
      hi = ds_t.astype(q.dtype)
      dk = dk + jnp.dot(hi, q, preferred_element_type=dk.dtype)
      if settings.split_ds and q.dtype != ds_t.dtype:
        lo = (ds_t - hi.astype(ds_t.dtype)).astype(q.dtype)
        dk = dk + jnp.dot(lo, q, preferred_element_type=dk.dtype)
      return dk, dv

    carry = jax.lax.fori_loop(0, n_full, lambda t, c: body(t, c, False), (dk, dv))
    dk, dv = jax.lax.fori_loop(n_full, n_full + n_partial, lambda t, c: body(t, c, True), carry)
  dk_ref[...] = dk * settings.scale
  dv_ref[...] = dv
