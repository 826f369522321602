"""jattn.dot_product_attention against jax.nn.dot_product_attention: values and gradients."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import RULES, array, assert_close, attention_np, normal

import jattn
from jattn import masks


def _inputs(B, T, S, N, K, H, dtype, seed=0):
  return (
    normal((B, T, N, H), dtype, seed),
    normal((B, S, K, H), dtype, seed + 1),
    normal((B, S, K, H), dtype, seed + 2),
  )


def _bool_mask(shape, seed=1):
  """A random mask whose every (b, n, t) row keeps at least its first key."""
  m = np.random.default_rng(seed).random(shape) < 0.6
  m[..., 0] = True
  return array(m)


# name -> (B, T, S, N, K, H, extra kwargs builder, bias shape or None). Every argument of
# jax.nn's, and every form of each (head grouping, T == S or not, bias and mask shapes,
# which lengths, window forms), is in some case, several together as in a real call.
CASES = {
  "mha": (2, 6, 6, 4, 4, 8, lambda B, T, S: {}, None),
  "gqa_bias_mask": (2, 5, 6, 4, 2, 4, lambda B, T, S: {"mask": _bool_mask((B, 1, T, S))}, "BNTS"),
  "mqa_causal_cross": (1, 5, 8, 4, 1, 4, lambda B, T, S: {"is_causal": True}, "1N1S"),
  "q_lengths_window": (
    2,
    6,
    6,
    2,
    2,
    4,
    lambda B, T, S: {"query_seq_lengths": array([3, 6], jnp.int32), "local_window_size": 2},
    "TS",
  ),
  "kv_lengths_window": (
    2,
    6,
    7,
    4,
    2,
    4,
    lambda B, T, S: {
      "key_value_seq_lengths": array([5, 7], jnp.int32),
      "local_window_size": (3, 0),
    },
    None,
  ),
  "both_lengths_causal_head_mask_scale": (
    2,
    6,
    7,
    4,
    2,
    8,
    lambda B, T, S: {
      "query_seq_lengths": array([4, 6], jnp.int32),
      "key_value_seq_lengths": array([3, 5], jnp.int32),
      "is_causal": True,
      "mask": _bool_mask((1, 4, T, S)),
      "scale": 0.3,
    },
    None,
  ),
  "everything": (
    2,
    6,
    6,
    4,
    2,
    8,
    lambda B, T, S: {
      "mask": _bool_mask((B, 1, T, S)),
      "is_causal": True,
      "local_window_size": (4, 0),
      "key_value_seq_lengths": array([6, 5], jnp.int32),
      "query_seq_lengths": array([6, 4], jnp.int32),
    },
    "BNTS",
  ),
}


def _bias(kind, B, N, T, S, dtype):
  if kind is None:
    return None
  shape = {"BNTS": (B, N, T, S), "1N1S": (1, N, 1, S), "TS": (T, S)}[kind]
  return normal(shape, dtype, 7)


# jax.nn, then every rule of jattn.
FNS = {
  "jax.nn": jax.nn.dot_product_attention,
  **{name: functools.partial(jattn.dot_product_attention, **rule) for name, rule in RULES.items()},
}


def _loss_and_grads(q, k, v, bias, kwargs):
  """Each of FNS's output, log-sum-exp and gradients of a fixed random projection of the
  output, by name.

  One jitted computation per call, for jax.nn and every rule: jax.nn run op by op compiles
  every small op for every new shape, which was most of a test's time, and each function
  in a program of its own paid a compile's fixed costs four times.
  """
  cot = normal(q.shape, jnp.float32, 3)
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

  @jax.jit
  def run(q, k, v, bias):
    results = {}
    for name, fn in FNS.items():

      def loss(q, k, v, bias):
        out, lse = fn(q, k, v, bias, return_residual=True, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cot), (out, lse)

      grads, (out, lse) = jax.grad(loss, argnums, has_aux=True)(q, k, v, bias)
      results[name] = (out, lse, grads)
    return results

  return run(q, k, v, bias)


# Every case in float32; bfloat16 for those with GQA or MQA, a bias or a mask (each case
# compiles four programs, so all of them in both dtypes cost CI time for little coverage).
BF16_CASES = (
  "gqa_bias_mask",
  "mqa_causal_cross",
  "both_lengths_causal_head_mask_scale",
  "everything",
)


# The default run keeps everything at once in both dtypes; the other cases are exhaustive.
@pytest.mark.parametrize(
  "case, dtype",
  [
    pytest.param(c, dtype, id=f"{c}-{name}", marks=() if c in kept else pytest.mark.exhaustive)
    for dtype, name, cases, kept in [
      (jnp.float32, "f32", CASES, ("everything",)),
      (jnp.bfloat16, "bf16", BF16_CASES, ("everything",)),
    ]
    for c in cases
  ],
)
def test_matches_jax_nn(case, dtype):
  B, T, S, N, K, H, extra, bias_kind = CASES[case]
  q, k, v = _inputs(B, T, S, N, K, H, dtype)
  bias = _bias(bias_kind, B, N, T, S, dtype)
  kwargs = extra(B, T, S)
  results = _loss_and_grads(q, k, v, bias, kwargs)
  theirs = results["jax.nn"]
  for backward in RULES:
    ours = results[backward]
    assert ours[0].dtype == dtype and ours[1].dtype == dtype
    assert_close(ours[0], theirs[0], dtype, err_msg=f"{backward}: output")
    # jax.nn gives rows with nothing to attend to a finite log-sum-exp; jattn says -inf.
    lse, lse_ref = (np.asarray(x, np.float32) for x in (ours[1], theirs[1]))
    finite = np.isfinite(lse)
    assert_close(lse[finite], lse_ref[finite], dtype, factor=2, err_msg=f"{backward}: lse")
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], ours[2], theirs[2]):
      assert a.dtype == b.dtype, name
      assert_close(a, b, dtype, factor=2, err_msg=f"{backward}: {name}")


def _unbatched_case(attention, rule, vmapped):
  """(out, lse) and the gradients of sum(out²) for TNH inputs, alone or vmapped over a batch
  of 3, in one program."""
  q, k, v = _inputs(3, 5, 6, 4, 2, 8, jnp.float32)
  bias = normal((4, 5, 6), jnp.float32, 5)
  f = functools.partial(
    attention, bias=bias, mask=_bool_mask((5, 6)), is_causal=True, return_residual=True, **rule
  )
  f = jax.vmap(f) if vmapped else f

  def loss(q, k, v):
    out, lse = f(q, k, v)
    return jnp.sum(out.astype(jnp.float32) ** 2), (out, lse)

  args = (q, k, v) if vmapped else (q[0], k[0], v[0])
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*args)
  return args, out, lse, grads


@functools.cache
def _unbatched_jax_nn(vmapped):
  return _unbatched_case(jax.nn.dot_product_attention, {}, vmapped)


# The default run keeps the unbatched layout through xla's custom_vjp and vmap through autodiff;
# the other rules are exhaustive.
@pytest.mark.parametrize(
  "vmapped, rule",
  [
    pytest.param(vmapped, r, id=f"{name}-{r}", marks=() if r == kept else pytest.mark.exhaustive)
    for vmapped, name, kept in [(False, "unbatched", "custom_vjp"), (True, "vmapped", "autodiff")]
    for r in RULES
  ],
)
def test_unbatched_layout_and_vmap(vmapped, rule):  # bf16: test_matches_jax_nn
  """TNH inputs, alone and vmapped over a batch, as jax.nn handles them."""
  args, out, lse, grads = _unbatched_case(jattn.dot_product_attention, RULES[rule], vmapped)
  _, ref, ref_lse, ref_grads = _unbatched_jax_nn(vmapped)
  assert out.shape == args[0].shape and lse.shape == args[0].shape[:-1]
  assert_close(out, ref)
  assert_close(lse, ref_lse, factor=2)
  for a, b in zip(grads, ref_grads):
    assert_close(a, b, factor=2)


# The default run keeps xla's custom_vjp; autodiff is exhaustive (test_unbatched_layout_and_vmap
# runs it under vmap by default), and so is blockwise (its rule batches through the same
# reverse-only wrapper as xla's, and test_transforms vmaps it against jax.nn by default).
@pytest.mark.parametrize(
  "rule", [r if r == "custom_vjp" else pytest.param(r, marks=pytest.mark.exhaustive) for r in RULES]
)
def test_vmap_matches_loop(rule):
  q, k, v = _inputs(3, 4, 5, 2, 1, 4, jnp.float32)
  ids = array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2], [3, 3, 3, 3, 3]])

  def one(q, k, v, ids):  # unbatched call inside vmap; the mask rides along as an array
    return jattn.dot_product_attention(
      q, k, v, segment_ids=(ids[:4], ids), is_causal=True, **RULES[rule]
    )

  def value_and_grad(q, k, v, ids):  # the output and the gradients of its sum, one program
    out, pull = jax.vjp(lambda q, k, v: one(q, k, v, ids), q, k, v)
    return out, pull(jnp.ones_like(out))

  got, g = jax.jit(jax.vmap(value_and_grad))(q, k, v, ids)
  loop = [jax.jit(value_and_grad)(q[i], k[i], v[i], ids[i]) for i in range(3)]
  assert_close(got, jnp.stack([out for out, _ in loop]))
  for a, b in zip(g, zip(*[grads for _, grads in loop])):
    assert_close(a, jnp.stack(b))


def test_mask_object_equals_its_array():
  q, k, v = _inputs(2, 6, 6, 2, 2, 4, jnp.float32)
  m = masks.causal() & masks.sliding_window(2, 1)
  dense = m.materialize(6, 6)
  assert_close(
    jattn.dot_product_attention(q, k, v, mask=m), jattn.dot_product_attention(q, k, v, mask=dense)
  )


def test_implementation_none_is_xla_and_jit_works():
  q, k, v = _inputs(1, 4, 4, 2, 2, 4, jnp.float32)
  f = jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True))
  assert_close(
    f(q, k, v), jattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  )


def test_zero_length_keys_give_zeros():
  q, k, v = _inputs(1, 3, 0, 2, 2, 4, jnp.float32)
  out, lse = jattn.dot_product_attention(q, k, v, return_residual=True)
  np.testing.assert_array_equal(out, 0.0)
  assert np.all(np.isneginf(lse))


# The default run keeps each empty dimension with one rule (B with autodiff, N with custom_vjp,
# H with blockwise); the other pairs are exhaustive (test_empty.py empties B, T and S for every
# mask form by default).
@pytest.mark.parametrize(
  "empty, rule",
  [
    pytest.param(
      e,
      r,
      id=f"{e}-{r}",
      marks=()
      if (e, r) in {("B", "autodiff"), ("N", "custom_vjp"), ("H", "blockwise")}
      else pytest.mark.exhaustive,
    )
    for r in RULES
    for e in "BNH"
  ],
)
def test_empty_dimensions_match_jax_nn(empty, rule):
  """B, N or H == 0 gives jax.nn's empty outputs, and gradients of the inputs' shapes, for
  every rule (blockwise raised ZeroDivisionError, and H == 0's default scale divided by 0)."""
  dims = dict(B=2, T=3, S=4, N=2, K=1, H=4)
  dims[empty] = 0
  if empty == "N":
    dims["K"] = 1  # N = 0 is a multiple of any K
  B, T, S, N, K, H = (dims[c] for c in "BTSNKH")
  q, k, v = _inputs(B, T, S, N, K, H, jnp.float32)
  bias = normal((B, N, T, S), seed=4)

  def ours(q, k, v, bias):
    return jattn.dot_product_attention(
      q, k, v, bias, is_causal=True, return_residual=True, **RULES[rule]
    )

  out, lse = ours(q, k, v, bias)
  # (scale=1: jax.nn warns dividing by sqrt(0) for its default scale)
  assert out.shape == jax.nn.dot_product_attention(q, k, v, scale=1.0).shape == (B, T, N, H)
  assert lse.shape == (B, T, N)
  if empty == "H":  # every logit is 0 + bias: lse is the log-sum-exp of the causal biases
    allowed = np.tril(np.ones((T, S), bool))
    assert_close(lse, attention_np(q, k, v, bias=bias, allowed=allowed, scale=1.0)[1])
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a)[1]), (0, 1, 2, 3)))(q, k, v, bias)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, bias.shape]
  assert all(np.all(np.isfinite(g)) for g in grads)


