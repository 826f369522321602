"""The ``attention_fn=`` adapter for Flax's own attention modules, on top of
:func:`jattn.dot_product_attention`.

:mod:`jattn.nnx` and :mod:`jattn.linen` each make one with :func:`make_attention_fn`,
differing in where ``sow_weights`` stores the weights and in which of Flax's functions runs
what jattn's kernels do not take (complex dtypes, Linen's einsum overrides). Also the
helpers both modules use to read Flax's masks and batch dimensions. Layout
[batch..., T, N, H].
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar, Unpack, cast

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, attention
from jattn._validate.keywords import Adapted, Weights, checked, names, options_of

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


def flatten_batch(
  x: jax.typing.ArrayLike | None, batch_dims: tuple[int, ...], trailing: int
) -> jax.Array | np.ndarray | None:
  """``x`` broadcastable to [batch_dims..., ``trailing`` dimensions] (a mask or bias over
  [batch..., N, T, S]) with its batch dimensions as one, of size 1 or
  ``math.prod(batch_dims)``: shape (1 or B, ...trailing)."""
  if x is None:
    return None
  x = cast("jax.Array | np.ndarray", x if hasattr(x, "shape") else np.asarray(x))
  rank = len(batch_dims) + trailing
  if x.ndim > rank:
    raise ValueError(
      f"mask and bias must have at most {rank} dimensions ([batch..., N, T, S]), "
      f"got shape {x.shape}"
    )
  x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
  lead, rest = x.shape[: len(batch_dims)], x.shape[len(batch_dims) :]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + rest)
  if lead != batch_dims:
    x = jnp.broadcast_to(x, batch_dims + rest)
  return x.reshape((math.prod(batch_dims),) + rest)


def as_bool_mask(mask: Any) -> Any:
  """A mask array of any dtype as Flax reads it (non-zero attends), boolean; anything
  else (None, a :class:`jattn.masks.Mask`) as it is."""
  if mask is None or not hasattr(mask, "dtype") and not isinstance(mask, (list, tuple)):
    return mask
  if not hasattr(mask, "dtype"):
    mask = np.asarray(mask)
  return mask if mask.dtype == np.bool_ else mask.astype(bool)


def check_flax_shapes(query: Any, key: Any, value: Any) -> None:
  """The shape rules of Flax's ``dot_product_attention`` on [batch..., T|S, N|K, H] heads,
  raised with Flax's words in the message (the core call checks the rest)."""
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(
      f"query, key and value must have the same rank (q, k, v must have same rank), got "
      f"{query.shape}, {key.shape} and {value.shape}"
    )
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(
      f"query, key and value must have the same batch dimensions (q, k, v batch dims must "
      f"match), got {query.shape}, {key.shape} and {value.shape}"
    )
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(
      f"key and value must have the same length (k, v lengths must match), got key "
      f"{key.shape} and value {value.shape}"
    )
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
      f"query and key must have the same head dimension (q, k depths must match), got "
      f"query {query.shape} and key {key.shape}"
    )


