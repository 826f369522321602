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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


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


@dataclasses.dataclass(frozen=True)
class Pieces:
  """An index array formed by concatenating arrays along its last axis, kept as those."""

  parts: tuple[Any, ...]

  def value(self) -> jax.Array:
    return jnp.concatenate(self.parts, axis=-1)

  def columns(self) -> list[jax.Array]:
    """Each column of the last axis, that axis dropped."""
    out = []
    for p in self.parts:
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
  inputs = [Deferred.of(r) for r in refs] + list(args)
  return _run(jaxpr, consts, inputs)


def _run(jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, inputs):
    env[v] = x
  for eqn in jaxpr.eqns:
    outs = _eqn(eqn, [read(v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [_materialise(read(v)) for v in jaxpr.outvars]


def _eqn(eqn: Any, invals: list[Any]) -> list[Any]:
  name, params = eqn.primitive.name, eqn.params
  deferred = [x for x in invals if isinstance(x, (Deferred, Pieces))]
  if name in ("pjit", "jit", "closed_call", "core_call") and "jaxpr" in params:
    inner = params["jaxpr"]
    inner = inner if isinstance(inner, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(inner, ())
    return _run(inner.jaxpr, inner.consts, invals)
  if name == "custom_jvp_call" and "call_jaxpr" in params:
    inner = params["call_jaxpr"]
    return _run(inner.jaxpr, inner.consts, invals)
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
      got = _point_gather(x, invals[1], params)
      if got is not None:
        return [got]
  if name == "concatenate" and params["dimension"] == len(eqn.outvars[0].aval.shape) - 1:
    parts: list[Any] = []
    for x in invals:
      parts.extend(x.parts if isinstance(x, Pieces) else (_materialise(x),))
    return [Pieces(tuple(parts))]
  invals = [_materialise(x) for x in invals]
  got = eqn.primitive.get_bind_params(params)
  # JAX 0.10 returns the parameters alone (call primitives' subfunctions among them); JAX
  # releases before it returned (subfunctions, parameters).
  subfuns, bind_params = got if isinstance(got, tuple) else ((), got)
  out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _point_gather(x: Deferred, indices: Any, params: dict[str, Any]) -> jax.Array | None:
  """The gather as a load from ``x``'s ref, where it reads single elements; else None."""
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
  columns = indices.columns() if isinstance(indices, Pieces) else None
  if columns is None:
    indices = _materialise(indices)
    columns = [indices[..., j] for j in range(indices.shape[-1])]
  by_dim = dict(zip(dn.start_index_map, columns))
  return x.gather([by_dim[d] for d in range(rank)], params["mode"], params.get("fill_value"))


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
  return x
