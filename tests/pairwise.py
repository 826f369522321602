"""All-pairs test cases: every value of each axis meets every value of every other axis in
some case, in far fewer cases than the full cross-product.

Each case compiles its own programs, so where a test's axes act independently (a bug that
needs three settings at once is the rare one) covering pairs keeps the coverage of the
cross-product at the cost of its largest two axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


def pairwise(axes: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
  """Cases (dicts axis -> value) covering every pair of values of every two axes.

  Greedy and deterministic: each new case starts from the first pair not yet covered and
  fills the other axes with the value that covers the most new pairs (the first on ties).
  A single axis gives one case per value.

  >>> len(pairwise({"a": [1, 2, 3], "b": "xy", "c": [True, False]}))
  6
  """
  names = list(axes)
  sizes = [len(axes[n]) for n in names]
  if any(size == 0 for size in sizes):
    raise ValueError(f"every axis needs at least one value, got sizes {dict(zip(names, sizes))}")
  if len(names) == 1:
    return [{names[0]: value} for value in axes[names[0]]]
  uncovered = {
    (i, a, j, b)
    for i, j in itertools.combinations(range(len(names)), 2)
    for a in range(sizes[i])
    for b in range(sizes[j])
  }
  rows = []
  while uncovered:
    i, a, j, b = min(uncovered)
    row: dict[int, int] = {i: a, j: b}
    for k in range(len(names)):
      if k in row:
        continue

      def gain(c, k=k):
        return sum(
          (min(k, m), c if k < m else v, max(k, m), v if k < m else c) in uncovered
          for m, v in row.items()
        )

      row[k] = max(range(sizes[k]), key=lambda c: (gain(c), -c))
    for (p, x), (q, y) in itertools.combinations(sorted(row.items()), 2):
      uncovered.discard((p, x, q, y))
    rows.append(row)
  return [{names[k]: axes[names[k]][row[k]] for k in range(len(names))} for row in rows]
