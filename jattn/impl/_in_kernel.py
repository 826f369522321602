"""Index functions evaluated inside a Pallas kernel, their arrays read from refs by index.

Masks and score functions read arrays (segment ids, lengths, block tables, a dense mask)
by indexing them with their position arguments. Inside a GPU kernel those arrays stay in
memory: Triton has no gather from a value held in registers, but a load from a ref at an
array of integer indices is a gather from memory. :func:`evaluate` runs a function's jaxpr
(:func:`jax.make_jaxpr`, its arrays as the leading inputs) with those inputs bound to refs:

- a point gather from one (``arr[b, q_idx]``, ``arr.at[i].get(mode="clip")``: every operand
  dimension collapsed, slices of size 1) becomes one load at the gathered indices, clipped
  (or masked and filled) as the gather's mode says;
- static slices of one (``arr[0]``, ``arr[:, 1:]``, ``arr[::2]``), dynamic slices that take
  one element or the whole extent of each dimension (``arr[b]`` at a scalar ``b``, as
  ``jnp`` indexes with a traced scalar), reshapes that add or drop unit dimensions,
  broadcasts that only add them, and dtype conversions of one are deferred to that load;
- anything else reads the whole array first (exact, but for Triton only where its shape is
  a power of two, and a gather from the loaded array does not lower at all: flex's
  selection, :mod:`jattn.impl.flex._lowers`, refuses functions that need either).

Index vectors built by concatenating scalars along a last axis (how ``jnp`` forms a
gather's indices) are kept as their pieces, so no concatenate or slice is lowered.

A kernel that cannot gather at all (Mosaic GPU's) passes its query and key indices as
:class:`Line` s: a tile's positions along one axis, from a first one. A point gather at
those positions (``arr[q_idx]``, ``arr[b, kv_idx]``, ``pos.at[q_idx].get(mode="clip")``),
every other index a scalar, reads one contiguous vector of the array (the kernel's own load)
and broadcasts it across the tile; a scalar broadcast to a tile stays a :class:`Splat`
until something needs the tile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from jattn import _checks


class Function(NamedTuple):
  """A mask or score function as a kernel evaluates it: its jaxpr, whose leading inputs are
  the arrays it reads (``arrays``), then the (score and) index arguments."""

  jaxpr: Any
  arrays: tuple[jax.Array, ...]

  @classmethod
  def trace(cls, fn: Any, *specs: Any) -> Function:
    """``fn`` traced at ``specs``, the arrays it closes over made leading inputs."""
    closed = jax.make_jaxpr(fn)(*specs)
    invars = list(closed.jaxpr.constvars) + list(closed.jaxpr.invars)
    jaxpr = closed.jaxpr.replace(constvars=[], invars=invars)
    return cls(jaxpr, tuple(jnp.asarray(c) for c in closed.consts))


def same_arrays(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> bool:
  """Whether two traces' arrays are the same arrays (the same objects, or equal constants)."""
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x is y:
      continue
    concrete = _checks.is_concrete(x) and _checks.is_concrete(y)
    if not concrete or (x.shape, x.dtype) != (y.shape, y.dtype):
      return False
    if not np.array_equal(np.asarray(x), np.asarray(y)):
      return False
  return True


