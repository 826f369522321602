"""Sequence-parallel (ring) attention over a ``jax.sharding.Mesh``.

When one device cannot hold a sequence's activations, shard the sequence
axis over several devices. :func:`ring_attention` keeps each device's query
shard in place and passes the key/value shards around a ring of devices with
``jax.lax.ppermute``; every device merges the partial results with the
online-softmax rule, so no device ever holds more than two key/value shards::

    step s, device i:  (o, m, l) ← blockwise attention of Q_i against K_{i-s}, V_{i-s}
                       m' = max(m_acc, m),  w_acc = l_acc·e^{m_acc−m'},  w = l·e^{m−m'}
                       l' = w_acc + w,  out ← (out·w_acc + o·w) / l'

(m and l are each row's max and sum, kept apart rather than as the log-sum-exp
m + log l, which loses log l when ``|m|`` is huge; see jattn.impl.blockwise.)

The backward pass rings too: each key/value shard travels with float32
accumulators of its own dK and dV, every device adds its queries'
contribution, and one last hop returns them to their owner. Per-device
memory for a training step is O(B·T·N·H / P) on P devices.

Everything runs on JAX's SPMD machinery (``jax.shard_map`` and collective
permutes), so the same code runs on several GPUs or TPUs, and on many hosts
after ``jax.distributed.initialize()``.

Causal load balance: with a contiguous split, device i's queries see i + 1
of the P key/value shards, so under causal masking the last device does
about twice the average work and every ring step waits for it. The
``"zigzag"`` layout gives device i sequence chunks i and 2P − 1 − i (of 2P),
``"striped"`` gives it positions i, i + P, i + 2P, ...; both leave every
device the same causal work. Bring inputs into a layout with :func:`permute`
and outputs back with :func:`unpermute`; masks are always written in the
sequence's natural positions.

Shape legend as in :mod:`jattn.attention`; P is the number of devices on the
ring axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jattn import _checks, _masking, _ring, _ring_splash, _spec, masks, testing
from jattn._options import Options
from jattn.impl import _common, _select, splash

__all__ = [
  "positions",
  "permute",
  "unpermute",
  "ring_attention",
]

LAYOUTS = ("contiguous", "zigzag", "striped")


# --- layouts ------------------------------------------------------------------


def _check_layout(layout: Any) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
  return layout


def positions(layout: str, length: int, num_shards: int) -> np.ndarray:
  """For a sequence laid out in ``layout`` over ``num_shards`` shards: the natural
  position of each entry, int32 of shape (length,).

  ``x_laid_out = x[positions]`` along the sequence axis, which is what
  :func:`permute` does. The ``"contiguous"`` layout is the identity.

  Example::

      >>> positions("zigzag", 8, 2).tolist()  # shard 0: chunks 0 and 3; shard 1: 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
      >>> positions("striped", 8, 2).tolist()
      [0, 2, 4, 6, 1, 3, 5, 7]
  """
  layout = _check_layout(layout)
  length = _checks.integer("length", length, minimum=0)
  num_shards = _checks.integer("num_shards", num_shards, minimum=1)
  _check_divisible("length", length, layout, num_shards)
  with jax.ensure_compile_time_eval():
    pos = jnp.concatenate(
      [_ring.shard_positions(layout, length, num_shards, i) for i in range(num_shards)]
    )
  return np.asarray(pos, np.int32)


@overload
def permute(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array: ...


@overload
def permute(x: np.ndarray, layout: str, num_shards: int, *, axis: int = 1) -> np.ndarray: ...


def permute(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, *, axis: int = 1
) -> jax.Array | np.ndarray:
  """``x`` (natural order along ``axis``) rearranged into ``layout`` for ``num_shards``
  shards: the inputs of :func:`ring_attention` with that layout. Works on NumPy and
  JAX arrays; for a training loop, permute token ids and position ids once in the
  input pipeline rather than activations in every layer."""
  return _reorder(x, layout, num_shards, axis, inverse=False)


@overload
def unpermute(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array: ...


@overload
def unpermute(x: np.ndarray, layout: str, num_shards: int, *, axis: int = 1) -> np.ndarray: ...


def unpermute(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, *, axis: int = 1
) -> jax.Array | np.ndarray:
  """The inverse of :func:`permute`: ``x`` laid out in ``layout`` back to natural order."""
  return _reorder(x, layout, num_shards, axis, inverse=True)


def _reorder(
  x: jax.typing.ArrayLike, layout: str, num_shards: int, axis: int, *, inverse: bool
) -> jax.Array | np.ndarray:
  """``x`` taken along ``axis`` at the layout's positions (or their inverse); NumPy stays NumPy."""
  x = _checks.as_array("x", x)
  axis = _checks.integer("axis", axis)
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for an array of shape {tuple(x.shape)}")
  index = positions(layout, x.shape[axis], num_shards)
  if inverse:
    index = np.argsort(index)
  return x.take(index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, index, axis=axis)


