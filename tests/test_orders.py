"""Derivatives of every order: what each rule supports works, the rest raises jattn's error.

docs/backward.md has the table: implementation="xla" differentiates to any order; blockwise
(and ring attention over blockwise pairs) takes first-order gradients and forward-over-reverse
ones (jax.hessian); splash and flex take first-order gradients. Every custom_vjp rule refuses
forward mode (jax.jvp, jax.jacfwd) in jattn's words. The default call follows the backend
that traces it: on this CPU it takes whatever xla takes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jattn

B, T, N, H = 1, 8, 2, 4


def _q(shape=(B, T, N, H), dtype=jnp.float32, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _attention(**kw):
  return lambda q: jattn.dot_product_attention(q, q * 0.5, jnp.cos(q), is_causal=True, **kw)


def _grad_of_grad(fn):
  """The gradient of |∇ sum(fn(q) · w)|²: a reverse pass over a reverse pass."""
  first = lambda q: jax.grad(
    lambda q: (fn(q) * jnp.sin(jnp.arange(q.size)).reshape(q.shape)).sum()
  )(q)
  return jax.grad(lambda q: (first(q) ** 2).sum())


def _hessian_vector(fn, q, t):
  """Forward over reverse: the Hessian of sum(fn(q)²) times t."""
  return jax.jvp(jax.grad(lambda q: (fn(q) ** 2).sum()), (q,), (t,))[1]


def _jit_hessian_vector(fn, q, t):
  """``_hessian_vector`` as one program: eagerly every operation of both orders compiles
  alone. The same JVP and transpose rules are traced."""
  return jax.jit(lambda q, t: _hessian_vector(fn, q, t))(q, t)


XLA_AUTODIFF = dict(implementation="xla", backward="autodiff")


# The references, autodiff of the materialised path, are computed once for the file: each
# case below differentiates a fresh lambda, which jax.jit would compile again.
@functools.cache
def _reference_grad_of_grad():
  return jax.jit(_grad_of_grad(_attention(**XLA_AUTODIFF)))(_q())


@functools.cache
def _reference_hessian_vector():
  return _jit_hessian_vector(_attention(**XLA_AUTODIFF), _q(), _q(seed=1))


@functools.cache
def _reference_hessian():
  return jax.jit(jax.hessian(lambda q: _attention(**XLA_AUTODIFF)(q).sum()))(_q((1, 3, 1, 2)))


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_xla_second_order_gradients_match_finite_differences_in_float64(backward):
  with jax.enable_x64():
    q = _q(dtype=jnp.float64)
    fn = lambda q: (_attention(implementation="xla", backward=backward)(q) ** 2).sum()
    jax.test_util.check_grads(fn, (q,), order=2, modes=["rev"], eps=1e-4)


@pytest.mark.parametrize(
  "kw", [dict(implementation="xla", backward="custom_vjp"), dict()], ids=["custom_vjp", "default"]
)
def test_grad_of_grad_equals_autodiff_of_the_plain_path(kw):
  """The default call (splash in its TPU branch, xla here) and xla's custom_vjp differentiate
  twice to what autodiff of the materialised path gives."""
  q = _q()
  want = _reference_grad_of_grad()
  np.testing.assert_allclose(_grad_of_grad(_attention(**kw))(q), want, rtol=1e-5, atol=1e-5)
  jitted = jax.jit(_grad_of_grad(_attention(**kw)))(q)
  np.testing.assert_allclose(jitted, want, rtol=1e-5, atol=1e-5)


def test_default_call_batches_and_takes_forward_modes():
  q = _q((2, B, T, N, H))
  out = jax.vmap(_attention())(q)
  np.testing.assert_allclose(out, jax.vmap(_attention(**XLA_AUTODIFF))(q), atol=1e-6)
  hvp = _hessian_vector(_attention(), q[0], q[1])
  np.testing.assert_allclose(
    hvp, _hessian_vector(_attention(**XLA_AUTODIFF), q[0], q[1]), rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("block", [(8, 8), (3, 2)])
def test_blockwise_forward_over_reverse_matches_autodiff(block):
  """blockwise's tile loops take JVPs: jax.hessian and jacfwd(grad) work."""
  q, t = _q(), _q(seed=1)
  kw = dict(implementation="blockwise", block_q=block[0], block_kv=block[1])
  np.testing.assert_allclose(
    _jit_hessian_vector(_attention(**kw), q, t), _reference_hessian_vector(), rtol=1e-5, atol=1e-5
  )
  hess = jax.jit(jax.hessian(lambda q: _attention(**kw)(q).sum()))(_q((1, 3, 1, 2)))
  np.testing.assert_allclose(hess, _reference_hessian(), rtol=1e-5, atol=1e-5)


def _raises_naming(fn, *args, who, way_out="implementation='xla'"):
  with pytest.raises(ValueError, match="first-order gradients") as info:
    fn(*args)
  assert who in str(info.value) and way_out in str(info.value), str(info.value)


