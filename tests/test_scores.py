"""jattn.scores: each score function against its formula, and inside attention."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TILED, TILED_LENGTH
from reference import RULES, array, assert_close, attention_jnp, attention_np, grid, normal

import jattn
from jattn import masks, scores

B, N, T, S = 2, 3, 5, 6


def _apply(fn, s):
  return np.asarray(fn(array(s), *masks.index_grid(B, N, T, S)))


def test_alibi_formula():
  slopes = np.array([0.5, 0.25, 0.125], np.float32)
  s = np.asarray(normal((B, N, T, S)))
  b, h, q, kv = grid(B, N, T, S)
  np.testing.assert_allclose(_apply(scores.alibi(slopes), s), s + slopes[h] * (kv - q), rtol=1e-6)
  np.testing.assert_allclose(
    _apply(scores.alibi(slopes, bidirectional=True), s), s - slopes[h] * np.abs(kv - q), rtol=1e-6
  )


def test_soft_cap_formula():
  s = 40 * np.asarray(normal((B, N, T, S)))
  got = _apply(scores.soft_cap(10.0), s)
  np.testing.assert_allclose(got, 10.0 * np.tanh(s / 10.0), rtol=1e-6)
  assert np.abs(got).max() <= 10.0


def _t5_bucket_np(rp, bidirectional, num_buckets, max_distance):
  """T5's bucketing, transcribed from the Mesh TensorFlow / Hugging Face code."""
  ret = 0
  n = -rp
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0) * num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val = max_exact + int(
    math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  )
  return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (6, 7)])
def test_t5_buckets(bidirectional, num_buckets, max_distance):
  rp = np.arange(-300, 301)
  got = scores.t5_bucket(
    array(rp), num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
  )
  want = [_t5_bucket_np(int(r), bidirectional, num_buckets, max_distance) for r in rp]
  np.testing.assert_array_equal(got, want)


def test_t5_buckets_literal():
  # kv - q:           0   1  -1 -20  200  -200
  got = scores.t5_bucket(
    array([0, 1, -1, -20, 200, -200]), num_buckets=32, max_distance=128, bidirectional=True
  )
  np.testing.assert_array_equal(got, [0, 17, 1, 10, 31, 15])


def test_relative_position_bias_formula():
  table = np.asarray(normal((8, N)))
  fn = scores.relative_position_bias(table, num_buckets=8, max_distance=16, bidirectional=False)
  s = np.asarray(normal((B, N, T, S)))
  b, h, q, kv = grid(B, N, T, S)
  bucket = np.vectorize(lambda r: _t5_bucket_np(r, False, 8, 16))(kv - q)
  np.testing.assert_allclose(_apply(fn, s), s + table[bucket, h], rtol=1e-6)


def test_compose_applies_in_order():
  add = lambda s, b, h, q, kv: s + 1.0
  double = lambda s, b, h, q, kv: 2.0 * s
  s = np.asarray(normal((B, N, T, S)))
  np.testing.assert_allclose(_apply(scores.compose(add, double), s), 2 * (s + 1), rtol=1e-6)
  np.testing.assert_allclose(_apply(scores.compose(double, add), s), 2 * s + 1, rtol=1e-6)
  assert "alibi" in repr(scores.compose(scores.alibi(np.ones(3, np.float32)), double))


SLOPES = np.array([0.3, 0.1, 0.05], np.float32)
TABLE = np.asarray(normal((8, 3), seed=4))


def _alibi_np(s, b, h, q, kv):
  return s + SLOPES[h] * (kv - q)


def _cap_np(s, b, h, q, kv):
  return 2.0 * np.tanh(s / 2.0)


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_attention_with_scores_matches_numpy(backward):
  q, k, v = normal((B, T, 3, 4)), normal((B, S, 1, 4), seed=1), normal((B, S, 1, 4), seed=2)
  out = jattn.dot_product_attention(
    q, k, v, score_fn=scores.alibi(SLOPES), logits_soft_cap=2.0, is_causal=True, backward=backward
  )
  want, _ = attention_np(
    q, k, v, score=lambda *a: _cap_np(_alibi_np(*a), *a[1:]), allowed=np.tril(np.ones((T, S), bool))
  )
  assert_close(out, want)


