"""Pieces every implementation shares: score tiles, the masked softmax, closures.

Shape legend as in :mod:`jattn.attention`; G = N // K query heads per key/value
head. Query head n belongs to key/value head n // G, as in jax.nn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.typing import ArrayLike, DTypeLike

from jattn import _compat
from jattn.impl.contract import CallSpec
from jattn.masks import indexing

__all__ = [
  "stats_dtype",
  "compute_dtype",
  "scales_queries",
  "scaled_queries",
  "group_heads",
  "ungroup_heads",
  "logits",
  "probs_times_values",
  "unnormalized_softmax",
  "softmax",
  "sharding_spec",
  "sharded_as",
  "reshard",
  "full",
  "varying_as",
  "at_positions",
  "row_max",
  "normalized_exp",
  "safe_total",
  "log_sum_exp",
  "add_sinks",
  "reduce_to_shape",
  "hoist",
  "float_or_none",
  "finish",
  "max_logit",
  "is_primal",
  "primal_values",
  "materialized",
]


def stats_dtype(dtype: DTypeLike) -> np.dtype:
  """Logits, maxima and sums: float32, or float64 for float64 inputs."""
  return np.promote_types(dtype, np.float32)


def compute_dtype(dtype: DTypeLike, backend: str) -> np.dtype:
  """The dtype xla and blockwise compute in for inputs of ``dtype`` on ``backend``: float32
  for bfloat16 and float16 on a CPU, else ``dtype`` itself; outputs and gradients are
  rounded back to ``dtype`` once, at the end. :func:`jattn._validate.build` decides it for the
  call's backend and records it on the spec, so it is part of the jit cache key.

  XLA's CPU dots have no fast path for narrow floats, and rounding once at the end is the
  more accurate (the measurement: docs/tuning.md). On a GPU or TPU (or routed as one by
  :func:`jattn.testing.lowering_for`) the computation stays narrow, with float32
  statistics.
  """
  dtype = np.dtype(dtype)
  if backend == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


def scales_queries(dtype: DTypeLike) -> bool:
  """Whether queries of ``dtype`` are multiplied by the scale before the q·k product.

  Float32/64 queries are: scaling the (T, H) queries is cheaper than scaling every
  (T, S) score, and fuses into their layout copy. Narrower queries are not, so the
  float32 scores are scaled instead of queries rounded after scaling.
  """
  return np.dtype(dtype) == stats_dtype(dtype)


def scaled_queries(query: jax.Array, scale: float) -> jax.Array:
  """``query`` times ``scale`` when :func:`scales_queries` says so, else ``query`` unchanged."""
  if scales_queries(query.dtype):
    return query * jnp.asarray(scale, query.dtype)
  return query


def group_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """(B, T, N, H) -> (B, K, G, T, H): query heads grouped by the key/value head they share.

  Contracting in this layout puts the batch-like axes (B, K) first and T next
  to H, which XLA's CPU dot handles without the transposes that a
  "BTKGH,BSKH->BKGTS" contraction costs.
  """
  B, T, N, H = x.shape
  return x.reshape(B, T, num_kv_heads, N // num_kv_heads, H).transpose(0, 2, 3, 1, 4)


def ungroup_heads(x: jax.Array) -> jax.Array:
  """(B, K, G, T, H) -> (B, T, N, H), the inverse of :func:`group_heads`."""
  B, K, G, T, H = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def logits(query_g: jax.Array, key: jax.Array, bias: jax.Array | None, scale: float) -> jax.Array:
  """``scale * q·k + bias`` for grouped query (B, K, G, T, H) and key (B, S, K, H), as (B, N, T, S).

  GQA contracts each key head with its G query heads directly, without
  repeating K. ``bias`` broadcasts to (B, N, T, S).
  """
  B, K, G, T, H = query_g.shape
  S = key.shape[1]
  chex.assert_shape(key, (B, S, K, H))
  dtype = stats_dtype(query_g.dtype)
  s = jnp.einsum(
    "BKGTH,BSKH->BKGTS", scaled_queries(query_g, scale), key, preferred_element_type=dtype
  )
  if not scales_queries(query_g.dtype):
    s = s * jnp.asarray(scale, dtype)
  s = s.reshape(B, K * G, T, S)
  if bias is not None:
    chex.assert_rank(bias, 4)
    s = s + bias.astype(dtype)
  return s


def probs_times_values(p: jax.Array, value: jax.Array) -> jax.Array:
  """``p @ v`` for p (B, N, T, S) and value (B, S, K, H), as (B, K, G, T, H) in float32/64."""
  B, N, T, S = p.shape
  K = value.shape[2]
  return jnp.einsum(
    "BKGTS,BSKH->BKGTH",
    p.astype(value.dtype).reshape(B, K, N // K, T, S),
    value,
    preferred_element_type=stats_dtype(value.dtype),
  )


def unnormalized_softmax(
  s: jax.Array, keep: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(p, m, l)``: p = exp(s - m), row maxima m and row sums l, over the allowed positions.

  Every finite score takes part, however negative: a row whose bias is
  ``finfo(float32).min`` everywhere is a uniform softmax, as in jax.nn. Masked
  positions and scores of -inf are left out (p exactly 0). A row with nothing
  left has l == 0, p == 0 and m == 0, so no -inf enters a subtraction and
  nothing is NaN, in value or gradient; dividing by :func:`safe_total` then
  gives zeros. m is a constant of the gradient (stop_gradient).
  """
  if keep is not None:
    s = jnp.where(keep, s, -jnp.inf)
  m = row_max(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))
  p = jnp.exp(s - m)
  return p, m, jnp.sum(p, axis=-1, keepdims=True)


