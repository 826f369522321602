"""Flax Linen: multi-head attention modules built on jattn, and an ``attention_fn`` adapter.

:class:`MultiHeadDotProductAttention` is a superset of Flax's
``linen.MultiHeadDotProductAttention``, and :class:`MultiHeadAttention` and
:class:`SelfAttention` of Flax's classes of those names: their fields and call arguments,
with Flax's defaults and meanings, their parameter tree (``query``, ``key``, ``value``,
``out``, and ``query_ln``/``key_ln``) and their class names, so an unnamed submodule gets
Flax's automatic name (``MultiHeadDotProductAttention_0``, ...), swapping the class changes
nothing else and the parameters of one load into the other unchanged; on top, the options
of :class:`jattn.nnx.MultiHeadAttention`. Decoding keeps Flax's ``cache`` collection
(``cached_key``, ``cached_value``, ``cache_index``) and, as jattn's additions, caches with
a length per row (``ragged_cache``), paged (``page_size``) and/or quantized
(``cache_dtype`` int8 or float8_e4m3fn); :func:`release_cache` empties finished rows of a
model's whole cache collection.

:func:`attention_fn` plugs jattn into Flax's own module:
``nn.MultiHeadDotProductAttention(..., attention_fn=jattn.linen.attention_fn)``.

Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, overload

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.attention import dot_product_attention as _flax_dot_product_attention

from jattn import positional
from jattn._validate.keywords import Routing, names
from jattn._validate.options import Options
from jattn.flax import _adapter as _flax_adapter
from jattn.flax import _cache as _flax_cache
from jattn.flax import _call as _flax_call
from jattn.flax import _config as _flax_config

__all__ = [
  "MultiHeadDotProductAttention",
  "MultiHeadAttention",
  "SelfAttention",
  "release_cache",
  "attention_fn",
]

default_kernel_init = nn.initializers.lecun_normal()

_RAGGED_REMEDY = "make the module with ragged_cache=True (or a paged cache, page_size=...)"


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention (self or cross) computed by :func:`jattn.dot_product_attention`.

  A superset of Flax's ``linen.MultiHeadDotProductAttention``: its fields, in its order,
  with its defaults and meanings (``normalize_qk`` True is Flax's LayerNorm, ``"rms"``
  RMSNorm; ``attention_fn`` None is jattn's attention, a function with Flax's contract
  computes it instead; ``force_fp32_for_softmax`` makes the sown weights float32, as
  Flax's, jattn's softmax being float32 always), then jattn's fields, which mean what the
  arguments of :class:`jattn.nnx.MultiHeadAttention` mean. The parameters are Flax's, and
  the input width is taken from the first call, as in Flax. Inputs are
  [batch_sizes..., length, features], any number of batch dimensions or none; a mask is
  an array broadcastable to [batch_sizes..., num_heads, q_length, kv_length] whose
  non-zero entries attend (Flax's ``make_causal_mask`` and ``make_attention_mask`` give
  float32 ones), or a :class:`jattn.masks.Mask`. What jattn's kernels do not take runs
  Flax's own materialised ``dot_product_attention``: complex inputs, and the einsum
  factories ``qk_attn_weights_einsum_cls`` / ``attn_weights_value_einsum_cls``.

  Decoding, as in Flax: initialise with ``decode=True`` on an input of the full length,
  which allocates the ``cache`` collection (``max_length`` = the keys' length) and
  attends as a call without ``decode`` does; then apply with ``mutable=["cache"]``: each
  ``decode=True`` call appends its tokens (one, as in Flax, or many) and attends causally
  over the cache. ``decode`` is a field, as in Flax, and a call argument that overrides
  it::

      variables = model.init(rng, jnp.zeros((B, max_length, F)), decode=True)
      cache = variables["cache"]
      y, mutated = model.apply({"params": variables["params"], "cache": cache},
                               prompt, decode=True, mutable=["cache"])
      cache = mutated["cache"]

  The collection holds Flax's variables, ``cached_key`` and ``cached_value``
  ([batch_sizes..., max_length, K, H]) and ``cache_index`` (the tokens every row holds),
  step by step the values Flax's module holds. jattn's fields shape other caches:
  ``ragged_cache`` keeps one length per row, ``cache_lengths`` (B,), in place of
  ``cache_index``, for calls with ``num_new`` (right-padded prompts of different
  lengths) and :func:`release_cache`; ``cache_dtype``, ``page_size`` and ``num_pages`` as
  the arguments of :meth:`jattn.nnx.MultiHeadAttention.init_cache` (``cache_dtype`` None:
  the keys' dtype): ``page_size`` set gives a paged cache (with a length per row) whose
  rows hold ``max_length`` rounded up to whole pages, from a pool of ``num_pages`` pages
  (default: enough for every row to fill), in ``cached_key_pages``,
  ``cached_value_pages``, ``page_table``, ``free_pages`` and ``cache_lengths``; a
  quantized cache adds ``cached_key_scale`` and ``cached_value_scale``. A ``mask`` sized
  to ``max_length`` fits any of them (the slots past it stay masked).
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
  sow_max_logit: bool = False
  cache_dtype: Any = None
  page_size: int | None = None
  num_pages: int | None = None
  ragged_cache: bool = False

  def __post_init__(self) -> None:
    self._config(None)
    self._cache_options()
    einsums = ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
    given = [name for name in einsums if getattr(self, name) is not None]
    if len(given) == 1:
      raise ValueError(
        f"{given[0]} needs its partner: qk_attn_weights_einsum_cls and "
        "attn_weights_value_einsum_cls are given together, as in Flax"
      )
    jattn_attention = {name: getattr(self, name) for name in names(Routing)}
    jattn_attention["sinks"] = self.sinks or None
    for name, value in jattn_attention.items():
      if given and self.attention_fn is None and value is not None:
        raise ValueError(
          f"{name}={value!r} applies to jattn's attention, but the einsum factories "
          f"({given[0]}) run Flax's materialised attention in its place"
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
      ragged_name="ragged_cache",
      ragged=self.ragged_cache,
    )

  # The heads: always once in_features is known; before the first call, None unless
  # qkv_features is set.
  @overload
  def _config(self, in_features: int) -> _flax_config.Heads: ...
  @overload
  def _config(self, in_features: None) -> _flax_config.Heads | None: ...
  def _config(self, in_features: int | None) -> _flax_config.Heads | None:
    return _flax_config.Config.of(self, in_features).check()

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
    sow_max_logit: bool | None = None,
  ) -> jax.Array:
    """As :meth:`jattn.nnx.MultiHeadAttention.__call__`, with Flax Linen's arguments
    (``dropout_rng`` in place of ``rngs``); weights, and max logits with
    ``sow_max_logit``, are sown into ``intermediates``."""
    x = _flax_call.inputs(inputs_q, inputs_k, inputs_v, inputs_kv, None, None, linen=True)
    heads = self._config(inputs_q.shape[-1])
    settings = _flax_config.Settings.of(self)
    decode = _flax_config.resolve("decode", decode, self.decode)
    is_causal = _flax_config.resolve("is_causal", is_causal, self.is_causal)
    sow_max = _flax_config.resolve("sow_max_logit", sow_max_logit, self.sow_max_logit)
    query, key, value = self._project(x, heads)
    # After the projections, which raise Flax's errors for inputs of the wrong width.
    _flax_call.check_inputs(x)
    held, cache_vars = self._cache(heads, key) if decode else (None, {})
    decode_step = held is not None
    init_pass = decode and not decode_step
    _flax_call.check_call(
      settings,
      inputs=x,
      decode_=decode_step,
      cache=held,
      positions=positions,
      segment_ids=segment_ids,
      num_new=None if init_pass else num_new,  # the init pass writes nothing
      sow_weights=sow_weights,
      remedy=_RAGGED_REMEDY,
    )
    dtype_name = _flax_cache.dtype_name
    _flax_cache.check_dtype(
      None if held is None else held.cache,
      key.dtype,
      origin="",
      settings=f"dtype={dtype_name(self.dtype)}, param_dtype={dtype_name(self.param_dtype)}, "
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
    flax_kwargs, flax_attention = self._flax_calls(
      settings, query, dropout_rng, deterministic, sow_weights
    )
    complex_ = jnp.issubdtype(query.dtype, jnp.complexfloating)
    causal: dict[str, Any] = dict(is_causal=True) if is_causal else {}
    got = _flax_call.attend(
      query,
      key,
      value,
      settings,
      is_causal=is_causal,
      positions=positions,
      mask=mask,
      segment_ids=segment_ids,
      cache=held,
      num_new=num_new,
      dropout_rng=None if deterministic else dropout_rng,
      sinks=sinks,
      sow_weights=bool(sow_weights),
      attention_fn=_flax_call.bind_attention_fn(  # Flax's call, as Linen's module makes it
        settings,
        only_taken=True,
        **flax_kwargs,
        **causal,
      ),
      flax_attention=flax_attention,
      flax_why=f"{query.dtype} inputs" if complex_ else "the einsum factories",
      fp32_weights=self.force_fp32_for_softmax,
      sow_max_logit=sow_max,
    )
    for name, sown in (("attention_weights", got.weights), ("max_logit", got.max_logit)):
      if sown is not None:
        self.sow("intermediates", name, sown)
    for var_name, a in (got.variables or {}).items():
      cache_vars[var_name].value = a
    return self._out(got.out, heads)

  def _out(self, out: jax.Array, heads: _flax_config.Heads) -> jax.Array:
    """The output projection of the heads (Flax's parameter ``out``)."""
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

  def _flax_calls(
    self,
    settings: _flax_config.Settings,
    query: jax.Array,
    dropout_rng: jax.Array | None,
    deterministic: bool,
    sow_weights: bool,
  ) -> tuple[dict[str, Any], Any]:
    """The keywords of Flax's calls (an ``attention_fn``'s, Flax's own attention's), and
    Flax's materialised attention with them bound where it computes what jattn's kernels do
    not take (complex inputs, the einsum factories), else None."""
    einsums = {
      name[:-4]: getattr(self, name)() if getattr(self, name) else None
      for name in ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
    }
    flax_kwargs: dict[str, Any] = dict(
      dropout_rng=dropout_rng,
      deterministic=deterministic,
      dtype=self.dtype,
      precision=self.precision,
      force_fp32_for_softmax=self.force_fp32_for_softmax,
      **einsums,
      **(dict(module=self) if sow_weights else {}),
    )
    complex_ = jnp.issubdtype(query.dtype, jnp.complexfloating)
    if settings.attention_fn is not None or not (complex_ or einsums["qk_attn_weights_einsum"]):
      return flax_kwargs, None
    flax_attention = functools.partial(
      _flax_dot_product_attention,
      dropout_rate=settings.dropout_rate,
      broadcast_dropout=settings.broadcast_dropout,
      **flax_kwargs,
    )
    return flax_kwargs, flax_attention

  def _project(
    self, x: _flax_call.Inputs, heads: _flax_config.Heads
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The query, key and value heads of the inputs (Flax's parameters ``query``, ``key``,
    ``value``), the q/k norm applied (``query_ln``, ``key_ln``)."""
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
    return query, key, value

  def _cache(
    self, heads: _flax_config.Heads, key: jax.Array
  ) -> tuple[_flax_cache.Held | None, dict[str, Any]]:
    """A ``decode=True`` call's cache, and its variables by name: the ``cache`` collection
    as held; or, at the first such call (init), the collection allocated for keys of this
    length, and None (the call attends as one without decode, as Flax's does)."""
    if self.has_variable("cache", "cached_key") or self.has_variable("cache", "cached_key_pages"):
      cache_vars: dict[str, Any] = {
        name: self.variable("cache", name)
        for name in _flax_cache.VARIABLES
        if self.has_variable("cache", name)
      }
      return _flax_cache.held(
        lambda n: cache_vars[n].value if n in cache_vars else None
      ), cache_vars
    if not jnp.issubdtype(key.dtype, jnp.complexfloating):
      empty = _flax_cache.init_cache(
        heads, key.shape[:-3], key.shape[-3], key.dtype, self._cache_options()
      )
      for name, a in empty.items():
        self.variable("cache", name, lambda a=a: a)
    return None, {}


class MultiHeadAttention(MultiHeadDotProductAttention):
  """:class:`MultiHeadDotProductAttention` under the name of Flax's ``linen.MultiHeadAttention``,
  its alias: the same module, whose unnamed instances are named ``MultiHeadAttention_0``,
  ... (Flax's automatic names come from the class name, and so do checkpoints' paths and
  the rngs made by name)."""


class SelfAttention(MultiHeadDotProductAttention):
  """Self-attention: :class:`MultiHeadDotProductAttention` called on ``inputs_q`` alone,
  as Flax's ``linen.SelfAttention`` (deprecated there, and so here: each call warns as
  Flax's does). Unnamed instances are named ``SelfAttention_0``, ..."""

  @nn.compact
  def __call__(  # type: ignore[override]
    self,
    inputs_q: jax.Array,
    mask: Any = None,
    deterministic: bool | None = None,
    dropout_rng: jax.Array | None = None,
    sow_weights: bool = False,
    *,
    decode: bool | None = None,
    is_causal: bool | None = None,
    segment_ids: Any = None,
    positions: Any = None,
    num_new: Any = None,
  ) -> jax.Array:
    """Flax's arguments, in Flax's order, then jattn's (keyword-only), as in
    :meth:`MultiHeadDotProductAttention.__call__`."""
    warnings.warn(
      "SelfAttention will be deprecated soon. Use "
      "`MultiHeadDotProductAttention.__call__(inputs_q)` instead (as Flax's SelfAttention "
      "says).",
      DeprecationWarning,
      stacklevel=2,
    )
    return super().__call__(
      inputs_q,
      mask=mask,
      deterministic=deterministic,
      dropout_rng=dropout_rng,
      sow_weights=sow_weights,
      decode=decode,
      is_causal=is_causal,
      segment_ids=segment_ids,
      positions=positions,
      num_new=num_new,
    )


# The variable of the ``cache`` collection holding each field of a jattn.decode cache.
CACHE_NAMES = _flax_cache.NAMES


def release_cache(cache: Mapping[str, Any], rows: jax.typing.ArrayLike) -> dict[str, Any]:
  """A model's ``cache`` collection with rows emptied in every attention cache.

  For continuous batching: the rows where ``rows`` (bool (B,)) is True restart at
  length 0, so the next ``decode=True`` apply writes a new request there (pass
  ``num_new`` with 0 for rows that should not advance), and in a paged cache their
  pages go back to the pool. Other rows are unchanged. ``cache`` is
  ``variables["cache"]`` of the whole model, nested by submodule; each attention cache
  in it (the variables of a module made with ``ragged_cache=True`` or ``page_size``) is
  released with :func:`jattn.decode.release`, anything else is returned as it is, and a
  cache of Flax's layout, whose one ``cache_index`` counts the tokens of every row, raises
  ValueError. Pure, and runs under ``jax.jit``::

      cache = jattn.linen.release_cache(cache, finished)
  """
  if not isinstance(cache, Mapping):
    raise TypeError(f"cache must be a cache collection (a mapping), got {type(cache).__name__}")
  return _release(cache, rows, "")


def _release(cache: Mapping[str, Any], rows: jax.typing.ArrayLike, path: str) -> dict[str, Any]:
  found = None
  if _flax_cache.NAMES["key"] in cache or _flax_cache.NAMES["key_pages"] in cache:
    found = _flax_cache.held(cache.get)
  if found is not None:
    return dict(cache) | _flax_cache.release(
      found, rows, f"the cache at {path or 'the top'!r}: {_RAGGED_REMEDY}"
    )
  return {
    name: _release(sub, rows, f"{path}/{name}".lstrip("/")) if isinstance(sub, Mapping) else sub
    for name, sub in cache.items()
  }


def _sow(module: nn.Module, weights: jax.Array) -> None:
  module.sow("intermediates", "attention_weights", weights)


attention_fn = _flax_adapter.make_attention_fn(
  _sow, "the 'intermediates' collection", __name__, _flax_dot_product_attention, linen=True
)
