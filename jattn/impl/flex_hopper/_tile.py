"""One tile's work inside a Hopper kernel, shared by the forward and backward kernels: its
scores in base 2 (scale, bias, score function, mask on PARTIAL tiles, segment ids, dense
mask; the tile's positions as the functions see them, :func:`line`), dropout's pattern, one
step of the online softmax, and what a pipeline streams beside its tensors' tiles (the
other axis's segment ids, the bias's and dense mask's tiles; a warp-specialised copy
warpgroup's :func:`copy_planes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn import dropout as _dropout
from jattn.impl import _in_kernel
from jattn.impl.flex_hopper import _mosaic
from jattn.impl.flex_hopper._mosaic import LOG2E


def scores(
  products: Any,
  *,
  scale: float,
  score_fn: Any,
  mask: Any,
  masked: bool,
  b: Any,
  h: Any,
  q0: Any,
  k0: Any,
  transposed: bool = False,
  derivative: bool = False,
  keep: Any = None,
  bias: Any = None,
  dense: Any = None,
  lengths: tuple[int, int] = (0, 0),
  slope_fn: Any = None,
) -> tuple[Any, Any]:
  """``(t, slope)`` of one tile: its base-2 scores ``score_fn(scale · q kᵀ + bias) · log2(e)``
  (``bias`` the tile's, float32, in ``products``' orientation, or None), -inf
  where a PARTIAL tile's mask says so, and d score_fn(x)/dx (None without a score function
  or ``derivative``; then ``slope_fn(x, ...)`` gives both, as :meth:`_call.Functions.bind`'s
  third). ``products`` is ``q kᵀ`` (``k qᵀ`` when ``transposed``: keys along
  rows); query rows start at ``q0``, key rows at ``k0``; mask and score function see the
  elements' own indices (``mask`` and ``score_fn`` as :meth:`_call.Functions.bind` gives them).
  ``keep(q_idx, kv_idx)``: the segment ids' conjunct (:func:`keeper`), and ``dense`` the
  dense mask's tile (nonzero: allowed; :func:`plane_tile`), and'ed with the mask on PARTIAL
  tiles. The functions get the tile's indices as :class:`_in_kernel.Line` s over axes of
  ``lengths`` (T, S), so an array they read along the positions is one vector load from
  global memory (:func:`line`)."""
  plgpu = _mosaic.mosaic_gpu()
  if bias is not None:  # the scores, biased: scaled first, as a plain tile is in one multiply
    products = products * float(scale) + bias
    scale = 1.0
  if score_fn is None and not masked:
    return products * (float(scale) * LOG2E), None
  iota = lambda axis: plgpu.broadcasted_iota(
    jnp.int32, products.shape, axis, layout=plgpu.Layout.WGMMA
  )
  q_axis = 1 if transposed else 0
  q_idx, kv_idx = iota(q_axis) + q0, iota(1 - q_axis) + k0
  q_line = line(q_idx, q_axis, q0, lengths[0])
  kv_line = line(kv_idx, 1 - q_axis, k0, lengths[1])
  slope = None
  if score_fn is None:
    t = products * (float(scale) * LOG2E)
  else:
    x = products * float(scale)
    if derivative:  # the function and its derivative, one traced jaxpr (Functions.slope)
      y, slope = (z.astype(jnp.float32) for z in slope_fn(x, b, h, q_line, kv_line))
    else:
      y = score_fn(x, b, h, q_line, kv_line).astype(jnp.float32)
    t = y * LOG2E
  if masked:
    allowed = None if mask is None else mask(b, h, q_line, kv_line)
    if keep is not None:
      allowed = keep(q_idx, kv_idx) if allowed is None else allowed & keep(q_idx, kv_idx)
    if dense is not None:
      allowed = dense != 0.0 if allowed is None else allowed & (dense != 0.0)
    if allowed is not None:
      t = jnp.where(allowed, t, -jnp.inf)
  return t, slope


def line(tile: Any, axis: int, start: Any, extent: int) -> _in_kernel.Line:
  """A tile's positions along ``axis`` (``tile``: ``start`` plus its iota there, in wgmma's
  layout) as the functions see them: an array read at them (:meth:`_in_kernel.Deferred.line`)
  is loaded as one vector from global memory, in the layout that broadcasts along the other
  axis into the tile's."""
  plgpu = _mosaic.mosaic_gpu()
  vector = plgpu.Layout.WGMMA.reduce(1 - axis)

  def load(view: Any) -> Any:
    run = _mosaic.load(view, vector, optimized=False)
    return lax.broadcast_in_dim(run, tile.shape, [axis])

  return _in_kernel.Line(tile, axis, start, extent, load)


