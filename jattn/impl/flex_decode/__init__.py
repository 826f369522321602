"""``implementation="flex_decode"``: jattn's GPU kernel for the ragged continuous-batching step
of :func:`jattn.decode.ragged_attention`, a split-KV decode kernel (as FlashDecoding and
FlexDecoding schedule it) reading a paged pool through the page table.

The step's query rows are query tiles of one request each (:mod:`jattn.decode._ragged`), a
few tokens against a row of many keys. One program per (query tile, key/value head, split
of the row's pages): its tile's queries for the heads that share the key/value head (GQA
read once, the rows ``i · G + g``) against the pages of its split, gathered one page at a
time by the id the row's page table holds, with an online softmax; splits past the row's
length run no page. The splits' partial results (each row's max, sum and weighted values)
are merged outside the kernel, one log-sum-exp merge, so a row of 32k keys is spread over
many programs instead of one. Either pool layout (separate pools, or the interleaved one
JAX's TPU kernel reads) is read as it is.

It expresses the causal cache mask, a left window over absolute positions, a soft cap, the
scale and GQA; float storage, power-of-two head dims and pages of at least 16 slots (a
Triton block); no other mask or score function, sinks, dropout, log-sum-exp or max logit,
no backward rule. Verified in Pallas' interpreter (:func:`jattn.testing.interpret_kernels`,
against the blockwise step) and by lowering for CUDA; an explicit opt-in
(``implementation="flex_decode"``) until a recorded run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn import testing
from jattn.impl import contract

__all__ = ["IMPLEMENTATION", "NAME", "Step", "refusal", "run"]

NAME = "flex_decode"


@dataclasses.dataclass(frozen=True)
class Step:
  """The kernel's static settings for one step."""

  scale: float
  window: int | None  # keys at most this far back from the query
  soft_cap: float | None
  pages_per_split: int
  num_warps: int = 4
  num_stages: int = 2


