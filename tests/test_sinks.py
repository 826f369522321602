"""Attention sinks: one extra logit per head with no value, in every rule and entry point.

The reference is the float64 NumPy formula below: out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} +
e^{sink}), lse = log(Σ_j e^{s_j} + e^{sink}), over the positions the mask allows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jattn
import jattn.linen
import jattn.nnx
from jattn import decode

B, T, S, H = 2, 12, 12, 8
RNG = np.random.default_rng(7)
SINKS = RNG.normal(size=(4,)) * 2
MASK = np.tril(np.ones((T, S), bool))
MASK[3] = False  # a row with nothing to attend to: out 0, lse = sink


def formula(q, k, v, sinks, mask, scale=None):
  """float64 NumPy: (out (B, T, N, H), lse (B, T, N)), GQA by repeating key/value heads."""
  N, K = q.shape[2], k.shape[2]
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  e = np.where(mask, np.exp(s - s.max()), 0.0)  # a common shift: exact, overflow-safe
  sink = np.exp(np.asarray(sinks)[None, :, None] - s.max())
  den = e.sum(-1) + sink
  out = np.einsum("bnts,bsnh->btnh", e / den[..., None], v)
  return out, (np.log(den) + s.max()).transpose(0, 2, 1)


def _inputs(N, K, dtype=np.float64):
  q = RNG.normal(size=(B, T, N, H)).astype(dtype)
  k = RNG.normal(size=(B, S, K, H)).astype(dtype)
  v = RNG.normal(size=(B, S, K, H)).astype(dtype)
  return q, k, v


RULES = [("xla", "autodiff"), ("xla", "custom_vjp"), ("blockwise", "custom_vjp")]


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("implementation, backward", RULES, ids=["-".join(r) for r in RULES])
def test_every_rule_matches_the_formula_with_gradients(x64, N, K, implementation, backward):
  q, k, v = _inputs(N, K)
  sinks = SINKS[:N]
  tiles = dict(block_q=4, block_kv=4) if implementation == "blockwise" else {}

  def run(q, k, v, sinks):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      mask=MASK,
      sinks=sinks,
      implementation=implementation,
      backward=backward,
      return_residual=True,
      **tiles,
    )

  out, lse = run(*map(jnp.asarray, (q, k, v, sinks)))
  want_out, want_lse = formula(q, k, v, sinks, MASK)
  np.testing.assert_allclose(out, want_out, atol=1e-12)
  np.testing.assert_allclose(lse, want_lse, atol=1e-12)
  np.testing.assert_array_equal(np.asarray(out)[:, 3], 0.0)
  np.testing.assert_allclose(np.asarray(lse)[:, 3], np.broadcast_to(sinks, (B, N)), atol=1e-12)

  def plain(q, k, v, sinks):  # the formula in jnp, for autodiff
    G = N // K
    kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
    s = jnp.where(MASK, s, -jnp.inf)
    full = jnp.concatenate(
      [s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1
    )
    lse = jax.nn.logsumexp(full, axis=-1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bnts,bsnh->btnh", p, vv), lse.transpose(0, 2, 1)

  w_out = jnp.asarray(RNG.normal(size=out.shape))
  w_lse = jnp.asarray(RNG.normal(size=lse.shape))

  def loss(fn):
    return lambda *a: (fn(*a)[0] * w_out).sum() + (fn(*a)[1] * w_lse).sum()

  args = tuple(map(jnp.asarray, (q, k, v, sinks)))
  got = jax.grad(loss(run), argnums=(0, 1, 2, 3))(*args)
  want = jax.grad(loss(plain), argnums=(0, 1, 2, 3))(*args)
  for name, g, w in zip(["q", "k", "v", "sinks"], got, want):
    np.testing.assert_allclose(g, w, atol=1e-10, err_msg=f"d{name}")
  if backward == "custom_vjp":
    jax.test_util.check_grads(loss(run), args, order=1, modes=["rev"])


def test_weights_leave_out_the_sinks_share(x64):
  q, k, _ = _inputs(4, 2)
  w = jattn.attention_weights(jnp.asarray(q), jnp.asarray(k), mask=MASK, sinks=SINKS)
  _, lse = formula(q, k, np.zeros_like(k), SINKS, MASK)
  p_sink = np.exp(SINKS[None, None, :] - lse).transpose(0, 2, 1)  # (B, N, T)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1 - p_sink, atol=1e-12)
  assert (np.asarray(w).sum(-1) < 1).all()


def test_splash_takes_the_sinks_itself():
  q, k, v = (jnp.asarray(x, jnp.float32) for x in _inputs(4, 2))
  q, k, v = (jnp.tile(x, (1, 12, 1, 1)) for x in (q, k, v))  # T = S = 144: padded to 256
  sinks = jnp.asarray(SINKS, jnp.float32)
  kw = dict(is_causal=True, query_seq_lengths=jnp.array([100, 0]), return_residual=True)

  def grads(impl):
    def f(q, k, v, sinks):
      out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, sinks=sinks, **kw)
      return (out * jnp.cos(out)).sum() + (0.37 * lse).sum(), (out, lse)

    return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)

  with jattn.testing.interpret_kernels():
    (_, (out, lse)), g = grads("splash")
  (_, (out_x, lse_x)), g_x = grads("xla")
  np.testing.assert_allclose(out, out_x, atol=2e-6)
  np.testing.assert_allclose(lse, lse_x, atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse)[1], np.broadcast_to(SINKS, (144, 4)), rtol=1e-6)
  for name, a, b in zip(["q", "k", "v", "sinks"], g, g_x):
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")


def test_ring_attention_and_decode_take_sinks():
  q, k, v = (jnp.asarray(x, jnp.float32) for x in _inputs(4, 2))
  sinks = jnp.asarray(SINKS, jnp.float32)
  want = jattn.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
  mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
  got = jattn.parallel.ring_attention(
    q, k, v, mesh=mesh, axis_name="sp", is_causal=True, sinks=sinks
  )
  np.testing.assert_allclose(got, want, atol=2e-6)

  cache = decode.init(B, S, 2, H, dtype=jnp.float32)
  first, cache = decode.attention(q[:, :8], k[:, :8], v[:, :8], cache, sinks=sinks)
  rest, cache = decode.attention(q[:, 8:], k[:, 8:], v[:, 8:], cache, sinks=sinks)
  np.testing.assert_allclose(jnp.concatenate([first, rest], 1), want, atol=2e-6)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(sinks=np.zeros(3)), ValueError, r"sinks must have shape \(N,\)=\(4,\)"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks must have a floating dtype"),
    (dict(sinks=np.zeros(4), implementation="cudnn"), ValueError, "does not support sinks"),
  ],
)
def test_bad_sinks_raise_naming_them(kw, error, match):
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(4, 2))
  with pytest.raises(error, match=match):
    jattn.dot_product_attention(q, k, v, **kw)


def test_modules_learn_sinks():
  """A tiny NNX model with sinks=True: the sinks start at zero and training moves them; the
  Linen twin has the same parameter and computes the same attention."""
  model = jattn.nnx.MultiHeadAttention(2, 8, sinks=True, is_causal=True, rngs=nnx.Rngs(0))
  assert model.sinks[...].shape == (2,) and not model.sinks[...].any()
  x = jnp.asarray(RNG.normal(size=(4, 6, 8)), jnp.float32)
  y = jnp.roll(x, 1, axis=1) * 0.5
  opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(30)]
  assert losses[-1] < losses[0]
  assert np.abs(np.asarray(model.sinks[...])).min() > 1e-2

  linen = jattn.linen.MultiHeadAttention(2, sinks=True, is_causal=True)
  params = linen.init(jax.random.key(0), x)["params"]
  assert params["sinks"].shape == (2,)
  params = {**params, "sinks": jnp.array([3.0, -3.0])}
  plain = {**params, "sinks": jnp.array([-1e30, -1e30])}  # a sink of ~-inf: no sink
  assert not np.allclose(linen.apply({"params": params}, x), linen.apply({"params": plain}, x))
