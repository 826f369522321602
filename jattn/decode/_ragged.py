"""The ragged continuous-batching step: :func:`ragged_attention` appends each request's new
tokens, packed along one axis, to its cache row and attends causally over that row.

A serving step mixes prefill chunks of new requests with the one-token decode steps of
running ones (vLLM, JetStream, sglang-jax): ``cu_seqlens`` (R + 1,) says where request
``r``'s tokens sit in the packed batch, ``[cu_seqlens[r], cu_seqlens[r + 1])``, and request
``r`` is cache row ``r``. Nothing is padded to the longest request: the step's query rows
are *query tiles*, ``block_q`` tokens of one request each (a request's last tile may be
short), at most ``ceil(T / block_q) + R`` of them for any split of the T tokens, so one
compiled program serves every mix. Each tile reads its request's cache row tile by tile,
as :func:`jattn.decode.attention` reads rows, and a tile of a short request stops at that
request's length, so a step's work follows the tokens and the rows they read.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, masks, testing
from jattn._validate.keywords import Decoding, checked, options_of
from jattn.attention import dot_product_attention
from jattn.decode._attend import over_tiles, seen_at
from jattn.decode._cache import Cache, KVCache, PagedKVCache, _dims
from jattn.decode._validate import _check_cache, _check_dtype, _check_room
from jattn.decode._writes import _write_packed
from jattn.impl import flex_decode, quant, ragged_paged, select

__all__ = ["ragged_attention", "explain_ragged"]

DEFAULT_BLOCK_Q = 8
"""Tokens per query tile when ``block_q`` is not given: a decode token fills one slot of
its tile, so small tiles keep a decode-heavy step's work near its tokens'."""


def ragged_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cache: Cache,
  cu_seqlens: jax.typing.ArrayLike,
  *,
  mask: masks.Mask | None = None,
  **keywords: Unpack[Decoding],
) -> tuple[Any, Cache]:
  """One continuous-batching step: each request's new tokens, packed, are appended to its
  cache row, then attend causally over that row.

  Request ``r``'s tokens are ``[cu_seqlens[r], cu_seqlens[r + 1])`` of the packed axis and
  go to cache row ``r``: token ``i`` of them sits at position ``cache.lengths[r] + i`` and
  attends to the row's slots up to its own. A prefill, a prefill chunk and a decode token
  are the same thing here, so new and running requests share one call. Tokens past
  ``cu_seqlens[-1]`` are padding: zero output, nothing written. Rows past the R requests
  are left as they are.

  Args:
    query: (T, N, H), already position-encoded (see :func:`jattn.decode.positions`, or
      ``cache.lengths[r] + i`` per token); N a multiple of the cache's K.
    key: (T, K, H), the new tokens' keys; value: (T, K, Hv).
    cache: a :class:`KVCache` or :class:`PagedKVCache`, contiguous or paged, float or
      quantized, with at least R rows; dtypes as for :func:`jattn.decode.attention`.
    cu_seqlens: int (R + 1,): 0, then each request's end; nondecreasing, at most T. May be
      traced: one compile serves any split of the T tokens. Concrete offsets that do not
      fit (not from 0, decreasing, past T, more requests than cache rows) raise naming
      ``cu_seqlens``; a row that would overflow or a pool short of pages raise as
      :func:`jattn.decode.update` does (under jit, as there, the tokens that do not fit
      are dropped and their queries return zeros).
    mask: a :class:`jattn.masks.Mask`, combined with the causal cache mask by ``&``; it
      sees the batch index as the request's cache row and ``q_idx`` as the token's index
      within the request's new tokens, or its absolute position with
      ``absolute_positions=True`` (``kv_idx`` is the cache slot, the absolute position).
    **keywords: those of :func:`jattn.decode.attention`
      (:class:`~jattn._validate.keywords.Decoding`), with the same meanings; score
      functions see the indices masks see. ``block_q`` sets the tokens per query tile
      (default 8). The same implementations read the cache: by default blockwise, tile by
      tile; ``implementation="xla"`` materialises a float contiguous cache's rows, one
      copy per query tile. ``implementation="ragged_paged"`` runs the step as JAX's TPU
      ragged paged attention kernel (``jattn.impl.ragged_paged``; ``block_q`` its
      queries per block, ``block_kv`` the slots of its key/value blocks) over a paged cache
      in the interleaved layout with float storage; it takes a soft cap, the scale and a
      window Mask over absolute positions, and refuses the rest by name.
      ``implementation="flex_decode"`` runs it as jattn's split-KV GPU kernel
      (``jattn.impl.flex_decode``; ``block_kv`` the slots a split reads) over a paged cache
      of either layout, taking the same. Each an explicit opt-in until a run on its
      hardware is recorded.

  Returns:
    ``(out, new_cache)``, out (T, N, Hv) in the query's dtype; with ``return_residual``
    and/or ``return_max_logit``, ``((out, lse), new_cache)`` and so on, lse and max_logit
    (T, N), as :func:`jattn.decode.attention` returns them.
  """
  call, query, key, value, cu, absolute, blocks = _checked_step(
    "ragged_attention", query, key, value, cache, cu_seqlens, mask, keywords
  )
  B = _dims(cache)[0]
  T = query.shape[0]
  options = options_of(call)
  kernel = None
  if options.implementation in KERNELS:
    kernel = _kernel_step(options.implementation, cache, mask, absolute, blocks, call)
  block = min(blocks[0] or options.block_q or DEFAULT_BLOCK_Q, T)
  plan = _plan(jnp.asarray(cu, jnp.int32), B, T, block)
  new_cache = _write_packed(cache, key, value, plan.counts, plan.row, plan.local)
  if isinstance(kernel, ragged_paged.Step):
    return _run_kernel(query, cache, new_cache, jnp.asarray(cu, jnp.int32), plan, kernel), new_cache
  tiled = _Tiled(query, cache, new_cache, plan, block)
  return _attend_tiles(tiled, mask, absolute, options, call, kernel), new_cache


class _Step(NamedTuple):
  """A step's arguments as checked at the boundary: the keywords left for the attention
  call, the tokens, the offsets, ``absolute_positions`` and a named kernel's block sizes."""

  call: dict[str, Any]
  query: jax.Array | np.ndarray
  key: jax.Array | np.ndarray
  value: jax.Array | np.ndarray
  cu: jax.Array | np.ndarray
  absolute: bool
  blocks: tuple[int | None, int | None]


