"""Where blockwise's key/value tiles come from: arrays, or a KV cache read tile by tile.

The blockwise loops (:mod:`jattn.impl.blockwise`) ask for key/value tile ``j`` as
``tiles.key_tile(j)`` and ``tiles.value_tile(j)``, each (B, K, block_kv, H), and hand the
per-tile gradients back to ``tiles.cotangent``. Two sources:

* :class:`Stacked`: key and value arrays (B, S, K, H), cut into tiles up front.
* :class:`CacheTiles`: the keys and values a :mod:`jattn.decode` cache holds, read
  only when a tile is visited. The cache is either dense, (B, S, K, H) per row (or
  rows named per query row, for a ragged step's query tiles), or
  paged, (P, page_size, K, H) pages with a page table (B, M) naming each row's
  pages in order; its storage may be quantized (:mod:`jattn.impl.quant`), with one
  float32 scale per (token, head). Tile ``j`` of row ``b`` covers the row's slots
  ``[j · block, (j + 1) · block)``: for a paged cache, ``block // page_size`` of
  its pages, gathered and dequantized for that tile alone. Slots at or past the
  row's length read as zeros, so stale pages (a finished request's tokens, NaN)
  never reach a product.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _compat
from jattn.impl import common, quant, tiling

__all__ = ["Stacked", "untile", "stacked", "interleave", "CacheTiles", "KV", "source"]


class Stacked(NamedTuple):
  """Key and value arrays cut into tiles up front: (n, B, K, block, H) each."""

  k_tiles: jax.Array
  v_tiles: jax.Array
  kv_len: int

  @property
  def num_tiles(self) -> int:
    return self.k_tiles.shape[0]

  def key_tile(self, j: jax.Array | int) -> jax.Array:
    return self.k_tiles[j]

  def value_tile(self, j: jax.Array | int) -> jax.Array:
    return self.v_tiles[j]

  @property
  def heads(self) -> tuple[int, int, Any]:
    """(K, Hv, the dtype value tiles are read as)."""
    return self.k_tiles.shape[2], self.v_tiles.shape[-1], self.v_tiles.dtype

  def cotangent(self, d_k: jax.Array, d_v: jax.Array) -> tuple[jax.Array, ...]:
    """(d_key, d_value) (B, S, K, H) from per-tile gradients (n, B, K, H, block)."""
    return tuple(untile(d)[:, : self.kv_len] for d in (d_k, d_v))


def untile(d: jax.Array) -> jax.Array:
  """Per-tile gradients (n, B, K, h, block) as per-slot ones (B, n · block, K, h)."""
  n, B, K, h, block = d.shape
  return d.transpose(1, 0, 4, 2, 3).reshape(B, n * block, K, h)


def interleave(keys: Any, values: Any) -> jax.Array:
  """Keys and values (..., K, H) as one pool's heads (..., 2K, H), key head k at head 2k and
  its values at 2k + 1: a paged cache's interleaved layout (JAX's TPU ragged paged
  attention's), which :class:`CacheTiles` reads back as ``[..., half::2, :]``."""
  both = jnp.stack([keys, values], axis=-2)  # (..., K, 2, H)
  return both.reshape(*keys.shape[:-2], 2 * keys.shape[-2], keys.shape[-1])


def stacked(key: jax.Array, value: jax.Array, block: int) -> Stacked:
  return Stacked(tiling.seq_tiles(key, block), tiling.seq_tiles(value, block), key.shape[1])


