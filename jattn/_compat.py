"""The JAX APIs whose form differs between the releases jattn supports (jax 0.10 to the newest).

Everything version-dependent lives here, so the rest of the package calls one spelling:

* :func:`only_on`: a function whose body is lowered for one platform only, so a fused
  kernel inside one branch of ``jax.lax.platform_dependent`` survives a multi-platform
  lowering (``jax.export(..., platforms=["cpu", "tpu"])``) and a second derivative taken
  where another branch runs. In every release up to the
  newest, a ``platform_dependent`` branch is lowered for each platform of the program, and
  a Pallas TPU kernel cannot be lowered for a CPU; this lowers the branch with a
  single-platform module context, which reaches into ``jax._src`` (``ModuleContext``).
* :func:`without_consts`: a function's trace with its constants as leading arguments
  (``custom_partitioning`` takes no function that closes over constants), from
  ``jax._src``'s ``convert_constvars_jaxpr``.
* :func:`no_mesh`: a block where eager computations see no mesh (inside ``shard_map``).
* :func:`needs_devices_when_lowered`: marks a primitive whose lowering may hold a
  ``custom_partitioning`` (which needs the program's devices), from ``jax._src.dispatch``.
* :func:`explicit_sharding`: the ``NamedSharding`` a traced array carries in JAX's
  Explicit sharding mode (sharding in types), or None.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3])

# --- one platform's lowering ---------------------------------------------------------

_only_on_p = jex_core.Primitive("jattn_only_on")
_only_on_p.multiple_results = True


def _only_on_abstract(
  *args: Any, jaxpr: jex_core.ClosedJaxpr, platform: str, refusal: str
) -> list[Any]:
  del args, platform, refusal
  return [v.aval for v in jaxpr.jaxpr.outvars]


def _only_on_impl(*args: Any, jaxpr: jex_core.ClosedJaxpr, platform: str, refusal: str) -> Any:
  del platform, refusal
  return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _only_on_lowering(
  ctx: mlir.LoweringRuleContext,
  *args: Any,
  jaxpr: jex_core.ClosedJaxpr,
  platform: str,
  refusal: str,
) -> Any:
  del refusal
  module = ctx.module_context
  if len(module.platforms) > 1 and platform in module.platforms:
    # This body runs only where the program runs on `platform` (it sits in that platform's
    # branch of a platform_dependent): lower it for that platform alone.
    ctx = ctx.replace(module_context=module.replace(platforms=(platform,)))
  fn = mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)
  return fn(ctx, *args)


def _only_on_batch(
  args: Sequence[Any],
  dims: Sequence[int | None],
  *,
  jaxpr: jex_core.ClosedJaxpr,
  platform: str,
  refusal: str,
) -> tuple[Any, list[int]]:
  fn = jex_core.jaxpr_as_fun(jaxpr)
  moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  axes = [None if d is None else 0 for d in dims]
  try:
    batched = jax.make_jaxpr(jax.vmap(lambda *a: fn(*a), in_axes=axes))(*moved)
  except NotImplementedError:
    # A body with no batching rule (a fused kernel's custom_partitioning): one call per
    # element of the mapped axis.
    def one_by_one(*a: Any) -> Any:
      mapped = [x for x, ax in zip(a, axes) if ax is not None]

      def call(xs: Sequence[Any]) -> Any:
        it = iter(xs)
        return fn(*(next(it) if ax is not None else x for x, ax in zip(a, axes)))

      return jax.lax.map(call, mapped)

    batched = jax.make_jaxpr(one_by_one)(*moved)
  outs = _only_on_p.bind(*moved, jaxpr=batched, platform=platform, refusal=refusal)
  return outs, [0] * len(batched.out_avals)


_only_on_p.def_abstract_eval(_only_on_abstract)
_only_on_p.def_impl(_only_on_impl)
mlir.register_lowering(_only_on_p, _only_on_lowering)
batching.primitive_batchers[_only_on_p] = _only_on_batch


# --- derivatives a branch cannot take, refused when that branch is lowered --------------
#
# A second derivative of a call with a fused branch differentiates that branch's forward
# and backward too (a platform_dependent differentiates every branch), though on the CPU it
# never runs. As JAX defers a custom_vjp's missing forward mode to evaluation, the branch's
# higher derivatives are placeholders that raise only if lowered, i.e. on the platform
# whose kernel cannot take them; the other platforms' branches differentiate as usual.

_refused_p = jex_core.Primitive("jattn_refused_derivative")
_refused_p.multiple_results = True


def _refused_abstract(
  *args: Any, out_avals: Sequence[jax.core.ShapedArray], message: str
) -> list[jax.core.ShapedArray]:
  del args, message
  return list(out_avals)


def _refused_raise(*args: Any, out_avals: Sequence[jax.core.ShapedArray], message: str) -> Any:
  raise ValueError(message)


def _refused_lowering(
  ctx: mlir.LoweringRuleContext,
  *args: Any,
  out_avals: Sequence[jax.core.ShapedArray],
  message: str,
) -> Any:
  raise ValueError(message)


def _refused_batch(
  args: Sequence[Any],
  dims: Sequence[int | None],
  *,
  out_avals: Sequence[jax.core.ShapedArray],
  message: str,
) -> tuple[Any, list[int]]:
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  avals = tuple(a.update(shape=(size, *a.shape)) for a in out_avals)
  return _refused_p.bind(*moved, out_avals=avals, message=message), [0] * len(avals)


def _tangents_refused(
  inputs: Sequence[Any], avals: Sequence[jax.core.ShapedArray], message: str
) -> list:
  """Placeholders for the tangents (or cotangents) of ``avals``: symbolic zeros where the
  dtype carries none (integers), refusals elsewhere."""
  wanted = [a for a in avals if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]
  outs = iter(_refused_p.bind(*inputs, out_avals=tuple(wanted), message=message))
  return [
    next(outs) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else ad.Zero(a.to_tangent_aval())
    for a in avals
  ]


def _refused_jvp(
  primals: Sequence[Any],
  tangents: Sequence[Any],
  *,
  out_avals: Sequence[jax.core.ShapedArray],
  message: str,
) -> tuple[Any, list]:
  outs = _refused_p.bind(*primals, out_avals=out_avals, message=message)
  given = [t for t in tangents if type(t) is not ad.Zero]
  return outs, _tangents_refused([*primals, *given], out_avals, message)


def _refused_transpose(
  cts: Sequence[Any], *args: Any, out_avals: Sequence[jax.core.ShapedArray], message: str
) -> list:
  known = [x for x in args if not ad.is_undefined_primal(x)]
  given = [c for c in cts if type(c) is not ad.Zero]
  undefined = [x.aval for x in args if ad.is_undefined_primal(x)]
  refused = iter(_tangents_refused([*known, *given], undefined, message))
  return [next(refused) if ad.is_undefined_primal(x) else None for x in args]


_refused_p.def_abstract_eval(_refused_abstract)
_refused_p.def_impl(_refused_raise)
mlir.register_lowering(_refused_p, _refused_lowering)
batching.primitive_batchers[_refused_p] = _refused_batch
ad.primitive_jvps[_refused_p] = _refused_jvp
ad.primitive_transposes[_refused_p] = _refused_transpose


def _only_on_jvp(
  primals: Sequence[Any],
  tangents: Sequence[Any],
  *,
  jaxpr: jex_core.ClosedJaxpr,
  platform: str,
  refusal: str,
) -> tuple[Any, list]:
  outs = _only_on_p.bind(*primals, jaxpr=jaxpr, platform=platform, refusal=refusal)
  given = [t for t in tangents if type(t) is not ad.Zero]
  avals = [v.aval for v in jaxpr.jaxpr.outvars]
  return outs, _tangents_refused([*primals, *given], avals, refusal)


ad.primitive_jvps[_only_on_p] = _only_on_jvp


def _bind(platform: str, refusal: str, fn: Callable[..., Any], *args: Any) -> Any:
  flat, tree = jax.tree.flatten(args)
  jaxpr, shape = jax.make_jaxpr(lambda *x: fn(*jax.tree.unflatten(tree, x)), return_shape=True)(
    *flat
  )
  outs = _only_on_p.bind(*flat, jaxpr=jaxpr, platform=platform, refusal=refusal)
  return jax.tree.unflatten(jax.tree.structure(shape), outs)


def only_on(platform: str, fn: Callable[..., Any], refusal: str) -> Callable[..., Any]:
  """``fn`` (arrays in, arrays out, reverse-differentiable) lowered for ``platform`` alone.

  ``platform`` is a lowering platform name (``"tpu"``, ``"cuda"``, ``"rocm"``, ``"cpu"``).
  Meant for the body of that platform's branch of ``jax.lax.platform_dependent``: in a
  program lowered for several platforms, the branch is lowered as if the program were for
  ``platform`` only. Gradients come from ``fn``'s own (a ``custom_vjp`` whose forward and
  backward are each lowered the same way). Any other derivative (forward mode, a second
  derivative) traces, so the other platforms' branches can take it, and raises
  ``ValueError(refusal)`` where this branch is lowered.
  """

  @jax.custom_vjp
  def run(*args: Any) -> Any:
    return _bind(platform, refusal, fn, *args)

  def fwd(*args: Any) -> Any:
    return _bind(platform, refusal, lambda *a: jax.vjp(fn, *a), *args)

  def bwd(vjp: Callable[..., Any], cotangent: Any) -> Any:
    return _bind(platform, refusal, lambda vjp, ct: vjp(ct), vjp, cotangent)

  run.defvjp(fwd, bwd)
  return functools.wraps(fn)(run)


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


def no_mesh() -> AbstractContextManager[Any]:
  """A block in which computations see no mesh: for evaluating NumPy-valued constants
  (splash's mask tables) eagerly while a ``shard_map`` body is being traced."""
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def needs_devices_when_lowered(primitive: jex_core.Primitive) -> None:
  """Lower programs holding ``primitive`` with their device assignment, as JAX does for
  ``custom_partitioning``, whose lowering rule needs it: for a primitive whose lowering rule
  traces a function that may call one (it hides the call from JAX's own scan of the
  program)."""
  from jax._src import dispatch

  dispatch.prim_requires_devices_during_lowering.add(primitive)


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
