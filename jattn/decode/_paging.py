"""The page pool of a paged KV cache: which pages each row holds, and which are free.

A paged cache keeps its tokens in ``P`` pages of ``page_size`` slots. Row ``b``'s
page table ``table[b]`` (M entries) names its pages in order: slot ``s`` of the row
lives in page ``table[b, s // page_size]`` at offset ``s % page_size``; ``-1`` marks
no page. A row's pages are always a prefix of its table, enough for its length.
``free`` (P,) bool marks the pages no row holds.

Both functions here are pure and of fixed shape, so they run inside ``jax.jit``:

* :func:`allocate` gives each row the pages its new length needs, taking free pages
  in ascending order and serving rows in batch order. When the pool runs short, a
  row gets the pages that are left (a prefix of what it needs) and the rest of the
  rows none: its new length is capped at what its pages hold.
* :func:`release` returns rows' pages to the pool and empties their tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def allocate(
  table: jax.Array, free: jax.Array, want: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(table, free, capacity)``: pages for ``want`` (B,) slots per row.

  ``capacity`` (B,) int32 is the number of slots each row's pages hold afterwards, at
  least ``want`` unless the pool ran out."""
  B, M = table.shape
  P = free.shape[0]
  first_slot = jnp.arange(M, dtype=jnp.int32)[None, :] * page_size
  need = (first_slot < want[:, None]) & (table < 0)  # (B, M), row-major order of service
  rank = (jnp.cumsum(need.reshape(-1)) - 1).reshape(B, M)
  free_ids = jnp.nonzero(free, size=P, fill_value=P)[0].astype(jnp.int32)  # ascending
  got = need & (rank < jnp.sum(free))
  ids = free_ids[jnp.clip(rank, 0, P - 1)]
  table = jnp.where(got, ids, table).astype(jnp.int32)
  free = free.at[jnp.where(got, ids, P).reshape(-1)].set(False, mode="drop")
  capacity = jnp.sum(table >= 0, axis=1, dtype=jnp.int32) * page_size
  return table, free, capacity


def pages_needed(
  table: jax.typing.ArrayLike, want: jax.typing.ArrayLike, page_size: int
) -> np.ndarray:
  """(B,) how many new pages each row needs for ``want`` slots; concrete arrays only."""
  table, want = np.asarray(table), np.asarray(want)
  held = np.sum(table >= 0, axis=1)
  return np.maximum(-(-want // page_size) - held, 0)


def release(table: jax.Array, free: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(table, free)`` with the pages of rows where ``rows`` (B,) is True back in the pool."""
  P = free.shape[0]
  back = rows[:, None] & (table >= 0)
  free = free.at[jnp.where(back, table, P).reshape(-1)].set(True, mode="drop")
  return jnp.where(rows[:, None], -1, table).astype(table.dtype), free
