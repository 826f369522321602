"""Masks written as functions of indices.

A :class:`Mask` says which query position may attend to which key/value
position: a function of broadcastable int arrays ``(batch, head, q_idx,
kv_idx)`` that returns booleans, True meaning "may attend" (as in
``jax.nn.dot_product_attention``). It is FlexAttention's ``mask_mod`` and
splash attention's mask classes in JAX. Masks combine with ``&``, ``|`` and
``~``, materialise to a dense boolean array, and classify (query tile,
key/value tile) pairs as EMPTY, PARTIAL or FULL so tiled implementations can
skip empty tiles and skip mask arithmetic on full ones.

Shape legend (shared with :mod:`jattn.attention`): B batch, N query heads,
T query length, S key/value length.

A mask is a pytree: the arrays it holds (segment ids, lengths, a dense array)
are its leaves, and its kind and settings are static, so masks can be passed
through ``jax.jit`` and ``jax.vmap`` and rebuilding an equal mask does not
recompile.

Example::

    >>> from jattn import masks
    >>> m = masks.causal() & masks.sliding_window(2, 0)
    >>> m.materialize(4, 4)[0, 0].astype(int)
    Array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1]], dtype=int32)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn._tree import Node

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by :meth:`Mask.block_view`."""

Extents = tuple  # (B, N, T, S), each an int or None when the mask does not fix it.


class _Rule(NamedTuple):
  """What one kind of mask node computes. All functions take (params, children, ...)."""

  name: str
  evaluate: Callable[..., jax.Array]  # (..., b, h, q, kv) -> bool, broadcast of the indices
  bounds: Callable[..., tuple]  # (..., tiles) -> (any_allowed, all_allowed) per tile
  extents: Callable[..., Extents]  # (...) -> (B, N, T, S) fixed by the mask's arrays
  describe: Callable[..., str]
  dense: Callable[..., jax.Array] | None = None  # (..., grid) -> bool; faster than evaluate


class _Tiles(NamedTuple):
  """Inclusive index bounds of every query tile (axis 2) and key/value tile (axis 3)."""

  q_lo: jax.Array  # (1, 1, nq, 1)
  q_hi: jax.Array
  kv_lo: jax.Array  # (1, 1, 1, nk)
  kv_hi: jax.Array
  block_q: int
  block_kv: int
  q_len: int
  kv_len: int
  # Tile i covers exactly positions [i * block_q, min((i + 1) * block_q, q_len)) (and the same
  # for kv). False inside reindex(): lo/hi are then hulls of mapped positions, and rules that
  # reduce arrays tile by tile must answer conservatively.
  aligned: bool = True


_UNSURE = (np.ones((1, 1, 1, 1), bool), np.zeros((1, 1, 1, 1), bool))
"""(any_allowed, all_allowed) that says PARTIAL for every tile: always safe."""


def index_grid(batch_size: int, num_heads: int, q_len: int, kv_len: int):
  """The index arrays masks and score functions receive on a full (B, N, T, S) grid.

  Returns ``(batch, head, q_idx, kv_idx)``: int32 arrays of shapes (B,1,1,1),
  (1,N,1,1), (1,1,T,1) and (1,1,1,S) that broadcast to (B, N, T, S).
  """
  batch_size, num_heads, q_len, kv_len = (
    _checks.integer(name, n, minimum=0)
    for name, n in (
      ("batch_size", batch_size),
      ("num_heads", num_heads),
      ("q_len", q_len),
      ("kv_len", kv_len),
    )
  )
  return tuple(
    _index_array(np.arange(n), axis)
    for axis, n in enumerate((batch_size, num_heads, q_len, kv_len))
  )


def _index_array(positions: np.ndarray, axis: int) -> jax.Array:
  """``positions`` as an int32 jax array along ``axis`` of a rank-4 grid.

  Built in NumPy and transferred: concrete even under jit (see _take), and no
  XLA program is compiled for it, so argument checks that evaluate masks on
  index grids compile nothing.
  """
  shape = [1, 1, 1, 1]
  shape[axis] = -1
  with jax.ensure_compile_time_eval():
    return jax.device_put(np.asarray(positions, np.int32).reshape(shape))


def _merge_extents(a: Extents, b: Extents, what: str) -> Extents:
  names = ("batch size", "number of heads", "query length", "key/value length")
  merged = []
  for name, x, y in zip(names, a, b):
    if x is not None and y is not None and x != y:
      raise ValueError(f"cannot combine masks with different {name} in {what}: {x} and {y}")
    merged.append(x if x is not None else y)
  return tuple(merged)


def _fixed(n: int) -> int | None:
  """A dimension of size 1 broadcasts, so it fixes nothing."""
  return None if n == 1 else n


def _array_extents(shape) -> Extents:
  """(B, N, T, S) fixed by an array broadcast to rank 4 (leading size-1 dims added)."""
  return tuple(_fixed(n) for n in (1,) * (4 - len(shape)) + tuple(shape))


# Constructors keep arrays as given and reshape where they are used, inside
# traced code: building a mask runs no computation, so a call with bad
# arguments fails before anything is compiled.


def _as_rank(arr, rank: int) -> jax.Array:
  """``arr`` with leading size-1 dimensions added up to ``rank``."""
  arr = jnp.asarray(arr)
  return arr.reshape((1,) * (rank - arr.ndim) + arr.shape)


def _at_batch(arr, b) -> jax.Array:
  """``arr[b]`` for per-batch values given as a scalar or (Bm,); Bm == 1 broadcasts."""
  arr = jnp.asarray(arr).reshape(-1)
  return arr[b] if arr.shape[0] > 1 else arr[0]


