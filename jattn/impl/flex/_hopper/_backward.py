"""flex's Hopper backward kernels (dQ; dK and dV in the transposed domain), and the
gradients of the floating arrays a score function reads, taken in XLA on the whole grid."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from jattn import dropout as _dropout
from jattn import masks as _masks
from jattn.impl import _common
from jattn.impl.flex._hopper import _call, _mosaic, _tile
from jattn.impl.flex._hopper._mosaic import LOG2E, ROWS


def backward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  out: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(dq, dk, dv)`` of the forward's output and natural log-sum-exp for their cotangents
  ``d_out`` and ``d_lse`` ((B, N, T) float32, zero where a row saw no key), from the output
  and base-2 log-sum-exp ``lse2``: a dQ kernel (one program per 64-row query tile,
  its key tiles streamed) and a dK/dV kernel in the transposed domain (one program per
  64-row key tile and query head, its query tiles streamed; ``Sᵀ = K Qᵀ``, ``dV += Pᵀ dO``,
  ``dPᵀ = V dOᵀ``, ``dK += dSᵀ Q``, every product a wgmma), dS rounded once to the inputs'
  dtype as on Hopper's Triton rows. Grouped queries sum their dK and dV over the group in
  XLA. Tiles of 64 by 64; the mask's schedules as in the forward."""
  plgpu = _mosaic.mosaic_gpu()
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G, dtype, bk = N // K, query.dtype, ROWS
  scale, stages, interpret = static.scale, static.stages, static.interpret
  n_ids = len(arrays.ids)
  n_streamed_ids = 1 if n_ids else 0
  swizzled = _mosaic.swizzled()
  layout = plgpu.Layout.WGMMA
  # The lse's cotangent enters dS as Δ does: dS = P ⊙ (dP − Δ + d_lse).
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
  delta = delta - d_lse
  # Rows that saw no key (lse -inf) take no gradient: shift them by +inf, p = 0
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)

  def scores(
    products: Any, fns: tuple[Any, Any], masked: bool, b: Any, h: Any, q0: Any, k0: Any,
    transposed: bool, keep: Any, tiles: tuple[Any, Any],
  ) -> tuple[Any, Any]:  # fmt: skip
    return _tile.scores(
      products, scale=scale, score_fn=fns[1], mask=fns[0], masked=masked, b=b, h=h, q0=q0,
      k0=k0, transposed=transposed, derivative=True, keep=keep, bias=tiles[0], dense=tiles[1],
    )  # fmt: skip

  def through_score(ds: Any, slope: Any) -> Any:
    """dS of the scaled scores: of the score function's output times its derivative."""
    return ds if slope is None else ds * slope

  def dq_body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    r = _call.split_refs(refs[6:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    fns = (r.mask, r.score_fn)
    dq_ref, q_smem, do_smem, lse_smem, delta_smem, bars, a_smem, id_smem = r.rest
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _mosaic.global_index(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    rows = pl.ds(i * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem, bars.at[3])
    for n in range(4):
      plgpu.barrier_wait(bars.at[n])
    lse = _mosaic.load(lse_smem, layout.reduce(1))
    dlt = _mosaic.load(delta_smem, layout.reduce(1))
    keeper = _tile.keeper(ids, b_g, rows, id_smem, bars.at[4], transposed=False)

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], k_smem: Any, v_smem: Any, *rest: Any) -> Any:
        *streamed, dq = rest  # the key tile's segment ids, bias and dense mask tiles
        ids_smem, bias_smem, dense_smem = _tile.split_streamed(
          streamed, n_streamed_ids, static.biased, static.dense and masked
        )
        j = order_ref[i, index[0] + first]
        products = _mosaic.matmul(q_smem, k_smem.transpose((1, 0)), (ROWS, bk))
        keep = keeper(*ids_smem)
        tiles = _tile.plane_tile(bias_smem), _tile.plane_tile(dense_smem)
        t, slope = scores(products, fns, masked, b_g, h_g, i * ROWS, j * bk, False, keep, tiles)
        p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [0]))
        dp = _mosaic.matmul(do_smem, v_smem.transpose((1, 0)), (ROWS, bk))
        dp = _tile.dropout_keep(dp.shape, static, r.seed, b_g, h_g, i * ROWS, j * bk)(dp)
        ds = p * (dp - lax.broadcast_in_dim(dlt, t.shape, [0]))
        ds = through_score(ds, slope).astype(dtype)
        return dq + _mosaic.matmul(_mosaic.staged(ds, a_smem), k_smem, (ROWS, H))

      return run

    def pipeline(first: Any, count: Any, masked: bool, dq: Any) -> Any:
      at = lambda t: order_ref[i, t + first]
      spec = plgpu.BlockSpec((bk, H), lambda t: (at(t), 0), transforms=swizzled)
      dense = r.dense if masked else None
      specs, refs = _tile.streams(ids, r.bias, dense, (b_g, b, h, h_g), i, ROWS, bk, at, False)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[spec, spec, *specs],
        max_concurrent_steps=stages, init_carry=dq,
      )(k_ref.at[b, :, kv_head, :], v_ref.at[b, :, kv_head, :], *refs)  # fmt: skip

    dq = plgpu.layout_cast(jnp.full((ROWS, H), 0.0, jnp.float32), layout)
    dq = _mosaic.walk(pipeline, full_ref[i], partial_ref[i], static.masked, dq)
    q_smem[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)

  def dkv_body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    r = _call.split_refs(refs[6:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    fns = (r.mask, r.score_fn)
    dk_ref, dv_ref, k_smem, v_smem, bars, a_smem, id_smem = r.rest
    j, h, b = lax.axis_index("kv"), lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _mosaic.global_index(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    cols = pl.ds(j * bk, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kv_head], k_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kv_head], v_smem, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    keeper = _tile.keeper(ids, b_g, cols, id_smem, bars.at[2], transposed=True)

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], q_smem: Any, do_smem: Any, lse_smem: Any, d_smem: Any,
              *rest: Any) -> Any:  # fmt: skip
        *streamed, carry = rest  # the query tile's segment ids, bias and dense mask tiles
        ids_smem, bias_smem, dense_smem = _tile.split_streamed(
          streamed, n_streamed_ids, static.biased, static.dense and masked
        )
        dk, dv = carry
        i = order_ref[j, index[0] + first]
        lse = _mosaic.load(lse_smem, layout.reduce(0))
        dlt = _mosaic.load(d_smem, layout.reduce(0))
        products = _mosaic.matmul(k_smem, q_smem.transpose((1, 0)), (bk, ROWS))
        keep = keeper(*ids_smem)
        tiles = _tile.plane_tile(bias_smem), _tile.plane_tile(dense_smem)
        t, slope = scores(products, fns, masked, b_g, h_g, i * ROWS, j * bk, True, keep, tiles)
        p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [1]))
        dropped = _tile.dropout_keep(p.shape, static, r.seed, b_g, h_g, i * ROWS, j * bk, True)
        dv = dv + _mosaic.matmul(_mosaic.staged(dropped(p).astype(dtype), a_smem), do_smem, (bk, H))
        dp = dropped(_mosaic.matmul(v_smem, do_smem.transpose((1, 0)), (bk, ROWS)))
        ds = p * (dp - lax.broadcast_in_dim(dlt, t.shape, [1]))
        ds = through_score(ds, slope).astype(dtype)
        return dk + _mosaic.matmul(_mosaic.staged(ds, a_smem), q_smem, (bk, H)), dv

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda t: order_ref[j, t + first]
      tile = plgpu.BlockSpec((ROWS, H), lambda t: (at(t), 0), transforms=swizzled)
      vec = plgpu.BlockSpec((ROWS,), lambda t: (at(t),))
      dense = r.dense if masked else None
      specs, refs = _tile.streams(ids, r.bias, dense, (b_g, b, h, h_g), j, bk, ROWS, at, True)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[tile, tile, vec, vec, *specs],
        max_concurrent_steps=stages, init_carry=carry,
      )(q_ref.at[b, :, h, :], do_ref.at[b, :, h, :], lse_ref.at[b, h, :],
        delta_ref.at[b, h, :], *refs)  # fmt: skip

    zero = plgpu.layout_cast(jnp.full((bk, H), 0.0, jnp.float32), layout)
    dk, dv = _mosaic.walk(pipeline, full_ref[j], partial_ref[j], static.masked, (zero, zero))
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, cols, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, cols, h])
    plgpu.wait_smem_to_gmem(0)

  a_scratch = lambda shape: plgpu.SMEM(shape, dtype, transforms=swizzled) if interpret else None
  inputs = (query, key, value, d_out, lse2.astype(jnp.float32), delta)
  dq = plgpu.kernel(
    dq_body,
    out_type=jax.ShapeDtypeStruct(query.shape, dtype),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=5),
      a_scratch((ROWS, bk)),
      plgpu.SMEM((ROWS,), jnp.int32) if n_ids else None,  # the query tile's segment ids
    ),
    **_mosaic.interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.rows, T, S))
  per_head = jax.ShapeDtypeStruct((B, S, N, H), dtype)  # each query head's dK, dV
  dk, dv = plgpu.kernel(
    dkv_body,
    out_type=(per_head, per_head),
    grid=(S // bk, N, B),
    grid_names=("kv", "h", "b"),
    scratch_types=(
      plgpu.SMEM((bk, H), dtype, transforms=swizzled),
      plgpu.SMEM((bk, H), dtype, transforms=swizzled),
      plgpu.Barrier(num_barriers=3),
      a_scratch((bk, ROWS)),
      plgpu.SMEM((bk,), jnp.int32) if n_ids else None,  # the key tile's segment ids
    ),
    **_mosaic.interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.cols, T, S, transposed=True))
  group = lambda x: x.reshape(B, S, K, G, H).sum(3, dtype=jnp.float32).astype(dtype)
  return dq, group(dk), group(dv)


