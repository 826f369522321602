"""The public entry of sequence-parallel attention: :func:`ring_attention`, its checks, and
the choice of each shard pair's kernel (blockwise loops, splash on a TPU, flex on a GPU)
through the selection table, as the one-device call chooses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jattn import _validate, attention, masks, testing
from jattn._validate.options import Options
from jattn.impl import common, contract, select, splash
from jattn.impl.contract import CallSpec
from jattn.parallel import _choices, _kernel_pairs, _ring, _splash_pairs
from jattn.parallel.layouts import (
  _check_divisible,
  _check_layout,
  _natural_mask,
  shard_positions,
)

__all__ = ["ring_attention"]


def ring_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  mesh: Mesh,
  axis_name: str,
  bias: jax.typing.ArrayLike | None = None,
  is_causal: bool = False,
  segment_ids: Any = None,
  mask: masks.Mask | jax.typing.ArrayLike | None = None,
  scale: float | None = None,
  query_seq_lengths: jax.typing.ArrayLike | None = None,
  key_value_seq_lengths: jax.typing.ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  logits_soft_cap: float | None = None,
  score_fn: Callable[..., jax.Array] | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  broadcast_dropout: bool = False,
  layout: str = "contiguous",
  batch_axis: str | tuple[str, ...] | None = None,
  head_axis: str | tuple[str, ...] | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  return_residual: bool = False,
  sinks: jax.typing.ArrayLike | None = None,
  implementation: str | None = None,
  options: Options | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention with the sequence sharded over mesh axis ``axis_name`` (ring attention).

  Computes what ``jattn.dot_product_attention`` computes with the same
  arguments, with the T and S axes split over the P devices of
  ``axis_name``: device i holds query shard i and key/value shard i, and the
  key/value shards (with their segment ids) travel around the ring. Inside
  each step the blockwise kernel runs, skipping tiles the mask empties. The
  backward pass is a custom_vjp that rings as well (see the module
  docstring). Works under ``jax.jit``; differentiable in query, key, value,
  bias and the score function's arrays.

  Args:
    query: (B, T, N, H). A ``jax.Array`` sharded as
      ``P(batch_axis, axis_name, head_axis, None)`` avoids any resharding;
      other inputs (NumPy arrays, unsharded or otherwise sharded arrays; key,
      value, segment ids, lengths and sinks alike) are resharded to that, under
      Auto and Explicit mesh axes alike.
    key, value: (B, S, K, H), N a multiple of K (GQA without repeating K/V).
    mesh: the ``jax.sharding.Mesh`` whose devices hold the shards.
    axis_name: the mesh axis the sequence is split over (the ring).
    bias: as in ``jattn.dot_product_attention`` (any shape broadcastable to
      (B, N, T, S)), its T and S axes (where not 1) in the inputs' layout order;
      each device holds the rows of its query shard and every column (its
      gradient stays there: no bias travels).
    is_causal, scale, query_seq_lengths, key_value_seq_lengths: as in
      ``jattn.dot_product_attention``, and so are local_window_size and
      logits_soft_cap, in natural sequence positions whatever the layout.
    segment_ids: packed-document ids, (B, T) when T == S or a pair
      ``(q_segment_ids, kv_segment_ids)``, in the same order as the inputs
      (permuted with them); sharded like the sequence, and the key/value ids
      travel with their shard.
    mask: a :class:`jattn.masks.Mask` in natural positions, evaluated on each
      pair of shards through :func:`jattn.masks.reindex`. Masks of indices
      (causal, windows, chunks, prefix-LM, strides, block-sparse layouts,
      lengths, from_fn) classify tiles exactly; masks holding arrays along T
      or S, and dense boolean arrays (in the inputs' layout order), are correct
      but replicated on every device and skip no tiles, so pass document ids as
      ``segment_ids``.
    score_fn: as in ``jattn.dot_product_attention``, called with global
      (batch, head, query, key) indices in natural positions on every shard
      pair; its arrays get their gradients.
    dropout_rate, dropout_rng, broadcast_dropout: as in
      ``jattn.dot_product_attention``; each weight's keep bit is drawn at its
      global natural position, so the pattern is the one-device call's.
    layout: how the inputs' sequence axis is ordered: ``"contiguous"``
      (natural order, device i holds the i-th slice), ``"zigzag"`` or
      ``"striped"`` (balanced causal work; see :func:`permute`). T and S must
      be divisible by P (by 2P for zigzag).
    batch_axis, head_axis: mesh axes (a name or a tuple of names) that the
      batch and the heads are sharded over at the same time; each device then
      holds a (B/Pb, T/P, N/Ph, H) block. N and K must be divisible by Ph.
    block_q, block_kv: the blockwise tile sizes inside each ring step
      (default per backend); any shard length works.
    return_residual: also return the log-sum-exp, (B, T, N), sharded like
      the output.
    sinks: per-head sink logits (N,), as in :func:`jattn.dot_product_attention`;
      applied once the ring has combined every shard's keys.
    implementation: what runs each (query shard, key/value shard) pair: ``"blockwise"``
      (any backend), ``"splash"`` (splash's fused TPU kernel per pair, the pair's mask
      tabulated when the call is traced; masks the same for every batch row and head,
      segment ids; float32 or bfloat16), ``"flex"`` (jattn's fused GPU kernel per pair,
      its mask and score function reading the pair's global positions; differentiated by
      its own rule, given the ring's merged output and log-sum-exp), or None: splash on
      a TPU and flex on a GPU where the selection table runs a pair's call on them
      (flex takes a score function's arrays only as its pytree leaves), blockwise
      otherwise. Each pair returns its log-sum-exp
      to the ring, so
      a pair's call is checked as ``jattn.dot_product_attention(...,
      implementation="splash", return_residual=True)`` is: splash refuses a
      ``logits_soft_cap``, and a bias, score function or dropout runs each pair
      blockwise (an explicit ``"splash"`` raises; None runs blockwise pairs).
    options: a :class:`jattn.Options` holding ``implementation``, ``block_q`` and
      ``block_kv`` as one value (its ``backward`` must be None).

  Returns:
    The output (B, T, N, H) in the query's dtype, sharded as
    ``P(batch_axis, axis_name, head_axis, None)`` (and the lse (B, T, N) with
    ``return_residual``, sharded alike), in the inputs' layout.
  """
  _check_pairs(implementation)  # before Options, which would list every implementation
  options = Options.of(options, implementation=implementation, block_q=block_q, block_kv=block_kv)
  _check_pairs(options.implementation)
  if options.backward is not None:
    raise ValueError(
      f"options.backward must be None: ring attention has its own backward rule, got "
      f"{options.backward!r}"
    )
  # Segment ids travel with their shards rather than as a Mask: checked separately below.
  # Each pair of shards runs blockwise here; the pairs' own implementation is options'.
  layout = _check_layout(layout)
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  ring_axes = _check_mesh_axes("axis_name", axis_name, mesh, allow_tuple=False)
  size = mesh.shape[axis_name]
  call = _validate.Arguments(
    query,
    key,
    value,
    bias,
    # A dense array in the layout's order, in natural order like masks of indices.
    mask=_natural_mask(mask, layout, size, (jnp.shape(query)[-3], jnp.shape(key)[-3])),
    scale=scale,
    is_causal=is_causal,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    local_window_size=local_window_size,
    return_residual=return_residual,
    logits_soft_cap=logits_soft_cap,
    score_fn=score_fn,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
    broadcast_dropout=broadcast_dropout,
    sinks=sinks,
    options=dataclasses.replace(options, implementation="blockwise"),
  )
  q, k, v, spec = _validate.build(call)
  spec = contract.rank4(spec)
  if spec.unbatched:
    raise ValueError(
      f"ring_attention needs batched inputs: query (B, T, N, H), got shape {q.shape}"
    )
  B, T, N, S, K = spec.B, spec.T, spec.N, spec.S, spec.K
  batch_axes = _check_mesh_axes("batch_axis", batch_axis, mesh)
  head_axes = _check_mesh_axes("head_axis", head_axis, mesh)
  used = [a for axes in (ring_axes, batch_axes, head_axes) for a in axes]
  if len(set(used)) != len(used):
    raise ValueError(
      f"axis_name, batch_axis and head_axis must name different mesh axes, got "
      f"axis_name={axis_name!r}, batch_axis={batch_axis!r}, "
      f"head_axis={head_axis!r}"
    )
  _check_divisible("query length T", T, layout, size)
  _check_divisible("key/value length S", S, layout, size)
  for name, n, axes in (
    ("batch size B", B, batch_axes),
    ("number of query heads N", N, head_axes),
    ("number of key/value heads K", K, head_axes),
  ):
    parts = math.prod(mesh.shape[a] for a in axes)
    if n % parts:
      raise ValueError(f"{name} ({n}) must be divisible by the {parts} devices of mesh axes {axes}")
  if spec.implementation == "xla":  # nothing to ring (an empty B, T, S, N or H): as one call
    out, lse = attention.attend(q, k, v, spec)
    return (out, lse.astype(q.dtype)) if return_residual else out
  q_ids, kv_ids = _segment_rows(segment_ids, B, T, S) or (None, None)
  soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
  assert spec.block_q is not None and spec.block_kv is not None, "blockwise's tiles are set"
  backend = testing.target_backend() or jax.default_backend()
  blocks = (spec.block_q, spec.block_kv)
  blocks_named = (options.block_q, options.block_kv)
  # Each device asks the selection table for a fused kernel per pair (flex on a GPU).
  kernels = blocks_named == (None, None) and _kernel_pairs.wanted(options.implementation, backend)
  ring = _ring.Ring(
    axis_name,
    size,
    layout,
    T,
    S,
    spec.scale,
    soft_cap,
    *blocks,
    _axes_or_none(batch_axes),
    _axes_or_none(head_axes),
    _pairs(
      options.implementation,
      spec,
      q.dtype,
      layout,
      size,
      segments=None if q_ids is None else masks.segments(q_ids, kv_ids),
      soft_cap=soft_cap,
      blocks_named=blocks_named,
      beside=_beyond_splash(bias, score_fn, spec.dropout_rate),
      kernels=kernels,
    ),
    spec.dropout_rate,
    spec.broadcast_dropout,
    try_kernels=kernels,
    kernel_named=named if (named := options.implementation) in _kernel_pairs.KERNELS else None,
  )
  out, lse = _ring.call(
    q,
    k,
    v,
    q_ids,
    kv_ids,
    spec.mask,
    spec.bias,
    spec.score_fn,
    spec.dropout_rng,
    ring=ring,
    mesh=mesh,
  )
  if spec.sinks is not None:
    sinks = _ring.place(spec.sinks, mesh, P(_axes_or_none(head_axes)))  # sharded like N
    out, lse = common.add_sinks(out, lse, sinks, lse.dtype)
  if return_residual:
    return out, lse.astype(q.dtype)
  return out


