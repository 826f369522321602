"""Mask kinds read from the caller's data: segment ids, a dense array, a function.

Unlike the kinds of :mod:`jattn.masks.kinds`, which compare positions
arithmetically and bound every tile exactly, these read arrays along the
sequence (:func:`~jattn.masks.segments`, :func:`~jattn.masks.from_array`) or
call a user's function (:func:`~jattn.masks.from_fn`), so their tile bounds
come from reductions over the data, or are unknown (``UNSURE``). Each is a
frozen dataclass registered as a pytree, as in :mod:`jattn.masks.kinds`, which
re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks, _compat
from jattn.masks import indexing as ix
from jattn.masks.core import STATIC, Grid, Mask
from jattn.masks.indexing import Extents
from jattn.masks.tiles import UNSURE, Bounds, Tiles, tile_any_all, tile_reduce

# --- segments (document masking) ---------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Segments(Mask):
  """``q_segment_ids[batch, q_idx] == kv_segment_ids[batch, kv_idx]`` (see :func:`segments`)."""

  q_segment_ids: Any
  kv_segment_ids: Any

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return ix.take(self.q_segment_ids, batch, q_idx) == ix.take(self.kv_segment_ids, batch, kv_idx)

  def tile_bounds(self, t: Tiles) -> Bounds:
    if not t.aligned:
      return UNSURE
    q_ids = ix.as_rank(self.q_segment_ids, 2, t.xp)
    kv_ids = ix.as_rank(self.kv_segment_ids, 2, t.xp)
    # Edge padding repeats the last id, so it adds no new id to the last tile.
    q_min = tile_reduce(q_ids, 1, t.block_q, t.q_len, "edge", "min")[:, None, :, None]
    q_max = tile_reduce(q_ids, 1, t.block_q, t.q_len, "edge", "max")[:, None, :, None]
    kv_min = tile_reduce(kv_ids, 1, t.block_kv, t.kv_len, "edge", "min")[:, None, None, :]
    kv_max = tile_reduce(kv_ids, 1, t.block_kv, t.kv_len, "edge", "max")[:, None, None, :]
    any_ = (q_min <= kv_max) & (kv_min <= q_max)
    all_ = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
    return any_, all_

  @property
  def extents(self) -> Extents:
    return (
      ix.shared_batch(self.children, 2, "segment ids"),
      None,
      jnp.shape(self.q_segment_ids)[-1],
      jnp.shape(self.kv_segment_ids)[-1],
    )

  def __repr__(self) -> str:
    return (
      f"segments(q_segment_ids {ix.shape_str(self.q_segment_ids)}, "
      f"kv_segment_ids {ix.shape_str(self.kv_segment_ids)})"
    )


def segments(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike | None = None) -> Mask:
  """Document masking for packed sequences: attend only within the same segment id.

  Args:
    q_segment_ids: int array (B, T) or (T,).
    kv_segment_ids: int array (B, S) or (S,); defaults to ``q_segment_ids``
      (self-attention).

  Tile classification compares each tile's smallest and largest id. It is
  exact when the ids are sorted along the sequence and either consecutive
  integers or the same array for queries and keys, as for packed documents;
  otherwise it may say PARTIAL for a tile that is empty.
  """
  q_ids = _checks.int_array("q_segment_ids", q_segment_ids, ranks=(1, 2))
  kv_ids = (
    q_ids
    if kv_segment_ids is None
    else _checks.int_array("kv_segment_ids", kv_segment_ids, ranks=(1, 2))
  )
  ix.shared_batch((q_ids, kv_ids), 2, "q_segment_ids and kv_segment_ids")
  return Segments(q_ids, kv_ids)


# --- dense arrays -----------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class FromArray(Mask):
  """A dense boolean ``array`` broadcastable to (B, N, T, S) (see :func:`from_array`)."""

  array: Any

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    arr = ix.as_rank(self.array, 4)
    index = tuple(0 if n == 1 else i for n, i in zip(arr.shape, (batch, head, q_idx, kv_idx)))
    if all(isinstance(i, int) for i in index):
      return arr[index]
    return arr.at[index].get(mode="clip")

  def tile_bounds(self, t: Tiles) -> Bounds:
    if not t.aligned and any(n > 1 for n in jnp.shape(self.array)[-2:]):
      return UNSURE
    dense = ix.as_rank(self.array, 4, t.xp)
    return tile_any_all(dense, t.block_q, t.block_kv, t.q_len, t.kv_len)

  @property
  def extents(self) -> Extents:
    return ix.array_extents(jnp.shape(self.array))

  def on_grid(self, grid: Grid) -> jax.Array:
    return ix.as_rank(self.array, 4)

  def __repr__(self) -> str:
    return f"from_array({ix.shape_str(self.array)})"


def from_array(mask: ArrayLike) -> Mask:
  """A dense boolean array broadcastable to (B, N, T, S), as jax.nn's ``mask``.

  Arrays of lower rank get leading dimensions of size 1, so (T, S) is shared
  by every batch row and head.
  """
  dtype = _checks.dtype_of(mask)
  if dtype != np.bool_:
    raise TypeError(f"mask must be a boolean array, got dtype {dtype}; pass additive masks as bias")
  arr = mask if hasattr(mask, "shape") else np.asarray(mask)
  if np.ndim(arr) > 4:
    raise ValueError(f"mask must have rank <= 4 (broadcastable to BNTS), got shape {np.shape(arr)}")
  return FromArray(arr)


# --- arbitrary functions ------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class FromFn(Mask):
  """A user's ``fn(batch, head, q_idx, kv_idx) -> bool`` (see :func:`from_fn`)."""

  fn: Callable[..., jax.Array] = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return self.fn(batch, head, q_idx, kv_idx)

  def tile_bounds(self, t: Tiles) -> Bounds:
    return UNSURE  # nothing is known about fn without evaluating it

  def __repr__(self) -> str:
    return f"from_fn({getattr(self.fn, '__name__', repr(self.fn))})"


def from_fn(fn: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]) -> Mask:
  """A mask from ``fn(batch, head, q_idx, kv_idx) -> bool`` (FlexAttention's mask_mod).

  The indices are int arrays that broadcast against each other; write ``fn``
  with broadcasting jnp operations, computing from the indices (index a
  captured (T, S) array as ``table[q_idx, kv_idx]``): tiled implementations
  evaluate it per tile, and attention checks this on two small grids. Tile
  classification is conservative (every tile PARTIAL) unless
  ``block_view(..., exact=True)`` is asked for.
  """
  if not callable(fn):
    raise TypeError(f"from_fn needs a callable fn(batch, head, q_idx, kv_idx), got {fn!r}")
  return FromFn(fn)
