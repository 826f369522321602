"""The custom_vjp that joins the flex kernel's forward pass to its backward pass
(:mod:`jattn.impl.flex._backward_kernels`), and the gradients it assembles from them:
``Δ = rowsum(O ⊙ dO)`` less the lse's cotangent, the bias's gradient summed from dS over its
broadcast axes, and the gradients of the floating arrays a score function reads (its VJP on
the grid, a chunk of query rows at a time). Which inputs are differentiated is read from
the custom_vjp's symbolic zeros, so an undifferentiated bias costs no buffer.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jattn.impl import _chunks, common, orders, tiling
from jattn.impl.flex._backward_kernels import backward
from jattn.impl.flex._kernels import Function, Settings, forward, kernel_scalars, log_sum_exp


def attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  schedules: tuple[tiling.Schedule, tiling.Schedule, tiling.Schedule],
  mask: tuple[Function | None, ...],
  score: tuple[Function | None, ...],
  settings: tuple[Settings, Settings, Settings],
  seed: jax.Array | None = None,
  bias: jax.Array | None = None,
  offsets: jax.Array | None = None,
  score_grid: Any = None,
  positions: tuple[Function | None, ...] = (None, None, None),
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`jattn.impl.flex._kernels.forward`'s ``(out, lse, max logit)``, differentiable in
  query, key, value, bias and the floating arrays the score function reads (the max logit,
  a statistic of the forward kernel's running max, in none).

  Per pass (forward, dQ, dK/dV), each at its own tiles: ``schedules`` (the forward's and
  dQ's rows, per query tile its key/value tiles; dK/dV's columns, per key/value tile its
  query tiles), ``mask`` and ``score`` (traced at that pass's tiles; the arrays they read
  the same in every pass) and ``settings``. ``seed`` the dropout's two words; ``offsets``
  the global index of the shard's first batch row and head
  (:func:`jattn.impl.flex._kernels.kernel_scalars`).
  ``score_grid``: the score function's jaxpr traced on a chunk of query rows of the
  (B, N, T, S) grid (its arrays the same, in the same order, as ``score``'s), for the
  gradients of the floating arrays it reads (learned parameters): where they are
  differentiated, the dQ kernel writes the gradient of the score function's output to a
  (B, N, T, S) float32 buffer (as a bias's gradient takes) and XLA takes the score
  function's VJP a chunk of rows at a time (:func:`_score_grid_vjp`). Without it,
  differentiating them is refused. ``positions``: per pass, the
  global (batch, head, q, kv) dropout is drawn at (traced as ``mask``; None: the kernels' own
  indices), for a sequence-parallel part.
  """
  arrays = (
    schedules,
    mask[0].arrays if mask[0] else (),
    score[0].arrays if score[0] else (),
    kernel_scalars(seed, offsets),
    positions[0].arrays if positions[0] else (),
  )
  jaxprs = (
    *(
      tuple(f.jaxpr if f else None for f in functions) for functions in zip(mask, score, positions)
    ),
    score_grid,
  )
  return _attention(jaxprs, settings, query, key, value, bias, arrays)


_WHO = "implementation='flex'"


# jaxprs: the (mask, score function, dropout's positions) of each pass, then the score
# function on the whole grid.
Jaxprs = tuple[tuple[Any, Any, Any], tuple[Any, Any, Any], tuple[Any, Any, Any], Any]
Passes = tuple[Settings, Settings, Settings]


