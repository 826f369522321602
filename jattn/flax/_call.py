"""The Flax modules' call: checks that raise before compiling, and attention on projected heads.

After the q/k/v projections (and q/k norm) both modules hand the heads to :func:`attend`:
RoPE, then the KV cache or :func:`jattn.dot_product_attention`. Nothing here
re-implements attention. Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import attention, decode, masks
from jattn._validate.keywords import Dropout, Weights
from jattn.flax import _adapter as _flax_adapter
from jattn.flax import _cache as _flax_cache
from jattn.flax._config import Settings


@dataclasses.dataclass(frozen=True)
class Inputs:
  """A call's inputs: the queries', keys' and values' (inputs_q's for self-attention)."""

  q: Any
  k: Any
  v: Any
  kv_name: str | None  # the argument that makes it cross-attention, None for self-attention


def inputs(
  inputs_q: jax.Array,
  inputs_k: jax.Array | None,
  inputs_v: jax.Array | None,
  inputs_kv: jax.Array | None,
  in_features: int | None,
  in_kv_features: int | None,
  *,
  linen: bool = False,
) -> Inputs:
  """Flax's inputs: ``inputs_v`` defaults to ``inputs_k`` and ``inputs_k`` to ``inputs_q``;
  ``inputs_kv`` gives both. Each [batch..., length, features]; checked here: arrays of
  rank 2 or more and the feature sizes (None: any). :func:`check_inputs` checks how they
  fit together. ``linen``: warn as Flax Linen's module does (``inputs_kv``, and an
  ``inputs_v`` shaped like a mask)."""
  if inputs_kv is not None and (inputs_k is not None or inputs_v is not None):
    raise ValueError(
      "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None: give "
      "inputs_kv (keys and values from one input) or inputs_k and inputs_v, not both"
    )
  if inputs_v is not None and inputs_k is None:
    raise ValueError(
      "`inputs_k` cannot be None if `inputs_v` is not None: inputs_k defaults to inputs_q "
      "only when inputs_v does too (pass one input for keys and values as inputs_k)"
    )
  kv_name = "inputs_kv" if inputs_kv is not None else "inputs_k" if inputs_k is not None else None
  kv = inputs_kv if inputs_kv is not None else inputs_k
  named: list[tuple[str | None, Any, int | None]]  # (name, array or None, features)
  named = [("inputs_q", inputs_q, in_features), (kv_name, kv, in_kv_features)]
  named.append(("inputs_v", inputs_v, in_kv_features))
  named = [(name, x, want) for name, x, want in named if x is not None]
  for name, x, want in named:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim < 2:
      raise ValueError(f"{name} must have shape (batch..., length, features), got {x.shape}")
    if want is not None and x.shape[-1] != want:
      raise ValueError(
        f"{name} must have {want} features in its last dimension, got shape {x.shape}"
      )
  if linen and inputs_kv is not None:
    warnings.warn(
      "The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v instead "
      "(as Flax's MultiHeadDotProductAttention says).",
      DeprecationWarning,
      stacklevel=3,
    )
  if linen and inputs_v is not None and inputs_v.shape[-1] == inputs_v.shape[-2]:
    warnings.warn(
      f"You are passing an array of shape {inputs_v.shape} to the `inputs_v` arg, when you "
      "may have intended to pass it to the `mask` arg: the function signature of "
      "MultiHeadDotProductAttention's `__call__` method has changed to `__call__(inputs_q, "
      "inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None, deterministic=None)` "
      "(Flax 0.7.4). Use the keyword argument `mask` instead.",
      DeprecationWarning,
      stacklevel=3,
    )
  kv = inputs_q if kv is None else kv
  return Inputs(inputs_q, kv, kv if inputs_v is None else inputs_v, kv_name)


def check_inputs(x: Inputs) -> None:
  """The inputs fit together: the same batch dimensions, and keys and values of one
  length."""
  for name, a in ((x.kv_name, x.k), ("inputs_v", x.v)):
    if a is not x.q and a.shape[:-2] != x.q.shape[:-2]:
      raise ValueError(
        f"inputs_q and {name} must have the same batch dimensions, got {x.q.shape} and {a.shape}"
      )
  if x.v.shape[:-1] != x.k.shape[:-1]:
    raise ValueError(
      f"inputs_k and inputs_v must have the same length, got {x.k.shape} and {x.v.shape}"
    )


def rope_positions(
  positions: jax.typing.ArrayLike | None,
  input_positions: jax.typing.ArrayLike | None,
  attention_fn: Callable | None,
) -> jax.typing.ArrayLike | None:
  """The positions RoPE reads: ``positions`` (jattn's name) or Flax's ``input_positions``,
  which goes to an ``attention_fn`` when the module has one."""
  if attention_fn is not None or input_positions is None:
    return positions
  if positions is not None:
    raise ValueError(
      "positions and input_positions are one argument (jattn's name and Flax's): give one"
    )
  return input_positions


def check_call(
  settings: Settings,
  *,
  inputs: Inputs,
  decode_: bool,
  cache: _flax_cache.Held | None,
  positions: jax.typing.ArrayLike | None,
  segment_ids: Any,
  num_new: jax.typing.ArrayLike | None,
  sow_weights: bool,
  remedy: str,
) -> None:
  """Call arguments that depend on the module's settings; raises before compiling.

  ``cache`` is the module's (None: none yet); ``remedy`` says how to make a cache with
  one length per row, which ``num_new`` needs."""
  implementation, rope = settings.options.implementation, settings.rope
  attention_fn = settings.attention_fn
  inputs_q, kv_name = inputs.q, inputs.kv_name
  if not isinstance(sow_weights, (bool, np.bool_)):
    raise TypeError(f"sow_weights must be a bool, got {sow_weights!r}")
  if not isinstance(decode_, (bool, np.bool_)):
    raise TypeError(f"decode must be a bool, got {decode_!r}")
  if sow_weights and implementation not in (None, "xla"):
    raise ValueError(
      f"sow_weights needs the materialised weights, which "
      f"implementation={implementation!r} never forms; use "
      "implementation='xla' (or None) to inspect them"
    )
  if kv_name is not None and rope is not None:
    raise ValueError(
      f"rope applies to self-attention; got {kv_name} (cross-attention), whose "
      "keys have no positions shared with the queries"
    )
  if attention_fn is not None and segment_ids is not None:
    raise ValueError(
      "segment_ids needs jattn's attention, which attention_fn replaces: pass them as a mask"
    )
  if num_new is not None and not decode_:
    raise ValueError("num_new applies only with decode=True")
  if decode_:
    _check_decode(settings, inputs, cache, positions, segment_ids, num_new, sow_weights, remedy)
  elif positions is not None:
    if rope is None:
      raise ValueError("positions are used only by rope, and this module has rope=None")
    T = inputs_q.shape[-2]
    shape = tuple(np.shape(positions))
    if shape not in ((T,), (1, T), inputs_q.shape[:-1]):
      raise ValueError(
        f"positions must have shape (T,) or (batch..., T) for inputs_q {inputs_q.shape}, "
        f"got {shape}"
      )


def _check_decode(
  settings: Settings,
  inputs: Inputs,
  cache: _flax_cache.Held | None,
  positions: jax.typing.ArrayLike | None,
  segment_ids: Any,
  num_new: jax.typing.ArrayLike | None,
  sow_weights: bool,
  remedy: str,
) -> None:
  """A ``decode=True`` call's arguments against the module's settings and its cache."""
  for name, given in (
    ("positions", positions),
    ("segment_ids", segment_ids),
    ("sow_weights", sow_weights or None),
  ):
    if given is not None:
      raise ValueError(
        f"decode=True does not take {name}: decoding is causal self-attention "
        "over the cache, whose positions come from the cache"
      )
  if settings.attention_fn is not None:
    raise ValueError(
      "decode=True attends over the KV cache with jattn.decode.attention, which takes no "
      "attention_fn: decode with a module made without one"
    )
  if cache is None:
    raise ValueError(
      "decode=True needs a KV cache: call init_cache(input_shape) (or init_cache(batch_size=, "
      "max_length=)) first"
    )
  inputs_q, kv_name = inputs.q, inputs.kv_name
  if jnp.issubdtype(inputs_q.dtype, jnp.complexfloating):
    raise TypeError(
      f"decode=True writes a jattn.decode cache, which holds floating dtypes, got inputs_q "
      f"of {inputs_q.dtype}"
    )
  if kv_name is not None and inputs.k.shape[-2] != inputs_q.shape[-2]:
    raise ValueError(
      f"decode=True writes {kv_name}'s tokens to the cache beside inputs_q's: they must have "
      f"the same length, got {inputs.k.shape} and inputs_q {inputs_q.shape}"
    )
  batch_dims = inputs_q.shape[:-2]
  if batch_dims != cache.batch_dims:
    raise ValueError(
      f"inputs_q has batch dimensions {batch_dims} (shape {inputs_q.shape}) but the cache "
      f"was made for {cache.batch_dims}"
    )
  if inputs_q.shape[-2] > cache.cache.max_length:
    raise ValueError(
      f"inputs_q has {inputs_q.shape[-2]} tokens, more than the cache's "
      f"max_length {cache.cache.max_length}"
    )
  if num_new is not None and cache.indexed:
    raise ValueError(
      "num_new needs a cache with one length per row, but this one keeps Flax's one "
      f"cache_index for all rows: {remedy}"
    )


def check_shardings(ndim: int, qkv_sharding: Any, out_sharding: Any) -> None:
  """The projections' ``qkv_sharding`` and ``out_sharding`` for inputs of rank ``ndim``
  (batch dimensions, length, features)."""
  batch = "".join(f"B{i}, " for i in range(ndim - 2)) if ndim > 3 else ""
  batch = "B, " if ndim == 3 else batch
  check_sharding("qkv_sharding", qkv_sharding, f"({batch}T, N, H)")
  check_sharding("out_sharding", out_sharding, f"({batch}T, F)")


def check_sharding(
  name: str, sharding: jax.sharding.NamedSharding | jax.sharding.PartitionSpec | None, shape: str
) -> None:
  """An ``out_sharding`` of a projection whose output has ``shape`` (letters, e.g.
  ``"(B, T, F)"``): None, a PartitionSpec or a NamedSharding of at most one entry per
  dimension."""
  if sharding is None:
    return
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = sharding.spec
  elif isinstance(sharding, jax.sharding.PartitionSpec):
    spec = sharding
  else:
    raise TypeError(
      f"{name} must be None, a jax.sharding.PartitionSpec or a NamedSharding, "
      f"got {type(sharding).__name__}"
    )
  rank = shape.count(",") + 1
  if len(spec) > rank:
    raise ValueError(
      f"{name} must have at most {rank} entries, one per dimension of {shape}, got {spec}"
    )


def resolve_deterministic(
  dropout_rate: float, call_value: bool | None, module_value: bool | None
) -> bool:
  """Flax's rule: the call's flag, else the module's; required only when dropout is on."""
  if not dropout_rate:
    return True
  value = call_value if call_value is not None else module_value
  if value is None:
    raise ValueError(
      "dropout_rate > 0 needs deterministic: pass deterministic= to the call or "
      "the constructor (or use module.eval() / module.train())"
    )
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"deterministic must be a bool, got {value!r}")
  return bool(value)


