"""The numerics contract: empty rows give zeros (never NaN), statistics in float32/float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import RULES, assert_close, attention_jnp, attention_np, normal

import jattn
from jattn import masks, testing
from jattn.impl import common

B, T, S, N, K, H = 2, 6, 4, 2, 1, 4


# Masks that leave at least one query row with nothing to attend to, as (kwargs, empty rows)
# where empty rows is a (B, T) bool array.
def _rows(*pairs):
  out = np.zeros((B, T), bool)
  for b, t in pairs:
    out[b, t] = True
  return out


EMPTYING = {
  "causal_offset": (dict(mask=masks.causal(-2)), _rows((0, 0), (0, 1), (1, 0), (1, 1))),
  "window_past_keys": (dict(local_window_size=(0, 0)), _rows((0, 4), (0, 5), (1, 4), (1, 5))),
  "chunked_past_keys": (dict(mask=masks.chunked(4)), _rows((0, 4), (0, 5), (1, 4), (1, 5))),
  "strided": (dict(mask=masks.strided(5) & masks.causal()), _rows((0, 4), (1, 4))),
  "strided_short_keys": (dict(mask=masks.strided(8)), _rows((0, 4), (0, 5), (1, 4), (1, 5))),
  "global_zero": (dict(mask=masks.global_tokens(0)), np.ones((B, T), bool)),
  "kv_lengths_zero": (
    dict(key_value_seq_lengths=jnp.array([0, 4], jnp.int32)),
    _rows(*[(0, t) for t in range(T)]),
  ),
  "q_lengths": (
    dict(query_seq_lengths=jnp.array([6, 2], jnp.int32)),
    _rows(*[(1, t) for t in range(2, T)]),
  ),
  "segments": (
    dict(segment_ids=(np.array([[0, 0, 1, 1, 2, 2]] * 2), np.array([[0, 0, 1, 1], [1, 1, 1, 1]]))),
    _rows((0, 4), (0, 5), (1, 0), (1, 1), (1, 4), (1, 5)),
  ),
  "array_row": (dict(mask=np.array([[True] * S] * (T - 1) + [[False] * S])), _rows((0, 5), (1, 5))),
  "fn": (dict(mask=masks.from_fn(lambda b, h, q, kv: (q != 3) & (kv >= b))), _rows((0, 3), (1, 3))),
  "bias_and_cap": (
    dict(mask=masks.causal(-5), bias=normal((1, N, T, S)) * 1e3, logits_soft_cap=5.0),
    _rows(*[(b, t) for b in range(B) for t in range(5)]),
  ),
}


def _qkv(dtype=jnp.float32):
  return (
    normal((B, T, N, H), dtype),
    normal((B, S, K, H), dtype, 1),
    normal((B, S, K, H), dtype, 2),
  )


# The default run keeps six kinds, each through one of the two rules; the other cases are
# exhaustive.
DEFAULT_BACKWARD = {
  "causal_offset": "autodiff",
  "strided_short_keys": "custom_vjp",
  "kv_lengths_zero": "custom_vjp",
  "segments": "autodiff",
  "fn": "autodiff",
  "bias_and_cap": "custom_vjp",
}


@pytest.mark.parametrize(
  "kind, backward",
  [
    pytest.param(kind, b, marks=() if DEFAULT_BACKWARD.get(kind) == b else pytest.mark.exhaustive)
    for kind in EMPTYING
    for b in ("autodiff", "custom_vjp")
  ],
)
def test_empty_rows_give_zeros_and_no_nan_or_inf(kind, backward):
  kwargs, empty = EMPTYING[kind]
  q, k, v = _qkv()
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, backward=backward, **kwargs)
  weights = normal((B, T, N, H), seed=9)
  loss = lambda q, k, v: jnp.sum(f(q, k, v) * weights)
  # No value the forward pass hands the backward, and no output, is inf or NaN: eagerly
  # (the forward and backward programs apart, with the residuals between them) and jitted.
  with jax.debug_infs(True), jax.debug_nans(True):
    dq, dk, dv = jax.grad(loss, (0, 1, 2))(q, k, v)
    jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  np.testing.assert_array_equal(np.asarray(dq)[empty], 0.0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  # The forward's outputs (lse is -inf on empty rows, so outside debug_infs).
  out, lse = jattn.dot_product_attention(q, k, v, backward=backward, return_residual=True, **kwargs)
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[empty], 0.0)
  assert np.abs(out[~empty]).sum() > 0 or empty.all()
  assert np.all(np.isneginf(lse[empty])) and np.all(np.isfinite(lse[~empty]))


def test_keys_that_no_query_sees_get_zero_gradient():
  q, k, v = _qkv()
  for backward in ("autodiff", "custom_vjp"):
    dk, dv = jax.grad(
      lambda k, v: jnp.sum(
        jattn.dot_product_attention(
          q, k, v, key_value_seq_lengths=jnp.array([2, 3], jnp.int32), backward=backward
        )
        ** 2
      ),
      (0, 1),
    )(k, v)
    np.testing.assert_array_equal(np.asarray(dk)[0, 2:], 0.0)
    np.testing.assert_array_equal(np.asarray(dv)[1, 3:], 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_low_precision_keeps_statistics_in_float32(dtype):
  """A softmax over many keys: sums of 2048 small weights would stall in 16-bit floats."""
  q, k, v = (
    normal((1, 4, 2, 8), dtype),
    normal((1, 2048, 2, 8), dtype, 1),
    normal((1, 2048, 2, 8), dtype, 2),
  )
  out, lse = jattn.dot_product_attention(q, k, v, return_residual=True)
  assert out.dtype == dtype and lse.dtype == dtype
  want, want_lse = attention_np(q, k, v)  # float64 on the same rounded inputs
  assert_close(out, want, dtype)
  assert_close(lse, want_lse, dtype)


def test_large_logits_do_not_overflow():
  q, k, v = _qkv()
  out = jattn.dot_product_attention(q * 1e3, k * 1e3, v, is_causal=True)
  assert np.all(np.isfinite(out))
  assert_close(out, attention_np(q * 1e3, k * 1e3, v, allowed=np.tril(np.ones((T, S), bool)))[0])


def test_float64_is_kept(x64):
  q, k, v = _qkv(jnp.float64)
  for backward in ("autodiff", "custom_vjp"):
    out, lse = jattn.dot_product_attention(
      q, k, v, is_causal=True, return_residual=True, backward=backward
    )
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    want, want_lse = attention_np(q, k, v, allowed=np.tril(np.ones((T, S), bool)))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_additive_minus_inf_bias_never_gives_nan(backward):
  """Users who mask with -inf in bias get masking, and zeros for rows left with nothing."""
  q, k, v = _qkv()
  bias = np.zeros((1, 1, T, S), np.float32)
  bias[..., 1:, 2:] = -np.inf  # rows 1.. see keys 0 and 1 only
  bias[..., 3, :] = -np.inf  # row 3 sees nothing
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, jnp.asarray(bias), backward=backward)
  out = f(q, k, v)
  grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out)[:, 3], 0.0)
  allowed = np.isfinite(bias)
  assert_close(out, attention_np(q, k, v, allowed=allowed)[0])
  for g in grads:
    assert np.all(np.isfinite(g))


def _vjp(fn, args, cotangent):
  """Outputs and gradients of ``fn`` at ``args`` for one output cotangent."""
  out, pull = jax.vjp(fn, *args)
  return out, pull(cotangent)


def _max_err(got, want):
  return max(
    float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
    for g, w in zip(got, want)
  )


@functools.cache
def _huge_mask_jax_nn(value):
  """Inputs with row 3 biased by ``value``, a cotangent, and jax.nn's outputs and gradients
  (the same for every rule)."""
  q, k, v = (normal((1, 8, 1, 4), seed=i) for i in range(3))
  bias = jnp.zeros((1, 1, 8, 8)).at[0, 0, 3].set(value)
  ct = normal((1, 8, 1, 4), seed=3)
  args = (q, k, v, bias)
  # One program (op by op, jax.nn compiles ~55)
  return args, ct, jax.jit(lambda *a: _vjp(jax.nn.dot_product_attention, a, ct))(*args)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize(
  "value", [-1e9, -1e30, float(np.finfo(np.float32).min)], ids=["1e9", "1e30", "f32min"]
)
def test_huge_additive_mask_on_a_row_keeps_jax_nn_gradients(rule, value):
  """A row biased by -1e9 everywhere is still a softmax (uniform, as in jax.nn), and its
  gradients are jax.nn's: the rules recompute exp(s - m) / l from the row's max and sum kept
  apart, not from m + log l, where log l vanishes next to |m| ~ 1e9. Down to float32.min the
  row is a softmax like any other: no threshold turns it into an empty row."""
  args, ct, want = _huge_mask_jax_nn(value)
  q, k, v, bias = args
  got = _vjp(lambda *a: jattn.dot_product_attention(*a, **RULES[rule]), args, ct)
  assert_close(got[0], want[0])
  for g, w in zip(got[1], want[1]):
    assert np.all(np.isfinite(g))
    assert_close(g, w, factor=5)
  # The row attends uniformly, as in jax.nn and the float64 formula.
  np.testing.assert_allclose(
    got[0][0, 3, 0], np.mean(np.asarray(v)[0, :, 0], axis=0), rtol=1e-6, atol=1e-6
  )


@pytest.mark.parametrize("rule", list(RULES))
def test_huge_additive_mask_in_float64(rule, x64):
  q, k, v = (normal((1, 8, 1, 4), np.float64, seed=i) for i in range(3))
  bias = jnp.zeros((1, 1, 8, 8), jnp.float64).at[0, 0, 3].set(-1e30).at[0, 0, 5, :4].set(-1e9)
  ct = normal((1, 8, 1, 4), np.float64, seed=3)
  # The formula's outputs and gradients, as one program (op by op it compiles ~60)
  want = jax.jit(lambda *a: _vjp(lambda *a: attention_jnp(*a)[0], a, ct))(q, k, v, bias)
  got = _vjp(lambda *a: jattn.dot_product_attention(*a, **RULES[rule]), (q, k, v, bias), ct)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def _rule_vjp(args, ct, rule, kw):
  """``_vjp`` of jax.nn (rule "jax.nn") or of a rule of RULES, keyword arguments ``kw`` (a
  tuple of items)."""
  if rule == "jax.nn":
    return _vjp(lambda *a: jax.nn.dot_product_attention(*a, **dict(kw)), args, ct)
  return _vjp(lambda *a: jattn.dot_product_attention(*a, **dict(kw), **RULES[rule]), args, ct)


# As one program, compiled once per rule, arguments, shapes and dtypes (and lowering_for's
# platform, part of every jit cache key), not the forward and backward passes apart per call.
_rule_vjp_jit = jax.jit(_rule_vjp, static_argnames=("rule", "kw"))


def _saturated_vjp(args, ct, rule, kw):
  """``_rule_vjp``, jitted but for jax.nn in float16: jitted, XLA:CPU rejects its float16 dot
  with float32 accumulation ('F16_F16_F32'), which it runs op by op."""
  if rule == "jax.nn" and args[0].dtype == jnp.float16:
    return _rule_vjp(args, ct, rule, kw)
  return _rule_vjp_jit(args, ct, rule, kw)


def _low_precision_errors(rule, kw, args, ct, dtype):
  """For the rule's output and input gradients at ``args`` rounded to ``dtype``: the max error
  against the rule evaluated in float32 on the same rounded inputs, and a tenth of a ``dtype``
  ulp of the largest exact value (the slack the accuracy target allows)."""
  kw = tuple(sorted(kw.items()))
  low = [a.astype(dtype) for a in args]
  exact = _saturated_vjp([a.astype(jnp.float32) for a in low], ct.astype(jnp.float32), rule, kw)
  got = _saturated_vjp(low, ct.astype(dtype), rule, kw)
  errors, slack = [], []
  for g, w in zip((got[0], *got[1]), (exact[0], *exact[1])):
    errors.append(_max_err([g], [w]))
    top = float(np.max(np.abs(np.asarray(w))))
    slack.append(0.1 * float(jnp.finfo(dtype).eps) * 2.0 ** np.floor(np.log2(max(top, 1e-30))))
  return errors, slack


def _saturated_inputs(case, dtype):
  """(q, k, v), the output cotangent and keyword arguments of a saturated case."""
  shape = (2, 12, 2, 16)
  mult = {"x10": 10.0, "x100": 100.0, "scale1e3": 1.0}[case]
  if dtype == jnp.float16 and case == "x100":
    mult = 20.0  # float16 overflows q·k at 100
  kw = dict(scale=1e3) if case == "scale1e3" else {}
  return [normal(shape, seed=i) * mult for i in range(3)], normal(shape, seed=3), kw


@functools.cache
def _saturated_jax_nn(case, dtype_name):
  """jax.nn's errors and the slack in a saturated case (the same for every rule)."""
  dtype = jnp.dtype(dtype_name)
  args, ct, kw = _saturated_inputs(case, dtype)
  return _low_precision_errors("jax.nn", kw, args, ct, dtype)


