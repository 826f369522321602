"""The Flax modules' call: checks that raise before compiling, and attention on projected heads.

After the q/k/v projections (and q/k norm) both modules hand the heads to :func:`attend`:
RoPE, then the KV cache or :func:`jattn.dot_product_attention`. Nothing here
re-implements attention. Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import attention, decode
from jattn._flax_config import Heads


def check_inputs(inputs_q, inputs_kv, in_features: int | None, in_kv_features: int | None):
  """(B, T, F) or (T, F) inputs with the right feature sizes; raises before compiling."""
  for name, x, want in (
    ("inputs_q", inputs_q, in_features),
    ("inputs_kv", inputs_kv, in_kv_features),
  ):
    if x is None:
      continue
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim not in (2, 3):
      raise ValueError(f"{name} must have shape (B, T, F) or (T, F), got {x.shape}")
    if want is not None and x.shape[-1] != want:
      raise ValueError(
        f"{name} must have {want} features in its last dimension, got shape {x.shape}"
      )
  if inputs_kv is not None and inputs_kv.ndim != inputs_q.ndim:
    raise ValueError(
      f"inputs_kv must have the rank of inputs_q {inputs_q.shape}, got {inputs_kv.shape}"
    )
  if inputs_kv is not None and inputs_q.ndim == 3 and inputs_kv.shape[0] != inputs_q.shape[0]:
    raise ValueError(
      f"inputs_q and inputs_kv must have the same batch size, got "
      f"{inputs_q.shape} and {inputs_kv.shape}"
    )


def check_call(
  *,
  inputs_q,
  cross: bool,
  decode_: bool,
  cache,
  positions,
  segment_ids,
  num_new,
  sow_weights: bool,
  implementation,
  rope,
) -> None:
  """Call arguments that depend on the module's settings; raises before compiling."""
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
  if cross and rope is not None:
    raise ValueError(
      "rope applies to self-attention; got inputs_kv (cross-attention), whose "
      "keys have no positions shared with the queries"
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
    ("inputs_kv", cross or None),
    ("positions", positions),
    ("segment_ids", segment_ids),
    ("sow_weights", sow_weights or None),
  ):
    if given is not None:
      raise ValueError(
        f"decode=True does not take {name}: decoding is causal self-attention "
        "over the cache, whose positions come from the cache"
      )
  if cache is None:
    raise ValueError("decode=True needs a KV cache: call init_cache(batch_size, max_length) first")
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


def check_sharding(name: str, sharding, shape: str) -> None:
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


def resolve_deterministic(dropout_rate: float, call_value, module_value) -> bool:
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


def attend(
  query,
  key,
  value,
  *,
  heads: Heads,
  is_causal: bool,
  rope,
  positions,
  mask,
  segment_ids,
  cache,
  num_new,
  sow_weights: bool,
  sinks=None,
  **options,
):
  """Attention over projected heads: RoPE, then the KV cache or plain attention.

  Args:
    query: (B, T, N, H) or (T, N, H), after the projection (and q/k norm).
    key, value: (B, S, K, H) or (S, K, H).
    cache: a :class:`jattn.decode.KVCache` or :class:`jattn.decode.PagedKVCache` to
      decode with, or None.
    sinks: the module's per-head sink logits (N,), or None.
    options: the module's keywords of :func:`jattn.dot_product_attention` (dropout,
      implementation, backward, tiles), passed on as they are.

  Returns:
    ``(out, weights, new_cache)``: out like query; weights (B, N, T, S) when
    ``sow_weights``, else None; new_cache None unless decoding.
  """
  if cache is not None:
    if rope is not None:
      pos = decode.positions(cache, query.shape[1])
      query, key = rope(query, pos), rope(key, pos)
    out, cache = decode.attention(
      query, key, value, cache, num_new=num_new, mask=mask, sinks=sinks, **options
    )
    return out, None, cache
  if rope is not None:
    pos = jnp.arange(query.shape[-3], dtype=jnp.int32) if positions is None else positions
    query, key = rope(query, pos), rope(key, pos)
  kwargs = dict(is_causal=bool(is_causal), segment_ids=segment_ids, sinks=sinks)
  weights = None
  if sow_weights:
    options["implementation"] = "xla"
    weights = attention.attention_weights(query, key, None, mask, **kwargs)
  out = attention.dot_product_attention(query, key, value, None, mask, **kwargs, **options)
  return out, weights, None
