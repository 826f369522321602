"""jattn.hopfield and jattn.nnx.HopfieldLayer against float64 NumPy formulas, plain jnp autodiff
and the properties of modern Hopfield networks: retrieval at large β, averages at small β, an
energy that never increases."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads
from reference import array, assert_close, normal

import jattn.nnx
from jattn import hopfield

M, D = 5, 8  # stored patterns, feature size
BETA = 0.9


def retrieve_np(queries, patterns, beta, steps):
  """ξ ← softmax(β ξ Xᵀ) X, ``steps`` times, in float64 from the formula."""
  xi, x = np.asarray(queries, np.float64), np.asarray(patterns, np.float64)
  for _ in range(steps):
    s = beta * np.einsum("...d,md->...m", xi, x)
    p = np.exp(s - s.max(-1, keepdims=True))
    xi = np.einsum("...m,md->...d", p / p.sum(-1, keepdims=True), x)
  return xi


def energy_np(queries, patterns, beta):
  """E(ξ) = −β⁻¹ lse(β Xξ) + ½ ξᵀξ + β⁻¹ log M + ½ maxᵢ ‖xᵢ‖², in float64."""
  xi, x = np.asarray(queries, np.float64), np.asarray(patterns, np.float64)
  s = beta * np.einsum("...d,md->...m", xi, x)
  m = s.max(-1)
  lse = m + np.log(np.exp(s - m[..., None]).sum(-1))
  return -lse / beta + 0.5 * (xi * xi).sum(-1) + np.log(len(x)) / beta + 0.5 * (x * x).sum(-1).max()


def retrieve_jnp(queries, patterns, beta, steps):
  """The same update in plain jnp, for jax.grad."""
  for _ in range(steps):
    queries = jnp.einsum(
      "...m,md->...d",
      jax.nn.softmax(beta * jnp.einsum("...d,md->...m", queries, patterns), axis=-1),
      patterns,
    )
  return queries


# --- values --------------------------------------------------------------------------------


# Query shapes: a single (d,) query, a batch, and two leading axes (the shape the gradient
# tests share, so its forward pass compiles once).
@pytest.mark.parametrize(
  "shape, steps", [((D,), 1), ((D,), 3), ((3, D), 1), ((2, 3, D), 1), ((2, 3, D), 3)]
)
def test_retrieve_matches_formula(shape, steps):
  q, x = normal(shape, seed=1), normal((M, D), seed=2)
  out = hopfield.retrieve(q, x, beta=BETA, steps=steps)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, retrieve_np(q, x, BETA, steps), factor=2)


def test_retrieve_bfloat16_keeps_dtype():
  q, x = normal((3, D), jnp.bfloat16, seed=1), normal((M, D), jnp.bfloat16, seed=2)
  out = hopfield.retrieve(q, x, beta=BETA)
  assert out.dtype == jnp.bfloat16
  assert_close(out, retrieve_np(q, x, BETA, 1))


def test_retrieve_empty_query_axis():
  out = hopfield.retrieve(jnp.zeros((0, D)), normal((M, D)), beta=BETA)
  assert out.shape == (0, D)


def test_energy_matches_formula():
  q, x = normal((2, 3, D), seed=1), normal((M, D), seed=2)
  e = hopfield.energy(q, x, beta=BETA)
  assert e.shape == (2, 3) and e.dtype == jnp.float32
  assert_close(e, energy_np(q, x, BETA))
  assert hopfield.energy(q[0, 0], x, beta=BETA).shape == ()


def test_huge_beta_stays_finite():
  q, x = 10 * normal((3, D), seed=1), 10 * normal((M, D), seed=2)
  out = hopfield.retrieve(q, x, beta=1e6, steps=2)
  grads = _grads(lambda q, x: hopfield.retrieve(q, x, beta=1e6, steps=2), q, x)
  assert all(np.isfinite(a).all() for a in (out, *grads, hopfield.energy(q, x, beta=1e6)))


def test_retrieve_under_jit():
  q, x = normal((3, D), seed=1), normal((M, D), seed=2)
  f = jax.jit(lambda q, x: hopfield.retrieve(q, x, beta=BETA, steps=2))
  assert_close(f(q, x), retrieve_np(q, x, BETA, 2), factor=2)


# --- gradients ------------------------------------------------------------------------------


def _grads(f, *args):
  """Gradients of sum(f(...) * w) with respect to every argument, w a fixed random cotangent."""
  w = normal(jax.eval_shape(f, *args).shape, seed=9)
  return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), tuple(range(len(args)))))(*args)


@pytest.mark.parametrize("steps", [1, 3])
def test_gradients_match_plain_jnp(steps):
  q, x = normal((2, 3, D), seed=1), normal((M, D), seed=2)
  ours = _grads(lambda q, x: hopfield.retrieve(q, x, beta=BETA, steps=steps), q, x)
  want = _grads(lambda q, x: retrieve_jnp(q, x, BETA, steps), q, x)
  for a, b in zip(ours, want):
    assert_close(a, b, factor=5)


def test_check_grads_float64(x64):
  q, x = normal((3, D), np.float64, seed=1), normal((M, D), np.float64, seed=2)
  f = jax.jit(lambda q, x: hopfield.retrieve(q, x, beta=0.7, steps=2))  # one program for all
  check_grads(f, (q, x), order=1, modes=["rev"])


# --- what β does ----------------------------------------------------------------------------


def _memories(num=16, dim=32, copies=2, noise=0.4, seed=0):
  """Unit-norm stored patterns and noisy queries (noise of norm ``noise``) made from them."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num, dim))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  source = np.repeat(np.arange(num), copies)
  n = rng.standard_normal((num * copies, dim))
  q = x[source] + noise * n / np.linalg.norm(n, axis=1, keepdims=True)
  # The setup is sound: each noisy query is still nearest to its own pattern.
  np.testing.assert_array_equal(np.argmax(q @ x.T, axis=1), source)
  return array(q, jnp.float32), array(x, jnp.float32), source


