"""The ring strategy of :func:`jattn.parallel.context_parallel_attention`: its own checks,
the ring's settings, and the choice of each shard pair's kernel (the ring's blockwise loops,
or a kernel of the selection table: one that tabulates its masks per pair, splash on a TPU,
or one run per pair, flex on a GPU), as the one-device call chooses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jattn import _validate, attention, masks, testing
from jattn._validate.keywords import options_of
from jattn._validate.options import Options
from jattn.impl import common, contract, select, splash
from jattn.impl.contract import CallSpec
from jattn.parallel import _choices, _kernel_pairs, _ring, _splash_pairs, _split
from jattn.parallel.layouts import _natural_mask, shard_positions

__all__ = ["ring"]


def ring(
  query: Any,
  key: Any,
  value: Any,
  bias: Any,
  mask: Any,
  split: _split.Split,
  keywords: dict[str, Any],
  *,
  strategy: str = "ring",
) -> Any:  # the output, with the lse and max logit where asked for
  """The ring over ``split``'s sequence axis (with USP, Ulysses inside each ring step over
  ``split.ulysses``); ``keywords`` as the one-device call's."""
  options = _options(keywords, strategy)
  # Segment ids travel with their shards rather than as a Mask: checked separately below.
  # The pairs run blockwise here; the pairs' own implementation is options'.
  segment_ids = keywords.pop("segment_ids", None)
  lengths = (np.shape(query)[-3], np.shape(key)[-3])
  mask = _natural_mask(mask, split.layout, split.size, lengths)  # natural order, as indices
  blockwise = dataclasses.replace(options, implementation="blockwise")
  q, k, v, spec = _validate.build(query, key, value, bias, mask, dict(keywords, options=blockwise))
  spec = contract.rank4(spec)
  if spec.unbatched:
    raise ValueError(
      f"ring_attention needs batched inputs: query (B, T, N, H), got shape {q.shape}"
    )
  B, T, N, S, K = spec.B, spec.T, spec.N, spec.S, spec.K
  split.check_shapes(B, T, S, N, K)
  if spec.implementation == "xla":  # nothing to ring (an empty B, T, S, N or H): as one call
    return attention.returned(*attention.attend(q, k, v, spec))
  q_ids, kv_ids = _split.segment_rows(segment_ids, B, T, S) or (None, None)
  soft_cap = keywords.get("logits_soft_cap")
  soft_cap = None if soft_cap is None else float(soft_cap)
  assert spec.block_q is not None and spec.block_kv is not None, "blockwise's tiles are set"
  backend = testing.target_backend() or jax.default_backend()
  blocks_named = (options.block_q, options.block_kv)
  # Each device asks the selection table for a fused kernel per pair (flex on a GPU).
  kernels = blocks_named == (None, None) and _kernel_pairs.wanted(options.implementation, backend)
  pairs = _pairs(
    options.implementation,
    spec,
    q.dtype,
    split.layout,
    split.size,
    segments=None if q_ids is None else masks.segments(q_ids, kv_ids),
    soft_cap=soft_cap,
    blocks_named=blocks_named,
    beside=_beyond_splash(bias, keywords.get("score_fn"), spec),
    kernels=kernels,
  )
  named = options.implementation
  settings = _ring.Ring(
    axis_name=split.axis_name,
    size=split.size,
    layout=split.layout,
    q_len=T,
    kv_len=S,
    scale=spec.scale,
    soft_cap=soft_cap,
    block_q=spec.block_q,
    block_kv=spec.block_kv,
    batch_axis=split.batch_axis,
    head_axis=split.head_axis,
    ulysses=split.ulysses,
    pairs=pairs,
    dropout_rate=spec.dropout_rate,
    broadcast_dropout=spec.broadcast_dropout,
    max_logit=spec.return_max_logit,
    try_kernels=kernels,
    kernel_named=named if named in _kernel_pairs.KERNELS else None,
  )
  out, lse, top = _ring.call(
    q,
    k,
    v,
    q_ids,
    kv_ids,
    spec.mask,
    spec.bias,
    spec.score_fn,
    spec.dropout_rng,
    ring=settings,
    mesh=split.mesh,
  )
  if spec.sinks is not None:  # added once the ring has combined every shard's keys
    sinks = _ring.place(spec.sinks, split.mesh, P(split.head_axis))  # sharded like N
    spec = dataclasses.replace(spec, sinks=sinks)
  return attention.returned(*common.finish(out, lse, top, spec, q.dtype, False))


def _options(keywords: dict[str, Any], strategy: str) -> Options:
  """The Routing keywords taken out of ``keywords``, checked for the ring: no backward rule
  (the ring has its own), an implementation that runs shard pairs."""
  if (backward := keywords.get("backward")) is not None:
    raise ValueError(
      f"backward must be None with strategy={strategy!r}, whose shard pairs differentiate by the "
      f"ring's own rule (a custom_vjp that rings the gradients), got {backward!r}; "
      f"strategy='all_gather' or 'ulysses' runs each device's part by any rule"
    )
  _check_pairs(keywords.get("implementation"))  # before Options, which would list every one
  options = options_of(keywords)
  _check_pairs(options.implementation)
  if options.backward is not None:
    raise ValueError(
      f"options.backward must be None: ring attention has its own backward rule, got "
      f"{options.backward!r}"
    )
  return options


