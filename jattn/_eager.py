"""Values computed from concrete arrays while a caller may be traced, one program at a time.

Argument checks and tile schedules compute small arrays from a call's settings and from
arrays that are often concrete (segment ids, lengths, index grids) while the call itself is
being traced. Evaluated operation by operation under :func:`jax.ensure_compile_time_eval`,
each operation compiles an XLA program of its own the first time it meets a shape: dozens
per call. :func:`evaluate` compiles the whole function once per structure and shapes and
runs it, and stages it into the caller's trace only when an input is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jattn import _checks

_COMPILED: dict[Hashable, Any] = {}
_LIMIT = 512  # programs kept; the oldest go first


def evaluate(fn: Callable[..., Any], *args: Any, static: tuple[Hashable, ...] = ()) -> Any:
  """``fn(*args, *static)``: concrete results (NumPy arrays) when every array in ``args``
  is concrete, from one compiled program per (fn, static, structure, shapes); otherwise
  ``fn`` staged into the trace the caller is in.

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
  compiled = _COMPILED.get(key)
  if compiled is None:
    jitted = jax.jit(lambda *a: fn(*a, *static))
    compiled = jitted.lower(*args).compile()
    if len(_COMPILED) >= _LIMIT:
      del _COMPILED[next(iter(_COMPILED))]
    _COMPILED[key] = compiled
  return jax.tree.map(np.asarray, compiled(*args))


def _sharding(x: Any) -> Hashable:
  sharding = getattr(x, "sharding", None)
  return None if sharding is None else sharding


def _concrete(x: Any) -> Any:
  return np.asarray(x) if _checks.is_concrete(x) else x
