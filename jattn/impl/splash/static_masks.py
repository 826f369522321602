"""Splash's masks: which jattn masks the kernel takes, and their splash form.

:func:`mask_reason` says why a mask cannot be compiled (None when it can); :func:`split`
separates a call's mask into its static conjuncts (a :class:`StaticMask`, tabulated when
the kernel is built) and the dynamic ones (segments and lengths, which travel as segment
ids); :func:`splash_mask` builds one splash mask per head from the static part, mapping
causal, windows and chunks onto splash's own masks and tabulating the rest block by block.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jattn import _compat
from jattn.impl.contract import CallSpec
from jattn.masks import core, index_maps, kinds, layouts

__all__ = ["mask_reason", "StaticMask", "split", "splash_modules", "varies_by_head", "splash_mask"]

if TYPE_CHECKING:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _mask_lib

# --- which masks compile ------------------------------------------------------


def _nodes(mask: core.Mask) -> Iterator[core.Mask]:
  yield mask
  for child in mask.children:
    if isinstance(child, core.Mask):
      yield from _nodes(child)


def mask_reason(mask: core.Mask | None) -> str | None:
  """Why splash cannot express ``mask`` exactly; None when it can."""
  seen = {kinds.Segments: 0, kinds.Lengths: 0}
  for part in core.conjuncts(mask):
    if type(part) in seen:
      seen[type(part)] += 1
      if seen[type(part)] > 1:
        return f"more than one {type(part).__name__.lower()} mask (splash takes one set of ids)"
      continue
    reason = _static_reason(part)
    if reason:
      return reason
  return None


def _static_reason(part: core.Mask) -> str | None:
  for node in _nodes(part):
    if isinstance(node, kinds.FromFn):
      return (
        f"mask {node!r} is an arbitrary index function (blockwise evaluates it per tile; "
        "splash takes masks it can tabulate when the kernel is built)"
      )
    if not isinstance(node, _STATIC_KINDS):
      return f"mask {node!r} has no splash form"
  if part.extents[0] is not None:
    return f"mask {part!r} varies over the batch rows (splash masks are per head)"
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(part)):
    return (
      f"mask {part!r} holds traced arrays (splash tabulates masks when the kernel is "
      "built: pass NumPy arrays, or compute the mask outside jit)"
    )
  return None


_STATIC_KINDS = (
  core.And,
  core.Or,
  core.Not,
  kinds.Causal,
  kinds.SlidingWindow,
  kinds.Chunked,
  kinds.GlobalTokens,
  kinds.Strided,
  kinds.FromArray,
  kinds.Segments,  # inside | or ~, with one batch row and known ids
  kinds.Lengths,
  kinds.PrefixLM,
  kinds.CausalPerRow,
  layouts.BlockSparse,
  index_maps.Reindex,  # with NumPy maps: a sequence-parallel part's mask (jattn.parallel)
)


class StaticMask:
  """The conjuncts splash tabulates, as a static setting of the call spec.

  Their arrays are NumPy copies, and the holder hashes and compares by the masks' kinds,
  settings and array contents, so jit compiles once per distinct mask (splash analyses
  masks when a kernel is built, so they cannot be traced arguments).
  """

  def __init__(self, parts: Iterable[core.Mask]) -> None:
    leaves, treedef = jax.tree.flatten(tuple(parts))
    leaves = [np.asarray(x) for x in leaves]
    self.parts = tuple(jax.tree.unflatten(treedef, leaves))
    digests = tuple(
      (x.shape, x.dtype.str, hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest())
      for x in leaves
    )
    self._key = (treedef, digests)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, StaticMask) and self._key == other._key

  def __repr__(self) -> str:
    return "StaticMask(" + " & ".join(map(repr, self.parts)) + ")"


def split(mask: core.Mask | None) -> tuple[StaticMask | None, core.Mask | None]:
  """``mask`` (which :func:`mask_reason` accepts) as (its tabulated conjuncts, the rest:
  segments and lengths, which travel as traced segment ids)."""
  parts = core.conjuncts(mask)
  dynamic = [p for p in parts if isinstance(p, (kinds.Segments, kinds.Lengths))]
  static = [p for p in parts if not isinstance(p, (kinds.Segments, kinds.Lengths))]
  return (StaticMask(static) if static else None), core.all_of(*dynamic)


def splash_modules() -> tuple[ModuleType, ModuleType]:
  """JAX's splash attention modules (the kernel's and the masks'), imported when first used."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel,
    splash_attention_mask,
  )

  return splash_attention_kernel, splash_attention_mask


