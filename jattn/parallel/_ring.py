"""One ring of :func:`jattn.parallel.ring_attention`: its settings, and each device's part.

:class:`Ring` holds a ring's static settings (the custom_vjp's non-differentiable
argument); :func:`call` runs it under ``jax.shard_map``. On each device the forward pass
attends its query shard to the key/value shard it holds, merges the partial result by the
online-softmax rule and passes the shard on (``ppermute``); the backward pass rings the
key/value shards with their gradient accumulators (see :mod:`jattn.parallel`).

USP (``Ring.ulysses``: Ulysses inside the ring) shards the sequence over two mesh axes, the
ring's and a Ulysses axis inside each ring step: an all-to-all over the Ulysses axis first
trades each device's sequence shard for a share of the heads, so that the Ulysses group
holds its whole ring chunk; the ring then runs over the ring axis with those heads, and one
more all-to-all brings the results back to sequence shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn import masks, testing
from jattn.impl import blockwise, common, orders, sharded, tiling
from jattn.impl.contract import CallSpec
from jattn.impl.select import Choice
from jattn.masks import indexing
from jattn.parallel import _choices, _kernel_pairs, _splash_pairs
from jattn.parallel.layouts import shard_positions

Tree = TypeVar("Tree")

Shard = tuple[jax.Array, jax.Array, jax.Array | None]
"""The (key, value, key/value segment ids or None) a device holds at one ring step."""

Partial = tuple[jax.Array, jax.Array, jax.Array]
"""A partial result ``(out, m, l)``: normalised output and the rows' max and sum."""

_Residuals = tuple[
  jax.Array,  # query
  jax.Array,  # key
  jax.Array,  # value
  jax.Array | None,  # q_ids
  jax.Array | None,  # kv_ids
  masks.Mask | None,
  jax.Array | None,  # bias
  tuple[Any, ...],  # the score function's constants
  jax.Array | None,  # dropout's key
  jax.Array,  # out
  jax.Array,  # m
  jax.Array,  # l
]


class Ring(NamedTuple):
  """Static settings of one ring: hashable, the custom_vjp's non-differentiable argument."""

  axis_name: Any
  size: int  # P
  layout: str
  q_len: int  # global T
  kv_len: int  # global S
  scale: float
  soft_cap: float | None
  block_q: int
  block_kv: int
  batch_axis: Any  # mesh axes the batch is sharded over (None: not sharded)
  head_axis: Any
  # USP: the mesh axis a ring chunk's sequence is split over besides, traded for heads by
  # all-to-alls around the ring (None: a plain ring).
  ulysses: str | None = None
  pairs: Any = None  # _splash_pairs.Pairs: each shard pair through splash (None: blockwise)
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False
  max_logit: bool = False  # also the rows' largest logit over every pair (return_max_logit)
  # Whether each device asks the selection table for a fused kernel per pair (a GPU, or a
  # kernel named), and the kernel named (None: the table's choice).
  try_kernels: bool = False
  kernel_named: str | None = None
  # Set on each device. Blockwise pairs: the call's score function (score_fn, then the soft
  # cap) closure-converted at a pair's tile shapes, fn(s, b, h, q, kv, *consts) on global
  # indices. Kernel pairs (_kernel_pairs): the kernel, and the score function's treedef
  # (its leaves are the consts).
  score: Any = None
  kernel: str | None = None
  score_tree: Any = None


