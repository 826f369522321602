"""Values computed from concrete arrays while a caller may be traced, one function at a time.

Argument checks and tile schedules compute small arrays from a call's settings and from
arrays that are often concrete (segment ids, lengths, index grids) while the call itself is
being traced. Evaluated operation by operation under :func:`jax.ensure_compile_time_eval`,
each operation compiles an XLA program of its own the first time it meets a shape: dozens
per call. :func:`evaluate` traces the whole function once per structure and shapes, and
stages it into the caller's trace only when an input is traced. Its jaxpr is usually
integer and boolean arithmetic (tile classes, index bounds), which NumPy evaluates exactly
as XLA does (:mod:`jattn._jaxpr_numpy`) in a fraction of a millisecond; any other function
is compiled once for the default backend.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jattn import _checks, _jaxpr_numpy

_CACHE: dict[Hashable, Any] = {}
_LIMIT = 512  # jaxprs and programs kept; the oldest go first


def evaluate(fn: Callable[..., Any], *args: Any, static: tuple[Hashable, ...] = ()) -> Any:
  """``fn(*args, *static)``: concrete results (NumPy arrays) when every array in ``args``
  is concrete, from one trace per (fn, static, structure, shapes), evaluated with NumPy
  or compiled once; otherwise ``fn`` staged into the trace the caller is in.

  ``fn`` must be a pure function of its arguments, defined once (a module-level function:
  it is part of the cache key); ``static`` holds its hashable settings.
  """
  leaves, treedef = jax.tree.flatten(args)
  if not all(map(_checks.is_concrete, leaves)):
    return fn(*args, *static)
  try:
    key: Hashable = (
      fn,
      static,
      jax.dtypes.canonicalize_dtype(np.float64),  # x64 mode on or off
      treedef,
      tuple((np.shape(x), _checks.dtype_of(x), _sharding(x)) for x in leaves),
    )
    hash(key)
  except TypeError:  # a structure with unhashable settings: operation by operation
    with jax.ensure_compile_time_eval():
      return jax.tree.map(_concrete, fn(*args, *static))
  call = lambda *a: fn(*a, *static)  # noqa: E731
  entry = _CACHE.get(key)
  if entry is None:
    entry = _prepare(call, args)
    if len(_CACHE) >= _LIMIT:
      del _CACHE[next(iter(_CACHE))]
    _CACHE[key] = entry
  closed, out_tree, compiled = entry
  if compiled is None:
    try:
      return jax.tree.unflatten(out_tree, _jaxpr_numpy.run(closed, *leaves))
    except _jaxpr_numpy.Unsupported:  # an operand NumPy cannot treat as XLA does
      compiled = _compile(call, args)
      _CACHE[key] = (closed, out_tree, compiled)
  return jax.tree.map(np.asarray, compiled(*args))


def _prepare(f: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any, Any]:
  """(jaxpr, output structure, None) for NumPy to evaluate, or (None, None, program)."""
  closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
  if not closed.effects and _jaxpr_numpy.supported(closed):
    return closed, jax.tree.structure(shapes), None
  return None, None, _compile(f, args)


def _compile(f: Callable[..., Any], args: tuple[Any, ...]) -> Any:
  return jax.jit(f).lower(*args).compile()


def _sharding(x: Any) -> Hashable:
  sharding = getattr(x, "sharding", None)
  return None if sharding is None else sharding


def _concrete(x: Any) -> Any:
  return np.asarray(x) if _checks.is_concrete(x) else x
