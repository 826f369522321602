"""jattn.positional: each encoding against NumPy float64 formulas and literals, RoPE's
properties (norm, relative positions), transformations, and every error path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pairwise import pairwise
from reference import (
  alibi_slopes_np,
  assert_close,
  attention_np,
  inv_freq_np,
  llama3_np,
  normal,
  rope_np,
  scaled_np,
  sinusoidal_np,
)

import jattn
from jattn import positional, scores

B, T, N, H = 2, 6, 3, 8
Scaling = positional.RopeScaling


SCALINGS = [
  None,
  Scaling("linear", 4.0),
  Scaling("ntk", 8.0),
  Scaling("llama3", 8.0),  # H=8, base 1e4: every wavelength is short, pairs unchanged
  Scaling("llama3", 4.0, original_max_position=64, low_freq_factor=1.0, high_freq_factor=8.0),
  Scaling("yarn", 4.0, original_max_position=64),
  Scaling(
    "yarn",
    16.0,
    original_max_position=256,
    beta_fast=8.0,
    beta_slow=2.0,
    truncate=False,
    attention_factor=1.25,
  ),
]
SCALING_IDS = ["none", "linear", "ntk", "llama3_default", "llama3_bands", "yarn", "yarn_custom"]


# ----------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize("shape", [(), (7,), (2, 5)])
@pytest.mark.parametrize("dim, max_timescale", [(2, 10_000), (8, 10_000), (6, 100.0)])
def test_sinusoidal_formula(shape, dim, max_timescale):
  p = np.random.default_rng(0).integers(0, 50, shape)
  got = positional.sinusoidal(jnp.asarray(p), dim, max_timescale=max_timescale)
  assert got.shape == shape + (dim,) and got.dtype == jnp.float32
  assert_close(got, sinusoidal_np(p, dim, max_timescale))


def test_sinusoidal_literal():
  # dim 4: frequencies 1 and 1/100; all sines first, then all cosines.
  got = positional.sinusoidal(jnp.array([0, 1]), 4)
  want = [[0, 0, 1, 1], [math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)]]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_sinusoidal_float_positions_and_dtypes(x64):
  p = np.array([[0.5, 2.25], [10.0, 1000.5]])
  got = positional.sinusoidal(jnp.asarray(p), 16, dtype=jnp.float64)
  assert got.dtype == jnp.float64
  np.testing.assert_allclose(got, sinusoidal_np(p, 16), rtol=1e-12, atol=1e-12)
  low = positional.sinusoidal(jnp.asarray(p, jnp.float32), 16, dtype=jnp.bfloat16)
  assert low.dtype == jnp.bfloat16
  assert_close(low, sinusoidal_np(p, 16), jnp.bfloat16)


# ----------------------------------------------------------------- frequencies and scaling


def test_rope_frequencies_unscaled():
  got = positional.rope_frequencies(16, base=500_000.0)
  assert got.dtype == np.float32 and got.shape == (8,)
  np.testing.assert_allclose(got, [500_000.0 ** (-i / 8) for i in range(8)], rtol=1e-6)


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=SCALING_IDS[1:])
@pytest.mark.parametrize("R, base", [(8, 10_000.0), (16, 10_000.0), (64, 500_000.0)])
def test_scaled_frequencies_match_numpy(scaling, R, base):
  got = positional.rope_frequencies(R, base=base, scaling=scaling)
  assert got.dtype == np.float32 and got.shape == (R // 2,)
  np.testing.assert_allclose(got, scaled_np(R, base, scaling)[0], rtol=1e-6)


def test_llama3_bands():
  # Llama 3.1: R=128, base 5e5, factor 8, L=8192, bands 1 and 4.
  s = Scaling("llama3", 8.0, original_max_position=8192, low_freq_factor=1.0, high_freq_factor=4.0)
  theta = inv_freq_np(128, 500_000.0)
  got = positional.rope_frequencies(128, base=500_000.0, scaling=s)
  np.testing.assert_allclose(got, llama3_np(128, 500_000.0, 8.0, 1.0, 4.0, 8192), rtol=1e-6)
  wavelen = 2 * np.pi / theta
  high, low = wavelen < 8192 / 4, wavelen > 8192
  np.testing.assert_allclose(got[high], theta[high], rtol=1e-6)
  np.testing.assert_allclose(got[low], theta[low] / 8, rtol=1e-6)
  mid = ~high & ~low
  assert high.sum() and low.sum() and mid.sum()
  assert np.all((got[mid] < theta[mid]) & (got[mid] > theta[mid] / 8))
  # Hand-computed: R=16, base 1e4, L=8192: pair 6 (λ = 2000π) lies between the bands.
  got = positional.rope_frequencies(16, scaling=Scaling("llama3", 8.0))
  smooth = (8192 / (2000 * math.pi) - 1) / 3
  np.testing.assert_allclose(got[6], 1e-3 * ((1 - smooth) / 8 + smooth), rtol=1e-6)
  np.testing.assert_allclose(got[[0, 5, 7]], [1.0, 10**-2.5, 10**-3.5 / 8], rtol=1e-6)


def test_ntk_divides_lowest_frequency_by_factor():
  got = positional.rope_frequencies(16, scaling=Scaling("ntk", 4.0))
  theta = inv_freq_np(16, 10_000.0)
  np.testing.assert_allclose(got[[0, -1]], [theta[0], theta[-1] / 4], rtol=1e-6)


def test_yarn_literal():
  # R=16, base 1e4, L=64: d(32) = 16 ln(1/π) / (2 ln 1e4) ≈ -0.99 -> 0;
  # d(1) = 16 ln(32/π) / (2 ln 1e4) ≈ 2.02 -> 3. Ramp γ = 0, 1/3, 2/3, 1, 1, ...
  got = positional.rope_frequencies(16, scaling=Scaling("yarn", 4.0, original_max_position=64))
  theta = 10.0 ** (-np.arange(8) / 2)
  gamma = np.array([0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
  np.testing.assert_allclose(got, theta * (1 - gamma + gamma / 4), rtol=1e-6)
  assert Scaling("yarn", 4.0).output_scale == pytest.approx(0.1 * math.log(4) + 1)
  assert Scaling("yarn", 4.0, attention_factor=1.5).output_scale == 1.5
  assert Scaling("llama3", 4.0).output_scale == 1.0


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones(truncate):
  R, base, L = 64, 10_000.0, 2048
  s = Scaling("yarn", 8.0, original_max_position=L, truncate=truncate)
  theta = inv_freq_np(R, base)
  rotations = L * theta / (2 * np.pi)  # turns of each pair over the original context
  got = positional.rope_frequencies(R, base=base, scaling=s)
  fast, slow = rotations >= 32, rotations <= 1
  assert fast.sum() and slow.sum()
  np.testing.assert_allclose(got[fast], theta[fast], rtol=1e-6)
  np.testing.assert_allclose(got[slow], theta[slow] / 8, rtol=1e-6)


@pytest.mark.parametrize("kind", positional.SCALING_KINDS)
def test_factor_one_changes_nothing(kind):
  got = positional.rope_frequencies(16, scaling=Scaling(kind, 1.0))
  np.testing.assert_allclose(got, positional.rope_frequencies(16), rtol=1e-6)
  assert Scaling(kind, 1.0).output_scale == 1.0


# ----------------------------------------------------------------- rope values


POSITIONS = {
  "T": lambda rng: rng.integers(0, 40, (T,)),
  "1T": lambda rng: rng.integers(0, 40, (1, T)),
  "BT": lambda rng: rng.integers(0, 40, (B, T)),
  "float_BT": lambda rng: rng.uniform(0, 40, (B, T)),
}


# Every pair of a positions layout, a rotary fraction and a scaling (the fraction sets the
# rotary dimension the scaled frequencies are computed for; the layout only broadcasts).
ROPE_CASES = pairwise(
  {
    "layout": list(POSITIONS) + ["unbatched"],
    "rotary_fraction": [1.0, 0.5],
    "scaling": list(zip(SCALING_IDS, SCALINGS)),
  }
)


@pytest.mark.parametrize(
  "layout, rotary_fraction, scaling",
  [(c["layout"], c["rotary_fraction"], c["scaling"][1]) for c in ROPE_CASES],
  ids=[f"{c['layout']}-{c['rotary_fraction']}-{c['scaling'][0]}" for c in ROPE_CASES],
)
def test_rope_matches_numpy_float64(layout, rotary_fraction, scaling, x64):
  rng = np.random.default_rng(1)
  if layout == "unbatched":
    x, p = rng.standard_normal((T, N, H)), rng.integers(0, 40, (T,))
  else:
    x, p = rng.standard_normal((B, T, N, H)), POSITIONS[layout](rng)
  got = positional.rope(
    jnp.asarray(x), jnp.asarray(p), base=100.0, rotary_fraction=rotary_fraction, scaling=scaling
  )
  assert got.dtype == jnp.float64 and got.shape == x.shape
  want = rope_np(x, p, base=100.0, rotary_fraction=rotary_fraction, scaling=scaling)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_rope_float32(scaling):
  x, p = normal((B, T, N, 16)), np.arange(T) * 7
  got = positional.rope(x, jnp.asarray(p), base=500_000.0, scaling=scaling)
  assert got.dtype == jnp.float32
  assert_close(got, rope_np(x, p, base=500_000.0, scaling=scaling), factor=5)


def test_rope_literal_rotation():
  # H=2: one pair turning by exactly p radians at base anything (θ_0 = 1).
  x = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])  # (T=3, N=1, H=2)
  got = positional.rope(x, jnp.array([0, 1, 2]))
  want = [[[1, 0]], [[math.cos(1), math.sin(1)]], [[-math.sin(2), math.cos(2)]]]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@given(
  positions=st.lists(st.integers(0, 100_000), min_size=T, max_size=T),
  base=st.sampled_from([10.0, 10_000.0, 1e6]),
  scaling=st.sampled_from(SCALINGS[:5]),
)
def test_rope_preserves_norm_of_each_vector(positions, base, scaling):
  with jax.enable_x64(True):
    x = normal((B, T, N, H), np.float64, seed=2)
    y = positional.rope(x, jnp.asarray(positions), base=base, scaling=scaling)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-12)


def test_yarn_scales_norm_by_output_scale(x64):
  s = SCALINGS[5]
  x = normal((B, T, N, H), np.float64)
  y = positional.rope(x, jnp.arange(T), scaling=s)
  np.testing.assert_allclose(
    jnp.linalg.norm(y, axis=-1), s.output_scale * jnp.linalg.norm(x, axis=-1), rtol=1e-12
  )


@given(
  m=st.integers(0, 5000),
  n=st.integers(0, 5000),
  shift=st.integers(-5000, 5000),
  scaling=st.sampled_from(SCALINGS),
  rotary_fraction=st.sampled_from([1.0, 0.75, 0.25]),
)
def test_rope_logits_depend_only_on_relative_position(m, n, shift, scaling, rotary_fraction):
  with jax.enable_x64(True):
    q, k = normal((1, 1, 16), np.float64, seed=3), normal((1, 1, 16), np.float64, seed=4)
    kw = dict(base=1000.0, rotary_fraction=rotary_fraction, scaling=scaling)

    def logit(a, b):
      return jnp.sum(
        positional.rope(q, jnp.array([a]), **kw) * positional.rope(k, jnp.array([b]), **kw)
      )

    np.testing.assert_allclose(logit(m, n), logit(m + shift, n + shift), rtol=1e-9, atol=1e-9)


def test_partial_rotary_leaves_tail_unchanged():
  x = normal((B, T, N, 16))
  y = positional.rope(x, jnp.arange(T) + 3, rotary_fraction=0.25)
  np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
  # The head is ordinary RoPE on the first R channels, pairing i with i + R/2.
  assert_close(y[..., :4], positional.rope(x[..., :4], jnp.arange(T) + 3))
  assert not np.allclose(y[:, 1:, :, :4], x[:, 1:, :, :4])


def test_rows_of_batched_positions_are_independent():
  x = normal((B, T, N, H))
  p = jnp.array([np.arange(T), np.arange(T)[::-1] * 5 + 100])
  y = positional.rope(x, p)
  for b in range(B):
    assert_close(y[b], positional.rope(x[b], p[b]))
  assert_close(positional.rope(x, p[:1]), positional.rope(x, p[0]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_keeps_dtype(dtype):
  x = normal((B, T, N, H), dtype)
  y = positional.rope(x, jnp.arange(T) * 11)
  assert y.dtype == dtype
  assert_close(y, rope_np(np.asarray(x, np.float32), np.arange(T) * 11), dtype)


def test_jit_and_vmap():
  x, p = normal((B, T, N, H)), jnp.array([np.arange(T), np.arange(T) + 9])
  eager = positional.rope(x, p, rotary_fraction=0.5, scaling=SCALINGS[5])
  fn = jax.jit(lambda x, p: positional.rope(x, p, rotary_fraction=0.5, scaling=SCALINGS[5]))
  assert_close(fn(x, p), eager)
  assert_close(
    jax.vmap(lambda x, p: positional.rope(x, p, rotary_fraction=0.5, scaling=SCALINGS[5]))(x, p),
    eager,
  )
  rot = positional.Rotary(rotary_fraction=0.5, scaling=SCALINGS[5])
  assert_close(jax.jit(rot)(x, p), eager)


def test_gradient_is_the_transposed_rotation(x64):
  # |rope(x)|² = |x|², so its gradient with respect to x is 2x.
  x = normal((T, N, H), np.float64)
  g = jax.grad(lambda x: jnp.sum(positional.rope(x, jnp.arange(T) * 3) ** 2))(x)
  np.testing.assert_allclose(g, 2 * x, rtol=1e-12)


@pytest.mark.parametrize("factor", [2.0, 4.0, 32.0])
def test_linear_scaling_at_f_times_m_is_plain_rope_at_m(factor):
  x, m = normal((B, T, N, H)), jnp.arange(T) * 13
  scaled = positional.rope(x, m * factor, scaling=Scaling("linear", factor))
  assert_close(scaled, positional.rope(x, m), factor=5)


def test_rotary_object():
  s = Scaling("llama3", 8.0, original_max_position=64)
  rot = positional.Rotary(base=1000, rotary_fraction=0.5, scaling=s)
  assert rot.base == 1000.0 and isinstance(rot.base, float)
  assert rot == positional.Rotary(base=1000.0, rotary_fraction=0.5, scaling=s)
  assert hash(rot) == hash(positional.Rotary(base=1000.0, rotary_fraction=0.5, scaling=s))
  x = normal((B, T, N, 16))
  np.testing.assert_array_equal(
    rot(x, jnp.arange(T)),
    positional.rope(x, jnp.arange(T), base=1000.0, rotary_fraction=0.5, scaling=s),
  )
  rot.check_head_dim(16)
  rot.check_head_dim(4)


# ----------------------------------------------------------------- ALiBi


def test_alibi_slopes_literals():
  np.testing.assert_array_equal(positional.alibi_slopes(8), [2.0**-k for k in range(1, 9)])
  np.testing.assert_array_equal(positional.alibi_slopes(1), [1 / 256])
  np.testing.assert_array_equal(
    positional.alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
  )
  np.testing.assert_array_equal(positional.alibi_slopes(3), [1 / 16, 1 / 256, 1 / 4])
  twelve = [
    0.5,
    0.25,
    0.125,
    0.0625,
    0.03125,
    0.015625,
    0.0078125,
    0.00390625,
    0.7071067811865476,
    0.3535533905932738,
    0.1767766952966369,
    0.08838834764831845,
  ]
  got = positional.alibi_slopes(12)
  assert got.dtype == np.float32 and got.shape == (12,)
  np.testing.assert_allclose(got, twelve, rtol=1e-7)


@pytest.mark.parametrize("num_heads", list(range(1, 41)) + [64, 96, 100])
def test_alibi_slopes_match_reference_algorithm(num_heads):
  np.testing.assert_allclose(
    positional.alibi_slopes(num_heads), alibi_slopes_np(num_heads), rtol=1e-7
  )


def test_alibi_slopes_feed_scores_alibi():
  n = 6
  q, k, v = normal((B, T, n, H)), normal((B, T, n, H), seed=1), normal((B, T, n, H), seed=2)
  slopes = positional.alibi_slopes(n)
  got = jattn.dot_product_attention(q, k, v, is_causal=True, score_fn=scores.alibi(slopes))
  want, _ = attention_np(
    q,
    k,
    v,
    allowed=np.tril(np.ones((T, T), bool)),
    score=lambda s, b, h, i, j: s + slopes.astype(np.float64)[h] * (j - i),
  )
  assert_close(got, want)


# ----------------------------------------------------------------- errors


X = jnp.zeros((B, T, N, H))

# (id, call, exception, message fragment)
BAD = [
  (
    "sin_dim_odd",
    lambda: positional.sinusoidal(jnp.arange(3), 3),
    ValueError,
    r"dim must be a positive even int, got 3",
  ),
  (
    "sin_dim_zero",
    lambda: positional.sinusoidal(jnp.arange(3), 0),
    ValueError,
    r"dim must be a positive even int, got 0",
  ),
  (
    "sin_dim_float",
    lambda: positional.sinusoidal(jnp.arange(3), 4.0),
    TypeError,
    r"dim must be an int, got 4.0",
  ),
  (
    "sin_timescale",
    lambda: positional.sinusoidal(jnp.arange(3), 4, max_timescale=0),
    ValueError,
    r"max_timescale must be a positive finite number, got 0",
  ),
  (
    "sin_timescale_inf",
    lambda: positional.sinusoidal(jnp.arange(3), 4, max_timescale=np.inf),
    ValueError,
    r"max_timescale must be a positive finite number, got inf",
  ),
  (
    "sin_dtype",
    lambda: positional.sinusoidal(jnp.arange(3), 4, dtype=jnp.int32),
    TypeError,
    r"dtype must be a floating dtype, got int32",
  ),
  (
    "sin_positions_bool",
    lambda: positional.sinusoidal(jnp.ones(3, bool), 4),
    TypeError,
    r"positions must have an integer or floating dtype, got bool",
  ),
  (
    "sin_positions_str",
    lambda: positional.sinusoidal("abc", 4),
    TypeError,
    r"positions must be an array, got str",
  ),
  (
    "x_int",
    lambda: positional.rope(jnp.zeros((B, T, N, H), jnp.int32), jnp.arange(T)),
    TypeError,
    r"x must have a floating dtype, got int32",
  ),
  (
    "x_rank",
    lambda: positional.rope(jnp.zeros((T, N * H)), jnp.arange(T)),
    ValueError,
    r"x must have shape \(B, T, N, H\) or \(T, N, H\), got \(6, 24\)",
  ),
  (
    "x_type",
    lambda: positional.rope("x", jnp.arange(T)),
    TypeError,
    r"x must be an array, got str",
  ),
  (
    "positions_length",
    lambda: positional.rope(X, jnp.arange(T + 1)),
    ValueError,
    r"positions must have shape \(T,\)=\(6,\), \(1, T\)=\(1, 6\) or \(B, T\)=\(2, 6\) for x "
    r"of shape \(B, T, N, H\)=\(2, 6, 3, 8\), got \(7,\)",
  ),
  (
    "positions_batch",
    lambda: positional.rope(X, jnp.zeros((B + 1, T), jnp.int32)),
    ValueError,
    r"or \(B, T\)=\(2, 6\) for x of shape .* got \(3, 6\)",
  ),
  (
    "positions_rank",
    lambda: positional.rope(X, jnp.zeros((B, T, 1), jnp.int32)),
    ValueError,
    r"got \(2, 6, 1\)",
  ),
  (
    "positions_unbatched",
    lambda: positional.rope(X[0], jnp.zeros((1, T), jnp.int32)),
    ValueError,
    r"positions must have shape \(T,\)=\(6,\) for x of shape \(T, N, H\)="
    r"\(6, 3, 8\), got \(1, 6\)",
  ),
  (
    "positions_bool",
    lambda: positional.rope(X, jnp.ones(T, bool)),
    TypeError,
    r"positions must have an integer or floating dtype, got bool",
  ),
  (
    "positions_complex",
    lambda: positional.rope(X, jnp.ones(T, jnp.complex64)),
    TypeError,
    r"positions must have an integer or floating dtype, got complex64",
  ),
  (
    "base_zero",
    lambda: positional.rope(X, jnp.arange(T), base=0.0),
    ValueError,
    r"base must be a positive finite number, got 0.0",
  ),
  (
    "base_str",
    lambda: positional.rope(X, jnp.arange(T), base="1e4"),
    TypeError,
    r"base must be a real number, got '1e4'",
  ),
  (
    "fraction_zero",
    lambda: positional.rope(X, jnp.arange(T), rotary_fraction=0.0),
    ValueError,
    r"rotary_fraction must be in \(0, 1\], got 0.0",
  ),
  (
    "fraction_big",
    lambda: positional.rope(X, jnp.arange(T), rotary_fraction=1.5),
    ValueError,
    r"rotary_fraction must be in \(0, 1\], got 1.5",
  ),
  (
    "rotary_dim_odd",
    lambda: positional.rope(X, jnp.arange(T), rotary_fraction=0.375),
    ValueError,
    r"rotary_fraction \(0.375\) times the head dimension H \(8\) gives "
    r"rotary_dim=3; it must be even and >= 2",
  ),
  (
    "rotary_dim_small",
    lambda: positional.rope(X, jnp.arange(T), rotary_fraction=0.125),
    ValueError,
    r"rotary_fraction \(0.125\) times the head dimension H \(8\) gives rotary_dim=1",
  ),
  (
    "head_dim_odd",
    lambda: positional.rope(jnp.zeros((T, N, 5)), jnp.arange(T)),
    ValueError,
    r"head dimension H \(5\) gives rotary_dim=5; it must be even",
  ),
  (
    "ntk_rotary_dim_2",
    lambda: positional.rope(X, jnp.arange(T), rotary_fraction=0.25, scaling=Scaling("ntk", 2.0)),
    ValueError,
    r"scaling kind 'ntk' needs rotary_dim > 2",
  ),
  (
    "scaling_type",
    lambda: positional.rope(X, jnp.arange(T), scaling={"kind": "linear"}),
    TypeError,
    r"scaling must be a jattn.positional.RopeScaling or None, got dict",
  ),
  (
    "freq_dim_odd",
    lambda: positional.rope_frequencies(7),
    ValueError,
    r"rotary_dim \(7\) gives rotary_dim=7; it must be even and >= 2",
  ),
  (
    "freq_dim_zero",
    lambda: positional.rope_frequencies(0),
    ValueError,
    r"rotary_dim=0; it must be even and >= 2",
  ),
  (
    "freq_dim_float",
    lambda: positional.rope_frequencies(8.0),
    TypeError,
    r"rotary_dim must be an int, got 8.0",
  ),
  (
    "freq_base",
    lambda: positional.rope_frequencies(8, base=-1.0),
    ValueError,
    r"base must be a positive finite number, got -1.0",
  ),
  (
    "kind_unknown",
    lambda: Scaling("dynamic", 2.0),
    ValueError,
    r"kind must be one of \['linear', 'ntk', 'llama3', 'yarn'\], got 'dynamic'",
  ),
  ("kind_type", lambda: Scaling(None, 2.0), TypeError, r"kind must be a str"),
  (
    "factor_small",
    lambda: Scaling("linear", 0.5),
    ValueError,
    r"factor must be >= 1 \(the ratio by which the context grows\), got 0.5",
  ),
  (
    "factor_nan",
    lambda: Scaling("linear", float("nan")),
    ValueError,
    r"factor must be finite, got nan",
  ),
  ("factor_str", lambda: Scaling("linear", "2"), TypeError, r"factor must be a real number"),
  (
    "original_max_zero",
    lambda: Scaling("llama3", 8.0, original_max_position=0),
    ValueError,
    r"original_max_position must be >= 1, got 0",
  ),
  (
    "original_max_float",
    lambda: Scaling("llama3", 8.0, original_max_position=8192.0),
    TypeError,
    r"original_max_position must be an int",
  ),
  (
    "llama3_bands",
    lambda: Scaling("llama3", 8.0, low_freq_factor=4.0, high_freq_factor=4.0),
    ValueError,
    r"low_freq_factor \(4.0\) and high_freq_factor \(4.0\) must satisfy 0 < "
    r"low_freq_factor < high_freq_factor",
  ),
  (
    "llama3_low_zero",
    lambda: Scaling("llama3", 8.0, low_freq_factor=0.0),
    ValueError,
    r"must satisfy 0 < low_freq_factor",
  ),
  (
    "yarn_betas",
    lambda: Scaling("yarn", 8.0, beta_fast=1.0, beta_slow=32.0),
    ValueError,
    r"beta_fast \(1.0\) and beta_slow \(32.0\) must satisfy beta_fast > beta_slow > 0",
  ),
  (
    "yarn_beta_slow_zero",
    lambda: Scaling("yarn", 8.0, beta_slow=0.0),
    ValueError,
    r"beta_fast > beta_slow > 0",
  ),
  (
    "attention_factor_zero",
    lambda: Scaling("yarn", 8.0, attention_factor=0.0),
    ValueError,
    r"attention_factor must be a positive finite number or None, got 0.0",
  ),
  (
    "attention_factor_kind",
    lambda: Scaling("linear", 8.0, attention_factor=1.2),
    ValueError,
    r"attention_factor applies only to kind='yarn', got kind='linear'",
  ),
  (
    "truncate_type",
    lambda: Scaling("yarn", 8.0, truncate="yes"),
    TypeError,
    r"truncate must be a bool, got 'yes'",
  ),
  (
    "rotary_base",
    lambda: positional.Rotary(base=0.0),
    ValueError,
    r"base must be a positive finite number, got 0.0",
  ),
  (
    "rotary_fraction",
    lambda: positional.Rotary(rotary_fraction=0.0),
    ValueError,
    r"rotary_fraction must be in \(0, 1\], got 0.0",
  ),
  (
    "rotary_scaling",
    lambda: positional.Rotary(scaling="yarn"),
    TypeError,
    r"scaling must be a jattn.positional.RopeScaling or None, got str",
  ),
  (
    "check_head_dim_odd",
    lambda: positional.Rotary(rotary_fraction=0.5).check_head_dim(6),
    ValueError,
    r"rotary_fraction \(0.5\) times the head dimension H \(6\) gives rotary_dim=3",
  ),
  (
    "check_head_dim_small",
    lambda: positional.Rotary().check_head_dim(1),
    ValueError,
    r"head dimension H \(1\) gives rotary_dim=1; it must be even and >= 2",
  ),
  (
    "check_head_dim_ntk",
    lambda: positional.Rotary(scaling=Scaling("ntk", 2.0)).check_head_dim(2),
    ValueError,
    r"scaling kind 'ntk' needs rotary_dim > 2",
  ),
  (
    "check_head_dim_type",
    lambda: positional.Rotary().check_head_dim("64"),
    TypeError,
    r"head_dim must be an int, got '64'",
  ),
  ("alibi_zero", lambda: positional.alibi_slopes(0), ValueError, r"num_heads must be >= 1, got 0"),
  (
    "alibi_float",
    lambda: positional.alibi_slopes(8.0),
    TypeError,
    r"num_heads must be an int, got 8.0",
  ),
  (
    "alibi_bool",
    lambda: positional.alibi_slopes(True),
    TypeError,
    r"num_heads must be an int, got True",
  ),
]


@pytest.mark.parametrize("call, error, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_errors(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_traced_positions_are_fine_but_settings_must_be_static():
  x = normal((T, N, H))
  jax.jit(positional.rope)(x, jnp.arange(T))  # traced positions: only their shape is checked
  with pytest.raises(TypeError, match=r"base must be a concrete Python or NumPy number"):
    jax.jit(lambda b: positional.rope(x, jnp.arange(T), base=b))(100.0)
