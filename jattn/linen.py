"""Flax Linen: a multi-head attention module built on jattn, and an ``attention_fn`` adapter.

:class:`MultiHeadAttention` has the options of :class:`jattn.nnx.MultiHeadAttention`
and the parameter names of Flax's ``linen.MultiHeadDotProductAttention``
(``query``, ``key``, ``value``, ``out``, and ``query_ln``/``key_ln``), so
the parameters of one load into the other unchanged. Decoding keeps the keys,
values and per-row lengths in the ``cache`` collection.

:func:`attention_fn` plugs jattn into Flax's own module:
``nn.MultiHeadDotProductAttention(..., attention_fn=jattn.linen.attention_fn)``.

Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jattn import _checks, _flax, positional
from jattn import decode as _decode

default_kernel_init = nn.initializers.lecun_normal()


class MultiHeadAttention(nn.Module):
  """Multi-head attention (self or cross) computed by :func:`jattn.dot_product_attention`.

  The fields mean what the arguments of :class:`jattn.nnx.MultiHeadAttention`
  mean; the input width is taken from the first call, as in Flax Linen.

  Decoding: initialise with ``decode=True`` on an input of the full length
  to allocate the cache (``max_length`` = that length), then apply with
  ``mutable=["cache"]``; each ``decode=True`` call appends its tokens (one
  or many, per-row ``num_new`` for ragged rows) and attends causally over the
  cache::

      variables = model.init(rng, jnp.zeros((B, max_length, F)), decode=True)
      cache = variables["cache"]
      y, mutated = model.apply({"params": variables["params"], "cache": cache},
                               prompt, decode=True, mutable=["cache"])
      cache = mutated["cache"]
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  use_bias: bool = True
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False
  deterministic: bool | None = None
  is_causal: bool = False
  rope: positional.Rotary | None = None
  normalize_qk: bool | str = False
  implementation: str | None = None
  backward: str | None = None
  block_q: int | None = None
  block_kv: int | None = None
  sinks: bool = False
  sinks_init: Any = nn.initializers.zeros_init()
  value_head_dim: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  out_kernel_init: Any = None

  def __post_init__(self):
    self._config(None)
    super().__post_init__()

  def _config(self, in_features):
    return _flax.check_config(
      num_heads=self.num_heads,
      in_features=in_features,
      num_kv_heads=self.num_kv_heads,
      qkv_features=self.qkv_features,
      out_features=self.out_features,
      dropout_rate=self.dropout_rate,
      broadcast_dropout=self.broadcast_dropout,
      deterministic=self.deterministic,
      is_causal=self.is_causal,
      rope=self.rope,
      normalize_qk=self.normalize_qk,
      implementation=self.implementation,
      backward=self.backward,
      block_q=self.block_q,
      block_kv=self.block_kv,
      value_head_dim=self.value_head_dim,
    )

  @nn.compact
  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_kv: jax.Array | None = None,
    *,
    mask: Any = None,
    segment_ids: Any = None,
    positions: Any = None,
    deterministic: bool | None = None,
    decode: bool = False,
    num_new: Any = None,
    sow_weights: bool = False,
    dropout_rng: jax.Array | None = None,
  ):
    """As :meth:`jattn.nnx.MultiHeadAttention.__call__`; weights are sown into ``intermediates``."""
    _flax.check_inputs(inputs_q, inputs_kv, None, None)
    heads = self._config(inputs_q.shape[-1])
    cross = inputs_kv is not None
    kv_in = inputs_q if inputs_kv is None else inputs_kv
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
    )
    query = dense(features=(N, H), name="query")(inputs_q)
    key = dense(features=(K, H), name="key")(kv_in)
    value = dense(features=(K, heads.value_head_dim), name="value")(kv_in)
    norm = {
      "rms": nn.RMSNorm,
      "layernorm": functools.partial(nn.LayerNorm, use_bias=False),
      None: None,
    }[_flax.qk_norm_kind(self.normalize_qk)]
    if norm is not None:
      query = norm(dtype=self.dtype, param_dtype=self.param_dtype, name="query_ln")(query)
      key = norm(dtype=self.dtype, param_dtype=self.param_dtype, name="key_ln")(key)

    cache, cache_vars = None, None
    if decode is True:
      initialised = self.has_variable("cache", "cached_key")
      if inputs_q.ndim != 3:
        raise ValueError(f"decode=True needs batched inputs (B, t, F), got {inputs_q.shape}")
      B, T = inputs_q.shape[:2]
      empty = _flax.init_cache(heads, B, T, key.dtype)
      cache_vars = tuple(
        self.variable("cache", name, lambda x=x: x)
        for name, x in (
          ("cached_key", empty.key),
          ("cached_value", empty.value),
          ("cache_lengths", empty.lengths),
        )
      )
      if initialised:
        cache = _decode.KVCache(*(v.value for v in cache_vars))
    # The init pass (decode=True, no cache yet) allocates the cache and attends
    # causally, like Flax; it checks what a non-decode call checks.
    init_pass = decode is True and cache is None
    if init_pass and cross:
      raise ValueError(
        "decode=True does not take inputs_kv: decoding is causal self-attention over the cache"
      )
    _flax.check_call(
      inputs_q=inputs_q,
      cross=cross,
      decode_=False if init_pass else decode,
      cache=cache,
      positions=positions,
      segment_ids=segment_ids,
      num_new=None if init_pass else num_new,
      sow_weights=sow_weights,
      implementation=self.implementation,
      rope=self.rope,
    )
    deterministic = _flax.resolve_deterministic(
      self.dropout_rate, deterministic, self.deterministic
    )
    if not deterministic and dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    sinks = None
    if _checks.boolean("sinks", self.sinks):
      sinks = self.param("sinks", self.sinks_init, (heads.num_heads,), self.param_dtype)
    out, weights, new_cache = _flax.attend(
      query,
      key,
      value,
      heads=heads,
      sinks=sinks,
      is_causal=self.is_causal or (decode is True and cache is None),
      rope=self.rope,
      positions=positions,
      mask=mask,
      segment_ids=segment_ids,
      cache=cache,
      num_new=num_new,
      dropout_rate=0.0 if deterministic else self.dropout_rate,
      dropout_rng=None if deterministic else dropout_rng,
      broadcast_dropout=self.broadcast_dropout,
      implementation=self.implementation,
      backward=self.backward,
      block_q=self.block_q,
      block_kv=self.block_kv,
      sow_weights=bool(sow_weights),
    )
    if weights is not None:
      self.sow("intermediates", "attention_weights", weights)
    if new_cache is not None:
      assert cache_vars is not None  # a new cache comes only from decode=True
      for var, x in zip(cache_vars, new_cache):
        var.value = x
    return nn.DenseGeneral(
      features=heads.out_features,
      axis=(-2, -1),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.out_kernel_init or self.kernel_init,
      bias_init=self.bias_init,
      use_bias=self.use_bias,
      precision=self.precision,
      name="out",
    )(out)


def _sow(module, weights) -> None:
  module.sow("intermediates", "attention_weights", weights)


attention_fn = _flax.make_attention_fn(_sow, "the 'intermediates' collection", __name__)
