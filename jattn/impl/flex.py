"""``implementation="flex"``: jattn's own fused GPU kernel, any index mask and score function
compiled into one Pallas kernel (Triton lowering), forward and backward.

The call's combined mask and its score function (with the soft cap) are traced into the
kernels' bodies on each tile's indices (:mod:`jattn.impl._in_kernel`); the tiles come from
the mask's tile classes as in blockwise, so EMPTY tiles are never loaded and FULL ones skip
the mask (:mod:`jattn.impl._flex_kernels`, :mod:`jattn.impl._flex_backward`). GQA and MQA
read each key/value head once; the value head dim may differ; lengths need not be whole
tiles; dropout's pattern is regenerated from (rng, batch, head, q, kv) in each kernel, as
every implementation draws it; a bias of any broadcastable shape is read tile by tile (its
gradient, where asked for, through a (B, N, T, S) float32 buffer); rows with nothing to
attend to give zeros and an lse of -inf.

On a GPU, ``implementation=None`` runs it for every call cuDNN does not express (it comes
after cuDNN in the table). Not yet: gradients of the floating arrays a score function reads
(learned parameters; refused when differentiated) and a per-GPU table of blocks, warps and
stages. Sinks are added around it, as for every implementation that does not take them
itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jattn import dropout as _dropout
from jattn.impl import _base, _flex_backward
from jattn.impl import _flex_kernels as _kernels

if TYPE_CHECKING:
  from jattn._spec import CallSpec

BACKWARDS: tuple[str, ...] = ()  # its own fused backward kernels
DEFAULT_BLOCKS = (64, 64)  # (block_q, block_kv): powers of two, as Triton's blocks are


def resolve_blocks(block_q: int | None, block_kv: int | None) -> tuple[int, int]:
  return (block_q or DEFAULT_BLOCKS[0], block_kv or DEFAULT_BLOCKS[1])


def _check(call: _base.Call) -> str | None:
  s = call.spec
  for name, block in (("block_q", s.block_q), ("block_kv", s.block_kv)):
    if block is not None and (block < 16 or block & (block - 1)):
      return f"{name}={block} (flex's tiles are powers of two, at least 16)"
  return None


def _prepare(spec: CallSpec, blocks: tuple[int | None, int | None], backend: str) -> CallSpec:
  del backend  # one table of tiles for now (see the module docstring)
  block_q, block_kv = resolve_blocks(*blocks)
  return dataclasses.replace(spec, block_q=block_q, block_kv=block_kv)


def _run(
  query: jax.Array, key: jax.Array, value: jax.Array, spec: CallSpec
) -> tuple[jax.Array, jax.Array]:
  B, T, N, _ = query.shape
  S = key.shape[1]
  # Tiles no longer than the lengths rounded up to a power of two (Triton's blocks).
  bq = min(spec.block_q or DEFAULT_BLOCKS[0], max(16, _kernels.pow2(T)))
  bk = min(spec.block_kv or DEFAULT_BLOCKS[1], max(16, _kernels.pow2(S)))
  specs = _kernels.index_specs(bq, bk)
  mask = score = None
  if spec.mask is not None:
    m = spec.mask
    mask = _kernels.Function.trace(lambda b, h, q, kv: m(b, h, q, kv), *specs)
  if spec.score_fn is not None:
    fn = spec.score_fn
    s_spec = jax.ShapeDtypeStruct((1, 1, bq, bk), jnp.promote_types(query.dtype, jnp.float32))
    score = _kernels.Function.trace(lambda s, b, h, q, kv: fn(s, b, h, q, kv), s_spec, *specs)
  rows, cols = _kernels.schedules(spec.mask, B, N, T, S, bq, bk)
  settings = _kernels.Settings(
    scale=spec.scale,
    q_len=T,
    kv_len=S,
    block_q=bq,
    block_kv=bk,
    num_warps=4 if spec.H <= 64 else 8,
    num_stages=2,
    interpret=spec.interpret,
    dropout_rate=spec.dropout_rate,
    broadcast_dropout=spec.broadcast_dropout,
  )
  seed = None
  if spec.dropout_rate:
    seed = jnp.stack(_dropout.seed_words(spec.dropout_rng))
  return _flex_backward.attention(
    query, key, value, rows, cols, mask, score, settings, seed, spec.bias
  )


IMPLEMENTATION = _base.Implementation(
  name="flex",
  runs_on=("gpu",),
  backwards=BACKWARDS,
  masks="every mask: index functions and the arrays they read, traced into the kernel",
  run=_run,
  prepare=_prepare,
  dtypes=("float32", "bfloat16", "float16"),
  tiles=True,
  fused=True,
  interpretable=True,
  check=_check,
)
