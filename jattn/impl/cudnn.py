"""``implementation="cudnn"``: jax.nn's cuDNN flash-attention kernel, from a jattn call spec.

``jax.nn.dot_product_attention(implementation="cudnn")`` runs NVIDIA's fused kernel (with
its fused backward) for bfloat16/float16 inputs. It takes jax.nn's masking arguments, so
:func:`arguments` translates the spec's one combined mask back into them: ``causal()`` into
``is_causal``, a window into ``local_window_size``, :func:`jattn.masks.lengths` into the
sequence lengths, dense arrays into ``mask``. Anything else has no cuDNN form
(:func:`reason`).

Where its semantics differ from jattn's contract, read from jax's
``_src/cudnn/fused_attention_stablehlo.py``: a boolean mask becomes an additive bias of a
large negative number, so a row the mask empties returns the mean of the values (jattn:
zeros); its backward drops the log-sum-exp's cotangent (here the returned log-sum-exp is
``stop_gradient``-ed, so that is visible rather than silently wrong). ``implementation=None``
therefore routes to cuDNN only calls where neither can matter (:func:`auto_reason`): no
bias, no mask array, no lengths, causal or a left window only with T == S (every row keeps
its diagonal), no ``return_residual``, head dim a multiple of 8 up to 128, and bfloat16
only (its float16 gradients in saturated rows measured far worse than jax.nn's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.impl import contract, orders, sharded
from jattn.impl.contract import CallSpec
from jattn.masks import core, kinds

__all__ = ["IMPLEMENTATION", "attention", "reason", "auto_reason"]

BACKWARDS: tuple[str, ...] = ()  # cuDNN's own fused backward


def _translate(spec: CallSpec) -> tuple[dict[str, Any] | None, str | None]:
  """(jax.nn masking keywords, None) or (None, why not)."""
  out: dict[str, Any] = dict(is_causal=False, local_window_size=None, mask=None)
  arrays, windows = [], []
  for part in core.conjuncts(spec.mask):
    if isinstance(part, kinds.Causal) and part.offset == 0:
      out["is_causal"] = True
    elif isinstance(part, kinds.SlidingWindow) and part.dilation == 1:
      windows.append(part)
    elif isinstance(part, kinds.Lengths) and "lengths" not in out:
      out["lengths"] = part
    elif isinstance(part, kinds.FromArray):
      arrays.append(part.array)
    elif isinstance(part, kinds.Segments):
      return None, "segment_ids (jax.nn's cuDNN call takes none)"
    else:
      return None, f"mask {part!r} has no cuDNN form"
  if len(windows) > 1:
    return None, "more than one sliding window"
  if windows:
    (w,) = windows
    right = w.right if not out["is_causal"] else (0 if w.right is None or w.right >= 0 else -1)
    if right != 0:
      return None, f"mask {w!r}: cuDNN's window is left-only, (pos - left, pos]"
    if w.left is None:
      out["is_causal"] = True
    else:
      out["local_window_size"] = (w.left, 0)
  if arrays:
    mask = arrays[0]
    for a in arrays[1:]:
      mask = jnp.logical_and(mask, a)
    out["mask"] = mask
  return out, None


def reason(spec: CallSpec) -> str | None:
  """Why jax.nn's cuDNN call cannot express ``spec``; None when it can."""
  if spec.H % 8 or spec.H > 256:
    return f"head dim H={spec.H} (cuDNN takes multiples of 8 up to 256)"
  if spec.Hv != spec.H:
    return f"value head dim {spec.Hv} != H={spec.H} (jax.nn's call takes value shaped like key)"
  return _translate(spec)[1]


def auto_reason(spec: CallSpec, dtype: np.dtype) -> str | None:
  """Why ``implementation=None`` does not route an expressible ``spec`` to cuDNN."""
  if dtype.name != "bfloat16":
    return (
      f"{dtype.name}: cuDNN's dq error in saturated float16 rows measured 430 times "
      "jax.nn's XLA path's on an H100 (docs/numerics.md)"
    )
  if spec.H > 128:
    return f"head dim H={spec.H} > 128 needs a Hopper GPU or later"
  if spec.bias is not None:
    return "bias (cuDNN's bias gradient has shape limits; not routed automatically)"
  if spec.return_residual:
    return "return_residual (cuDNN's backward drops the log-sum-exp's cotangent)"
  keywords, _ = _translate(spec)
  assert keywords is not None
  if keywords["mask"] is not None or "lengths" in keywords:
    return "a mask array or lengths can empty rows, which cuDNN fills with the values' mean"
  if (keywords["is_causal"] or keywords["local_window_size"]) and spec.T != spec.S:
    return f"causal or windowed with T={spec.T} != S={spec.S}"
  return None


def attention(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array]:
  """``(out (B, T, N, H), lse (B, T, N))`` from jax.nn's cuDNN kernel; lse is not
  differentiable (zeros unless ``spec.return_residual``)."""
  keywords, _ = _translate(spec)
  assert keywords is not None
  lengths = keywords.pop("lengths", None)
  if lengths is not None:
    B, T, S = spec.B, spec.T, spec.S
    keywords["query_seq_lengths"] = jnp.broadcast_to(
      jnp.asarray(T if lengths.q_lengths is None else lengths.q_lengths, jnp.int32), (B,)
    )
    keywords["key_value_seq_lengths"] = jnp.broadcast_to(
      jnp.asarray(S if lengths.kv_lengths is None else lengths.kv_lengths, jnp.int32), (B,)
    )
  # jax.nn overloads return_residual as Literal[False] -> Array and Literal[True] -> (Array,
  # Array); each value of a bool matches one, but mypy matches no overload for a bool.
  result = jax.nn.dot_product_attention(  # type: ignore[call-overload]
    query,
    key,
    value,
    spec.bias,
    scale=spec.scale,
    implementation="cudnn",
    return_residual=spec.return_residual,
    **keywords,
  )
  if spec.return_residual:
    out, lse = result
    return out, jax.lax.stop_gradient(lse.astype(jnp.float32))
  return result, jnp.zeros((spec.B, spec.T, spec.N), jnp.float32)


def _run(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  return sharded.per_shard(_first_order, query, key, value, spec)


def _first_order(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> sharded.Results:
  """:func:`attention` with jax.nn's gradients, whose forward mode and second derivatives
  are refused in jattn's words (JAX's are about a custom_vjp and the kernel's internals).
  No max logit: the table refuses return_max_logit."""
  out, lse = orders.reverse_once(attention, "implementation='cudnn'", orders.FUSED)(
    query, key, value, spec
  )
  return out, lse, None


IMPLEMENTATION = contract.Implementation(
  name="cudnn",
  runs_on=("gpu",),
  backwards=BACKWARDS,
  masks=(
    "jax.nn's: a boolean array, causal (offset 0), a left window, lengths; auto routes "
    "only bfloat16 calls with no mask, or causal/left windows with T == S (no empty rows)"
  ),
  run=_run,
  dtypes=("bfloat16", "float16"),
  score_fn="cuDNN has no score function",
  soft_cap="cuDNN has no soft cap",
  dropout="jax.nn's cuDNN call has no dropout",
  sinks="jax.nn's cuDNN call has no sinks",
  max_logit="jax.nn's cuDNN call keeps its running max to itself",
  fused=True,
  check=lambda call: reason(call.spec),
  auto_check=lambda call: auto_reason(call.spec, call.dtype),
)
