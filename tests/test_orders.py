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
from reference import array

import jattn

B, T, N, H = 1, 8, 2, 4


def _q(shape=(B, T, N, H), dtype=jnp.float32, seed=0):
  return array(np.random.default_rng(seed).normal(size=shape), dtype)


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


# autodiff is exhaustive: test_xla's test_autodiff_rule_supports_forward_mode checks its
# second derivatives (both modes) against finite differences in float64 by default.
@pytest.mark.parametrize(
  "backward", [pytest.param("autodiff", marks=pytest.mark.exhaustive), "custom_vjp"]
)
def test_xla_second_order_gradients_match_finite_differences_in_float64(backward):
  with jax.enable_x64():
    q = _q(dtype=jnp.float64)
    fn = lambda q: (_attention(implementation="xla", backward=backward)(q) ** 2).sum()
    # Jitted: check_grads' evaluations of both orders reuse programs instead of running each
    # operation alone.
    jax.test_util.check_grads(jax.jit(fn), (q,), order=2, modes=["rev"], eps=1e-4)


# The custom_vjp's case is exhaustive: its second derivatives are checked by default against
# finite differences in float64 (test_xla_second_order_gradients_match_finite_differences...).
@pytest.mark.parametrize(
  "kw",
  [
    pytest.param(
      dict(implementation="xla", backward="custom_vjp"),
      id="custom_vjp",
      marks=pytest.mark.exhaustive,
    ),
    pytest.param(dict(), id="default"),
  ],
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


# (8, 8), one tile, is exhaustive: (3, 2) takes the Hessian-vector product through whole and
# partial tiles, and jax.hessian through partial ones (test_transforms' hessian-blockwise, two
# by two whole tiles against jax.nn, is exhaustive too).
@pytest.mark.parametrize("block", [pytest.param((8, 8), marks=pytest.mark.exhaustive), (3, 2)])
def test_blockwise_forward_over_reverse_matches_autodiff(block):
  """blockwise's tile loops take JVPs: jax.hessian and jacfwd(grad) work."""
  q, t = _q(), _q(seed=1)
  kw = dict(implementation="blockwise", block_q=block[0], block_kv=block[1])
  np.testing.assert_allclose(
    _jit_hessian_vector(_attention(**kw), q, t), _reference_hessian_vector(), rtol=1e-5, atol=1e-5
  )
  hess = jax.jit(jax.hessian(lambda q: _attention(**kw)(q).sum()))(_q((1, 3, 1, 2)))
  np.testing.assert_allclose(hess, _reference_hessian(), rtol=1e-5, atol=1e-5)


def _raises_naming(fn, *args, who, way_out="implementation='xla'", what="first-order gradients"):
  with pytest.raises(ValueError, match=what) as info:
    fn(*args)
  assert who in str(info.value) and way_out in str(info.value), str(info.value)


def _refuses_forward_mode(fn, *args, who, way_out="implementation='xla' with backward='autodiff'"):
  """jattn's ValueError for forward mode through a custom_vjp rule, naming it and the way out."""
  _raises_naming(
    fn,
    *args,
    who=f"{who} gives reverse-mode derivatives only",
    way_out=way_out,
    what="forward mode",
  )


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
  (jattn/impl/sharded.py). Both refuse what they cannot take with jattn's message, never a
  bare error from inside Pallas."""
  if devices == 1:
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  # A length of its own per case: the jitted call's trace cache does not key on the patched
  # device count, so the second case would rerun the first's trace.
  q = _q((1, 16 * devices, 2, 16))
  fn = _attention(implementation="flex")
  with jattn.testing.interpret_kernels():
    _raises_naming(jax.jit(_grad_of_grad(fn)), q, who="implementation='flex'")
    _raises_naming(_jit_hessian_vector, fn, q, q, who="implementation='flex'")
    _refuses_forward_mode(jax.jit(jax.jacfwd(fn)).lower, q, who="implementation='flex'")


# The default run keeps xla's rule. blockwise is exhaustive: by default test_transforms takes
# jvp, jacfwd and grad of vmap through it, test_attention vmap of its vjp, and
# test_adversarial_paths its forward mode on every call path; flex and splash compile
# interpreted kernels.
@pytest.mark.parametrize(
  "kw",
  [
    pytest.param(dict(implementation="blockwise"), marks=pytest.mark.exhaustive),
    dict(implementation="xla", backward="custom_vjp"),
    pytest.param(dict(implementation="flex"), marks=pytest.mark.exhaustive),
    pytest.param(dict(implementation="splash"), marks=pytest.mark.exhaustive),
  ],
  ids=["blockwise", "xla-custom_vjp", "flex", "splash"],
)
def test_forward_mode_through_a_custom_vjp_rule_raises(kw):
  """jax.jvp, jax.jacfwd and jax.linearize's map of a call whose gradients come from a
  custom_vjp raise jattn's ValueError naming the rule and the way out (JAX's is "can't apply
  forward-mode autodiff (jvp) to a custom_vjp function"), eagerly, under jit and under vmap,
  while reverse mode through vmap, both ways round, gives autodiff's gradients."""
  q = _q((1, 128, 1, 128)) if kw["implementation"] == "splash" else _q()
  fn = _attention(**kw)
  with jattn.testing.interpret_kernels():
    for transform in _FORWARD_MODE:
      _refuses_forward_mode(transform(fn), q, who=f"implementation={kw['implementation']!r}")
    _assert_reverse_through_vmap_is_autodiffs(fn, _attention(**XLA_AUTODIFF), q)


_FORWARD_MODE = (
  lambda fn: lambda q: jax.jvp(fn, (q,), (q,)),
  lambda fn: lambda q: jax.jit(lambda q: jax.jvp(fn, (q,), (q,)))(q),
  lambda fn: jax.jacfwd(fn),
  lambda fn: lambda q: jax.linearize(fn, q)[1](q),
  lambda fn: lambda q: jax.vmap(lambda t: jax.jvp(fn, (q,), (t,))[1])(jnp.stack([q, -q])),
)


def _assert_reverse_through_vmap_is_autodiffs(fn, reference, q, atol=1e-5):
  """grad of vmap and vmap of grad of ``fn`` equal ``reference``'s (a batch of two), all four
  in one jitted program (eagerly, each operation of the two orders compiles alone)."""
  w = jnp.sin(jnp.arange(q.size * 2)).reshape((2, *q.shape))
  grad_of_vmap = lambda f: jax.grad(lambda q: (jax.vmap(f)(jnp.stack([q, q * 2])) * w).sum())
  vmap_of_grad = lambda f: jax.vmap(jax.grad(lambda q, w: (f(q) * w).sum()))
  both = lambda f, q: (grad_of_vmap(f)(q), vmap_of_grad(f)(jnp.stack([q, -q]), w))
  got, want = jax.jit(lambda q: (both(fn, q), both(reference, q)))(q)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=atol)


