"""The query-row chunks flex takes the gradients it leaves to XLA in (a bias's, and the
floating arrays' a score function reads): how many rows at a time, and the scan that sums
the learned arrays' gradients over the chunks and gathers the bias's, so those gradients
hold a chunk's (B, N, rows, S) scores and cotangents at a time, not the whole grid's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# A chunk's float32 (B, N, rows, S) grid array is kept under this many bytes where T allows.
CHUNK_BYTES = 1 << 28
LEAST = 64  # fewer rows than this make too many small steps: a larger divisor of T instead


def rows(B: int, N: int, T: int, S: int, multiple: int = 1) -> int:
  """The query rows taken at a time: the most, a multiple of ``multiple`` that divides T,
  whose (B, N, rows, S) float32 array fits in :data:`CHUNK_BYTES`; where that is under
  :data:`LEAST` rows, the fewest such rows that are not (T itself for a prime T)."""
  divisors = [c for c in range(multiple, T + 1, multiple) if T % c == 0]
  fits = [c for c in divisors if B * N * c * S * 4 <= CHUNK_BYTES]
  best = max(fits, default=0)
  if best >= min(LEAST, T):
    return best
  return min(c for c in divisors if c >= min(LEAST, T))


def at(x: jax.Array, axis: int, first: Any, count: int) -> jax.Array:
  """``x``'s query rows ``first`` to ``first + count`` along ``axis``; a broadcast axis (1)
  as it is."""
  return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, first, count, axis)


def over_rows(
  chunk: Callable[[Any], tuple[list[jax.Array], jax.Array | None]],
  T: int,
  count: int,
  learned: Sequence[jax.ShapeDtypeStruct],
  bias: jax.ShapeDtypeStruct | None,
) -> tuple[list[jax.Array], jax.Array | None]:
  """``chunk(first)``'s gradients over T query rows, ``count`` at a time (dividing T):
  ``chunk`` gives, for rows ``first`` to ``first + count``, the ``learned`` arrays'
  gradients and the gradient of a ``bias`` (rank 4, its query axis at 2: ``count`` rows of
  it, or 1 where it has none; None where no bias is differentiated). Returns the learned
  arrays' gradients summed over the chunks and the bias's, summed over the chunks where it
  has no query axis, each chunk's rows where it has one; each accumulated in the dtype its
  ``learned`` or ``bias`` entry names. One chunk (``count == T``) runs without a scan."""
  if T % count:
    raise ValueError(f"count: must divide T = {T}, got {count}")
  like = lambda d, x: d.astype(x.dtype)
  if count == T:
    d_learned, d_bias = chunk(0)
    d_learned = [like(d, x) for d, x in zip(d_learned, learned)]
    return d_learned, None if bias is None or d_bias is None else like(d_bias, bias)

  def step(sums: Any, first: Any) -> Any:
    d_learned, d_bias = chunk(first)
    d_learned = [a + like(d, a) for a, d in zip(sums[0], d_learned)]
    if sums[1] is None:
      return (d_learned, None), None
    d_bias = like(d_bias, sums[1])
    if d_bias.shape[2] == 1:  # no query axis: summed over the chunks
      return (d_learned, sums[1] + d_bias), None
    return (d_learned, lax.dynamic_update_slice_in_dim(sums[1], d_bias, first, 2)), None

  zeros = [jnp.zeros(x.shape, x.dtype) for x in learned]
  d_bias = None if bias is None else jnp.zeros(bias.shape, bias.dtype)
  firsts = jnp.arange(0, T, count, dtype=jnp.int32)
  (d_learned, d_bias), _ = lax.scan(step, (zeros, d_bias), firsts)
  return d_learned, d_bias


def bias_rows(shape: Sequence[int], count: int) -> tuple[int, ...]:
  """A rank-4 bias's shape cut to ``count`` query rows (its query axis, 2, kept at 1 where
  it broadcasts): the shape of a chunk's gradient of it."""
  return (shape[0], shape[1], min(shape[2], count), shape[3])