def dropout_keep(
  shape: tuple[int, ...],
  static: Any,
  refs: Any,
  b: Any,
  h: Any,
  q0: Any,
  k0: Any,
  transposed: bool = False,
) -> Any:
  """``keep(x)``: a tile of P or dP with dropout applied, zero where dropped and scaled by
  1 / (1 − rate) where kept, drawn at the elements' global indices (batch row ``b``, head
  ``h``, query rows from ``q0``, keys from ``k0``; keys along rows when ``transposed``; on a
  sequence-parallel part, the global positions ``refs.positions`` maps them to) as every
  implementation draws it (:func:`jattn.dropout.keep_from_seed`, from ``refs.seed``); the
  identity without dropout (``static.dropout_rate`` 0). The pattern is drawn once per call
  of this."""
  rate = static.dropout_rate
  if not rate:
    return lambda x: x
  plgpu = _mosaic.mosaic_gpu()
  iota = lambda axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
  q_axis = 1 if transposed else 0
  q_idx, kv_idx = iota(q_axis) + q0, iota(1 - q_axis) + k0
  idx: tuple[Any, ...] = (b, h, q_idx, kv_idx)
  if refs.positions is not None:  # through the part's maps, read as runs (lines)
    lines = (
      line(q_idx, q_axis, q0, static.lengths[0]),
      line(kv_idx, 1 - q_axis, k0, static.lengths[1]),
    )
    idx = tuple(refs.positions(b, h, *lines))
  if static.broadcast_dropout:
    idx = _dropout.shared_indices(*idx)
  seed_ref = refs.seed
  kept = _dropout.keep_from_seed((seed_ref[0], seed_ref[1]), rate, *idx)
  return lambda x: jnp.where(kept, x * (1.0 / (1.0 - rate)), jnp.zeros_like(x))


def online_softmax(t: Any, m: Any, l: Any, masked: bool) -> tuple[Any, Any, Any, Any]:
  """One key tile's step of the base-2 online softmax: ``(p, alpha, m, l)`` from the tile's
  scores ``t`` and the rows' running max ``m`` and sum ``l``, alpha rescaling what came
  before. On a PARTIAL tile a row whose keys so far are all masked keeps m = -inf: it is
  shifted by 0, not by -inf."""
  m_new = jnp.maximum(m, t.max(axis=1))
  shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - shift)
  p = jnp.exp2(t - lax.broadcast_in_dim(shift, t.shape, [0]))
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def streamed_ids(
  ids: Sequence[Any], b: Any, block: int, tile: Any, transposed: bool
) -> tuple[list[Any], list[Any]]:
  """The streamed axis's segment ids (``ids``: the kernel's refs, or none) as a pipeline's
  extra ``(in_specs, refs)``: ``tile(step)`` the step's tile of ``block`` entries. In a
  kernel one axis's ids are held for the program (the query tile's; the key tile's in the
  transposed dK/dV kernel), the other's streamed with each tile."""
  if not ids:
    return [], []
  src = ids[0] if transposed else ids[1]
  spec = _mosaic.mosaic_gpu().BlockSpec((block,), lambda t: (tile(t),))
  return [spec], [src.at[_mosaic.row(src, b)]]


def streamed_plane(
  planes: Any, b: Any, h: Any, held: Any, rows: int, block: int, tile: Any
) -> tuple[list[Any], list[Any]]:
  """A bias's or dense mask's tile at each step as a pipeline's extra ``(in_specs, refs)``
  (none where ``planes`` is None): of ``planes`` (Bb, Nb, rows axis, streamed axis;
  :func:`_call.planes`) at batch row ``b`` and head ``h`` (local for a bias, sharded as the
  query is; global for a dense mask, whole on each device), the held tile ``held`` of
  ``rows`` rows, ``block`` columns from tile ``tile(step)``."""
  if planes is None:
    return [], []
  swizzled = _mosaic.swizzled(jnp.dtype(planes.dtype).itemsize)  # read in wgmma's layout
  spec = _mosaic.mosaic_gpu().BlockSpec(
    (rows, block), lambda t: (held, tile(t)), transforms=swizzled
  )
  return [spec], [plane(planes, b, h)]


def plane(planes: Any, b: Any, h: Any) -> Any:
  """The (rows, columns) plane of a bias's or dense mask's ``planes`` (:func:`_call.planes`)
  at batch row ``b`` and head ``h``, where the planes do not broadcast them."""
  return planes.at[_mosaic.row(planes, b), h if planes.shape[1] > 1 else 0]


def slot_planes(bias: Sequence[Any], dense: Sequence[Any], stages: int, cols: int) -> Any:
  """A warp-specialised kernel's shared memory for the bias's and the dense mask's tiles
  (``bias``, ``dense``: the call's, or ()): ``stages`` slots of both compute groups' rows
  by ``cols`` streamed columns, in the layout wgmma's loads read (the mask as bfloat16 0 and
  1); a None for each absent."""
  plgpu = _mosaic.mosaic_gpu()

  def slots(dtype: Any) -> Any:
    swizzled = _mosaic.swizzled(jnp.dtype(dtype).itemsize)
    return plgpu.SMEM((stages, 2 * _mosaic.ROWS, cols), dtype, transforms=swizzled)

  return (
    slots(bias[0].dtype) if bias else None,
    slots(jnp.bfloat16) if dense else None,
  )


