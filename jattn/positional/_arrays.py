"""Input checks and the compute dtype shared by sinusoids and RoPE."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jattn import _checks


def _compute_dtype(dtype: DTypeLike) -> np.dtype:
  """float64 for float64 data (only possible under x64), else float32."""
  return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _float_array(name: str, value: Any) -> jax.Array | np.ndarray:
  arr = _checks.as_array(name, value)
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {arr.dtype}")
  return arr


def _positions_array(value: Any) -> jax.Array | np.ndarray:
  arr = _checks.as_array("positions", value)
  if arr.dtype == np.bool_ or not (
    jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
  ):
    raise TypeError(f"positions must have an integer or floating dtype, got {arr.dtype}")
  return arr
