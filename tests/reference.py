"""Independent references for the tests: NumPy float64 formulas (attention, masks,
positional encodings) and a plain jnp attention for autodiff. Nothing here imports jattn,
so a bug in jattn cannot hide in its own reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {
  np.dtype(np.float64): 1e-9,
  np.dtype(np.float32): 2e-5,
  np.dtype(jnp.bfloat16): 2e-2,
  np.dtype(np.float16): 4e-3,
}

# Every (implementation, backward) rule, as keyword arguments of
# jattn.dot_product_attention; blockwise with tiles smaller than the test
# shapes (and not dividing them), so several tiles and padding are exercised.
RULES = {
  "autodiff": dict(implementation="xla", backward="autodiff"),
  "custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=2, block_kv=3),
}


def assert_close(actual, expected, dtype=None, *, factor: float = 1.0, err_msg: str = ""):
  """Elementwise close, with an absolute tolerance scaled by the expected values' size."""
  dtype = np.dtype(dtype if dtype is not None else np.asarray(actual).dtype)
  tol = TOLERANCE[dtype] * factor
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  size = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * size, err_msg=err_msg)


def normal(shape, dtype=np.float32, seed=0):
  """Standard normal inputs from NumPy (jax.random would compile for every new shape)."""
  return array(np.random.default_rng(seed).standard_normal(shape), dtype)


def array(x, dtype=None):
  """``jnp.asarray(x, dtype)`` without compiling: jnp.asarray and jnp.array stage a program
  for every new shape and dtype (a conversion, or a copy), jax.device_put of a NumPy array
  of the final dtype none. float32 and integers are cast by NumPy, rounding to nearest even
  as XLA's conversion does; narrower floats keep XLA's conversion."""
  x = np.asarray(x)
  dtype = jax.dtypes.canonicalize_dtype(x.dtype if dtype is None else dtype)
  if dtype.kind in "biu" or dtype in (np.float32, np.float64):
    return jax.device_put(x.astype(dtype))
  return jnp.asarray(x, dtype)


def grid(B, N, T, S):
  """NumPy index grid (batch, head, q, kv) broadcasting to (B, N, T, S)."""
  return (
    np.arange(B).reshape(-1, 1, 1, 1),
    np.arange(N).reshape(1, -1, 1, 1),
    np.arange(T).reshape(1, 1, -1, 1),
    np.arange(S).reshape(1, 1, 1, -1),
  )


