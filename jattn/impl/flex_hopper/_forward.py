"""flex's Hopper forward kernels: one warpgroup per 64 query rows (:func:`one_warpgroup`),
or warp-specialised as FlashAttention-3 arranges it (:func:`specialized`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.impl import tiling
from jattn.impl.flex_hopper import _call, _mosaic, _tile
from jattn.impl.flex_hopper._mosaic import ROWS


def one_warpgroup(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
  out_dtype: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out, lse in base 2, the rows' running max in base 2)``: the package's ``forward``'s
  one-warpgroup kernel; ``out`` in ``out_dtype`` (float32 for the backward's Δ; default: the
  inputs' dtype); the max -inf for rows that saw no key."""
  plgpu = _mosaic.mosaic_gpu()
  B, T, N, H = query.shape
  S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
  dtype = query.dtype
  scale, block_kv, stages = static.scale, static.block_kv, static.stages
  interpret = static.interpret
  n_ids = len(arrays.ids)
  G = N // K
  swizzled = _mosaic.swizzled()
  wgmma_layout = plgpu.Layout.WGMMA
  o_dtype = jnp.dtype(out_dtype or dtype)
  o_transforms = _mosaic.swizzled(o_dtype.itemsize)  # float32: 8 x 32 tiles
  n_streamed_ids = 1 if n_ids else 0

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref = refs[:3]
    r = _call.split_refs(refs[3:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    mask, score_fn = r.mask, r.score_fn
    out_ref, lse_ref, max_ref, q_smem, o_smem, lse_smem, q_bar, p_smem, id_smem = r.rest
    i = tiling.tile_of(lax.axis_index("q"), T // ROWS, static.from_last[0])
    h, b = lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _mosaic.global_index(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    rows = pl.ds(i * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_bar.at[0])
    reduced = wgmma_layout.reduce(1)
    keeper = _tile.keeper(ids, b_g, rows, id_smem, q_bar.at[1], transposed=False)
    plgpu.barrier_wait(q_bar.at[0])
    carry = (
      plgpu.layout_cast(jnp.full((ROWS, Hv), 0.0, jnp.float32), wgmma_layout),
      plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
      plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), reduced),
    )

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], k_smem: Any, v_smem: Any, *rest: Any) -> Any:
        *streamed, carry = rest  # the key tile's segment ids, bias and dense mask tiles
        ids_smem, bias_smem, dense_smem = _tile.split_streamed(
          streamed, n_streamed_ids, static.biased, static.dense and masked
        )
        acc, m, l = carry
        j = order_ref[i, index[0] + first]  # the key tile

        products = _mosaic.matmul(q_smem, k_smem.transpose((1, 0)), (ROWS, block_kv))
        t, _ = _tile.scores(
          products, scale=scale, score_fn=score_fn, mask=mask, masked=masked, b=b_g, h=h_g,
          q0=i * ROWS, k0=j * block_kv, keep=keeper(*ids_smem),
          bias=_tile.plane_tile(bias_smem), dense=_tile.plane_tile(dense_smem),
          lengths=static.lengths,
        )  # fmt: skip
        p, alpha, m_new, l = _tile.online_softmax(t, m, l, masked)
        # l sums P as it is; O sums it with dropout applied
        dropped = _tile.dropout_keep(p.shape, static, r, b_g, h_g, i * ROWS, j * block_kv)
        a = _mosaic.staged(dropped(p).astype(dtype), p_smem)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return _mosaic.accumulate(acc, a, v_smem, interpret), m_new, l

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda step: (order_ref[i, step + first], 0)
      k_spec = plgpu.BlockSpec((block_kv, H), at, transforms=swizzled)
      v_spec = plgpu.BlockSpec((block_kv, Hv), at, transforms=swizzled)
      dense = r.dense if masked else None
      specs, refs = _tile.streams(
        ids, r.bias, dense, (b_g, b, h, h_g), i, ROWS, block_kv, lambda t: at(t)[0], False
      )
      return plgpu.emit_pipeline(
        step(first, masked),
        grid=(count,),
        in_specs=[k_spec, v_spec, *specs],
        max_concurrent_steps=stages,
        init_carry=carry,
      )(k_ref.at[b, :, kv_head, :], v_ref.at[b, :, kv_head, :], *refs)

    acc, m, l = _mosaic.walk(pipeline, full_ref[i], partial_ref[i], static.masked, carry)
    if static.masked:  # rows that saw no key: acc is 0 (every p was), l too; out 0
      l = jnp.where(l == 0.0, 1.0, l)  # m stays -inf there: lse = m + log2(1)
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_dtype)
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)
    _mosaic.store_rows(m, lse_smem, max_ref.at[b, h, rows])  # the lse's buffer, now free

  return plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct((B, T, N, Hv), o_dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, Hv), o_dtype, transforms=o_transforms),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=2),
      plgpu.SMEM((ROWS, block_kv), dtype, transforms=swizzled) if interpret else None,
      plgpu.SMEM((ROWS,), jnp.int32) if n_ids else None,  # the query tile's segment ids
    ),
    **_mosaic.interpreted(interpret),
  )(query, key, value, *arrays.kernel_inputs(arrays.forward, T, S))


