"""Attention over a cache: :func:`attention` writes the new tokens, then attends causally
over what each row holds, materialised (``implementation="xla"``, a float contiguous cache)
or blockwise, reading the cache tile by tile."""

from __future__ import annotations

import dataclasses
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _validate, masks, scores
from jattn._validate.keywords import Decoding, checked, options_of
from jattn._validate.options import Options
from jattn.attention import dot_product_attention, returned
from jattn.decode._cache import Cache, KVCache, PagedKVCache, _dims
from jattn.decode._validate import _check_cache, _check_new, _check_query
from jattn.decode._writes import _write
from jattn.impl import blockwise as _blockwise
from jattn.impl import common, contract, kv_tiles, quant, select
from jattn.impl.contract import CallSpec


def attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cache: Cache,
  *,
  num_new: jax.typing.ArrayLike | None = None,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  **keywords: Unpack[Decoding],
) -> tuple[jax.Array | tuple[jax.Array, jax.Array | None], Cache]:
  """Causal attention of t new tokens over the cache, after writing their keys and values.

  Query ``i`` of row ``b`` sits at position ``cache.lengths[b] + i`` and
  attends to cache slots ``j <= cache.lengths[b] + i``: its own token and
  everything before it. Prefill, chunked prefill and one-token decode steps
  are all this call.

  Args:
    query: (B, t, N, H), already position-encoded; N a multiple of K.
    key: (B, t, K, H), the new tokens' keys, already position-encoded.
    value: (B, t, K, Hv).
    cache: the :class:`KVCache` or :class:`PagedKVCache` before this call; query,
      key and value must have its B, K, H and dtype (any one floating dtype for
      a quantized cache).
    num_new: None or int array (B,): as in :func:`update`; query rows at or
      past ``num_new[b]`` are padding and return zeros, and so do the rows of
      tokens dropped under jit (overflow, or a pool out of pages; see the
      docstring of :mod:`jattn.decode`).
    **keywords: the keywords of :func:`jattn.dot_product_attention` but those of
      masking, which the cache sets (:class:`~jattn._validate.keywords.Decoding`:
      scale, score_fn, logits_soft_cap, sinks, dropout, return_residual and the
      implementation, backward, tiles or options), with the same meanings.
      ``score_fn`` sees ``q_idx`` within the chunk and ``kv_idx`` as the
      cache slot (see :mod:`jattn.decode`), unless ``absolute_positions=True``: then
      score functions and :class:`jattn.masks.Mask` objects see ``q_idx`` as the query's
      absolute position ``cache.lengths[b] + i``, as over the whole sequence (a mask
      array stays laid over the chunk's queries). The Flax modules decode so.
      ``"cudnn"`` is not available: the cache mask is an index mask. By
      default (and with ``"blockwise"``) attention runs blockwise and reads
      the cache tile by tile, visiting only tiles some row has reached, with
      no copy of the cache; ``implementation="xla"`` or
      ``backward="autodiff"`` materialise a float contiguous cache's keys and
      values instead. A paged or quantized cache is read tile by tile only
      (so ``backward="autodiff"``, which has no rule for that, is refused),
      and a paged cache's ``block_kv`` is a multiple of its page size.
    bias: float array broadcastable to (B, N, t, max_length), added to the logits.
    mask: a :class:`jattn.masks.Mask` or boolean array broadcastable to
      (B, N, t, max_length), combined with the causal cache mask by ``&``.
      Index-based masks see the same indices as ``score_fn``. With a paged cache, a
      mask or bias array may also be sized to fewer slots that reach into the rows'
      last page (the max_length asked for, before it was rounded up to whole
      pages): it is padded, and the slots past it are masked.

  Returns:
    ``(out, new_cache)`` with out (B, t, N, Hv) in the query's dtype; with
    ``return_residual`` and/or ``return_max_logit``, ``((out, lse), new_cache)``,
    ``((out, max_logit), new_cache)`` or ``((out, lse, max_logit), new_cache)``, lse and
    max_logit (B, t, N).
  """
  call = checked("attention", keywords, Decoding)
  _check_cache(cache)
  key, value, num_new = _check_new(cache, key, value, num_new)
  query = _check_query(cache, query, key)
  options = options_of(call)
  allowed = masks.causal(cache.lengths)
  mask, bias, requested = _fit_to_pages(cache, mask, bias)
  if requested is not None:
    allowed = allowed & masks.lengths(kv_lengths=requested)
  if _checks.boolean("absolute_positions", call.pop("absolute_positions", False)):
    at = cache.lengths.astype(jnp.int32)[:, None] + jnp.arange(key.shape[1], dtype=jnp.int32)[None]
    mask, call["score_fn"] = seen_at(mask, call.get("score_fn"), q=at)
  if mask is not None:
    if not isinstance(mask, masks.Mask):
      mask = masks.from_array(mask)
    try:
      allowed = allowed & mask
    except ValueError as e:
      raise ValueError(f"mask: {e}") from None
  new_cache = _write(cache, key, value, num_new)
  # The rows' kept tokens as query lengths: a Masking keyword the cache sets itself.
  call["query_seq_lengths"] = _kept(cache, new_cache, key.shape[1], num_new)
  materialised = not select.reads_cache(options.implementation, options.backward)
  if isinstance(new_cache, KVCache) and new_cache.key_scale is None and materialised:
    # Slots past a row's length hold whatever was there (uninitialised memory, a finished
    # request's tokens, NaN): the mask excludes them, but 0 · NaN is NaN in p·v and in the
    # gradients, so they are read as zeros.
    slots = jnp.arange(cache.max_length)[None, :]
    written = (slots < new_cache.lengths[:, None])[:, :, None, None]
    out = dot_product_attention(
      query,
      jnp.where(written, new_cache.key, 0),
      jnp.where(written, new_cache.value, 0),
      bias,
      allowed,
      options=options,
      **call,
    )
    return out, new_cache
  return over_tiles(query, new_cache, bias, allowed, options, call), new_cache