def _segment_rows(segment_ids: Any, B: int, T: int, S: int) -> tuple[jax.Array, jax.Array] | None:
  """Segment ids checked and broadcast to (B, T) query and (B, S) key/value ids, in the order
  given (the inputs' layout), to travel with their shards; None without ids."""
  if segment_ids is None:
    return None
  seg = _validate.segments(segment_ids, False, T, S)
  q_ids, kv_ids = (jnp.broadcast_to(jnp.asarray(x), (B, n)) for x, n in zip(seg.children, (T, S)))
  return q_ids, kv_ids


def _beyond_splash(bias: Any, score_fn: Any, dropout_rate: float) -> str | None:
  """What the ring's splash pairs do not take (they run segment ids, masks and a soft cap)."""
  for name, given in (("a bias", bias is not None), ("a score_fn", score_fn is not None)):
    if given:
      return name
  return "dropout" if dropout_rate else None


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
      f"ring_attention(implementation={implementation!r}) takes no block_q or block_kv: "
      f"they are blockwise's tiles (the kernel's come from its own table)"
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


def _check_mesh_axes(
  name: str, axes: Any, mesh: Mesh, *, allow_tuple: bool = True
) -> tuple[str, ...]:
  if axes is None:
    if allow_tuple:
      return ()
    raise TypeError(f"{name} must name a mesh axis, got None")
  names = axes if allow_tuple and isinstance(axes, tuple) else (axes,)
  for a in names:
    if a not in mesh.axis_names:
      raise ValueError(
        f"{name}={axes!r}: unknown mesh axis {a!r}; the mesh has axes {tuple(mesh.axis_names)}"
      )
  return tuple(names)


def _axes_or_none(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes
