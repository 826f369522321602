"""ALiBi's per-head slopes (Press et al., 2022)."""

from __future__ import annotations

import numpy as np

from jattn import _checks


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes (Press et al., 2022), for :func:`jattn.scores.alibi`.

  For N a power of two, head h (from 1) gets ``2 ** (-8 h / N)``. Otherwise,
  with n the largest power of two below N, the n slopes of n heads are
  followed by the first N - n of every other slope of 2n heads (``2 ** (-8 h
  / (2n))`` for odd h), exactly as ``get_slopes`` in
  ofirpress/attention_with_linear_biases.

  Args:
    num_heads: N, a positive int.

  Returns:
    (N,) NumPy float32 array of slopes in (0, 1).

  Example::

      >>> from jattn import positional, scores
      >>> positional.alibi_slopes(6).tolist()
      [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
      >>> fn = scores.alibi(positional.alibi_slopes(6))
  """
  num_heads = _checks.integer("num_heads", num_heads, minimum=1)
  n = 1 << (num_heads.bit_length() - 1)  # largest power of two <= N
  slopes = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
  if n < num_heads:
    extra = 2.0 ** (-8.0 * np.arange(1, 2 * n + 1, 2) / (2 * n))
    slopes = np.concatenate([slopes, extra[: num_heads - n]])
  return slopes.astype(np.float32)