@_choices.jit(static_argnames=("ring", "mesh"))
def call(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  score_fn: Any,
  rng: jax.Array | None,
  *,
  ring: Ring,
  mesh: Mesh,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The ring over ``mesh``: the inputs in the layout's order, ``bias`` (rank 4, its T and S
  axes in the layout's order where not 1) split by query rows and whole along S, the mask and
  score function (a :class:`jattn.scores.ScoreFn`) on global natural positions, dropout's
  key; returns the output and the log-sum-exp, sharded like the query."""
  sequence = ring.axis_name if ring.ulysses is None else (ring.axis_name, ring.ulysses)
  seq = P(ring.batch_axis, sequence, ring.head_axis, None)
  ids = P(ring.batch_axis, sequence)
  query, key, value = (place(x, mesh, seq) for x in (query, key, value))
  q_ids, kv_ids = (None if x is None else place(x, mesh, ids) for x in (q_ids, kv_ids))
  mask, score_fn, rng = jax.tree.map(lambda x: place(x, mesh, P()), (mask, score_fn, rng))
  bias_spec = None
  if bias is not None:
    Bb, Nb, Tb, _ = bias.shape
    bias_spec = P(
      ring.batch_axis if Bb > 1 else None,
      _heads(ring) if Nb > 1 else None,  # USP: a device's heads after the all-to-all
      ring.axis_name if Tb > 1 else None,
      None,
    )
    bias = place(bias, mesh, bias_spec)
  rows = P(ring.batch_axis, sequence, ring.head_axis)
  run = jax.shard_map(
    functools.partial(_per_device, ring),
    mesh=mesh,
    in_specs=(seq, seq, seq, ids, ids, P(), bias_spec, P(), P()),
    out_specs=(seq, rows, rows if ring.max_logit else None),
    # Off: the ring's custom_vjp supplies the backward pass, so JAX never transposes
    # these collectives (what the varying-axes types serve), and the scan carries mix
    # device-varying shards with constant zeros, which the check would want annotated.
    check_vma=False,
  )
  return run(query, key, value, q_ids, kv_ids, mask, bias, score_fn, rng)


def place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  """``x`` resharded to ``spec`` on the mesh's Explicit axes; unchanged where it has none.

  Under Explicit axes an array's sharding is part of its type, and ``shard_map`` refuses an
  input whose type differs from its in_specs: an unsharded or otherwise sharded input is
  resharded here (JAX inserts the collectives, and transposes them for the gradients).
  Auto axes need nothing: ``jit`` moves inputs to ``shard_map``'s specs itself.
  """
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  if not explicit:
    return x

  def keep(entry: Any) -> Any:
    if entry is None:
      return None
    kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in explicit)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  return jax.sharding.reshard(x, NamedSharding(mesh, P(*(keep(e) for e in spec))))


def _per_device(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  score_fn: Any,
  rng: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  if ring.ulysses is not None:  # USP: the Ulysses group's chunk, a share of its heads
    chunk = lambda x: jax.lax.all_to_all(x, ring.ulysses, split_axis=2, concat_axis=1, tiled=True)
    query, key, value = (chunk(x) for x in (query, key, value))
    q_ids, kv_ids = (
      None if x is None else jax.lax.all_gather(x, ring.ulysses, axis=1, tiled=True)
      for x in (q_ids, kv_ids)
    )
    back = lambda x: jax.lax.all_to_all(x, ring.ulysses, split_axis=1, concat_axis=2, tiled=True)
    plain = ring._replace(ulysses=None, head_axis=_heads(ring))
    results = _per_device(plain, query, key, value, q_ids, kv_ids, mask, bias, score_fn, rng)
    return jax.tree.map(back, results)  # type: ignore[return-value]
  consts: tuple[Any, ...] = ()
  if ring.try_kernels and ring.pairs is None:
    ring = _with_kernel(ring, query, key, value, q_ids, kv_ids, mask, bias, score_fn, rng)
  if ring.kernel is not None:
    consts = tuple(jax.tree.leaves(score_fn))
  elif score_fn is not None:
    # Converted once, here, so that its arrays (learned tables and slopes, whether pytree
    # leaves or closed over) are explicit inputs of the ring's custom_vjp, which returns their
    # cotangents; each pair then sees it through its own index maps (_pair_score).
    B, t, N, _ = query.shape
    bq, bk = min(ring.block_q, t), min(ring.block_kv, key.shape[1])
    s = jax.ShapeDtypeStruct((B, N, bq, bk), common.stats_dtype(query.dtype))
    converted, found = common.hoist(score_fn, s, *tiling.tile_indices(B, N, bq, bk, 0, 0))
    ring, consts = ring._replace(score=converted), tuple(found)
  out, lse, top = _ring_vjp(ring, query, key, value, q_ids, kv_ids, mask, bias, consts, rng)
  return out.astype(query.dtype), lse, top


def _with_kernel(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  score_fn: Any,
  rng: jax.Array | None,
) -> Ring:
  """The ring with its pairs' fused kernel where the selection table picks one for this
  device's first pair (every pair's call differs only in its positions); the choice, or
  why each pair runs blockwise instead, is recorded for :func:`jattn.parallel.explain`."""
  B, t, N, _ = query.shape
  bq, bk = min(ring.block_q, t), min(ring.block_kv, key.shape[1])
  s = jax.ShapeDtypeStruct((B, N, bq, bk), common.stats_dtype(query.dtype))
  held = _kernel_pairs.leaves(score_fn, (s, *tiling.tile_indices(B, N, bq, bk, 0, 0)))
  backend = testing.target_backend() or jax.default_backend()
  if held is None:
    why = (
      "the score function closes over traced arrays that are not its pytree leaves (their "
      "gradients come from blockwise's rule)"
    )
    if ring.kernel_named is not None:
      raise ValueError(f"ring_attention(implementation={ring.kernel_named!r}): {why}")
    reason = f"each shard pair runs blockwise: {why}"
    _choices.record(Choice("blockwise", None, reason, {}, backend))
    return ring
  ring = ring._replace(kernel="", score_tree=held[0])  # the pair's spec rebuilds the function
  columns = _bias_columns(ring, bias, _source(ring, 0))
  spec = _kernel_spec(ring, query, key, value, q_ids, kv_ids, mask, columns, held[1], rng, 0)
  _, choice = _kernel_pairs.choose(spec, query.dtype, ring.kernel_named)
  if choice.implementation not in _kernel_pairs.KERNELS:
    reason = (
      f"each shard pair runs blockwise: the table runs a pair's call on "
      f"{choice.implementation} ({choice.reason})"
    )
    _choices.record(Choice("blockwise", None, reason, choice.rejected, choice.backend))
    return ring._replace(kernel=None, score_tree=None)
  reason = f"{choice.implementation} runs each shard pair: {choice.reason}"
  _choices.record(dataclasses.replace(choice, reason=reason))
  return ring._replace(kernel=choice.implementation)


def _kernel_spec(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  columns: jax.Array | None,
  leaves: Any,
  rng: jax.Array | None,
  step: jax.Array | int,
) -> CallSpec:
  """One kernel pair's call (:mod:`jattn.parallel._kernel_pairs`): this device's queries
  against the key/value shard it holds at ring step ``step``."""
  score_fn = None if ring.score_tree is None else jax.tree.unflatten(ring.score_tree, leaves)
  spec = _kernel_pairs.pair_spec(
    shapes=(query.shape, key.shape, value.shape),
    maps=_pair_maps(ring, query, _source(ring, step)),
    mask=mask,
    segments=None if q_ids is None else masks.segments(q_ids, kv_ids),
    score_fn=score_fn,
    bias=columns,
    scale=ring.scale,
    dropout=(ring.dropout_rate, ring.broadcast_dropout, rng),
    max_logit=ring.max_logit,
  )
  if ring.kernel:  # chosen: the spec completed for it (every step's is the first's kind)
    spec, _ = _kernel_pairs.choose(spec, query.dtype, ring.kernel)
  return spec


# --- one device's part ------------------------------------------------------------


def global_rows(axes: Any, n: int) -> jax.Array | None:
  """Inside a shard_map: the global index of this device's ``n`` rows of an axis sharded
  over mesh ``axes`` (a PartitionSpec entry), None where it is not sharded."""
  if axes is None:
    return None
  return jax.lax.axis_index(axes) * n + jnp.arange(n, dtype=jnp.int32)


def _maps(ring: Ring, query: jax.Array) -> list[jax.Array | None]:
  """Global batch and head indices of this device's block (None where not sharded)."""
  B, _, N, _ = query.shape
  return [global_rows(ring.batch_axis, B), global_rows(_heads(ring), N)]