def test_attention_weights_with_empty_head_dim_are_uniform():
  q, k, _ = _inputs(1, 2, 4, 1, 1, 0, jnp.float32)
  np.testing.assert_allclose(jattn.attention_weights(q, k), np.full((1, 1, 2, 4), 0.25))


def test_segment_ids_against_numpy():
  q, k, v = _inputs(2, 6, 6, 2, 2, 4, jnp.float32)
  ids = np.array([[0, 0, 0, 1, 1, 2], [5, 5, 6, 6, 6, 6]])
  out = jattn.dot_product_attention(q, k, v, segment_ids=array(ids))
  allowed = (ids[:, :, None] == ids[:, None, :])[:, None]
  assert_close(out, attention_np(q, k, v, allowed=allowed)[0])
  # A pair of ids allows cross-attention between differently packed sequences.
  q_ids, kv_ids = ids[:, :4], np.array([[0, 1, 1, 2, 2, 2], [6, 6, 6, 5, 5, 5]])
  out = jattn.dot_product_attention(q[:, :4], k, v, segment_ids=(q_ids, kv_ids))
  allowed = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  assert_close(out, attention_np(q[:, :4], k, v, allowed=allowed)[0])


def test_repeated_calls_do_not_retrace(monkeypatch):
  """The jitted core is traced once per shape, even with freshly built masks."""
  from jattn.impl import select, xla

  # Forget the jitted core's traces so that it traces here (jax.clear_caches() would also
  # throw away every program this worker compiled before, for the tests after this one).
  jattn.attention.attend.clear_cache()
  counted = chex.assert_max_traces(xla.attention, n=1)
  monkeypatch.setitem(select.TABLE, "xla", dataclasses.replace(xla.IMPLEMENTATION, run=counted))
  q, k, v = _inputs(2, 4, 4, 2, 2, 4, jnp.float32)
  for i in range(3):
    ids = array(np.array([[0, 0, 1, 1], [0, 1, 1, 1]]) + i)
    jattn.dot_product_attention(
      q + i,
      k,
      v,
      mask=masks.causal() & masks.segments(ids),
      score_fn=jattn.scores.alibi(array(np.array([0.1, 0.2]) * i)),
    )
  with pytest.raises(AssertionError, match="traced"):  # a new shape traces again
    jattn.dot_product_attention(
      q[:, :3],
      k,
      v,
      mask=masks.causal()
      & masks.segments(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32)),
      score_fn=jattn.scores.alibi(array([0.1, 0.2])),
    )


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_passes_through_to_jax_nn():
  q, k, v = _inputs(2, 128, 128, 4, 2, 64, jnp.bfloat16)
  cot = normal(q.shape, jnp.bfloat16, 3)

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(q, k, v, implementation):
    f = lambda q, k, v: jnp.sum(
      jattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation).astype(
        jnp.float32
      )
      * cot
    )
    return jax.value_and_grad(f, (0, 1, 2))(q, k, v)

  for a, b in zip(jax.tree.leaves(run(q, k, v, "cudnn")), jax.tree.leaves(run(q, k, v, "xla"))):
    assert_close(a, b, jnp.bfloat16, factor=2)