def _checked_step(
  name: str,
  query: Any,
  key: Any,
  value: Any,
  cache: Cache,
  cu_seqlens: Any,
  mask: Any,
  keywords: Any,
) -> _Step:
  """The checks :func:`ragged_attention` and :func:`explain_ragged` share (``name`` the
  caller's, for its keyword errors)."""
  call = checked(name, keywords, Decoding)
  _check_cache(cache)
  query, key, value = _check_tokens(cache, query, key, value)
  B = _dims(cache)[0]
  cu = _offsets(cu_seqlens, query.shape[0], B)
  if _checks.is_concrete(cu):
    counts = np.zeros(B, np.int64)
    counts[: cu.shape[0] - 1] = np.diff(np.asarray(cu))
    _check_room(cache, counts)
  if mask is not None and not isinstance(mask, masks.Mask):
    raise TypeError(
      "mask must be a jattn.masks.Mask (a function of positions: the packed tokens have no "
      f"(T, S) grid an array could cover), got {type(mask).__name__}"
    )
  absolute = _checks.boolean("absolute_positions", call.pop("absolute_positions", False))
  # The kernel's own block sizes (it is no tiled implementation of dot_product_attention).
  blocks = (None, None)
  if call.get("implementation") in KERNELS:
    blocks = (call.pop("block_q", None), call.pop("block_kv", None))
  return _Step(call, query, key, value, cu, absolute, blocks)


class _Tiled(NamedTuple):
  """A step written to its cache, about to attend as query tiles (see the module
  docstring): the packed query, the cache before and after the write, the plan."""

  query: Any
  cache: Cache
  new_cache: Cache
  plan: _Plan
  block: int