@dataclasses.dataclass(frozen=True)
class Deferred:
  """An input array still in its ref: ``ref`` seen with ``shape`` and ``dtype``, where
  logical dimension i is the ref's dimension ``dims[i]`` (None: a unit dimension the ref
  lacks) from element ``starts[i]`` in steps of ``steps[i]`` (a static slice); ref
  dimensions no logical one maps are read at ``pinned`` (ref dimension, index) pairs, else
  at 0 (the ref's own unit dimensions); a pinned index may be traced (a dynamic slice's
  start)."""

  ref: Any
  shape: tuple[int, ...]
  dtype: Any
  dims: tuple[int | None, ...]
  starts: tuple[int, ...]
  steps: tuple[int, ...]
  pinned: tuple[tuple[int, Any], ...] = ()

  @classmethod
  def of(cls, ref: Any) -> Deferred:
    shape = tuple(ref.shape)
    n = len(shape)
    return cls(ref, shape, np.dtype(ref.dtype), tuple(range(n)), (0,) * n, (1,) * n)

  def _ref_index(self, logical: Sequence[Any]) -> tuple[Any, ...]:
    """The ref's index: ``logical[i]`` (an index into logical dimension i, or a static
    slice of all of it) put at the ref dimension it maps to, pinned dimensions at their
    index, the rest at 0."""
    at: dict[int, Any] = dict(self.pinned)
    for i, d in enumerate(self.dims):
      if d is not None:
        at[d] = logical[i]
    return tuple(at.get(d, 0) for d in range(len(self.ref.shape)))

  def load(self) -> jax.Array:
    """The whole array (a load of its part of the ref)."""
    whole = [
      slice(start, start + step * (n - 1) + 1, step)
      for n, start, step in zip(self.shape, self.starts, self.steps)
    ]
    index = self._ref_index(whole)
    value = self.ref[index] if index else self.ref[...]
    if tuple(jnp.shape(value)) != self.shape:  # a scalar stays one (Mosaic GPU has no 0-d vector)
      value = value.reshape(self.shape)
    return value if value.dtype == self.dtype else value.astype(self.dtype)

  def reshaped(self, shape: tuple[int, ...]) -> Deferred | None:
    """Seen as ``shape``, where that only adds or drops unit dimensions; else None."""
    axes = list(zip(self.shape, self.dims, self.starts, self.steps))
    kept = [a for a in axes if a[0] != 1]
    if [n for n in shape if n != 1] != [a[0] for a in kept]:
      return None
    # A dropped unit dimension that maps a ref dimension keeps reading it at its start.
    pinned = dict(self.pinned)
    pinned.update((d, start) for n, d, start, _ in axes if n == 1 and d is not None)
    it = iter(kept)
    new = [next(it) if n != 1 else (1, None, 0, 1) for n in shape]
    return dataclasses.replace(
      self,
      shape=tuple(shape),
      dims=tuple(a[1] for a in new),
      starts=tuple(a[2] for a in new),
      steps=tuple(a[3] for a in new),
      pinned=tuple(sorted(pinned.items(), key=lambda item: item[0])),
    )

  def sliced(
    self, start: Sequence[int], limit: Sequence[int], strides: Sequence[int] | None
  ) -> Deferred:
    """``lax.slice`` of it: the same ref, each dimension from a later start, in longer steps."""
    strides = strides or (1,) * len(self.shape)
    return dataclasses.replace(
      self,
      shape=tuple(-(-(hi - lo) // st) for lo, hi, st in zip(start, limit, strides)),
      starts=tuple(s0 + lo * st0 for s0, st0, lo in zip(self.starts, self.steps, start)),
      steps=tuple(st0 * st for st0, st in zip(self.steps, strides)),
    )

  def dynamic_sliced(self, starts: Sequence[Any], sizes: Sequence[int]) -> Deferred | None:
    """``lax.dynamic_slice`` of it where each dimension keeps one element (at its start,
    clamped into the dimension as dynamic_slice clamps) or all of them; else None."""
    if any(k not in (1, n) for k, n in zip(sizes, self.shape)):
      return None
    pinned = dict(self.pinned)
    dims = list(self.dims)
    for i, (k, n, d, start, step) in enumerate(
      zip(sizes, self.shape, self.dims, self.starts, self.steps)
    ):
      if k == n:  # the whole dimension (a unit one too: its start is clamped to 0)
        continue
      dims[i] = None
      if d is not None:  # the ref's element: from the slice's start, in its steps
        idx = jnp.clip(jnp.asarray(starts[i]).astype(jnp.int32), 0, n - 1)
        pinned[d] = start + (idx * step if step != 1 else idx)
    ordered = tuple(sorted(pinned.items(), key=lambda item: item[0]))
    return dataclasses.replace(self, shape=tuple(sizes), dims=tuple(dims), pinned=ordered)

  def gather(self, indices: Sequence[jax.Array], mode: Any, fill: Any) -> jax.Array:
    """``array[indices[0], indices[1], ...]`` elementwise (one index array per logical
    dimension, broadcast together), read from the ref."""
    indices = jnp.broadcast_arrays(*indices)
    valid = None
    shape = indices[0].shape if indices else None
    at: dict[int, Any] = {d: _full(shape, i) for d, i in self.pinned}
    for i, (n, d, start, step) in enumerate(zip(self.shape, self.dims, self.starts, self.steps)):
      idx = indices[i].astype(jnp.int32)
      if _fills(mode):
        inside = (idx >= 0) & (idx < n)
        valid = inside if valid is None else valid & inside
      idx = jnp.clip(idx, 0, n - 1)
      if d is not None:  # the ref's element: from the slice's start, in its steps
        scaled = idx if step == 1 else idx * step
        at[d] = scaled + start if start else scaled
    ref_index = tuple(at.get(d, _full(shape, 0)) for d in range(len(self.ref.shape)))
    out = self.ref[ref_index].astype(self.dtype) if ref_index else self.ref[...]
    if valid is not None:
      out = jnp.where(valid, out, jnp.asarray(0 if fill is None else fill, self.dtype))
    return out

  def line(self, indices: Sequence[Any], mode: Any = None) -> jax.Array | None:
    """``array[indices...]`` where one index is a :class:`Line` and the others scalars
    (or :class:`Splat` s): the array's contiguous run at the line's positions, read by the
    line's own load, each scalar index clamped into its dimension (as a clipping gather
    clamps, and as XLA reads ``jnp``'s plain indexing, which promises indices in bounds).
    None where it is not such a read: a filling gather (``mode``) at scalar indices, which
    might fall outside; an array shorter than the positions' axis; a read in steps."""
    lines = [i for i, x in enumerate(indices) if isinstance(x, Line)]
    if len(lines) != 1 or any(not isinstance(x, (Line, Splat)) and jnp.ndim(x) for x in indices):
      return None
    if _fills(mode) and len(indices) > 1:
      return None
    (k,) = lines
    line, dim = indices[k], self.dims[k]
    if line.shape != tuple(jnp.shape(line.tile)) or any(
      getattr(op, "reshapes", False) for op in line.ops
    ):
      return None  # a line whose tile is not the index's
    # The run must lie inside the array: the shifted positions from 0 to extent + offset.
    if line.offset is None or line.offset < 0 or self.shape[k] < line.extent + line.offset:
      return None
    if self.steps[k] != 1 or dim is None:
      return None
    at: dict[int, Any] = dict(self.pinned)
    for i, (n, d, start, step) in enumerate(zip(self.shape, self.dims, self.starts, self.steps)):
      if i == k or d is None:
        continue
      x = indices[i]
      idx = jnp.clip(jnp.asarray(x.value if isinstance(x, Splat) else x, jnp.int32), 0, n - 1)
      at[d] = start + (idx * step if step != 1 else idx)
    at[dim] = pl.ds(self.starts[k] + line.start, line.length)
    view = self.ref.at[tuple(at.get(d, 0) for d in range(len(self.ref.shape)))]
    out = line.load(view)
    if out.dtype == self.dtype:
      return out
    # a comparison, not a conversion, to booleans (Mosaic GPU converts no tile to them)
    return out != 0 if self.dtype == np.bool_ else out.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Line:
  """A tile's positions along ``axis`` as a kernel passes them for ``q_idx`` or ``kv_idx``:
  ``tile`` is ``start`` (a scalar, non-negative) plus the tile's iota along ``axis``; the
  positions run over an axis of ``extent`` (the sequence's length). ``load(view)`` brings a
  1-D ref view of the tile's extent along ``axis`` into a tile of ``tile``'s shape, constant
  along the other axes: how the kernel reads an array at these positions
  (:meth:`Deferred.line`). Shifts, integer conversions and unit dimensions keep it a line,
  recorded in ``ops`` and applied to the tile only where something needs its
  :attr:`value` (a kernel may not lower them on the tile: Mosaic GPU adds no unit
  dimension to a tile in wgmma's layout); ``offset`` is the shift added to the positions
  (None: one not known while tracing), which bounds where a read of them may fall."""

  tile: Any
  axis: int
  start: Any
  extent: int
  load: Callable[[Any], Any]
  shape: tuple[int, ...] = ()
  ops: tuple[Callable[[Any], Any], ...] = ()
  offset: int | None = 0

  def __post_init__(self) -> None:
    if not self.shape:
      object.__setattr__(self, "shape", tuple(jnp.shape(self.tile)))

  @property
  def value(self) -> Any:
    out = self.tile
    for op in self.ops:
      out = op(out)
    return out

  @property
  def length(self) -> int:
    """How many positions the tile holds along ``axis``."""
    return self.shape[self.axis]

  def then(self, op: Callable[[Any], Any], **changes: Any) -> Line:
    """This line with ``op`` applied to its value, and ``changes`` to its fields."""
    return dataclasses.replace(self, ops=(*self.ops, op), **changes)


@dataclasses.dataclass(frozen=True)
class Splat:
  """A scalar ``value`` broadcast to ``shape``, kept a scalar."""

  value: Any
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Known:
  """A boolean tile whose every element is ``value``, known while tracing (a position
  compared with a bound no position crosses)."""

  value: bool
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Pieces:
  """An index array formed by concatenating arrays along its last axis, kept as those."""

  parts: tuple[Any, ...]

  def value(self) -> jax.Array:
    return jnp.concatenate([_materialise(p) for p in self.parts], axis=-1)

  def columns(self) -> list[Any]:
    """Each column of the last axis, that axis dropped (a :class:`Line`'s or
    :class:`Splat`'s only column stays one)."""
    out: list[Any] = []
    for p in self.parts:
      if isinstance(p, (Line, Splat)) and p.shape[-1] == 1:
        out.append(_reshaped(p, p.shape[:-1]))
        continue
      p = _materialise(p)
      for j in range(p.shape[-1]):
        out.append(p[..., j] if p.shape[-1] > 1 else p.reshape(p.shape[:-1]))
    return out


def evaluate(jaxpr: Any, refs: Sequence[Any], *args: Any) -> list[Any]:
  """Run ``jaxpr`` (a ClosedJaxpr or Jaxpr) on ``(*refs, *args)``: its first ``len(refs)``
  inputs are read from ``refs`` by index, the others are ``args``. Returns its outputs."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    consts, jaxpr = list(jaxpr.consts), jaxpr.jaxpr
  else:
    consts = []
  # Each array as the function sees it: a kernel may hold it wider (Mosaic GPU loads no
  # vector of booleans) and it is read back in the function's dtype.
  inputs = [
    dataclasses.replace(Deferred.of(r), dtype=np.dtype(v.aval.dtype))
    for r, v in zip(refs, jaxpr.invars)
  ] + list(args)
  return _run(jaxpr, consts, inputs, any(isinstance(a, Line) for a in args))


def _run(
  jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any], lines: bool = False
) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, inputs):
    env[v] = x
  for eqn in jaxpr.eqns:
    outs = _eqn(eqn, [read(v) for v in eqn.invars], lines)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [_materialise(read(v)) for v in jaxpr.outvars]


def _eqn(eqn: Any, invals: list[Any], lines: bool = False) -> list[Any]:
  name, params = eqn.primitive.name, eqn.params
  deferred = [x for x in invals if isinstance(x, (Deferred, Pieces))]
  if name in ("pjit", "jit", "closed_call", "core_call") and "jaxpr" in params:
    inner = params["jaxpr"]
    inner = inner if isinstance(inner, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(inner, ())
    return _run(inner.jaxpr, inner.consts, invals, lines)
  if name == "custom_jvp_call" and "call_jaxpr" in params:
    inner = params["call_jaxpr"]
    return _run(inner.jaxpr, inner.consts, invals, lines)
  if lines and (kept := _on_lines(eqn, invals)) is not None:
    return [kept]
  if deferred:
    x = invals[0]
    if name in ("reshape", "broadcast_in_dim", "squeeze") and isinstance(x, Deferred):
      seen = x.reshaped(tuple(eqn.outvars[0].aval.shape))
      if seen is not None:
        return [seen]
    if name == "slice" and isinstance(x, Deferred):
      return [x.sliced(params["start_indices"], params["limit_indices"], params["strides"])]
    if name == "dynamic_slice" and isinstance(x, Deferred):
      starts = [_materialise(i) for i in invals[1:]]
      sliced = x.dynamic_sliced(starts, params["slice_sizes"])
      if sliced is not None:
        return [sliced]
    if name == "convert_element_type" and isinstance(x, Deferred):
      return [dataclasses.replace(x, dtype=np.dtype(params["new_dtype"]))]
    if name == "gather" and isinstance(x, Deferred):
      got = _point_gather(x, invals[1], params, lines)
      if got is not None:
        return [got]
  if name == "concatenate" and params["dimension"] == len(eqn.outvars[0].aval.shape) - 1:
    parts: list[Any] = []
    for x in invals:
      kept = x if isinstance(x, (Line, Splat)) else _materialise(x)
      parts.extend(x.parts if isinstance(x, Pieces) else (kept,))
    return [Pieces(tuple(parts))]
  invals = [_materialise(x) for x in invals]
  got = eqn.primitive.get_bind_params(params)
  # JAX 0.10 returns the parameters alone (call primitives' subfunctions among them); JAX
  # releases before it returned (subfunctions, parameters).
  subfuns, bind_params = got if isinstance(got, tuple) else ((), got)
  out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _point_gather(
  x: Deferred, indices: Any, params: dict[str, Any], lines: bool = False
) -> jax.Array | None:
  """The gather as a load from ``x``'s ref, where it reads single elements (a contiguous
  run at a :class:`Line`'s positions, where ``lines``); else None."""
  dn = params["dimension_numbers"]
  rank = len(x.shape)
  if (
    dn.offset_dims
    or getattr(dn, "operand_batching_dims", ())
    or tuple(params["slice_sizes"]) != (1,) * rank
    or sorted(dn.collapsed_slice_dims) != list(range(rank))
    or sorted(dn.start_index_map) != list(range(rank))
  ):
    return None
  if isinstance(indices, Pieces):
    columns = indices.columns()
  elif isinstance(indices, (Line, Splat)) and indices.shape[-1] == 1:
    columns = [_reshaped(indices, indices.shape[:-1])]
  else:
    indices = _materialise(indices)
    columns = [indices[..., j] for j in range(indices.shape[-1])]
  by_dim = dict(zip(dn.start_index_map, columns))
  ordered = [by_dim[d] for d in range(rank)]
  if lines and (got := x.line(ordered, params["mode"])) is not None:
    return got
  ordered = [_materialise(c) for c in ordered]
  return x.gather(ordered, params["mode"], params.get("fill_value"))


def _full(shape: tuple[int, ...] | None, i: int) -> Any:
  """Index ``i`` as an index array of ``shape`` (all of a gather's indices are arrays), or
  the integer where there are none (a rank-0 array's gather)."""
  return i if shape is None else jnp.full(shape, i, jnp.int32)


def _fills(mode: Any) -> bool:
  return "FILL" in str(mode).upper()


def _materialise(x: Any) -> Any:
  if isinstance(x, Deferred):
    return x.load()
  if isinstance(x, Pieces):
    return x.value()
  if isinstance(x, Line):
    return x.value
  if isinstance(x, Splat):
    return jnp.broadcast_to(x.value, x.shape)
  if isinstance(x, Known):
    return jnp.full(x.shape, x.value)
  return x


def _scalar(x: Any) -> bool:
  """Whether ``x`` is a scalar (or a :class:`Splat`, a scalar broadcast)."""
  if isinstance(x, (Deferred, Pieces, Line, Known)):
    return False
  return isinstance(x, Splat) or not jnp.ndim(x)


def _value(x: Any) -> Any:
  return x.value if isinstance(x, Splat) else x


def _reshaped(x: Any, shape: tuple[int, ...]) -> Any:
  """A :class:`Line` or :class:`Splat` seen as ``shape`` (unit dimensions added or dropped
  after the line's axis), else None."""
  shape = tuple(shape)
  if isinstance(x, Splat):
    return Splat(x.value, shape)
  kept = [n for n in x.shape if n != 1]
  if [n for n in shape if n != 1] != kept or x.shape[: x.axis + 1] != shape[: x.axis + 1]:
    return None
  if shape == tuple(jnp.shape(x.tile)):  # back to the tile's own shape
    ops = tuple(op for op in x.ops if not getattr(op, "reshapes", False))
    return dataclasses.replace(x, shape=shape, ops=ops)
  return x.then(_reshape_to(shape), shape=shape)


def _reshape_to(shape: tuple[int, ...]) -> Callable[[Any], Any]:
  def op(v: Any) -> Any:
    return jnp.reshape(v, shape)

  op.reshapes = True  # type: ignore[attr-defined]
  return op


def _static(x: Any) -> int | None:
  """``x`` as a Python int where it is an integer known while tracing, else None."""
  if isinstance(x, (int, np.integer)) or (isinstance(x, np.ndarray) and x.ndim == 0):
    return int(x)
  return None


def _shifted(offset: int | None, s: Any, sign: int) -> int | None:
  """A line's ``offset`` after adding ``sign * s`` (None where either is not known)."""
  k = _static(s)
  return None if offset is None or k is None else offset + sign * k


_SHIFTS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b}
# A position p >= 0 compared with a bound c <= 0, with p on the left:
_NEVER_NEGATIVE = {"lt": False, "ge": True}


def _on_lines(eqn: Any, invals: list[Any]) -> Any:
  """``eqn`` on :class:`Line` s, :class:`Splat` s and :class:`Known` s, kept so where the
  result is one; None (evaluate it on the tiles) elsewhere."""
  name, params = eqn.primitive.name, eqn.params
  out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
  x = invals[0] if invals else None
  if name == "broadcast_in_dim":
    if _scalar(x) and not params["broadcast_dimensions"]:
      return Splat(_value(x), out_shape)
    if isinstance(x, (Line, Splat)):
      return _reshaped(x, out_shape)
    return None
  if name in ("reshape", "squeeze") and isinstance(x, (Line, Splat)):
    return _reshaped(x, out_shape)
  if name == "convert_element_type" and isinstance(x, (Line, Splat)):
    dtype = np.dtype(params["new_dtype"])
    if isinstance(x, Splat):
      return Splat(jnp.asarray(x.value).astype(dtype), x.shape)
    if jnp.issubdtype(dtype, jnp.integer):
      return x.then(lambda v: v.astype(dtype), start=jnp.asarray(x.start).astype(dtype))
    return None
  if name in _SHIFTS and len(invals) == 2:
    a, b = invals
    shift = _SHIFTS[name]
    if isinstance(a, Line) and _scalar(b):
      s = _value(b)
      offset = _shifted(a.offset, s, -1 if name == "sub" else 1)
      return a.then(lambda v: shift(v, s), start=shift(a.start, s), offset=offset)
    if name == "add" and isinstance(b, Line) and _scalar(a):
      s = _value(a)
      return b.then(lambda v: v + s, start=b.start + s, offset=_shifted(b.offset, s, 1))
    if isinstance(a, Splat) and isinstance(b, Splat):
      return Splat(shift(a.value, b.value), out_shape)
    return None
  if name in _NEVER_NEGATIVE and len(invals) == 2:
    a, b = invals
    bound = _static(b)
    if isinstance(a, Line) and a.offset is not None and a.offset >= 0:
      if bound is not None and bound <= 0:  # positions + offset >= 0 >= bound
        return Known(_NEVER_NEGATIVE[name], out_shape)
    return None
  if name == "select_n" and isinstance(x, Known):
    return invals[1 + int(x.value)]
  return None