def _take(arr, b, idx) -> jax.Array:
  """``arr[b, idx]`` for ids given as (Bm, L) or (L,), clamping out-of-range positions."""
  arr = _as_rank(arr, 2)
  if arr.shape[0] == 1:
    return arr[0].at[idx].get(mode="clip")
  if _is_iota(b, arr.shape[0]) and sum(n > 1 for n in jnp.shape(idx)) <= 1:
    # Every batch row with one index vector: a take along the sequence axis
    # keeps the batch axis a plain array axis, which sharding propagation
    # splits across devices (a gather by (b, idx) makes it gather the ids).
    rows = jnp.take(arr, jnp.ravel(idx), axis=1, mode="clip")
    shape = [arr.shape[0] if n == 0 else 1 for n in range(jnp.ndim(idx))]
    shape[next((i for i, n in enumerate(jnp.shape(idx)) if n > 1), len(shape) - 1)] = -1
    return rows.reshape(shape)
  return arr.at[b, idx].get(mode="clip")


def _is_iota(b, n: int) -> bool:
  """Whether ``b`` is the concrete batch index ``arange(n)`` along its first axis."""
  shape = jnp.shape(b)
  if not shape or shape[0] != n or any(d != 1 for d in shape[1:]):
    return False
  if not _checks.is_concrete(b):
    return False
  return bool(np.array_equal(np.ravel(np.asarray(b)), np.arange(n)))


def _batch_size(arr, rank: int) -> int | None:
  """The batch size fixed by an array whose batched form has ``rank`` dims (None: broadcasts)."""
  shape = jnp.shape(arr)
  return _fixed(shape[0]) if len(shape) == rank else None


def _shared_batch(arrays, rank: int, names: str) -> int | None:
  """The one batch size per-batch ``arrays`` (None entries skipped) fix; they must agree."""
  sizes = {n for a in arrays if a is not None if (n := _batch_size(a, rank)) is not None}
  if len(sizes) > 1:
    raise ValueError(f"{names} must have the same batch size, got {sorted(sizes)}")
  return sizes.pop() if sizes else None


def _tile_reduce(x: jax.Array, axis: int, block: int, length: int, fill, reducer) -> jax.Array:
  """Reduce ``x`` over tiles of ``block`` along ``axis``; size-1 axes stay size 1."""
  if x.shape[axis] == 1:
    return x
  n_tiles = -(-length // block)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n_tiles * block - length)
  if isinstance(fill, str):
    x = jnp.pad(x, pad, mode=fill)
  else:
    x = jnp.pad(x, pad, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (n_tiles, block) + x.shape[axis + 1 :])
  return reducer(x, axis=axis + 1)


def _tile_any_all(dense: jax.Array, block_q: int, block_kv: int, q_len: int, kv_len: int):
  """Per tile of a dense (Bm, Nm, T, S) bool array (T, S may be 1): whether any, all are True."""
  any_, all_ = dense, dense
  for axis, block, length in ((2, block_q, q_len), (3, block_kv, kv_len)):
    any_ = _tile_reduce(any_, axis, block, length, False, jnp.any)
    all_ = _tile_reduce(all_, axis, block, length, True, jnp.all)
  return any_, all_


def _describe_plain(name: str, keys: tuple[str, ...]):
  def describe(params, children):
    args = ", ".join(f"{k}={v!r}" for k, v in zip(keys, params))
    return f"{name}({args})"

  return describe


def _no_extents(params, children) -> Extents:
  return (None, None, None, None)


def _batch_index(arr) -> jax.Array:
  """Per-batch values shaped (Bm, 1, 1, 1) to broadcast against tiles."""
  return jnp.asarray(arr).reshape(-1, 1, 1, 1)


def _batch_extents(params, children) -> Extents:
  return (_shared_batch(children, 1, "per-batch values"), None, None, None)


def _shape_str(arr) -> str:
  return "shape=" + str(tuple(jnp.shape(arr)))


# --- causal ---------------------------------------------------------------


def _causal_eval(params, children, b, h, q, kv):
  (offset,) = params
  return kv - q <= offset  # not kv <= q + offset, which overflows int32 for large offsets


def _causal_bounds(params, children, t: _Tiles):
  (offset,) = params
  return t.kv_lo - t.q_hi <= offset, t.kv_hi - t.q_lo <= offset


_CAUSAL = _Rule(
  "causal", _causal_eval, _causal_bounds, _no_extents, _describe_plain("causal", ("offset",))
)


def _causal_batch_eval(params, children, b, h, q, kv):
  (offset,) = children
  return kv - q <= _at_batch(offset, b)


def _causal_batch_bounds(params, children, t: _Tiles):
  off = _batch_index(children[0])
  return t.kv_lo - t.q_hi <= off, t.kv_hi - t.q_lo <= off


_CAUSAL_PER_BATCH = _Rule(
  "causal",
  _causal_batch_eval,
  _causal_batch_bounds,
  _batch_extents,
  lambda params, children: f"causal(offset {_shape_str(children[0])})",
)


def causal(offset: int | jax.typing.ArrayLike = 0) -> Mask:
  """Query ``q`` of batch row ``b`` may attend to ``kv <= q + offset[b]``.

  ``offset=0`` is ``is_causal=True`` of ``jax.nn.dot_product_attention``
  (top-left aligned). For T new queries appended after S - T cached keys, use
  ``offset=S - T`` (bottom-right aligned, chunked prefill and decoding).

  ``offset`` is a Python or NumPy int (a static setting, one per compiled
  program) or an int array of shape () or (B,), possibly traced, for
  per-row offsets such as the lengths of a ragged KV cache. Negative offsets
  are allowed in both forms: the first ``-offset`` queries then see nothing.

  Example::

      >>> masks.causal(np.array([0, 2])).materialize(2, 3)[:, 0].astype(int)
      Array([[[1, 0, 0],
              [1, 1, 0]],
      <BLANKLINE>
             [[1, 1, 1],
              [1, 1, 1]]], dtype=int32)
  """
  if isinstance(offset, numbers.Integral) and not isinstance(offset, (bool, np.bool_)):
    return Mask(_CAUSAL, (_checks.integer("offset", offset, int32=True),))
  if isinstance(offset, (bool, np.bool_, float)):
    raise TypeError(
      f"offset must be an int, got {offset!r} of type {type(offset).__name__}; "
      "per-row offsets are an integer array of shape () or (B,)"
    )
  return Mask(_CAUSAL_PER_BATCH, (), (_checks.int_array("offset", offset, ranks=(0, 1)),))


# --- sliding window ---------------------------------------------------------


def _window_eval(params, children, b, h, q, kv):
  left, right = params
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q), jnp.shape(kv)), bool)
  if left is not None:  # kv - q, not q +- width: stays in int32 for any int32 width
    ok = ok & (kv - q >= -left)
  if right is not None:
    ok = ok & (kv - q <= right)
  return ok


