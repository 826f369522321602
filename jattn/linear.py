r"""Linear (kernelised) attention: ``φ(Q) (φ(K)ᵀ V) / (φ(Q) (φ(K)ᵀ 1) + eps)``.

Softmax attention weighs value s for query t by ``exp(scale · q_t·k_s)``.
Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") replaces
that kernel by a dot product of nonnegative features, ``φ(q_t)·φ(k_s)``, so
the sums over keys can be taken once, before the queries arrive::

    out_t = Σ_s (φ(q_t)·φ(k_s)) v_s / (Σ_s φ(q_t)·φ(k_s) + eps)
          = φ(q_t)ᵀ (Σ_s φ(k_s) v_sᵀ) / (φ(q_t)ᵀ Σ_s φ(k_s) + eps)

per head (shape legend of :mod:`jattn.attention`; F is the number of
features). No T×S array is ever formed: the cost is O(T·F·H) time and
O(T·(F + H)) memory per head instead of softmax attention's O(T·S·H) and
O(T·S). With ``is_causal=True`` query t sums only over keys s <= t: the
sequence is cut into chunks of C = ``chunk_size`` positions, each chunk
forms its masked C×C weights (O(C²·(F + H)) per chunk) and adds the running
prefix sums ``Σ φ(k) vᵀ`` (K, F, H) and ``Σ φ(k)`` (K, F) carried from the
chunks before it (O(C·F·H)): O(T·(C·(F + H) + F·H)) in all, T/C sequential
steps. The backward pass recomputes each chunk and keeps only the T/C prefix
states. GQA shares one ``Σ φ(k) vᵀ`` between the G query heads
of a key/value head. Sums are kept in float32 (float64 for float64 inputs);
the output has the query's dtype.

Feature maps:

- ``"elu+1"``: ``elu(x) + 1`` (Katharopoulos et al.), positive everywhere.
- ``"relu"``: ``max(x, 0)``. A query whose features meet no key's features
  has a zero denominator; its output is zeros (the ``eps`` keeps the division
  finite), never NaN.
- ``"favor+"``: positive random features (Performer, Choromanski et al.
  2021) whose dot product is an unbiased estimate of the softmax kernel
  ``exp(scale · q·k)``: with ``x' = sqrt(scale) · x`` and a random
  projection W (m, H) (:func:`random_projection`),
  ``φ(x) = exp(W x' - |x'|²/2 - c) / sqrt(m)`` (:func:`favor_features`).
  The stabiliser c (each query row's max, each key head's max over all
  keys) cancels in the ratio and keeps every exponent <= 0, so large logits
  cannot overflow.
- any callable ``fn(x) -> features``: ``x`` is the query (B, T, N, H) or the
  key (B, S, K, H) in float32 (float64), the result keeps the leading axes
  and ends in F, the same F for both. It must be nonnegative: the
  denominator is a sum of feature products and only ``eps`` guards it. It
  may hold arrays (learned features): it is called afresh on every call,
  under the caller's ``jax.jit`` (eager calls with a callable run op by op).

Only ``"favor+"`` approximates softmax attention, and only in expectation
over the random projection: the error of each kernel estimate falls as
1/sqrt(m), and the output is a ratio of two estimates (biased for small m),
so use it where a noisy softmax is acceptable, with m a few times H or more.
``"elu+1"`` and ``"relu"`` are different kernels, not approximations: a
model trained with softmax attention does not keep its outputs when switched
to them.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jattn.linear import linear_attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 100, 4, 16))  # B T N H
    >>> kv = jax.random.normal(jax.random.key(1), (2, 100, 2, 16))  # B S K H: GQA
    >>> linear_attention(q, kv, kv, is_causal=True).shape
    (2, 100, 4, 16)
    >>> out = linear_attention(q, kv, kv, feature_map="favor+", rng=jax.random.key(2),
    ...                        num_features=128)  # ≈ softmax attention
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _validate
from jattn.impl import common

__all__ = [
  "linear_attention",
  "random_projection",
  "favor_features",
]

FEATURE_MAPS = ("elu+1", "relu", "favor+")


def linear_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  feature_map: str | Callable[[jax.Array], jax.Array] = "elu+1",
  is_causal: bool = False,
  chunk_size: int = 64,
  eps: float = 1e-6,
  rng: jax.Array | None = None,
  num_features: int | None = None,
  orthogonal: bool = True,
  scale: float | None = None,
) -> jax.Array:
  """Kernelised attention in O(T) time and memory; see the module docstring.

  Args:
    query: (B, T, N, H) or unbatched (T, N, H), floating dtype.
    key: (B, S, K, H) or (S, K, H), same dtype as query; N % K == 0.
    value: same shape and dtype as key.
    feature_map: ``"elu+1"``, ``"relu"``, ``"favor+"`` or a callable
      ``fn(x) -> (..., F)`` returning nonnegative features.
    is_causal: query t attends to keys s <= t; needs T == S.
    chunk_size: positions per chunk of the causal scan (any T works; larger
      chunks do more masked work per position and fewer sequential steps).
      Ignored when not causal.
    eps: added to every denominator, > 0. With ``"favor+"`` it is added to
      the stabilised denominator (see :func:`favor_features`), whose
      stabilisers are constants to autodiff: they cancel in the ratio up to
      eps, so gradients are exact up to a relative O(eps / denominator).
    rng: ``"favor+"`` only, and required there: a ``jax.random.key`` (or
      ``PRNGKey``) drawing the projection, shared by all batch rows and heads.
    num_features: ``"favor+"`` only: m, the number of random features;
      default ``round(H · log H)`` (at least 1), Performer's choice.
    orthogonal: ``"favor+"``: draw the projection's rows in orthogonal blocks
      (lower variance) rather than independently.
    scale: ``"favor+"`` only: the softmax kernel's logit scale, >= 0,
      default ``1 / sqrt(H)``. The deterministic maps have no scale: passing
      one with them is an error rather than silently ignored.

  Returns:
    The output, shaped and typed like ``query``.
  """
  q, k, v = _validate.qkv(query, key, value)
  if k.shape != v.shape:
    raise ValueError(
      f"key and value must have the same shape for linear_attention, got key {k.shape} "
      f"and value {v.shape}"
    )
  H = q.shape[-1]
  T, S = q.shape[-3], k.shape[-3]
  is_causal = _checks.boolean("is_causal", is_causal)
  if is_causal and T != S:
    raise ValueError(f"is_causal=True needs as many queries as keys, got T={T} and S={S}")
  chunk_size = _checks.integer("chunk_size", chunk_size, minimum=1)
  eps = _checks.positive_real("eps", eps)
  orthogonal = _checks.boolean("orthogonal", orthogonal)
  feature_map = _check_feature_map(feature_map, q, k)
  if feature_map == "favor+":
    if rng is None:
      raise ValueError(
        "feature_map='favor+' needs rng, a jax.random.key to draw its random projection, got None"
      )
    _checks.prng_key("rng", rng)
    if H == 0:
      raise ValueError(f"feature_map='favor+' needs a head dimension H >= 1, got query {q.shape}")
    if num_features is None:
      num_features = max(1, round(H * math.log(H)))
    num_features = _checks.integer("num_features", num_features, minimum=1)
    scale = 1.0 / math.sqrt(H) if scale is None else _check_scale(scale)
  else:
    for name, setting in (("rng", rng), ("num_features", num_features), ("scale", scale)):
      if setting is not None:
        raise ValueError(
          f"{name} applies only to feature_map='favor+', got feature_map={_describe(feature_map)}"
        )
  # Drawn outside _linear's jit: threefry is slow to compile on CPU, and this
  # compiles once per (m, H) rather than once per shape of the inputs.
  projection = _projection(rng, num_features, H, orthogonal) if feature_map == "favor+" else None
  # A callable is not made a static argument of a jit: it may be unhashable, and a
  # cached compilation would keep the arrays it held then (stale weights). It runs
  # inside the caller's jit, or op by op.
  core = _linear_jit if isinstance(feature_map, str) else _linear
  return core(
    q,
    k,
    v,
    projection,
    feature_map=feature_map,
    is_causal=is_causal,
    chunk_size=chunk_size if is_causal else None,
    eps=eps,
    scale=scale,
  )


def random_projection(
  rng: jax.Array, num_features: int, head_dim: int, *, orthogonal: bool = True
) -> jax.Array:
  """The FAVOR+ projection W, (num_features, head_dim) float32, rows ~ N(0, I) each.

  ``orthogonal=True`` (Performer's default) draws the rows in blocks of
  ``head_dim`` mutually orthogonal directions (Q of the QR decomposition of
  a Gaussian matrix, signs fixed so that it is Haar distributed), the last
  block cut short, and gives each row the length of an independent Gaussian
  vector, so every row is still marginally N(0, I) while rows within a block
  never overlap. Otherwise the rows are independent Gaussians. Always drawn
  in float32, so one rng gives the same features for every input dtype.
  """
  _checks.prng_key("rng", rng)
  num_features = _checks.integer("num_features", num_features, minimum=1)
  head_dim = _checks.integer("head_dim", head_dim, minimum=1)
  orthogonal = _checks.boolean("orthogonal", orthogonal)
  return _projection(rng, num_features, head_dim, orthogonal)


def favor_features(
  x: jax.typing.ArrayLike,
  projection: jax.typing.ArrayLike,
  *,
  scale: float | None = None,
  is_query: bool,
) -> jax.Array:
  """FAVOR+ features ``exp(W x' - |x'|²/2 - c) / sqrt(m)`` with ``x' = sqrt(scale) · x``.

  Args:
    x: queries (..., N, H) or keys (..., S, K, H), floating dtype.
    projection: W, (m, H), e.g. from :func:`random_projection`.
    scale: the softmax kernel's logit scale, >= 0, default ``1 / sqrt(H)``.
    is_query: the stabiliser c is each row's max over its m features for
      queries, and for keys the max over all S keys and m features of each
      key head (axis -2), so that ``φ(q)·φ(k)`` keeps the ratio of any two
      kernel values. Both are constants under differentiation.

  Returns:
    (..., m) features in float32 (float64 for float64 inputs), each in
    [0, 1/sqrt(m)].
  """
  x = _checks.as_array("x", x)
  w = _checks.as_array("projection", projection)
  for name, a in (("x", x), ("projection", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
  if x.ndim < 1 or w.ndim != 2 or w.shape[1] != x.shape[-1]:
    raise ValueError(
      f"projection must have shape (m, H) with H the last dimension of x, "
      f"got projection {w.shape} and x {x.shape}"
    )
  is_query = _checks.boolean("is_query", is_query)
  if not is_query and x.ndim < 3:
    raise ValueError(f"keys x must have shape (..., S, K, H), got {x.shape}")
  scale = 1.0 / math.sqrt(x.shape[-1]) if scale is None else _check_scale(scale)
  return _favor(x, w, scale=scale, is_query=is_query)


def _check_scale(scale: Any) -> float:
  scale = _checks.real("scale", scale)
  if not (np.isfinite(scale) and scale >= 0):
    raise ValueError(f"scale must be a finite number >= 0 for feature_map='favor+', got {scale}")
  return scale


def _describe(feature_map: str | Callable[..., Any]) -> str:
  return repr(feature_map) if isinstance(feature_map, str) else "a callable"


def _check_feature_map(
  feature_map: Any, q: jax.Array | np.ndarray, k: jax.Array | np.ndarray
) -> str | Callable[..., jax.Array]:
  """The feature map name, or a callable whose outputs have been checked by shape."""
  if isinstance(feature_map, str):
    if feature_map not in FEATURE_MAPS:
      raise ValueError(
        f"feature_map must be one of {list(FEATURE_MAPS)} or a callable, got {feature_map!r}"
      )
    return feature_map
  if not callable(feature_map):
    raise TypeError(
      f"feature_map must be one of {list(FEATURE_MAPS)} or a callable, got "
      f"{type(feature_map).__name__}"
    )
  dtype = common.stats_dtype(q.dtype)
  features = []
  for name, x in (("query", q), ("key", k)):
    out = jax.eval_shape(feature_map, jax.ShapeDtypeStruct(x.shape, dtype))
    if not isinstance(out, jax.ShapeDtypeStruct) or not jnp.issubdtype(out.dtype, jnp.floating):
      raise TypeError(f"feature_map must return one floating array, got {out} for the {name}")
    if len(out.shape) != x.ndim or out.shape[:-1] != x.shape[:-1]:
      raise ValueError(
        f"feature_map must map the {name} {x.shape} to features of shape "
        f"{x.shape[:-1] + ('F',)}, got {out.shape}"
      )
    features.append(out.shape[-1])
  if features[0] != features[1]:
    raise ValueError(
      f"feature_map must give query and key the same number of features F, "
      f"got {features[0]} and {features[1]}"
    )
  return feature_map


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _projection(rng: jax.Array, m: int, H: int, orthogonal: bool) -> jax.Array:
  if not orthogonal:
    return jax.random.normal(rng, (m * H,), jnp.float32).reshape(m, H)
  blocks = -(-m // H)
  # One flat draw (XLA compiles a 1-D threefry much faster than an N-D one).
  z = jax.random.normal(rng, (blocks * H * H + m * H,), jnp.float32)
  q, r = jnp.linalg.qr(z[: blocks * H * H].reshape(blocks, H, H))
  signs = jnp.where(jnp.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0)
  rows = jnp.swapaxes(q * signs[:, None, :], -1, -2).reshape(blocks * H, H)[:m]
  norms = jnp.linalg.norm(z[blocks * H * H :].reshape(m, H), axis=-1)
  return rows * norms[:, None]


def _favor(
  x: jax.Array | np.ndarray, w: jax.Array | np.ndarray, *, scale: float, is_query: bool
) -> jax.Array:
  dtype = common.stats_dtype(x.dtype)
  x = x.astype(dtype) * np.sqrt(scale).astype(dtype)
  logits = jnp.einsum("...H,FH->...F", x, w.astype(dtype)) - 0.5 * jnp.sum(
    x * x, axis=-1, keepdims=True
  )
  axes = (-1,) if is_query else (-3, -1)
  c = jax.lax.stop_gradient(jnp.max(logits, axis=axes, keepdims=True, initial=-np.inf))
  return jnp.exp(logits - c) / np.sqrt(w.shape[0]).astype(dtype)


def _features(
  x: jax.Array | np.ndarray,
  *,
  feature_map: str | Callable[..., jax.Array],
  projection: jax.Array | None,
  scale: float | None,
  is_query: bool,
) -> jax.Array:
  x = x.astype(common.stats_dtype(x.dtype))
  match feature_map:
    case "elu+1":
      return jax.nn.elu(x) + 1
    case "relu":
      return jax.nn.relu(x)
    case "favor+":
      assert projection is not None and scale is not None, "favor+ has its projection and scale"
      return _favor(x, projection, scale=scale, is_query=is_query)
    case _:
      assert not isinstance(feature_map, str), feature_map  # checked against FEATURE_MAPS
      return feature_map(x).astype(x.dtype)


def _linear(
  query: jax.Array | np.ndarray,
  key: jax.Array | np.ndarray,
  value: jax.Array | np.ndarray,
  projection: jax.Array | None,
  *,
  feature_map: str | Callable[..., jax.Array],
  is_causal: bool,
  chunk_size: int | None,
  eps: float,
  scale: float | None,
) -> jax.Array:
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  dims = chex.Dimensions(B=B, T=T, S=S, N=N, K=K, H=H)
  chex.assert_shape(query, dims["BTNH"])
  chex.assert_shape([key, value], dims["BSKH"])
  phi = functools.partial(_features, feature_map=feature_map, projection=projection, scale=scale)
  phi_q, phi_k = phi(query, is_query=True), phi(key, is_query=False)
  v = value.astype(phi_k.dtype)
  if is_causal:
    assert chunk_size is not None, "a causal call has its chunk size"
    out = _causal(phi_q, phi_k, v, chunk_size=chunk_size, eps=eps)
  else:
    out = _global(phi_q, phi_k, v, eps=eps)
  out = out.astype(query.dtype)
  return out[0] if unbatched else out


_linear_jit = jax.jit(
  _linear, static_argnames=("feature_map", "is_causal", "chunk_size", "eps", "scale")
)


def _global(
  phi_q: jax.Array, phi_k: jax.Array, v: jax.Array | np.ndarray, *, eps: float
) -> jax.Array:
  """Every query sees every key: two contractions through (K, F, H) and (K, F)."""
  B, T, N, F = phi_q.shape
  _, S, K, H = v.shape
  q = phi_q.reshape(B, T, K, N // K, F)
  kv = jnp.einsum("BSKF,BSKH->BKFH", phi_k, v)
  z = jnp.sum(phi_k, axis=1)
  num = jnp.einsum("BTKGF,BKFH->BTKGH", q, kv)
  den = jnp.einsum("BTKGF,BKF->BTKG", q, z)
  return (num / (den + eps)[..., None]).reshape(B, T, N, H)


def _causal(
  phi_q: jax.Array, phi_k: jax.Array, v: jax.Array | np.ndarray, *, chunk_size: int, eps: float
) -> jax.Array:
  """Query t sees keys s <= t: a scan over chunks carrying the prefix sums.

  T is padded at the end to whole chunks with zero features and values:
  padded keys come after every real query (the mask hides them and they
  reach the carry only after the last chunk), padded queries divide 0 by eps
  and are sliced off.
  """
  B, T, N, F = phi_q.shape
  _, S, K, H = v.shape
  G = N // K
  C = max(1, min(chunk_size, T))
  num_chunks = -(-T // C)

  def chunks(x: jax.Array | np.ndarray) -> jax.Array:  # (B, T, ...) -> (num_chunks, B, C, ...)
    x = jnp.pad(x, [(0, 0), (0, num_chunks * C - T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, num_chunks, C, *x.shape[2:]), 1, 0)

  below = jnp.tril(jnp.ones((C, C), phi_q.dtype)).reshape(1, 1, 1, C, C)

  @jax.checkpoint
  def step(
    carry: tuple[jax.Array, jax.Array], chunk: tuple[jax.Array, jax.Array, jax.Array]
  ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    kv, z = carry  # (B, K, F, H), (B, K, F): sums over the chunks before this one
    q, k, v = chunk  # (B, C, K, G, F), (B, C, K, F), (B, C, K, H)
    a = jnp.einsum("BCKGF,BDKF->BKGCD", q, k) * below
    num = jnp.einsum("BKGCD,BDKH->BCKGH", a, v) + jnp.einsum("BCKGF,BKFH->BCKGH", q, kv)
    den = jnp.sum(a, axis=-1).transpose(0, 3, 1, 2) + jnp.einsum("BCKGF,BKF->BCKG", q, z)
    carry = kv + jnp.einsum("BDKF,BDKH->BKFH", k, v), z + jnp.sum(k, axis=1)
    return carry, num / (den + eps)[..., None]

  init = (jnp.zeros((B, K, F, H), v.dtype), jnp.zeros((B, K, F), v.dtype))
  xs = (chunks(phi_q.reshape(B, T, K, G, F)), chunks(phi_k), chunks(v))
  _, out = jax.lax.scan(step, init, xs)  # (num_chunks, B, C, K, G, H)
  out = jnp.moveaxis(out, 0, 1).reshape(B, num_chunks * C, N, H)
  return out[:, :T]
