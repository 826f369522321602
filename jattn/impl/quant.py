"""Quantized key/value storage: int8 and float8_e4m3fn with one float32 scale per
(token, key/value head).

A stored vector ``x`` (H,) of one token and head becomes ``round(x / scale)`` with
``scale = max|x| / QMAX``, so its largest element maps to ±QMAX and nothing clips:
symmetric absmax quantization, as KV caches in serving stacks do (vLLM, JetStream,
kvax). int8 rounds to integers (QMAX = 127, a relative error of at most 0.5 / 127 of the
vector's largest element); float8_e4m3fn rounds to its 3-bit mantissa (QMAX = 448, the
largest finite e4m3 value: an error of at most 2⁻⁴ of each element plus 2⁻¹⁰ of the
scale, the absolute term for elements below 2⁻⁶ of the scale, which fall among e4m3's
subnormals, spaced 2⁻⁹ apart). A
vector of zeros gets scale 0 and reads back as zeros.

Reading is :func:`dequantize`, tile by tile inside attention, so a whole cache is
never expanded to floats.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

__all__ = ["QMAX", "SCALE_DTYPE", "is_quantized", "quantize", "dequantize", "storage_dtype"]

# The storage dtypes a cache may hold besides floats, and the largest value each
# quantized vector's absmax is mapped to.
QMAX = {np.dtype(jnp.int8): 127.0, np.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = np.dtype(np.float32)


def is_quantized(dtype: DTypeLike) -> bool:
  """Whether a cache of storage ``dtype`` holds quantized values and scales."""
  return np.dtype(dtype) in QMAX


def quantize(x: jax.Array, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
  """``(values in dtype, scales float32)`` of x (..., H): one scale per vector along H.

  The values are ``x / scale`` rounded (int8) or cast (float8, round to nearest even)."""
  dtype = np.dtype(dtype)
  qmax = QMAX[dtype]
  x = x.astype(SCALE_DTYPE)
  scale = jnp.max(jnp.abs(x), axis=-1) / qmax
  inverse = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), 0)
  y = jnp.clip(x * inverse[..., None], -qmax, qmax)
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  return y.astype(dtype), scale


def dequantize(values: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
  """``values · scale`` in ``dtype``: values (..., H) in a quantized dtype, scale (...)."""
  return (values.astype(SCALE_DTYPE) * scale[..., None]).astype(dtype)


def storage_dtype(name: str, dtype: Any) -> np.dtype:
  """A KV cache's storage dtype: floating, or int8 / float8_e4m3fn (quantized)."""
  try:
    checked = np.dtype(dtype)
  except TypeError:
    checked = None
  if checked is None or not (jnp.issubdtype(checked, jnp.floating) or is_quantized(checked)):
    raise TypeError(
      f"{name} must be a floating dtype, int8 or float8_e4m3fn, got "
      f"{dtype if checked is None else checked}"
    )
  return checked
