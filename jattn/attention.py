"""``jattn.dot_product_attention``: validate once, normalise, pick an implementation.

Shape legend, used in every docstring, einsum string and shape assertion::

    B  batch size
    T  query length (target)
    S  key/value length (source)
    N  number of query heads
    K  number of key/value heads (N a multiple of K: MHA, GQA, MQA)
    H  head dimension
    G  N // K, query heads per key/value head

Data flows one way: the public call checks every argument and raises before
anything is traced or compiled; every way of masking (``mask``,
``is_causal``, ``local_window_size``, sequence lengths, ``segment_ids``)
becomes one :class:`jattn.masks.Mask`, ``score_fn`` and ``logits_soft_cap``
become one score function; then a jitted core dispatches to the
implementation, which never re-validates.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jattn import _checks, masks, scores
from jattn.impl import _common, blockwise, xla

# Implementation name -> the backward rules it supports (first is its default).
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
  "xla": xla.BACKWARDS,
  "blockwise": blockwise.BACKWARDS,
  "cudnn": (),  # jax.nn's cuDNN kernel, with its own fused backward
}
BACKWARDS = ("autodiff", "custom_vjp")
_WHY_NOT = {
  ("blockwise", "autodiff"): " (JAX cannot reverse-differentiate its tile loops, whose trip "
  "counts depend on the mask, and autodiff would store every "
  "tile's probabilities, O(T·S) memory)",
}

# implementation=None picks "blockwise" once the materialised (B, N, T, S)
# float32 scores would reach this many bytes on the default backend, and
# "xla" below it. CPU: measured crossover with experiments/bench.py (README);
# accelerators: the materialised path is fast there until memory runs short.
AUTO_BLOCKWISE_BYTES = {"cpu": 8 * 2**20, "gpu": 2**30, "tpu": 2**30}


def dot_product_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: jax.typing.ArrayLike | None = None,
  key_value_seq_lengths: jax.typing.ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  implementation: str | None = None,
  return_residual: bool = False,
  segment_ids: Any = None,
  score_fn: Callable | None = None,
  logits_soft_cap: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  backward: str | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
):
  r"""Scaled dot-product attention; a drop-in superset of ``jax.nn.dot_product_attention``.

  Computes ``softmax(score_fn(scale · Q Kᵀ + bias)) V`` per head over the
  positions the masks allow. Every argument jax.nn has keeps its meaning.

  Args:
    query: (B, T, N, H) or unbatched (T, N, H), floating dtype.
    key: (B, S, K, H) or (S, K, H), same dtype as query; N % K == 0.
    value: same shape and dtype as key.
    bias: optional float array added to the scaled logits, broadcastable to
      (B, N, T, S) (lower ranks get leading 1s). Differentiable.
    mask: optional boolean array broadcastable to (B, N, T, S), True meaning
      "may attend", or a :class:`jattn.masks.Mask`.
    scale: logit scale, default ``1 / sqrt(H)`` (1 when H == 0: every logit is 0).
    is_causal: query t attends to keys s <= t (top-left aligned, as jax.nn).
    query_seq_lengths: int array (B,); query rows at or past the length
      attend to nothing and return zeros.
    key_value_seq_lengths: int array (B,); keys at or past it are masked.
    local_window_size: int w or (left, right): t - left <= s <= t + right.
    implementation: None (auto: see below), ``"xla"`` (materialised scores,
      fastest for short sequences), ``"blockwise"`` (online softmax over
      tiles, O(B·T·N·H) memory, skips tiles the mask empties), or ``"cudnn"``
      (jax.nn's cuDNN kernel on NVIDIA GPUs, for the arguments jax.nn
      supports). None picks ``"blockwise"`` when ``block_q``/``block_kv`` are
      given, ``"xla"`` when ``backward="autodiff"``, and otherwise
      ``"blockwise"`` once the (B, N, T, S) float32 scores would take
      ``AUTO_BLOCKWISE_BYTES[backend]`` or more (8 MiB on CPU, 1 GiB on GPU
      and TPU), ``"xla"`` below that.
    return_residual: also return the rows' log-sum-exp, shape (B, T, N) or
      (T, N), in the query's dtype; -inf for rows that attend to nothing.
    segment_ids: packed-sequence document ids: an int array (B, T) (or (T,)
      unbatched) when T == S, or a pair ``(q_segment_ids, kv_segment_ids)``;
      positions attend only within their segment.
    score_fn: ``fn(score, batch, head, q_idx, kv_idx) -> score`` applied to
      the scaled, biased logits (see :mod:`jattn.scores`). It must compute
      from its (possibly traced) index arguments, which blockwise gives per
      tile: checked on two small grids. A floating result in another dtype is
      cast back to float32 (float64 for float64 inputs).
    logits_soft_cap: if set, ``cap · tanh(s / cap)`` after ``score_fn``,
      before masking.
    dropout_rate: dropout on the attention weights, in [0, 1), with inverted
      scaling; the kept set is a pure function of (rng, b, n, t, s).
    dropout_rng: a ``jax.random.key`` (or ``PRNGKey``); needed when
      ``dropout_rate > 0``.
    broadcast_dropout: draw one dropout pattern of shape (T, S) and share it
      across every batch row and head (Flax's ``broadcast_dropout=True``);
      by default each (b, n) draws its own.
    backward: how gradients are formed: ``"autodiff"`` (JAX differentiates the
      forward pass) or ``"custom_vjp"`` (jattn's explicit rule, which keeps
      only the inputs and the log-sum-exp and recomputes the probabilities).
      None picks the implementation's default (``"autodiff"`` for ``"xla"``,
      ``"custom_vjp"``, its only rule, for ``"blockwise"``).
    block_q, block_kv: tile sizes of ``"blockwise"`` (default per backend,
      :data:`jattn.impl.blockwise.DEFAULT_BLOCKS`); any T and S work.

  Returns:
    The output, shaped and typed like ``query``; with ``return_residual``, the
    pair ``(output, lse)``.

  Unlike jax.nn, a query row that may attend to nothing returns zeros (jax.nn
  returns the mean of the values) and the log-sum-exp is differentiable.
  """
  impl, bwd = _check_choices(implementation, backward)
  blocks = _check_blocks(impl, block_q, block_kv)
  q, k, v = _checks.qkv(query, key, value)
  unbatched = q.ndim == 3
  B, T, N, H = (1,) * unbatched + tuple(q.shape)
  S = k.shape[-3]
  if impl is None:
    impl, bwd = _check_choices(_auto(B * N * T * S, backward, blocks), backward)
  blocks = blockwise.resolve_blocks(*blocks)
  scale = _check_scale(scale, H)
  bias = _check_bias(bias, (B, N, T, S))
  _check_flags(
    is_causal=is_causal, return_residual=return_residual, broadcast_dropout=broadcast_dropout
  )
  window = _check_window(local_window_size)
  lengths = tuple(
    _check_lengths(name, x, B)
    for name, x in (
      ("query_seq_lengths", query_seq_lengths),
      ("key_value_seq_lengths", key_value_seq_lengths),
    )
  )
  dropout_rate = _check_dropout(dropout_rate, dropout_rng)

  if impl == "cudnn":
    return _cudnn(
      query,
      key,
      value,
      bias,
      mask,
      scale=scale,
      is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=window,
      return_residual=return_residual,
      unsupported={
        "segment_ids": segment_ids,
        "score_fn": score_fn,
        "logits_soft_cap": logits_soft_cap,
        "dropout_rate": dropout_rate or None,
      },
    )

  combined = _combine_masks(mask, is_causal, window, lengths, segment_ids, unbatched, (B, N, T, S))
  score = _check_score(score_fn, logits_soft_cap, q.dtype, (B, N, T, S))

  out, lse = _attend(
    q,
    k,
    v,
    bias,
    combined,
    score,
    dropout_rng if dropout_rate else None,
    scale=scale,
    dropout_rate=dropout_rate,
    broadcast_dropout=bool(broadcast_dropout),
    implementation=impl,
    backward=bwd,
    return_residual=bool(return_residual),
    blocks=blocks,
  )
  return (out, lse) if return_residual else out


def attention_weights(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: jax.typing.ArrayLike | None = None,
  key_value_seq_lengths: jax.typing.ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  segment_ids: Any = None,
  score_fn: Callable | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """The attention probabilities ``dot_product_attention`` applies, for inspection.

  Takes the arguments of :func:`dot_product_attention` that shape the
  probabilities (no value, no dropout) with the same meanings, and returns the
  materialised softmax, shape (B, N, T, S) (or (N, T, S) unbatched), in the
  query's dtype. Rows that may attend to nothing are zeros. It materialises
  the full score matrix: use it to look at weights, not to compute attention.
  Differentiable.

  Example::

    >>> import jax.numpy as jnp, jattn
    >>> q = k = jnp.ones((1, 3, 1, 2))
    >>> jattn.attention_weights(q, k, is_causal=True)[0, 0]
    Array([[1.        , 0.        , 0.        ],
           [0.5       , 0.5       , 0.        ],
           [0.33333334, 0.33333334, 0.33333334]], dtype=float32)
  """
  q, k, _ = _checks.qkv(query, key, key)
  unbatched = q.ndim == 3
  B, T, N, H = (1,) * unbatched + tuple(q.shape)
  S = k.shape[-3]
  scale = _check_scale(scale, H)
  bias = _check_bias(bias, (B, N, T, S))
  _check_flags(is_causal=is_causal)
  lengths = tuple(
    _check_lengths(name, x, B)
    for name, x in (
      ("query_seq_lengths", query_seq_lengths),
      ("key_value_seq_lengths", key_value_seq_lengths),
    )
  )
  combined = _combine_masks(
    mask, is_causal, _check_window(local_window_size), lengths, segment_ids, unbatched, (B, N, T, S)
  )
  score = _check_score(score_fn, logits_soft_cap, q.dtype, (B, N, T, S))
  return _weights(q, k, bias, combined, score, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _weights(query, key, bias, mask, score_fn, *, scale):
  unbatched = query.ndim == 3
  if unbatched:
    query, key = query[None], key[None]
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  p = xla.weights(query, key, bias, mask=mask, score_fn=score_fn, scale=scale)
  return p[0] if unbatched else p


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "dropout_rate",
    "broadcast_dropout",
    "implementation",
    "backward",
    "return_residual",
    "blocks",
  ),
)
def _attend(
  query,
  key,
  value,
  bias,
  mask,
  score_fn,
  dropout_rng,
  *,
  scale,
  dropout_rate,
  broadcast_dropout,
  implementation,
  backward,
  return_residual,
  blocks,
):
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  dims = chex.Dimensions(B=B, T=T, S=S, N=N, K=K, H=H)
  chex.assert_shape(query, dims["BTNH"])
  chex.assert_shape([key, value], dims["BSKH"])
  match implementation:
    case "xla":
      out, lse = xla.attention(
        query,
        key,
        value,
        bias,
        mask=mask,
        score_fn=score_fn,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout,
        backward=backward,
      )
    case "blockwise" if B and N and T and S and H:
      out, lse = blockwise.attention(
        query,
        key,
        value,
        bias,
        mask=mask,
        score_fn=score_fn,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout,
        block_q=blocks[0],
        block_kv=blocks[1],
      )
    case "blockwise":  # nothing to tile: an empty output, rows with no keys, or H == 0
      out, lse = xla.attention(
        query,
        key,
        value,
        bias,
        mask=mask,
        score_fn=score_fn,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout,
        backward="autodiff",
      )
    case _:
      raise ValueError(f"unknown implementation {implementation!r}")
  chex.assert_shape(lse, dims["BTN"])
  lse = lse.astype(query.dtype) if return_residual else None
  if unbatched:
    return out[0], None if lse is None else lse[0]
  return out, lse


def _auto(num_scores: int, backward: str | None, blocks) -> str:
  """The implementation ``implementation=None`` stands for (see dot_product_attention)."""
  if blocks != (None, None):
    return "blockwise"
  if backward == "autodiff":
    return "xla"
  limit = AUTO_BLOCKWISE_BYTES.get(jax.default_backend(), AUTO_BLOCKWISE_BYTES["gpu"])
  return "blockwise" if 4 * num_scores >= limit else "xla"


def _check_choices(implementation, backward) -> tuple[str | None, str | None]:
  """(implementation, backward) checked; (None, backward) while auto is still to choose."""
  if implementation is None:
    if backward is not None and backward not in BACKWARDS:
      raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
    return None, backward
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {sorted(IMPLEMENTATIONS)} or None, got {implementation!r}"
    )
  supported = IMPLEMENTATIONS[implementation]
  if backward is None:
    return implementation, (supported[0] if supported else None)
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
  if backward not in supported:
    rules = (
      f"supports only {list(supported)}"
      if supported
      else "has its own fused backward; leave backward=None"
    )
    raise ValueError(
      f"implementation={implementation!r} does not support "
      f"backward={backward!r}: it {rules}"
      f"{_WHY_NOT.get((implementation, backward), '')}"
    )
  return implementation, backward


def _check_scale(scale, head_dim: int) -> float:
  if scale is None:  # with H == 0 every logit is an empty sum, 0, whatever the scale
    return 1.0 / float(np.sqrt(head_dim)) if head_dim else 1.0
  scale = _checks.real("scale", scale)
  if not np.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def _check_flags(**flags) -> None:
  for name, flag in flags.items():
    _checks.boolean(name, flag)


def _combine_masks(mask, is_causal, window, lengths, segment_ids, unbatched, bnts):
  """Every way of masking as one checked :class:`jattn.masks.Mask`; None when nothing masks."""
  B, N, T, S = bnts
  parts = [_check_mask(mask)]
  if is_causal:
    parts.append(masks.causal())
  if window is not None:
    parts.append(masks.sliding_window(*window))
  if any(x is not None for x in lengths):
    parts.append(masks.lengths(*lengths))
  if segment_ids is not None:
    parts.append(_check_segments(segment_ids, unbatched, T, S))
  combined = masks.all_of(*(m for m in parts if m is not None))
  if combined is not None:
    _check_mask_shapes(combined, B, N, T, S)
  return combined


def _check_bias(bias, bnts):
  if bias is None:
    return None
  bias = _checks.as_array("bias", bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    hint = "; pass boolean masks as mask" if bias.dtype == np.bool_ else ""
    raise TypeError(f"bias must have a floating dtype, got {bias.dtype}{hint}")
  if bias.ndim > 4:
    raise ValueError(f"bias must be broadcastable to (B, N, T, S)={bnts}, got shape {bias.shape}")
  shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
  _checks.broadcastable("bias", shape, bnts, "(B, N, T, S)")
  return bias


def _check_mask(mask) -> masks.Mask | None:
  if mask is None or isinstance(mask, masks.Mask):
    return mask
  if not hasattr(mask, "dtype") and not isinstance(mask, (list, tuple)):
    raise TypeError(
      f"mask must be a boolean array or a jattn.masks.Mask, got {type(mask).__name__}"
    )
  return masks.from_array(mask)


def _check_mask_shapes(mask: masks.Mask, B, N, T, S) -> None:
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
  out = jax.eval_shape(lambda: mask.on_grid(masks.index_grid(B, N, T, S)))
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


def _user_fns(node):
  """The nodes of a Mask or ScoreFn tree that wrap a user's function (``from_fn``)."""
  if node.rule.name == "from_fn":
    yield node
  for child in node.children:
    if isinstance(child, (masks.Mask, scores.ScoreFn)):
      yield from _user_fns(child)