def _heads(ring: Ring) -> Any:
  """The mesh axes a device's heads are sharded over inside the ring: the call's head axes,
  and with USP the Ulysses axis within them (each device's share of its group's heads)."""
  if ring.ulysses is None:
    return ring.head_axis
  return (*sharded.axis_names(ring.head_axis), ring.ulysses)


def _pair_plan(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  consts: tuple[Any, ...],
  rng: jax.Array | None,
  source: jax.Array,
) -> blockwise.Plan:
  """The blockwise plan of this device's queries against the key/value shard of ``source``:
  the mask and score function on global positions, dropout drawn there."""
  maps = _pair_maps(ring, query, source)
  parts = []
  if mask is not None:
    parts.append(masks.reindex(mask, **dict(zip(("batch", "head", "q", "kv"), maps))))
  if q_ids is not None:
    parts.append(masks.segments(q_ids, kv_ids))
  score = None
  if ring.score is not None:
    present = tuple(m is not None for m in maps)
    score = (
      functools.partial(_pair_score, ring.score, present),
      (*(m for m in maps if m is not None), *consts),
    )
  return blockwise.plan(
    query,
    key.shape[1],
    mask=masks.all_of(*parts),
    score_fn=None,
    score=score,
    scale=ring.scale,
    dropout_rate=ring.dropout_rate,
    dropout_rng=rng,
    broadcast_dropout=ring.broadcast_dropout,
    positions=maps if ring.dropout_rate else None,
    block_q=ring.block_q,
    block_kv=ring.block_kv,
  )