@functools.cache
def _tabulated_class() -> Callable[
  [Sequence[core.Mask], int, int, int, tuple[int, int]], _mask_lib.Mask
]:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  class Tabulated(mask_lib.Mask):
    """A splash mask read from jattn masks' index function at batch row 0, one head.

    Positions past the real lengths (T, S) are False, so blocks made only of padding
    are skipped. Rows are evaluated one block-row band at a time, as splash asks for
    the blocks of a band in turn.
    """

    def __init__(
      self, parts: Sequence[core.Mask], head: int, T: int, S: int, shape: tuple[int, int]
    ) -> None:
      self.parts, self.head, self.T, self.S, self._shape = parts, head, T, S, shape

    @property
    def shape(self) -> tuple[int, ...]:
      return self._shape

    @functools.lru_cache(maxsize=2)  # noqa: B019  # a band per kernel build; freed with it
    def _band(self, start: int, stop: int) -> np.ndarray:
      rows = np.arange(start, stop)
      cols = np.arange(self._shape[1])
      # NumPy index arrays, not jax.Arrays: the masks' index functions broadcast with any
      # int arrays, and NumPy keeps the table on the host.
      index: tuple[Any, ...] = (
        np.zeros((1, 1, 1, 1), np.int32),
        np.full((1, 1, 1, 1), self.head, np.int32),
        np.minimum(rows, self.T - 1).astype(np.int32).reshape(1, 1, -1, 1),
        np.minimum(cols, self.S - 1).astype(np.int32).reshape(1, 1, 1, -1),
      )
      with jax.ensure_compile_time_eval(), _compat.no_mesh():
        allowed = np.ones((len(rows), len(cols)), bool)
        for part in self.parts:
          allowed &= np.broadcast_to(np.asarray(part(*index))[0, 0], allowed.shape)
      return allowed & (rows[:, None] < self.T) & (cols[None, :] < self.S)

    def __getitem__(self, idx: tuple[slice, slice]) -> np.ndarray:
      q_slice, kv_slice = idx
      start, stop, _ = q_slice.indices(self._shape[0])
      return self._band(start, stop)[:, kv_slice]

  return Tabulated


def _native(parts: Sequence[core.Mask], shape: tuple[int, int]) -> _mask_lib.Mask | None:
  """The splash mask computed in-kernel from indices equal to ``all_of(*parts)``, or None."""
  _, mask_lib = splash_modules()
  by_kind: dict[type, list] = {}
  for part in parts:
    by_kind.setdefault(type(part), []).append(part)
  if not by_kind:
    return None
  if set(by_kind) <= {kinds.Causal, kinds.SlidingWindow} and all(
    len(v) == 1 for v in by_kind.values()
  ):
    (causal,) = by_kind.get(kinds.Causal, [None])
    (window,) = by_kind.get(kinds.SlidingWindow, [None])
    if window is None:
      return mask_lib.CausalMask(shape, offset=causal.offset)
    if window.dilation != 1:
      return None
    right = window.right
    if causal is not None:
      right = causal.offset if right is None else min(right, causal.offset)
    return mask_lib.LocalMask(shape, (window.left, right), offset=0)
  if set(by_kind) == {kinds.Causal, kinds.Chunked} and all(len(v) == 1 for v in by_kind.values()):
    (causal,), (chunk,) = by_kind[kinds.Causal], by_kind[kinds.Chunked]
    if causal.offset == 0:
      return mask_lib.ChunkedCausalMask(shape, chunk.size)
  return None


def varies_by_head(spec: CallSpec) -> bool:
  """Whether the tabulated masks differ between heads (a device then needs every head)."""
  parts = () if spec.static_mask is None else spec.static_mask.parts
  return any(part.extents[1] is not None for part in parts)


def splash_mask(
  static: Sequence[core.Mask], N: int, T: int, S: int, shape: tuple[int, int]
) -> _mask_lib.MultiHeadMask:
  """One splash mask per query head for the batch-independent conjuncts ``static``."""
  _, mask_lib = splash_modules()
  if not static:
    head_masks = [mask_lib.FullMask(shape)] * N
  elif (native := _native(static, shape)) is not None:
    head_masks = [native] * N
  else:
    Tabulated = _tabulated_class()
    per_head = any(part.extents[1] is not None for part in static)
    if per_head:
      head_masks = [Tabulated(static, h, T, S, shape) for h in range(N)]
    else:
      head_masks = [Tabulated(static, 0, T, S, shape)] * N
  return mask_lib.MultiHeadMask(head_masks)
