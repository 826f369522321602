"""The gradients flex's Hopper kernels leave to XLA, taken on the whole (B, N, T, S) grid:
of the floating arrays a score function reads (learned ALiBi slopes) and of a bias, where
those are differentiated; and the zero cotangents of the arrays that take none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jattn import dropout as _dropout
from jattn import masks as _masks
from jattn.impl import _common
from jattn.impl.flex._hopper import _call
from jattn.impl.flex._hopper._mosaic import LOG2E, ROWS


def zero_cotangent(x: jax.Array) -> Any:
  """The cotangent of a custom_vjp input that takes no gradient: zeros, float0 for integers."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """A mask's or score function's tile jaxpr (traced at ROWS x ROWS) on the whole (B, N, T,
  S) grid in XLA, its arrays as plain inputs: mapped over batch rows and heads (global:
  ``offsets`` added) and tiles; ``scores`` (B, N, T, S) a score function's input."""
  (out,) = _outputs_on_grid(jaxpr, arrays, shape, offsets, scores)
  return out


def _outputs_on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None,
) -> list[jax.Array]:  # fmt: skip
  """:func:`_on_grid` for a jaxpr of several outputs: each on the whole grid."""
  B, N, T, S = shape
  run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, []))
  iota = lax.broadcasted_iota(jnp.int32, (ROWS, ROWS), 0)
  q_in, kv_in = iota, iota.T

  def tile(b: Any, h: Any, i: Any, j: Any, *x: Any) -> tuple[jax.Array, ...]:
    ys = run(*arrays, *x, b, h, q_in + i * ROWS, kv_in + j * ROWS)
    return tuple(jnp.broadcast_to(y, (ROWS, ROWS)) for y in ys)

  x: tuple[jax.Array, ...] = ()
  if scores is not None:  # its (B, N, T/ROWS, S/ROWS, ROWS, ROWS) tiles
    tiles = scores.reshape(B, N, T // ROWS, ROWS, S // ROWS, ROWS)
    x = (tiles.transpose(0, 1, 2, 4, 3, 5),)
  each = tile
  for axis in (3, 2, 1, 0):  # over key tiles, query tiles, heads, batch rows
    in_axes: list[int | None] = [None] * 4
    in_axes[axis] = 0
    each = jax.vmap(each, in_axes=(*in_axes, *(0,) * len(x)))  # the scores' leading axis
  b = jnp.arange(B, dtype=jnp.int32) + offsets[0]
  h = jnp.arange(N, dtype=jnp.int32) + offsets[1]
  i, j = (
    jnp.arange(T // ROWS, dtype=jnp.int32),
    jnp.arange(S // ROWS, dtype=jnp.int32),
  )
  outs = each(b, h, i, j, *x)  # each (B, N, T/ROWS, S/ROWS, ROWS, ROWS)
  return [out.transpose(0, 1, 2, 4, 3, 5).reshape(B, N, T, S) for out in outs]


def grid_grads(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
  chosen: list[int],
  wants_bias: bool,
) -> tuple[list[jax.Array], jax.Array | None]:
  """``(the gradients of arrays.score[chosen], the bias's gradient or None)``, from the
  whole (B, N, T, S) grid in XLA: the score function's VJP at the call's scores (recomputed
  in float32: scale · q kᵀ + bias), the cotangent dS = P ⊙ (dP − Δ + d_lse) of its output,
  P from the forward's log-sum-exp, ``d_lse`` as the backward kernels take it
  (:func:`_backward.one_warpgroup`); the bias's is
  dS before the score function, summed over the axes the bias broadcasts."""
  B, T, N, _ = query.shape
  S, K = key.shape[1], key.shape[2]
  f = jnp.float32
  fns = static.functions
  grouped = lambda x: jnp.repeat(x.astype(f), N // K, axis=2)
  x = jnp.einsum("btnh,bsnh->bnts", query.astype(f), grouped(key)) * static.scale
  if arrays.bias:
    x = x + arrays.bias[0].astype(f)
  shape = (B, N, T, S)
  allowed = None
  if fns.mask is not None:
    allowed = _on_grid(fns.mask[ROWS, ROWS], arrays.mask, shape, arrays.offsets).astype(bool)
  if arrays.dense:  # the dense mask (whole on each device), at this device's rows and heads
    dense = arrays.dense[0]
    if dense.shape[0] > 1:
      dense = dense[jnp.arange(B) + arrays.offsets[0]]
    if dense.shape[1] > 1:
      dense = dense[:, jnp.arange(N) + arrays.offsets[1]]
    dense = jnp.broadcast_to(dense, (*dense.shape[:2], T, S))
    allowed = dense if allowed is None else allowed & dense
  if arrays.ids:  # segment ids, at the global batch rows
    rows = jnp.arange(B) + arrays.offsets[0]
    q_ids, kv_ids = (a[rows] if a.shape[0] > 1 else a[:1] for a in arrays.ids)
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    allowed = same if allowed is None else allowed & same

  def score(x: jax.Array, *learned: jax.Array) -> jax.Array:
    if fns.score is None:
      return x
    inputs = list(arrays.score)
    for i, a in zip(chosen, learned):
      inputs[i] = a
    return _on_grid(fns.score[ROWS, ROWS], inputs, shape, arrays.offsets, x).astype(f)

  y, vjp = jax.vjp(score, x, *(arrays.score[i] for i in chosen))
  t = y * LOG2E
  if allowed is not None:
    t = jnp.where(allowed, t, -jnp.inf)
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)  # rows that saw no key: p = 0
  p = jnp.exp2(t - lse2[..., None])
  dp = jnp.einsum("btnh,bsnh->bnts", d_out.astype(f), grouped(value))
  if static.dropout_rate:  # dP through the pattern the kernels drew
    b, h, q, kv = _masks.index_grid(B, N, T, S)
    idx: tuple[Any, ...] = (b + arrays.offsets[0], h + arrays.offsets[1], q, kv)  # global
    if fns.positions is not None:  # a sequence-parallel part's: through its maps, as the kernels
      idx = tuple(
        _outputs_on_grid(fns.positions[ROWS, ROWS], arrays.positions, shape, arrays.offsets)
      )
    if static.broadcast_dropout:
      idx = _dropout.shared_indices(*idx)
    (seed,) = arrays.seed
    kept = _dropout.keep_from_seed((seed[0], seed[1]), static.dropout_rate, *idx)
    dp = jnp.where(kept, dp / (1.0 - static.dropout_rate), 0.0)
  # Δ = rowsum(P ⊙ dP) = rowsum(O ⊙ dO) at the unrounded output: the kernel's, rounded to
  # the inputs' dtype, would leave its rounding in dP − Δ, which the sum over every
  # position (ALiBi's slope sums dS times the distance) amplifies.
  delta = jnp.sum(p * dp, axis=-1, keepdims=True)
  d_x, *d_learned = vjp(p * (dp - delta + d_lse[..., None]))
  d_bias = None
  if wants_bias:
    d_bias = _common.reduce_to_shape(d_x, arrays.bias[0].shape).astype(arrays.bias[0].dtype)
  return d_learned, d_bias
