"""Pieces every implementation shares: score tiles, the masked softmax, closures.

Shape legend as in :mod:`jattn.attention`; G = N // K query heads per key/value
head. Query head n belongs to key/value head n // G, as in jax.nn.
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

# A finite stand-in for -inf as the running max of a row with nothing to attend
# to. Finite so that no subtraction can make inf - inf; capped at float32's
# range as in jax.nn.
MASKED_MAX = float(-0.7 * np.finfo(np.float32).max)


def stats_dtype(dtype) -> np.dtype:
  """Logits, maxima and sums: float32, or float64 for float64 inputs."""
  return np.promote_types(dtype, np.float32)


def scales_queries(dtype) -> bool:
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
  s = jnp.einsum("BKGTH,BSKH->BKGTS", scaled_queries(query_g, scale), key,
                 preferred_element_type=dtype)
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
  return jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(value.dtype).reshape(B, K, N // K, T, S), value,
                    preferred_element_type=stats_dtype(value.dtype))


def unnormalized_softmax(s: jax.Array, keep: jax.Array | None):
  """``(p, m, l)``: p = exp(s - m), row maxima m and row sums l, for the allowed positions.

  Masked scores become MASKED_MAX, so their exp underflows to exactly 0 and no
  -inf enters the arithmetic. A row with nothing allowed (or only -inf scores)
  has m == MASKED_MAX (see :func:`attends`): its p and l are finite garbage
  that the caller multiplies away. Gradients through p stay finite everywhere.
  """
  if keep is not None:
    s = jnp.where(keep, s, MASKED_MAX)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=MASKED_MAX))
  p = jnp.exp(s - m)
  return p, m, jnp.sum(p, axis=-1, keepdims=True)


def attends(m: jax.Array) -> jax.Array:
  """Whether each row attends to anything, from its max of :func:`unnormalized_softmax`."""
  return m > MASKED_MAX


def masked_exp(s: jax.Array, m: jax.Array, keep: jax.Array | None) -> jax.Array:
  """``exp(s - m)`` where allowed, exactly 0 elsewhere; no inf or NaN in value or grad.

  Backward passes use it with m = lse to recompute the normalised
  probabilities. The inner ``where`` keeps masked lanes at exp(0), so a large
  masked score cannot overflow, before the outer ``where`` zeroes them.
  """
  if keep is None:
    return jnp.exp(s - m)
  return jnp.where(keep, jnp.exp(jnp.where(keep, s, m) - m), 0)


def safe_total(l: jax.Array) -> jax.Array:
  """Row sums with empty rows (sum exactly 0) replaced by 1, so dividing leaves zeros.

  Written as an addition with a constant rather than a ``where``: the select's
  transpose made XLA's CPU backward pass about 1.5x slower.
  """
  return l + jax.lax.stop_gradient((l == 0).astype(l.dtype))


def log_sum_exp(m: jax.Array, l: jax.Array) -> jax.Array:
  """The rows' log-sum-exp from max and sum: -inf for rows that attend to nothing."""
  return jnp.where(attends(m) & (l > 0), m + jnp.log(safe_total(l)), -jnp.inf)


def reduce_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Sum ``x`` over the axes where ``shape`` has size 1 (the transpose of broadcasting)."""
  axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def hoist(fn: Callable, *example_args) -> tuple[Callable, list[Any]]:
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

  def converted(*args):
    flat, _ = jax.tree_util.tree_flatten(args[:len(args) - n_consts])
    outs = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, args[len(args) - n_consts:]))(*flat)
    return outs[0] if len(outs) == 1 else tuple(outs)

  return converted, consts


def float_or_none(cotangents, primals):
  """A custom_vjp's cotangents for its inputs: None for integer and boolean ones."""
  return tuple(
      ct if ct is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact) else None
      for ct, x in zip(cotangents, primals))