def bind_attention_fn(
  settings: Settings,
  *,
  dropout_rng: jax.Array | None,
  deterministic: bool,
  dtype: jax.typing.DTypeLike | None,
  precision: jax.lax.PrecisionLike,
  only_taken: bool = False,
  **more: Any,
) -> Callable[..., jax.Array] | None:
  """``settings.attention_fn`` with every keyword of Flax's call but ``mask`` bound, or None
  when the module has none. ``only_taken``: pass only the keywords the function takes, as
  Linen does (NNX passes them all), but never drop ``is_causal``."""
  fn = settings.attention_fn
  if fn is None:
    return None
  kwargs = dict(
    dropout_rng=dropout_rng,
    dropout_rate=settings.dropout_rate,
    broadcast_dropout=settings.broadcast_dropout,
    deterministic=deterministic,
    dtype=dtype,
    precision=precision,
    **more,
  )
  if only_taken:
    taken = inspect.signature(fn).parameters
    if "is_causal" in kwargs and "is_causal" not in taken:
      raise ValueError(
        "is_causal needs an attention_fn that takes is_causal; this one does not: pass a "
        "causal mask instead"
      )
    kwargs = {k: v for k, v in kwargs.items() if k in taken}
  return functools.partial(fn, **kwargs)


def _rows(x: Any, batch_dims: tuple[int, ...]) -> Any:
  """``x`` of shape [batch_dims..., ...] with its batch dimensions as one of B rows (B = 1
  with none); as it is when it has no such leading dimensions (a shared (T,) array)."""
  if x is None or not hasattr(x, "shape") or tuple(x.shape[: len(batch_dims)]) != batch_dims:
    return x
  if x.ndim == len(batch_dims) + 1 and not batch_dims:  # (T,): shared by the rows
    return x
  shape = (math.prod(batch_dims),) + tuple(x.shape[len(batch_dims) :])
  return x if tuple(x.shape) == shape else x.reshape(shape)


