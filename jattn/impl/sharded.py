"""Fused kernels on batch- and head-sharded inputs: each device runs the kernel on its share.

XLA cannot partition a Pallas or cuDNN kernel. Attention is independent per (batch row,
head), so each device can run the kernel on its own rows and heads and the results are the
global result's shards. :func:`per_shard` arranges that in both of JAX's sharding modes:

* Explicit mode (``jax.sharding.AxisType.Explicit`` axes, ``jax.set_mesh``): the inputs
  carry their sharding in their types, and the kernel is wrapped in ``jax.shard_map`` over
  the mesh axes that shard the batch and the heads.
* Auto mode (``NamedSharding`` inputs under ``jit``): the sharding is known only when XLA
  partitions the program, so the kernel's forward and backward each get a partitioning rule
  (``custom_partitioning``, as jax's cuDNN attention has) handing each device its batch
  rows and heads. The backward runs the forward again on each device (the rule sees
  arrays, not residuals).

Key/value heads follow the query heads: GQA groups stay whole on a device when the mesh
axes that shard N also shard K (K == 1 keeps its one head on every device). Per-head
static masks and head counts that do not divide keep the heads whole (batch sharding
only). A sharded sequence axis never reaches here: the selection table refuses it.

Kernels that trace the mask and score function into their body (flex) run them on global
indices (``global_index=True``): the arrays they read stay whole on every device, and each
device's spec keeps the global B, N and K with the global index of its first batch row and
head (``spec.shard_offsets``), which makes the kernel's program ids global. Masks and score
functions that read the batch or head index, and dropout, then come out as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn import _compat
from jattn.impl import common, orders
from jattn.impl.contract import CallSpec

__all__ = ["MeshAxes", "Attend", "Mesh", "sequence_axes", "per_shard", "axis_names"]

MeshAxes = str | tuple[str, ...] | None
"""One entry of a PartitionSpec: a mesh axis, several, or None (not sharded)."""

Attend = Callable[[jax.Array, jax.Array, jax.Array, "CallSpec"], "Results"]
"""A kernel on one device's share: ``(q, k, v, spec) -> (out, lse, max_logit or None)``."""

Results = tuple[jax.Array, jax.Array, jax.Array | None]
"""A kernel: ``(query, key, value, spec) -> (out, lse)`` on rank-4 inputs."""

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in axis_names(axes))


_dims = common.sharding_spec  # the mesh axes of each dimension (Explicit mode), else Nones


def sequence_axes(query: jax.Array | np.ndarray, key: jax.Array | np.ndarray) -> tuple | None:
  """The mesh axes that shard the query's or key's sequence axis (Explicit mode), or None.

  ``query`` (B, T, N, H), ``key`` (B, S, K, H), arrays or tracers."""
  axes = tuple(a for x in (query, key) if x.ndim == 4 for a in (_dims(x)[1],) if a is not None)
  return axes or None


