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
import jax.numpy as jnp
import numpy as np


def is_concrete(x: Any) -> bool:
  """True when ``x`` holds known values (not a tracer inside jit/vmap/grad)."""
  return not isinstance(x, jax.core.Tracer)


def hashable(x: Any) -> bool:
  """True when ``x`` can be hashed: jit can key its caches on it (a static argument, or a
  treedef whose static fields hold it), and so can the caches that follow jit's keys."""
  try:
    hash(x)
  except TypeError:
    return False
  return True


def dtype_of(x: Any) -> np.dtype:
  return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def shape_of(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  return tuple(shape) if shape is not None else np.shape(x)


def as_array(name: str, value: Any) -> jax.Array | np.ndarray:
  """``value`` as an array: jax/NumPy arrays as they are, NumPy scalars, lists and numbers
  via NumPy."""
  if isinstance(value, (jax.Array, np.ndarray)):
    return value
  if isinstance(value, np.generic):
    return np.asarray(value)
  if isinstance(value, (list, tuple, numbers.Number)) and not isinstance(value, bool):
    return np.asarray(value)
  raise TypeError(f"{name} must be an array, got {type(value).__name__}")


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def integer(name: str, value: Any, *, minimum: int | None = None, int32: bool = False) -> int:
  """A Python (or NumPy) integer, optionally bounded below.

  ``int32=True`` for settings that enter int32 index arithmetic (mask offsets,
  widths, sizes): values outside int32's range would wrap or overflow there.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  if int32:
    _in_int32(name, value, value)
  return value


def _in_int32(name: str, low: int, high: int) -> None:
  if high > INT32_MAX:
    raise ValueError(
      f"{name} must be at most 2**31 - 1 = {INT32_MAX} (jattn's positions and "
      f"ids are int32), got {high}"
    )
  if low < INT32_MIN:
    raise ValueError(
      f"{name} must be at least -2**31 = {INT32_MIN} (jattn's positions and "
      f"ids are int32), got {low}"
    )


def real(name: str, value: Any) -> float:
  """A concrete real number (Python or NumPy scalar, or a concrete 0-d array)."""
  if isinstance(value, bool):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} must be a concrete Python or NumPy number, got a traced value of shape "
      f"{shape_of(value)}; it is a static setting of the computation"
    )
  dtype = getattr(value, "dtype", None)  # NumPy scalars, 0-d arrays; complex is not real
  if (
    shape_of(value) == ()
    and dtype is not None
    and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating))
  ):
    return float(np.asarray(value))
  raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")


def positive_real(name: str, value: Any) -> float:
  """``value`` as a float, checked: a concrete, positive, finite real number."""
  value = real(name, value)
  if not (value > 0 and np.isfinite(value)):
    raise ValueError(f"{name} must be a positive finite number, got {value}")
  return value


def int_array(
  name: str, value: Any, *, ranks: tuple[int, ...], nonnegative: bool = False
) -> jax.Array | np.ndarray | np.integer:
  """An integer array of one of ``ranks``; negative values rejected when concrete.

  Concrete values outside int32's range are rejected too: jattn computes in
  int32, where an int64 or uint32 length of 2**32 would silently wrap to 0.
  (Traced values cannot be checked.)
  """
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
  if not np.can_cast(dtype, np.int32) and is_concrete(arr) and np.size(arr):
    held = np.asarray(arr)
    _in_int32(name, int(held.min()), int(held.max()))
  return arr


def broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...], legend: str) -> None:
  """Each dim of ``shape`` (same rank as ``target``) is 1 or equal to the target's."""
  if len(shape) != len(target) or any(s not in (1, t) for s, t in zip(shape, target)):
    raise ValueError(
      f"{name} must be broadcastable to {legend}={target} (each dimension 1 or equal), "
      f"got shape {shape}"
    )


def boolean(name: str, value: Any) -> bool:
  """A Python (or NumPy) bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def prng_key(name: str, rng: Any) -> None:
  """A single ``jax.random.key`` (shape ()) or legacy ``PRNGKey`` (uint32, shape (2,))."""
  dtype = getattr(rng, "dtype", None)
  is_key = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  is_raw = dtype == np.uint32 and getattr(rng, "shape", None) == (2,)
  if not (is_key and rng.shape == ()) and not is_raw:
    raise TypeError(
      f"{name} must be a single jax.random.key or PRNGKey, got "
      f"{getattr(rng, 'dtype', type(rng).__name__)}{getattr(rng, 'shape', '')}"
    )


def flags(**flags: Any) -> None:
  for name, flag in flags.items():
    boolean(name, flag)


def dropout_rate(rate: Any) -> float:
  rate = real("dropout_rate", rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  return rate


def offsets(
  name: str,
  cu: Any,
  tokens: str,
  total: int,
  *,
  count: str = "num_seqs",
  unit: str = "sequence",
  most: tuple[int, str] | None = None,
) -> jax.Array | np.ndarray:
  """Packed sequences' offsets (``varlen_attention``'s, ``ragged_attention``'s) checked: an
  int array (``count`` + 1,) (at most ``most[0]`` entries, ``most[1]`` saying why), and where
  concrete from 0, nondecreasing and at most ``total`` (``tokens`` naming them in errors):
  NumPy int32 then, else traced int32. ``unit`` is what one offset ends."""
  x = as_array(name, cu)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an int array of offsets, got dtype {x.dtype}")
  limit, why = most or (None, "")
  if x.ndim != 1 or x.shape[0] < 1 or (limit is not None and x.shape[0] > limit):
    raise ValueError(
      f"{name} must have shape ({count} + 1,){why}: 0, then each {unit}'s end, got {x.shape}"
    )
  if not is_concrete(x):
    return x.astype(jnp.int32)
  xs = np.asarray(x)
  if xs[0] != 0:
    raise ValueError(f"{name} must start at 0, got {xs.tolist()}")
  if (np.diff(xs) < 0).any():
    raise ValueError(f"{name} must be nondecreasing, got {xs.tolist()}")
  if xs[-1] > total:
    raise ValueError(f"{name} ends at {xs[-1]}, past the {tokens}: got {xs.tolist()}")
  return xs.astype(np.int32)
