"""Tiling for :mod:`jattn.impl.blockwise`: which tiles to visit, and one tile's scores.

The schedule: :func:`tile_classes` classifies every (query tile, key/value tile) pair as
EMPTY, PARTIAL or FULL over all batch rows and heads (from the mask's
:meth:`~jattn.masks.Mask.block_view`, with tiles that hold padding at most PARTIAL), and
:func:`schedule` orders each row's tiles FULL first, then PARTIAL, so that :func:`visit`
runs two loops with those trip counts and never touches an EMPTY tile.

The tiles: reshapes between (B, L, K, H) arrays and stacks of tiles (GQA's G query heads
of a key/value head stacked into one (G · block_q)-row matrix), the bias window of a tile,
and :func:`tile`, the scores, mask and dropout of one tile that the forward pass and both
backward passes share, with :func:`d_probs`, the dA = dY Vᵀ of one tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jattn import dropout as _dropout
from jattn import masks
from jattn.impl import common
from jattn.masks import indexing

__all__ = [
  "Carry",
  "Consts",
  "Static",
  "Schedule",
  "tile_classes",
  "schedule",
  "heaviest_last",
  "seq_tiles",
  "stack_heads",
  "unstack_heads",
  "query_tiles",
  "untile_queries",
  "row_tiles",
  "tile_indices",
  "pad_bias",
  "bias_window",
  "Seed",
  "Tile",
  "tile",
  "keep_scale",
  "d_probs",
  "visit",
]

Carry = TypeVar("Carry")

Consts = tuple[Sequence[Any], Sequence[Any]]
"""(mask constants, score function constants), hoisted out of their closures."""


class Static(NamedTuple):
  """Hashable settings of one call: the custom_vjp's non-differentiable argument."""

  scale: float
  dropout_rate: float
  broadcast_dropout: bool  # one (T, S) dropout pattern for every (batch, head)
  q_len: int  # T
  kv_len: int  # S
  block_q: int
  block_kv: int
  mask_fn: Callable | None  # (q, kv, *consts) -> bool, for every batch row and head
  score_fn: Callable | None  # (s, b, h, q, kv, *consts) -> s


class Schedule(NamedTuple):
  """Which tiles to visit: for each query tile (rows) or key/value tile (columns),
  the other axis's tile indices with FULL tiles first, then PARTIAL, and their counts."""

  order: jax.Array  # (n, m) int32
  num_full: jax.Array  # (n,) int32
  num_partial: jax.Array  # (n,) int32


# --- the schedule -------------------------------------------------------------


def tile_classes(
  mask: masks.Mask | None, B: int, N: int, T: int, S: int, bq: int, bk: int
) -> np.ndarray | jax.Array:
  """(nq, nk) int8 tile classes for all batch rows and heads at once.

  A tile is EMPTY only if it is empty for every (batch, head), FULL only if
  full for all. Tiles that hold padding past T or S are at most PARTIAL, so
  the padding gets masked.
  """
  nq, nk = math.ceil(T / bq), math.ceil(S / bk)
  if mask is None:
    view = np.full((nq, nk), masks.FULL, np.int8)
  else:
    per_head = mask.block_view(T, S, block_q=bq, block_kv=bk, batch_size=B, num_heads=N)
    xp = np if isinstance(per_head, np.ndarray) else jnp
    lo = xp.min(per_head, axis=(0, 1))
    hi = xp.max(per_head, axis=(0, 1))
    view = xp.where(
      lo == masks.FULL, masks.FULL, xp.where(hi == masks.EMPTY, masks.EMPTY, masks.PARTIAL)
    ).astype(np.int8)
  xp = np if isinstance(view, np.ndarray) else jnp
  edge = xp.zeros((nq, nk), bool)
  if T % bq:
    edge = edge | (xp.arange(nq) == nq - 1)[:, None]
  if S % bk:
    edge = edge | (xp.arange(nk) == nk - 1)[None, :]
  return xp.where(edge & (view == masks.FULL), masks.PARTIAL, view).astype(np.int8)


def schedule(view: np.ndarray | jax.Array) -> Schedule:
  """For each row of ``view``: its column indices, FULL first, then PARTIAL, then EMPTY."""
  xp = np if isinstance(view, np.ndarray) else jnp
  rank = xp.where(view == masks.FULL, 0, xp.where(view == masks.PARTIAL, 1, 2))
  order = xp.argsort(rank, axis=1, stable=True).astype(np.int32)
  num_full = xp.sum(view == masks.FULL, axis=1).astype(np.int32)
  num_partial = xp.sum(view == masks.PARTIAL, axis=1).astype(np.int32)
  return Schedule(order, num_full, num_partial)


def heaviest_last(schedule: Schedule) -> bool:
  """Whether a known schedule's rows grow heavier along the axis (a causal mask's query
  tiles): the centre of their tile counts lies past the middle. A kernel that launches one
  program per row takes the rows from the last, so that the longest programs start first
  and the short ones fill the end. False for an even spread and for a traced schedule."""
  if isinstance(schedule.num_full, jax.core.Tracer):
    return False
  work = np.asarray(schedule.num_full, np.int64) + np.asarray(schedule.num_partial, np.int64)
  return int(np.sum(work * (2 * np.arange(work.size) - (work.size - 1)))) > 0