def per_shard(
  attend: Attend,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  spec: CallSpec,
  *,
  heads_whole: bool = False,
  auto: bool = True,
  global_index: bool = False,
) -> Results:
  """``attend(query, key, value, spec) -> (out, lse, max_logit)`` run on each device's share
  (``max_logit`` None unless ``spec.return_max_logit``).

  ``query`` (B, T, N, H), ``key`` and ``value`` (B, S, K, H|Hv), ``spec`` a rank-4
  :class:`jattn.impl.contract.CallSpec`. ``heads_whole``: the kernel cannot take a share of the
  heads (its masks differ per head), so only the batch is split. ``auto``: give the kernel
  a partitioning rule for Auto mode (with one device, ``attend`` runs as it is).
  ``global_index``: the kernel reads ``spec.shard_offsets`` and evaluates the mask and score
  function on global indices (see the module docstring).
  """
  sharding = _compat.explicit_sharding(query)
  if sharding is None:
    # Inside a shard_map over the whole mesh (a sequence-parallel call's part or shard pair)
    # the arrays are one device's: the kernel runs on them as they are, where a partitioning
    # rule would only run its forward pass once more in the backward.
    if auto and jax.device_count() > 1 and not _compat.inside_manual_mesh():
      return _partitioned(attend, query, key, value, spec, heads_whole, global_index)
    return attend(query, key, value, spec)
  mesh = sharding.mesh
  b, _, n, _ = _dims(query)
  n = _head_axes(mesh, n, spec.N, spec.K, heads_whole)
  if b is None and n is None:
    return attend(query, key, value, spec)
  kn = n if spec.K > 1 else None
  q_spec, kv_spec = P(b, None, n, None), P(b, None, kn, None)
  query = _reshard(query, q_spec)
  key, value = _reshard(key, kv_spec), _reshard(value, kv_spec)
  local = dataclasses.replace(
    spec,
    B=spec.B // _size(mesh, b),
    N=spec.N // _size(mesh, n),
    K=spec.K // _size(mesh, kn),
  )
  spec_specs = _spec_partition(spec, b, n, global_index)
  leaves, treedef = jax.tree.flatten(spec)
  parts = jax.tree.leaves(spec_specs, is_leaf=lambda x: isinstance(x, P))
  spec = jax.tree.unflatten(treedef, [_reshard(x, p) for x, p in zip(leaves, parts)])
  rows = P(b, None, n)
  out_spec = (P(b, None, n, None), rows, rows if spec.return_max_logit else None)

  def device_call(q: jax.Array, k: jax.Array, v: jax.Array, s: CallSpec) -> Any:
    if global_index:
      s = dataclasses.replace(s, shard_offsets=_offsets(b, n, local.B, local.N))
    else:
      s = dataclasses.replace(s, B=local.B, N=local.N, K=local.K)
    return attend(q, k, v, s)

  run = jax.shard_map(
    device_call,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, spec_specs),
    out_specs=out_spec,
    # The kernels' own custom_vjps give the backward pass; Pallas calls carry no
    # varying-axes types.
    check_vma=False,
  )
  return run(query, key, value, spec)


def _head_axes(mesh: Mesh, n: MeshAxes, N: int, K: int, heads_whole: bool) -> MeshAxes:
  """``n`` (the mesh axes sharding the N query heads; K key/value heads) if the kernel can
  take that share, else None."""
  size = _size(mesh, n)
  if heads_whole or N % size or (K > 1 and K % size):
    return None
  return n


def axis_names(axes: MeshAxes) -> tuple[str, ...]:
  """The mesh axis names of one PartitionSpec entry."""
  return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _offsets(b: MeshAxes, n: MeshAxes, rows: int, heads: int) -> jax.Array:
  """(2,) int32 inside a per-device call: the global index of its first batch row and query
  head, with ``rows`` batch rows over mesh axes ``b`` and ``heads`` heads over ``n``."""
  first = [
    jnp.int32(0) if axes is None else jax.lax.axis_index(axes) * size
    for axes, size in ((b, rows), (n, heads))
  ]
  return jnp.stack(first).astype(jnp.int32)


def _reshard(x: jax.Array, spec: P) -> jax.Array:
  want = tuple(spec) + (None,) * (x.ndim - len(spec))
  return x if _dims(x) == want else jax.sharding.reshard(x, spec)


def _spec_partition(spec: CallSpec, b: MeshAxes, n: MeshAxes, global_index: bool) -> CallSpec:
  """PartitionSpecs for the spec's arrays: batch-indexed leading axes over ``b`` (whole with
  ``global_index``), the sinks' heads over ``n``, a rank-4 bias over both where it is not
  broadcast."""

  def leaf(x: jax.Array | None) -> P | None:
    if x is None:
      return None
    if x.ndim == 0 or global_index:
      return P()
    return P(b if x.shape[0] == spec.B and spec.B > 1 else None)

  def bias(x: jax.Array | None) -> P | None:
    if x is None:
      return None
    rows = b if x.shape[0] == spec.B and spec.B > 1 else None
    heads = n if x.shape[1] == spec.N and spec.N > 1 else None
    return P(rows, heads)

  return dataclasses.replace(
    spec,
    bias=bias(spec.bias),
    mask=None if spec.mask is None else jax.tree.map(leaf, spec.mask),
    score_fn=None if spec.score_fn is None else jax.tree.map(lambda x: P(), spec.score_fn),
    dropout_rng=None if spec.dropout_rng is None else P(),
    sinks=None if spec.sinks is None else P(n),
  )


# --- Auto mode: a partitioning rule -----------------------------------------------------