def test_large_beta_retrieves_the_nearest_pattern():
  q, x, source = _memories()
  out = np.asarray(hopfield.retrieve(q, x, beta=32.0))
  np.testing.assert_array_equal(np.argmax(out @ np.asarray(x).T, axis=1), source)
  assert np.linalg.norm(out - np.asarray(x)[source], axis=1).max() < 1e-3
  # Stored patterns are (nearly) fixed points.
  assert_close(hopfield.retrieve(x, x, beta=32.0, steps=3), x, factor=10)


def test_retrieval_error_falls_as_beta_grows():
  q, x, source = _memories()
  errors = [
    float(
      np.linalg.norm(
        np.asarray(hopfield.retrieve(q, x, beta=b)) - np.asarray(x)[source], axis=1
      ).mean()
    )
    for b in (0.5, 2.0, 8.0, 32.0)
  ]
  assert all(a > b for a, b in zip(errors, errors[1:])), errors
  assert errors[0] > 0.5 and errors[-1] < 1e-4, errors


def test_small_beta_gives_the_mean_pattern():
  q, x, _ = _memories()
  out = hopfield.retrieve(q, x, beta=1e-3)
  np.testing.assert_allclose(out, np.broadcast_to(np.asarray(x).mean(0), q.shape), atol=1e-3)


@pytest.mark.parametrize("beta", [0.3, 1.0, 4.0])
def test_energy_never_increases(beta):
  q, x = 3 * normal((6, D), seed=4), normal((M, D), seed=5)
  energies = [hopfield.energy(q, x, beta=beta)]
  for _ in range(5):
    q = hopfield.retrieve(q, x, beta=beta)
    energies.append(hopfield.energy(q, x, beta=beta))
  e = np.stack(energies)  # (steps + 1, queries)
  assert (np.diff(e, axis=0) <= 1e-5 * np.abs(e[:-1]).max()).all(), e
  assert (e[-1] < e[0] - 1e-2).all(), e  # the first updates do descend
  assert (e >= -1e-5).all(), e  # E is bounded below by 0


def test_docstring_examples_run():
  for obj in (hopfield, jattn.nnx.HopfieldLayer):
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder(recurse=False).find(obj):
      runner.run(test)
    assert runner.failures == 0 and runner.tries > 0, obj


