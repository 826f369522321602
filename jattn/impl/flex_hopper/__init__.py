"""``implementation="flex_hopper"``: flex's kernels written for Mosaic GPU, for Hopper
(sm_90): wgmma and TMA through Pallas.

**Not yet run on a GPU, and reached only by name**: they lower for CUDA from a CPU (one
Mosaic GPU call per kernel) and compute exact values in Mosaic GPU's interpreter (jax
0.11.2 and 0.12), but ``implementation=None`` routes no call to them until a GPU has run
them and the record is committed; ``implementation="flex_hopper"`` (this package's row of
the selection table, :data:`IMPLEMENTATION`) opts in, and ``python -m experiments.gpu_probe``
times them (methods ``hopper`` and ``hopper_ws``, the latter with the warp-specialised
kernels) beside cuDNN and the Triton kernels.
The package, a module a concern: ``_mosaic`` (Mosaic GPU's pieces the kernels share),
``_call`` (what the kernels refuse, and a call prepared for them: schedules, segment ids,
the traced mask and score function and the arrays they read), ``_tile`` (one tile's
scores and softmax step), ``_forward`` (the two forward kernels), ``_backward`` (the dQ and
dK/dV kernels, one warpgroup or warp-specialised), ``_grid`` (the gradients left to XLA on
the whole grid: learned arrays', a bias's), ``_padding`` (lengths and head dims off the
tiles), ``_attention`` (:func:`forward`, and :func:`attention`, which joins the forward
kernel and the backward's two in a ``custom_vjp``); here the row.

Masks and score functions are traced per tile shape (``_call.Functions``) and may read
arrays at the batch row and head (lengths, prefix lengths, ALiBi's slopes): the kernels take
those as inputs and read them an element at a time; segment ids are and'ed with them (each
program copies its own tile's ids once and streams the other axis's ids with each tile it
walks). Dropout's pattern is regenerated in each kernel from the seed at every element's
global indices (``_tile.dropout_keep``; on a sequence-parallel part, the global positions
its maps give, read as runs), as every implementation draws it. A bias is read tile by tile
beside the key tiles (transposed planes for dK/dV), in wgmma's layout from swizzled shared
memory; so is a dense boolean mask (as bfloat16 0 and 1, on PARTIAL tiles). An array a mask
or score function reads along the query or key positions (``flags[q_idx]``, a sequence-
parallel part's position map) is read as one run a tile from global memory (``_tile.line``);
one read at computed positions (a table indexed by distance, T5's) is refused by name:
Mosaic GPU has no gather. Lengths and head dims off the kernels' tiles run padded to them
(``_padding``), the padding masked and cut.

One program per (query tile of 64 rows, head, batch row), one warpgroup: the query tile is
copied to shared memory once (TMA), then ``plgpu.emit_pipeline`` streams the key and value
tiles through ``stages`` shared-memory buffers (TMA, mbarriers) while the warpgroup runs
``S = Q Kᵀ`` and ``O += P V`` on the tensor cores (wgmma) and the online softmax in base 2
between them (the scale times log2(e) folded into one multiply, as the Triton kernels do).
A mask's tile schedule (flex's: per query tile, its FULL key tiles, then its PARTIAL ones)
comes in as three int32 arrays that the pipelines' index maps read: the FULL tiles stream
through one pipeline, the PARTIAL ones through a second, the only one that evaluates the
mask (traced into the kernel body on the tile's indices); EMPTY tiles are never loaded (and
where the rows grow heavier along the sequence, causal query tiles, the programs take them
last first: ``_call.Static.from_last``). On
the GPU each step's P V (and each backward product summed into dQ, dK or dV) accumulates
into the rescaled accumulator's own registers (``_mosaic.accumulate``), and P stays in
registers as wgmma's A operand; the interpreter, which cannot start a wgmma from an
accumulator in registers and reads A from shared memory only, adds a fresh accumulator
(``acc · α + P V``) and stages P there: the same sums, which its tests check.

``specialized=True`` arranges the passes as FlashAttention-3 does (``_forward.specialized``,
``_backward.specialized``): a copy warpgroup walks the schedule and feeds the streamed
tiles by TMA to two compute warpgroups of 64 rows each, which share them (in the forward,
taking turns on the tensor cores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn.impl import _gpus, contract, sharded
from jattn.impl.contract import CallSpec
from jattn.impl.flex_hopper import _call
from jattn.impl.flex_hopper._attention import attention as attention
from jattn.impl.flex_hopper._attention import forward as forward
from jattn.impl.flex_hopper._mosaic import LOG2E as LOG2E
from jattn.impl.flex_hopper._mosaic import ROWS as ROWS
from jattn.impl.flex_hopper._mosaic import has_interpreter as has_interpreter
from jattn.impl.flex_hopper._padding import head_dim as head_dim
from jattn.impl.flex_hopper._padding import paddable as paddable

__all__ = [
  "IMPLEMENTATION",
  "OPT_IN",
  "forward",
  "attention",
  "LOG2E",
  "ROWS",
  "has_interpreter",
  "head_dim",
  "paddable",
]


OPT_IN = (
  "flex's Hopper kernels have not yet run on a GPU, and jattn routes no call to a kernel "
  "before a recorded run: implementation='flex_hopper' opts in"
)


def _check(call: contract.Call) -> str | None:
  s = call.spec
  if s.interpret:
    if not has_interpreter():
      return "Pallas interpret mode: Mosaic GPU's interpreter needs jax >= 0.11.2"
  elif _gpus.generation(kind := _gpus.gpu_kind()) != "sm_90":
    here = repr(kind) if kind else "none is named (jattn.testing.lowering_for's device_kind)"
    return f"it needs a Hopper GPU (sm_90), and {here}"
  if (s.T % ROWS or s.S % ROWS) and not paddable(s.mask):
    return (
      f"lengths T={s.T}, S={s.S} with a mask fixed to them (it takes multiples of "
      f"{ROWS}, or pads a call whose mask it can pad)"
    )
  up = lambda n: -(-n // ROWS) * ROWS
  padded = (up(s.T), up(s.S))  # the lengths it runs at
  if reason := _call.mask_reason(s.mask, padded):
    return f"mask {s.mask!r}: it takes {reason}"
  if reason := _call.score_reason(s.score_fn, padded):
    return f"score_fn {s.score_fn!r}: it takes {reason}"
  bias_dtype = None if s.bias is None else jnp.result_type(s.bias)
  H, Hv = head_dim(s.H), head_dim(s.Hv)  # the head dims it runs at
  if reason := _call.smem_reason(H, call.dtype, bias_dtype, s.mask, Hv=Hv):
    return reason
  return None


def _run(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  # Mosaic GPU's interpreter runs on ordered callbacks, which a partitioning rule cannot
  # carry: interpreted (tests), the kernels run on the arrays as they come.
  return sharded.per_shard(
    _attend, query, key, value, spec, global_index=True, auto=not spec.interpret
  )


def _attend(query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec) -> sharded.Results:
  out, lse, top = attention(
    query,
    key,
    value,
    scale=spec.scale,
    mask=spec.mask,
    score_fn=spec.score_fn,
    interpret=spec.interpret,
    offsets=spec.shard_offsets,
    dropout_rate=spec.dropout_rate,
    dropout_rng=spec.dropout_rng,
    broadcast_dropout=spec.broadcast_dropout,
    bias=spec.bias,
    batch_heads=(spec.B, spec.N),
    positions=spec.positions,
  )
  return out, lse, top if spec.return_max_logit else None


IMPLEMENTATION = contract.Implementation(
  name="flex_hopper",
  runs_on=("gpu",),
  backwards=(),  # its own fused backward kernels
  masks=(
    "masks of the indices reading arrays at the batch row and head or along the positions "
    "(causal, windows, chunks, strides, lengths, prefix-LM, from_fn, a part's position map), "
    "and'ed with segment ids and a dense mask"
  ),
  run=_run,
  dtypes=("bfloat16", "float16"),
  positions=None,  # a sequence-parallel part's dropout positions are read in the kernels
  fused=True,
  interpretable=True,
  check=_check,
  opt_in=OPT_IN,
)