def test_an_unhashable_callable_is_a_score_fn():
  """A callable object that cannot be hashed (a dataclass with ``eq``, say) is checked and
  applied as a plain function is, though jit cannot key its caches on it."""

  @dataclasses.dataclass
  class Alibi:
    slopes: np.ndarray

    def __call__(self, s, b, h, q, kv):
      return s + jnp.asarray(self.slopes)[h] * (kv - q)

  fn = Alibi(SLOPES)
  with pytest.raises(TypeError):
    hash(fn)
  q, k, v = normal((B, T, 3, 4)), normal((B, S, 1, 4), seed=1), normal((B, S, 1, 4), seed=2)
  for _ in range(2):  # the second call checks it again, with nothing kept from the first
    out = jattn.dot_product_attention(q, k, v, score_fn=fn, implementation="xla")
    assert_close(out, attention_np(q, k, v, score=_alibi_np)[0])


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_learned_score_parameters_get_gradients(backward):
  """Gradients reach a relative-position table and ALiBi slopes, inside jit, as in training."""
  q, k, v = normal((B, T, 3, 4)), normal((B, S, 3, 4), seed=1), normal((B, S, 3, 4), seed=2)

  def loss_ours(table, slopes):
    fn = scores.compose(
      scores.relative_position_bias(table, num_buckets=8, max_distance=16), scores.alibi(slopes)
    )
    return jnp.sum(jattn.dot_product_attention(q, k, v, score_fn=fn, backward=backward) ** 2)

  def loss_ref(table, slopes):
    def score(s, b, h, qi, kv):
      bucket = scores.t5_bucket(kv - qi, num_buckets=8, max_distance=16, bidirectional=True)
      return s + table[bucket, h] + slopes[h] * (kv - qi)

    return jnp.sum(attention_jnp(q, k, v, score=score)[0] ** 2)

  args = (array(TABLE), array(SLOPES))
  got = jax.jit(jax.grad(loss_ours, (0, 1)))(*args)
  want = jax.jit(jax.grad(loss_ref, (0, 1)))(*args)  # one program, not one per operation
  for a, b in zip(got, want):
    assert_close(a, b, np.float32, factor=5)
  assert np.abs(np.asarray(got[0])).sum() > 0


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_score_fn_closing_over_traced_values(backward):
  """A plain closure over traced arrays differentiates under grad(jit(...)) and jit(grad(...))."""
  q, k, v = normal((1, 4, 2, 4)), normal((1, 4, 2, 4), seed=1), normal((1, 4, 2, 4), seed=2)

  def loss(temperature, offset):
    fn = lambda s, b, h, qi, kv: s * temperature + jnp.where(qi >= kv + offset, 0.0, -1.0)
    return jnp.sum(jattn.dot_product_attention(q, k, v, score_fn=fn, backward=backward) ** 2)

  def loss_ref(temperature, offset):
    fn = lambda s, b, h, qi, kv: s * temperature + jnp.where(qi >= kv + offset, 0.0, -1.0)
    return jnp.sum(attention_jnp(q, k, v, score=fn)[0] ** 2)

  t, off = jnp.float32(0.7), jnp.int32(1)
  want = jax.jit(jax.grad(loss_ref))(t, off)  # one program, not one per operation
  assert_close(jax.grad(jax.jit(loss))(t, off), want, factor=5)
  assert_close(jax.jit(jax.grad(loss))(t, off), want, factor=5)


def _integer_inputs():
  """Integer-valued q, k, v: with scale 0.5 every logit, and ``_narrow``'s result, is
  exact in float16 and bfloat16, so rounding the scores loses nothing."""
  rng = np.random.default_rng(7)
  return tuple(
    array(rng.integers(-2, 3, shape), jnp.float32)
    for shape in ((B, T, N, 4), (B, S, N, 4), (B, S, N, 4))
  )


def _narrow_formula(s, b, h, qi, kv):
  return 2 * s - 0.25 * abs(qi - kv)


# The default run keeps bfloat16 through the custom_vjp; the other cases are exhaustive.
@pytest.mark.parametrize(
  "dtype, rule",
  [
    pytest.param(dtype, r, id=f"{name}-{r}", marks=() if r == kept else pytest.mark.exhaustive)
    for dtype, name, kept in [
      (jnp.float16, "float16", None),
      (jnp.bfloat16, "bfloat16", "custom_vjp"),
    ]
    for r in RULES
  ],
)
def test_score_fn_computing_in_a_narrow_dtype(rule, dtype):
  """A score_fn returning float16/bfloat16 is computed in float32 from there on: the right
  values, zeros and -inf for rows that attend to nothing, finite gradients (it once gave NaN
  rows, rows of mean(v), or JAX's "unexpected JAX type" from every custom_vjp)."""
  q, k, v = _integer_inputs()
  lengths = array([T, 2], jnp.int32)  # row 1: queries 2.. attend to nothing
  narrow = lambda s, b, h, qi, kv: _narrow_formula(s, b, h, qi, kv).astype(dtype)

  def ours(q, k, v):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      scale=0.5,
      score_fn=narrow,
      is_causal=True,
      query_seq_lengths=lengths,
      return_residual=True,
      **RULES[rule],
    )

  allowed = np.tril(np.ones((T, S), bool)) & (
    np.arange(T)[:, None] < np.asarray(lengths)[:, None, None, None]
  )
  out, lse = ours(q, k, v)
  assert out.dtype == lse.dtype == jnp.float32
  want_out, want_lse = attention_np(q, k, v, scale=0.5, score=_narrow_formula, allowed=allowed)
  assert_close(out, want_out)
  assert_close(
    np.where(np.isfinite(want_lse), lse, 0), np.where(np.isfinite(want_lse), want_lse, 0)
  )
  np.testing.assert_array_equal(out[1, 2:], 0.0)
  assert np.all(np.isneginf(lse[1, 2:])) and np.all(np.isfinite(lse[0]))

  cot = normal((B, T, N, 4), seed=3)

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v)
      return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return f

  def ref(q, k, v):
    score = lambda *a: narrow(*a).astype(jnp.float32)
    return attention_jnp(q, k, v, allowed=jnp.asarray(allowed), scale=0.5, score=score)

  got = jax.grad(loss(ours), (0, 1, 2))(q, k, v)
  want = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)  # one program, not one per op
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    assert_close(g, w, dtype)  # the score's cotangent is rounded to ``dtype`` in both


