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
_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("jattn_backend", default=None)


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


@contextlib.contextmanager
def lowering_for(backend: str) -> Iterator[None]:
  """Route calls traced inside the block as on ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``).

  For lowering a program for another platform from this machine::

      with jattn.testing.lowering_for("tpu"):
        text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()

  ``implementation=None`` then picks what it would pick there (splash on TPU), and an
  explicit ``implementation="splash"`` is accepted; the program can be lowered, not run,
  unless it is run on that platform.
  """
  if backend not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"backend must be one of ['cpu', 'gpu', 'tpu'], got {backend!r}")
  token = _BACKEND.set(backend)
  try:
    yield
  finally:
    _BACKEND.reset(token)


def target_backend() -> str | None:
  """The backend named by :func:`lowering_for`, or None."""
  return _BACKEND.get()