# --- errors --------------------------------------------------------------------------------

Q, X = np.zeros((3, D), np.float32), np.zeros((M, D), np.float32)

# (id, overrides, exception, message fragment)
BAD_INPUTS = [
  ("queries_type", dict(queries="abc"), TypeError, r"queries must be an array, got str"),
  (
    "queries_int",
    dict(queries=Q.astype(np.int32)),
    TypeError,
    r"queries must have a floating dtype, got int32",
  ),
  (
    "patterns_int",
    dict(patterns=X.astype(np.int32)),
    TypeError,
    r"patterns must have a floating dtype, got int32",
  ),
  (
    "dtype_mismatch",
    dict(patterns=jnp.zeros((M, D), jnp.bfloat16)),
    TypeError,
    r"same dtype, got queries float32 and patterns bfloat16",
  ),
  (
    "patterns_rank3",
    dict(patterns=np.zeros((1, M, D), np.float32)),
    ValueError,
    r"patterns must have shape \(M, d\), one stored pattern per row, got \(1, 5, 8\)",
  ),
  (
    "patterns_rank1",
    dict(patterns=np.zeros((D,), np.float32)),
    ValueError,
    r"patterns must have shape \(M, d\)",
  ),
  (
    "no_patterns",
    dict(patterns=np.zeros((0, D), np.float32)),
    ValueError,
    r"at least one pattern \(M >= 1\), got shape \(0, 8\)",
  ),
  (
    "scalar_query",
    dict(queries=np.float32(1.0)),
    ValueError,
    r"queries must have shape \(\.\.\., d\)",
  ),
  (
    "features",
    dict(queries=np.zeros((3, D - 1), np.float32)),
    ValueError,
    r"same feature size d, got queries \(3, 7\) and patterns \(5, 8\)",
  ),
  ("beta_zero", dict(beta=0.0), ValueError, r"beta must be a positive finite number, got 0.0"),
  ("beta_negative", dict(beta=-1), ValueError, r"beta must be a positive finite number"),
  ("beta_inf", dict(beta=float("inf")), ValueError, r"positive finite number, got inf"),
  ("beta_nan", dict(beta=float("nan")), ValueError, r"positive finite number, got nan"),
  ("beta_str", dict(beta="1"), TypeError, r"beta must be a real number"),
  ("beta_bool", dict(beta=True), TypeError, r"beta must be a real number"),
  ("steps_zero", dict(steps=0), ValueError, r"steps must be >= 1, got 0"),
  ("steps_float", dict(steps=1.5), TypeError, r"steps must be an int, got 1.5"),
]


