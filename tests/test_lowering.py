"""Routing follows the backend that traces a call, and jattn's settings key the jit cache.

As jax.nn's call does, ``implementation=None`` picks for ``jax.default_backend()``: on this
CPU a program holds the CPU's choice whatever platform it is later lowered for, and that
choice (xla or blockwise) lowers everywhere. ``jattn.testing.lowering_for("tpu")`` traces as
on a TPU: the program holds splash's kernel (``tpu_custom_call``), forward and backward;
``lowering_for(("cpu", "tpu"))`` takes the portable choice for a multi-platform export,
which runs here with the CPU's values. The :mod:`jattn.testing` blocks
(``interpret_kernels``, ``lowering_for``) cannot leak through a user's own jit cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import array

import jattn
from jattn import testing

B, T, N, H = 2, 136, 2, 64
Q = array(np.random.default_rng(0).normal(size=(B, T, N, H)), jnp.bfloat16)
IDS = array(np.repeat([[0] * 50 + [1] * 86], B, axis=0))


def _attend(q):
  return jattn.dot_product_attention(q, q, q, is_causal=True, segment_ids=IDS)


def _grad(q):
  return jax.grad(lambda q: jnp.sum(_attend(q).astype(jnp.float32) ** 2))(q)


def _kernels(text: str) -> int:
  return text.count("tpu_custom_call")


# Forward: one splash kernel. Backward: the forward kernel, dq and dkv; with several devices
# (tests/conftest.py simulates 8) the kernel runs under its Auto-mode partitioning rule,
# whose backward runs the forward kernel once more (jattn/impl/sharded.py).
BACKWARD = 3 + (jax.device_count() > 1)


@pytest.mark.parametrize(
  "fn, kernels", [(_attend, 1), (_grad, BACKWARD)], ids=["forward", "backward"]
)
def test_lowering_for_a_tpu_holds_splash_and_the_default_backend_holds_none(fn, kernels):
  with testing.lowering_for("tpu"):
    exported = export.export(jax.jit(fn), platforms=["tpu"])(Q)
  assert _kernels(exported.mlir_module()) == kernels
  # Traced here, the program holds the CPU's choice, which lowers for any platform.
  for platforms in (("tpu",), ("cpu",), ("cpu", "tpu")):
    assert _kernels(export.export(jax.jit(fn), platforms=platforms)(Q).mlir_module()) == 0
  assert _kernels(jax.jit(fn).trace(Q).lower(lowering_platforms=("tpu",)).as_text()) == 0


@pytest.mark.parametrize("fn", [_attend, _grad], ids=["forward", "backward"])
def test_a_multi_platform_export_runs_the_portable_choice(fn):
  want = jax.jit(fn)(Q)
  with testing.lowering_for(("cpu", "tpu")):
    assert jattn.explain(Q, Q, Q, is_causal=True, segment_ids=IDS).implementation == "xla"
    exported = export.export(jax.jit(fn), platforms=["cpu", "tpu"])(Q)
  assert _kernels(exported.mlir_module()) == 0
  np.testing.assert_array_equal(np.asarray(exported.call(Q)), np.asarray(want))


def test_export_of_the_default_call_on_auto_sharded_inputs():
  """Batch-sharded inputs (Auto mode, 8 simulated devices) export for the TPU and for the CPU
  and the TPU at once: the program holds no host callback, and runs here."""
  mesh = jax.make_mesh((jax.device_count(),), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  q = jax.device_put(
    jnp.tile(Q[:1, :16].astype(jnp.float32), (jax.device_count(), 1, 1, 1)),
    NamedSharding(mesh, P("b")),
  )
  fn = jax.jit(lambda q: jattn.dot_product_attention(q, q, q, is_causal=True))
  for platforms in (["tpu"], ["cpu", "tpu"]):
    exported = export.export(fn, platforms=platforms)(q)
    assert "host_callback" not in exported.mlir_module()
  want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
  np.testing.assert_allclose(exported.call(q), want, atol=1e-6, rtol=1e-6)


def test_lowering_for_checks_its_backends():
  with pytest.raises(ValueError, match="backend must be one of"):
    with testing.lowering_for("metal"):
      pass
  with pytest.raises(ValueError, match="backend must be one of"):
    with testing.lowering_for(()):
      pass
  with pytest.raises(ValueError, match="device_kind names a GPU or a TPU"):
    with testing.lowering_for("cpu", device_kind="NVIDIA H100"):
      pass
  with pytest.raises(ValueError, match="device_kind names a GPU or a TPU"):
    with testing.lowering_for(("cpu", "tpu"), device_kind="TPU v5 lite"):
      pass
  with testing.lowering_for("cuda"):
    assert testing.target_backend() == "gpu" and not testing.portable()
  with testing.lowering_for(["cpu", "cuda", "gpu"]):
    assert testing.target_backend() == "cpu" and testing.portable()


def test_lowering_for_does_not_leak_through_a_users_jit_cache():
  # Lowered for the TPU inside lowering_for, then called here: traced again, and so refused.
  g = jax.jit(lambda q: jattn.dot_product_attention(q, q, q, implementation="splash") * 1.0)
  with testing.lowering_for("tpu"):
    assert _kernels(g.trace(Q).lower(lowering_platforms=("tpu",)).as_text()) == 1
  # ... and the reverse: lowered for the TPU first, then run here, needs a TPU.
  with pytest.raises(ValueError, match="implementation='splash' needs a TPU"):
    g(Q)


def test_interpret_kernels_does_not_leak_through_a_users_jit_cache():
  q = Q[:1, :128].astype(jnp.float32)
  g = jax.jit(lambda q: jattn.dot_product_attention(q, q, q, implementation="splash") * 1.0)
  with testing.interpret_kernels():
    out = g(q)
  want = jattn.dot_product_attention(q, q, q, implementation="xla")
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)
  with pytest.raises(ValueError, match="implementation='splash' needs a TPU"):
    g(q)  # outside the block the cached interpreted program is not reused
