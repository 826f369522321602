"""flex's kernels written for Mosaic GPU, for Hopper (sm_90): wgmma and TMA through Pallas.

**Not yet run on a GPU, and reached only by name**: they lower for CUDA from a CPU (one
Mosaic GPU call per kernel) and compute exact values in Mosaic GPU's interpreter (jax >=
0.12), but ``implementation=None`` routes no call to them until a GPU has run them and the
record is committed; ``implementation="flex_hopper"`` (the selection table's row,
:data:`jattn.impl.flex.HOPPER`) opts in, and ``python -m experiments.gpu_probe`` times them
(methods ``hopper`` and ``hopper_ws``, the latter with the warp-specialised forward kernel)
beside cuDNN and the Triton kernels.
:func:`attention` joins the forward kernel and :func:`backward`'s two kernels in a
``custom_vjp``. Masks and score functions are traced per tile shape (:class:`_Functions`)
and may read arrays at the batch row and head (lengths, prefix lengths, ALiBi's slopes):
the kernels take those as inputs and read them an element at a time; segment ids are
and'ed with them (each program copies its own tile's ids once and streams the other axis's
ids with each tile it walks). Arrays read at each query or key position (a dense mask, a
table indexed by distance), a bias and dropout come later.

One program per (query tile of 64 rows, head, batch row), one warpgroup: the query tile is
copied to shared memory once (TMA), then ``plgpu.emit_pipeline`` streams the key and value
tiles through ``stages`` shared-memory buffers (TMA, mbarriers) while the warpgroup runs
``S = Q Kᵀ`` and ``O += P V`` on the tensor cores (wgmma) and the online softmax in base 2
between them (the scale times log2(e) folded into one multiply, as the Triton kernels do).
A mask's tile schedule (flex's: per query tile, its FULL key tiles, then its PARTIAL ones)
comes in as three int32 arrays that the pipelines' index maps read: the FULL tiles stream
through one pipeline, the PARTIAL ones through a second, the only one that evaluates the
mask (traced into the kernel body on the tile's indices); EMPTY tiles are never loaded. Each
step's P V goes to a fresh accumulator added to the rescaled one (``acc · α + P V``, one
FMA per element), since the interpreter cannot accumulate into an accumulator initialised
from registers; on the GPU P stays in registers as wgmma's A operand, while the interpreter,
whose wgmma reads A from shared memory only, stages it there.

``forward(..., specialized=True)`` arranges the forward pass as FlashAttention-3 does
(:func:`_forward_specialized`): a copy warpgroup walks the schedule and feeds key and value
tiles by TMA to two compute warpgroups, which share them and take turns on the tensor cores.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from jattn import masks as _masks
from jattn.impl import _common, _tiling
from jattn.impl.flex import _in_kernel as _in_kernel
from jattn.impl.flex import _kernels as _kernels
from jattn.masks import _core as _masks_core

LOG2E = math.log2(math.e)
ROWS = 64  # a warpgroup's wgmma M


def _plgpu() -> Any:
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


def _load(ref: Any, layout: Any) -> Any:
  """A whole shared-memory ref into registers in ``layout`` (jax 0.10 takes an index too)."""
  load = _plgpu().load
  if "idx" in inspect.signature(load).parameters:
    return load(ref, (), layout=layout)
  return load(ref, layout=layout)


def has_interpreter() -> bool:
  """Whether this JAX has Mosaic GPU's interpreter (jax >= 0.12)."""
  return hasattr(_plgpu(), "InterpretGPUParams")


def _swizzled() -> tuple[Any, Any]:
  """wgmma's operands in shared memory: 8 x 64 tiles, 128-byte swizzle (16-bit elements)."""
  plgpu = _plgpu()
  return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _interpreted(interpret: bool) -> dict[str, Any]:
  """``plgpu.kernel``'s keyword for Mosaic GPU's interpreter, where asked for."""
  return dict(interpret=_plgpu().InterpretGPUParams()) if interpret else {}


def _matmul(a: Any, b: Any, shape: tuple[int, int]) -> Any:
  """``a @ b`` on the tensor cores (wgmma) into a fresh float32 accumulator of ``shape``."""
  plgpu = _plgpu()

  def run(acc_ref: Any) -> Any:
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _staged(x: Any, smem: Any) -> Any:
  """wgmma's A operand: registers on a GPU (``smem`` None); in shared memory for the
  interpreter, whose wgmma reads A from there only."""
  if smem is None:
    return x
  smem[...] = x
  _plgpu().commit_smem()
  return smem


def _offsets(offsets: jax.Array | None) -> jax.Array:
  """The kernels' int32 (2,) input: the global index of the first batch row and head."""
  return jnp.zeros((2,), jnp.int32) if offsets is None else jnp.asarray(offsets, jnp.int32)


def _global(b: Any, h: Any, off_ref: Any) -> tuple[Any, Any]:
  """A program's batch row and head as the mask and score function see them: global."""
  return b + off_ref[0], h + off_ref[1]


def _walk(pipeline: Any, n_full: Any, n_partial: Any, masked: bool, carry: Any) -> Any:
  """A schedule's FULL tiles through one ``pipeline(first, count, masked, carry)``, then,
  where there is a mask, its PARTIAL ones through a second."""
  carry = pipeline(0, n_full, False, carry)
  return pipeline(n_full, n_partial, True, carry) if masked else carry


def _tile_scores(
  products: Any,
  *,
  scale: float,
  score_fn: Any,
  mask: Any,
  masked: bool,
  b: Any,
  h: Any,
  q0: Any,
  k0: Any,
  transposed: bool = False,
  derivative: bool = False,
  keep: Any = None,
) -> tuple[Any, Any]:
  """``(t, slope)`` of one tile: its base-2 scores ``score_fn(scale · q kᵀ) · log2(e)``, -inf
  where a PARTIAL tile's mask says so, and d score_fn(x)/dx (None without a score function
  or ``derivative``). ``products`` is ``q kᵀ`` (``k qᵀ`` when ``transposed``: keys along
  rows); query rows start at ``q0``, key rows at ``k0``; mask and score function see the
  elements' own indices (``mask`` and ``score_fn`` as :meth:`_Functions.bind` gives them).
  ``keep(q_idx, kv_idx)``: the segment ids' conjunct (:func:`_keeper`), and'ed with the mask
  on PARTIAL tiles."""
  plgpu = _plgpu()
  if score_fn is None and not masked:
    return products * (float(scale) * LOG2E), None
  iota = lambda axis: plgpu.broadcasted_iota(
    jnp.int32, products.shape, axis, layout=plgpu.Layout.WGMMA
  )
  q_idx, kv_idx = (iota(1) + q0, iota(0) + k0) if transposed else (iota(0) + q0, iota(1) + k0)
  slope = None
  if score_fn is None:
    t = products * (float(scale) * LOG2E)
  else:
    score = lambda x: score_fn(x, b, h, q_idx, kv_idx).astype(jnp.float32)
    x = products * float(scale)
    if derivative:  # score functions act elementwise on the scores
      y, slope = jax.jvp(score, (x,), (jnp.ones_like(x),))
    else:
      y = score(x)
    t = y * LOG2E
  if masked:
    allowed = None if mask is None else mask(b, h, q_idx, kv_idx)
    if keep is not None:
      allowed = keep(q_idx, kv_idx) if allowed is None else allowed & keep(q_idx, kv_idx)
    if allowed is not None:
      t = jnp.where(allowed, t, -jnp.inf)
  return t, slope