def refusal(
  *,
  paged: bool,
  quantized: bool,
  head_dims: tuple[int, int],
  page_size: int,
) -> str | None:
  """Why the kernel cannot run a ragged step with these properties, or None (what it takes
  of the step's keywords, its caller checks)."""
  if not paged:
    return "it needs a paged cache: the kernel reads pages through the page table"
  if quantized:
    return "it needs float storage (quantized pages are read by the blockwise step)"
  H, Hv = head_dims
  if H != Hv or H < 16 or H & (H - 1):
    return (
      f"it needs a power-of-two head dim of at least 16 shared by keys and values (got {H}, {Hv})"
    )
  if page_size < 16 or page_size & (page_size - 1):
    return (
      f"it needs pages of a power of two of at least 16 slots, a Triton block (got {page_size})"
    )
  return None


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def run(
  queries: jax.Array,
  key_pool: jax.Array,
  value_pool: jax.Array | None,
  page_table: jax.Array,
  lengths: jax.Array,
  first: jax.Array,
  q_lens: jax.Array,
  step: Step,
) -> jax.Array:
  """The step's query tiles through the kernel: queries (n, bq, N, H); the pools (P, ps, K,
  H), or one interleaved pool (P, ps, 2K, H) and ``value_pool`` None; page_table (n, M) each
  tile's row's pages (ids >= 0); lengths (n,) its row's length with the step written; first
  (n,) its first token's position; q_lens (n,) its tokens. Returns (n, bq, N, H) in the
  queries' dtype, zero on rows past q_lens."""
  n, bq, N, H = queries.shape
  interleaved = value_pool is None
  K = key_pool.shape[2] // 2 if interleaved else key_pool.shape[2]
  G = N // K
  rows = _pow2(max(16, bq * G))
  M = page_table.shape[1]
  splits = math.ceil(M / step.pages_per_split)
  # (n, bq, K, G, H) -> (n, K, bq * G, H): a program's rows are its tile's queries of the
  # heads sharing its key/value head, query i's head g at row i * G + g.
  q = queries.reshape(n, bq, K, G, H).transpose(0, 2, 1, 3, 4).reshape(n, K, bq * G, H)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - bq * G), (0, 0)))
  Mp = _pow2(M)
  table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, Mp - M)))
  meta = jnp.stack([lengths, first, q_lens, jnp.zeros_like(lengths)], axis=1).astype(jnp.int32)
  pools = (key_pool, key_pool if interleaved else value_pool)
  kernel = functools.partial(
    _kernel, step=step, group=G, pages=M, interleaved=interleaved, dtype=queries.dtype
  )
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  acc, m, l = pl.pallas_call(
    kernel,
    grid=(n, K, splits),
    in_specs=[
      pl.BlockSpec((None, None, rows, H), lambda v, k, s: (v, k, 0, 0)),
      whole(pools[0]),
      whole(pools[1]),
      pl.BlockSpec((None, Mp), lambda v, k, s: (v, 0)),
      pl.BlockSpec((None, 4), lambda v, k, s: (v, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, rows, H), lambda v, k, s: (v, k, s, 0, 0)),
      pl.BlockSpec((None, None, None, rows), lambda v, k, s: (v, k, s, 0)),
      pl.BlockSpec((None, None, None, rows), lambda v, k, s: (v, k, s, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((n, K, splits, rows, H), jnp.float32),
      jax.ShapeDtypeStruct((n, K, splits, rows), jnp.float32),
      jax.ShapeDtypeStruct((n, K, splits, rows), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=step.num_warps, num_stages=step.num_stages),
    interpret=testing.interpreting(),
    name="jattn_flex_decode",
  )(q, pools[0], pools[1], table, meta)
  # The splits merged: each weighted by exp(its max - the row's max).
  top = jnp.max(m, axis=2, keepdims=True)
  safe = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
  total = jnp.sum(w * l, axis=2)
  out = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
  out = out[:, :, : bq * G].reshape(n, K, bq, G, H).transpose(0, 2, 1, 3, 4)
  return out.reshape(n, bq, N, H).astype(queries.dtype)


def _kernel(
  q_ref: Any,
  k_ref: Any,
  v_ref: Any,
  table_ref: Any,
  meta_ref: Any,
  acc_ref: Any,
  m_ref: Any,
  l_ref: Any,
  *,
  step: Step,
  group: int,
  pages: int,
  interleaved: bool,
  dtype: Any,
) -> None:
  k, s = pl.program_id(1), pl.program_id(2)
  length, first, q_len = meta_ref[0], meta_ref[1], meta_ref[2]
  q = q_ref[...]
  rows, H = q.shape
  ps = k_ref.shape[1]
  kh, vh = (2 * k, 2 * k + 1) if interleaved else (k, k)
  position = first + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
  live = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group < q_len
  start = s * step.pages_per_split
  stop = jnp.minimum(jnp.minimum(start + step.pages_per_split, pages), (length + ps - 1) // ps)

  def body(p: Any, carry: Any) -> Any:
    acc, m, l = carry
    page = table_ref[p]
    keys = k_ref[page, :, kh, :]  # (ps, H)
    values = v_ref[page, :, vh, :]
    t = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * step.scale
    if step.soft_cap is not None:
      t = step.soft_cap * jnp.tanh(t / step.soft_cap)
    slot = p * ps + jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1)
    ok = live & (slot <= position) & (slot < length)
    if step.window is not None:
      ok = ok & (slot >= position - step.window)
    t = jnp.where(ok, t, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(t, axis=1))
    base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
    prob = jnp.where(ok, jnp.exp(t - base[:, None]), 0.0)
    l = l * alpha + jnp.sum(prob, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(
      prob.astype(dtype), values.astype(dtype), preferred_element_type=jnp.float32
    )
    return acc, m_new, l

  init = (
    jnp.zeros((rows, H), jnp.float32),
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  acc, m, l = jax.lax.fori_loop(start, jnp.maximum(stop, start), body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


IMPLEMENTATION = contract.Implementation(
  name=NAME,
  runs_on=("gpu",),
  backwards=(),
  masks=(
    "decode.ragged_attention's causal cache mask and a left window (absolute positions); "
    "a paged pool in either layout, float storage"
  ),
  run=contract.step_only(NAME),
  interpretable=True,
  opt_in=(
    "verified in Pallas' interpreter and by lowering for CUDA, not yet run on a GPU: "
    "reached only by name (implementation='flex_decode') until a recorded run"
  ),
  ragged_only="query tiles over a paged pool",
)
