"""Deferred tracing: a function that is traced where it is lowered, not where it is called.

A call with routes (``implementation=None`` where a fused kernel expresses it) branches on
the platform it is lowered for, and JAX traces every branch of a ``platform_dependent``:
a program compiled for a CPU or a GPU traced splash's TPU kernel as well (its mask tables,
its Pallas body, its partitioning rule) and threw it away, most of the tracing time of
such a call. :func:`call` instead binds a primitive that carries the function and the
types of its results; the function is traced by the primitive's lowering rule, so only in
programs that keep it, lowered for the platform that runs it.

Its results' types must be known without tracing it, so it suits functions whose results
mirror their arguments: a kernel's ``(out, lse)`` and its backward pass from the inputs
(the Auto-mode partitioning rule of :mod:`jattn.impl._sharded`, which recomputes what it
needs). The primitive has no derivative and no batching rule of its own, as
``custom_partitioning`` has none: it sits inside ``custom_vjp`` functions, and a ``vmap``
of it raises ``NotImplementedError``, which :func:`jattn._compat.only_on` answers with one
call per element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from jattn import _compat

_deferred_p = jex_core.Primitive("jattn_deferred")
_deferred_p.multiple_results = True


def call(fn: Callable[..., Sequence[Any]], out_types: Sequence[Any], *args: Any) -> list[Any]:
  """``fn(*args)``, flat arrays in and out, traced only when lowered.

  ``out_types``: the avals of ``fn``'s results (``jax.core.ShapedArray``), checked against
  them (shapes and dtypes) when it is lowered.
  """
  return _deferred_p.bind(*args, fn=fn, out_types=tuple(out_types))


def _abstract(*args: Any, fn: Callable[..., Any], out_types: tuple[Any, ...]) -> list[Any]:
  del args, fn
  return list(out_types)


def _impl(*args: Any, fn: Callable[..., Any], out_types: tuple[Any, ...]) -> Any:
  del out_types
  return list(fn(*args))


def _lowering(
  ctx: mlir.LoweringRuleContext, *args: Any, fn: Callable[..., Any], out_types: tuple[Any, ...]
) -> Any:
  avals = cast(Sequence[jax.core.ShapedArray], ctx.avals_in)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  closed = jax.make_jaxpr(lambda *a: list(fn(*a)))(*structs)
  got = [(a.shape, a.dtype) for a in closed.out_avals]
  want = [(a.shape, a.dtype) for a in out_types]
  if got != want:  # an internal error: the caller's out_types disagree with its function
    raise TypeError(f"jattn: a deferred function returned {got}, declared {want}")
  return mlir.lower_fun(jex_core.jaxpr_as_fun(closed), multiple_results=True)(ctx, *args)


def _batch(args: Any, dims: Any, *, fn: Callable[..., Any], out_types: Any) -> Any:
  raise NotImplementedError("jattn's deferred kernel call has no batching rule")


_deferred_p.def_abstract_eval(_abstract)
_deferred_p.def_impl(_impl)
mlir.register_lowering(_deferred_p, _lowering, cacheable=False)
batching.primitive_batchers[_deferred_p] = _batch
_compat.needs_devices_when_lowered(_deferred_p)  # the kernels' partitioning rules
