"""The kinds of mask: what each allows, as an index function and as bounds per tile.

Each kind is a frozen dataclass with named fields, registered as a pytree
(settings static, arrays as children), and holds side by side its index
function ``__call__(batch, head, q_idx, kv_idx)``, its ``tile_bounds`` (see
:mod:`jattn.masks.tiles`) and its ``extents``. The constructors below
(:func:`causal`, :func:`sliding_window`, ...) check their arguments and are
the public way to build them; block-sparse layouts are in
:mod:`jattn.masks.layouts`.

Kinds compare query and key/value positions arithmetically (``causal``,
``sliding_window``, ``chunked``, ``global_tokens``, ``strided``), possibly
against one value per batch row (``causal`` with per-row offsets,
``prefix_lm``, ``lengths``): those are defined here. The kinds that read the
caller's arrays along the sequence (``segments``, ``from_array``) or wrap a
user's function (``from_fn``) are defined in ``jattn.masks._data`` and
re-exported here, so ``kinds.Segments``, ``kinds.FromArray`` and
``kinds.FromFn`` name every kind in one place.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks, _compat
from jattn.masks import indexing as ix
from jattn.masks._data import FromArray as FromArray
from jattn.masks._data import FromFn as FromFn
from jattn.masks._data import Segments as Segments
from jattn.masks._data import from_array as from_array
from jattn.masks._data import from_fn as from_fn
from jattn.masks._data import segments as segments
from jattn.masks.core import STATIC, Mask

__all__ = [
  "Causal",
  "CausalPerRow",
  "causal",
  "SlidingWindow",
  "sliding_window",
  "Chunked",
  "chunked",
  "PrefixLM",
  "prefix_lm",
  "Lengths",
  "lengths",
  "GlobalTokens",
  "global_tokens",
  "Strided",
  "strided",
  "Segments",
  "segments",
  "FromArray",
  "from_array",
  "FromFn",
  "from_fn",
]
from jattn.masks.indexing import Extents
from jattn.masks.tiles import Bounds, Tiles

# --- causal ---------------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Causal(Mask):
  """``kv_idx - q_idx <= offset`` with one static offset (see :func:`causal`)."""

  offset: int = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return kv_idx - q_idx <= self.offset  # not kv <= q + offset: overflows int32 for large ones

  def tile_bounds(self, t: Tiles) -> Bounds:
    return t.kv_lo - t.q_hi <= self.offset, t.kv_hi - t.q_lo <= self.offset

  def __repr__(self) -> str:
    return f"causal(offset={self.offset!r})"


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class CausalPerRow(Mask):
  """``kv_idx - q_idx <= offset[batch]`` with an int array offset of shape () or (B,)."""

  offset: Any

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return kv_idx - q_idx <= ix.at_batch(self.offset, batch)

  def tile_bounds(self, t: Tiles) -> Bounds:
    off = ix.batch_index(self.offset, t.xp)
    return t.kv_lo - t.q_hi <= off, t.kv_hi - t.q_lo <= off

  @property
  def extents(self) -> Extents:
    return (ix.shared_batch((self.offset,), 1, "per-batch values"), None, None, None)

  def __repr__(self) -> str:
    return f"causal(offset {ix.shape_str(self.offset)})"


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
    return Causal(_checks.integer("offset", offset, int32=True))
  if isinstance(offset, (bool, np.bool_, float)):
    raise TypeError(
      f"offset must be an int, got {offset!r} of type {type(offset).__name__}; "
      "per-row offsets are an integer array of shape () or (B,)"
    )
  return CausalPerRow(_checks.int_array("offset", offset, ranks=(0, 1)))


# --- sliding window ---------------------------------------------------------


def _window_bounds(
  left: int | None, right: int | None, d_lo: jax.Array, d_hi: jax.Array, xp: ModuleType
) -> Bounds:
  """Bounds of ``-left <= kv - q <= right`` for tiles whose kv - q spans [d_lo, d_hi]."""
  any_ = all_ = xp.ones(np.broadcast_shapes(d_lo.shape, d_hi.shape), bool)
  if left is not None:
    any_, all_ = any_ & (d_hi >= -left), all_ & (d_lo >= -left)
  if right is not None:
    any_, all_ = any_ & (d_lo <= right), all_ & (d_hi <= right)
  return any_, all_


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class SlidingWindow(Mask):
  """``-left <= kv_idx - q_idx <= right`` (None: unbounded), every ``dilation``-th of those."""

  left: int | None = field(metadata=STATIC)
  right: int | None = field(metadata=STATIC)
  dilation: int = field(default=1, metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), bool)
    if self.left is not None:  # kv - q, not q +- width: stays in int32 for any int32 width
      ok = ok & (kv_idx - q_idx >= -self.left)
    if self.right is not None:
      ok = ok & (kv_idx - q_idx <= self.right)
    if self.dilation > 1:
      ok = ok & ((kv_idx - q_idx) % self.dilation == 0)
    return ok

  def tile_bounds(self, t: Tiles) -> Bounds:
    left, right, dilation = self.left, self.right, self.dilation
    d_lo, d_hi = t.kv_lo - t.q_hi, t.kv_hi - t.q_lo  # range of kv - q inside the tile
    any_, all_ = _window_bounds(left, right, d_lo, d_hi, t.xp)
    if dilation == 1:
      return any_, all_
    # Every kv - q in [d_lo, d_hi] occurs in a rectangular tile, so a tile holds an
    # allowed pair exactly when a multiple of the dilation lies in that range cut
    # to the window: both classes are exact.
    lo = d_lo if left is None else t.xp.maximum(d_lo, -left)
    hi = d_hi if right is None else t.xp.minimum(d_hi, right)
    any_ = (lo <= hi) & ((hi // dilation) * dilation >= lo)
    return any_, all_ & (d_lo == d_hi) & (d_lo % dilation == 0)

  def __repr__(self) -> str:
    dilation = "" if self.dilation == 1 else f", dilation={self.dilation!r}"
    return f"sliding_window(left={self.left!r}, right={self.right!r}{dilation})"


def sliding_window(left: int | None, right: int | None = 0, *, dilation: int = 1) -> Mask:
  """Query ``q`` may attend to ``q - left <= kv <= q + right``; None is unbounded.

  ``sliding_window(l, r)`` is ``local_window_size=(l, r)`` of jax.nn. With
  ``dilation=d`` only every d-th of those positions is kept, ``(kv - q) % d
  == 0`` (Longformer's dilated window: ``left = d · w`` reaches w positions
  back). Tile classes are exact, so blockwise attention visits only tiles
  that hold an allowed pair.
  """
  left, right = (
    None if w is None else _checks.integer(name, w, minimum=0, int32=True)
    for name, w in (("left", left), ("right", right))
  )
  dilation = _checks.integer("dilation", dilation, minimum=1, int32=True)
  return SlidingWindow(left, right, dilation)


# --- chunked ---------------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Chunked(Mask):
  """``q_idx // size == kv_idx // size`` (see :func:`chunked`)."""

  size: int = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return q_idx // self.size == kv_idx // self.size

  def tile_bounds(self, t: Tiles) -> Bounds:
    size = self.size
    q0, q1, k0, k1 = t.q_lo // size, t.q_hi // size, t.kv_lo // size, t.kv_hi // size
    return (q0 <= k1) & (k0 <= q1), (q0 == q1) & (k0 == k1) & (q0 == k0)

  def __repr__(self) -> str:
    return f"chunked(size={self.size!r})"


