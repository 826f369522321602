"""Test configuration: 8 simulated CPU devices, strict JAX numerics, a reproducible
hypothesis profile."""

import os

# Sharding tests (test_parallel.py) run on 8 simulated CPU devices. XLA reads the
# flag when JAX starts its CPU backend, so it is set before anything imports JAX.
# Single-device tests still run on device 0 and are no slower for it.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

# Implicit rank promotion hides shape bugs; jattn never relies on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
  "jattn",
  max_examples=15,
  deadline=None,
  derandomize=True,
  print_blob=True,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("jattn")


@pytest.fixture
def x64():
  """Run a test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield
