"""Property tests: random shapes, masks, biases and score functions against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

import jattn
from jattn import masks, scores


@st.composite
def problems(draw):
  B = draw(st.integers(1, 2))
  T, S = draw(st.integers(1, 7)), draw(st.integers(1, 7))
  K, G, H = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
  N = K * G
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  kind = draw(
    st.sampled_from(
      [
        "none",
        "causal",
        "window",
        "chunked",
        "prefix_lm",
        "segments",
        "lengths",
        "global",
        "strided",
        "array",
        "fn",
        "jax_nn_args",
        "combo",
      ]
    )
  )
  mask, allowed, kwargs = None, np.ones((B, N, T, S), bool), {}
  if kind == "causal":
    offset = draw(st.integers(-3, 3))
    mask, allowed = masks.causal(offset), ref.causal_np(T, S, offset)
  elif kind == "window":
    left, right = draw(st.none() | st.integers(0, 3)), draw(st.none() | st.integers(0, 3))
    mask, allowed = masks.sliding_window(left, right), ref.window_np(T, S, left, right)
  elif kind == "chunked":
    size = draw(st.integers(1, 4))
    mask, allowed = masks.chunked(size), ref.chunked_np(T, S, size)
  elif kind == "prefix_lm":
    prefix = rng.integers(0, S + 1, size=B)
    mask, allowed = masks.prefix_lm(prefix), ref.prefix_np(T, S, prefix)
  elif kind == "segments":
    q_ids, kv_ids = rng.integers(0, 3, size=(B, T)), rng.integers(0, 3, size=(B, S))
    if draw(st.booleans()):
      q_ids, kv_ids = np.sort(q_ids, axis=1), np.sort(kv_ids, axis=1)
    kwargs["segment_ids"] = (q_ids, kv_ids)
    allowed = ref.segments_np(q_ids, kv_ids)
  elif kind == "lengths":
    q_lens, kv_lens = rng.integers(0, T + 1, size=B), rng.integers(0, S + 1, size=B)
    mask, allowed = masks.lengths(q_lens, kv_lens), ref.lengths_np(T, S, q_lens, kv_lens)
  elif kind == "global":
    n = draw(st.integers(0, 3))
    mask, allowed = masks.global_tokens(n), ref.global_np(T, S, n)
  elif kind == "strided":
    stride = draw(st.integers(1, 3))
    mask, allowed = masks.strided(stride), ref.strided_np(T, S, stride)
  elif kind == "array":
    arr = rng.random((B, draw(st.sampled_from([1, N])), T, S)) < 0.6
    mask, allowed = arr, arr
  elif kind == "fn":
    period = draw(st.integers(2, 4))
    mask = masks.from_fn(lambda b, h, q, kv: (q * 2 + kv + h + b) % period != 0)
    b_, h_, q_, kv_ = ref.grid(B, N, T, S)
    allowed = (q_ * 2 + kv_ + h_ + b_) % period != 0
  elif kind == "jax_nn_args":
    window = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    kv_lens = rng.integers(0, S + 1, size=B).astype(np.int32)
    kwargs.update(is_causal=True, local_window_size=window, key_value_seq_lengths=kv_lens)
    allowed = (
      ref.causal_np(T, S) & ref.window_np(T, S, *window) & ref.lengths_np(T, S, None, kv_lens)
    )
  elif kind == "combo":
    mask = (masks.causal(1) & ~masks.chunked(2)) | masks.global_tokens(1)
    allowed = (ref.causal_np(T, S, 1) & ~ref.chunked_np(T, S, 2)) | ref.global_np(T, S, 1)
  kwargs["mask"] = mask

  bias = None
  bias_shape = draw(st.sampled_from([None, (B, N, T, S), (1, N, 1, S), (T, S)]))
  if bias_shape is not None:
    bias = rng.standard_normal(bias_shape)

  score_kind = draw(st.sampled_from(["none", "alibi", "relative", "cap", "fn"]))
  score_np = None
  slopes = rng.random(N) * 0.5
  table = rng.standard_normal((8, N))
  if score_kind == "alibi":
    kwargs["score_fn"] = scores.alibi(slopes)
    score_np = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
  elif score_kind == "relative":
    kwargs["score_fn"] = scores.relative_position_bias(table, num_buckets=8, max_distance=10)
    bucket = lambda r: np.asarray(
      scores.t5_bucket(ref.array(r), num_buckets=8, max_distance=10, bidirectional=True)
    )
    score_np = lambda s, b, h, q, kv: s + table[bucket(kv - q), h]
  elif score_kind == "cap":
    kwargs["logits_soft_cap"] = 1.5
    score_np = lambda s, b, h, q, kv: 1.5 * np.tanh(s / 1.5)
  elif score_kind == "fn":
    kwargs["score_fn"] = lambda s, b, h, q, kv: s - 0.1 * jnp.abs(q - kv) * (h + 1)
    score_np = lambda s, b, h, q, kv: s - 0.1 * np.abs(q - kv) * (h + 1)

  arrays = (
    rng.standard_normal((B, T, N, H)),
    rng.standard_normal((B, S, K, H)),
    rng.standard_normal((B, S, K, H)),
  )
  rule = draw(st.sampled_from(["autodiff", "custom_vjp", "blockwise"]))
  if rule == "blockwise":  # tiles that rarely divide T and S
    rule = dict(
      implementation="blockwise", block_q=draw(st.integers(1, 4)), block_kv=draw(st.integers(1, 4))
    )
  else:
    rule = dict(implementation="xla", backward=rule)
  return arrays, bias, kwargs, np.broadcast_to(allowed, (B, N, T, S)), score_np, rule


# Every example compiles anew. The default run draws a share of each property's examples; its
# twin ..._more_draws, exhaustive, draws more (its own name gives it its own derandomized draws).
@settings(max_examples=8)
@given(problems())
def test_matches_float64_numpy(problem):
  _check_matches_float64_numpy(problem)


@pytest.mark.exhaustive
@settings(max_examples=7)
@given(problems())
def test_matches_float64_numpy_more_draws(problem):
  _check_matches_float64_numpy(problem)


def _check_matches_float64_numpy(problem):
  (q, k, v), bias, kwargs, allowed, score_np, rule = problem
  with jax.enable_x64(True):
    args = [ref.array(x, jnp.float64) for x in (q, k, v)]
    bias64 = None if bias is None else ref.array(bias, jnp.float64)
    if isinstance(kwargs.get("score_fn"), jattn.ScoreFn):
      kwargs["score_fn"] = jax.tree_util.tree_map(ref.array, kwargs["score_fn"])
    # One jitted program per example (eagerly, the call's checks and glue each compiled a
    # program of their own); the masks, ids and lengths it closes over stay concrete.
    attend = lambda *a: jattn.dot_product_attention(*a, return_residual=True, **rule, **kwargs)
    out, lse = jax.jit(attend)(*args, bias64)
    want, want_lse = ref.attention_np(q, k, v, bias=bias, allowed=allowed, score=score_np)
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-9)


@settings(max_examples=5)
@given(problems())
def test_custom_vjp_gradients_match_plain_autodiff(problem):
  """The explicit rules of both implementations against autodiff of a plain reference."""
  _check_custom_vjp_gradients(problem)


@pytest.mark.exhaustive
@settings(max_examples=10)
@given(problems())
def test_custom_vjp_gradients_more_draws(problem):
  _check_custom_vjp_gradients(problem)


def _check_custom_vjp_gradients(problem):
  (q, k, v), bias, kwargs, allowed, _, rule = problem
  if rule["implementation"] == "xla":
    rule = dict(implementation="xla", backward="custom_vjp")
  kwargs.pop("score_fn", None)  # score functions have their own gradient tests
  kwargs.pop("logits_soft_cap", None)
  q, k, v = (ref.array(x, jnp.float32) for x in (q, k, v))
  bias = ref.array(np.zeros((1, 1, 1, 1)) if bias is None else bias, jnp.float32)
  cot = ref.array(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

  def ours(q, k, v, bias):
    return jnp.sum(jattn.dot_product_attention(q, k, v, bias, **rule, **kwargs) * cot)

  def plain(q, k, v, bias):
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    return jnp.sum(ref.attention_jnp(q, k, v, bias, allowed=allowed)[0] * cot)

  both = lambda *a: [jax.grad(f, (0, 1, 2, 3))(*a) for f in (ours, plain)]
  got, want = jax.jit(both)(q, k, v, bias)  # one program, not two
  for a, b in zip(got, want):
    ref.assert_close(a, b, np.float32, factor=10)
