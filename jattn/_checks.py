"""Argument checks shared by the public functions.

Every public function validates its inputs here, before anything is traced or
compiled, and raises ValueError (bad shape or value) or TypeError (bad dtype
or type) with a message that names the argument, what was expected and what
arrived. Implementations never call these: they trust normalised arguments.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np


def is_concrete(x: Any) -> bool:
  """True when ``x`` holds known values (not a tracer inside jit/vmap/grad)."""
  return not isinstance(x, jax.core.Tracer)


def dtype_of(x: Any) -> np.dtype:
  return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def shape_of(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  return tuple(shape) if shape is not None else np.shape(x)


def as_array(name: str, value: Any):
  """``value`` as an array: jax/NumPy arrays as they are, lists and numbers via NumPy."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return value
  if isinstance(value, (list, tuple, numbers.Number)) and not isinstance(value, bool):
    return np.asarray(value)
  raise TypeError(f"{name} must be an array, got {type(value).__name__}")


def integer(name: str, value: Any, *, minimum: int | None = None) -> int:
  """A Python (or NumPy) integer, optionally bounded below."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return value


def real(name: str, value: Any) -> float:
  """A concrete real number (Python or NumPy scalar, or a concrete 0-d array)."""
  if isinstance(value, bool):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a concrete Python or NumPy number, got a traced value of shape "
        f"{shape_of(value)}; it is a static setting of the computation")
  if shape_of(value) == () and np.issubdtype(dtype_of(value), np.number):
    return float(np.asarray(value))
  raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")


def int_array(name: str, value: Any, *, ranks: tuple[int, ...], nonnegative: bool = False):
  """An integer array of one of ``ranks``; negative values rejected when concrete."""
  if not hasattr(value, "dtype") and not isinstance(value, (list, tuple, numbers.Integral)):
    raise TypeError(f"{name} must be an integer array, got {type(value).__name__}")
  arr = value if hasattr(value, "dtype") else np.asarray(value)
  dtype = dtype_of(arr)
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(f"{name} must have an integer dtype, got {dtype}")
  if arr.ndim not in ranks:
    expected = " or ".join(str(r) for r in ranks)
    raise ValueError(f"{name} must have rank {expected}, got shape {shape_of(arr)}")
  if nonnegative and is_concrete(arr) and np.any(np.asarray(arr) < 0):
    raise ValueError(f"{name} must be non-negative, got {np.asarray(arr).tolist()}")
  return arr


def broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...], legend: str) -> None:
  """Each dim of ``shape`` (same rank as ``target``) is 1 or equal to the target's."""
  if len(shape) != len(target) or any(s not in (1, t) for s, t in zip(shape, target)):
    raise ValueError(
        f"{name} must be broadcastable to {legend}={target} (each dimension 1 or equal), "
        f"got shape {shape}")
