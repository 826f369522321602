"""flex's Hopper backward kernels: dQ, and dK and dV in the transposed domain."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.impl import tiling
from jattn.impl.flex_hopper import _call, _mosaic, _tile
from jattn.impl.flex_hopper._mosaic import ROWS


def _tensors(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  out: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
) -> tuple[jax.Array, ...]:
  """The backward kernels' six tensor inputs: query, key, value, dO, the base-2 log-sum-exp
  (+inf where a row saw no key: p = 0 there, no gradient) and Δ = rowsum(O ⊙ dO) − d_lse
  (the lse's cotangent enters dS as Δ does: dS = P ⊙ (dP − Δ + d_lse))."""
  f = jnp.float32
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(f), d_out.astype(f)) - d_lse
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2).astype(f)
  return query, key, value, d_out, lse2, delta


class _At(NamedTuple):
  """A backward tile: its PARTIAL-ness, the program's global batch row and head, its first
  query and key, the segment ids' conjunct (``_tile.keeper``'s) and its bias and dense mask
  tiles (``_tile.plane_tile``'s, or None)."""

  masked: bool
  b: Any
  h: Any
  q0: Any
  k0: Any
  keep: Any
  tiles: tuple[Any, Any]


def _dq_tile(
  static: _call.Static, r: _call.Refs, at: _At, dq: Any, q: Any, do: Any, k: Any, v: Any,
  lse: Any, dlt: Any, staging: Any,
) -> Any:  # fmt: skip
  """``dq`` plus one key tile's ``dS K`` (S = Q Kᵀ, dP = dO Vᵀ, dS = P ⊙ (dP − Δ), through
  the score function's derivative; ``lse`` and Δ along the tile's rows), every product a
  wgmma; one-warpgroup and warp-specialised kernels alike."""
  products = _mosaic.matmul(q, k.transpose((1, 0)), (ROWS, ROWS))
  t, slope = _scores(static, r, at, products, transposed=False)
  p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [0]))
  dp = _mosaic.matmul(do, v.transpose((1, 0)), (ROWS, ROWS))
  dp = _tile.dropout_keep(dp.shape, static, r, at.b, at.h, at.q0, at.k0)(dp)
  ds = _through_score(p * (dp - lax.broadcast_in_dim(dlt, t.shape, [0])), slope)
  return _mosaic.accumulate(dq, _mosaic.staged(ds.astype(k.dtype), staging), k, static.interpret)


def _dkv_tile(
  static: _call.Static, r: _call.Refs, at: _At, dk: Any, dv: Any, k: Any, v: Any, q: Any,
  do: Any, lse: Any, dlt: Any, staging: Any,
) -> tuple[Any, Any]:  # fmt: skip
  """``(dk, dv)`` plus one query tile's ``dSᵀ Q`` and ``Pᵀ dO``, in the transposed domain
  (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ; ``lse`` and Δ along the tile's columns), every product a wgmma;
  one-warpgroup and warp-specialised kernels alike."""
  products = _mosaic.matmul(k, q.transpose((1, 0)), (ROWS, ROWS))
  t, slope = _scores(static, r, at, products, transposed=True)
  p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [1]))
  dropped = _tile.dropout_keep(p.shape, static, r, at.b, at.h, at.q0, at.k0, True)
  pv = _mosaic.staged(dropped(p).astype(k.dtype), staging)
  dv = _mosaic.accumulate(dv, pv, do, static.interpret)
  dp = dropped(_mosaic.matmul(v, do.transpose((1, 0)), (ROWS, ROWS)))
  ds = _through_score(p * (dp - lax.broadcast_in_dim(dlt, t.shape, [1])), slope)
  dk = _mosaic.accumulate(dk, _mosaic.staged(ds.astype(k.dtype), staging), q, static.interpret)
  return dk, dv


def _scores(
  static: _call.Static, r: _call.Refs, at: _At, products: Any, transposed: bool
) -> tuple[Any, Any]:
  """A backward tile's ``(t, slope)`` (:func:`_tile.scores`, with the derivative)."""
  return _tile.scores(
    products, scale=static.scale, score_fn=r.score_fn, mask=r.mask, masked=at.masked, b=at.b,
    h=at.h, q0=at.q0, k0=at.k0, transposed=transposed, derivative=True, keep=at.keep,
    bias=at.tiles[0], dense=at.tiles[1], lengths=static.lengths, slope_fn=r.slope,
  )  # fmt: skip


