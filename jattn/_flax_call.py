"""The Flax modules' call: checks that raise before compiling, and attention on projected heads.

After the q/k/v projections (and q/k norm) both modules hand the heads to :func:`attend`:
RoPE, then the KV cache or :func:`jattn.dot_product_attention`. Nothing here
re-implements attention. Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import attention, decode, masks
from jattn._flax_config import Settings


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
) -> Inputs:
  """Flax's inputs: ``inputs_v`` defaults to ``inputs_k`` and ``inputs_k`` to ``inputs_q``;
  ``inputs_kv`` gives both. Checked before compiling: (B, T, F) or (T, F), the feature
  sizes (None: any), ranks, batch sizes and the keys' and values' lengths."""
  if inputs_kv is not None and (inputs_k is not None or inputs_v is not None):
    raise ValueError(
      "give inputs_kv (keys and values from one input) or inputs_k and inputs_v, not both"
    )
  if inputs_v is not None and inputs_k is None:
    raise ValueError(
      "inputs_v needs inputs_k: inputs_k defaults to inputs_q only when inputs_v does too "
      "(pass one input for keys and values as inputs_k)"
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
    if x.ndim not in (2, 3):
      raise ValueError(f"{name} must have shape (B, T, F) or (T, F), got {x.shape}")
    if want is not None and x.shape[-1] != want:
      raise ValueError(
        f"{name} must have {want} features in its last dimension, got shape {x.shape}"
      )
  for name, x, _ in named[1:]:
    if x.ndim != inputs_q.ndim:
      raise ValueError(f"{name} must have the rank of inputs_q {inputs_q.shape}, got {x.shape}")
    if inputs_q.ndim == 3 and x.shape[0] != inputs_q.shape[0]:
      raise ValueError(
        f"inputs_q and {name} must have the same batch size, got {inputs_q.shape} and {x.shape}"
      )
  # kv is not None here: inputs_v needs inputs_k (raised above)
  if inputs_v is not None and inputs_v.shape[:-1] != kv.shape[:-1]:  # type: ignore[union-attr]
    raise ValueError(
      f"inputs_k and inputs_v must have the same length, got {kv.shape} and {inputs_v.shape}"  # type: ignore[union-attr]
    )
  kv = inputs_q if kv is None else kv
  return Inputs(inputs_q, kv, kv if inputs_v is None else inputs_v, kv_name)


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
  inputs_q: jax.Array,
  kv_name: str | None,
  decode_: bool,
  cache: decode.Cache | None,
  positions: jax.typing.ArrayLike | None,
  segment_ids: Any,
  num_new: jax.typing.ArrayLike | None,
  sow_weights: bool,
) -> None:
  """Call arguments that depend on the module's settings; raises before compiling.

  ``kv_name`` names the argument that made the call cross-attention, None for
  self-attention."""
  implementation, rope = settings.options.implementation, settings.rope
  attention_fn = settings.attention_fn
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
  if not decode_:
    if positions is not None and rope is None:
      raise ValueError("positions are used only by rope, and this module has rope=None")
    if positions is not None:
      T = inputs_q.shape[-2]
      shape = tuple(np.shape(positions))
      if shape not in ((T,), (1, T)) and not (
        inputs_q.ndim == 3 and shape == (inputs_q.shape[0], T)
      ):
        raise ValueError(
          f"positions must have shape (T,) or (B, T) for inputs_q {inputs_q.shape}, got {shape}"
        )
    return
  for name, given in (
    (kv_name, kv_name),
    ("positions", positions),
    ("segment_ids", segment_ids),
    ("sow_weights", sow_weights or None),
  ):
    if given is not None:
      raise ValueError(
        f"decode=True does not take {name}: decoding is causal self-attention "
        "over the cache, whose positions come from the cache"
      )
  if attention_fn is not None:
    raise ValueError(
      "decode=True attends over the KV cache with jattn.decode.attention, which takes no "
      "attention_fn: decode with a module made without one"
    )
  if cache is None:
    raise ValueError(
      "decode=True needs a KV cache: call init_cache(input_shape) (or init_cache(batch_size=, "
      "max_length=)) first"
    )
  B = inputs_q.shape[0] if inputs_q.ndim == 3 else None
  if B is None:
    raise ValueError(f"decode=True needs batched inputs (B, t, F), got {inputs_q.shape}")
  rows = cache.lengths.shape[0]
  if B != rows:
    raise ValueError(f"inputs_q has batch size {B} but the cache was made for {rows}")
  if inputs_q.shape[1] > cache.max_length:
    raise ValueError(
      f"inputs_q has {inputs_q.shape[1]} tokens, more than the cache's "
      f"max_length {cache.max_length}"
    )


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
  cache: decode.Cache | None,
  num_new: jax.typing.ArrayLike | None,
  dropout_rng: jax.Array | None,
  sow_weights: bool,
  sinks: jax.typing.ArrayLike | None = None,
  attention_fn: Callable[..., jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array | None, decode.Cache | None]:
  """Attention over projected heads: RoPE, then the KV cache or plain attention.

  Args:
    query: (B, T, N, H) or (T, N, H), after the projection (and q/k norm).
    key, value: (B, S, K, H) or (S, K, H).
    settings: the module's; ``is_causal`` is the call's.
    cache: a :class:`jattn.decode.KVCache` or :class:`jattn.decode.PagedKVCache` to
      decode with, or None.
    dropout_rng: None for no dropout.
    sinks: the module's per-head sink logits (N,), or None.
    attention_fn: :func:`bind_attention_fn`'s, which then computes (and sows) the
      attention in place of jattn's, or None.

  Returns:
    ``(out, weights, new_cache)``: out like query; weights (B, N, T, S) when
    ``sow_weights``, else None; new_cache None unless decoding.
  """
  rope = settings.rope
  options: dict[str, Any] = dict(
    dropout_rate=settings.dropout_rate if dropout_rng is not None else 0.0,
    dropout_rng=dropout_rng,
    broadcast_dropout=settings.broadcast_dropout,
    options=settings.options,
  )
  if cache is not None:
    if rope is not None:
      pos: jax.typing.ArrayLike = decode.positions(cache, query.shape[1])
      query, key = rope(query, pos), rope(key, pos)
    out, cache = decode.attention(
      query, key, value, cache, num_new=num_new, mask=mask, sinks=sinks, **options
    )
    return out, None, cache  # type: ignore[return-value]  # out alone: no return_residual
  if rope is not None:
    pos = jnp.arange(query.shape[-3], dtype=jnp.int32) if positions is None else positions
    query, key = rope(query, pos), rope(key, pos)
  if attention_fn is not None:
    return attention_fn(query, key, value, mask=mask), None, None
  kwargs = dict(is_causal=bool(is_causal), segment_ids=segment_ids, sinks=sinks)
  weights = None
  if sow_weights:
    options["options"] = dataclasses.replace(settings.options, implementation="xla")
    weights = attention.attention_weights(query, key, None, mask, **kwargs)
  out = attention.dot_product_attention(query, key, value, None, mask, **kwargs, **options)
  return out, weights, None
