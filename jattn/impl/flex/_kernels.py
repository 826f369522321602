"""The flex kernel's forward pass: a Pallas kernel (Triton lowering) with the call's mask and
score function traced into its body.

One program per (query tile, batch row, query head); it walks the key/value tiles of its
query tile's row of the tile schedule (:func:`jattn.impl.tiling.schedule`: FULL tiles
first, with no mask arithmetic, then PARTIAL ones, masked; EMPTY tiles never loaded) with
an online softmax in float32 (float64 for float64 inputs). The key/value head is
``n // G`` (GQA and MQA read K/V once, never repeated). The mask and score function run
on each tile's indices through :func:`jattn.impl._in_kernel.evaluate`, the arrays they
read passed as kernel inputs and loaded by index. Rows the mask empties give zeros and a
log-sum-exp of -inf.

Scores are kept in base 2, ``t = s · log2(e)`` (for a plain call one multiply of ``q kᵀ`` by
``scale · log2(e)``), so each probability is one ``exp2``, the GPU's native exponential,
where ``exp`` costs a range reduction around it. Each row's max ``m`` and the base-2 log of
its sum ``log2 l`` are written apart (the log-sum-exp, ``(m + log2 l) · ln 2``, is formed
outside): the backward pass recomputes probabilities as ``exp2((t - m) - log2 l)``, exact
where ``t`` is near ``m`` even when ``|m|`` is huge (an additive -1e9 mask on a whole row,
scores scaled by 1e3), where ``exp2(t - lse)`` would lose ``log2 l``, and every digit below
``ulp(lse)``, to rounding.

Lengths are padded to whole tiles and head dimensions to powers of two (zeros, sliced off
after): Triton's blocks are powers of two. The tile logic (the schedule, the two loops,
the masked online softmax) is independent of the lowering; only the compiler parameters
name Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn import dropout as _dropout
from jattn.impl import _in_kernel, common, tiling
from jattn.impl._in_kernel import Function
from jattn.impl.tiling import pad_to, tile_of
from jattn.impl.tiling import padded_bias as pad_bias


class Settings(NamedTuple):
  """The static settings of one forward kernel."""

  scale: float
  q_len: int  # T
  kv_len: int  # S
  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int
  interpret: bool
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False  # one (T, S) pattern for every batch row and head
  from_last: bool = False  # programs take their tiles last first (tiling.heaviest_last)
  split_ds: bool = True  # dK sums dS as two narrow parts, hi + lo (flex.SPLIT_DS)


def in_tile_order(specs: Sequence[pl.BlockSpec], count: int, from_last: bool) -> list[Any]:
  """``specs`` whose index maps read their first grid index through :func:`tile_of` (every
  other field of each spec kept)."""
  if not from_last:
    return list(specs)
  return [
    dataclasses.replace(spec, index_map=functools.partial(_reordered, spec.index_map, count))
    for spec in specs
  ]


def _reordered(index_map: Any, count: int, program: Any, *rest: Any) -> Any:
  return index_map(tile_of(program, count, True), *rest)


def index_specs(block_q: int, block_kv: int) -> list[jax.ShapeDtypeStruct]:
  """The (batch, head, q_idx, kv_idx) a kernel passes a mask or score function on a tile."""
  return [
    jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, 1, block_q, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, 1, 1, block_kv), jnp.int32),
  ]


def forward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  rows: tiling.Schedule,
  mask: Function | None,
  score: Function | None,
  settings: Settings,
  scalars: jax.Array | None = None,
  bias: jax.Array | None = None,
  out_dtype: Any = None,
  positions: Function | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(out (B, T, N, Hv) in out_dtype (default: the query's), m, log2 l)``: each row's max
  base-2 score and the base-2 log of its sum of powers of two, (B, T, N) float32 (float64
  for float64 inputs), from which :func:`log_sum_exp` forms the row's log-sum-exp; rows
  with nothing to attend to have ``m = -inf`` and ``log2 l = 0``.

  query (B, T, N, H); key (B, S, K, H); value (B, S, K, Hv); ``rows`` the schedule of the
  (ceil(T / block_q), ceil(S / block_kv)) tiles; ``mask`` and ``score`` traced at
  :func:`index_specs` (the score function with a (1, 1, block_q, block_kv) float32 score
  first); ``scalars`` the dropout seed and the shard's offsets (:func:`kernel_scalars`,
  the seed needed when ``settings.dropout_rate`` > 0); ``bias`` (Bb, Nb, Tb, Sb), each axis 1 or
  the call's, added to the scaled scores before the score function; ``positions`` (traced at
  :func:`index_specs`, four outputs) the global (batch, head, q, kv) dropout is drawn at, for
  a sequence-parallel part (:attr:`jattn.impl.contract.CallSpec.positions`; None: the kernel's
  own indices).
  """
  B, T, N, H = query.shape
  S, K, Hv = key.shape[1], key.shape[2], value.shape[-1]
  bq, bk = settings.block_q, settings.block_kv
  nq, nk = math.ceil(T / bq), math.ceil(S / bk)
  Hp, Hvp = pow2(H), pow2(Hv)
  q = pad_to(query, nq * bq, Hp)
  k = pad_to(key, nk * bk, Hp)
  v = pad_to(value, nk * bk, Hvp)
  functions = (mask, score, positions)
  arrays = [a for f in functions if f is not None for a in f.arrays]
  n_mask, n_score, n_positions = (len(f.arrays) if f else 0 for f in functions)
  jaxpr_mask, jaxpr_score, jaxpr_positions = (f.jaxpr if f else None for f in functions)
  kernel = functools.partial(
    _forward_kernel,
    settings=settings,
    counts=(n_mask, n_score, n_positions, bias is not None),
    jaxprs=(jaxpr_mask, jaxpr_score, jaxpr_positions),
  )
  whole = whole_specs(arrays)
  if bias is not None:
    arrays.append(pad_bias(bias, nq * bq, nk * bk))
    whole.append(bias_row_spec(arrays[-1].shape, bq))
  if scalars is None:
    scalars = kernel_scalars(None)
  G = N // K
  ordered = functools.partial(in_tile_order, count=nq, from_last=settings.from_last)
  out, m, log_l = pl.pallas_call(
    kernel,
    grid=(nq, B, N),
    in_specs=ordered(
      [
        pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, nk * bk, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
        pl.BlockSpec((None, nk * bk, None, Hvp), lambda i, b, n: (b, 0, n // G, 0)),
        *schedule_specs(rows),
        *whole,
      ]
    ),
    out_specs=ordered(
      [
        pl.BlockSpec((None, bq, None, Hvp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
      ]
    ),
    out_shape=[
      jax.ShapeDtypeStruct((B, nq * bq, N, Hvp), out_dtype or query.dtype),
      *[jax.ShapeDtypeStruct((B, N, nq * bq), common.stats_dtype(query.dtype))] * 2,
    ],
    compiler_params=plgpu.CompilerParams(
      num_warps=settings.num_warps, num_stages=settings.num_stages
    ),
    interpret=settings.interpret,
    name="jattn_flex_forward",
  )(q, k, v, rows.order, rows.num_full, rows.num_partial, scalars, *arrays)
  rows_of = lambda x: x[:, :, :T].transpose(0, 2, 1)
  return out[:, :T, :, :Hv], rows_of(m), rows_of(log_l)


LOG2_E = math.log2(math.e)


def log_sum_exp(m: jax.Array, log2_l: jax.Array) -> jax.Array:
  """The rows' (natural) log-sum-exp from :func:`forward`'s base-2 ``m`` and ``log2 l``
  (-inf where empty)."""
  return (m + log2_l) * jnp.asarray(math.log(2), m.dtype)


class Scorer(NamedTuple):
  """One tile's scores inside a kernel, in base 2: ``scale · q kᵀ`` (plus the bias, through
  the score function) times ``log2(e)``, the mask (PARTIAL tiles only; padding past T and
  S included). Shared by the forward and backward kernels, so both see the very same
  scores."""

  settings: Settings
  jaxprs: tuple[Any, Any, Any]  # mask, score function, dropout's positions (None where absent)
  mask_refs: tuple[Any, ...]
  score_refs: tuple[Any, ...]
  scalars_ref: Any = None  # kernel_scalars: the dropout seed, then the shard's offsets
  position_refs: tuple[Any, ...] = ()  # the arrays dropout's positions read

  def dropped(
    self,
    x: jax.Array,
    q_idx: jax.Array,
    kv_idx: jax.Array,
    batch: jax.Array,
    head: jax.Array,
  ) -> jax.Array:
    """``x`` (bq, bk) with dropout applied: zero where dropped, scaled by 1 / (1 − rate)
    where kept (the pattern of :func:`jattn.dropout.keep_from_seed`, regenerated), drawn at
    the tile's indices or, for a sequence-parallel part, the global positions they map to."""
    rate = self.settings.dropout_rate
    if not rate:
      return x
    bq, bk = x.shape
    idx: tuple[Any, ...] = (batch, head, q_idx.reshape(1, 1, bq, 1), kv_idx.reshape(1, 1, 1, bk))
    if self.jaxprs[2] is not None:
      idx = tuple(_in_kernel.evaluate(self.jaxprs[2], self.position_refs, *idx))
    if self.settings.broadcast_dropout:
      idx = _dropout.shared_indices(*idx)
    seed = (self.scalars_ref[0], self.scalars_ref[1])
    keep = _dropout.keep_from_seed(seed, rate, *idx).reshape(bq, bk)
    return jnp.where(keep, x * jnp.asarray(1 / (1 - rate), x.dtype), jnp.zeros_like(x))

  def __call__(
    self,
    q: jax.Array,
    k: jax.Array,
    q_idx: jax.Array,
    kv_idx: jax.Array,
    batch: jax.Array,
    head: jax.Array,
    masked: bool,
    derivative: bool = False,
    bias: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array | None]:
    """``(t, slope)``: the (bq, bk) base-2 scores ``t = s · log2(e)`` in the statistics
    dtype, -inf where masked, and d score_fn(x)/dx at ``s`` (None without a score function
    or ``derivative``). A plain tile is one multiply of ``q kᵀ`` by ``scale · log2(e)``.
    ``batch`` and ``head`` are (1, 1, 1, 1) int32, ``q_idx`` (bq,), ``kv_idx`` (bk,);
    ``bias`` the tile's bias, (bq or 1, bk or 1)."""
    s = jnp.dot(q, k.T, preferred_element_type=common.stats_dtype(q.dtype))
    return self.of_products(s, q_idx, kv_idx, batch, head, masked, derivative, bias)

  def transposed(
    self,
    k: jax.Array,
    q: jax.Array,
    q_idx: jax.Array,
    kv_idx: jax.Array,
    batch: jax.Array,
    head: jax.Array,
    masked: bool,
    derivative: bool = False,
    bias: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array | None]:
    """What :meth:`__call__` gives, transposed: ``(tᵀ, slopeᵀ)``, (bk, bq), from ``k qᵀ``.
    A plain tile (no bias, no score function) stays transposed throughout, its mask's
    padding read in that orientation and only the mask function's values transposed (on
    PARTIAL tiles); with a bias or a score function the products are transposed to the
    call's orientation, where those act, and back."""
    f = common.stats_dtype(q.dtype)
    s_t = jnp.dot(k, q.T, preferred_element_type=f)
    if bias is None and self.jaxprs[1] is None:
      t_t = s_t * jnp.asarray(self.settings.scale * LOG2_E, f)
      if not masked:
        return t_t, None
      keep_t = (kv_idx[:, None] < self.settings.kv_len) & (q_idx[None, :] < self.settings.q_len)
      if self.jaxprs[0] is not None:
        keep_t = keep_t & self._mask(q_idx, kv_idx, batch, head).T
      return jnp.where(keep_t, t_t, -jnp.inf), None
    t, slope = self.of_products(s_t.T, q_idx, kv_idx, batch, head, masked, derivative, bias)
    return t.T, None if slope is None else slope.T

  def of_products(
    self,
    s: jax.Array,
    q_idx: jax.Array,
    kv_idx: jax.Array,
    batch: jax.Array,
    head: jax.Array,
    masked: bool,
    derivative: bool = False,
    bias: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array | None]:
    """:meth:`__call__` from the tile's products ``s = q kᵀ`` (bq, bk), in the statistics
    dtype."""
    bq, bk = s.shape
    f = s.dtype
    rest = (q_idx, kv_idx, batch, head, masked)
    if bias is None and self.jaxprs[1] is None:
      return self._masked(s * jnp.asarray(self.settings.scale * LOG2_E, f), *rest), None
    s = s * jnp.asarray(self.settings.scale, f)
    if bias is not None:
      s = s + bias.astype(f)
    qi, ki = q_idx.reshape(1, 1, bq, 1), kv_idx.reshape(1, 1, 1, bk)
    slope = None
    if self.jaxprs[1] is not None:

      def score(x: jax.Array) -> jax.Array:
        (y,) = _in_kernel.evaluate(
          self.jaxprs[1], self.score_refs, x.reshape(1, 1, bq, bk), batch, head, qi, ki
        )
        return jnp.broadcast_to(y, (1, 1, bq, bk)).reshape(bq, bk).astype(f)

      if derivative:  # score functions act elementwise on the scores
        s, slope = jax.jvp(score, (s,), (jnp.ones_like(s),))
      else:
        s = score(s)
    return self._masked(s * jnp.asarray(LOG2_E, f), *rest), slope

  def _masked(
    self,
    t: jax.Array,
    q_idx: jax.Array,
    kv_idx: jax.Array,
    batch: jax.Array,
    head: jax.Array,
    masked: bool,
  ) -> jax.Array:
    """``t`` -inf where the mask (or the padding past T and S) says no, on PARTIAL tiles."""
    if not masked:
      return t
    keep = (q_idx[:, None] < self.settings.q_len) & (kv_idx[None, :] < self.settings.kv_len)
    if self.jaxprs[0] is not None:
      keep = keep & self._mask(q_idx, kv_idx, batch, head)
    return jnp.where(keep, t, -jnp.inf)

  def _mask(
    self, q_idx: jax.Array, kv_idx: jax.Array, batch: jax.Array, head: jax.Array
  ) -> jax.Array:
    """The mask function's (bq, bk) values on the tile."""
    bq, bk = q_idx.shape[0], kv_idx.shape[0]
    qi, ki = q_idx.reshape(1, 1, bq, 1), kv_idx.reshape(1, 1, 1, bk)
    (m4,) = _in_kernel.evaluate(self.jaxprs[0], self.mask_refs, batch, head, qi, ki)
    return jnp.broadcast_to(m4, (1, 1, bq, bk)).reshape(bq, bk)


Counts = tuple[int, int, int, bool]
"""How many arrays the mask, the score function and dropout's positions read, and whether a
bias follows them: how a kernel's trailing refs divide (:func:`split_refs`)."""


def split_refs(
  refs: Sequence[Any], counts: Counts
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], Any, tuple[Any, ...]]:
  """``(mask refs, score refs, positions' refs, bias ref or None, the rest)`` of a kernel's
  trailing refs."""
  n_mask, n_score, n_positions, has_bias = counts
  a, b = n_mask, n_mask + n_score
  c = b + n_positions
  return (
    tuple(refs[:a]),
    tuple(refs[a:b]),
    tuple(refs[b:c]),
    refs[c] if has_bias else None,
    tuple(refs[c + has_bias :]),
  )


def bias_row_spec(shape: tuple[int, ...], block_q: int) -> pl.BlockSpec:
  """The padded bias's (query tile, all keys) plane for the programs (query tile, b, n)."""
  Bb, Nb, Tb, Sb = shape
  return pl.BlockSpec(
    (None, None, block_q if Tb > 1 else 1, Sb),
    lambda i, b, n: (b if Bb > 1 else 0, n if Nb > 1 else 0, i if Tb > 1 else 0, 0),
  )


def bias_tile(ref: Any, rows: Any, cols: Any) -> jax.Array | None:
  """The bias of one tile from a (rows, keys) ref: ``rows`` and ``cols`` slices, applied only
  along the axes that are not 1 (broadcast ones stay 1)."""
  if ref is None:
    return None
  return ref[rows if ref.shape[0] > 1 else slice(None), cols if ref.shape[1] > 1 else slice(None)]


def scalar_index(x: jax.Array) -> jax.Array:
  """A program id as the (1, 1, 1, 1) int32 index masks and score functions take."""
  return jnp.full((1, 1, 1, 1), x, jnp.int32)


def global_index(scalars_ref: Any, b: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(batch, head)``: a program's batch row ``b`` and query head ``n`` within its shard as
  the global indices the mask, score function and dropout see (:func:`scalar_index`)."""
  b0, n0 = (scalars_ref[i].astype(jnp.int32) for i in (2, 3))
  return scalar_index(b + b0), scalar_index(n + n0)


def _forward_kernel(
  q_ref: Any,
  k_ref: Any,
  v_ref: Any,
  order_ref: Any,
  num_full_ref: Any,
  num_partial_ref: Any,
  scalars_ref: Any,
  *refs: Any,
  settings: Settings,
  counts: Counts,
  jaxprs: tuple[Any, Any, Any],
) -> None:
  mask_refs, score_refs, position_refs, bias_ref, (o_ref, m_ref, log_l_ref) = split_refs(
    refs, counts
  )
  scorer = Scorer(settings, jaxprs, mask_refs, score_refs, scalars_ref, position_refs)
  bq, bk = settings.block_q, settings.block_kv
  i = tile_of(pl.program_id(0), order_ref.shape[0], settings.from_last)
  b, n = pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  f = common.stats_dtype(q.dtype)
  q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
  batch, head = global_index(scalars_ref, b, n)

  def body(t: jax.Array, carry: tuple[Any, Any, Any], masked: bool) -> tuple[Any, Any, Any]:
    acc, m, l = carry
    j = order_ref[i, t]
    kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
    k = k_ref[pl.ds(j * bk, bk), :]
    bias = bias_tile(bias_ref, slice(None), pl.ds(j * bk, bk))
    t, _ = scorer(q, k, q_idx, kv_idx, batch, head, masked, bias=bias)
    m_new = jnp.maximum(m, jnp.max(t, axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(t - shift[:, None])
    correction = jnp.exp2(m - shift)
    v = v_ref[pl.ds(j * bk, bk), :]
    kept = scorer.dropped(p, q_idx, kv_idx, batch, head)  # the normaliser counts them all
    acc = acc * correction[:, None] + jnp.dot(kept.astype(v.dtype), v, preferred_element_type=f)
    return acc, m_new, l * correction + jnp.sum(p, axis=1)

  Hvp = o_ref.shape[-1]
  carry = (
    jnp.zeros((bq, Hvp), f),
    jnp.full((bq,), -jnp.inf, f),
    jnp.zeros((bq,), f),
  )
  n_full, n_partial = num_full_ref[i], num_partial_ref[i]
  carry = jax.lax.fori_loop(0, n_full, lambda t, c: body(t, c, False), carry)
  acc, m, l = jax.lax.fori_loop(n_full, n_full + n_partial, lambda t, c: body(t, c, True), carry)
  some = l > 0
  o_ref[...] = jnp.where(some[:, None], acc / jnp.where(some, l, 1.0)[:, None], 0.0).astype(
    o_ref.dtype
  )
  m_ref[...] = jnp.where(some, m, -jnp.inf)
  log_l_ref[...] = jnp.log2(jnp.where(some, l, 1.0))


def _origin(ndim: int, *_: Any) -> tuple[int, ...]:
  return (0,) * ndim


def whole_specs(arrays: Sequence[jax.Array]) -> list[pl.BlockSpec]:
  """Each array whole in every program (the arrays masks and score functions read)."""
  return [pl.BlockSpec(a.shape, functools.partial(_origin, a.ndim)) for a in arrays]


def schedule_specs(schedule: tiling.Schedule) -> list[pl.BlockSpec]:
  """A tile schedule's three arrays and :func:`kernel_scalars`, whole in every program (the
  kernels' inputs after the tiles they walk)."""
  return [
    pl.BlockSpec(schedule.order.shape, lambda *_: (0, 0)),
    pl.BlockSpec(schedule.num_full.shape, lambda *_: (0,)),
    pl.BlockSpec(schedule.num_partial.shape, lambda *_: (0,)),
    pl.BlockSpec((4,), lambda *_: (0,)),
  ]


def kernel_scalars(seed: jax.Array | None, offsets: jax.Array | None = None) -> jax.Array:
  """The kernels' (4,) uint32 input: the dropout seed's two words
  (:func:`jattn.dropout.seed_words`; zeros without dropout), then the global index of the
  shard's first batch row and first query head (zeros unsharded; :func:`global_index`)."""
  seed = jnp.zeros((2,), jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32)
  offsets = jnp.zeros((2,), jnp.uint32) if offsets is None else offsets.astype(jnp.uint32)
  return jnp.concatenate([seed, offsets])


def pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def schedules(
  mask: Any, B: int, N: int, T: int, S: int, block_q: int, block_kv: int
) -> tuple[tiling.Schedule, tiling.Schedule]:
  """``(rows, cols)``: per query tile its key/value tiles, and per key/value tile its query
  tiles, FULL first, then PARTIAL (blockwise's schedules). NumPy arrays where the mask is
  known when traced (so :func:`jattn.impl.tiling.heaviest_last` can read them; the kernels
  take them as constants), else traced."""
  view = tiling.tile_classes(mask, B, N, T, S, block_q, block_kv)
  return tiling.schedule(view), tiling.schedule(view.T)
