"""jattn.linear: every feature map against a materialised NumPy float64 formula
(A = φ(Q)φ(K)ᵀ, lower-triangular when causal; out = A V / (A·1 + eps)), gradients
against autodiff of the same formula in plain jnp, FAVOR+ against softmax
attention, the projection's structure, large logits, and every error path."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from pairwise import pairwise
from reference import assert_close, normal

from jattn import linear
from jattn.linear import linear_attention, random_projection

B, T, N, H = 2, 7, 4, 8
RNG = jax.random.key(0)
M = round(H * math.log(H))  # 17: Performer's default number of features for H=8
MAPS = ("elu+1", "relu", "favor+", "callable")


# ----------------------------------------------------------------- independent references


def pairs_jnp(x):
  """A user feature map with F = 2H: the positive and negative parts."""
  return jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)


@functools.cache
def projection_np():
  """The projection linear_attention draws from RNG with the default num_features."""
  return np.asarray(random_projection(RNG, M, H), np.float64)


def favor_np(x, w, *, scale, is_query):
  """Performer's positive features of x (B, L, heads, H), stabilised per query row or
  per key head (max over L and the m features)."""
  x = np.sqrt(scale) * np.asarray(x, np.float64)
  logits = x @ w.T - 0.5 * np.sum(x * x, axis=-1, keepdims=True)
  axes = -1 if is_query else (1, 3)
  return np.exp(logits - np.max(logits, axis=axes, keepdims=True)) / np.sqrt(len(w))


def phi_np(feature_map, x, *, is_query, scale=1 / np.sqrt(H)):
  """φ(x) in float64 for a map's name, or a NumPy function of x."""
  x = np.asarray(x, np.float64)
  if callable(feature_map):
    return feature_map(x)
  match feature_map:
    case "elu+1":
      return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    case "relu":
      return np.maximum(x, 0)
    case "favor+":
      return favor_np(x, projection_np(), scale=scale, is_query=is_query)
    case "callable":
      return np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=-1)


def linear_np(q, k, v, feature_map, *, causal, eps=1e-6, **phi_args):
  """Float64 linear attention with the T×S weights materialised; q (B, T, N, H)."""
  phi_q = phi_np(feature_map, q, is_query=True, **phi_args)
  phi_k = phi_np(feature_map, k, is_query=False, **phi_args)
  G = q.shape[2] // k.shape[2]
  phi_k = np.repeat(phi_k, G, axis=2)
  v = np.repeat(np.asarray(v, np.float64), G, axis=2)
  a = np.einsum("btnf,bsnf->bnts", phi_q, phi_k)
  if causal:
    a = a * np.tril(np.ones(a.shape[-2:]))
  den = a.sum(-1).transpose(0, 2, 1)[..., None]
  return np.einsum("bnts,bsnh->btnh", a, v) / (den + eps)


def phi_jnp(feature_map, x, *, is_query):
  match feature_map:
    case "elu+1":
      return jax.nn.elu(x) + 1
    case "relu":
      return jax.nn.relu(x)
    case "favor+":
      x = x / H**0.25
      logits = x @ jnp.asarray(projection_np()).T - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
      axes = -1 if is_query else (1, 3)
      c = jax.lax.stop_gradient(jnp.max(logits, axis=axes, keepdims=True))
      return jnp.exp(logits - c) / np.sqrt(M)
    case "callable":
      return pairs_jnp(x)


def linear_jnp(q, k, v, feature_map, *, causal, eps=1e-6):
  """The same formula in plain jnp, for autodiff."""
  G = q.shape[2] // k.shape[2]
  phi_q = phi_jnp(feature_map, q, is_query=True)
  phi_k = jnp.repeat(phi_jnp(feature_map, k, is_query=False), G, axis=2)
  a = jnp.einsum("btnf,bsnf->bnts", phi_q, phi_k)
  if causal:
    a = jnp.where(jnp.tril(jnp.ones(a.shape[-2:], bool)), a, 0.0)
  num = jnp.einsum("bnts,bsnh->btnh", a, jnp.repeat(v, G, axis=2))
  return num / (a.sum(-1).transpose(0, 2, 1)[..., None] + eps)


def call(q, k, v, feature_map, **kwargs):
  if feature_map == "favor+":
    kwargs.setdefault("rng", RNG)
  fm = pairs_jnp if feature_map == "callable" else feature_map
  return linear_attention(q, k, v, feature_map=fm, **kwargs)


def inputs(K, dtype=np.float32, *, T=T, size=1.0, seed=0):
  """query (B, T, N, H) and key scaled by ``size``, value (B, T, K, H)."""
  rs = np.random.default_rng(seed)
  shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H))
  return tuple(
    jnp.asarray(scale * rs.standard_normal(shape), dtype)
    for scale, shape in zip((size, size, 1.0), shapes)
  )


