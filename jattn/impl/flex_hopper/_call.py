"""A call as flex's Hopper kernels take it: what they refuse (each refusal naming the
argument), the tile schedules, the segment ids, and the mask and score function traced at
the kernels' tile shapes with the arrays they read (:class:`Functions`, :class:`Arrays`,
:class:`Static`), which every kernel splits off its refs the same way (:func:`split_refs`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn import dropout as _dropout
from jattn import masks as _masks
from jattn.impl import _in_kernel, common, tiling
from jattn.impl.flex_hopper import _mosaic
from jattn.impl.flex_hopper._mosaic import ROWS
from jattn.masks import core as masks_core


class Functions(NamedTuple):
  """The mask (its conjuncts other than segment ids) and the score function as the kernels
  evaluate them: jaxprs traced at each tile shape the kernels use (batch row and head as
  scalars, query and key indices of the tile's shape), whose leading inputs are the arrays
  they read. The kernels take those arrays as inputs and read them an element at a time at
  indices of the batch row and head (:mod:`jattn.impl._in_kernel`; :func:`mask_reason`
  and :func:`score_reason` refuse functions that read them otherwise)."""

  mask: dict[tuple[int, ...], Any] | None
  score: dict[tuple[int, ...], Any] | None
  n_mask: int  # arrays the mask reads
  n_score: int  # arrays the score function reads
  # The score function and its derivative in the score, (y, dy/ds), traced at each tile
  # shape too: the backward evaluates that jaxpr, not jax.jvp inside the kernel (Mosaic
  # GPU's loads, which read arrays along the positions, have no differentiation rule).
  slope: dict[tuple[int, ...], Any] | None = None
  # A sequence-parallel part's dropout: (b, h, q_idx, kv_idx) -> the global positions it
  # is drawn at, through the part's maps (CallSpec.positions), which it reads.
  positions: dict[tuple[int, ...], Any] | None = None
  n_positions: int = 0

  def bind(self, refs: Sequence[Any]) -> tuple[Any, Any, Any, Any]:
    """``(mask(b, h, q_idx, kv_idx), score_fn(s, b, h, q_idx, kv_idx), slope(s, b, h,
    q_idx, kv_idx) -> (score_fn(s, ...), its derivative in s), positions(b, h, q_idx,
    kv_idx) -> global (b, h, q, kv))`` inside a kernel, their arrays read from ``refs`` (the
    mask's, the score function's, the positions' maps); None where absent."""
    n = self.n_mask + self.n_score
    mask_refs, score_refs = tuple(refs[: self.n_mask]), tuple(refs[self.n_mask : n])
    position_refs = tuple(refs[n : n + self.n_positions])

    def run(jaxprs: dict[tuple[int, ...], Any], refs: tuple[Any, ...], *args: Any) -> Any:
      out = _in_kernel.evaluate(jaxprs[args[-1].shape], refs, *args)  # the tile's shape
      return out[0] if len(out) == 1 else tuple(out)

    mask = score = slope = positions = None
    if self.mask is not None:
      mask = functools.partial(run, self.mask, mask_refs)
    if self.score is not None:
      score = functools.partial(run, self.score, score_refs)
    if self.slope is not None:
      slope = functools.partial(run, self.slope, score_refs)
    if self.positions is not None:
      positions = functools.partial(run, self.positions, position_refs)
    return mask, score, slope, positions


class Static(NamedTuple):
  """A call's static settings, as every kernel takes them."""

  scale: float
  block_kv: int  # the forward's key tiles (the backward's are ROWS)
  stages: int  # tiles in flight
  interpret: bool
  masked: bool  # a mask (is_causal included) leaves PARTIAL tiles to mask
  functions: Functions
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False  # one (T, S) pattern for every batch row and head
  biased: bool = False  # a bias is added to the scaled scores
  dense: bool = False  # a dense boolean mask is and'ed with the mask on PARTIAL tiles
  lengths: tuple[int, int] = (0, 0)  # T and S: the axes a function's positions run over
  specialized: bool = False  # warp-specialised kernels (128-row blocks)
  # Whether the forward's, dQ's and dK/dV's programs take their tiles last first: where a
  # schedule's rows grow heavier along its axis (causal query tiles), the longest launch
  # first (tiling.heaviest_last, as flex's Triton kernels order theirs).
  from_last: tuple[bool, bool, bool] = (False, False, False)


class Arrays(NamedTuple):
  """A call's arrays beside query, key and value (a pytree: the custom_vjp's inputs)."""

  offsets: jax.Array  # int32 (2,): the global index of the first batch row and head
  seed: tuple[jax.Array, ...]  # dropout's two uint32 words (jattn.dropout.seed_words), or ()
  bias: tuple[jax.Array, ...]  # the bias as given (rank 4, broadcastable), or ()
  dense: tuple[jax.Array, ...]  # a dense boolean mask, rank 4, broadcastable, or ()
  forward: tuple[jax.Array, ...]  # the forward's schedule: order, FULL and PARTIAL counts
  rows: tuple[jax.Array, ...]  # dQ's (ROWS x ROWS tiles, 2 ROWS x ROWS warp-specialised;
  # () where only the forward runs)
  cols: tuple[jax.Array, ...]  # dK/dV's, over key tiles (of 2 ROWS warp-specialised)
  ids: tuple[jax.Array, ...]  # segment ids, query (Bm, T) and key (Bm, S) int32, or ()
  mask: tuple[jax.Array, ...]  # what the mask's other conjuncts read
  score: tuple[jax.Array, ...]  # what the score function reads
  positions: tuple[jax.Array, ...] = ()  # the maps a sequence-parallel part's dropout reads

  def kernel_inputs(
    self, schedule: tuple[jax.Array, ...], T: int, S: int, transposed: bool = False
  ) -> list[jax.Array]:
    """A kernel's inputs after its tensors: ``schedule``, the offsets, the dropout seed, the
    segment ids, the mask's and the score function's arrays, the bias and the dense mask
    (:func:`planes`, transposed for the dK/dV kernel; the mask's as bfloat16 0 and 1), in
    the order :func:`split_refs` reads them."""
    dense = [x.astype(jnp.bfloat16) for x in self.dense]  # read in wgmma's layout as 16-bit
    tiled = [planes(x, T, S, transposed) for x in (*self.bias, *dense)]
    read = [_widened(x) for x in (*self.mask, *self.score, *self.positions)]
    return [*schedule, self.offsets, *self.seed, *self.ids, *read, *tiled]


def _widened(x: jax.Array) -> jax.Array:
  """An array a function reads, as a kernel holds it: booleans and 8-bit integers as int32
  (Mosaic GPU loads no vector of either from a run of positions); read back in its own
  dtype (:func:`_in_kernel.evaluate`)."""
  if x.dtype == jnp.bool_ or (jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize == 1):
    return x.astype(jnp.int32)
  return x


def planes(x: jax.Array, T: int, S: int, transposed: bool) -> jax.Array:
  """A rank-4 bias or dense mask as the kernels read it, tile by tile: (Bb, Nb, T, S), its
  query and key axes broadcast where they were 1 (``transposed``: (Bb, Nb, S, T), for the
  dK/dV kernel); its batch and head axes stay as given (1 or the call's)."""
  whole = jnp.broadcast_to(x, (*x.shape[:2], T, S))
  return jnp.swapaxes(whole, 2, 3) if transposed else whole


class Refs(NamedTuple):
  """A kernel's refs after its tensors, by what they hold."""

  schedule: tuple[Any, ...]  # order, FULL and PARTIAL counts
  offsets: Any
  seed: Any  # None without dropout
  ids: tuple[Any, ...]  # segment ids, or ()
  mask: Any  # the mask's evaluator (Functions.bind), or None
  score_fn: Any  # the score function's, or None
  slope: Any  # the score function's with its derivative (Functions.bind), or None
  positions: Any  # a sequence-parallel part's dropout positions (Functions.bind), or None
  bias: Any  # the bias's planes (:func:`planes`), or None
  dense: Any  # the dense mask's planes, or None
  rest: tuple[Any, ...]  # the outputs and scratch


def split_refs(refs: Sequence[Any], static: Static, n_ids: int) -> Refs:
  """A kernel's refs after its tensors (in the order of :meth:`Arrays.kernel_inputs`)."""
  f = static.functions
  n_seed = 1 if static.dropout_rate else 0
  at = 4 + n_seed
  ids = tuple(refs[at : at + n_ids])
  n_fn = f.n_mask + f.n_score + f.n_positions
  mask, score_fn, slope, positions = f.bind(refs[at + n_ids : at + n_ids + n_fn])
  seed = refs[4] if n_seed else None
  at = at + n_ids + n_fn
  bias = refs[at] if static.biased else None
  at += static.biased
  dense = refs[at] if static.dense else None
  at += static.dense
  return Refs(
    tuple(refs[:3]), refs[3], seed, ids, mask, score_fn, slope, positions, bias, dense,
    tuple(refs[at:]),
  )  # fmt: skip


def check_inputs(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  is_causal: bool,
  mask: Any,
  score_fn: Any,
  block_kv: int,
  interpret: bool,
  specialized: bool,
  dropout_rate: float = 0.0,
  dropout_rng: Any = None,
  bias: Any = None,
  backward: bool = False,
) -> None:
  """What the kernels take, each refusal naming the argument."""
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  dtype = query.dtype
  if dtype not in (jnp.float16, jnp.bfloat16):
    raise ValueError(f"query: the Hopper kernel takes float16 or bfloat16, got {dtype}")
  if key.dtype != dtype or value.dtype != dtype:
    raise ValueError(f"key, value: dtypes {key.dtype}, {value.dtype} differ from query's {dtype}")
  Hv = value.shape[-1]
  if key.shape != (B, S, K, H) or value.shape != (B, S, K, Hv):
    raise ValueError(f"key, value: shapes {key.shape}, {value.shape}; want (B, S, K, H) = "
                     f"{(B, S, K, H)} with query's B and H, value's head dim its own")  # fmt: skip
  if N % K:
    raise ValueError(f"query: {N} heads are not a multiple of key's {K}")
  if H % 64:
    raise ValueError(f"query: head dim {H} is not a multiple of 64")
  if Hv % 64:
    raise ValueError(f"value: head dim {Hv} is not a multiple of 64")
  if T % ROWS or S % block_kv or block_kv % 64:
    raise ValueError(
      f"query, key: lengths {T} and {S} must be multiples of {ROWS} and block_kv={block_kv} "
      "(itself a multiple of 64)"
    )
  if specialized and T % (2 * ROWS):
    raise ValueError(f"query: length {T} must be a multiple of {2 * ROWS} (specialized=True)")
  if specialized and backward and S % (2 * ROWS):
    raise ValueError(
      f"key: length {S} must be a multiple of {2 * ROWS} (specialized=True, differentiated)"
    )
  if is_causal and T != S:
    raise ValueError(f"is_causal: the Hopper kernel takes T = S, got {T} and {S}")
  if reason := mask_reason(mask, (T, S)):
    raise ValueError(f"mask: the Hopper kernel takes {reason}")
  if reason := score_reason(score_fn, (T, S)):
    raise ValueError(f"score_fn: the Hopper kernel takes {reason}")
  if bias is not None:
    shape = jnp.shape(bias)
    if len(shape) != 4 or any(n not in (1, m) for n, m in zip(shape, (B, N, T, S))):
      raise ValueError(f"bias: shape {shape} does not broadcast to (B, N, T, S) = {(B, N, T, S)}")
    if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
      raise ValueError(f"bias: a floating array, got {jnp.result_type(bias)}")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate: must be in [0, 1), got {dropout_rate}")
  if dropout_rate and dropout_rng is None:
    raise ValueError("dropout_rng: dropout_rate > 0 needs a key, got None")
  if interpret and not _mosaic.has_interpreter():
    raise ValueError("interpret: Mosaic GPU's interpreter needs jax >= 0.11.2")


def prepare(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool,
  mask: Any,
  score_fn: Any,
  block_kv: int,
  stages: int,
  interpret: bool,
  specialized: bool,
  offsets: jax.Array | None,
  backward: bool,
  dropout_rate: float = 0.0,
  dropout_rng: Any = None,
  broadcast_dropout: bool = False,
  bias: jax.Array | None = None,
  batch_heads: tuple[int, int] | None = None,
  positions: Any = None,
) -> tuple[Arrays, Static]:
  """A call checked (:func:`check_inputs`, each refusal naming the argument) and as the
  kernels take it: the forward's tile schedule (and the backward's, where ``backward``), the
  segment ids, the dense mask, the bias, the dropout seed, and the mask and score function
  traced at the kernels' tile shapes with the arrays they read; for a sequence-parallel
  part's dropout, ``positions`` (:attr:`jattn.impl.contract.CallSpec.positions`) traced the
  same way."""
  check_inputs(
    query, key, value, is_causal=is_causal, mask=mask, score_fn=score_fn, block_kv=block_kv,
    interpret=interpret, specialized=specialized, dropout_rate=dropout_rate,
    dropout_rng=dropout_rng, bias=bias, backward=backward,
  )  # fmt: skip
  bias_dtype = None if bias is None else jnp.result_type(bias)
  H, Hv = query.shape[-1], value.shape[-1]
  if reason := smem_reason(H, query.dtype, bias_dtype, mask, block_kv, stages, backward, Hv):
    raise ValueError(f"query: {reason}")
  rows = 2 * ROWS if specialized else ROWS  # a forward program's query rows
  full, forward_s, _ = _schedules(query, key, is_causal, mask, block_kv, rows, batch_heads)
  shapes = [(ROWS, block_kv)]
  rows_s: tuple[Any, ...] = ()
  cols_s: tuple[Any, ...] = ()
  if backward:  # dQ's schedule over query blocks, dK/dV's over key blocks: 64 or 128 rows
    _, rows_s, _ = _schedules(query, key, is_causal, mask, ROWS, rows, batch_heads)
    _, _, cols_s = _schedules(query, key, is_causal, mask, rows, ROWS, batch_heads)
    shapes.append((ROWS, ROWS))  # dQ's tiles, and dK/dV's transposed ones
  rest, ids, dense = _split_ids(full)
  T, S = query.shape[1], key.shape[1]
  rate = float(dropout_rate)
  mask_fns, mask_arrays = _traced(rest, shapes, score=False)
  score_fns, score_arrays = _traced(score_fn, shapes, score=True)
  slopes = None
  if score_fn is not None and backward:
    slopes, slope_arrays = _traced(_with_slope(score_fn), [(ROWS, ROWS)], score=True)
    if not _in_kernel.same_arrays(score_arrays, slope_arrays):
      raise ValueError(f"score_fn: {score_fn!r} reads other arrays when differentiated")
  position_fns: Any = None
  position_arrays: tuple[jax.Array, ...] = ()
  if rate and positions is not None:
    position_fns, position_arrays = _traced(_at_positions(positions), shapes, score=False)
    if reason := _reads_reason(_at_positions(positions), score=False, lengths=(T, S)):
      raise ValueError(f"positions: the Hopper kernel takes maps it reads as runs, and {reason}")
  functions = Functions(
    mask_fns, score_fns, len(mask_arrays), len(score_arrays), slopes, position_fns,
    len(position_arrays),
  )  # fmt: skip
  last = lambda s: bool(s) and tiling.heaviest_last(tiling.Schedule(*s))
  static = Static(
    float(scale), block_kv, stages, interpret, full is not None, functions, rate,
    bool(broadcast_dropout) and rate > 0, bias is not None, bool(dense),
    (query.shape[1], key.shape[1]), specialized, (last(forward_s), last(rows_s), last(cols_s)),
  )  # fmt: skip
  seed = (jnp.stack(_dropout.seed_words(dropout_rng)),) if rate else ()
  sched = lambda s: tuple(jnp.asarray(x) for x in s)
  biases = () if bias is None else (bias,)
  arrays = Arrays(
    _offsets(offsets), seed, biases, dense, sched(forward_s), sched(rows_s), sched(cols_s), ids,
    mask_arrays, score_arrays, position_arrays,
  )  # fmt: skip
  return arrays, static


def smem_reason(
  H: int,
  dtype: Any,
  bias_dtype: Any,
  mask: Any,
  block_kv: int = 64,
  stages: int = 2,
  backward: bool = True,
  Hv: int | None = None,
) -> str | None:
  """Why a kernel of the call (head dim ``H``, the value's ``Hv`` (default ``H``), inputs
  of ``dtype``, a bias of ``bias_dtype`` or None) would not fit in a Hopper program's shared
  memory (:func:`shared_memory`), or None."""
  item = jnp.dtype(dtype).itemsize
  bias_item = 0 if bias_dtype is None else jnp.dtype(bias_dtype).itemsize
  dense = any(isinstance(p, _masks.kinds.FromArray) for p in masks_core.conjuncts(mask))
  dims = (H, H if Hv is None else Hv)
  for kernel, n in shared_memory(dims, item, block_kv, stages, backward, bias_item, dense).items():
    if n > _mosaic.SMEM_BYTES:
      return (
        f"at head dim {H} the {kernel} kernel would need {n} bytes of shared memory "
        f"({stages} stages; a bias's and a dense mask's tiles), past Hopper's "
        f"{_mosaic.SMEM_BYTES}: fewer stages, or a bfloat16 bias"
      )
  return None


def shared_memory(
  dims: tuple[int, int],
  item: int,
  block_kv: int,
  stages: int,
  backward: bool,
  bias_item: int,
  dense: bool,
) -> dict[str, int]:
  """The bytes of shared memory the one-warpgroup forward kernel (and, where ``backward``,
  the dQ and dK/dV kernels) take, from their buffers: the held tiles, ``stages`` of each
  streamed one (head dims ``dims``, (H, Hv); inputs of ``item`` bytes an element, a bias of
  ``bias_item`` (0: none), a dense mask's bfloat16 tiles), and the forward's float32
  output where the backward needs it. (The warp-specialised kernels check their own.)"""
  H, Hv = dims
  planes = lambda cols: stages * ROWS * cols * (bias_item + (2 if dense else 0))
  out_item = 4 if backward else item
  needs = {"forward": ROWS * (H * item + Hv * out_item) + stages * block_kv * (H + Hv) * item}
  needs["forward"] += planes(block_kv)
  if backward:  # two held tiles and two streamed ones each (q, dO; k, v)
    needs["dQ"] = needs["dK/dV"] = ROWS * (H + Hv) * item * (1 + stages) + planes(ROWS)
  return needs


def _offsets(offsets: jax.Array | None) -> jax.Array:
  """The kernels' int32 (2,) input: the global index of the first batch row and head."""
  return jnp.zeros((2,), jnp.int32) if offsets is None else jnp.asarray(offsets, jnp.int32)


def _index_specs(shape: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
  """The (batch, head, q_idx, kv_idx) a kernel passes a mask or score function on a tile of
  ``shape``: the program's batch row and head as scalars, the tile's indices."""
  scalar, tile = (jax.ShapeDtypeStruct(x, jnp.int32) for x in ((), shape))
  return [scalar, scalar, tile, tile]


def _at_positions(maps: Any) -> Any:
  """``(b, h, q, kv) -> the global positions maps (CallSpec.positions) take them to``."""

  def at(*idx: Any) -> tuple[Any, ...]:
    return common.at_positions(idx, maps)

  return at


def _with_slope(score_fn: Any) -> Any:
  """``(s, b, h, q, kv) -> (score_fn(s, b, h, q, kv), its derivative in s)``: score
  functions act elementwise on the scores."""

  def both(s: Any, *rest: Any) -> tuple[Any, Any]:
    return jax.jvp(lambda s: score_fn(s, *rest), (s,), (jnp.ones_like(s),))

  return both


def _traced(
  fn: Any, shapes: Sequence[tuple[int, ...]], *, score: bool
) -> tuple[dict[tuple[int, ...], Any] | None, tuple[jax.Array, ...]]:
  """``fn`` (a mask, or a score function where ``score``) traced at each tile shape, and the
  arrays it reads (the same at every shape): ``(None, ())`` where ``fn`` is None."""
  if fn is None:
    return None, ()
  found: dict[tuple[int, ...], _in_kernel.Function] = {}
  for shape in dict.fromkeys(shapes):
    specs = _index_specs(shape)
    if score:
      specs.insert(0, jax.ShapeDtypeStruct(shape, jnp.float32))
    found[shape] = _in_kernel.Function.trace(lambda *a: fn(*a), *specs)
  first = next(iter(found.values()))
  for other in found.values():
    if not _in_kernel.same_arrays(first.arrays, other.arrays):
      name = "score_fn" if score else "mask"
      raise ValueError(f"{name}: {fn!r} reads different arrays at tiles of {list(found)}")
  return {shape: f.jaxpr for shape, f in found.items()}, first.arrays


class _Probe:
  """A kernel input's stand-in while a traced function is checked: notes whether it is read
  other than one element at a time (a slice or a gather at index arrays) or as a run of
  positions (through ``at``: :meth:`_in_kernel.Deferred.line`)."""

  def __init__(self, array: jax.Array) -> None:
    self.shape, self.dtype, self.wide = tuple(array.shape), array.dtype, False

  @property
  def at(self) -> _ProbeAt:
    return _ProbeAt(self)

  def __getitem__(self, index: Any) -> jax.Array:
    index = index if isinstance(index, tuple) else (index,)
    if index == (Ellipsis,):
      index = tuple(slice(None) for _ in self.shape)
    shape: list[int] = []
    for i, n in zip(index, self.shape):
      if isinstance(i, slice):
        shape.append(len(range(*i.indices(n))))
      elif jnp.ndim(i):  # a gather: its index arrays share one shape
        shape = list(jnp.shape(i))
    self.wide = self.wide or bool(shape)
    return jnp.zeros(shape, self.dtype)


class _ProbeAt:
  """``probe.at[index]``: a view of the run ``index`` names (a ``pl.ds`` along one axis,
  scalars elsewhere), whose read returns zeros of its shape."""

  def __init__(self, probe: _Probe) -> None:
    self.probe = probe

  def __getitem__(self, index: Any) -> jax.ShapeDtypeStruct:
    index = index if isinstance(index, tuple) else (index,)
    shape = tuple(i.size for i in index if isinstance(i, pl.Slice))
    return jax.ShapeDtypeStruct(shape, self.probe.dtype)


def _probe_line(axis: int, extent: int, tile: Any, start: Any) -> _in_kernel.Line:
  """A :class:`_in_kernel.Line` of traced positions whose reads return zeros."""

  def load(view: jax.ShapeDtypeStruct) -> jax.Array:
    return lax.broadcast_in_dim(jnp.zeros(view.shape, view.dtype), tile.shape, [axis])

  return _in_kernel.Line(tile, axis, start, extent, load)


def _reads_reason(fn: Any, *, score: bool, lengths: tuple[int, int] | None = None) -> str | None:
  """Where ``fn`` reads an array other than an element at a time at indices of the batch
  row and head, or as a run at the tile's query or key positions (``arr[q_idx]``,
  ``arr[b, kv_idx]``; the array at least as long as that axis, of ``lengths`` (T, S) where
  known), a phrase saying so (a table indexed by distance, say); None where the kernels can
  evaluate it."""
  jaxprs, arrays = _traced(fn, [(ROWS, ROWS)], score=score)
  if not arrays:
    return None
  assert jaxprs is not None
  probes = [_Probe(a) for a in arrays]
  specs = _index_specs((ROWS, ROWS)) + [jax.ShapeDtypeStruct((), jnp.int32)] * 2
  if score:
    specs.insert(0, jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32))
  T, S = lengths or (0, 0)

  def run(*a: Any) -> Any:
    *head, q_idx, kv_idx, q0, k0 = a
    lines = _probe_line(0, T, q_idx, q0), _probe_line(1, S, kv_idx, k0)
    return _in_kernel.evaluate(jaxprs[ROWS, ROWS], probes, *head, *lines)

  jax.eval_shape(run, *specs)
  wide = [p.shape for p in probes if p.wide]
  if not wide:
    return None
  return (
    f"it reads an array of shape {wide[0]} at each query or key position other than as a "
    "run at the positions of one axis (arr[q_idx], arr[b, kv_idx]) no shorter than it"
  )


def mask_reason(mask: Any, lengths: tuple[int, int] | None = None) -> str | None:
  """What the Hopper kernels cannot take in ``mask`` (None: they take it): masks of the
  indices reading arrays at the batch row and head (lengths, prefix lengths, per-row
  causal offsets) or along the query or key positions (a sequence-parallel part's position
  maps, per-position flags; as long as the axis, of ``lengths`` (T, S) where known), and'ed
  with at most one set of segment ids and one dense boolean mask (which each program reads
  tile by tile)."""
  parts = masks_core.conjuncts(mask)
  for kind in _TILED:
    if sum(isinstance(p, kind) for p in parts) > 1:
      return f"one {kind.__name__} mask at most, {mask} has several"
  rest = _masks.all_of(*(p for p in parts if not isinstance(p, _TILED)))
  if rest is not None and (reason := _reads_reason(rest, score=False, lengths=lengths)):
    return (
      "masks reading arrays at the batch row and head or along the positions (and segment "
      f"ids, a dense mask), and {reason}"
    )
  return None


def score_reason(score_fn: Any, lengths: tuple[int, int] | None = None) -> str | None:
  """What the Hopper kernels cannot take in ``score_fn`` (None: they take it): score
  functions of the indices, reading arrays at the batch row and head (ALiBi's per-head
  slopes) or along the positions (:func:`mask_reason`'s), not a table indexed by distance."""
  if score_fn is None:
    return None
  if reason := _reads_reason(score_fn, score=True, lengths=lengths):
    return (
      f"score functions reading arrays at the batch row and head or along the positions, "
      f"and {reason}"
    )
  return None


# The conjuncts the kernels read tile by tile, one of each at most: segment ids, a dense mask.
_TILED = (_masks.kinds.Segments, _masks.kinds.FromArray)


def _split_ids(mask: Any) -> tuple[Any, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """``mask`` (checked by :func:`mask_reason`) as (its other conjuncts, the segment ids it
  reads: query (Bm, T) and key (Bm, S) int32, or (); its dense mask, rank 4, or ())."""
  parts = masks_core.conjuncts(mask)
  ids: tuple[jax.Array, ...] = ()
  dense: tuple[jax.Array, ...] = ()
  rest = []
  for part in parts:
    if isinstance(part, _masks.kinds.Segments):
      ids = tuple(
        jnp.asarray(x, jnp.int32).reshape(-1, jnp.shape(x)[-1])
        for x in (part.q_segment_ids, part.kv_segment_ids)
      )
    elif isinstance(part, _masks.kinds.FromArray):
      array = jnp.asarray(part.array)
      dense = (array.reshape((1,) * (4 - array.ndim) + array.shape),)
    else:
      rest.append(part)
  return _masks.all_of(*rest), ids, dense


def _schedules(
  query: jax.Array,
  key: jax.Array,
  is_causal: bool,
  mask: Any,
  block: int,
  rows: int = ROWS,
  batch_heads: tuple[int, int] | None = None,
) -> tuple[Any, tiling.Schedule, tiling.Schedule]:
  """The mask and'ed with causal, and its (rows, columns) schedules at ``rows x block``,
  over the whole call's batch rows and heads (``batch_heads``; default the query's): one
  schedule every program walks, whichever device it runs on."""
  B, T, N, _ = query.shape
  B, N = batch_heads or (B, N)
  S = key.shape[1]
  if is_causal:
    mask = _masks.causal() if mask is None else _masks.causal() & mask
  view = tiling.tile_classes(mask, B, N, T, S, rows, block)
  return mask, tiling.schedule(view), tiling.schedule(view.T)
