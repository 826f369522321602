"""A functional key/value cache for autoregressive decoding and chunked prefill.

Shape legend as in :mod:`jattn.attention`; here T is the number of new tokens
in one call (written ``t``) and the cache holds up to ``max_length`` key/value
positions per batch row.

A :class:`KVCache` is a pytree of fixed shape: the keys and values written so
far, ``(B, max_length, K, H)`` each, and ``lengths`` ``(B,)``, how many
positions of each row hold tokens. Every call returns a new cache (nothing is
mutated), so a jitted decode step takes the cache as an argument and is traced
once for all steps. Rows are ragged: each has its own length. A prompt batch
right-padded to ``t`` tokens is written with ``num_new`` = the prompt lengths;
the padding is not written and padded query rows return zeros.

:func:`attention` writes the ``t`` new keys and values, then lets query ``i``
of row ``b`` (absolute position ``lengths[b] + i``) attend to cache slots
``j <= lengths[b] + i``, with ``lengths`` taken before the write. So a
prefill, a prefill cut into chunks and one-token decode steps are the same
call and give the same outputs as causal attention over the whole sequence.

Slots past a row's length never reach the result: they are masked and read as
zeros, so garbage there (NaN included) cannot leak into outputs or gradients.

By default attention runs blockwise and reads the cache a key/value tile at a
time, visiting only the tiles some row has reached: a step costs what the rows
hold, not ``max_length``, and the cache is never copied. ``implementation="xla"``
(or ``backward="autodiff"``) instead materialises the scores over the whole
``max_length``, reading a zeroed copy of a contiguous cache.

Overflow: a row cannot hold more than ``max_length`` tokens. When the lengths
and ``num_new`` are concrete (eager calls), writing past ``max_length`` raises
ValueError. Under ``jax.jit`` they are traced and cannot be checked: tokens
past ``max_length`` are dropped and the lengths saturate at ``max_length``; the
dropped tokens' queries return zeros (and get zero gradients), like padded rows.
Check ``cache.lengths`` on the host between steps, or wrap the step with
``jax.experimental.checkify``, if a request may run that long.

Masks and score functions given to :func:`attention` see ``q_idx`` as the
index within the new chunk (0 .. t-1) and ``kv_idx`` as the cache slot, which
is the absolute position. Position-dependent ones (ALiBi, relative biases,
sliding windows) must shift the query index by the row's old length::

    lengths = cache.lengths
    shifted = lambda s, b, h, q, kv: alibi(s, b, h, q + lengths[b], kv)

Positional encodings of the new keys and queries are the caller's: use
:func:`positions` for their absolute positions (e.g. for RoPE).

Paged caches (:func:`init_paged`, a :class:`PagedKVCache`) hold the same rows in a
pool of fixed-size pages instead of one ``(B, max_length)`` slab: each row's page
table names its pages in order, :func:`update` and :func:`attention` take pages
from the pool as rows grow, and :func:`release` gives a finished row's pages back,
so requests of different lengths join and leave a running batch without copying.
Every function here takes either kind of cache, with the same semantics.
Attention over a paged cache runs blockwise, with a key/value tile of
``block_kv`` slots made of whole pages: a tile's pages are gathered only when the
schedule visits it, and tiles past every row's length are never visited, so a
step's work and memory grow with the pages in use, not with
``max_pages_per_seq``. A mask or bias array given to :func:`attention` may be sized
to a max_length that rounds up to the rows' pages (say 10 slots for rows of 3 pages
of 4): it is padded to the rows' length, the slots past it masked, so the same mask
fits a contiguous cache of that max_length and a paged one.

Running out of pages: when the lengths, ``num_new``, page table and pool are
concrete, a write that needs more pages than are free raises ValueError. Under
``jax.jit`` rows get pages in batch order, free pages in ascending order; a row
that finds the pool empty keeps the tokens its pages hold and drops the rest, its
length capped as at overflow; the dropped tokens' queries return zeros, like padded
rows. Check ``cache.free.sum()`` or ``cache.lengths`` on
the host between steps.

Quantized caches: ``dtype=jnp.int8`` or ``jnp.float8_e4m3fn`` in :func:`init` or
:func:`init_paged` stores keys and values quantized on write, with one float32
scale per (token, key/value head) (:mod:`jattn._quant`), and attention
dequantizes them tile by tile. Queries, keys and values are then any one floating
dtype, and the output has the query's. A quantized cache is for inference:
gradients reach the query, not the keys and values stored in it.

Sharding: under ``jax.set_mesh`` with Explicit axes, queries, keys and values sharded
over the batch and the heads (say ``P("data", None, "model", None)``) give outputs of
that sharding, and a contiguous cache takes the sharding of the keys and values written
into it (a cache placed with ``jax.device_put`` keeps its own): each device holds and
reads its own rows and heads, and a step moves nothing between devices. A paged cache's
pool is shared by every row, so its heads are sharded but its pages are not, and each
write gathers the new tokens over the batch.

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import decode
    >>> cache = decode.init(2, 16, 2, 8)  # B=2, max_length=16, K=2, H=8
    >>> q, kv = jnp.ones((2, 5, 4, 8)), jnp.ones((2, 5, 2, 8))  # N=4: GQA
    >>> out, cache = decode.attention(q, kv, kv, cache)  # prefill 5 tokens
    >>> out, cache = decode.attention(q[:, :1], kv[:, :1], kv[:, :1], cache)  # one step
    >>> cache.lengths
    Array([6, 6], dtype=int32)
    >>> paged = decode.init_paged(8, 4, 2, 4, 2, 8)  # 8 pages of 4 slots, 4 pages a row
    >>> out, paged = decode.attention(q, kv, kv, paged)  # 5 tokens: 2 pages a row
    >>> paged.page_table
    Array([[ 0,  1, -1, -1],
           [ 2,  3, -1, -1]], dtype=int32)
    >>> decode.release(paged, jnp.array([True, False])).free.sum()  # row 0's pages back
    Array(6, dtype=int32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _paging, _quant, _spec, masks
from jattn import attention as _attention
from jattn.attention import dot_product_attention
from jattn.impl import _common, _kv
from jattn.impl import blockwise as _blockwise


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
    key_pages: (num_pages, page_size, K, H).
    value_pages: (num_pages, page_size, K, Hv), same dtype as key_pages.
    page_table: (B, max_pages_per_seq) int32, page ids or -1.
    lengths: (B,) int32, the number of tokens written to each row.
    free: (num_pages,) bool, the pages no row holds.
    key_scale, value_scale: None, or float32 (num_pages, page_size, K) for a
      quantized cache, as in :class:`KVCache`.
  """

  key_pages: jax.Array
  value_pages: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  free: jax.Array
  key_scale: jax.Array | None = None
  value_scale: jax.Array | None = None

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
  key, value, key_scale, value_scale = _stores(
    (B, S), num_kv_heads, head_dim, value_head_dim, dtype
  )
  return KVCache(key, value, jnp.zeros((B,), jnp.int32), key_scale, value_scale)


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
) -> PagedKVCache:
  """An empty paged cache: ``num_pages`` pages of ``page_size`` slots, all free, and
  ``batch_size`` rows of up to ``max_pages_per_seq`` pages (max_length =
  max_pages_per_seq · page_size tokens), lengths 0.

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
  key, value, key_scale, value_scale = _stores(
    (P, ps), num_kv_heads, head_dim, value_head_dim, dtype
  )
  return PagedKVCache(
    key,
    value,
    jnp.full((B, M), -1, jnp.int32),
    jnp.zeros((B,), jnp.int32),
    jnp.ones((P,), bool),
    key_scale,
    value_scale,
  )


def _sizes(**sizes: int) -> tuple[int, ...]:
  """The given sizes, each checked to be an int >= 1 (errors name it)."""
  return tuple(_checks.integer(name, n, minimum=1) for name, n in sizes.items())


def _stores(lead: tuple[int, int], num_kv_heads, head_dim, value_head_dim, dtype):
  """Zero keys (*lead, K, H) and values (*lead, K, Hv) in the checked storage ``dtype``, and
  zero float32 scales (*lead, K) each when it is quantized (else None):
  ``(key, value, key_scale, value_scale)``."""
  K, H = _sizes(num_kv_heads=num_kv_heads, head_dim=head_dim)
  Hv = H if value_head_dim is None else _sizes(value_head_dim=value_head_dim)[0]
  dtype = _checks.storage_dtype("dtype", dtype)
  scales: tuple[Any, ...] = (None, None)
  if _quant.is_quantized(dtype):  # two arrays, not one shared: a step may donate the cache
    scales = tuple(jnp.zeros((*lead, K), _quant.SCALE_DTYPE) for _ in range(2))
  return (jnp.zeros((*lead, K, H), dtype), jnp.zeros((*lead, K, Hv), dtype), *scales)


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


def attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cache: Cache,
  *,
  num_new: jax.typing.ArrayLike | None = None,
  scale: float | None = None,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  score_fn: Callable | None = None,
  logits_soft_cap: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  implementation: str | None = None,
  backward: str | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  return_residual: bool = False,
  sinks: jax.typing.ArrayLike | None = None,
):
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
      module docstring).
    scale, score_fn, logits_soft_cap, dropout_rate, dropout_rng: as in
      :func:`jattn.dot_product_attention`, and so are broadcast_dropout,
      implementation, backward, block_q, block_kv, return_residual and
      sinks (per-head sink logits (N,)).
      ``score_fn`` sees ``q_idx`` within the chunk and ``kv_idx`` as the
      cache slot (see the module docstring).
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
    ``(out, new_cache)`` with out (B, t, N, Hv) in the query's dtype, or
    ``((out, lse), new_cache)`` with ``return_residual``, lse (B, t, N).
  """
  _check_cache(cache)
  key, value, num_new = _check_new(cache, key, value, num_new)
  query = _check_query(cache, query, key)
  allowed = masks.causal(cache.lengths)
  mask, bias, requested = _fit_to_pages(cache, mask, bias)
  if requested is not None:
    allowed = allowed & masks.lengths(kv_lengths=requested)
  if mask is not None:
    if not isinstance(mask, masks.Mask):
      mask = masks.from_array(mask)
    try:
      allowed = allowed & mask
    except ValueError as e:
      raise ValueError(f"mask: {e}") from None
  new_cache = _write(cache, key, value, num_new)
  options: dict[str, Any] = dict(
    scale=scale,
    query_seq_lengths=_kept(cache, new_cache, key.shape[1], num_new),
    implementation=implementation,
    return_residual=return_residual,
    score_fn=score_fn,
    logits_soft_cap=logits_soft_cap,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    broadcast_dropout=broadcast_dropout,
    backward=backward,
    block_q=block_q,
    block_kv=block_kv,
    sinks=sinks,
  )
  materialised = implementation not in (None, "blockwise") or backward == "autodiff"
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
      **options,
    )
    return out, new_cache
  return _over_tiles(query, new_cache, bias, allowed, options), new_cache