@pytest.mark.parametrize(
  "overrides, error, match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_retrieve_errors(overrides, error, match):
  args = dict(queries=Q, patterns=X, beta=1.0) | overrides
  with pytest.raises(error, match=match):
    hopfield.retrieve(args.pop("queries"), args.pop("patterns"), **args)


@pytest.mark.parametrize(
  "overrides, error, match",
  [c[1:] for c in BAD_INPUTS if "steps" not in c[0]],
  ids=[c[0] for c in BAD_INPUTS if "steps" not in c[0]],
)
def test_energy_errors(overrides, error, match):
  args = dict(queries=Q, patterns=X, beta=1.0) | overrides
  with pytest.raises(error, match=match):
    hopfield.energy(args.pop("queries"), args.pop("patterns"), **args)


def test_traced_beta_is_an_error():
  with pytest.raises(TypeError, match="beta must be a concrete Python or NumPy number"):
    jax.jit(lambda q, b: hopfield.retrieve(q, X, beta=b))(Q, 1.0)


# --- jattn.nnx.HopfieldLayer ------------------------------------------------------------------


def _numpy_init(key, shape, dtype):
  """Standard normal patterns from NumPy: jax.random would compile for every new shape."""
  del key
  return normal(shape, dtype, seed=7)


def _layer(**kw):
  kw = dict(in_features=D, num_patterns=M, pattern_init=_numpy_init, rngs=nnx.Rngs(0)) | kw
  return jattn.nnx.HopfieldLayer(**kw)


def test_layer_default_init_is_standard_normal():
  # The docstring example's shape, so jax.random compiles once for both.
  patterns = jattn.nnx.HopfieldLayer(16, 32, rngs=nnx.Rngs(0)).patterns[...]
  assert patterns.shape == (32, 16) and patterns.dtype == jnp.float32
  assert abs(float(patterns.mean())) < 0.2 and abs(float(patterns.std()) - 1) < 0.15


def test_layer_output_is_retrieval_from_its_patterns():
  layer = _layer(steps=2)
  x = normal((2, 3, D), seed=1)
  assert layer.patterns.shape == (M, D) and isinstance(layer.patterns, nnx.Param)
  assert layer.beta == pytest.approx(1 / np.sqrt(D))
  out = layer(x)
  assert_close(out, retrieve_np(x, layer.patterns[...], 1 / np.sqrt(D), 2), factor=2)
  assert_close(out, hopfield.retrieve(x, layer.patterns[...], beta=layer.beta, steps=2))
  assert_close(_layer(beta=3.0)(x[0, 0]), retrieve_np(x[0, 0], layer.patterns[...], 3.0, 1))


def test_layer_dtypes():
  x = normal((3, D), seed=1)
  assert _layer(param_dtype=jnp.bfloat16).patterns.dtype == jnp.bfloat16
  assert _layer(dtype=jnp.bfloat16)(x).dtype == jnp.bfloat16


def test_layer_gradients_reach_patterns():
  layer = _layer(steps=2)
  x, w = normal((4, D), seed=1), normal((4, D), seed=2)
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) * w)))(layer)
  want = jax.jit(jax.grad(lambda p: jnp.sum(retrieve_jnp(x, p, layer.beta, 2) * w)))(
    layer.patterns[...]
  )
  assert np.abs(want).max() > 1e-3
  assert_close(grads["patterns"][...], want, factor=5)


def test_layer_learns_to_map_inputs_to_targets():
  rng = np.random.default_rng(0)
  centers, targets = rng.standard_normal((2, 4, D))
  labels = np.arange(32) % 4
  x = array(centers[labels] + 0.1 * rng.standard_normal((32, D)), jnp.float32)
  y = array(targets[labels], jnp.float32)
  layer = _layer(num_patterns=4, beta=2.0)
  optimizer = nnx.Optimizer(layer, optax.adam(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(layer, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(layer)
    optimizer.update(layer, grads)
    return loss

  losses = [float(step(layer, optimizer)) for _ in range(40)]
  assert losses[-1] < 0.25 * losses[0], losses


def test_layer_under_nnx_jit():
  layer = _layer()
  x = normal((2, 3, D), seed=1)
  assert_close(nnx.jit(lambda m, x: m(x))(layer, x), layer(x))


CONSTRUCTOR_ERRORS = [
  (dict(in_features=0), ValueError, r"in_features must be >= 1, got 0"),
  (dict(num_patterns=0), ValueError, r"num_patterns must be >= 1, got 0"),
  (dict(num_patterns=2.5), TypeError, r"num_patterns must be an int"),
  (dict(beta=0.0), ValueError, r"beta must be a positive finite number, got 0.0"),
  (dict(beta="big"), TypeError, r"beta must be a real number"),
  (dict(steps=0), ValueError, r"steps must be >= 1, got 0"),
  (dict(pattern_init="normal"), TypeError, r"pattern_init must be an initializer"),
]


@pytest.mark.parametrize("kwargs, error, match", CONSTRUCTOR_ERRORS)
def test_layer_constructor_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    _layer(**kwargs)


@pytest.mark.parametrize(
  "inputs, error, match",
  [
    (
      np.zeros((2, D + 1), np.float32),
      ValueError,
      r"inputs must have 8 features in its last dimension, got shape \(2, 9\)",
    ),
    (np.float32(1.0), ValueError, r"inputs must have 8 features"),
    ([[0.0] * D], TypeError, r"inputs must be an array, got list"),
  ],
)
def test_layer_call_errors(inputs, error, match):
  with pytest.raises(error, match=match):
    _layer()(inputs)