# The saturated cells, (case, dtype, rule), and the ones each test runs by default, every rule
# in each (the known gaps below among them); x10 (x100's programs at other values) and
# scale=1e3 in float16 are exhaustive. On a CPU both 16-bit dtypes compute in float32
# (common.compute_dtype): there the default run keeps x100 and scale=1e3 in bfloat16, and
# float16 (the same programs but for the inputs' rounding) is exhaustive. Routed as on a GPU,
# each dtype computes narrow: there it keeps x100 in both dtypes, and scale=1e3 (the same narrow
# programs at other values; on a CPU by default) is exhaustive.
def _saturated(default):
  return [
    pytest.param(
      case,
      dtype,
      rule,
      id=f"{case}-{name}-{rule}",
      marks=() if (case, name) in default else pytest.mark.exhaustive,
    )
    for case in ("x10", "x100", "scale1e3")
    for dtype, name in ((jnp.bfloat16, "bf16"), (jnp.float16, "f16"))
    for rule in RULES
  ]


@pytest.mark.parametrize(
  "case, dtype, rule", _saturated(default={("x100", "bf16"), ("scale1e3", "bf16")})
)
def test_saturated_softmax_gradients_no_worse_than_jax_nn(case, dtype, rule):
  """As the softmax saturates (one key takes each row), low-precision gradients stay as
  accurate as jax.nn's. The default rule once rounded the unnormalised probabilities, whose
  cotangent then stopped cancelling against the row sum's: dq errors of 1.9 where the true
  |dq| is below 1e-9; the custom_vjp rules once lost log l at scale=1e3."""
  _check_saturated(case, dtype, rule)


