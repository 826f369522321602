"""A mask seen through index maps (:func:`reindex`), for sequence-parallel attention.

Ring attention (:mod:`jattn.parallel`) evaluates a mask written in global
positions on one device's shard of the sequence, possibly permuted (zig-zag,
striped): each axis of the new mask maps to positions of the original one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jattn import _compat
from jattn.masks import indexing as ix
from jattn.masks.core import Mask
from jattn.masks.indexing import Extents
from jattn.masks.tiles import UNSURE, Bounds, Tiles, tile_reduce

__all__ = ["Reindex", "reindex"]


def _mapped_range(positions: jax.Array, block: int, length: int) -> tuple[jax.Array, jax.Array]:
  """Smallest and largest mapped position in each tile of ``block`` entries of ``positions``
  (along its last axis: (L,), or (B, L) for a row of positions per batch row)."""
  axis = positions.ndim - 1
  lo = tile_reduce(positions, axis, block, length, "edge", "min")
  hi = tile_reduce(positions, axis, block, length, "edge", "max")
  return lo, hi


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Reindex(Mask):
  """``mask(batch[b], head[n], q[i], kv[j])`` at ``(b, n, i, j)``; a None map is the identity."""

  mask: Mask
  batch: Any
  head: Any
  q: Any
  kv: Any

  @property
  def _maps(self) -> tuple:
    return self.batch, self.head, self.q, self.kv

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return self.mask(*ix.through_maps(self._maps, (batch, head, q_idx, kv_idx)))

  def tile_bounds(self, t: Tiles) -> Bounds:
    # Tiles of the new axes are bounded by the hull of the positions they map
    # to: a superset, so the mask's "any" stays an over- and its "all" an
    # under-approximation, both safe. Contiguous maps (a shard of a sequence)
    # keep the mask's classes exact.
    mapped = t
    if self.q is not None or self.kv is not None:
      if not t.aligned:  # tiles already stand for hulls: positions per tile are unknown here
        return UNSURE
      mapped = t._replace(aligned=False)
    if self.q is not None:
      q_lo, q_hi = _mapped_range(self.q, t.block_q, t.q_len)
      if q_lo.ndim == 2:
        # A row of positions per batch row: tiles are one row of bounds for every batch
        # row (the masks' contract), so each takes the hull of its positions over the rows.
        q_lo, q_hi = q_lo.min(axis=0), q_hi.max(axis=0)
      q_lo, q_hi = (x.reshape(1, 1, -1, 1) for x in (q_lo, q_hi))
      mapped = mapped._replace(q_lo=q_lo, q_hi=q_hi)
    if self.kv is not None:
      kv_lo, kv_hi = (x.reshape(1, 1, 1, -1) for x in _mapped_range(self.kv, t.block_kv, t.kv_len))
      mapped = mapped._replace(kv_lo=kv_lo, kv_hi=kv_hi)
    out = []
    for x in self.mask.tile_bounds(mapped):
      x = t.xp.asarray(x)
      x = x.reshape((1,) * (4 - x.ndim) + x.shape)
      for axis, positions in ((0, self.batch), (1, self.head)):
        if positions is not None and x.shape[axis] > 1:
          x = t.xp.take(x, t.xp.asarray(positions), axis=axis, mode="clip")
      out.append(x)
    return out[0], out[1]

  @property
  def extents(self) -> Extents:
    own = list(self.mask.extents)
    if self.q is not None and jnp.ndim(self.q) == 2 and self.batch is None:
      own[0] = jnp.shape(self.q)[0]  # a row of positions per batch row fixes the batch
    return tuple(mine if m is None else jnp.shape(m)[-1] for mine, m in zip(own, self._maps))

  def __repr__(self) -> str:
    parts = [
      f"{name} {ix.shape_str(m)}"
      for name, m in zip(("batch", "head", "q", "kv"), self._maps)
      if m is not None
    ]
    return f"reindex({self.mask!r}, {', '.join(parts)})"


def reindex(
  mask: Mask,
  *,
  batch: ArrayLike | None = None,
  head: ArrayLike | None = None,
  q: ArrayLike | None = None,
  kv: ArrayLike | None = None,
) -> Mask:
  """``mask`` seen through index maps: the new mask at ``(b, n, i, j)`` is
  ``mask(batch[b], head[n], q[i], kv[j])``.

  Each map is an int array of shape (L,) giving, for every position of the
  new axis, the position of ``mask``'s axis it stands for; None keeps the axis
  as it is. ``q`` may also be (B, L): row ``b``'s query ``i`` stands for
  ``q[b, i]`` (a decode step's absolute positions, each row's chunk after its
  own cached tokens); a tile's class then comes from the hull of its positions
  over the rows. Sequence-parallel attention uses it to evaluate a mask written in
  global positions on one device's shard (``q = offset + arange(T_shard)``),
  or on a permuted sequence (:mod:`jattn.parallel`'s zig-zag and striped
  layouts). Maps may be traced.

  Tile classes come from the range of positions each tile maps to, so they
  stay exact for contiguous maps and are conservative (PARTIAL where unsure)
  otherwise. Masks that hold arrays along T or S (``segments``,
  ``from_array``) are evaluated correctly through a map but classify every
  tile they touch as PARTIAL.

  Example::

      >>> shard = masks.reindex(masks.causal(), q=np.arange(2, 4), kv=np.arange(0, 2))
      >>> shard.materialize(2, 2)[0, 0].astype(int)  # rows 2-3, columns 0-1 of causal()
      Array([[1, 1],
             [1, 1]], dtype=int32)
  """
  if not isinstance(mask, Mask):
    raise TypeError(f"reindex needs a jattn.masks.Mask, got {type(mask).__name__}")
  return Reindex(mask, *ix.checked_maps(batch=batch, head=head, q=q, kv=kv))