def _probe_grids(bnts):
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


def _describe_positions(positions) -> str:
  return ", ".join(
    f"{name} [{p[0]}, {p[-1] + 1})"
    for name, p in zip(("batch", "head", "q_idx", "kv_idx"), positions)
  )


def _probe_args(positions, score_dtype) -> tuple[np.ndarray, ...]:
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


def _check_on_tiles(what: str, fn: Callable, bnts, *, exact_shape: bool, score_dtype=None) -> None:
  """Evaluate a user's mask or score function on the two grids of :func:`_probe_grids`.

  Raises ValueError naming ``what`` when the function fails or returns the wrong shape on
  either grid (it broadcasts a captured (T, S) array against its inputs, say), or gives
  other values at the same positions on the two (it reads positions from an array's
  shape). The indices are traced, as in a tile loop. Values are compared only when the
  function depends on no traced value and has no side effects (a debug callback). Costs
  one trace and a few tiny eager operations.
  """
  if 0 in bnts:
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
  grids = _probe_grids(bnts)
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
  with jax.ensure_compile_time_eval():
    t_val, w_val = jex_core.jaxpr_as_fun(closed)(*args[0], *args[1])
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


def _check_window(window):
  if window is None:
    return None
  if isinstance(window, numbers.Integral) and not isinstance(window, bool):
    window = (window, window)
  if not (isinstance(window, tuple) and len(window) == 2):
    raise TypeError(
      f"local_window_size must be an int or a (left, right) tuple of ints, got {window!r}"
    )
  return tuple(
    _checks.integer(f"local_window_size[{i}]", w, minimum=0, int32=True)
    for i, w in enumerate(window)
  )


