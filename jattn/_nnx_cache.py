"""Flax NNX: :class:`jattn.nnx.MultiHeadAttention`'s KV cache, kept as one ``nnx.Cache``
variable per array of the :mod:`jattn.decode` cache (``cache_key``, ``cache_lengths``,
``cache_page_table``, ...), None for the fields it lacks.
"""

from __future__ import annotations

from flax import nnx

from jattn import _flax_cache
from jattn import decode as _decode


def store(module: nnx.Module, cache: _decode.Cache | None) -> None:
  """One ``nnx.Cache`` per array of ``cache`` on ``module``, None for the fields it lacks
  (all of them for None: no cache)."""
  held = {} if cache is None else cache._asdict()
  for field in _flax_cache.CACHE_FIELDS:
    x = held.get(field)
    setattr(module, f"cache_{field}", nnx.data(None) if x is None else nnx.Cache(x))


def write(module: nnx.Module, cache: _decode.Cache) -> None:
  """Store a cache of the held one's kind and shapes into its variables."""
  for field, x in cache._asdict().items():
    if x is not None:
      getattr(module, f"cache_{field}")[...] = x


def held(module: nnx.Module) -> _decode.Cache | None:
  """The cache ``module``'s variables hold, or None when they hold none."""
  variables = {f: getattr(module, f"cache_{f}") for f in _flax_cache.CACHE_FIELDS}
  return _flax_cache.cache_from(lambda f: None if variables[f] is None else variables[f][...])