def _through_score(ds: Any, slope: Any) -> Any:
  """dS of the scaled scores: of the score function's output times its derivative."""
  return ds if slope is None else ds * slope


def _grouped(x: jax.Array, K: int, dtype: Any) -> jax.Array:
  """Each query head's dK or dV (B, S, N, ·) summed over its group of K key/value heads."""
  B, S, N, _ = x.shape
  return x.reshape(B, S, K, N // K, -1).sum(3, dtype=jnp.float32).astype(dtype)


def one_warpgroup(
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
  S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
  G, dtype, bk = N // K, query.dtype, ROWS
  scale, stages, interpret = static.scale, static.stages, static.interpret
  n_ids = len(arrays.ids)
  n_streamed_ids = 1 if n_ids else 0
  swizzled = _mosaic.swizzled()
  layout = plgpu.Layout.WGMMA

  def dq_body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    r = _call.split_refs(refs[6:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    dq_ref, q_smem, do_smem, lse_smem, delta_smem, bars, a_smem, id_smem = r.rest
    i = tiling.tile_of(lax.axis_index("q"), T // ROWS, static.from_last[1])
    h, b = lax.axis_index("h"), lax.axis_index("b")
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
        tiles = _tile.plane_tile(bias_smem), _tile.plane_tile(dense_smem)
        at = _At(masked, b_g, h_g, i * ROWS, j * bk, keeper(*ids_smem), tiles)
        return _dq_tile(static, r, at, dq, q_smem, do_smem, k_smem, v_smem, lse, dlt, a_smem)

      return run

    def pipeline(first: Any, count: Any, masked: bool, dq: Any) -> Any:
      at = lambda t: order_ref[i, t + first]
      k_spec = plgpu.BlockSpec((bk, H), lambda t: (at(t), 0), transforms=swizzled)
      v_spec = plgpu.BlockSpec((bk, Hv), lambda t: (at(t), 0), transforms=swizzled)
      dense = r.dense if masked else None
      specs, refs = _tile.streams(ids, r.bias, dense, (b_g, b, h, h_g), i, ROWS, bk, at, False)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[k_spec, v_spec, *specs],
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
    dk_ref, dv_ref, k_smem, v_smem, bars, a_smem, id_smem = r.rest
    j = tiling.tile_of(lax.axis_index("kv"), S // bk, static.from_last[2])
    h, b = lax.axis_index("h"), lax.axis_index("b")
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
        i = order_ref[j, index[0] + first]
        lse = _mosaic.load(lse_smem, layout.reduce(0))
        dlt = _mosaic.load(d_smem, layout.reduce(0))
        tiles = _tile.plane_tile(bias_smem), _tile.plane_tile(dense_smem)
        at = _At(masked, b_g, h_g, i * ROWS, j * bk, keeper(*ids_smem), tiles)
        dk, dv = carry
        args = (k_smem, v_smem, q_smem, do_smem, lse, dlt, a_smem)
        return _dkv_tile(static, r, at, dk, dv, *args)

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda t: order_ref[j, t + first]
      tile = lambda d: plgpu.BlockSpec((ROWS, d), lambda t: (at(t), 0), transforms=swizzled)
      vec = plgpu.BlockSpec((ROWS,), lambda t: (at(t),))
      dense = r.dense if masked else None
      specs, refs = _tile.streams(ids, r.bias, dense, (b_g, b, h, h_g), j, bk, ROWS, at, True)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[tile(H), tile(Hv), vec, vec, *specs],
        max_concurrent_steps=stages, init_carry=carry,
      )(q_ref.at[b, :, h, :], do_ref.at[b, :, h, :], lse_ref.at[b, h, :],
        delta_ref.at[b, h, :], *refs)  # fmt: skip

    zero = lambda d: plgpu.layout_cast(jnp.full((bk, d), 0.0, jnp.float32), layout)
    dk, dv = _mosaic.walk(pipeline, full_ref[j], partial_ref[j], static.masked, (zero(H), zero(Hv)))
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, cols, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, cols, h])
    plgpu.wait_smem_to_gmem(0)

  a_scratch = lambda shape: plgpu.SMEM(shape, dtype, transforms=swizzled) if interpret else None
  inputs = _tensors(query, key, value, out, lse2, d_out, d_lse)
  dq = plgpu.kernel(
    dq_body,
    out_type=jax.ShapeDtypeStruct(query.shape, dtype),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, Hv), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=5),
      a_scratch((ROWS, bk)),
      plgpu.SMEM((ROWS,), jnp.int32) if n_ids else None,  # the query tile's segment ids
    ),
    **_mosaic.interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.rows, T, S))
  per_head = lambda d: jax.ShapeDtypeStruct((B, S, N, d), dtype)  # each query head's dK, dV
  dk, dv = plgpu.kernel(
    dkv_body,
    out_type=(per_head(H), per_head(Hv)),
    grid=(S // bk, N, B),
    grid_names=("kv", "h", "b"),
    scratch_types=(
      plgpu.SMEM((bk, H), dtype, transforms=swizzled),
      plgpu.SMEM((bk, Hv), dtype, transforms=swizzled),
      plgpu.Barrier(num_barriers=3),
      a_scratch((bk, ROWS)),
      plgpu.SMEM((bk,), jnp.int32) if n_ids else None,  # the key tile's segment ids
    ),
    **_mosaic.interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.cols, T, S, transposed=True))
  return dq, _grouped(dk, K, dtype), _grouped(dv, K, dtype)


