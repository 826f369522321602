"""flex's forward pass as a Mosaic GPU kernel for Hopper (sm_90): wgmma and TMA through Pallas.

**Not yet run on a GPU, and reached by nothing**: it lowers for CUDA from a CPU (the program
holds one Mosaic GPU call) and computes exact values in Mosaic GPU's interpreter (jax >= 0.12),
but no call of jattn routes to it until a GPU has run it and its record is committed;
``python -m experiments.gpu_probe`` times it (method ``hopper``) beside cuDNN and the Triton
kernels. The backward pass, masks that read arrays and score functions come after that.

One program per (query tile of 64 rows, head, batch row), one warpgroup: the query tile is
copied to shared memory once (TMA), then ``plgpu.emit_pipeline`` streams the key and value
tiles through ``stages`` shared-memory buffers (TMA, mbarriers) while the warpgroup runs
``S = Q Kᵀ`` and ``O += P V`` on the tensor cores (wgmma) and the online softmax in base 2
between them (the scale times log2(e) folded into one multiply, as the Triton kernels do).
A mask's tile schedule (flex's: per query tile, its FULL key tiles, then its PARTIAL ones)
comes in as three int32 arrays that the pipelines' index maps read: the FULL tiles stream
through one pipeline, the PARTIAL ones through a second, the only one that evaluates the
mask (traced into the kernel body on the tile's indices); EMPTY tiles are never loaded. Each
step's P V goes to a fresh accumulator added to the rescaled one (``acc · α + P V``, one
FMA per element), since the interpreter cannot accumulate into an accumulator initialised
from registers; on the GPU P stays in registers as wgmma's A operand, while the interpreter,
whose wgmma reads A from shared memory only, stages it there.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn import masks as _masks
from jattn.impl import _tiling

LOG2E = math.log2(math.e)
ROWS = 64  # a warpgroup's wgmma M


def _plgpu() -> Any:
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


def forward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool = False,
  mask: _masks.Mask | None = None,
  block_kv: int = 64,
  stages: int = 2,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` of softmax attention: query (B, T, N, H), key and value (B, S, K, H),
  N a multiple of K (grouped queries), float16 or bfloat16, H a multiple of 64, T a multiple
  of 64 and S of ``block_kv``; ``is_causal`` as jax.nn's (query t sees keys s <= t, T = S),
  and ``mask`` a jattn mask of indices alone (one that reads no array), and'ed with it.
  ``lse`` is (B, N, T) float32, the natural log-sum-exp of each row's scaled scores; a row
  that sees no key gives zeros and an lse of -inf.
  ``interpret`` runs it in Mosaic GPU's interpreter (jax >= 0.12), on any backend."""
  plgpu = _plgpu()
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  dtype = query.dtype
  if dtype not in (jnp.float16, jnp.bfloat16):
    raise ValueError(f"query: the Hopper kernel takes float16 or bfloat16, got {dtype}")
  if key.dtype != dtype or value.dtype != dtype:
    raise ValueError(f"key, value: dtypes {key.dtype}, {value.dtype} differ from query's {dtype}")
  if key.shape != (B, S, K, H) or value.shape != key.shape:
    raise ValueError(f"key, value: shapes {key.shape}, {value.shape}; want (B, S, K, H) = "
                     f"{(B, S, K, H)} with query's B and H")  # fmt: skip
  if N % K:
    raise ValueError(f"query: {N} heads are not a multiple of key's {K}")
  if H % 64:
    raise ValueError(f"query: head dim {H} is not a multiple of 64")
  if T % ROWS or S % block_kv or block_kv % 64:
    raise ValueError(
      f"query, key: lengths {T} and {S} must be multiples of {ROWS} and block_kv={block_kv} "
      "(itself a multiple of 64)"
    )
  if is_causal and T != S:
    raise ValueError(f"is_causal: the Hopper kernel takes T = S, got {T} and {S}")
  if mask is not None and jax.tree.leaves(mask):
    raise ValueError(f"mask: the Hopper kernel takes masks of indices alone, {mask} reads arrays")
  if is_causal:
    mask = _masks.causal() if mask is None else _masks.causal() & mask
  view = _tiling.tile_classes(mask, B, N, T, S, ROWS, block_kv)
  order, num_full, num_partial = _tiling.schedule(view)
  if interpret and not hasattr(plgpu, "InterpretGPUParams"):
    raise ValueError("interpret: Mosaic GPU's interpreter needs jax >= 0.12")
  G = N // K
  scale_log2 = float(scale) * LOG2E
  # wgmma's operands in shared memory: 8 x 64 tiles with a 128-byte swizzle (16-bit elements)
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  wgmma_layout = plgpu.Layout.WGMMA

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, order_ref, full_ref, partial_ref = refs[:6]
    out_ref, lse_ref, q_smem, o_smem, lse_smem, q_bar, p_smem = refs[6:]
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    rows = pl.ds(i * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    reduced = wgmma_layout.reduce(1)
    carry = (
      plgpu.layout_cast(jnp.full((ROWS, H), 0.0, jnp.float32), wgmma_layout),
      plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
      plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), reduced),
    )

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], k_smem: Any, v_smem: Any, carry: Any) -> Any:
        acc, m, l = carry
        j = order_ref[i, index[0] + first]  # the key tile

        def scores(acc_ref: Any) -> Any:
          plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
          return acc_ref[...]

        t = pl.run_scoped(scores, plgpu.ACC((ROWS, block_kv), jnp.float32)) * scale_log2
        m_new = m
        if masked:  # PARTIAL tiles: the mask on the tile's indices
          iota = lambda axis: plgpu.broadcasted_iota(
            jnp.int32, (ROWS, block_kv), axis, layout=wgmma_layout
          )
          q_idx, kv_idx = iota(0) + i * ROWS, iota(1) + j * block_kv
          assert mask is not None
          t = jnp.where(mask(b, h, q_idx, kv_idx), t, -jnp.inf)
        m_new = jnp.maximum(m, t.max(axis=1))
        # A row whose keys so far are all masked keeps m = -inf: shift it by 0, not by -inf
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - shift)
        p = jnp.exp2(t - lax.broadcast_in_dim(shift, t.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        p = p.astype(dtype)
        if p_smem is not None:  # the interpreter's wgmma reads A from shared memory only
          p_smem[...] = p
          plgpu.commit_smem()

        def values(acc_ref: Any) -> Any:
          plgpu.wgmma(acc_ref, p if p_smem is None else p_smem, v_smem)
          return acc_ref[...]

        pv = pl.run_scoped(values, plgpu.ACC((ROWS, H), jnp.float32))
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda step: (order_ref[i, step + first], 0)
      spec = plgpu.BlockSpec((block_kv, H), at, transforms=swizzled)
      return plgpu.emit_pipeline(
        step(first, masked),
        grid=(count,),
        in_specs=[spec, spec],
        max_concurrent_steps=stages,
        init_carry=carry,
      )(k_ref.at[b, :, kv_head, :], v_ref.at[b, :, kv_head, :])

    n_full = full_ref[i]
    carry = pipeline(0, n_full, False, carry)
    if mask is not None:
      carry = pipeline(n_full, partial_ref[i], True, carry)
    acc, m, l = carry
    if mask is not None:  # rows that saw no key: zeros (and lse -inf)
      acc = jnp.where(lax.broadcast_in_dim(l, acc.shape, [0]) == 0.0, 0.0, acc)
      l = jnp.where(l == 0.0, 1.0, l)  # m stays -inf there: lse = m + log2(1)
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  extra = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
  out, lse2 = plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct(query.shape, dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.SMEM((ROWS, block_kv), dtype, transforms=swizzled) if interpret else None,
    ),
    **extra,
  )(query, key, value, jnp.asarray(order), jnp.asarray(num_full), jnp.asarray(num_partial))
  return out, lse2 / LOG2E
