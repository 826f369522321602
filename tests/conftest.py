"""Test configuration: 8 simulated CPU devices, XLA flags that compile the tests' small
programs quickly, strict JAX numerics, a reproducible hypothesis profile, the ``x64`` fixture,
the count of the sweeps' ``exhaustive`` cases the run left out and a quick exit for workers."""

import gc
import importlib.metadata
import os
import sys

# Sharding tests run on 8 simulated CPU devices. XLA reads the flag when JAX starts its CPU
# backend, so it is set before anything imports JAX; single-device tests still run on device 0.
# The tests' programs are tiny: LLVM's costly passes are turned down so they compile quickly
# (docs/tuning.md). JATTN_TEST_OPTIMIZE=1 keeps XLA's defaults, the programs users get. A flag
# is set only where the installed XLA knows it (an unknown flag in XLA_FLAGS aborts).
_JAXLIB = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
_TEST_FLAGS = {
  "xla_force_host_platform_device_count": "8",
  **(
    {}
    if os.environ.get("JATTN_TEST_OPTIMIZE") == "1"
    else {
      "xla_backend_optimization_level": "0",
      "xla_llvm_disable_expensive_passes": "true",
      # jaxlib 0.11.2's XLA (0.12's too) has no classic emitters and aborts on the flag it
      # no longer knows; jaxlib 0.10 still takes it.
      **({"xla_cpu_use_fusion_emitters": "false"} if _JAXLIB < (0, 11) else {}),
      "xla_cpu_parallel_codegen_split_count": "1",
    }
  ),
}
for _name, _value in _TEST_FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Tracing allocates millions of short-lived objects: what the imports made is frozen out of
# collections, and the young generation is collected far less often (refcounts still free).
gc.freeze()
gc.set_threshold(200_000, 20, 50)

# Implicit rank promotion hides shape bugs; jattn never relies on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

# No test reads the source locations of the programs: each operation keeps its one user frame.
jax.config.update("jax_include_full_tracebacks_in_locations", False)

_steady = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("jattn", max_examples=15, print_blob=True, **_steady)
settings.load_profile("jattn")


@pytest.fixture
def x64():
  """Run a test with 64-bit types enabled."""
  with jax.enable_x64(True):
    yield


# pyproject.toml's -m "not exhaustive" leaves out the cases marked exhaustive beside their sweeps.
# Under xdist each worker deselects, uncounted by pytest's summary: the workers send their count,
# and the main process says it once at the end.
_left_out = [0]


def pytest_deselected(items):
  _left_out[0] += sum(1 for item in items if item.get_closest_marker("exhaustive"))


def pytest_collection_finish(session):
  if hasattr(session.config, "workeroutput"):
    session.config.workeroutput["exhaustive_left_out"] = _left_out[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  _left_out[0] = max(_left_out[0], getattr(node, "workeroutput", {}).get("exhaustive_left_out", 0))


@pytest.hookimpl(trylast=True)  # after the slowest durations, above pytest's last line
def pytest_terminal_summary(terminalreporter):
  if n := _left_out[0]:
    terminalreporter.write_line(f"{n} exhaustive cases left out: -m exhaustive runs them")


# A worker has sent its results when it unconfigures. Ending its process there, first, skips
# freeing the programs and traces it cached and pytest's last hunt for unraisable exceptions
# (five garbage collections, a second): time the main process spent waiting for the workers.
@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
  if hasattr(config, "workerinput"):
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