def _online_softmax(t: Any, m: Any, l: Any, masked: bool) -> tuple[Any, Any, Any, Any]:
  """One key tile's step of the base-2 online softmax: ``(p, alpha, m, l)`` from the tile's
  scores ``t`` and the rows' running max ``m`` and sum ``l``, alpha rescaling what came
  before. On a PARTIAL tile a row whose keys so far are all masked keeps m = -inf: it is
  shifted by 0, not by -inf."""
  m_new = jnp.maximum(m, t.max(axis=1))
  shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - shift)
  p = jnp.exp2(t - lax.broadcast_in_dim(shift, t.shape, [0]))
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


class _Functions(NamedTuple):
  """The mask (its conjuncts other than segment ids) and the score function as the kernels
  evaluate them: jaxprs traced at each tile shape the kernels use (batch row and head as
  scalars, query and key indices of the tile's shape), whose leading inputs are the arrays
  they read. The kernels take those arrays as inputs and read them an element at a time at
  indices of the batch row and head (:mod:`jattn.impl.flex._in_kernel`; :func:`mask_reason`
  and :func:`score_reason` refuse functions that read them otherwise)."""

  mask: dict[tuple[int, ...], Any] | None
  score: dict[tuple[int, ...], Any] | None
  n_mask: int  # arrays the mask reads
  n_score: int  # arrays the score function reads

  def bind(self, refs: Sequence[Any]) -> tuple[Any, Any]:
    """``(mask(b, h, q_idx, kv_idx), score_fn(s, b, h, q_idx, kv_idx))`` inside a kernel,
    their arrays read from ``refs`` (the mask's, then the score function's); None where
    absent."""
    mask_refs, score_refs = tuple(refs[: self.n_mask]), tuple(refs[self.n_mask :])
    mask = score = None
    if self.mask is not None:
      masks_ = self.mask
      mask = lambda b, h, q, kv: _in_kernel.evaluate(masks_[q.shape], mask_refs, b, h, q, kv)[0]
    if self.score is not None:
      fns = self.score
      score = lambda x, b, h, q, kv: _in_kernel.evaluate(fns[x.shape], score_refs, x, b, h, q, kv)[
        0
      ]
    return mask, score


class _Static(NamedTuple):
  """A call's static settings, as every kernel takes them."""

  scale: float
  block_kv: int  # the forward's key tiles (the backward's are ROWS)
  stages: int  # tiles in flight
  interpret: bool
  masked: bool  # a mask (is_causal included) leaves PARTIAL tiles to mask
  functions: _Functions


class _Arrays(NamedTuple):
  """A call's arrays beside query, key and value (a pytree: the custom_vjp's inputs)."""

  offsets: jax.Array  # int32 (2,): the global index of the first batch row and head
  forward: tuple[jax.Array, ...]  # the forward's schedule: order, FULL and PARTIAL counts
  rows: tuple[jax.Array, ...]  # dQ's (ROWS x ROWS tiles; () where only the forward runs)
  cols: tuple[jax.Array, ...]  # dK/dV's, over key tiles
  ids: tuple[jax.Array, ...]  # segment ids, query (Bm, T) and key (Bm, S) int32, or ()
  mask: tuple[jax.Array, ...]  # what the mask's other conjuncts read
  score: tuple[jax.Array, ...]  # what the score function reads

  def kernel_inputs(self, schedule: tuple[jax.Array, ...]) -> list[jax.Array]:
    """A kernel's inputs after its tensors: ``schedule``, the offsets, the segment ids, the
    mask's and the score function's arrays (:func:`_split`)."""
    return [*schedule, self.offsets, *self.ids, *self.mask, *self.score]


def _split(refs: Sequence[Any], static: _Static, n_ids: int) -> tuple[Any, ...]:
  """``(schedule's three refs, offsets, ids' refs, (mask, score) evaluators, the rest)`` of a
  kernel's refs after its tensors (the order of :meth:`_Arrays.kernel_inputs`)."""
  f = static.functions
  n_fn = f.n_mask + f.n_score
  ids = tuple(refs[4 : 4 + n_ids])
  return (
    tuple(refs[:3]),
    refs[3],
    ids,
    f.bind(refs[4 + n_ids : 4 + n_ids + n_fn]),
    refs[4 + n_ids + n_fn :],
  )


def _check_inputs(
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
) -> None:
  """What the kernels take, each refusal naming the argument."""
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  dtype = query.dtype
  if dtype not in (jnp.float16, jnp.bfloat16):
    raise ValueError(f"query: the Hopper kernel takes float16 or bfloat16, got {dtype}")
  if key.dtype != dtype or value.dtype != dtype:
    raise ValueError(f"key, value: dtypes {key.dtype}, {value.dtype} differ from query's {dtype}")
  if key.shape != (B, S, K, H) or value.shape != key.shape:
    raise ValueError(f"key, value: shapes {key.shape}, {value.shape}; want (B, S, K, H) = "
                     f"{(B, S, K, H)} with query's B and H")  # fmt: skip
  if N % K:
    raise ValueError(f"query: {N} heads are not a multiple of key's {K}")
  if H % 64:
    raise ValueError(f"query: head dim {H} is not a multiple of 64")
  if T % ROWS or S % block_kv or block_kv % 64:
    raise ValueError(
      f"query, key: lengths {T} and {S} must be multiples of {ROWS} and block_kv={block_kv} "
      "(itself a multiple of 64)"
    )
  if specialized and T % (2 * ROWS):
    raise ValueError(f"query: length {T} must be a multiple of {2 * ROWS} (specialized=True)")
  if is_causal and T != S:
    raise ValueError(f"is_causal: the Hopper kernel takes T = S, got {T} and {S}")
  if reason := mask_reason(mask):
    raise ValueError(f"mask: the Hopper kernel takes {reason}")
  if reason := score_reason(score_fn):
    raise ValueError(f"score_fn: the Hopper kernel takes {reason}")
  if interpret and not has_interpreter():
    raise ValueError("interpret: Mosaic GPU's interpreter needs jax >= 0.12")


