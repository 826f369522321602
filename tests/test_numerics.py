"""The numerics contract: empty rows give zeros (never NaN), statistics in float32/float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks
from reference import assert_close, attention_np, normal

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
    "kv_lengths_zero": (dict(key_value_seq_lengths=jnp.array([0, 4], jnp.int32)),
                        _rows(*[(0, t) for t in range(T)])),
    "q_lengths": (dict(query_seq_lengths=jnp.array([6, 2], jnp.int32)),
                  _rows(*[(1, t) for t in range(2, T)])),
    "segments": (dict(segment_ids=(np.array([[0, 0, 1, 1, 2, 2]] * 2),
                                   np.array([[0, 0, 1, 1], [1, 1, 1, 1]]))),
                 _rows((0, 4), (0, 5), (1, 0), (1, 1), (1, 4), (1, 5))),
    "array_row": (dict(mask=np.array([[True] * S] * (T - 1) + [[False] * S])),
                  _rows((0, 5), (1, 5))),
    "fn": (dict(mask=masks.from_fn(lambda b, h, q, kv: (q != 3) & (kv >= b))), _rows((0, 3),
                                                                                     (1, 3))),
    "bias_and_cap": (dict(mask=masks.causal(-5), bias=normal((1, N, T, S)) * 1e3,
                          logits_soft_cap=5.0), _rows(*[(b, t) for b in range(B)
                                                        for t in range(5)])),
}


def _qkv(dtype=jnp.float32):
  return (normal((B, T, N, H), dtype), normal((B, S, K, H), dtype, 1),
          normal((B, S, K, H), dtype, 2))


@pytest.mark.parametrize("backward", ["autodiff", "custom_vjp"])
@pytest.mark.parametrize("kind", list(EMPTYING))
def test_empty_rows_give_zeros_and_no_nan_or_inf(kind, backward):
  kwargs, empty = EMPTYING[kind]
  q, k, v = _qkv()
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, backward=backward, **kwargs)
  weights = normal((B, T, N, H), seed=9)
  loss = lambda q, k, v: jnp.sum(f(q, k, v) * weights)
  # No intermediate or output is inf or NaN, forward or backward, traced or not.
  with jax.debug_infs(True), jax.debug_nans(True):
    out = f(q, k, v)
    dq, dk, dv = jax.grad(loss, (0, 1, 2))(q, k, v)
    jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(dq)[empty], 0.0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  assert np.abs(np.asarray(out)[~empty]).sum() > 0 or empty.all()
  _, lse = jattn.dot_product_attention(q, k, v, backward=backward, return_residual=True, **kwargs)
  lse = np.asarray(lse)
  assert np.all(np.isneginf(lse[empty])) and np.all(np.isfinite(lse[~empty]))


def test_keys_that_no_query_sees_get_zero_gradient():
  q, k, v = _qkv()
  for backward in ("autodiff", "custom_vjp"):
    dk, dv = jax.grad(lambda k, v: jnp.sum(jattn.dot_product_attention(
        q, k, v, key_value_seq_lengths=jnp.array([2, 3], jnp.int32), backward=backward) ** 2),
                      (0, 1))(k, v)
    np.testing.assert_array_equal(np.asarray(dk)[0, 2:], 0.0)
    np.testing.assert_array_equal(np.asarray(dv)[1, 3:], 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_low_precision_keeps_statistics_in_float32(dtype):
  """A softmax over many keys: sums of 2048 small weights would stall in 16-bit floats."""
  q, k, v = (normal((1, 4, 2, 8), dtype), normal((1, 2048, 2, 8), dtype, 1),
             normal((1, 2048, 2, 8), dtype, 2))
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
    out, lse = jattn.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                           backward=backward)
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