def repeat_kv_heads(query: jax.Array, x: jax.Array) -> jax.Array:
  """Key or value heads [..., S, K, H] repeated to the query's N heads (GQA)."""
  n, k = query.shape[-2], x.shape[-2]
  return x if n == k else jnp.repeat(x, n // k, axis=-2)


def causal_bool(q_len: int, kv_len: int) -> np.ndarray:
  """(T, S) bool: query t sees keys s <= t, as Flax's ``is_causal`` (top-left aligned)."""
  return np.tril(np.ones((q_len, kv_len), bool))


def with_causal(mask: Any, q_len: int, kv_len: int) -> Any:
  """``mask`` (None or an array, non-zero attends) and the causal pattern, as one bool mask."""
  causal = causal_bool(q_len, kv_len)
  return causal if mask is None else jnp.logical_and(as_bool_mask(mask), causal)


def make_attention_fn(
  sow: Callable[[_Module, jax.Array], None],
  collection: str,
  module_name: str,
  flax_fn: Callable[..., jax.Array],
  *,
  linen: bool,
) -> Callable[..., jax.Array]:
  """Flax's ``attention_fn`` contract on top of :func:`jattn.dot_product_attention`.

  ``sow(module, weights)`` stores the weights when Flax passes ``module``;
  ``collection`` names where, for the docstring. Layout [batch..., T, N, H];
  extra batch dimensions are flattened. ``flax_fn`` is Flax's own
  ``dot_product_attention`` of that front end (``linen``: Linen's, else NNX's), which
  computes what jattn's kernels do not take: complex dtypes, and Linen's einsum overrides.
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
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., jax.Array] | None = None,
    qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
    attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
    **keywords: Unpack[Adapted],
  ) -> jax.Array:
    settings = checked("attention_fn", keywords, Adapted)
    einsums = (qk_attn_weights_einsum, attn_weights_value_einsum)
    _check_arguments((query, key, value), einsums, precision, einsum_dot_general)
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    check_flax_shapes(query, key, value)
    flax_kw: dict[str, Any] = dict(
      bias=bias,
      broadcast_dropout=broadcast_dropout,
      dropout_rng=dropout_rng,
      dropout_rate=dropout_rate,
      deterministic=deterministic,
      dtype=dtype,
      precision=precision,
      module=module,
    )
    overrides = einsum_dot_general is not None or einsums[0] is not None
    if jnp.issubdtype(dtype, jnp.complexfloating) or overrides:
      for name, setting in settings.items():
        if setting is not None:
          why = "einsum overrides" if overrides else f"{np.dtype(dtype).name} inputs"
          raise ValueError(
            f"{name} is a setting of jattn's kernels, which take no {why}: those run Flax's "
            "own materialised dot_product_attention"
          )
      if not linen:
        if overrides:
          raise ValueError(
            "einsum_dot_general, qk_attn_weights_einsum and attn_weights_value_einsum are "
            "arguments of Flax Linen's dot_product_attention: use jattn.linen.attention_fn"
          )
        return flax_fn(query, key, value, mask=mask, is_causal=is_causal, **flax_kw)
      if is_causal:
        mask = with_causal(mask, query.shape[-3], key.shape[-3])
      key, value = repeat_kv_heads(query, key), repeat_kv_heads(query, value)
      flax_kw.update(
        force_fp32_for_softmax=force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=einsums[0],
        attn_weights_value_einsum=einsums[1],
      )
      return flax_fn(query, key, value, mask=mask, **flax_kw)
    fp32 = force_fp32_for_softmax and jnp.dtype(dtype) != jnp.float32
    return _by_jattn(sow, query, key, value, mask, flax_kw, is_causal, fp32, settings)

  attention_fn.__doc__ = _adapter_doc(collection)
  attention_fn.__module__ = module_name
  attention_fn.__qualname__ = "attention_fn"
  return attention_fn


def _check_arguments(
  arrays: tuple[Any, Any, Any], einsums: tuple[Any, Any], precision: Any, einsum_dot_general: Any
) -> None:
  """Flax's rules for an ``attention_fn``'s arguments: heads of rank 3 or more, the einsum
  overrides given together and apart from ``precision`` and ``einsum_dot_general``."""
  for name, x in zip(("query", "key", "value"), arrays):
    if not hasattr(x, "shape") or x.ndim < 3:
      raise ValueError(
        f"{name} must have shape [batch..., length, heads, head_dim], got "
        f"{getattr(x, 'shape', type(x).__name__)}"
      )
  if (einsums[0] is None) != (einsums[1] is None):
    raise ValueError(
      "qk_attn_weights_einsum and attn_weights_value_einsum must be specified together"
    )
  if (precision is not None or einsum_dot_general is not None) and einsums[0] is not None:
    raise ValueError(
      "precision/einsum_dot_general and qk_attn_weights_einsum/attn_weights_value_einsum "
      "are mutually exclusive: give one of them"
    )


def _by_jattn(
  sow: Callable[[Any, jax.Array], None],
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  mask: Any,
  flax_kw: dict[str, Any],
  is_causal: bool,
  fp32_weights: bool,
  settings: dict[str, Any],
) -> jax.Array:
  """The adapter's call of :func:`jattn.dot_product_attention` (and, with Flax's
  ``module``, of :func:`jattn.attention_weights`, sown): Flax's keywords ``flax_kw``
  read as Flax reads them, jattn's ``settings`` bound by the caller."""
  bias, module = flax_kw["bias"], flax_kw["module"]
  batch_dims = query.shape[:-3]
  if len(batch_dims) > 1:  # the core call takes one batch dimension or none
    flat = lambda x: x.reshape((math.prod(batch_dims),) + x.shape[-3:])
    query, key, value = flat(query), flat(key), flat(value)
    mask, bias = flatten_batch(mask, batch_dims, 3), flatten_batch(bias, batch_dims, 3)
  mask = as_bool_mask(mask)
  rate = _checks.real("dropout_rate", flax_kw["dropout_rate"])
  dropout_rng = flax_kw["dropout_rng"]
  if flax_kw["deterministic"] or rate == 0.0:
    rate, dropout_rng = 0.0, None
  elif dropout_rng is None:
    raise ValueError(f"dropout_rate={rate} with deterministic=False needs dropout_rng")
  options = options_of(settings)  # what is left in settings: the Scoring keywords
  weights = Weights(is_causal=bool(is_causal), **settings)  # type: ignore[typeddict-item]
  with _precision_context(flax_kw["precision"]):
    if module is not None:
      q, k = (query.astype(jnp.float32), key.astype(jnp.float32)) if fp32_weights else (query, key)
      p = attention.attention_weights(q, k, bias, mask, **weights)
      sow(module, _unflatten(p, batch_dims))
      if options.implementation is None:  # the sown weights' materialised path
        options = dataclasses.replace(options, implementation="xla")
    out = attention.dot_product_attention(
      query,
      key,
      value,
      bias,
      mask,
      dropout_rate=rate,
      dropout_rng=dropout_rng,
      broadcast_dropout=bool(flax_kw["broadcast_dropout"]),
      options=options,
      **weights,
    )
  return _unflatten(out, batch_dims)