# What each argument and result of the partitioned kernel is, by its leading axes:
# q (B, T, N, H); kv (B, S, K, H); rows (B, ...): batch-indexed mask arrays; row_heads
# (B, N): the sinks, one row per batch row; lse (B, T, N); bias_* a rank-4 bias with a
# batch axis, a head axis or both (the others broadcast); other: replicated. None: an axis
# of its own.
_FACTORS: dict[str, tuple[str | None, ...]] = {
  "q": ("b", "t", "n", "h"),
  "k": ("b", "s", "k", "h"),
  "v": ("b", "s", "k", "hv"),
  "out": ("b", "t", "n", "hv"),
  "lse": ("b", "t", "n"),
  "row_heads": ("b", "n"),
  "rows": ("b",),
  "bias_bn": ("b", "n"),
  "bias_b": ("b",),
  "bias_n": (None, "n"),
}


def _partitioned(
  attend: Attend,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  spec: CallSpec,
  heads_whole: bool,
  global_index: bool,
) -> Results:
  """Auto mode: the kernel's forward and backward under a partitioning rule, each device
  running them on its batch rows and heads (see the module docstring). The max logit, where
  asked for, is a third result of the forward rule, with no cotangent."""
  B, N, K = spec.B, spec.N, spec.K
  if spec.sinks is not None:  # one row per batch row: each device's gradient is its rows'
    spec = dataclasses.replace(spec, sinks=jnp.broadcast_to(spec.sinks, (B, N)))
  leaves, treedef = jax.tree.flatten(spec)
  roles = jax.tree.leaves(_roles(spec, global_index))
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

  outs = ("out", "lse", "lse") if spec.return_max_logit else ("out", "lse")

  def local(
    q: jax.Array, k: jax.Array, v: jax.Array, *leaves: Any, offsets: jax.Array | None = None
  ) -> tuple[jax.Array, ...]:
    s = jax.tree.unflatten(treedef, leaves)
    if global_index:
      s = dataclasses.replace(s, shard_offsets=offsets)
    else:
      s = dataclasses.replace(s, B=q.shape[0], N=q.shape[2], K=k.shape[2])
    return tuple(x for x in attend(q, k, v, s)[: len(outs)] if x is not None)

  def local_grads(wanted: tuple[int, ...]) -> Callable[..., tuple[Any, ...]]:
    """The per-device backward: gradients for q, k, v and the leaves ``wanted``."""

    def grads(
      q: jax.Array, k: jax.Array, v: jax.Array, *rest: Any, offsets: jax.Array | None = None
    ) -> tuple[Any, ...]:
      leaves, cotangents = rest[: len(roles)], rest[len(roles) :]

      def differentiable(
        q: jax.Array, k: jax.Array, v: jax.Array, *chosen: jax.Array
      ) -> tuple[jax.Array, jax.Array]:
        full = list(leaves)
        for i, x in zip(wanted, chosen):
          full[i] = x
        out, lse = local(q, k, v, *full, offsets=offsets)[:2]  # not the max logit: a statistic
        return out, lse

      _, vjp = jax.vjp(differentiable, q, k, v, *(leaves[i] for i in wanted))
      return vjp(tuple(cotangents))

    return grads

  rules = (B, N, K, heads_whole, global_index)
  forward = _rule(local, ("q", "k", "v", *roles), outs, rules)
  who = f"implementation={spec.implementation!r}"
  only_forward = orders.first_order(forward, who, orders.FUSED, forward=False)

  def only_backward(wanted: tuple[int, ...]) -> Callable[..., Any]:
    backward = _rule(
      local_grads(wanted),
      ("q", "k", "v", *roles, "out", "lse"),
      ("q", "k", "v", *(roles[i] for i in wanted)),
      rules,
    )
    return orders.first_order(backward, who, orders.FUSED, forward=False)

  run = _kernel_vjp(forward, only_forward, only_backward, floats, who)
  out, lse, *top = run(query, key, value, leaves)
  return out, lse, (top[0] if top else None)