def _window_bounds(params, children, t: _Tiles):
  left, right = params
  d_lo, d_hi = t.kv_lo - t.q_hi, t.kv_hi - t.q_lo  # range of kv - q inside the tile
  any_ = all_ = jnp.ones(jnp.broadcast_shapes(d_lo.shape, d_hi.shape), bool)
  if left is not None:
    any_, all_ = any_ & (d_hi >= -left), all_ & (d_lo >= -left)
  if right is not None:
    any_, all_ = any_ & (d_lo <= right), all_ & (d_hi <= right)
  return any_, all_


_WINDOW = _Rule(
  "sliding_window",
  _window_eval,
  _window_bounds,
  _no_extents,
  _describe_plain("sliding_window", ("left", "right")),
)


def _dilated_eval(params, children, b, h, q, kv):
  left, right, dilation = params
  return _window_eval((left, right), children, b, h, q, kv) & ((kv - q) % dilation == 0)


def _dilated_bounds(params, children, t: _Tiles):
  # Every kv - q in [d_lo, d_hi] occurs in a rectangular tile, so a tile holds an
  # allowed pair exactly when a multiple of the dilation lies in that range cut
  # to the window: both classes are exact.
  left, right, dilation = params
  d_lo, d_hi = t.kv_lo - t.q_hi, t.kv_hi - t.q_lo
  lo = d_lo if left is None else jnp.maximum(d_lo, -left)
  hi = d_hi if right is None else jnp.minimum(d_hi, right)
  any_ = (lo <= hi) & ((hi // dilation) * dilation >= lo)
  _, inside = _window_bounds((left, right), children, t)
  return any_, inside & (d_lo == d_hi) & (d_lo % dilation == 0)


_DILATED = _Rule(
  "sliding_window",
  _dilated_eval,
  _dilated_bounds,
  _no_extents,
  _describe_plain("sliding_window", ("left", "right", "dilation")),
)


def sliding_window(left: int | None, right: int | None = 0, *, dilation: int = 1) -> Mask:
  """Query ``q`` may attend to ``q - left <= kv <= q + right``; None is unbounded.

  ``sliding_window(l, r)`` is ``local_window_size=(l, r)`` of jax.nn. With
  ``dilation=d`` only every d-th of those positions is kept, ``(kv - q) % d
  == 0`` (Longformer's dilated window: ``left = d · w`` reaches w positions
  back). Tile classes are exact, so blockwise attention visits only tiles
  that hold an allowed pair.
  """
  params = tuple(
    None if w is None else _checks.integer(name, w, minimum=0, int32=True)
    for name, w in (("left", left), ("right", right))
  )
  dilation = _checks.integer("dilation", dilation, minimum=1, int32=True)
  if dilation == 1:
    return Mask(_WINDOW, params)
  return Mask(_DILATED, params + (dilation,))


# --- chunked ---------------------------------------------------------------


def _chunked_eval(params, children, b, h, q, kv):
  (size,) = params
  return q // size == kv // size


def _chunked_bounds(params, children, t: _Tiles):
  (size,) = params
  q0, q1, k0, k1 = t.q_lo // size, t.q_hi // size, t.kv_lo // size, t.kv_hi // size
  return (q0 <= k1) & (k0 <= q1), (q0 == q1) & (k0 == k1) & (q0 == k0)


_CHUNKED = _Rule(
  "chunked", _chunked_eval, _chunked_bounds, _no_extents, _describe_plain("chunked", ("size",))
)


def chunked(size: int) -> Mask:
  """Positions attend within their chunk: ``q // size == kv // size`` (local blocks)."""
  return Mask(_CHUNKED, (_checks.integer("size", size, minimum=1, int32=True),))


# --- prefix LM -------------------------------------------------------------


def _prefix_eval(params, children, b, h, q, kv):
  (prefix,) = children
  return (kv < _at_batch(prefix, b)) | (kv <= q)


def _prefix_bounds(params, children, t: _Tiles):
  (prefix,) = children
  p = _batch_index(prefix)
  return (t.kv_lo < p) | (t.kv_lo <= t.q_hi), (t.kv_hi < p) | (t.kv_hi <= t.q_lo)


_PREFIX = _Rule(
  "prefix_lm",
  _prefix_eval,
  _prefix_bounds,
  _batch_extents,
  lambda params, children: f"prefix_lm(prefix_lengths={_shape_str(children[0])})",
)


def _per_batch(name: str, value: Any):
  return _checks.int_array(name, value, ranks=(0, 1), nonnegative=True)


def prefix_lm(prefix_lengths) -> Mask:
  """Prefix-LM: bidirectional inside the first ``prefix_lengths[b]`` positions, causal after.

  Query ``q`` may attend to ``kv < prefix_lengths[b]`` or ``kv <= q``.
  ``prefix_lengths`` is an int or an int array of shape (B,).
  """
  return Mask(_PREFIX, (), (_per_batch("prefix_lengths", prefix_lengths),))


# --- segments (document masking) ---------------------------------------------


def _segments_eval(params, children, b, h, q, kv):
  q_ids, kv_ids = children
  return _take(q_ids, b, q) == _take(kv_ids, b, kv)


def _segments_bounds(params, children, t: _Tiles):
  if not t.aligned:
    return _UNSURE
  q_ids, kv_ids = (_as_rank(c, 2) for c in children)
  # Edge padding repeats the last id, so it adds no new id to the last tile.
  q_min = _tile_reduce(q_ids, 1, t.block_q, t.q_len, "edge", jnp.min)[:, None, :, None]
  q_max = _tile_reduce(q_ids, 1, t.block_q, t.q_len, "edge", jnp.max)[:, None, :, None]
  kv_min = _tile_reduce(kv_ids, 1, t.block_kv, t.kv_len, "edge", jnp.min)[:, None, None, :]
  kv_max = _tile_reduce(kv_ids, 1, t.block_kv, t.kv_len, "edge", jnp.max)[:, None, None, :]
  any_ = (q_min <= kv_max) & (kv_min <= q_max)
  all_ = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
  return any_, all_


def _segments_extents(params, children) -> Extents:
  q_ids, kv_ids = children
  return (
    _shared_batch(children, 2, "segment ids"),
    None,
    jnp.shape(q_ids)[-1],
    jnp.shape(kv_ids)[-1],
  )


_SEGMENTS = _Rule(
  "segments",
  _segments_eval,
  _segments_bounds,
  _segments_extents,
  lambda params, children: (
    f"segments(q_segment_ids {_shape_str(children[0])}, kv_segment_ids {_shape_str(children[1])})"
  ),
)


def segments(q_segment_ids, kv_segment_ids=None) -> Mask:
  """Document masking for packed sequences: attend only within the same segment id.

  Args:
    q_segment_ids: int array (B, T) or (T,).
    kv_segment_ids: int array (B, S) or (S,); defaults to ``q_segment_ids``
      (self-attention).

  Tile classification compares each tile's smallest and largest id. It is
  exact when the ids are sorted along the sequence and either consecutive
  integers or the same array for queries and keys, as for packed documents;
  otherwise it may say PARTIAL for a tile that is empty.
  """
  q_ids = _checks.int_array("q_segment_ids", q_segment_ids, ranks=(1, 2))
  kv_ids = (
    q_ids
    if kv_segment_ids is None
    else _checks.int_array("kv_segment_ids", kv_segment_ids, ranks=(1, 2))
  )
  _shared_batch((q_ids, kv_ids), 2, "q_segment_ids and kv_segment_ids")
  return Mask(_SEGMENTS, (), (q_ids, kv_ids))


# --- sequence lengths (padding) ---------------------------------------------


def _lengths_eval(params, children, b, h, q, kv):
  q_lens, kv_lens = children
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q), jnp.shape(kv)), bool)
  if q_lens is not None:
    ok = ok & (q < _at_batch(q_lens, b))
  if kv_lens is not None:
    ok = ok & (kv < _at_batch(kv_lens, b))
  return ok


