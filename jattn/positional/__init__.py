"""Positional encodings: sinusoids, rotary embeddings (RoPE) with context scaling, ALiBi slopes.

Pure functions of arrays plus two frozen settings objects. Shape legend
(shared with :mod:`jattn.attention`): B batch, T length, N heads, H head
dimension, R the rotary dimension (the first R of the H channels rotate).

* :func:`sinusoidal` — Vaswani et al. (2017) absolute embeddings, (..., dim).
* :func:`rope` — rotary embeddings (Su et al., 2021) applied to queries or
  keys in (B, T, N, H) or (T, N, H) layout, optionally on a fraction of the
  channels and with a :class:`RopeScaling` (linear, NTK, Llama 3.1, YaRN);
  :func:`rope_frequencies` gives its inverse frequencies and
  :class:`Rotary` bundles its settings for modules.
* :func:`alibi_slopes` — per-head slopes for :func:`jattn.scores.alibi`.

Frequencies and slopes depend only on static settings, so they are computed
once in NumPy float64 and returned as NumPy float32 constants.

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import positional
    >>> q = jnp.ones((2, 5, 4, 8))                        # (B, T, N, H)
    >>> positional.rope(q, jnp.arange(5)).shape
    (2, 5, 4, 8)
"""

from jattn.positional._alibi import alibi_slopes as alibi_slopes
from jattn.positional._rope import SCALING_KINDS as SCALING_KINDS
from jattn.positional._rope import RopeScaling as RopeScaling
from jattn.positional._rope import Rotary as Rotary
from jattn.positional._rope import rope as rope
from jattn.positional._rope import rope_frequencies as rope_frequencies
from jattn.positional._sinusoidal import sinusoidal as sinusoidal

__all__ = [
  "sinusoidal",
  "RopeScaling",
  "rope_frequencies",
  "rope",
  "Rotary",
  "alibi_slopes",
]