@jax.custom_jvp
def softmax(s: jax.Array, keep: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(y, m, l)``: the normalised probabilities y = p / l of :func:`unnormalized_softmax`, with
  its row max m and sum l. Rows with nothing allowed are zeros.

  The derivative is jax.nn.softmax's, ``ẏ = y ⊙ (ṡ − rowsum(y ⊙ ṡ))``, rather than the chain
  rule through p and l: its transpose ``y ⊙ (g − rowsum(y ⊙ g))`` cancels exactly when a row
  saturates (y one-hot, so rowsum(y ⊙ g) is g at the hot position), where the chain rule
  leaves rounding noise that the scale then multiplies. ``l̇ = l · rowsum(y ⊙ ṡ)``; m is a
  constant (its choice cancels out of y and of m + log l).

  ẏ is then projected once more, ``ẏ − y · rowsum(ẏ)`` (the same ẏ in exact arithmetic, where
  rowsum(ẏ) is 0), so that the transpose first centres the cotangent, ``g' = g − rowsum(y ⊙ g)``,
  and then forms ``y ⊙ (g' − rowsum(y ⊙ g'))``. In a nearly saturated row (y at the hot key
  1 − δ, δ small but not 0) the one-pass form gets its δ·|g|-sized result by cancelling rounded
  terms of size |g|: noise of an ulp of |g|, rounded as XLA happens to fuse the products and
  sums (with or without a multiply-add), that the scale and |k| then multiply into dq and dk.
  g' is small at the hot key, so the second pass has nothing large left to cancel.
  """
  p, m, l = unnormalized_softmax(s, keep)
  return p / safe_total(l), m, l


@softmax.defjvp
def _softmax_jvp(
  primals: tuple[jax.Array, jax.Array | None], tangents: tuple[jax.Array, Any]
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
  s, keep = primals
  s_dot, _ = tangents
  y, m, l = softmax(s, keep)
  if keep is not None:
    s_dot = jnp.where(keep, s_dot, 0)  # masked scores may be anything, even inf
  y_dot_s = jnp.sum(y * s_dot, axis=-1, keepdims=True)
  y_dot = y * (s_dot - y_dot_s)
  y_dot = y_dot - y * jnp.sum(y_dot, axis=-1, keepdims=True)  # transposed: g centred first
  return (y, m, l), (y_dot, jnp.zeros_like(m), l * y_dot_s)


def sharding_spec(x: ArrayLike) -> tuple:
  """The mesh axes each dimension of ``x`` is sharded over in its type (Explicit mode): one
  entry per dimension, None where it is not sharded. All None in Auto mode and without a
  mesh, where types carry no sharding."""
  sharding = _compat.explicit_sharding(x)
  spec = () if sharding is None else tuple(sharding.spec)
  return spec + (None,) * (jnp.ndim(x) - len(spec))


def sharded_as(spec: Iterable[Any], *, mesh_of: ArrayLike) -> jax.sharding.NamedSharding:
  """A NamedSharding of ``spec`` over the mesh of ``mesh_of``'s type, which names mesh axes
  (Explicit mode): the mesh that ``out_sharding=`` and reshard need outside ``jax.set_mesh``
  too."""
  sharding = _compat.explicit_sharding(mesh_of)
  assert sharding is not None, "mesh_of must be sharded over Explicit mesh axes"
  return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


def reshard(x: jax.Array, spec: Iterable[Any], *, mesh_of: ArrayLike) -> jax.Array:
  """``x`` sharded in its type as ``spec`` says (one entry per dimension), over the mesh of
  ``mesh_of``'s type; ``x`` unchanged where that is already so, and where neither names a
  mesh axis (Auto mode, no mesh)."""
  spec = tuple(spec)
  if spec == sharding_spec(x):
    return x
  return jax.sharding.reshard(x, sharded_as(spec, mesh_of=mesh_of))


def full(
  shape: Sequence[int],
  fill_value: ArrayLike,
  dtype: DTypeLike,
  *,
  like: jax.Array,
  axes: Iterable[int | None],
) -> jax.Array:
  """``jnp.full(shape, fill_value, dtype)`` sharded as ``like`` is along ``axes``: one of
  like's axes per dimension of ``shape``, or None for a dimension that is not sharded.

  A loop's initial carry must have the sharding in types of what its body returns, and in
  Explicit mode plain jnp.full is replicated. Where ``like``'s type names no mesh axis
  (Auto mode, no mesh) this is plain jnp.full.
  """
  spec = sharding_spec(like)
  parts = tuple(None if a is None else spec[a] for a in axes)
  if not any(parts):
    out = jnp.full(shape, fill_value, dtype)
  else:
    out = jnp.full(shape, fill_value, dtype, out_sharding=sharded_as(parts, mesh_of=like))
  return varying_as(out, like)


def varying_as(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` typed as varying over the manual mesh axes ``like`` varies over (inside a
  ``jax.shard_map`` that checks them, a loop's carry must vary as its body's result does)."""
  have = _compat.varying_axes(x)
  missing = tuple(sorted(a for a in _compat.varying_axes(like) if a not in have))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def at_positions(idx: Sequence[Any], positions: Sequence[Any] | None) -> tuple[Any, ...]:
  """Broadcasting (batch, head, q, kv) indices mapped through ``positions`` (a
  :attr:`CallSpec.positions`: each entry None or an int (L,) map; None, the identity)."""
  return tuple(idx) if positions is None else indexing.through_maps(positions, idx)


