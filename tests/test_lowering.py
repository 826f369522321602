"""Routing follows the platform a program is lowered for, and jattn's settings key the jit cache.

From this CPU: ``.lower(lowering_platforms=("tpu",))`` and ``jax.export`` for ``["tpu"]``
of a function calling ``implementation=None`` hold splash's kernel (``tpu_custom_call``),
forward and backward, with no jattn context manager; a multi-platform export
(``["cpu", "tpu"]``) holds it too and runs here with the CPU's values. The
:mod:`jattn.testing` blocks (``interpret_kernels``, ``lowering_for``) cannot leak through a
user's own jit cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jattn
from jattn import testing

B, T, N, H = 2, 136, 2, 64
Q = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, N, H)), jnp.bfloat16)
IDS = jnp.asarray(np.repeat([[0] * 50 + [1] * 86], B, axis=0))


def _attend(q):
  return jattn.dot_product_attention(q, q, q, is_causal=True, segment_ids=IDS)


def _grad(q):
  return jax.grad(lambda q: jnp.sum(_attend(q).astype(jnp.float32) ** 2))(q)


def _kernels(text: str) -> int:
  return text.count("tpu_custom_call")


# Forward: one splash kernel. Backward: the forward kernel, dq and dkv; with several devices
# (tests/conftest.py simulates 8) the kernel runs under its Auto-mode partitioning rule,
# whose backward runs the forward kernel once more (jattn/impl/_sharded.py).
BACKWARD = 3 + (jax.device_count() > 1)


@pytest.mark.parametrize(
  "fn, kernels", [(_attend, 1), (_grad, BACKWARD)], ids=["forward", "backward"]
)
def test_export_routes_as_on_each_platform(fn, kernels):
  want = jax.jit(fn)(Q)
  for platforms in (("tpu",), ("cpu",), ("cpu", "tpu")):
    exported = export.export(jax.jit(fn), platforms=platforms)(Q)
    assert _kernels(exported.mlir_module()) == (kernels if "tpu" in platforms else 0), platforms
    if "cpu" in platforms:  # the CPU's branch runs here, with the CPU's values
      np.testing.assert_array_equal(np.asarray(exported.call(Q)), np.asarray(want))


def test_lowering_platforms_route_without_a_context_manager():
  traced = jax.jit(_grad).trace(Q)
  assert _kernels(traced.lower(lowering_platforms=("tpu",)).as_text()) == BACKWARD
  assert _kernels(traced.lower(lowering_platforms=("cpu",)).as_text()) == 0


def test_explain_names_what_runs_where_the_program_is_lowered_elsewhere():
  choice = jattn.explain(Q, Q, Q, is_causal=True, segment_ids=IDS, backend=None)
  assert choice.implementation == "xla" and choice.elsewhere == {"tpu": "splash"}
  assert "lowered for tpu: splash" in str(choice)
  # A call splash cannot express runs the portable choice everywhere.
  bias = jnp.zeros((T, T), jnp.bfloat16)
  assert jattn.explain(Q, Q, Q, bias, is_causal=True).elsewhere == {}
  # backward= names a jattn rule: no fused kernel anywhere, so forward mode works.
  assert jattn.explain(Q, Q, Q, is_causal=True, backward="autodiff").elsewhere == {}
  f = lambda q: jattn.dot_product_attention(q, q, q, is_causal=True, backward="autodiff")
  jax.jvp(f, (Q,), (Q,))


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


# ------------------------------------------------------------------ deferred tracing


def _primitives(jaxpr) -> set[str]:
  """The names of the primitives in a jaxpr and every jaxpr its equations hold."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def test_a_route_is_traced_only_where_it_is_lowered():
  """On this CPU with 8 devices (Auto mode), tracing a routed call and its gradient traces
  no splash kernel; lowering it for a TPU traces and holds them all."""
  assert jax.device_count() > 1  # tests/conftest.py; one device keeps the kernels' own VJP
  names = _primitives(jax.make_jaxpr(_grad)(Q).jaxpr)
  assert "jattn_deferred" in names and "pallas_call" not in names
  assert _kernels(jax.jit(_grad).trace(Q).lower(lowering_platforms=("tpu",)).as_text()) == BACKWARD


def test_a_deferred_call_is_traced_when_lowered_and_checks_its_types():
  from jattn.impl import _deferred

  x = jnp.arange(6.0).reshape(2, 3)
  types = [jax.core.ShapedArray((2, 3), jnp.float32)]
  calls = []

  def double(x):
    calls.append(x.shape)
    return [x * 2]

  np.testing.assert_array_equal(_deferred.call(double, types, x)[0], x * 2)  # eager
  calls.clear()
  jaxpr = jax.make_jaxpr(lambda x: _deferred.call(double, types, x))(x)
  assert calls == [] and _primitives(jaxpr.jaxpr) == {"jattn_deferred"}
  np.testing.assert_array_equal(jax.jit(lambda x: _deferred.call(double, types, x)[0])(x), x * 2)
  assert calls == [(2, 3)]  # traced once, by the lowering
  wrong = [jax.core.ShapedArray((3, 2), jnp.float32)]
  with pytest.raises(TypeError, match=r"returned \[\(\(2, 3\), .*declared \[\(\(3, 2\)"):
    jax.jit(lambda x: _deferred.call(double, wrong, x)[0]).lower(x)
  with pytest.raises(NotImplementedError, match="no batching rule"):
    jax.vmap(lambda x: _deferred.call(double, types[:1], x)[0])(jnp.stack([x, x]))
