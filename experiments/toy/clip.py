"""QK-clip on the toy transformer: bound every head's attention logits during training.

After an optimizer step, each layer's query and key projections are scaled per head by
:func:`jattn.qk_clip_scales` of the max logits that layer sowed in the step's own forward
pass (the pass the gradients were taken from), as docs/attention.md shows for one layer:
a head whose largest logit m exceeded τ has its logits shrunk by ``min(1, τ / m)``,
``alpha`` of the shrink (in the exponent) on the query side and the rest on the key side.
The optimizer's state is left as it is. :func:`compare` sums up a clipped run against the
same rule's run without the clip from their per-step records.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jattn
from experiments.toy.model import Transformer


def qk_clip(
  model: Transformer, max_logits: Sequence[jax.Array], threshold: float, *, alpha: float = 0.5
) -> None:
  """Scales ``model``'s query and key projections in place.

  Args:
    model: a :class:`~experiments.toy.model.Transformer` (any rule).
    max_logits: each layer's max logits (B, T, N), in layer order, as
      :func:`experiments.toy.model.forward` returns them.
    threshold: τ > 0.
    alpha: the query side's share of the clip, in [0, 1].
  """
  if len(max_logits) != len(model.blocks):
    raise ValueError(f"max_logits holds {len(max_logits)} layers, the model {len(model.blocks)}")
  for block, logits in zip(model.blocks, max_logits):
    attention = block.attention
    q_scale, k_scale = jattn.qk_clip_scales(
      logits, threshold, num_kv_heads=attention.num_kv_heads, alpha=alpha
    )
    for proj, scale in ((attention.query, q_scale), (attention.key, k_scale)):
      proj.kernel[...] *= scale[None, :, None].astype(proj.kernel.dtype)  # (F, N|K, H)
      if proj.bias is not None:
        proj.bias[...] *= scale[:, None].astype(proj.bias.dtype)  # (N|K, H)


def head_max(max_logits: Sequence[jax.Array]) -> jax.Array:
  """Each layer's and head's largest logit (L, N) from per-layer max logits (B, T, N)."""
  return jnp.stack([jnp.max(m.reshape(-1, m.shape[-1]), axis=0) for m in max_logits])


def _by_layer(records: Sequence[dict]) -> list[list[list[float]]]:
  """Per layer, per step, the heads' max logits."""
  return [list(layer) for layer in zip(*(r["max_logit_heads"] for r in records))]


def _side(records: Sequence[dict], threshold: float) -> dict:
  """One run's max logits and losses."""
  logits = [r["max_logit"] for r in records]
  peak = max(range(len(logits)), key=logits.__getitem__)
  final = records[-1]
  return dict(
    peak_max_logit=logits[peak],
    peak_step=records[peak]["step"],
    final_max_logit=logits[-1],
    peak_max_logit_by_layer=[max(max(h) for h in layer) for layer in _by_layer(records)],
    steps_above_threshold=sum(m > threshold for m in logits),
    largest_rise_per_step=max((b - a for a, b in zip(logits, logits[1:])), default=0.0),
    final_loss=final["loss"],
    final_eval_loss=final["eval_loss"],
    final_eval_bits_per_token=final["eval_bits_per_token"],
  )


def compare(
  without: Sequence[dict], clipped: Sequence[dict], *, threshold: float, rule: str, alpha: float
) -> dict:
  """A clipped run against the same rule's run without the clip, from their per-step records
  (:func:`experiments.toy.training.train`'s, with ``max_logit`` and ``max_logit_heads``):
  for each, the peak max logit and its step, the final one, each layer's peak, the steps
  above τ, the largest rise from one step to the next, and the final losses."""
  return dict(
    threshold=threshold,
    rule=rule,
    alpha=alpha,
    without=_side(without, threshold),
    clipped=_side(clipped, threshold),
  )
