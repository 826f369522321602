"""The Flax modules' KV caches: settings, allocation, and the cache kept as one variable
per field.

Shape legend as in :mod:`jattn.attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _quant, decode
from jattn._flax_config import Heads


@dataclasses.dataclass(frozen=True)
class CacheOptions:
  """Checked cache settings: storage dtype (None: the keys' dtype), paging."""

  dtype: np.dtype | None = None
  page_size: int | None = None
  num_pages: int | None = None


def check_cache_options(
  *,
  dtype_name: str,
  dtype: jax.typing.DTypeLike | None,
  page_size: int | None,
  num_pages: int | None,
  implementation: str | None,
  block_kv: int | None,
) -> CacheOptions:
  """The cache settings of ``init_cache`` (NNX) or the module's fields (Linen), checked.

  A paged or quantized cache is read by blockwise attention alone, in tiles of whole
  pages, so the module's ``implementation`` and ``block_kv`` must allow that.
  """
  dtype = None if dtype is None else _checks.storage_dtype(dtype_name, dtype)
  if page_size is not None:
    page_size = _checks.integer("page_size", page_size, minimum=1, int32=True)
  if num_pages is not None:
    num_pages = _checks.integer("num_pages", num_pages, minimum=1, int32=True)
    if page_size is None:
      raise ValueError(
        f"num_pages applies only to a paged cache: give page_size too, got num_pages={num_pages}"
      )
  kind = " and ".join(
    k
    for k, on in (
      (f"paged (page_size={page_size})", page_size is not None),
      (f"quantized ({dtype_name}={dtype})", dtype is not None and _quant.is_quantized(dtype)),
    )
    if on
  )
  if kind and implementation not in (None, "blockwise"):
    raise ValueError(
      f"a {kind} cache is read by blockwise attention alone, but this module has "
      f"implementation={implementation!r}; use implementation=None or 'blockwise'"
    )
  if page_size is not None and block_kv is not None and block_kv % page_size:
    raise ValueError(
      f"block_kv must be a multiple of page_size={page_size} (a paged cache is read in "
      f"tiles of whole pages), got block_kv={block_kv}"
    )
  return CacheOptions(dtype, page_size, num_pages)


def _is_int(x: object) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def size(
  input_shape: Sequence[int] | int | None,
  dtype: Any,  # a dtype or None; max_length in init_cache(B, L)
  batch_size: int | None,
  max_length: int | None,
) -> tuple[int, int, jax.typing.DTypeLike | None]:
  """``(batch_size, max_length, dtype)`` from the arguments of the NNX module's
  ``init_cache``: Flax's ``input_shape`` (B, max_length, F) and ``dtype``, or jattn's
  ``batch_size=`` and ``max_length=`` (also taken positionally, two ints, as before)."""
  if _is_int(input_shape) and _is_int(dtype) and batch_size is None and max_length is None:
    return input_shape, dtype, None  # type: ignore[return-value]  # two ints: init_cache(B, L)
  if input_shape is None:
    if batch_size is None or max_length is None:
      raise TypeError(
        "init_cache needs input_shape (batch, max_length, features), or batch_size= and max_length="
      )
    return batch_size, max_length, dtype
  if batch_size is not None or max_length is not None:
    raise TypeError("init_cache takes input_shape or batch_size= and max_length=, not both")
  if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3:
    raise ValueError(
      f"input_shape must be (batch, max_length, features), as in Flax's init_cache, got "
      f"{input_shape!r}"
    )
  return input_shape[0], input_shape[1], dtype


def init_cache(
  heads: Heads,
  batch_size: int,
  max_length: int,
  dtype: jax.typing.DTypeLike,
  options: CacheOptions = CacheOptions(),
) -> decode.Cache:
  """An empty cache for ``heads``: contiguous, or paged when ``options.page_size`` is set.

  ``dtype`` is used when ``options.dtype`` is None. A paged cache gives each row
  ``ceil(max_length / page_size)`` pages (its max_length rounded up to whole pages) from a
  pool of ``num_pages`` pages, by default enough for every row to fill; masks sized to
  ``max_length`` still fit it (:func:`jattn.decode.attention` pads them to whole pages).
  """
  batch_size = _checks.integer("batch_size", batch_size, minimum=1)
  max_length = _checks.integer("max_length", max_length, minimum=1)
  dtype = options.dtype if options.dtype is not None else dtype
  layout: dict[str, Any] = dict(dtype=dtype, value_head_dim=heads.value_head_dim)
  if options.page_size is None:
    return decode.init(batch_size, max_length, heads.num_kv_heads, heads.head_dim, **layout)
  pages_per_row = -(-max_length // options.page_size)
  return decode.init_paged(
    batch_size * pages_per_row if options.num_pages is None else options.num_pages,
    options.page_size,
    batch_size,
    pages_per_row,
    heads.num_kv_heads,
    heads.head_dim,
    **layout,
  )


def cache_accepts(cache: decode.Cache, dtype: jax.typing.DTypeLike) -> bool:
  """Whether keys of ``dtype`` can be written to ``cache``: its own dtype, or any floating
  dtype for a quantized cache."""
  storage = cache.dtype
  return dtype == storage or (_quant.is_quantized(storage) and jnp.issubdtype(dtype, jnp.floating))


def check_dtype(
  cache: decode.Cache | None,
  dtype: jax.typing.DTypeLike,
  *,
  origin: str,
  settings: str,
  remedy: str,
) -> None:
  """Raise TypeError unless keys of ``dtype`` can be written to ``cache`` (None: nothing to
  check). ``origin`` says where the cache's dtype came from, ``settings`` the module's dtypes
  that made ``dtype``, ``remedy`` what to change (``{dtype}`` is filled in)."""
  if cache is None or cache_accepts(cache, dtype):
    return
  raise TypeError(
    f"the KV cache holds {cache.dtype} keys and values{origin}, but this module computes "
    f"them in {dtype} ({settings}); {remedy.format(dtype=dtype)}"
  )


def dtype_name(dtype: jax.typing.DTypeLike | None) -> str | None:
  """A dtype's name for messages, None for None."""
  return None if dtype is None else jnp.dtype(dtype).name


def cache_from(get: Callable[[str], Any]) -> decode.Cache | None:
  """The cache whose fields ``get(field)`` returns (None for absent ones), or None when
  there is none: the modules keep one variable per field of the cache."""
  if get("key_pages") is not None:
    return decode.PagedKVCache(*(get(f) for f in decode.PagedKVCache._fields))
  if get("key") is not None:
    return decode.KVCache(*(get(f) for f in decode.KVCache._fields))
  return None


CACHE_FIELDS = tuple(dict.fromkeys(decode.KVCache._fields + decode.PagedKVCache._fields))


def release(cache: decode.Cache | None, rows: jax.typing.ArrayLike) -> decode.Cache:
  """:func:`jattn.decode.release` for a module's cache, which must exist."""
  if cache is None:
    raise ValueError("there is no KV cache to release rows of: call init_cache first")
  return decode.release(cache, rows)
