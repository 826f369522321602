"""How a sequence-parallel call is split over its mesh, checked once for every strategy: the
mesh axes of the sequence, the batch and the heads (:class:`Split`), and segment ids as rows
that travel with their shards."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jattn import _validate
from jattn.parallel.layouts import _check_divisible, _check_layout


class Split(NamedTuple):
  """The checked mesh settings of a call: the sequence over ``axis_name``'s ``size``
  devices in ``layout`` order (USP: each of those chunks split again over ``ulysses``'s
  devices, contiguously), the batch and heads over the other named axes."""

  mesh: Mesh
  axis_name: str
  size: int  # P, the devices of axis_name
  layout: str
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  ulysses: str | None = None  # USP's Ulysses axis

  @classmethod
  def of(
    cls,
    mesh: Any,
    axis_name: Any,
    layout: Any,
    batch_axis: Any,
    head_axis: Any,
    *,
    usp: bool = False,
  ) -> Split:
    """The settings checked; raises naming the argument. ``usp``: ``axis_name`` is a pair
    ``(ring_axis, ulysses_axis)``."""
    layout = _check_layout(layout)
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if usp != (isinstance(axis_name, tuple) and len(axis_name) == 2):
      want = "a pair (ring_axis, ulysses_axis) with" if usp else "one mesh axis without"
      raise TypeError(f"axis_name must be {want} strategy='usp', got {axis_name!r}")
    names = axis_name if usp else (axis_name,)
    ring_axes = [a for n in names for a in _mesh_axes("axis_name", n, mesh, allow_tuple=False)]
    batch_axes = _mesh_axes("batch_axis", batch_axis, mesh)
    head_axes = _mesh_axes("head_axis", head_axis, mesh)
    used = [*ring_axes, *batch_axes, *head_axes]
    if len(set(used)) != len(used):
      raise ValueError(
        f"axis_name, batch_axis and head_axis must name different mesh axes, got "
        f"axis_name={axis_name!r}, batch_axis={batch_axis!r}, head_axis={head_axis!r}"
      )
    ring_axis, ulysses = ring_axes[0], (ring_axes[1] if usp else None)
    return cls(mesh, ring_axis, mesh.shape[ring_axis], layout, batch_axes, head_axes, ulysses)

  @property
  def sequence_devices(self) -> int:
    """How many devices the sequence is split over: the ring's, times Ulysses' with USP."""
    return self.size * (1 if self.ulysses is None else self.mesh.shape[self.ulysses])

  @property
  def batch_axis(self) -> str | tuple[str, ...] | None:
    """The batch's PartitionSpec entry."""
    return axes_or_none(self.batch_axes)

  @property
  def head_axis(self) -> str | tuple[str, ...] | None:
    """The heads' PartitionSpec entry."""
    return axes_or_none(self.head_axes)

  def check_shapes(self, B: int, T: int, S: int, N: int, K: int) -> None:
    """The lengths split into the layout's shards, the batch and heads over their axes; with
    USP each ring chunk over the Ulysses devices, and the heads too."""
    _check_divisible("query length T", T, self.layout, self.size)
    _check_divisible("key/value length S", S, self.layout, self.size)
    if self.ulysses is not None:
      self._check_usp(T, S, N, K)
    for name, n, axes in (
      ("batch size B", B, self.batch_axes),
      ("number of query heads N", N, self.head_axes),
      ("number of key/value heads K", K, self.head_axes),
    ):
      parts = math.prod(self.mesh.shape[a] for a in axes)
      if n % parts:
        raise ValueError(
          f"{name} ({n}) must be divisible by the {parts} devices of mesh axes {axes}"
        )

  def _check_usp(self, T: int, S: int, N: int, K: int) -> None:
    assert self.ulysses is not None
    u = self.mesh.shape[self.ulysses]
    for name, n in (("query length T", T), ("key/value length S", S)):
      if (n // self.size) % u:
        raise ValueError(
          f"strategy='usp' splits each of the {self.size} ring chunks of the {name}={n} over "
          f"the {u} devices of mesh axis {self.ulysses!r}: {n // self.size} tokens a chunk do "
          f"not divide by {u}"
        )
    heads = math.prod(self.mesh.shape[a] for a in self.head_axes) * u
    for name, n in (("query heads N", N), ("key/value heads K", K)):
      if n % heads:
        raise ValueError(
          f"strategy='usp' splits the heads over the {heads} devices of mesh axes "
          f"{(*self.head_axes, self.ulysses)}, and the number of {name}={n} does not divide "
          f"by {heads}: use strategy='ring', or repeat the key/value heads to a multiple of "
          f"{heads}"
        )


def _mesh_axes(name: str, axes: Any, mesh: Mesh, *, allow_tuple: bool = True) -> tuple[str, ...]:
  if axes is None:
    if allow_tuple:
      return ()
    raise TypeError(f"{name} must name a mesh axis, got None")
  names = axes if allow_tuple and isinstance(axes, tuple) else (axes,)
  for a in names:
    if a not in mesh.axis_names:
      raise ValueError(
        f"{name}={axes!r}: unknown mesh axis {a!r}; the mesh has axes {tuple(mesh.axis_names)}"
      )
  return tuple(names)


def axes_or_none(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
  """A PartitionSpec entry for mesh ``axes``: None, one name, or the tuple."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def segment_rows(segment_ids: Any, B: int, T: int, S: int) -> tuple[jax.Array, jax.Array] | None:
  """Segment ids checked and broadcast to (B, T) query and (B, S) key/value ids, in the order
  given (the inputs' layout), to travel with their shards; None without ids."""
  if segment_ids is None:
    return None
  seg = _validate.segments(segment_ids, False, T, S)
  q_ids, kv_ids = (jnp.broadcast_to(jnp.asarray(x), (B, n)) for x, n in zip(seg.children, (T, S)))
  return q_ids, kv_ids