def attention_np(q, k, v, *, bias=None, allowed=None, scale=None, score=None, keep=None, rate=0.0):
  """Float64 attention from the formula.

  q (B, T, N, H); k, v (B, S, K, H); bias and allowed broadcast to (B, N, T, S);
  score(s, b, h, q, kv) modifies the logits; keep is the dropout keep mask.
  Returns (out (B, T, N, H), lse (B, T, N)); empty rows give zeros and -inf.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, N // K, axis=2)
  v = np.repeat(v, N // K, axis=2)
  scale = 1 / np.sqrt(H) if scale is None else scale
  s = scale * np.einsum("btnh,bsnh->bnts", q, k)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  if score is not None:
    s = score(s, *grid(B, N, T, S))
  allowed = np.ones(s.shape, bool) if allowed is None else np.broadcast_to(allowed, s.shape)
  m = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(np.where(allowed, s - m, -np.inf))
  l = p.sum(-1, keepdims=True)
  p = p / np.where(l > 0, l, 1.0)
  with np.errstate(divide="ignore"):
    lse = np.where(l > 0, np.log(l) + m, -np.inf)[..., 0].transpose(0, 2, 1)
  if keep is not None:
    p = np.where(keep, p / (1 - rate), 0.0)
  out = np.einsum("bnts,bsnh->btnh", p, v)
  return out, lse


def attention_jnp(q, k, v, bias=None, *, allowed=None, scale=None, score=None, keep=None, rate=0.0):
  """The same formula in plain jnp, for autodiff; returns (out, lse)."""
  B, T, N, H = q.shape
  K = k.shape[2]
  k = jnp.repeat(k, N // K, axis=2)
  v = jnp.repeat(v, N // K, axis=2)
  scale = 1 / np.sqrt(H) if scale is None else scale
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  s = scale * jnp.einsum("btnh,bsnh->bnts", q, k).astype(dtype)
  if bias is not None:
    s = s + bias
  if score is not None:
    s = score(s, *(jnp.asarray(i) for i in grid(B, N, T, k.shape[1])))
  allowed = jnp.ones(s.shape, bool) if allowed is None else jnp.broadcast_to(allowed, s.shape)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, s, -1e30), axis=-1, keepdims=True))
  p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, m) - m), 0.0)
  l = p.sum(-1, keepdims=True)
  safe_l = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, jnp.log(safe_l) + m, -jnp.inf)[..., 0].transpose(0, 2, 1)
  p = p / safe_l
  if keep is not None:
    p = jnp.where(keep, p / (1 - rate), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", p, v).astype(q.dtype), lse


# Mask formulas in NumPy, one per jattn.masks constructor, written from their definitions.
def causal_np(T, S, offset=0):
  q, kv = np.arange(T)[:, None], np.arange(S)[None]
  return kv <= q + offset


def window_np(T, S, left, right):
  q, kv = np.arange(T)[:, None], np.arange(S)[None]
  ok = np.ones((T, S), bool)
  if left is not None:
    ok &= kv >= q - left
  if right is not None:
    ok &= kv <= q + right
  return ok


def chunked_np(T, S, size):
  return (np.arange(T)[:, None] // size) == (np.arange(S)[None] // size)


def prefix_np(T, S, prefix):  # prefix: (B,) -> (B, 1, T, S)
  q, kv = np.arange(T)[:, None], np.arange(S)[None]
  return np.stack([(kv < p) | (kv <= q) for p in prefix])[:, None]


def segments_np(q_ids, kv_ids):  # (B, T), (B, S) -> (B, 1, T, S)
  return (np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :])[:, None]


def lengths_np(T, S, q_lens=None, kv_lens=None):
  B = len(q_lens if q_lens is not None else kv_lens)
  q_lens = [T] * B if q_lens is None else q_lens
  kv_lens = [S] * B if kv_lens is None else kv_lens
  q, kv = np.arange(T)[:, None], np.arange(S)[None]
  return np.stack([(q < a) & (kv < b) for a, b in zip(q_lens, kv_lens)])[:, None]


def global_np(T, S, n):
  return (np.arange(T)[:, None] < n) | (np.arange(S)[None] < n)


def strided_np(T, S, stride):
  return (np.arange(T)[:, None] - np.arange(S)[None]) % stride == 0


def dilated_window_np(T, S, left, right, dilation):
  d = np.arange(S)[None] - np.arange(T)[:, None]
  return window_np(T, S, left, right) & (d % dilation == 0)


def block_sparse_np(layout, block_q, block_kv, T, S):
  """A (..., nqb, nkb) block layout expanded to (..., T, S); positions past it are masked."""
  layout = np.asarray(layout)
  dense = np.repeat(np.repeat(layout, block_q, axis=-2), block_kv, axis=-1)
  out = np.zeros(layout.shape[:-2] + (T, S), bool)
  t, s = min(T, dense.shape[-2]), min(S, dense.shape[-1])
  out[..., :t, :s] = dense[..., :t, :s]
  return out


def tile_classes_np(dense, block_q, block_kv):
  """EMPTY/PARTIAL/FULL (0/1/2) per tile of a dense (B, N, T, S) bool array, by brute force."""
  B, N, T, S = dense.shape
  nq, nk = -(-T // block_q), -(-S // block_kv)
  out = np.zeros((B, N, nq, nk), np.int8)
  for i in range(nq):
    for j in range(nk):
      tile = dense[:, :, i * block_q : (i + 1) * block_q, j * block_kv : (j + 1) * block_kv]
      out[:, :, i, j] = np.where(tile.all((2, 3)), 2, np.where(tile.any((2, 3)), 1, 0))
  return out


# Positional encodings, written from the published formulas in loops (jattn's helpers are
# not called). A RoPE scaling is read by its fields (kind, factor, ...), as jattn stores it.


def sinusoidal_np(p, dim, max_timescale=10_000.0):
  """(..., dim): sin(p / max_timescale^(2i/dim)) in the first half, cos in the second."""
  p = np.asarray(p, np.float64)
  out = np.zeros(p.shape + (dim,))
  for i in range(dim // 2):
    angle = p / max_timescale ** (2 * i / dim)
    out[..., i] = np.sin(angle)
    out[..., dim // 2 + i] = np.cos(angle)
  return out


def inv_freq_np(R, base):
  return np.array([1.0 / base ** (2 * i / R) for i in range(R // 2)])


def llama3_np(R, base, factor, low_freq_factor, high_freq_factor, old_context_len):
  """Meta's ``apply_scaling`` (llama-models, Llama 3.1), transcribed."""
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  new = []
  for freq in inv_freq_np(R, base):
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      new.append(freq)
    elif wavelen > low_freq_wavelen:
      new.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      new.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(new)