# One device is exhaustive: the error and its path are the same on eight (sharded, by default).
@pytest.mark.parametrize(
  "devices",
  [
    pytest.param(1, id="one-device", marks=pytest.mark.exhaustive),
    pytest.param(8, id="many-devices"),
  ],
)
def test_forward_mode_through_cudnn_raises(devices, monkeypatch):
  """jax.nn's cuDNN call is a custom_vjp too: forward mode through it raises jattn's error, on
  one device and through the partitioning rule, and its gradients pass through (jax.nn's XLA
  path stands in for the kernel, lowered as for a GPU)."""
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(
    jax.nn, "dot_product_attention", lambda *a, implementation=None, **kw: real(*a, **kw)
  )
  if devices == 1:
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  # cuDNN takes head dims in multiples of 8; a length of its own per case, as for flex.
  q = _q((B, T * devices, N, 8), dtype=jnp.bfloat16)
  fn = lambda q: _attention(implementation="cudnn")(q).astype(jnp.float32)
  reference = lambda q: _attention(**XLA_AUTODIFF)(q).astype(jnp.float32)
  with jattn.testing.lowering_for("gpu"):
    for transform in _FORWARD_MODE:
      _refuses_forward_mode(transform(fn), q, who="implementation='cudnn'")
    _assert_reverse_through_vmap_is_autodiffs(fn, reference, q, atol=2e-2)
    _raises_naming(jax.jit(_grad_of_grad(fn)), q, who="implementation='cudnn'")


# The default run keeps xla's rule; blockwise and the ring are exhaustive, as test_blockwise's
# and test_parallel's check_grads take the same wrappers in float64 by default (partial tiles
# and a bias; a zig-zag causal ring over 4 devices).
@pytest.mark.parametrize(
  "kw",
  [
    pytest.param(
      dict(implementation="blockwise", block_q=3, block_kv=2), marks=pytest.mark.exhaustive
    ),
    dict(implementation="xla", backward="custom_vjp"),
    pytest.param(dict(ring=True), marks=pytest.mark.exhaustive),
  ],
  ids=["blockwise", "xla-custom_vjp", "ring"],
)
def test_custom_vjp_rules_check_grads_in_float64(kw, x64):
  """Each rule's reverse mode, through the wrapper that refuses forward mode, against finite
  differences: query, key, value and bias differentiated."""
  rng = np.random.default_rng(0)
  q, k, v = (array(rng.normal(size=(1, 8, 2, 4))) for _ in range(3))
  bias = array(rng.normal(size=(1, 2, 8, 8)))
  if kw.get("ring"):
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    f = lambda q, k, v: jattn.parallel.ring_attention(
      q, k, v, mesh=mesh, axis_name="sp", is_causal=True
    )
    args = (q, k, v)
  else:
    f = lambda q, k, v, b: jattn.dot_product_attention(q, k, v, b, is_causal=True, **kw)
    args = (q, k, v, bias)
  jax.test_util.check_grads(jax.jit(f), args, order=1, modes=["rev"])


def _ring(q):
  mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))  # shards of 4 rows
  return jattn.parallel.ring_attention(
    q, q * 0.5, jnp.cos(q), mesh=mesh, axis_name="sp", is_causal=True
  )


def test_ring_attention_refuses_forward_mode_and_grad_of_grad():
  q = _q()
  who = "ring_attention(implementation='blockwise')"
  for transform in _FORWARD_MODE[1:3]:  # under jit, and jacfwd
    _refuses_forward_mode(transform(_ring), q, who=who, way_out="implementation='xla'")
  # Under jit: eagerly, every operation of the forward and first backward would compile alone
  # before the second backward raises.
  _raises_naming(jax.jit(_grad_of_grad(_ring)), q, who=who, way_out="'xla'")


# Exhaustive (two thirds of the ring's derivative checks' time): the default run takes
# blockwise's Hessian-vector product (test_blockwise_forward_over_reverse_matches_autodiff),
# the rule every ring pair runs, and reverse mode through vmap on xla's custom_vjp.
@pytest.mark.exhaustive
def test_ring_attention_forward_over_reverse_and_reverse_through_vmap():
  q, t = _q(), _q(seed=1)
  _assert_reverse_through_vmap_is_autodiffs(_ring, _attention(**XLA_AUTODIFF), q)
  np.testing.assert_allclose(
    _jit_hessian_vector(_ring, q, t), _reference_hessian_vector(), rtol=1e-5, atol=1e-5
  )
