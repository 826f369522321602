"""The masking and scoring arguments of a call, checked and combined (pieces of
:func:`jattn._validate.build`).

:func:`combined_mask` turns every way of masking (``mask``, ``is_causal``, a window,
sequence lengths, segment ids) into one checked :class:`jattn.masks.Mask`;
:func:`score_function` turns ``score_fn`` and ``logits_soft_cap`` into one checked
:class:`jattn.scores.ScoreFn`; :func:`checked_bias` checks the bias; :func:`segments`
reads segment ids. User functions (``masks.from_fn``, a plain ``score_fn``) are probed on
small grids, since tiled implementations evaluate them tile by tile.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.typing import ArrayLike, DTypeLike

from jattn import _checks, masks, scores
from jattn.impl import common


def combined_mask(
  mask: Any,
  is_causal: bool,
  window: tuple[int, int] | None,
  lengths: Sequence[ArrayLike | None],
  segment_ids: Any,
  unbatched: bool,
  bnts: tuple[int, int, int, int],
) -> masks.Mask | None:
  """Every way of masking as one checked :class:`jattn.masks.Mask`; None when nothing masks."""
  B, N, T, S = bnts
  parts = [_mask(mask)]
  if is_causal:
    parts.append(masks.causal())
  if window is not None:
    parts.append(masks.sliding_window(*window))
  if any(x is not None for x in lengths):
    parts.append(masks.lengths(*lengths))
  if segment_ids is not None:
    parts.append(segments(segment_ids, unbatched, T, S))
  combined = masks.all_of(*(m for m in parts if m is not None))
  if combined is not None:
    _mask_shapes(combined, B, N, T, S)
  return combined


def checked_bias(
  bias: Any, bnts: tuple[int, int, int, int], query_dtype: DTypeLike
) -> jax.Array | np.ndarray | None:
  """``bias`` checked: a floating or integer array broadcastable to (B, N, T, S), an integer
  one cast to the logits' dtype (``promote_types(query_dtype, float32)``, as jax.nn adds it
  to its logits); None stays None. A boolean bias is refused: it would add 1 where True."""
  if bias is None:
    return None
  bias = _checks.as_array("bias", bias)
  if jnp.issubdtype(bias.dtype, jnp.integer):
    bias = bias.astype(jnp.promote_types(query_dtype, np.float32))
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    hint = "; pass boolean masks as mask" if bias.dtype == np.bool_ else ""
    raise TypeError(f"bias must have a floating or integer dtype, got {bias.dtype}{hint}")
  if bias.ndim > 4:
    raise ValueError(f"bias must be broadcastable to (B, N, T, S)={bnts}, got shape {bias.shape}")
  shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
  _checks.broadcastable("bias", shape, bnts, "(B, N, T, S)")
  return bias


def _mask(mask: Any) -> masks.Mask | None:
  if mask is None or isinstance(mask, masks.Mask):
    return mask
  if not hasattr(mask, "dtype") and not isinstance(mask, (list, tuple)):
    raise TypeError(
      f"mask must be a boolean array or a jattn.masks.Mask, got {type(mask).__name__}"
    )
  return masks.from_array(mask)


def _mask_shapes(mask: masks.Mask, B: int, N: int, T: int, S: int) -> None:
  try:
    extents = mask.extents
  except ValueError as e:
    raise ValueError(f"mask: {e}") from None
  names = ("batch size B", "number of heads N", "query length T", "key/value length S")
  for name, own, want in zip(names, extents, (B, N, T, S)):
    if own is not None and own != want:
      raise ValueError(
        f"mask {mask!r} holds arrays for {name}={own}, but the inputs have "
        f"{name}={want}; masks must be broadcastable to (B, N, T, S)="
        f"{(B, N, T, S)}"
      )
  if _checks.hashable(jax.tree.structure(mask)):
    out = _on_grid_jit.eval_shape(mask, B, N, T, S)  # traced once per structure and shapes
  else:  # a setting jit cannot key its cache on (an unhashable from_fn callable)
    out = jax.eval_shape(_on_grid, mask, B, N, T, S)
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise TypeError(f"mask {mask!r} must evaluate to one boolean array, got {type(out).__name__}")
  if out.dtype != np.bool_:
    raise TypeError(f"mask {mask!r} must evaluate to bool, got {out.dtype}")
  if len(out.shape) != 4:
    raise ValueError(
      f"mask {mask!r} must evaluate to a rank-4 array broadcastable to "
      f"(B, N, T, S)={(B, N, T, S)}, got shape {out.shape}"
    )
  _checks.broadcastable(f"mask {mask!r}", tuple(out.shape), (B, N, T, S), "(B, N, T, S)")
  for node in _user_fns(mask):
    _check_on_tiles(f"mask {node!r}", node, (B, N, T, S), exact_shape=False)


def _on_grid(mask: masks.Mask, B: int, N: int, T: int, S: int) -> Any:
  return mask.on_grid(masks.index_grid(B, N, T, S))


_on_grid_jit = jax.jit(_on_grid, static_argnums=(1, 2, 3, 4))


def _scores(score_fn: Callable[..., Any], s: jax.Array) -> Any:
  return score_fn(s, *masks.index_grid(*s.shape))


_scores_jit = jax.jit(_scores, static_argnums=0)


def _user_fns(node: masks.Mask | scores.ScoreFn) -> Iterator[masks.Mask | scores.ScoreFn]:
  """The nodes of a Mask or ScoreFn tree that wrap a user's function (``from_fn``)."""
  if isinstance(node, (masks.kinds.FromFn, scores.FromFn)):
    yield node
  for child in node.children:
    if isinstance(child, (masks.Mask, scores.ScoreFn)):
      yield from _user_fns(child)


