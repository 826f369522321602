"""Helpers for testing code that uses jattn's accelerator kernels on a machine without one.

Example::

    >>> import jax.numpy as jnp, jattn
    >>> q = jnp.ones((1, 128, 2, 64))
    >>> with jattn.testing.interpret_kernels():
    ...   out = jattn.dot_product_attention(q, q, q, is_causal=True, implementation="splash")
    >>> out.shape
    (1, 128, 2, 64)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("jattn_interpret", default=False)


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
  """Run Pallas kernels (``implementation="splash"``) in Pallas interpret mode.

  Inside the block, calls that name a Pallas kernel run it through Pallas's interpreter on
  any backend: exact but slow, for small shapes in tests. Calls traced inside the block
  compile separately from calls traced outside it. ``implementation=None`` still picks by
  the real backend.
  """
  token = _INTERPRET.set(True)
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def interpreting() -> bool:
  """True inside :func:`interpret_kernels`."""
  return _INTERPRET.get()