def _fit_to_pages(cache: Cache, mask, bias) -> tuple[Any, Any, int | None]:
  """``(mask, bias, requested)``: for a paged cache, a mask or bias array whose key axis is
  shorter than the rows but reaches into their last page (a max_length asked for, rounded
  up to whole pages as the Flax modules' ``init_cache`` does) padded to the rows' length,
  mask with False and bias with 0; ``requested`` is the shortest such key axis, past which
  slots are masked, or None when nothing was padded (then mask and bias are unchanged)."""
  if not isinstance(cache, PagedKVCache):
    return mask, bias, None
  S = cache.max_length
  lowest = max(S - cache.page_size + 1, 2)  # a key axis of 1 broadcasts

  def fit(name, x, pad_value):
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


def _kept(cache: Cache, new_cache: Cache, t: int, num_new) -> jax.Array | None:
  """(B,) how many of the t new tokens each row's cache took, the query rows that attend
  (the rest return zeros, like padding), or None when all t of every row were kept.

  Under jit a row may keep fewer than ``num_new`` (overflow past max_length, or a pool that
  ran out of pages); a query whose token was dropped would otherwise see the slots it
  should have been written to (unwritten, read as zeros) or, at overflow, the whole row."""
  kept = new_cache.lengths.astype(jnp.int32) - cache.lengths.astype(jnp.int32)
  if num_new is None and _checks.is_concrete(kept) and np.all(np.asarray(kept) == t):
    return None
  return kept