def _probe_grids(bnts: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Positions of two small grids that overlap: a tile at an offset (batch 1, head 1, q_idx
  in [1, 3), kv_idx in [2, 4), as far as B, N, T, S allow) and the grid from 0 to the
  tile's end.

  Tiled implementations evaluate masks and score functions on tiles like the first;
  evaluating on both shows whether a function computes from its index arguments. The q
  and kv offsets differ, so functions of a local kv - q are caught too.
  """
  tile, wide = [], []
  for axis, (n, offset) in enumerate(zip(bnts, (1, 1, 1, 2))):
    lo = min(offset, n - 1)
    hi = lo + 1 if axis < 2 else min(lo + 2, n)
    tile.append(np.arange(lo, hi))
    wide.append(np.arange(hi))
  return tile, wide


def _describe_positions(positions: Sequence[np.ndarray]) -> str:
  return ", ".join(
    f"{name} [{p[0]}, {p[-1] + 1})"
    for name, p in zip(("batch", "head", "q_idx", "kv_idx"), positions)
  )


def _probe_args(
  positions: Sequence[np.ndarray], score_dtype: DTypeLike | None
) -> tuple[np.ndarray, ...]:
  """(s, b, h, q, kv) for a score function, (b, h, q, kv) for a mask, on ``positions``."""
  idx = tuple(
    np.asarray(p, np.int32).reshape([-1 if a == axis else 1 for a in range(4)])
    for axis, p in enumerate(positions)
  )
  if score_dtype is None:
    return idx
  b, h, q, kv = idx  # the same score at the same (b, h, q, kv) on every grid
  s = (0.5 * q - 0.25 * kv + 0.125 * h - 0.0625 * b).astype(score_dtype)
  return (s,) + idx


def _on_both(fn: Callable[..., Any], n: int, *arrays: Any) -> tuple[Any, Any]:
  """``fn`` on the first ``n`` arrays and on the rest."""
  return fn(*arrays[:n]), fn(*arrays[n:])


# One program per function and probe shapes, reused by every call that checks that function.
_on_both_jit = jax.jit(_on_both, static_argnums=(0, 1))

# The functions :func:`_check_on_tiles` has passed, each with the probes it passed on; held
# weakly, so a user's function and the arrays it closes over are not kept alive by the check.
_passed: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()


def _values_on_both(key: Any, closed: Any, n: int, args: list[Any]) -> tuple[Any, Any]:
  """The function ``key`` (traced to ``closed``) evaluated on both probe grids' arguments
  (``n`` each), as concrete values even while the caller is traced."""
  if not closed.jaxpr.eqns:  # it returns its inputs or constants: nothing to compute
    return jex_core.jaxpr_as_fun(closed)(*args[0], *args[1])
  # jit keys its cache on the function: an unhashable one is evaluated operation by operation
  if _checks.hashable(key):
    # A from_fn mask calls its user's function and nothing else: keyed on that function, a
    # mask built anew from it reuses the program. Compiled ahead and called, the program gives
    # values even while the caller is traced, and operations on the arrays the function closes
    # over stay in it (under ensure_compile_time_eval each would compile a program of its own).
    compiled = _on_both_jit.lower(key, n, *args[0], *args[1]).compile()
    return compiled(*args[0], *args[1])
  with jax.ensure_compile_time_eval():  # values even while the caller is traced
    return _on_both(key, n, *args[0], *args[1])


def _check_on_tiles(
  what: str,
  fn: Callable[..., Any],
  bnts: tuple[int, ...],
  *,
  exact_shape: bool,
  score_dtype: DTypeLike | None = None,
) -> None:
  """Evaluate a user's mask or score function on the two grids of :func:`_probe_grids`.

  Raises ValueError naming ``what`` when the function fails or returns the wrong shape on
  either grid (it broadcasts a captured (T, S) array against its inputs, say), or gives
  other values at the same positions on the two (it reads positions from an array's
  shape). The indices are traced, as in a tile loop. Values are compared only when the
  function depends on no traced value and has no side effects (a debug callback). Costs
  nothing for a function that passed on the same grids before; else one trace and, for a
  function not seen before, one small compiled program.
  """
  if 0 in bnts:
    return
  grids = _probe_grids(bnts)
  # A function that passed on these grids passes again, as jit reuses a program traced from
  # it: the same closure over the same concrete values. Only functions whose values were
  # compared are remembered; one closing over traced values is checked on every call.
  memo = (tuple(tuple(p.tolist()) for g in grids for p in g), score_dtype, exact_shape)
  key = fn.fn if isinstance(fn, masks.kinds.FromFn) else fn
  with contextlib.suppress(TypeError):  # unhashable, or takes no weak reference
    if memo in _passed.get(key, ()):
      return
  contract = (
    f"{what} must compute from its index arguments (batch, head, q_idx, kv_idx), "
    "which may be traced: implementations evaluate it on tiles of the "
    "(B, N, T, S) grid (blockwise, ring attention)"
  )
  advice = (
    "Index captured arrays with the indices (table[q_idx, kv_idx]) rather than "
    "broadcasting them against the grid."
  )
  args = [_probe_args(positions, score_dtype) for positions in grids]
  shapes = [tuple(len(p) for p in positions) for positions in grids]
  names = [f"{kind} {_describe_positions(p)}" for kind, p in zip(("tile", "grid"), grids)]
  n = len(args[0])
  try:
    closed = jax.make_jaxpr(lambda *a: (fn(*a[:n]), fn(*a[n:])))(*args[0], *args[1])
  except Exception:  # it ran on the whole grid: find which smaller grid it cannot take
    for name, a in zip(names, args):
      try:
        jax.eval_shape(fn, *a)
      except Exception as e:
        raise ValueError(
          f"{contract}; on the {name} it raised {type(e).__name__}: {e}. {advice}"
        ) from None
    raise
  outs = closed.out_avals  # one array per grid, or a function that returns several
  for i, (name, shape) in enumerate(zip(names, shapes)):
    got = tuple(outs[i].shape) if len(outs) == 2 else None
    fits = got is not None and (
      got == shape
      if exact_shape
      else (len(got) == 4 and all(g in (1, m) for g, m in zip(got, shape)))
    )
    if not fits:
      raise ValueError(
        f"{contract}; on the {name} of shape {shape} it returned "
        f"{'shape ' + str(got) if got else 'not one array'}. {advice}"
      )
  if closed.effects or not all(map(_checks.is_concrete, closed.consts)):
    return  # closes over traced values (inside jit, vmap, grad) or has side effects
  t_val, w_val = _values_on_both(key, closed, n, args)
  t_val = np.broadcast_to(np.asarray(t_val), shapes[0])
  w_val = np.broadcast_to(np.asarray(w_val), shapes[1])[
    tuple(slice(p[0], p[-1] + 1) for p in grids[0])
  ]
  same = (
    np.array_equal(t_val, w_val)
    if t_val.dtype == np.bool_
    else np.allclose(t_val, w_val, rtol=1e-5, atol=1e-6, equal_nan=True)
  )
  if not same:
    raise ValueError(
      f"{contract}; it gives other values at the positions "
      f"{_describe_positions(grids[0])} when evaluated on that tile than on "
      f"the grid {_describe_positions(grids[1])}. Does it read positions from "
      "an array's shape, as jnp.arange(x.shape[-1]) does? Use q_idx and "
      "kv_idx."
    )
  if _checks.hashable(key):
    with contextlib.suppress(TypeError):  # a callable that takes no weak reference is not kept
      _passed.setdefault(key, set()).add(memo)


def segments(segment_ids: Any, unbatched: bool, T: int, S: int) -> masks.Mask:
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(
        f"segment_ids must be an array or a pair (q_segment_ids, "
        f"kv_segment_ids), got a sequence of length {len(segment_ids)}"
      )
    q_ids, kv_ids = segment_ids
  else:
    if T != S:
      raise ValueError(
        f"segment_ids as one array needs T == S, got T={T} and S={S}; "
        "pass (q_segment_ids, kv_segment_ids)"
      )
    q_ids = kv_ids = segment_ids
  rank = 1 if unbatched else 2
  for name, ids, length in (("q_segment_ids", q_ids, T), ("kv_segment_ids", kv_ids, S)):
    ids = _checks.int_array(f"segment_ids ({name})", _checks.as_array(name, ids), ranks=(rank,))
    if ids.shape[-1] != length:
      raise ValueError(
        f"segment_ids ({name}) must have length {length} along the sequence "
        f"axis, got shape {ids.shape}"
      )
  return masks.segments(q_ids, kv_ids)


def score_function(
  score_fn: Callable[..., jax.Array] | None,
  soft_cap: float | None,
  dtype: DTypeLike,
  bnts: tuple[int, int, int, int],
) -> scores.ScoreFn | None:
  fns = []
  if score_fn is not None:
    fns.append(scores.from_fn(score_fn))
  if soft_cap is not None:
    try:
      fns.append(scores.soft_cap(soft_cap))
    except (TypeError, ValueError) as e:
      raise type(e)(f"logits_soft_cap: {e}") from None
  if not fns:
    return None
  fn = fns[0] if len(fns) == 1 else scores.compose(*fns)
  heads = fn.num_heads
  if heads is not None and heads != bnts[1]:
    raise ValueError(
      f"score_fn {fn!r} has per-head parameters for {heads} query heads, but "
      f"the query has number of heads N={bnts[1]}; give one slope or table "
      f"column per query head"
    )
  if score_fn is not None:
    stats = common.stats_dtype(dtype)
    score = jax.ShapeDtypeStruct(bnts, stats)
    if _checks.hashable(score_fn):
      out = _scores_jit.eval_shape(score_fn, score)  # traced once per function and shape
    else:  # an unhashable callable: jit cannot key its cache on it
      out = jax.eval_shape(lambda s: _scores(score_fn, s), score)
    if not isinstance(out, jax.ShapeDtypeStruct):
      raise TypeError(
        f"score_fn must return one float array of the score's shape "
        f"(B, N, T, S)={bnts}, got {type(out).__name__} "
        f"{jax.tree.map(lambda x: f'{x.dtype}{tuple(x.shape)}', out)}"
      )
    if not jnp.issubdtype(out.dtype, jnp.floating):
      raise TypeError(
        f"score_fn must return a floating array (computed in any float dtype, "
        f"cast back to the score's {np.dtype(stats).name}), got {out.dtype}"
      )
    if tuple(out.shape) != bnts:
      raise ValueError(
        f"score_fn must return a float array of the score's shape "
        f"(B, N, T, S)={bnts}, got {out.dtype}{tuple(out.shape)}"
      )
    if not isinstance(score_fn, scores.ScoreFn) or any(True for _ in _user_fns(score_fn)):
      _check_on_tiles("score_fn", score_fn, bnts, exact_shape=True, score_dtype=stats)
  return fn