def test_blockwise_grad_of_grad_raises_naming_the_rule_and_the_way_out():
  """The default picks blockwise on long sequences; its second reverse pass used to fail with
  JAX's message about while loops with dynamic bounds."""
  long = _q((1, 2048, 1, 4))  # float32 scores of 16 MiB: over the CPU's 8 MiB
  assert jattn.explain(long, long, long, is_causal=True).implementation == "blockwise"
  # Eagerly through the default's route (the rule raises as under jit, the same message;
  # an eager call runs every operation of both passes alone before it), and under jit.
  _raises_naming(_grad_of_grad(_attention()), long, who="implementation='blockwise'")
  for kw in (dict(), dict(implementation="blockwise")):
    _raises_naming(jax.jit(_grad_of_grad(_attention(**kw))), long, who="implementation='blockwise'")
  # The way out named by the message works (one program: eagerly, every operation on the
  # 2048 x 2048 scores compiles and runs alone).
  out = jax.jit(_grad_of_grad(_attention(implementation="xla")))(long)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("residual", [False, True])
def test_splash_second_derivatives_raise_naming_splash(residual):
  q = _q((1, 128, 2, 128))

  def fn(q):
    kw = dict(implementation="splash", return_residual=residual)
    got = jattn.dot_product_attention(q, q * 0.5, jnp.cos(q), is_causal=True, **kw)
    return got[0] + got[1][..., None] if residual else got

  with jattn.testing.interpret_kernels():
    _raises_naming(_grad_of_grad(fn), q, who="implementation='splash'")
    if not residual:  # forward over reverse (with lse: JAX's own "jvp of a custom_vjp")
      _raises_naming(_hessian_vector, fn, q, q, who="implementation='splash'")


def test_a_default_call_traced_for_tpu_refuses_a_second_derivative():
  """Traced as on a TPU, the default call runs splash, whose second derivative is refused in
  jattn's words when traced; its first derivative lowers to the kernels."""
  q = _q((1, 128, 2, 128))
  with jattn.testing.lowering_for("tpu"):
    with pytest.raises(ValueError, match="implementation='splash' gives first-order"):
      jax.jit(_grad_of_grad(_attention())).trace(q)
    first = jax.jit(jax.grad(lambda q: _attention()(q).sum())).trace(q)
    assert "tpu_custom_call" in first.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("devices", [1, 8], ids=["one-device", "many-devices"])
def test_flex_refuses_higher_and_forward_derivatives_naming_the_rule(devices, monkeypatch):
  """On one device flex runs its own custom_vjp; on several its Auto-mode partitioning rule
  (jattn/impl/_sharded.py). Both refuse what they cannot take with jattn's message, never a
  bare error from inside Pallas."""
  if devices == 1:
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  q = _q((1, 16, 2, 16))
  fn = _attention(implementation="flex")
  with jattn.testing.interpret_kernels():
    _raises_naming(jax.jit(_grad_of_grad(fn)), q, who="implementation='flex'")
    _raises_naming(_jit_hessian_vector, fn, q, q, who="implementation='flex'")
    with pytest.raises(TypeError, match="forward-mode autodiff"):  # JAX's: see docs/backward.md
      jax.jit(jax.jacfwd(fn)).lower(q)


@pytest.mark.parametrize(
  "kw",
  [
    dict(implementation="blockwise"),
    dict(implementation="xla", backward="custom_vjp"),
    pytest.param(dict(implementation="flex"), marks=pytest.mark.exhaustive),
    pytest.param(dict(implementation="splash"), marks=pytest.mark.exhaustive),
  ],
  ids=["blockwise", "xla-custom_vjp", "flex", "splash"],
)
def test_forward_mode_through_a_custom_vjp_rule_raises(kw):
  """jax.jvp and jax.jacfwd of a call whose gradients come from a custom_vjp raise JAX's
  TypeError, eagerly, under jit and under vmap (a wrapper that reworded it broke grad of
  vmap: docs/backward.md), while grad of vmap works."""
  q = _q((1, 128, 1, 128)) if kw["implementation"] == "splash" else _q()
  fn = _attention(**kw)
  grad_of_vmap = jax.grad(lambda q: jax.vmap(fn)(jnp.stack([q, q * 2])).sum())
  with jattn.testing.interpret_kernels():
    for transform in (
      lambda q: jax.jvp(fn, (q,), (q,)),
      lambda q: jax.jit(lambda q: jax.jvp(fn, (q,), (q,)))(q),
      lambda q: jax.jacfwd(fn)(q),
      lambda q: jax.linearize(fn, q)[1](q),
    ):
      with pytest.raises(TypeError, match="forward-mode autodiff"):
        transform(q)
    assert np.isfinite(np.asarray(grad_of_vmap(q))).all()


def test_ring_attention_second_derivatives():
  mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))  # shards of 4 rows
  q, t = _q(), _q(seed=1)
  ring = lambda q: jattn.parallel.ring_attention(
    q, q * 0.5, jnp.cos(q), mesh=mesh, axis_name="sp", is_causal=True
  )
  np.testing.assert_allclose(
    _jit_hessian_vector(ring, q, t), _reference_hessian_vector(), rtol=1e-5, atol=1e-5
  )
  # Under jit: eagerly, every operation of the forward and first backward would compile alone
  # before the second backward raises.
  _raises_naming(
    jax.jit(_grad_of_grad(ring)),
    q,
    who="ring_attention(implementation='blockwise')",
    way_out="'xla'",
  )
