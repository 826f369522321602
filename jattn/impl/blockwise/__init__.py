"""Blockwise attention: online softmax over tiles, O(B·T·N·H) memory (FlashAttention-2).

Queries are cut into tiles of ``block_q`` rows and keys/values into tiles of
``block_kv``. The forward pass loops over query tiles; for each it loops over
the key/value tiles the mask lets it see, keeping a running row max ``m``, a
running sum ``l`` and an unnormalised output ``acc`` in float32:

    s = scale · q kᵀ + bias,  s = score_fn(s),  m' = max(m, rowmax(s)),
    p = exp(s − m'),  l = l·exp(m − m') + rowsum(p),  acc = acc·exp(m − m') + p v

and writes ``acc / l`` and the log-sum-exp ``m + log l``. Masked positions and
-inf scores count as exp(−inf) = 0 and m starts at −inf; every finite score
takes part. No (T, S) array is ever formed: the largest is one
(B, N, block_q, block_kv) tile.

The backward pass (the only rule: JAX cannot reverse-differentiate the
dynamic-length loops) keeps the inputs and each row's max m and sum l (two
(B, T, N) float32 arrays: as fused kernels do, m and l are kept apart, since
their log-sum-exp m + log l loses log l when |m| is huge, e.g. under an
additive −1e9 mask). It first passes over the query tiles, recomputing each
tile's probabilities ``A = exp(s − m) / l`` and ``dA = dY Vᵀ`` to sum

    Δ = rowsum(A ⊙ dA) − dlse

exactly as jax.nn's materialised softmax does (with bfloat16/float16 values,
whose rounded weights the forward's l summed, the pass also sums A and
corrects l ← l · rowsum(A), Δ ← Δ / rowsum(A), so each recomputed row sums to
1): FlashAttention's identity
Δ = rowsum(dY ⊙ Y) is one pass cheaper but equals it only up to summation
order, and in a saturated row (A one-hot) that rounding residue survives the
cancellation dA − Δ at the hot key and is amplified by scale·|k| in dQ. Then
it loops over key/value tiles, and within each over the query tiles that see
it, recomputing A and dA and forming

    dV += Aᵀ dY,  dS = A ⊙ (dA − Δ),
    dQ += scale · dS K,  dK += scale · dSᵀ Q,  dbias tile = dS

with dropout's kept weights and inverted scale applied to A and dA, and score
functions differentiated through their own VJP tile by tile.

Tile skipping: the mask's :meth:`~jattn.masks.Mask.block_view` classifies
every tile pair, taken over all batch rows and heads, as EMPTY, PARTIAL or
FULL. Each query tile's row of key/value tiles is sorted into its FULL tiles,
then its PARTIAL ones; two loops with those trip counts visit them, the first
with no mask arithmetic at all, and EMPTY tiles are never visited. The
backward pass does the same by columns. When the mask's arrays are traced
(segment ids under jit) the view is computed on the fly, so the trip counts
are data-dependent: that is why the loops are ``while`` loops.

GQA: the G query heads of a key/value head are stacked into one
(G · block_q)-row matrix, so K and V are never repeated in memory.

Arguments arrive normalised and validated, as a :class:`jattn.impl.contract.CallSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import dropout as _dropout
from jattn import masks as _masks
from jattn.impl import common, contract, kv_tiles, orders, tiling
from jattn.impl.blockwise import _backward as _blockwise_backward
from jattn.impl.contract import CallSpec
from jattn.impl.kv_tiles import KV
from jattn.impl.tiling import Consts

__all__ = [
  "IMPLEMENTATION",
  "BACKWARDS",
  "DEFAULT_BLOCKS",
  "default_blocks",
  "resolve_blocks",
  "attention",
  "attention_over_cache",
  "Plan",
  "plan",
  "forward",
  "backward",
]

BACKWARDS = ("custom_vjp",)


_Residuals = tuple[
  jax.Array,  # query
  KV,
  jax.Array | None,  # bias
  tiling.Seed | None,  # dropout seed words, and where they are drawn
  tiling.Schedule,  # rows
  tiling.Schedule,  # cols
  tuple[Any, ...],  # mask constants
  tuple[Any, ...],  # score function constants
  jax.Array,  # m
  jax.Array,  # l
]

# Default (block_q, block_kv) per backend: on a CPU a score tile of all heads fits the L3
# cache; on a GPU each tile step is a few kernel launches, so tiles fill the device
# (the measurements: docs/tuning.md).
DEFAULT_BLOCKS = {"cpu": (512, 512), "gpu": (1024, 1024), "tpu": (512, 512)}


def default_blocks(backend: str) -> tuple[int, int]:
  """(block_q, block_kv) used for ``backend`` when the caller gives none."""
  return DEFAULT_BLOCKS.get(backend, DEFAULT_BLOCKS["cpu"])


def resolve_blocks(
  block_q: int | None, block_kv: int | None, backend: str | None = None
) -> tuple[int, int]:
  """The given tile sizes, with ``backend``'s defaults (the running one's by default) where
  they are None."""
  default_q, default_kv = default_blocks(backend or jax.default_backend())
  return (default_q if block_q is None else block_q, default_kv if block_kv is None else block_kv)


def attention(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Returns ``(out (B, T, N, H) in query's dtype, lse (B, T, N) in float32/64, max logit
  (B, T, N) or None)``.

  Reads the bias (rank 4), mask, score function, scale, dropout and tiles from ``spec``.
  """
  return _attention(query, (key, value), key.shape[1], spec)


