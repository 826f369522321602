"""Test configuration: strict JAX numerics and a reproducible hypothesis profile."""

import jax
import pytest
from hypothesis import HealthCheck, settings

# Implicit rank promotion hides shape bugs; jattn never relies on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "jattn", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("jattn")


@pytest.fixture
def x64():
  """Run a test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield
