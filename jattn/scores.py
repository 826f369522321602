"""Score modifiers: functions ``score_fn(score, batch, head, q_idx, kv_idx) -> score``.

FlexAttention's ``score_mod`` in JAX. ``score`` is the float32 (float64 under
x64) array of scaled logits plus bias; the index arguments are int arrays that
broadcast against it (see :func:`jattn.masks.index_grid`). A score function
runs before masking, so it never sees masked positions as special.

The built-ins return :class:`ScoreFn` objects: pytrees whose arrays (ALiBi
slopes, a relative-position table) are leaves, so they can be learned
parameters and gradients flow to them. Any plain callable with the same
signature works too.

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import scores
    >>> fn = scores.compose(scores.alibi(jnp.array([0.5])), scores.soft_cap(30.0))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jattn import _checks, _compat
from jattn.masks import indexing

__all__ = [
  "ScoreFn",
  "from_fn",
  "compose",
  "alibi",
  "soft_cap",
  "t5_bucket",
  "relative_position_bias",
  "reindex",
]

STATIC = {"static": True}
"""Field metadata of a setting: part of a score function's treedef, not one of its children
(as :data:`jattn.masks.core.STATIC` for masks)."""


class ScoreFn:
  """A score modifier: ``fn(score, batch, head, q_idx, kv_idx) -> score``.

  Each kind is a frozen dataclass registered as a pytree, as the masks are: its settings
  (a cap, a bucket count, a user's function) are static fields, part of the treedef, and
  its arrays (ALiBi's slopes, a relative-position table) and sub-functions are its
  children, traced and differentiable.
  """

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    raise NotImplementedError(f"{type(self).__name__} defines no score function")

  @property
  def num_heads(self) -> int | None:
    """N, the number of query heads its per-head parameters are for (ALiBi's slopes, a
    relative-position table's columns); None when it has none. Attention raises unless
    it equals the query's N: a parameter is never reused or cut to fit."""
    return None

  @property
  def children(self) -> tuple:
    """The arrays and score functions it holds (its pytree children), in field order."""
    return tuple(
      getattr(self, f.name)
      for f in dataclasses.fields(self)  # type: ignore[arg-type]  # every kind is a dataclass
      if not f.metadata.get("static")
    )


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class FromFn(ScoreFn):
  """A user's ``fn(score, batch, head, q_idx, kv_idx)`` (see :func:`from_fn`)."""

  fn: Callable = field(metadata=STATIC)

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    # A user function may compute in a narrower dtype (float16, bfloat16): its floating
    # result is taken back to the score's dtype (float32, float64 for float64 inputs), so
    # every implementation and every custom_vjp sees the statistics dtype it expects.
    out = self.fn(score, batch, head, q_idx, kv_idx)
    if (
      hasattr(out, "dtype") and jnp.issubdtype(out.dtype, jnp.floating) and out.dtype != score.dtype
    ):
      out = out.astype(score.dtype)
    return out

  def __repr__(self) -> str:
    return f"from_fn({getattr(self.fn, '__name__', repr(self.fn))})"


def from_fn(fn: Callable) -> ScoreFn:
  """Wrap a plain ``fn(score, batch, head, q_idx, kv_idx)`` as a :class:`ScoreFn`.

  A floating result in another dtype than ``score`` (e.g. a function that
  computes in bfloat16) is cast back to the score's dtype.
  """
  if isinstance(fn, ScoreFn):
    return fn
  if not callable(fn):
    raise TypeError(
      f"score_fn must be callable as fn(score, batch, head, q_idx, kv_idx), got {fn!r}"
    )
  return FromFn(fn)


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Compose(ScoreFn):
  """Score functions applied in order (see :func:`compose`)."""

  fns: tuple[ScoreFn, ...]

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    for fn in self.fns:
      score = fn(score, batch, head, q_idx, kv_idx)
    return score

  @property
  def num_heads(self) -> int | None:
    heads = {fn.num_heads for fn in self.fns} - {None}
    return heads.pop() if heads else None

  @property
  def children(self) -> tuple:
    return self.fns

  def __repr__(self) -> str:
    return "compose(" + ", ".join(map(repr, self.fns)) + ")"


def compose(*fns: Callable) -> ScoreFn:
  """Apply score functions in order: ``compose(f, g)(s, ...) == g(f(s, ...), ...)``."""
  if not fns:
    raise ValueError("compose needs at least one score function")
  nodes = tuple(from_fn(f) for f in fns)
  sized = [fn for fn in nodes if fn.num_heads is not None]
  if len({fn.num_heads for fn in sized}) > 1:
    raise ValueError(
      "compose needs score functions for the same number of heads, got "
      + " and ".join(f"{fn!r} for {fn.num_heads}" for fn in sized)
    )
  return Compose(nodes)


def _float_array(name: str, value: Any, *, ndim: int) -> jax.Array | np.ndarray:
  """A floating array of rank ``ndim``, kept as given (no copy, no cast)."""
  arr = value if hasattr(value, "dtype") else np.asarray(value)
  if not np.issubdtype(arr.dtype, np.floating):
    raise TypeError(f"{name} must have a floating dtype, got {arr.dtype}")
  if arr.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim}, got shape {arr.shape}")
  return arr


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Alibi(ScoreFn):
  """``score + slopes[head] * (kv_idx - q_idx)`` (see :func:`alibi`)."""

  slopes: Any
  bidirectional: bool = field(metadata=STATIC)

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    distance = (kv_idx - q_idx).astype(score.dtype)
    if self.bidirectional:
      distance = -jnp.abs(distance)
    return score + jnp.asarray(self.slopes)[head].astype(score.dtype) * distance

  @property
  def num_heads(self) -> int | None:
    return self.slopes.shape[0]

  def __repr__(self) -> str:
    return f"alibi(slopes shape={tuple(self.slopes.shape)}, bidirectional={self.bidirectional})"


def alibi(slopes: ArrayLike, *, bidirectional: bool = False) -> ScoreFn:
  """ALiBi (Press et al., 2022): add ``slopes[head] * (kv_idx - q_idx)`` to the score.

  For causal attention ``kv <= q``, so the bias is a penalty growing with
  distance. ``bidirectional=True`` adds ``-slopes[head] * |q_idx - kv_idx|``.

  Args:
    slopes: float array (N,), one slope per query head (usually positive);
      attention raises unless N is the query's number of heads.
  """
  return Alibi(_float_array("slopes", slopes, ndim=1), bool(bidirectional))


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class SoftCap(ScoreFn):
  """``cap * tanh(score / cap)`` (see :func:`soft_cap`)."""

  cap: float = field(metadata=STATIC)

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    return self.cap * jnp.tanh(score / self.cap)

  def __repr__(self) -> str:
    return f"soft_cap({self.cap!r})"


def soft_cap(cap: float) -> ScoreFn:
  """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``."""
  return SoftCap(_checks.positive_real("cap", cap))


def t5_bucket(
  relative_position: jax.Array, *, num_buckets: int, max_distance: int, bidirectional: bool
) -> jax.Array:
  """T5's bucket of ``relative_position = kv_idx - q_idx``.

  Half the buckets (all of them when not bidirectional) hold exact small
  distances; the rest cover distances up to ``max_distance`` logarithmically,
  and farther ones share the last bucket. When bidirectional, the upper half
  of the buckets is for keys after the query.
  """
  num_buckets = _checks.integer("num_buckets", num_buckets, minimum=2)
  max_distance = _checks.integer("max_distance", max_distance, minimum=1)
  n = jnp.asarray(relative_position)
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = jnp.where(n > 0, num_buckets, 0)
    n = jnp.abs(n)
  else:
    n = jnp.maximum(-n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # log of max(n, 1) keeps log(0) = -inf out of the graph; those lanes use is_small.
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
    max_distance / max_exact
  )
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(n.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, n, large)


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class RelativePositionBias(ScoreFn):
  """``score + table[bucket(kv_idx - q_idx), head]`` (see :func:`relative_position_bias`)."""

  table: Any
  num_buckets: int = field(metadata=STATIC)
  max_distance: int = field(metadata=STATIC)
  bidirectional: bool = field(metadata=STATIC)

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    bucket = t5_bucket(
      kv_idx - q_idx,
      num_buckets=self.num_buckets,
      max_distance=self.max_distance,
      bidirectional=self.bidirectional,
    )
    return score + jnp.asarray(self.table)[bucket, head].astype(score.dtype)

  @property
  def num_heads(self) -> int | None:
    return self.table.shape[1]

  def __repr__(self) -> str:
    return (
      f"relative_position_bias(table shape={tuple(self.table.shape)}, num_buckets="
      f"{self.num_buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional})"
    )


def relative_position_bias(
  table: ArrayLike, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> ScoreFn:
  """T5's learned relative position bias: add ``table[bucket(kv_idx - q_idx), head]``.

  Args:
    table: float array (num_buckets, N), usually a trainable parameter; attention
      raises unless N is the query's number of heads.
    num_buckets, max_distance, bidirectional: T5's bucketing (see
      :func:`t5_bucket`); T5 uses 32, 128 and True in the encoder, False in
      the decoder.
  """
  num_buckets = _checks.integer("num_buckets", num_buckets, minimum=2)
  max_distance = _checks.integer("max_distance", max_distance, minimum=1)
  max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
  if max_exact < 1 or max_distance <= max_exact:
    raise ValueError(
      f"max_distance ({max_distance}) must exceed the exact range ({max_exact}) "
      f"that num_buckets={num_buckets} gives"
    )
  table = _float_array("table", table, ndim=2)
  if table.shape[0] != num_buckets:
    raise ValueError(
      f"table must have shape (num_buckets={num_buckets}, N), got {tuple(table.shape)}"
    )
  return RelativePositionBias(table, num_buckets, max_distance, bool(bidirectional))


@_compat.register_dataclass
@dataclass(frozen=True, eq=False)
class Reindex(ScoreFn):
  """``fn`` seen through index maps (see :func:`reindex`)."""

  fn: ScoreFn
  batch: Any
  head: Any
  q: Any
  kv: Any

  def __call__(
    self, score: jax.Array, batch: jax.Array, head: jax.Array, q_idx: jax.Array, kv_idx: jax.Array
  ) -> jax.Array:
    maps = (self.batch, self.head, self.q, self.kv)
    return self.fn(score, *indexing.through_maps(maps, (batch, head, q_idx, kv_idx)))

  def __repr__(self) -> str:
    return f"reindex({self.fn!r})"


def reindex(
  fn: Callable,
  *,
  batch: ArrayLike | None = None,
  head: ArrayLike | None = None,
  q: ArrayLike | None = None,
  kv: ArrayLike | None = None,
) -> ScoreFn:
  """``fn`` seen through index maps: the new function at ``(b, n, i, j)`` calls ``fn`` with
  indices ``(batch[b], head[n], q[i], kv[j])``, as :func:`jattn.masks.reindex` does for a
  mask. Each map is an int (L,) array (maybe traced) or None, the identity. Sequence-parallel
  attention (:mod:`jattn.parallel`) uses it to evaluate a score function written in global
  positions on one device's shard; its per-head parameters are then indexed by global head.
  A soft cap reads no index and comes back as it is (so a kernel that takes a soft cap and no
  other score function, splash, still sees one).

  Example::

      >>> import numpy as np
      >>> shard = reindex(lambda s, b, h, q, kv: s - abs(q - kv), q=np.array([6, 7]))
      >>> shard(jnp.zeros((1, 1, 2, 2)), 0, 0, jnp.arange(2)[:, None], jnp.arange(2)).tolist()
      [[[[-6.0, -5.0], [-7.0, -6.0]]]]
  """
  maps = indexing.checked_maps(batch=batch, head=head, q=q, kv=kv)
  if isinstance(fn, SoftCap):
    return fn
  return Reindex(from_fn(fn), *maps)
