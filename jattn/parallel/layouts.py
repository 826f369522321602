"""Sequence layouts over the devices of a ring: which natural positions each shard holds.

``"contiguous"`` gives device i the i-th slice of the sequence; ``"zigzag"`` gives it chunks i
and 2P − 1 − i (of 2P); ``"striped"`` gives it positions i, i + P, i + 2P, ... Both of the
latter leave every device the same work under causal masking. :func:`permute` brings inputs
into a layout and :func:`unpermute` brings outputs back; masks are always written in the
sequence's natural positions (:func:`shard_positions` maps a shard's rows to them).
"""

from __future__ import annotations

from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks, masks
from jattn.impl import common

__all__ = ["LAYOUTS", "positions", "permute", "unpermute", "shard_positions"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check_layout(layout: Any) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
  return layout


def positions(layout: str, length: int, num_shards: int) -> np.ndarray:
  """For a sequence laid out in ``layout`` over ``num_shards`` shards: the natural
  position of each entry, int32 of shape (length,).

  ``x_laid_out = x[positions]`` along the sequence axis, which is what
  :func:`permute` does. The ``"contiguous"`` layout is the identity.

  Example::

      >>> positions("zigzag", 8, 2).tolist()  # shard 0: chunks 0 and 3; shard 1: 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
      >>> positions("striped", 8, 2).tolist()
      [0, 2, 4, 6, 1, 3, 5, 7]
  """
  layout = _check_layout(layout)
  length = _checks.integer("length", length, minimum=0)
  num_shards = _checks.integer("num_shards", num_shards, minimum=1)
  _check_divisible("length", length, layout, num_shards)
  return np.concatenate(
    [_rows(np, layout, length, num_shards, np.int32(i)) for i in range(num_shards)]
  )


@overload
def permute(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array: ...


@overload
def permute(x: np.ndarray, layout: str, num_shards: int, *, axis: int = 1) -> np.ndarray: ...


def permute(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, *, axis: int = 1
) -> jax.Array | np.ndarray:
  """``x`` (natural order along ``axis``) rearranged into ``layout`` for ``num_shards``
  shards: the inputs of :func:`ring_attention` with that layout. Works on NumPy and
  JAX arrays; for a training loop, permute token ids and position ids once in the
  input pipeline rather than activations in every layer."""
  return _reorder(x, layout, num_shards, axis, inverse=False)


@overload
def unpermute(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array: ...


@overload
def unpermute(x: np.ndarray, layout: str, num_shards: int, *, axis: int = 1) -> np.ndarray: ...


def unpermute(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, *, axis: int = 1
) -> jax.Array | np.ndarray:
  """The inverse of :func:`permute`: ``x`` laid out in ``layout`` back to natural order."""
  return _reorder(x, layout, num_shards, axis, inverse=True)


def _reorder(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, axis: int, *, inverse: bool
) -> jax.Array | np.ndarray:
  """``x`` taken along ``axis`` at the layout's positions (or their inverse); NumPy stays NumPy."""
  x = _checks.as_array("x", x)
  axis = _checks.integer("axis", axis)
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for an array of shape {tuple(x.shape)}")
  index = positions(layout, x.shape[axis], num_shards)
  if inverse:
    index = np.argsort(index)
  if isinstance(x, np.ndarray):
    return x.take(index, axis=axis)
  spec = common.sharding_spec(x)
  if not any(spec):  # Auto mode, or no mesh: XLA places the gather
    return jnp.take(x, index, axis=axis)
  # Explicit mode: the result keeps x's sharding (a sequence sharded over the devices stays
  # so, and the gather moves the rows between them), which a gather must be told.
  where = (slice(None),) * (axis % x.ndim) + (index,)
  return x.at[where].get(out_sharding=common.sharded_as(spec, mesh_of=x))


def _check_divisible(name: str, length: int, layout: str, num_shards: int) -> None:
  parts = 2 * num_shards if layout == "zigzag" else num_shards
  if length % parts:
    what = f"2 x {num_shards} zig-zag chunks" if layout == "zigzag" else f"{num_shards} devices"
    raise ValueError(
      f"{name} must be divisible by the number of shards: {length} does not "
      f"split into {what} (layout={layout!r})"
    )


def shard_positions(layout: str, length: int, num_shards: int, shard: ArrayLike) -> jax.Array:
  """Natural positions (int32, shape (length // num_shards,)) of shard ``shard``'s rows.

  ``shard`` may be traced (``jax.lax.axis_index``).
  """
  return _rows(jnp, layout, length, num_shards, jnp.asarray(shard, jnp.int32))


def _rows(xp: Any, layout: str, length: int, num_shards: int, shard: Any) -> Any:
  """:func:`shard_positions` in the array module ``xp``: NumPy for a known shard (no program
  compiled), jax.numpy for a traced one."""
  size = length // num_shards
  r = xp.arange(size, dtype=np.int32)
  if layout == "contiguous":
    return shard * size + r
  if layout == "striped":
    return r * num_shards + shard
  half = size // 2  # zigzag: chunks `shard` and 2P - 1 - shard of 2P
  return xp.where(r < half, shard * half + r, (2 * num_shards - 1 - shard) * half + r - half)


def _natural_mask(mask: Any, layout: str, num_shards: int, lengths: tuple[int, int]) -> Any:
  """A dense boolean mask array given in ``layout`` order (its last two axes, where they have
  the query and key/value ``lengths``) back in natural order, where masks of indices are
  written; a :class:`jattn.masks.Mask` or None unchanged. An axis of another length stays as
  it is, for the call's checks to refuse by the argument's name."""
  if mask is None or isinstance(mask, masks.Mask) or layout == "contiguous":
    return mask
  mask = jnp.asarray(mask)
  for axis, n in zip((-2, -1), lengths):
    if mask.ndim >= -axis and mask.shape[axis] == n > 1:
      mask = unpermute(mask, layout, num_shards, axis=axis)
  return mask
