"""JAX's TPU ragged paged attention kernel, the fused kernel of a continuous-batching step.

:func:`jattn.decode.ragged_attention` hands it a step whose keys and values are already in
a paged pool in the interleaved layout (``decode.init_paged(..., kv_layout="interleaved")``:
key head k at head 2k, its values at 2k + 1), which the kernel reads as it is, through the
rows' page tables: no step copies the pool. It expresses the causal cache mask (each
request's queries bottom-right aligned with its row's length), a left sliding window over
absolute positions, a soft cap and GQA; float storage only (it takes one scale for a whole
pool, and jattn's quantized caches keep one per token and head), no other score function,
sinks, dropout, log-sum-exp or max logit, and no backward rule.

Verified here by lowering for TPU (the program holds the kernel's Mosaic custom call) and,
since neither Pallas interpreter runs the kernel (the TPU one cannot follow the reshaped
reference it reads the pool through, the generic one its DMA semaphores), under
:func:`jattn.testing.interpret_kernels` by JAX's own reference of the kernel,
``ref_ragged_paged_attention``, on the very arguments the kernel would get (eager calls:
the reference loops over the requests in Python). It is an explicit opt-in
(``implementation="ragged_paged"``) until a recorded run on a TPU.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jattn import _checks, testing
from jattn.impl import contract

__all__ = ["IMPLEMENTATION", "Step", "run", "refusal"]

NAME = "ragged_paged"


@dataclasses.dataclass(frozen=True)
class Step:
  """The kernel's static settings for one step."""

  scale: float
  window: int | None  # keys at most this far back from the query (the kernel's is one more)
  soft_cap: float | None
  queries_per_block: int
  kv_pages_per_block: int


def refusal(*, interleaved: bool, quantized: bool, head_dims: tuple[int, int]) -> str | None:
  """Why the kernel cannot run a ragged step with these properties, or None (what it takes
  of the step's keywords, its caller checks)."""
  if not interleaved:
    return (
      "it needs a paged cache in the interleaved layout (decode.init_paged(..., "
      "kv_layout='interleaved')): the kernel reads keys and values from one pool, and copying "
      "a separate pair into one would copy the pool every step"
    )
  if quantized:
    return "it needs float storage: the kernel takes one scale for a whole pool, not one per token"
  if head_dims[0] != head_dims[1]:
    return f"it needs values of the keys' head dim (got H={head_dims[0]}, Hv={head_dims[1]})"
  return None


def run(
  query: jax.Array,
  pool: jax.Array,
  kv_lens: jax.Array,
  page_indices: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  step: Step,
) -> jax.Array:
  """The kernel on one step: query (T, N, H), pool (P, page_size, 2K, H), kv_lens (R,) the
  rows' lengths with the step's tokens written, page_indices (R, M) valid page ids,
  cu_q_lens (R + 1,), num_seqs (1,). Returns (T, N, H); rows past ``cu_q_lens[num_seqs]``
  are unspecified."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

  window = None if step.window is None else step.window + 1
  args = (query, pool, kv_lens, page_indices, cu_q_lens, num_seqs)
  if testing.interpreting():
    if not all(_checks.is_concrete(x) for x in args[2:]):
      raise ValueError(
        "implementation='ragged_paged' under jattn.testing.interpret_kernels runs JAX's "
        "reference of the kernel, which loops over the requests in Python: call "
        "decode.ragged_attention outside jax.jit there"
      )
    out = rpa.ref_ragged_paged_attention(
      *args, sm_scale=step.scale, sliding_window=window, soft_cap=step.soft_cap
    )
    return jax.numpy.pad(out, ((0, query.shape[0] - out.shape[0]), (0, 0), (0, 0)))
  return rpa.ragged_paged_attention(
    *args,
    sm_scale=step.scale,
    sliding_window=window,
    soft_cap=step.soft_cap,
    num_queries_per_block=step.queries_per_block,
    num_kv_pages_per_block=step.kv_pages_per_block,
  )


IMPLEMENTATION = contract.Implementation(
  name=NAME,
  runs_on=("tpu",),
  backwards=(),
  masks=(
    "decode.ragged_attention's causal cache mask and a left window (absolute positions); "
    "a paged pool in the interleaved layout, float storage"
  ),
  run=contract.step_only(NAME),
  opt_in=(
    "verified by lowering for TPU and against JAX's reference of the kernel, not yet run on "
    "a TPU: reached only by name (implementation='ragged_paged') until a recorded run"
  ),
  ragged_only="packed tokens over a paged pool",
)


def pages_per_block(page_size: int, pages_per_row: int) -> int:
  """Pages a key/value block reads: blockwise's default tile of 512 slots in whole pages,
  at most a row's pages."""
  return int(np.clip(512 // page_size, 1, pages_per_row))
