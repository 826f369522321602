"""``implementation="flex"``: jattn's own fused GPU kernel, any index mask and score function
compiled into one Pallas kernel (Triton lowering), forward and backward.

The call's combined mask and its score function (with the soft cap) are traced into the
kernels' bodies on each tile's indices (:mod:`jattn.impl._in_kernel`); the tiles come from
the mask's tile classes as in blockwise, so EMPTY tiles are never loaded and FULL ones skip
the mask (:mod:`jattn.impl.flex._kernels`, :mod:`jattn.impl.flex._backward_kernels`). GQA
and MQA read each key/value head once; the value head dim may differ; lengths need not be whole
tiles; dropout's pattern is regenerated from (rng, batch, head, q, kv) in each kernel, as
every implementation draws it; a bias of any broadcastable shape is read tile by tile (its
gradient, where asked for, through a (B, N, T, S) float32 buffer); rows with nothing to
attend to give zeros and an lse of -inf. Inputs sharded over the batch and heads run per
device (:func:`jattn.impl.sharded.per_shard`), the mask, score function and dropout on
global indices; a sequence-parallel part (:mod:`jattn.parallel`) draws its dropout at the
global positions its rows and columns stand for, a map traced into the kernels as masks are.

A mask or score function Triton cannot evaluate in the kernel (a gather from an array in
registers, as ``jnp.searchsorted`` makes; an array read whole whose dimensions are not
powers of two, as in ``valid.sum(-1)[b]``) is refused by name in the selection table
(:mod:`jattn.impl.flex._lowers`), never left to fail in lowering.

Its kernels written for Mosaic GPU, for Hopper, are a package and row of their own
(:mod:`jattn.impl.flex_hopper`): an explicit opt-in, never picked by
``implementation=None``, until a GPU has run them and their record is committed.

On a GPU, ``implementation=None`` runs it for every call cuDNN does not express and it does
(it comes after cuDNN in the table). Its tiles, warps and stages come from :data:`TILES`, by GPU
generation, head dim and dtype (starting points until measured with
``python -m experiments.tune_flex``). The floating arrays a score function reads (learned
ALiBi slopes, a T5 table) get their gradients, where differentiated, from the score
function's VJP on the (B, N, T, S) grid in XLA, a chunk of query rows at a time
(:mod:`jattn.impl._chunks`), its cotangent the dQ kernel's dS (a (B, N, T, S) float32
buffer, as a bias's gradient takes). Sinks are
added around it, as for every implementation that does not take them itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import dropout as _dropout
from jattn.impl import _chunks, _gpus, _in_kernel, common, contract, sharded, tiling
from jattn.impl._gpus import generation as generation
from jattn.impl.contract import CallSpec
from jattn.impl.flex import _backward as _flex_backward
from jattn.impl.flex import _kernels as _kernels
from jattn.impl.flex import _lowers as _flex_lowers

__all__ = [
  "IMPLEMENTATION",
  "Tiles",
  "Passes",
  "FALLBACK",
  "generation",
  "tiles_for",
  "tiles_reason",
]

BACKWARDS: tuple[str, ...] = ()  # its own fused backward kernels


class Tiles(NamedTuple):
  """The kernels' launch settings: tiles (powers of two, as Triton's blocks are) and Triton's
  warps per program and software-pipelining stages."""

  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int


class Passes(NamedTuple):
  """Each kernel's launch settings: the forward pass, the dQ pass and the dK/dV pass walk
  their own tile schedules, so each takes the tiles that suit its accumulators."""

  forward: Tiles
  dq: Tiles
  dkv: Tiles


def _same(tiles: Tiles) -> Passes:
  return Passes(tiles, tiles, tiles)


# Keyed by (GPU generation, head dim rounded up to a power of two, bytes per input element).
# The Hopper bfloat16 rows are measured on an H200, the rest are starting points that compile
# without spills (docs/tuning.md; python -m experiments.check_flex_compile, tune_flex).
TILES: dict[tuple[str, int, int], Passes] = {
  ("sm_80", 64, 2): Passes(Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2)),
  ("sm_80", 128, 2): _same(Tiles(64, 64, 8, 2)),
  ("sm_80", 256, 2): _same(Tiles(32, 32, 8, 2)),
  ("sm_80", 64, 4): _same(Tiles(64, 32, 4, 2)),
  ("sm_80", 128, 4): _same(Tiles(32, 32, 8, 2)),
  ("sm_80", 256, 4): _same(Tiles(16, 32, 8, 1)),
  ("sm_90", 64, 2): _same(Tiles(64, 64, 4, 3)),
  ("sm_90", 128, 2): Passes(Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 2), Tiles(32, 64, 4, 3)),
  ("sm_90", 256, 2): _same(Tiles(32, 32, 8, 2)),
  ("sm_90", 64, 4): _same(Tiles(64, 32, 4, 2)),
  ("sm_90", 128, 4): _same(Tiles(32, 32, 8, 2)),
  ("sm_90", 256, 4): _same(Tiles(32, 32, 8, 1)),
}
FALLBACK = _same(Tiles(32, 32, 4, 2))  # head dims past the table (and float64 in interpret mode)

# Whether the dK/dV kernel sums dS into dK as two narrow parts (hi, and its rounding error
# lo) or as one, as cuDNN and FlashAttention do, by GPU generation: one part where measured
# as fast and as accurate as they are (Hopper), two elsewhere (docs/tuning.md).
SPLIT_DS: dict[str, bool] = {"sm_80": True, "sm_90": False}


def tiles_for(head_dim: int, itemsize: int, device_kind: str | None = None) -> Passes:
  """The table's row for a call, on ``device_kind`` (default: the first GPU, if any)."""
  if device_kind is None:
    device_kind = _gpus.gpu_kind()
  key = (generation(device_kind), max(64, _kernels.pow2(head_dim)), itemsize)
  return TILES.get(key, FALLBACK)


