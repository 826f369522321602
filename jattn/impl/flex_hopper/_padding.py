"""Lengths and head dims off the Hopper kernels' tiles: a call padded to them, its padding
masked.

The kernels take head dims in multiples of 64 (a 128-byte swizzled row of 16-bit values): a
query and key head dim off them is padded with zeros, which adds nothing to q kᵀ (the scale
is the call's, set from the unpadded H), a value head dim likewise, its zero columns cut
from the output (and their gradients with them, by the pad's transpose). They take query
and key lengths in whole tiles (64 rows, 128 warp-specialised,
``block_kv`` keys). A call of other lengths runs on inputs padded with zeros to the next
multiple, the padded keys masked out (``masks.lengths(None, S)``, a conjunct of the indices
with exact tile classes: only the last key tile is PARTIAL), the padded query rows cut from
the output and log-sum-exp (their gradient is zero: the pad's transpose drops it). What the
mask and the score function read along the positions is padded with them: segment ids
(padded rows and keys get ids of their own), a dense mask (False), a bias (zeros), a
sequence-parallel part's position maps (their last entry repeated). A mask holding other
arrays fixed to the call's lengths is not padded (:func:`paddable`): the kernels refuse
those lengths by name."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import masks as _masks
from jattn.impl import tiling
from jattn.masks import core as masks_core

HEAD = 64  # the head dims' multiple


class Padded(NamedTuple):
  """A call's tensors padded to whole tiles along the sequence axes and to multiples of
  :data:`HEAD` along the head dims, and its keyword arguments with the mask, bias and
  position maps padded with them."""

  query: jax.Array
  key: jax.Array
  value: jax.Array
  options: dict[str, Any]


def multiple(block_kv: int, specialized: bool) -> int:
  """The length both sequence axes are padded to a multiple of: every kernel's tile (64
  query rows, 128 warp-specialised; ``block_kv`` keys; the backward's 64 or 128 either
  way), one multiple for both so that T = S stays so (``is_causal``)."""
  return math.lcm(block_kv, 128 if specialized else 64)


def paddable(mask: Any) -> bool:
  """Whether a call with ``mask`` can be padded: its conjuncts other than segment ids and
  a dense mask fix no query or key length (they are functions of the indices, or read
  arrays at the batch row and head)."""
  for part in masks_core.conjuncts(mask):
    if isinstance(part, (_masks.kinds.Segments, _masks.kinds.FromArray)):
      continue
    if any(n is not None for n in part.extents[2:]):
      return False
  return True


def head_dim(h: int) -> int:
  """A head dim as the kernels run it: the next multiple of :data:`HEAD`."""
  return -(-h // HEAD) * HEAD


def pad(query: jax.Array, key: jax.Array, value: jax.Array, **options: Any) -> Padded | None:
  """The call (``options``: the kernels' keyword arguments, ``block_kv``, ``specialized``,
  ``mask``, ``bias``, ``positions`` among them) padded along T and S to whole tiles
  (:func:`multiple`), where its mask can be padded (:func:`paddable`), and along the head
  dims to multiples of :data:`HEAD`; None where nothing is padded."""
  to = multiple(options["block_kv"], options["specialized"])
  T, S = query.shape[1], key.shape[1]
  Tp, Sp = -(-T // to) * to, -(-S // to) * to
  if not paddable(options["mask"]):
    Tp, Sp = T, S  # refused by the kernels' check where off the tiles
  H, Hv = head_dim(query.shape[3]), head_dim(value.shape[3])
  if (Tp, Sp, H, Hv) == (T, S, query.shape[3], value.shape[3]):
    return None
  if (Tp, Sp) != (T, S):
    options = _lengths(T, S, Tp, Sp, **options)
  return Padded(
    tiling.pad_to(query, Tp, H), tiling.pad_to(key, Sp, H), tiling.pad_to(value, Sp, Hv),
    options,
  )  # fmt: skip


def _lengths(T: int, S: int, Tp: int, Sp: int, **options: Any) -> dict[str, Any]:
  """``options`` with the mask, bias and position maps padded from T and S to Tp and Sp."""
  mask, bias, positions = options["mask"], options["bias"], options["positions"]
  parts = []
  for part in masks_core.conjuncts(mask):
    if isinstance(part, _masks.kinds.Segments):
      q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in (part.q_segment_ids, part.kv_segment_ids))
      # Padded rows and keys in documents of their own (the key padding is masked anyway)
      low = jnp.minimum(q_ids.min(), kv_ids.min())
      part = _masks.segments(
        _pad_axis(q_ids, -1, Tp, value=low - 1), _pad_axis(kv_ids, -1, Sp, value=low - 2)
      )
    elif isinstance(part, _masks.kinds.FromArray):
      array = jnp.asarray(part.array)
      array = _pad_axis(array, -2, Tp, value=False) if array.shape[-2] == T else array
      part = _masks.from_array(
        _pad_axis(array, -1, Sp, value=False) if array.shape[-1] == S else array
      )
    parts.append(part)
  if Sp > S:
    parts.append(_masks.lengths(None, S))  # the padded keys
  if bias is not None and jnp.ndim(bias) == 4:  # (another rank: refused by the kernels' check)
    bias = tiling.padded_bias(jnp.asarray(bias), Tp, Sp)
  if positions is not None:  # a part's maps: the padding drawn at the last position's
    maps = list(positions)
    for i, n in ((2, Tp), (3, Sp)):
      if maps[i] is not None:
        maps[i] = _pad_axis(jnp.asarray(maps[i]), 0, n, mode="edge")
    positions = tuple(maps)
  return dict(options, mask=_masks.all_of(*parts), bias=bias, positions=positions)


def _pad_axis(x: jax.Array, axis: int, n: int, **kw: Any) -> jax.Array:
  """``x`` padded at the end of ``axis`` to length ``n`` (``jnp.pad``'s keywords: zeros by
  default)."""
  axis = axis % x.ndim
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  if "value" in kw:
    kw = {"constant_values": kw["value"]}
  return jnp.pad(x, widths, **kw)