def row_max(m: jax.Array) -> jax.Array:
  """A running row maximum made safe to subtract: -inf (nothing allowed yet) becomes 0."""
  return jax.lax.stop_gradient(jnp.where(m == -jnp.inf, jnp.zeros_like(m), m))


def normalized_exp(s: jax.Array, m: jax.Array, l: jax.Array, keep: jax.Array | None) -> jax.Array:
  """The normalised probabilities ``exp(s - m) / l`` recomputed from a forward pass's m and l.

  Backward passes use it. m and l are kept apart, as fused kernels keep them,
  rather than folded into the log-sum-exp m + log l: at |m| around 1e9 (an
  additive -1e9 mask on a whole row) log l is lost to rounding in that sum and
  the recomputed row would sum to l instead of 1. Here ``s - m`` is exact for
  scores near the maximum and ``log l`` is subtracted after it. Masked
  positions are exactly 0; the inner ``where`` keeps them at exp(0) first, so
  a large masked score cannot overflow and no inf or NaN reaches a gradient.
  Rows with l == 0 (nothing allowed) give zeros.
  """
  log_l = jnp.log(safe_total(l))
  if keep is None:
    return jnp.exp((s - m) - log_l)
  return jnp.where(keep, jnp.exp((jnp.where(keep, s, m) - m) - log_l), 0)


def safe_total(l: jax.Array) -> jax.Array:
  """Row sums with empty rows (sum exactly 0) replaced by 1, so dividing leaves zeros.

  Written as an addition with a constant rather than a ``where``: the select's
  transpose made XLA's CPU backward pass about 1.5x slower.
  """
  return l + jax.lax.stop_gradient((l == 0).astype(l.dtype))


def log_sum_exp(m: jax.Array, l: jax.Array) -> jax.Array:
  """The rows' log-sum-exp from max and sum: -inf for rows that attend to nothing."""
  return jnp.where(l > 0, m + jnp.log(safe_total(l)), -jnp.inf)


