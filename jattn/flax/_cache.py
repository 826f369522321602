"""The Flax modules' KV caches: settings, allocation, and the cache kept as named variables.

Both modules keep a cache as one variable per array (NNX ``nnx.Cache`` attributes, Linen's
``cache`` collection), under Flax's names where Flax's modules have the array:
``cached_key`` and ``cached_value`` ([batch..., max_length, K, H]) and ``cache_index`` (one
int32 count of the tokens every row holds), so a Flax cache and a jattn cache are the same
variables. jattn's additions have their own: ``cache_lengths`` (B,) in place of
``cache_index`` for a cache with one length per row (``ragged``, and every paged cache),
``cached_key_pages``, ``cached_value_pages``, ``page_table``, ``free_pages`` (paged),
``cached_key_scale``, ``cached_value_scale`` (quantized). Inside, the modules read and
write them as a :mod:`jattn.decode` cache of B rows, B the product of the batch dimensions.

Shape legend as in :mod:`jattn.attention`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, decode
from jattn.flax._config import Heads
from jattn.impl import quant, select

# The variable holding each field of a jattn.decode cache.
NAMES = {
  "key": "cached_key",
  "value": "cached_value",
  "key_pages": "cached_key_pages",
  "value_pages": "cached_value_pages",
  "page_table": "page_table",
  "lengths": "cache_lengths",
  "free": "free_pages",
  "key_scale": "cached_key_scale",
  "value_scale": "cached_value_scale",
}
INDEX = "cache_index"  # Flax's one length for all rows, in place of cache_lengths
VARIABLES = (*NAMES.values(), INDEX)
CACHE_FIELDS = tuple(dict.fromkeys(decode.KVCache._fields + decode.PagedKVCache._fields))
assert set(NAMES) == set(CACHE_FIELDS)
# Fields of a contiguous cache laid out [batch..., max_length, ...], kept (B, ...) inside.
_PER_ROW = ("key", "value", "key_scale", "value_scale")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
  """Checked cache settings: storage dtype (None: the keys' dtype), paging, and whether
  each row keeps its own length (always, for a paged cache)."""

  dtype: np.dtype | None = None
  page_size: int | None = None
  num_pages: int | None = None
  ragged: bool = False


def check_cache_options(
  *,
  dtype_name: str,
  dtype: jax.typing.DTypeLike | None,
  page_size: int | None,
  num_pages: int | None,
  implementation: str | None,
  block_kv: int | None,
  ragged_name: str = "ragged",
  ragged: bool = False,
) -> CacheOptions:
  """The cache settings of ``init_cache`` (NNX) or the module's fields (Linen), checked.

  A paged or quantized cache is read by blockwise attention alone, in tiles of whole
  pages, so the module's ``implementation`` and ``block_kv`` must allow that.
  """
  dtype = None if dtype is None else quant.storage_dtype(dtype_name, dtype)
  _checks.boolean(ragged_name, ragged)
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
      (f"quantized ({dtype_name}={dtype})", dtype is not None and quant.is_quantized(dtype)),
    )
    if on
  )
  if kind and implementation is not None and implementation not in select.CACHE_READERS:
    names = " or ".join(select.CACHE_READERS)
    readers = " or ".join(repr(n) for n in select.CACHE_READERS)
    raise ValueError(
      f"a {kind} cache is read by {names} attention alone, but this module has "
      f"implementation={implementation!r}; use implementation=None or {readers}"
    )
  if page_size is not None and block_kv is not None and block_kv % page_size:
    raise ValueError(
      f"block_kv must be a multiple of page_size={page_size} (a paged cache is read in "
      f"tiles of whole pages), got block_kv={block_kv}"
    )
  return CacheOptions(dtype, page_size, num_pages, bool(ragged) or page_size is not None)


def _is_int(x: object) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def size(
  input_shape: Sequence[int] | int | None,
  dtype: Any,  # a dtype or None; max_length in init_cache(B, L)
  batch_size: int | Sequence[int] | None,
  max_length: int | None,
) -> tuple[tuple[int, ...], int, jax.typing.DTypeLike | None]:
  """``(batch_dims, max_length, dtype)`` from the arguments of the NNX module's
  ``init_cache``: Flax's ``input_shape`` [batch..., max_length, F] and ``dtype``, or
  jattn's ``batch_size=`` (an int or a tuple of batch dimensions) and ``max_length=``
  (also taken positionally, two ints)."""
  if _is_int(input_shape) and _is_int(dtype) and batch_size is None and max_length is None:
    return (int(input_shape),), int(dtype), None  # type: ignore[arg-type]  # init_cache(B, L)
  if input_shape is None:
    if batch_size is None or max_length is None:
      raise TypeError(
        "init_cache needs input_shape (batch..., max_length, features), or batch_size= and "
        "max_length="
      )
    dims = tuple(batch_size) if isinstance(batch_size, (tuple, list)) else (batch_size,)
    for d in dims:
      _checks.integer("batch_size", d, minimum=1)
    return tuple(int(d) for d in dims), max_length, dtype
  if batch_size is not None or max_length is not None:
    raise TypeError("init_cache takes input_shape or batch_size= and max_length=, not both")
  if (
    not isinstance(input_shape, (tuple, list))
    or len(input_shape) < 2
    or not all(_is_int(d) and d >= 1 for d in input_shape)
  ):
    raise ValueError(
      f"input_shape must be (batch..., max_length, features) of positive ints, as in Flax's "
      f"init_cache, got {input_shape!r}"
    )
  return tuple(int(d) for d in input_shape[:-2]), int(input_shape[-2]), dtype


def init_cache(
  heads: Heads,
  batch_dims: tuple[int, ...],
  max_length: int,
  dtype: jax.typing.DTypeLike,
  options: CacheOptions = CacheOptions(),
) -> dict[str, jax.Array]:
  """The variables of an empty cache for ``heads`` and rows ``batch_dims`` (possibly none),
  by name: contiguous, or paged when ``options.page_size`` is set.

  ``dtype`` is used when ``options.dtype`` is None. A paged cache gives each row
  ``ceil(max_length / page_size)`` pages (its max_length rounded up to whole pages) from a
  pool of ``num_pages`` pages, by default enough for every row to fill; masks sized to
  ``max_length`` still fit it (:func:`jattn.decode.attention` pads them to whole pages).
  A cache with one length per row (``options.ragged``) has exactly one batch dimension.
  """
  max_length = _checks.integer("max_length", max_length, minimum=1)
  if options.ragged and len(batch_dims) != 1:
    kind = "a paged" if options.page_size is not None else "a ragged"
    raise ValueError(
      f"{kind} cache keeps one length per row and takes exactly one batch dimension "
      f"(B, max_length, F), got batch dimensions {batch_dims}"
    )
  batch_size = math.prod(batch_dims)
  dtype = options.dtype if options.dtype is not None else dtype
  layout: dict[str, Any] = dict(dtype=dtype, value_head_dim=heads.value_head_dim)
  cache: decode.Cache
  if options.page_size is None:
    cache = decode.init(batch_size, max_length, heads.num_kv_heads, heads.head_dim, **layout)
  else:
    pages_per_row = -(-max_length // options.page_size)
    cache = decode.init_paged(
      batch_size * pages_per_row if options.num_pages is None else options.num_pages,
      options.page_size,
      batch_size,
      pages_per_row,
      heads.num_kv_heads,
      heads.head_dim,
      **layout,
    )
  return variables_of(cache, batch_dims, indexed=not options.ragged)


def variables_of(
  cache: decode.Cache, batch_dims: tuple[int, ...], *, indexed: bool
) -> dict[str, jax.Array]:
  """The variables holding ``cache``, of ``math.prod(batch_dims)`` rows, by name: its
  per-row arrays shaped [batch_dims..., ...] again; with ``indexed``, Flax's one
  ``cache_index`` (row 0's length: all rows hold the same) in place of ``cache_lengths``."""
  out = {}
  contiguous = isinstance(cache, decode.KVCache)  # a paged cache has one batch dimension
  for field, x in cache._asdict().items():
    if x is None:
      continue
    if field == "lengths" and indexed:
      out[INDEX] = x[0]
    elif contiguous and field in _PER_ROW:
      out[NAMES[field]] = x.reshape(batch_dims + x.shape[1:])
    else:
      out[NAMES[field]] = x
  return out


@dataclasses.dataclass(frozen=True)
class Held:
  """A module's cache read from its variables: a :mod:`jattn.decode` cache of B rows (the
  batch dimensions flattened), the batch dimensions, and whether it keeps Flax's one
  ``cache_index`` (True) or a length per row."""

  cache: decode.Cache
  batch_dims: tuple[int, ...]
  indexed: bool

  def variables(self, cache: decode.Cache) -> dict[str, jax.Array]:
    """The variables holding ``cache``, a new state of this one."""
    return variables_of(cache, self.batch_dims, indexed=self.indexed)


def held(get: Callable[[str], Any]) -> Held | None:
  """The cache whose variables ``get(name)`` returns (None for absent ones), or None when
  there is none."""
  if get(NAMES["key_pages"]) is not None:
    paged = decode.PagedKVCache(*(get(NAMES[f]) for f in decode.PagedKVCache._fields))
    return Held(paged, paged.lengths.shape, indexed=False)
  key = get(NAMES["key"])
  if key is None:
    return None
  batch_dims = tuple(key.shape[:-3])
  rows = math.prod(batch_dims)
  fields = {f: get(NAMES[f]) for f in decode.KVCache._fields}
  for f in _PER_ROW:
    if fields[f] is not None:
      fields[f] = fields[f].reshape((rows,) + fields[f].shape[len(batch_dims) :])
  index = get(INDEX)
  indexed = index is not None
  if indexed:
    fields["lengths"] = jnp.full((rows,), index, jnp.int32)
  elif fields["lengths"] is None:
    raise ValueError(
      f"a cache with {NAMES['key']} needs {INDEX} (one length for all rows) or "
      f"{NAMES['lengths']} (one per row); it has neither"
    )
  return Held(decode.KVCache(**fields), batch_dims, indexed)


def cache_accepts(cache: decode.Cache, dtype: jax.typing.DTypeLike) -> bool:
  """Whether keys of ``dtype`` can be written to ``cache``: its own dtype, or any floating
  dtype for a quantized cache."""
  storage = cache.dtype
  return dtype == storage or (quant.is_quantized(storage) and jnp.issubdtype(dtype, jnp.floating))


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


def release(found: Held | None, rows: jax.typing.ArrayLike, remedy: str) -> dict[str, jax.Array]:
  """:func:`jattn.decode.release` of a module's cache, which must exist and keep a length per
  row; the new variables. ``remedy`` says how to make such a cache."""
  if found is None:
    raise ValueError("there is no KV cache to release rows of: call init_cache first")
  if found.indexed:
    raise ValueError(
      f"releasing rows needs a cache with one length per row, but this one keeps Flax's one "
      f"{INDEX} for all rows: {remedy}"
    )
  return found.variables(decode.release(found.cache, rows))
