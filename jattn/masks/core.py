"""The :class:`Mask` type, its combinators (``&``, ``|``, ``~``, :func:`all_of`) and
the dense and tile views every mask has.

Each kind of mask (:mod:`jattn.masks.kinds`, :mod:`jattn.masks.layouts`,
:mod:`jattn.masks.index_maps`) is a frozen dataclass subclass of :class:`Mask`
with named fields and three things side by side: ``__call__`` (its index
function), ``tile_bounds`` (its bounds per tile, see :mod:`jattn.masks.tiles`)
and its ``extents``. Each is registered as a pytree: fields marked
``static`` (window sizes, offsets, a user's function) are part of the
treedef, the others (arrays, sub-masks) are its children. So a mask built
anew with equal settings hits jit's cache, and its arrays are traced
arguments rather than constants baked into a compiled program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _compat
from jattn.masks import indexing, tiles
from jattn.masks.indexing import Extents

__all__ = ["Grid", "STATIC", "index_grid", "Mask", "all_of", "conjuncts", "And", "Or", "Not"]

Grid = tuple[jax.Array, ...]
"""``(batch, head, q_idx, kv_idx)``: int32 index arrays that broadcast to (B, N, T, S)."""

STATIC = {"static": True}
"""Field metadata of a setting: part of a mask's treedef, not one of its children."""


def index_grid(batch_size: int, num_heads: int, q_len: int, kv_len: int) -> Grid:
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
    indexing.index_array(np.arange(n), axis)
    for axis, n in enumerate((batch_size, num_heads, q_len, kv_len))
  )


def _on_full_grid(
  mask: Mask, batch_size: int, num_heads: int, q_len: int, kv_len: int
) -> jax.Array:
  """``mask`` evaluated on the full (B, N, T, S) grid."""
  dense = mask.on_grid(index_grid(batch_size, num_heads, q_len, kv_len))
  return jnp.broadcast_to(dense, (batch_size, num_heads, q_len, kv_len))


# One program per mask structure (its kind and settings are its treedef) and sizes: evaluated
# operation by operation, each of a mask's operations would compile a program of its own for
# every new shape.
_on_full_grid_jit = jax.jit(_on_full_grid, static_argnums=(1, 2, 3, 4))


def _dense(mask: Mask, batch_size: int, num_heads: int, q_len: int, kv_len: int) -> jax.Array:
  """:func:`_on_full_grid` through one cached program; in the caller's trace, if any."""
  if not _checks.hashable(jax.tree.structure(mask)):
    # a setting jit cannot key its cache on (an unhashable from_fn callable)
    return _on_full_grid(mask, batch_size, num_heads, q_len, kv_len)
  return _on_full_grid_jit(mask, batch_size, num_heads, q_len, kv_len)


