"""Sinusoidal absolute position embeddings (Vaswani et al., 2017)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn.positional._arrays import _compute_dtype, _positions_array


def sinusoidal(
  positions: jax.typing.ArrayLike,
  dim: int,
  *,
  max_timescale: float = 10_000,
  dtype: Any = jnp.float32,
) -> jax.Array:
  """Sinusoidal position embeddings (Vaswani et al., 2017, section 3.5).

  With ``w_i = max_timescale ** (-2 i / dim)`` for ``i = 0 .. dim/2 - 1``, the
  embedding is ``[sin(p w_0), ..., sin(p w_{dim/2-1}), cos(p w_0), ...,
  cos(p w_{dim/2-1})]``: all sines, then all cosines (the Tensor2Tensor /
  Flax layout), not the paper's interleaved sin/cos pairs. The frequencies
  are the paper's; Tensor2Tensor and Flax's examples space theirs as
  ``max_timescale ** (-i / (dim/2 - 1))`` instead, so their tables differ
  slightly in every channel but the first.

  Args:
    positions: int or float array of any shape (...); fractional positions
      are fine.
    dim: embedding width, a positive even int.
    max_timescale: the longest wavelength is ``2π · max_timescale`` (about).
    dtype: output dtype, floating. Angles are computed in float32 (float64
      when ``dtype`` is float64 under x64).

  Returns:
    (..., dim) array of ``dtype``.
  """
  positions = _positions_array(positions)
  dim = _checks.integer("dim", dim)
  if dim <= 0 or dim % 2:
    raise ValueError(f"dim must be a positive even int, got {dim}")
  max_timescale = _checks.positive_real("max_timescale", max_timescale)
  try:
    dtype = jax.dtypes.canonicalize_dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a floating dtype, got {dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype, got {dtype}")
  return _embed(positions, dim=dim, max_timescale=max_timescale, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("dim", "max_timescale", "dtype"))
def _embed(positions: jax.Array, *, dim: int, max_timescale: float, dtype: np.dtype) -> jax.Array:
  """``sinusoidal`` on checked arguments, one program (not an operation at a time) outside jit."""
  compute = _compute_dtype(dtype)
  inv_timescales = max_timescale ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
  positions = jnp.asarray(positions).astype(compute)
  angles = positions[..., None] * jnp.asarray(inv_timescales, compute).reshape(
    (1,) * positions.ndim + (dim // 2,)
  )
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1).astype(dtype)
