"""How masks read the arrays they hold, and the extents those arrays fix.

Constructors keep arrays as given and reshape them where they are read, inside
traced code: building a mask runs no computation, so a call with bad
arguments fails before anything is compiled.

Per-row values (a causal offset, a prefix or a padding length) are given as
a scalar or (B,); ids along a sequence (segment ids) as (L,) or (B, L); a size
1 axis broadcasts. A mask's *extents* are the (B, N, T, S) its arrays fix,
None where it broadcasts; combining masks checks that they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks

__all__ = [
  "Extents",
  "NO_EXTENTS",
  "checked_maps",
  "through_maps",
  "index_array",
  "merge_extents",
  "fixed",
  "array_extents",
  "batch_size",
  "shared_batch",
  "as_rank",
  "at_batch",
  "batch_index",
  "take",
  "shape_str",
]

Extents = tuple  # (B, N, T, S), each an int or None when the mask does not fix it.

NO_EXTENTS: Extents = (None, None, None, None)


def checked_maps(**maps: ArrayLike | None) -> list[Any]:
  """Index maps by name (batch, head, q, kv), each an int (L,) array or None, checked; the
  query's may also be (B, L), a row of positions per batch row."""
  checked = {
    name: None if m is None else _checks.int_array(name, m, ranks=(1, 2) if name == "q" else (1,))
    for name, m in maps.items()
  }
  q, batch = checked.get("q"), checked.get("batch")
  if q is not None and q.ndim == 2 and batch is not None and q.shape[0] != batch.shape[0]:
    raise ValueError(
      f"q must have a row of positions per batch row, {batch.shape[0]} as batch maps, got {q.shape}"
    )
  return list(checked.values())


def through_maps(maps: Sequence[Any], idx: Sequence[Any]) -> tuple[Any, ...]:
  """Broadcasting (batch, head, q, kv) indices ``idx``, each taken through its map in ``maps``
  (an int (L,) array, or for the query a (B, L) one read at the batch index too; None keeps
  the index): what a mask or score function written in other positions sees
  (``masks.reindex``, ``scores.reindex``, a sequence-parallel part's dropout)."""
  b = idx[0]
  return tuple(
    i if m is None else jnp.asarray(m).at[(b, i) if jnp.ndim(m) == 2 else i].get(mode="clip")
    for m, i in zip(maps, idx, strict=True)
  )


def index_array(positions: np.ndarray, axis: int) -> jax.Array:
  """``positions`` as an int32 jax array along ``axis`` of a rank-4 grid.

  Built in NumPy and transferred: concrete even under jit (see :func:`take`),
  and no XLA program is compiled for it, so argument checks that evaluate
  masks on index grids compile nothing.
  """
  shape = [1, 1, 1, 1]
  shape[axis] = -1
  with jax.ensure_compile_time_eval():
    return jax.device_put(np.asarray(positions, np.int32).reshape(shape))


def merge_extents(a: Extents, b: Extents, what: str) -> Extents:
  """The extents two masks fix together; raises where both fix a size and differ."""
  names = ("batch size", "number of heads", "query length", "key/value length")
  merged = []
  for name, x, y in zip(names, a, b):
    if x is not None and y is not None and x != y:
      raise ValueError(f"cannot combine masks with different {name} in {what}: {x} and {y}")
    merged.append(x if x is not None else y)
  return tuple(merged)


def fixed(n: int) -> int | None:
  """A dimension of size 1 broadcasts, so it fixes nothing."""
  return None if n == 1 else n


def array_extents(shape: Sequence[int]) -> Extents:
  """(B, N, T, S) fixed by an array broadcast to rank 4 (leading size-1 dims added)."""
  return tuple(fixed(n) for n in (1,) * (4 - len(shape)) + tuple(shape))


def batch_size(arr: ArrayLike, rank: int) -> int | None:
  """The batch size fixed by an array whose batched form has ``rank`` dims (None: broadcasts)."""
  shape = jnp.shape(arr)
  return fixed(shape[0]) if len(shape) == rank else None


def shared_batch(arrays: Iterable[ArrayLike | None], rank: int, names: str) -> int | None:
  """The one batch size per-batch ``arrays`` (None entries skipped) fix; they must agree."""
  sizes = {n for a in arrays if a is not None if (n := batch_size(a, rank)) is not None}
  if len(sizes) > 1:
    raise ValueError(f"{names} must have the same batch size, got {sorted(sizes)}")
  return sizes.pop() if sizes else None


def as_rank(arr: ArrayLike, rank: int, xp: ModuleType = jnp) -> Any:
  """``arr`` with leading size-1 dimensions added up to ``rank``, an array of ``xp``."""
  out = xp.asarray(arr)
  return out.reshape((1,) * (rank - out.ndim) + out.shape)


def at_batch(arr: ArrayLike, b: jax.Array) -> jax.Array:
  """``arr[b]`` for per-batch values given as a scalar or (Bm,); Bm == 1 broadcasts."""
  arr = jnp.asarray(arr).reshape(-1)
  if arr.shape[0] == 1:
    return arr[0]
  if _is_iota(b, arr.shape[0]):
    # Every batch row in order: a reshape, not a gather by b, so a batch sharded in Explicit
    # mode stays sharded (a gather's sharding is ambiguous there).
    return arr.reshape(jnp.shape(b))
  return arr[b]


def batch_index(arr: ArrayLike, xp: ModuleType) -> Any:
  """Per-batch values shaped (Bm, 1, 1, 1) to broadcast against tiles, an array of ``xp``."""
  return xp.asarray(arr).reshape(-1, 1, 1, 1)


def take(ids: ArrayLike, b: jax.Array, idx: jax.Array) -> jax.Array:
  """``ids[b, idx]`` for ids given as (Bm, L) or (L,), clamping out-of-range positions."""
  arr: jax.Array = as_rank(ids, 2)
  if arr.shape[0] == 1:
    return arr[0].at[idx].get(mode="clip")
  if _is_iota(b, arr.shape[0]) and sum(n != 1 for n in jnp.shape(idx)) <= 1:
    # Every batch row with one index vector: a take along the sequence axis
    # keeps the batch axis a plain array axis, which sharding propagation
    # splits across devices (a gather by (b, idx) makes it gather the ids).
    rows = jnp.take(arr, jnp.ravel(idx), axis=1, mode="clip")
    shape = [arr.shape[0] if n == 0 else 1 for n in range(jnp.ndim(idx))]
    # The index vector's axis is its one axis of size other than 1 (0 for an empty sequence);
    # sizes are given, not -1, which a reshape cannot infer when the batch is empty.
    axis = next((i for i, n in enumerate(jnp.shape(idx)) if n != 1), len(shape) - 1)
    shape[axis] = int(np.size(idx))
    return rows.reshape(shape)
  return arr.at[b, idx].get(mode="clip")


def _is_iota(b: jax.Array, n: int) -> bool:
  """Whether ``b`` is the concrete batch index ``arange(n)`` along its first axis."""
  shape = jnp.shape(b)
  if not shape or shape[0] != n or any(d != 1 for d in shape[1:]):
    return False
  if not _checks.is_concrete(b):
    return False
  return bool(np.array_equal(np.ravel(np.asarray(b)), np.arange(n)))


def shape_str(arr: ArrayLike) -> str:
  """``shape=(...)``, how reprs name an array a mask holds."""
  return "shape=" + str(tuple(jnp.shape(arr)))
