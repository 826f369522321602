"""Mosaic GPU's pieces as flex's Hopper kernels use them: the module itself (imported when
a kernel is built), its interpreter, wgmma into a fresh accumulator or a held one, the
shared-memory layout wgmma reads, the walk over a tile schedule, and the constants every
kernel shares."""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)


ROWS = 64  # a warpgroup's wgmma M
SMEM_BYTES = 227 * 1024  # the shared memory one Hopper (sm_90) program may take


def mosaic_gpu() -> Any:
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


def load(ref: Any, layout: Any, optimized: bool = True) -> Any:
  """A whole shared-memory ref into registers in ``layout`` (jax 0.10 requires an index too;
  0.11 still takes one but warns that it is deprecated, 0.12 takes none); a global-memory
  one with ``optimized=False`` (Mosaic GPU before jax 0.12 has no optimized load from
  there)."""
  load = mosaic_gpu().load
  idx = inspect.signature(load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return load(ref, (), layout=layout, optimized=optimized)
  return load(ref, layout=layout, optimized=optimized)


def has_interpreter() -> bool:
  """Whether this JAX has Mosaic GPU's interpreter (jax >= 0.11.2)."""
  return hasattr(mosaic_gpu(), "InterpretGPUParams")


def swizzled(itemsize: int = 2) -> tuple[Any, Any]:
  """wgmma's operands in shared memory, and any tile read into registers in wgmma's layout:
  rows of 128 bytes in tiles of 8 (8 x 64 for 16-bit elements, 8 x 32 for 32-bit ones),
  128-byte swizzle."""
  plgpu = mosaic_gpu()
  return plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128)


def interpreted(interpret: bool) -> dict[str, Any]:
  """``plgpu.kernel``'s keyword for Mosaic GPU's interpreter, where asked for."""
  return dict(interpret=mosaic_gpu().InterpretGPUParams()) if interpret else {}


def matmul(a: Any, b: Any, shape: tuple[int, int]) -> Any:
  """``a @ b`` on the tensor cores (wgmma) into a fresh float32 accumulator of ``shape``."""
  plgpu = mosaic_gpu()

  def run(acc_ref: Any) -> Any:
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate(acc: Any, a: Any, b: Any, interpret: bool) -> Any:
  """``acc + a @ b`` on the tensor cores. On a GPU wgmma accumulates into ``acc``'s own
  registers (``plgpu.ACC.init``, as FlashAttention-3 and JAX's ``attention_mgpu`` do: no
  second float32 accumulator held beside it); Mosaic GPU's interpreter (``interpret``),
  which cannot start a wgmma from an accumulator in registers, adds a fresh one."""
  if interpret:
    return acc + matmul(a, b, acc.shape)
  plgpu = mosaic_gpu()
  return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))


def staged(x: Any, smem: Any) -> Any:
  """wgmma's A operand: registers on a GPU (``smem`` None); in shared memory for the
  interpreter, whose wgmma reads A from there only."""
  if smem is None:
    return x
  smem[...] = x
  mosaic_gpu().commit_smem()
  return smem


def global_index(b: Any, h: Any, off_ref: Any) -> tuple[Any, Any]:
  """A program's batch row and head as the mask and score function see them: global."""
  return b + off_ref[0], h + off_ref[1]


def walk(pipeline: Any, n_full: Any, n_partial: Any, masked: bool, carry: Any) -> Any:
  """A schedule's FULL tiles through one ``pipeline(first, count, masked, carry)``, then,
  where there is a mask, its PARTIAL ones through a second."""
  carry = pipeline(0, n_full, False, carry)
  return pipeline(n_full, n_partial, True, carry) if masked else carry


def row(ref: Any, b: Any) -> Any:
  """The row of per-batch values ``ref`` (Bm, ...) for global batch row ``b``."""
  return b if ref.shape[0] > 1 else 0


def smem_bytes(buffers: Any) -> int:
  """The bytes of shared memory a pytree of ``plgpu.SMEM`` buffers (Nones skipped) takes."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(buffers))


def drain(free: Any, steps: Any, stages: int) -> None:
  """A copy warpgroup's last waits, after it has issued ``steps`` tiles into ``stages``
  slots: on each barrier of ``free`` (per slot, arrived at by the compute warpgroups when a
  tile's slot is released), the releases of the last ``stages`` tiles, which no later copy
  waited for. Every phase of those barriers is then observed before they are freed (jax
  0.11's interpreter checks that); on the GPU the copy warpgroup ends with the compute
  warpgroups' last tiles, which end the program anyway."""
  plgpu = mosaic_gpu()
  first = jnp.maximum(steps - stages, jnp.zeros_like(steps))

  @pl.loop(first, steps)
  def _(t: Any) -> None:
    slot = jax.lax.rem(t, jnp.array(stages, t.dtype))
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])


def store_rows(x: Any, smem: Any, gmem: Any) -> None:
  """Per-row values ``x`` (a warpgroup's rows) to ``gmem`` through ``smem``, a rows buffer
  free for reuse (its last copy out waited for), waiting for this copy too."""
  plgpu = mosaic_gpu()
  smem[...] = x
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)
