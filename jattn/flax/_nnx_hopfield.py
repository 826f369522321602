"""Flax NNX: :class:`HopfieldLayer`, a modern Hopfield layer with learnable stored patterns.

Re-exported by :mod:`jattn.nnx`; the retrieval itself is :func:`jattn.hopfield.retrieve`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jattn import _checks
from jattn import hopfield as _hopfield


class HopfieldLayer(nnx.Module):
  """Modern Hopfield retrieval from learnable stored patterns (Ramsauer et al., 2020).

  Each input is a state ξ that is updated ``steps`` times by
  ``ξ ← softmax(β ξ Xᵀ) X`` against the layer's stored patterns X
  (``self.patterns``, an ``nnx.Param`` of shape (num_patterns, in_features)):
  :func:`jattn.hopfield.retrieve`, one attention head with keys = values = X.
  Training moves the patterns; the output is always a convex combination of
  them.

  Args:
    in_features: d, the feature size of inputs, patterns and outputs.
    num_patterns: M, the number of stored patterns.
    beta: inverse temperature, a positive finite number (default
      ``1 / sqrt(in_features)``, attention's usual scale).
    steps: updates per call, an int >= 1.
    pattern_init: initializer ``(key, shape, dtype) -> array`` of the patterns
      (default: standard normal).
    param_dtype: dtype of the patterns; dtype: computation dtype (default:
      inputs and patterns promoted together, as Flax's layers do).
    rngs: ``nnx.Rngs`` with a ``params`` stream.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jattn.nnx
    >>> layer = jattn.nnx.HopfieldLayer(16, 32, beta=0.5, rngs=nnx.Rngs(0))
    >>> layer.patterns.shape
    (32, 16)
    >>> layer(jnp.ones((2, 5, 16))).shape
    (2, 5, 16)
  """

  def __init__(
    self,
    in_features: int,
    num_patterns: int,
    *,
    beta: float | None = None,
    steps: int = 1,
    pattern_init: Any = nnx.initializers.normal(stddev=1.0),
    param_dtype: Any = jnp.float32,
    dtype: Any = None,
    rngs: nnx.Rngs,
  ):
    self.in_features = _checks.integer("in_features", in_features, minimum=1)
    self.num_patterns = _checks.integer("num_patterns", num_patterns, minimum=1)
    self.beta = (
      1.0 / math.sqrt(self.in_features) if beta is None else _checks.positive_real("beta", beta)
    )
    self.steps = _checks.integer("steps", steps, minimum=1)
    if not callable(pattern_init):
      raise TypeError(
        f"pattern_init must be an initializer (key, shape, dtype) -> array, got "
        f"{type(pattern_init).__name__}"
      )
    self.dtype, self.param_dtype = dtype, param_dtype
    self.patterns = nnx.Param(
      pattern_init(rngs.params(), (self.num_patterns, self.in_features), param_dtype)
    )

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Retrieve from the stored patterns.

    Args:
      inputs: (..., in_features), any number of leading axes.

    Returns:
      (..., in_features), in the computation dtype.
    """
    if not hasattr(inputs, "shape") or not hasattr(inputs, "dtype"):
      raise TypeError(f"inputs must be an array, got {type(inputs).__name__}")
    if inputs.ndim < 1 or inputs.shape[-1] != self.in_features:
      raise ValueError(
        f"inputs must have {self.in_features} features in its last dimension, "
        f"got shape {tuple(inputs.shape)}"
      )
    inputs, patterns = nnx_dtypes.promote_dtype((inputs, self.patterns[...]), dtype=self.dtype)
    return _hopfield.retrieve(inputs, patterns, beta=self.beta, steps=self.steps)