def chunked(size: int) -> Mask:
  """Positions attend within their chunk: ``q // size == kv // size`` (local blocks)."""
  return Chunked(_checks.integer("size", size, minimum=1, int32=True))


# --- prefix LM -------------------------------------------------------------


def _per_batch(name: str, value: Any) -> jax.Array | np.ndarray | np.integer:
  return _checks.int_array(name, value, ranks=(0, 1), nonnegative=True)


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class PrefixLM(Mask):
  """``kv_idx < prefix_lengths[batch]`` or ``kv_idx <= q_idx`` (see :func:`prefix_lm`)."""

  prefix_lengths: Any

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return (kv_idx < ix.at_batch(self.prefix_lengths, batch)) | (kv_idx <= q_idx)

  def tile_bounds(self, t: Tiles) -> Bounds:
    p = ix.batch_index(self.prefix_lengths, t.xp)
    return (t.kv_lo < p) | (t.kv_lo <= t.q_hi), (t.kv_hi < p) | (t.kv_hi <= t.q_lo)

  @property
  def extents(self) -> Extents:
    return (ix.shared_batch((self.prefix_lengths,), 1, "per-batch values"), None, None, None)

  def __repr__(self) -> str:
    return f"prefix_lm(prefix_lengths={ix.shape_str(self.prefix_lengths)})"