def _prepare(
  query: jax.Array,
  key: jax.Array,
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
) -> tuple[_Arrays, _Static]:
  """A call as the kernels take it: the forward's tile schedule (and the backward's, where
  ``backward``), the segment ids, and the mask and score function traced at the kernels'
  tile shapes with the arrays they read."""
  rows = 2 * ROWS if specialized else ROWS  # a forward program's query rows
  full, forward_s, _ = _schedules(query, key, is_causal, mask, block_kv, rows)
  shapes = [(ROWS, block_kv)]
  rows_s: tuple[Any, ...] = ()
  cols_s: tuple[Any, ...] = ()
  if backward:
    _, rows_s, cols_s = _schedules(query, key, is_causal, mask, ROWS)
    shapes.append((ROWS, ROWS))  # dQ's tiles, and dK/dV's transposed ones
  rest, ids = _split_ids(full)
  mask_fns, mask_arrays = _traced(rest, shapes, score=False)
  score_fns, score_arrays = _traced(score_fn, shapes, score=True)
  functions = _Functions(mask_fns, score_fns, len(mask_arrays), len(score_arrays))
  static = _Static(float(scale), block_kv, stages, interpret, full is not None, functions)
  sched = lambda s: tuple(jnp.asarray(x) for x in s)
  arrays = _Arrays(
    _offsets(offsets), sched(forward_s), sched(rows_s), sched(cols_s), ids, mask_arrays,
    score_arrays,
  )  # fmt: skip
  return arrays, static


def _index_specs(shape: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
  """The (batch, head, q_idx, kv_idx) a kernel passes a mask or score function on a tile of
  ``shape``: the program's batch row and head as scalars, the tile's indices."""
  scalar, tile = (jax.ShapeDtypeStruct(x, jnp.int32) for x in ((), shape))
  return [scalar, scalar, tile, tile]


def _traced(
  fn: Any, shapes: Sequence[tuple[int, ...]], *, score: bool
) -> tuple[dict[tuple[int, ...], Any] | None, tuple[jax.Array, ...]]:
  """``fn`` (a mask, or a score function where ``score``) traced at each tile shape, and the
  arrays it reads (the same at every shape): ``(None, ())`` where ``fn`` is None."""
  if fn is None:
    return None, ()
  found: dict[tuple[int, ...], _kernels.Function] = {}
  for shape in dict.fromkeys(shapes):
    specs = _index_specs(shape)
    if score:
      specs.insert(0, jax.ShapeDtypeStruct(shape, jnp.float32))
    found[shape] = _kernels.Function.trace(lambda *a: fn(*a), *specs)
  first = next(iter(found.values()))
  for other in found.values():
    if not _kernels.same_arrays(first.arrays, other.arrays):
      name = "score_fn" if score else "mask"
      raise ValueError(f"{name}: {fn!r} reads different arrays at tiles of {list(found)}")
  return {shape: f.jaxpr for shape, f in found.items()}, first.arrays


class _Probe:
  """A kernel input's stand-in while a traced function is checked: notes whether it is read
  other than one element at a time (a slice or a gather at index arrays)."""

  def __init__(self, array: jax.Array) -> None:
    self.shape, self.dtype, self.wide = tuple(array.shape), array.dtype, False

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


def _reads_reason(fn: Any, *, score: bool) -> str | None:
  """Where ``fn`` reads an array other than an element at a time at indices of the batch
  row and head alone (an array per query or key position, a table indexed by distance), a
  phrase saying so; None where the kernels can evaluate it."""
  jaxprs, arrays = _traced(fn, [(ROWS, ROWS)], score=score)
  if not arrays:
    return None
  assert jaxprs is not None
  probes = [_Probe(a) for a in arrays]
  specs = _index_specs((ROWS, ROWS))
  if score:
    specs.insert(0, jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32))
  jax.eval_shape(lambda *a: _in_kernel.evaluate(jaxprs[ROWS, ROWS], probes, *a), *specs)
  wide = [p.shape for p in probes if p.wide]
  if not wide:
    return None
  return f"it reads an array of shape {wide[0]} at each query or key position"


def score_reason(score_fn: Any) -> str | None:
  """What the Hopper kernels cannot take in ``score_fn`` (None: they take it): score
  functions of the indices, reading arrays at the batch row and head alone (ALiBi's
  per-head slopes; not a table indexed by distance)."""
  if score_fn is None:
    return None
  if reason := _reads_reason(score_fn, score=True):
    return f"score functions reading arrays at the batch row and head alone, and {reason}"
  return None


