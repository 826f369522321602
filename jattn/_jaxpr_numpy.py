"""Integer and boolean jaxprs evaluated with NumPy, bit for bit as XLA computes them.

Tile schedules and mask checks compute small integer and boolean arrays (tile classes,
index bounds) from a call's settings. Compiling each such function for the backend costs
tens of milliseconds (and more on a GPU) per mask structure and shape; its jaxpr is a few
dozen integer operations that NumPy evaluates in well under a millisecond. :func:`run`
evaluates a jaxpr whose values are all integers or booleans and whose primitives are in
:data:`RULES`, with XLA's semantics where NumPy's differ (division truncates toward zero,
out-of-range gathers clamp or fill, integers wrap); anything else raises
:class:`Unsupported`, and the caller compiles instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend import core


class Unsupported(Exception):
  """The jaxpr needs a primitive, dtype or operand that :func:`run` does not evaluate."""


def supported(closed: core.ClosedJaxpr) -> bool:
  """Whether every value of ``closed`` is an integer or boolean and every primitive has a
  rule (checked through nested jaxprs), so :func:`run` can evaluate it."""
  return _supported(closed.jaxpr)


def run(closed: core.ClosedJaxpr, *args: Any) -> list[np.ndarray]:
  """The outputs of ``closed`` on concrete ``args``, as NumPy arrays of the jaxpr's dtypes.

  Raises :class:`Unsupported` for an operand XLA would treat in a way NumPy cannot repeat
  (an integer division by zero or by -1, a negative integer power)."""
  with np.errstate(all="ignore"):  # integers wrap, as in XLA
    return _eval(closed.jaxpr, closed.consts, args)


def _supported(jaxpr: core.Jaxpr) -> bool:
  for var in (*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars):
    if not _integral(var.aval):
      return False
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _CALLS:
      if not _supported(eqn.params["jaxpr"].jaxpr):
        return False
    elif name not in RULES:
      return False
    if not all(_integral(v.aval) for v in (*eqn.invars, *eqn.outvars)):
      return False
  return True


def _integral(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_))


def _eval(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[np.ndarray]:
  env: dict[Any, np.ndarray] = {}

  def read(v: Any) -> np.ndarray:
    if isinstance(v, core.Literal):
      return np.asarray(v.val, _aval(v).dtype)
    return env[v]

  for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
    env[var] = np.asarray(value)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CALLS:
      closed = eqn.params["jaxpr"]
      outs = _eval(closed.jaxpr, closed.consts, ins)
    else:
      out = RULES[name](*ins, **eqn.params)
      outs = list(out) if eqn.primitive.multiple_results else [out]
    for var, value in zip(eqn.outvars, outs):
      value = np.asarray(value)
      aval = _aval(var)
      if value.shape != aval.shape:
        raise Unsupported(f"{name} gave shape {value.shape}, the jaxpr says {aval.shape}")
      env[var] = value.astype(aval.dtype, copy=False)
  return [read(v) for v in jaxpr.outvars]


def _aval(var: Any) -> Any:
  return var.aval  # a ShapedArray: integral avals are all that reach here


_CALLS = ("jit", "pjit", "closed_call", "core_call")


def _plain(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
  """An elementwise rule: placement parameters ignored, a widened result refused."""

  def rule(*xs: np.ndarray, out_dtype: Any = None, **_: Any) -> np.ndarray:
    if out_dtype is not None:
      raise Unsupported("an operation with a result dtype of its own")
    return fn(*xs)

  return rule


def _check_divisor(what: str, x: np.ndarray, y: np.ndarray) -> None:
  # x / 0 and INT_MIN / -1 are XLA-defined values NumPy does not give: those operands go
  # back to the compiler.
  if np.any(y == 0) or (np.issubdtype(x.dtype, np.signedinteger) and np.any(y == -1)):
    raise Unsupported(f"integer {what} by zero or by -1")


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  _check_divisor("division", x, y)
  q = np.floor_divide(x, y)  # XLA truncates toward zero, NumPy floors
  return q + ((q * y != x) & ((x < 0) != (y < 0))).astype(q.dtype)


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  _check_divisor("remainder", x, y)
  return np.fmod(x, y)  # the sign of the dividend, as C and XLA


def _integer_pow(x: np.ndarray, *, y: int) -> np.ndarray:
  if y < 0:
    raise Unsupported("a negative integer power")
  return np.power(x, y)


def _broadcast_in_dim(
  x: np.ndarray, *, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_: Any
) -> np.ndarray:
  expanded = [1] * len(shape)
  for axis, dim in zip(broadcast_dimensions, x.shape):
    expanded[axis] = dim
  return np.broadcast_to(x.reshape(expanded), shape)


def _iota(*, dtype: Any, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
  line = np.arange(shape[dimension], dtype=dtype)
  return np.broadcast_to(
    line.reshape([-1 if a == dimension else 1 for a in range(len(shape))]), shape
  )


def _pad(
  x: np.ndarray, value: np.ndarray, *, padding_config: Sequence[tuple[int, int, int]]
) -> np.ndarray:
  for axis, (lo, hi, interior) in enumerate(padding_config):
    if interior:
      n = x.shape[axis]
      shape = list(x.shape)
      shape[axis] = n + (n - 1) * interior if n else 0
      spread = np.full(shape, value, x.dtype)
      index = [slice(None)] * x.ndim
      index[axis] = slice(None, None, interior + 1)
      spread[tuple(index)] = x
      x = spread
    if lo < 0 or hi < 0:
      index = [slice(None)] * x.ndim
      index[axis] = slice(max(-lo, 0), x.shape[axis] - max(-hi, 0))
      x = x[tuple(index)]
    if lo > 0 or hi > 0:
      widths = [(0, 0)] * x.ndim
      widths[axis] = (max(lo, 0), max(hi, 0))
      x = np.pad(x, widths, constant_values=value)
  return x


def _slice(
  x: np.ndarray,
  *,
  start_indices: Sequence[int],
  limit_indices: Sequence[int],
  strides: Sequence[int] | None,
) -> np.ndarray:
  strides = strides or (1,) * x.ndim
  return x[tuple(slice(a, b, s) for a, b, s in zip(start_indices, limit_indices, strides))]


def _gather(
  x: np.ndarray,
  indices: np.ndarray,
  *,
  dimension_numbers: lax.GatherDimensionNumbers,
  slice_sizes: Sequence[int],
  mode: lax.GatherScatterMode,
  fill_value: Any,
  **_: Any,
) -> np.ndarray:
  """lax.gather: the index vector is the last axis of ``indices``."""
  dn = dimension_numbers
  batch_shape = indices.shape[:-1]
  dropped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
  kept = [d for d in range(x.ndim) if d not in dropped]  # the offset dims, in operand order
  rank = len(batch_shape) + len(kept)
  batch_axes = [a for a in range(rank) if a not in dn.offset_dims]

  def batch_shaped(a: np.ndarray) -> np.ndarray:  # batch-shaped array, placed in the output
    shape = [1] * rank
    for axis, n in zip(batch_axes, a.shape):
      shape[axis] = n
    return a.reshape(shape)

  starts, in_bounds = [], np.ones(batch_shape, bool)
  for d in range(x.ndim):
    if d in dn.start_index_map:
      start = indices[..., dn.start_index_map.index(d)].astype(np.int64)
      limit = x.shape[d] - slice_sizes[d]
      in_bounds &= (start >= 0) & (start <= limit)
      start = np.clip(start, 0, max(limit, 0))
    elif d in dn.operand_batching_dims:
      axis = dn.start_indices_batching_dims[dn.operand_batching_dims.index(d)]
      start = _iota(dtype=np.int64, shape=batch_shape, dimension=axis)
    else:
      start = np.zeros(batch_shape, np.int64)
    starts.append(batch_shaped(start))
  index = []
  for d in range(x.ndim):
    if d in dropped:
      index.append(starts[d])
    else:
      shape = [1] * rank
      shape[dn.offset_dims[kept.index(d)]] = slice_sizes[d]
      index.append(starts[d] + np.arange(slice_sizes[d]).reshape(shape))
  out = x[tuple(index)]
  if mode == lax.GatherScatterMode.FILL_OR_DROP:
    fill = _gather_fill(x.dtype) if fill_value is None else fill_value
    out = np.where(batch_shaped(in_bounds), out, np.asarray(fill, x.dtype))
  return out


def _dynamic_slice(x: np.ndarray, *starts: np.ndarray, slice_sizes: Sequence[int]) -> np.ndarray:
  # XLA clamps each start so that the slice fits.
  index = []
  for start, size, dim in zip(starts, slice_sizes, x.shape):
    begin = int(np.clip(start, 0, dim - size))
    index.append(slice(begin, begin + size))
  return x[tuple(index)]


def _gather_fill(dtype: np.dtype) -> Any:
  # lax.gather's default fill: the most negative signed, largest unsigned value, True.
  if np.issubdtype(dtype, np.bool_):
    return True
  info = np.iinfo(dtype)
  return info.min if np.issubdtype(dtype, np.signedinteger) else info.max


def _reduce(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
  return lambda x, *, axes, **_: fn(x, axis=tuple(axes))


def _cumulative(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
  def rule(x: np.ndarray, *, axis: int, reverse: bool) -> np.ndarray:
    if reverse:
      return np.flip(fn(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)
    return fn(x, axis=axis, dtype=x.dtype)

  return rule


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
  return np.choose(which.astype(np.int32), cases)


def _convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray:
  return x.astype(new_dtype)  # integers wrap; bool is "nonzero", as XLA converts


RULES: dict[str, Callable[..., Any]] = {
  "add": _plain(np.add),
  "sub": _plain(np.subtract),
  "mul": _plain(np.multiply),
  "div": _plain(_div),
  "rem": _plain(_rem),
  "neg": _plain(np.negative),
  "abs": _plain(np.abs),
  "sign": _plain(np.sign),
  "max": _plain(np.maximum),
  "min": _plain(np.minimum),
  "integer_pow": _integer_pow,
  "and": _plain(np.bitwise_and),
  "or": _plain(np.bitwise_or),
  "xor": _plain(np.bitwise_xor),
  "not": _plain(np.invert),
  "eq": _plain(np.equal),
  "ne": _plain(np.not_equal),
  "lt": _plain(np.less),
  "le": _plain(np.less_equal),
  "gt": _plain(np.greater),
  "ge": _plain(np.greater_equal),
  "select_n": _plain(_select_n),
  "convert_element_type": _convert,
  "iota": _iota,
  "broadcast_in_dim": _broadcast_in_dim,
  "reshape": lambda x, *, new_sizes, **_: x.reshape(new_sizes),
  "squeeze": lambda x, *, dimensions: np.squeeze(x, tuple(dimensions)),
  "expand_dims": lambda x, *, dimensions: np.expand_dims(x, tuple(dimensions)),
  "transpose": lambda x, *, permutation: np.transpose(x, permutation),
  "rev": lambda x, *, dimensions: np.flip(x, tuple(dimensions)),
  "concatenate": lambda *xs, dimension: np.concatenate(xs, dimension),
  "pad": _pad,
  "slice": _slice,
  "gather": _gather,
  "dynamic_slice": _dynamic_slice,
  "reduce_and": _reduce(np.all),
  "reduce_or": _reduce(np.any),
  "reduce_min": _reduce(np.min),
  "reduce_max": _reduce(np.max),
  "reduce_sum": _reduce(np.sum),
  "cumsum": _cumulative(np.cumsum),
  "cummax": _cumulative(lambda x, axis, dtype: np.maximum.accumulate(x, axis=axis)),
  "cummin": _cumulative(lambda x, axis, dtype: np.minimum.accumulate(x, axis=axis)),
}
"""NumPy rules for the integer and boolean primitives of mask arithmetic, by name."""
