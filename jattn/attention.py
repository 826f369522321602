"""``jattn.dot_product_attention``: validate once, normalise, pick an implementation.

Shape legend, used in every docstring, einsum string and shape assertion::

    B  batch size
    T  query length (target)
    S  key/value length (source)
    N  number of query heads
    K  number of key/value heads (N a multiple of K: MHA, GQA, MQA)
    H  head dimension
    G  N // K, query heads per key/value head

Data flows one way: the public call hands every argument to
:func:`jattn._validate.build`, which checks them and raises before anything is traced
or compiled, and returns a :class:`jattn.impl.contract.CallSpec`: every way of masking
(``mask``, ``is_causal``, ``local_window_size``, sequence lengths,
``segment_ids``) as one :class:`jattn.masks.Mask`, ``score_fn`` and
``logits_soft_cap`` as one score function, the chosen implementation and rule.
A jitted core then passes the spec to the implementation, which never
re-validates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack

import chex
import jax

from jattn import _validate, masks
from jattn._validate.keywords import Keywords, Weights, checked
from jattn._validate.options import Options
from jattn.impl import common, contract, select, xla
from jattn.impl.contract import CallSpec
from jattn.impl.select import (  # public names of the table
  AUTO_BLOCKWISE_BYTES,
  BACKENDS,
  BACKWARDS,
  IMPLEMENTATIONS,
  TABLE,
  Choice,
)

__all__ = [
  "dot_product_attention",
  "attention_weights",
  "explain",
  "Choice",
  "TABLE",
  "IMPLEMENTATIONS",
  "BACKENDS",
  "BACKWARDS",
  "AUTO_BLOCKWISE_BYTES",
  "trace_abstract",
  "returned",
]


def dot_product_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: jax.typing.ArrayLike | None = None,
  key_value_seq_lengths: jax.typing.ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  implementation: str | None = None,
  return_residual: bool = False,
  segment_ids: Any = None,
  score_fn: Callable | None = None,
  logits_soft_cap: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  backward: str | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  sinks: jax.typing.ArrayLike | None = None,
  return_max_logit: bool = False,
  options: Options | None = None,
) -> Any:  # the output; (output, lse), (output, max_logit) or (output, lse, max_logit)
  r"""Scaled dot-product attention; a drop-in superset of ``jax.nn.dot_product_attention``.

  Computes ``softmax(score_fn(scale · Q Kᵀ + bias)) V`` per head over the
  positions the masks allow. Every argument jax.nn has keeps its meaning.

  Args:
    query: (B, T, N, H) or unbatched (T, N, H), floating dtype.
    key: (B, S, K, H) or (S, K, H), same dtype as query; N % K == 0.
    value: same shape and dtype as key.
    bias: optional float array added to the scaled logits, broadcastable to
      (B, N, T, S) (lower ranks get leading 1s). Differentiable. An integer bias is
      cast to the logits' dtype first, as jax.nn adds it; a boolean one is refused.
    mask: optional boolean array broadcastable to (B, N, T, S), True meaning
      "may attend", or a :class:`jattn.masks.Mask`.
    scale: logit scale, default ``1 / sqrt(H)`` (1 when H == 0: every logit is 0).
    is_causal: query t attends to keys s <= t (top-left aligned, as jax.nn).
    query_seq_lengths: int array (B,); query rows at or past the length
      attend to nothing and return zeros.
    key_value_seq_lengths: int array (B,); keys at or past it are masked.
    local_window_size: int w or (left, right): t - left <= s <= t + right.
    implementation: None (auto), or a name from :data:`IMPLEMENTATIONS`, the selection
      table's rows (``"xla"`` materialises the scores; ``"blockwise"`` runs an online
      softmax over tiles in O(B·T·N·H) memory; the fused kernels of each backend;
      docs/implementations.md lists them all, generated from the table). None picks, on
      the running backend, its first fused kernel in table order that expresses the call
      exactly and is not an opt-in, when no ``backward`` rule is named; otherwise
      ``"blockwise"`` when ``block_q``/``block_kv`` are given, ``"xla"`` when
      ``backward="autodiff"``, and otherwise ``"blockwise"`` once the
      (B, N, T, S) float32 scores would take ``AUTO_BLOCKWISE_BYTES[backend]``
      or more (8 MiB on CPU, 1 GiB on GPU and TPU), ``"xla"`` below that.
      :func:`jattn.explain` shows the choice and why. An implementation that
      cannot express the call raises, naming the feature.
    return_residual: also return the rows' log-sum-exp, shape (B, T, N) or
      (T, N), in the query's dtype; -inf for rows that attend to nothing.
    segment_ids: packed-sequence document ids: an int array (B, T) (or (T,)
      unbatched) when T == S, or a pair ``(q_segment_ids, kv_segment_ids)``;
      positions attend only within their segment.
    score_fn: ``fn(score, batch, head, q_idx, kv_idx) -> score`` applied to
      the scaled, biased logits (see :mod:`jattn.scores`). It must compute
      from its (possibly traced) index arguments, which blockwise gives per
      tile: checked on two small grids. A floating result in another dtype is
      cast back to float32 (float64 for float64 inputs).
    logits_soft_cap: if set, ``cap · tanh(s / cap)`` after ``score_fn``,
      before masking.
    dropout_rate: dropout on the attention weights, in [0, 1), with inverted
      scaling; the kept set is a pure function of (rng, b, n, t, s).
    dropout_rng: a ``jax.random.key`` (or ``PRNGKey``); needed when
      ``dropout_rate > 0``.
    broadcast_dropout: draw one dropout pattern of shape (T, S) and share it
      across every batch row and head (Flax's ``broadcast_dropout=True``);
      by default each (b, n) draws its own.
    backward: how gradients are formed: ``"autodiff"`` (JAX differentiates the
      forward pass) or ``"custom_vjp"`` (jattn's explicit rule, which keeps
      only the inputs and the log-sum-exp and recomputes the probabilities).
      None picks the implementation's default (``"autodiff"`` for ``"xla"``,
      ``"custom_vjp"``, its only rule, for ``"blockwise"``); the fused kernels have
      their own backward and take None.
    block_q, block_kv: tile sizes of the tiled implementations, each by its own rule
      (``"blockwise"`` takes any, default per backend,
      :data:`jattn.impl.blockwise.DEFAULT_BLOCKS`; any T and S work).
    sinks: optional per-head logits, a float array (N,), differentiable
      (attention sinks, as in gpt-oss and StreamingLLM): each row's softmax
      gets one more logit ``sinks[n]`` with no value, so
      ``out = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sinks[n]))`` and the
      log-sum-exp includes it. A row the mask empties returns zeros and its
      log-sum-exp is the sink.
    return_max_logit: also return each query row's largest logit, the one softmax sees
      after the scale, bias, score function and soft cap, over the keys the mask allows
      (sinks and dropout aside), shape (B, T, N) or (T, N), float32; -inf for a row that
      sees no key. A statistic, for QK-clip (:func:`jattn.qk_clip_scales`): no gradient
      flows through it. An implementation that does not keep its running max to return
      refuses it (jax.nn's cuDNN call, splash): None then picks one that does.
    options: a :class:`jattn.Options` holding ``implementation``, ``backward``,
      ``block_q`` and ``block_kv`` as one value (give each in one place only).

  Returns:
    The output, shaped and typed like ``query``; with ``return_residual``, the
    pair ``(output, lse)``; with ``return_max_logit``, ``(output, max_logit)``, or
    ``(output, lse, max_logit)`` with both.

  Unlike jax.nn, a query row that may attend to nothing returns zeros (jax.nn
  returns the mean of the values) and the log-sum-exp is differentiable.
  """
  keywords = Keywords(
    scale=scale,
    is_causal=is_causal,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    local_window_size=local_window_size,
    implementation=implementation,
    return_residual=return_residual,
    segment_ids=segment_ids,
    score_fn=score_fn,
    logits_soft_cap=logits_soft_cap,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    broadcast_dropout=broadcast_dropout,
    backward=backward,
    block_q=block_q,
    block_kv=block_kv,
    sinks=sinks,
    return_max_logit=return_max_logit,
    options=options,
  )
  q, k, v, spec = _validate.build(query, key, value, bias, mask, keywords)
  return returned(*attend(q, k, v, spec))


def returned(out: jax.Array, lse: jax.Array | None, max_logit: jax.Array | None) -> Any:
  """A call's results as it returns them: the output, then the log-sum-exp and the max
  logit where they were asked for (None where not)."""
  extra = tuple(x for x in (lse, max_logit) if x is not None)
  return (out, *extra) if extra else out


def attention_weights(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  **keywords: Unpack[Weights],
) -> jax.Array:
  """The attention probabilities ``dot_product_attention`` applies, for inspection.

  Takes the arguments of :func:`dot_product_attention` that shape the
  probabilities (no value, no dropout: the :class:`~jattn._validate.keywords.Scoring` and
  :class:`~jattn._validate.keywords.Masking` keywords) with the same meanings, and returns the
  materialised softmax, shape (B, N, T, S) (or (N, T, S) unbatched), in the
  query's dtype. Rows that may attend to nothing are zeros; with ``sinks`` the
  sink's share is left out, so rows sum to less than 1. It materialises
  the full score matrix: use it to look at weights, not to compute attention.
  Differentiable.

  Example::

    >>> import jax.numpy as jnp, jattn
    >>> q = k = jnp.ones((1, 3, 1, 2))
    >>> jattn.attention_weights(q, k, is_causal=True)[0, 0]
    Array([[1.        , 0.        , 0.        ],
           [0.5       , 0.5       , 0.        ],
           [0.33333334, 0.33333334, 0.33333334]], dtype=float32)
  """
  xla = dict(checked("attention_weights", keywords, Weights), implementation="xla")
  q, k, _, spec = _validate.build(query, key, None, bias, mask, xla)
  return _weights(q, k, spec)


def explain(
  query: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  key: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  value: jax.typing.ArrayLike | jax.ShapeDtypeStruct,
  bias: jax.typing.ArrayLike | jax.ShapeDtypeStruct | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  *,
  backend: str | None = None,
  **keywords: Unpack[Keywords],
) -> Choice:
  """Which implementation :func:`dot_product_attention` runs for these arguments, and why.

  Takes the arguments of :func:`dot_product_attention` (for every array argument, an
  array or a ``jax.ShapeDtypeStruct``: query, key, value, bias, a mask array, segment ids
  and their pairs, lengths, sinks, dropout_rng) and checks them the same way, so a bad
  call raises the same error. ``backend`` (``"cpu"``, ``"gpu"`` or ``"tpu"``;
  default: JAX's default backend) names where the call would run, so a laptop
  shows what a TPU pod would run. Nothing is computed.

  Returns a :class:`jattn.Choice`: ``.implementation``,
  ``.backward`` (the rule; None for the fused kernels' own), ``.reason`` and
  ``.rejected`` (every other implementation, and why not).

  Example::

    >>> import jax, jax.numpy as jnp, jattn
    >>> q = jax.ShapeDtypeStruct((8, 4096, 16, 128), jnp.bfloat16)
    >>> jattn.explain(q, q, q, is_causal=True, backend="tpu").implementation
    'splash'
    >>> jattn.explain(q, q, q, is_causal=True, backend="cpu").implementation
    'blockwise'
  """
  select.check_backend(backend)
  kwargs = checked("explain", keywords, Keywords)
  choices: list[Choice] = []

  def trace(q: Any, k: Any, v: Any, b: Any, m: Any, kw: dict[str, Any]) -> None:
    choices.append(_validate.build(q, k, v, b, m, kw, backend=backend, explain=True))

  trace_abstract(trace, query, key, value, bias, mask, kwargs)
  return choices[0]


def trace_abstract(fn: Callable[..., Any], *args: Any) -> None:
  """Trace ``fn(*args)`` under ``jax.eval_shape``, computing nothing: every
  ``jax.ShapeDtypeStruct``, wherever it sits in ``args`` (query, key, value, a mask array,
  both ids of a segment pair, lengths, sinks, dropout's key), becomes an abstract array;
  everything else (arrays, :class:`jattn.masks.Mask` objects, score functions, settings) is
  passed as given. The explains of :func:`explain` and :func:`jattn.parallel.explain`."""
  is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)
  is_leaf = lambda x: is_shape(x) or isinstance(x, masks.Mask)
  leaves, tree = jax.tree_util.tree_flatten(args, is_leaf=is_leaf)
  shaped = [i for i, x in enumerate(leaves) if is_shape(x)]

  def run(abstract: list[jax.Array]) -> tuple[()]:
    filled = list(leaves)
    for i, x in zip(shaped, abstract):
      filled[i] = x
    fn(*jax.tree_util.tree_unflatten(tree, filled))
    return ()

  jax.eval_shape(run, [leaves[i] for i in shaped])


@jax.jit
def _weights(query: jax.Array, key: jax.Array, spec: CallSpec) -> jax.Array:
  if spec.unbatched:
    query, key = query[None], key[None]
  p = xla.weights(query, key, contract.rank4(spec))
  return p[0] if spec.unbatched else p


@jax.jit
def attend(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """The jitted core: one compiled program per spec's settings and the arrays' shapes;
  ``(out, lse or None, max_logit or None)`` as the spec asks."""
  if spec.unbatched:
    query, key, value = query[None], key[None], value[None]
  results = _run(query, key, value, contract.rank4(spec))
  if spec.unbatched:
    return jax.tree.map(lambda x: x[0], results)  # type: ignore[return-value]
  return results


def _run(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """One implementation on rank-4 inputs: ``(out, lse or None, max_logit or None)`` as
  returned to the caller."""
  dims = chex.Dimensions(B=spec.B, T=spec.T, S=spec.S, N=spec.N, K=spec.K, H=spec.H, V=spec.Hv)
  chex.assert_shape(query, dims["BTNH"])
  chex.assert_shape(key, dims["BSKH"])
  chex.assert_shape(value, dims["BSKV"])
  row = TABLE[spec.implementation]
  out, lse, max_logit = row.run(query, key, value, spec)
  chex.assert_shape(lse, dims["BTN"])
  if spec.return_max_logit:
    chex.assert_shape(max_logit, dims["BTN"])
  return common.finish(out, lse, max_logit, spec, query.dtype, row.takes_sinks)
