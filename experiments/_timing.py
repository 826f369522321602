"""Timing and table cells shared by the benchmarks.

Timing on a small shared CPU is treacherous: the call right after another method
(jax.nn freeing its (B, N, T, S) scores, another library's threads still spinning)
or after a pause runs up to 4x slower, whatever it is, and single calls of a few
milliseconds vary by a third. So :func:`rounds_ms` times each method as a block of
back-to-back calls after an untimed one and keeps the block's median, and the
methods' blocks alternate in rounds, in an order that rotates from round to round
so that no method always follows the same one. Compare methods by
:func:`median_ratio`, the median of per-round ratios: the machine's drift over
minutes then reaches both sides of every ratio alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np


def block_ms(fn: Callable, args, calls: int) -> float:
  """The median, in milliseconds, of ``calls`` back-to-back calls of ``fn(*args)`` after one
  untimed call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def calls_for(fn: Callable, args, min_seconds: float, most: int = 200, least: int = 3) -> int:
  """How many calls make a block last about ``min_seconds`` (at least ``least``, at most
  ``most``), from one warm-up call (which also compiles) and one timed call."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - start
  return max(least, min(most, int(min_seconds / max(once, 1e-6))))


def sized_block_ms(
  fn: Callable, args, *, min_calls: int, min_seconds: float, once_seconds: float = math.inf
) -> tuple[float, int]:
  """One method alone: the median milliseconds per call of a block of back-to-back calls,
  and how many calls that is. One warm-up call and one timed call (:func:`block_ms`) size
  the block (at least ``min_calls``, enough to last about ``min_seconds``, at most 200),
  whose median :func:`block_ms` takes after its own untimed call. A call slower than
  ``once_seconds`` is not repeated: its time is the one timed call."""
  once = block_ms(fn, args, 1)
  if once > once_seconds * 1e3:
    return once, 1
  calls = max(min_calls, min(200, int(min_seconds * 1e3 / once)))
  return block_ms(fn, args, calls), calls


def rounds_ms(
  fns: Mapping[str, tuple[Callable, tuple]],
  rounds: int,
  min_seconds: float = 0.1,
  min_calls: int = 3,
) -> dict[str, np.ndarray]:
  """Per method ``name -> (fn, args)``, its block median (ms per call) in each of ``rounds``
  rounds; a block has at least ``min_calls`` calls (1 suits calls of seconds, whose noise is
  small against their length). In round r the methods take their turns starting from the
  (r mod n)-th, so each follows every other equally often."""
  names = list(fns)
  calls = {name: calls_for(*fns[name], min_seconds, least=min_calls) for name in names}
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      times[name].append(block_ms(*fns[name], calls[name]))
  return {name: np.asarray(t) for name, t in times.items()}


def median_ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
  """The median over rounds of ``numerator / denominator`` (two :func:`rounds_ms` rows)."""
  return float(np.median(np.asarray(numerator) / np.asarray(denominator)))


def fmt(x, spec: str) -> str:
  """A table cell: ``format(x, spec)``, or an em dash for a missing (None or NaN) value."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "—"
  return format(x, spec)