def _check(call: contract.Call) -> str | None:
  s = call.spec
  if reason := tiles_reason(s.block_q, s.block_kv):
    return reason
  # The mask and score function as the kernels would see them: what Triton cannot lower
  # (a gather from registers, an array read whole) is refused here, not in lowering.
  for bq, bk in sorted({(x.block_q, x.block_kv) for x in _passes(s, s.T, s.S, call.dtype)}):
    if reason := _flex_lowers.why_not(s.mask, s.score_fn, bq, bk, s.H, call.dtype):
      return reason
  return None


def _passes(spec: CallSpec, T: int, S: int, dtype: Any) -> Passes:
  """Each kernel's tiles: the caller's for every pass where named, else the table's, no
  longer than the lengths rounded up to a power of two (Triton's blocks)."""

  def fit(row: Tiles) -> Tiles:
    bq = min(spec.block_q or row.block_q, max(16, _kernels.pow2(T)))
    bk = min(spec.block_kv or row.block_kv, max(16, _kernels.pow2(S)))
    return row._replace(block_q=bq, block_kv=bk)

  return Passes(*map(fit, tiles_for(spec.H, jnp.dtype(dtype).itemsize)))


def _prepare(spec: CallSpec, blocks: tuple[int | None, int | None], backend: str) -> CallSpec:
  # The caller's tiles stay (None where not named): the table is keyed by the inputs' dtype
  # and the GPU's generation, which _run reads.
  del blocks, backend
  return spec