def group_tiles(buffers: tuple[Any, Any], slot: Any, group: Any, masked: bool) -> Any:
  """A compute group's rows of a slot's bias and dense-mask tiles (:func:`slot_planes`'
  ``buffers``) in registers: ``(bias, dense)``, each None where absent, the dense mask's
  also on FULL tiles (``masked`` False), where it is not read."""
  rows = lambda ref: (
    () if ref is None else (ref.at[slot, pl.ds(group * _mosaic.ROWS, _mosaic.ROWS)],)
  )
  bias, dense = buffers
  return plane_tile(rows(bias)), plane_tile(rows(dense)) if masked else None


def copy_planes(
  bias: Any,
  dense: Any,
  buffers: tuple[Any, Any],
  slot: Any,
  at: tuple[Any, Any, Any, Any],
  rows: Any,
  cols: Any,
  barrier: Any,
) -> None:
  """A warp-specialised kernel's copy warpgroup: the bias's and the dense mask's tiles
  (``rows``, ``cols``) into slot ``slot`` of their ``buffers`` (None where absent) by TMA, each
  completing on ``barrier`` (the mask's on FULL tiles too, where it is not read: each slot's
  barrier counts the same copies). ``at`` as :func:`streams` takes it: the bias is read at
  this device's batch row and head, the mask's whole arrays at global ones."""
  plgpu = _mosaic.mosaic_gpu()
  b_g, b, h, h_g = at
  for planes, buffer, (pb, ph) in ((bias, buffers[0], (b, h)), (dense, buffers[1], (b_g, h_g))):
    if buffer is not None:
      plgpu.copy_gmem_to_smem(plane(planes, pb, ph).at[rows, cols], buffer.at[slot], barrier)


def plane_tile(smem: Sequence[Any]) -> Any:
  """A streamed bias or dense-mask tile (``smem``: its buffer, or none) in registers,
  float32, or None."""
  if not smem:
    return None
  plgpu = _mosaic.mosaic_gpu()
  return _mosaic.load(smem[0], plgpu.Layout.WGMMA).astype(jnp.float32)


def streams(
  ids: Sequence[Any],
  bias: Any,
  dense: Any,
  at: tuple[Any, Any, Any, Any],
  held: Any,
  rows: int,
  block: int,
  tile: Any,
  transposed: bool,
) -> tuple[list[Any], list[Any]]:
  """A pipeline's extra ``(in_specs, refs)`` beside its tensors' tiles: the streamed axis's
  segment ids (:func:`streamed_ids`), the bias's tile and the dense mask's (:func:`streamed_plane`;
  ``dense`` None on FULL tiles, which skip the mask), in that order (:func:`split_streamed`).
  ``at``: the program's (global batch row, local batch row, local head, global head): the
  bias is sharded as the query is, the mask's arrays (ids, dense mask) are whole on each
  device."""
  b_g, b, h, h_g = at
  parts = (
    streamed_ids(ids, b_g, block, tile, transposed),
    streamed_plane(bias, b, h, held, rows, block, tile),
    streamed_plane(dense, b_g, h_g, held, rows, block, tile),
  )
  return [s for p in parts for s in p[0]], [r for p in parts for r in p[1]]


def split_streamed(
  streamed: Sequence[Any], n_ids: int, biased: bool, dense: bool
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
  """A pipeline step's streamed buffers as (segment ids', the bias's, the dense mask's),
  each one buffer or none, in the order the pipelines stream them."""
  ids, rest = tuple(streamed[:n_ids]), tuple(streamed[n_ids:])
  bias, rest = (rest[:1], rest[1:]) if biased else ((), rest)
  return ids, bias, rest[:1] if dense else ()


def keeper(
  ids: Sequence[Any], b: Any, held: Any, smem: Any, barrier: Any, *, transposed: bool
) -> Any:
  """``make(*streamed_ids_smem) -> keep(q_idx, kv_idx)`` (None without segment ids) for
  :func:`scores`; copies the held tile's ids (rows ``held``) to ``smem`` first."""
  if not ids:
    return lambda *_: None
  plgpu = _mosaic.mosaic_gpu()
  vector = plgpu.Layout.WGMMA.reduce
  src = ids[1] if transposed else ids[0]
  plgpu.copy_gmem_to_smem(src.at[_mosaic.row(src, b), held], smem, barrier)
  plgpu.barrier_wait(barrier)
  held_ids = _mosaic.load(smem, vector(1))  # along the tile's rows

  def make(streamed: Any) -> Any:
    # The streamed tile's ids, along its columns: read now, while its buffer is held.
    other = _mosaic.load(streamed, vector(0))

    def keep(q_idx: Any, kv_idx: Any) -> Any:
      shape = q_idx.shape
      rows = lax.broadcast_in_dim(held_ids, shape, [0])
      return rows == lax.broadcast_in_dim(other, shape, [1])

    return keep

  return make