def _attend_tiles(
  tiled: _Tiled,
  mask: masks.Mask | None,
  absolute: bool,
  options: Any,
  call: dict[str, Any],
  kernel: Any,
) -> Any:
  """The step's query tiles over their rows (the GPU kernel's, the materialised path's or
  the table's cache reader), the results back on the packed tokens."""
  query, cache, new_cache, plan, block = tiled
  old = cache.lengths.astype(jnp.int32)
  new = new_cache.lengths.astype(jnp.int32)
  rows = plan.tile_row
  kept = (new - old)[rows]  # tokens of the tile's request the row took (under jit, maybe fewer)
  call["query_seq_lengths"] = jnp.where(
    plan.tile_live, jnp.clip(kept - plan.tile_start, 0, block), 0
  )
  first = old[rows] + plan.tile_start  # each tile's first token's absolute position
  allowed = masks.causal(first)
  at = (first if absolute else plan.tile_start)[:, None] + jnp.arange(block, dtype=jnp.int32)[None]
  mask, call["score_fn"] = seen_at(mask, call.get("score_fn"), batch=rows, q=at)
  if mask is not None:
    try:
      allowed = allowed & mask
    except ValueError as e:
      raise ValueError(f"mask: {e}") from None
  tiles_q = jnp.where(plan.slot_live[:, :, None, None], jnp.asarray(query)[plan.token], 0)
  lengths = jnp.where(plan.tile_live, new[rows], 0).astype(cache.lengths.dtype)
  if isinstance(kernel, flex_decode.Step):
    assert isinstance(new_cache, PagedKVCache)
    out = flex_decode.run(
      tiles_q,
      new_cache.key_pages,
      new_cache.value_pages,
      jnp.maximum(new_cache.page_table[rows], 0),
      lengths.astype(jnp.int32),
      first,
      call["query_seq_lengths"].astype(jnp.int32),
      kernel,
    )
    return _unpack(out, plan)
  materialised = not select.reads_cache(options.implementation, options.backward)
  if isinstance(new_cache, KVCache) and new_cache.key_scale is None and materialised:
    slots = jnp.arange(new_cache.max_length)[None, :]
    written = (slots < lengths[:, None])[:, :, None, None]
    out = dot_product_attention(
      tiles_q,
      jnp.where(written, new_cache.key[rows], 0),
      jnp.where(written, new_cache.value[rows], 0),
      None,
      allowed,
      options=options,
      **call,
    )
  elif isinstance(new_cache, KVCache):
    dense = new_cache._replace(lengths=lengths)
    out = over_tiles(tiles_q, dense, None, allowed, options, call, cache_rows=rows)
  else:
    paged = new_cache._replace(page_table=new_cache.page_table[rows], lengths=lengths)
    out = over_tiles(tiles_q, paged, None, allowed, options, call)
  results = out if isinstance(out, tuple) else (out,)
  back = tuple(_unpack(x, plan) for x in results)
  return back if isinstance(out, tuple) else back[0]