def _pair_maps(ring: Ring, query: jax.Array, source: jax.Array) -> tuple[Any, Any, Any, Any]:
  """The global (batch, head, q, kv) positions of this device's queries against the keys of
  ``source``'s shard (None: the identity, an axis not sharded)."""
  batch, head = _maps(ring, query)
  here = jax.lax.axis_index(ring.axis_name)
  return (
    batch,
    head,
    shard_positions(ring.layout, ring.q_len, ring.size, here),
    shard_positions(ring.layout, ring.kv_len, ring.size, source),
  )


def _pair_score(converted: Any, present: tuple[bool, ...], s: jax.Array, *args: Any) -> jax.Array:
  """The ring's converted score function on one pair's tile: ``args`` are the tile's (batch,
  head, q, kv) indices, then the pair's index maps (those ``present``), then the function's
  constants (whose cotangents blockwise's backward pass returns after the maps')."""
  idx, rest = args[:4], args[4:]
  n = sum(present)
  found = iter(rest[:n])
  maps = [next(found) if p else None for p in present]
  return converted(s, *indexing.through_maps(maps, idx), *rest[n:])


def _bias_columns(ring: Ring, bias: jax.Array | None, source: jax.Array) -> jax.Array | None:
  """This device's bias rows against the keys of ``source``'s shard (all of S where it is 1)."""
  if bias is None or bias.shape[3] == 1:
    return bias
  s = ring.kv_len // ring.size
  return jax.lax.dynamic_slice_in_dim(bias, source * s, s, axis=3)


def _pair_settings(ring: Ring, step: jax.Array | int) -> dict[str, Any]:
  """What :mod:`jattn.parallel._splash_pairs` needs of ring step ``step`` on this device."""
  here = jax.lax.axis_index(ring.axis_name)
  return dict(
    pairs=ring.pairs,
    here=here,
    source=_source(ring, step),
    scale=ring.scale,
    soft_cap=ring.soft_cap,
  )


