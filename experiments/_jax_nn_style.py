"""The baseline of experiments/accuracy.py where jax.nn cannot express a case: jax.nn's XLA
attention written out, with the features it lacks (score functions, soft cap, dropout) added
where jattn applies them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn import masks

# The dtypes whose logits jax.nn computes with a dot algorithm preset (float32 accumulation).
PRESETS = {
  np.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
  np.dtype(np.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
}


LOGITS = "BTKGH,BSKH->BKGTS"


@functools.cache
def precision(dtype, q_shape: tuple, k_shape: tuple):
  """The precision jax.nn's logits einsum runs with: its preset for ``dtype``, unless the
  backend rejects it for these shapes (float16 on CPU; bfloat16 dots small enough for XLA's
  elemental emitter), when jax.nn catches the error and uses the default."""
  preset = PRESETS.get(np.dtype(dtype))
  if preset is None:
    return None
  try:
    jnp.einsum(
      LOGITS,
      jnp.zeros(q_shape, dtype),
      jnp.zeros(k_shape, dtype),
      precision=preset,
      preferred_element_type=jnp.float32,
    ).block_until_ready()
  except Exception:  # as jax.nn's bare except
    return None
  return preset


def jax_nn_style(
  query,
  key,
  value,
  bias=None,
  *,
  scale,
  allowed=None,
  score_fn=None,
  soft_cap=None,
  keep=None,
  dropout_rate=0.0,
):
  """jax.nn's XLA attention (jax/_src/nn/functions.py, _dot_product_attention_core) with the
  features it lacks added where jattn applies them: float32 logits from the input dtype,
  then bias, score_fn, soft cap, masking with jax.nn's large negative number, the softmax in
  float32, dropout on the probabilities, probabilities cast to the input dtype, einsum with
  the values. Returns (out, lse) like jax.nn with return_residual=True."""
  Bq, Tq, Nq, Hq = query.shape
  _, Sk, Kk, _ = key.shape
  G = Nq // Kk
  logits_dtype = jnp.promote_types(query.dtype, np.float32)
  q = query.reshape(Bq, Tq, Kk, G, Hq)
  logits = jnp.einsum(
    LOGITS,
    q,
    key,
    precision=precision(query.dtype, q.shape, key.shape),
    preferred_element_type=logits_dtype,
  ).reshape(Bq, Nq, Tq, Sk)
  logits *= jnp.array(scale, dtype=logits.dtype)
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    logits = (logits + bias).astype(logits.dtype)
  if score_fn is not None:
    logits = score_fn(logits, *masks.index_grid(Bq, Nq, Tq, Sk))
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  if allowed is not None:
    large_negative = jnp.asarray(-0.7 * np.finfo(np.float32).max, np.float32)
    logits = jnp.where(jnp.asarray(allowed), logits, large_negative.astype(logits.dtype))
  logits = logits.astype(np.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  if keep is not None:
    probs = jnp.where(jnp.asarray(keep), probs / (1.0 - dropout_rate), 0.0)
  probs = probs.astype(key.dtype).reshape(Bq, Kk, G, Tq, Sk)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, value).reshape(Bq, Tq, Nq, Hq)
  lse = jax.nn.logsumexp(logits, axis=-1).astype(key.dtype).transpose(0, 2, 1)
  return out, lse