def _beyond_splash(bias: Any, score_fn: Any, spec: CallSpec) -> str | None:
  """What the ring's splash pairs do not take (they run segment ids, masks and a soft cap)."""
  for name, given in (("a bias", bias is not None), ("a score_fn", score_fn is not None)):
    if given:
      return name
  if spec.return_max_logit:
    return f"return_max_logit: {select.TABLE['splash'].max_logit}"
  return "dropout" if spec.dropout_rate else None


# The ring's own blockwise loops, or per pair a kernel that tabulates its masks (splash,
# through _splash_pairs) or one the table runs (_kernel_pairs).
_PAIRS = ("blockwise", *select.STATIC_MASKS, *_kernel_pairs.KERNELS)


def _check_pairs(implementation: Any) -> None:
  if implementation not in (None, *_PAIRS):
    raise ValueError(
      f"implementation must be one of {list(_PAIRS)} or None, got {implementation!r}"
    )


def _pairs(
  implementation: str | None,
  spec: CallSpec,
  dtype: DTypeLike,
  layout: str,
  size: int,
  *,
  segments: masks.Mask | None,
  soft_cap: float | None,
  blocks_named: tuple[int | None, int | None],
  beside: str | None,
  kernels: bool,
) -> _splash_pairs.Pairs | None:
  """The splash kernels of each shard pair (:mod:`jattn.parallel._splash_pairs`), or None.

  A pair runs splash only where the one-device call would: the pair's own call (its shard
  lengths, segment ids, soft cap and dtype, always returning the log-sum-exp the ring
  merges) goes through splash's row of the selection table, and an explicit
  ``implementation="splash"`` the table refuses raises with the table's reason.
  """
  backend = testing.target_backend() or jax.default_backend()
  blockwise = lambda why: _choices.record(
    select.Choice("blockwise", None, f"each shard pair runs blockwise: {why}", {}, backend)
  )
  if implementation == "blockwise":
    blockwise("named by the caller")
    return None
  if implementation in _kernel_pairs.KERNELS and blocks_named != (None, None):
    raise ValueError(
      f"the ring's shard pairs through implementation={implementation!r} take no block_q or "
      f"block_kv: they are blockwise's tiles (the kernel's come from its own table)"
    )
  if kernels:  # the pairs' kernel is chosen, and recorded, on each device (_kernel_pairs)
    return None
  interpret = testing.interpreting()
  why = beside or _splash_pairs.reason(spec.mask)
  if why is None and blocks_named != (None, None):
    why = "block_q and block_kv are blockwise's tiles"
  if why is None:
    why = _pair_reason(spec, dtype, size, segments, soft_cap, backend)
  if implementation is None:
    if why is not None or backend != "tpu" or testing.portable():  # several platforms
      blockwise(f"splash does not express a pair's call: {why}" if why else "not on a TPU")
      return None
  elif why is not None:
    raise ValueError(f"ring_attention(implementation='splash') does not support {why}")
  elif not interpret and backend != "tpu":
    raise ValueError(
      "ring_attention(implementation='splash') needs a TPU (jattn.testing.interpret_kernels() "
      "runs it in Pallas interpret mode, for tests)"
    )
  named = "named by the caller" if implementation else "the fused kernel for TPU"
  reason = f"splash runs each shard pair ({named}), the pair's mask tabulated"
  _choices.record(select.Choice("splash", None, reason, {}, backend))
  return _splash_pairs.plan(
    spec.mask,
    layout=layout,
    size=size,
    q_len=spec.T,
    kv_len=spec.S,
    positions=shard_positions,
  )


def _pair_reason(
  spec: CallSpec,
  dtype: DTypeLike,
  size: int,
  segments: masks.Mask | None,
  soft_cap: float | None,
  backend: str,
) -> str | None:
  """Why splash's table row refuses one shard pair's call (see :func:`_pairs`), or None."""
  t, s = spec.T // size, spec.S // size
  block_q, block_kv = splash.resolve_blocks(None, None, t, s)
  pair = _splash_pairs.pair_spec(
    shapes=((spec.B, t, spec.N, spec.H), (spec.B, s, spec.K, spec.H), (spec.B, s, spec.K, spec.Hv)),
    segments=segments,
    scale=spec.scale,
    soft_cap=soft_cap,
    block_q=block_q,
    block_kv=block_kv,
    interpret=testing.interpreting(),
  )
  call = select.Call(
    spec=pair,
    dtype=np.dtype(dtype),
    backend=backend,
    backward_named=False,
    blocks_named=False,
  )
  why = select.why_not("splash", call, device=False)
  if why is not None and soft_cap is not None and why.startswith("return_residual"):
    # The caller may not have asked for the lse: say why the pairs need it.
    why = (
      f"logits_soft_cap: every shard pair returns its log-sum-exp for the ring to merge and "
      f"differentiate, and splash does not support {why}"
    )
  return why
