"""``implementation="splash"``: jattn calls compiled into JAX's splash attention TPU kernel.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is a Pallas kernel
with a fused backward that skips the (query block, key/value block) pairs a mask empties.
It takes a static mask per head (analysed when the kernel is built), segment ids, a logit
soft cap, GQA/MQA and per-head sink logits. This module compiles a :class:`CallSpec`
into those arguments:

* the mask's conjuncts that are the same for every batch row and hold known values
  (causal with any static offset, sliding windows, chunks, dense arrays, per-head arrays,
  global tokens, strides, block-sparse layouts, and ``&``/``|``/``~`` of those) become one
  splash mask per head. Causal, windows and chunked-causal map onto splash's own
  ``CausalMask``/``LocalMask``/``ChunkedCausalMask``, which the kernel computes from
  indices; the rest are tabulated block by block from the jattn mask's index function;
* :func:`jattn.masks.segments`, :func:`jattn.masks.lengths` and the padding of lengths that
  are not whole blocks become splash segment ids: a padded or out-of-length position gets an
  id no other position has;
* the scale multiplies the query; ``logits_soft_cap`` is the kernel's own soft cap; K == 1
  runs the MQA kernel, other K the grouped MHA kernel.

jattn's numerics contract (a row that may attend to nothing returns zeros, its
log-sum-exp is -inf and its gradients are zero) does not hold for the kernel alone, which
averages the values of such a row or divides 0 by 0. Every call therefore passes each head
a sink logit far below any real logit and far above the kernel's mask value: a row with a
key to attend to is unchanged (the sink's weight ``exp(sink - max)`` is exactly 0), while
an empty row gets weight 1 on the sink, so its output is exactly 0, its log-sum-exp is the
sink (mapped to -inf here) and the backward's probabilities ``exp(mask_value - sink)`` are
exactly 0.

``return_residual`` uses the kernel's residual-saving forward, which JAX cannot
differentiate; a ``custom_vjp`` here differentiates the output through the kernel's own
backward and the log-sum-exp through two identities: d lse / d q = softmax · K (one more
forward with the keys as values) and d lse / d K = the value-gradient of that forward.

:func:`mask_reason` says why a mask cannot be compiled (None when it can); the selection
table (:mod:`jattn.impl._select`) asks it. Nothing here validates arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _compat
from jattn.impl import _base, _orders, _sharded
from jattn.masks import _core, kinds, layouts

LANES = 128  # splash's block sizes must be multiples of the TPU's lane count
DEFAULT_BLOCK = 512  # per side; capped to the padded length
BACKWARDS: tuple[str, ...] = ()  # splash has its own fused backward

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # splash's DEFAULT_MASK_VALUE
_SINK = 0.5 * _MASK_VALUE  # below every real logit, above every masked one
_EMPTY_BELOW = 0.5 * _SINK  # a log-sum-exp below this belongs to a row with nothing to attend


# --- which masks compile ------------------------------------------------------


def _nodes(mask):
  yield mask
  for child in mask.children:
    if isinstance(child, _core.Mask):
      yield from _nodes(child)


def mask_reason(mask: _core.Mask | None) -> str | None:
  """Why splash cannot express ``mask`` exactly; None when it can."""
  seen = {kinds.Segments: 0, kinds.Lengths: 0}
  for part in _core.conjuncts(mask):
    if type(part) in seen:
      seen[type(part)] += 1
      if seen[type(part)] > 1:
        return f"more than one {type(part).__name__.lower()} mask (splash takes one set of ids)"
      continue
    reason = _static_reason(part)
    if reason:
      return reason
  return None


def _static_reason(part: _core.Mask) -> str | None:
  for node in _nodes(part):
    if isinstance(node, kinds.FromFn):
      return (
        f"mask {node!r} is an arbitrary index function (blockwise evaluates it per tile; "
        "splash takes masks it can tabulate when the kernel is built)"
      )
    if not isinstance(node, _STATIC_KINDS):
      return f"mask {node!r} has no splash form"
  if part.extents[0] is not None:
    return f"mask {part!r} varies over the batch rows (splash masks are per head)"
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(part)):
    return (
      f"mask {part!r} holds traced arrays (splash tabulates masks when the kernel is "
      "built: pass NumPy arrays, or compute the mask outside jit)"
    )
  return None


_STATIC_KINDS = (
  _core.And,
  _core.Or,
  _core.Not,
  kinds.Causal,
  kinds.SlidingWindow,
  kinds.Chunked,
  kinds.GlobalTokens,
  kinds.Strided,
  kinds.FromArray,
  kinds.Segments,  # inside | or ~, with one batch row and known ids
  kinds.Lengths,
  kinds.PrefixLM,
  kinds.CausalPerRow,
  layouts.BlockSparse,
)


class StaticMask:
  """The conjuncts splash tabulates, as a static setting of the call spec.

  Their arrays are NumPy copies, and the holder hashes and compares by the masks' kinds,
  settings and array contents, so jit compiles once per distinct mask (splash analyses
  masks when a kernel is built, so they cannot be traced arguments).
  """

  def __init__(self, parts):
    leaves, treedef = jax.tree.flatten(tuple(parts))
    leaves = [np.asarray(x) for x in leaves]
    self.parts = tuple(jax.tree.unflatten(treedef, leaves))
    digests = tuple(
      (x.shape, x.dtype.str, hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest())
      for x in leaves
    )
    self._key = (treedef, digests)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other) -> bool:
    return isinstance(other, StaticMask) and self._key == other._key

  def __repr__(self) -> str:
    return "StaticMask(" + " & ".join(map(repr, self.parts)) + ")"


def split(mask) -> tuple[StaticMask | None, _core.Mask | None]:
  """``mask`` (which :func:`mask_reason` accepts) as (its tabulated conjuncts, the rest:
  segments and lengths, which travel as traced segment ids)."""
  parts = _core.conjuncts(mask)
  dynamic = [p for p in parts if isinstance(p, (kinds.Segments, kinds.Lengths))]
  static = [p for p in parts if not isinstance(p, (kinds.Segments, kinds.Lengths))]
  return (StaticMask(static) if static else None), _core.all_of(*dynamic)


# --- block geometry ---------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def resolve_blocks(block_q: int | None, block_kv: int | None, T: int, S: int) -> tuple[int, int]:
  """(block_q, block_kv): the given sizes, else DEFAULT_BLOCK capped to the padded lengths."""
  bq = min(DEFAULT_BLOCK, _round_up(max(T, 1), LANES)) if block_q is None else block_q
  bkv = min(DEFAULT_BLOCK, _round_up(max(S, 1), LANES)) if block_kv is None else block_kv
  return bq, bkv


def blocks_reason(block_q: int, block_kv: int) -> str | None:
  bad = [f"{n}={b}" for n, b in (("block_q", block_q), ("block_kv", block_kv)) if b % LANES]
  return f"{' and '.join(bad)} not a multiple of {LANES}" if bad else None


# --- the kernel's arguments ------------------------------------------------------


def _splash_modules():
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel,
    splash_attention_mask,
  )

  return splash_attention_kernel, splash_attention_mask


@functools.cache
def _tabulated_class():
  _, mask_lib = _splash_modules()

  class Tabulated(mask_lib.Mask):
    """A splash mask read from jattn masks' index function at batch row 0, one head.

    Positions past the real lengths (T, S) are False, so blocks made only of padding
    are skipped. Rows are evaluated one block-row band at a time, as splash asks for
    the blocks of a band in turn.
    """

    def __init__(self, parts, head: int, T: int, S: int, shape: tuple[int, int]):
      self.parts, self.head, self.T, self.S, self._shape = parts, head, T, S, shape

    @property
    def shape(self) -> tuple[int, ...]:
      return self._shape

    @functools.lru_cache(maxsize=2)  # noqa: B019  # a band per kernel build; freed with it
    def _band(self, start: int, stop: int) -> np.ndarray:
      rows = np.arange(start, stop)
      cols = np.arange(self._shape[1])
      index = (
        np.zeros((1, 1, 1, 1), np.int32),
        np.full((1, 1, 1, 1), self.head, np.int32),
        np.minimum(rows, self.T - 1).astype(np.int32).reshape(1, 1, -1, 1),
        np.minimum(cols, self.S - 1).astype(np.int32).reshape(1, 1, 1, -1),
      )
      with jax.ensure_compile_time_eval(), _compat.no_mesh():
        allowed = np.ones((len(rows), len(cols)), bool)
        for part in self.parts:
          allowed &= np.broadcast_to(np.asarray(part(*index))[0, 0], allowed.shape)
      return allowed & (rows[:, None] < self.T) & (cols[None, :] < self.S)

    def __getitem__(self, idx) -> np.ndarray:
      q_slice, kv_slice = idx
      start, stop, _ = q_slice.indices(self._shape[0])
      return self._band(start, stop)[:, kv_slice]

  return Tabulated


def _native(parts, shape):
  """The splash mask computed in-kernel from indices equal to ``all_of(*parts)``, or None."""
  _, mask_lib = _splash_modules()
  by_kind: dict[type, list] = {}
  for part in parts:
    by_kind.setdefault(type(part), []).append(part)
  if not by_kind:
    return None
  if set(by_kind) <= {kinds.Causal, kinds.SlidingWindow} and all(
    len(v) == 1 for v in by_kind.values()
  ):
    (causal,) = by_kind.get(kinds.Causal, [None])
    (window,) = by_kind.get(kinds.SlidingWindow, [None])
    if window is None:
      return mask_lib.CausalMask(shape, offset=causal.offset)
    if window.dilation != 1:
      return None
    right = window.right
    if causal is not None:
      right = causal.offset if right is None else min(right, causal.offset)
    return mask_lib.LocalMask(shape, (window.left, right), offset=0)
  if set(by_kind) == {kinds.Causal, kinds.Chunked} and all(len(v) == 1 for v in by_kind.values()):
    (causal,), (chunk,) = by_kind[kinds.Causal], by_kind[kinds.Chunked]
    if causal.offset == 0:
      return mask_lib.ChunkedCausalMask(shape, chunk.size)
  return None


def varies_by_head(spec) -> bool:
  """Whether the tabulated masks differ between heads (a device then needs every head)."""
  parts = () if spec.static_mask is None else spec.static_mask.parts
  return any(part.extents[1] is not None for part in parts)


def _splash_mask(static, N: int, T: int, S: int, shape):
  """One splash mask per query head for the batch-independent conjuncts ``static``."""
  _, mask_lib = _splash_modules()
  if not static:
    head_masks = [mask_lib.FullMask(shape)] * N
  elif (native := _native(static, shape)) is not None:
    head_masks = [native] * N
  else:
    Tabulated = _tabulated_class()
    per_head = any(part.extents[1] is not None for part in static)
    if per_head:
      head_masks = [Tabulated(static, h, T, S, shape) for h in range(N)]
    else:
      head_masks = [Tabulated(static, 0, T, S, shape)] * N
  return mask_lib.MultiHeadMask(head_masks)


def _segment_ids(dynamic, B: int, T: int, S: int, Tp: int, Sp: int):
  """(q ids (B, Tp), kv ids (B, Sp)) int32 carrying segments, lengths and padding; None when
  nothing needs them. Real ids are renumbered 0, 1, ... (:func:`_dense`); a position that
  may not take part gets -1 (queries) or -2 (keys), so it matches nothing, not even another."""
  segments = next((p for p in dynamic if isinstance(p, kinds.Segments)), None)
  lengths = next((p for p in dynamic if isinstance(p, kinds.Lengths)), None)
  if segments is None and lengths is None and (Tp, Sp) == (T, S):
    return None
  ids, ok = [], []
  for axis, (n, padded) in enumerate(((T, Tp), (S, Sp))):
    if segments is None:
      x = jnp.zeros((B, n), jnp.int32)
    else:
      x = (segments.q_segment_ids, segments.kv_segment_ids)[axis]
      x = jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape(-1, n), (B, n))
    ids.append(jnp.pad(x, ((0, 0), (0, padded - n))))
    valid = jnp.broadcast_to(jnp.arange(padded) < n, (B, padded))
    limit = None if lengths is None else (lengths.q_lengths, lengths.kv_lengths)[axis]
    if limit is not None:
      limit = jnp.broadcast_to(jnp.asarray(limit), (B,))[:, None]
      valid = valid & (jnp.arange(padded)[None, :] < limit)
    ok.append(valid)
  q_ids, kv_ids = _dense(ids[0], ids[1])
  return jnp.where(ok[0], q_ids, -1), jnp.where(ok[1], kv_ids, -2)


def _dense(q_ids, kv_ids):
  """The ids renumbered per batch row as ranks 0, 1, ... among that row's distinct ids.

  Only equality reaches the kernel, and ranks keep it while leaving every negative id
  free: any int32 id works, including ids at int32's ends, where ``min(ids) - 1`` would
  wrap onto a real one."""
  both = jnp.concatenate([q_ids, kv_ids], axis=1)
  order = jnp.argsort(both, axis=1)
  ordered = jnp.take_along_axis(both, order, axis=1)
  new = jnp.concatenate([ordered[:, :1] != ordered[:, :1], ordered[:, 1:] != ordered[:, :-1]], 1)
  rank = jnp.cumsum(new, axis=1, dtype=jnp.int32)
  rows = jnp.arange(both.shape[0])[:, None]
  dense = jnp.zeros_like(rank).at[rows, order].set(rank)
  return dense[:, : q_ids.shape[1]], dense[:, q_ids.shape[1] :]


def soft_cap_of(score_fn) -> float | None:
  """The cap when ``score_fn`` is exactly ``logits_soft_cap`` (checked by the table)."""
  return None if score_fn is None else float(score_fn.cap)


def attention(query, key, value, spec) -> tuple[jax.Array, jax.Array]:
  """``(out (B, T, N, H) in query's dtype, lse (B, T, N) float32)`` through splash.

  Reads the masks (``spec.static_mask`` and ``spec.mask``, see :func:`split`), the soft
  cap, the scale, the tiles and ``interpret`` from ``spec``.
  """
  kernel_lib, _ = _splash_modules()
  B, T, S, N, K = spec.B, spec.T, spec.S, spec.N, spec.K
  bq, bkv = spec.block_q, spec.block_kv
  Tp, Sp = _round_up(T, bq), _round_up(S, bkv)
  dynamic = _core.conjuncts(spec.mask)  # segments and lengths (see split)
  static = [] if spec.static_mask is None else list(spec.static_mask.parts)
  mask = _splash_mask(static, N, T, S, (Tp, Sp))
  blocks = kernel_lib.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )
  make = kernel_lib.make_splash_mqa if K == 1 else kernel_lib.make_splash_mha
  settings: dict[str, Any] = dict(
    block_sizes=blocks,
    attn_logits_soft_cap=soft_cap_of(spec.score_fn),
    head_shards=1,
    q_seq_shards=1,
    interpret=spec.interpret,
  )
  ids = _segment_ids(dynamic, B, T, S, Tp, Sp)

  # (B, T, N, H) -> (B, N, Tp, H), the query scaled in float32 and cast back.
  q = (query.astype(jnp.float32) * spec.scale).astype(query.dtype)
  q = jnp.pad(q.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
  pad_kv = ((0, 0), (0, 0), (0, Sp - S), (0, 0))
  k, v = (jnp.pad(x.transpose(0, 2, 1, 3), pad_kv) for x in (key, value))
  if K == 1:
    k, v = k[:, 0], v[:, 0]

  # The user's sinks, or the one that keeps empty rows at zero; never below _SINK, so an
  # empty row's weight goes to the sink rather than to the kernel's masked logits.
  # One row of sinks per batch row ((N,) or (B, N) given): the kernel runs per batch row.
  sinks = jnp.full((B, N), _SINK, jnp.float32)
  if spec.sinks is not None:
    given = jnp.broadcast_to(spec.sinks.astype(jnp.float32), (B, N))
    sinks = jnp.maximum(given, _SINK)

  def run(save_residuals, q, k, v, ids, sinks):
    # The kernel (its mask tables are arrays) is made where it is used: a custom_vjp's
    # backward is traced apart from its forward and may not close over the forward's values.
    kernel = make(mask, save_residuals=save_residuals, **settings)

    def one(q, k, v, ids, sinks):
      segment_ids = None if ids is None else kernel_lib.SegmentIds(*ids)
      return kernel(q, k, v, segment_ids, sinks=sinks)

    return jax.vmap(one)(q, k, v, ids, sinks)

  if spec.return_residual:
    run_plain, run_residual = functools.partial(run, False), functools.partial(run, True)
    out, lse = _with_lse(run_plain, run_residual, q, k, v, ids, sinks)
  else:
    plain = _orders.reverse_once(functools.partial(run, False), _WHO, _orders.FUSED)
    out, lse = plain(q, k, v, ids, sinks), None
  out = out[:, :, :T].transpose(0, 2, 1, 3)
  if lse is None:
    lse = jnp.zeros((B, T, N), jnp.float32)  # not returned (return_residual=False)
  else:
    lse = lse[:, :, :T].transpose(0, 2, 1)
    lse = jnp.where(lse < _EMPTY_BELOW, -jnp.inf, lse)  # no sink (or a sink of about -inf)
  return out, lse


_WHO = "implementation='splash'"


def _with_lse(run, run_residual, q, k, v, ids, sinks):
  """``run_residual(q, k, v, ids, sinks) -> (out, (lse,))`` made differentiable in both
  outputs."""

  @jax.custom_vjp
  def f(q, k, v, ids, sinks):
    out, (lse,) = run_residual(q, k, v, ids, sinks)
    return out, lse

  def fwd(q, k, v, ids, sinks):
    out, lse = f(q, k, v, ids, sinks)
    return (out, lse), (q, k, v, ids, sinks, lse)

  def bwd(res, cotangents):
    return _orders.first_order(grads, _WHO, _orders.FUSED, forward=False)(res, cotangents)

  def grads(res, cotangents):
    q, k, v, ids, sinks, lse = res
    d_out, d_lse = cotangents
    _, vjp = jax.vjp(lambda q, k, v, sinks: run(q, k, v, ids, sinks), q, k, v, sinks)
    dq, dk, dv, d_sinks = vjp(d_out)
    # lse_i = log(sum_j exp(q_i . k_j) + exp(sink)): d/dq_i = sum_j p_ij k_j (attention with
    # the keys as values), d/dk_j = sum_i p_ij q_i d_lse_i (that attention's value-gradient),
    # d/dsink = exp(sink - lse_i).
    d_lse = d_lse.astype(jnp.float32)
    k_as_v, vjp_v = jax.vjp(lambda kv: run(q, k, kv, ids, sinks), k)
    dq = dq + (d_lse[..., None] * k_as_v.astype(jnp.float32)).astype(dq.dtype)
    (dk_lse,) = vjp_v((d_lse[..., None] * q.astype(jnp.float32)).astype(q.dtype))
    p_sink = jnp.exp(sinks[:, :, None] - lse.astype(jnp.float32))  # (B, N, Tp)
    d_sinks = d_sinks + (d_lse * p_sink).sum(axis=2)
    return dq, dk + dk_lse, dv, None, d_sinks

  f.defvjp(fwd, bwd)
  return f(q, k, v, ids, sinks)


# --- the table's row ---------------------------------------------------------------


def _check(call: _base.Call) -> str | None:
  s = call.spec
  if reason := mask_reason(s.mask):
    return reason
  if s.return_residual and s.score_fn is not None:
    return (
      "return_residual with logits_soft_cap (the log-sum-exp's gradient through the cap "
      "needs the capped logits, which the kernel does not return)"
    )
  if call.blocks_named:
    return blocks_reason(*resolve_blocks(s.block_q, s.block_kv, s.T, s.S))
  return None


def _prepare(spec, blocks: tuple[int | None, int | None], backend: str):
  del backend  # splash's tiles depend on the lengths alone
  block_q, block_kv = resolve_blocks(blocks[0], blocks[1], spec.T, spec.S)
  static_mask, rest = split(spec.mask)
  return dataclasses.replace(
    spec, mask=rest, static_mask=static_mask, block_q=block_q, block_kv=block_kv
  )


def _run(query, key, value, spec) -> tuple[jax.Array, jax.Array]:
  whole = varies_by_head(spec)
  return _sharded.per_shard(attention, query, key, value, spec, heads_whole=whole)


IMPLEMENTATION = _base.Implementation(
  name="splash",
  runs_on=("tpu",),
  backwards=BACKWARDS,
  masks=(
    "masks the same for every batch row with known values (causal with any offset, "
    "windows, chunks, arrays, per-head arrays, global tokens, strides, block-sparse "
    "layouts, and their & | ~), segment ids, lengths"
  ),
  run=_run,
  prepare=_prepare,
  dtypes=("float32", "bfloat16"),
  bias="splash adds no bias",
  score_fn="splash has no score function (logits_soft_cap it has)",
  dropout="splash has no dropout",
  tiles=True,
  fused=True,
  takes_sinks=True,
  interpretable=True,
  check=_check,
)