def forward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool = False,
  mask: _masks.Mask | None = None,
  score_fn: Any = None,
  block_kv: int = 64,
  stages: int = 2,
  interpret: bool = False,
  base2: bool = False,
  specialized: bool = False,
  offsets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` of softmax attention: query (B, T, N, H), key and value (B, S, K, H),
  N a multiple of K (grouped queries), float16 or bfloat16, H a multiple of 64, T a multiple
  of 64 and S of ``block_kv``; ``is_causal`` as jax.nn's (query t sees keys s <= t, T = S),
  and ``mask`` a jattn mask, and'ed with it, that reads arrays at the batch row and head
  alone (lengths, prefix lengths, per-row causal offsets), and'ed with at most one set of
  segment ids (:func:`mask_reason`); ``score_fn(s, batch, head, q_idx, kv_idx)`` a jattn
  score function applied to the scaled scores, reading arrays at the batch row and head
  alone (``scores.soft_cap``, ``scores.alibi``; :func:`score_reason`).
  ``lse`` is (B, N, T) float32, the natural log-sum-exp of each row's scaled scores; a row
  that sees no key gives zeros and an lse of -inf.
  ``interpret`` runs it in Mosaic GPU's interpreter (jax >= 0.12), on any backend; ``base2``
  returns the log-sum-exp in base 2 of the scores times log2(e), as the backward takes it.
  ``specialized``: the warp-specialised kernel (:func:`_forward_specialized`: a copy
  warpgroup and two compute warpgroups per 128 query rows; T a multiple of 128).
  ``offsets``: the global index of the first batch row and head (int32 (2,)) where these
  inputs are one device's share of a sharded call; the mask and score function see
  global indices."""
  _check_inputs(
    query, key, value, is_causal=is_causal, mask=mask, score_fn=score_fn, block_kv=block_kv,
    interpret=interpret, specialized=specialized,
  )  # fmt: skip
  arrays, static = _prepare(
    query, key, scale=scale, is_causal=is_causal, mask=mask, score_fn=score_fn,
    block_kv=block_kv, stages=stages, interpret=interpret, specialized=specialized,
    offsets=offsets, backward=False,
  )  # fmt: skip
  run = _forward_specialized if specialized else _forward
  out, lse2 = run(query, key, value, arrays, static)
  return out, lse2 if base2 else lse2 / LOG2E


def _forward(
  query: jax.Array, key: jax.Array, value: jax.Array, arrays: _Arrays, static: _Static
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse in base 2)``: :func:`forward`'s one-warpgroup kernel."""
  plgpu = _plgpu()
  B, T, N, H = query.shape
  K = key.shape[2]
  dtype = query.dtype
  scale, block_kv, stages = static.scale, static.block_kv, static.stages
  interpret = static.interpret
  n_ids = len(arrays.ids)
  G = N // K
  swizzled = _swizzled()
  wgmma_layout = plgpu.Layout.WGMMA

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref = refs[:3]
    (order_ref, full_ref, partial_ref), off_ref, ids, (mask, score_fn), rest = _split(
      refs[3:], static, n_ids
    )
    out_ref, lse_ref, q_smem, o_smem, lse_smem, q_bar, p_smem, id_smem = rest
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _global(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    rows = pl.ds(i * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_bar.at[0])
    reduced = wgmma_layout.reduce(1)
    keeper = _keeper(ids, b_g, rows, id_smem, q_bar.at[1], transposed=False)
    plgpu.barrier_wait(q_bar.at[0])
    carry = (
      plgpu.layout_cast(jnp.full((ROWS, H), 0.0, jnp.float32), wgmma_layout),
      plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
      plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), reduced),
    )

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], k_smem: Any, v_smem: Any, *rest: Any) -> Any:
        *ids_smem, carry = rest  # the key tile's segment ids, where the mask reads them
        acc, m, l = carry
        j = order_ref[i, index[0] + first]  # the key tile

        products = _matmul(q_smem, k_smem.transpose((1, 0)), (ROWS, block_kv))
        t, _ = _tile_scores(
          products, scale=scale, score_fn=score_fn, mask=mask, masked=masked, b=b_g, h=h_g,
          q0=i * ROWS, k0=j * block_kv, keep=keeper(*ids_smem),
        )  # fmt: skip
        p, alpha, m_new, l = _online_softmax(t, m, l, masked)
        pv = _matmul(_staged(p.astype(dtype), p_smem), v_smem, (ROWS, H))
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda step: (order_ref[i, step + first], 0)
      spec = plgpu.BlockSpec((block_kv, H), at, transforms=swizzled)
      ids_specs, ids_refs = _streamed(ids, b_g, block_kv, lambda t: at(t)[0], False)
      return plgpu.emit_pipeline(
        step(first, masked),
        grid=(count,),
        in_specs=[spec, spec, *ids_specs],
        max_concurrent_steps=stages,
        init_carry=carry,
      )(k_ref.at[b, :, kv_head, :], v_ref.at[b, :, kv_head, :], *ids_refs)

    acc, m, l = _walk(pipeline, full_ref[i], partial_ref[i], static.masked, carry)
    if static.masked:  # rows that saw no key: acc is 0 (every p was), l too; out 0
      l = jnp.where(l == 0.0, 1.0, l)  # m stays -inf there: lse = m + log2(1)
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct(query.shape, dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=2),
      plgpu.SMEM((ROWS, block_kv), dtype, transforms=swizzled) if interpret else None,
      plgpu.SMEM((ROWS,), jnp.int32) if n_ids else None,  # the query tile's segment ids
    ),
    **_interpreted(interpret),
  )(query, key, value, *arrays.kernel_inputs(arrays.forward))


def _schedules(
  query: jax.Array, key: jax.Array, is_causal: bool, mask: Any, block: int, rows: int = ROWS
) -> tuple[Any, _tiling.Schedule, _tiling.Schedule]:
  """The mask and'ed with causal, and its (rows, columns) schedules at ``rows x block``."""
  B, T, N, _ = query.shape
  S = key.shape[1]
  if is_causal:
    mask = _masks.causal() if mask is None else _masks.causal() & mask
  view = _tiling.tile_classes(mask, B, N, T, S, rows, block)
  return mask, _tiling.schedule(view), _tiling.schedule(view.T)


def mask_reason(mask: Any) -> str | None:
  """What the Hopper kernels cannot take in ``mask`` (None: they take it): masks of the
  indices reading arrays at the batch row and head alone (lengths, prefix lengths, per-row
  causal offsets), and'ed with at most one set of segment ids (which each program reads
  tile by tile)."""
  parts = _masks_core.conjuncts(mask)
  if sum(isinstance(p, _masks.kinds.Segments) for p in parts) > 1:
    return f"one segments mask at most, {mask} has several"
  rest = _masks.all_of(*(p for p in parts if not isinstance(p, _masks.kinds.Segments)))
  if rest is not None and (reason := _reads_reason(rest, score=False)):
    return f"masks reading arrays at the batch row and head alone (and segment ids), and {reason}"
  return None


def _split_ids(mask: Any) -> tuple[Any, tuple[jax.Array, ...]]:
  """``mask`` (checked by :func:`mask_reason`) as (its other conjuncts, the segment ids it
  reads: query (Bm, T) and key (Bm, S) int32, or ())."""
  parts = _masks_core.conjuncts(mask)
  ids: tuple[jax.Array, ...] = ()
  rest = []
  for part in parts:
    if isinstance(part, _masks.kinds.Segments):
      ids = tuple(
        jnp.asarray(x, jnp.int32).reshape(-1, jnp.shape(x)[-1])
        for x in (part.q_segment_ids, part.kv_segment_ids)
      )
    else:
      rest.append(part)
  return _masks.all_of(*rest), ids


def _streamed(
  ids: Sequence[Any], b: Any, block: int, tile: Any, transposed: bool
) -> tuple[list[Any], list[Any]]:
  """The streamed axis's segment ids (``ids``: the kernel's refs, or none) as a pipeline's
  extra ``(in_specs, refs)``: ``tile(step)`` the step's tile of ``block`` entries. In a
  kernel one axis's ids are held for the program (the query tile's; the key tile's in the
  transposed dK/dV kernel), the other's streamed with each tile."""
  if not ids:
    return [], []
  src = ids[0] if transposed else ids[1]
  spec = _plgpu().BlockSpec((block,), lambda t: (tile(t),))
  return [spec], [src.at[_row(src, b)]]


def _keeper(
  ids: Sequence[Any], b: Any, held: Any, smem: Any, barrier: Any, *, transposed: bool
) -> Any:
  """``make(*streamed_ids_smem) -> keep(q_idx, kv_idx)`` (None without segment ids) for
  :func:`_tile_scores`; copies the held tile's ids (rows ``held``) to ``smem`` first."""
  if not ids:
    return lambda *_: None
  plgpu = _plgpu()
  vector = plgpu.Layout.WGMMA.reduce
  src = ids[1] if transposed else ids[0]
  plgpu.copy_gmem_to_smem(src.at[_row(src, b), held], smem, barrier)
  plgpu.barrier_wait(barrier)
  held_ids = _load(smem, vector(1))  # along the tile's rows

  def make(streamed: Any) -> Any:
    # The streamed tile's ids, along its columns: read now, while its buffer is held.
    other = _load(streamed, vector(0))

    def keep(q_idx: Any, kv_idx: Any) -> Any:
      shape = q_idx.shape
      rows = lax.broadcast_in_dim(held_ids, shape, [0])
      return rows == lax.broadcast_in_dim(other, shape, [1])

    return keep

  return make


def _row(ref: Any, b: Any) -> Any:
  """The row of per-batch values ``ref`` (Bm, ...) for global batch row ``b``."""
  return b if ref.shape[0] > 1 else 0


def _forward_specialized(
  query: jax.Array, key: jax.Array, value: jax.Array, arrays: _Arrays, static: _Static
) -> tuple[jax.Array, jax.Array]:
  """``(out, lse in base 2)``: :func:`forward` as FlashAttention-3 arranges it on Hopper.

  One program per 128 query rows, head and batch row, three warpgroups. The third copies:
  it walks the block's schedule (its FULL key tiles, then its PARTIAL ones, as
  ``schedule``'s int32 arrays at 128 x block_kv list them) and brings each key and value
  tile into one of ``stages`` shared-memory slots by TMA, each completing on the slot's
  barrier, waiting first until both compute warpgroups have released the slot. The first
  two compute, 64 query rows each, over the same tiles: ``S = Q Kᵀ`` and ``O += P V`` on
  the tensor cores, the online softmax in base 2 between them, the mask evaluated on
  PARTIAL tiles only. A schedule barrier that both
  compute warpgroups pass twice a step keeps one's softmax under the other's matrix
  products (ping-pong). The copy warpgroup gives up registers for the compute ones
  (``set_max_registers``). Where the block's schedule lists a tile one half of it does not
  need, that half evaluates the mask there and keeps nothing of it."""
  plgpu = _plgpu()
  B, T, N, H = query.shape
  K = key.shape[2]
  dtype = query.dtype
  G = N // K
  bk, stages, scale, interpret = static.block_kv, static.stages, static.scale, static.interpret
  swizzled = _swizzled()
  wgmma_layout = plgpu.Layout.WGMMA
  masked_tiles = static.masked
  n_ids = len(arrays.ids)

  def body(*refs: Any) -> None:
    q_ref, k_ref, v_ref = refs[:3]
    (order_ref, full_ref, partial_ref), off_ref, ids, (mask, score_fn), rest = _split(
      refs[3:], static, n_ids
    )
    out_ref, lse_ref, scoped = rest
    (qo_smem, k_smem, v_smem, lse_smem, p_smem, qid_smem, kid_smem), barriers = scoped
    k_ready, v_ready, q_ready, k_free, v_free, turn, ids_ready = barriers
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    b_g, h_g = _global(b, h, off_ref)
    n_full, n_partial = full_ref[i], partial_ref[i]
    steps = n_full + n_partial
    slot_of = lambda t: lax.rem(t, jnp.array(stages, t.dtype))

    def take_turn() -> None:  # the ping-pong: both compute warpgroups pass, in turn
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _compute() -> None:
      plgpu.set_max_registers(232, action="increase")
      q_smem = qo_smem.at[wg]
      q0 = i * (2 * ROWS) + wg * ROWS
      rows = pl.ds(q0, ROWS)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_ready.at[wg])
      held = None if qid_smem is None else qid_smem.at[wg]
      keeper = _keeper(ids, b_g, rows, held, ids_ready.at[wg], transposed=False)
      plgpu.barrier_wait(q_ready.at[wg])
      reduced = wgmma_layout.reduce(1)
      carry = (
        plgpu.layout_cast(jnp.full((ROWS, H), 0.0, jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
        plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), reduced),
      )
      pl.when(wg == 1)(take_turn)  # the second waits for the first's first product

      def step(t: Any, carry: Any, masked: bool) -> Any:
        acc, m, l = carry
        slot = slot_of(t)
        j = order_ref[i, t]  # the key tile
        plgpu.barrier_wait(k_ready.at[slot])

        def qk(acc_ref: Any) -> Any:
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          take_turn()
          return acc_ref[...]

        products = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32))
        # The key tile's ids (landed with it) are read before its slot is released.
        streamed = () if kid_smem is None else (kid_smem.at[slot],)
        keep = keeper(*streamed) if masked else None
        plgpu.barrier_arrive(k_free.at[slot])
        t_, _ = _tile_scores(
          products, scale=scale, score_fn=score_fn, mask=mask, masked=masked, b=b_g, h=h_g,
          q0=q0, k0=j * bk, keep=keep,
        )  # fmt: skip
        p, alpha, m_new, l = _online_softmax(t_, m, l, masked)
        p16 = p.astype(dtype)
        plgpu.barrier_arrive(turn)  # this softmax is done: the other may multiply
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(turn)  # and the tensor cores are ours again
        pv = _matmul(_staged(p16, None if p_smem is None else p_smem.at[wg]), v_smem.at[slot],
                     (ROWS, H))  # fmt: skip
        plgpu.barrier_arrive(v_free.at[slot])
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

      carry = lax.fori_loop(0, n_full, lambda t, c: step(t, c, False), carry)
      acc, m, l = lax.fori_loop(n_full, steps, lambda t, c: step(t, c, masked_tiles), carry)
      pl.when(wg == 0)(take_turn)  # the first's last pass, matching the second's first
      if masked_tiles:  # rows that saw no key: acc is 0 (every p was), l too; out 0
        l = jnp.where(l == 0.0, 1.0, l)  # m stays -inf there: lse = m + log2(1)
      q_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
      lse_smem.at[wg][...] = m + jnp.log2(l)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, rows, h])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _copy() -> None:
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(h, jnp.array(G, h.dtype))

      @pl.loop(0, steps)
      def _(t: Any) -> None:
        slot = slot_of(t)
        cols = pl.ds(order_ref[i, t] * bk, bk)

        @pl.when(t >= stages)  # the slot's last tile is released by both compute groups
        def _() -> None:
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kv_head], k_smem.at[slot], k_ready.at[slot])
        if kid_smem is not None:  # the key tile's segment ids, on the same barrier
          kv_ids = ids[1]
          plgpu.copy_gmem_to_smem(
            kv_ids.at[_row(kv_ids, b_g), cols], kid_smem.at[slot], k_ready.at[slot]
          )

        @pl.when(t >= stages)
        def _() -> None:
          plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kv_head], v_smem.at[slot], v_ready.at[slot])

  def entry(*refs: Any) -> None:
    smem = (
      plgpu.SMEM((2, ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((stages, bk, H), dtype, transforms=swizzled),
      plgpu.SMEM((stages, bk, H), dtype, transforms=swizzled),
      plgpu.SMEM((2, ROWS), jnp.float32),
      # The interpreter's wgmma reads its A operand (P) from shared memory only.
      plgpu.SMEM((2, ROWS, bk), dtype, transforms=swizzled) if interpret else None,
      plgpu.SMEM((2, ROWS), jnp.int32) if n_ids else None,  # each group's query ids
      plgpu.SMEM((stages, bk), jnp.int32) if n_ids else None,  # each slot's key ids
    )
    barriers = (
      # a key tile landed in the slot (and its segment ids: two copies arrive)
      plgpu.Barrier(num_arrivals=2 if n_ids else 1, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),  # a value tile
      plgpu.Barrier(num_barriers=2),  # each compute group's query tile
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both groups done with a key slot
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # and with a value slot
      plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the ping-pong's turn
      plgpu.Barrier(num_barriers=2),  # each compute group's query ids
    )
    pl.run_scoped(lambda *scoped: body(*refs, scoped), smem, barriers, collective_axes="wg")

  return plgpu.kernel(
    entry,
    out_type=(
      jax.ShapeDtypeStruct(query.shape, dtype),
      jax.ShapeDtypeStruct((B, N, T), jnp.float32),
    ),
    grid=(T // (2 * ROWS), N, B),
    grid_names=("q", "h", "b"),
    num_threads=3,
    thread_name="wg",
    **_interpreted(interpret),
  )(query, key, value, *arrays.kernel_inputs(arrays.forward))


def _backward(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  out: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  arrays: _Arrays,
  static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(dq, dk, dv)`` of :func:`forward`'s output for the cotangent ``d_out``, from its
  output and base-2 log-sum-exp ``lse2``: a dQ kernel (one program per 64-row query tile,
  its key tiles streamed) and a dK/dV kernel in the transposed domain (one program per
  64-row key tile and query head, its query tiles streamed; ``Sᵀ = K Qᵀ``, ``dV += Pᵀ dO``,
  ``dPᵀ = V dOᵀ``, ``dK += dSᵀ Q``, every product a wgmma), dS rounded once to the inputs'
  dtype as on Hopper's Triton rows. Grouped queries sum their dK and dV over the group in
  XLA. Tiles of 64 by 64; the mask's schedules as in the forward."""
  plgpu = _plgpu()
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G, dtype, bk = N // K, query.dtype, ROWS
  scale, stages, interpret = static.scale, static.stages, static.interpret
  n_ids = len(arrays.ids)
  swizzled = _swizzled()
  layout = plgpu.Layout.WGMMA
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
  # Rows that saw no key (lse -inf) take no gradient: shift them by +inf, p = 0
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)

  def scores(
    products: Any, fns: tuple[Any, Any], masked: bool, b: Any, h: Any, q0: Any, k0: Any,
    transposed: bool, keep: Any,
  ) -> tuple[Any, Any]:  # fmt: skip
    return _tile_scores(
      products, scale=scale, score_fn=fns[1], mask=fns[0], masked=masked, b=b, h=h, q0=q0,
      k0=k0, transposed=transposed, derivative=True, keep=keep,
    )  # fmt: skip

  def through_score(ds: Any, slope: Any) -> Any:
    """dS of the scaled scores: of the score function's output times its derivative."""
    return ds if slope is None else ds * slope

  def dq_body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    (order_ref, full_ref, partial_ref), off_ref, ids, fns, rest = _split(refs[6:], static, n_ids)
    dq_ref, q_smem, do_smem, lse_smem, delta_smem, bars, a_smem, id_smem = rest
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _global(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    rows = pl.ds(i * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem, bars.at[3])
    for n in range(4):
      plgpu.barrier_wait(bars.at[n])
    lse = _load(lse_smem, layout.reduce(1))
    dlt = _load(delta_smem, layout.reduce(1))
    keeper = _keeper(ids, b_g, rows, id_smem, bars.at[4], transposed=False)

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], k_smem: Any, v_smem: Any, *rest: Any) -> Any:
        *ids_smem, dq = rest
        j = order_ref[i, index[0] + first]
        products = _matmul(q_smem, k_smem.transpose((1, 0)), (ROWS, bk))
        keep = keeper(*ids_smem)
        t, slope = scores(products, fns, masked, b_g, h_g, i * ROWS, j * bk, False, keep)
        p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [0]))
        dp = _matmul(do_smem, v_smem.transpose((1, 0)), (ROWS, bk))
        ds = p * (dp - lax.broadcast_in_dim(dlt, t.shape, [0]))
        ds = through_score(ds, slope).astype(dtype)
        return dq + _matmul(_staged(ds, a_smem), k_smem, (ROWS, H))

      return run

    def pipeline(first: Any, count: Any, masked: bool, dq: Any) -> Any:
      at = lambda t: order_ref[i, t + first]
      spec = plgpu.BlockSpec((bk, H), lambda t: (at(t), 0), transforms=swizzled)
      ids_specs, ids_refs = _streamed(ids, b_g, bk, at, False)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[spec, spec, *ids_specs],
        max_concurrent_steps=stages, init_carry=dq,
      )(k_ref.at[b, :, kv_head, :], v_ref.at[b, :, kv_head, :], *ids_refs)  # fmt: skip

    dq = plgpu.layout_cast(jnp.full((ROWS, H), 0.0, jnp.float32), layout)
    dq = _walk(pipeline, full_ref[i], partial_ref[i], static.masked, dq)
    q_smem[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)

  def dkv_body(*refs: Any) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    (order_ref, full_ref, partial_ref), off_ref, ids, fns, rest = _split(refs[6:], static, n_ids)
    dk_ref, dv_ref, k_smem, v_smem, bars, a_smem, id_smem = rest
    j, h, b = lax.axis_index("kv"), lax.axis_index("h"), lax.axis_index("b")
    b_g, h_g = _global(b, h, off_ref)
    kv_head = lax.div(h, jnp.array(G, h.dtype))
    cols = pl.ds(j * bk, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kv_head], k_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kv_head], v_smem, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    keeper = _keeper(ids, b_g, cols, id_smem, bars.at[2], transposed=True)

    def step(first: Any, masked: bool) -> Any:
      def run(index: tuple[Any], q_smem: Any, do_smem: Any, lse_smem: Any, d_smem: Any,
              *rest: Any) -> Any:  # fmt: skip
        *ids_smem, carry = rest
        dk, dv = carry
        i = order_ref[j, index[0] + first]
        lse = _load(lse_smem, layout.reduce(0))
        dlt = _load(d_smem, layout.reduce(0))
        products = _matmul(k_smem, q_smem.transpose((1, 0)), (bk, ROWS))
        keep = keeper(*ids_smem)
        t, slope = scores(products, fns, masked, b_g, h_g, i * ROWS, j * bk, True, keep)
        p = jnp.exp2(t - lax.broadcast_in_dim(lse, t.shape, [1]))
        dv = dv + _matmul(_staged(p.astype(dtype), a_smem), do_smem, (bk, H))
        dp = _matmul(v_smem, do_smem.transpose((1, 0)), (bk, ROWS))
        ds = p * (dp - lax.broadcast_in_dim(dlt, t.shape, [1]))
        ds = through_score(ds, slope).astype(dtype)
        return dk + _matmul(_staged(ds, a_smem), q_smem, (bk, H)), dv

      return run

    def pipeline(first: Any, count: Any, masked: bool, carry: Any) -> Any:
      at = lambda t: order_ref[j, t + first]
      tile = plgpu.BlockSpec((ROWS, H), lambda t: (at(t), 0), transforms=swizzled)
      vec = plgpu.BlockSpec((ROWS,), lambda t: (at(t),))
      ids_specs, ids_refs = _streamed(ids, b_g, ROWS, at, True)
      return plgpu.emit_pipeline(
        step(first, masked), grid=(count,), in_specs=[tile, tile, vec, vec, *ids_specs],
        max_concurrent_steps=stages, init_carry=carry,
      )(q_ref.at[b, :, h, :], do_ref.at[b, :, h, :], lse_ref.at[b, h, :],
        delta_ref.at[b, h, :], *ids_refs)  # fmt: skip

    zero = plgpu.layout_cast(jnp.full((bk, H), 0.0, jnp.float32), layout)
    dk, dv = _walk(pipeline, full_ref[j], partial_ref[j], static.masked, (zero, zero))
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, cols, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, cols, h])
    plgpu.wait_smem_to_gmem(0)

  a_scratch = lambda shape: plgpu.SMEM(shape, dtype, transforms=swizzled) if interpret else None
  inputs = (query, key, value, d_out, lse2.astype(jnp.float32), delta)
  dq = plgpu.kernel(
    dq_body,
    out_type=jax.ShapeDtypeStruct(query.shape, dtype),
    grid=(T // ROWS, N, B),
    grid_names=("q", "h", "b"),
    scratch_types=(
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS, H), dtype, transforms=swizzled),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=5),
      a_scratch((ROWS, bk)),
      plgpu.SMEM((ROWS,), jnp.int32) if n_ids else None,  # the query tile's segment ids
    ),
    **_interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.rows))
  per_head = jax.ShapeDtypeStruct((B, S, N, H), dtype)  # each query head's dK, dV
  dk, dv = plgpu.kernel(
    dkv_body,
    out_type=(per_head, per_head),
    grid=(S // bk, N, B),
    grid_names=("kv", "h", "b"),
    scratch_types=(
      plgpu.SMEM((bk, H), dtype, transforms=swizzled),
      plgpu.SMEM((bk, H), dtype, transforms=swizzled),
      plgpu.Barrier(num_barriers=3),
      a_scratch((bk, ROWS)),
      plgpu.SMEM((bk,), jnp.int32) if n_ids else None,  # the key tile's segment ids
    ),
    **_interpreted(interpret),
  )(*inputs, *arrays.kernel_inputs(arrays.cols))
  group = lambda x: x.reshape(B, S, K, G, H).sum(3, dtype=jnp.float32).astype(dtype)
  return dq, group(dk), group(dv)


def attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  scale: float,
  is_causal: bool = False,
  mask: _masks.Mask | None = None,
  score_fn: Any = None,
  interpret: bool = False,
  specialized: bool = False,
  offsets: jax.Array | None = None,
  block_kv: int = 64,
  stages: int = 2,
) -> jax.Array:
  """:func:`forward`'s output, differentiable in query, key and value by :func:`_backward`'s
  kernels, and in the floating arrays a score function reads (learned ALiBi slopes) through
  the score function's VJP on the whole (B, N, T, S) grid in XLA (O(B·N·T·S) memory, as
  flex's Triton kernels take them; :func:`_learned_grads`), where those are differentiated;
  arguments as :func:`forward`'s."""
  _check_inputs(
    query, key, value, is_causal=is_causal, mask=mask, score_fn=score_fn, block_kv=block_kv,
    interpret=interpret, specialized=specialized,
  )  # fmt: skip
  arrays, static = _prepare(
    query, key, scale=scale, is_causal=is_causal, mask=mask, score_fn=score_fn,
    block_kv=block_kv, stages=stages, interpret=interpret, specialized=specialized,
    offsets=offsets, backward=True,
  )  # fmt: skip
  run = _forward_specialized if specialized else _forward

  # The arrays the mask and score function read (traced arrays among them) are the
  # custom_vjp's inputs, not its closure.
  @jax.custom_vjp
  def attend(q: jax.Array, k: jax.Array, v: jax.Array, arrays: _Arrays) -> jax.Array:
    return run(q, k, v, arrays, static)[0]

  def fwd(q: Any, k: Any, v: Any, arrays: Any) -> Any:
    # symbolic_zeros: each input comes as (value, perturbed). Which of the score function's
    # arrays are learned rides in the residuals' tree structure: () where so, else None.
    learned = tuple(
      () if a.perturbed and jnp.issubdtype(a.value.dtype, jnp.floating) else None
      for a in arrays.score
    )
    q, k, v, arrays = _common.primal_values((q, k, v, arrays))
    out, lse2 = run(q, k, v, arrays, static)
    return out, (q, k, v, out, lse2, arrays, learned)

  def bwd(res: Any, d_out: Any) -> Any:
    q, k, v, out, lse2, arrays, learned = res
    d_out = _common.materialized(d_out)
    dq, dk, dv = _backward(q, k, v, out, lse2, d_out, arrays, static)
    d_arrays = jax.tree.map(_zero_cotangent, arrays)
    chosen = [i for i, x in enumerate(learned) if x is not None]
    if chosen:
      d_chosen = _learned_grads(q, k, v, out, lse2, d_out, arrays, static, chosen)
      d_score = list(d_arrays.score)
      for i, d in zip(chosen, d_chosen):
        d_score[i] = d.astype(arrays.score[i].dtype)
      d_arrays = d_arrays._replace(score=tuple(d_score))
    return dq, dk, dv, d_arrays

  attend.defvjp(fwd, bwd, symbolic_zeros=True)
  return attend(query, key, value, arrays)


def _zero_cotangent(x: jax.Array) -> Any:
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _on_grid(
  jaxpr: Any, arrays: Sequence[jax.Array], shape: tuple[int, int, int, int], offsets: Any,
  scores: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """A mask's or score function's tile jaxpr (traced at ROWS x ROWS) on the whole (B, N, T,
  S) grid in XLA, its arrays as plain inputs: mapped over batch rows and heads (global:
  ``offsets`` added) and tiles; ``scores`` (B, N, T, S) a score function's input."""
  B, N, T, S = shape
  run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, []))
  iota = lax.broadcasted_iota(jnp.int32, (ROWS, ROWS), 0)
  q_in, kv_in = iota, iota.T

  def tile(b: Any, h: Any, i: Any, j: Any, *x: Any) -> jax.Array:
    (y,) = run(*arrays, *x, b, h, q_in + i * ROWS, kv_in + j * ROWS)
    return jnp.broadcast_to(y, (ROWS, ROWS))

  x: tuple[jax.Array, ...] = ()
  if scores is not None:  # its (B, N, T/ROWS, S/ROWS, ROWS, ROWS) tiles
    tiles = scores.reshape(B, N, T // ROWS, ROWS, S // ROWS, ROWS)
    x = (tiles.transpose(0, 1, 2, 4, 3, 5),)
  each = tile
  for axis in (3, 2, 1, 0):  # over key tiles, query tiles, heads, batch rows
    in_axes: list[int | None] = [None] * 4
    in_axes[axis] = 0
    each = jax.vmap(each, in_axes=(*in_axes, *(0,) * len(x)))  # the scores' leading axis
  b = jnp.arange(B, dtype=jnp.int32) + offsets[0]
  h = jnp.arange(N, dtype=jnp.int32) + offsets[1]
  i, j = jnp.arange(T // ROWS, dtype=jnp.int32), jnp.arange(S // ROWS, dtype=jnp.int32)
  out = each(b, h, i, j, *x)  # (B, N, T/ROWS, S/ROWS, ROWS, ROWS)
  return out.transpose(0, 1, 2, 4, 3, 5).reshape(B, N, T, S)


def _learned_grads(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  out: jax.Array,
  lse2: jax.Array,
  d_out: jax.Array,
  arrays: _Arrays,
  static: _Static,
  chosen: list[int],
) -> list[jax.Array]:
  """The gradients of the score function's arrays ``arrays.score[chosen]``: its VJP on the
  whole (B, N, T, S) grid at the call's scaled scores (recomputed in float32), the cotangent
  dS = P ⊙ (dP − Δ) of its output, P from the forward's log-sum-exp."""
  del out  # rounded to the inputs' dtype: Δ is recomputed (below)
  B, T, N, _ = query.shape
  S, K = key.shape[1], key.shape[2]
  f = jnp.float32
  fns = static.functions
  assert fns.score is not None
  score_jaxpr = fns.score[ROWS, ROWS]
  grouped = lambda x: jnp.repeat(x.astype(f), N // K, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", query.astype(f), grouped(key)) * static.scale
  shape = (B, N, T, S)
  allowed = None
  if fns.mask is not None:
    allowed = _on_grid(fns.mask[ROWS, ROWS], arrays.mask, shape, arrays.offsets).astype(bool)
  if arrays.ids:  # segment ids, at the global batch rows
    rows = jnp.arange(B) + arrays.offsets[0]
    q_ids, kv_ids = (x[rows] if x.shape[0] > 1 else x[:1] for x in arrays.ids)
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    allowed = same if allowed is None else allowed & same

  def score(*learned: jax.Array) -> jax.Array:
    inputs = list(arrays.score)
    for i, x in zip(chosen, learned):
      inputs[i] = x
    return _on_grid(score_jaxpr, inputs, shape, arrays.offsets, s).astype(f)

  y, vjp = jax.vjp(score, *(arrays.score[i] for i in chosen))
  t = y * LOG2E
  if allowed is not None:
    t = jnp.where(allowed, t, -jnp.inf)
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)  # rows that saw no key: p = 0
  p = jnp.exp2(t - lse2[..., None])
  dp = jnp.einsum("btnh,bsnh->bnts", d_out.astype(f), grouped(value))
  # Δ = rowsum(P ⊙ dP) = rowsum(O ⊙ dO) at the unrounded output: the kernel's, rounded to
  # the inputs' dtype, would leave its rounding in dP − Δ, which the sum over every
  # position (ALiBi's slope sums dS times the distance) amplifies.
  delta = jnp.sum(p * dp, axis=-1, keepdims=True)
  return list(vjp(p * (dp - delta)))
