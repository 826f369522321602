"""Adversarial inputs: extreme but legal values, masks that empty rows every way, odd tiles.

Every rule is checked against a float64 NumPy reference of jattn's numerics contract
(``experiments.accuracy.attention_reference``) and, where jax.nn's semantics are the
same, against jax.nn's own error on the same inputs. The contract:

* every finite score takes part in the softmax, however negative (a row whose bias is
  float32.min everywhere gives mean(v), as jax.nn does);
* positions masked by a mask mechanism, or whose score is -inf, are excluded;
* a row with nothing left returns zeros, log-sum-exp -inf and zero gradients; nothing is
  ever NaN, forward or backward.

Shapes come from a few fixed choices so that compiled functions are reused across
examples (jattn's jit caches by shape and static arguments).

tests/test_adversarial_paths.py draws the paths a call can take (ring pair kernels, input
placements, kernels' refusals, empty dimensions) the same way.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from reference import array

import jattn
from experiments.accuracy import attention_reference, max_abs_error

F32_MIN = float(np.finfo(np.float32).min)

# (B, T, S, N, K, H): T > S (causal and windows leave late rows empty), T < S with GQA, T == S.
SHAPES = [(2, 7, 5, 2, 1, 4), (1, 5, 9, 4, 2, 3), (2, 6, 6, 2, 2, 4)]
MAGNITUDES = [1e-20, 1e-6, 1e-2, 1.0, 10.0, 1e2, 1e3, 1e4]
LARGE_NEGATIVE = [-1e9, -1e30, -3e38, F32_MIN, -np.inf]
RULE_NAMES = ["xla/autodiff", "xla/custom_vjp", "blockwise", "blockwise/default", "default"]
# No shrinking: every shrink step compiles anew; a failing example is printed as drawn.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


@st.composite
def rules(draw, T, S):
  """Keyword arguments of one rule; blockwise tiles anywhere from 1 to one past the length."""
  name = draw(st.sampled_from(RULE_NAMES))
  return name, {
    "xla/autodiff": dict(implementation="xla", backward="autodiff"),
    "xla/custom_vjp": dict(implementation="xla", backward="custom_vjp"),
    "blockwise": dict(
      implementation="blockwise",
      block_q=draw(st.integers(1, T + 1)),
      block_kv=draw(st.integers(1, S + 1)),
    ),
    "blockwise/default": dict(implementation="blockwise"),
    "default": dict(),
  }[name]


def _vjp_arrays(fn, q, k, v, bias, ct):
  primals = (q, k, v) + ((bias,) if bias is not None else ())
  f = lambda q, k, v, *b: fn(q, k, v, b[0] if b else None)
  out, vjp, lse = jax.vjp(f, *primals, has_aux=True)
  grads = vjp(ct)
  result = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
  if bias is not None:
    result["dbias"] = grads[3]
  return result


def _numpy(result):
  return {n: np.asarray(np.asarray(x, np.float32), np.float64) for n, x in result.items()}


def _vjp(fn, q, k, v, bias, ct):
  """out, lse and the gradients of sum(out * ct) (dbias too when there is a bias), as one
  jitted program: eagerly, the forward and the backward each compiled a program of their
  own, and the operations between them one each. Arrays ``fn`` closes over (masks, lengths,
  ids) stay concrete constants, as in an eager call."""
  return _numpy(jax.jit(functools.partial(_vjp_arrays, fn))(q, k, v, bias, ct))


@functools.partial(jax.jit, static_argnames=("rule", "scale"))
def _jattn_and_jax_nn_vjp(q, k, v, bias, ct, rule, scale):
  """``_vjp`` of jattn's ``rule`` (its items, sorted) and of jax.nn (as experiments/accuracy.py's
  baseline) on the same inputs, as one jitted program: one compilation per example, not one
  per function (and eagerly, jax.nn compiled ~60 operations for each new combination)."""
  fn = lambda q, k, v, b: jax.nn.dot_product_attention(
    q, k, v, b, scale=scale, return_residual=True
  )
  return (
    _vjp_arrays(_jattn(dict(rule), scale=scale), q, k, v, bias, ct),
    _vjp_arrays(fn, q, k, v, bias, ct),
  )


def _jattn(rule, **kwargs):
  def fn(q, k, v, bias):
    return jattn.dot_product_attention(q, k, v, bias, return_residual=True, **rule, **kwargs)

  return fn


def _assert_no_nan(got, where=""):
  for name, x in got.items():
    assert not np.any(np.isnan(x)), f"{where}: NaN in {name}"
    if name != "lse":
      assert np.all(np.isfinite(x)), f"{where}: inf in {name}"
    else:
      assert not np.any(x == np.inf), f"{where}: +inf in lse"


def _arrays(rng, shape, dtype, scales=(1.0, 1.0, 1.0)):
  B, T, S, N, K, H = shape
  q = rng.standard_normal((B, T, N, H)) * scales[0]
  k = rng.standard_normal((B, S, K, H)) * scales[1]
  v = rng.standard_normal((B, S, K, H)) * scales[2]
  ct = rng.standard_normal((B, T, N, H))
  return tuple(array(np.asarray(x, np.float32), dtype) for x in (q, k, v, ct))


def _scores(q, k, bias, scale=None):
  """Float64 scaled logits plus bias, (B, N, T, S)."""
  q, k = (np.asarray(np.asarray(x, np.float32), np.float64) for x in (q, k))
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = scale * np.einsum("btnh,bsnh->bnts", q, k)
  if bias is not None:
    bias = np.asarray(bias, np.float64)
    s = s + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  return s


# --- extreme magnitudes and additive masks: jax.nn's semantics and jattn's agree ---------------


@st.composite
def settings_drawn(draw):
  """A shape, an input dtype (float32 twice as often as bfloat16) and a seeded generator."""
  shape = draw(st.sampled_from(SHAPES))
  dtype = draw(st.sampled_from([jnp.float32, jnp.float32, jnp.bfloat16]))
  return shape, dtype, np.random.default_rng(draw(st.integers(0, 2**16)))


@st.composite
def extreme_problems(draw):
  shape, dtype, rng = draw(settings_drawn())
  B, T, S, N, K, H = shape
  scales = tuple(draw(st.sampled_from(MAGNITUDES)) for _ in range(3))
  q, k, v, ct = _arrays(rng, shape, dtype, scales)
  bias_shape = draw(st.sampled_from([None, (B, N, T, S), (T, S), (1, N, 1, S)]))
  scale = draw(st.sampled_from([None, None, 1e-3, 1e3]))
  bias = None
  if bias_shape is not None:
    bias = rng.standard_normal(bias_shape) * draw(st.sampled_from([1.0, 1e3]))
    # Large negatives (-inf among them) on random positions, each row keeping one position.
    fill = rng.random(bias_shape) < draw(st.sampled_from([0.0, 0.3, 0.9]))
    np.put_along_axis(fill, rng.integers(0, bias_shape[-1], bias_shape[:-1] + (1,)), False, -1)
    bias = np.where(fill, rng.choice(LARGE_NEGATIVE, size=bias_shape), bias)
    if bias_shape[-2] == T and draw(st.booleans()):
      # Whole rows of one finite large negative: every score takes part, and the row is
      # uniform once the scores are absorbed. A row of -1e9 (float32 spacing 64 there) is
      # drawn only where the scores beside it stay well inside that spacing: otherwise its
      # softmax depends on how each implementation rounds (scale * q·k) + bias.
      logits = _scores(q, k, None, scale) + np.asarray(bias, np.float64)
      values = LARGE_NEGATIVE[:-1] if np.max(np.abs(logits)) < 16 else LARGE_NEGATIVE[1:-1]
      rows = rng.random(bias_shape[:-1]) < 0.3
      bias = np.where(rows[..., None], draw(st.sampled_from(values)), bias)
    bias = array(bias, jnp.float32)
  name, rule = draw(rules(T, S))
  return (q, k, v, bias, ct), scale, name, rule


def _rounding_floor(quantity, q, k, v, ct, scale):
  """The rounding every rule's gradients may carry beyond jax.nn's: about ε·|dY|·|v| in a
  row's dA, times scale·|k| in dq and scale·|q| in dk (found on a GPU: dq 5.6e-20 where the
  truth is 4e-150 and jax.nn's cancels to it). Blockwise once needed 2H times this, when it
  took Δ = rowsum(A ⊙ dA) as FlashAttention's rowsum(dY ⊙ Y) (dq 1.3e3 where the truth is 0,
  at scale 1e3 and |k| 2.6e3); it now sums Δ as jax.nn does."""
  top = lambda x: float(np.max(np.abs(np.asarray(x, np.float32))))
  B, T, N, _ = q.shape
  delta = float(jnp.finfo(jnp.float32).eps) * top(ct) * top(v)
  return {
    "dq": scale * top(k) * delta,
    "dk": scale * top(q) * T * N * delta,
    "dbias": B * N * T * delta,
  }.get(quantity, 0.0)


# The default run draws 8 examples, test_extreme_inputs_against_jax_nn_and_float64_more_draws 7
# more (exhaustive; its own name gives it its own derandomized draws).
@settings(max_examples=8, phases=NO_SHRINK)
@given(extreme_problems())
def test_extreme_inputs_against_jax_nn_and_float64(problem):
  _check_extreme_inputs_against_jax_nn_and_float64(problem)


@pytest.mark.exhaustive
@settings(max_examples=7, phases=NO_SHRINK)
@given(extreme_problems())
def test_extreme_inputs_against_jax_nn_and_float64_more_draws(problem):
  _check_extreme_inputs_against_jax_nn_and_float64(problem)


def _check_extreme_inputs_against_jax_nn_and_float64(problem):
  (q, k, v, bias, ct), scale, name, rule = problem
  H = q.shape[-1]
  scale_value = 1 / np.sqrt(H) if scale is None else scale
  got, base = map(
    _numpy, _jattn_and_jax_nn_vjp(q, k, v, bias, ct, tuple(sorted(rule.items())), scale)
  )
  _assert_no_nan(got, name)
  want = attention_reference(q, k, v, bias, ct, scale=scale_value, dtype=np.float64)
  for quantity, ref in want.items():
    err = max_abs_error(got[quantity], ref)
    err_jax_nn = max_abs_error(base[quantity], ref)
    size = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
    # Four times jax.nn's error, plus a sliver of the largest value: errors of rounding pass,
    # semantic ones (a wrong row, a lost mask, a NaN) do not. experiments/accuracy.py
    # holds precision to the tighter target on its cases.
    allowed = 4 * err_jax_nn + size * max(2**-17, 2 * float(jnp.finfo(q.dtype).eps))
    allowed += _rounding_floor(quantity, q, k, v, ct, scale_value)
    assert err <= allowed, (
      f"{name} {rule}: {quantity} error {err:.3g}, jax.nn's "
      f"{err_jax_nn:.3g}, allowed {allowed:.3g} (largest |value| "
      f"{size:.3g})"
    )


# --- rows with nothing to attend to, by every mechanism ---------------------------------------


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Four segment ids; the last is one no key has.
ID_PALETTES = [
  (0, 1, 2, 7),
  (INT32_MIN, INT32_MAX, INT32_MAX - 1, INT32_MIN + 1),
  (INT32_MAX, -5, INT32_MIN, 0),
]

MECHANISMS = [
  "bool_mask",
  "causal_q_lengths",
  "kv_lengths",
  "segments",
  "window",
  "inf_bias",
  "min_bias",
]


@st.composite
def masked_problems(draw):
  shape, dtype, rng = draw(settings_drawn())
  B, T, S, N, K, H = shape
  q, k, v, ct = _arrays(rng, shape, dtype, (draw(st.sampled_from([1.0, 3.0])),) * 2 + (1.0,))
  used = draw(st.lists(st.sampled_from(MECHANISMS), min_size=1, max_size=3, unique=True))
  qi, ki = np.arange(T)[:, None], np.arange(S)[None]
  allowed = np.ones((B, 1, T, S), bool)
  kwargs, bias = {}, None
  lengths = lambda n: rng.choice([0, n, *range(n + 1)], size=B).astype(np.int32)
  if "bool_mask" in used:
    mask = rng.random((B, 1, T, S)) < 0.7
    mask[:, :, rng.random(T) < 0.3] = False  # whole rows
    kwargs["mask"] = array(mask)
    allowed &= mask
  if "causal_q_lengths" in used:
    q_lens = lengths(T)
    kwargs.update(is_causal=True, query_seq_lengths=array(q_lens))
    allowed &= (ki <= qi) & (qi < q_lens[:, None, None, None])
  if "kv_lengths" in used:
    kv_lens = lengths(S)
    kwargs["key_value_seq_lengths"] = array(kv_lens)
    allowed &= ki < kv_lens[:, None, None, None]
  if "segments" in used:
    q_ids = rng.integers(0, 3, size=(B, T))
    q_ids[rng.random((B, T)) < 0.3] = 3  # an id no key has: those rows see nothing
    kv_ids = rng.integers(0, 3, size=(B, S))
    # Any int32 id is legal: small ones, and ones at int32's ends, where an id one below the
    # smallest (a padding id) would wrap onto a real one.
    palette = np.asarray(draw(st.sampled_from(ID_PALETTES)), np.int64)
    q_ids, kv_ids = palette[q_ids], palette[kv_ids]
    kwargs["segment_ids"] = (array(q_ids, jnp.int32), array(kv_ids, jnp.int32))
    allowed &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  if "window" in used:
    left, right = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    kwargs["local_window_size"] = (left, right)  # rows past S + left see nothing when T > S
    allowed &= (ki >= qi - left) & (ki <= qi + right)
  if "inf_bias" in used or "min_bias" in used:
    bias = rng.standard_normal((B, N, T, S)).astype(np.float32)
    rows = rng.random((B, N, T)) < 0.4
    if "inf_bias" in used:
      bias[rng.random((B, N, T, S)) < 0.3] = -np.inf
      bias[rows] = -np.inf
    if "min_bias" in used:  # float32.min takes part: such a row averages what it may see
      rows = ~rows if "inf_bias" in used else rows
      bias[rows & (rng.random((B, N, T)) < 0.5)] = F32_MIN
    bias = array(bias)
  name, rule = draw(rules(T, S))
  return (q, k, v, bias, ct), allowed, kwargs, used, name, rule


_jax_nn_masked = jax.jit(jax.nn.dot_product_attention)  # one program per shape and dtype


# The default run draws 5 examples, test_rows_with_nothing_to_attend_to_more_draws 10 more
# (exhaustive; its own name gives it its own derandomized draws).
@settings(max_examples=5, phases=NO_SHRINK)
@given(masked_problems())
def test_rows_with_nothing_to_attend_to(problem):
  _check_rows_with_nothing_to_attend_to(problem)


@pytest.mark.exhaustive
@settings(max_examples=10, phases=NO_SHRINK)
@given(masked_problems())
def test_rows_with_nothing_to_attend_to_more_draws(problem):
  _check_rows_with_nothing_to_attend_to(problem)


def _check_rows_with_nothing_to_attend_to(problem):
  (q, k, v, bias, ct), allowed, kwargs, used, name, rule = problem
  where = f"{name} {rule} {used}"
  got = _vjp(_jattn(rule, **kwargs), q, k, v, bias, ct)
  _assert_no_nan(got, where)
  want = attention_reference(
    q, k, v, bias, ct, scale=1 / np.sqrt(q.shape[-1]), allowed=allowed, dtype=np.float64
  )
  # Rows with nothing left: exactly zeros, lse -inf, no gradient to q or to their bias.
  empty = np.isneginf(want["lse"])  # (B, T, N)
  assert np.all(got["out"][empty] == 0), f"{where}: empty rows are not zeros"
  assert np.all(np.isneginf(got["lse"][empty])), f"{where}: empty rows' lse is not -inf"
  # The log-sum-exp comes back in the query's dtype: a row biased by float32.min attends (to
  # every position alike) but its lse, about -3.4e38, rounds to -inf in bfloat16, as jax.nn's.
  want["lse"] = np.asarray(jnp.asarray(want["lse"], jnp.float32).astype(q.dtype), np.float64)
  representable = ~empty & np.isfinite(want["lse"])
  assert np.all(np.isfinite(got["lse"][representable])), f"{where}: lse of rows that attend"
  assert np.all(got["dq"][empty] == 0), f"{where}: empty rows have a gradient"
  if bias is not None:
    assert np.all(got["dbias"].transpose(0, 2, 1, 3)[empty] == 0), where
  tol = 2e-5 if q.dtype == jnp.float32 else 2e-2
  for quantity, ref in want.items():
    size = max(1.0, float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0)))
    err = max_abs_error(got[quantity], ref)
    assert err <= tol * size, f"{where}: {quantity} error {err:.3g} (largest |value| {size:.3g})"
  # jax.nn, given the same positions as a boolean mask, agrees on rows that attend to some
  # position whose score is far above its large negative; elsewhere its semantics differ.
  jax_nn = _jax_nn_masked(q, k, v, bias, array(allowed))
  same = np.any(allowed & (_scores(q, k, bias) > -1e37), axis=-1).transpose(0, 2, 1)
  np.testing.assert_allclose(
    np.asarray(jax_nn, np.float64)[same],
    want["out"][same],
    atol=tol * max(1.0, np.max(np.abs(want["out"]), initial=0.0)),
    err_msg="jax.nn on rows where its semantics agree (harness check)",
  )
  np.testing.assert_allclose(
    got["out"][same],
    np.asarray(jax_nn, np.float64)[same],
    atol=tol * max(1.0, np.max(np.abs(want["out"]), initial=0.0)),
    err_msg=f"{where}: against jax.nn",
  )


# --- float32.min rows: every finite score takes part, continuously -----------------------------


RULES = {
  "xla/autodiff": dict(implementation="xla", backward="autodiff"),
  "xla/custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=3, block_kv=2),
  "blockwise/default": dict(implementation="blockwise"),
  "default": dict(),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_float32_min_bias_rows_average_the_values(rule):
  """A row biased by c everywhere softmaxes the same scores shifted by c: as c goes to
  float32.min its weights become uniform (the scores are absorbed), so the output goes to
  mean(v) continuously, as in jax.nn; a row of -inf and float32.min averages the finite ones."""
  B, T, S, N, K, H = 2, 6, 5, 2, 1, 4
  q, k, v, ct = _arrays(np.random.default_rng(3), (B, T, S, N, K, H), jnp.float32)
  bias = np.zeros((B, N, T, S), np.float32)
  for t, c in enumerate([-1e30, -1e37, -3e38, F32_MIN]):
    bias[:, :, t] = c
  bias[:, :, 4, :2] = -np.inf
  bias[:, :, 4, 2:] = F32_MIN
  bias = array(bias)
  got = _vjp(_jattn(RULES[rule]), q, k, v, bias, ct)
  _assert_no_nan(got, rule)
  want = attention_reference(q, k, v, bias, ct, scale=0.5, dtype=np.float64)
  mean_v = np.asarray(v, np.float64).mean(1)  # (B, K, H); K = 1
  np.testing.assert_allclose(
    want["out"][:, :4],
    np.broadcast_to(mean_v[:, None], (B, 4, N, H)),
    rtol=1e-12,
    err_msg="reference",
  )
  np.testing.assert_allclose(got["out"], want["out"], atol=1e-5, err_msg=f"{rule}: out")
  jax_nn = _jax_nn_masked(q, k, v, bias)  # jitted: one program, shared by the rules
  np.testing.assert_allclose(
    got["out"][:, :4], np.asarray(jax_nn)[:, :4], atol=1e-5, err_msg=f"{rule}: against jax.nn"
  )
  for quantity in ("dq", "dk", "dv", "dbias"):
    np.testing.assert_allclose(
      got[quantity], want[quantity], atol=1e-5, err_msg=f"{rule}: {quantity}"
    )
  np.testing.assert_allclose(got["lse"][:, 5], want["lse"][:, 5], rtol=1e-6)


# --- empty dimensions ------------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize(
  "shape", [(0, 4, 3, 2, 1, 4), (2, 0, 3, 2, 1, 4), (2, 4, 0, 2, 1, 4)], ids=["B=0", "T=0", "S=0"]
)
def test_empty_dimensions(shape, rule):
  q, k, v, ct = _arrays(np.random.default_rng(0), shape, jnp.float32)
  B, T, S, N, K, H = shape
  bias = jnp.ones((1, N, T, S))
  got = _vjp(_jattn(RULES[rule], is_causal=True), q, k, v, bias, ct)
  _assert_no_nan(got, rule)
  assert got["out"].shape == (B, T, N, H) and got["lse"].shape == (B, T, N)
  assert got["dk"].shape == (B, S, K, H) and got["dbias"].shape == (1, N, T, S)
  want = attention_reference(
    q, k, v, bias, ct, scale=0.5, allowed=np.tril(np.ones((T, S), bool)), dtype=np.float64
  )
  for quantity, ref in want.items():
    assert max_abs_error(got[quantity], ref) == 0, quantity


# --- segment ids anywhere in int32, every implementation -------------------------------------


def _ring(**kw):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ring",))

  def fn(q, k, v, bias, segment_ids, **rest):
    assert bias is None
    return jattn.parallel.ring_attention(
      q, k, v, mesh=mesh, axis_name="ring", segment_ids=segment_ids, **kw, **rest
    )

  return fn


EVERY_IMPLEMENTATION = {
  **{name: functools.partial(jattn.dot_product_attention, **rule) for name, rule in RULES.items()},
  "splash": functools.partial(jattn.dot_product_attention, implementation="splash"),
  "ring/blockwise": _ring(implementation="blockwise"),  # ring/splash: splash's ids, per pair
}


# The default run keeps xla's rules, the default and splash (whose padding id once wrapped);
# blockwise's cases are exhaustive (its ids reach the tiles as xla's reach the scores; the
# default at these shapes is one tile of blockwise's), and so is the ring's (test_parallel.py
# moves segment ids around a ring by default).
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.exhaustive) if n.startswith(("ring", "blockwise")) else n
    for n in EVERY_IMPLEMENTATION
  ],
)
def test_segment_ids_at_both_ends_of_int32_every_implementation(name):
  """Ids are only compared, so any int32 id must work; a padding id below the smallest one
  (splash pads to whole blocks) once wrapped onto a real id at int32's minimum."""
  B, T, S, N, K, H = 2, 12, 12, 2, 1, 8
  q, k, v, ct = _arrays(np.random.default_rng(5), (B, T, S, N, K, H), jnp.float32)
  ids = np.array([[INT32_MIN] * 5 + [INT32_MAX - 1] * 7, [INT32_MAX] * 6 + [INT32_MIN + 1] * 6])
  segment_ids = array(ids, jnp.int32)
  kw = dict(segment_ids=segment_ids, is_causal=True)
  if not name.startswith("ring"):
    kw["key_value_seq_lengths"] = array([10, 7])  # lengths join the ids in splash
  fn = lambda q, k, v, bias: EVERY_IMPLEMENTATION[name](q, k, v, bias, return_residual=True, **kw)
  with jattn.testing.interpret_kernels():
    got = _vjp(fn, q, k, v, None, ct)
  allowed = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((T, S), bool))
  if "key_value_seq_lengths" in kw:
    allowed &= np.arange(S) < np.array([10, 7])[:, None, None]
  want = attention_reference(
    q, k, v, None, ct, scale=1 / np.sqrt(H), allowed=allowed[:, None], dtype=np.float64
  )
  _assert_no_nan(got, name)
  for quantity, ref in want.items():
    if quantity == "dbias":
      continue
    size = max(1.0, float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0)))
    err = max_abs_error(got[quantity], ref)
    assert err <= 2e-5 * size, f"{name}: {quantity} error {err:.3g}"


