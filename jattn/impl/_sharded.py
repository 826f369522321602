"""Fused kernels on batch- and head-sharded inputs: each device runs the kernel on its share.

XLA cannot partition a Pallas or cuDNN kernel. Where the inputs carry their sharding in
their types (JAX's Explicit sharding mode: ``jax.sharding.AxisType.Explicit`` axes and
``jax.set_mesh``), :func:`per_shard` wraps the kernel in ``jax.shard_map`` over the mesh
axes that shard the batch and the heads, so every device attends over its own rows and
heads and nothing is gathered. Attention is independent per (batch row, head), so the
per-device results are the global result's shards.

Key/value heads follow the query heads: GQA groups stay whole on a device when the mesh
axes that shard N also shard K (K == 1 keeps its one head on every device). Per-head
static masks and head counts that do not divide keep the heads whole on each device
(batch sharding only). A sharded sequence axis never reaches here: the selection table
refuses it and names ``jattn.parallel.ring_attention``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jattn import _compat


def _size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def _dims(x) -> tuple:
  sharding = _compat.explicit_sharding(x)
  spec = () if sharding is None else tuple(sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def sequence_axes(query, key) -> tuple | None:
  """The mesh axes that shard the query's or key's sequence axis (Explicit mode), or None.

  ``query`` (B, T, N, H), ``key`` (B, S, K, H), arrays or tracers."""
  axes = tuple(a for x in (query, key) if x.ndim == 4 for a in (_dims(x)[1],) if a is not None)
  return axes or None


def per_shard(attend: Callable, query, key, value, spec, *, heads_whole: bool = False):
  """``attend(query, key, value, spec) -> (out, lse)`` run on each device's share.

  ``query`` (B, T, N, H), ``key`` and ``value`` (B, S, K, H|Hv), ``spec`` a rank-4
  :class:`jattn._spec.CallSpec`. Without Explicit sharding on ``query`` this is ``attend``
  itself. ``heads_whole``: the kernel cannot take a share of the heads (its masks differ
  per head), so only the batch is split.
  """
  sharding = _compat.explicit_sharding(query)
  if sharding is None:
    return attend(query, key, value, spec)
  mesh = sharding.mesh
  b, _, n, _ = _dims(query)
  if heads_whole or spec.N % _size(mesh, n) or (spec.K > 1 and spec.K % _size(mesh, n)):
    n = None
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
  spec_specs = _spec_partition(spec, b, n)
  out_spec = (P(b, None, n, None), P(b, None, n))
  run = jax.shard_map(
    lambda q, k, v, s: attend(q, k, v, dataclasses.replace(s, B=local.B, N=local.N, K=local.K)),
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, spec_specs),
    out_specs=out_spec,
    # The kernels' own custom_vjps give the backward pass; Pallas calls carry no
    # varying-axes types.
    check_vma=False,
  )
  return run(query, key, value, spec)


def _reshard(x, spec: P):
  return x if _dims(x) == tuple(spec) else jax.sharding.reshard(x, spec)


def _spec_partition(spec, b, n):
  """PartitionSpecs for the spec's arrays: batch-indexed leading axes over ``b``, the
  sinks' heads over ``n``, a rank-4 bias over both where it is not broadcast."""

  def leaf(x):
    if x is None:
      return None
    if x.ndim == 0:
      return P()
    return P(b if x.shape[0] == spec.B and spec.B > 1 else None)

  def bias(x):
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
    routes=(),
  )
