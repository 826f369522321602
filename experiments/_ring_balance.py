"""Causal load balance of ring attention, computed from the masks alone (no devices).

For a ring over P devices with the sequence in one of ``jattn.parallel.LAYOUTS``,
:func:`work_per_device` counts, for each device and ring step, the (query tile, key/value
tile) pairs that the blockwise kernel visits (tiles not classified EMPTY by
``masks.reindex(masks.causal(), ...)``) and the exact allowed (query, key) pairs;
:func:`balance` gives each layout's max/mean across devices (1.0 = even).

Zigzag pairs are exactly even, striped nearly so. Contiguous: the last device
holds the last T/P rows, (P − 1/2)·(T/P)² pairs against a mean of
P·(T/P)²/2, so pairs max/mean tends to (2P − 1)/P for T/P ≫ 1; counted in
whole shards (ring steps with any work: P on the last device, (P + 1)/2 on
average) it is 2P/(P + 1), which is what tiles as large as a shard give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jattn import masks, parallel


class Work(NamedTuple):
  """Work of each device over a whole ring, shape (P,) each."""

  tiles: np.ndarray  # visited (query, key/value) tiles, in units of a full block_q x block_kv tile
  pairs: np.ndarray  # allowed (query, key) pairs: the exact attention work


def work_per_device(
  layout: str, T: int, P: int, block_q: int, block_kv: int, *, causal: bool = True
) -> Work:
  """Per-device work of a ring over ``P`` devices with the sequence in ``layout``.

  At ring step s device i holds the key/value shard of device j = (i - s) % P;
  its kernel visits every tile of ``masks.reindex(mask, q=pos[i], kv=pos[j])``
  not classified EMPTY (the classification is what the kernel skips on, so it
  is conservative for non-contiguous layouts), and the exact work is the number
  of pairs with kv position <= query position. Tiles at the end of a shard that
  are shorter than a block count by their area.
  """
  L = T // P
  pos = parallel.positions(layout, T, P).reshape(P, L)
  bq, bk = min(block_q, L), min(block_kv, L)
  q_sizes = np.minimum(bq, L - np.arange(0, L, bq))
  kv_sizes = np.minimum(bk, L - np.arange(0, L, bk))
  area = np.outer(q_sizes, kv_sizes) / (bq * bk)
  tiles = np.zeros(P, np.float64)
  pairs = np.zeros(P, np.int64)
  for i in range(P):
    for s in range(P):
      j = (i - s) % P
      if not causal:
        tiles[i] += area.sum()
        pairs[i] += L * L
        continue
      view = masks.reindex(masks.causal(), q=pos[i], kv=pos[j]).block_view(
        L, L, block_q=bq, block_kv=bk
      )[0, 0]
      tiles[i] += area[view != masks.EMPTY].sum()
      pairs[i] += int(np.searchsorted(np.sort(pos[j]), pos[i], side="right").sum())
  return Work(tiles, pairs)


def balance(
  layouts: Sequence[str], T: int, P: int, blocks: tuple[int, int], *, causal: bool
) -> list[dict]:
  """max/mean of each layout's per-device work at ``P`` devices."""
  rows = []
  for layout in layouts:
    work = work_per_device(layout, T, P, *blocks, causal=causal)
    rows.append(
      dict(
        layout=layout,
        P=P,
        tiles=work.tiles.tolist(),
        pairs=work.pairs.tolist(),
        tiles_max_over_mean=float(work.tiles.max() / work.tiles.mean()),
        pairs_max_over_mean=float(work.pairs.max() / work.pairs.mean()),
        total_tiles=float(work.tiles.sum()),
      )
    )
  return rows
