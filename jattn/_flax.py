"""What :mod:`jattn.nnx` and :mod:`jattn.linen` share: checks, and attention on projected heads.

The modules differ only in how Flax stores parameters and state. Everything
else lives here as plain functions: constructor checks (raised at
construction), call checks (raised before anything compiles), the attention
step after the q/k/v projections (RoPE, KV cache, the call to
:func:`jattn.dot_product_attention`) and the ``attention_fn=`` adapter for
Flax's own modules. None of it re-implements attention.

Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _quant, attention, decode, positional
from jattn.impl import _select

NORMALIZE_QK = (False, True, "rms", "layernorm")


@dataclasses.dataclass(frozen=True)
class Heads:
  """Checked head layout of a multi-head attention module."""

  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  qkv_features: int  # N·H
  out_features: int
  value_head_dim: int = 0  # Hv (set to H when not given)

  def __post_init__(self):
    if not self.value_head_dim:
      object.__setattr__(self, "value_head_dim", self.head_dim)


def check_config(
  *,
  num_heads,
  in_features,
  num_kv_heads,
  qkv_features,
  out_features,
  in_kv_features=None,
  dropout_rate,
  broadcast_dropout,
  deterministic,
  is_causal,
  rope,
  normalize_qk,
  implementation,
  backward,
  block_q,
  block_kv,
  value_head_dim=None,
) -> Heads | None:
  """Every constructor argument of the modules, checked; raises with a clear message.

  Returns the head layout, or None when neither ``in_features`` nor
  ``qkv_features`` is known yet (Linen, before the first call).
  """
  num_heads = _checks.integer("num_heads", num_heads, minimum=1)
  if in_features is not None:
    in_features = _checks.integer("in_features", in_features, minimum=1)
  if in_kv_features is not None:
    _checks.integer("in_kv_features", in_kv_features, minimum=1)
  num_kv_heads = (
    num_heads if num_kv_heads is None else _checks.integer("num_kv_heads", num_kv_heads, minimum=1)
  )
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
  _checks.dropout_rate(dropout_rate)
  _checks.flags(broadcast_dropout=broadcast_dropout, is_causal=is_causal)
  if deterministic is not None and not isinstance(deterministic, (bool, np.bool_)):
    raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")
  if rope is not None and not isinstance(rope, positional.Rotary):
    raise TypeError(f"rope must be a jattn.positional.Rotary or None, got {type(rope).__name__}")
  if not any(normalize_qk is v or (isinstance(v, str) and normalize_qk == v) for v in NORMALIZE_QK):
    raise ValueError(f"normalize_qk must be one of {list(NORMALIZE_QK)}, got {normalize_qk!r}")
  _select.check_choices(implementation, backward)
  _checks.tile_sizes(implementation, block_q, block_kv)
  if value_head_dim is not None:
    value_head_dim = _checks.integer("value_head_dim", value_head_dim, minimum=1)
  out_features = (
    in_features
    if out_features is None
    else _checks.integer("out_features", out_features, minimum=1)
  )
  if qkv_features is None and in_features is None:
    return None  # Linen infers the widths from the first input
  qkv_features = _checks.integer(
    "qkv_features", in_features if qkv_features is None else qkv_features, minimum=1
  )
  if qkv_features % num_heads:
    raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})")
  head_dim = qkv_features // num_heads
  if rope is not None:
    try:
      rope.check_head_dim(head_dim)
    except ValueError as e:
      raise ValueError(f"rope: {e} (head_dim = qkv_features // num_heads = {head_dim})") from None
  return Heads(num_heads, num_kv_heads, head_dim, qkv_features, out_features, value_head_dim or 0)


def qk_norm_kind(normalize_qk) -> str | None:
  """None, "rms" or "layernorm" for a checked ``normalize_qk``."""
  if normalize_qk is False:
    return None
  return "rms" if normalize_qk is True else normalize_qk


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


# --- KV caches ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheOptions:
  """Checked cache settings: storage dtype (None: the keys' dtype), paging."""

  dtype: np.dtype | None = None
  page_size: int | None = None
  num_pages: int | None = None


def check_cache_options(
  *, dtype_name: str, dtype, page_size, num_pages, implementation, block_kv
) -> CacheOptions:
  """The cache settings of ``init_cache`` (NNX) or the module's fields (Linen), checked.

  A paged or quantized cache is read by blockwise attention alone, in tiles of whole
  pages, so the module's ``implementation`` and ``block_kv`` must allow that.
  """
  dtype = None if dtype is None else _checks.storage_dtype(dtype_name, dtype)
  if page_size is not None:
    page_size = _checks.integer("page_size", page_size, minimum=1, int32=True)
  if num_pages is not None:
    num_pages = _checks.integer("num_pages", num_pages, minimum=1, int32=True)
    if page_size is None:
      raise ValueError(
        f"num_pages applies only to a paged cache: give page_size too, got num_pages={num_pages}"
      )
  kind = " and ".join(
    k
    for k, on in (
      (f"paged (page_size={page_size})", page_size is not None),
      (f"quantized ({dtype_name}={dtype})", dtype is not None and _quant.is_quantized(dtype)),
    )
    if on
  )
  if kind and implementation not in (None, "blockwise"):
    raise ValueError(
      f"a {kind} cache is read by blockwise attention alone, but this module has "
      f"implementation={implementation!r}; use implementation=None or 'blockwise'"
    )
  if page_size is not None and block_kv is not None and block_kv % page_size:
    raise ValueError(
      f"block_kv must be a multiple of page_size={page_size} (a paged cache is read in "
      f"tiles of whole pages), got block_kv={block_kv}"
    )
  return CacheOptions(dtype, page_size, num_pages)


def init_cache(
  heads: Heads, batch_size: int, max_length: int, dtype, options: CacheOptions = CacheOptions()
) -> decode.Cache:
  """An empty cache for ``heads``: contiguous, or paged when ``options.page_size`` is set.

  ``dtype`` is used when ``options.dtype`` is None. A paged cache gives each row
  ``ceil(max_length / page_size)`` pages (its max_length rounded up to whole pages) from a
  pool of ``num_pages`` pages, by default enough for every row to fill; masks sized to
  ``max_length`` still fit it (:func:`jattn.decode.attention` pads them to whole pages).
  """
  batch_size = _checks.integer("batch_size", batch_size, minimum=1)
  max_length = _checks.integer("max_length", max_length, minimum=1)
  dtype = options.dtype if options.dtype is not None else dtype
  layout = dict(dtype=dtype, value_head_dim=heads.value_head_dim)
  if options.page_size is None:
    return decode.init(batch_size, max_length, heads.num_kv_heads, heads.head_dim, **layout)
  pages_per_row = -(-max_length // options.page_size)
  return decode.init_paged(
    batch_size * pages_per_row if options.num_pages is None else options.num_pages,
    options.page_size,
    batch_size,
    pages_per_row,
    heads.num_kv_heads,
    heads.head_dim,
    **layout,
  )


def cache_accepts(cache: decode.Cache, dtype) -> bool:
  """Whether keys of ``dtype`` can be written to ``cache``: its own dtype, or any floating
  dtype for a quantized cache."""
  storage = cache.dtype
  return dtype == storage or (_quant.is_quantized(storage) and jnp.issubdtype(dtype, jnp.floating))


def cache_from(get: Callable[[str], Any]) -> decode.Cache | None:
  """The cache whose fields ``get(field)`` returns (None for absent ones), or None when
  there is none: the modules keep one variable per field of the cache."""
  if get("key_pages") is not None:
    return decode.PagedKVCache(*(get(f) for f in decode.PagedKVCache._fields))
  if get("key") is not None:
    return decode.KVCache(*(get(f) for f in decode.KVCache._fields))
  return None


CACHE_FIELDS = tuple(dict.fromkeys(decode.KVCache._fields + decode.PagedKVCache._fields))


def release(cache: decode.Cache | None, rows) -> decode.Cache:
  """:func:`jattn.decode.release` for a module's cache, which must exist."""
  if cache is None:
    raise ValueError("there is no KV cache to release rows of: call init_cache first")
  return decode.release(cache, rows)


# --- attention_fn adapters ------------------------------------------------------


def _precision_context(precision):
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, (tuple, list)):
    if len(set(precision)) != 1:
      raise ValueError(
        f"precision as a pair must name one precision for both operands, got {precision!r}"
      )
    precision = precision[0]
  if isinstance(precision, jax.lax.Precision):
    precision = {
      jax.lax.Precision.DEFAULT: "default",
      jax.lax.Precision.HIGH: "high",
      jax.lax.Precision.HIGHEST: "highest",
    }[precision]
  if not isinstance(precision, str):
    raise TypeError(f"precision must be None, a jax.lax.Precision or its name, got {precision!r}")
  return jax.default_matmul_precision(precision)


def _flatten_batch(x, batch_dims: tuple[int, ...], rank: int):
  """Broadcast-compatible ``x`` (mask/bias over [batch..., N, T, S]) as rank-4 (B, N, T, S)."""
  if x is None:
    return None
  x = x if hasattr(x, "shape") else np.asarray(x)
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


def make_attention_fn(sow: Callable, collection: str, module_name: str) -> Callable:
  """Flax's ``attention_fn`` contract on top of :func:`jattn.dot_product_attention`.

  ``sow(module, weights)`` stores the weights when Flax passes ``module``;
  ``collection`` names where, for the docstring. Layout [batch..., T, N, H];
  extra batch dimensions are flattened.
  """

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    *,
    implementation: str | None = None,
    backward: str | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    logits_soft_cap: float | None = None,
    score_fn: Callable | None = None,
    sinks=None,
  ):
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


def _unflatten(x, batch_dims):
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