def specialized(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
  out_dtype: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out, lse in base 2, running max in base 2)``: the package's ``forward`` as
  FlashAttention-3 arranges it on Hopper, ``out`` in ``out_dtype`` as
  :func:`one_warpgroup`'s.

  One program per 128 query rows, head and batch row, three warpgroups. The third copies:
  it walks the block's schedule (its FULL key tiles, then its PARTIAL ones, as
  ``schedule``'s int32 arrays at 128 x block_kv list them) and brings each key and value
  tile into one of ``stages`` shared-memory slots by TMA, each completing on the slot's
  barrier, waiting first until both compute warpgroups have released the slot. The first
  two compute, 64 query rows each, over the same tiles: ``S = Q Kᵀ`` and ``O += P V`` on
  the tensor cores, the online softmax in base 2 between them, the mask evaluated on
  PARTIAL tiles only. A schedule barrier that both
  compute warpgroups pass twice a step keeps one's softmax under the other's matrix
  products (ping-pong). The copy warpgroup gives up registers for the compute ones
  (``set_max_registers``). Where the block's schedule lists a tile one half of it does not
  need, that half evaluates the mask there and keeps nothing of it."""
  plgpu = _mosaic.mosaic_gpu()
  B, T, N, H = query.shape
  S, K, Hv = key.shape[1], key.shape[2], value.shape[3]
  dtype = query.dtype
  G = N // K
  bk, stages, scale, interpret = static.block_kv, static.stages, static.scale, static.interpret
  swizzled = _mosaic.swizzled()
  wgmma_layout = plgpu.Layout.WGMMA
  masked_tiles = static.masked
  n_ids = len(arrays.ids)
  o_dtype = jnp.dtype(out_dtype or dtype)
  # Shared memory: both groups' query tiles, `stages` key and value slots, the outputs
  # where the query tiles cannot hold them (float32, or a value head dim of its own), each
  # slot's bias and dense mask tiles (both groups' rows).
  smem = (
    plgpu.SMEM((2, ROWS, H), dtype, transforms=swizzled),
    plgpu.SMEM((stages, bk, H), dtype, transforms=swizzled),
    plgpu.SMEM((stages, bk, Hv), dtype, transforms=swizzled),
    plgpu.SMEM((2, ROWS), jnp.float32),
    plgpu.SMEM((2, ROWS), jnp.int32) if n_ids else None,  # each group's query ids
    plgpu.SMEM((stages, bk), jnp.int32) if n_ids else None,  # each slot's key ids
    plgpu.SMEM((2, ROWS, Hv), o_dtype, transforms=_mosaic.swizzled(o_dtype.itemsize))
    if o_dtype != dtype or Hv != H
    else None,
    *_tile.slot_planes(arrays.bias, arrays.dense, stages, bk),
  )
  need = _mosaic.smem_bytes(smem)
  if need > _mosaic.SMEM_BYTES:
    raise ValueError(
      f"specialized: the warp-specialised forward would need {need} bytes of shared memory "
      f"(head dim {H}, {stages} stages of {bk} keys, the bias's and dense mask's tiles, a "
      f"float32 output), past Hopper's {_mosaic.SMEM_BYTES}: fewer stages, a bfloat16 bias, or "
      "specialized=False"
    )
  # The interpreter's wgmma reads its A operand (P) from shared memory only.
  staging = plgpu.SMEM((2, ROWS, bk), dtype, transforms=swizzled) if interpret else None

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref = refs[:3]
    r = _call.split_refs(refs[3:], static, n_ids)
    (order_ref, full_ref, partial_ref), off_ref, ids = r.schedule, r.offsets, r.ids
    mask, score_fn = r.mask, r.score_fn
    out_ref, lse_ref, max_ref, scoped = r.rest
    (buffers, p_smem), barriers = scoped
    qo_smem, k_smem, v_smem, lse_smem, qid_smem, kid_smem, o_smem, *planes_smem = buffers
    bias_smem, dense_smem = planes_smem
    k_ready, v_ready, q_ready, k_free, v_free, turn, ids_ready = barriers
    i = tiling.tile_of(lax.axis_index("q"), T // (2 * ROWS), static.from_last[0])
    h, b = lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    b_g, h_g = _mosaic.global_index(b, h, off_ref)
    n_full, n_partial = full_ref[i], partial_ref[i]
    steps = n_full + n_partial
    slot_of = lambda t: lax.rem(t, jnp.array(stages, t.dtype))

    def take_turn() -> None:  # the ping-pong: both compute warpgroups pass, in turn
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _compute() -> None:
      plgpu.set_max_registers(232, action="increase")
      q_smem = qo_smem.at[wg]
      q0 = i * (2 * ROWS) + wg * ROWS
      rows = pl.ds(q0, ROWS)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_ready.at[wg])
      held = None if qid_smem is None else qid_smem.at[wg]
      keeper = _tile.keeper(ids, b_g, rows, held, ids_ready.at[wg], transposed=False)
      plgpu.barrier_wait(q_ready.at[wg])
      reduced = wgmma_layout.reduce(1)
      carry = (
        plgpu.layout_cast(jnp.full((ROWS, Hv), 0.0, jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
        plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), reduced),
      )
      pl.when(wg == 1)(take_turn)  # the second waits for the first's first product

      def step(t: Any, carry: Any, masked: bool) -> Any:
        acc, m, l = carry
        slot = slot_of(t)
        j = order_ref[i, t]  # the key tile
        plgpu.barrier_wait(k_ready.at[slot])

        def qk(acc_ref: Any) -> Any:
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          take_turn()
          return acc_ref[...]

        products = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32))
        # The key tile's ids (landed with it) are read before its slot is released.
        streamed = () if kid_smem is None else (kid_smem.at[slot],)
        keep = keeper(*streamed) if masked else None
        # and the group's rows of its bias and dense mask tiles
        bias, dense = _tile.group_tiles((bias_smem, dense_smem), slot, wg, masked)
        plgpu.barrier_arrive(k_free.at[slot])
        t_, _ = _tile.scores(
          products, scale=scale, score_fn=score_fn, mask=mask, masked=masked, b=b_g, h=h_g,
          q0=q0, k0=j * bk, keep=keep, bias=bias, dense=dense, lengths=static.lengths,
        )  # fmt: skip
        p, alpha, m_new, l = _tile.online_softmax(t_, m, l, masked)
        p16 = _tile.dropout_keep(p.shape, static, r, b_g, h_g, q0, j * bk)(p).astype(dtype)
        plgpu.barrier_arrive(turn)  # this softmax is done: the other may multiply
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(turn)  # and the tensor cores are ours again
        a = _mosaic.staged(p16, None if p_smem is None else p_smem.at[wg])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = _mosaic.accumulate(acc, a, v_smem.at[slot], interpret)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      carry = lax.fori_loop(0, n_full, lambda t, c: step(t, c, False), carry)
      acc, m, l = lax.fori_loop(n_full, steps, lambda t, c: step(t, c, masked_tiles), carry)
      pl.when(wg == 0)(take_turn)  # the first's last pass, matching the second's first
      if masked_tiles:  # rows that saw no key: acc is 0 (every p was), l too; out 0
        l = jnp.where(l == 0.0, 1.0, l)  # m stays -inf there: lse = m + log2(1)
      # the output in the query tile's buffer, or (float32, Hv != H) its own
      out_smem = q_smem if o_smem is None else o_smem.at[wg]
      out_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_dtype)
      lse_smem.at[wg][...] = m + jnp.log2(l)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, rows, h])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, rows])
      plgpu.wait_smem_to_gmem(0)
      _mosaic.store_rows(m, lse_smem.at[wg], max_ref.at[b, h, rows])  # the lse's buffer

    @pl.when(wg == 2)
    def _copy() -> None:
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(h, jnp.array(G, h.dtype))

      @pl.loop(0, steps)
      def _(t: Any) -> None:
        slot = slot_of(t)
        cols = pl.ds(order_ref[i, t] * bk, bk)

        @pl.when(t >= stages)  # the slot's last tile is released by both compute groups
        def _() -> None:
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kv_head], k_smem.at[slot], k_ready.at[slot])
        # the block's bias and dense mask tiles, on the same barrier
        block = pl.ds(i * 2 * ROWS, 2 * ROWS)
        at = (b_g, b, h, h_g)
        planes = (bias_smem, dense_smem)
        _tile.copy_planes(r.bias, r.dense, planes, slot, at, block, cols, k_ready.at[slot])
        if kid_smem is not None:  # the key tile's segment ids, on the same barrier
          kv_ids = ids[1]
          plgpu.copy_gmem_to_smem(
            kv_ids.at[_mosaic.row(kv_ids, b_g), cols], kid_smem.at[slot], k_ready.at[slot]
          )

        @pl.when(t >= stages)
        def _() -> None:
          plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kv_head], v_smem.at[slot], v_ready.at[slot])

      _mosaic.drain((k_free, v_free), steps, stages)

  def entry(*refs: Any) -> None:
    barriers = (
      # a key tile landed in the slot (and its segment ids, its bias tile: a copy each)
      plgpu.Barrier(
        num_arrivals=1 + bool(n_ids) + bool(arrays.bias) + bool(arrays.dense), num_barriers=stages
      ),
      plgpu.Barrier(num_barriers=stages),  # a value tile
      plgpu.Barrier(num_barriers=2),  # each compute group's query tile
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both groups done with a key slot
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # and with a value slot
      plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the ping-pong's turn
      plgpu.Barrier(num_barriers=2),  # each compute group's query ids
    )
    pl.run_scoped(
      lambda *scoped: body(*refs, scoped), (smem, staging), barriers, collective_axes="wg"
    )

  return plgpu.kernel(
    entry,
    out_type=(
      jax.ShapeDtypeStruct((B, T, N, Hv), o_dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ),
    grid=(T // (2 * ROWS), N, B),
    grid_names=("q", "h", "b"),
    num_threads=3,
    thread_name="wg",
    **_mosaic.interpreted(interpret),
  )(query, key, value, *arrays.kernel_inputs(arrays.forward, T, S))
