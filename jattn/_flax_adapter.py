"""The ``attention_fn=`` adapter for Flax's own attention modules, on top of
:func:`jattn.dot_product_attention`.

:mod:`jattn.nnx` and :mod:`jattn.linen` each make one with :func:`make_attention_fn`,
differing only in where ``sow_weights`` stores the weights. Layout [batch..., T, N, H].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, attention

_Module = TypeVar("_Module")  # the Flax module kind (NNX or Linen) that ``sow`` stores into


def _precision_context(
  precision: jax.lax.PrecisionLike,
) -> contextlib.AbstractContextManager[object]:
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, (tuple, list)):
    if len(set(precision)) != 1:
      raise ValueError(
        f"precision as a pair must name one precision for both operands, got {precision!r}"
      )
    # One of a pair: a DotAlgorithm (a tuple too) has entries that differ, raised above.
    precision = precision[0]  # type: ignore[assignment]
  if isinstance(precision, jax.lax.Precision):
    precision = {
      jax.lax.Precision.DEFAULT: "default",
      jax.lax.Precision.HIGH: "high",
      jax.lax.Precision.HIGHEST: "highest",
    }[precision]
  if not isinstance(precision, str):
    raise TypeError(f"precision must be None, a jax.lax.Precision or its name, got {precision!r}")
  return jax.default_matmul_precision(precision)


def _flatten_batch(
  x: jax.typing.ArrayLike | None, batch_dims: tuple[int, ...], rank: int
) -> jax.Array | np.ndarray | None:
  """Broadcast-compatible ``x`` (mask/bias over [batch..., N, T, S]) as rank-4 (B, N, T, S)."""
  if x is None:
    return None
  x = cast("jax.Array | np.ndarray", x if hasattr(x, "shape") else np.asarray(x))
  if x.ndim > rank:
    raise ValueError(
      f"mask and bias must have at most {rank} dimensions ([batch..., N, T, S]), "
      f"got shape {x.shape}"
    )
  x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
  lead = x.shape[:-3]
  if len(batch_dims) <= 1:
    return x
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[-3:])
  x = jnp.broadcast_to(x, batch_dims + x.shape[-3:])
  return x.reshape((math.prod(batch_dims),) + x.shape[-3:])


def make_attention_fn(
  sow: Callable[[_Module, jax.Array], None], collection: str, module_name: str
) -> Callable[..., jax.Array]:
  """Flax's ``attention_fn`` contract on top of :func:`jattn.dot_product_attention`.

  ``sow(module, weights)`` stores the weights when Flax passes ``module``;
  ``collection`` names where, for the docstring. Layout [batch..., T, N, H];
  extra batch dimensions are flattened.
  """

  def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: jax.typing.DTypeLike | None = None,
    precision: jax.lax.PrecisionLike = None,
    module: _Module | None = None,
    is_causal: bool = False,
    *,
    implementation: str | None = None,
    backward: str | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    logits_soft_cap: float | None = None,
    score_fn: Callable | None = None,
    sinks: jax.typing.ArrayLike | None = None,
  ) -> jax.Array:
    arrays = [query, key, value]
    for name, x in zip(("query", "key", "value"), arrays):
      if not hasattr(x, "shape") or x.ndim < 3:
        raise ValueError(
          f"{name} must have shape [batch..., length, heads, head_dim], got "
          f"{getattr(x, 'shape', type(x).__name__)}"
        )
    if dtype is None:
      dtype = jnp.result_type(*arrays)
    query, key, value = (jnp.asarray(x, dtype) for x in arrays)
    if not query.ndim == key.ndim == value.ndim:
      raise ValueError(
        f"query, key and value must have the same rank, got {query.shape}, "
        f"{key.shape} and {value.shape}"
      )
    batch_dims = query.shape[:-3]
    rank = query.ndim
    if len(batch_dims) > 1:
      flat = lambda x: x.reshape((math.prod(batch_dims),) + x.shape[-3:])
      query, key, value = flat(query), flat(key), flat(value)
    mask = _flatten_batch(mask, batch_dims, rank)
    bias = _flatten_batch(bias, batch_dims, rank)
    if mask is not None and mask.dtype != np.bool_:
      mask = mask.astype(bool)  # Flax accepts 0/1 masks of any dtype
    rate = _checks.real("dropout_rate", dropout_rate)
    if deterministic or rate == 0.0:
      rate, dropout_rng = 0.0, None
    elif dropout_rng is None:
      raise ValueError(f"dropout_rate={rate} with deterministic=False needs dropout_rng")
    kwargs: dict[str, Any] = dict(
      is_causal=bool(is_causal), logits_soft_cap=logits_soft_cap, score_fn=score_fn, sinks=sinks
    )
    with _precision_context(precision):
      if module is not None:
        sow(
          module,
          _unflatten(attention.attention_weights(query, key, bias, mask, **kwargs), batch_dims),
        )
        implementation = "xla" if implementation is None else implementation
      out = attention.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        dropout_rate=rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=bool(broadcast_dropout),
        implementation=implementation,
        backward=backward,
        block_q=block_q,
        block_kv=block_kv,
        **kwargs,
      )
    return _unflatten(out, batch_dims)

  attention_fn.__doc__ = _adapter_doc(collection)
  attention_fn.__module__ = module_name
  attention_fn.__qualname__ = "attention_fn"
  return attention_fn


def _unflatten(x: jax.Array, batch_dims: tuple[int, ...]) -> jax.Array:
  if len(batch_dims) <= 1:
    return x
  return x.reshape(batch_dims + x.shape[1:])


def _adapter_doc(collection: str) -> str:
  return f"""Drop-in ``attention_fn=`` for Flax's attention modules, computed by jattn.

  Accepts exactly the keyword arguments Flax passes (``mask``,
  ``dropout_rng``, ``dropout_rate``, ``broadcast_dropout``, ``deterministic``,
  ``dtype``, ``precision``, ``module``, ``is_causal``) with Flax's meanings,
  plus jattn's own settings, bound with ``functools.partial``:
  ``implementation``, ``backward``, ``block_q``, ``block_kv``,
  ``logits_soft_cap``, ``score_fn``, ``sinks`` (per-head sink logits (N,)).

  Differences from Flax's default: a query row whose mask allows nothing
  returns zeros (Flax returns the mean of the values); dropout draws its
  pattern with :mod:`jattn.dropout` (same rate, inverted scaling and
  ``broadcast_dropout`` sharing, different random bits); ``precision``
  applies as ``jax.default_matmul_precision``. With ``module`` (Flax's
  ``sow_weights=True``) the weights are sown into ``{collection}`` as
  ``attention_weights`` and the materialised implementation computes the
  output, unless ``implementation`` says otherwise.

  Args:
    query: [batch..., T, N, H].
    key, value: [batch..., S, K, H]; N a multiple of K.
    bias, mask: broadcastable to [batch..., N, T, S]; mask True = attend.

  Returns:
    [batch..., T, N, H] in the promoted dtype.
  """