def seen_at(
  mask: jax.typing.ArrayLike | masks.Mask | None,
  score_fn: Any,
  *,
  batch: jax.typing.ArrayLike | None = None,
  q: jax.typing.ArrayLike,
) -> tuple[Any, Any]:
  """``(mask, score_fn)`` seen at other indices (``absolute_positions``): a
  :class:`jattn.masks.Mask` and a score function evaluated at query positions ``q`` (B, t)
  (and batch rows ``batch``, where the call's rows stand for others); a mask array, given
  as an array or ``masks.from_array``, stays laid over the call's own rows and queries."""
  if isinstance(mask, masks.Mask) and not isinstance(mask, masks.kinds.FromArray):
    mask = masks.reindex(mask, batch=batch, q=q)
  if score_fn is not None:
    score_fn = scores.reindex(score_fn, batch=batch, q=q)
  return mask, score_fn


def _fit_to_pages(
  cache: Cache,
  mask: jax.typing.ArrayLike | masks.Mask | None,
  bias: jax.typing.ArrayLike | None,
) -> tuple[Any, Any, int | None]:
  """``(mask, bias, requested)``: for a paged cache, a mask or bias array whose key axis is
  shorter than the rows but reaches into their last page (a max_length asked for, rounded
  up to whole pages as the Flax modules' ``init_cache`` does) padded to the rows' length,
  mask with False and bias with 0; ``requested`` is the shortest such key axis, past which
  slots are masked, or None when nothing was padded (then mask and bias are unchanged)."""
  if not isinstance(cache, PagedKVCache):
    return mask, bias, None
  S = cache.max_length
  lowest = max(S - cache.page_size + 1, 2)  # a key axis of 1 broadcasts

  def fit(name: str, x: Any, pad_value: bool | int) -> tuple[Any, int | None]:
    if x is None or (isinstance(x, masks.Mask) and not isinstance(x, masks.kinds.FromArray)):
      return x, None
    wrapped = isinstance(x, masks.kinds.FromArray)
    arr = x.array if wrapped else _checks.as_array(name, x)
    if arr.ndim == 0 or not lowest <= arr.shape[-1] < S:
      return x, None
    xp = np if isinstance(arr, np.ndarray) else jnp
    widths = [(0, 0)] * (arr.ndim - 1) + [(0, S - arr.shape[-1])]
    arr = xp.pad(arr, widths, constant_values=pad_value)
    return (masks.from_array(arr) if wrapped else arr), arr.shape[-1] - widths[-1][1]

  mask, mask_length = fit("mask", mask, False)
  bias, bias_length = fit("bias", bias, 0)
  lengths = [n for n in (mask_length, bias_length) if n is not None]
  return mask, bias, min(lengths) if lengths else None