@functools.partial(
  _compat.register_dataclass,
  data_fields=["key", "value", "key_scale", "value_scale", "page_table", "lengths", "rows"],
  meta_fields=["dtype", "block", "interleaved"],
)
@dataclasses.dataclass(frozen=True)
class CacheTiles:
  """A dense or paged KV cache as a source of tiles (see the module docstring)."""

  key: Any  # (B, S, K, H) dense, or (P, page_size, K, H) pages; float or quantized
  value: Any  # the same with Hv
  key_scale: Any  # None, or float32 (B, S, K) / (P, page_size, K) for quantized storage
  value_scale: Any
  page_table: Any  # None (dense), or int32 (B, M): row b's pages in order, -1 where none
  lengths: Any  # int32 (B,): slots of each row that hold tokens
  dtype: Any  # what tiles are read as: the query's dtype
  block: int  # slots per tile; a multiple of page_size for a paged cache
  # None, or int32 (B',) for a dense cache: the cache row each of the B' query rows reads
  # (a ragged step's query tiles, several to a row); lengths are then per query row.
  rows: Any = None
  # A paged pool holding keys and values interleaved by head (key head k at 2k, its values
  # at 2k + 1), given as both ``key`` and ``value``: each tile reads its half of the heads.
  interleaved: bool = False

  @property
  def paged(self) -> bool:
    return self.page_table is not None

  @property
  def kv_len(self) -> int:
    """Slots per row: S, or M · page_size."""
    if self.paged:
      return self.page_table.shape[1] * self.key.shape[1]
    return self.key.shape[1]

  @property
  def num_tiles(self) -> int:
    return math.ceil(self.kv_len / self.block)

  @property
  def heads(self) -> tuple[int, int, Any]:
    """(K, Hv, the dtype value tiles are read as)."""
    if self.interleaved:
      return self.key.shape[2] // 2, self.key.shape[3], np.dtype(self.dtype)
    return self.key.shape[2], self.value.shape[3], np.dtype(self.dtype)

  def _slots(self, j: jax.Array | int) -> jax.Array:
    return j * self.block + jnp.arange(self.block, dtype=jnp.int32)

  def _table(self) -> jax.Array:
    """The page table padded with -1 to whole tiles: (B, num_tiles · block // page_size)."""
    table = self.page_table
    pad = self.num_tiles * (self.block // self.key.shape[1]) - table.shape[1]
    return jnp.pad(table, ((0, 0), (0, pad)), constant_values=-1) if pad else table

  def _pages(self, j: jax.Array | int) -> jax.Array:
    """(B, block // page_size) page ids of tile j, -1 where the row has none."""
    per_tile = self.block // self.key.shape[1]
    return jax.lax.dynamic_slice_in_dim(self._table(), j * per_tile, per_tile, axis=1)

  def _read(
    self, store: jax.Array, scale: jax.Array | None, j: jax.Array | int, half: int
  ) -> jax.Array:
    """Tile j of ``store`` as (B, K, block, h) in ``dtype``, zero past each row's length;
    ``half`` 0 for keys, 1 for values (which heads of an interleaved pool)."""
    slots = self._slots(j)
    if self.paged:
      pages = jnp.maximum(self._pages(j), 0)  # -1: past the row's length, zeroed below
      B, per_tile = pages.shape
      x = _gather_pages(store, pages).reshape(B, self.block, *store.shape[2:])
      if self.interleaved:
        x = x[:, :, half::2]
      if scale is not None:
        scale = _gather_pages(scale, pages).reshape(B, self.block, scale.shape[2])
    elif self.rows is not None:  # each query row's cache row, slots past it clamped
      at = (self.rows[:, None], jnp.minimum(slots, self.kv_len - 1)[None, :])
      x = store[at]
      if scale is not None:
        scale = scale[at]
    elif self.kv_len % self.block == 0:
      x = jax.lax.dynamic_slice_in_dim(store, j * self.block, self.block, axis=1)
      if scale is not None:
        scale = jax.lax.dynamic_slice_in_dim(scale, j * self.block, self.block, axis=1)
    else:  # the last tile runs past the rows: those slots are past every length, zeroed
      x = jnp.take(store, slots, axis=1, mode="clip")
      if scale is not None:
        scale = jnp.take(scale, slots, axis=1, mode="clip")
    x = x.astype(self.dtype) if scale is None else quant.dequantize(x, scale, self.dtype)
    written = slots[None, :] < self.lengths[:, None]
    x = jnp.where(written[:, :, None, None], x, jnp.zeros((), self.dtype))
    return x.transpose(0, 2, 1, 3)

  def key_tile(self, j: jax.Array | int) -> jax.Array:
    return self._read(self.key, self.key_scale, j, 0)

  def value_tile(self, j: jax.Array | int) -> jax.Array:
    return self._read(self.value, self.value_scale, j, 1)

  def cotangent(self, d_k: jax.Array, d_v: jax.Array) -> CacheTiles:
    """The cache's cotangent from per-tile gradients (n, B, K, h, block): scattered back
    into the rows or pages for float storage; none for quantized storage (rounding has no
    useful derivative), the scales, the page table and the lengths."""

    def back(store: jax.Array, d: jax.Array, half: int) -> jax.Array | None:
      if quant.is_quantized(store.dtype):
        return None
      d = untile(d)  # (B, slots, K, h)
      if self.interleaved:  # into its half of the pool's heads, zeros in the other half
        d = interleave(d, jnp.zeros_like(d)) if half == 0 else interleave(jnp.zeros_like(d), d)
      if not self.paged:
        d = d[:, : self.kv_len]
        if self.rows is not None:  # query rows sharing a cache row add up
          d = jnp.zeros(store.shape, d.dtype).at[self.rows].add(d)
        return d.astype(store.dtype)
      pages = self._table()  # (B, n · block // page_size)
      pages = jnp.where(pages < 0, store.shape[0], pages)  # dropped by the scatter
      d = d.reshape(*pages.shape, *store.shape[1:])
      return jnp.zeros(store.shape, d.dtype).at[pages].add(d, mode="drop").astype(store.dtype)

    return dataclasses.replace(
      self,
      key=back(self.key, d_k, 0),
      value=back(self.value, d_v, 1),
      key_scale=None,
      value_scale=None,
      page_table=None,
      lengths=None,
      rows=None,
    )


KV = tuple[jax.Array, jax.Array] | CacheTiles
"""Where key/value tiles come from: a (key, value) pair, or a KV cache read tile by tile."""


def _gather_pages(store: jax.Array, pages: jax.Array) -> jax.Array:
  """``store[pages]``: pages (B, n) of a pool (P, page_size, ...) as (B, n, page_size, ...).

  In Explicit mode the result is sharded as the page ids' rows and the pool's trailing
  dimensions (heads) are, which JAX's gather cannot infer on its own; each device gathers
  its own rows' pages from its share of the pool's heads."""
  spec = (*common.sharding_spec(pages), *common.sharding_spec(store)[1:])
  if not any(spec):
    return store[pages]
  src = pages if any(common.sharding_spec(pages)) else store
  return store.at[pages].get(out_sharding=common.sharded_as(spec, mesh_of=src))


def source(kv: CacheTiles | tuple[jax.Array, jax.Array], block: int) -> Stacked | CacheTiles:
  """The tile source of blockwise's ``kv`` argument: a (key, value) pair or CacheTiles."""
  if isinstance(kv, CacheTiles):
    return kv
  key, value = kv
  return stacked(key, value, block)