def _run(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  # Each device runs the kernels on its batch rows and heads; the mask, score function and
  # dropout see the global indices there (spec.shard_offsets), so any of them splits.
  return sharded.per_shard(_attend, query, key, value, spec, global_index=True)


def _attend(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  """The kernels on one device's share: query (b, T, n, H) of the call's (B, T, N, H)."""
  T, S = query.shape[1], key.shape[1]
  passes = _passes(spec, T, S, query.dtype)
  s_dtype = jnp.promote_types(query.dtype, jnp.float32)
  traced = _traces(spec, passes, s_dtype)
  if traced is None:  # the passes' traces read different arrays: one tiling for all
    passes = _same(passes.forward)
    traced = _traces(spec, passes, s_dtype)
    assert traced is not None
  mask, score, positions = traced
  score_grid = None
  if score[0] is not None and any(jnp.issubdtype(a.dtype, jnp.floating) for a in score[0].arrays):
    # learnable: the score function on the whole grid, for its arrays' gradients
    assert spec.score_fn is not None
    B, N = query.shape[0], query.shape[2]
    rows = _chunks.rows(B, N, T, S)  # its VJP taken this many query rows at a time
    score_grid = _grid_trace(spec.score_fn, score[0], B, N, rows, S, s_dtype)
  # The tile classes over all batch rows and heads, the global ones (the mask's arrays are
  # whole on each device): the forward's and dQ's rows, dK/dV's columns.
  schedules = (
    _kernels.schedules(spec.mask, spec.B, spec.N, T, S, *passes.forward[:2])[0],
    _kernels.schedules(spec.mask, spec.B, spec.N, T, S, *passes.dq[:2])[0],
    _kernels.schedules(spec.mask, spec.B, spec.N, T, S, *passes.dkv[:2])[1],
  )

  split_ds = SPLIT_DS.get(generation(_gpus.gpu_kind()), True)

  def settings(row: Tiles, schedule: tiling.Schedule) -> _kernels.Settings:
    return _kernels.Settings(
      scale=spec.scale,
      q_len=T,
      kv_len=S,
      block_q=row.block_q,
      block_kv=row.block_kv,
      num_warps=row.num_warps,
      num_stages=row.num_stages,
      interpret=spec.interpret,
      dropout_rate=spec.dropout_rate,
      broadcast_dropout=spec.broadcast_dropout,
      from_last=tiling.heaviest_last(schedule),
      split_ds=split_ds,
    )

  seed = None
  if spec.dropout_rate:
    seed = jnp.stack(_dropout.seed_words(spec.dropout_rng))
  out, lse, top = _flex_backward.attention(
    query,
    key,
    value,
    schedules,
    mask,
    score,
    (
      settings(passes.forward, schedules[0]),
      settings(passes.dq, schedules[1]),
      settings(passes.dkv, schedules[2]),
    ),
    seed,
    spec.bias,
    spec.shard_offsets,
    score_grid,
    positions,
  )
  return out, lse, top if spec.return_max_logit else None


Traces = tuple[tuple[_in_kernel.Function | None, ...], ...]


def _traces(spec: CallSpec, passes: Passes, s_dtype: Any) -> Traces | None:
  """``(masks, score functions, dropout's positions)``: the call's mask, score function and
  the global positions its dropout is drawn at (a sequence-parallel part's
  ``spec.positions``; None: the kernels' own indices) traced at each pass's tiles (a
  trace's shapes are its tiles'), or None where the traces do not read the very same arrays
  (the kernels share one copy of them, and their gradients)."""
  found: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
  for row in passes:
    bq, bk = row.block_q, row.block_kv
    if (bq, bk) in found:
      continue
    specs = _kernels.index_specs(bq, bk)
    mask = score = None
    if spec.mask is not None:
      m = spec.mask
      mask = _in_kernel.Function.trace(lambda b, h, q, kv: m(b, h, q, kv), *specs)
    if spec.score_fn is not None:
      fn = spec.score_fn
      s_spec = jax.ShapeDtypeStruct((1, 1, bq, bk), s_dtype)
      score = _in_kernel.Function.trace(lambda s, b, h, q, kv: fn(s, b, h, q, kv), s_spec, *specs)
    positions = None
    if spec.dropout_rate and spec.positions is not None:
      maps = spec.positions
      positions = _in_kernel.Function.trace(
        lambda b, h, q, kv: common.at_positions((b, h, q, kv), maps), *specs
      )
    found[bq, bk] = (mask, score, positions)
  first = next(iter(found.values()))
  for other in found.values():
    for x, y in zip(first, other):
      if x is not None and not _in_kernel.same_arrays(x.arrays, y.arrays):
        return None
  chosen = [found[row.block_q, row.block_kv] for row in passes]
  return tuple(tuple(x[i] for x in chosen) for i in range(3))


def _grid_trace(
  fn: Any, tile: _in_kernel.Function, B: int, N: int, T: int, S: int, dtype: Any
) -> Any:
  """The score function traced on T query rows of this device's (B, N, T, S) grid (a chunk
  of them: the query index an input, (1, 1, T, 1)), for the gradients of the arrays it
  reads; None if they do not come out as the tile trace's (then those gradients are
  refused)."""
  specs = [
    jax.ShapeDtypeStruct(shape, jnp.int32)
    for shape in ((B, 1, 1, 1), (1, N, 1, 1), (1, 1, T, 1), (1, 1, 1, S))
  ]
  s_spec = jax.ShapeDtypeStruct((B, N, T, S), dtype)
  grid = _in_kernel.Function.trace(lambda s, b, h, q, kv: fn(s, b, h, q, kv), s_spec, *specs)
  same = len(grid.arrays) == len(tile.arrays) and all(
    (a.shape, a.dtype) == (b.shape, b.dtype) for a, b in zip(grid.arrays, tile.arrays)
  )
  return grid.jaxpr if same else None


IMPLEMENTATION = contract.Implementation(
  name="flex",
  runs_on=("gpu",),
  backwards=BACKWARDS,
  masks=(
    "every mask kind, and index functions traced into the kernel whose operations Triton "
    "lowers (captured arrays read by indexing them with the index arguments)"
  ),
  run=_run,
  prepare=_prepare,
  dtypes=("float32", "bfloat16", "float16"),
  positions=None,  # dropout's global positions are traced into the kernels (_traces)
  tiles=True,
  tile_rule=lambda bq, bk: tiles_reason(bq, bk),
  ring_pairs=True,
  fused=True,
  interpretable=True,
  check=_check,
)


def tiles_reason(block_q: int | None, block_kv: int | None) -> str | None:
  """Why flex cannot take these tile sizes (Triton's blocks: powers of two, at least 16), or
  None; a size not given takes flex's default."""
  for name, block in (("block_q", block_q), ("block_kv", block_kv)):
    if block is not None and (block < 16 or block & (block - 1)):
      return f"{name}={block} (flex's tiles are powers of two, at least 16)"
  return None