def _kept(
  cache: Cache, new_cache: Cache, t: int, num_new: jax.typing.ArrayLike | None
) -> jax.Array | None:
  """(B,) how many of the t new tokens each row's cache took, the query rows that attend
  (the rest return zeros, like padding), or None when all t of every row were kept.

  Under jit a row may keep fewer than ``num_new`` (overflow past max_length, or a pool that
  ran out of pages); a query whose token was dropped would otherwise see the slots it
  should have been written to (unwritten, read as zeros) or, at overflow, the whole row."""
  kept = new_cache.lengths.astype(jnp.int32) - cache.lengths.astype(jnp.int32)
  if num_new is None and _checks.is_concrete(kept) and np.all(np.asarray(kept) == t):
    return None
  return kept


def over_tiles(
  query: jax.Array | np.ndarray,
  cache: Cache,
  bias: jax.typing.ArrayLike | None,
  mask: masks.Mask,
  options: Options,
  call: dict[str, Any],
  cache_rows: jax.Array | None = None,
) -> Any:  # the output, with the lse and max logit where asked for
  """Blockwise attention reading the cache tile by tile (a CacheTiles source), through the
  implementation the selection table names for it (its ``read_cache`` entry: blockwise's
  :func:`jattn.impl.blockwise.attention_over_cache`). ``cache_rows`` (B',), for a contiguous
  cache, names the cache row each of the query's B' rows reads, with ``cache.lengths``
  then given per query row (a paged cache's page table and lengths are so already)."""
  kind = "paged" if isinstance(cache, PagedKVCache) else "quantized"
  if quant.is_quantized(cache.dtype):
    kind = f"{kind} ({np.dtype(cache.dtype).name})" if kind == "quantized" else kind
  reader = select.cache_reader(options.implementation, options.backward, kind)
  B, S, K, H, Hv = _dims(cache)
  if cache_rows is not None:
    B = cache_rows.shape[0]
  if query.shape[2] == 0:  # no query heads: the empty output dot_product_attention gives
    t = query.shape[1]
    empty = jnp.zeros((B, t, 0), jnp.float32)
    return returned(
      jnp.zeros((B, t, 0, Hv), query.dtype),
      empty if call.get("return_residual") else None,
      empty if call.get("return_max_logit") else None,
    )
  block_kv = options.block_kv
  if isinstance(cache, PagedKVCache):
    ps = cache.page_size
    if block_kv is None:
      default = _blockwise.resolve_blocks(None, None)[1]
      block_kv = ps * max(1, default // ps)
    elif block_kv % ps:
      raise ValueError(
        f"block_kv must be a multiple of the cache's page_size={ps} (a tile is whole "
        f"pages), got {block_kv}"
      )
  # The keys and values are read from the cache: the spec is built from their shapes.
  shape_of = lambda h: jax.ShapeDtypeStruct((B, S, K, h), query.dtype)
  options = dataclasses.replace(options, implementation=reader.name, block_kv=block_kv)
  keywords = dict(call, options=options)
  _, _, _, spec = _validate.build(
    query, shape_of(H), shape_of(Hv), bias, mask, keywords, shapes_only=True
  )
  stores = cache[:2]
  interleaved = isinstance(cache, PagedKVCache) and cache.interleaved
  if interleaved:  # one pool, read for keys and for values: no copy is made
    stores = (cache[0], cache[0])
  # Explicit mode: the page table and lengths take the query's batch sharding, so that each
  # device gathers the pages of its own rows from the (unsharded) pool.
  rows = common.sharding_spec(query)[:1]
  page_table = None
  if isinstance(cache, PagedKVCache):
    page_table = common.reshard(cache.page_table, (*rows, None), mesh_of=query)
  tiles = kv_tiles.CacheTiles(
    key=stores[0],
    value=stores[1],
    key_scale=cache.key_scale,
    value_scale=cache.value_scale,
    page_table=page_table,
    lengths=common.reshard(cache.lengths, rows, mesh_of=query),
    dtype=np.dtype(query.dtype),
    block=min(spec.block_kv, S),  # as blockwise.plan caps it
    rows=cache_rows,
    interleaved=interleaved,
  )
  return returned(*_attend_cache(query, tiles, spec))


@jax.jit
def _attend_cache(
  query: jax.Array, tiles: kv_tiles.CacheTiles, spec: CallSpec
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """The jitted core over a KV cache: blockwise attention reading ``tiles`` one tile at a
  time, finished as :func:`jattn.dot_product_attention` finishes (sinks, dtypes, the lse and
  max logit where asked for)."""
  spec = contract.rank4(spec)
  read_cache = select.TABLE[spec.implementation].read_cache
  assert read_cache is not None, spec.implementation
  out, lse, top = read_cache(query, tiles, spec)
  return common.finish(out, lse, top, spec, query.dtype, False)