@functools.partial(orders.reverse_only, nondiff_argnums=(0, 1), who=_WHO, rule=orders.KERNEL_RULE)
def _attention(
  jaxprs: Jaxprs,
  settings: Passes,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  arrays: tuple[Any, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  out, m, log_l = _forward(jaxprs, settings, query, key, value, bias, arrays)
  return out, log_sum_exp(m, log_l), _max_logit(m)


def _max_logit(m: jax.Array) -> jax.Array:
  """The rows' largest logit from the kernel's base-2 running max (-inf where empty)."""
  return jax.lax.stop_gradient(m * jnp.asarray(math.log(2), m.dtype))


def _forward(
  jaxprs: Jaxprs, settings: Passes, *operands: Any, out_dtype: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The forward kernel's ``(out, m, log2 l)`` for :func:`_attention`'s operands (query,
  key, value, bias, arrays)."""
  query, key, value, bias, (schedules, mask_arrays, score_arrays, scalars, position_arrays) = (
    operands
  )
  mask, score, positions = jaxprs[0]
  return forward(
    query,
    key,
    value,
    schedules[0],
    None if mask is None else Function(mask, mask_arrays),
    None if score is None else Function(score, score_arrays),
    settings[0],
    scalars,
    bias,
    out_dtype,
    None if positions is None else Function(positions, position_arrays),
  )


def _attention_fwd(
  jaxprs: Jaxprs,
  settings: Passes,
  query: Any,
  key: Any,
  value: Any,
  bias: Any,
  arrays: Any,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[Any, ...]]:
  # symbolic_zeros: each input comes as (value, perturbed); perturbed says it is differentiated.
  # Static facts ride in the residuals' tree structure: () where true, None where not.
  score_arrays = arrays[2]
  learned = tuple(
    () if a.perturbed and jnp.issubdtype(a.value.dtype, jnp.floating) else None
    for a in score_arrays
  )
  if any(x is not None for x in learned) and jaxprs[3] is None:
    raise ValueError(
      "implementation='flex' cannot differentiate the floating arrays this score function "
      "reads (it traces differently on the whole grid); use implementation='blockwise'"
    )
  wants_d_bias = bias is not None and bias.perturbed
  query, key, value, bias, arrays = common.primal_values((query, key, value, bias, arrays))
  # The output is kept unrounded (float32) for Δ = rowsum(O ⊙ dO): from a bfloat16 output,
  # its rounding survives the cancellation dP − Δ in a saturated row and is amplified by
  # scale·|k| in dQ (2-20x jax.nn's error measured: experiments/accuracy.py).
  f = common.stats_dtype(query.dtype)
  # A second derivative differentiates this forward pass too (for the residuals): refused
  # in jattn's words, as the backward's are, rather than by Pallas.
  forward = orders.first_order(
    lambda *operands: _forward(jaxprs, settings, *operands, out_dtype=f),
    _WHO,
    orders.FUSED,
    forward=False,
  )
  out, m, log_l = forward(query, key, value, bias, arrays)
  flags = (() if wants_d_bias else None, learned)
  residuals = (query, key, value, bias, arrays, out, m, log_l, flags)
  return (out.astype(query.dtype), log_sum_exp(m, log_l), _max_logit(m)), residuals


def _attention_bwd(
  jaxprs: Jaxprs, settings: Passes, residuals: tuple[Any, ...], cotangents: Any
) -> tuple[Any, ...]:
  grads = functools.partial(_grads, jaxprs, settings)
  cotangents = tuple(common.materialized(c) for c in cotangents)
  # A second derivative would differentiate the kernels: refused in jattn's words.
  return orders.first_order(grads, _WHO, orders.FUSED, forward=False)(residuals, cotangents)


def _grads(
  jaxprs: Jaxprs, settings: Passes, residuals: tuple[Any, ...], cotangents: Any
) -> tuple[Any, ...]:
  query, key, value, bias, arrays, out, m, log_l, (wants_d_bias, learned) = residuals
  learning = any(x is not None for x in learned)
  d_out, d_lse, _ = cotangents  # the max logit is a statistic: nothing flows back through it
  (_, rows, cols), mask_arrays, score_arrays, scalars, position_arrays = arrays
  # The lse's cotangent enters the scores' as Δ does: dS = P ⊙ (dP − Δ + d_lse).
  f = common.stats_dtype(query.dtype)
  # Rows with nothing to attend to (lse -inf) have P = 0 and no gradient, whatever their
  # lse's cotangent (cos(-inf) is NaN): it must not reach 0 · (dP − Δ).
  d_lse = jnp.where(jnp.isneginf(m), 0, d_lse.astype(f))
  delta = jnp.einsum("BTNV,BTNV->BTN", out.astype(f), d_out.astype(f)) - d_lse
  dq, dk, dv, ds = backward(
    query,
    key,
    value,
    d_out,
    (m, log_l),
    delta,
    rows,
    cols,
    scalars,
    mask_arrays,
    score_arrays,
    jaxprs[1:3],
    settings[1:],
    bias,
    wants_d_bias is not None or learning,
    learning,
    position_arrays,
  )
  T, S = query.shape[1], key.shape[1]
  d_arrays = jax.tree.map(_zero_cotangent, arrays)
  if ds is not None:
    ds = ds[:, :, :T, :S]
  d_bias = None
  if learning:  # ds is the score function's output's gradient: take its VJP on the grid
    assert ds is not None
    chosen = [i for i, x in enumerate(learned) if x is not None]
    d_bias, d_chosen = _score_grid_vjp(
      jaxprs[3], settings[0], query, key, bias, score_arrays, chosen, scalars, ds,
      wants_d_bias is not None,
    )  # fmt: skip
    d_score = list(d_arrays[2])
    for i, d in zip(chosen, d_chosen):
      d_score[i] = d.astype(score_arrays[i].dtype)
    d_arrays = (*d_arrays[:2], tuple(d_score), *d_arrays[3:])
  elif wants_d_bias is not None and ds is not None and bias is not None:
    d_bias = common.reduce_to_shape(ds, bias.shape)
  if bias is not None:
    d_bias = jnp.zeros_like(bias) if d_bias is None else d_bias.astype(bias.dtype)
  return dq, dk, dv, d_bias, d_arrays


def _score_grid_vjp(
  grid_jaxpr: Any,
  settings: Settings,
  query: jax.Array,
  key: jax.Array,
  bias: jax.Array | None,
  score_arrays: tuple[jax.Array, ...],
  chosen: list[int],
  scalars: jax.Array,
  d_scores: jax.Array,
  wants_d_bias: bool,
) -> tuple[jax.Array | None, list[jax.Array]]:
  """``(the bias's gradient or None, the gradients of score_arrays[chosen])``: the score
  function's VJP on the (B, N, T, S) grid at this device's scores (recomputed, in the
  statistics dtype), its output's gradient ``d_scores`` the cotangent, a chunk of query
  rows at a time (``grid_jaxpr``'s rows: :func:`jattn.impl.flex._grid_trace`) through
  :func:`jattn.impl._chunks.over_rows`; the bias's is dS before the score function,
  summed over the axes the bias broadcasts."""
  B, T, N, _ = query.shape
  S, K = key.shape[1], key.shape[2]
  C = grid_jaxpr.invars[-2].aval.shape[2]  # the q index's (1, 1, C, 1)
  f = common.stats_dtype(query.dtype)
  b0, n0 = (scalars[i].astype(jnp.int32) for i in (2, 3))  # the shard's first row and head
  batch = (jnp.arange(B, dtype=jnp.int32) + b0).reshape(B, 1, 1, 1)
  heads = (jnp.arange(N, dtype=jnp.int32) + n0).reshape(1, N, 1, 1)
  keys = jnp.arange(S, dtype=jnp.int32).reshape(1, 1, 1, S)
  run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(grid_jaxpr, []))

  def chunk(first: Any) -> tuple[list[jax.Array], jax.Array | None]:
    rows = _chunks.at(query, 1, first, C)
    part = None if bias is None else _chunks.at(bias, 2, first, C)
    s = common.logits(common.group_heads(rows, K), key, part, settings.scale)
    index = (batch, heads, (jnp.arange(C, dtype=jnp.int32) + first).reshape(1, 1, C, 1), keys)

    def score(s: jax.Array, *learned: jax.Array) -> jax.Array:
      inputs = list(score_arrays)
      for i, x in zip(chosen, learned):
        inputs[i] = x
      (y,) = run(*inputs, s, *index)
      return jnp.broadcast_to(y, s.shape).astype(f)

    _, vjp = jax.vjp(score, s, *(score_arrays[i] for i in chosen))
    d_raw, *d_chosen = vjp(_chunks.at(d_scores, 2, first, C).astype(f))
    d_bias = None
    if wants_d_bias:
      assert bias is not None
      d_bias = common.reduce_to_shape(d_raw, _chunks.bias_rows(bias.shape, C))
    return d_chosen, d_bias

  learned = [jax.ShapeDtypeStruct(score_arrays[i].shape, f) for i in chosen]
  d_bias = jax.ShapeDtypeStruct(bias.shape, f) if wants_d_bias and bias is not None else None
  d_chosen, d = _chunks.over_rows(chunk, T, C, learned, d_bias)
  return d, d_chosen


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _zero_cotangent(x: jax.Array) -> Any:
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)