def explain_ragged(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cache: Cache,
  cu_seqlens: jax.typing.ArrayLike,
  *,
  mask: masks.Mask | None = None,
  backend: str | None = None,
  **keywords: Unpack[Decoding],
) -> select.Choice:
  """What :func:`ragged_attention` runs for these arguments, and why: the decode counterpart
  of :func:`jattn.explain`. ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``; default: JAX's)
  names where the step would run. Returns a :class:`jattn.Choice` whose ``rejected`` says,
  for each fused kernel of the step (``"ragged_paged"`` on TPU, ``"flex_decode"`` on GPU),
  why it is not the one: what it cannot take, its backend, or that it is an opt-in not yet
  run on its hardware. The arguments are checked as :func:`ragged_attention` checks them
  (a named kernel that cannot run the step raises); nothing is computed or written.

  Example::

    >>> import jax.numpy as jnp
    >>> from jattn import decode
    >>> cache = decode.init_paged(8, 16, 2, 4, 2, 128, kv_layout="interleaved")
    >>> q, kv = jnp.ones((8, 4, 128)), jnp.ones((8, 2, 128))
    >>> choice = decode.explain_ragged(q, kv, kv, cache, jnp.array([0, 5, 8]), backend="tpu")
    >>> choice.implementation, choice.rejected["ragged_paged"][:34]
    ('blockwise', 'verified by lowering for TPU and a')
  """
  call, *_, absolute, blocks = _checked_step(
    "explain_ragged", query, key, value, cache, cu_seqlens, mask, keywords
  )
  options = options_of(call)
  where = backend or testing.target_backend() or jax.default_backend()
  rejected = {}
  with testing.lowering_for(where):
    for name in KERNELS:
      try:
        _kernel_step(name, cache, mask, absolute, blocks, call)
      except ValueError as e:
        if name == options.implementation:
          raise
        rejected[name] = str(e).removeprefix(f"implementation={name!r} ")
        continue
      if name != options.implementation:
        rejected[name] = select.TABLE[name].opt_in or "not named"
  if options.implementation in KERNELS:
    return select.Choice(options.implementation, None, "named by the caller", rejected, where)
  reader = options.implementation or "blockwise"
  rule = options.backward or select.TABLE[reader].backwards[0]
  if select.reads_cache(options.implementation, options.backward):
    reason = "the table's cache reader: the step's query tiles read their rows tile by tile"
  else:
    reason = "materialised: each query tile's row copied whole (a float contiguous cache)"
  named_reason = "named by the caller; " if options.implementation else ""
  return select.Choice(reader, rule, named_reason + reason, rejected, where)


KERNELS = (ragged_paged.NAME, flex_decode.NAME)
"""The table's rows that run the step as one fused kernel (each an explicit opt-in)."""


