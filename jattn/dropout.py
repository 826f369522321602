"""Dropout on attention weights, as a pure function of indices.

Whether the weight of (batch, head, q_idx, kv_idx) is kept depends on the rng
and those four indices only — not on shapes, tiles or the order of work — so a
tiled implementation regenerates, tile by tile, exactly the mask the
materialised one draws for the same rng, in the forward and backward pass.

The bits come from the Threefry-2x32 hash (20 rounds, as ``jax.random``): a
per-(batch, head) key is hashed from the rng, then ``(q_idx, kv_idx)`` is
hashed under that key. It is written with jnp integer ops so it fuses into the
surrounding computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks

__all__ = [
  "threefry2x32",
  "seed_words",
  "keep_mask",
  "shared_indices",
  "keep_from_seed",
]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(
  key: tuple[ArrayLike, ArrayLike], count: tuple[ArrayLike, ArrayLike]
) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 with 20 rounds on broadcastable uint32 arrays; returns two words.

  Bit-identical to ``jax.extend.random.threefry2x32_p`` (tested), but elementwise
  and broadcasting.
  """
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
  x0 = jnp.asarray(count[0], jnp.uint32) + ks[0]
  x1 = jnp.asarray(count[1], jnp.uint32) + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def seed_words(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 words :func:`keep_from_seed` hashes under, drawn from a key."""
  words = jax.random.bits(rng, (2,), jnp.uint32)
  return words[0], words[1]


def keep_mask(
  rng: jax.Array,
  rate: float,
  batch: ArrayLike,
  head: ArrayLike,
  q_idx: ArrayLike,
  kv_idx: ArrayLike,
) -> jax.Array:
  """Booleans: True where the attention weight is kept (probability ``1 - rate``).

  Args:
    rng: a ``jax.random.key`` or legacy ``PRNGKey``.
    rate: the dropout rate in [0, 1).
    batch, head, q_idx, kv_idx: broadcastable int arrays of global indices
      (see :func:`jattn.masks.index_grid`).

  Returns:
    bool array of the broadcast shape of the indices.
  """
  rate = _checks.real("rate", rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"rate must be in [0, 1), got {rate}")
  return keep_from_seed(seed_words(rng), rate, batch, head, q_idx, kv_idx)


def shared_indices(
  batch: ArrayLike, head: ArrayLike, q_idx: ArrayLike, kv_idx: ArrayLike
) -> tuple[jax.Array, jax.Array, ArrayLike, ArrayLike]:
  """Indices for a pattern shared across batch rows and heads: batch and head set to 0."""
  zero = jnp.zeros((1,) * jnp.ndim(batch), jnp.int32)
  return zero, zero, q_idx, kv_idx


def keep_from_seed(
  seed: tuple[ArrayLike, ArrayLike],
  rate: float,
  batch: ArrayLike,
  head: ArrayLike,
  q_idx: ArrayLike,
  kv_idx: ArrayLike,
) -> jax.Array:
  """:func:`keep_mask` from :func:`seed_words`, unchecked: for implementations.

  A tiled implementation draws the seed once and calls this on each tile's
  global indices.
  """
  as_u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  key_bh = threefry2x32(seed, (as_u32(batch), as_u32(head)))
  bits, _ = threefry2x32(key_bh, (as_u32(q_idx), as_u32(kv_idx)))
  threshold = np.uint32(min(int(rate * 2.0**32), 2**32 - 1))
  return bits >= threshold
