"""Sparse attention patterns: block-sparse layouts, BigBird and Longformer.

A block-sparse layout is a boolean table over (query block, key/value block)
pairs (splash attention's block masks): :func:`block_sparse` turns one into a
mask whose tile classes are exact for any tile size, so blockwise attention
costs in proportion to the tiles the layout touches. :func:`bigbird_layout`
draws BigBird's layout in NumPy from a seed; :func:`bigbird` and
:func:`longformer` build the two papers' patterns as masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks, _compat
from jattn.masks import indexing as ix
from jattn.masks.core import STATIC, Mask
from jattn.masks.indexing import Extents
from jattn.masks.kinds import Causal, global_tokens, sliding_window
from jattn.masks.tiles import Bounds, Tiles

__all__ = ["BlockSparse", "block_sparse", "longformer", "bigbird_layout", "bigbird"]


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class BlockSparse(Mask):
  """``layout[..., q_idx // block_q, kv_idx // block_kv]``; False past the layout's blocks."""

  layout: Any
  block_q: int = field(metadata=STATIC)
  block_kv: int = field(metadata=STATIC)

  def __call__(
    self, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    table = ix.as_rank(self.layout, 4)
    nqb, nkb = table.shape[-2:]
    qb, kb = q_idx // self.block_q, kv_idx // self.block_kv
    inside = (qb < nqb) & (kb < nkb)
    index = tuple(0 if n == 1 else i for n, i in zip(table.shape, (batch, head, qb, kb)))
    return table.at[index].get(mode="clip") & inside

  def tile_bounds(self, t: Tiles) -> Bounds:
    # A (query tile, key/value tile) covers a rectangle of layout blocks and
    # holds at least one position of each of them, so counting the allowed
    # blocks in the rectangle (a summed-area table) classifies it exactly.
    block_q, block_kv, xp = self.block_q, self.block_kv, t.xp
    table = ix.as_rank(self.layout, 4, xp).astype(xp.int32)
    nqb, nkb = table.shape[-2:]
    sat = xp.pad(xp.cumsum(xp.cumsum(table, axis=2), axis=3), ((0, 0), (0, 0), (1, 0), (1, 0)))
    r0 = xp.minimum(t.q_lo // block_q, nqb)  # (1, 1, nq, 1): first block row
    r1 = xp.minimum(t.q_hi // block_q + 1, nqb)  # one past the last
    c0 = xp.minimum(t.kv_lo // block_kv, nkb)  # (1, 1, 1, nk)
    c1 = xp.minimum(t.kv_hi // block_kv + 1, nkb)

    def corner(r: Any, c: Any) -> Any:  # (Bm, Nm, nq, nk), arrays of xp
      r, c = r[0, 0], c[0, 0]
      if xp is np:  # indexed as jax.numpy indexes: negative from the end, then clamped
        r = np.clip(np.where(r < 0, r + nqb + 1, r), 0, nqb)
        c = np.clip(np.where(c < 0, c + nkb + 1, c), 0, nkb)
      return sat[:, :, r, c]

    count = corner(r1, c1) - corner(r0, c1) - corner(r1, c0) + corner(r0, c0)
    inside = (t.q_hi < nqb * block_q) & (t.kv_hi < nkb * block_kv)
    return count > 0, inside & (count == (r1 - r0) * (c1 - c0))

  @property
  def extents(self) -> Extents:
    # The layout's leading axes are batch and heads; its blocks fix no length.
    return ix.array_extents(jnp.shape(self.layout)[:-2] + (1, 1))

  def __repr__(self) -> str:
    sizes = (self.block_q, self.block_kv)
    return f"block_sparse({ix.shape_str(self.layout)}, block_size={sizes!r})"


def block_sparse(layout: ArrayLike, block_size: int | tuple[int, int]) -> Mask:
  """A block-sparse layout: query block i may attend to key/value block j where
  ``layout[..., i, j]`` is True (splash attention's block masks, BigBird).

  Args:
    layout: boolean array (nqb, nkb), or (N, nqb, nkb) / (B, N, nqb, nkb) for
      per-head or per-row layouts (size-1 axes broadcast).
    block_size: positions per block, ``b`` or ``(block_q, block_kv)``; query
      ``q`` is in block ``q // block_q``. Positions past the layout's last
      block are masked.

  Tile classes are exact for any tile size, so blockwise attention costs in
  proportion to the tiles the layout touches.

  Example::

      >>> masks.block_sparse(np.eye(2, dtype=bool), 2).materialize(4, 4)[0, 0].astype(int)
      Array([[1, 1, 0, 0],
             [1, 1, 0, 0],
             [0, 0, 1, 1],
             [0, 0, 1, 1]], dtype=int32)
  """
  dtype = _checks.dtype_of(layout)
  if dtype != np.bool_:
    raise TypeError(f"layout must be a boolean array, got dtype {dtype}")
  arr = layout if hasattr(layout, "shape") else np.asarray(layout)
  if np.ndim(arr) not in (2, 3, 4):
    raise ValueError(
      f"layout must have shape (nqb, nkb), (N, nqb, nkb) or (B, N, nqb, nkb), got {np.shape(arr)}"
    )
  if isinstance(block_size, tuple):
    if len(block_size) != 2:
      raise ValueError(
        f"block_size must be an int or a pair (block_q, block_kv), got {block_size!r}"
      )
    block_q, block_kv = (
      _checks.integer(n, b, minimum=1, int32=True)
      for n, b in zip(("block_size[0]", "block_size[1]"), block_size)
    )
  else:
    block_q = block_kv = _checks.integer("block_size", block_size, minimum=1, int32=True)
  return BlockSparse(arr, block_q, block_kv)


def longformer(window: int | tuple[int, int], *, num_global: int = 1, dilation: int = 1) -> Mask:
  """Longformer's pattern (Beltagy et al. 2020): a sliding window plus global tokens.

  Each position attends to ``window`` positions on each side (or ``(left,
  right)``; ``(w, 0)`` for a causal model, combined with :func:`causal`),
  every ``dilation``-th one (so the window reaches ``dilation · w`` away),
  and the first ``num_global`` positions attend to and are attended by all.
  Equal to ``sliding_window(d·l, d·r, dilation=d) | global_tokens(num_global)``.
  """
  if isinstance(window, tuple):
    if len(window) != 2:
      raise ValueError(f"window must be an int or a pair (left, right), got {window!r}")
    left, right = (
      _checks.integer(n, w, minimum=0, int32=True)
      for n, w in zip(("window[0]", "window[1]"), window)
    )
  else:
    left = right = _checks.integer("window", window, minimum=0, int32=True)
  dilation = _checks.integer("dilation", dilation, minimum=1, int32=True)
  _checks.integer("window times dilation", max(left, right) * dilation, int32=True)
  local = sliding_window(left * dilation, right * dilation, dilation=dilation)
  num_global = _checks.integer("num_global", num_global, minimum=0, int32=True)
  return local | global_tokens(num_global) if num_global else local


def bigbird_layout(
  num_q_blocks: int,
  num_kv_blocks: int | None = None,
  *,
  num_window_blocks: int = 3,
  num_global_blocks: int = 1,
  num_random_blocks: int = 2,
  seed: int = 0,
  causal: bool = False,
) -> np.ndarray:
  """BigBird's block layout (Zaheer et al. 2020) as a boolean (nqb, nkb) NumPy array.

  Query block i sees the ``num_window_blocks`` blocks centred on block i
  (an odd number), the first ``num_global_blocks`` blocks (which in turn
  see everything), and ``num_random_blocks`` other blocks drawn without
  replacement from those not already allowed, from
  ``numpy.random.default_rng(seed)``: the same seed gives the same layout.
  With ``causal`` only blocks j <= i are allowed and drawn from, so each row
  keeps its random blocks under a causal mask.
  """
  nqb = _checks.integer("num_q_blocks", num_q_blocks, minimum=1)
  nkb = nqb if num_kv_blocks is None else _checks.integer("num_kv_blocks", num_kv_blocks, minimum=1)
  window = _checks.integer("num_window_blocks", num_window_blocks, minimum=0)
  if window % 2 == 0 and window:
    raise ValueError(
      f"num_window_blocks must be odd (centred on the query block) or 0, got {window}"
    )
  n_global = _checks.integer("num_global_blocks", num_global_blocks, minimum=0)
  n_random = _checks.integer("num_random_blocks", num_random_blocks, minimum=0)
  seed = _checks.integer("seed", seed, minimum=0)
  i, j = np.arange(nqb)[:, None], np.arange(nkb)[None, :]
  layout = (np.abs(i - j) <= window // 2) if window else np.zeros((nqb, nkb), bool)
  layout |= (i < n_global) | (j < n_global)
  if _checks.boolean("causal", causal):
    layout &= j <= i
  rng = np.random.default_rng(seed)
  for row in range(n_global, nqb):
    free = np.flatnonzero(~layout[row] & ((j[0] <= row) if causal else True))
    layout[row, rng.choice(free, size=min(n_random, free.size), replace=False)] = True
  return layout


def bigbird(
  q_len: int,
  kv_len: int | None = None,
  *,
  block_size: int = 64,
  num_window_blocks: int = 3,
  num_global_blocks: int = 1,
  num_random_blocks: int = 2,
  seed: int = 0,
  causal: bool = False,
) -> Mask:
  """BigBird's sparse pattern for ``q_len`` queries and ``kv_len`` keys/values:
  ``block_sparse(bigbird_layout(...), block_size)``; see :func:`bigbird_layout`.

  The random blocks are fixed by ``seed`` (one layout shared by every batch
  row and head), so the forward and backward passes and every step of
  training see the same pattern. ``causal=True`` draws them from the past
  and combines the layout with ``causal()``, for decoders.

  Example::

      >>> m = masks.bigbird(4096, block_size=64, seed=0)
      >>> float(m.materialize(4096, 4096).mean())  # most rows: 3 + 1 + 2 of 64 blocks; row 0: all
      0.107421875
  """
  q_len = _checks.integer("q_len", q_len, minimum=1)
  kv_len = q_len if kv_len is None else _checks.integer("kv_len", kv_len, minimum=1)
  block_size = _checks.integer("block_size", block_size, minimum=1)
  layout = bigbird_layout(
    math.ceil(q_len / block_size),
    math.ceil(kv_len / block_size),
    num_window_blocks=num_window_blocks,
    num_global_blocks=num_global_blocks,
    num_random_blocks=num_random_blocks,
    seed=seed,
    causal=causal,
  )
  mask = block_sparse(layout, block_size)
  return mask & Causal(0) if causal else mask  # the causal() mask