def _lengths_bounds(params, children, t: _Tiles):
  q_lens, kv_lens = children
  any_ = all_ = jnp.ones((1, 1, 1, 1), bool)
  if q_lens is not None:
    n = _batch_index(q_lens)
    any_, all_ = any_ & (t.q_lo < n), all_ & (t.q_hi < n)
  if kv_lens is not None:
    n = _batch_index(kv_lens)
    any_, all_ = any_ & (t.kv_lo < n), all_ & (t.kv_hi < n)
  return any_, all_


def _describe_lengths(params, children):
  q_lens, kv_lens = children
  parts = [
    f"{name} {_shape_str(x)}"
    for name, x in (("q_lengths", q_lens), ("kv_lengths", kv_lens))
    if x is not None
  ]
  return f"lengths({', '.join(parts)})"


_LENGTHS = _Rule("lengths", _lengths_eval, _lengths_bounds, _batch_extents, _describe_lengths)


def lengths(q_lengths=None, kv_lengths=None) -> Mask:
  """Padding: query ``q`` and key ``kv`` take part only below their row's length.

  ``q_lengths`` and ``kv_lengths`` are ints or int arrays of shape (B,). A
  padded query row may attend to nothing, so its output is zeros.
  """
  if q_lengths is None and kv_lengths is None:
    raise ValueError("lengths needs q_lengths, kv_lengths or both, got neither")
  children = tuple(
    None if x is None else _per_batch(name, x)
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths))
  )
  _shared_batch(children, 1, "q_lengths and kv_lengths")
  return Mask(_LENGTHS, (), children)


# --- global tokens ----------------------------------------------------------


def _global_eval(params, children, b, h, q, kv):
  (n,) = params
  return (q < n) | (kv < n)


def _global_bounds(params, children, t: _Tiles):
  (n,) = params
  return (t.q_lo < n) | (t.kv_lo < n), (t.q_hi < n) | (t.kv_hi < n)


_GLOBAL = _Rule(
  "global_tokens",
  _global_eval,
  _global_bounds,
  _no_extents,
  _describe_plain("global_tokens", ("n",)),
)


def global_tokens(n: int) -> Mask:
  """The first ``n`` positions are global: they attend to all and all attend to them.

  Alone it allows only pairs that touch a global token; combine with ``|``,
  e.g. ``global_tokens(2) | sliding_window(64, 64)`` (Longformer, BigBird).
  """
  return Mask(_GLOBAL, (_checks.integer("n", n, minimum=0, int32=True),))


# --- strided (dilated) ------------------------------------------------------


def _strided_eval(params, children, b, h, q, kv):
  (stride,) = params
  return (q - kv) % stride == 0


