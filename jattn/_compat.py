"""The JAX APIs whose form differs between the releases jattn supports (jax 0.10 to the newest).

Everything version-dependent lives here, so the rest of the package calls one spelling:

* :func:`without_consts`: a function's trace with its constants as leading arguments
  (``custom_partitioning`` takes no function that closes over constants), from
  ``jax._src``'s ``convert_constvars_jaxpr``.
* :func:`no_mesh`: a block where eager computations see no mesh (inside ``shard_map``).
* :func:`explicit_sharding`: the ``NamedSharding`` a traced array carries in JAX's
  Explicit sharding mode (sharding in types), or None.
* :func:`varying_axes`: the manual mesh axes a traced array varies over in a ``shard_map``.
* :func:`scan_counts`: a ``scan`` equation's constants and carried values, from its
  parameters (named differently from jax 0.11).
* :func:`batched_aval`: the type ``jax.vmap`` gives a batched value (a primitive's batching
  rule), from ``jax._src``'s ``unmapped_aval``.
* :func:`register_dataclass`: ``jax.tree_util.register_dataclass`` without its defect (two
  classes' treedefs compare equal), which every pytree class of jattn's is registered by.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
from jax.extend import core as jex_core

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3])

# --- sharding in types -----------------------------------------------------------------


def explicit_sharding(x: Any) -> jax.sharding.NamedSharding | None:
  """The NamedSharding of ``x``'s type when it is sharded over Explicit mesh axes, else None
  (Auto axes, no mesh, or a NumPy array)."""
  try:
    sharding = jax.typeof(x).sharding
  except (AttributeError, TypeError):
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return None
  explicit = jax.sharding.AxisType.Explicit
  if not any(t == explicit for t in mesh.axis_types):
    return None
  return sharding


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes ``x`` varies over inside a ``jax.shard_map`` (its type's
  ``manual_axis_type.varying``; ``vma`` in other releases), empty outside one."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def inside_manual_mesh() -> bool:
  """Whether the code runs inside a ``jax.shard_map`` over every axis of its mesh: arrays are
  then each device's own, and nothing is left for XLA to partition."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = jax.sharding.AxisType.Manual
  return not mesh.empty and all(t == manual for t in mesh.axis_types)


def gpu_target(device_kind: str = "NVIDIA H100") -> AbstractContextManager[Any]:
  """A block in which Pallas' Triton lowering targets a GPU of ``device_kind`` on a machine
  without one (a program lowered for ``"cuda"`` from a CPU). From JAX 0.12 the lowering
  reads the GPU's compute capability from the abstract mesh's device, and without one it
  raises; earlier releases lower without it, and there this block does nothing."""
  device_type = getattr(jax.sharding, "AbstractDevice", None)
  if device_type is None:
    return contextlib.nullcontext()
  device = device_type(device_kind=device_kind, num_cores=None, platform="cuda")
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def tpu_target(device_kind: str) -> AbstractContextManager[Any]:
  """A block in which Mosaic's TPU lowering targets a TPU of ``device_kind`` (``"TPU v5
  lite"``, ``"TPU v6 lite"``) on a machine without one: kernels whose lowering reads the
  chip's generation (JAX's ragged paged attention) lower for it from a CPU."""
  from jax._src import mesh as mesh_lib  # public as jax.sharding.AbstractDevice from JAX 0.12

  device_type = getattr(jax.sharding, "AbstractDevice", None) or mesh_lib.AbstractDevice
  device = device_type(device_kind=device_kind, num_cores=1, platform="tpu")
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def no_mesh() -> AbstractContextManager[Any]:
  """A block in which computations see no mesh: for evaluating NumPy-valued constants
  (splash's mask tables) eagerly while a ``shard_map`` body is being traced."""
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def without_consts(
  fn: Callable[..., Any], *args: Any
) -> tuple[Callable[..., tuple[Any, ...]], list[Any]]:
  """``(g, consts)`` with ``g(*consts, *args) == tuple(fn(*args))`` and no constant inside
  ``g``'s trace; ``fn`` takes and returns flat arrays (traced once, at ``args``' shapes)."""
  from jax._src.interpreters import partial_eval as pe

  closed = jax.make_jaxpr(fn)(*args)
  opened = jex_core.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
  run = jex_core.jaxpr_as_fun(opened)
  return (lambda *a: tuple(run(*a))), list(closed.consts)


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """``(constants, carried values)`` of a ``scan`` equation's body inputs (the scanned
  arrays follow them): its ``num_consts`` and ``num_carry`` parameters in jax 0.10, the
  leaves of the first two parts of ``ft_in`` (constants, carry, scanned) from jax 0.11."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(list(consts.vals)), len(list(carry.vals))


def batched_aval(size: int, aval: Any, mesh_axis: Any = None) -> Any:
  """``aval`` with a leading batch axis of ``size`` (sharded over the Explicit ``mesh_axis``
  of a ``vmap(..., spmd_axis_name=...)``, else not): the type ``jax.vmap`` gives a batched
  value, its sharding spec and varying axes kept. From ``jax._src.core.unmapped_aval``, which
  JAX's own batching rules for primitives with fixed result types call (``ffi_call``)."""
  from jax._src import core

  return core.unmapped_aval(size, 0, aval, mesh_axis)


# --- pytree dataclasses ----------------------------------------------------------------


def register_dataclass(
  cls: type, *, data_fields: Sequence[str] | None = None, meta_fields: Sequence[str] | None = None
) -> type:
  """Register the dataclass ``cls`` as a pytree, as ``jax.tree_util.register_dataclass`` does:
  ``data_fields`` are its children, ``meta_fields`` (by default the fields whose metadata says
  ``static``) part of its treedef, and unflattening calls ``cls(**fields)``.

  JAX's own registration (jax 0.10 to 0.12 at least) makes a treedef whose equality ignores the
  class: two dataclasses with as many data fields and equal static values have equal treedefs
  (``causal(1)`` and ``global_tokens(1)``, ``a & b`` and ``a | b``), with different hashes.
  ``jax.jit``'s cache of compiled programs compares keys by equality after a few bits of their
  hash, so now and then one class's call ran the program compiled for the other and returned
  its result. A custom node's treedef compares its registration, hence its class."""
  if (data_fields is None) != (meta_fields is None):
    raise TypeError("register_dataclass: give both data_fields and meta_fields, or neither")
  if data_fields is None or meta_fields is None:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    data_fields = [f.name for f in fields if not f.metadata.get("static", False)]
    meta_fields = [f.name for f in fields if f.metadata.get("static", False)]
  data, meta = tuple(data_fields), tuple(meta_fields)
  keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

  def flatten(x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tuple(getattr(x, name) for name in data), tuple(getattr(x, name) for name in meta)

  def flatten_with_keys(x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    children, aux = flatten(x)
    return tuple(zip(keys, children)), aux

  def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
    return cls(**dict(zip(meta, aux)), **dict(zip(data, children)))

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls
