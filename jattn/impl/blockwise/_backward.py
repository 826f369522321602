"""Blockwise attention's backward pass: the rule :mod:`jattn.impl.blockwise`'s custom_vjp
runs (and ring attention runs per shard pair).

A first pass over the query tiles sums Δ = rowsum(A ⊙ dA) from recomputed probabilities
(:func:`_row_dots`); then for each key/value tile, the query tiles that see it recompute
A = exp(s − m) / l and dA = dY Vᵀ and accumulate dV, dQ, dK and the bias's gradient (see
:mod:`jattn.impl.blockwise` for the formulas and the tile schedule).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jattn.impl import common, kv_tiles, tiling
from jattn.impl.kv_tiles import KV
from jattn.impl.tiling import Consts


def _row_dots(
  static: tiling.Static,
  q_tiles: jax.Array,
  do_tiles: jax.Array,
  tiles: kv_tiles.Stacked | kv_tiles.CacheTiles,
  bias: jax.Array | None,
  seed: tiling.Seed | None,
  consts: Consts,
  m: jax.Array,
  l: jax.Array,
  rows: tiling.Schedule,
  with_sums: bool,
) -> tuple[jax.Array, jax.Array | None]:
  """(rowsum(A ⊙ dA), rowsum(A) if ``with_sums`` else None) per row, each (nq, B, N, bq, 1):
  A recomputed from m and l, dA = dY Vᵀ."""
  dtype = m.dtype
  keep_scale = tiling.keep_scale(static, dtype)

  def query_tile(
    i: jax.Array, q_tile: jax.Array, do_tile: jax.Array, m_i: jax.Array, l_i: jax.Array
  ) -> tuple[jax.Array, jax.Array | None]:
    def body(
      j: jax.Array, acc: tuple[jax.Array, jax.Array | None], masked: bool
    ) -> tuple[jax.Array, jax.Array | None]:
      tile = tiling.tile(static, q_tile, tiles.key_tile(j), bias, seed, consts, i, j, masked=masked)
      p = common.normalized_exp(tile.s, m_i, l_i, tile.keep)
      d_p = tiling.d_probs(tile, do_tile, tiles.value_tile(j), keep_scale, dtype)
      dot, total = acc
      # An einsum rather than sum(p * d_p): XLA's CPU backend fused the latter's multiply and
      # the exp into the reduction and ran the pass 6x slower.
      dot = dot + jnp.einsum("BNrk,BNrk->BNr", p, d_p)[..., None]
      return dot, None if total is None else total + jnp.sum(p, axis=-1, keepdims=True)

    zeros = jnp.zeros_like(m_i)  # (B, N, bq, 1)
    return tiling.visit(rows, i, body, (zeros, zeros if with_sums else None))

  tile_ids = jnp.arange(q_tiles.shape[0], dtype=jnp.int32)
  return jax.lax.map(lambda x: query_tile(*x), (tile_ids, q_tiles, do_tiles, m, l))


def backward(
  static: tiling.Static,
  residuals: tuple[
    jax.Array,  # query
    KV,
    jax.Array | None,  # bias
    tiling.Seed | None,  # dropout seed words, and where they are drawn
    tiling.Schedule,  # cols
    Consts,
    jax.Array | None,  # out: None with rows, where Δ takes a pass of its own
    jax.Array,  # m
    jax.Array,  # l
  ],
  d_out: jax.Array,
  d_lse: jax.Array,
  rows: tiling.Schedule | None = None,
) -> tuple[
  jax.Array,
  tuple[jax.Array, ...] | kv_tiles.CacheTiles,
  jax.Array | None,
  tuple[None, ...],
  tuple[jax.Array | None, ...],
]:
  """Gradients in float32/64 (the custom_vjp casts them to the inputs' dtypes). With the
  query tiles' schedule ``rows``, Δ = rowsum(A ⊙ dA) takes a pass of its own over the tiles;
  without it Δ = rowsum(dY ⊙ Y) comes from ``out`` (ring attention, whose rows span shards)."""
  query, kv, bias, seed, cols, consts, out, m, l = residuals
  mask_consts, score_consts = consts
  B, T, N, H = query.shape
  bq, bk = static.block_q, static.block_kv
  tiles = kv_tiles.source(kv, bk)
  K, Hv, v_dtype = tiles.heads
  dtype = common.stats_dtype(query.dtype)
  keep_scale = tiling.keep_scale(static, dtype)

  q_tiles = tiling.query_tiles(common.scaled_queries(query, static.scale), bq, K)
  prescaled = common.scales_queries(query.dtype)
  d_out = d_out.astype(dtype)
  do_tiles = tiling.query_tiles(d_out, bq, K)
  m, l = tiling.row_tiles(m, bq), tiling.row_tiles(l, bq)
  padded_bias = tiling.pad_bias(bias, static)
  if rows is None:
    # Δ = rowsum(dY ⊙ Y) − dlse = rowsum(A ⊙ dA) − dlse per row, from the output alone.
    assert out is not None, "without the query tiles' schedule, Δ comes from the output"
    delta = tiling.row_tiles(jnp.sum(d_out * out, axis=-1) - d_lse.astype(dtype), bq)
  else:
    # Δ = rowsum(A ⊙ dA) over the very dA that dS = A ⊙ (dA − Δ) subtracts it from, one more
    # pass: in a saturated row the two cancel exactly, as in jax.nn (rowsum(dY ⊙ Y) leaves a
    # rounding residue that scale·|k| amplifies in dq). With narrow values the same pass
    # corrects l by the recomputed row sums (the module docstring; docs/tuning.md).
    narrow = v_dtype != dtype
    row_dot, row_sum = _row_dots(
      static,
      q_tiles,
      do_tiles,
      tiles,
      padded_bias,
      seed,
      consts,
      m,
      l,
      rows,
      with_sums=narrow,
    )
    if narrow:
      assert row_sum is not None, "_row_dots sums the rows with_sums=narrow"
      row_sum = common.safe_total(row_sum)
      l = l * row_sum
      row_dot = row_dot / row_sum
    delta = row_dot - tiling.row_tiles(d_lse.astype(dtype), bq)

  # Only float constants (a learned table, ALiBi slopes) get gradients.
  is_float = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in score_consts]

  def kv_tile(
    carry: tuple[jax.Array, jax.Array | None, tuple[jax.Array, ...]], xs: jax.Array
  ) -> tuple[
    tuple[jax.Array, jax.Array | None, tuple[jax.Array, ...]], tuple[jax.Array, jax.Array]
  ]:
    d_q, d_bias, d_consts = carry
    j = xs
    k_tile, v_tile = tiles.key_tile(j), tiles.value_tile(j)

    def body(
      i: jax.Array,
      inner: tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, tuple[jax.Array, ...]],
      masked: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, tuple[jax.Array, ...]]:
      d_k, d_v, d_q, d_bias, d_consts = inner
      q_tile = q_tiles[i]
      tile = tiling.tile(
        static, q_tile, k_tile, padded_bias, seed, consts, i, j, masked=masked, with_vjp=True
      )
      p = common.normalized_exp(tile.s, m[i], l[i], tile.keep)  # A, normalised
      p_used = p
      if tile.drop is not None:
        assert keep_scale is not None, "dropout's kept weights come with its scale"
        p_used = jnp.where(tile.drop, p * keep_scale, 0)
      do_tile = do_tiles[i]
      d_v = d_v + jnp.einsum("BKrk,BKrH->BKHk", tiling.stack_heads(p_used, K), do_tile)
      d_p = tiling.d_probs(tile, do_tile, v_tile, keep_scale, dtype)
      d_s = p * (d_p - delta[i])
      if tile.score_vjp is not None:
        d_s, *d_c = tile.score_vjp(d_s)
        d_c = [d for d, f in zip(d_c, is_float) if f]
        d_consts = tuple(a + b.astype(a.dtype) for a, b in zip(d_consts, d_c))
      if d_bias is not None:
        start, size = tiling.bias_window(d_bias, static, i, j)
        part = common.reduce_to_shape(d_s, size).astype(d_bias.dtype)
        d_bias = jax.lax.dynamic_update_slice(
          d_bias, jax.lax.dynamic_slice(d_bias, start, size) + part, start
        )
      # dQ = scale · dS K and dK = scale · dSᵀ Q: with pre-scaled queries, dK needs no
      # product and dQ is scaled once at the end.
      d_s = tiling.stack_heads(d_s, K)
      if not prescaled:
        d_s = d_s * jnp.asarray(static.scale, dtype)
      d_q = d_q.at[i].add(jnp.einsum("BKrk,BKkH->BKrH", d_s, k_tile.astype(dtype)))
      d_k = d_k + jnp.einsum("BKrk,BKrH->BKHk", d_s, q_tile.astype(dtype))
      return d_k, d_v, d_q, d_bias, d_consts

    # dK and dV accumulate transposed, (H, block_kv) per head: XLA's CPU dot contracts the
    # query rows into that layout faster (docs/tuning.md).
    kv_like: dict[str, Any] = dict(like=k_tile, axes=(0, 1, None, None))
    zeros_k = common.full((B, K, H, bk), 0, dtype, **kv_like)
    zeros_v = common.full((B, K, Hv, bk), 0, dtype, **kv_like)
    d_k, d_v, d_q, d_bias, d_consts = tiling.visit(
      cols, j, body, (zeros_k, zeros_v, d_q, d_bias, d_consts)
    )
    return (d_q, d_bias, d_consts), (d_k, d_v)

  init = (
    jnp.zeros_like(q_tiles, dtype),
    None if padded_bias is None else jnp.zeros_like(padded_bias, dtype),
    tuple(jnp.zeros_like(c, dtype) for c, f in zip(score_consts, is_float) if f),
  )
  (d_q, d_bias, d_float), (d_k, d_v) = jax.lax.scan(
    kv_tile, init, jnp.arange(tiles.num_tiles, dtype=jnp.int32)
  )
  d_query = tiling.untile_queries(d_q, N, T)
  if prescaled:
    d_query = d_query * jnp.asarray(static.scale, dtype)
  d_kv = tiles.cotangent(d_k, d_v)  # from (nk, B, K, H, bk) and (nk, B, K, Hv, bk)
  if bias is not None and d_bias is not None:
    d_bias = d_bias[:, :, : bias.shape[2], : bias.shape[3]]
  d_floats = iter(d_float)
  d_score = tuple(
    next(d_floats).astype(jnp.result_type(c)) if f else None for c, f in zip(score_consts, is_float)
  )
  d_mask = tuple(None for _ in mask_consts)
  return d_query, d_kv, d_bias, d_mask, d_score
