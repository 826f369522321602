"""Flax NNX: :class:`jattn.nnx.MultiHeadAttention`'s KV cache, kept as one ``nnx.Cache``
attribute per variable of :mod:`jattn.flax._cache` (Flax's ``cached_key``, ``cached_value``,
``cache_index``; jattn's ``cache_lengths``, ``page_table``, ...), None for those it lacks.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx

from jattn.flax import _cache as _flax_cache


def store(module: nnx.Module, variables: Mapping[str, jax.Array]) -> None:
  """One ``nnx.Cache`` attribute per variable on ``module``, None for the others (all of
  them for an empty mapping: no cache)."""
  for name in _flax_cache.VARIABLES:
    x = variables.get(name)
    setattr(module, name, nnx.data(None) if x is None else nnx.Cache(x))


def write(module: nnx.Module, variables: Mapping[str, jax.Array]) -> None:
  """Store new values of the held variables (same names and shapes)."""
  for name, x in variables.items():
    getattr(module, name)[...] = x


def held(module: nnx.Module) -> _flax_cache.Held | None:
  """The cache ``module``'s variables hold, or None when they hold none."""

  def get(name: str) -> jax.Array | None:
    variable = getattr(module, name, None)
    return None if variable is None else variable[...]

  return _flax_cache.held(get)