@pytest.mark.parametrize(
  "case, dtype, rule", _saturated(default={("x100", "bf16"), ("x100", "f16")})
)
def test_saturated_gradients_computed_narrow_as_on_a_gpu(case, dtype, rule):
  """On a CPU xla and blockwise compute bfloat16/float16 inputs in float32
  (common.compute_dtype); routed as on a GPU they compute in the narrow dtype with float32
  statistics (blockwise correcting its row sums for the rounded weights). That path, checked
  here on the CPU."""
  assert common.compute_dtype(dtype, "cpu") == np.float32
  assert common.compute_dtype(dtype, "gpu") == dtype
  # jax.nn's errors (cached, every rule's target) as the CPU test takes them: outside the
  # routing, which jax.nn does not read but every jit cache key does (its programs again).
  _saturated_jax_nn(case, np.dtype(dtype).name)
  with testing.lowering_for("gpu"):
    _check_saturated(case, dtype, rule, gap_key=f"{rule} (narrow)")


def _check_saturated(case, dtype, rule, gap_key=None):
  args, ct, kw = _saturated_inputs(case, dtype)
  ref, slack = _saturated_jax_nn(case, np.dtype(dtype).name)
  got, _ = _low_precision_errors(rule, kw, args, ct, dtype)
  gap = SATURATION_GAPS.get((case, np.dtype(dtype).name, gap_key or rule), ())
  for name, g, r, tol in zip(("out", "dq", "dk", "dv"), got, ref, slack):
    if name in gap:
      # Known gap (README, numerics): not within the target, but within cancellation noise of
      # the terms that cancel, |scale · dY·v · k| ~ 1e4 here, and never growing with it.
      assert g <= 1.5 * r + 1e-2, (name, g, r)
      continue
    assert g <= 1.5 * r + tol, (name, g, r, tol)