def add_sinks(
  out: jax.Array, lse: jax.Array, sinks: jax.Array, dtype: DTypeLike
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` of attention over the keys, (B, T, N, H) and (B, T, N), turned into
  attention with one more logit per head, ``sinks`` (N,), that has no value:

      lse' = log(exp(lse) + exp(sink)),   out' = out · exp(lse - lse').

  Rows with nothing to attend to (lse = -inf) get out' = 0 and lse' = sink. Exact up to
  rounding in ``dtype`` (the statistics dtype); differentiable in all three through the
  implementation's log-sum-exp. out' is returned in out's dtype.
  """
  lse = lse.astype(dtype)
  sink = jnp.broadcast_to(sinks.astype(dtype), lse.shape)
  keep = jax.nn.sigmoid(lse - sink)  # exp(lse - lse'), 0 for an empty row
  new_out = (out.astype(dtype) * keep[..., None]).astype(out.dtype)
  return new_out, jnp.logaddexp(lse, sink)


def reduce_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Sum ``x`` over the axes where ``shape`` has size 1 (the transpose of broadcasting)."""
  axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def hoist(fn: Callable[..., Any], *example_args: Any) -> tuple[Callable[..., Any], list[Any]]:
  """Closure-convert ``fn`` for use inside a custom_vjp.

  A custom_vjp must see every array it depends on as an explicit argument:
  values captured in closures (a traced relative-bias table, segment ids from
  an enclosing jit) would otherwise leak tracers or lose their gradients. This
  traces ``fn`` at the example arguments' shapes and returns ``(converted,
  consts)`` where ``converted(*args, *consts) == fn(*args)`` and ``consts`` are
  all values ``fn`` closes over. Unlike ``jax.closure_convert`` it hoists
  integer tracers too, so the rule also works under ``grad(jit(...))``.
  """
  closed = jax.make_jaxpr(fn)(*example_args)
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  n_consts = len(consts)

  def converted(*args: Any) -> Any:
    flat, _ = jax.tree_util.tree_flatten(args[: len(args) - n_consts])
    outs = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, args[len(args) - n_consts :]))(*flat)
    return outs[0] if len(outs) == 1 else tuple(outs)

  return converted, consts


def float_or_none(
  cotangents: Iterable[jax.Array | None], primals: Iterable[ArrayLike]
) -> tuple[jax.Array | None, ...]:
  """A custom_vjp's cotangents for its inputs: None for integer and boolean ones."""
  return tuple(
    ct if ct is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact) else None
    for ct, x in zip(cotangents, primals)
  )


def finish(
  out: jax.Array,
  lse: jax.Array,
  max_logit: jax.Array | None,
  spec: CallSpec,
  dtype: DTypeLike,
  sinks_done: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """An implementation's ``(out, lse, max_logit)`` as the caller gets them: the sinks added
  (unless the kernel took them, ``sinks_done``), the output in ``dtype``, the lse in
  ``dtype`` if ``spec.return_residual`` asked for it, else None, the max logit in float32,
  a statistic no gradient flows through, if ``spec.return_max_logit`` asked for it."""
  if spec.sinks is not None and not sinks_done:
    out, lse = add_sinks(out, lse, spec.sinks, stats_dtype(dtype))
    out = out.astype(dtype)  # xla and blockwise kept it in float32/64 for this
  if spec.return_max_logit:
    assert max_logit is not None, f"{spec.implementation} returns the max logit it was asked for"
    max_logit = jax.lax.stop_gradient(max_logit.astype(jnp.float32))
  return out, (lse.astype(dtype) if spec.return_residual else None), max_logit


def max_logit(m: jax.Array, l: jax.Array) -> jax.Array:
  """The rows' largest logit from their running max and sum: -inf for rows that attend to
  nothing (l == 0), whose m is a placeholder; no gradient flows through it."""
  return jax.lax.stop_gradient(jnp.where(l > 0, m, -jnp.inf))


# --- custom_vjps with symbolic zeros (defvjp(..., symbolic_zeros=True)) --------------------


def is_primal(x: Any) -> bool:
  """Whether ``x`` is a forward rule's wrapped input (its ``.value`` and ``.perturbed``)."""
  return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def primal_values(tree: Any) -> Any:
  """``tree`` with each wrapped input of a forward rule replaced by its value."""
  return jax.tree.map(lambda x: x.value, tree, is_leaf=is_primal)


def materialized(cotangent: Any) -> jax.Array:
  """A backward rule's cotangent, zeros where it came as a symbolic zero."""
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent
