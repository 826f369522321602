"""NumPy evaluation of integer and boolean jaxprs (jattn._jaxpr_numpy), bit for bit against
XLA's compiled result, and _eager.evaluate's fallback to compiling what it cannot evaluate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jattn import _eager, _jaxpr_numpy, masks

I32 = np.iinfo(np.int32)
# Every pair of these: the wrap-around edges, signs, zero (divisors exclude it).
EDGES = np.array([I32.min, I32.min + 1, -7, -2, -1, 0, 1, 2, 3, 7, I32.max - 1, I32.max], np.int32)
X = EDGES[:, None] + np.zeros((1, EDGES.size), np.int32)
Y = EDGES[None, :] + np.zeros((EDGES.size, 1), np.int32)
NONZERO = np.where(Y == 0, 5, np.where(Y == -1, -3, Y))  # divisors XLA and NumPy agree on
IDS = np.array([[3, -1, 0, 9, -12, 2]], np.int32)

CASES = {
  "wrapping_arithmetic": (lambda x, y: (x + y, x - y, x * y, -x, abs(x), x**3), (X, Y)),
  "truncating_division": (lambda x, y: (lax.div(x, y), lax.rem(x, y), x // y, x % y), (X, NONZERO)),
  "sign_min_max_bits": (
    lambda x, y: (jnp.sign(x), jnp.minimum(x, y), jnp.maximum(x, y), x & y, x | y, x ^ y, ~x),
    (X, Y),
  ),
  "comparisons_and_logic": (
    lambda x, y: (x < y, x <= y, x > y, x >= y, x == y, x != y, (x < y) & (x > 0), ~(x < y)),
    (X, Y),
  ),
  "selects": (
    lambda x, y: (jnp.where(x < y, x, y), lax.select_n(jnp.clip(x, 0, 2), x, y, x * 2)),
    (X, Y),
  ),
  "conversions": (
    lambda x: (x.astype(jnp.int8), x.astype(jnp.uint8), x.astype(bool), (x > 0).astype(jnp.int32)),
    (X,),
  ),
  "shapes": (
    lambda x: (
      jnp.broadcast_to(x[:, :1], (2, 12, 12)),
      x.reshape(3, 48).T,
      jnp.expand_dims(x, 0).squeeze(0),
      jnp.concatenate([x, x[:2]], 0),
      lax.pad(x, np.int32(-9), [(2, -3, 1), (-1, 2, 0)]),
      x[1:11:3, ::-2],
      lax.iota(jnp.int32, 5)[None] + lax.broadcasted_iota(jnp.int32, (4, 5), 0),
    ),
    (X,),
  ),
  "reductions_and_scans": (
    lambda x: (
      jnp.min(x, 0),
      jnp.max(x, (0, 1)),
      jnp.all(x > -5, 1),
      jnp.any(x > 5, 0),
      jnp.sum(x, 1),
      jnp.cumsum(x, 1),
      lax.cumsum(x, 0, reverse=True),
      lax.cummax(x, 1),
      lax.cummin(x, 0, reverse=True),
    ),
    (X,),
  ),
  "gathers": (
    lambda x, i: (
      x[:, i[0]],  # negative ids wrap, the rest clamp
      jnp.take(x, i[0], axis=1, mode="clip"),
      jnp.take(x, i[0], axis=0, mode="fill"),
      jnp.take(x, i[0], axis=0, mode="fill", fill_value=-4),
      jnp.take_along_axis(x, jnp.abs(i[:, :4]) % 12 + jnp.zeros((12, 1), jnp.int32), axis=1),
      lax.dynamic_slice_in_dim(x, 2, 3, axis=0),
      jnp.take((x > 0)[0], i[0], mode="fill"),
    ),
    (X, IDS),
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_numpy_matches_xla_bit_for_bit(name):
  fn, args = CASES[name]
  closed = jax.make_jaxpr(fn)(*args)
  assert _jaxpr_numpy.supported(closed)
  got = _jaxpr_numpy.run(closed, *args)
  want = jax.tree.leaves(jax.jit(fn)(*args))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, np.asarray(w))


def test_int64_under_x64(x64):
  x = X.astype(np.int64) * np.int64(2**33)
  fn = lambda x: (x * 3 + 1, x // 7, jnp.cumsum(x, 0))  # noqa: E731
  closed = jax.make_jaxpr(fn)(x)
  assert closed.jaxpr.invars[0].aval.dtype == np.int64 and _jaxpr_numpy.supported(closed)
  for g, w in zip(_jaxpr_numpy.run(closed, x), jax.jit(fn)(x)):
    np.testing.assert_array_equal(g, np.asarray(w))


@pytest.mark.parametrize(
  "fn",
  [
    lambda x: x.astype(jnp.float32) * 0.5,  # a float value
    lambda x: jnp.sort(x, axis=1),  # a primitive without a rule
    lambda x: jax.debug.print("{}", x[0, 0]) or x,  # a side effect
  ],
  ids=["float", "sort", "effect"],
)
def test_what_numpy_does_not_evaluate_is_compiled(fn, capfd):
  closed = jax.make_jaxpr(fn)(X)
  assert not (_jaxpr_numpy.supported(closed) and not closed.effects)
  np.testing.assert_array_equal(_eager.evaluate(fn, X), np.asarray(jax.jit(fn)(X)))


def _divide(x, y):
  return lax.div(x, y), lax.rem(x, y)


def test_division_by_zero_or_minus_one_falls_back_to_xla():
  closed = jax.make_jaxpr(_divide)(X, Y)
  assert _jaxpr_numpy.supported(closed)
  with pytest.raises(_jaxpr_numpy.Unsupported, match="division"):
    _jaxpr_numpy.run(closed, X, Y)
  # XLA defines x / 0 and INT_MIN / -1; evaluate gives its answers, through the compiler.
  for g, w in zip(_eager.evaluate(_divide, X, Y), jax.jit(_divide)(X, Y)):
    np.testing.assert_array_equal(g, np.asarray(w))
  for g, w in zip(_eager.evaluate(_divide, X, NONZERO), jax.jit(_divide)(X, NONZERO)):
    np.testing.assert_array_equal(g, np.asarray(w))


MASKS = {
  "combined": (masks.causal(1) & ~masks.strided(3)) | masks.global_tokens(1),
  "segments_and_lengths": masks.segments(np.array([[0, 0, 1, 1, 1, 2, 2, 3, 3]]))
  & masks.lengths(kv_lengths=np.array([7])),
  "chunked_window": masks.chunked(4) & masks.sliding_window(3, 1),
  "bigbird": masks.bigbird(9, 9, block_size=2, num_random_blocks=1, seed=4),
}


def _from_numpy_and_compiled(f, monkeypatch):
  """``f()`` twice, each with an empty cache: evaluated with NumPy while compiling is
  forbidden, then compiled while NumPy evaluation is refused."""

  def no_compiling(*a, **k):
    raise AssertionError("compiled")

  with monkeypatch.context() as m:
    m.setattr(_eager, "_CACHE", {})
    m.setattr(_eager, "_compile", no_compiling)
    from_numpy = f()
  with monkeypatch.context() as m:
    m.setattr(_eager, "_CACHE", {})
    m.setattr(_jaxpr_numpy, "supported", lambda closed: False)
    return from_numpy, f()


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("name", list(MASKS))
def test_block_views_evaluated_without_compiling_equal_the_compiled(name, exact, monkeypatch):
  view = lambda: MASKS[name].block_view(9, 9, block_q=2, block_kv=4, num_heads=2, exact=exact)  # noqa: E731
  from_numpy, compiled = _from_numpy_and_compiled(view, monkeypatch)
  assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.int8
  np.testing.assert_array_equal(from_numpy, compiled)


@pytest.mark.parametrize("name", list(MASKS))
def test_materialized_masks_evaluated_without_compiling_equal_the_traced(name, monkeypatch):
  """Mask.materialize on concrete masks: NumPy evaluation (compiling forbidden), the compiled
  fallback, and the mask staged into a jit (the path of every traced call) agree."""
  dense = lambda m: m.materialize(9, 9, num_heads=2)  # noqa: E731
  from_numpy, compiled = _from_numpy_and_compiled(lambda: dense(MASKS[name]), monkeypatch)
  traced = jax.jit(dense)(MASKS[name])
  assert isinstance(from_numpy, jax.Array) and from_numpy.dtype == np.bool_
  assert from_numpy.shape == (1, 2, 9, 9)
  np.testing.assert_array_equal(from_numpy, compiled)
  np.testing.assert_array_equal(from_numpy, traced)