def test_num_heads_of_score_functions():
  table = np.ones((8, 3), np.float32)
  assert scores.alibi(SLOPES).num_heads == 3
  assert scores.relative_position_bias(table, num_buckets=8, max_distance=16).num_heads == 3
  assert scores.soft_cap(5.0).num_heads is None
  assert scores.from_fn(lambda s, *idx: s).num_heads is None
  assert (
    scores.compose(lambda s, *idx: s, scores.alibi(SLOPES), scores.soft_cap(5.0)).num_heads == 3
  )


L = TILED_LENGTH  # TILED's blockwise evaluates score functions on 2 x 2 tiles of 4 x 4
TABLE_LL = np.asarray(normal((L, L), seed=5))
RELATIVE = np.asarray(normal((2 * L - 1,), seed=6))

NOT_FROM_INDICES = {
  # The captured (T, S) table of the issue; jnp broadcasts (T, S) against (B, N, T, S)
  # without rank promotion, which tests otherwise forbid.
  "captured_table": lambda s, b, h, qi, kv: s + jnp.asarray(TABLE_LL),
  "positions_from_shape": lambda s, b, h, qi, kv: (
    s
    - 0.1
    * jnp.abs(
      jnp.arange(s.shape[-2]).reshape(1, 1, -1, 1) - jnp.arange(s.shape[-1]).reshape(1, 1, 1, -1)
    )
  ),
}


@pytest.mark.parametrize("implementation", list(TILED) + ["attention_weights"])
@pytest.mark.parametrize("name", list(NOT_FROM_INDICES))
def test_score_fn_that_does_not_compute_from_its_indices_is_rejected(name, implementation):
  """Such functions worked on the materialised path, then failed 15 frames deep (a captured
  table) or silently differed (positions from s.shape) on tiles: now every path raises."""
  q = k = v = normal((1, L, 2, 4))
  fn = NOT_FROM_INDICES[name]
  match = r"score_fn must compute from its index arguments \(batch, head, q_idx, kv_idx\)"
  with jax.numpy_rank_promotion("allow"), pytest.raises(ValueError, match=match) as info:
    if implementation == "attention_weights":
      jattn.attention_weights(q, k, score_fn=fn)
    else:
      jattn.dot_product_attention(q, k, v, score_fn=fn, **TILED[implementation])
  assert ("Incompatible shapes" in str(info.value)) == (name == "captured_table")
  assert ("from an array's shape" in str(info.value)) == (name == "positions_from_shape")


def _relative_np(s, b, h, qi, kv):
  return s + RELATIVE[qi - kv + L - 1]


@pytest.mark.parametrize("implementation", list(TILED))
def test_score_fns_that_compute_from_their_indices_work_everywhere(implementation):
  q, k, v = normal((2, L, 2, 4)), normal((2, L, 2, 4), seed=1), normal((2, L, 2, 4), seed=2)
  relative = lambda s, b, h, qi, kv: s + jnp.asarray(RELATIVE)[qi - kv + L - 1]
  out = jattn.dot_product_attention(q, k, v, score_fn=relative, **TILED[implementation])
  assert_close(out, attention_np(q, k, v, score=_relative_np)[0])

  slopes = np.array([0.5, 0.25], np.float32)
  out = jattn.dot_product_attention(
    q, k, v, score_fn=scores.alibi(slopes), is_causal=True, **TILED[implementation]
  )
  want = attention_np(
    q,
    k,
    v,
    score=lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi),
    allowed=np.tril(np.ones((L, L), bool)),
  )[0]
  assert_close(out, want)

  @jax.jit
  def closure(temperature, offset):  # closes over traced arrays: values cannot be probed
    fn = lambda s, b, h, qi, kv: s * temperature + relative(s, b, h, qi + offset, kv) - s
    return jattn.dot_product_attention(q, k, v, score_fn=fn, **TILED[implementation])

  want = attention_np(
    q,
    k,
    v,
    score=lambda s, b, h, qi, kv: 0.5 * s + RELATIVE[np.clip(qi + 1 - kv + L - 1, 0, 2 * L - 2)],
  )[0]
  assert_close(closure(jnp.float32(0.5), jnp.int32(1)), want)
