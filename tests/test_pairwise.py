"""tests/pairwise.py: every pair of values of every two axes is in some case."""

import itertools

import numpy as np
import pytest
from pairwise import pairwise


def _pairs(cases, axes):
  return {(i, repr(c[i]), j, repr(c[j])) for c in cases for i, j in itertools.combinations(axes, 2)}


@pytest.mark.parametrize("seed", range(20))
def test_every_pair_is_covered(seed):
  rng = np.random.default_rng(seed)
  axes = {f"x{i}": list(range(rng.integers(1, 6))) for i in range(rng.integers(2, 7))}
  cases = pairwise(axes)
  assert all(set(c) == set(axes) for c in cases)
  assert _pairs(cases, axes) == {
    (i, repr(a), j, repr(b))
    for i, j in itertools.combinations(axes, 2)
    for a in axes[i]
    for b in axes[j]
  }
  sizes = sorted(len(v) for v in axes.values())
  assert sizes[-1] * sizes[-2] <= len(cases) <= int(np.prod(sizes))


def test_small_cases_and_errors():
  assert pairwise({"a": [1, 2]}) == [{"a": 1}, {"a": 2}]
  assert len(pairwise({"a": [1, 2], "b": "xyz"})) == 6
  assert len(pairwise({f"x{i}": [0, 1] for i in range(6)})) <= 8  # 64 in the full product
  assert len(pairwise({"a": range(4), "b": range(3), "c": range(3), "d": range(2)})) <= 14
  with pytest.raises(ValueError, match="at least one value"):
    pairwise({"a": [1], "b": []})