def _weights_np(q, k, *, bias=None, allowed=None, score=None):
  """float64 softmax(scale·QKᵀ + bias) over allowed keys, zero rows where nothing is allowed."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  K = k.shape[2]
  s = np.einsum("BTNH,BSNH->BNTS", q, np.repeat(k, N // K, axis=2)) / np.sqrt(H)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  if score is not None:
    s = score(s)
  allowed = np.ones(s.shape, bool) if allowed is None else np.broadcast_to(allowed, s.shape)
  m = np.max(np.where(allowed, s, -np.inf), -1, keepdims=True)
  e = np.where(allowed, np.exp(np.where(allowed, s - np.where(np.isfinite(m), m, 0.0), 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  return e / np.where(total == 0, 1.0, total)


@pytest.mark.parametrize("K", [4, 2, 1])
def test_attention_weights_match_numpy_and_are_the_probabilities_used(K):
  B, T, S, N, H = 2, 5, 6, 4, 8
  q, k, v = _inputs(B, T, S, N, K, H, jnp.float32)
  bias = normal((1, N, T, S), seed=9)
  lengths = np.array([5, 2])
  kw = dict(is_causal=True, key_value_seq_lengths=lengths, logits_soft_cap=2.0)
  allowed = np.tril(np.ones((T, S), bool)) & (np.arange(S) < lengths[:, None, None, None])
  got = jattn.attention_weights(q, k, bias, **kw)
  want = _weights_np(q, k, bias=bias, allowed=allowed, score=lambda s: 2.0 * np.tanh(s / 2.0))
  assert_close(got, want)
  # The weights times V are the attention output.
  out = jattn.dot_product_attention(q, k, v, bias, implementation="xla", **kw)
  via_weights = jnp.einsum("BNTS,BSNH->BTNH", got, jnp.repeat(v, N // K, axis=2))
  assert_close(out, via_weights)


def test_attention_weights_empty_rows_unbatched_and_gradient():
  q, k, _ = _inputs(1, 4, 4, 2, 2, 4, jnp.float32)
  w = jattn.attention_weights(q[0], k[0], mask=masks.causal(-2))
  assert w.shape == (2, 4, 4)
  np.testing.assert_array_equal(w[:, :2], 0.0)  # rows 0 and 1 see nothing
  assert_close(w, _weights_np(q, k, allowed=np.tril(np.ones((4, 4), bool), -2))[0])
  g = jax.jit(
    jax.grad(lambda q: jnp.sum(jattn.attention_weights(q, k, is_causal=True)[..., 0] ** 2))
  )(q)
  causal = jnp.where(np.tril(np.ones((1, 1, 4, 4), bool)), 0.0, -1e30)
  g_ref = jax.jit(  # one program, not one per operation
    jax.grad(
      lambda q: jnp.sum(
        jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k) / 2.0 + causal)[..., 0] ** 2
      )
    )
  )(q)
  assert_close(g, g_ref, factor=5)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(key=np.zeros((2, 6, 3, 8), np.float32)), ValueError, "multiple of the number"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(bias=np.zeros((2, 4, 5, 5), np.float32)), ValueError, "bias"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
  ],
)
def test_attention_weights_errors(kwargs, error, match):
  args = dict(query=np.zeros((2, 5, 4, 8), np.float32), key=np.zeros((2, 6, 2, 8), np.float32))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jattn.attention_weights(**args)


_jax_nn = jax.jit(jax.nn.dot_product_attention)  # one program, not one per operation


# The default run keeps an int32 bias through xla's rules and a uint8 one through the default;
# the other cases are exhaustive (blockwise promotes the bias in the front door it shares).
@pytest.mark.parametrize(
  "dtype, bias_dtype, rule",
  [
    pytest.param(
      dtype, bias, r, id=f"{name}-{r}", marks=() if r in kept else pytest.mark.exhaustive
    )
    for dtype, bias, name, kept in [
      (jnp.float32, jnp.int32, "i32", ("autodiff", "custom_vjp")),
      (jnp.bfloat16, jnp.uint8, "u8", ("default",)),
    ]
    for r in [*RULES, "default"]
  ],
)
def test_integer_bias_is_promoted_as_jax_nn_promotes_it(rule, dtype, bias_dtype):
  """jax.nn adds an integer bias to its float32 logits (int + float32 is float32); so does
  jattn, with the same values and gradients as the bias cast to float32 by hand."""
  q, k, v = (normal((2, 5, 2, 4), dtype, seed) for seed in (0, 1, 2))
  bias = array(np.random.default_rng(3).integers(-3, 4, (2, 1, 5, 5)) % 7, bias_dtype)
  kw = RULES.get(rule, {})
  got = jattn.dot_product_attention(q, k, v, bias, **kw)
  want = _jax_nn(q, k, v, bias)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(
    got, jattn.dot_product_attention(q, k, v, bias.astype(jnp.float32), **kw)
  )
  assert_close(got, want, dtype)
  grad = jax.jit(  # one program per bias dtype
    jax.grad(lambda q, b: jattn.dot_product_attention(q, k, v, b, **kw).astype(jnp.float32).sum())
  )
  np.testing.assert_array_equal(grad(q, bias), grad(q, bias.astype(jnp.float32)))