def yarn_np(R, base, factor, L, beta_fast, beta_slow, truncate):
  """YaRN NTK-by-parts as in jquesnelle/yarn: a ramp in the pair index between the
  pairs that turn beta_fast and beta_slow times over L positions."""

  def pair_index(rotations):  # solve L / (2π base^(2i/R)) = rotations for i
    return R * math.log(L / (2 * math.pi * rotations)) / (2 * math.log(base))

  lo, hi = pair_index(beta_fast), pair_index(beta_slow)
  if truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, R - 1)
  width = (hi - lo) or 0.001
  out = []
  for i, theta in enumerate(inv_freq_np(R, base)):
    gamma = min(max((i - lo) / width, 0.0), 1.0)  # 0: keep, 1: interpolate
    out.append((1 - gamma) * theta + gamma * theta / factor)
  return np.array(out)


def scaled_np(R, base, s):
  """(inverse frequencies, output scale) of RopeScaling ``s`` (None: plain RoPE)."""
  if s is None:
    return inv_freq_np(R, base), 1.0
  if s.kind == "linear":
    return inv_freq_np(R, base) / s.factor, 1.0
  if s.kind == "ntk":
    return inv_freq_np(R, base * s.factor ** (R / (R - 2))), 1.0
  if s.kind == "llama3":
    return llama3_np(
      R, base, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
    ), 1.0
  mscale = s.attention_factor or 0.1 * math.log(s.factor) + 1
  return yarn_np(
    R, base, s.factor, s.original_max_position, s.beta_fast, s.beta_slow, s.truncate
  ), mscale


def rope_np(x, positions, *, base=10_000.0, rotary_fraction=1.0, scaling=None):
  """Rotate-half RoPE in float64: pair (i, i + R/2) turns by position · θ_i."""
  x = np.asarray(x, np.float64)
  unbatched = x.ndim == 3
  x = x[None] if unbatched else x
  pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])
  R = int(x.shape[-1] * rotary_fraction)
  theta, mscale = scaled_np(R, base, scaling)
  y = x.copy()
  for i in range(R // 2):
    c = np.cos(pos * theta[i])[..., None]  # (B, T, 1) against (B, T, N)
    s = np.sin(pos * theta[i])[..., None]
    a, b = x[..., i], x[..., i + R // 2]
    y[..., i] = mscale * (a * c - b * s)
    y[..., i + R // 2] = mscale * (b * c + a * s)
  return y[0] if unbatched else y


def alibi_slopes_np(n):
  """``get_slopes`` from ofirpress/attention_with_linear_biases, transcribed."""

  def get_slopes_power_of_2(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    ratio = start
    return [start * ratio**i for i in range(n)]

  if math.log2(n).is_integer():
    return get_slopes_power_of_2(n)
  closest_power_of_2 = 2 ** math.floor(math.log2(n))
  return (
    get_slopes_power_of_2(closest_power_of_2)
    + alibi_slopes_np(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
  )
