"""The checks of an attention call's arrays and scalar settings, shared by every entry point
(:func:`jattn._validate.build`, :func:`jattn.linear_attention`): each raises at the public
boundary with a message naming the argument, what was expected and what arrived."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn._checks import as_array, int_array, integer, prng_key, real
from jattn._checks import dropout_rate as dropout_rate


def qkv(
  query: Any, key: Any, value: Any, *, shapes_only: bool = False
) -> tuple[jax.Array | np.ndarray, Any, Any]:
  """Query (B, T, N, H) or (T, N, H), key (B, S, K, H) or (S, K, H), value (B, S, K, Hv) or
  (S, K, Hv) with a head dimension of its own, as arrays.

  One floating dtype for all three, N a multiple of K; the layout of
  ``jax.nn.dot_product_attention``, shared by every attention function.
  """
  q = as_array("query", query)
  if shapes_only:  # key and value are read elsewhere: their shapes and dtype suffice
    k, v = key, value
  else:
    k, v = as_array("key", key), as_array("value", value)
  for name, x in (("query", q), ("key", k), ("value", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(
      f"query, key and value must have the same dtype, got "
      f"query {q.dtype}, key {k.dtype} and value {v.dtype}"
    )
  if q.ndim not in (3, 4):
    raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {q.shape}")
  layout = "(B, S, K, H)" if q.ndim == 4 else "(S, K, H)"
  if k.ndim != q.ndim:
    raise ValueError(f"key must have shape {layout} to match query {q.shape}, got {k.shape}")
  if v.ndim != k.ndim or k.shape[:-1] != v.shape[:-1]:
    raise ValueError(
      f"key and value must have the same shape but for the head dimension, got key "
      f"{k.shape} and value {v.shape}"
    )
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(
      f"query and key must have the same head dimension H, got query {q.shape} and key {k.shape}"
    )
  if q.ndim == 4 and q.shape[0] != k.shape[0]:
    raise ValueError(
      f"query and key must have the same batch size B, got query {q.shape} and key {k.shape}"
    )
  n, kh = q.shape[-2], k.shape[-2]
  if kh == 0 or n % kh:
    raise ValueError(
      f"the number of query heads N ({n}) must be a multiple of the number "
      f"of key/value heads K ({kh})"
    )
  return q, k, v


def scale(scale: Any, head_dim: int) -> float:
  if scale is None:  # with H == 0 every logit is an empty sum, 0, whatever the scale
    return 1.0 / float(np.sqrt(head_dim)) if head_dim else 1.0
  scale = real("scale", scale)
  if not np.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def window(window: Any) -> tuple[int, int] | None:
  if window is None:
    return None
  if isinstance(window, numbers.Integral) and not isinstance(window, bool):
    window = (window, window)
  if not (isinstance(window, tuple) and len(window) == 2):
    raise TypeError(
      f"local_window_size must be an int or a (left, right) tuple of ints, got {window!r}"
    )
  left, right = (
    integer(f"local_window_size[{i}]", w, minimum=0, int32=True) for i, w in enumerate(window)
  )
  return left, right


def seq_lengths(name: str, lengths: Any, B: int) -> jax.Array | np.ndarray | np.integer | None:
  if lengths is None:
    return None
  lengths = int_array(name, as_array(name, lengths), ranks=(1,), nonnegative=True)
  if lengths.shape != (B,):
    raise ValueError(f"{name} must have shape (B,)=({B},), got {lengths.shape}")
  return lengths


def sinks(sinks: Any, N: int) -> jax.Array | np.ndarray | None:
  """Per-head sink logits: a floating array of shape (N,); None stays None."""
  if sinks is None:
    return None
  sinks = as_array("sinks", sinks)
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
  if sinks.shape != (N,):
    raise ValueError(
      f"sinks must have shape (N,)=({N},), one logit per query head, got {sinks.shape}"
    )
  return sinks


def dropout(rate: Any, rng: Any) -> float:
  rate = dropout_rate(rate)
  if rate > 0.0:
    if rng is None:
      raise ValueError(f"dropout_rate={rate} needs dropout_rng, got None")
    prng_key("dropout_rng", rng)
  return rate
