"""Case sets that several test files share: every mask kind at a file's shapes, the score
functions, the implementations a mask or score function must agree across.

Unlike reference.py (independent formulas, no jattn), these are built with jattn's public
constructors: they are the inputs under test, not the ground truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks, scores


def mask_kinds(
  B: int, T: int, S: int, *, ids, window, chunk, prefix, lengths, num_global, stride
) -> dict[str, masks.Mask | None]:
  """Every mask kind once, for a (B, T, S) problem; several leave query rows empty.

  ids: (query ids (B, T), key ids (B, S)); window: (left, right); prefix: (B,) prefix
  lengths; lengths: (query lengths (B,), key lengths (B,)), a key length of 0 empties a
  batch row. The remaining settings are the kinds' single parameters.
  """
  return {
    "none": None,
    "causal": masks.causal(),
    "causal_empty_rows": masks.causal(-2),
    "window": masks.sliding_window(*window),
    "chunked": masks.chunked(chunk),
    "prefix_lm": masks.prefix_lm(np.array(prefix)),
    "segments": masks.segments(*ids),
    "lengths_empty_rows": masks.lengths(np.array(lengths[0]), np.array(lengths[1])),
    "global": masks.global_tokens(num_global),
    "strided": masks.strided(stride),
    "from_array": masks.from_array(np.random.default_rng(0).random((B, 1, T, S)) < 0.5),
    "from_fn": masks.from_fn(lambda b, h, q, kv: (q + kv + b + h) % 3 != 0),
    "combined": (masks.causal(1) & ~masks.strided(3)) | masks.global_tokens(1),
  }


# Every kind of score function, for SCORE_FN_HEADS query heads: the built-in ones with their
# parameters (ALiBi slopes and a T5 relative-position table, float32) and a plain function.
SCORE_FN_HEADS = 4
SCORE_FNS = {
  "alibi": scores.alibi(np.array([0.5, 0.2, 0.1, 0.05])),
  "relative": scores.relative_position_bias(
    np.linspace(-1, 1, 16 * SCORE_FN_HEADS).reshape(16, SCORE_FN_HEADS),
    num_buckets=16,
    max_distance=8,
  ),
  "soft_cap": scores.soft_cap(1.5),
  "custom": lambda s, b, h, q, kv: s * (1.0 + 0.1 * h) - 0.05 * (q - kv) ** 2,
}


def score_fn_in(fn, dtype):
  """``fn`` with its parameters cast to ``dtype`` (a plain function or None: unchanged)."""
  if isinstance(fn, jattn.ScoreFn):
    fn = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), fn)
  return fn


# The paths a user's mask or score function goes through: materialised, on tiles, and the
# default rule. With 4 x 4 tiles, blockwise evaluates it on 2 x 2 tiles of a TILED_LENGTH
# sequence.
TILED_LENGTH = 8
TILED = {
  "xla": dict(implementation="xla"),
  "blockwise": dict(implementation="blockwise", block_q=4, block_kv=4),
  "auto": {},
}
