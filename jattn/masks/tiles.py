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

Example::

    >>> from jattn import masks
    >>> masks.causal().block_view(4, 4, block_q=2, block_kv=2)[0, 0]  # FULL=2, PARTIAL=1
    array([[1, 0],
           [2, 1]], dtype=int8)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _eager

if TYPE_CHECKING:
  from jattn.masks._core import Mask

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by :meth:`Mask.block_view`."""


class Tiles(NamedTuple):
  """Inclusive index bounds of every query tile (axis 2) and key/value tile (axis 3)."""

  q_lo: jax.Array  # (1, 1, nq, 1)
  q_hi: jax.Array
  kv_lo: jax.Array  # (1, 1, 1, nk)
  kv_hi: jax.Array
  block_q: int
  block_kv: int
  q_len: int
  kv_len: int
  # Tile i covers exactly positions [i * block_q, min((i + 1) * block_q, q_len)) (and the same
  # for kv). False inside reindex(): lo/hi are then hulls of mapped positions, and kinds that
  # reduce arrays tile by tile must answer conservatively.
  aligned: bool = True


Bounds = tuple[Any, Any]
"""(any_allowed, all_allowed) per tile, boolean arrays broadcastable to (B, N, nq, nk)."""

UNSURE: Bounds = (np.ones((1, 1, 1, 1), bool), np.zeros((1, 1, 1, 1), bool))
"""(any_allowed, all_allowed) that says PARTIAL for every tile: always safe."""


def tile_reduce(
  x: jax.Array,
  axis: int,
  block: int,
  length: int,
  fill: bool | str,
  reducer: Callable[..., jax.Array],
) -> jax.Array:
  """Reduce ``x`` over tiles of ``block`` along ``axis``; size-1 axes stay size 1.

  ``fill`` pads the last tile: a constant, or ``"edge"`` (the last entry repeated).
  """
  if x.shape[axis] == 1:
    return x
  n_tiles = -(-length // block)
  extra = n_tiles * block - length
  if extra and fill == "edge":
    # Along ``axis`` only: jnp.pad's "edge" mode slices every axis, which a batch axis
    # sharded in Explicit mode cannot take.
    last = jax.lax.slice_in_dim(x, length - 1, length, axis=axis)
    x = jnp.concatenate([x, jnp.repeat(last, extra, axis=axis)], axis=axis)
  elif extra:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    x = jnp.pad(x, pad, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (n_tiles, block) + x.shape[axis + 1 :])
  return reducer(x, axis=axis + 1)


def tile_any_all(
  dense: jax.Array, block_q: int, block_kv: int, q_len: int, kv_len: int
) -> tuple[jax.Array, jax.Array]:
  """Per tile of a dense (Bm, Nm, T, S) bool array (T, S may be 1): whether any, all are True."""
  any_, all_ = dense, dense
  for axis, block, length in ((2, block_q, q_len), (3, block_kv, kv_len)):
    any_ = tile_reduce(any_, axis, block, length, False, jnp.any)
    all_ = tile_reduce(all_, axis, block, length, True, jnp.all)
  return any_, all_


def grid_tiles(q_len: int, kv_len: int, block_q: int, block_kv: int) -> Tiles:
  """The tiles of a (q_len, kv_len) grid cut into ``block_q`` by ``block_kv`` tiles."""
  q_lo = jnp.arange(math.ceil(q_len / block_q), dtype=jnp.int32) * block_q
  kv_lo = jnp.arange(math.ceil(kv_len / block_kv), dtype=jnp.int32) * block_kv
  return Tiles(
    q_lo=q_lo.reshape(1, 1, -1, 1),
    q_hi=jnp.minimum(q_lo + block_q, q_len).reshape(1, 1, -1, 1) - 1,
    kv_lo=kv_lo.reshape(1, 1, 1, -1),
    kv_hi=jnp.minimum(kv_lo + block_kv, kv_len).reshape(1, 1, 1, -1) - 1,
    block_q=block_q,
    block_kv=block_kv,
    q_len=q_len,
    kv_len=kv_len,
  )


def classify(
  mask: Mask,
  q_len: int,
  kv_len: int,
  *,
  block_q: int,
  block_kv: int,
  batch_size: int,
  num_heads: int,
  exact: bool,
) -> np.ndarray | jax.Array:
  """:meth:`Mask.block_view` for checked arguments: int8 (B, N, nq, nk) tile classes.

  One trace per mask structure and sizes, evaluated with NumPy where it can
  (:func:`jattn._eager.evaluate`),
  concrete whenever the mask's arrays are, even while the caller is traced."""
  static = (q_len, kv_len, block_q, block_kv, batch_size, num_heads, exact)
  return _eager.evaluate(_classes, mask, static=static)


def _classes(
  mask: Mask,
  q_len: int,
  kv_len: int,
  block_q: int,
  block_kv: int,
  batch_size: int,
  num_heads: int,
  exact: bool,
) -> jax.Array:
  nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
  if exact:
    dense = mask.materialize(q_len, kv_len, batch_size=batch_size, num_heads=num_heads)
    any_, all_ = tile_any_all(dense, block_q, block_kv, q_len, kv_len)
  else:
    any_, all_ = mask.tile_bounds(grid_tiles(q_len, kv_len, block_q, block_kv))
  view = jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)
  return jnp.broadcast_to(view, (batch_size, num_heads, nq, nk))
