"""Which GPU a call is traced for, and its generation: what the GPU kernels' rows (flex's
tiles, flex_hopper's check) read."""

from __future__ import annotations

import functools

import jax

from jattn import testing

# device_kind names of sm_90 (Hopper) and newer GPUs.
_HOPPER = ("H100", "H200", "H800", "H20", "GH200", "GB200", "B200")


def generation(device_kind: str) -> str:
  """``"sm_90"`` for Hopper and newer (by ``jax.Device.device_kind``), else ``"sm_80"``."""
  return "sm_90" if any(name in device_kind for name in _HOPPER) else "sm_80"


def gpu_kind() -> str:
  """The GPU a call is traced for: the one :func:`jattn.testing.lowering_for` names, else the
  first GPU here ("" without one: interpret mode, or lowering for CUDA from a CPU)."""
  named = testing.target_device_kind()
  if named is not None:
    return named
  return _first_gpu_kind()


@functools.cache
def _first_gpu_kind() -> str:
  try:
    return jax.devices("gpu")[0].device_kind
  except RuntimeError:
    return ""