def _kernel_vjp(
  forward: Callable[..., Any],
  only_forward: Callable[..., Any],
  only_backward: Callable[[tuple[int, ...]], Callable[..., Any]],
  floats: list[int],
  who: str,
) -> Callable[..., Any]:
  """``run(q, k, v, leaves)``: the partitioned ``forward`` in a custom_vjp whose backward is
  ``only_backward(wanted)`` for the floating leaves (at ``floats``) the caller
  differentiates (symbolic zeros tell: a static fact carried in the residuals' tree
  structure, () where it does and None where not)."""
  Residuals = tuple[jax.Array, jax.Array, jax.Array, list[Any], tuple[Any, ...]]

  @functools.partial(orders.reverse_only, who=who, rule=orders.KERNEL_RULE)
  def run(q: jax.Array, k: jax.Array, v: jax.Array, leaves: list[Any]) -> Any:
    return forward(q, k, v, *leaves)

  def run_fwd(q: Any, k: Any, v: Any, leaves: list[Any]) -> tuple[Any, Residuals]:
    flags = tuple(() if leaves[i].perturbed else None for i in floats)
    q, k, v, leaves = common.primal_values((q, k, v, leaves))
    return only_forward(q, k, v, *leaves), (q, k, v, leaves, flags)

  def run_bwd(
    residuals: Residuals, cotangents: tuple[Any, ...]
  ) -> tuple[jax.Array, jax.Array, jax.Array, list[Any]]:
    q, k, v, leaves, flags = residuals
    wanted = tuple(i for i, flag in zip(floats, flags) if flag is not None)
    d_out, d_lse = (common.materialized(c) for c in cotangents[:2])  # none for the max logit
    dq, dk, dv, *d_chosen = only_backward(wanted)(q, k, v, *leaves, d_out, d_lse)
    d_leaves: list = [None] * len(leaves)
    for i, d in zip(wanted, d_chosen):
      d_leaves[i] = d
    return dq, dk, dv, d_leaves

  run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
  return run


def _roles(spec: CallSpec, global_index: bool) -> CallSpec:
  """The spec with each array replaced by its role in :data:`_FACTORS` (or "other")."""

  def mask_leaf(x: jax.Array) -> str:
    rows = x.ndim and x.shape[0] == spec.B and spec.B > 1 and not global_index
    return "rows" if rows else "other"

  def bias(x: jax.Array) -> str:
    rows, heads = (x.shape[i] == n and n > 1 for i, n in ((0, spec.B), (1, spec.N)))
    return {(1, 1): "bias_bn", (1, 0): "bias_b", (0, 1): "bias_n"}.get((rows, heads), "other")

  return dataclasses.replace(
    spec,
    bias=None if spec.bias is None else bias(spec.bias),
    mask=None if spec.mask is None else jax.tree.map(mask_leaf, spec.mask),
    score_fn=None if spec.score_fn is None else jax.tree.map(lambda x: "other", spec.score_fn),
    dropout_rng=None if spec.dropout_rng is None else "other",
    sinks=None if spec.sinks is None else "row_heads",
  )


