"""Ring attention's shard pairs through the selection table's fused kernel: flex on a GPU.

A pair's call is the one-device call of this device's query shard against the key/value shard
it holds at a ring step: its mask and score function seen at the pair's global positions
(:func:`jattn.masks.reindex`, :func:`jattn.scores.reindex`), its bias the shard's columns,
returning its log-sum-exp. The selection table chooses what runs it
(:func:`jattn._validate.for_shard`), as it chooses for a part of the all-gather and Ulysses
strategies; the ring runs a pair here when the table picks flex (on a GPU, or interpreted).

A pair's backward is its kernel's own rule, given the ring's merged output ``O`` and
log-sum-exp ``L``: with ``w = exp(lse_p - L)`` the pair's output receives ``w · dO`` and its
log-sum-exp ``w · (dO · (O_p - O) + dL)`` (:func:`grads`, which splash's pairs share), so the
pair's forward pass runs again in the backward one.

The score function's arrays enter the ring's custom_vjp as its pytree leaves, rebuilt here on
each pair, so their gradients come from the kernel's rule; a score function that closes over
arrays it does not hold as leaves keeps the ring on blockwise pairs (:func:`leaves`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jattn import _validate, masks, scores, testing
from jattn.impl import common, select
from jattn.impl.contract import CallSpec
from jattn.impl.select import Choice

__all__ = ["KERNELS", "wanted", "leaves", "pair_spec", "choose", "attend", "grads"]

KERNELS = select.RING_PAIRS
"""What the ring runs through this module: the table's rows whose own rule takes an lse
cotangent (``ring_pairs``)."""


def leaves(score_fn: Any, example: Any) -> tuple[Any, list[Any]] | None:
  """``(treedef, leaves)`` of the score function when its leaves hold every traced float
  array it reads (checked by converting it at ``example``, its arguments); None when it
  closes over another (a learned table captured by a closure, whose gradient the kernel's
  rule could not return)."""
  if score_fn is None:
    return None, []
  found, treedef = jax.tree.flatten(score_fn)
  _, consts = common.hoist(score_fn, *example)
  held = {id(x) for x in found}
  for c in consts:
    traced = isinstance(c, jax.core.Tracer)
    if traced and id(c) not in held and jnp.issubdtype(jnp.result_type(c), jnp.inexact):
      return None
  return treedef, found


def pair_spec(
  *,
  shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
  maps: tuple[Any, Any, Any, Any],
  mask: masks.Mask | None,
  segments: masks.Mask | None,
  score_fn: Any,
  bias: jax.Array | None,
  scale: float,
  dropout: tuple[float, bool, Any],
  max_logit: bool = False,
) -> CallSpec:
  """One pair's call before its implementation is chosen: the one-device call of a query
  shard (``shapes[0]``) against a key/value shard, at global positions ``maps`` (batch,
  head, q, kv; None: the identity)."""
  (B, T, N, H), (_, S, K, _), (*_, Hv) = shapes
  named = dict(zip(("batch", "head", "q", "kv"), maps))
  parts = [] if mask is None else [masks.reindex(mask, **named)]
  if segments is not None:
    parts.append(segments)
  rate, broadcast, rng = dropout
  return CallSpec(
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    unbatched=False,
    bias=bias,
    mask=masks.all_of(*parts),
    score_fn=None if score_fn is None else scores.reindex(score_fn, **named),
    dropout_rng=rng if rate else None,
    scale=scale,
    dropout_rate=rate,
    broadcast_dropout=broadcast,
    implementation="",
    backward=None,
    block_q=None,
    block_kv=None,
    return_residual=True,
    return_max_logit=max_logit,
    interpret=testing.interpreting(),
    positions=maps if rate else None,
  )


def choose(spec: CallSpec, dtype: Any, implementation: str | None) -> tuple[CallSpec, Choice]:
  """The pair's spec completed for the table's choice, and the choice (raises where the
  caller named an implementation the table refuses for the pair)."""
  return _validate.for_shard(
    spec, dtype=dtype, implementation=implementation, backward=None, blocks=(None, None)
  )


def attend(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The pair's ``(out, lse, max logit)`` in float32/64 (lse -inf on rows with nothing to
  attend to; the max logit None unless ``spec.return_max_logit``)."""
  out, lse, top = select.TABLE[spec.implementation].run(query, key, value, spec)
  dtype = common.stats_dtype(query.dtype)
  return out.astype(dtype), lse.astype(dtype), top


def grads(
  pair: Callable[..., tuple[jax.Array, jax.Array]],
  primals: tuple[Any, ...],
  out: jax.Array,
  lse: jax.Array,
  d_out: jax.Array,
  d_lse: jax.Array,
) -> tuple[Any, ...]:
  """The cotangents of ``pair(*primals)`` (a pair's ``(out, lse)``) given the ring's merged
  ``out`` and ``lse`` and their cotangents (see the module docstring)."""
  (o_p, lse_p), vjp = jax.vjp(pair, *primals)
  dtype = o_p.dtype
  live = jnp.isfinite(lse_p)
  w = jnp.where(live, jnp.exp(jnp.where(live, lse_p, 0) - jnp.where(jnp.isfinite(lse), lse, 0)), 0)
  d_out = d_out.astype(dtype)
  d_o_p = w[..., None] * d_out
  d_lse_p = w * (jnp.sum(d_out * (o_p - out.astype(dtype)), axis=-1) + d_lse.astype(dtype))
  return vjp((d_o_p, d_lse_p.astype(lse_p.dtype)))


def wanted(implementation: str | None, backend: str) -> bool:
  """Whether the ring should ask the table for a fused kernel per pair: the caller named
  one, or the call runs on a GPU (one platform)."""
  if implementation in KERNELS:
    return True
  return implementation is None and backend == "gpu" and not testing.portable()
