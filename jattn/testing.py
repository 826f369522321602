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
from collections.abc import Iterator, Sequence

import jax

from jattn import _compat

__all__ = [
  "interpret_kernels",
  "interpreting",
  "lowering_for",
  "portable",
  "target_backend",
  "target_device_kind",
]

# JAX "user contexts": their values are part of every jit cache key (the user's own jitted
# functions included), so a function traced inside one of the blocks below is traced again
# outside it, and the reverse: a setting cannot leak through a cached program.
_INTERPRET = jax.make_user_context(False)
_BACKEND = jax.make_user_context(None)
_DEVICE_KIND = jax.make_user_context(None)


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
  """Run Pallas kernels (``implementation="splash"``) in Pallas interpret mode.

  Inside the block, calls that name a Pallas kernel run it through Pallas's interpreter on
  any backend: exact but slow, for small shapes in tests. The setting is part of every jit
  cache key, so any jitted function (yours included) traced inside the block compiles
  separately from the same function traced outside it. ``implementation=None`` still picks
  by the real backend.
  """
  with _INTERPRET(True):
    yield


def interpreting() -> bool:
  """True inside :func:`interpret_kernels`."""
  return bool(_INTERPRET.value)


@contextlib.contextmanager
def lowering_for(backend: str | Sequence[str], device_kind: str | None = None) -> Iterator[None]:
  """Route calls traced inside the block as on ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``).

  ``implementation=None`` picks by the backend that traces the call, as
  ``jax.nn.dot_product_attention`` does: ``jax.default_backend()``. To lower or export a
  program for another platform from this machine, name that platform here::

      with jattn.testing.lowering_for("tpu"):
        text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()

  ``implementation=None`` then picks what it would pick there (splash on TPU), and an
  explicit ``implementation="splash"`` is accepted; the program can be lowered, not run,
  unless it is run on that platform. A sequence of backends (``("cpu", "tpu")``) is for a
  program lowered for all of them at once (``jax.export(..., platforms=["cpu", "tpu"])``):
  ``implementation=None`` then takes the portable choice (``"xla"`` or ``"blockwise"``,
  sized as on the first backend), which lowers everywhere. Like :func:`interpret_kernels`,
  the setting is part of every jit cache key. ``"cuda"`` and ``"rocm"`` (lowering platform
  names) mean ``"gpu"``.

  ``device_kind``: the GPU the program is for, as ``jax.Device.device_kind`` names it
  (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-80GB"``): flex picks its tiles for that
  GPU's generation, and Pallas' Triton lowering (which from JAX 0.12 reads the GPU's compute
  capability) targets it. With ``backend="tpu"``, the TPU (``"TPU v5 lite"``): Mosaic's
  lowering of kernels that read the chip's generation (JAX's ragged paged attention,
  ``implementation="ragged_paged"`` of :func:`jattn.decode.ragged_attention`) targets it.
  """
  names = (backend,) if isinstance(backend, str) else tuple(backend)
  backends = tuple(dict.fromkeys(_BACKEND_OF.get(b, b) for b in names))
  if not backends or any(b not in ("cpu", "gpu", "tpu") for b in backends):
    raise ValueError(
      "backend must be one of ['cpu', 'gpu', 'tpu'] (or 'cuda', 'rocm'), or a non-empty "
      f"sequence of them, got {backend!r}"
    )
  if device_kind is not None and backends not in (("gpu",), ("tpu",)):
    raise ValueError(
      f"device_kind names a GPU or a TPU; backend is {backend!r}, not 'gpu' or 'tpu'"
    )
  if device_kind is not None and backends == ("tpu",) and not device_kind.startswith("TPU"):
    raise ValueError(
      f"device_kind must name a TPU for backend 'tpu', as jax.Device.device_kind does "
      f"('TPU v5 lite', 'TPU v6 lite'), got {device_kind!r}"
    )
  with contextlib.ExitStack() as stack:
    stack.enter_context(_BACKEND(backends))
    if device_kind is not None and backends == ("tpu",):
      stack.enter_context(_compat.tpu_target(device_kind))
    elif device_kind is not None:
      stack.enter_context(_DEVICE_KIND(device_kind))
      stack.enter_context(_compat.gpu_target(device_kind))
    yield


_BACKEND_OF = {"cuda": "gpu", "rocm": "gpu"}


def target_backend() -> str | None:
  """The backend named by :func:`lowering_for` (the first, when it names several), or None."""
  backends = _BACKEND.value
  return backends[0] if backends else None


def portable() -> bool:
  """True inside :func:`lowering_for` naming several backends: the call must lower on each."""
  return len(_BACKEND.value or ()) > 1


def target_device_kind() -> str | None:
  """The GPU named by :func:`lowering_for`'s ``device_kind``, or None."""
  return _DEVICE_KIND.value
