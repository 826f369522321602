"""Sequence-parallel attention by strategy: :func:`context_parallel_attention`.

Four ways to split one attention call's sequence over the P devices of a mesh axis (two
axes for USP), as large-model trainers do (MaxText's ``context_parallel_strategy``,
DeepSpeed-Ulysses, TransformerEngine's context parallelism, USP's unified sequence
parallelism):

* ``"ring"``: each device keeps its query shard; key/value shards travel around the ring
  and partial results merge by the online-softmax rule (:func:`jattn.parallel.ring_attention`).
  Memory per device O(T/P); P steps of point-to-point traffic that overlap the compute.
* ``"all_gather"``: each device keeps its query shard and gathers every key and value once
  (one all-gather, its transpose a reduce-scatter in the backward pass), then runs the
  one-device call on (T/P queries, S keys). Memory per device O(S) for keys and values.
* ``"ulysses"``: two all-to-alls trade the sequence shard for a head shard: each device
  then holds the whole sequence for N/P heads and runs the one-device call on it; one more
  all-to-all brings the output back to sequence shards. N and K must divide by P.
* ``"usp"``: both at once over two mesh axes ``(ring_axis, ulysses_axis)`` of P_r and P_u
  devices (T split over P_r·P_u): within each group of P_u devices an all-to-all trades the
  sequence for heads (the group then holds one ring chunk for N/P_u heads), and the groups
  run the ring over ``ring_axis`` on it. Ulysses' all-to-alls stay within a group (on a
  fast link: the devices of one host), the ring's hops cross groups and overlap the
  compute; N and K divide by P_u only, and the ring is P_r steps, not P_r·P_u.

In the all-gather and Ulysses strategies each device runs :func:`jattn.dot_product_attention`'s
own core on its part, the implementation chosen for that part by the selection table (the
fused kernel of the backend where it expresses the part); the mask and score function are
evaluated at the global positions of the part's rows and columns (:func:`jattn.masks.reindex`,
:func:`jattn.scores.reindex`) and dropout is drawn there (``CallSpec.positions``), so values,
log-sum-exp, gradients and the dropout pattern are the one-device call's. A kernel that
tabulates its masks when it is built (splash) gets each part's mask at positions known when
the call is traced: the same for every Ulysses device, one per device for the all-gather,
which picks its kernel on the device (:func:`_part_masks`).

Arrays with a sequence axis come in the inputs' layout order (query, key, value, bias,
segment ids, a dense mask array); masks and score functions of indices are written in
natural positions, whatever the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn import _validate, attention, masks, scores, testing
from jattn._validate.keywords import Keywords, checked, options_of
from jattn.impl import contract, select, sharded
from jattn.impl.contract import CallSpec
from jattn.impl.select import Choice
from jattn.impl.splash.static_masks import StaticMask
from jattn.masks import core
from jattn.parallel import _choices, _ring, _ring_call, _split
from jattn.parallel.layouts import _natural_mask, positions, shard_positions

__all__ = ["STRATEGIES", "context_parallel_attention", "ring_attention", "explain"]

STRATEGIES = ("ring", "all_gather", "ulysses", "usp")


def context_parallel_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  mesh: Mesh,
  axis_name: str | tuple[str, str],
  strategy: str = "ring",
  layout: str = "contiguous",
  batch_axis: str | tuple[str, ...] | None = None,
  head_axis: str | tuple[str, ...] | None = None,
  **keywords: Unpack[Keywords],
) -> Any:  # the output, with the lse and max logit where asked for
  """:func:`jattn.dot_product_attention` with the sequence sharded over mesh axis ``axis_name``.

  Computes what ``jattn.dot_product_attention(query, key, value, bias, mask, **keywords)``
  computes on one device, values, log-sum-exp, gradients and dropout pattern alike, with
  T and S split over the P devices of ``axis_name`` by ``strategy`` (see the module
  docstring): ``"ring"`` (:func:`jattn.parallel.ring_attention`), ``"all_gather"``,
  ``"ulysses"`` or ``"usp"`` (Ulysses within a group of devices, the ring across groups),
  each taking every keyword. Works under ``jax.jit`` and in both sharding modes (Auto and
  Explicit axes).

  Args:
    query: (B, T, N, H), in ``layout`` order along T; best sharded as
      ``P(batch_axis, axis_name, head_axis, None)`` (other placements are resharded).
    key, value: (B, S, K, H), in ``layout`` order along S; N a multiple of K.
    bias: as in :func:`jattn.dot_product_attention`, its T and S axes (where not 1) in
      ``layout`` order; sharded like the scores each device computes.
    mask: a :class:`jattn.masks.Mask` in natural positions (it classifies tiles on each
      device exactly where it is a mask of indices), or a dense boolean array in ``layout``
      order (correct, but whole on every device: pass documents as ``segment_ids``).
    mesh, axis_name: the mesh and the axis the sequence is split over; with
      ``strategy="usp"`` a pair ``(ring_axis, ulysses_axis)``, the sequence split over
      both (ring major: the layout orders the P_r chunks of the ring, each split
      contiguously over the Ulysses devices).
    strategy: ``"ring"``, ``"all_gather"``, ``"ulysses"`` or ``"usp"``.
    layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``, as :func:`jattn.parallel.permute`
      orders the inputs (zig-zag and striped balance causal work in the ring, USP and
      all-gather strategies; Ulysses computes whole sequences and needs no balance). With
      USP, permute with the ring's size P_r.
    batch_axis, head_axis: mesh axes the batch and the heads are sharded over besides.
    **keywords: every other keyword of :func:`jattn.dot_product_attention` (``is_causal``,
      ``segment_ids`` in ``layout`` order, lengths, ``local_window_size``, ``score_fn``
      and ``logits_soft_cap`` on global indices, dropout, ``sinks``, ``return_residual``,
      ``implementation``, ``backward``, tiles, ``options``): ``implementation`` and
      ``backward`` name what runs each device's part (the ring's pairs: ``"blockwise"``,
      ``"splash"`` or ``"flex"``, differentiated by the ring's own rule, so ``backward``
      must be None).

  Returns:
    The output (B, T, N, Hv) in ``layout`` order, sharded as
    ``P(batch_axis, axis_name, head_axis, None)`` (USP: the sequence over both axes); with
    ``return_residual`` also the log-sum-exp (B, T, N), with ``return_max_logit`` each
    row's largest logit (B, T, N), sharded alike.

  Example::

      >>> mesh = jax.make_mesh((1,), ("sp",))  # one device here; P devices split T and S
      >>> q = jnp.ones((1, 8, 2, 4))
      >>> out = context_parallel_attention(
      ...   q, q, q, mesh=mesh, axis_name="sp", strategy="ulysses", is_causal=True
      ... )
      >>> out.shape
      (1, 8, 2, 4)
  """
  kwargs = checked("context_parallel_attention", keywords, Keywords)
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
  split = _split.Split.of(mesh, axis_name, layout, batch_axis, head_axis, usp=strategy == "usp")
  if strategy in ("ring", "usp"):  # USP: the ring, with Ulysses inside each ring step
    return _ring_call.ring(query, key, value, bias, mask, split, kwargs, strategy=strategy)
  return _gathered(query, key, value, bias, mask, strategy, split, kwargs)


def ring_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  mesh: Mesh,
  axis_name: str,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  layout: str = "contiguous",
  batch_axis: str | tuple[str, ...] | None = None,
  head_axis: str | tuple[str, ...] | None = None,
  **keywords: Unpack[Keywords],
) -> Any:  # the output, with the lse and max logit where asked for
  """Ring attention: :func:`context_parallel_attention` with ``strategy="ring"``.

  Device i keeps query shard i; the key/value shards (with their segment ids) travel around
  the ring of ``axis_name``'s devices, each step's partial result merged by the
  online-softmax rule, and the backward pass rings the gradients (a custom_vjp). Arguments
  and returns as :func:`context_parallel_attention`'s; ``implementation`` names what runs
  each (query shard, key/value shard) pair: ``"blockwise"`` (the ring's own tile loops, any
  backend), a kernel of the selection table that tabulates its masks per pair (splash on a
  TPU) or one run per pair through the table (flex on a GPU), or None (the backend's where
  the table runs a pair's call on it, blockwise otherwise); ``backward`` must be None.
  """
  checked("ring_attention", keywords, Keywords)
  return context_parallel_attention(
    query,
    key,
    value,
    bias,
    mask,
    mesh=mesh,
    axis_name=axis_name,
    strategy="ring",
    layout=layout,
    batch_axis=batch_axis,
    head_axis=head_axis,
    **keywords,
  )


def explain(
  query: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  key: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  value: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  bias: jax.typing.ArrayLike | jax.ShapeDtypeStruct | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  backend: str | None = None,
  **arguments: Any,
) -> Choice:
  """What each device runs for :func:`context_parallel_attention` with these arguments
  (``mesh``, ``axis_name``, ``strategy`` and the rest), and why: the implementation of its
  part (all-gather, Ulysses) or of each shard pair (ring), as a :class:`jattn.Choice`.

  Arrays may be ``jax.ShapeDtypeStruct`` values; nothing is computed. ``backend``
  (``"cpu"``, ``"gpu"``, ``"tpu"``; default JAX's) names where the call would run, as
  :func:`jattn.explain`'s does.

  Example::

      >>> q = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
      >>> mesh = jax.make_mesh((1,), ("sp",))
      >>> kw = dict(mesh=mesh, axis_name="sp", is_causal=True)
      >>> explain(q, q, q, strategy="ulysses", backend="gpu", **kw).implementation
      'cudnn'
      >>> explain(q, q, q, strategy="all_gather", backend="gpu", **kw).implementation
      'flex'
      >>> explain(q, q, q, strategy="all_gather", backend="tpu", **kw).implementation
      'splash'
      >>> explain(q, q, q, strategy="ulysses", backend="cpu", **kw).implementation
      'blockwise'
  """
  select.check_backend(backend)
  target = testing.lowering_for(backend) if backend else contextlib.nullcontext()
  call = lambda q, k, v, b, m, kw: context_parallel_attention(q, k, v, b, m, **kw)
  with _choices.recording(run=False) as choices, target:
    attention.trace_abstract(call, query, key, value, bias, mask, arguments)
  if not choices:  # nothing to split (an empty dimension): the one-device call
    raise ValueError("explain: the call has an empty dimension; jattn.explain says what it runs")
  return choices[0]


class _Plan(NamedTuple):
  """Static settings of one all-gather or Ulysses call (hashable: a jit static argument)."""

  strategy: str
  axis_name: str
  size: int  # P
  layout: str
  q_len: int  # global T
  kv_len: int  # global S
  batch_axis: Any  # a PartitionSpec entry, None when the batch is not sharded
  head_axis: Any
  implementation: str | None
  backward: str | None
  blocks: tuple[int | None, int | None]
  # Each device's part of the mask with NumPy index maps (_part_masks), or None.
  part_masks: tuple[StaticMask, ...] | None


def _gathered(
  query: Any,
  key: Any,
  value: Any,
  bias: Any,
  mask: Any,
  strategy: str,
  split: _split.Split,
  keywords: dict[str, Any],
) -> Any:
  # What runs each device's part is chosen per part; the whole call is checked without it
  # (a fused kernel named here would refuse the whole call's sharded sequence).
  options = options_of(keywords)
  # Segment ids travel as arrays, in the layout's order like the inputs, and meet the keys
  # they belong to on each device: a mask of the ids themselves classifies each tile of a
  # part exactly, where one reindexed to natural positions could not say.
  segment_ids = keywords.pop("segment_ids", None)
  layout, size = split.layout, split.size
  lengths = (jnp.shape(query)[-3], jnp.shape(key)[-3])
  mask = _natural_mask(mask, layout, size, lengths)  # in natural order, as masks of indices
  # Checked as for a CPU, where the table's choice (xla or blockwise) keeps the mask whole in
  # the spec (splash's would move parts of it, tabulated for the whole call, out of it): each
  # device's part is then chosen for the backend that traces it.
  q, k, v, spec = _validate.build(query, key, value, bias, mask, keywords, backend="cpu")
  if spec.unbatched:
    raise ValueError(
      f"context_parallel_attention needs batched inputs: query (B, T, N, H), got shape {q.shape}"
    )
  split.check_shapes(spec.B, spec.T, spec.S, spec.N, spec.K)
  _check_heads(spec, split, strategy)
  ids = _split.segment_rows(segment_ids, spec.B, spec.T, spec.S)
  if not (all(spec.bnts) and spec.H):  # nothing to split (an empty B, T, S, N or H)
    if ids is not None:
      spec = dataclasses.replace(spec, mask=masks.all_of(spec.mask, masks.segments(*ids)))
    return attention.returned(*attention.attend(q, k, v, spec))
  # Ulysses' parts take the static form on any backend (one mask, exact tiles); the
  # all-gather's, one per device, only where a kernel that tabulates its masks may run them.
  backend = testing.target_backend() or select.default_backend()
  named = options.implementation
  tabulated = named in select.STATIC_MASKS or (
    named is None and any(backend in select.TABLE[n].runs_on for n in select.STATIC_MASKS)
  )
  part_masks, why_not = None, None
  if strategy == "ulysses" or tabulated:
    part_masks, why_not = _part_masks(
      spec.mask, strategy, layout, size, spec.T, spec.S, split.batch_axes, split.head_axes
    )
  if why_not and named in select.STATIC_MASKS:
    raise ValueError(
      f"context_parallel_attention(strategy={strategy!r}, implementation={named!r}) does not "
      f"support {why_not}: {named} tabulates each device's part of the mask when its kernel "
      f"is built"
    )
  plan = _Plan(
    strategy=strategy,
    axis_name=split.axis_name,
    size=size,
    layout=layout,
    q_len=spec.T,
    kv_len=spec.S,
    batch_axis=split.batch_axis,
    head_axis=split.head_axis,
    implementation=named,
    backward=options.backward,
    blocks=(options.block_q, options.block_kv),
    part_masks=part_masks,
  )
  return attention.returned(*_call(q, k, v, ids, contract.rank4(spec), plan=plan, mesh=split.mesh))


def _part_masks(
  mask: masks.Mask | None,
  strategy: str,
  layout: str,
  size: int,
  q_len: int,
  kv_len: int,
  batch_axes: tuple[str, ...],
  head_axes: tuple[str, ...],
) -> tuple[tuple[StaticMask, ...] | None, str | None]:
  """Each device's part of ``mask`` (natural positions) seen through NumPy index maps, as a
  kernel that tabulates its masks when it is built (splash) takes it: one for Ulysses, whose
  devices all see the whole sequence in the layout's order, one per device for the
  all-gather, by its query shard's positions; and why there are none where ``mask`` holds
  traced arrays or varies over a sharded batch or head axis (its parts then read the
  device's traced rows, as :func:`_per_device` maps them)."""
  if mask is None:
    return None, None
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask)):
    return None, "a mask holding traced arrays"
  heads_split = strategy == "ulysses" or bool(head_axes)
  for part in core.conjuncts(mask):
    if part.extents[0] is not None and batch_axes:
      return None, f"mask {part!r}, which varies over the batch rows sharded by {batch_axes}"
    if part.extents[1] is not None and heads_split:
      return None, f"mask {part!r}, which varies over the heads split across devices"
  contiguous = layout == "contiguous"
  kv = None if contiguous else positions(layout, kv_len, size)
  if strategy == "ulysses":
    rows = [None if contiguous else positions(layout, q_len, size)]
  else:
    rows = list(positions(layout, q_len, size).reshape(size, q_len // size))
  parts = tuple(
    StaticMask([mask if q is None and kv is None else masks.reindex(mask, q=q, kv=kv)])
    for q in rows
  )
  return parts, None


def _check_heads(spec: CallSpec, split: _split.Split, strategy: str) -> None:
  """Ulysses splits the heads over the sequence's devices as well as the head axes."""
  if strategy != "ulysses":
    return
  parts = math.prod(split.mesh.shape[a] for a in split.head_axes) * split.size
  for name, n in (("query heads N", spec.N), ("key/value heads K", spec.K)):
    if n % parts:
      raise ValueError(
        f"strategy='ulysses' splits the heads over the {parts} devices of mesh axes "
        f"{(*split.head_axes, split.axis_name)}, and the number of {name}={n} does not "
        f"divide by {parts}: use strategy='all_gather' or 'ring', or repeat the key/value "
        f"heads to a multiple of {parts}"
      )


@_choices.jit(static_argnames=("plan", "mesh"))
def _call(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  ids: tuple[jax.Array, jax.Array] | None,
  spec: CallSpec,
  *,
  plan: _Plan,
  mesh: Mesh,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  b, h, axis = plan.batch_axis, plan.head_axis, plan.axis_name
  seq = P(b, axis, h, None)
  ids_spec = None if ids is None else (P(b, axis), P(b, axis))
  if ids is not None:
    ids = (_ring.place(ids[0], mesh, P(b, axis)), _ring.place(ids[1], mesh, P(b, axis)))
  bias, rest = spec.bias, dataclasses.replace(spec, bias=None)
  bias_spec: P | None = None if bias is None else _bias_spec(plan, bias.shape)
  query, key, value = (_ring.place(x, mesh, seq) for x in (query, key, value))
  if bias is not None and bias_spec is not None:
    bias = _ring.place(bias, mesh, bias_spec)
  rest = jax.tree.map(lambda x: _ring.place(x, mesh, P()), rest)
  rows = P(b, axis, h)
  run = jax.shard_map(
    functools.partial(_per_device, plan),
    mesh=mesh,
    in_specs=(seq, seq, seq, bias_spec, ids_spec, jax.tree.map(lambda _: P(), rest)),
    out_specs=(
      seq,
      rows if spec.return_residual else None,
      rows if spec.return_max_logit else None,
    ),
    # Off: Pallas kernels' results carry no varying-axes types; JAX transposes the
    # all-gathers and all-to-alls, and sums the replicated inputs' cotangents, regardless.
    check_vma=False,
  )
  return run(query, key, value, bias, ids, rest)


def _bias_spec(plan: _Plan, shape: tuple[int, ...]) -> P:
  """The bias's split: like the scores each device computes, broadcast axes whole."""
  Bb, Nb, Tb, _ = shape
  if plan.strategy == "ulysses":  # whole sequences, heads over (head_axis, axis_name)
    heads = (*sharded.axis_names(plan.head_axis), plan.axis_name)
    return P(plan.batch_axis if Bb > 1 else None, heads if Nb > 1 else None, None, None)
  return P(
    plan.batch_axis if Bb > 1 else None,
    plan.head_axis if Nb > 1 else None,
    plan.axis_name if Tb > 1 else None,
    None,
  )


def _attend(
  query: jax.Array, key: jax.Array, value: jax.Array, *, spec: CallSpec
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """One device's part, or zeros of its results' types where :func:`explain` only asks what
  would run it (the part's kernel may trace only on its platform)."""
  if not _choices.only_choosing():
    return attention.attend(query, key, value, spec)
  out = jnp.zeros((*query.shape[:-1], value.shape[-1]), query.dtype)
  rows = lambda asked, dtype: jnp.zeros(query.shape[:-1], dtype) if asked else None
  return out, rows(spec.return_residual, query.dtype), rows(spec.return_max_logit, jnp.float32)


def _per_device(
  plan: _Plan,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  ids: tuple[jax.Array, jax.Array] | None,
  spec: CallSpec,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  axis, P_ = plan.axis_name, plan.size
  B, _, N, _ = query.shape
  batch = _ring.global_rows(plan.batch_axis, B)
  if plan.strategy == "ulysses":
    query, key, value = (
      jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
      for x in (query, key, value)
    )
    n = N // P_
    first = jax.lax.axis_index(axis) * n  # of this device's heads, after the all-to-all
    if plan.head_axis is not None:
      first = first + jax.lax.axis_index(plan.head_axis) * N
    head: jax.Array | None = first + jnp.arange(n, dtype=jnp.int32)
    natural = plan.layout == "contiguous"
    q_pos = None if natural else jnp.asarray(positions(plan.layout, plan.q_len, P_))
    kv_pos = None if natural else jnp.asarray(positions(plan.layout, plan.kv_len, P_))
  else:  # all_gather
    key, value = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (key, value))
    head = _ring.global_rows(plan.head_axis, N)
    q_pos = shard_positions(plan.layout, plan.q_len, P_, jax.lax.axis_index(axis))
    natural = plan.layout == "contiguous"
    kv_pos = None if natural else jnp.asarray(positions(plan.layout, plan.kv_len, P_))
  maps = dict(batch=batch, head=head, q=q_pos, kv=kv_pos)
  segments = []
  if ids is not None:  # in the layout's order, as the keys and (Ulysses) queries are here
    q_ids, kv_ids = ids
    if plan.strategy == "ulysses":
      q_ids = jax.lax.all_gather(q_ids, axis, axis=1, tiled=True)
    kv_ids = jax.lax.all_gather(kv_ids, axis, axis=1, tiled=True)
    segments.append(masks.segments(q_ids, kv_ids))
  if plan.strategy == "ulysses" and plan.part_masks is not None:
    # The same part mask on every device, its maps NumPy: exact tile classes for any kernel.
    parts = [*plan.part_masks[0].parts, *segments]
  else:
    parts = [*([] if spec.mask is None else [masks.reindex(spec.mask, **maps)]), *segments]
  local = dataclasses.replace(
    spec,
    B=query.shape[0],
    T=query.shape[1],
    S=key.shape[1],
    N=query.shape[2],
    K=key.shape[2],
    bias=bias,
    mask=masks.all_of(*parts),
    score_fn=None if spec.score_fn is None else scores.reindex(spec.score_fn, **maps),
    # Taken by head index even where the heads are whole: passed on as the shard_map's input
    # itself, the replicated sinks gave wrong outputs (JAX 0.10; the cause is not known).
    sinks=None if spec.sinks is None else spec.sinks[jnp.arange(N) if head is None else head],
    positions=(batch, head, q_pos, kv_pos) if spec.dropout_rate else None,
  )
  choose = functools.partial(
    _validate.for_shard,
    dtype=query.dtype,
    implementation=plan.implementation,
    backward=plan.backward,
    blocks=plan.blocks,
  )
  if plan.strategy == "all_gather" and plan.part_masks is not None:
    # A kernel that tabulates its masks when it is built (splash) cannot read the device's
    # traced query positions: it runs each device's own tabulated part, picked on the device.
    mine = lambda m: dataclasses.replace(local, mask=masks.all_of(*m.parts, *segments))
    trial, choice = choose(mine(plan.part_masks[0]))
    if trial.static_mask is not None:
      distinct = list(dict.fromkeys(plan.part_masks))  # the first device's part first
      specs = [trial] + [choose(mine(m))[0] for m in distinct[1:]]
      branches = [functools.partial(_attend, spec=spec) for spec in specs]
      which = jnp.asarray([distinct.index(m) for m in plan.part_masks], jnp.int32)
      _choices.record(choice)
      return jax.lax.switch(which[jax.lax.axis_index(axis)], branches, query, key, value)
  local, choice = choose(local)
  _choices.record(choice)
  results = _attend(query, key, value, spec=local)
  if plan.strategy == "ulysses":  # back to sequence shards, every head (lse, max logit too)
    back = lambda x: jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)
    results = jax.tree.map(back, results)
  return results
