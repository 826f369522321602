"""Flax NNX: a multi-head attention module built on jattn, and an ``attention_fn`` adapter.

:class:`MultiHeadAttention` is a superset of Flax's ``nnx.MultiHeadAttention``: the same
arguments (positional and keyword, Flax's defaults and meanings), ``init_cache(input_shape,
dtype)`` and parameter tree (``query``, ``key``, ``value``, ``out``, ``query_ln``,
``key_ln``), so swapping the class changes nothing else and a checkpoint of one loads into
the other. On top: GQA/MQA, RoPE, segment ids, a choice of implementation and backward
rule, and a KV cache taking one or many tokens per call with ragged rows: contiguous or
paged, float or int8/float8 (:meth:`MultiHeadAttention.init_cache`), finished rows released
for new requests (:meth:`MultiHeadAttention.release_cache`).

:func:`attention_fn` plugs jattn into Flax's own module:
``nnx.MultiHeadAttention(..., attention_fn=jattn.nnx.attention_fn)``.
:class:`HopfieldLayer` is a modern Hopfield layer with learnable stored patterns, on top
of :func:`jattn.hopfield.retrieve`. Shape legend as in :mod:`jattn.attention`; F is a
feature size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import astuple
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.attention import dot_product_attention_weights as _flax_weights

from jattn import _checks, positional
from jattn import decode as _decode
from jattn._validate.options import Options
from jattn.flax import _adapter as _flax_adapter
from jattn.flax import _cache as _flax_cache
from jattn.flax import _call as _flax_call
from jattn.flax import _config as _flax_config
from jattn.flax import _nnx_cache as _nnx_cache
from jattn.flax._nnx_hopfield import HopfieldLayer as HopfieldLayer

__all__ = ["MultiHeadAttention", "attention_fn", "HopfieldLayer"]

default_kernel_init = nnx.initializers.lecun_normal()

_RAGGED_REMEDY = "call init_cache(..., ragged=True) (or page_size=...)"


class MultiHeadAttention(nnx.Module):
  """Multi-head attention (self or cross) computed by :func:`jattn.dot_product_attention`.

  Takes every argument of Flax's ``nnx.MultiHeadAttention``, positional and keyword,
  with Flax's defaults and meanings; the ones this module reads differently:

  Args:
    num_heads: N, the number of query heads.
    in_features: F of ``inputs_q``.
    qkv_features: N·H, the query width (default ``in_features``); H = qkv_features // N.
    out_features: output width (default ``in_features``).
    num_kv_heads: K, heads of keys and values (default N); N % K == 0 (GQA, MQA when 1).
    in_kv_features: F of ``inputs_k`` and ``inputs_v`` (default ``in_features``).
    broadcast_dropout, dropout_rate: dropout on the attention weights, one pattern shared
      across batch rows and heads when ``broadcast_dropout``.
    deterministic, decode: defaults of the call's arguments of those names.
    attention_fn: None for jattn's attention with the settings below, or a function
      with Flax's ``attention_fn`` contract that computes it instead (then no
      ``implementation``, ``backward``, tiles, ``sinks``, ``segment_ids`` or ``decode``).
    normalize_qk: normalise each query and key head before the product: True or
      ``"layernorm"`` (LayerNorm without bias, as in Flax), ``"rms"`` (RMSNorm), or False.
    rngs: ``nnx.Rngs`` for the parameters and, with dropout, a ``dropout`` stream,
      kept for the calls unless ``keep_rngs`` is False.
    is_causal: (jattn's, like those below) causal self-attention, query t seeing keys
      s <= t; the default of the call's ``is_causal``.
    rope: a :class:`jattn.positional.Rotary` applied to queries and keys, or None.
    implementation, backward, block_q, block_kv, options: as in
      :func:`jattn.dot_product_attention` (the module keeps them as ``options``).
    sinks: learn one sink logit per query head (``self.sinks``, shape (num_heads,),
      initialised by ``sinks_init``, zeros by default), passed as ``sinks`` to the
      attention call: each head may put weight on "nothing" (gpt-oss, StreamingLLM).
    value_head_dim: the value projection's width per head, Hv (default: the
      query/key head dim, qkv_features // num_heads); the output projection
      reads num_heads · Hv features (MLA-style heads).
    sow_max_logit: sow each query row's largest logit (B, T, N), float32, as
      ``nnx.Intermediate`` ``max_logit`` (the default of the call's argument of that name):
      what QK-clip reads (:func:`jattn.qk_clip_scales`). Off by default.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jattn.nnx
    >>> mha = jattn.nnx.MultiHeadAttention(4, 32, num_kv_heads=2, is_causal=True,
    ...                                    rope=jattn.positional.Rotary(), rngs=nnx.Rngs(0))
    >>> mha(jnp.ones((2, 10, 32))).shape
    (2, 10, 32)
  """

  # Set in __init__; None until there is one (no QK norm).
  query_ln: Any
  key_ln: Any

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    broadcast_dropout: bool = True,
    dropout_rate: float = 0.0,
    deterministic: bool | None = None,
    precision: Any = None,
    kernel_init: Any = default_kernel_init,
    out_kernel_init: Any = None,
    bias_init: Any = nnx.initializers.zeros_init(),
    out_bias_init: Any = None,
    use_bias: bool = True,
    attention_fn: Any = None,
    decode: bool | None = None,
    normalize_qk: bool | str = False,
    qkv_promote_dtype: Any = nnx_dtypes.promote_dtype,
    out_promote_dtype: Any = nnx_dtypes.promote_dtype,
    ln_promote_dtype: Any = nnx_dtypes.promote_dtype,
    qkv_dot_general: Any = None,
    out_dot_general: Any = None,
    qkv_dot_general_cls: Any = None,
    out_dot_general_cls: Any = None,
    rngs: nnx.Rngs,
    keep_rngs: bool = True,
    kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
    out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
    bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    is_causal: bool = False,
    rope: positional.Rotary | None = None,
    implementation: str | None = None,
    backward: str | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    options: Options | None = None,
    sinks: bool = False,
    sinks_init: Any = nnx.initializers.zeros_init(),
    value_head_dim: int | None = None,
    sow_max_logit: bool = False,
  ):
    heads = _flax_config.Config(
      num_heads=num_heads,
      in_features=in_features,
      num_kv_heads=num_kv_heads,
      qkv_features=qkv_features,
      out_features=out_features,
      dropout_rate=dropout_rate,
      broadcast_dropout=broadcast_dropout,
      deterministic=deterministic,
      is_causal=is_causal,
      rope=rope,
      normalize_qk=normalize_qk,
      implementation=implementation,
      backward=backward,
      block_q=block_q,
      block_kv=block_kv,
      options=options,
      value_head_dim=value_head_dim,
      decode=decode,
      attention_fn=attention_fn,
      sinks=sinks,
      sow_max_logit=sow_max_logit,
      in_kv_features=in_kv_features,
    ).check()
    assert heads is not None  # None only without in_features, which Linen infers
    self.heads, self.head_dim = heads, heads.head_dim
    self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
    self.in_features = in_features
    self.in_kv_features = in_features if in_kv_features is None else in_kv_features
    self.qkv_features, self.out_features = heads.qkv_features, heads.out_features
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    self.use_bias, self.attention_fn, self.decode = use_bias, attention_fn, decode
    self.dropout_rate, self.broadcast_dropout = float(dropout_rate), bool(broadcast_dropout)
    self.deterministic, self.is_causal = deterministic, bool(is_causal)
    self.rope, self.normalize_qk, self.sow_max_logit = rope, normalize_qk, sow_max_logit
    self.options = Options.of(
      options, implementation=implementation, backward=backward, block_q=block_q, block_kv=block_kv
    )
    self.implementation, self.backward, self.block_q, self.block_kv = astuple(self.options)
    common: Any = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision)
    linear: Any = functools.partial(
      nnx.LinearGeneral,
      **common,
      kernel_init=kernel_init,
      bias_init=bias_init,
      promote_dtype=qkv_promote_dtype,
      dot_general=qkv_dot_general,
      dot_general_cls=qkv_dot_general_cls,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      rngs=rngs,
    )
    H = heads.head_dim
    self.query = linear(in_features, (heads.num_heads, H))
    self.key = linear(self.in_kv_features, (heads.num_kv_heads, H))
    self.value = linear(self.in_kv_features, (heads.num_kv_heads, heads.value_head_dim))
    sink_logits = sinks_init(rngs.params(), (heads.num_heads,), param_dtype) if sinks else None
    self.sinks = nnx.data(None) if sink_logits is None else nnx.Param(sink_logits)
    norm = _qk_norm(normalize_qk, H, dtype, param_dtype, ln_promote_dtype, rngs)
    if norm is None:
      self.query_ln = self.key_ln = nnx.data(None)
    else:
      self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
      self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
    self.out = nnx.LinearGeneral(
      (heads.num_heads, heads.value_head_dim),
      heads.out_features,
      axis=(-2, -1),
      **common,
      kernel_init=out_kernel_init or kernel_init,
      bias_init=out_bias_init or bias_init,
      promote_dtype=out_promote_dtype,
      dot_general=out_dot_general,
      dot_general_cls=out_dot_general_cls,
      kernel_metadata=out_kernel_metadata or kernel_metadata,
      bias_metadata=out_bias_metadata or bias_metadata,
      rngs=rngs,
    )
    self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
    _nnx_cache.store(self, {})  # cached_key, cached_value, cache_index, ...: None until init_cache

  def init_cache(
    self,
    input_shape: Any = None,
    dtype: Any = None,
    *,
    batch_size: int | tuple[int, ...] | None = None,
    max_length: int | None = None,
    page_size: int | None = None,
    num_pages: int | None = None,
    ragged: bool = False,
  ) -> None:
    """Allocate an empty KV cache of ``max_length`` tokens per row for ``decode=True`` calls.

    ``init_cache(input_shape, dtype)`` as in Flax, or ``init_cache(batch_size=B,
    max_length=L)`` (also ``init_cache(B, L)``). Calling it again starts a new, empty cache.

    Args:
      input_shape: (batch..., max_length, F), e.g. a full-length input's shape: the rows
        (any number of batch dimensions, or none) decoded together, each holding at most
        max_length tokens.
      dtype: the stored keys' and values' dtype (default: the module's dtype, or
        float32); ``jnp.int8`` or ``jnp.float8_e4m3fn`` quantizes them on write, with
        a float32 scale per token and head (inference only: no gradients reach the
        cache), and the module may compute in any floating dtype.
      batch_size, max_length: the batch dimensions (an int or a tuple) and max_length,
        in place of ``input_shape``.
      page_size: None for a contiguous cache (:func:`jattn.decode.init`), or the slots
        per page of a paged one (:func:`jattn.decode.init_paged`): each row gets
        ``ceil(max_length / page_size)`` pages, taken from a shared pool as it grows. A
        ``mask`` sized to ``max_length`` fits either cache (the slots past it stay masked).
      num_pages: the pool's size, with ``page_size`` (default: enough for every row to
        fill); a smaller pool is the point of paging when rows finish at different
        lengths: see :meth:`release_cache`.
      ragged: keep one length per row, for calls with ``num_new`` (right-padded prompts
        of different lengths) and :meth:`release_cache`; a paged cache always does. It
        takes exactly one batch dimension.

    The cache's arrays are ``nnx.Cache`` attributes. A contiguous cache has Flax's:
    ``cached_key`` and ``cached_value`` ([batch..., max_length, K, H]) and
    ``cache_index`` (how many tokens every row holds), which step by step hold what Flax's
    module's hold; a ragged one ``cache_lengths`` (B,) in place of ``cache_index``; a
    paged one ``cached_key_pages``, ``cached_value_pages``, ``page_table``,
    ``free_pages`` and ``cache_lengths``; a quantized one adds ``cached_key_scale`` and
    ``cached_value_scale``. :attr:`cache` gives them back as one :mod:`jattn.decode`
    cache. A paged or quantized cache is read by blockwise attention alone, so the
    module's ``implementation`` must be None or ``"blockwise"`` (and ``block_kv`` a
    multiple of ``page_size``).
    """
    batch_dims, max_length, dtype = _flax_cache.size(input_shape, dtype, batch_size, max_length)
    options = _flax_cache.check_cache_options(
      dtype_name="dtype",
      dtype=dtype,
      page_size=page_size,
      num_pages=num_pages,
      implementation=self.implementation,
      block_kv=self.block_kv,
      ragged=ragged,
    )
    default = jnp.float32 if self.query.dtype is None else self.query.dtype
    _nnx_cache.store(
      self, _flax_cache.init_cache(self.heads, batch_dims, max_length, default, options)
    )

  def set_view(
    self,
    deterministic: bool | None = None,
    decode: bool | None = None,
    batch_size: int | tuple[int] | None = None,
    max_length: int | None = None,
    sow_max_logit: bool | None = None,
  ) -> None:
    """For ``nnx.view``, as Flax's: set ``deterministic`` and ``decode``; with
    ``batch_size`` and ``max_length``, a module without a cache allocates one; jattn's
    ``sow_max_logit`` (every attention layer of a model at once)."""
    if sow_max_logit is not None:
      self.sow_max_logit = _checks.boolean("sow_max_logit", sow_max_logit)
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
    if decode and self.cache is None and (batch_size, max_length) != (None, None):
      self.init_cache(batch_size=batch_size, max_length=max_length)

  @property
  def cache(self) -> _decode.Cache | None:
    """The KV cache, a :class:`jattn.decode.KVCache` or :class:`jattn.decode.PagedKVCache`,
    or None before :meth:`init_cache`: its rows are the cache variables' batch dimensions,
    flattened, and each row's length is ``cache_index`` (Flax's cache) or its own."""
    held = _nnx_cache.held(self)
    return None if held is None else held.cache

  def release_cache(self, rows: jax.typing.ArrayLike) -> None:
    """Empty the cache rows where ``rows`` (bool (B,)) is True, for continuous batching.

    A released row restarts at length 0 (the next ``decode=True`` call writes a new
    request there; pass ``num_new`` with 0 for rows that should not advance) and, in a
    paged cache, its pages go back to the pool. Other rows are unchanged. Works under
    ``nnx.jit``; see :func:`jattn.decode.release`.
    """
    _nnx_cache.write(self, _flax_cache.release(_nnx_cache.held(self), rows, _RAGGED_REMEDY))

  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    inputs_kv: jax.Array | None = None,
    mask: Any = None,
    deterministic: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    sow_weights: bool = False,
    decode: bool | None = None,
    is_causal: bool | None = None,
    sow_max_logit: bool | None = None,
    out_sharding: Any = None,
    qkv_sharding: Any = None,
    input_positions: Any = None,
    segment_ids: Any = None,
    positions: Any = None,
    num_new: Any = None,
  ) -> jax.Array:
    """Attend from ``inputs_q`` to ``inputs_k`` and ``inputs_v`` (default: itself).

    Flax's arguments with Flax's meanings, then jattn's.

    Args:
      inputs_q: (batch..., T, F): any number of batch dimensions (B below), or none.
      inputs_k, inputs_v: (batch..., S, F_kv) for cross-attention; ``inputs_v``
        defaults to ``inputs_k``, and ``inputs_kv`` gives both.
      mask: an array broadcastable to (batch..., N, T, S) whose non-zero entries attend
        (Flax's reading: ``nnx.make_causal_mask`` gives float32 ones), or a
        :class:`jattn.masks.Mask`; combined with ``is_causal``.
      deterministic: True turns dropout off (default: the constructor's).
      rngs: dropout rng (default: the stream forked at construction).
      sow_weights: store the attention weights (B, N, T, S) as ``nnx.Intermediate``
        ``attention_weights``; needs ``implementation`` "xla" or None.
      decode: append the tokens to the KV cache (see :meth:`init_cache`) and attend
        causally over everything cached, with each row's own offset (default: the
        constructor's, else False); any number of tokens per call.
      is_causal: causal attention (default: the constructor's); ignored by ``decode``.
      sow_max_logit: sow each query row's largest logit, (B, T, N) float32, as
        ``nnx.Intermediate`` ``max_logit`` (default: the constructor's); a statistic, no
        gradient flows through it.
      out_sharding: the output projection's ``out_sharding``: a PartitionSpec or
        NamedSharding of the (B, T, out_features) output, for meshes with Explicit axes
        (``jax.set_mesh``). None: what JAX infers from the inputs.
      qkv_sharding: the same for the query, key and value projections' outputs,
        (B, T, N, H), (B, S, K, H) and (B, S, K, Hv), e.g. ``P("data", None, "model",
        None)`` for heads sharded over ``"model"``.
      input_positions: Flax's name for ``positions``, or passed to ``attention_fn``.
      segment_ids: packed-sequence ids, as in :func:`jattn.dot_product_attention`.
      positions: (T,) or (B, T) token positions for RoPE (default 0..T-1).
      num_new: with ``decode``, an int array (B,): row b appends only its first
        ``num_new[b]`` tokens (right-padded ragged prompts); the others' outputs are zeros.

    Returns:
      (B, T, out_features) or (T, out_features).
    """
    settings = _flax_config.Settings.of(self)
    x = _flax_call.inputs(
      inputs_q, inputs_k, inputs_v, inputs_kv, self.in_features, self.in_kv_features
    )
    _flax_call.check_shardings(inputs_q.ndim, qkv_sharding, out_sharding)
    decode = _flax_config.resolve("decode", decode, self.decode)
    is_causal = _flax_config.resolve("is_causal", is_causal, self.is_causal)
    sow_max = _flax_config.resolve("sow_max_logit", sow_max_logit, self.sow_max_logit)
    positions = _flax_call.rope_positions(positions, input_positions, self.attention_fn)
    _flax_call.check_inputs(x)
    held = _nnx_cache.held(self) if decode else None
    _flax_call.check_call(
      settings,
      inputs=x,
      decode_=decode,
      cache=held,
      positions=positions,
      segment_ids=segment_ids,
      num_new=num_new,
      sow_weights=sow_weights,
      remedy=_RAGGED_REMEDY,
    )
    deterministic = _flax_call.resolve_deterministic(
      self.dropout_rate, deterministic, self.deterministic
    )
    dropout_rng = None if deterministic else self._dropout_rng(rngs)

    query, key, value = (
      proj(a, out_sharding=qkv_sharding)
      for proj, a in ((self.query, x.q), (self.key, x.k), (self.value, x.v))
    )
    if self.query_ln is not None:
      query, key = self.query_ln(query), self.key_ln(key)
    self._check_cache_dtype(held, key.dtype, inputs_q.dtype)
    flax_kwargs: dict[str, Any] = dict(  # Flax's call's keywords, as its module gives them
      dropout_rng=dropout_rng,
      deterministic=deterministic,
      dtype=self.dtype,
      precision=self.precision,
      module=self if sow_weights else None,
    )
    flax_attention = None
    if jnp.issubdtype(query.dtype, jnp.complexfloating) and self.attention_fn is None:
      flax_attention = functools.partial(
        _flax_materialised,
        dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        **flax_kwargs,
      )
    if input_positions is not None:
      flax_kwargs["input_positions"] = input_positions
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
      dropout_rng=dropout_rng,
      sinks=None if self.sinks is None else self.sinks[...],
      sow_weights=bool(sow_weights),
      attention_fn=_flax_call.bind_attention_fn(settings, is_causal=is_causal, **flax_kwargs),
      flax_attention=flax_attention,
      flax_why=f"{query.dtype} inputs",
      sow_max_logit=sow_max,
    )
    for name, sown in (("attention_weights", got.weights), ("max_logit", got.max_logit)):
      if sown is not None:
        self.sow(nnx.Intermediate, name, sown)
    if got.variables is not None:
      _nnx_cache.write(self, got.variables)  # the cache's new variables
    return self.out(got.out, out_sharding=out_sharding)

  def _check_cache_dtype(self, held: Any, dtype: Any, inputs_dtype: Any) -> None:
    """The keys of ``dtype`` fit the cache (None: none held) as it was made."""
    name = _flax_cache.dtype_name
    _flax_cache.check_dtype(
      None if held is None else held.cache,
      dtype,
      origin=" (init_cache's dtype)",
      settings=f"module dtype={name(self.query.dtype)}, "
      f"param_dtype={name(self.query.param_dtype)}, inputs {inputs_dtype}",
      remedy="call init_cache(input_shape, dtype={dtype})",
    )

  def _dropout_rng(self, rngs: nnx.Rngs | nnx.RngStream | None) -> jax.Array:
    """A dropout key from the call's ``rngs``, else from the stream kept at construction."""
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
    if stream is None:
      raise ValueError(
        "dropout needs an rng: construct with nnx.Rngs(..., dropout=...) or pass rngs= to the call"
      )
    return stream()


def _qk_norm(
  normalize_qk: bool | str, H: int, dtype: Any, param_dtype: Any, promote_dtype: Any, rngs: Any
) -> Any:
  """The q/k norm's constructor for H features (``scale_metadata`` left to give), or None."""
  norm: Any = {
    "rms": nnx.RMSNorm,
    "layernorm": functools.partial(nnx.LayerNorm, use_bias=False),
    None: None,
  }[_flax_config.qk_norm_kind(normalize_qk)]
  if norm is None:
    return None
  kw = dict(dtype=dtype, param_dtype=param_dtype, promote_dtype=promote_dtype, rngs=rngs)
  return functools.partial(norm, H, **kw)


def _flax_materialised(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: Any = None,
  *,
  mask: Any,
  precision: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """Flax NNX's materialised attention (its ``dot_product_attention`` when it sows or drops
  out): Flax's weights, then their product with the values. The module runs it for complex
  inputs, which Flax's other branch hands to ``jax.nn.dot_product_attention``, casting them
  to real; its ``attention_fn`` adapter too."""
  weights = _flax_weights(query, key, bias, mask, precision=precision, **kwargs)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def _sow(module: nnx.Module, weights: jax.Array) -> None:
  module.sow(nnx.Intermediate, "attention_weights", weights)


attention_fn = _flax_adapter.make_attention_fn(
  _sow, "nnx.Intermediate", __name__, _flax_materialised, linen=False
)
