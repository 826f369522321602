"""Writes into a cache: :func:`update` scatters new tokens after each row's last one
(taking pages from the pool for a paged cache), :func:`release` empties finished rows, and
:func:`positions` names the slots the next tokens will take."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn.decode import _paging
from jattn.decode._cache import Cache, KVCache, PagedKVCache
from jattn.decode._validate import _check_cache, _check_new
from jattn.impl import common, kv_tiles, quant


def release(cache: Cache, rows: jax.typing.ArrayLike) -> Cache:
  """The cache with the rows where ``rows`` (a boolean array (B,)) is True emptied:
  their lengths 0 and, for a paged cache, their pages back in the pool. Released
  rows restart empty (a new request); the others are unchanged. Runs under jit."""
  _check_cache(cache)
  rows = _checks.as_array("rows", rows)
  B = cache.lengths.shape[0]
  if rows.dtype != np.bool_ or rows.shape != (B,):
    raise ValueError(
      f"rows must be a boolean array of shape (B,)=({B},), got {rows.dtype}{rows.shape}"
    )
  lengths = jnp.where(rows, 0, cache.lengths).astype(cache.lengths.dtype)
  if isinstance(cache, KVCache):
    return cache._replace(lengths=lengths)
  table, free = _paging.release(cache.page_table, cache.free, jnp.asarray(rows))
  return cache._replace(page_table=table, free=free, lengths=lengths)


def positions(cache: Cache, num_new: int) -> jax.Array:
  """Absolute positions (B, num_new) int32 of the next ``num_new`` tokens of each row.

  ``positions[b, i] = cache.lengths[b] + i``: what RoPE or learned position
  embeddings of the new queries and keys need, before :func:`update`.
  """
  _check_cache(cache)
  num_new = _checks.integer("num_new", num_new, minimum=0)
  lengths = cache.lengths.astype(jnp.int32)
  return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def update(
  cache: Cache,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  num_new: jax.typing.ArrayLike | None = None,
) -> Cache:
  """Write new keys and values after each row's last token.

  Args:
    cache: the :class:`KVCache` or :class:`PagedKVCache` to extend (not modified).
    key: (B, t, K, H) keys of the t new tokens, the cache's dtype (any floating
      dtype for a quantized cache), 1 <= t <= max_length.
    value: (B, t, K, Hv) their values, key's dtype.
    num_new: None (all t tokens of every row are real) or an int array (B,)
      with ``0 <= num_new[b] <= t``: row b writes only its first
      ``num_new[b]`` tokens (right-padded ragged prompts). Traced values are
      clipped to [0, t].

  Returns:
    The new cache: row b holds the tokens at slots ``lengths[b] ...
    lengths[b] + num_new[b] - 1`` and ``lengths[b] += num_new[b]``.

  Raises ValueError when the lengths and num_new are concrete and a row would
  exceed ``max_length``, or, for a paged cache, when the rows need more new pages
  than the pool has free. When they are traced (inside jit) this cannot be
  checked: tokens past ``max_length``, or past the pages a row could get, are
  dropped and the row's length saturates there (check ``cache.lengths`` on the
  host, or use ``jax.experimental.checkify``).
  """
  _check_cache(cache)
  key, value, num_new = _check_new(cache, key, value, num_new)
  return _write(cache, key, value, num_new)


@jax.jit
def _write(
  cache: Cache,
  key: jax.Array | np.ndarray,
  value: jax.Array | np.ndarray,
  num_new: jax.typing.ArrayLike | None,
) -> Cache:
  """The scatter behind :func:`update`; arguments already checked. One compiled program per
  cache structure and shapes, so that an eager decoding loop runs one program per step for
  the write, not one per operation."""
  B, t = key.shape[:2]
  S = cache.max_length
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = jnp.full((B,), t, jnp.int32) if num_new is None else jnp.clip(num_new, 0, t)
  lengths = cache.lengths.astype(jnp.int32)
  new_lengths, table, free = _grow(cache, n)
  pos = lengths[:, None] + i  # (B, t)
  kept = pos < new_lengths[:, None]  # the first n[b] tokens, as far as the row has room
  stored, scales = _stored(cache, key, value)

  if isinstance(cache, KVCache):
    # Row by row (a scatter batched over B): each row writes only its own slots, so a
    # batch sharded in Explicit mode stays sharded. A cache whose type names mesh axes
    # keeps them (the new tokens are resharded to it); one that names none (as init makes
    # it) takes the sharding of the keys and values written into it.
    slots = jnp.where(kept, pos, S)  # S and beyond are dropped by the scatter
    put_row = jax.vmap(lambda store, at, x: store.at[at].set(x, mode="drop"))

    def put_rows(store: jax.Array | None, x: jax.Array | None) -> Any:
      if x is None:
        return None
      store = jnp.asarray(store)
      src = store if any(common.sharding_spec(store)) else x
      spec = common.sharding_spec(src)
      spec = (spec[0], None, *spec[2:])  # slots are written along the sequence
      store, x, at = (
        common.reshard(a, s, mesh_of=src)
        for a, s in ((store, spec), (x, spec), (slots, spec[:1] + (None,)))
      )
      return put_row(store, at, x)

    return KVCache(
      put_rows(cache.key, stored[0]),
      put_rows(cache.value, stored[1]),
      new_lengths.astype(cache.lengths.dtype),
      put_rows(cache.key_scale, scales[0]),
      put_rows(cache.value_scale, scales[1]),
    )
  ps = cache.page_size
  page = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, cache.max_pages_per_seq - 1), axis=1)
  at = (jnp.where(kept, page, cache.num_pages), pos % ps)

  def put(store: jax.Array | None, x: jax.Array | None) -> Any:
    if x is None:
      return None
    # Every row writes into the one pool of pages, so the new tokens are gathered over a
    # batch sharded in Explicit mode; heads keep the pool's sharding, else take the keys'.
    store = jnp.asarray(store)
    src = store if common.sharding_spec(store)[2] else x
    spec = (None, None, common.sharding_spec(src)[2], *(None,) * (x.ndim - 3))
    store, x = (common.reshard(a, spec, mesh_of=src) for a in (store, x))
    pages, slots = (common.reshard(i, (None, None), mesh_of=src) for i in at)
    return store.at[pages, slots].set(x, mode="drop")

  pools = _pools(cache, stored)
  return PagedKVCache(
    put(cache.key_pages, pools[0]),
    put(cache.value_pages, pools[1]),
    table,
    new_lengths.astype(cache.lengths.dtype),
    free,
    put(cache.key_scale, scales[0]),
    put(cache.value_scale, scales[1]),
  )


def _pools(cache: PagedKVCache, stored: tuple[Any, Any]) -> tuple[Any, Any]:
  """What a paged cache's pools take of new keys and values (..., K, H): each its own, or in
  the interleaved layout the one pool both, key head k at 2k and its values at 2k + 1 (and
  None for the absent value pool)."""
  return stored if not cache.interleaved else (kv_tiles.interleave(*stored), None)


@jax.jit
def _write_packed(
  cache: Cache,
  key: jax.Array | np.ndarray,
  value: jax.Array | np.ndarray,
  counts: jax.Array,
  row: jax.Array,
  local: jax.Array,
) -> Cache:
  """The scatter of a ragged step: packed tokens (T, K, H) each written to cache row
  ``row`` (T,) (-1: padding, not written) at slot ``lengths[row] + local``; ``counts`` (B,)
  how many each row takes. Rows grow (and take pages) as :func:`_write` grows them, tokens
  past a row's room dropped, its length saturating."""
  lengths = cache.lengths.astype(jnp.int32)
  new_lengths, table, free = _grow(cache, counts)
  r = jnp.maximum(row, 0)
  pos = lengths[r] + local
  kept = (row >= 0) & (pos < new_lengths[r])
  stored, scales = _stored(cache, key, value)
  if isinstance(cache, KVCache):
    at = (jnp.where(kept, r, cache.key.shape[0]), pos)  # row B and beyond: dropped
    return KVCache(
      _put(at, cache.key, stored[0]),
      _put(at, cache.value, stored[1]),
      new_lengths.astype(cache.lengths.dtype),
      _put(at, cache.key_scale, scales[0]),
      _put(at, cache.value_scale, scales[1]),
    )
  ps = cache.page_size
  page = table[r, jnp.clip(pos // ps, 0, cache.max_pages_per_seq - 1)]
  at = (jnp.where(kept, page, cache.num_pages), pos % ps)
  pools = _pools(cache, stored)
  return PagedKVCache(
    _put(at, cache.key_pages, pools[0]),
    _put(at, cache.value_pages, pools[1]),
    table,
    new_lengths.astype(cache.lengths.dtype),
    free,
    _put(at, cache.key_scale, scales[0]),
    _put(at, cache.value_scale, scales[1]),
  )


def _put(at: tuple[jax.Array, jax.Array], store: Any, x: Any) -> Any:
  """``store`` with ``x`` scattered at ``at`` (indices past the store dropped); None for an
  absent store (a float cache's scales)."""
  return None if x is None else store.at[at].set(x, mode="drop")


def _grow(cache: Cache, counts: Any) -> tuple[jax.Array, Any, Any]:
  """``(new_lengths, page_table, free)``: the rows' lengths after ``counts`` (B,) more tokens,
  capped at max_length and, for a paged cache, at the pages the pool could give them (then
  the table and free list after giving them; None, None for a contiguous cache)."""
  lengths = cache.lengths.astype(jnp.int32)
  new_lengths = jnp.minimum(lengths + counts.astype(jnp.int32), cache.max_length)
  if not isinstance(cache, PagedKVCache):
    return new_lengths, None, None
  table, free, capacity = _paging.allocate(
    cache.page_table, cache.free, new_lengths, cache.page_size
  )
  return jnp.minimum(new_lengths, capacity), table, free


def _stored(cache: Cache, key: Any, value: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
  """``((key, value), (key_scale, value_scale))`` as the cache stores them: quantized with
  their scales for an int8/float8 cache (gradients do not flow into it, see
  :mod:`jattn.decode`), else as given with no scales."""
  if not quant.is_quantized(cache.dtype):
    return (key, value), (None, None)
  (k_q, k_s), (v_q, v_s) = (
    quant.quantize(jax.lax.stop_gradient(x), cache.dtype) for x in (key, value)
  )
  return (k_q, v_q), (k_s, v_s)
