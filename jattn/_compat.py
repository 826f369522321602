"""The JAX APIs whose form differs between the releases jattn supports (jax 0.10 to the newest).

Everything version-dependent lives here, so the rest of the package calls one spelling:

* :func:`only_on`: a function whose body is lowered for one platform only, so a fused
  kernel inside one branch of ``jax.lax.platform_dependent`` survives a multi-platform
  lowering (``jax.export(..., platforms=["cpu", "tpu"])``). In every release up to the
  newest, a ``platform_dependent`` branch is lowered for each platform of the program, and
  a Pallas TPU kernel cannot be lowered for a CPU; this lowers the branch with a
  single-platform module context, which reaches into ``jax._src`` (``ModuleContext``).
* :func:`without_consts`: a function's trace with its constants as leading arguments
  (``custom_partitioning`` takes no function that closes over constants), from
  ``jax._src``'s ``convert_constvars_jaxpr``.
* :func:`no_mesh`: a block where eager computations see no mesh (inside ``shard_map``).
* :func:`explicit_sharding`: the ``NamedSharding`` a traced array carries in JAX's
  Explicit sharding mode (sharding in types), or None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3])

# --- one platform's lowering ---------------------------------------------------------

_only_on_p = jex_core.Primitive("jattn_only_on")
_only_on_p.multiple_results = True


def _only_on_abstract(*args, jaxpr, platform):
  del args, platform
  return [v.aval for v in jaxpr.jaxpr.outvars]


def _only_on_impl(*args, jaxpr, platform):
  del platform
  return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _only_on_lowering(ctx, *args, jaxpr, platform):
  module = ctx.module_context
  if len(module.platforms) > 1 and platform in module.platforms:
    # This body runs only where the program runs on `platform` (it sits in that platform's
    # branch of a platform_dependent): lower it for that platform alone.
    ctx = ctx.replace(module_context=module.replace(platforms=(platform,)))
  fn = mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)
  return fn(ctx, *args)


def _only_on_batch(args, dims, *, jaxpr, platform):
  fn = jex_core.jaxpr_as_fun(jaxpr)
  moved = [
    x if d is batching.not_mapped else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)
  ]
  axes = [None if d is batching.not_mapped else 0 for d in dims]
  batched = jax.make_jaxpr(jax.vmap(lambda *a: fn(*a), in_axes=axes))(*moved)
  return _only_on_p.bind(*moved, jaxpr=batched, platform=platform), [0] * len(batched.out_avals)


_only_on_p.def_abstract_eval(_only_on_abstract)
_only_on_p.def_impl(_only_on_impl)
mlir.register_lowering(_only_on_p, _only_on_lowering)
batching.primitive_batchers[_only_on_p] = _only_on_batch


def _bind(platform: str, fn: Callable, *args) -> Any:
  flat, tree = jax.tree.flatten(args)
  jaxpr, shape = jax.make_jaxpr(lambda *x: fn(*jax.tree.unflatten(tree, x)), return_shape=True)(
    *flat
  )
  outs = _only_on_p.bind(*flat, jaxpr=jaxpr, platform=platform)
  return jax.tree.unflatten(jax.tree.structure(shape), outs)


def only_on(platform: str, fn: Callable) -> Callable:
  """``fn`` (arrays in, arrays out, reverse-differentiable) lowered for ``platform`` alone.

  ``platform`` is a lowering platform name (``"tpu"``, ``"cuda"``, ``"rocm"``, ``"cpu"``).
  Meant for the body of that platform's branch of ``jax.lax.platform_dependent``: in a
  program lowered for several platforms, the branch is lowered as if the program were for
  ``platform`` only. Gradients come from ``fn``'s own (a ``custom_vjp`` whose forward and
  backward are each lowered the same way); forward-mode differentiation is not supported.
  """

  @jax.custom_vjp
  def run(*args):
    return _bind(platform, fn, *args)

  def fwd(*args):
    return _bind(platform, lambda *a: jax.vjp(fn, *a), *args)

  def bwd(vjp, cotangent):
    return _bind(platform, lambda vjp, ct: vjp(ct), vjp, cotangent)

  run.defvjp(fwd, bwd)
  return functools.wraps(fn)(run)


# --- sharding in types -----------------------------------------------------------------


def explicit_sharding(x) -> jax.sharding.NamedSharding | None:
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


def no_mesh():
  """A block in which computations see no mesh: for evaluating NumPy-valued constants
  (splash's mask tables) eagerly while a ``shard_map`` body is being traced."""
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def without_consts(fn: Callable, *args) -> tuple[Callable, list]:
  """``(g, consts)`` with ``g(*consts, *args) == tuple(fn(*args))`` and no constant inside
  ``g``'s trace; ``fn`` takes and returns flat arrays (traced once, at ``args``' shapes)."""
  from jax._src.interpreters import partial_eval as pe

  closed = jax.make_jaxpr(fn)(*args)
  opened = jex_core.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
  run = jex_core.jaxpr_as_fun(opened)
  return (lambda *a: tuple(run(*a))), list(closed.consts)
