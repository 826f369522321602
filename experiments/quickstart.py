"""jattn in one minute: drop-in parity with jax.nn, index-function masks, score functions,
dropout, and the two backward rules. Run: python -m experiments.quickstart
"""

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks, scores


def max_diff(a, b):
  """Largest difference relative to the largest magnitude, over all arrays of a pytree."""
  return max(
    float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def main():
  B, T, N, K, H = 2, 256, 8, 2, 64  # grouped-query attention: 8 query heads share 2 K/V heads
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (B, T, N, H))
  k = jax.random.normal(kk, (B, T, K, H))
  v = jax.random.normal(kv, (B, T, K, H))
  loss = lambda attn: lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
  grad = lambda attn: jax.jit(jax.grad(loss(attn), (0, 1, 2)))  # compiled whole: one program

  print("1. Drop-in for jax.nn.dot_product_attention (causal GQA, float32)")
  reference = lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)
  ref, ref_grads = jax.jit(reference)(q, k, v), grad(reference)(q, k, v)
  for backward in ("autodiff", "custom_vjp"):
    attn = lambda *a: jattn.dot_product_attention(*a, is_causal=True, backward=backward)
    out, grads = jax.jit(attn)(q, k, v), grad(attn)(q, k, v)
    print(
      f"   backward={backward!r:13} relative difference to jax.nn: output "
      f"{max_diff(out, ref):.1e}, gradients {max_diff(grads, ref_grads):.1e}"
    )

  print("\n2. Masks as functions of indices: packed documents, causal, sliding window")
  doc_ids = jnp.repeat(jnp.array([[0, 1, 2, 3], [0, 0, 1, 1]]), T // 4, axis=1)  # (B, T)
  mask = masks.segments(doc_ids) & masks.causal() & masks.sliding_window(48, 0)
  print(f"   mask = {mask!r}")
  out = jattn.dot_product_attention(q, k, v, mask=mask)
  view = mask.block_view(T, T, block_q=64, block_kv=64)
  counts = {
    name: int((view == c).sum())
    for name, c in (("empty", masks.EMPTY), ("partial", masks.PARTIAL), ("full", masks.FULL))
  }
  print(f"   64x64 tiles over both batch rows: {counts} (a tiled kernel skips the empty ones)")
  dense = jattn.dot_product_attention(q, k, v, mask=mask.materialize(T, T))
  print(f"   same as the dense boolean mask: relative difference {max_diff(out, dense):.1e}")

  print("\n3. Score functions: ALiBi and logit soft-capping (Gemma 2)")
  slopes = 2.0 ** (-8.0 * jnp.arange(1, N + 1) / N)
  out = jattn.dot_product_attention(
    q, k, v, is_causal=True, score_fn=scores.alibi(slopes), logits_soft_cap=30.0
  )
  print(f"   output {out.shape} {out.dtype}, finite: {bool(jnp.all(jnp.isfinite(out)))}")

  print("\n4. Dropout on the attention weights, reproducible from (rng, b, n, t, s)")
  a = jattn.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=kd)
  b = jattn.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=kd)
  print(f"   same rng, same output: {bool(jnp.array_equal(a, b))}")

  print("\n5. Rows with nothing to attend to give zeros, never NaN")
  out, lse = jattn.dot_product_attention(
    q, k, v, key_value_seq_lengths=jnp.array([0, T], jnp.int32), return_residual=True
  )
  print(
    f"   batch row 0 (no keys): output all zero {bool(jnp.all(out[0] == 0))}, "
    f"lse {float(lse[0, 0, 0])}; jax.nn would return the mean of the values"
  )
  grads = grad(
    lambda *a: jattn.dot_product_attention(
      *a, key_value_seq_lengths=jnp.array([0, T], jnp.int32), backward="custom_vjp"
    )
  )(q, k, v)
  print(f"   gradients finite: {all(bool(np.isfinite(np.asarray(g)).all()) for g in grads)}")


if __name__ == "__main__":
  main()
