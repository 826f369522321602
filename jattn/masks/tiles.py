"""Tile classification: which (query tile, key/value tile) pairs a mask leaves EMPTY,
PARTIAL or FULL, so tiled implementations skip empty tiles and skip mask arithmetic on
full ones.

Every mask kind bounds its allowed pairs tile by tile in O(number of tiles)
work: from the index ranges of the tiles (:class:`Tiles`) its ``tile_bounds``
method returns two boolean arrays that broadcast to (B, N, nq, nk), whether
*any* pair of a tile may attend and whether *all* may. An "any" that
over-approximates and an "all" that under-approximates are always safe: they
only turn an EMPTY or FULL tile into PARTIAL. The bounds of most kinds are
exact; :data:`UNSURE` (every tile PARTIAL) is the answer when nothing better
is known, as for ``from_fn``.

Bounds are array code written once for two array modules (``Tiles.xp``): the
tiles of a mask whose arrays are concrete are classified with NumPy on the
host, as splash attention computes its mask info, so a schedule read while
the caller is traced stays a NumPy array and nothing is compiled; a mask
holding traced arrays is classified with ``jax.numpy`` in the caller's trace.

Example::

    >>> from jattn import masks
    >>> masks.causal().block_view(4, 4, block_q=2, block_kv=2)[0, 0]  # FULL=2, PARTIAL=1
    array([[1, 0],
           [2, 1]], dtype=int8)
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks

__all__ = [
  "EMPTY",
  "PARTIAL",
  "FULL",
  "Bounds",
  "Tiles",
  "Bounded",
  "classify",
  "grid_tiles",
  "tile_reduce",
  "tile_any_all",
  "array_module",
  "is_concrete",
  "on_host",
  "UNSURE",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by :meth:`Mask.block_view`."""


class Tiles(NamedTuple):
  """Inclusive index bounds of every query tile (axis 2) and key/value tile (axis 3)."""

  q_lo: Any  # (1, 1, nq, 1) int32, of the array module ``xp``
  q_hi: Any
  kv_lo: Any  # (1, 1, 1, nk)
  kv_hi: Any
  block_q: int
  block_kv: int
  q_len: int
  kv_len: int
  # Tile i covers exactly positions [i * block_q, min((i + 1) * block_q, q_len)) (and the same
  # for kv). False inside reindex(): lo/hi are then hulls of mapped positions, and kinds that
  # reduce arrays tile by tile must answer conservatively.
  aligned: bool = True
  # The array module bounds are computed with: numpy for a concrete mask (its arrays are
  # NumPy arrays then), jax.numpy for a traced one.
  xp: ModuleType = jnp


Bounds = tuple[Any, Any]
"""(any_allowed, all_allowed) per tile, boolean arrays broadcastable to (B, N, nq, nk)."""


class Bounded(Protocol):
  """What classification reads of a mask (a :class:`jattn.masks.Mask`): its tile bounds."""

  def tile_bounds(self, t: Tiles) -> Bounds: ...


M = TypeVar("M", bound=Bounded)

UNSURE: Bounds = (np.ones((1, 1, 1, 1), bool), np.zeros((1, 1, 1, 1), bool))
"""(any_allowed, all_allowed) that says PARTIAL for every tile: always safe."""


def array_module(x: Any) -> ModuleType:
  """numpy for a NumPy array or scalar, jax.numpy for anything else."""
  return np if isinstance(x, (np.ndarray, np.generic)) else jnp