def _rule(
  fn: Callable[..., Any],
  roles_in: tuple[str, ...],
  roles_out: tuple[str, ...],
  rules: tuple[int, int, int, bool, bool],
) -> Callable[..., Any]:
  """``fn`` (flat arrays in and out) under custom_partitioning: batch rows over the query's
  batch axes, heads over its head axes (where the kernel can take them), the rest whole on
  each device, with the constants ``fn`` closes over (a kernel's mask tables) as leading
  arguments."""

  def partitioned(*args: jax.Array) -> Any:
    traced, consts = _compat.without_consts(fn, *args)
    roles = ("other",) * len(consts) + roles_in

    def lower(*a: jax.Array, offsets: jax.Array | None) -> Any:  # local shapes: traced anew
      return fn(*a[len(consts) :], offsets=offsets)

    wrapped = custom_partitioning(traced)
    _define(wrapped, lower, roles, roles_out, rules)
    return wrapped(*consts, *args)

  # custom_partitioning has no batching rule: under vmap, one call per element of the mapped
  # axis (each still partitioned over the batch and heads).
  @jax.custom_batching.custom_vmap
  def mapped(*args: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(partitioned(*args))

  @mapped.def_vmap
  def _one_by_one(
    axis_size: int, in_batched: Sequence[bool], *args: jax.Array
  ) -> tuple[Any, tuple[bool, ...]]:
    del axis_size

    def one(xs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
      it = iter(xs)
      return mapped(*(next(it) if b else x for x, b in zip(args, in_batched)))

    outs = jax.lax.map(one, [x for x, b in zip(args, in_batched) if b])
    return outs, (True,) * len(outs)

  return mapped


def _role_specs(b: MeshAxes, n: MeshAxes, kn: MeshAxes) -> dict[str, P]:
  """Each role's PartitionSpec with the batch over ``b``, the query heads over ``n`` and the
  key/value heads over ``kn``."""
  return {
    "q": P(b, None, n, None),
    "out": P(b, None, n, None),
    "k": P(b, None, kn, None),
    "v": P(b, None, kn, None),
    "lse": P(b, None, n),
    "rows": P(b),
    "row_heads": P(b, n),
    "bias_bn": P(b, n),
    "bias_b": P(b),
    "bias_n": P(None, n),
    "other": P(),
  }


def _mapping(role: str, i: int, shape: tuple[int, ...]) -> ArrayMapping:
  """The Shardy factors of argument ``i`` in ``role``: the role's shared ones, else its own."""
  names = _FACTORS.get(role, ())
  own = lambda d: f"{role[0]}{i}x{d}"  # noqa: E731  # a factor of this axis alone
  return ArrayMapping(
    *(names[d] or own(d) if d < len(names) else own(d) for d in range(len(shape)))
  )


def _define(
  wrapped: custom_partitioning,
  lower: Callable[..., Any],
  roles_in: tuple[str, ...],
  roles_out: tuple[str, ...],
  rules: tuple[int, int, int, bool, bool],
) -> None:
  """The partitioning rule of :func:`_rule`."""
  B, N, K, heads_whole, global_index = rules

  def axes(mesh: Mesh, query_sharding: jax.sharding.Sharding) -> tuple[MeshAxes, MeshAxes]:
    """(batch axes, head axes) of the query's sharding that the kernel takes."""
    spec = tuple(getattr(query_sharding, "spec", ())) + (None,) * 4
    return spec[0], _head_axes(mesh, spec[2], N, K, heads_whole)

  def specs(
    mesh: Mesh, query_sharding: jax.sharding.Sharding, roles: tuple[str, ...]
  ) -> tuple[NamedSharding, ...]:
    b, n = axes(mesh, query_sharding)
    by_role = _role_specs(b, n, n if K > 1 else None)
    return tuple(NamedSharding(mesh, by_role[r]) for r in roles)

  first = roles_in.index("q")  # the query follows the hoisted constants

  def infer(
    mesh: Mesh, arg_shapes: Sequence[jax.ShapeDtypeStruct], result_shape: Any
  ) -> tuple[NamedSharding, ...]:
    del result_shape
    return specs(mesh, arg_shapes[first].sharding, roles_out)

  def partition(
    mesh: Mesh, arg_shapes: Sequence[jax.ShapeDtypeStruct], result_shape: Any
  ) -> tuple[Mesh, Callable[..., Any], tuple[NamedSharding, ...], tuple[NamedSharding, ...]]:
    del result_shape
    sharding = arg_shapes[first].sharding
    b, n = axes(mesh, sharding)
    out_specs = specs(mesh, sharding, roles_out)
    # A result whole along a mesh axis that splits the batch or heads (the one key/value
    # head with K == 1; a bias broadcast over the batch or heads; a score function's
    # table) is a gradient each device computes from its own rows and heads only: add up
    # the devices' shares over those axes.
    split = [a for axes_ in (b, n) for a in axis_names(axes_)]
    summed = [
      tuple(a for a in split if a not in {x for e in spec.spec for x in axis_names(e)})
      for spec in out_specs
    ]

    def run(*args: jax.Array) -> Any:
      offsets = None
      if global_index:
        offsets = _offsets(b, n, B // _size(mesh, b), N // _size(mesh, n))
      outs = lower(*args, offsets=offsets)
      return tuple(jax.lax.psum(x, over) if over else x for x, over in zip(outs, summed))

    return mesh, run, out_specs, specs(mesh, sharding, roles_in)

  def sharding_rule(
    mesh: Mesh, value_types: Sequence[Any], result_types: Sequence[Any]
  ) -> SdyShardingRule:
    del mesh
    ins = tuple(_mapping(r, i, t.shape) for i, (r, t) in enumerate(zip(roles_in, value_types)))
    outs = tuple(
      _mapping(r, i + len(ins), t.shape) for i, (r, t) in enumerate(zip(roles_out, result_types))
    )
    return SdyShardingRule(ins, outs)

  wrapped.def_partition(
    partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule
  )