# --- tiles --------------------------------------------------------------------


def seq_tiles(x: jax.Array, block: int) -> jax.Array:
  """(B, L, K, H) -> (ceil(L / block), B, K, block, H), zero-padded along L."""
  B, L, K, H = x.shape
  n = math.ceil(L / block)
  x = jnp.pad(x, ((0, 0), (0, n * block - L), (0, 0), (0, 0)))
  return x.reshape(B, n, block, K, H).transpose(1, 0, 3, 2, 4)


def stack_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """(..., N, block, X) -> (..., K, G · block, X): each key/value head's G query heads stacked
  into one matrix.

  Written as a split and a merge, two reshapes that JAX carries a sharding in types through
  (Explicit mode: heads sharded over a mesh axis end up on K, or on G where K is too small).
  """
  *lead, N, block, X = x.shape
  G = N // num_kv_heads
  return x.reshape(*lead, num_kv_heads, G, block, X).reshape(*lead, num_kv_heads, G * block, X)


def unstack_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """The inverse of :func:`stack_heads`: (..., K, G · block, X) -> (..., N, block, X)."""
  *lead, K, rows, X = x.shape
  G = num_heads // K
  return x.reshape(*lead, K, G, rows // G, X).reshape(*lead, num_heads, rows // G, X)


def query_tiles(x: jax.Array, block: int, num_kv_heads: int) -> jax.Array:
  """(B, T, N, H) -> (nq, B, K, G · block, H): each key/value head's G query heads stacked."""
  return stack_heads(seq_tiles(x, block), num_kv_heads)  # from (nq, B, N, block, H)


def untile_queries(x: jax.Array, num_heads: int, length: int) -> jax.Array:
  """The inverse of :func:`query_tiles`: (nq, B, K, G · block, H) -> (B, T, N, H)."""
  x = unstack_heads(x, num_heads).transpose(1, 0, 3, 2, 4)  # (B, nq, block, N, H)
  B, nq, block, N, H = x.shape
  return x.reshape(B, nq * block, N, H)[:, :length]


def row_tiles(x: jax.Array, block: int) -> jax.Array:
  """Per-row statistics (B, T, N) -> (nq, B, N, block, 1), zero-padded."""
  B, T, N = x.shape
  n = math.ceil(T / block)
  x = jnp.pad(x, ((0, 0), (0, n * block - T), (0, 0)))
  return x.reshape(B, n, block, N).transpose(1, 0, 3, 2)[..., None]


def tile_indices(
  B: int, N: int, bq: int, bk: int, qi: jax.Array | int, ki: jax.Array | int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Global (batch, head, q_idx, kv_idx) of tile (qi, ki), broadcasting to (B, N, bq, bk)."""
  return (  # concrete batch index: masks take along sequences
    indexing.index_array(np.arange(B), 0),
    indexing.index_array(np.arange(N), 1),
    (qi * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, bq, 1),
    (ki * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, bk),
  )


def pad_bias(bias: jax.Array | None, static: Static) -> jax.Array | None:
  """Bias (Bb, Nb, Tb, Sb) with its T and S axes (where not 1) padded to whole tiles."""
  if bias is None:
    return None
  pads = [(0, 0), (0, 0)]
  for size, length, block in (
    (bias.shape[2], static.q_len, static.block_q),
    (bias.shape[3], static.kv_len, static.block_kv),
  ):
    pads.append((0, 0) if size == 1 else (0, math.ceil(length / block) * block - length))
  return jnp.pad(bias, pads)


def bias_window(
  bias: jax.Array, static: Static, qi: jax.Array | int, ki: jax.Array | int
) -> tuple[tuple[jax.Array, ...], tuple[int, int, int, int]]:
  """Start and size of tile (qi, ki) in a padded bias, for dynamic_slice."""
  Bb, Nb, Tb, Sb = bias.shape
  start = (0, 0, 0 if Tb == 1 else qi * static.block_q, 0 if Sb == 1 else ki * static.block_kv)
  size = (Bb, Nb, 1 if Tb == 1 else static.block_q, 1 if Sb == 1 else static.block_kv)
  return tuple(jnp.asarray(x, jnp.int32) for x in start), size


class Seed(NamedTuple):
  """Dropout's seed words (2,) uint32, and the global positions it is drawn at (a
  :attr:`CallSpec.positions`, None on one device)."""

  words: jax.Array
  positions: Any = None


class Tile(NamedTuple):
  """What the forward and backward passes share for one (query tile, key/value tile)."""

  s: jax.Array  # (B, N, bq, bk) scores after bias and score_fn, float32/64
  keep: jax.Array | None  # mask, None on FULL tiles
  drop: jax.Array | None  # dropout keep mask
  score_vjp: Callable | None  # d_s -> (d_s before score_fn, *d_score_consts)


def tile(
  static: Static,
  q_tile: jax.Array,
  k_tile: jax.Array,
  bias: jax.Array | None,
  seed: Seed | None,
  consts: tuple[Sequence[Any], Sequence[Any]],
  qi: jax.Array | int,
  ki: jax.Array | int,
  *,
  masked: bool,
  with_vjp: bool = False,
) -> Tile:
  """Scores, mask and dropout of tile (qi, ki); q_tile (B, K, G·bq, H), k_tile (B, K, bk, H)."""
  mask_consts, score_consts = consts
  B, K, rows, _ = q_tile.shape
  bq, bk = static.block_q, static.block_kv
  N = rows // bq * K
  dtype = common.stats_dtype(q_tile.dtype)
  s = jnp.einsum("BKrH,BKkH->BKrk", q_tile, k_tile, preferred_element_type=dtype)
  if not common.scales_queries(q_tile.dtype):  # else the tiles come pre-scaled
    s = s * jnp.asarray(static.scale, dtype)
  s = unstack_heads(s, N)  # (B, N, bq, bk)
  if bias is not None:
    start, size = bias_window(bias, static, qi, ki)
    s = s + jax.lax.dynamic_slice(bias, start, size).astype(dtype)
  idx = tile_indices(B, N, bq, bk, qi, ki)
  score_vjp = None
  score_fn = static.score_fn
  if score_fn is not None:
    if with_vjp:
      s, score_vjp = jax.vjp(lambda s, *c: score_fn(s, *idx, *c), s, *score_consts)
    else:
      s = score_fn(s, *idx, *score_consts)
  keep = None
  if masked:
    b, h, q, kv = idx
    keep = (q < static.q_len) & (kv < static.kv_len)
    if static.mask_fn is not None:
      keep = keep & static.mask_fn(q, kv, *mask_consts)
  drop = None
  if static.dropout_rate:
    assert seed is not None, "dropout draws its seed words whenever dropout_rate > 0"
    drop_idx = common.at_positions(idx, seed.positions)
    drop_idx = _dropout.shared_indices(*drop_idx) if static.broadcast_dropout else drop_idx
    drop = _dropout.keep_from_seed((seed.words[0], seed.words[1]), static.dropout_rate, *drop_idx)
  return Tile(s, keep, drop, score_vjp)


def keep_scale(static: Static, dtype: DTypeLike) -> jax.Array | None:
  """Inverted dropout's scale 1 / (1 − rate) for kept weights, None without dropout."""
  return None if not static.dropout_rate else jnp.asarray(1 / (1 - static.dropout_rate), dtype)


def d_probs(
  tile: Tile, do_tile: jax.Array, v_tile: jax.Array, keep_scale: jax.Array | None, dtype: DTypeLike
) -> jax.Array:
  """dA = dY Vᵀ of one tile, (B, N, bq, bk), with dropout's kept weights and scale applied.
  The Δ pass and the gradient pass both take it from here, so Δ = rowsum(A ⊙ dA) sums the
  very dA that dS = A ⊙ (dA − Δ) subtracts it from."""
  d_p = jnp.einsum("BKrH,BKkH->BKrk", do_tile, v_tile, preferred_element_type=dtype)
  d_p = unstack_heads(d_p, tile.s.shape[1])
  if tile.drop is None:
    return d_p
  assert keep_scale is not None, "dropout's kept weights come with its scale"
  return jnp.where(tile.drop, d_p * keep_scale, 0)


def visit(
  schedule: Schedule,
  i: jax.Array | int,
  body: Callable[[jax.Array, Carry, bool], Carry],
  carry: Carry,
) -> Carry:
  """Run ``body(j, carry, masked)`` over row ``i``'s FULL tiles, then its PARTIAL ones."""
  n_full, n_partial = schedule.num_full[i], schedule.num_partial[i]
  order = schedule.order[i]
  carry = jax.lax.fori_loop(0, n_full, lambda t, c: body(order[t], c, False), carry)
  return jax.lax.fori_loop(n_full, n_full + n_partial, lambda t, c: body(order[t], c, True), carry)


def tile_of(program: Any, count: int, from_last: bool) -> Any:
  """The tile a kernel's first grid index stands for: the same, or counted from the last
  (``from_last``), so the heaviest rows of a schedule that grows along its axis launch first
  (the grid's first axis varies fastest: each (batch row, head) takes its tiles in this
  order)."""
  return count - 1 - program if from_last else program


def pad_to(x: jax.Array, length: int, width: int) -> jax.Array:
  """(B, L, heads, X) zero-padded to (B, length, heads, width)."""
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, width - x.shape[3])))


def padded_bias(bias: jax.Array, Tp: int, Sp: int) -> jax.Array:
  """Bias (Bb, Nb, Tb, Sb) with its T and S axes, where not 1, zero-padded to Tp and Sp."""
  pads = [(0, 0), (0, 0)] + [(0, 0 if n == 1 else m - n) for n, m in zip(bias.shape[2:], (Tp, Sp))]
  return jnp.pad(bias, pads)