# ------------------------------------------------------------------------------ values


# Every pair of a feature map, causal or not, and GQA or MHA.
REFERENCE_CASES = pairwise({"feature_map": MAPS, "causal": [False, True], "K": [2, 4]})


@pytest.mark.parametrize(
  "feature_map, causal, K",
  [tuple(c.values()) for c in REFERENCE_CASES],
  ids=[
    f"{c['feature_map']}-{'causal' if c['causal'] else 'full'}-{'gqa' if c['K'] == 2 else 'mha'}"
    for c in REFERENCE_CASES
  ],
)
def test_matches_reference(feature_map, causal, K):
  q, k, v = inputs(K)
  out = call(q, k, v, feature_map, is_causal=causal, chunk_size=3)  # 3 does not divide T=7
  assert out.dtype == np.float32
  assert_close(out, linear_np(q, k, v, feature_map, causal=causal))


@pytest.mark.parametrize("chunk_size", [1, 64])
def test_chunk_sizes(chunk_size):
  """One position per step, and one chunk longer than T (3, which leaves a partial
  chunk, is in test_matches_reference)."""
  q, k, v = inputs(2)
  out = call(q, k, v, "elu+1", is_causal=True, chunk_size=chunk_size)
  assert_close(out, linear_np(q, k, v, "elu+1", causal=True))


def test_unbatched_under_jit_and_vmap():
  """Unbatched (T, N, H) calls, vmapped over the batch inside jit with a traced rng, equal
  the reference (favor+: its key stabiliser must use the unbatched layout's axes)."""
  q, k, v = inputs(2)
  f = lambda q, k, v, rng: call(q, k, v, "favor+", is_causal=True, rng=rng, scale=0.3, chunk_size=4)
  out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(q, k, v, RNG)
  assert_close(out, linear_np(q, k, v, "favor+", causal=True, scale=0.3))


def test_callable_holding_arrays():
  """A feature map object (unhashable, holding weights) is called afresh each time: a
  changed weight changes the output, and gradients reach the weight."""

  @dataclasses.dataclass
  class Features:
    w: jax.Array

    def __call__(self, x):
      return jax.nn.relu(x @ self.w)

  q, k, v = inputs(2)
  w = normal((H, 2 * H), seed=6)
  feature_map = Features(w)
  attend = lambda f: linear_attention(q, k, v, feature_map=f, is_causal=True, chunk_size=3)
  out = attend(feature_map)
  phi = lambda x: np.maximum(x @ np.asarray(w, np.float64), 0)
  assert_close(out, linear_np(q, k, v, phi, causal=True))
  feature_map.w = w + 1.0
  assert not np.allclose(attend(feature_map), out)
  grad = jax.jit(jax.grad(lambda w: jnp.sum(attend(Features(w)))))(w)
  assert np.all(np.isfinite(grad)) and np.any(grad != 0)


def test_bfloat16_output_dtype():
  q, k, v = inputs(2, jnp.bfloat16)
  out = call(q, k, v, "elu+1")
  assert out.dtype == jnp.bfloat16
  assert_close(out, linear_np(q, k, v, "elu+1", causal=False))


GRADIENT_CASES = [("favor+", False), ("elu+1", True), ("relu", True), ("favor+", True)]