def _source(ring: Ring, step: jax.Array | int) -> jax.Array:
  """The device whose key/value shard this device holds at ring step ``step``."""
  return (jax.lax.axis_index(ring.axis_name) - step) % ring.size


def _pass_on(ring: Ring, x: Tree) -> Tree:
  """Send ``x`` (a pytree) to the next device on the ring, receive the previous one's."""
  perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, ring.axis_name, perm), x)


def _merge(a: Partial, b: Partial) -> Partial:
  """Online-softmax merge of two partial results ``(out, m, l)`` over disjoint key sets.

  ``out`` is each part's normalised output, m and l its rows' max and sum (m = 0,
  l = 0 where the part has nothing to attend to). The merged rows keep m and l
  apart, as the blockwise rule does, so a row at |m| ~ 1e9 loses nothing; rows
  with nothing to attend to in either part stay zeros with l = 0, with no
  inf - inf anywhere.
  """
  (out_a, m_a, l_a), (out_b, m_b, l_b) = a, b
  live = lambda m, l: jnp.where(l > 0, m, -jnp.inf)
  m = common.row_max(jnp.maximum(live(m_a, l_a), live(m_b, l_b)))
  w_a, w_b = (
    jnp.where(l > 0, l * jnp.exp(jnp.where(l > 0, x - m, 0)), 0)
    for x, l in ((m_a, l_a), (m_b, l_b))
  )
  l = w_a + w_b
  out = (out_a * w_a[..., None] + out_b * w_b[..., None]) / common.safe_total(l)[..., None]
  return out, m, l


def _forward(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  consts: tuple[Any, ...],
  rng: jax.Array | None,
) -> tuple[Partial, jax.Array | None]:
  """This device's ``(out, m, l)`` in float32/64 after the whole ring (see blockwise.forward),
  and its rows' largest logit over every pair (None unless ``ring.max_logit``)."""

  def attend(step: jax.Array | int, kv: Shard) -> tuple[Partial, jax.Array | None]:
    """The pair's partial result, and its rows' largest logit where the ring keeps it."""
    k, v, ids = kv
    if ring.pairs is not None:
      pair = _splash_pairs.attend(query, k, v, q_ids, ids, **_pair_settings(ring, step))
      return _splash_pairs.as_partial(*pair), None  # never asked: splash keeps its max
    source = _source(ring, step)
    columns = _bias_columns(ring, bias, source)
    if ring.kernel is not None:
      spec = _kernel_spec(ring, query, k, v, q_ids, ids, mask, columns, consts, rng, step)
      out, lse, top = _kernel_pairs.attend(query, k, v, spec)
      return _splash_pairs.as_partial(out, lse), top
    plan = _pair_plan(ring, query, k, q_ids, ids, mask, consts, rng, source)
    out, m, l = blockwise.forward(plan, query, k, v, columns)
    return (out, m, l), common.max_logit(m, l) if ring.max_logit else None

  def merged(acc: tuple[Partial, Any], pair: tuple[Partial, Any]) -> tuple[Partial, Any]:
    (partial, top), (partial_b, top_b) = acc, pair
    return _merge(partial, partial_b), None if top is None else jnp.maximum(top, top_b)

  def step(carry: tuple[Shard, Any], s: jax.Array) -> tuple[tuple[Shard, Any], None]:
    kv, acc = carry
    incoming = _pass_on(ring, kv)  # independent of this step's work: may overlap it
    return (incoming, merged(acc, attend(s, kv))), None

  B, T, N, _ = query.shape
  Hv = value.shape[-1]
  dtype = common.stats_dtype(query.dtype)
  rows = jnp.zeros((B, T, N), dtype)
  top = jnp.full((B, T, N), -jnp.inf, dtype) if ring.max_logit else None
  empty = ((jnp.zeros((B, T, N, Hv), dtype), rows, rows), top)
  (kv, acc), _ = jax.lax.scan(step, ((key, value, kv_ids), empty), jnp.arange(ring.size - 1))
  return merged(acc, attend(ring.size - 1, kv))


