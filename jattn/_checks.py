"""Argument checks shared by the public functions.

Every public function validates its inputs here, before anything is traced or
compiled, and raises ValueError (bad shape or value) or TypeError (bad dtype
or type) with a message that names the argument, what was expected and what
arrived. Implementations never call these: they trust normalised arguments.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _quant


def is_concrete(x: Any) -> bool:
  """True when ``x`` holds known values (not a tracer inside jit/vmap/grad)."""
  return not isinstance(x, jax.core.Tracer)


def dtype_of(x: Any) -> np.dtype:
  return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def shape_of(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  return tuple(shape) if shape is not None else np.shape(x)


def as_array(name: str, value: Any) -> jax.Array | np.ndarray:
  """``value`` as an array: jax/NumPy arrays as they are, NumPy scalars, lists and numbers
  via NumPy."""
  if isinstance(value, (jax.Array, np.ndarray)):
    return value
  if isinstance(value, np.generic):
    return np.asarray(value)
  if isinstance(value, (list, tuple, numbers.Number)) and not isinstance(value, bool):
    return np.asarray(value)
  raise TypeError(f"{name} must be an array, got {type(value).__name__}")


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def integer(name: str, value: Any, *, minimum: int | None = None, int32: bool = False) -> int:
  """A Python (or NumPy) integer, optionally bounded below.

  ``int32=True`` for settings that enter int32 index arithmetic (mask offsets,
  widths, sizes): values outside int32's range would wrap or overflow there.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  if int32:
    _in_int32(name, value, value)
  return value


def _in_int32(name: str, low: int, high: int) -> None:
  if high > INT32_MAX:
    raise ValueError(
      f"{name} must be at most 2**31 - 1 = {INT32_MAX} (jattn's positions and "
      f"ids are int32), got {high}"
    )
  if low < INT32_MIN:
    raise ValueError(
      f"{name} must be at least -2**31 = {INT32_MIN} (jattn's positions and "
      f"ids are int32), got {low}"
    )


def real(name: str, value: Any) -> float:
  """A concrete real number (Python or NumPy scalar, or a concrete 0-d array)."""
  if isinstance(value, bool):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} must be a concrete Python or NumPy number, got a traced value of shape "
      f"{shape_of(value)}; it is a static setting of the computation"
    )
  dtype = getattr(value, "dtype", None)  # NumPy scalars, 0-d arrays; complex is not real
  if (
    shape_of(value) == ()
    and dtype is not None
    and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating))
  ):
    return float(np.asarray(value))
  raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")


def positive_real(name: str, value: Any) -> float:
  """``value`` as a float, checked: a concrete, positive, finite real number."""
  value = real(name, value)
  if not (value > 0 and np.isfinite(value)):
    raise ValueError(f"{name} must be a positive finite number, got {value}")
  return value


def int_array(
  name: str, value: Any, *, ranks: tuple[int, ...], nonnegative: bool = False
) -> jax.Array | np.ndarray | np.integer:
  """An integer array of one of ``ranks``; negative values rejected when concrete.

  Concrete values outside int32's range are rejected too: jattn computes in
  int32, where an int64 or uint32 length of 2**32 would silently wrap to 0.
  (Traced values cannot be checked.)
  """
  if not hasattr(value, "dtype") and not isinstance(value, (list, tuple, numbers.Integral)):
    raise TypeError(f"{name} must be an integer array, got {type(value).__name__}")
  arr = value if hasattr(value, "dtype") else np.asarray(value)
  dtype = dtype_of(arr)
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(f"{name} must have an integer dtype, got {dtype}")
  if arr.ndim not in ranks:
    expected = " or ".join(str(r) for r in ranks)
    raise ValueError(f"{name} must have rank {expected}, got shape {shape_of(arr)}")
  if nonnegative and is_concrete(arr) and np.any(np.asarray(arr) < 0):
    raise ValueError(f"{name} must be non-negative, got {np.asarray(arr).tolist()}")
  if not np.can_cast(dtype, np.int32) and is_concrete(arr) and np.size(arr):
    held = np.asarray(arr)
    _in_int32(name, int(held.min()), int(held.max()))
  return arr


def broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...], legend: str) -> None:
  """Each dim of ``shape`` (same rank as ``target``) is 1 or equal to the target's."""
  if len(shape) != len(target) or any(s not in (1, t) for s, t in zip(shape, target)):
    raise ValueError(
      f"{name} must be broadcastable to {legend}={target} (each dimension 1 or equal), "
      f"got shape {shape}"
    )


def boolean(name: str, value: Any) -> bool:
  """A Python (or NumPy) bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def prng_key(name: str, rng: Any) -> None:
  """A single ``jax.random.key`` (shape ()) or legacy ``PRNGKey`` (uint32, shape (2,))."""
  dtype = getattr(rng, "dtype", None)
  is_key = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  is_raw = dtype == np.uint32 and getattr(rng, "shape", None) == (2,)
  if not (is_key and rng.shape == ()) and not is_raw:
    raise TypeError(
      f"{name} must be a single jax.random.key or PRNGKey, got "
      f"{getattr(rng, 'dtype', type(rng).__name__)}{getattr(rng, 'shape', '')}"
    )


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


# --- the call's scalar settings, shared by every entry point ----------------------------


def scale(scale: Any, head_dim: int) -> float:
  if scale is None:  # with H == 0 every logit is an empty sum, 0, whatever the scale
    return 1.0 / float(np.sqrt(head_dim)) if head_dim else 1.0
  scale = real("scale", scale)
  if not np.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def flags(**flags: Any) -> None:
  for name, flag in flags.items():
    boolean(name, flag)


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


def tile_sizes(
  implementation: str | None, block_q: Any, block_kv: Any
) -> tuple[int | None, int | None]:
  """Tile sizes checked; they exist only for the tiled implementations (the table's tiles
  column; with implementation=None they exclude the others, see _select.choose)."""
  # Imported here, not at the top: the table's modules import jattn.masks, which imports this.
  from jattn.impl._select import TILED as tiled

  blocks = (
    None if block_q is None else integer("block_q", block_q, minimum=1),
    None if block_kv is None else integer("block_kv", block_kv, minimum=1),
  )
  if implementation is not None and implementation not in tiled and blocks != (None, None):
    names = ", ".join(repr(n) for n in tiled[:-1]) + f" or {tiled[-1]!r}"
    raise ValueError(
      f"block_q and block_kv apply only to implementation={names}, got "
      f"implementation={implementation!r}"
    )
  # The fused kernels' own tile rules, checked when the sizes are given (an Options is made),
  # not first at the call; blockwise takes any size.
  reason = None
  if implementation == "flex":
    reason = flex_tiles_reason(*blocks)
  elif implementation == "splash":
    from jattn.impl import splash

    # A size not given takes splash's default, a multiple of its lanes.
    reason = splash.blocks_reason(*(splash.LANES if b is None else b for b in blocks))
  if reason is not None:
    raise ValueError(f"implementation={implementation!r} does not support {reason}")
  return blocks


def flex_tiles_reason(block_q: int | None, block_kv: int | None) -> str | None:
  """Why flex cannot take these tile sizes (Triton's blocks: powers of two, at least 16), or
  None; a size not given takes flex's default."""
  for name, block in (("block_q", block_q), ("block_kv", block_kv)):
    if block is not None and (block < 16 or block & (block - 1)):
      return f"{name}={block} (flex's tiles are powers of two, at least 16)"
  return None


def dropout_rate(rate: Any) -> float:
  rate = real("dropout_rate", rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  return rate


def dropout(rate: Any, rng: Any) -> float:
  rate = dropout_rate(rate)
  if rate > 0.0:
    if rng is None:
      raise ValueError(f"dropout_rate={rate} needs dropout_rng, got None")
    prng_key("dropout_rng", rng)
  return rate


def storage_dtype(name: str, dtype: Any) -> np.dtype:
  """A KV cache's storage dtype: floating, or int8 / float8_e4m3fn (quantized)."""
  try:
    checked = np.dtype(dtype)
  except TypeError:
    checked = None
  if checked is None or not (jnp.issubdtype(checked, jnp.floating) or _quant.is_quantized(checked)):
    raise TypeError(
      f"{name} must be a floating dtype, int8 or float8_e4m3fn, got "
      f"{dtype if checked is None else checked}"
    )
  return checked