# The default run keeps FAVOR+ (its random features) non-causal and elu+1 causal, the settings
# test_check_grads and test_favor_approximates_softmax_attention use; the other two are
# exhaustive.
@pytest.mark.parametrize(
  "feature_map, causal",
  [
    c
    if c in (("favor+", False), ("elu+1", True))
    else pytest.param(*c, marks=pytest.mark.exhaustive)
    for c in GRADIENT_CASES
  ],
)
def test_float64_values_and_gradients(x64, feature_map, causal):
  q, k, v = inputs(2, np.float64)
  out, vjp = jax.vjp(
    functools.partial(call, feature_map=feature_map, is_causal=causal, chunk_size=3), q, k, v
  )
  assert out.dtype == np.float64
  assert_close(out, linear_np(q, k, v, feature_map, causal=causal))
  ct = normal(out.shape, np.float64, seed=9)
  expected = jax.jit(
    jax.grad(lambda *a: jnp.sum(ct * linear_jnp(*a, feature_map, causal=causal)), argnums=(0, 1, 2))
  )(q, k, v)
  for name, got, want in zip("qkv", vjp(ct), expected):
    assert_close(got, want, factor=10, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_check_grads(x64, causal):
  """Against finite differences (the shapes and settings of the test above: its compiled
  backward pass is reused)."""
  q, k, v = inputs(2, np.float64)
  check_grads(
    functools.partial(call, feature_map="elu+1", is_causal=causal, chunk_size=3),
    (q, k, v),
    order=1,
    modes=["rev"],
  )


def test_long_causal_with_large_logits():
  """T=200 in chunks of 16, float32, logits so large that without the stabilisers about
  half of the FAVOR+ query rows would have every feature underflow to 0 (and so output
  zeros): no NaN or inf, and the chunked scan equals the materialised float64 formula."""
  q, k, v = inputs(2, T=200, size=10.0, seed=3)
  x = np.asarray(q, np.float64) / H**0.25
  raw = np.float32(np.exp(x @ projection_np().T - 0.5 * np.sum(x * x, -1, keepdims=True)))
  assert np.mean(np.all(raw == 0, axis=-1)) > 0.25  # the case is hard
  out = call(q, k, v, "favor+", is_causal=True, chunk_size=16)
  assert np.all(np.isfinite(out))
  assert_close(out, linear_np(q, k, v, "favor+", causal=True))


def test_relu_rows_with_zero_denominator_are_zeros(x64):
  """(float64 with the settings of test_float64_values_and_gradients[relu-True], whose
  compiled backward pass it reuses.)"""
  q, k, v = inputs(2, np.float64)
  q = q.at[:, :3].set(-jnp.abs(q[:, :3]))  # queries 0..2: no positive feature
  k = k.at[:, :, 1].set(-jnp.abs(k[:, :, 1]))  # kv head 1 (query heads 2, 3): none either
  causal, vjp = jax.vjp(
    functools.partial(call, feature_map="relu", is_causal=True, chunk_size=3), q, k, v
  )
  for out in (np.asarray(call(q, k, v, "relu", chunk_size=3)), np.asarray(causal)):
    assert np.all(out[:, :3] == 0) and np.all(out[:, :, 2:] == 0)
    assert np.any(out[:, 3:, :2] != 0)
  assert_close(causal, linear_np(q, k, v, "relu", causal=True))
  for grad in vjp(jnp.ones_like(q)):
    assert np.all(np.isfinite(grad))


# ----------------------------------------------------------------- FAVOR+ and its projection


def test_orthogonal_projection():
  """Blocks of H rows are orthogonal, blocks are independent, rows are N(0, I)."""
  w = np.asarray(random_projection(jax.random.key(1), 4092, H), np.float64)  # 511 blocks + 4
  assert w.shape == (4092, H)
  unit = w / np.linalg.norm(w, axis=1, keepdims=True)
  blocks = unit[:4088].reshape(511, H, H)
  np.testing.assert_allclose(
    blocks @ blocks.transpose(0, 2, 1), np.broadcast_to(np.eye(H), (511, H, H)), atol=1e-5
  )
  np.testing.assert_allclose(unit[4088:] @ unit[4088:].T, np.eye(4), atol=1e-5)
  assert np.max(np.abs(unit[:H] @ unit[H : 2 * H].T)) > 0.1  # blocks are independent
  np.testing.assert_allclose(w.mean(0), 0, atol=0.1)
  np.testing.assert_allclose(np.cov(w.T), np.eye(H), atol=0.1)
  np.testing.assert_allclose(np.mean(unit, axis=0), 0, atol=0.05)  # directions uniform


def test_favor_features_match_formula():
  x = normal((B, T, 2, H), seed=4)
  w = projection_np()
  for is_query in (True, False):
    got = linear.favor_features(x, jnp.asarray(w, jnp.float32), scale=0.5, is_query=is_query)
    assert_close(got, favor_np(x, w, scale=0.5, is_query=is_query))


def test_favor_approximates_softmax_attention():
  """Mean absolute error against jax.nn over 8 projections falls as m grows (by about
  sqrt(32) here: the error of each kernel estimate falls as 1/sqrt(m))."""
  q, k, v = (x[:1] for x in inputs(2, T=16, size=0.5, seed=5))
  expected = jax.nn.dot_product_attention(q, k, v)[None]
  rngs = jax.random.split(jax.random.key(7), 8)
  errors = []
  for m in (16, 512):
    out = jax.vmap(lambda r: call(q, k, v, "favor+", rng=r, num_features=m))(rngs)
    errors.append(float(jnp.mean(jnp.abs(out - expected))))
  assert errors[0] > 3 * errors[1], errors
  assert errors[1] < 0.03, errors


# --------------------------------------------------------------------------------- errors

Q, KV = jnp.zeros((B, T, N, H)), jnp.zeros((B, T, 2, H))

# (id, keyword overrides, exception, message fragment)
BAD_INPUTS = [
  (
    "unknown_map",
    dict(feature_map="softmax"),
    ValueError,
    r"feature_map must be one of \['elu\+1', 'relu', 'favor\+'\] or a callable, got 'softmax'",
  ),
  (
    "map_type",
    dict(feature_map=3),
    TypeError,
    r"feature_map must be one of .* or a callable, got int",
  ),
  (
    "map_shape",
    dict(feature_map=lambda x: x.sum(-1)),
    ValueError,
    r"feature_map must map the query \(2, 7, 4, 8\) to features of shape \(2, 7, 4, 'F'\), "
    r"got \(2, 7, 4\)",
  ),
  (
    "map_dtype",
    dict(feature_map=lambda x: x > 0),
    TypeError,
    r"feature_map must return one floating array",
  ),
  (
    "favor_no_rng",
    dict(feature_map="favor+"),
    ValueError,
    r"feature_map='favor\+' needs rng, a jax.random.key",
  ),
  (
    "favor_bad_rng",
    dict(feature_map="favor+", rng=jnp.zeros(3)),
    TypeError,
    r"rng must be a single jax.random.key or PRNGKey, got float32\(3,\)",
  ),
  (
    "favor_key_batch",
    dict(feature_map="favor+", rng=jax.random.split(RNG)),
    TypeError,
    r"rng must be a single jax.random.key",
  ),
  (
    "num_features",
    dict(feature_map="favor+", rng=RNG, num_features=0),
    ValueError,
    r"num_features must be >= 1, got 0",
  ),
  (
    "scale_negative",
    dict(feature_map="favor+", rng=RNG, scale=-1.0),
    ValueError,
    r"scale must be a finite number >= 0 for feature_map='favor\+', got -1.0",
  ),
  (
    "scale_elu",
    dict(scale=0.5),
    ValueError,
    r"scale applies only to feature_map='favor\+', got feature_map='elu\+1'",
  ),
  (
    "rng_relu",
    dict(feature_map="relu", rng=RNG),
    ValueError,
    r"rng applies only to feature_map='favor\+', got feature_map='relu'",
  ),
  (
    "num_features_callable",
    dict(feature_map=pairs_jnp, num_features=4),
    ValueError,
    r"num_features applies only to feature_map='favor\+', got feature_map=a callable",
  ),
  ("chunk_zero", dict(chunk_size=0), ValueError, r"chunk_size must be >= 1, got 0"),
  ("chunk_float", dict(chunk_size=8.0), TypeError, r"chunk_size must be an int"),
  ("eps_zero", dict(eps=0.0), ValueError, r"eps must be a positive finite number, got 0.0"),
  ("eps_nan", dict(eps=float("nan")), ValueError, r"eps must be a positive finite number"),
  ("causal_type", dict(is_causal=1), TypeError, r"is_causal must be a bool, got 1"),
  ("orthogonal_type", dict(orthogonal="yes"), TypeError, r"orthogonal must be a bool"),
  (
    "causal_T_ne_S",
    dict(is_causal=True, key=KV[:, :5], value=KV[:, :5]),
    ValueError,
    r"is_causal=True needs as many queries as keys, got T=7 and S=5",
  ),
  (
    "qkv_heads",
    dict(query=jnp.zeros((B, T, 3, H))),
    ValueError,
    r"number of query heads N \(3\) must be a multiple of the number of key/value heads K \(2\)",
  ),
  (
    "qkv_shapes",
    dict(value=jnp.zeros((B, T, 2, H // 2))),
    ValueError,
    r"key and value must have the same shape",
  ),
  (
    "qkv_dtype",
    dict(query=jnp.zeros((B, T, N, H), jnp.int32)),
    TypeError,
    r"query must have a floating dtype, got int32",
  ),
]


@pytest.mark.parametrize(
  "overrides, error, message",
  [case[1:] for case in BAD_INPUTS],
  ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_raises(overrides, error, message):
  args = dict(query=Q, key=KV, value=KV) | overrides
  with pytest.raises(error, match=message):
    linear_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


@pytest.mark.parametrize(
  "call_, error, message",
  [
    (lambda: random_projection(RNG, 0, H), ValueError, r"num_features must be >= 1, got 0"),
    (lambda: random_projection(RNG, 4, 0), ValueError, r"head_dim must be >= 1, got 0"),
    (lambda: random_projection(0, 4, H), TypeError, r"rng must be a single jax.random.key"),
    (
      lambda: linear.favor_features(Q, jnp.zeros((4, H + 1)), is_query=True),
      ValueError,
      r"projection must have shape \(m, H\) with H the last dimension of x",
    ),
  ],
  ids=["num_features", "head_dim", "rng", "favor_shape"],
)
def test_bad_helper_input_raises(call_, error, message):
  with pytest.raises(error, match=message):
    call_()