Partial2 = tuple[jax.Array, jax.Array]
"""A pair's ``(out, lse)``."""


def _merged(all_: Any, floats: Any, is_float: list[bool]) -> list[Any]:
  """``all_`` with its float entries replaced, in order, by ``floats``."""
  it = iter(floats)
  return [next(it) if f else x for x, f in zip(all_, is_float)]


_Local = tuple[jax.Array | None, tuple[jax.Array, ...]]
"""A device's own cotangent accumulators: the bias rows it holds, the score constants'."""


def _add_columns(ring: Ring, d_bias: jax.Array, d_b: jax.Array, source: Any) -> jax.Array:
  """The device's bias cotangent (its rows, every column) with one pair's added at the
  columns of key/value shard ``source`` (all of them where the bias has one column)."""
  if d_bias.shape[3] == 1:
    return d_bias + d_b
  s = ring.kv_len // ring.size
  part = jax.lax.dynamic_slice_in_dim(d_bias, source * s, s, axis=3) + d_b
  return jax.lax.dynamic_update_slice_in_dim(d_bias, part, source * s, axis=3)


def _backward(
  ring: Ring, residuals: _Residuals, d_out: jax.Array, d_lse: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, tuple[jax.Array | None, ...]]:
  query, key, value, q_ids, kv_ids, mask, bias, consts, rng, out, m, l = residuals

  lse = common.log_sum_exp(m, l)
  dtype = common.stats_dtype(query.dtype)
  is_float = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in consts]

  def grads(step: jax.Array | int, kv: Shard, here: _Local) -> tuple[Any, ...]:
    """This pair's (d_q, d_k, d_v), its cotangents added to ``here`` (bias, constants)."""
    k, v, ids = kv
    if ring.pairs is not None:
      settings = _pair_settings(ring, step)
      d = _splash_pairs.grads(query, k, v, q_ids, ids, out, lse, d_out, d_lse, **settings)
      return (*d, here)
    source = _source(ring, step)
    columns = _bias_columns(ring, bias, source)
    if ring.kernel is not None:

      def pair(q: jax.Array, k: jax.Array, v: jax.Array, b: Any, c: Any) -> Partial2:
        leaves = _merged(consts, c, is_float)
        spec = _kernel_spec(ring, q, k, v, q_ids, ids, mask, b, leaves, rng, step)
        out, lse, _ = _kernel_pairs.attend(q, k, v, spec)
        return out, lse

      floats = [c for c, f in zip(consts, is_float) if f]
      d_q, d_k, d_v, d_b, d_f = _kernel_pairs.grads(
        pair, (query, k, v, columns, floats), out, lse, d_out, d_lse
      )
      d_c: Any = _merged([None] * len(consts), d_f, is_float)
    else:
      plan = _pair_plan(ring, query, k, q_ids, ids, mask, consts, rng, source)
      d_q, d_k, d_v, d_b, d_c = blockwise.backward(
        plan, query, k, v, out, m, l, d_out, d_lse, columns
      )
    d_bias, d_consts = here
    if d_bias is not None:
      assert d_b is not None, "a bias has a cotangent"
      d_bias = _add_columns(ring, d_bias, d_b, source)
    # The constants' cotangents follow the pair's index maps'; the float ones are arrays.
    own = [b for b, f in zip(d_c[len(d_c) - len(consts) :], is_float) if f]
    d_consts = tuple(a + b for a, b in zip(d_consts, own, strict=True) if b is not None)
    return d_q, d_k, d_v, (d_bias, d_consts)

  def step(
    carry: tuple[Shard, tuple[jax.Array, jax.Array], jax.Array, _Local], s: jax.Array
  ) -> tuple[tuple[Shard, tuple[jax.Array, jax.Array], jax.Array, _Local], None]:
    kv, d_kv, d_q, here = carry
    incoming = _pass_on(ring, kv)
    g_q, g_k, g_v, here = grads(s, kv, here)
    # The shard's gradient accumulators travel on with it; their hop overlaps the next
    # step's work, which only adds to them at its end.
    d_kv = _pass_on(ring, (d_kv[0] + g_k, d_kv[1] + g_v))
    return (incoming, d_kv, d_q + g_q, here), None

  here: _Local = (
    None if bias is None else jnp.zeros(bias.shape, dtype),
    tuple(jnp.zeros(jnp.shape(c), dtype) for c, f in zip(consts, is_float) if f),
  )
  init = (
    (key, value, kv_ids),
    (jnp.zeros(key.shape, dtype), jnp.zeros(value.shape, dtype)),
    jnp.zeros(query.shape, dtype),
    here,
  )
  (kv, d_kv, d_q, here), _ = jax.lax.scan(step, init, jnp.arange(ring.size - 1))
  g_q, g_k, g_v, (d_bias, d_floats) = grads(ring.size - 1, kv, here)
  d_k, d_v = _pass_on(ring, (d_kv[0] + g_k, d_kv[1] + g_v))  # the last hop: home
  floats = iter(d_floats)
  d_consts = tuple(
    next(floats).astype(jnp.result_type(c)) if f else None for c, f in zip(consts, is_float)
  )
  return (
    (d_q + g_q).astype(query.dtype),
    d_k.astype(key.dtype),
    d_v.astype(value.dtype),
    None if d_bias is None or bias is None else d_bias.astype(bias.dtype),
    d_consts,
  )