class Mask:
  """An attention mask: a function of ``(batch, head, q_idx, kv_idx)`` returning bool.

  Build masks with the constructors of :mod:`jattn.masks` and combine them
  with ``&``, ``|`` and ``~``. Calling a mask evaluates it on broadcastable
  index arrays. Masks are immutable pytrees.
  """

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    raise NotImplementedError(f"{type(self).__name__} defines no index function")

  def tile_bounds(self, t: tiles.Tiles) -> tiles.Bounds:
    """(any_allowed, all_allowed) for every tile of ``t``; see :mod:`jattn.masks.tiles`."""
    raise NotImplementedError(f"{type(self).__name__} defines no tile bounds")

  @property
  def extents(self) -> Extents:
    """(B, N, T, S) fixed by the mask's arrays; None where the mask broadcasts."""
    return indexing.NO_EXTENTS

  @property
  def children(self) -> tuple:
    """The arrays and masks this mask holds (its pytree children), in field order."""
    return tuple(
      getattr(self, f.name)
      for f in dataclasses.fields(self)  # type: ignore[arg-type]  # every kind is a dataclass
      if not f.metadata.get("static")
    )

  def on_grid(self, grid: Grid) -> jax.Array:
    """Evaluate on a full :func:`index_grid`, keeping dense arrays as they are.

    The result has the broadcast shape of what the mask depends on (e.g.
    (1, 1, T, S) for ``causal()``); no argument checks, for implementations.
    """
    return self(*grid)

  # NumPy arrays defer to __rand__ / __ror__ rather than applying ``&`` to the Mask as an
  # object element (which raised "unsupported operand type(s) for &: 'bool' and 'Mask'").
  __array_ufunc__ = None

  def __and__(self, other: Mask) -> Mask:
    node = And(self, _check_operand(other, "&"))
    _ = node.extents  # raises on incompatible shapes, at construction
    return node

  def __or__(self, other: Mask) -> Mask:
    node = Or(self, _check_operand(other, "|"))
    _ = node.extents
    return node

  def __rand__(self, other: object) -> Mask:
    return _check_operand(other, "&") & self

  def __ror__(self, other: object) -> Mask:
    return _check_operand(other, "|") | self

  def __invert__(self) -> Mask:
    return Not(self)

  def _sizes(self, batch_size: int | None, num_heads: int | None) -> tuple[int, int]:
    own_b, own_n = self.extents[:2]
    sizes: list[int] = []
    for name, given, own in (("batch_size", batch_size, own_b), ("num_heads", num_heads, own_n)):
      if given is None:
        sizes.append(1 if own is None else own)
        continue
      given = _checks.integer(name, given, minimum=0)
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
    Evaluated by one ``jax.jit`` program per mask structure (kind and settings) and
    sizes, compiled once and reused for masks with other arrays of the same shapes;
    inside a trace it is staged into it.
    """
    q_len = _checks.integer("q_len", q_len, minimum=0)
    kv_len = _checks.integer("kv_len", kv_len, minimum=0)
    self._check_lengths(q_len, kv_len)
    batch_size, num_heads = self._sizes(batch_size, num_heads)
    return _dense(self, batch_size, num_heads, q_len, kv_len)

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
  ) -> np.ndarray | jax.Array:
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
    dense: np.ndarray | jax.Array | None = None
    if exact and tiles.is_concrete(self):
      with jax.ensure_compile_time_eval():  # known values even while the caller is traced
        dense = np.asarray(_dense(self, batch_size, num_heads, q_len, kv_len))
    elif exact:
      dense = _dense(self, batch_size, num_heads, q_len, kv_len)
    return tiles.classify(
      self,
      q_len,
      kv_len,
      block_q=block_q,
      block_kv=block_kv,
      batch_size=batch_size,
      num_heads=num_heads,
      dense=dense,
    )


def _check_operand(other: object, op: str) -> Mask:
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


def conjuncts(mask: Mask | None) -> list[Mask]:
  """The masks ``mask`` is the ``&`` of, in order (kernels map each onto their own form)."""
  if mask is None:
    return []
  if isinstance(mask, And):
    return conjuncts(mask.a) + conjuncts(mask.b)
  return [mask]


def _combined_extents(*masks: Mask) -> Extents:
  out = indexing.NO_EXTENTS
  for mask in masks:
    out = indexing.merge_extents(out, mask.extents, "a combined mask")
  return out


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class And(Mask):
  """``a & b``: both allow."""

  a: Mask
  b: Mask

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return self.a(batch, head, q_idx, kv_idx) & self.b(batch, head, q_idx, kv_idx)

  def tile_bounds(self, t: tiles.Tiles) -> tiles.Bounds:
    (a_any, a_all), (b_any, b_all) = self.a.tile_bounds(t), self.b.tile_bounds(t)
    return a_any & b_any, a_all & b_all  # "any" may over-approximate: stays safe (PARTIAL)

  @property
  def extents(self) -> Extents:
    return _combined_extents(self.a, self.b)

  def on_grid(self, grid: Grid) -> jax.Array:
    return self.a.on_grid(grid) & self.b.on_grid(grid)

  def __repr__(self) -> str:
    return f"({self.a!r} & {self.b!r})"


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Or(Mask):
  """``a | b``: either allows."""

  a: Mask
  b: Mask

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return self.a(batch, head, q_idx, kv_idx) | self.b(batch, head, q_idx, kv_idx)

  def tile_bounds(self, t: tiles.Tiles) -> tiles.Bounds:
    (a_any, a_all), (b_any, b_all) = self.a.tile_bounds(t), self.b.tile_bounds(t)
    return a_any | b_any, a_all | b_all  # "all" may under-approximate: stays safe

  @property
  def extents(self) -> Extents:
    return _combined_extents(self.a, self.b)

  def on_grid(self, grid: Grid) -> jax.Array:
    return self.a.on_grid(grid) | self.b.on_grid(grid)

  def __repr__(self) -> str:
    return f"({self.a!r} | {self.b!r})"


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Not(Mask):
  """``~mask``: allows exactly what ``mask`` does not."""

  mask: Mask

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return ~self.mask(batch, head, q_idx, kv_idx)

  def tile_bounds(self, t: tiles.Tiles) -> tiles.Bounds:
    any_, all_ = self.mask.tile_bounds(t)
    return ~all_, ~any_

  @property
  def extents(self) -> Extents:
    return _combined_extents(self.mask)

  def on_grid(self, grid: Grid) -> jax.Array:
    return ~self.mask.on_grid(grid)

  def __repr__(self) -> str:
    return f"~{self.mask!r}"