def _kernel_step(
  name: str,
  cache: Cache,
  mask: masks.Mask | None,
  absolute: bool,
  blocks: tuple[int | None, int | None],
  call: dict[str, Any],
) -> Any:
  """The settings of kernel ``name`` (one of :data:`KERNELS`) for this step (``blocks``:
  the queries and key/value slots of its blocks, where given), or an error naming what the
  kernel cannot take."""
  row = select.TABLE[name]
  backend = testing.target_backend() or jax.default_backend()
  if backend not in row.runs_on and not testing.interpreting():
    where = row.runs_on[0].upper()
    raise ValueError(
      f"implementation={name!r} runs on {where}, and the backend is {backend!r} (to lower "
      f"for one from here, use jattn.testing.lowering_for({row.runs_on[0]!r}, "
      "device_kind=...))"
    )
  _, _, _, H, Hv = _dims(cache)
  window, bad_mask = None, False
  if isinstance(mask, masks.kinds.SlidingWindow):
    bad_mask = not absolute or mask.dilation != 1
    window = mask.left
  elif mask is not None:
    bad_mask = True
  # What neither kernel takes, by name: checked after each kernel's own properties.
  features = {
    "mask (but masks.sliding_window(w) with absolute_positions=True)": bad_mask,
    "score_fn (but logits_soft_cap)": call.get("score_fn") is not None,
    "sinks": call.get("sinks") is not None,
    "dropout_rate > 0": (call.get("dropout_rate") or 0) > 0,
    "return_residual": bool(call.get("return_residual")),
    "return_max_logit": bool(call.get("return_max_logit")),
  }
  paged = isinstance(cache, PagedKVCache)
  quantized = quant.is_quantized(cache.dtype)
  if name == ragged_paged.NAME:
    why = ragged_paged.refusal(
      interleaved=isinstance(cache, PagedKVCache) and cache.interleaved,
      quantized=quantized,
      head_dims=(H, Hv),
    )
  else:
    page_size = cache.page_size if isinstance(cache, PagedKVCache) else 0
    why = flex_decode.refusal(
      paged=paged, quantized=quantized, head_dims=(H, Hv), page_size=page_size
    )
  why = why or next((f"{f}: the kernel has none" for f, used in features.items() if used), None)
  if why is not None:
    raise ValueError(f"implementation={name!r} cannot run this step: {why}")
  assert isinstance(cache, PagedKVCache)
  scale = float(1 / np.sqrt(H) if call.get("scale") is None else call["scale"])
  cap = call.get("logits_soft_cap")
  cap = None if cap is None else float(cap)
  queries, per_block = (
    None if b is None else _checks.integer(n, b, minimum=1)
    for n, b in zip(("block_q", "block_kv"), blocks)
  )
  if per_block is not None and per_block % cache.page_size:
    raise ValueError(
      f"block_kv must be a multiple of the cache's page_size={cache.page_size} (the kernel "
      f"reads whole pages), got {per_block}"
    )
  pages = (
    ragged_paged.pages_per_block(cache.page_size, cache.max_pages_per_seq)
    if per_block is None
    else min(per_block // cache.page_size, cache.max_pages_per_seq)
  )
  if name == flex_decode.NAME:
    return flex_decode.Step(scale=scale, window=window, soft_cap=cap, pages_per_split=pages)
  return ragged_paged.Step(
    scale=scale,
    window=window,
    soft_cap=cap,
    queries_per_block=queries or 32,
    kv_pages_per_block=pages,
  )


def _run_kernel(
  query: Any, cache: Cache, new_cache: Cache, cu: jax.Array, plan: _Plan, step: Any
) -> jax.Array:
  """The step through the fused kernel: the tokens each row kept (all of them, unless a row
  ran out of room under jit) packed for it, the rows' lengths with them written, their
  pages; the output back on the step's tokens, zero where a token was not kept."""
  assert isinstance(new_cache, PagedKVCache)
  R, T = cu.shape[0] - 1, query.shape[0]
  kept = (new_cache.lengths.astype(jnp.int32) - cache.lengths.astype(jnp.int32))[:R]
  cu_kept = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(kept, dtype=jnp.int32)])
  slots = jnp.arange(T, dtype=jnp.int32)
  seq = _owner(cu_kept, slots)
  source = jnp.clip(cu[seq] + slots - cu_kept[seq], 0, T - 1)
  packed = jnp.where((slots < cu_kept[-1])[:, None, None], jnp.asarray(query)[source], 0)
  B = new_cache.lengths.shape[0]
  cu_rows = jnp.concatenate([cu_kept, jnp.full(B - R, cu_kept[-1], jnp.int32)])
  out = ragged_paged.run(
    packed,
    new_cache.key_pages,
    new_cache.lengths.astype(jnp.int32),
    jnp.maximum(new_cache.page_table, 0).astype(jnp.int32),
    cu_rows,
    jnp.array([R], jnp.int32),
    step,
  )
  r = jnp.clip(plan.row, 0, max(R - 1, 0))
  live = (plan.row >= 0) & (plan.local < kept[r])
  back = out[jnp.clip(cu_kept[r] + plan.local, 0, T - 1)]
  return jnp.where(live[:, None, None], back, jnp.zeros((), back.dtype))


