"""QK-clip: per-head scales for the query and key projections, from the attention's max logits.

MuonClip (Kimi K2) keeps attention logits bounded in training: after each optimizer step,
every head whose largest logit exceeded a threshold τ has its query and key projection
weights rescaled, so that its logits shrink by ``η = min(1, τ / max_logit)``. The query
side takes ``η**alpha`` and the key side ``η**(1 - alpha)`` (``alpha = 0.5`` splits it
evenly). :func:`qk_clip_scales` computes those factors from the max logits that
``jattn.dot_product_attention(..., return_max_logit=True)`` returns (or the Flax modules
sow with ``sow_max_logit=True``), the largest over the batch, the positions and, inside a
``shard_map``, the data-parallel devices. Shape legend as in :mod:`jattn.attention`.

A training step, for one attention layer whose projections are (F, N, H) and (F, K, H)::

    loss, grads, max_logits = step(params, batch)      # max_logits: (B, T, N) of the layer
    params = optimizer_update(params, grads)
    q_scale, k_scale = jattn.qk_clip_scales(max_logits, threshold=100.0, num_kv_heads=K)
    params["query"]["kernel"] *= q_scale[None, :, None]  # (F, N, H) * (1, N, 1)
    params["key"]["kernel"] *= k_scale[None, :, None]    # (F, K, H) * (1, K, 1)

(The projections' biases, where they have any, scale alike.) docs/attention.md shows it with
the Flax modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _checks

__all__ = ["qk_clip_scales"]


def qk_clip_scales(
  max_logits: jax.typing.ArrayLike,
  threshold: float,
  *,
  num_kv_heads: int | None = None,
  alpha: float = 0.5,
  axis_name: str | tuple[str, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The per-head factors QK-clip multiplies the query and key projections by.

  Args:
    max_logits: (..., N) float, the heads last: one layer's max logits, e.g. (B, T, N) as
      ``return_max_logit=True`` returns them. The largest over every other axis is each
      head's; -inf (a head that saw no key) or a largest at or below ``threshold`` leaves
      the head as it is.
    threshold: τ > 0, the largest logit a head may keep.
    num_kv_heads: K, the key/value heads (default N); N % K == 0. Each key head is shared by
      N // K query heads (GQA): it takes the strongest clip of its group to the power
      ``1 - alpha``, and each query head the rest of its own, so that every query head's
      logits scale by exactly its own η (a query head whose sibling was clipped is scaled
      up by as much as the shared key head is scaled down).
    alpha: the query side's share of the clip, in [0, 1].
    axis_name: mesh axes (inside ``jax.shard_map`` or ``pmap``) over which the max logits'
      batch is split: the largest is taken over those devices too (``lax.pmax``). Under
      ``jit`` with sharded arrays, the max over the batch axis already spans the devices.

  Returns:
    ``(query_scales (N,), key_scales (K,))``, float32, each in (0, 1] where K == N; with
    ``query_scales[n] * key_scales[n // G] == min(1, threshold / max_logit[n])``.

  Example::

    >>> import jax.numpy as jnp, jattn
    >>> q_scale, k_scale = jattn.qk_clip_scales(jnp.array([[50.0, 400.0]]), 100.0)
    >>> q_scale, k_scale
    (Array([1. , 0.5], dtype=float32), Array([1. , 0.5], dtype=float32))
  """
  x = _checks.as_array("max_logits", max_logits)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"max_logits must have a floating dtype, got {x.dtype}")
  if x.ndim < 1 or x.shape[-1] == 0:
    raise ValueError(f"max_logits must have shape (..., N) with N > 0 heads, got {x.shape}")
  threshold = _checks.positive_real("threshold", threshold)
  alpha = _checks.real("alpha", alpha)
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must be in [0, 1], got {alpha}")
  N = x.shape[-1]
  K = N if num_kv_heads is None else _checks.integer("num_kv_heads", num_kv_heads, minimum=1)
  if N % K:
    raise ValueError(f"the {N} heads of max_logits must be a multiple of num_kv_heads ({K})")
  largest = jnp.max(jnp.asarray(x, jnp.float32).reshape(-1, N), axis=0)
  if axis_name is not None:
    largest = jax.lax.pmax(largest, axis_name)
  eta = jnp.where(largest > threshold, threshold / largest, 1.0)  # -inf and NaN: no clip
  key = jnp.min(eta.reshape(K, N // K), axis=1) ** (1.0 - alpha)
  query = eta / jnp.repeat(key, N // K)
  return query, key
