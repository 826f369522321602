"""The Hopper kernels' entry points: :func:`forward` (the forward kernel alone) and
:func:`attention`, which joins it and the backward's two kernels in a ``custom_vjp`` (the
bias's and learned arrays' gradients left to XLA on the grid, :mod:`._grid`). Lengths and
head dims off the kernels' tiles run padded (:mod:`._padding`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jattn import masks as _masks
from jattn.impl import common, orders
from jattn.impl.flex_hopper import _backward, _call, _forward, _grid, _padding
from jattn.impl.flex_hopper._mosaic import LOG2E

_WHO = "implementation='flex_hopper'"


def forward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool = False,
  mask: _masks.Mask | None = None,
  score_fn: Any = None,
  block_kv: int = 64,
  stages: int = 2,
  interpret: bool = False,
  base2: bool = False,
  specialized: bool = False,
  offsets: jax.Array | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  bias: jax.Array | None = None,
  batch_heads: tuple[int, int] | None = None,
  positions: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` of softmax attention: query (B, T, N, H), key and value (B, S, K, H),
  N a multiple of K (grouped queries), float16 or bfloat16, any head dims (padded to
  multiples of 64), any lengths (padded to the tiles: T a multiple of 64, S of
  ``block_kv``); ``is_causal`` as jax.nn's (query t sees keys s <= t, T = S),
  and ``mask`` a jattn mask, and'ed with it, that reads arrays at the batch row and head
  (lengths, prefix lengths, per-row causal offsets) or along the query or key positions (a
  part's position map), and'ed with at most one set of segment ids and one dense mask
  (:func:`_call.mask_reason`); ``score_fn(s, batch, head, q_idx, kv_idx)`` a jattn score
  function applied to the scaled scores, reading arrays the same ways (``scores.soft_cap``,
  ``scores.alibi``; :func:`_call.score_reason`).
  ``bias`` (rank 4, broadcastable to (B, N, T, S), floating) is added to the scaled scores
  before the score function, read tile by tile; dropout (``dropout_rate``, ``dropout_rng``,
  ``broadcast_dropout``) as jattn's.
  ``lse`` is (B, N, T) float32, the natural log-sum-exp of each row's scaled scores; a row
  that sees no key gives zeros and an lse of -inf.
  ``interpret`` runs it in Mosaic GPU's interpreter (jax >= 0.11.2), on any backend; ``base2``
  returns the log-sum-exp in base 2 of the scores times log2(e), as the backward takes it.
  ``specialized``: the warp-specialised kernel (:func:`_forward.specialized`: a copy
  warpgroup and two compute warpgroups per 128 query rows; T a multiple of 128), and in
  :func:`attention` the warp-specialised backward kernels too
  (:func:`_backward.specialized`; S a multiple of 128 as well).
  ``offsets``: the global index of the first batch row and head (int32 (2,)) where these
  inputs are one device's share of a sharded call, and ``batch_heads`` the whole call's
  batch size and query heads; the mask and score function see global indices, and read
  their arrays (whole on each device) there, the tile schedule covers every row and head.
  ``positions``: a sequence-parallel part's maps to the global (batch, head, query, key)
  positions its dropout is drawn at (:attr:`jattn.impl.contract.CallSpec.positions`).
  Lengths and head dims off the kernels' tiles run padded (:mod:`_padding`), the padding
  masked and cut."""
  options = dict(
    scale=scale, is_causal=is_causal, mask=mask, score_fn=score_fn, block_kv=block_kv,
    stages=stages, interpret=interpret, specialized=specialized, offsets=offsets,
    dropout_rate=dropout_rate, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
    bias=bias, batch_heads=batch_heads, positions=positions,
  )  # fmt: skip
  padded = _padding.pad(query, key, value, **options)
  if padded is not None:  # lengths or head dims off the tiles: run padded, the padding cut
    out, lse = forward(padded.query, padded.key, padded.value, base2=base2, **padded.options)
    return out[:, : query.shape[1], :, : value.shape[3]], lse[:, :, : query.shape[1]]
  arrays, static = _call.prepare(query, key, value, backward=False, **options)
  run = _forward.specialized if specialized else _forward.one_warpgroup
  out, lse2, _ = run(query, key, value, arrays, static)
  return out, lse2 if base2 else lse2 / LOG2E


def attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool = False,
  mask: _masks.Mask | None = None,
  score_fn: Any = None,
  interpret: bool = False,
  specialized: bool = False,
  offsets: jax.Array | None = None,
  block_kv: int = 64,
  stages: int = 2,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  bias: jax.Array | None = None,
  batch_heads: tuple[int, int] | None = None,
  positions: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out, lse, max logit)``: :func:`forward`'s output and natural log-sum-exp, and each
  row's largest logit (a statistic: no gradient; -inf where a row sees no key), the lse and
  the max (B, T, N) as jattn's implementations return them; the output and the lse
  differentiable: in query, key and value by the
  backward kernels (:func:`_backward.one_warpgroup`, or :func:`_backward.specialized`; the
  log-sum-exp's cotangent enters dS as Δ
  does, dS = P ⊙ (dP − Δ + d_lse), so sinks and ``return_residual`` take it), and in the
  bias and the floating arrays a score function reads (learned ALiBi slopes), where those
  are differentiated, through the (B, N, T, S) grid in XLA a chunk of query rows at a time
  (:func:`_grid.grid_grads`); arguments as
  :func:`forward`'s, lengths and head dims off the kernels' tiles padded as there."""
  options = dict(
    scale=scale, is_causal=is_causal, mask=mask, score_fn=score_fn, block_kv=block_kv,
    stages=stages, interpret=interpret, specialized=specialized, offsets=offsets,
    dropout_rate=dropout_rate, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
    bias=bias, batch_heads=batch_heads, positions=positions,
  )  # fmt: skip
  padded = _padding.pad(query, key, value, **options)
  if padded is not None:  # lengths or head dims off the tiles: run padded, the padding cut
    out, lse, top = attention(padded.query, padded.key, padded.value, **padded.options)
    T = query.shape[1]
    return out[:, :T, :, : value.shape[3]], lse[:, :T], top[:, :T]
  arrays, static = _call.prepare(query, key, value, backward=True, **options)
  run = _forward.specialized if specialized else _forward.one_warpgroup
  backward = _backward.specialized if specialized else _backward.one_warpgroup
  natural = lambda lse2: jnp.swapaxes(lse2 / LOG2E, 1, 2)  # (B, N, T) base 2 -> (B, T, N)
  # The rows' largest logit, a statistic of the forward kernel's running max.
  largest = lambda m2: jax.lax.stop_gradient(natural(m2))

  # The arrays the mask and score function read (traced arrays among them) are the
  # custom_vjp's inputs, not its closure. Forward mode, and a second derivative (which would
  # differentiate the kernels), are refused in jattn's words, not Pallas'.
  @functools.partial(orders.reverse_only, who=_WHO, rule=orders.KERNEL_RULE)
  def attend(q: jax.Array, k: jax.Array, v: jax.Array, arrays: _call.Arrays) -> Any:
    out, lse2, m2 = run(q, k, v, arrays, static)
    return out, natural(lse2), largest(m2)

  def fwd(q: Any, k: Any, v: Any, arrays: Any) -> Any:
    # symbolic_zeros: each input comes as (value, perturbed). Which of the score function's
    # arrays are learned, and whether the bias is, rides in the residuals' tree structure:
    # () where so, else None.
    learned = tuple(
      () if a.perturbed and jnp.issubdtype(a.value.dtype, jnp.floating) else None
      for a in (*arrays.score, *arrays.bias)
    )
    q, k, v, arrays = common.primal_values((q, k, v, arrays))
    # The output kept unrounded (float32) for Δ = rowsum(O ⊙ dO): from a 16-bit output its
    # rounding survives the cancellation dP − Δ in a saturated row, amplified in dQ and dK.
    forward = orders.first_order(
      lambda q, k, v, arrays: run(q, k, v, arrays, static, jnp.float32),
      _WHO,
      orders.FUSED,
      forward=False,
    )
    out, lse2, m2 = forward(q, k, v, arrays)
    results = (out.astype(q.dtype), natural(lse2), largest(m2))
    return results, (q, k, v, out, lse2, arrays, learned)

  def bwd(res: Any, cotangents: Any) -> Any:
    cotangents = tuple(common.materialized(c) for c in cotangents)
    return orders.first_order(grads, _WHO, orders.FUSED, forward=False)(res, cotangents)

  def grads(res: Any, cotangents: Any) -> Any:
    q, k, v, out, lse2, arrays, learned = res
    d_out, d_lse, _ = cotangents  # the max logit is a statistic: nothing flows back through it
    # Rows that saw no key (lse -inf) take no gradient, whatever their lse's cotangent.
    d_lse = jnp.where(jnp.isneginf(lse2), 0.0, jnp.swapaxes(d_lse, 1, 2).astype(jnp.float32))
    dq, dk, dv = backward(q, k, v, out, lse2, d_out, d_lse, arrays, static)
    d_arrays = jax.tree.map(_grid.zero_cotangent, arrays)
    n_score = len(arrays.score)
    chosen = [i for i, x in enumerate(learned[:n_score]) if x is not None]
    wants_bias = any(x is not None for x in learned[n_score:])
    if chosen or wants_bias:
      d_chosen, d_bias = _grid.grid_grads(
        q, k, v, lse2, d_out, d_lse, arrays, static, chosen, wants_bias
      )
      d_score = list(d_arrays.score)
      for i, d in zip(chosen, d_chosen):
        d_score[i] = d.astype(arrays.score[i].dtype)
      d_arrays = d_arrays._replace(score=tuple(d_score))
      if d_bias is not None:
        d_arrays = d_arrays._replace(bias=(d_bias,))
    return dq, dk, dv, d_arrays

  attend.defvjp(fwd, bwd, symbolic_zeros=True)
  return attend(query, key, value, arrays)
