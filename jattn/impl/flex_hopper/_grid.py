"""The gradients flex's Hopper kernels leave to XLA, taken on the (B, N, T, S) grid a chunk
of query rows at a time: of the floating arrays a score function reads (learned ALiBi
slopes) and of a bias, where those are differentiated; and the zero cotangents of the arrays
that take none."""

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
from jattn.impl import _chunks, common
from jattn.impl.flex_hopper import _call
from jattn.impl.flex_hopper._mosaic import LOG2E, ROWS


def zero_cotangent(x: jax.Array) -> Any:
  """The cotangent of a custom_vjp input that takes no gradient: zeros, float0 for integers."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None, first_row: Any = 0,
) -> jax.Array:  # fmt: skip
  """A mask's or score function's tile jaxpr (traced at ROWS x ROWS) on the (B, N, T, S)
  grid in XLA, its arrays as plain inputs: mapped over batch rows and heads (global:
  ``offsets`` added) and tiles; ``scores`` (B, N, T, S) a score function's input; T query
  rows from ``first_row`` (a multiple of ROWS)."""
  (out,) = _outputs_on_grid(jaxpr, arrays, shape, offsets, scores, first_row)
  return out


def _outputs_on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None, first_row: Any = 0,
) -> list[jax.Array]:  # fmt: skip
  """:func:`_on_grid` for a jaxpr of several outputs: each on the whole grid, or on the
  query rows from ``first_row`` (a multiple of ROWS; shape's T the rows taken)."""
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
    jnp.arange(T // ROWS, dtype=jnp.int32) + first_row // ROWS,
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
  rows: int | None = None,
) -> tuple[list[jax.Array], jax.Array | None]:
  """``(the gradients of arrays.score[chosen], the bias's gradient or None)``, from the
  (B, N, T, S) grid in XLA, ``rows`` query rows at a time (a multiple of ROWS dividing T;
  default :func:`jattn.impl._chunks.rows`, a chunk's float32 grid array under
  ``CHUNK_BYTES`` where T allows): the score function's VJP at the call's scores
  (recomputed in float32: scale · q kᵀ + bias), the cotangent dS = P ⊙ (dP − Δ + d_lse) of
  its output, P from the forward's log-sum-exp, ``d_lse`` as the backward kernels take it
  (:func:`_backward.one_warpgroup`); the bias's is dS before the score function, summed over
  the axes the bias broadcasts; both summed or gathered over the chunks by
  :func:`jattn.impl._chunks.over_rows`."""
  B, T, N, _ = query.shape
  S, K = key.shape[1], key.shape[2]
  C = _chunks.rows(B, N, T, S, multiple=ROWS) if rows is None else rows
  if C % ROWS or T % C:
    raise ValueError(f"rows: a multiple of {ROWS} that divides T = {T}, got {C}")
  f = jnp.float32
  fns = static.functions
  grouped = lambda x: jnp.repeat(x.astype(f), N // K, axis=2)
  key_f, value_f = grouped(key), grouped(value)
  bias = arrays.bias[0] if arrays.bias else None
  dense, ids = _local_masks(arrays, B, N)
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)  # rows that saw no key: p = 0
  shape = (B, N, C, S)

  def chunk(first: Any) -> tuple[list[jax.Array], jax.Array | None]:
    """The learned arrays' gradients from query rows ``first`` to ``first + C``, and the
    bias's gradient there (its query axis C long, or 1)."""
    x = jnp.einsum("btnh,bsnh->bnts", _chunks.at(query, 1, first, C).astype(f), key_f)
    x = x * static.scale
    if bias is not None:
      x = x + _chunks.at(bias, 2, first, C).astype(f)
    allowed = _allowed(fns, arrays, dense, ids, shape, first)

    def score(x: jax.Array, *learned: jax.Array) -> jax.Array:
      if fns.score is None:
        return x
      inputs = list(arrays.score)
      for i, a in zip(chosen, learned):
        inputs[i] = a
      return _on_grid(
        fns.score[ROWS, ROWS], inputs, shape, arrays.offsets, x, first_row=first
      ).astype(f)

    y, vjp = jax.vjp(score, x, *(arrays.score[i] for i in chosen))
    t = y * LOG2E
    if allowed is not None:
      t = jnp.where(allowed, t, -jnp.inf)
    p = jnp.exp2(t - _chunks.at(lse2, 2, first, C)[..., None])
    dp = jnp.einsum("btnh,bsnh->bnts", _chunks.at(d_out, 1, first, C).astype(f), value_f)
    if static.dropout_rate:  # dP through the pattern the kernels drew
      dp = _dropped(dp, arrays, static, shape, first)
    # Δ = rowsum(P ⊙ dP) = rowsum(O ⊙ dO) at the unrounded output: the kernel's, rounded to
    # the inputs' dtype, would leave its rounding in dP − Δ, which the sum over every
    # position (ALiBi's slope sums dS times the distance) amplifies.
    delta = jnp.sum(p * dp, axis=-1, keepdims=True)
    d_x, *d_learned = vjp(p * (dp - delta + _chunks.at(d_lse, 2, first, C)[..., None]))
    d_bias = None
    if wants_bias:
      assert bias is not None
      d_bias = common.reduce_to_shape(d_x, _chunks.bias_rows(bias.shape, C))
    return d_learned, d_bias

  learned = [jax.ShapeDtypeStruct(arrays.score[i].shape, f) for i in chosen]
  bias_out = jax.ShapeDtypeStruct(bias.shape, f) if wants_bias and bias is not None else None
  d_learned, d_bias = _chunks.over_rows(chunk, T, C, learned, bias_out)
  if d_bias is not None:
    assert bias is not None
    d_bias = d_bias.astype(bias.dtype)
  return d_learned, d_bias


def _local_masks(arrays: _call.Arrays, B: int, N: int) -> tuple[Any, Any]:
  """``(dense, ids)``: the dense mask (whole on each device) at this device's B rows and N
  heads, and the segment ids at its global batch rows; None where the call has none."""
  dense = None
  if arrays.dense:
    dense = arrays.dense[0]
    if dense.shape[0] > 1:
      dense = dense[jnp.arange(B) + arrays.offsets[0]]
    if dense.shape[1] > 1:
      dense = dense[:, jnp.arange(N) + arrays.offsets[1]]
  ids = None
  if arrays.ids:
    batch = jnp.arange(B) + arrays.offsets[0]
    ids = tuple(a[batch] if a.shape[0] > 1 else a[:1] for a in arrays.ids)
  return dense, ids


def _allowed(
  fns: Any, arrays: _call.Arrays, dense: Any, ids: Any, shape: tuple[int, int, int, int], first: Any
) -> jax.Array | None:
  """Which (B, N, C, S) positions of the chunk from query row ``first`` the mask, the dense
  mask and the segment ids allow (None: all)."""
  _, _, C, S = shape
  allowed = None
  if fns.mask is not None:
    allowed = _on_grid(
      fns.mask[ROWS, ROWS], arrays.mask, shape, arrays.offsets, first_row=first
    ).astype(bool)
  if dense is not None:
    part = jnp.broadcast_to(_chunks.at(dense, 2, first, C), (*dense.shape[:2], C, S))
    allowed = part if allowed is None else allowed & part
  if ids is not None:
    q_ids, kv_ids = _chunks.at(ids[0], 1, first, C), ids[1]
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    allowed = same if allowed is None else allowed & same
  return allowed


def _dropped(
  dp: jax.Array,
  arrays: _call.Arrays,
  static: _call.Static,
  shape: tuple[int, int, int, int],
  first: Any,
) -> jax.Array:
  """dP of the chunk from query row ``first`` through the dropout pattern the kernels drew
  (at the global indices, or a sequence-parallel part's positions through its maps)."""
  fns = static.functions
  B, N, C, S = shape
  b, h, q, kv = _masks.index_grid(B, N, C, S)
  idx: tuple[Any, ...] = (b + arrays.offsets[0], h + arrays.offsets[1], q + first, kv)
  if fns.positions is not None:
    idx = tuple(
      _outputs_on_grid(
        fns.positions[ROWS, ROWS], arrays.positions, shape, arrays.offsets, first_row=first
      )
    )
  if static.broadcast_dropout:
    idx = _dropout.shared_indices(*idx)
  (seed,) = arrays.seed
  kept = _dropout.keep_from_seed((seed[0], seed[1]), static.dropout_rate, *idx)
  return jnp.where(kept, dp / (1.0 - static.dropout_rate), 0.0)