def _zero_cotangent(x: jax.Array) -> Any:
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """A mask's or score function's tile jaxpr (traced at ROWS x ROWS) on the whole (B, N, T,
  S) grid in XLA, its arrays as plain inputs: mapped over batch rows and heads (global:
  ``offsets`` added) and tiles; ``scores`` (B, N, T, S) a score function's input."""
  B, N, T, S = shape
  run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, []))
  iota = lax.broadcasted_iota(jnp.int32, (ROWS, ROWS), 0)
  q_in, kv_in = iota, iota.T

  def tile(b: Any, h: Any, i: Any, j: Any, *x: Any) -> jax.Array:
    (y,) = run(*arrays, *x, b, h, q_in + i * ROWS, kv_in + j * ROWS)
    return jnp.broadcast_to(y, (ROWS, ROWS))

  x: tuple[jax.Array, ...] = ()
  if scores is not None:  # its (B, N, T/ROWS, S/ROWS, ROWS, ROWS) tiles
    tiles = scores.reshape(B, N, T // ROWS, ROWS, S // ROWS, ROWS)
    x = (tiles.transpose(0, 1, 2, 4, 3, 5),)
  each = tile
  for axis in (3, 2, 1, 0):  # over key tiles, query tiles, heads, batch rows
    in_axes: list[int | None] = [None] * 4
    in_axes[axis] = 0
    each = jax.vmap(each, in_axes=(*in_axes, *(0,) * len(x)))  # the scores' leading axis
  b = jnp.arange(B, dtype=jnp.int32) + offsets[0]
  h = jnp.arange(N, dtype=jnp.int32) + offsets[1]
  i, j = (
    jnp.arange(T // ROWS, dtype=jnp.int32),
    jnp.arange(S // ROWS, dtype=jnp.int32),
  )
  out = each(b, h, i, j, *x)  # (B, N, T/ROWS, S/ROWS, ROWS, ROWS)
  return out.transpose(0, 1, 2, 4, 3, 5).reshape(B, N, T, S)


def grid_grads(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
  chosen: list[int],
  wants_bias: bool,
) -> tuple[list[jax.Array], jax.Array | None]:
  """``(the gradients of arrays.score[chosen], the bias's gradient or None)``, from the
  whole (B, N, T, S) grid in XLA: the score function's VJP at the call's scores (recomputed
  in float32: scale · q kᵀ + bias), the cotangent dS = P ⊙ (dP − Δ + d_lse) of its output,
  P from the forward's log-sum-exp, ``d_lse`` as :func:`backward` takes it; the bias's is
  dS before the score function, summed over the axes the bias broadcasts."""
  B, T, N, _ = query.shape
  S, K = key.shape[1], key.shape[2]
  f = jnp.float32
  fns = static.functions
  grouped = lambda x: jnp.repeat(x.astype(f), N // K, axis=2)
  x = jnp.einsum("btnh,bsnh->bnts", query.astype(f), grouped(key)) * static.scale
  if arrays.bias:
    x = x + arrays.bias[0].astype(f)
  shape = (B, N, T, S)
  allowed = None
  if fns.mask is not None:
    allowed = _on_grid(fns.mask[ROWS, ROWS], arrays.mask, shape, arrays.offsets).astype(bool)
  if arrays.dense:  # the dense mask (whole on each device), at this device's rows and heads
    dense = arrays.dense[0]
    if dense.shape[0] > 1:
      dense = dense[jnp.arange(B) + arrays.offsets[0]]
    if dense.shape[1] > 1:
      dense = dense[:, jnp.arange(N) + arrays.offsets[1]]
    dense = jnp.broadcast_to(dense, (*dense.shape[:2], T, S))
    allowed = dense if allowed is None else allowed & dense
  if arrays.ids:  # segment ids, at the global batch rows
    rows = jnp.arange(B) + arrays.offsets[0]
    q_ids, kv_ids = (a[rows] if a.shape[0] > 1 else a[:1] for a in arrays.ids)
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    allowed = same if allowed is None else allowed & same

  def score(x: jax.Array, *learned: jax.Array) -> jax.Array:
    if fns.score is None:
      return x
    inputs = list(arrays.score)
    for i, a in zip(chosen, learned):
      inputs[i] = a
    return _on_grid(fns.score[ROWS, ROWS], inputs, shape, arrays.offsets, x).astype(f)

  y, vjp = jax.vjp(score, x, *(arrays.score[i] for i in chosen))
  t = y * LOG2E
  if allowed is not None:
    t = jnp.where(allowed, t, -jnp.inf)
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)  # rows that saw no key: p = 0
  p = jnp.exp2(t - lse2[..., None])
  dp = jnp.einsum("btnh,bsnh->bnts", d_out.astype(f), grouped(value))
  if static.dropout_rate:  # dP through the pattern the kernels drew
    b, h, q, kv = _masks.index_grid(B, N, T, S)
    idx: tuple[Any, ...] = (b + arrays.offsets[0], h + arrays.offsets[1], q, kv)  # global
    if static.broadcast_dropout:
      idx = _dropout.shared_indices(*idx)
    (seed,) = arrays.seed
    kept = _dropout.keep_from_seed((seed[0], seed[1]), static.dropout_rate, *idx)
    dp = jnp.where(kept, dp / (1.0 - static.dropout_rate), 0.0)
  # Δ = rowsum(P ⊙ dP) = rowsum(O ⊙ dO) at the unrounded output: the kernel's, rounded to
  # the inputs' dtype, would leave its rounding in dP − Δ, which the sum over every
  # position (ALiBi's slope sums dS times the distance) amplifies.
  delta = jnp.sum(p * dp, axis=-1, keepdims=True)
  d_x, *d_learned = vjp(p * (dp - delta + d_lse[..., None]))
  d_bias = None
  if wants_bias:
    d_bias = _common.reduce_to_shape(d_x, arrays.bias[0].shape).astype(arrays.bias[0].dtype)
  return d_learned, d_bias