# Cells of test_saturated_softmax_gradients_no_worse_than_jax_nn that miss the target, and the
# quantities that miss it. In a saturated row jax.nn's gradient cancels exactly (one-hot y, so
# rowsum(y ⊙ g) is exactly g at the hot key) and its error is 0. The custom_vjp rule's backward
# recomputes scores whose last bit differs from the forward's where XLA's CPU backend fuses
# scale · x − m into one multiply-add, so the hot key's weight is 1 ± ε and its gradient keeps
# ε · scale · |k|. The autodiff rule keeps the forward's weights and centres the cotangent
# before the softmax's transpose (common.softmax); its dq in float16 at x100 (4.3e-5) is the
# float64 formula's own change under the cotangent's rounding (4.2e-5), which jax.nn's error
# (2.5e-5) falls short of. Blockwise sums Δ = rowsum(A ⊙ dA) exactly as jax.nn does and meets
# the target except in float16 at x100, where its dq is 1.8x jax.nn's against this float32
# reference, with float32 tiles (a CPU) and narrow ones (a GPU) alike (experiments/accuracy.py,
# against float64, has it within).
_GAPS = {
  ("x100", "float16", "autodiff"): ("dq",),
  ("x100", "float16", "custom_vjp"): ("dq", "dk"),
  ("x100", "float16", "blockwise"): ("dq",),
  **{
    ("scale1e3", d, r): ("dq", "dk")
    for d in ("bfloat16", "float16")
    for r in ("autodiff", "custom_vjp")
  },
}
# The same cells, computed in float32 (a CPU) and in the narrow dtype (routed as on a GPU).
SATURATION_GAPS = {
  **_GAPS,
  **{(case, d, f"{rule} (narrow)"): gap for (case, d, rule), gap in _GAPS.items()},
}


