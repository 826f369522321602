"""Every JAX transformation jax.nn's call takes, through jattn's default call and each rule.

The default call on this CPU picks by the backend that traces it, as jax.nn does: at these
sizes ``"xla"`` with autodiff, so it takes every transformation jax.nn's call takes and gives
its values. Each implementation takes what its rule allows and gives jax.nn's values there;
where it cannot (forward mode through a custom_vjp, a second derivative through a fused
kernel), the call raises jattn's ValueError naming the rule and the way out, never JAX's
internal message. splash and flex run in Pallas interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jattn

B, T, N, H = 2, 16, 2, 8
_RNG = np.random.default_rng(0)
Q, K, V, W = (jnp.asarray(_RNG.normal(size=(B, T, N, H)), jnp.float32) for _ in range(4))
KW = dict(is_causal=True)

IMPLEMENTATIONS = {
  "default": {},
  "xla": dict(implementation="xla"),
  "xla-custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=8, block_kv=8),
  "splash": dict(implementation="splash"),
  "flex": dict(implementation="flex"),
}
FORWARD_MODE = {"default", "xla"}  # autodiff: jvp, jacfwd
SECOND_ORDER = {"default", "xla", "xla-custom_vjp", "blockwise"}  # forward over reverse
FUSED = {"splash", "flex"}


def _loss(attend):
  return lambda q, k, v: jnp.sum(attend(q, k, v) * W)


def _scan(attend):
  def body(carry, _):
    return attend(carry, K, V), None

  return lambda q, k, v: jax.lax.scan(body, q, None, length=2)[0]


def _shard_map(attend, check_vma=True):
  """attend on each device's batch row, and its gradient (two devices)."""
  mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  mapped = jax.shard_map(
    attend, mesh=mesh, in_specs=(P("b"),) * 3, out_specs=P("b"), check_vma=check_vma
  )
  return lambda q, k, v: (mapped(q, k, v), jax.grad(_loss(mapped))(q, k, v))


# name -> (the transformation of attend(q, k, v), what it needs of the rule)
TRANSFORMS = {
  "jit": (lambda f: jax.jit(f)(Q, K, V), None),
  "grad": (lambda f: jax.grad(_loss(f), argnums=(0, 1, 2))(Q, K, V), None),
  "vjp": (lambda f: jax.vjp(f, Q, K, V)[1](W), None),
  "jacrev": (lambda f: jax.jacrev(lambda q: f(q, K, V)[0, :4, 0])(Q), None),
  "vmap": (lambda f: jax.vmap(f)(*(jnp.stack([x, x[::-1]]) for x in (Q, K, V))), None),
  "vmap-grad": (
    lambda f: jax.vmap(jax.grad(_loss(f)))(*(jnp.stack([x, x[::-1]]) for x in (Q, K, V))),
    None,
  ),
  "grad-vmap": (
    lambda f: jax.grad(
      lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v) * jnp.stack([W, -W])), argnums=(0, 1, 2)
    )(*(jnp.stack([x, x[::-1]]) for x in (Q, K, V))),
    None,
  ),
  "remat": (lambda f: jax.grad(jax.checkpoint(_loss(f)), argnums=(0, 1, 2))(Q, K, V), None),
  "scan": (lambda f: jax.grad(lambda q: jnp.sum(_scan(f)(q, K, V) * W))(Q), None),
  "shard_map": (lambda f: _shard_map(f)(Q, K, V), None),
  # Pallas kernels' results carry no varying-axes types: fused kernels need check_vma=False.
  "shard_map-unchecked": (lambda f: _shard_map(f, check_vma=False)(Q, K, V), None),
  "jvp": (lambda f: jax.jvp(f, (Q, K, V), (W, W * 0.5, W[::-1]))[1], "forward"),
  "jacfwd": (lambda f: jax.jacfwd(lambda q: f(q, K, V)[0, :4, 0])(Q), "forward"),
  "hessian": (
    lambda f: jax.hessian(lambda q: jnp.sum(f(q, K, V)[0, :3] * W[0, :3]))(Q[:, :3, :1]),
    "second",
  ),
}