# --- caches that run out under jit: dropped tokens' queries return zeros ----------------------


@st.composite
def short_caches(draw):
  """A prompt batch written into a cache too small for it under jit: a page pool with fewer
  pages than the prompts need, or rows shorter than the prompts; the cache built inside or
  outside the jitted step, float32 or int8."""
  B, t, N, K, H = 2, 6, 2, 1, 4
  num_new = np.array([draw(st.integers(1, t)) for _ in range(B)])
  paged = draw(st.booleans())
  page_size = draw(st.sampled_from([1, 2, 4]))
  if paged:
    need = -(-num_new // page_size)  # pages per row
    pool = draw(st.integers(0, int(need.sum()) - 1)) if need.sum() > 0 else 0
    pool = max(pool, 1)
    got = np.minimum(need, np.maximum(pool - np.concatenate([[0], np.cumsum(need)[:-1]]), 0))
    kept = np.minimum(num_new, got * page_size)  # pages in batch order, ascending
    make = lambda: jattn.decode.init_paged(
      pool, page_size, B, -(-t // page_size), K, H, dtype=dtype
    )
    pre = 0
  else:  # rows already holding `pre` tokens, so the prompts overflow max_length
    max_length = draw(st.integers(t, t + 3))
    pre = draw(st.integers(1, max_length))
    kept = np.minimum(num_new, max_length - pre)
    make = lambda: jattn.decode.init(B, max_length, K, H, dtype=dtype)
  dtype = draw(st.sampled_from([jnp.float32, jnp.int8]))
  inside = draw(st.booleans())
  seed = draw(st.integers(0, 2**16))
  return (B, t, N, K, H), pre, num_new, kept, make, inside, dtype, seed


# The default run draws 3 examples, test_tokens_dropped_under_jit_return_zeros_more_draws 5
# more (exhaustive).
@settings(max_examples=3, phases=NO_SHRINK)
@given(short_caches())
def test_tokens_dropped_under_jit_return_zeros(problem):
  _check_tokens_dropped_under_jit_return_zeros(problem)


@pytest.mark.exhaustive
@settings(max_examples=5, phases=NO_SHRINK)
@given(short_caches())
def test_tokens_dropped_under_jit_return_zeros_more_draws(problem):
  _check_tokens_dropped_under_jit_return_zeros(problem)


def _check_tokens_dropped_under_jit_return_zeros(problem):
  (B, t, N, K, H), pre, num_new, kept, make, inside, dtype, seed = problem
  rng = np.random.default_rng(seed)
  q, k, v, ct = (  # NumPy: slicing jax.Arrays row by row below would compile each slice
    np.asarray(rng.standard_normal(shape), np.float32)
    for shape in ((B, t, N, H), (B, pre + t, K, H), (B, pre + t, K, H), (B, t, N, H))
  )

  def step(q, k, v, cache, num_new):
    cache = make() if cache is None else cache
    if pre:  # earlier tokens, written eagerly or inside the step
      cache = jattn.decode.update(cache, k[:, :pre], v[:, :pre])
    out, cache = jattn.decode.attention(q, k[:, pre:], v[:, pre:], cache, num_new=num_new)
    return jnp.sum(out * ct), (out, cache.lengths)

  cache = None if inside else make()
  (_, (out, lengths)), dq = jax.jit(jax.value_and_grad(step, has_aux=True))(
    q, k, v, cache, array(num_new)
  )
  out, lengths, dq = np.asarray(out), np.asarray(lengths), np.asarray(dq)
  where = (
    f"{pre} held, kept {kept.tolist()} of {num_new.tolist()}, {np.dtype(dtype).name}, "
    f"inside={inside}"
  )
  np.testing.assert_array_equal(lengths, pre + kept, err_msg=where)
  for b in range(B):
    n = int(kept[b])
    assert not np.asarray(out[b, n:]).any(), f"{where}: dropped rows are not zeros"
    assert not np.asarray(dq[b, n:]).any(), f"{where}: dropped rows have a gradient"
    if n == 0:
      continue
    want = attention_reference(
      q[b : b + 1, :n],
      k[b : b + 1, : pre + n],
      v[b : b + 1, : pre + n],
      None,
      ct[b : b + 1, :n],
      scale=1 / np.sqrt(H),
      allowed=np.tril(np.ones((n, pre + n), bool), k=pre),
      dtype=np.float64,
    )
    tol = 2e-5 if dtype == jnp.float32 else 5e-2  # int8 rounds keys and values
    for got, ref in ((out[b, :n], want["out"][0]), (dq[b, :n], want["dq"][0])):
      err = max_abs_error(np.asarray(got, np.float64), ref)
      assert err <= tol * max(1.0, np.max(np.abs(ref))), f"{where}: error {err:.3g}"


# --- derivatives of every order, every rule --------------------------------------------------


@functools.partial(jax.jit, static_argnames=("rule", "order"))
def _second_derivative(q, k, v, ct, rule, order):
  """One jitted program (eagerly, each operation of each order compiles alone), shared by the
  examples of a shape, rule and order (a closure per example compiled each anew)."""
  loss = lambda q: jnp.sum(jattn.dot_product_attention(q, k, v, is_causal=True, **dict(rule)) * ct)
  if order == "grad_of_grad":
    return jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)
  return jax.jvp(jax.grad(lambda q: loss(q) ** 2), (q,), (ct,))[1]


SECOND_DERIVATIVES = (
  st.sampled_from(SHAPES),
  st.sampled_from(["grad_of_grad", "hessian_vector"]),
  st.sampled_from(RULE_NAMES + ["splash"]),
  st.integers(0, 2**16),
)


# The default run draws 3 examples, test_second_derivatives_more_draws 5 more (exhaustive).
@settings(max_examples=3, phases=NO_SHRINK)
@given(*SECOND_DERIVATIVES)
def test_second_derivatives_match_autodiff_or_name_the_rule(shape, order, name, seed):
  """Each rule either gives autodiff's second derivative or raises jattn's ValueError naming
  itself and the way out (docs/backward.md's table), never JAX's message about its internals."""
  _check_second_derivatives(shape, order, name, seed)


@pytest.mark.exhaustive
@settings(max_examples=5, phases=NO_SHRINK)
@given(*SECOND_DERIVATIVES)
def test_second_derivatives_more_draws(shape, order, name, seed):
  _check_second_derivatives(shape, order, name, seed)


def _check_second_derivatives(shape, order, name, seed):
  B, T, S, N, K, H = shape
  q, k, v, ct = _arrays(np.random.default_rng(seed), shape, jnp.float32)
  rule = dict(implementation="splash") if name == "splash" else RULES[name]

  f = lambda rule: functools.partial(
    _second_derivative, k=k, v=v, ct=ct, rule=tuple(sorted(rule.items())), order=order
  )

  want = f(dict(implementation="xla", backward="autodiff"))(q)
  supported = {
    "grad_of_grad": ("xla/autodiff", "xla/custom_vjp", "default"),  # default: xla at this size
    "hessian_vector": (
      "xla/autodiff",
      "xla/custom_vjp",
      "default",
      "blockwise",
      "blockwise/default",
    ),
  }[order]
  with jattn.testing.interpret_kernels():
    if name not in supported:
      with pytest.raises(ValueError, match=r"gives first-order gradients.*implementation='xla'"):
        f(rule)(q)
      return
    got = f(rule)(q)
  size = max(1.0, float(np.max(np.abs(np.asarray(want)))))
  err = max_abs_error(np.asarray(got, np.float64), np.asarray(want, np.float64))
  assert err <= 1e-4 * size, f"{name} {order}: error {err:.3g} (largest |value| {size:.3g})"
