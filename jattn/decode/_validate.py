"""The checks behind the public functions of :mod:`jattn.decode`: a cache's fields, new
keys and values (with overflow and running out of pages when concrete), a query; errors
name the argument, what it must be and what it is."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn.decode import _paging
from jattn.decode._cache import Cache, KVCache, PagedKVCache, _dims
from jattn.impl import quant


def _check_cache(cache: object) -> None:
  if not isinstance(cache, (KVCache, PagedKVCache)):
    raise TypeError(
      "cache must be a jattn.decode.KVCache or PagedKVCache (see decode.init and "
      f"decode.init_paged), got {type(cache).__name__}"
    )
  paged = isinstance(cache, PagedKVCache)
  k_name, v_name = (
    ("cache.key_pages", "cache.value_pages") if paged else ("cache.key", "cache.value")
  )
  for name, x in zip(cache._fields, cache):
    if x is None and name in ("key_scale", "value_scale", "value_pages"):
      continue  # a float cache's scales; the interleaved layout's values (in key_pages)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"cache.{name} must be an array, got {type(x).__name__}")
  k, v = cache[0], cache[1]
  if paged:
    if k.ndim != 4:
      raise ValueError(f"{k_name} must have shape (num_pages, page_size, K, H), got {k.shape}")
    if v is None and k.shape[2] % 2:
      raise ValueError(
        f"{k_name} must have an even number of heads in the interleaved layout (value_pages "
        f"None: keys at even heads, values at odd ones), got {k.shape}"
      )
  elif k.ndim != 4 or k.shape[1] < 1:
    raise ValueError(
      f"cache.key must have shape (B, max_length, K, H) with max_length >= 1, got {k.shape}"
    )
  if v is not None and (v.ndim != 4 or v.shape[:3] != k.shape[:3]):
    raise ValueError(
      f"{k_name} and {v_name} must have the same shape but for the head dimension, got "
      f"{k.shape} and {v.shape}"
    )
  if v is not None and v.dtype != k.dtype:
    raise TypeError(f"{k_name} and {v_name} must have the same dtype, got {k.dtype} and {v.dtype}")
  lengths = cache.lengths
  B = cache.page_table.shape[0] if isinstance(cache, PagedKVCache) else k.shape[0]
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
      f"cache.lengths must be an integer array of shape (B,)=({B},), "
      f"got {lengths.dtype}{lengths.shape}"
    )
  quantized = quant.is_quantized(k.dtype)
  scale_shape = k.shape[:2] + (k.shape[2] // 2,) if v is None else k.shape[:3]
  for name, x in (("cache.key_scale", cache.key_scale), ("cache.value_scale", cache.value_scale)):
    if quantized and (x is None or x.shape != scale_shape or x.dtype != quant.SCALE_DTYPE):
      got = "None" if x is None else f"{x.dtype}{x.shape}"
      raise ValueError(
        f"{name} must be a float32 array of shape {scale_shape} for a {k.dtype} cache, got {got}"
      )
    if not quantized and x is not None:
      raise ValueError(f"{name} must be None for a {k.dtype} cache (scales are for int8/float8)")
  if isinstance(cache, PagedKVCache):
    table, free = cache.page_table, cache.free
    if table.ndim != 2 or table.shape[1] < 1 or not jnp.issubdtype(table.dtype, jnp.integer):
      raise ValueError(
        f"cache.page_table must be an integer array of shape (B, max_pages_per_seq), got "
        f"{table.dtype}{table.shape}"
      )
    if free.shape != (k.shape[0],) or free.dtype != np.bool_:
      raise ValueError(
        f"cache.free must be a boolean array of shape (num_pages,)=({k.shape[0]},), got "
        f"{free.dtype}{free.shape}"
      )
    if _checks.is_concrete(table):
      ids = np.asarray(table)
      if np.any((ids < -1) | (ids >= k.shape[0])):
        raise ValueError(
          f"cache.page_table must hold page ids in [0, num_pages={k.shape[0]}) or -1, got "
          f"{ids.min()} .. {ids.max()}"
        )
  S = cache.max_length
  if _checks.is_concrete(lengths):
    held = np.asarray(lengths)
    if np.any((held < 0) | (held > S)):
      raise ValueError(f"cache.lengths must be in [0, max_length={S}], got {held.tolist()}")


def _check_new(
  cache: Cache,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  num_new: jax.typing.ArrayLike | None,
) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray, Any]:
  """key, value (B, t, K, H) matching the cache and num_new (B,) or None; overflow and
  running out of pages if concrete."""
  key, value = _checks.as_array("key", key), _checks.as_array("value", value)
  B, S, K, H, Hv = _dims(cache)
  shape = cache.key.shape if isinstance(cache, KVCache) else (B, S, K, H)
  layout = f"(B, t, K, H)=({B}, t, {K}, {H})"
  for name, x in (("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape {layout} like the cache, got {x.shape}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(
      f"key and value must have the same shape but for the head dimension, got key "
      f"{key.shape} and value {value.shape}"
    )
  if (key.shape[0], key.shape[2], key.shape[3]) != (B, K, H):
    raise ValueError(
      f"key and value must have shape {layout} to match the cache's (B, max_length, K, H)="
      f"{shape}, got {key.shape}"
    )
  if value.shape[3] != Hv:
    raise ValueError(
      f"value must have shape (B, t, K, Hv)=({B}, t, {K}, {Hv}) to match the cache's "
      f"value head dimension Hv={Hv}, got {value.shape}"
    )
  t = key.shape[1]
  if not 1 <= t <= S:
    raise ValueError(
      f"key and value must hold 1 <= t <= max_length={S} new tokens, got t={t} in shape {key.shape}"
    )
  _check_dtype(cache, "key", key)
  if value.dtype != key.dtype:
    raise TypeError(f"value must have key's dtype {key.dtype}, got {value.dtype}")
  if num_new is not None:
    num_new = _checks.int_array("num_new", _checks.as_array("num_new", num_new), ranks=(1,))
    if num_new.shape != (B,):
      raise ValueError(f"num_new must have shape (B,)=({B},), got {num_new.shape}")
    if _checks.is_concrete(num_new):
      n = np.asarray(num_new)
      if np.any((n < 0) | (n > t)):
        raise ValueError(f"num_new must be in [0, t={t}] (the new tokens given), got {n.tolist()}")
  if num_new is None or _checks.is_concrete(num_new):
    _check_room(cache, np.full((B,), t) if num_new is None else np.asarray(num_new))
  return key, value, num_new


def _check_room(cache: Cache, n: np.ndarray) -> None:
  """Where the cache's lengths (and a paged cache's table and pool) are concrete, that every
  row has room for its ``n`` (B,) new tokens: no overflow, enough free pages."""
  S = cache.max_length
  if _checks.is_concrete(cache.lengths):
    lengths = np.asarray(cache.lengths)
    over = np.flatnonzero(lengths + n > S)
    if over.size:
      b = int(over[0])
      raise ValueError(
        f"cache row {b} would overflow: it holds {int(lengths[b])} tokens and "
        f"{int(n[b])} new ones make {int(lengths[b] + n[b])} > "
        f"max_length={S}"
      )
    if (
      isinstance(cache, PagedKVCache)
      and _checks.is_concrete(cache.page_table)
      and _checks.is_concrete(cache.free)
    ):
      needed = _paging.pages_needed(cache.page_table, lengths + n, cache.page_size)
      free = int(np.sum(np.asarray(cache.free)))
      if needed.sum() > free:
        raise ValueError(
          f"the paged cache is out of pages: the new tokens need {int(needed.sum())} more "
          f"pages (per row {needed.tolist()}) and {free} of num_pages={cache.num_pages} are "
          "free; release finished rows (decode.release, or the Flax modules' release_cache) "
          "or make the pool larger"
        )


def _check_dtype(cache: Cache, name: str, x: jax.Array | np.ndarray) -> None:
  storage = cache.dtype
  if quant.is_quantized(storage):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype (the cache quantizes it), got {x.dtype}")
  elif x.dtype != storage:
    raise TypeError(f"{name} must have the cache's dtype {storage}, got {x.dtype}")


def _check_query(
  cache: Cache, query: jax.typing.ArrayLike, key: jax.Array | np.ndarray
) -> jax.Array | np.ndarray:
  query = _checks.as_array("query", query)
  B, _, K, H, _ = _dims(cache)
  t = key.shape[1]
  if query.ndim != 4 or query.shape[0] != B or query.shape[1] != t or query.shape[3] != H:
    raise ValueError(
      f"query must have shape (B, t, N, H)=({B}, {t}, N, {H}) to match key "
      f"(B, t, K, H) and the cache, got {query.shape}"
    )
  if query.shape[2] % K:
    raise ValueError(
      f"the number of query heads N ({query.shape[2]}) must be a multiple of "
      f"the cache's number of key/value heads K ({K})"
    )
  _check_dtype(cache, "query", query)
  if query.dtype != key.dtype:
    raise TypeError(f"query must have key's dtype {key.dtype}, got {query.dtype}")
  return query