def _who(ring: Ring) -> str:
  name = "splash" if ring.pairs is not None else ring.kernel or "blockwise"
  return f"ring_attention(implementation={name!r})"


@functools.partial(
  orders.reverse_only,
  nondiff_argnums=(0,),
  who=_who,
  rule="the ring's backward rule (a custom_vjp)",
  way_out=(
    "gather the sequence and call dot_product_attention(implementation='xla', "
    "backward='autodiff'), which differentiates in both modes"
  ),
)
def _ring_vjp(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  consts: tuple[Any, ...],
  rng: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  (out, m, l), top = _forward(ring, query, key, value, q_ids, kv_ids, mask, bias, consts, rng)
  return out, common.log_sum_exp(m, l), top


def _ring_fwd(
  ring: Ring,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  q_ids: jax.Array | None,
  kv_ids: jax.Array | None,
  mask: masks.Mask | None,
  bias: jax.Array | None,
  consts: tuple[Any, ...],
  rng: jax.Array | None,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array | None], _Residuals]:
  (out, m, l), top = _forward(ring, query, key, value, q_ids, kv_ids, mask, bias, consts, rng)
  residuals = (query, key, value, q_ids, kv_ids, mask, bias, consts, rng, out, m, l)
  return (out, common.log_sum_exp(m, l), top), residuals


def _ring_bwd(ring: Ring, residuals: _Residuals, cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
  d_out, d_lse = cotangents[:2]  # the max logit is a statistic: nothing flows back through it
  blockwise_pairs = ring.pairs is None and ring.kernel is None
  backward = orders.first_order(
    functools.partial(_backward, ring),
    _who(ring),
    orders.TILE_LOOPS if blockwise_pairs else orders.FUSED,
    forward=blockwise_pairs,  # blockwise's tile loops take JVPs, Pallas kernels do not
    way_out="gather the sequence and call dot_product_attention(implementation='xla')",
  )
  d_query, d_key, d_value, d_bias, d_consts = backward(residuals, d_out, d_lse)
  # Ids, masks and dropout's key: integers, no cotangent.
  return d_query, d_key, d_value, None, None, None, d_bias, d_consts, None


_ring_vjp.defvjp(_ring_fwd, _ring_bwd)
