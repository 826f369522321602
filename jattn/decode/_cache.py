"""The two caches' types and their storage: :class:`KVCache` (one slab per row) and
:class:`PagedKVCache` (a pool of pages, :mod:`jattn.decode._paging`), each float or
quantized (:mod:`jattn.impl.quant`); :func:`init` and :func:`init_paged` make empty ones."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn.impl import quant


class KVCache(NamedTuple):
  """Keys and values of the tokens seen so far; a pytree of fixed shape.

  Attributes:
    key: (B, max_length, K, H); slots at or past ``lengths[b]`` are unused.
    value: (B, max_length, K, Hv), same dtype as key; Hv is H unless the cache
      was made with ``value_head_dim``.
    lengths: (B,) int32, the number of tokens written to each row.
    key_scale, value_scale: None, or float32 (B, max_length, K) for a quantized
      cache (key and value int8 or float8_e4m3fn): slot s of head k holds
      ``key[b, s, k] * key_scale[b, s, k]``.
  """

  key: jax.Array
  value: jax.Array
  lengths: jax.Array
  key_scale: jax.Array | None = None
  value_scale: jax.Array | None = None

  @property
  def max_length(self) -> int:
    """How many tokens each row can hold."""
    return self.key.shape[1]

  @property
  def dtype(self) -> np.dtype:
    """The storage dtype of keys and values: a float, or int8 / float8_e4m3fn (quantized)."""
    return np.dtype(self.key.dtype)


class PagedKVCache(NamedTuple):
  """Keys and values in a pool of pages, a page table per row; a pytree of fixed shape.

  Slot s of row b (its s-th token) lives in page ``page_table[b, s // page_size]``
  at offset ``s % page_size``. A row's pages are a prefix of its table row,
  enough for ``lengths[b]`` tokens; ``-1`` marks no page.

  Attributes:
    key_pages: (num_pages, page_size, K, H); or, in the interleaved layout, the one pool
      of keys and values (num_pages, page_size, 2K, H), key head k at head 2k and its
      values at 2k + 1, as JAX's TPU ragged paged attention reads it.
    value_pages: (num_pages, page_size, K, Hv), same dtype as key_pages; None in the
      interleaved layout.
    page_table: (B, max_pages_per_seq) int32, page ids or -1.
    lengths: (B,) int32, the number of tokens written to each row.
    free: (num_pages,) bool, the pages no row holds.
    key_scale, value_scale: None, or float32 (num_pages, page_size, K) for a
      quantized cache, as in :class:`KVCache`.
  """

  key_pages: jax.Array
  value_pages: jax.Array | None
  page_table: jax.Array
  lengths: jax.Array
  free: jax.Array
  key_scale: jax.Array | None = None
  value_scale: jax.Array | None = None

  @property
  def interleaved(self) -> bool:
    """Whether keys and values share one pool, interleaved by head (``value_pages`` None)."""
    return self.value_pages is None

  @property
  def page_size(self) -> int:
    return self.key_pages.shape[1]

  @property
  def num_pages(self) -> int:
    return self.key_pages.shape[0]

  @property
  def max_pages_per_seq(self) -> int:
    return self.page_table.shape[1]

  @property
  def max_length(self) -> int:
    """How many tokens each row can hold: max_pages_per_seq · page_size."""
    return self.page_table.shape[1] * self.key_pages.shape[1]

  @property
  def dtype(self) -> np.dtype:
    """The storage dtype of keys and values, as in :class:`KVCache`."""
    return np.dtype(self.key_pages.dtype)


Cache = KVCache | PagedKVCache


def init(
  batch_size: int,
  max_length: int,
  num_kv_heads: int,
  head_dim: int,
  *,
  dtype: Any = jnp.float32,
  value_head_dim: int | None = None,
) -> KVCache:
  """An empty cache: zero keys (B, max_length, K, H) and values (B, max_length, K, Hv),
  lengths 0; Hv is ``value_head_dim``, default ``head_dim``. ``dtype`` is a floating
  dtype, or ``jnp.int8`` / ``jnp.float8_e4m3fn`` for a quantized cache (with scales)."""
  B, S = _sizes(batch_size=batch_size, max_length=max_length)
  stores = _stores((B, S), num_kv_heads, head_dim, value_head_dim, dtype)
  key, value, lengths, *scales = _filled((*stores[:2], ((B,), np.int32, 0), *stores[2:]))
  return KVCache(key, value, lengths, *scales)


def init_paged(
  num_pages: int,
  page_size: int,
  batch_size: int,
  max_pages_per_seq: int,
  num_kv_heads: int,
  head_dim: int,
  *,
  dtype: Any = jnp.float32,
  value_head_dim: int | None = None,
  kv_layout: str = "separate",
) -> PagedKVCache:
  """An empty paged cache: ``num_pages`` pages of ``page_size`` slots, all free, and
  ``batch_size`` rows of up to ``max_pages_per_seq`` pages (max_length =
  max_pages_per_seq · page_size tokens), lengths 0.

  ``kv_layout``: ``"separate"`` pools of keys and of values, or ``"interleaved"``: one
  pool (num_pages, page_size, 2K, H) holding key head k at head 2k and its values at
  2k + 1 (values of the keys' head dim), the layout JAX's TPU ragged paged attention
  kernel reads, so a step hands it the pool as it is.

  ``dtype`` as in :func:`init`. ``page_size`` is also the unit of attention's
  key/value tiles (``block_kv``, default the largest multiple of ``page_size`` up to
  blockwise's default tile), so pages of 64–512 slots keep the tile loop short on a
  CPU; ``num_pages`` may be smaller than ``batch_size · max_pages_per_seq``: rows take
  pages as they grow.
  """
  P, ps, B, M = _sizes(
    num_pages=num_pages,
    page_size=page_size,
    batch_size=batch_size,
    max_pages_per_seq=max_pages_per_seq,
  )
  if kv_layout not in ("separate", "interleaved"):
    raise ValueError(f"kv_layout must be 'separate' or 'interleaved', got {kv_layout!r}")
  stores = _stores((P, ps), num_kv_heads, head_dim, value_head_dim, dtype)
  if kv_layout == "interleaved":
    (shape, store_dtype, zero), value = stores[0], stores[1]
    if value[0][3] != shape[3]:
      raise ValueError(
        f"value_head_dim must be head_dim ({shape[3]}) in the interleaved layout (keys and "
        f"values share the pool's heads), got {value[0][3]}"
      )
    stores = (((P, ps, 2 * shape[2], shape[3]), store_dtype, zero), *stores[2:])
  tables = (((B, M), np.int32, -1), ((B,), np.int32, 0), ((P,), np.bool_, True))
  if kv_layout == "interleaved":
    pool, page_table, lengths, free, *scales = _filled((stores[0], *tables, *stores[1:]))
    return PagedKVCache(pool, None, page_table, lengths, free, *scales)
  key, value, page_table, lengths, free, *scales = _filled((*stores[:2], *tables, *stores[2:]))
  return PagedKVCache(key, value, page_table, lengths, free, *scales)


def _sizes(**sizes: int) -> tuple[int, ...]:
  """The given sizes, each checked to be an int >= 1 (errors name it)."""
  return tuple(_checks.integer(name, n, minimum=1) for name, n in sizes.items())


_Fill = tuple[tuple[int, ...], Any, Any]
"""An array to allocate: (shape, dtype, the value of every element)."""


def _stores(
  lead: tuple[int, int],
  num_kv_heads: int,
  head_dim: int,
  value_head_dim: int | None,
  dtype: Any,
) -> tuple[_Fill, ...]:
  """Zero keys (*lead, K, H) and values (*lead, K, Hv) in the checked storage ``dtype``,
  and when it is quantized zero float32 scales (*lead, K) each: ``(key, value)`` or ``(key,
  value, key_scale, value_scale)``, as :func:`_filled` takes them."""
  K, H = _sizes(num_kv_heads=num_kv_heads, head_dim=head_dim)
  Hv = H if value_head_dim is None else _sizes(value_head_dim=value_head_dim)[0]
  dtype = np.dtype(quant.storage_dtype("dtype", dtype))
  stores: tuple[_Fill, ...] = (((*lead, K, H), dtype, 0), ((*lead, K, Hv), dtype, 0))
  if quant.is_quantized(dtype):
    stores += (((*lead, K), np.dtype(quant.SCALE_DTYPE), 0),) * 2
  return stores


@functools.partial(jax.jit, static_argnums=0)
def _filled(fills: tuple[_Fill, ...]) -> tuple[jax.Array, ...]:
  """The arrays ``fills`` describes, made by one program (outside jit, each jnp.zeros would
  compile its own for every new shape). Each is a buffer of its own, so a step may donate
  the cache."""
  return tuple(jnp.full(shape, value, dtype) for shape, dtype, value in fills)


def _dims(cache: Cache) -> tuple[int, int, int, int, int]:
  """(B, max_length, K, H, Hv) of a checked cache."""
  if isinstance(cache, KVCache):
    B, S, K, H = cache.key.shape
  else:
    B = cache.page_table.shape[0]
    S = cache.max_length
    _, _, K, H = cache.key_pages.shape
    if cache.value_pages is None:  # interleaved: keys and values share the pool's heads
      return B, S, K // 2, H, H
    return B, S, K, H, cache.value_pages.shape[3]
  return B, S, K, H, cache.value.shape[3]