def _as_rows(mask: Any, segment_ids: Any, batch_dims: tuple[int, ...]) -> tuple[Any, Any]:
  """A call's mask array (Flax's reading: non-zero attends) and segment ids (or their pair)
  with the batch dimensions as one of B rows; a :class:`jattn.masks.Mask` as it is."""
  if mask is not None and not isinstance(mask, masks.Mask):
    mask = _flax_adapter.flatten_batch(_flax_adapter.as_bool_mask(mask), batch_dims, 3)
  if segment_ids is not None:
    pair = isinstance(segment_ids, (tuple, list))
    ids = [_rows(i, batch_dims) for i in (segment_ids if pair else (segment_ids,))]
    ids = [i[None] if batch_dims == () and np.ndim(i) == 1 else i for i in ids]
    segment_ids = tuple(ids) if pair else ids[0]
  return mask, segment_ids


class Attended(NamedTuple):
  """What :func:`attend` gives the module: ``out`` [batch..., T, N, Hv]; ``weights``
  [batch..., N, T, S] when it sows them, else None; the cache's new variables, None unless
  decoding; ``max_logit`` [batch..., T, N] when it sows them (``sow_max_logit``), else
  None."""

  out: jax.Array
  weights: jax.Array | None = None
  variables: dict[str, jax.Array] | None = None
  max_logit: jax.Array | None = None