_jax_nn = jax.jit(jax.nn.dot_product_attention)  # one program, not one per operation


@pytest.mark.parametrize("rule", list(RULES))
def test_bias_rows_are_continuous_down_to_float32_min(rule):
  """Every finite score takes part: a row biased by -1e38, -2.4e38 (below jax.nn's own masked
  value) or float32.min is a uniform softmax, as in jax.nn; -inf alone leaves a row empty
  (zeros, lse -inf, zero gradients, where jax.nn gives NaN)."""
  q, k, v = (normal((1, 6, 1, 4), seed=i) for i in range(3))
  mean_v = np.mean(np.asarray(v)[0, :, 0], axis=0)
  for value in (-1e38, -2.4e38, float(np.finfo(np.float32).min)):
    bias = jnp.zeros((1, 1, 6, 6)).at[0, 0, 2].set(value)
    out, lse = jattn.dot_product_attention(q, k, v, bias, return_residual=True, **RULES[rule])
    assert_close(out, _jax_nn(q, k, v, bias))
    np.testing.assert_allclose(out[0, 2, 0], mean_v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[0, 2, 0], value + np.log(6), rtol=1e-6)
  bias = jnp.zeros((1, 1, 6, 6)).at[0, 0, 2].set(-jnp.inf)
  f = lambda q, k, v, b: jattn.dot_product_attention(
    q, k, v, b, return_residual=True, **RULES[rule]
  )
  (out, lse), grads = _vjp(f, (q, k, v, bias), (normal((1, 6, 1, 4), seed=3), jnp.ones((1, 6, 1))))
  np.testing.assert_array_equal(out[0, 2], 0.0)
  assert lse[0, 2, 0] == -np.inf
  np.testing.assert_array_equal(grads[0][0, 2], 0.0)
  np.testing.assert_array_equal(grads[3][0, 0, 2], 0.0)
  for g in grads:
    assert np.all(np.isfinite(g))