def _check_tokens(
  cache: Cache, query: Any, key: Any, value: Any
) -> tuple[jax.Array | np.ndarray, ...]:
  """query (T, N, H), key (T, K, H), value (T, K, Hv) matching the cache and each other."""
  q, k, v = (_checks.as_array(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
  _, _, K, H, Hv = _dims(cache)
  for name, x, want in (
    ("query", q, "N, H"),
    ("key", k, f"K={K}, H={H}"),
    ("value", v, f"K={K}, Hv={Hv}"),
  ):
    if x.ndim != 3:
      raise ValueError(
        f"{name} must have shape (T, {want}), the step's tokens packed, got {x.shape}"
      )
  if k.shape[1:] != (K, H) or v.shape[1:] != (K, Hv) or v.shape[0] != k.shape[0]:
    raise ValueError(
      f"key and value must have shapes (T, K, H)=(T, {K}, {H}) and (T, K, Hv)=(T, {K}, {Hv}) "
      f"to match the cache, got key {k.shape} and value {v.shape}"
    )
  if q.shape[0] != k.shape[0] or q.shape[2] != H:
    raise ValueError(
      f"query must have shape (T, N, H)=({k.shape[0]}, N, {H}) to match key, got {q.shape}"
    )
  if q.shape[0] < 1:
    raise ValueError(f"query, key and value must hold T >= 1 tokens, got query {q.shape}")
  if q.shape[1] % K:
    raise ValueError(
      f"the number of query heads N ({q.shape[1]}) must be a multiple of the cache's number "
      f"of key/value heads K ({K})"
    )
  _check_dtype(cache, "key", k)
  for name, x in (("value", v), ("query", q)):
    if x.dtype != k.dtype:
      raise TypeError(f"{name} must have key's dtype {k.dtype}, got {x.dtype}")
  return q, k, v


def _offsets(cu_seqlens: Any, T: int, B: int) -> jax.Array | np.ndarray:
  """``cu_seqlens`` checked (:func:`jattn._checks.offsets`): int (R + 1,) with R <= B; where
  concrete, from 0, nondecreasing, at most T. Traced offsets are clipped to [0, T]."""
  most = (B + 1, f" for R <= B={B} requests (one per cache row)")
  cu = _checks.offsets(
    "cu_seqlens", cu_seqlens, f"T={T} tokens given", T, count="R", unit="request", most=most
  )
  return cu if _checks.is_concrete(cu) else jnp.clip(cu, 0, T)


class _Plan(NamedTuple):
  """Where each packed token goes and which query tile holds it (see the module docstring).
  Tokens: ``row`` (T,) its request (cache row), -1 for padding; ``local`` (T,) its index
  among the request's new tokens; ``tile``, ``slot`` (T,) where it sits among the query
  tiles. Tiles: ``tile_row`` (n,) the request each reads; ``tile_start`` (n,) its first
  token's index among the request's; ``tile_live`` (n,) whether it holds any; ``token``
  (n, block) the packed index of each slot, ``slot_live`` whether the slot holds one.
  ``counts`` (B,): the new tokens of each cache row."""

  row: jax.Array
  local: jax.Array
  tile: jax.Array
  slot: jax.Array
  tile_row: jax.Array
  tile_start: jax.Array
  tile_live: jax.Array
  token: jax.Array
  slot_live: jax.Array
  counts: jax.Array


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _plan(cu: jax.Array, B: int, T: int, block: int) -> _Plan:
  R = cu.shape[0] - 1
  n = jnp.maximum(jnp.diff(cu), 0)
  counts = jnp.zeros(B, jnp.int32).at[:R].set(n)
  # Every tile holds a token: at most T of them, and at most ceil(T / block) + R.
  num_tiles = max(1, min(math.ceil(T / block) + R, T))
  per = -(-n // block)
  first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per, dtype=jnp.int32)])
  v = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_row = _owner(first, v)
  tile_live = v < first[-1]
  tile_start = (v - first[tile_row]) * block
  i = jnp.arange(block, dtype=jnp.int32)[None, :]
  within = tile_start[:, None] + i
  slot_live = tile_live[:, None] & (within < n[tile_row][:, None]) if R else (within < 0)
  token = jnp.clip(cu[tile_row][:, None] + within, 0, T - 1)
  tokens = jnp.arange(T, dtype=jnp.int32)
  seq = _owner(cu, tokens)
  row = jnp.where(tokens < cu[-1], seq, -1).astype(jnp.int32)
  local = tokens - cu[seq]
  tile = first[seq] + local // block
  return _Plan(
    row, local, tile, local % block, tile_row, tile_start, tile_live, token, slot_live, counts
  )


def _owner(offsets: jax.Array, at: jax.Array) -> jax.Array:
  """For each index of ``at``, the request whose span of ``offsets`` (R + 1,) holds it,
  clamped to [0, R - 1] (0 past the last span, or with no request)."""
  R = offsets.shape[0] - 1
  return jnp.clip(jnp.searchsorted(offsets, at, side="right") - 1, 0, max(R - 1, 0))


def _unpack(x: jax.Array, plan: _Plan) -> jax.Array:
  """A per-tile result (n, block, ...) back on the packed tokens (T, ...), zero on padding."""
  got = x[jnp.clip(plan.tile, 0, x.shape[0] - 1), plan.slot]
  live = (plan.row >= 0).reshape((-1,) + (1,) * (got.ndim - 1))
  return jnp.where(live, got, jnp.zeros((), got.dtype))