def specialized(
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
  """``(dq, dk, dv)`` as :func:`one_warpgroup`'s, warp-specialised as the forward's
  :func:`_forward.specialized` is: each kernel's program holds 128 rows, 64 for each of two
  compute warpgroups (dQ: query rows, their Q, dO, log-sum-exp and Δ; dK/dV: key rows,
  their K and V), and a third warpgroup walks the block's schedule (``arrays.rows`` at 128 x
  64, ``arrays.cols`` at 128 keys x 64 queries), bringing each streamed tile (dQ: K and V;
  dK/dV: Q, dO, log-sum-exp, Δ; with the streamed axis's segment ids and the block's bias and
  dense mask tiles) into one of ``static.stages`` shared-memory slots by TMA, waiting until
  both compute warpgroups have released the slot; it gives up registers for them
  (``set_max_registers``). Both compute warpgroups run every tile the block's schedule lists
  (a half that does not need it evaluates the mask there and keeps nothing). T and S must
  be multiples of 128."""
  tensors = _tensors(query, key, value, out, lse2, d_out, d_lse)
  dq = _specialized_pass(tensors, arrays, static, transposed=False)
  dk, dv = _specialized_pass(tensors, arrays, static, transposed=True)
  K, dtype = key.shape[2], query.dtype
  return dq, _grouped(dk, K, dtype), _grouped(dv, K, dtype)


def _specialized_pass(
  tensors: tuple[jax.Array, ...], arrays: _call.Arrays, static: _call.Static, transposed: bool
) -> Any:
  """One warp-specialised kernel of :func:`specialized`: dQ, or (``transposed``) dK and dV
  for each query head."""
  plgpu = _mosaic.mosaic_gpu()
  query, key, value, d_out, lse2, delta = tensors
  B, T, N, H = query.shape
  S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
  G, dtype = N // K, query.dtype
  stages, interpret = static.stages, static.interpret
  n_ids = len(arrays.ids)
  blocks = (S if transposed else T) // (2 * ROWS)  # of the held axis
  layout = plgpu.Layout.WGMMA
  swizzled = _mosaic.swizzled()
  tile = lambda lead, d: plgpu.SMEM((lead, ROWS, d), dtype, transforms=swizzled)
  vec = lambda lead: plgpu.SMEM((lead, ROWS), jnp.float32)
  # Held for each compute group: dQ's Q, dO, lse, Δ; dK/dV's K, V. Streamed into each slot:
  # the other axis's. The streamed axis's ids per slot, each group's own ids; each slot's
  # bias and dense mask tiles, both groups' rows.
  held: tuple[Any, ...]
  streamed: tuple[Any, ...]
  if transposed:  # K and V held; Q, dO, lse, Δ streamed
    held = (tile(2, H), tile(2, Hv))
    streamed = (tile(stages, H), tile(stages, Hv), vec(stages), vec(stages))
  else:  # Q, dO, lse, Δ held; K and V streamed
    held = (tile(2, H), tile(2, Hv), vec(2), vec(2))
    streamed = (tile(stages, H), tile(stages, Hv))
  ids_smem = (
    (plgpu.SMEM((2, ROWS), jnp.int32), plgpu.SMEM((stages, ROWS), jnp.int32))
    if n_ids
    else (None, None)
  )
  planes_smem = _tile.slot_planes(arrays.bias, arrays.dense, stages, ROWS)
  smem = (held, streamed, ids_smem, planes_smem)
  need = _mosaic.smem_bytes(smem)
  name = "dK/dV" if transposed else "dQ"
  if need > _mosaic.SMEM_BYTES:
    raise ValueError(
      f"specialized: the warp-specialised {name} kernel would need {need} bytes of shared "
      f"memory (head dim {H}, {stages} stages, the bias's and dense mask's tiles), past "
      f"Hopper's {_mosaic.SMEM_BYTES}: fewer stages, a bfloat16 bias, or specialized=False"
    )
  # The interpreter's wgmma reads its A operand (P, dS) from shared memory only.
  staging = plgpu.SMEM((2, ROWS, ROWS), dtype, transforms=swizzled) if interpret else None
  n_streamed = len(streamed) + bool(n_ids) + bool(arrays.bias) + bool(arrays.dense)
  barriers = (
    plgpu.Barrier(num_arrivals=len(held), num_barriers=2),  # each group's held tiles landed
    plgpu.Barrier(num_barriers=2),  # each group's own segment ids
    plgpu.Barrier(num_arrivals=n_streamed, num_barriers=stages),  # a slot's tiles landed
    plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both groups are done with a slot
  )

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    r = _call.split_refs(refs[6:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    *outs, scoped = r.rest
    (held_smem, slot_smem, (own_ids, slot_ids), (bias_smem, dense_smem), a_smem), bars = scoped
    held_ready, ids_ready, ready, free = bars
    n = tiling.tile_of(lax.axis_index("block"), blocks, static.from_last[2 if transposed else 1])
    h, b = lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    b_g, h_g = _mosaic.global_index(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    n_full, n_partial = full_ref[n], partial_ref[n]
    slot_of = lambda t: lax.rem(t, jnp.array(stages, t.dtype))

    @pl.when(wg < 2)
    def _compute() -> None:
      plgpu.set_max_registers(232, action="increase")
      start = n * (2 * ROWS) + wg * ROWS
      rows = pl.ds(start, ROWS)
      mine = [x.at[wg] for x in held_smem]
      if transposed:
        sources = [k_ref.at[b, rows, kv_head], v_ref.at[b, rows, kv_head]]
      else:
        sources = [
          q_ref.at[b, rows, h], do_ref.at[b, rows, h], lse_ref.at[b, h, rows],
          delta_ref.at[b, h, rows],
        ]  # fmt: skip
      for src, dst in zip(sources, mine):
        plgpu.copy_gmem_to_smem(src, dst, held_ready.at[wg])
      held_ids = None if own_ids is None else own_ids.at[wg]
      keeper = _tile.keeper(ids, b_g, rows, held_ids, ids_ready.at[wg], transposed=transposed)
      plgpu.barrier_wait(held_ready.at[wg])
      a = None if a_smem is None else a_smem.at[wg]
      zero = lambda d: plgpu.layout_cast(jnp.full((ROWS, d), 0.0, jnp.float32), layout)

      def step(t: Any, carry: Any, masked: bool) -> Any:
        slot = slot_of(t)
        other = order_ref[n, t]  # the streamed tile
        q0, k0 = (other * ROWS, start) if transposed else (start, other * ROWS)
        plgpu.barrier_wait(ready.at[slot])
        slots = [x.at[slot] for x in slot_smem]
        keep = keeper(*(() if slot_ids is None else (slot_ids.at[slot],)))
        tiles = _tile.group_tiles((bias_smem, dense_smem), slot, wg, masked)
        at = _At(masked, b_g, h_g, q0, k0, keep, tiles)
        if transposed:  # K, V held; Q, dO, lse, Δ streamed
          q_smem, do_smem, lse_smem, d_smem = slots
          lse = _mosaic.load(lse_smem, layout.reduce(0))
          dlt = _mosaic.load(d_smem, layout.reduce(0))
          k_smem, v_smem = mine
          dk, dv = carry
          carry = _dkv_tile(static, r, at, dk, dv, k_smem, v_smem, q_smem, do_smem, lse, dlt, a)
        else:  # Q, dO, lse, Δ held; K, V streamed
          q_smem, do_smem, lse_smem, d_smem = mine
          lse = _mosaic.load(lse_smem, layout.reduce(1))
          dlt = _mosaic.load(d_smem, layout.reduce(1))
          k_smem, v_smem = slots
          carry = _dq_tile(static, r, at, carry, q_smem, do_smem, k_smem, v_smem, lse, dlt, a)
        plgpu.barrier_arrive(free.at[slot])
        return carry

      carry = (zero(H), zero(Hv)) if transposed else zero(H)
      carry = lax.fori_loop(0, n_full, lambda t, c: step(t, c, False), carry)
      if static.masked:
        carry = lax.fori_loop(n_full, n_full + n_partial, lambda t, c: step(t, c, True), carry)
      # The gradients through the held tiles' buffers, which no copy writes again.
      if transposed:
        dk, dv = carry
        results = [(dk * static.scale, mine[0], outs[0]), (dv, mine[1], outs[1])]
      else:
        results = [(carry * static.scale, mine[0], outs[0])]
      for x, buffer, _ in results:
        buffer[...] = x.astype(dtype)
      plgpu.commit_smem()
      for _, buffer, dst in results:
        plgpu.copy_smem_to_gmem(buffer, dst.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _copy() -> None:
      plgpu.set_max_registers(40, action="decrease")

      @pl.loop(0, n_full + n_partial)
      def _(t: Any) -> None:
        slot = slot_of(t)
        span = pl.ds(order_ref[n, t] * ROWS, ROWS)  # the streamed tile's rows

        @pl.when(t >= stages)  # the slot's last tile is released by both compute groups
        def _() -> None:
          plgpu.barrier_wait(free.at[slot])

        if transposed:
          sources = [
            q_ref.at[b, span, h], do_ref.at[b, span, h], lse_ref.at[b, h, span],
            delta_ref.at[b, h, span],
          ]  # fmt: skip
        else:
          sources = [k_ref.at[b, span, kv_head], v_ref.at[b, span, kv_head]]
        for src, dst in zip(sources, slot_smem):
          plgpu.copy_gmem_to_smem(src, dst.at[slot], ready.at[slot])
        if slot_ids is not None:  # the streamed axis's segment ids
          src = ids[0] if transposed else ids[1]
          plgpu.copy_gmem_to_smem(
            src.at[_mosaic.row(src, b_g), span], slot_ids.at[slot], ready.at[slot]
          )
        # the block's bias and dense mask tiles, on the same barrier
        block = pl.ds(n * (2 * ROWS), 2 * ROWS)
        at = (b_g, b, h, h_g)
        planes = (bias_smem, dense_smem)
        _tile.copy_planes(r.bias, r.dense, planes, slot, at, block, span, ready.at[slot])

      _mosaic.drain((free,), n_full + n_partial, stages)

  def entry(*refs: Any) -> None:
    pl.run_scoped(
      lambda *scoped: body(*refs, scoped), (*smem, staging), barriers, collective_axes="wg"
    )

  if transposed:
    per_head = lambda d: jax.ShapeDtypeStruct((B, S, N, d), dtype)  # each query head's dK, dV
    out_type: Any = (per_head(H), per_head(Hv))
  else:
    out_type = jax.ShapeDtypeStruct(query.shape, dtype)
  schedule = arrays.cols if transposed else arrays.rows
  return plgpu.kernel(
    entry,
    out_type=out_type,
    grid=(blocks, N, B),
    grid_names=("block", "h", "b"),
    num_threads=3,
    thread_name="wg",
    **_mosaic.interpreted(interpret),
  )(*tensors, *arrays.kernel_inputs(schedule, T, S, transposed=transposed))