def prefix_lm(prefix_lengths: ArrayLike) -> Mask:
  """Prefix-LM: bidirectional inside the first ``prefix_lengths[b]`` positions, causal after.

  Query ``q`` may attend to ``kv < prefix_lengths[b]`` or ``kv <= q``.
  ``prefix_lengths`` is an int or an int array of shape (B,).
  """
  return PrefixLM(_per_batch("prefix_lengths", prefix_lengths))


# --- sequence lengths (padding) ---------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Lengths(Mask):
  """``q_idx < q_lengths[batch]`` and ``kv_idx < kv_lengths[batch]``; None: no limit."""

  q_lengths: Any
  kv_lengths: Any

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), bool)
    if self.q_lengths is not None:
      ok = ok & (q_idx < ix.at_batch(self.q_lengths, batch))
    if self.kv_lengths is not None:
      ok = ok & (kv_idx < ix.at_batch(self.kv_lengths, batch))
    return ok

  def tile_bounds(self, t: Tiles) -> Bounds:
    any_ = all_ = t.xp.ones((1, 1, 1, 1), bool)
    if self.q_lengths is not None:
      n = ix.batch_index(self.q_lengths, t.xp)
      any_, all_ = any_ & (t.q_lo < n), all_ & (t.q_hi < n)
    if self.kv_lengths is not None:
      n = ix.batch_index(self.kv_lengths, t.xp)
      any_, all_ = any_ & (t.kv_lo < n), all_ & (t.kv_hi < n)
    return any_, all_

  @property
  def extents(self) -> Extents:
    return (ix.shared_batch(self.children, 1, "per-batch values"), None, None, None)

  def __repr__(self) -> str:
    parts = [
      f"{name} {ix.shape_str(x)}"
      for name, x in (("q_lengths", self.q_lengths), ("kv_lengths", self.kv_lengths))
      if x is not None
    ]
    return f"lengths({', '.join(parts)})"


def lengths(q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None) -> Mask:
  """Padding: query ``q`` and key ``kv`` take part only below their row's length.

  ``q_lengths`` and ``kv_lengths`` are ints or int arrays of shape (B,). A
  padded query row may attend to nothing, so its output is zeros.
  """
  if q_lengths is None and kv_lengths is None:
    raise ValueError("lengths needs q_lengths, kv_lengths or both, got neither")
  q_lens, kv_lens = (
    None if x is None else _per_batch(name, x)
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths))
  )
  ix.shared_batch((q_lens, kv_lens), 1, "q_lengths and kv_lengths")
  return Lengths(q_lens, kv_lens)


# --- global tokens ----------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class GlobalTokens(Mask):
  """``q_idx < n`` or ``kv_idx < n`` (see :func:`global_tokens`)."""

  n: int = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return (q_idx < self.n) | (kv_idx < self.n)

  def tile_bounds(self, t: Tiles) -> Bounds:
    n = self.n
    return (t.q_lo < n) | (t.kv_lo < n), (t.q_hi < n) | (t.kv_hi < n)

  def __repr__(self) -> str:
    return f"global_tokens(n={self.n!r})"


def global_tokens(n: int) -> Mask:
  """The first ``n`` positions are global: they attend to all and all attend to them.

  Alone it allows only pairs that touch a global token; combine with ``|``,
  e.g. ``global_tokens(2) | sliding_window(64, 64)`` (Longformer, BigBird).
  """
  return GlobalTokens(_checks.integer("n", n, minimum=0, int32=True))


# --- strided (dilated) ------------------------------------------------------


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Strided(Mask):
  """``(q_idx - kv_idx) % stride == 0`` (see :func:`strided`)."""

  stride: int = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return (q_idx - kv_idx) % self.stride == 0

  def tile_bounds(self, t: Tiles) -> Bounds:
    stride = self.stride
    d_lo, d_hi = t.q_lo - t.kv_hi, t.q_hi - t.kv_lo  # range of q - kv inside the tile
    any_ = (d_hi // stride) * stride >= d_lo  # a multiple of stride lies in [d_lo, d_hi]
    all_ = (d_lo == d_hi) & (d_lo % stride == 0)
    if stride == 1:
      all_ = t.xp.ones_like(all_)
    return any_, all_

  def __repr__(self) -> str:
    return f"strided(stride={self.stride!r})"


def strided(stride: int) -> Mask:
  """Attend at distances that are multiples of ``stride``: ``(q - kv) % stride == 0``.

  With ``sliding_window`` this is a dilated window; with ``causal`` and a
  local window it is the Sparse Transformer's strided pattern.
  """
  return Strided(_checks.integer("stride", stride, minimum=1, int32=True))