def _attention(kw):
  def attend(q, k, v):
    if q.shape[1] != k.shape[1]:  # hessian's short query: the keys up to it
      k, v = k[:, : q.shape[1], : q.shape[2]], v[:, : q.shape[1], : q.shape[2]]
    return jattn.dot_product_attention(q, k, v, **KW, **kw)

  return attend


def _reference(q, k, v):
  if q.shape[1] != k.shape[1]:
    k, v = k[:, : q.shape[1], : q.shape[2]], v[:, : q.shape[1], : q.shape[2]]
  return jax.nn.dot_product_attention(q, k, v, **KW)


# Cases the default run checks in other files, exhaustive here: blockwise's hessian (test_orders'
# blockwise forward-over-reverse case, against autodiff), its jacrev and vmap of grad (a vmap of
# a vjp through the reverse-only wrapper every rule shares: test_attention's vmap-against-a-loop
# case through xla's custom_vjp, and grad-vmap here) and its vjp (grad here and
# test_blockwise's gradients); the fused kernels' gradients (test_splash and test_flex, against
# xla).
ELSEWHERE = {
  ("hessian", "blockwise"),
  ("jacrev", "blockwise"),
  ("vmap-grad", "blockwise"),
  ("vjp", "blockwise"),
  ("grad", "splash"),
  ("grad", "flex"),
}


def _cases():
  for t in TRANSFORMS:
    for name in IMPLEMENTATIONS:
      # By default: every transformation of the default call, and of each rule the
      # cheap ones; shard_map and the fused kernels' heavier cases are the exhaustive tier.
      heavy = name != "default" and (
        t.startswith("shard_map") or (name in FUSED and t not in ("grad", "jvp", "hessian"))
      )
      marks = [pytest.mark.exhaustive] if heavy or (t, name) in ELSEWHERE else []
      yield pytest.param(t, name, id=f"{t}-{name}", marks=marks)


def _jitted(*thunks):
  """The thunks' results from one jitted program: run eagerly, each operation of a
  transformation (a jax.grad, vmap, shard_map) compiles a program of its own."""
  return jax.jit(lambda: tuple(thunk() for thunk in thunks))()


@pytest.mark.parametrize("transform, name", list(_cases()))
def test_transformation_equals_jax_nn_or_raises_jattns_error(transform, name):
  apply, needs = TRANSFORMS[transform]
  if transform == "shard_map" and name in FUSED:
    pytest.skip("shard_map-unchecked runs them; test_a_checked_shard_map_... the refusal")
  takes = (
    needs is None
    or (needs == "forward" and name in FORWARD_MODE)
    or (needs == "second" and name in SECOND_ORDER)
  )
  with jattn.testing.interpret_kernels():
    if not takes:
      what = "reverse-mode derivatives only" if needs == "forward" else "first-order"
      with pytest.raises(ValueError, match=what) as info:
        _jitted(lambda: apply(_attention(IMPLEMENTATIONS[name])))
      assert "implementation='xla'" in str(info.value), str(info.value)
      return
    got, want = _jitted(lambda: apply(_attention(IMPLEMENTATIONS[name])), lambda: apply(_reference))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def test_the_default_call_is_xla_with_autodiff_here():
  """What makes the default take every transformation: its choice on this CPU."""
  choice = jattn.explain(Q, K, V, **KW)
  assert (choice.implementation, choice.backward) == ("xla", "autodiff")


def test_a_checked_shard_map_refuses_pallas_kernels_and_the_default_falls_back():
  """Inside a shard_map that checks varying axes, an explicit Pallas kernel names
  check_vma=False; the default call traced as on a TPU picks a portable rule and composes."""
  with jattn.testing.interpret_kernels():
    for name in FUSED:
      with pytest.raises(ValueError, match=f"implementation='{name}'.*check_vma=False"):
        _jitted(lambda: _shard_map(_attention(IMPLEMENTATIONS[name]))(Q, K, V))
  with jattn.testing.lowering_for("tpu"):
    assert jattn.explain(Q, K, V, **KW).implementation == "splash"
    got, want = _jitted(
      lambda: _shard_map(_attention({}))(Q, K, V), lambda: _shard_map(_reference)(Q, K, V)
    )
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