def _check_lengths(name, lengths, B):
  if lengths is None:
    return None
  lengths = _checks.int_array(name, _checks.as_array(name, lengths), ranks=(1,), nonnegative=True)
  if lengths.shape != (B,):
    raise ValueError(f"{name} must have shape (B,)=({B},), got {lengths.shape}")
  return lengths


def _check_segments(segment_ids, unbatched: bool, T: int, S: int) -> masks.Mask:
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


def _check_score(score_fn, soft_cap, dtype, bnts) -> scores.ScoreFn | None:
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
    stats = _common.stats_dtype(dtype)
    out = jax.eval_shape(
      lambda s: score_fn(s, *masks.index_grid(*bnts)), jax.ShapeDtypeStruct(bnts, stats)
    )
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


def _check_blocks(implementation, block_q, block_kv) -> tuple[int | None, int | None]:
  """Tile sizes checked; they exist only for "blockwise" (None picks it, see _auto)."""
  blocks = (
    None if block_q is None else _checks.integer("block_q", block_q, minimum=1),
    None if block_kv is None else _checks.integer("block_kv", block_kv, minimum=1),
  )
  if implementation not in (None, "blockwise") and blocks != (None, None):
    raise ValueError(
      f"block_q and block_kv apply only to implementation='blockwise', got "
      f"implementation={implementation!r}"
    )
  return blocks


def _check_dropout_rate(rate) -> float:
  rate = _checks.real("dropout_rate", rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  return rate


def _check_dropout(rate, rng) -> float:
  rate = _check_dropout_rate(rate)
  if rate > 0.0:
    if rng is None:
      raise ValueError(f"dropout_rate={rate} needs dropout_rng, got None")
    _checks.prng_key("dropout_rng", rng)
  return rate


def _cudnn(query, key, value, bias, mask, *, unsupported, **kwargs):
  for name, value_ in unsupported.items():
    if value_ is not None:
      raise ValueError(f"implementation='cudnn' does not support {name}; use implementation='xla'")
  if isinstance(mask, masks.Mask):
    if mask.rule.name != "from_array":
      raise ValueError(
        f"implementation='cudnn' takes mask only as a boolean array, got "
        f"{mask!r}; use implementation='xla'"
      )
    (mask,) = mask.children
  if jax.default_backend() != "gpu":
    raise ValueError(
      f"implementation='cudnn' needs an NVIDIA GPU; the default backend is "
      f"{jax.default_backend()!r}"
    )
  return jax.nn.dot_product_attention(
    query, key, value, bias, mask, implementation="cudnn", **kwargs
  )
