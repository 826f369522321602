"""The ground truth of experiments/accuracy.py (and tests/test_adversarial.py): attention in
NumPy, forward and backward by hand, under jattn's contract, in float32 or float64."""

from __future__ import annotations

import numpy as np


def attention_reference(
  q,
  k,
  v,
  bias,
  ct,
  *,
  scale: float,
  dtype,
  allowed=None,
  score=None,
  d_score=None,
  keep=None,
  rate: float = 0.0,
) -> dict:
  """NumPy attention in ``dtype`` (float32 or float64), forward and, by hand, the backward of
  ``sum(out * ct)``, under jattn's contract: every finite score takes part in the softmax,
  masked (``allowed`` False) and -inf scores do not, and rows left with nothing give zeros,
  lse -inf and zero gradients.

  q, ct (B, T, N, H); k, v (B, S, K, H); bias and allowed broadcast to (B, N, T, S);
  ``score(s, b, h, q, kv)`` modifies the logits and ``d_score`` is its derivative in s;
  ``keep`` is dropout's keep mask. Returns out, lse (B, T, N), dq, dk, dv and dbias (bias's
  shape), all in ``dtype``.
  """
  up = lambda x: None if x is None else np.asarray(np.asarray(x, np.float32), dtype)
  q, k, v, ct, bias = (up(x) for x in (q, k, v, ct, bias))
  Bq, Tq, Nq, Hq = q.shape
  _, Sk, Kk, _ = k.shape
  G = Nq // Kk
  kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  scale = dtype(scale)
  s0 = scale * np.einsum("btnh,bsnh->bnts", q, kr)
  if bias is not None:
    s0 = s0 + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  idx = (
    np.arange(Bq).reshape(-1, 1, 1, 1),
    np.arange(Nq).reshape(1, -1, 1, 1),
    np.arange(Tq).reshape(1, 1, -1, 1),
    np.arange(Sk).reshape(1, 1, 1, -1),
  )
  s = s0 if score is None else np.asarray(score(s0, *idx), dtype)
  use = s > -np.inf
  if allowed is not None:
    use = use & allowed
  m = np.max(np.where(use, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
  m = np.where(np.isfinite(m), m, 0).astype(dtype)
  e = np.where(use, np.exp(np.where(use, s, m) - m), 0).astype(dtype)
  l = e.sum(-1, keepdims=True)
  p = e / np.where(l > 0, l, 1)
  lse = np.where(l > 0, np.log(np.where(l > 0, l, 1)) + m, -np.inf)[..., 0].transpose(0, 2, 1)
  p_used = p if keep is None else np.where(keep, p / dtype(1 - rate), 0).astype(dtype)
  out = np.einsum("bnts,bsnh->btnh", p_used, vr)

  d_p_used = np.einsum("btnh,bsnh->bnts", ct, vr)
  d_p = d_p_used if keep is None else np.where(keep, d_p_used / dtype(1 - rate), 0)
  d_s = p * (d_p - np.sum(p * d_p, axis=-1, keepdims=True))
  if d_score is not None:
    d_s = d_s * np.asarray(d_score(s0, *idx), dtype)
  group_sum = lambda x: x.reshape(Bq, Sk, Kk, G, Hq).sum(3)
  grads = dict(
    dq=scale * np.einsum("bnts,bsnh->btnh", d_s, kr),
    dk=group_sum(scale * np.einsum("bnts,btnh->bsnh", d_s, q)),
    dv=group_sum(np.einsum("bnts,btnh->bsnh", p_used, ct)),
  )
  if bias is not None:
    shape = (1,) * (4 - bias.ndim) + bias.shape
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and d_s.shape[i] != 1)
    grads["dbias"] = d_s.sum(axes, keepdims=True).reshape(bias.shape)
  return dict(out=out, lse=lse, **grads)