def _strided_bounds(params, children, t: _Tiles):
  (stride,) = params
  d_lo, d_hi = t.q_lo - t.kv_hi, t.q_hi - t.kv_lo  # range of q - kv inside the tile
  any_ = (d_hi // stride) * stride >= d_lo  # a multiple of stride lies in [d_lo, d_hi]
  all_ = (d_lo == d_hi) & (d_lo % stride == 0)
  if stride == 1:
    all_ = jnp.ones_like(all_)
  return any_, all_


_STRIDED = _Rule(
  "strided", _strided_eval, _strided_bounds, _no_extents, _describe_plain("strided", ("stride",))
)


def strided(stride: int) -> Mask:
  """Attend at distances that are multiples of ``stride``: ``(q - kv) % stride == 0``.

  With ``sliding_window`` this is a dilated window; with ``causal`` and a
  local window it is the Sparse Transformer's strided pattern.
  """
  return Mask(_STRIDED, (_checks.integer("stride", stride, minimum=1, int32=True),))


# --- block-sparse layouts ----------------------------------------------------


def _block_ids(params, children, q, kv):
  block_q, block_kv = params
  table = children[0]
  nqb, nkb = jnp.shape(table)[-2:]
  qb, kb = q // block_q, kv // block_kv
  return qb, kb, (qb < nqb) & (kb < nkb)


def _blocks_eval(params, children, b, h, q, kv):
  table = _as_rank(children[0], 4)
  qb, kb, inside = _block_ids(params, children, q, kv)
  index = tuple(0 if n == 1 else i for n, i in zip(table.shape, (b, h, qb, kb)))
  return table.at[index].get(mode="clip") & inside


def _blocks_bounds(params, children, t: _Tiles):
  # A (query tile, key/value tile) covers a rectangle of layout blocks and
  # holds at least one position of each of them, so counting the allowed
  # blocks in the rectangle (a summed-area table) classifies it exactly.
  block_q, block_kv = params
  table = _as_rank(children[0], 4).astype(jnp.int32)
  nqb, nkb = table.shape[-2:]
  sat = jnp.pad(jnp.cumsum(jnp.cumsum(table, axis=2), axis=3), ((0, 0), (0, 0), (1, 0), (1, 0)))
  r0 = jnp.minimum(t.q_lo // block_q, nqb)  # (1, 1, nq, 1): first block row
  r1 = jnp.minimum(t.q_hi // block_q + 1, nqb)  # one past the last
  c0 = jnp.minimum(t.kv_lo // block_kv, nkb)  # (1, 1, 1, nk)
  c1 = jnp.minimum(t.kv_hi // block_kv + 1, nkb)

  def corner(r, c):  # (Bm, Nm, nq, nk)
    return sat[:, :, r[0, 0], c[0, 0]]

  count = corner(r1, c1) - corner(r0, c1) - corner(r1, c0) + corner(r0, c0)
  inside = (t.q_hi < nqb * block_q) & (t.kv_hi < nkb * block_kv)
  return count > 0, inside & (count == (r1 - r0) * (c1 - c0))


_BLOCKS = _Rule(
  "block_sparse",
  _blocks_eval,
  _blocks_bounds,
  # The layout's leading axes are batch and heads; its blocks fix no length.
  lambda params, children: _array_extents(jnp.shape(children[0])[:-2] + (1, 1)),
  lambda params, children: f"block_sparse({_shape_str(children[0])}, block_size={tuple(params)!r})",
)


def block_sparse(layout, block_size: int | tuple[int, int]) -> Mask:
  """A block-sparse layout: query block i may attend to key/value block j where
  ``layout[..., i, j]`` is True (splash attention's block masks, BigBird).

  Args:
    layout: boolean array (nqb, nkb), or (N, nqb, nkb) / (B, N, nqb, nkb) for
      per-head or per-row layouts (size-1 axes broadcast).
    block_size: positions per block, ``b`` or ``(block_q, block_kv)``; query
      ``q`` is in block ``q // block_q``. Positions past the layout's last
      block are masked.

  Tile classes are exact for any tile size, so blockwise attention costs in
  proportion to the tiles the layout touches.

  Example::

      >>> masks.block_sparse(np.eye(2, dtype=bool), 2).materialize(4, 4)[0, 0].astype(int)
      Array([[1, 1, 0, 0],
             [1, 1, 0, 0],
             [0, 0, 1, 1],
             [0, 0, 1, 1]], dtype=int32)
  """
  dtype = _checks.dtype_of(layout)
  if dtype != np.bool_:
    raise TypeError(f"layout must be a boolean array, got dtype {dtype}")
  arr = layout if hasattr(layout, "shape") else np.asarray(layout)
  if arr.ndim not in (2, 3, 4):
    raise ValueError(
      f"layout must have shape (nqb, nkb), (N, nqb, nkb) or (B, N, nqb, nkb), "
      f"got {tuple(arr.shape)}"
    )
  if isinstance(block_size, tuple):
    if len(block_size) != 2:
      raise ValueError(
        f"block_size must be an int or a pair (block_q, block_kv), got {block_size!r}"
      )
    sizes = tuple(
      _checks.integer(n, b, minimum=1, int32=True)
      for n, b in zip(("block_size[0]", "block_size[1]"), block_size)
    )
  else:
    size = _checks.integer("block_size", block_size, minimum=1, int32=True)
    sizes = (size, size)
  return Mask(_BLOCKS, sizes, (arr,))


def longformer(window: int | tuple[int, int], *, num_global: int = 1, dilation: int = 1) -> Mask:
  """Longformer's pattern (Beltagy et al. 2020): a sliding window plus global tokens.

  Each position attends to ``window`` positions on each side (or ``(left,
  right)``; ``(w, 0)`` for a causal model, combined with :func:`causal`),
  every ``dilation``-th one (so the window reaches ``dilation · w`` away),
  and the first ``num_global`` positions attend to and are attended by all.
  Equal to ``sliding_window(d·l, d·r, dilation=d) | global_tokens(num_global)``.
  """
  if isinstance(window, tuple):
    if len(window) != 2:
      raise ValueError(f"window must be an int or a pair (left, right), got {window!r}")
    left, right = (
      _checks.integer(n, w, minimum=0, int32=True)
      for n, w in zip(("window[0]", "window[1]"), window)
    )
  else:
    left = right = _checks.integer("window", window, minimum=0, int32=True)
  dilation = _checks.integer("dilation", dilation, minimum=1, int32=True)
  _checks.integer("window times dilation", max(left, right) * dilation, int32=True)
  local = sliding_window(left * dilation, right * dilation, dilation=dilation)
  num_global = _checks.integer("num_global", num_global, minimum=0, int32=True)
  return local | global_tokens(num_global) if num_global else local


def bigbird_layout(
  num_q_blocks: int,
  num_kv_blocks: int | None = None,
  *,
  num_window_blocks: int = 3,
  num_global_blocks: int = 1,
  num_random_blocks: int = 2,
  seed: int = 0,
  causal: bool = False,
) -> np.ndarray:
  """BigBird's block layout (Zaheer et al. 2020) as a boolean (nqb, nkb) NumPy array.

  Query block i sees the ``num_window_blocks`` blocks centred on block i
  (an odd number), the first ``num_global_blocks`` blocks (which in turn
  see everything), and ``num_random_blocks`` other blocks drawn without
  replacement from those not already allowed, from
  ``numpy.random.default_rng(seed)``: the same seed gives the same layout.
  With ``causal`` only blocks j <= i are allowed and drawn from, so each row
  keeps its random blocks under a causal mask.
  """
  nqb = _checks.integer("num_q_blocks", num_q_blocks, minimum=1)
  nkb = nqb if num_kv_blocks is None else _checks.integer("num_kv_blocks", num_kv_blocks, minimum=1)
  window = _checks.integer("num_window_blocks", num_window_blocks, minimum=0)
  if window % 2 == 0 and window:
    raise ValueError(
      f"num_window_blocks must be odd (centred on the query block) or 0, got {window}"
    )
  n_global = _checks.integer("num_global_blocks", num_global_blocks, minimum=0)
  n_random = _checks.integer("num_random_blocks", num_random_blocks, minimum=0)
  seed = _checks.integer("seed", seed, minimum=0)
  i, j = np.arange(nqb)[:, None], np.arange(nkb)[None, :]
  layout = (np.abs(i - j) <= window // 2) if window else np.zeros((nqb, nkb), bool)
  layout |= (i < n_global) | (j < n_global)
  if _checks.boolean("causal", causal):
    layout &= j <= i
  rng = np.random.default_rng(seed)
  for row in range(n_global, nqb):
    free = np.flatnonzero(~layout[row] & ((j[0] <= row) if causal else True))
    layout[row, rng.choice(free, size=min(n_random, free.size), replace=False)] = True
  return layout


def bigbird(
  q_len: int,
  kv_len: int | None = None,
  *,
  block_size: int = 64,
  num_window_blocks: int = 3,
  num_global_blocks: int = 1,
  num_random_blocks: int = 2,
  seed: int = 0,
  causal: bool = False,
) -> Mask:
  """BigBird's sparse pattern for ``q_len`` queries and ``kv_len`` keys/values:
  ``block_sparse(bigbird_layout(...), block_size)``; see :func:`bigbird_layout`.

  The random blocks are fixed by ``seed`` (one layout shared by every batch
  row and head), so the forward and backward passes and every step of
  training see the same pattern. ``causal=True`` draws them from the past
  and combines the layout with ``causal()``, for decoders.

  Example::

      >>> m = masks.bigbird(4096, block_size=64, seed=0)
      >>> float(m.materialize(4096, 4096).mean()) < 0.11  # 3 + 1 + 2 of 64 blocks, global rows all
      True
  """
  q_len = _checks.integer("q_len", q_len, minimum=1)
  kv_len = q_len if kv_len is None else _checks.integer("kv_len", kv_len, minimum=1)
  block_size = _checks.integer("block_size", block_size, minimum=1)
  layout = bigbird_layout(
    math.ceil(q_len / block_size),
    math.ceil(kv_len / block_size),
    num_window_blocks=num_window_blocks,
    num_global_blocks=num_global_blocks,
    num_random_blocks=num_random_blocks,
    seed=seed,
    causal=causal,
  )
  mask = block_sparse(layout, block_size)
  return mask & Mask(_CAUSAL, (0,)) if causal else mask  # the causal() mask


# --- dense arrays -----------------------------------------------------------


def _array_eval(params, children, b, h, q, kv):
  arr = _as_rank(children[0], 4)
  index = tuple(0 if n == 1 else i for n, i in zip(arr.shape, (b, h, q, kv)))
  if all(isinstance(i, int) for i in index):
    return arr[index]
  return arr.at[index].get(mode="clip")


def _array_bounds(params, children, t: _Tiles):
  if not t.aligned and any(n > 1 for n in jnp.shape(children[0])[-2:]):
    return _UNSURE
  return _tile_any_all(_as_rank(children[0], 4), t.block_q, t.block_kv, t.q_len, t.kv_len)


_ARRAY = _Rule(
  "from_array",
  _array_eval,
  _array_bounds,
  lambda params, children: _array_extents(jnp.shape(children[0])),
  lambda params, children: f"from_array({_shape_str(children[0])})",
  dense=lambda params, children, grid: _as_rank(children[0], 4),
)


def from_array(mask) -> Mask:
  """A dense boolean array broadcastable to (B, N, T, S), as jax.nn's ``mask``.

  Arrays of lower rank get leading dimensions of size 1, so (T, S) is shared
  by every batch row and head.
  """
  dtype = _checks.dtype_of(mask)
  if dtype != np.bool_:
    raise TypeError(f"mask must be a boolean array, got dtype {dtype}; pass additive masks as bias")
  arr = mask if hasattr(mask, "shape") else np.asarray(mask)
  if arr.ndim > 4:
    raise ValueError(f"mask must have rank <= 4 (broadcastable to BNTS), got shape {arr.shape}")
  return Mask(_ARRAY, (), (arr,))


# --- arbitrary functions ------------------------------------------------------


def _fn_bounds(params, children, t: _Tiles):
  return jnp.ones((1, 1, 1, 1), bool), jnp.zeros((1, 1, 1, 1), bool)


_FN = _Rule(
  "from_fn",
  lambda params, children, b, h, q, kv: params[0](b, h, q, kv),
  _fn_bounds,
  _no_extents,
  lambda params, children: f"from_fn({getattr(params[0], '__name__', repr(params[0]))})",
)


def from_fn(fn: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]) -> Mask:
  """A mask from ``fn(batch, head, q_idx, kv_idx) -> bool`` (FlexAttention's mask_mod).

  The indices are int arrays that broadcast against each other; write ``fn``
  with broadcasting jnp operations, computing from the indices (index a
  captured (T, S) array as ``table[q_idx, kv_idx]``): tiled implementations
  evaluate it per tile, and attention checks this on two small grids. Tile
  classification is conservative (every tile PARTIAL) unless
  ``block_view(..., exact=True)`` is asked for.
  """
  if not callable(fn):
    raise TypeError(f"from_fn needs a callable fn(batch, head, q_idx, kv_idx), got {fn!r}")
  return Mask(_FN, (fn,))


# --- combinators -------------------------------------------------------------


def _and_bounds(params, children, t):
  (a_any, a_all), (b_any, b_all) = (_bounds(c, t) for c in children)
  return a_any & b_any, a_all & b_all  # "any" may over-approximate: stays safe (PARTIAL)


def _or_bounds(params, children, t):
  (a_any, a_all), (b_any, b_all) = (_bounds(c, t) for c in children)
  return a_any | b_any, a_all | b_all  # "all" may under-approximate: stays safe


def _not_bounds(params, children, t):
  any_, all_ = _bounds(children[0], t)
  return ~all_, ~any_


def _combined_extents(params, children) -> Extents:
  out = (None,) * 4
  for child in children:
    out = _merge_extents(out, child.extents, "a combined mask")
  return out


_AND = _Rule(
  "and",
  lambda p, c, *idx: c[0](*idx) & c[1](*idx),
  _and_bounds,
  _combined_extents,
  lambda p, c: f"({c[0]!r} & {c[1]!r})",
  dense=lambda p, c, grid: _dense(c[0], grid) & _dense(c[1], grid),
)
_OR = _Rule(
  "or",
  lambda p, c, *idx: c[0](*idx) | c[1](*idx),
  _or_bounds,
  _combined_extents,
  lambda p, c: f"({c[0]!r} | {c[1]!r})",
  dense=lambda p, c, grid: _dense(c[0], grid) | _dense(c[1], grid),
)
_NOT = _Rule(
  "not",
  lambda p, c, *idx: ~c[0](*idx),
  _not_bounds,
  _combined_extents,
  lambda p, c: f"~{c[0]!r}",
  dense=lambda p, c, grid: ~_dense(c[0], grid),
)


# --- index maps ----------------------------------------------------------------


def _reindex_eval(params, children, b, h, q, kv):
  mask, *maps = children
  idx = tuple(
    i if m is None else jnp.asarray(m).at[i].get(mode="clip") for m, i in zip(maps, (b, h, q, kv))
  )
  return mask(*idx)


def _mapped_range(positions, block: int, length: int):
  """Smallest and largest mapped position in each tile of ``block`` entries of ``positions``."""
  lo = _tile_reduce(positions, 0, block, length, "edge", jnp.min)
  hi = _tile_reduce(positions, 0, block, length, "edge", jnp.max)
  return lo, hi


def _reindex_bounds(params, children, t: _Tiles):
  # Tiles of the new axes are bounded by the hull of the positions they map
  # to: a superset, so the child's "any" stays an over- and its "all" an
  # under-approximation, both safe. Contiguous maps (a shard of a sequence)
  # keep the child's classes exact.
  mask, batch, head, q, kv = children
  mapped = t
  if q is not None or kv is not None:
    if not t.aligned:  # tiles already stand for hulls: positions per tile are unknown here
      return _UNSURE
    mapped = t._replace(aligned=False)
  if q is not None:
    q_lo, q_hi = (x.reshape(1, 1, -1, 1) for x in _mapped_range(q, t.block_q, t.q_len))
    mapped = mapped._replace(q_lo=q_lo, q_hi=q_hi)
  if kv is not None:
    kv_lo, kv_hi = (x.reshape(1, 1, 1, -1) for x in _mapped_range(kv, t.block_kv, t.kv_len))
    mapped = mapped._replace(kv_lo=kv_lo, kv_hi=kv_hi)
  out = []
  for x in _bounds(mask, mapped):
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for axis, positions in ((0, batch), (1, head)):
      if positions is not None and x.shape[axis] > 1:
        x = jnp.take(x, jnp.asarray(positions), axis=axis, mode="clip")
    out.append(x)
  return tuple(out)


def _reindex_extents(params, children) -> Extents:
  mask, *maps = children
  return tuple(own if m is None else jnp.shape(m)[0] for own, m in zip(mask.extents, maps))


def _describe_reindex(params, children):
  mask, *maps = children
  parts = [
    f"{name} {_shape_str(m)}"
    for name, m in zip(("batch", "head", "q", "kv"), maps)
    if m is not None
  ]
  return f"reindex({mask!r}, {', '.join(parts)})"


_REINDEX = _Rule("reindex", _reindex_eval, _reindex_bounds, _reindex_extents, _describe_reindex)


def reindex(mask: Mask, *, batch=None, head=None, q=None, kv=None) -> Mask:
  """``mask`` seen through index maps: the new mask at ``(b, n, i, j)`` is
  ``mask(batch[b], head[n], q[i], kv[j])``.

  Each map is an int array of shape (L,) giving, for every position of the
  new axis, the position of ``mask``'s axis it stands for; None keeps the axis
  as it is. Sequence-parallel attention uses it to evaluate a mask written in
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
  maps = []
  for name, m in (("batch", batch), ("head", head), ("q", q), ("kv", kv)):
    maps.append(None if m is None else _checks.int_array(name, m, ranks=(1,)))
  return Mask(_REINDEX, (), (mask, *maps))


def _bounds(mask: Mask, tiles: _Tiles):
  return mask.rule.bounds(mask.params, mask.children, tiles)


def _dense(mask: Mask, grid) -> jax.Array:
  if mask.rule.dense is not None:
    return mask.rule.dense(mask.params, mask.children, grid)
  return mask.rule.evaluate(mask.params, mask.children, *grid)


def _check_operand(other, op: str) -> Mask:
  if not isinstance(other, Mask):
    what = (
      f"an array of shape {tuple(other.shape)} ({type(other).__name__})"
      if hasattr(other, "shape")
      else f"{type(other).__name__} {other!r}"
    )
    raise TypeError(
      f"'{op}' combines a jattn.masks.Mask only with another Mask, got {what}; "
      "wrap a boolean array with masks.from_array(...) first"
    )
  return other


def all_of(*masks: Mask) -> Mask | None:
  """``masks[0] & masks[1] & ...``; None when there are none."""
  out = None
  for m in masks:
    out = m if out is None else out & m
  return out


class Mask(Node):
  """An attention mask: a function of ``(batch, head, q_idx, kv_idx)`` returning bool.

  Build masks with the constructors of :mod:`jattn.masks` and combine them
  with ``&``, ``|`` and ``~``. Calling a mask evaluates it on broadcastable
  index arrays.
  """

  def __call__(self, batch, head, q_idx, kv_idx) -> jax.Array:
    return self.rule.evaluate(self.params, self.children, batch, head, q_idx, kv_idx)

  def on_grid(self, grid) -> jax.Array:
    """Evaluate on a full :func:`index_grid`, keeping dense arrays as they are.

    The result has the broadcast shape of what the mask depends on (e.g.
    (1, 1, T, S) for ``causal()``); no argument checks, for implementations.
    """
    return _dense(self, grid)

  @property
  def extents(self) -> Extents:
    """(B, N, T, S) fixed by the mask's arrays; None where the mask broadcasts."""
    return self.rule.extents(self.params, self.children)

  # NumPy arrays defer to __rand__ / __ror__ rather than applying ``&`` to the Mask as an
  # object element (which raised "unsupported operand type(s) for &: 'bool' and 'Mask'").
  __array_ufunc__ = None

  def __and__(self, other: Mask) -> Mask:
    node = Mask(_AND, (), (self, _check_operand(other, "&")))
    _ = node.extents  # raises on incompatible shapes, at construction
    return node

  def __or__(self, other: Mask) -> Mask:
    node = Mask(_OR, (), (self, _check_operand(other, "|")))
    _ = node.extents
    return node

  def __rand__(self, other) -> Mask:
    return _check_operand(other, "&") & self

  def __ror__(self, other) -> Mask:
    return _check_operand(other, "|") | self

  def __invert__(self) -> Mask:
    return Mask(_NOT, (), (self,))

  def _sizes(self, batch_size, num_heads) -> tuple[int, int]:
    own_b, own_n = self.extents[:2]
    sizes: list[int] = []
    for name, given, own in (("batch_size", batch_size, own_b), ("num_heads", num_heads, own_n)):
      if given is None:
        sizes.append(own or 1)
        continue
      given = _checks.integer(name, given, minimum=1)
      if own is not None and own != given:
        raise ValueError(f"{name} is {given} but the mask holds arrays for {own}")
      sizes.append(given)
    return sizes[0], sizes[1]

  def _check_lengths(self, q_len: int, kv_len: int) -> None:
    _, _, own_t, own_s = self.extents
    for name, given, own in (("q_len", q_len, own_t), ("kv_len", kv_len, own_s)):
      if own is not None and own != given:
        raise ValueError(f"{name} is {given} but the mask holds arrays for length {own}")

  def materialize(
    self, q_len: int, kv_len: int, *, batch_size: int | None = None, num_heads: int | None = None
  ) -> jax.Array:
    """The dense boolean mask of shape (B, N, T, S).

    B and N default to the sizes of the mask's own arrays (1 when it has none).
    """
    q_len = _checks.integer("q_len", q_len, minimum=0)
    kv_len = _checks.integer("kv_len", kv_len, minimum=0)
    self._check_lengths(q_len, kv_len)
    batch_size, num_heads = self._sizes(batch_size, num_heads)
    dense = self.on_grid(index_grid(batch_size, num_heads, q_len, kv_len))
    return jnp.broadcast_to(dense, (batch_size, num_heads, q_len, kv_len))

  def block_view(
    self,
    q_len: int,
    kv_len: int,
    *,
    block_q: int,
    block_kv: int,
    batch_size: int | None = None,
    num_heads: int | None = None,
    exact: bool = False,
  ):
    """Classify every (query tile, key/value tile) pair as EMPTY, PARTIAL or FULL.

    Tiles are ``block_q`` queries by ``block_kv`` keys; the last tile of each
    axis may be shorter. Without ``exact`` the classification comes from each
    mask's tile bounds in O(number of tiles) work: exact for every constructor
    (``segments`` when its ids are sorted, see there), conservative (PARTIAL
    where unsure) for ``from_fn`` and for some combinations. ``exact=True`` evaluates the mask
    densely, O(B·N·T·S) work, and is exact for every mask.

    Returns:
      int8 array of shape (B, N, ceil(T / block_q), ceil(S / block_kv)) with
      values EMPTY, PARTIAL, FULL: a NumPy array when the mask's arrays are
      concrete, a traced array inside jit otherwise.
    """
    q_len = _checks.integer("q_len", q_len, minimum=0)
    kv_len = _checks.integer("kv_len", kv_len, minimum=0)
    block_q = _checks.integer("block_q", block_q, minimum=1)
    block_kv = _checks.integer("block_kv", block_kv, minimum=1)
    self._check_lengths(q_len, kv_len)
    batch_size, num_heads = self._sizes(batch_size, num_heads)
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
    with jax.ensure_compile_time_eval():
      if exact:
        dense = self.materialize(q_len, kv_len, batch_size=batch_size, num_heads=num_heads)
        any_, all_ = _tile_any_all(dense, block_q, block_kv, q_len, kv_len)
      else:
        q_lo = jnp.arange(nq, dtype=jnp.int32) * block_q
        kv_lo = jnp.arange(nk, dtype=jnp.int32) * block_kv
        tiles = _Tiles(
          q_lo=q_lo.reshape(1, 1, -1, 1),
          q_hi=jnp.minimum(q_lo + block_q, q_len).reshape(1, 1, -1, 1) - 1,
          kv_lo=kv_lo.reshape(1, 1, 1, -1),
          kv_hi=jnp.minimum(kv_lo + block_kv, kv_len).reshape(1, 1, 1, -1) - 1,
          block_q=block_q,
          block_kv=block_kv,
          q_len=q_len,
          kv_len=kv_len,
        )
        any_, all_ = _bounds(self, tiles)
      view = jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)
      view = jnp.broadcast_to(view, (batch_size, num_heads, nq, nk))
    return np.asarray(view) if _checks.is_concrete(view) else view


jax.tree_util.register_pytree_node_class(Mask)
