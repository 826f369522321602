"""Flax Linen: a multi-head attention module built on jattn, and an ``attention_fn`` adapter.

:class:`MultiHeadAttention` is a superset of Flax's ``linen.MultiHeadDotProductAttention``:
its fields and call arguments, with Flax's defaults and meanings, and its parameter
tree (``query``, ``key``, ``value``, ``out``, and ``query_ln``/``key_ln``), so
swapping the class changes nothing else and the parameters of one load into the
other unchanged; on top, the options of :class:`jattn.nnx.MultiHeadAttention`.
Decoding keeps the keys, values and per-row lengths in the ``cache`` collection:
contiguous, or paged (``page_size``) and/or quantized (``cache_dtype`` int8 or
float8_e4m3fn); :func:`release_cache` empties finished rows of a model's whole cache
collection.

:func:`attention_fn` plugs jattn into Flax's own module:
``nn.MultiHeadDotProductAttention(..., attention_fn=jattn.linen.attention_fn)``.

Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, overload

import jax
import jax.numpy as jnp
from flax import linen as nn

from jattn import _flax_adapter, _flax_cache, _flax_call, _flax_config, positional
from jattn import decode as _decode
from jattn._options import Options

__all__ = ["MultiHeadAttention", "release_cache", "attention_fn"]

default_kernel_init = nn.initializers.lecun_normal()


class MultiHeadAttention(nn.Module):
  """Multi-head attention (self or cross) computed by :func:`jattn.dot_product_attention`.

  A superset of Flax's ``linen.MultiHeadDotProductAttention``: its fields, in its order,
  with its defaults and meanings (``normalize_qk`` True is Flax's LayerNorm, ``"rms"``
  RMSNorm; ``attention_fn`` None is jattn's attention, a function with Flax's contract
  computes it instead; ``force_fp32_for_softmax`` and the einsum factories go to that
  function, jattn's softmax being float32 always), then jattn's fields, which mean what
  the arguments of :class:`jattn.nnx.MultiHeadAttention` mean. The parameters are Flax's,
  and the input width is taken from the first call, as in Flax.

  Decoding: initialise with ``decode=True`` on an input of the full length
  to allocate the cache (``max_length`` = that length), then apply with
  ``mutable=["cache"]``; each ``decode=True`` call appends its tokens (one
  or many, per-row ``num_new`` for ragged rows) and attends causally over the
  cache. ``decode`` is a field, as in Flax, and a call argument that overrides it::

      variables = model.init(rng, jnp.zeros((B, max_length, F)), decode=True)
      cache = variables["cache"]
      y, mutated = model.apply({"params": variables["params"], "cache": cache},
                               prompt, decode=True, mutable=["cache"])
      cache = mutated["cache"]

  The fields ``cache_dtype``, ``page_size`` and ``num_pages`` shape that cache as the
  arguments of :meth:`jattn.nnx.MultiHeadAttention.init_cache` do (``cache_dtype``
  None: the keys' dtype): ``page_size`` set gives a paged cache whose rows hold
  ``max_length`` rounded up to whole pages, from a pool of ``num_pages`` pages
  (default: enough for every row to fill); a ``mask`` sized to ``max_length`` fits it
  as it fits a contiguous cache (the slots past it stay masked). Variables of the
  collection, one per array of the :mod:`jattn.decode` cache: ``cached_key``,
  ``cached_value`` (contiguous) or ``cached_key_pages``, ``cached_value_pages``,
  ``page_table``, ``free_pages`` (paged); ``cache_lengths``; ``cached_key_scale``,
  ``cached_value_scale`` (quantized).
  """

  num_heads: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  broadcast_dropout: bool = True
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  precision: Any = None
  kernel_init: Any = default_kernel_init
  out_kernel_init: Any = None
  bias_init: Any = nn.initializers.zeros_init()
  out_bias_init: Any = None
  use_bias: bool = True
  attention_fn: Any = None
  decode: bool = False
  normalize_qk: bool | str = False
  force_fp32_for_softmax: bool = False
  qkv_dot_general: Any = None
  out_dot_general: Any = None
  qkv_dot_general_cls: Any = None
  out_dot_general_cls: Any = None
  qk_attn_weights_einsum_cls: Any = None
  attn_weights_value_einsum_cls: Any = None
  # jattn's
  num_kv_heads: int | None = None
  is_causal: bool = False
  rope: positional.Rotary | None = None
  implementation: str | None = None
  backward: str | None = None
  block_q: int | None = None
  block_kv: int | None = None
  options: Options | None = None
  sinks: bool = False
  sinks_init: Any = nn.initializers.zeros_init()
  value_head_dim: int | None = None
  cache_dtype: Any = None
  page_size: int | None = None
  num_pages: int | None = None

  def __post_init__(self) -> None:
    self._config(None)
    self._cache_options()
    for name in ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls"):
      if getattr(self, name) is not None and self.attention_fn is None:
        raise ValueError(
          f"{name} applies to an attention_fn that takes einsum factories; jattn's "
          "attention (attention_fn=None) takes none"
        )
    super().__post_init__()

  def _cache_options(self) -> _flax_cache.CacheOptions:
    options = _flax_config.Settings.of(self).options
    return _flax_cache.check_cache_options(
      dtype_name="cache_dtype",
      dtype=self.cache_dtype,
      page_size=self.page_size,
      num_pages=self.num_pages,
      implementation=options.implementation,
      block_kv=options.block_kv,
    )

  # The heads: always once in_features is known; before the first call, None unless
  # qkv_features is set.
  @overload
  def _config(self, in_features: int) -> _flax_config.Heads: ...
  @overload
  def _config(self, in_features: None) -> _flax_config.Heads | None: ...
  def _config(self, in_features: int | None) -> _flax_config.Heads | None:
    return _flax_config.check_config(
      in_features=in_features,
      **{name: getattr(self, name) for name in _flax_config.CONFIG},
    )

  @nn.compact
  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    inputs_kv: jax.Array | None = None,
    mask: Any = None,
    deterministic: bool | None = None,
    dropout_rng: jax.Array | None = None,
    sow_weights: bool = False,
    decode: bool | None = None,
    is_causal: bool | None = None,
    segment_ids: Any = None,
    positions: Any = None,
    num_new: Any = None,
  ) -> jax.Array:
    """As :meth:`jattn.nnx.MultiHeadAttention.__call__`, with Flax Linen's arguments
    (``dropout_rng`` in place of ``rngs``); weights are sown into ``intermediates``."""
    x = _flax_call.inputs(inputs_q, inputs_k, inputs_v, inputs_kv, None, None)
    heads = self._config(inputs_q.shape[-1])
    settings = _flax_config.Settings.of(self)
    decode = _flax_config.resolve("decode", decode, self.decode)
    is_causal = _flax_config.resolve("is_causal", is_causal, self.is_causal)
    N, K, H = heads.num_heads, heads.num_kv_heads, heads.head_dim
    dense = functools.partial(
      nn.DenseGeneral,
      axis=-1,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.kernel_init,
      bias_init=self.bias_init,
      use_bias=self.use_bias,
      precision=self.precision,
      dot_general=self.qkv_dot_general,
      dot_general_cls=self.qkv_dot_general_cls,
    )
    query = dense(features=(N, H), name="query")(x.q)
    key = dense(features=(K, H), name="key")(x.k)
    value = dense(features=(K, heads.value_head_dim), name="value")(x.v)
    norm = {
      "rms": nn.RMSNorm,
      "layernorm": functools.partial(nn.LayerNorm, use_bias=False),
      None: None,
    }[_flax_config.qk_norm_kind(self.normalize_qk)]
    if norm is not None:
      query = norm(dtype=self.dtype, param_dtype=self.param_dtype, name="query_ln")(query)
      key = norm(dtype=self.dtype, param_dtype=self.param_dtype, name="key_ln")(key)

    cache: _decode.Cache | None = None
    cache_vars: dict[str, Any] = {}  # the cache collection's variables, by cache field
    if decode:
      if inputs_q.ndim != 3:
        raise ValueError(f"decode=True needs batched inputs (B, t, F), got {inputs_q.shape}")
      if self.has_variable("cache", CACHE_NAMES["lengths"]):
        cache_vars = {
          field: self.variable("cache", name)
          for field, name in CACHE_NAMES.items()
          if self.has_variable("cache", name)
        }
        cache = _flax_cache.cache_from(lambda f: cache_vars[f].value if f in cache_vars else None)
      else:
        B, T = inputs_q.shape[:2]
        empty = _flax_cache.init_cache(heads, B, T, key.dtype, self._cache_options())
        cache_vars = {
          field: self.variable("cache", CACHE_NAMES[field], lambda x=x: x)
          for field, x in empty._asdict().items()
          if x is not None
        }
    # The init pass (decode=True, no cache yet) allocates the cache and attends
    # causally, like Flax; it checks what a non-decode call checks.
    init_pass = decode and cache is None
    if init_pass and x.kv_name is not None:
      raise ValueError(
        f"decode=True does not take {x.kv_name}: decoding is causal self-attention over the cache"
      )
    _flax_call.check_call(
      settings,
      inputs_q=inputs_q,
      kv_name=x.kv_name,
      decode_=False if init_pass else decode,
      cache=cache,
      positions=positions,
      segment_ids=segment_ids,
      num_new=None if init_pass else num_new,
      sow_weights=sow_weights,
    )
    name = _flax_cache.dtype_name
    _flax_cache.check_dtype(
      cache,
      key.dtype,
      origin="",
      settings=f"dtype={name(self.dtype)}, param_dtype={name(self.param_dtype)}, "
      f"inputs {inputs_q.dtype}",
      remedy="set cache_dtype={dtype} (or None: the keys' dtype at the init pass)",
    )
    deterministic = _flax_call.resolve_deterministic(
      self.dropout_rate, deterministic, self.deterministic
    )
    if not deterministic and dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    sinks = None
    if self.sinks:
      sinks = self.param("sinks", self.sinks_init, (heads.num_heads,), self.param_dtype)
    einsums = {
      name[:-4]: getattr(self, name)() if getattr(self, name) else None
      for name in ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
    }
    out, weights, new_cache = _flax_call.attend(
      query,
      key,
      value,
      settings,
      is_causal=is_causal or init_pass,
      positions=positions,
      mask=mask,
      segment_ids=segment_ids,
      cache=cache,
      num_new=num_new,
      dropout_rng=None if deterministic else dropout_rng,
      sinks=sinks,
      sow_weights=bool(sow_weights),
      attention_fn=_flax_call.bind_attention_fn(  # Flax's call, as Linen's module makes it
        settings,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        dtype=self.dtype,
        precision=self.precision,
        only_taken=True,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        **einsums,
        **(dict(module=self) if sow_weights else {}),
        **(dict(is_causal=True) if is_causal else {}),
      ),
    )
    if weights is not None:
      self.sow("intermediates", "attention_weights", weights)
    if new_cache is not None:
      assert cache_vars  # a new cache comes only from decode=True
      for field, x in new_cache._asdict().items():
        if x is not None:
          cache_vars[field].value = x
    return nn.DenseGeneral(
      features=heads.out_features,
      axis=(-2, -1),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.out_kernel_init or self.kernel_init,
      bias_init=self.out_bias_init or self.bias_init,
      use_bias=self.use_bias,
      precision=self.precision,
      dot_general=self.out_dot_general,
      dot_general_cls=self.out_dot_general_cls,
      name="out",
    )(out)


# The ``cache`` collection's variable for each field of a jattn.decode cache.
CACHE_NAMES = {
  "key": "cached_key",
  "value": "cached_value",
  "key_pages": "cached_key_pages",
  "value_pages": "cached_value_pages",
  "page_table": "page_table",
  "lengths": "cache_lengths",
  "free": "free_pages",
  "key_scale": "cached_key_scale",
  "value_scale": "cached_value_scale",
}
assert set(CACHE_NAMES) == set(_flax_cache.CACHE_FIELDS)


def release_cache(cache: Mapping[str, Any], rows: jax.typing.ArrayLike) -> dict[str, Any]:
  """A model's ``cache`` collection with rows emptied in every jattn attention cache.

  For continuous batching: the rows where ``rows`` (bool (B,)) is True restart at
  length 0, so the next ``decode=True`` apply writes a new request there (pass
  ``num_new`` with 0 for rows that should not advance), and in a paged cache their
  pages go back to the pool. Other rows are unchanged. ``cache`` is
  ``variables["cache"]`` of the whole model, nested by submodule; each
  :class:`MultiHeadAttention`'s cache in it is released with
  :func:`jattn.decode.release`, anything else is returned as it is. Pure, and runs
  under ``jax.jit``::

      cache = jattn.linen.release_cache(cache, finished)
  """
  if not isinstance(cache, Mapping):
    raise TypeError(f"cache must be a cache collection (a mapping), got {type(cache).__name__}")
  if CACHE_NAMES["lengths"] in cache:
    names = {field: name for field, name in CACHE_NAMES.items() if name in cache}
    held = _flax_cache.cache_from(lambda f: cache[names[f]] if f in names else None)
    if held is not None:
      released = _decode.release(held, rows)
      return dict(cache) | {names[f]: x for f, x in released._asdict().items() if x is not None}
  return {
    name: release_cache(sub, rows) if isinstance(sub, Mapping) else sub
    for name, sub in cache.items()
  }


def _sow(module: nn.Module, weights: jax.Array) -> None:
  module.sow("intermediates", "attention_weights", weights)


attention_fn = _flax_adapter.make_attention_fn(_sow, "the 'intermediates' collection", __name__)
