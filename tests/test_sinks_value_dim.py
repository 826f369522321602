"""Attention sinks (one extra logit per head with no value) and a value head dim of its own
(value (B, S, K, Hv), output (B, T, N, Hv)), in every rule and entry point.

The reference is the float64 NumPy formula below: out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} +
e^{sink}), lse = log(Σ_j e^{s_j} + e^{sink}), over the positions the mask allows (no sink:
e^{sink} = 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from reference import array

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
  """float64 NumPy: (out (B, T, N, Hv), lse (B, T, N)), GQA by repeating key/value heads;
  sinks None: no sink."""
  N, K = q.shape[2], k.shape[2]
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  e = np.where(mask, np.exp(s - s.max()), 0.0)  # a common shift: exact, overflow-safe
  sink = 0.0 if sinks is None else np.exp(np.asarray(sinks)[None, :, None] - s.max())
  den = e.sum(-1) + sink
  with np.errstate(divide="ignore", invalid="ignore"):
    out = np.nan_to_num(np.einsum("bnts,bsnh->btnh", e / den[..., None], v))
    return out, (np.log(den) + s.max()).transpose(0, 2, 1)


def _inputs(N, K, Hv=H, dtype=np.float64):
  q = RNG.normal(size=(B, T, N, H)).astype(dtype)
  k = RNG.normal(size=(B, S, K, H)).astype(dtype)
  v = RNG.normal(size=(B, S, K, Hv)).astype(dtype)
  return q, k, v


RULES = [("xla", "autodiff"), ("xla", "custom_vjp"), ("blockwise", "custom_vjp")]


HEADS = {  # (N, K, Hv, with sinks): value head dims and sinks, with and without each other
  "mha-sinks": (4, 4, H, True),
  "gqa-hv5-sinks": (4, 2, 5, True),
  "gqa-hv5-no-sinks": (4, 2, 5, False),
}


# The default run keeps each rule with one of the head settings, the i-th rule with the i-th
# setting; the other cases are exhaustive.
@pytest.mark.parametrize(
  "implementation, backward, N, K, Hv, with_sinks",
  [
    pytest.param(
      *rule, *heads, id="-".join([*rule, name]), marks=() if i == j else pytest.mark.exhaustive
    )
    for i, rule in enumerate(RULES)
    for j, (name, heads) in enumerate(HEADS.items())
  ],
)
def test_every_rule_matches_the_formula_with_gradients(
  x64, N, K, Hv, with_sinks, implementation, backward
):
  q, k, v = _inputs(N, K, Hv)
  sinks = SINKS[:N] if with_sinks else None
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

  def plain(q, k, v, sinks):  # the formula in jnp, for autodiff
    G = N // K
    kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
    s = jnp.where(MASK, s, -jnp.inf)
    if sinks is not None:
      sink = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
      s = jnp.concatenate([s, sink], -1)
    lse = jax.nn.logsumexp(s, axis=-1)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]  # empty rows: all -inf, p = 0
    p = jnp.exp(s - safe)[..., :S]
    return jnp.einsum("bnts,bsnh->btnh", p, vv), lse.transpose(0, 2, 1)

  want_out, want_lse = formula(q, k, v, sinks, MASK)
  w_out = array(RNG.normal(size=(B, T, N, Hv)))
  w_lse = array(np.where(np.isfinite(want_lse), RNG.normal(size=(B, T, N)), 0.0))

  def loss(fn, aux=False):
    def f(*a):
      out, lse = fn(*a)
      value = (out * w_out).sum() + (jnp.where(w_lse != 0, lse, 0.0) * w_lse).sum()
      return (value, (out, lse)) if aux else value

    return f

  args = tuple(array(x) for x in (q, k, v, sinks) if x is not None)
  if sinks is None:
    run_, plain_ = (
      (lambda f: lambda q, k, v: f(q, k, v, None))(run),
      (lambda f: lambda q, k, v: f(q, k, v, None))(plain),
    )
  else:
    run_, plain_ = run, plain
  argnums = tuple(range(len(args)))
  # The rule's outputs and gradients as one program (eagerly, its forward pass would compile
  # apart from the backward's, and again for the gradients).
  step = jax.value_and_grad(loss(run_, aux=True), argnums=argnums, has_aux=True)
  (_, (out, lse)), got = jax.jit(step)(*args)
  assert out.shape == (B, T, N, Hv)
  np.testing.assert_allclose(out, want_out, atol=1e-12)
  np.testing.assert_allclose(lse, want_lse, atol=1e-12)
  np.testing.assert_array_equal(np.asarray(out)[:, 3], 0.0)
  empty_lse = -np.inf if sinks is None else np.broadcast_to(sinks, (B, N))
  np.testing.assert_allclose(np.asarray(lse)[:, 3], empty_lse, atol=1e-12)

  want = jax.jit(jax.grad(loss(plain_), argnums=argnums))(*args)  # one program, not ~40
  for name, g, w in zip(["q", "k", "v", "sinks"], got, want):
    assert np.isfinite(np.asarray(g)).all() and np.isfinite(np.asarray(w)).all(), name
    np.testing.assert_allclose(g, w, atol=1e-10, err_msg=f"d{name}")
  if backward == "custom_vjp" and Hv != H and with_sinks:  # once per rule: sinks and Hv
    jax.test_util.check_grads(jax.jit(loss(run_)), args, order=1, modes=["rev"])


def test_weights_leave_out_the_sinks_share(x64):
  q, k, _ = _inputs(4, 2)
  w = jattn.attention_weights(array(q), array(k), mask=MASK, sinks=SINKS)
  _, lse = formula(q, k, np.zeros_like(k), SINKS, MASK)
  p_sink = np.exp(SINKS[None, None, :] - lse).transpose(0, 2, 1)  # (B, N, T)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1 - p_sink, atol=1e-12)
  assert (np.asarray(w).sum(-1) < 1).all()


def test_splash_takes_the_sinks_itself():
  # T = S = 144: padded to 256. Tiled and cast by NumPy (jnp would compile each operation).
  q, k, v = (np.tile(np.asarray(x, np.float32), (1, 12, 1, 1)) for x in _inputs(4, 2, Hv=24))
  sinks = np.asarray(SINKS, np.float32)
  kw = dict(is_causal=True, query_seq_lengths=array([100, 0]), return_residual=True)

  def grads(impl):
    def f(q, k, v, sinks):
      out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, sinks=sinks, **kw)
      return (out * jnp.cos(out)).sum() + (0.37 * lse).sum(), (out, lse)

    # One jitted program (eagerly, every operation around the kernels compiles alone).
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

  with jattn.testing.interpret_kernels():
    (_, (out, lse)), g = grads("splash")
  (_, (out_x, lse_x)), g_x = grads("xla")
  np.testing.assert_allclose(out, out_x, atol=2e-6)
  np.testing.assert_allclose(lse, lse_x, atol=2e-6)
  np.testing.assert_allclose(np.asarray(lse)[1], np.broadcast_to(SINKS, (144, 4)), rtol=1e-6)
  for name, a, b in zip(["q", "k", "v", "sinks"], g, g_x):
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")


def test_ring_attention_and_decode_take_sinks_and_value_head_dims():
  q, k, v = (np.asarray(x, np.float32) for x in _inputs(4, 2, Hv=5))  # NumPy: no program
  sinks = np.asarray(SINKS, np.float32)
  mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))

  def ring(q, k, v, sinks):
    return jattn.parallel.ring_attention(
      q, k, v, mesh=mesh, axis_name="sp", is_causal=True, sinks=sinks
    )

  def plain(q, k, v, sinks):
    return jattn.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)

  def step(f):  # the output and gradients as one program (the output alone is another)
    def loss(*a):
      out = f(*a)
      return (out * jnp.cos(out)).sum(), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

  (_, got), got_grads = step(ring)(q, k, v, sinks)
  (_, want), want_grads = step(plain)(q, k, v, sinks)
  np.testing.assert_allclose(got, want, atol=2e-6)
  assert got.shape == (B, T, 4, 5)
  for name, a, b in zip("qkvs", got_grads, want_grads):
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")
  cache = decode.init(B, S, 2, H, dtype=jnp.float32, value_head_dim=5)
  assert cache.value.shape == (B, S, 2, 5)
  # Two chunks of one shape: one program (the cache's write and attention) serves both.
  first, cache = decode.attention(q[:, :6], k[:, :6], v[:, :6], cache, sinks=sinks)
  rest, cache = decode.attention(q[:, 6:], k[:, 6:], v[:, 6:], cache, sinks=sinks)
  np.testing.assert_allclose(np.concatenate([first, rest], 1), want, atol=2e-6)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(sinks=np.zeros(3)), ValueError, r"sinks must have shape \(N,\)=\(4,\)"),
    (
      dict(value=np.zeros((B, S + 1, 2, 5))),
      ValueError,
      r"key and value must have the same shape but for the head dimension, got key "
      r"\(2, 12, 2, 8\) and value \(2, 13, 2, 5\)",
    ),
    (
      dict(value=np.zeros((B, S, 2, 5)), implementation="cudnn"),
      ValueError,
      r"does not support value head dim 5 != H=8",
    ),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks must have a floating dtype"),
    (dict(sinks=np.zeros(4), implementation="cudnn"), ValueError, "does not support sinks"),
  ],
)
def test_bad_sinks_and_value_shapes_raise_naming_them(kw, error, match):
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(4, 2))
  v = jnp.asarray(kw.pop("value", v), jnp.bfloat16)
  with pytest.raises(error, match=match):
    jattn.dot_product_attention(q, k, v, **kw)


def test_decode_and_modules_check_value_head_dims():
  cache = decode.init(B, S, 2, H, value_head_dim=5)
  k = jnp.zeros((B, 1, 2, H))
  with pytest.raises(ValueError, match=r"value must have shape \(B, t, K, Hv\)=\(2, t, 2, 5\)"):
    decode.update(cache, k, jnp.zeros((B, 1, 2, H)))
  with pytest.raises(ValueError, match="value_head_dim must be >= 1"):
    decode.init(B, S, 2, H, value_head_dim=0)
  with pytest.raises(ValueError, match="value_head_dim must be >= 1"):
    jattn.nnx.MultiHeadAttention(2, 8, value_head_dim=0, rngs=nnx.Rngs(0))


def test_modules_with_a_value_head_dim_of_their_own():
  """MLA-style heads: query/key width 4 per head, value width 3; decoding with the cache
  equals the full causal call; the Linen twin has the same parameter shapes."""
  x = array(RNG.normal(size=(2, 6, 8)), jnp.float32)
  model = jattn.nnx.MultiHeadAttention(2, 8, value_head_dim=3, is_causal=True, rngs=nnx.Rngs(0))
  assert model.value.kernel[...].shape == (8, 2, 3)
  assert model.out.kernel[...].shape == (2, 3, 8)
  # Jitted calls: a program each, not one per operation of the module.
  call = nnx.jit(lambda m, x, decode: m(x, decode=decode), static_argnums=2)
  full = call(model, x, False)
  model.init_cache(2, 6)
  steps = np.concatenate([call(model, x[:, :4], True), call(model, x[:, 4:], True)], 1)
  np.testing.assert_allclose(steps, full, atol=1e-6)
  linen = jattn.linen.MultiHeadAttention(2, value_head_dim=3, is_causal=True)
  params = jax.jit(linen.init)(jax.random.key(0), x)["params"]
  assert params["value"]["kernel"].shape == (8, 2, 3)
  assert params["out"]["kernel"].shape == (2, 3, 8)
  assert jax.jit(linen.apply)({"params": params}, x).shape == x.shape


def test_modules_learn_sinks():
  """A tiny NNX model with sinks=True: the sinks start at zero and training moves them; the
  Linen twin has the same parameter and computes the same attention."""
  model = jattn.nnx.MultiHeadAttention(2, 8, sinks=True, is_causal=True, rngs=nnx.Rngs(0))
  assert model.sinks[...].shape == (2,) and not model.sinks[...].any()
  x = array(RNG.normal(size=(4, 6, 8)), jnp.float32)
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

  # The Flax adapter takes sinks bound with functools.partial.
  fn = functools.partial(jattn.nnx.attention_fn, sinks=array([2.0, -1.0]))
  qkv = array(RNG.normal(size=(3, 2, 6, 2, 4)), jnp.float32)
  np.testing.assert_allclose(
    fn(*qkv), jattn.dot_product_attention(*qkv, sinks=array([2.0, -1.0])), atol=1e-6
  )

  linen = jattn.linen.MultiHeadAttention(2, sinks=True, is_causal=True)
  params = jax.jit(linen.init)(jax.random.key(0), x)["params"]
  assert params["sinks"].shape == (2,)
  params = {**params, "sinks": array([3.0, -3.0])}
  plain = {**params, "sinks": array([-1e30, -1e30])}  # a sink of ~-inf: no sink
  apply = jax.jit(linen.apply)  # one program for both, not one per operation
  assert not np.allclose(apply({"params": params}, x), apply({"params": plain}, x))


def test_bfloat16_with_sinks_no_worse_than_jax_nn_without():
  """bfloat16 errors against a float32 evaluation: with sinks, no worse than jax.nn's own
  error on the same inputs without them (jax.nn has no sinks)."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 64, 4, 32)), jnp.bfloat16) for _ in range(3))
  sinks = array(rng.normal(size=(4,)) + 1.0, jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  # jax.nn's error as one program (eagerly, each of its operations compiles; bitwise the same
  # error). jattn's calls stay apart: inside one program with the float32 reference, XLA may
  # skip the rounding of their bfloat16 outputs.
  peer = jax.jit(
    lambda q, k, v: jnp.abs(
      f32(jax.nn.dot_product_attention(q, k, v, is_causal=True))
      - jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
    ).max()
  )(q, k, v)
  ref = jattn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True, sinks=sinks)
  for implementation in ("xla", "blockwise"):
    got = jattn.dot_product_attention(
      q, k, v, is_causal=True, sinks=sinks, implementation=implementation
    )
    assert jnp.abs(f32(got) - ref).max() <= 1.25 * peer, implementation