def _over_tiles(query, cache: Cache, bias, mask, options):
  """Blockwise attention reading the cache tile by tile (a CacheTiles source)."""
  kind = "paged" if isinstance(cache, PagedKVCache) else "quantized"
  if _quant.is_quantized(cache.dtype):
    kind = f"{kind} ({np.dtype(cache.dtype).name})" if kind == "quantized" else kind
  implementation = options["implementation"]
  if implementation not in (None, "blockwise"):
    raise ValueError(
      f"implementation={implementation!r} cannot read a {kind} cache: attention over one "
      "runs blockwise, reading it tile by tile (implementation=None or 'blockwise')"
    )
  if options["backward"] == "autodiff":
    raise ValueError(
      f"backward='autodiff' cannot read a {kind} cache: attention over one runs blockwise, "
      "reading it tile by tile, and has no autodiff rule (backward=None or 'custom_vjp')"
    )
  B, S, K, H, Hv = _dims(cache)
  block_kv = options["block_kv"]
  if isinstance(cache, PagedKVCache):
    ps = cache.page_size
    if block_kv is None:
      default = _blockwise.resolve_blocks(None, None)[1]
      block_kv = ps * max(1, default // ps)
    elif _checks.integer("block_kv", block_kv, minimum=1) % ps:
      raise ValueError(
        f"block_kv must be a multiple of the cache's page_size={ps} (a tile is whole "
        f"pages), got {block_kv}"
      )
  # Shapes only (zero-stride NumPy views): the spec is built and checked as for any call.
  shape_of = lambda h: np.broadcast_to(np.zeros((), query.dtype), (B, S, K, h))
  _, _, _, spec = _spec.build(
    query,
    shape_of(H),
    shape_of(Hv),
    bias,
    mask,
    **dict(options, implementation="blockwise", block_kv=block_kv),
  )
  stores = (cache.key_pages, cache.value_pages) if isinstance(cache, PagedKVCache) else cache[:2]
  # Explicit mode: the page table and lengths take the query's batch sharding, so that each
  # device gathers the pages of its own rows from the (unsharded) pool.
  rows = _common.sharding_spec(query)[:1]
  page_table = None
  if isinstance(cache, PagedKVCache):
    page_table = _common.reshard(cache.page_table, (*rows, None), mesh_of=query)
  tiles = _kv.CacheTiles(
    key=stores[0],
    value=stores[1],
    key_scale=cache.key_scale,
    value_scale=cache.value_scale,
    page_table=page_table,
    lengths=_common.reshard(cache.lengths, rows, mesh_of=query),
    dtype=np.dtype(query.dtype),
    block=min(spec.block_kv, S),  # as blockwise.plan caps it
  )
  out, lse = _attention._attend_cache(query, tiles, spec)
  return (out, lse) if spec.return_residual else out


def _dims(cache: Cache) -> tuple[int, int, int, int, int]:
  """(B, max_length, K, H, Hv) of a checked cache."""
  if isinstance(cache, KVCache):
    B, S, K, H = cache.key.shape
  else:
    B = cache.page_table.shape[0]
    S = cache.max_length
    _, _, K, H = cache.key_pages.shape
  return B, S, K, H, (cache.value if isinstance(cache, KVCache) else cache.value_pages).shape[3]


def _write(cache: Cache, key, value, num_new) -> Cache:
  """The scatter behind :func:`update`; arguments already checked."""
  B, t = key.shape[:2]
  S = cache.max_length
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = jnp.full((B,), t, jnp.int32) if num_new is None else jnp.clip(num_new, 0, t)
  lengths = cache.lengths.astype(jnp.int32)
  new_lengths = jnp.minimum(lengths + n.astype(jnp.int32), S)
  if isinstance(cache, PagedKVCache):
    table, free, capacity = _paging.allocate(
      cache.page_table, cache.free, new_lengths, cache.page_size
    )
    new_lengths = jnp.minimum(new_lengths, capacity)
  pos = lengths[:, None] + i  # (B, t)
  kept = pos < new_lengths[:, None]  # the first n[b] tokens, as far as the row has room
  stored: tuple[Any, Any] = (key, value)
  scales: tuple[Any, Any] = (None, None)
  if _quant.is_quantized(cache.dtype):
    # Gradients do not flow into a quantized cache (see the module docstring).
    (k_q, k_s), (v_q, v_s) = (
      _quant.quantize(jax.lax.stop_gradient(x), cache.dtype) for x in stored
    )
    stored, scales = (k_q, v_q), (k_s, v_s)

  if isinstance(cache, KVCache):
    # Row by row (a scatter batched over B): each row writes only its own slots, so a
    # batch sharded in Explicit mode stays sharded. A cache whose type names mesh axes
    # keeps them (the new tokens are resharded to it); one that names none (as init makes
    # it) takes the sharding of the keys and values written into it.
    slots = jnp.where(kept, pos, S)  # S and beyond are dropped by the scatter
    put_row = jax.vmap(lambda store, at, x: store.at[at].set(x, mode="drop"))

    def put_rows(store, x) -> Any:
      if x is None:
        return None
      store = jnp.asarray(store)
      src = store if any(_common.sharding_spec(store)) else x
      spec = _common.sharding_spec(src)
      spec = (spec[0], None, *spec[2:])  # slots are written along the sequence
      store, x, at = (
        _common.reshard(a, s, mesh_of=src)
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

  def put(store, x) -> Any:
    if x is None:
      return None
    # Every row writes into the one pool of pages, so the new tokens are gathered over a
    # batch sharded in Explicit mode; heads keep the pool's sharding, else take the keys'.
    store = jnp.asarray(store)
    src = store if _common.sharding_spec(store)[2] else x
    spec = (None, None, _common.sharding_spec(src)[2], *(None,) * (x.ndim - 3))
    store, x = (_common.reshard(a, spec, mesh_of=src) for a in (store, x))
    pages, slots = (_common.reshard(i, (None, None), mesh_of=src) for i in at)
    return store.at[pages, slots].set(x, mode="drop")

  return PagedKVCache(
    put(cache.key_pages, stored[0]),
    put(cache.value_pages, stored[1]),
    table,
    new_lengths.astype(cache.lengths.dtype),
    free,
    put(cache.key_scale, scales[0]),
    put(cache.value_scale, scales[1]),
  )


def _check_cache(cache) -> None:
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
    if x is None and name in ("key_scale", "value_scale"):
      continue
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"cache.{name} must be an array, got {type(x).__name__}")
  k, v = cache[0], cache[1]
  if paged:
    if k.ndim != 4:
      raise ValueError(f"{k_name} must have shape (num_pages, page_size, K, H), got {k.shape}")
  elif k.ndim != 4 or k.shape[1] < 1:
    raise ValueError(
      f"cache.key must have shape (B, max_length, K, H) with max_length >= 1, got {k.shape}"
    )
  if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"{k_name} and {v_name} must have the same shape but for the head dimension, got "
      f"{k.shape} and {v.shape}"
    )
  if v.dtype != k.dtype:
    raise TypeError(f"{k_name} and {v_name} must have the same dtype, got {k.dtype} and {v.dtype}")
  lengths = cache.lengths
  B = cache.page_table.shape[0] if isinstance(cache, PagedKVCache) else k.shape[0]
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
      f"cache.lengths must be an integer array of shape (B,)=({B},), "
      f"got {lengths.dtype}{lengths.shape}"
    )
  quantized = _quant.is_quantized(k.dtype)
  scale_shape = k.shape[:3]
  for name, x in (("cache.key_scale", cache.key_scale), ("cache.value_scale", cache.value_scale)):
    if quantized and (x is None or x.shape != scale_shape or x.dtype != _quant.SCALE_DTYPE):
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
  cache: Cache, key, value, num_new
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
  if _checks.is_concrete(cache.lengths) and (num_new is None or _checks.is_concrete(num_new)):
    lengths = np.asarray(cache.lengths)
    n = np.full((B,), t) if num_new is None else np.asarray(num_new)
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
  return key, value, num_new


def _check_dtype(cache: Cache, name: str, x) -> None:
  storage = cache.dtype
  if _quant.is_quantized(storage):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype (the cache quantizes it), got {x.dtype}")
  elif x.dtype != storage:
    raise TypeError(f"{name} must have the cache's dtype {storage}, got {x.dtype}")


def _check_query(cache: Cache, query, key):
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