def _maybe_unrows(x: jax.Array | None, batch_dims: tuple[int, ...]) -> jax.Array | None:
  return None if x is None else _unrows(x, batch_dims)


def _unrows(x: jax.Array, batch_dims: tuple[int, ...]) -> jax.Array:
  shape = batch_dims + x.shape[1:]
  return x if x.shape == shape else x.reshape(shape)


def _flax_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  flax_attention: Callable[..., jax.Array],
  *,
  is_causal: bool,
  mask: Any,
  segment_ids: Any,
  sinks: Any,
  why: str,
  sow_max_logit: bool = False,
) -> jax.Array:
  """Flax's own materialised attention (``flax_attention``, Flax's ``dot_product_attention``
  with the call's keywords bound) on [batch..., T, N, H] heads, for what jattn's kernels do
  not take (``why``); jattn's additions are refused."""
  for name, given in (
    ("a jattn.masks.Mask", isinstance(mask, masks.Mask) or None),
    ("segment_ids", segment_ids),
    ("sinks", sinks),
    ("sow_max_logit", sow_max_logit or None),
  ):
    if given is not None:
      raise TypeError(
        f"{why} run Flax's materialised attention, which takes no {name}: pass a mask array"
      )
  if is_causal:
    mask = _flax_adapter.with_causal(mask, query.shape[-3], key.shape[-3])
  key = _flax_adapter.repeat_kv_heads(query, key)
  value = _flax_adapter.repeat_kv_heads(query, value)
  return flax_attention(query, key, value, mask=mask)


def attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  settings: Settings,
  *,
  is_causal: bool,
  positions: jax.typing.ArrayLike | None,
  mask: jax.typing.ArrayLike | masks.Mask | None,
  segment_ids: Any,
  cache: _flax_cache.Held | None,
  num_new: jax.typing.ArrayLike | None,
  dropout_rng: jax.Array | None,
  sow_weights: bool,
  sinks: jax.typing.ArrayLike | None = None,
  attention_fn: Callable[..., jax.Array] | None = None,
  flax_attention: Callable[..., jax.Array] | None = None,
  flax_why: str = "",
  fp32_weights: bool = False,
  sow_max_logit: bool = False,
) -> Attended:
  """Attention over projected heads: RoPE, then the KV cache or plain attention.

  Args:
    query: [batch..., T, N, H], after the projection (and q/k norm); no batch dimension
      is one row.
    key, value: [batch..., S, K, H] and [batch..., S, K, Hv].
    settings: the module's; ``is_causal`` is the call's.
    mask: an array broadcastable to [batch..., N, T, S], non-zero attends (Flax's
      reading, whatever its dtype), or a :class:`jattn.masks.Mask`.
    cache: the module's cache to decode with, or None.
    dropout_rng: None for no dropout.
    sinks: the module's per-head sink logits (N,), or None.
    attention_fn: :func:`bind_attention_fn`'s, which then computes (and sows) the
      attention in place of jattn's, or None.
    flax_attention: Flax's own ``dot_product_attention`` with the call's keywords bound,
      which computes (and sows) the attention instead when given: for what jattn's
      kernels do not take, named by ``flax_why`` (complex dtypes, einsum overrides).
    fp32_weights: sow the weights in float32 whatever the dtype (Flax's
      ``force_fp32_for_softmax``).
    sow_max_logit: also return each row's largest logit (for QK-clip), [batch..., T, N].

  Returns:
    An :class:`Attended`.
  """
  rope = settings.rope
  dropout = Dropout(
    dropout_rate=settings.dropout_rate if dropout_rng is not None else 0.0,
    dropout_rng=dropout_rng,
    broadcast_dropout=settings.broadcast_dropout,
  )
  given_mask = mask  # as the call gave it, for an attention function with Flax's contract
  if flax_attention is not None and cache is None and rope is None:
    out = _flax_attention(
      query,
      key,
      value,
      flax_attention,
      is_causal=is_causal,
      mask=mask,
      segment_ids=segment_ids,
      sinks=sinks,
      why=flax_why,
      sow_max_logit=sow_max_logit,
    )
    return Attended(out)
  # jattn's calls take one batch dimension: the batch dimensions become B rows (B = 1 with
  # none), and go back on the way out.
  batch_dims = tuple(query.shape[:-3])
  given = query, key, value
  query, key, value = (_rows(x, batch_dims) for x in given)
  mask, segment_ids = _as_rows(mask, segment_ids, batch_dims)
  if cache is not None:
    if rope is not None:
      pos: jax.typing.ArrayLike = decode.positions(cache.cache, query.shape[1])
      query, key = rope(query, pos), rope(key, pos)
    decoded: Any
    decoded, new_cache = decode.attention(
      query,
      key,
      value,
      cache.cache,
      num_new=num_new,
      mask=mask,
      sinks=sinks,
      absolute_positions=True,  # a Mask sees each query where it sits in its sequence
      options=settings.options,
      return_max_logit=sow_max_logit,
      **dropout,
    )
    variables = cache.variables(new_cache)  # type: ignore[arg-type]
    if sow_max_logit:
      out, top = decoded
      return Attended(_unrows(out, batch_dims), None, variables, _unrows(top, batch_dims))
    return Attended(_unrows(decoded, batch_dims), None, variables)
  if rope is not None:
    if positions is None:
      positions = jnp.arange(query.shape[-3], dtype=jnp.int32)
    elif np.ndim(positions) == len(batch_dims) + 1 and np.ndim(positions) > 1:
      positions = _rows(positions, batch_dims)  # one row of positions per batch row
    query, key = rope(query, positions), rope(key, positions)
  if attention_fn is not None or flax_attention is not None:
    query, key, value = (_unrows(x, batch_dims) for x in (query, key, value))
    if flax_attention is not None:  # with rope, applied above on the rows
      out = _flax_attention(
        query,
        key,
        value,
        flax_attention,
        is_causal=is_causal,
        mask=given_mask,
        segment_ids=segment_ids,
        sinks=sinks,
        why=flax_why,
        sow_max_logit=sow_max_logit,
      )
      return Attended(out)
    return Attended(attention_fn(query, key, value, mask=given_mask))  # type: ignore[misc]
  shaping = Weights(is_causal=bool(is_causal), segment_ids=segment_ids, sinks=sinks)
  got = _by_jattn(
    query, key, value, mask, settings, shaping, dropout, sow_weights, fp32_weights, sow_max_logit
  )
  weights, top = (_maybe_unrows(x, batch_dims) for x in (got.weights, got.max_logit))
  return Attended(_unrows(got.out, batch_dims), weights, None, top)


def _by_jattn(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  mask: Any,
  settings: Settings,
  shaping: Weights,
  dropout: Dropout,
  sow_weights: bool,
  fp32_weights: bool,
  sow_max_logit: bool,
) -> Attended:
  """:func:`jattn.dot_product_attention` on B rows of heads (and
  :func:`jattn.attention_weights`, when the weights are sown, on the materialised path)."""
  weights, options = None, settings.options
  if sow_weights:
    options = dataclasses.replace(options, implementation="xla")
    q, k = (query.astype(jnp.float32), key.astype(jnp.float32)) if fp32_weights else (query, key)
    weights = attention.attention_weights(q, k, None, mask, **shaping)
  out = attention.dot_product_attention(
    query,
    key,
    value,
    None,
    mask,
    options=options,
    return_max_logit=sow_max_logit,
    **shaping,
    **dropout,
  )
  if sow_max_logit:
    return Attended(out[0], weights, None, out[1])
  return Attended(out, weights)