def attention_over_cache(
  query: jax.Array, tiles: kv_tiles.CacheTiles, spec: CallSpec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """:func:`attention` with keys and values read from a KV cache tile by tile
  (``spec.block_kv == tiles.block``): a tile is gathered, dequantized and masked only
  when the schedule visits it, so a call's memory grows with the tiles in use."""
  return _attention(query, tiles, tiles.kv_len, spec)


def _attention(
  query: jax.Array, kv: KV, kv_len: int, spec: CallSpec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  dtype = query.dtype
  wide = spec.compute_dtype or dtype
  if wide != dtype:  # autodiff casts the gradients back through these casts
    query = query.astype(wide)
    if isinstance(kv, kv_tiles.CacheTiles):
      kv = dataclasses.replace(kv, dtype=wide)
    else:
      key, value = kv
      kv = (key.astype(wide), value.astype(wide))
  p = plan(
    query,
    kv_len,
    mask=spec.mask,
    score_fn=spec.score_fn,
    scale=spec.scale,
    dropout_rate=spec.dropout_rate,
    dropout_rng=spec.dropout_rng,
    broadcast_dropout=spec.broadcast_dropout,
    positions=spec.positions,
    block_q=spec.block_q,  # type: ignore[arg-type]  # set by prepare (IMPLEMENTATION)
    block_kv=spec.block_kv,  # type: ignore[arg-type]
  )
  out, lse, top = _attention_vjp(
    p.static, query, kv, spec.bias, p.seed, p.rows, p.cols, p.mask_consts, p.score_consts
  )
  # With sinks to add (jattn.attention), out stays in the statistics dtype until then.
  out = out if spec.sinks is not None else out.astype(dtype)
  return out, lse, top if spec.return_max_logit else None


class Plan(NamedTuple):
  """Everything one call needs besides the arrays: settings, tile schedules, hoisted constants."""

  static: tiling.Static
  rows: tiling.Schedule  # per query tile: the key/value tiles to visit (forward)
  cols: tiling.Schedule  # per key/value tile: the query tiles to visit (backward)
  seed: tiling.Seed | None  # dropout seed words, and where they are drawn
  mask_consts: tuple
  score_consts: tuple

  @property
  def consts(self) -> Consts:
    return (self.mask_consts, self.score_consts)


def plan(
  query: jax.Array,
  kv_len: int,
  *,
  mask: _masks.Mask | None,
  score_fn: Callable[..., jax.Array] | None,
  scale: float,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  positions: Any = None,
  block_q: int,
  block_kv: int,
  score: tuple[Callable[..., jax.Array], tuple[Any, ...]] | None = None,
) -> Plan:
  """Tile sizes, the schedules of non-empty tiles and the closure-converted mask and score
  function for query (B, T, N, H) against ``kv_len`` = S keys. Used by :func:`attention` and
  by :mod:`jattn.parallel`, which plans one call per pair of shards.

  ``score``, in place of ``score_fn``: a score function already closure-converted,
  ``(fn(s, b, h, q, kv, *consts), consts)``, for a caller that differentiates the constants
  itself (:func:`backward` returns their cotangents in this order)."""
  B, T, N, _ = query.shape
  S = kv_len
  bq, bk = min(block_q, T), min(block_kv, S)
  view = tiling.tile_classes(mask, B, N, T, S, bq, bk)
  rows, cols = (jax.tree.map(jnp.asarray, tiling.schedule(v)) for v in (view, view.T))

  example = tiling.tile_indices(B, N, bq, bk, 0, 0)
  mask_fn: Callable | None = None
  mask_consts: list = []
  if mask is not None:
    # The batch and head indices are always the whole (concrete) ranges: closing over them
    # lets masks index their per-row arrays along the sequence only (see masks.indexing.take).
    b, h, q, kv = example
    mask_fn, mask_consts = common.hoist(lambda q, kv: mask(b, h, q, kv), q, kv)
  modify: Callable | None = None
  score_consts: list = []
  if score is not None:
    assert score_fn is None, "a score function comes converted or not, not both"
    modify, score_consts = score[0], list(score[1])
  elif score_fn is not None:
    s = jax.ShapeDtypeStruct((B, N, bq, bk), common.stats_dtype(query.dtype))
    modify, score_consts = common.hoist(score_fn, s, *example)
  seed = None
  if dropout_rate:
    assert dropout_rng is not None, "a checked call with dropout has its key"
    seed = tiling.Seed(jnp.stack(_dropout.seed_words(dropout_rng)), positions)
  static = tiling.Static(
    float(scale), float(dropout_rate), bool(broadcast_dropout), T, S, bq, bk, mask_fn, modify
  )
  return Plan(static, rows, cols, seed, tuple(mask_consts), tuple(score_consts))


def forward(
  p: Plan, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out (B, T, N, H), m (B, T, N), l (B, T, N))``, all float32/64, with no custom_vjp
  around them: the normalised output and each row's max and sum (m = 0 and l = 0 for rows
  that attend to nothing); the log-sum-exp is ``common.log_sum_exp(m, l)``."""
  return _forward(p.static, query, (key, value), bias, p.seed, p.rows, p.consts)


def backward(
  p: Plan,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  out: jax.Array,
  m: jax.Array,
  l: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
  bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, tuple[jax.Array | None, ...]]:
  """Float32/64 ``(d_query, d_key, d_value, d_bias, d_score)`` of :func:`forward`'s outputs
  given the cotangents of out and the log-sum-exp (``d_score``: of the plan's score function
  constants, in their order, None for the integer ones); ``out``, ``m`` and ``l`` may be
  those of a larger softmax that this call is one part of (ring attention): the rule only
  needs the final rows' output, max and sum. Δ here is FlashAttention's rowsum(dY ⊙ Y) from
  ``out``, since a row's probabilities span the other parts too; :func:`attention` sums the
  exact rowsum(A ⊙ dA)."""
  d_query, d_kv, d_bias, _, d_score = _blockwise_backward.backward(
    p.static, (query, (key, value), bias, p.seed, p.cols, p.consts, out, m, l), d_out, d_lse
  )
  assert isinstance(d_kv, tuple), "a (key, value) pair's cotangent is a pair"
  d_key, d_value = d_kv
  return d_query, d_key, d_value, d_bias, d_score


# --- forward ------------------------------------------------------------------


def _forward(
  static: tiling.Static,
  query: jax.Array,
  kv: KV,
  bias: jax.Array | None,
  seed: tiling.Seed | None,
  rows: tiling.Schedule,
  consts: Consts,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out (B, T, N, Hv), m (B, T, N), l (B, T, N))``, all float32/64 (see :func:`forward`);
  ``kv`` is a (key, value) pair or a :class:`jattn.impl.kv_tiles.CacheTiles`."""
  B, T, N, H = query.shape
  tiles = kv_tiles.source(kv, static.block_kv)
  K, Hv, v_dtype = tiles.heads
  G = N // K
  bq = static.block_q
  dtype = common.stats_dtype(query.dtype)
  q_tiles = tiling.query_tiles(common.scaled_queries(query, static.scale), bq, K)
  bias = tiling.pad_bias(bias, static)
  keep_scale = tiling.keep_scale(static, dtype)

  def query_tile(i: jax.Array, q_tile: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    def body(
      j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], masked: bool
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
      acc, m, l = carry
      tile = tiling.tile(static, q_tile, tiles.key_tile(j), bias, seed, consts, i, j, masked=masked)
      s = tile.s if tile.keep is None else jnp.where(tile.keep, tile.s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))  # -inf: nothing yet
      shift = common.row_max(m_new)
      # Narrow values (bfloat16, float16): p is rounded to their dtype for p·v, and the row
      # sum adds up the same rounded weights, so the output is exactly their weighted mean
      # (a saturated row returns its value row exactly, which its gradient relies on).
      p = jnp.exp(s - shift).astype(v_dtype)
      # m is a constant of the derivative, as the shift is (both stop_gradient), so l and acc
      # differentiate as sums over one fixed shift: forward mode through this loop (jvp of
      # the backward pass, jax.hessian) is exact over any number of key/value tiles.
      alpha = jnp.exp(jax.lax.stop_gradient(m) - shift)
      l = l * alpha + jnp.sum(p, axis=-1, keepdims=True, dtype=dtype)
      if tile.drop is not None:
        assert keep_scale is not None, "dropout's kept weights come with its scale"
        p = jnp.where(tile.drop, p * keep_scale.astype(p.dtype), 0)
      pv = jnp.einsum(
        "BKrk,BKkH->BKrH",
        tiling.stack_heads(p, K),
        tiles.value_tile(j),
        preferred_element_type=dtype,
      )
      acc = acc * tiling.stack_heads(alpha, K) + pv
      return acc, m_new, l

    # Sharded as the query tiles (acc) and the query's batch and heads (m, l) are.
    rows_like: dict[str, Any] = dict(like=query, axes=(0, 2, None, None))
    init = (
      common.full((B, K, G * bq, Hv), 0, dtype, like=q_tile, axes=(0, 1, 2, None)),
      common.full((B, N, bq, 1), -jnp.inf, dtype, **rows_like),
      common.full((B, N, bq, 1), 0, dtype, **rows_like),
    )
    acc, m, l = tiling.visit(rows, i, body, init)
    out = acc / tiling.stack_heads(common.safe_total(l), K)  # empty rows: acc is 0
    return out, common.row_max(m)[..., 0], l[..., 0]  # (B, K, G·bq, H), (B, N, bq) twice

  tile_ids = jnp.arange(q_tiles.shape[0], dtype=jnp.int32)
  out, m, l = jax.lax.map(lambda x: query_tile(*x), (tile_ids, q_tiles))
  out = tiling.untile_queries(out, N, T)
  rows_of = lambda x: x.transpose(1, 0, 3, 2).reshape(B, -1, N)[:, :T]  # (nq, B, N, bq)
  return out, rows_of(m), rows_of(l)


# --- the custom_vjp -----------------------------------------------------------


@functools.partial(orders.reverse_only, nondiff_argnums=(0,), who="implementation='blockwise'")
def _attention_vjp(
  static: tiling.Static,
  query: jax.Array,
  kv: KV,
  bias: jax.Array | None,
  seed: tiling.Seed | None,
  rows: tiling.Schedule,
  cols: tiling.Schedule,
  mask_consts: tuple[Any, ...],
  score_consts: tuple[Any, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  out, m, l = _forward(static, query, kv, bias, seed, rows, (mask_consts, score_consts))
  return out, common.log_sum_exp(m, l), common.max_logit(m, l)


def _attention_fwd(
  static: tiling.Static,
  query: jax.Array,
  kv: KV,
  bias: jax.Array | None,
  seed: tiling.Seed | None,
  rows: tiling.Schedule,
  cols: tiling.Schedule,
  mask_consts: tuple[Any, ...],
  score_consts: tuple[Any, ...],
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], _Residuals]:
  out, m, l = _forward(static, query, kv, bias, seed, rows, (mask_consts, score_consts))
  residuals = (query, kv, bias, seed, rows, cols, mask_consts, score_consts, m, l)
  return (out, common.log_sum_exp(m, l), common.max_logit(m, l)), residuals


def _attention_bwd(
  static: tiling.Static,
  residuals: _Residuals,
  cotangents: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[Any, ...]:
  query, kv, bias, seed, rows, cols, mask_consts, score_consts, m, l = residuals
  d_out, d_lse, _ = cotangents  # the max logit is a statistic: nothing flows back through it
  backward = orders.first_order(
    functools.partial(_blockwise_backward.backward, static),
    "implementation='blockwise'",
    orders.TILE_LOOPS,
    forward=True,
  )
  d_query, d_kv, d_bias, d_mask, d_score = backward(
    (query, kv, bias, seed, cols, (mask_consts, score_consts), None, m, l),
    d_out,
    d_lse,
    rows,
  )
  d_query = d_query.astype(query.dtype)
  if isinstance(kv, tuple):
    d_kv = tuple(d.astype(x.dtype) for d, x in zip(d_kv, kv))
  if bias is not None:
    d_bias = d_bias.astype(bias.dtype)
  return d_query, d_kv, d_bias, None, None, None, d_mask, d_score


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


def _prepare(spec: CallSpec, blocks: tuple[int | None, int | None], backend: str) -> CallSpec:
  block_q, block_kv = resolve_blocks(blocks[0], blocks[1], backend)
  return dataclasses.replace(spec, block_q=block_q, block_kv=block_kv)


IMPLEMENTATION = contract.Implementation(
  name="blockwise",
  runs_on=contract.BACKENDS,
  backwards=BACKWARDS,
  masks="every mask (skips the tiles it empties)",
  run=attention,
  positions=None,
  prepare=_prepare,
  tiles=True,
  read_cache=attention_over_cache,
  backward_notes=(
    (
      "autodiff",
      " (JAX cannot reverse-differentiate its tile loops, whose trip counts depend on the "
      "mask, and autodiff would store every tile's probabilities, O(T·S) memory)",
    ),
  ),
)
