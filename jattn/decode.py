"""A functional key/value cache for autoregressive decoding and chunked prefill.

Shape legend as in :mod:`jattn.attention`; here T is the number of new tokens
in one call (written ``t``) and the cache holds up to ``max_length`` key/value
positions per batch row.

A :class:`KVCache` is a pytree of fixed shape: the keys and values written so
far, ``(B, max_length, K, H)`` each, and ``lengths`` ``(B,)``, how many
positions of each row hold tokens. Every call returns a new cache (nothing is
mutated), so a jitted decode step takes the cache as an argument and is traced
once for all steps. Rows are ragged: each has its own length. A prompt batch
right-padded to ``t`` tokens is written with ``num_new`` = the prompt lengths;
the padding is not written and padded query rows return zeros.

:func:`attention` writes the ``t`` new keys and values, then lets query ``i``
of row ``b`` (absolute position ``lengths[b] + i``) attend to cache slots
``j <= lengths[b] + i``, with ``lengths`` taken before the write. So a
prefill, a prefill cut into chunks and one-token decode steps are the same
call and give the same outputs as causal attention over the whole sequence.

Slots past a row's length never reach the result: they are masked and read as
zeros, so garbage there (NaN included) cannot leak into outputs or gradients.

Overflow: a row cannot hold more than ``max_length`` tokens. When the lengths
and ``num_new`` are concrete (eager calls), writing past ``max_length`` raises
ValueError. Under ``jax.jit`` they are traced and cannot be checked: tokens
past ``max_length`` are dropped and the lengths saturate at ``max_length``.
Check ``cache.lengths`` on the host between steps, or wrap the step with
``jax.experimental.checkify``, if a request may run that long.

Masks and score functions given to :func:`attention` see ``q_idx`` as the
index within the new chunk (0 .. t-1) and ``kv_idx`` as the cache slot, which
is the absolute position. Position-dependent ones (ALiBi, relative biases,
sliding windows) must shift the query index by the row's old length::

    lengths = cache.lengths
    shifted = lambda s, b, h, q, kv: alibi(s, b, h, q + lengths[b], kv)

Positional encodings of the new keys and queries are the caller's: use
:func:`positions` for their absolute positions (e.g. for RoPE).

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import decode
    >>> cache = decode.init(2, 16, 2, 8)  # B=2, max_length=16, K=2, H=8
    >>> q, kv = jnp.ones((2, 5, 4, 8)), jnp.ones((2, 5, 2, 8))  # N=4: GQA
    >>> out, cache = decode.attention(q, kv, kv, cache)  # prefill 5 tokens
    >>> out, cache = decode.attention(q[:, :1], kv[:, :1], kv[:, :1], cache)  # one step
    >>> cache.lengths
    Array([6, 6], dtype=int32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, masks
from jattn.attention import dot_product_attention


class KVCache(NamedTuple):
  """Keys and values of the tokens seen so far; a pytree of fixed shape.

  Attributes:
    key: (B, max_length, K, H); slots at or past ``lengths[b]`` are unused.
    value: (B, max_length, K, Hv), same dtype as key; Hv is H unless the cache
      was made with ``value_head_dim``.
    lengths: (B,) int32, the number of tokens written to each row.
  """

  key: jax.Array
  value: jax.Array
  lengths: jax.Array

  @property
  def max_length(self) -> int:
    """How many tokens each row can hold."""
    return self.key.shape[1]


def init(
  batch_size: int,
  max_length: int,
  num_kv_heads: int,
  head_dim: int,
  *,
  dtype: Any = jnp.float32,
  value_head_dim: int | None = None,
) -> KVCache:
  """An empty cache: zero keys (B, max_length, K, H) and values (B, max_length, K, Hv),
  lengths 0; Hv is ``value_head_dim``, default ``head_dim``."""
  B, S, K, H = (
    _checks.integer(name, n, minimum=1)
    for name, n in (
      ("batch_size", batch_size),
      ("max_length", max_length),
      ("num_kv_heads", num_kv_heads),
      ("head_dim", head_dim),
    )
  )
  Hv = H if value_head_dim is None else _checks.integer("value_head_dim", value_head_dim, minimum=1)
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a floating dtype, got {dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype, got {dtype}")
  return KVCache(
    jnp.zeros((B, S, K, H), dtype), jnp.zeros((B, S, K, Hv), dtype), jnp.zeros((B,), jnp.int32)
  )


def positions(cache: KVCache, num_new: int) -> jax.Array:
  """Absolute positions (B, num_new) int32 of the next ``num_new`` tokens of each row.

  ``positions[b, i] = cache.lengths[b] + i``: what RoPE or learned position
  embeddings of the new queries and keys need, before :func:`update`.
  """
  _check_cache(cache)
  num_new = _checks.integer("num_new", num_new, minimum=0)
  lengths = cache.lengths.astype(jnp.int32)
  return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def update(
  cache: KVCache,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  num_new: jax.typing.ArrayLike | None = None,
) -> KVCache:
  """Write new keys and values after each row's last token.

  Args:
    cache: the cache to extend (not modified).
    key: (B, t, K, H) keys of the t new tokens, the cache's dtype, 1 <= t <= max_length.
    value: (B, t, K, H) their values.
    num_new: None (all t tokens of every row are real) or an int array (B,)
      with ``0 <= num_new[b] <= t``: row b writes only its first
      ``num_new[b]`` tokens (right-padded ragged prompts). Traced values are
      clipped to [0, t].

  Returns:
    The new cache: row b holds the tokens at slots ``lengths[b] ...
    lengths[b] + num_new[b] - 1`` and ``lengths[b] += num_new[b]``.

  Raises ValueError when the lengths and num_new are concrete and a row would
  exceed ``max_length``. When they are traced (inside jit) this cannot be
  checked: tokens past ``max_length`` are dropped and the row's length
  saturates at ``max_length`` (check ``cache.lengths`` on the host, or use
  ``jax.experimental.checkify``).
  """
  _check_cache(cache)
  key, value, num_new = _check_new(cache, key, value, num_new)
  return _write(cache, key, value, num_new)


def attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cache: KVCache,
  *,
  num_new: jax.typing.ArrayLike | None = None,
  scale: float | None = None,
  bias: jax.typing.ArrayLike | None = None,
  mask: jax.typing.ArrayLike | masks.Mask | None = None,
  score_fn: Callable | None = None,
  logits_soft_cap: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  implementation: str | None = None,
  backward: str | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  return_residual: bool = False,
  sinks: jax.typing.ArrayLike | None = None,
):
  """Causal attention of t new tokens over the cache, after writing their keys and values.

  Query ``i`` of row ``b`` sits at position ``cache.lengths[b] + i`` and
  attends to cache slots ``j <= cache.lengths[b] + i``: its own token and
  everything before it. Prefill, chunked prefill and one-token decode steps
  are all this call.

  Args:
    query: (B, t, N, H), already position-encoded; N a multiple of K.
    key: (B, t, K, H), the new tokens' keys, already position-encoded.
    value: (B, t, K, H).
    cache: the :class:`KVCache` before this call; query, key and value must
      have its B, K, H and dtype.
    num_new: None or int array (B,): as in :func:`update`; query rows at or
      past ``num_new[b]`` are padding and return zeros.
    scale, score_fn, logits_soft_cap, dropout_rate, dropout_rng: as in
      :func:`jattn.dot_product_attention`, and so are broadcast_dropout,
      implementation, backward, block_q, block_kv, return_residual and
      sinks (per-head sink logits (N,)).
      ``score_fn`` sees ``q_idx`` within the chunk and ``kv_idx`` as the
      cache slot (see the module docstring).
      ``"cudnn"`` is not available: the cache mask is an index mask.
    bias: float array broadcastable to (B, N, t, max_length), added to the logits.
    mask: a :class:`jattn.masks.Mask` or boolean array broadcastable to
      (B, N, t, max_length), combined with the causal cache mask by ``&``.
      Index-based masks see the same indices as ``score_fn``.

  Returns:
    ``(out, new_cache)`` with out (B, t, N, H) in the query's dtype, or
    ``((out, lse), new_cache)`` with ``return_residual``, lse (B, t, N).
  """
  _check_cache(cache)
  key, value, num_new = _check_new(cache, key, value, num_new)
  query = _check_query(cache, query, key.shape[1])
  allowed = masks.causal(cache.lengths)
  if mask is not None:
    if not isinstance(mask, masks.Mask):
      mask = masks.from_array(mask)
    try:
      allowed = allowed & mask
    except ValueError as e:
      raise ValueError(f"mask: {e}") from None
  new_cache = _write(cache, key, value, num_new)
  # Slots past a row's length hold whatever was there (uninitialised memory, a finished
  # request's tokens, NaN): the mask excludes them, but 0 · NaN is NaN in p·v and in the
  # gradients, so they are read as zeros.
  slots = jnp.arange(cache.max_length)[None, :]
  written = (slots < new_cache.lengths[:, None])[:, :, None, None]
  out = dot_product_attention(
    query,
    jnp.where(written, new_cache.key, 0),
    jnp.where(written, new_cache.value, 0),
    bias,
    allowed,
    scale=scale,
    query_seq_lengths=num_new,
    implementation=implementation,
    return_residual=return_residual,
    score_fn=score_fn,
    logits_soft_cap=logits_soft_cap,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    broadcast_dropout=broadcast_dropout,
    backward=backward,
    block_q=block_q,
    block_kv=block_kv,
    sinks=sinks,
  )
  return out, new_cache


def _write(
  cache: KVCache, key: jax.Array | np.ndarray, value: jax.Array | np.ndarray, num_new
) -> KVCache:
  """The scatter behind :func:`update`; arguments already checked."""
  B, t = key.shape[:2]
  S = cache.max_length
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  n = jnp.full((B,), t, jnp.int32) if num_new is None else jnp.clip(num_new, 0, t)
  lengths = cache.lengths.astype(jnp.int32)
  pos = lengths[:, None] + i  # (B, t); S and beyond are dropped by the scatter
  pos = jnp.where(i < n[:, None], pos, S)
  rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, t))
  return KVCache(
    cache.key.at[rows, pos].set(key, mode="drop"),
    cache.value.at[rows, pos].set(value, mode="drop"),
    jnp.minimum(lengths + n.astype(jnp.int32), S).astype(cache.lengths.dtype),
  )


def _check_cache(cache) -> None:
  if not isinstance(cache, KVCache):
    raise TypeError(
      f"cache must be a jattn.decode.KVCache (see decode.init), got {type(cache).__name__}"
    )
  k, v, lengths = cache
  for name, x in (("cache.key", k), ("cache.value", v), ("cache.lengths", lengths)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if k.ndim != 4 or k.shape[1] < 1:
    raise ValueError(
      f"cache.key must have shape (B, max_length, K, H) with max_length >= 1, got {k.shape}"
    )
  if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"cache.key and cache.value must have the same shape but for the head dimension, got "
      f"{k.shape} and {v.shape}"
    )
  if v.dtype != k.dtype:
    raise TypeError(
      f"cache.key and cache.value must have the same dtype, got {k.dtype} and {v.dtype}"
    )
  if lengths.shape != (k.shape[0],) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
      f"cache.lengths must be an integer array of shape (B,)=({k.shape[0]},), "
      f"got {lengths.dtype}{lengths.shape}"
    )
  if _checks.is_concrete(lengths):
    held = np.asarray(lengths)
    if np.any((held < 0) | (held > k.shape[1])):
      raise ValueError(
        f"cache.lengths must be in [0, max_length={k.shape[1]}], got {held.tolist()}"
      )


def _check_new(
  cache: KVCache, key, value, num_new
) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray, Any]:
  """key, value (B, t, K, H) matching the cache and num_new (B,) or None; overflow if concrete."""
  key, value = _checks.as_array("key", key), _checks.as_array("value", value)
  B, S, K, H = cache.key.shape
  layout = f"(B, t, K, H)=({B}, t, {K}, {H})"
  for name, x in (("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape {layout} like the cache, got {x.shape}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(
      f"key and value must have the same shape but for the head dimension, got key "
      f"{key.shape} and value {value.shape}"
    )
  if (key.shape[0], key.shape[2], key.shape[3]) != (B, K, H):
    raise ValueError(
      f"key and value must have shape {layout} to match the cache's "
      f"{cache.key.shape}, got {key.shape}"
    )
  Hv = cache.value.shape[3]
  if value.shape[3] != Hv:
    raise ValueError(
      f"value must have shape (B, t, K, Hv)=({B}, t, {K}, {Hv}) to match the cache's "
      f"{cache.value.shape}, got {value.shape}"
    )
  t = key.shape[1]
  if not 1 <= t <= S:
    raise ValueError(
      f"key and value must hold 1 <= t <= max_length={S} new tokens, got t={t} in shape {key.shape}"
    )
  for name, x in (("key", key), ("value", value)):
    if x.dtype != cache.key.dtype:
      raise TypeError(f"{name} must have the cache's dtype {cache.key.dtype}, got {x.dtype}")
  if num_new is not None:
    num_new = _checks.int_array("num_new", _checks.as_array("num_new", num_new), ranks=(1,))
    if num_new.shape != (B,):
      raise ValueError(f"num_new must have shape (B,)=({B},), got {num_new.shape}")
    if _checks.is_concrete(num_new):
      n = np.asarray(num_new)
      if np.any((n < 0) | (n > t)):
        raise ValueError(f"num_new must be in [0, t={t}] (the new tokens given), got {n.tolist()}")
  if _checks.is_concrete(cache.lengths) and (num_new is None or _checks.is_concrete(num_new)):
    lengths = np.asarray(cache.lengths)
    n = np.full((B,), t) if num_new is None else np.asarray(num_new)
    over = np.flatnonzero(lengths + n > S)
    if over.size:
      b = int(over[0])
      raise ValueError(
        f"cache row {b} would overflow: it holds {int(lengths[b])} tokens and "
        f"{int(n[b])} new ones make {int(lengths[b] + n[b])} > "
        f"max_length={S}"
      )
  return key, value, num_new


def _check_query(cache: KVCache, query, t: int):
  query = _checks.as_array("query", query)
  B, _, K, H = cache.key.shape
  if query.ndim != 4 or query.shape[0] != B or query.shape[1] != t or query.shape[3] != H:
    raise ValueError(
      f"query must have shape (B, t, N, H)=({B}, {t}, N, {H}) to match key "
      f"(B, t, K, H) and the cache, got {query.shape}"
    )
  if query.shape[2] % K:
    raise ValueError(
      f"the number of query heads N ({query.shape[2]}) must be a multiple of "
      f"the cache's number of key/value heads K ({K})"
    )
  if query.dtype != cache.key.dtype:
    raise TypeError(f"query must have the cache's dtype {cache.key.dtype}, got {query.dtype}")
  return query