def tile_reduce(x: Any, axis: int, block: int, length: int, fill: bool | str, reducer: str) -> Any:
  """Reduce ``x`` over tiles of ``block`` along ``axis``; size-1 axes stay size 1.

  ``fill`` pads the last tile: a constant, or ``"edge"`` (the last entry repeated).
  ``reducer`` names the reduction (``"min"``, ``"max"``, ``"any"``, ``"all"``) of ``x``'s
  array module: NumPy arrays are reduced with NumPy, others with jax.numpy.
  """
  if x.shape[axis] == 1:
    return x
  xp = array_module(x)
  n_tiles = -(-length // block)
  extra = n_tiles * block - length
  if extra and fill == "edge":
    last: Any
    if xp is np:
      last = np.take(x, [length - 1], axis=axis)
    else:
      # Along ``axis`` only: jnp.pad's "edge" mode slices every axis, which a batch axis
      # sharded in Explicit mode cannot take.
      last = jax.lax.slice_in_dim(x, length - 1, length, axis=axis)
    x = xp.concatenate([x, xp.repeat(last, extra, axis=axis)], axis=axis)
  elif extra:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    x = xp.pad(x, pad, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (n_tiles, block) + x.shape[axis + 1 :])
  return getattr(xp, reducer)(x, axis=axis + 1)


def tile_any_all(dense: Any, block_q: int, block_kv: int, q_len: int, kv_len: int) -> Bounds:
  """Per tile of a dense (Bm, Nm, T, S) bool array (T, S may be 1): whether any, all are True."""
  any_, all_ = dense, dense
  for axis, block, length in ((2, block_q, q_len), (3, block_kv, kv_len)):
    any_ = tile_reduce(any_, axis, block, length, False, "any")
    all_ = tile_reduce(all_, axis, block, length, True, "all")
  return any_, all_


def grid_tiles(q_len: int, kv_len: int, block_q: int, block_kv: int, xp: ModuleType = jnp) -> Tiles:
  """The tiles of a (q_len, kv_len) grid cut into ``block_q`` by ``block_kv`` tiles, as
  arrays of ``xp`` (numpy or jax.numpy)."""
  q_lo = xp.arange(math.ceil(q_len / block_q), dtype=xp.int32) * block_q
  kv_lo = xp.arange(math.ceil(kv_len / block_kv), dtype=xp.int32) * block_kv
  return Tiles(
    q_lo=q_lo.reshape(1, 1, -1, 1),
    q_hi=xp.minimum(q_lo + block_q, q_len).reshape(1, 1, -1, 1) - 1,
    kv_lo=kv_lo.reshape(1, 1, 1, -1),
    kv_hi=xp.minimum(kv_lo + block_kv, kv_len).reshape(1, 1, 1, -1) - 1,
    block_q=block_q,
    block_kv=block_kv,
    q_len=q_len,
    kv_len=kv_len,
    xp=xp,
  )


def is_concrete(mask: Bounded) -> bool:
  """Whether every array ``mask`` holds has known values (none is a tracer)."""
  return all(map(_checks.is_concrete, jax.tree.leaves(mask)))


def on_host(mask: M) -> M:
  """A concrete ``mask`` with its arrays as NumPy arrays, in the dtypes jax.numpy would give
  them (int64 ids are int32 unless x64 is on), for bounds computed with NumPy."""
  return jax.tree.map(_host_array, mask)


def _host_array(x: Any) -> np.ndarray:
  x = np.asarray(x)
  return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def classify(
  mask: Bounded,
  q_len: int,
  kv_len: int,
  *,
  block_q: int,
  block_kv: int,
  batch_size: int,
  num_heads: int,
  dense: Any = None,
) -> np.ndarray | jax.Array:
  """:meth:`Mask.block_view` for checked arguments: int8 (B, N, nq, nk) tile classes.

  From ``dense``, the mask materialised on the (B, N, T, S) grid, when given (exact
  classes); else from the mask's tile bounds. A NumPy array computed with NumPy when the
  mask's arrays are concrete, even while the caller is traced; jax.numpy in the caller's
  trace otherwise.
  """
  shape = (batch_size, num_heads, math.ceil(q_len / block_q), math.ceil(kv_len / block_kv))
  xp = np if is_concrete(mask) else jnp
  if dense is not None:
    any_, all_ = tile_any_all(xp.asarray(dense), block_q, block_kv, q_len, kv_len)
  else:
    host = on_host(mask) if xp is np else mask
    any_, all_ = host.tile_bounds(grid_tiles(q_len, kv_len, block_q, block_kv, xp))
  view = xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(xp.int8)
  if xp is np:
    return np.array(np.broadcast_to(view, shape))  # a writable array of its own
  return jnp.broadcast_to(view, shape)
