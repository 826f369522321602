"""Materialised attention: every score of the (B, N, T, S) grid at once.

The reference implementation, and the fastest for short sequences. Memory is
O(B·N·T·S). Two backward rules:

* ``"autodiff"``: JAX differentiates the forward computation.
* ``"custom_vjp"``: the explicit rule. The forward pass keeps only its inputs
  and each row's max m and sum l (two (B, N, T) arrays, kept apart rather than
  as the log-sum-exp m + log l, which loses log l when |m| is huge); the
  backward pass recomputes the probabilities A = exp(s − m) / l from them and
  forms

      dV = Aᵀ dY,   dA = dY Vᵀ,   dS = A ⊙ (dA − rowsum(A ⊙ dA) + dlse),
      dQ = scale · dS K,   dK = scale · dSᵀ Q,   dbias = dS summed to bias's shape,

  with dropout's kept weights and inverted scale applied to A in ``Aᵀ dY`` and
  to dA, score functions differentiated through their own VJP (so learned
  tables get gradients), and GQA gradients summed over each group by the
  grouped einsums.

Arguments arrive normalised and validated, as a :class:`jattn.impl.contract.CallSpec`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import dropout as _dropout
from jattn.impl import common, contract, orders
from jattn.impl.contract import CallSpec
from jattn.masks import index_grid

__all__ = ["IMPLEMENTATION", "BACKWARDS", "attention", "weights"]

BACKWARDS = ("autodiff", "custom_vjp")

_Static = tuple[float, float, np.dtype]
"""(scale, dropout_rate, out's dtype): the custom_vjp's non-differentiable settings."""

_Residuals = tuple[
  jax.Array,  # query
  jax.Array,  # key
  jax.Array,  # value
  jax.Array | None,  # bias
  jax.Array | None,  # keep
  jax.Array | None,  # drop
  tuple[Any, ...],  # the score function's constants
  jax.Array,  # m
  jax.Array,  # l
]


def attention(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Returns ``(out (B, T, N, H) in query's dtype, lse (B, T, N) in float32/64, max logit
  (B, T, N) or None)``.

  Reads the bias (rank 4), mask, score function, scale, dropout and backward rule from
  ``spec``.
  """
  B, T, N, _ = query.shape
  S = key.shape[1]
  bias, score_fn, scale, dropout_rate = spec.bias, spec.score_fn, spec.scale, spec.dropout_rate
  grid = index_grid(B, N, T, S)
  keep = None if spec.mask is None else spec.mask.on_grid(grid)
  drop = None
  if dropout_rate:
    idx = common.at_positions(grid, spec.positions)
    idx = _dropout.shared_indices(*idx) if spec.broadcast_dropout else idx
    drop = _dropout.keep_mask(spec.dropout_rng, dropout_rate, *idx)

  # With sinks to add (jattn.attention), out stays in the statistics dtype until then.
  out_dtype = query.dtype if spec.sinks is None else common.stats_dtype(query.dtype)
  wide = spec.compute_dtype or query.dtype
  if wide != query.dtype:  # a CPU: narrow inputs computed in float32, rounded once at the end
    query, key, value = (x.astype(wide) for x in (query, key, value))
  static = (scale, dropout_rate, out_dtype)
  if spec.backward == "autodiff":
    modify: Callable | None = None if score_fn is None else (lambda s: score_fn(s, *grid))
    out, lse, top = _forward(query, key, value, bias, keep, drop, modify, (), static)[0]
    return out, lse, top if spec.return_max_logit else None

  assert spec.backward == "custom_vjp", spec.backward
  modify = None
  consts: list = []
  if score_fn is not None:
    example = jax.ShapeDtypeStruct((B, N, T, S), common.stats_dtype(query.dtype))
    modify, consts = common.hoist(lambda s: score_fn(s, *index_grid(B, N, T, S)), example)
  out, lse, top = _attention_vjp(static, modify, query, key, value, bias, keep, drop, tuple(consts))
  return out, lse, top if spec.return_max_logit else None


def weights(query: jax.Array, key: jax.Array, spec: CallSpec) -> jax.Array:
  """The normalised probabilities (B, N, T, S) in query's dtype; zero rows where nothing attends."""
  B, T, N, _ = query.shape
  S = key.shape[1]
  grid = index_grid(B, N, T, S)
  keep = None if spec.mask is None else spec.mask.on_grid(grid)
  s = common.logits(common.group_heads(query, key.shape[2]), key, spec.bias, spec.scale)
  if spec.score_fn is not None:
    s = spec.score_fn(s, *grid)
  p, m, l = common.softmax(s, keep)
  if spec.sinks is not None:  # each row's share of the keys; the sink's share is left out
    lse = common.log_sum_exp(m, l)
    p = p * jax.nn.sigmoid(lse - spec.sinks.astype(lse.dtype)[None, :, None, None])
  return p.astype(query.dtype)


def _forward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  keep: jax.Array | None,
  drop: jax.Array | None,
  modify: Callable[..., jax.Array] | None,
  consts: Sequence[Any],
  static: _Static,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """The forward pass shared by both rules: ``(out, lse, max logit), (m, l)``, the rows' max
  and sum kept (B, N, T, 1) for the custom_vjp; ``static`` is (scale, dropout_rate, out's
  dtype)."""
  scale, dropout_rate, out_dtype = static
  s = common.logits(common.group_heads(query, key.shape[2]), key, bias, scale)
  if modify is not None:
    s = modify(s, *consts)
  # The normalised probabilities, with jax.nn.softmax's derivative (see common.softmax), and
  # rounded to the values' dtype only after normalising, as jax.nn does.
  p, m, l = common.softmax(s, keep)
  if drop is not None:
    p = jnp.where(drop, p / (1.0 - dropout_rate), 0)
  out = common.probs_times_values(p, value)
  out = common.ungroup_heads(out).astype(out_dtype)
  rows = lambda x: x[..., 0].transpose(0, 2, 1)  # (B, N, T, 1) -> (B, T, N)
  return (out, rows(common.log_sum_exp(m, l)), rows(common.max_logit(m, l))), (m, l)


@functools.partial(
  orders.reverse_only,
  nondiff_argnums=(0, 1),
  who="implementation='xla'",
  rule="backward='custom_vjp' (jattn's explicit rule)",
)
def _attention_vjp(
  static: _Static,
  modify: Callable[..., jax.Array] | None,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  keep: jax.Array | None,
  drop: jax.Array | None,
  consts: tuple[Any, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  return _forward(query, key, value, bias, keep, drop, modify, consts, static)[0]


def _attention_fwd(
  static: _Static,
  modify: Callable[..., jax.Array] | None,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None,
  keep: jax.Array | None,
  drop: jax.Array | None,
  consts: tuple[Any, ...],
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], _Residuals]:
  results, (m, l) = _forward(query, key, value, bias, keep, drop, modify, consts, static)
  # The rows' max and sum, not their log-sum-exp m + log l: see common.normalized_exp.
  return results, (query, key, value, bias, keep, drop, consts, m, l)


def _attention_bwd(
  static: _Static,
  modify: Callable[..., jax.Array] | None,
  residuals: _Residuals,
  cotangents: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[
  jax.Array, jax.Array, jax.Array, jax.Array | None, None, None, tuple[jax.Array | None, ...]
]:
  scale, dropout_rate, _ = static
  query, key, value, bias, keep, drop, consts, m, l = residuals
  d_out, d_lse, _ = cotangents  # the max logit is a statistic: nothing flows back through it
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  G = N // K
  dtype = common.stats_dtype(query.dtype)

  query_g = common.group_heads(query, K)
  s = common.logits(query_g, key, bias, scale)
  if modify is not None:
    s, modify_vjp = jax.vjp(modify, s, *consts)
  p = common.normalized_exp(s, m, l, keep)  # A, the normalised probabilities
  p_used = p if drop is None else jnp.where(drop, p / (1.0 - dropout_rate), 0)

  d_out = common.group_heads(d_out.astype(dtype), K)
  d_value = jnp.einsum("BKGTS,BKGTH->BSKH", p_used.reshape(B, K, G, T, S), d_out)
  d_p_used = jnp.einsum("BKGTH,BSKH->BKGTS", d_out, value, preferred_element_type=dtype).reshape(
    B, N, T, S
  )
  d_p = d_p_used if drop is None else jnp.where(drop, d_p_used / (1.0 - dropout_rate), 0)
  # rowsum(A ⊙ dA): computed from the materialised grid rather than from
  # rowsum(out ⊙ dY), which would inherit the output's rounding.
  row_dot = jnp.sum(p * d_p, axis=-1, keepdims=True)
  d_s = p * (d_p - row_dot + d_lse.astype(dtype).transpose(0, 2, 1)[..., None])

  d_consts: Sequence[jax.Array] = ()
  if modify is not None:
    d_s, *d_consts = modify_vjp(d_s)
  d_bias = None
  if bias is not None:
    d_bias = common.reduce_to_shape(d_s, bias.shape).astype(bias.dtype)
  d_s = d_s.reshape(B, K, G, T, S) * jnp.asarray(scale, dtype)
  d_query = common.ungroup_heads(jnp.einsum("BKGTS,BSKH->BKGTH", d_s, key))
  d_key = jnp.einsum("BKGTS,BKGTH->BSKH", d_s, query_g)
  return (
    d_query.astype(query.dtype),
    d_key.astype(key.dtype),
    d_value.astype(value.dtype),
    d_bias,
    None,
    None,
    common.float_or_none(d_consts, consts),
  )


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


IMPLEMENTATION = contract.Implementation(
  name="xla",
  runs_on=contract.BACKENDS,
  backwards=BACKWARDS,
  masks="every mask",
  run=attention,
  positions=None,
)