def _unflatten(x: jax.Array, batch_dims: tuple[int, ...]) -> jax.Array:
  if len(batch_dims) <= 1:
    return x
  return x.reshape(batch_dims + x.shape[1:])


def _adapter_doc(collection: str) -> str:
  settings = ", ".join(f"``{name}``" for name in names(Adapted))
  return f"""Drop-in ``attention_fn=`` for Flax's attention modules, computed by jattn.

  Accepts exactly the keyword arguments Flax passes (``mask``,
  ``dropout_rng``, ``dropout_rate``, ``broadcast_dropout``, ``deterministic``,
  ``dtype``, ``precision``, ``module``, ``is_causal``, and Linen's
  ``force_fp32_for_softmax``, ``einsum_dot_general``, ``qk_attn_weights_einsum``,
  ``attn_weights_value_einsum``) with Flax's meanings, plus jattn's own settings,
  bound with ``functools.partial``: {settings}, as in :func:`jattn.dot_product_attention`.
  A mask of any dtype reads as Flax reads it: non-zero attends.

  Differences from Flax's default: a query row whose mask allows nothing
  returns zeros (Flax returns the mean of the values); dropout draws its
  pattern with :mod:`jattn.dropout` (same rate, inverted scaling and
  ``broadcast_dropout`` sharing, different random bits); ``precision``
  applies as ``jax.default_matmul_precision``. With ``module`` (Flax's
  ``sow_weights=True``) the weights are sown into ``{collection}`` as
  ``attention_weights`` (float32 with ``force_fp32_for_softmax``, as Flax's)
  and the materialised implementation computes the output, unless
  ``implementation`` says otherwise. Complex inputs, and einsum overrides,
  which jattn's kernels do not take, run Flax's own materialised
  ``dot_product_attention`` (then without jattn's settings).

  Args:
    query: [batch..., T, N, H].
    key, value: [batch..., S, K, H]; N a multiple of K.
    bias, mask: broadcastable to [batch..., N, T, S]; mask non-zero = attend.

  Returns:
    [batch..., T, N, H] in the promoted dtype.
  """
