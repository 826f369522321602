"""The materialised implementation's explicit custom_vjp and autodiff rules against autodiff
of a plain reference in float64 for every mask kind, and jax.test_util.check_grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCORE_FN_HEADS, SCORE_FNS, mask_kinds, score_fn_in
from jax.test_util import check_grads
from reference import assert_close, attention_jnp, normal

import jattn
from jattn import masks

B, T, S, N, K, H = 2, 4, 5, SCORE_FN_HEADS, 2, 3
IDS_Q = np.array([[0, 0, 1, 1], [2, 3, 3, 3]])
IDS_KV = np.array([[0, 1, 1, 1, 2], [3, 3, 2, 2, 5]])

# Every mask kind, several of which leave some query rows with nothing to attend to.
MASKS = mask_kinds(
  B,
  T,
  S,
  ids=(IDS_Q, IDS_KV),
  window=(1, 1),
  chunk=2,
  prefix=[2, 0],
  lengths=([3, 4], [0, 2]),
  num_global=1,
  stride=2,
)


def _inputs(dtype):
  return (
    normal((B, T, N, H), dtype),
    normal((B, S, K, H), dtype, 1),
    normal((B, S, K, H), dtype, 2),
    normal((1, N, T, S), dtype, 3),
  )


def _finite(lse):
  return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _ours(mask, backward, score_fn=None, **kw):
  def f(q, k, v, bias):
    out, lse = jattn.dot_product_attention(
      q, k, v, bias, mask=mask, score_fn=score_fn, return_residual=True, backward=backward, **kw
    )
    return out, _finite(lse)

  return f


def _plain(mask, score_fn=None):
  allowed = None if mask is None else mask.materialize(T, S, batch_size=B, num_heads=N)

  def f(q, k, v, bias):
    out, lse = attention_jnp(q, k, v, bias, allowed=allowed, score=score_fn)
    return out, _finite(lse)

  return f


def _grads(f, args, seed=11):
  """Gradients of a random projection of both outputs, so the lse cotangent is exercised."""
  out = jax.eval_shape(f, *args)
  cots = [normal(o.shape, o.dtype, seed + i) for i, o in enumerate(out)]
  loss = lambda *a: sum(jnp.sum(o * c) for o, c in zip(f(*a), cots))
  return jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*args)


def _both_rules_and_formula(mask, score_fn=None):
  """Outputs (out, lse) and gradients of both rules and of the plain formula, on float64
  inputs, from one program (x64 must be on)."""
  args = _inputs(jnp.float64)
  fns = [_ours(mask, "custom_vjp", score_fn), _ours(mask, "autodiff", score_fn)]
  fns.append(_plain(mask, score_fn))
  out = jax.eval_shape(fns[0], *args)
  cots = [normal(o.shape, o.dtype, 11 + i) for i, o in enumerate(out)]

  def value_and_grads(f, *a):
    loss = lambda *a: sum(jnp.sum(o * c) for o, c in zip(f(*a), cots))
    return f(*a), jax.grad(loss, (0, 1, 2, 3))(*a)

  return jax.jit(lambda *a: [value_and_grads(f, *a) for f in fns])(*args)


def _assert_rules_match_formula(results):
  *rules, (want, want_grads) = results
  for rule, (got, grads) in zip(["custom_vjp", "autodiff"], rules):
    for name, a, b in zip(["out", "lse"], got, want):
      assert_close(a, b, np.float64, err_msg=f"{rule}: {name}")
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], grads, want_grads):
      assert_close(a, b, np.float64, factor=5, err_msg=f"{rule}: {name}")
      assert np.all(np.isfinite(a)), name


# The default run keeps rows left empty, segments, a function of all four indices, and &, | and ~
# together; the other kinds are exhaustive.
@pytest.mark.parametrize(
  "kind",
  [
    k
    if k in ("causal_empty_rows", "segments", "from_fn", "combined")
    else pytest.param(k, marks=pytest.mark.exhaustive)
    for k in MASKS
  ],
)
def test_both_rules_match_autodiff_of_plain_reference(kind, x64):
  """Values, lse and gradients (of q, k, v and bias, under cotangents on out and lse) of the
  explicit custom_vjp and of autodiff through jattn, against the plain formula in float64:
  to 1e-9, which is what check_grads (below, for the masks with empty rows) checks too."""
  _assert_rules_match_formula(_both_rules_and_formula(MASKS[kind]))


@pytest.mark.parametrize(
  "kind",
  [
    pytest.param("none", marks=pytest.mark.exhaustive),
    pytest.param("causal_empty_rows", marks=pytest.mark.exhaustive),
    "lengths_empty_rows",
    "combined",
  ],
)
def test_check_grads_float64(kind, x64):
  args = _inputs(jnp.float64)
  for backward in ("custom_vjp", "autodiff"):
    # Jitted: check_grads' evaluations reuse one program instead of running each operation.
    check_grads(jax.jit(_ours(MASKS[kind], backward)), args, order=1, modes=["rev"])


# The default run keeps the learned table (relative) and the soft cap; the other score
# functions are exhaustive (test_blockwise's sweep runs each by default).
@pytest.mark.parametrize(
  "name",
  [
    n if n in ("relative", "soft_cap") else pytest.param(n, marks=pytest.mark.exhaustive)
    for n in SCORE_FNS
  ],
)
def test_both_rules_with_score_fns(name, x64):
  fn = score_fn_in(SCORE_FNS[name], jnp.float64)
  _assert_rules_match_formula(_both_rules_and_formula(masks.causal(1), fn))


def test_check_grads_float64_learned_score_fn(x64):
  fn = score_fn_in(SCORE_FNS["relative"], jnp.float64)
  f = jax.jit(_ours(masks.causal(), "custom_vjp", fn))
  check_grads(f, _inputs(jnp.float64), order=1, modes=["rev"])


def test_check_grads_float64_dropout_and_soft_cap(x64):
  f = _ours(
    masks.sliding_window(2, 0),
    "custom_vjp",
    dropout_rate=0.3,
    dropout_rng=jax.random.key(2),
    logits_soft_cap=3.0,
  )
  check_grads(jax.jit(f), _inputs(jnp.float64), order=1, modes=["rev"])


def test_check_grads_float64_mqa_unbatched(x64):
  q, k, v, _ = _inputs(jnp.float64)

  def f(q, k, v):
    return jattn.dot_product_attention(
      q[0], k[0, :, :1], v[0, :, :1], is_causal=True, backward="custom_vjp"
    )

  check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"])


def test_backward_rules_agree_in_bfloat16():
  args = _inputs(jnp.bfloat16)
  mask = masks.causal() & masks.segments(
    np.array([[0, 0, 1, 1]] * 2), np.array([[0, 0, 1, 1, 1]] * 2)
  )
  got = _grads(_ours(mask, "custom_vjp"), args)
  want = _grads(_ours(mask, "autodiff"), args)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    assert_close(a, b, jnp.bfloat16, factor=2)


def test_autodiff_rule_supports_forward_mode(x64):
  args = _inputs(jnp.float64)
  f = _ours(
    masks.causal() & masks.segments(IDS_Q, IDS_KV), "autodiff", score_fn=SCORE_FNS["relative"]
  )
  # Jitted: check_grads' many second-order evaluations reuse compiled programs instead of
  # dispatching every operation of every derivative eagerly.
  check_grads(jax.jit(f), args, order=2, modes=["fwd", "rev"])
