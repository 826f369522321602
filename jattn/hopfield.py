r"""Modern Hopfield networks (Ramsauer et al., 2020, "Hopfield Networks is All You Need").

Let M denote the number of stored patterns, d the feature size, L the number
of queries. The stored patterns are the rows of X, shape (M, d); a state (a
query) ξ has shape (d,). One update of the continuous modern Hopfield network
is::

    ξ ← softmax(β X ξ)ᵀ X          (for L queries at once: Ξ ← softmax(β Ξ Xᵀ) X)

which is exactly one attention head: queries = ξ, keys = values = X, and the
inverse temperature β in the place of the logit scale 1/sqrt(d).
:func:`retrieve` is written that way, as a call to
:func:`jattn.dot_product_attention` with ``scale=beta``, so it inherits its
numerics (float32 softmax statistics for low-precision inputs, never NaN) and
its gradients.

What β does: the update is a softmax-weighted average of the stored patterns.
With large β (well separated patterns, β · separation ≫ log M) the softmax is
nearly one-hot and one update retrieves the single stored pattern nearest
(by inner product) to the query: the fixed points sit near the stored
patterns. With small β the weights spread out and the fixed points are
metastable states, averages over groups of similar patterns; as β → 0 every
query goes to the mean of all patterns.

The update minimises the energy (:func:`energy`)::

    E(ξ) = −β⁻¹ log Σᵢ exp(β xᵢᵀξ) + ½ ξᵀξ + β⁻¹ log M + ½ maxᵢ ‖xᵢ‖²

by the concave-convex procedure, so E never increases from one update to the
next; the two constants shift it so that E ≥ 0.

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import hopfield
    >>> patterns = jnp.array([[1., 1., -1., -1.], [1., -1., 1., -1.], [-1., 1., 1., -1.]])
    >>> noisy = jnp.array([0.8, 1.2, -0.9, 0.1])          # nearest to pattern 0
    >>> out = hopfield.retrieve(noisy, patterns, beta=8.0)
    >>> print(out.round(3))                               # large beta: pattern 0
    [ 1.  1. -1. -1.]
    >>> print(hopfield.retrieve(noisy, patterns, beta=0.01).round(1))  # small: the mean
    [ 0.3  0.3  0.3 -1. ]
    >>> e = hopfield.energy(jnp.stack([noisy, out]), patterns, beta=8.0)
    >>> print(f"energy {e[0]:.2f} -> {e[1]:.2f}")         # the update lowered it
    energy 0.79 -> 0.14
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jattn import _checks
from jattn.attention import dot_product_attention

__all__ = [
  "retrieve",
  "energy",
]


def retrieve(
  queries: jax.typing.ArrayLike, patterns: jax.typing.ArrayLike, *, beta: float, steps: int = 1
) -> jax.Array:
  """Modern Hopfield retrieval: ``ξ ← softmax(β ξ Xᵀ) X``, applied ``steps`` times.

  Each update is one attention head with keys = values = ``patterns`` and
  logit scale ``beta`` (see the module docstring). Differentiable with respect
  to both arrays; works under ``jax.jit`` (``beta`` and ``steps`` are static).

  Args:
    queries: (..., d) states ξ, any number of leading axes (a single (d,)
      query too); floating dtype.
    patterns: (M, d) stored patterns X as rows, M >= 1; the dtype of queries.
    beta: inverse temperature, a concrete positive finite number.
    steps: number of updates, an int >= 1. They are unrolled in the compiled
      program, so keep it small; one update usually reaches the fixed point.

  Returns:
    The retrieved states, shaped and typed like ``queries``.
  """
  xi, x = _check_arrays(queries, patterns)
  beta = _checks.positive_real("beta", beta)
  steps = _checks.integer("steps", steps, minimum=1)
  return _retrieve(xi, x, beta=beta, steps=steps)


def energy(
  queries: jax.typing.ArrayLike, patterns: jax.typing.ArrayLike, *, beta: float
) -> jax.Array:
  """The modern Hopfield energy of each query state.

  ``E(ξ) = −β⁻¹ log Σᵢ exp(β xᵢᵀξ) + ½ ξᵀξ + β⁻¹ log M + ½ maxᵢ ‖xᵢ‖²``, which
  :func:`retrieve`'s update never increases and which is never negative.

  Args:
    queries: (..., d) states ξ, floating dtype.
    patterns: (M, d) stored patterns, M >= 1, the dtype of queries.
    beta: inverse temperature, a concrete positive finite number.

  Returns:
    The energies, shape (...) (the queries' leading axes), in their dtype;
    computed in float32 (float64 for float64 inputs).
  """
  xi, x = _check_arrays(queries, patterns)
  return _energy(xi, x, beta=_checks.positive_real("beta", beta))


@functools.partial(jax.jit, static_argnames=("beta", "steps"))
def _retrieve(queries: jax.Array, patterns: jax.Array, *, beta: float, steps: int) -> jax.Array:
  lead, d = queries.shape[:-1], queries.shape[-1]
  M = patterns.shape[0]
  xi = queries.reshape(1, math.prod(lead), 1, d)  # (B=1, T=L, N=1, H=d)
  x = patterns.reshape(1, M, 1, d)  # (B=1, S=M, K=1, H=d): keys = values = X

  for _ in range(steps):  # unrolled: steps is small (one update usually converges)
    xi = dot_product_attention(xi, x, x, scale=beta)
  return xi.reshape(queries.shape)


@functools.partial(jax.jit, static_argnames=("beta",))
def _energy(queries: jax.Array, patterns: jax.Array, *, beta: float) -> jax.Array:
  dtype = jnp.promote_types(queries.dtype, jnp.float32)
  xi, x = queries.astype(dtype), patterns.astype(dtype)
  M = patterns.shape[0]
  lse = jax.nn.logsumexp(beta * jnp.einsum("...d,md->...m", xi, x), axis=-1)
  largest = jnp.max(jnp.sum(x * x, axis=-1))
  e = -lse / beta + 0.5 * jnp.sum(xi * xi, axis=-1) + math.log(M) / beta + 0.5 * largest
  return e.astype(queries.dtype)


def _check_arrays(
  queries: jax.typing.ArrayLike, patterns: jax.typing.ArrayLike
) -> tuple[jax.Array, jax.Array]:
  xi, x = _checks.as_array("queries", queries), _checks.as_array("patterns", patterns)
  for name, a in (("queries", xi), ("patterns", x)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
  if xi.dtype != x.dtype:
    raise TypeError(
      f"queries and patterns must have the same dtype, got queries {xi.dtype} "
      f"and patterns {x.dtype}"
    )
  if x.ndim != 2:
    raise ValueError(
      f"patterns must have shape (M, d), one stored pattern per row, got {tuple(x.shape)}"
    )
  if x.shape[0] < 1:
    raise ValueError(
      f"patterns must hold at least one pattern (M >= 1), got shape {tuple(x.shape)}"
    )
  if xi.ndim < 1:
    raise ValueError(
      f"queries must have shape (..., d) with at least the feature axis, got {tuple(xi.shape)}"
    )
  if xi.shape[-1] != x.shape[-1]:
    raise ValueError(
      f"queries and patterns must have the same feature size d, got queries "
      f"{tuple(xi.shape)} and patterns {tuple(x.shape)}"
    )
  return jnp.asarray(xi), jnp.asarray(x)
