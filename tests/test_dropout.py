"""jattn.dropout and dropout inside attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry2x32_p
from reference import RULES, array, assert_close, attention_jnp, attention_np, normal

import jattn
from jattn import dropout, masks


def test_threefry_is_bit_identical_to_jax():
  rng = np.random.default_rng(0)
  words = [array(rng.integers(0, 2**32, size=(64,), dtype=np.uint32)) for _ in range(4)]
  want = threefry2x32_p.bind(*words)
  got = dropout.threefry2x32(words[:2], words[2:])
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


# One grid for the statistical tests: keep_mask's operations compile once for its shape.
GRID = masks.index_grid(2, 4, 128, 128)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction(rate):
  keep = dropout.keep_mask(jax.random.key(1), rate, *GRID)
  assert keep.shape == (2, 4, 128, 128) and keep.dtype == jnp.bool_
  assert abs(float(keep.mean()) - (1 - rate)) < 0.01  # 131072 draws: sd 0.0014


def test_rate_zero_keeps_everything():
  assert bool(dropout.keep_mask(jax.random.key(1), 0.0, *GRID).all())


def test_mask_is_a_function_of_indices_only():
  """A tile drawn on its own equals the same tile of the full grid."""
  keep_mask = jax.jit(dropout.keep_mask, static_argnums=1)  # eagerly: every operation alone
  rng = jax.random.key(7)
  full = keep_mask(rng, 0.3, *masks.index_grid(2, 3, 20, 24))
  b, h = jnp.array(1).reshape(1, 1, 1, 1), jnp.array(2).reshape(1, 1, 1, 1)
  q = jnp.arange(8, 16).reshape(1, 1, -1, 1)
  kv = jnp.arange(4, 20).reshape(1, 1, 1, -1)
  np.testing.assert_array_equal(keep_mask(rng, 0.3, b, h, q, kv)[0, 0], full[1, 2, 8:16, 4:20])
  # The same rng as a typed key or a legacy PRNGKey draws the same mask.
  legacy = keep_mask(jax.random.PRNGKey(7), 0.3, *masks.index_grid(2, 3, 20, 24))
  np.testing.assert_array_equal(legacy, full)


def test_masks_differ_across_rng_batch_and_head():
  a = np.asarray(dropout.keep_mask(jax.random.key(0), 0.5, *GRID))
  b = np.asarray(dropout.keep_mask(jax.random.key(1), 0.5, *GRID))
  assert 0.4 < (a != b).mean() < 0.6
  assert 0.4 < (a[0, 0] != a[1, 0]).mean() < 0.6
  assert 0.4 < (a[0, 0] != a[0, 1]).mean() < 0.6


def _qkv(B=2, T=5, S=6, N=4, K=2, H=4):
  return normal((B, T, N, H)), normal((B, S, K, H), seed=1), normal((B, S, K, H), seed=2)


@functools.cache
def _reference_grads(rate, key, broadcast):
  """Autodiff of the formula, causal, dropout with ``rate`` and ``jax.random.key(key)`` (its
  (b=0, h=0) pattern for every batch row and head if ``broadcast``): one program, computed
  once for the cases that share it."""
  q, k, v = _qkv()
  B, T, N, S = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
  grid = masks.index_grid(1, 1, T, S) if broadcast else masks.index_grid(B, N, T, S)
  keep = jnp.broadcast_to(dropout.keep_mask(jax.random.key(key), rate, *grid), (B, N, T, S))
  causal = np.tril(np.ones((T, S), bool))
  loss = lambda *a: jnp.sum(attention_jnp(*a, allowed=causal, keep=keep, rate=rate)[0] ** 2)
  return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
def test_attention_dropout_matches_reference(backward):
  q, k, v = _qkv()
  rng, rate = jax.random.key(3), 0.25
  keep = dropout.keep_mask(rng, rate, *masks.index_grid(2, 4, 5, 6))
  causal = np.tril(np.ones((5, 6), bool))
  out, lse = jax.jit(  # one program (eagerly, every operation would compile alone)
    lambda *a: jattn.dot_product_attention(
      *a,
      is_causal=True,
      dropout_rate=rate,
      dropout_rng=rng,
      backward=backward,
      return_residual=True,
    )
  )(q, k, v)
  want, want_lse = attention_np(q, k, v, allowed=causal, keep=np.asarray(keep), rate=rate)
  assert_close(out, want)
  assert_close(lse, want_lse)  # dropout acts after the softmax: lse is unchanged
  grads = jax.jit(
    jax.grad(
      lambda *a: jnp.sum(
        jattn.dot_product_attention(
          *a, is_causal=True, dropout_rate=rate, dropout_rng=rng, backward=backward
        )
        ** 2
      ),
      (0, 1, 2),
    )
  )(q, k, v)
  for a, b in zip(grads, _reference_grads(rate, 3, broadcast=False)):
    assert_close(a, b, factor=5)


def test_dropout_is_unbiased():
  q, k, v = _qkv(B=1, T=3, S=8, N=2, K=2)
  rngs = jax.random.split(jax.random.key(0), 2000)
  outs = jax.vmap(functools.partial(jattn.dot_product_attention, q, k, v, dropout_rate=0.2))(
    dropout_rng=rngs
  )
  mean = np.asarray(outs).mean(0)
  np.testing.assert_allclose(mean, jattn.dot_product_attention(q, k, v), atol=0.03)
  assert np.asarray(outs).std(0).min() > 0.01  # and it does drop something


def test_same_rng_same_output_and_rate_zero_ignores_rng():
  q, k, v = _qkv()
  f = lambda rng, rate: jattn.dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=rng)
  np.testing.assert_array_equal(f(jax.random.key(5), 0.3), f(jax.random.key(5), 0.3))
  assert not np.array_equal(f(jax.random.key(5), 0.3), f(jax.random.key(6), 0.3))
  np.testing.assert_array_equal(f(jax.random.key(5), 0.0), jattn.dot_product_attention(q, k, v))


# The default run keeps xla's custom_vjp; blockwise's and autodiff's cases are exhaustive
# (test_blockwise.py's sweep draws blockwise's dropout against the float64 formula by default).
@pytest.mark.parametrize(
  "rule",
  [
    r if r == "custom_vjp" else pytest.param(r, marks=pytest.mark.exhaustive) for r in sorted(RULES)
  ],
)
def test_broadcast_dropout_shares_one_pattern_across_batch_and_heads(rule):
  B, T, S, N = 2, 5, 6, 4
  q, k, v = _qkv()
  rng, rate = jax.random.key(7), 0.4
  # The pattern broadcast_dropout uses is the (b=0, h=0) one of the per-head draw.
  keep = np.broadcast_to(
    np.asarray(dropout.keep_mask(rng, rate, *masks.index_grid(1, 1, T, S))), (B, N, T, S)
  )
  f = lambda *a: jattn.dot_product_attention(
    *a, is_causal=True, dropout_rate=rate, dropout_rng=rng, broadcast_dropout=True, **RULES[rule]
  )
  causal = np.tril(np.ones((T, S), bool))
  want, _ = attention_np(q, k, v, allowed=causal, keep=keep, rate=rate)
  # Jitted (eagerly, every operation would compile and run alone).
  assert_close(jax.jit(f)(q, k, v), want)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2)))(q, k, v)
  for a, b in zip(grads, _reference_grads(rate, 7, broadcast=True)):
    assert_close(a, b, factor=5)
  # Without it, heads and rows draw their own patterns: the outputs differ.
  independent = jax.jit(
    lambda *a: jattn.dot_product_attention(
      *a, is_causal=True, dropout_rate=rate, dropout_rng=rng, **RULES[rule]
    )
  )(q, k, v)
  assert not np.allclose(independent, want)


def test_broadcast_dropout_must_be_a_bool():
  q, k, v = _qkv()
  with pytest.raises(TypeError, match="broadcast_dropout must be a bool"):
    jattn.dot_product_attention(q, k, v, broadcast_dropout="yes")