def _check_divisible(name: str, length: int, layout: str, num_shards: int) -> None:
  parts = 2 * num_shards if layout == "zigzag" else num_shards
  if length % parts:
    what = f"2 x {num_shards} zig-zag chunks" if layout == "zigzag" else f"{num_shards} devices"
    raise ValueError(
      f"{name} must be divisible by the number of shards: {length} does not "
      f"split into {what} (layout={layout!r})"
    )


# --- ring attention -------------------------------------------------------------


def ring_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  *,
  mesh: Mesh,
  axis_name: str,
  is_causal: bool = False,
  segment_ids: Any = None,
  mask: masks.Mask | None = None,
  scale: float | None = None,
  query_seq_lengths: jax.typing.ArrayLike | None = None,
  key_value_seq_lengths: jax.typing.ArrayLike | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  logits_soft_cap: float | None = None,
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
  docstring). Works under ``jax.jit``; differentiable in query, key and value.

  Args:
    query: (B, T, N, H). A ``jax.Array`` sharded as
      ``P(batch_axis, axis_name, head_axis, None)`` avoids any resharding;
      other inputs (NumPy arrays, unsharded or otherwise sharded arrays; key,
      value, segment ids, lengths and sinks alike) are resharded to that, under
      Auto and Explicit mesh axes alike.
    key, value: (B, S, K, H), N a multiple of K (GQA without repeating K/V).
    mesh: the ``jax.sharding.Mesh`` whose devices hold the shards.
    axis_name: the mesh axis the sequence is split over (the ring).
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
      or S are correct but replicated on every device and skip no tiles, so
      pass document ids as ``segment_ids``.
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
      segment ids; float32 or bfloat16), or None: splash on a TPU where it expresses
      the call, blockwise otherwise. Each pair returns its log-sum-exp to the ring, so
      a pair's call is checked as ``jattn.dot_product_attention(...,
      implementation="splash", return_residual=True)`` is: splash refuses a
      ``logits_soft_cap`` (an explicit ``"splash"`` raises; None runs blockwise pairs).
    options: a :class:`jattn.Options` holding ``implementation``, ``block_q`` and
      ``block_kv`` as one value (its ``backward`` must be None).

  Returns:
    The output (B, T, N, H) in the query's dtype, sharded as
    ``P(batch_axis, axis_name, head_axis, None)`` (and the lse (B, T, N) with
    ``return_residual``, sharded alike), in the inputs' layout.

  Not supported here (use ``jattn.dot_product_attention``): ``bias``,
  ``score_fn``, dropout.
  """
  arguments = dict(locals())  # the call as given, before any name below is rebound
  if mask is not None and not isinstance(mask, masks.Mask):
    raise TypeError(
      f"ring_attention takes mask as a jattn.masks.Mask, got "
      f"{type(mask).__name__}; a dense (T, S) array defeats sharding the sequence"
    )
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
  call = _spec.Arguments.of(
    arguments,
    segment_ids=None,
    implementation=None,
    block_q=None,
    block_kv=None,
    options=dataclasses.replace(options, implementation="blockwise"),
  )
  q, k, v, spec = _spec.build(call)
  if spec.unbatched:
    raise ValueError(
      f"ring_attention needs batched inputs: query (B, T, N, H), got shape {q.shape}"
    )
  B, T, N, S, K = spec.B, spec.T, spec.N, spec.S, spec.K
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  ring_axes = _check_mesh_axes("axis_name", axis_name, mesh, allow_tuple=False)
  batch_axes = _check_mesh_axes("batch_axis", batch_axis, mesh)
  head_axes = _check_mesh_axes("head_axis", head_axis, mesh)
  used = [a for axes in (ring_axes, batch_axes, head_axes) for a in axes]
  if len(set(used)) != len(used):
    raise ValueError(
      f"axis_name, batch_axis and head_axis must name different mesh axes, got "
      f"axis_name={axis_name!r}, batch_axis={batch_axis!r}, "
      f"head_axis={head_axis!r}"
    )
  layout = _check_layout(layout)
  size = mesh.shape[axis_name]
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
  q_ids = kv_ids = None
  if segment_ids is not None:
    seg = _masking.segments(segment_ids, False, T, S)
    q_ids, kv_ids = (jnp.broadcast_to(jnp.asarray(x), (B, n)) for x, n in zip(seg.children, (T, S)))
  soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
  blocks = (spec.block_q, spec.block_kv)
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
      blocks_named=(options.block_q, options.block_kv),
    ),
  )
  out, lse = _ring.call(q, k, v, q_ids, kv_ids, spec.mask, ring=ring, mesh=mesh)
  if spec.sinks is not None:
    sinks = _ring.place(spec.sinks, mesh, P(_axes_or_none(head_axes)))  # sharded like N
    out, lse = _common.add_sinks(out, lse, sinks, lse.dtype)
  if return_residual:
    return out, lse.astype(q.dtype)
  return out


def _check_pairs(implementation: Any) -> None:
  if implementation not in (None, "blockwise", "splash"):
    raise ValueError(
      f"implementation must be one of ['blockwise', 'splash'] or None, got {implementation!r}"
    )


def _pairs(
  implementation: str | None,
  spec: _spec.CallSpec,
  dtype: DTypeLike,
  layout: str,
  size: int,
  *,
  segments: masks.Mask | None,
  soft_cap: float | None,
  blocks_named: tuple[int | None, int | None],
) -> _ring_splash.Pairs | None:
  """The splash kernels of each shard pair (:mod:`jattn._ring_splash`), or None (blockwise).

  A pair runs splash only where the one-device call would: the pair's own call (its shard
  lengths, segment ids, soft cap and dtype, always returning the log-sum-exp the ring
  merges) goes through splash's row of the selection table, and an explicit
  ``implementation="splash"`` the table refuses raises with the table's reason.
  """
  if implementation == "blockwise":
    return None
  interpret = testing.interpreting()
  backend = testing.target_backend() or jax.default_backend()
  why = _ring_splash.reason(spec.mask)
  if why is None and blocks_named != (None, None):
    why = "block_q and block_kv are blockwise's tiles"
  if why is None:
    why = _pair_reason(spec, dtype, size, segments, soft_cap, backend)
  if implementation is None:
    if why is not None or backend != "tpu" or testing.portable():  # several platforms
      return None
  elif why is not None:
    raise ValueError(f"ring_attention(implementation='splash') does not support {why}")
  elif not interpret and backend != "tpu":
    raise ValueError(
      "ring_attention(implementation='splash') needs a TPU (jattn.testing.interpret_kernels() "
      "runs it in Pallas interpret mode, for tests)"
    )
  return _ring_splash.plan(
    spec.mask,
    layout=layout,
    size=size,
    q_len=spec.T,
    kv_len=spec.S,
    positions=_ring.shard_positions,
  )


def _pair_reason(
  spec: _spec.CallSpec,
  dtype: DTypeLike,
  size: int,
  segments: masks.Mask | None,
  soft_cap: float | None,
  backend: str,
) -> str | None:
  """Why splash's table row refuses one shard pair's call (see :func:`_pairs`), or None."""
  t, s = spec.T // size, spec.S // size
  block_q, block_kv = splash.resolve_blocks(None, None, t, s)
  pair = _ring_splash.pair_spec(
    shapes=((spec.B, t, spec.N, spec.H), (spec.B, s, spec.K, spec.H), (spec.B, s, spec.K, spec.Hv)),
    segments=segments,
    scale=spec.scale,
    soft_cap=soft_cap,
    block_q=block_q,
    block_kv=block_kv,
    interpret=testing.interpreting(),
  )
  call = _select.Call(
    spec=pair,
    dtype=np.dtype(dtype),
    backend=backend,
    backward_named=False,
    blocks_named=False,
  )
  why = _select.why_not("splash", call, device=False)
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
