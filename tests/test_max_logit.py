"""return_max_logit: each query row's largest logit from every implementation that keeps a
running max, against a float64 NumPy formula; where it sits in the results; no gradient
through it; the kernels that keep their max to themselves refused and skipped; decoding;
the Flax modules' sown max logits; QK-clip's scales. The context-parallel strategies return
it with every other argument in test_context_parallel.py, the Hopper kernels in
test_flex_hopper.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from reference import assert_close, causal_np, grid, lengths_np, normal

import jattn
import jattn.linen
import jattn.nnx
from jattn import decode, scores

B, T, N, K, H = 2, 12, 4, 2, 8
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])


def max_logit_np(q, k, *, allowed=None, bias=None, scale=None, score=None, cap=None):
  """Float64: per (b, t, n) the largest of scale · q·k (+ bias, then score, then the soft cap)
  over the keys ``allowed`` lets it see; -inf where it sees none. (B, T, N)."""
  q, k = (np.asarray(x, np.float64) for x in (q, k))
  Bq, Tq, Nq, Hq = q.shape
  S = k.shape[1]
  k = np.repeat(k, Nq // k.shape[2], axis=2)
  s = (Hq**-0.5 if scale is None else scale) * np.einsum("btnh,bsnh->bnts", q, k)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  if score is not None:
    s = score(s, *grid(Bq, Nq, Tq, S))
  if cap is not None:
    s = cap * np.tanh(s / cap)
  allowed = np.ones(s.shape, bool) if allowed is None else np.broadcast_to(allowed, s.shape)
  return np.max(np.where(allowed, s, -np.inf), axis=-1).transpose(0, 2, 1)


def _inputs(dtype=np.float32):
  q, k, v = (
    normal((B, T, N, H), dtype, 0),
    normal((B, T, K, H), dtype, 1),
    normal((B, T, K, H), dtype, 2),
  )
  bias = normal((1, N, T, T), dtype, 3)
  return q, k, v, bias


# Every argument that moves the logits, and lengths that empty the second row's last rows.
CALL = dict(
  is_causal=True,
  query_seq_lengths=np.array([T, T - 3], np.int32),
  score_fn=scores.alibi(jnp.asarray(SLOPES, jnp.float32)),
  logits_soft_cap=4.0,
  sinks=np.linspace(-1.0, 1.0, N).astype(np.float32),  # not a key: not in the max
  dropout_rate=0.2,  # after the softmax: not in the max either
  dropout_rng=jax.random.key(0),
)


def _alibi_np(s, b, h, q, kv):
  return s - SLOPES[h] * np.abs(q - kv)


def _want(q, k, bias):
  allowed = causal_np(T, T)[None, None] & lengths_np(T, T, q_lens=np.array([T, T - 3]))
  return max_logit_np(q, k, allowed=allowed, bias=bias, score=_alibi_np, cap=4.0)


@pytest.mark.parametrize(
  "rule",
  [
    dict(implementation="xla", backward="autodiff"),
    dict(implementation="xla", backward="custom_vjp"),
    dict(implementation="blockwise", block_q=4, block_kv=5),
    dict(implementation="flex"),
  ],
  ids=["xla-autodiff", "xla-custom_vjp", "blockwise", "flex"],
)
def test_every_running_max_is_the_formula(rule):
  """The max logit every implementation keeps is the formula's (after the scale, bias, score
  function and soft cap; sinks and dropout aside), -inf on rows that see no key; asking for
  it changes neither the output nor the lse."""
  q, k, v, bias = _inputs()
  with jattn.testing.interpret_kernels():
    call = functools.partial(jattn.dot_product_attention, q, k, v, bias, **CALL, **rule)
    out, lse, top = call(return_residual=True, return_max_logit=True)
    plain_out, plain_lse = call(return_residual=True)
  want = _want(q, k, bias)
  assert top.shape == (B, T, N) and top.dtype == jnp.float32
  np.testing.assert_array_equal(np.isneginf(top), np.isneginf(want))
  assert np.isneginf(want[1, T - 3 :]).all() and np.isfinite(want[0]).all()
  finite = np.isfinite(want)
  assert_close(np.asarray(top)[finite], want[finite], np.float32)
  np.testing.assert_array_equal(out, plain_out)
  np.testing.assert_array_equal(lse, plain_lse)


def test_results_in_order_and_unbatched():
  q, k, v, _ = _inputs()
  out = jattn.dot_product_attention(q, k, v, is_causal=True)
  got, top = jattn.dot_product_attention(q, k, v, is_causal=True, return_max_logit=True)
  np.testing.assert_array_equal(got, out)
  assert_close(top, max_logit_np(q, k, allowed=causal_np(T, T)), np.float32)
  got, lse, top2 = jattn.dot_product_attention(
    q, k, v, is_causal=True, return_residual=True, return_max_logit=True
  )
  assert lse.shape == (B, T, N) and np.array_equal(top, top2)
  one, top1 = jattn.dot_product_attention(q[0], k[0], v[0], is_causal=True, return_max_logit=True)
  assert one.shape == (T, N, H) and top1.shape == (T, N)
  np.testing.assert_array_equal(top1, top[0])
  with pytest.raises(TypeError, match="return_max_logit must be a bool"):
    jattn.dot_product_attention(q, k, v, return_max_logit="yes")


@pytest.mark.parametrize("rule", ["autodiff", "custom_vjp", "blockwise"])
def test_no_gradient_flows_through_the_max_logit(rule):
  """A statistic: its cotangent reaches nothing (in q, k, v or the bias), and a loss that
  adds it has the gradients of the loss without it."""
  q, k, v, bias = _inputs()
  rules = dict(
    autodiff=dict(implementation="xla", backward="autodiff"),
    custom_vjp=dict(implementation="xla", backward="custom_vjp"),
    blockwise=dict(implementation="blockwise", block_q=4, block_kv=4),
  )
  attend = lambda *a: jattn.dot_product_attention(
    *a, is_causal=True, return_max_logit=True, **rules[rule]
  )
  only_max = jax.grad(lambda *a: jnp.sum(attend(*a)[1]), (0, 1, 2, 3))(q, k, v, bias)
  assert all(not np.any(g) for g in only_max)
  both = jax.grad(lambda *a: jnp.sum(attend(*a)[0] ** 2) + jnp.sum(attend(*a)[1]), (0, 1, 2))
  out_only = jax.grad(lambda *a: jnp.sum(attend(*a)[0] ** 2), (0, 1, 2))
  for g, w in zip(both(q, k, v, bias), out_only(q, k, v, bias)):
    np.testing.assert_array_equal(g, w)


def test_kernels_that_keep_their_max_are_refused_and_skipped():
  """jax.nn's cuDNN call and splash keep their running max to themselves: the table says
  so, an explicit call raises naming return_max_logit, and None takes the next kernel."""
  q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
  gpu = jattn.explain(q, q, q, is_causal=True, backend="gpu")
  assert gpu.implementation == "cudnn"
  gpu = jattn.explain(q, q, q, is_causal=True, return_max_logit=True, backend="gpu")
  assert gpu.implementation == "flex"
  assert "return_max_logit: jax.nn's cuDNN call keeps its running max" in gpu.rejected["cudnn"]
  tpu = jattn.explain(q, q, q, is_causal=True, return_max_logit=True, backend="tpu")
  assert tpu.implementation != "splash" and "return_max_logit" in tpu.rejected["splash"]
  x = normal((1, 128, 2, 16))
  with (
    jattn.testing.interpret_kernels(),
    pytest.raises(ValueError, match=r"implementation='splash' does not support return_max_log"),
  ):
    jattn.dot_product_attention(x, x, x, implementation="splash", return_max_logit=True)


@pytest.mark.parametrize("paged", [False, True])
def test_decode_returns_the_max_logit_over_what_each_row_holds(paged):
  """Chunked prefill of ragged rows: each query's max runs over the cache slots it may see
  (causal over what its row holds), as over the whole sequence in one call."""
  q, k, v, _ = _inputs()
  cache = decode.init_paged(16, 4, B, 4, K, H) if paged else decode.init(B, 16, K, H)
  tops = []
  for lo, hi in ((0, 5), (5, 6), (6, T)):
    (out, top), cache = decode.attention(
      q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], cache, return_max_logit=True
    )
    tops.append(top)
  assert_close(
    np.concatenate(tops, axis=1), max_logit_np(q, k, allowed=causal_np(T, T)), np.float32
  )
  (out, lse, top), cache = decode.attention(
    q[:, :1], k[:, :1], v[:, :1], cache, num_new=np.array([1, 0]), return_residual=True,
    return_max_logit=True,
  )  # fmt: skip
  assert np.isneginf(top[1]).all() and np.isfinite(top[0]).all()  # row 1 wrote nothing


def test_flax_modules_sow_max_logits_when_asked():
  """Off by default; with sow_max_logit (the constructor's, or the call's) NNX sows
  ``max_logit`` as an nnx.Intermediate and Linen into ``intermediates``: each row's largest
  logit over the module's own projected heads, batch dimensions kept."""
  x = np.random.default_rng(4).standard_normal((2, 3, T, 16)).astype(np.float32)
  mha = jattn.nnx.MultiHeadAttention(4, 16, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
  _, inter = nnx.capture(mha, nnx.Intermediate)(x)
  assert "max_logit" not in inter
  _, inter = nnx.capture(mha, nnx.Intermediate)(x, sow_max_logit=True)
  (top,) = inter["max_logit"].get_value()
  q, k = mha.query(x).reshape(6, T, 4, 4), mha.key(x).reshape(6, T, 2, 4)
  want = max_logit_np(q, k, allowed=causal_np(T, T)).reshape(2, 3, T, 4)
  assert_close(top, want, np.float32)
  always = jattn.nnx.MultiHeadAttention(
    4, 16, num_kv_heads=2, is_causal=True, sow_max_logit=True, rngs=nnx.Rngs(0)
  )
  _, inter = nnx.capture(always, nnx.Intermediate)(x)
  np.testing.assert_array_equal(inter["max_logit"].get_value()[0], top)
  mha.set_view(sow_max_logit=True)  # what nnx.view sets on every layer of a model
  _, inter = nnx.capture(mha, nnx.Intermediate)(x)
  np.testing.assert_array_equal(inter["max_logit"].get_value()[0], top)

  module = jattn.linen.MultiHeadDotProductAttention(4, num_kv_heads=2, is_causal=True)
  params = module.init(jax.random.key(0), x)
  _, state = module.apply(params, x, sow_max_logit=True, mutable=["intermediates"])
  (top,) = state["intermediates"]["max_logit"]
  dense = lambda name, heads: nn.DenseGeneral((heads, 4)).apply(
    {"params": params["params"][name]}, x
  )
  q, k = dense("query", 4).reshape(6, T, 4, 4), dense("key", 2).reshape(6, T, 2, 4)
  assert_close(top, max_logit_np(q, k, allowed=causal_np(T, T)).reshape(2, 3, T, 4), np.float32)
  with pytest.raises(ValueError, match="sow_max_logit=True applies to jattn's attention"):
    jattn.nnx.MultiHeadAttention(
      4, 16, sow_max_logit=True, attention_fn=jattn.nnx.attention_fn, rngs=nnx.Rngs(0)
    )


def test_qk_clip_scales():
  """min(1, τ / max) per head, the largest over the batch and positions, split between the
  query and key sides by alpha; with GQA each key head takes its group's strongest clip
  and every query head's product is its own η exactly; -inf (no key seen) clips nothing."""
  top = np.array([[[50.0, 400.0, 200.0, -np.inf]], [[120.0, 10.0, 50.0, -np.inf]]], np.float32)
  q_scale, k_scale = jattn.qk_clip_scales(top, 100.0)
  eta = np.array([100 / 120, 100 / 400, 100 / 200, 1.0])
  assert_close(q_scale, np.sqrt(eta), np.float32)
  assert_close(k_scale, np.sqrt(eta), np.float32)
  q_scale, k_scale = jattn.qk_clip_scales(top, 100.0, num_kv_heads=2, alpha=0.25)
  want_k = np.array([min(eta[0], eta[1]), min(eta[2], eta[3])]) ** 0.75
  assert_close(k_scale, want_k, np.float32)
  assert_close(q_scale * np.repeat(k_scale, 2), eta, np.float32)
  # Data-parallel devices: the largest over each device's batch rows, then over devices.
  mesh = jax.make_mesh((2,), ("dp",), (jax.sharding.AxisType.Auto,))
  per_device = jax.shard_map(
    lambda t: jattn.qk_clip_scales(t, 100.0, axis_name="dp"),
    mesh=mesh,
    in_specs=jax.sharding.PartitionSpec("dp"),
    out_specs=jax.sharding.PartitionSpec(),
  )
  q_scale, _ = per_device(top)
  assert_close(q_scale, np.sqrt(eta), np.float32)
  for bad, error, match in (
    (dict(threshold=0.0), ValueError, "threshold must be"),
    (dict(alpha=1.5), ValueError, r"alpha must be in \[0, 1\], got 1.5"),
    (dict(num_kv_heads=3), ValueError, "must be a multiple of num_kv_heads"),
  ):
    kw = dict(threshold=100.0) | bad
    with pytest.raises(error, match=match):
      jattn.qk_clip_scales(top, **kw)
  with pytest.raises(TypeError, match="max_logits must have a floating dtype"):
    jattn.qk_clip_scales(np.ones((2, 4), np.int32), 1.0)
