"""Flax NNX: a multi-head attention module built on jattn, and an ``attention_fn`` adapter.

:class:`MultiHeadAttention` keeps the parameter layout of Flax's
``nnx.MultiHeadAttention`` (submodules ``query``, ``key``, ``value``, ``out``
and, with ``normalize_qk``, ``query_ln`` and ``key_ln``), so the parameters
of one load into the other with ``nnx.update(ours, nnx.state(theirs,
nnx.Param))``. On top it has GQA/MQA, RoPE, segment ids, a choice of
implementation and backward rule, and a KV cache that takes one or many
tokens per call (chunked prefill) with ragged rows: contiguous or paged, float
or quantized to int8/float8 (:meth:`MultiHeadAttention.init_cache`), with
finished rows released for new requests (:meth:`MultiHeadAttention.release_cache`).

:func:`attention_fn` plugs jattn into Flax's own module:
``nnx.MultiHeadAttention(..., attention_fn=jattn.nnx.attention_fn)``.

:class:`HopfieldLayer` is a modern Hopfield layer with learnable stored
patterns, on top of :func:`jattn.hopfield.retrieve`.

Shape legend as in :mod:`jattn.attention`; F is a feature size.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import _checks, _flax_adapter, _flax_cache, _flax_call, _flax_config, positional
from jattn import decode as _decode
from jattn._nnx_hopfield import HopfieldLayer as HopfieldLayer

__all__ = ["MultiHeadAttention", "attention_fn", "HopfieldLayer"]

default_kernel_init = nnx.initializers.lecun_normal()


class MultiHeadAttention(nnx.Module):
  """Multi-head attention (self or cross) computed by :func:`jattn.dot_product_attention`.

  Args:
    num_heads: N, the number of query heads.
    in_features: F of ``inputs_q``.
    num_kv_heads: K, heads of keys and values (default N); N % K == 0 (GQA, MQA when 1).
    qkv_features: N·H, the query width (default ``in_features``); H = qkv_features // N.
    out_features: output width (default ``in_features``).
    in_kv_features: F of ``inputs_kv`` (default ``in_features``).
    use_bias: biases in the four projections.
    dropout_rate: dropout on the attention weights.
    broadcast_dropout: share one dropout pattern across batch rows and heads.
    deterministic: default for the call's ``deterministic`` (dropout off when True).
    is_causal: causal self-attention (query t sees keys s <= t).
    rope: a :class:`jattn.positional.Rotary` applied to queries and keys, or None.
    normalize_qk: normalise each query and key head before the product:
      True or ``"rms"`` (RMSNorm), ``"layernorm"`` (LayerNorm without bias,
      Flax's ``normalize_qk=True``), or False.
    implementation, backward, block_q, block_kv: as in
      :func:`jattn.dot_product_attention`.
    sinks: learn one sink logit per query head (``self.sinks``, shape
      (num_heads,)), passed as ``sinks`` to the attention call: each head may
      put weight on "nothing" (gpt-oss, StreamingLLM). ``sinks_init``
      initialises it (zeros by default).
    value_head_dim: the value projection's width per head, Hv (default: the
      query/key head dim, qkv_features // num_heads); the output projection
      reads num_heads · Hv features (MLA-style heads).
    dtype: computation dtype (default: inferred); param_dtype: parameter dtype.
    precision, kernel_init, bias_init, out_kernel_init: of the projections.
    rngs: ``nnx.Rngs`` for the parameters and, with dropout, a ``dropout`` stream.

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
    *,
    num_kv_heads: int | None = None,
    qkv_features: int | None = None,
    out_features: int | None = None,
    in_kv_features: int | None = None,
    use_bias: bool = True,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = False,
    deterministic: bool | None = None,
    is_causal: bool = False,
    rope: positional.Rotary | None = None,
    normalize_qk: bool | str = False,
    implementation: str | None = None,
    backward: str | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    sinks: bool = False,
    sinks_init: Any = nnx.initializers.zeros_init(),
    value_head_dim: int | None = None,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Any = default_kernel_init,
    bias_init: Any = nnx.initializers.zeros_init(),
    out_kernel_init: Any = None,
    rngs: nnx.Rngs,
  ):
    heads = _flax_config.check_config(
      num_heads=num_heads,
      in_features=in_features,
      num_kv_heads=num_kv_heads,
      qkv_features=qkv_features,
      out_features=out_features,
      in_kv_features=in_kv_features,
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
      value_head_dim=value_head_dim,
    )
    assert heads is not None  # None only without in_features, which Linen infers
    self.heads = heads
    self.num_heads, self.num_kv_heads, self.head_dim = (
      heads.num_heads,
      heads.num_kv_heads,
      heads.head_dim,
    )
    self.in_features = in_features
    self.in_kv_features = in_features if in_kv_features is None else in_kv_features
    self.dropout_rate = float(dropout_rate)
    self.broadcast_dropout = bool(broadcast_dropout)
    self.deterministic = deterministic
    self.is_causal = bool(is_causal)
    self.rope = rope
    self.normalize_qk = normalize_qk
    self.implementation, self.backward = implementation, backward
    self.block_q, self.block_kv = block_q, block_kv

    linear = functools.partial(
      nnx.LinearGeneral,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    H = heads.head_dim
    self.query = linear(in_features, (heads.num_heads, H))
    self.key = linear(self.in_kv_features, (heads.num_kv_heads, H))
    self.value = linear(self.in_kv_features, (heads.num_kv_heads, heads.value_head_dim))
    self.sinks = (
      nnx.Param(sinks_init(rngs.params(), (heads.num_heads,), param_dtype))
      if _checks.boolean("sinks", sinks)
      else nnx.data(None)
    )
    norm = {
      "rms": nnx.RMSNorm,
      "layernorm": functools.partial(nnx.LayerNorm, use_bias=False),
      None: None,
    }[_flax_config.qk_norm_kind(normalize_qk)]
    if norm is None:
      self.query_ln = self.key_ln = nnx.data(None)
    else:
      self.query_ln = norm(H, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.key_ln = norm(H, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.out = nnx.LinearGeneral(
      (heads.num_heads, heads.value_head_dim),
      heads.out_features,
      axis=(-2, -1),
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=out_kernel_init or kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None
    self._set_cache(None)

  def init_cache(
    self,
    batch_size: int,
    max_length: int,
    *,
    dtype: Any = None,
    page_size: int | None = None,
    num_pages: int | None = None,
  ) -> None:
    """Allocate an empty KV cache of ``max_length`` tokens per row for ``decode=True`` calls.

    Calling it again starts a new, empty cache.

    Args:
      batch_size: B, the rows decoded together.
      max_length: the most tokens a row holds.
      dtype: the stored keys' and values' dtype (default: the module's dtype, or
        float32); ``jnp.int8`` or ``jnp.float8_e4m3fn`` quantizes them on write, with
        a float32 scale per token and head (inference only: no gradients reach the
        cache), and the module may compute in any floating dtype.
      page_size: None for a contiguous cache (:func:`jattn.decode.init`), or the
        slots per page of a paged one (:func:`jattn.decode.init_paged`): each row gets
        ``ceil(max_length / page_size)`` pages (its max_length rounded up to whole
        pages), taken from a shared pool as it grows. A ``mask`` of ``decode=True``
        calls sized to ``max_length`` fits either cache (the slots past it stay
        masked).
      num_pages: the pool's size, with ``page_size`` (default: enough for every row to
        fill, ``batch_size * ceil(max_length / page_size)``); a smaller pool is the point
        of paging when rows finish at different lengths: see :meth:`release_cache`.

    A paged or quantized cache is read by blockwise attention alone, so the module's
    ``implementation`` must be None or ``"blockwise"`` (and ``block_kv`` a multiple of
    ``page_size``). The cache's arrays are ``nnx.Cache`` variables named after its
    fields (``cache_key``, ``cache_lengths``, ``cache_page_table``, ``cache_free``,
    ``cache_key_scale``, ...); :attr:`cache` gives them back as one cache.
    """
    options = _flax_cache.check_cache_options(
      dtype_name="dtype",
      dtype=dtype,
      page_size=page_size,
      num_pages=num_pages,
      implementation=self.implementation,
      block_kv=self.block_kv,
    )
    default = jnp.float32 if self.query.dtype is None else self.query.dtype
    self._set_cache(_flax_cache.init_cache(self.heads, batch_size, max_length, default, options))

  def _set_cache(self, cache: _decode.Cache | None) -> None:
    """One ``nnx.Cache`` per array of ``cache`` (``cache_key``, ``cache_lengths``,
    ``cache_page_table``, ...), None for the fields it lacks."""
    held = {} if cache is None else cache._asdict()
    for field in _flax_cache.CACHE_FIELDS:
      x = held.get(field)
      setattr(self, f"cache_{field}", nnx.data(None) if x is None else nnx.Cache(x))

  def _write_cache(self, cache: _decode.Cache) -> None:
    """Store a cache of the held one's kind and shapes into its variables."""
    for field, x in cache._asdict().items():
      if x is not None:
        getattr(self, f"cache_{field}")[...] = x

  @property
  def cache(self) -> _decode.Cache | None:
    """The KV cache, a :class:`jattn.decode.KVCache` or :class:`jattn.decode.PagedKVCache`,
    or None before :meth:`init_cache`."""

    def get(field):
      var = getattr(self, f"cache_{field}")
      return None if var is None else var[...]

    return _flax_cache.cache_from(get)

  def release_cache(self, rows: jax.typing.ArrayLike) -> None:
    """Empty the cache rows where ``rows`` (bool (B,)) is True, for continuous batching.

    A released row restarts at length 0 (the next ``decode=True`` call writes a new
    request there; pass ``num_new`` with 0 for rows that should not advance) and, in a
    paged cache, its pages go back to the pool. Other rows are unchanged. Works under
    ``nnx.jit``; see :func:`jattn.decode.release`.
    """
    self._write_cache(_flax_cache.release(self.cache, rows))

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
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    out_sharding: Any = None,
    qkv_sharding: Any = None,
  ):
    """Attend from ``inputs_q`` to ``inputs_kv`` (default: itself).

    Args:
      inputs_q: (B, T, F) or (T, F).
      inputs_kv: (B, S, F_kv) or (S, F_kv) for cross-attention, or None.
      mask: boolean array broadcastable to (B, N, T, S) or a
        :class:`jattn.masks.Mask`, combined with ``is_causal``.
      segment_ids: packed-sequence ids, as in :func:`jattn.dot_product_attention`.
      positions: (T,) or (B, T) token positions for RoPE (default 0..T-1).
      deterministic: True turns dropout off (default: the constructor's).
      decode: append the tokens to the KV cache (see :meth:`init_cache`)
        and attend causally over everything cached, with each row's own
        offset. Any number of tokens per call: a whole prompt, chunks of
        one, or one token per step.
      num_new: with ``decode``, an int array (B,): row b appends only its
        first ``num_new[b]`` tokens (right-padded ragged prompts); the other
        rows' outputs are zeros.
      sow_weights: store the attention weights (B, N, T, S) as
        ``nnx.Intermediate`` ``attention_weights``; materialises them, so it
        needs ``implementation`` "xla" or None.
      rngs: dropout rng (default: the stream forked at construction).
      out_sharding: the sharding of the output, passed to the output projection's
        ``out_sharding`` (as in Flax's ``nnx.MultiHeadAttention``): a PartitionSpec or
        NamedSharding of the (B, T, out_features) output, for meshes with Explicit
        axes (``jax.set_mesh``). None: what JAX infers from the inputs.
      qkv_sharding: the same for the query, key and value projections' outputs,
        (B, T, N, H), (B, S, K, H) and (B, S, K, Hv): one spec for all three, e.g.
        ``P("data", None, "model", None)`` for heads sharded over ``"model"``.

    Returns:
      (B, T, out_features) or (T, out_features).
    """
    cross = inputs_kv is not None
    _flax_call.check_inputs(inputs_q, inputs_kv, self.in_features, self.in_kv_features)
    batch = "B, " if inputs_q.ndim == 3 else ""
    _flax_call.check_sharding("qkv_sharding", qkv_sharding, f"({batch}T, N, H)")
    _flax_call.check_sharding("out_sharding", out_sharding, f"({batch}T, F)")
    cache = self.cache if decode is True else None
    _flax_call.check_call(
      inputs_q=inputs_q,
      cross=cross,
      decode_=decode,
      cache=cache,
      positions=positions,
      segment_ids=segment_ids,
      num_new=num_new,
      sow_weights=sow_weights,
      implementation=self.implementation,
      rope=self.rope,
    )
    deterministic = _flax_call.resolve_deterministic(
      self.dropout_rate, deterministic, self.deterministic
    )
    dropout_rng = None
    if not deterministic:
      stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
      if stream is None:
        raise ValueError(
          "dropout needs an rng: construct with nnx.Rngs(..., dropout=...) or "
          "pass rngs= to the call"
        )
      dropout_rng = stream()

    kv_in = inputs_q if inputs_kv is None else inputs_kv
    query, key, value = (
      proj(x, out_sharding=qkv_sharding)
      for proj, x in ((self.query, inputs_q), (self.key, kv_in), (self.value, kv_in))
    )
    if self.query_ln is not None:
      query, key = self.query_ln(query), self.key_ln(key)
    name = _flax_cache.dtype_name
    _flax_cache.check_dtype(
      cache,
      key.dtype,
      origin=" (init_cache's dtype)",
      settings=f"module dtype={name(self.query.dtype)}, "
      f"param_dtype={name(self.query.param_dtype)}, inputs {inputs_q.dtype}",
      remedy="call init_cache(batch_size, max_length, dtype={dtype})",
    )
    out, weights, new_cache = _flax_call.attend(
      query,
      key,
      value,
      heads=self.heads,
      is_causal=self.is_causal,
      rope=self.rope,
      positions=positions,
      mask=mask,
      segment_ids=segment_ids,
      cache=cache,
      num_new=num_new,
      dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
      dropout_rng=dropout_rng,
      broadcast_dropout=self.broadcast_dropout,
      implementation=self.implementation,
      backward=self.backward,
      block_q=self.block_q,
      block_kv=self.block_kv,
      sinks=None if self.sinks is None else self.sinks[...],
      sow_weights=bool(sow_weights),
    )
    if weights is not None:
      self.sow(nnx.Intermediate, "attention_weights", weights)
    if new_cache is not None:
      self._write_cache(new_cache)
    return self.out(out, out_sharding=out_sharding)


def _sow(module, weights) -> None:
  module.sow(nnx.Intermediate, "attention_weights", weights)


attention_fn = _flax_adapter.make_attention_fn(_sow, "nnx.Intermediate", __name__)
