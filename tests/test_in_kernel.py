"""Masks and score functions evaluated inside a Pallas kernel, their arrays read from refs by
index (jattn.impl._in_kernel): the same values as outside, in interpret mode, and a
program that lowers to Triton for CUDA from this CPU (Triton has no gather from registers,
so a mask reading segment ids, lengths or a dense array must load them from memory)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCORE_FN_HEADS, SCORE_FNS, mask_kinds
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from reference import array

from jattn import _compat
from jattn.impl import _in_kernel

B, N, T, S, BQ, BK = 2, SCORE_FN_HEADS, 32, 32, 16, 16
IDS = np.repeat(np.arange(4), 8)[None].repeat(B, 0)
IDS[1, 20:] = 7
MASKS = {
  k: m
  for k, m in mask_kinds(
    B,
    T,
    S,
    ids=(IDS, IDS),
    window=(4, 1),
    chunk=8,
    prefix=[5, 9],
    lengths=([20, 32], [32, 0]),
    num_global=2,
    stride=3,
  ).items()
  if m is not None
}
GRID = (B, N, T // BQ, S // BK)
SPECS = [jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32)] * 2 + [
  jax.ShapeDtypeStruct((1, 1, BQ, 1), jnp.int32),
  jax.ShapeDtypeStruct((1, 1, 1, BK), jnp.int32),
]


def _opened(fn, *specs):
  """``fn``'s jaxpr with the arrays it closes over as leading inputs, and those arrays."""
  closed = jax.make_jaxpr(fn)(*specs)
  invars = list(closed.jaxpr.constvars) + list(closed.jaxpr.invars)
  jaxpr = closed.jaxpr.replace(constvars=[], invars=invars)
  return jaxpr, [c if isinstance(c, jax.Array) else array(c) for c in closed.consts]


def _tile_kernel(jaxpr, n_refs, with_scores):
  """A kernel writing ``jaxpr``'s value on tile (b, h, i, j) of the (B, N, T, S) grid."""

  def kernel(*refs):
    arrays, rest = refs[:n_refs], refs[n_refs:]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    q = (i * BQ + jnp.arange(BQ, dtype=jnp.int32)).reshape(1, 1, BQ, 1)
    kv = (j * BK + jnp.arange(BK, dtype=jnp.int32)).reshape(1, 1, 1, BK)
    bh = [jnp.full((1, 1, 1, 1), x, jnp.int32) for x in (b, h)]
    args = [*bh, q, kv]
    if with_scores:
      args = [rest[0][...].reshape(1, 1, BQ, BK)] + args
    (out,) = _in_kernel.evaluate(jaxpr, arrays, *args)
    rest[-1][...] = jnp.broadcast_to(out, (1, 1, BQ, BK)).reshape(BQ, BK).astype(jnp.float32)

  return kernel


def _call(jaxpr, arrays, scores=None, *, interpret):
  whole = [pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n) for a in arrays]
  tile = pl.BlockSpec((None, None, BQ, BK), lambda b, h, i, j: (b, h, i, j))
  operands = list(arrays) + ([] if scores is None else [scores])
  return pl.pallas_call(
    _tile_kernel(jaxpr, len(arrays), scores is not None),
    grid=GRID,
    in_specs=whole + ([] if scores is None else [tile]),
    out_specs=tile,
    out_shape=jax.ShapeDtypeStruct((B, N, T, S), jnp.float32),
    interpret=interpret,
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
  )(*operands)


def _lowers_to_triton(jaxpr, arrays, scores=None):
  operands = [*arrays, *([] if scores is None else [scores])]
  fn = jax.jit(lambda *a: _call(jaxpr, a[: len(arrays)], *a[len(arrays) :], interpret=False))
  # Pallas' Triton lowering warns of deprecation; the GPU it targets is named, not found.
  with warnings.catch_warnings(), _compat.gpu_target("NVIDIA H100"):
    warnings.simplefilter("ignore")
    text = fn.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
  return "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_every_mask_kind_is_exact_inside_a_kernel_and_lowers_to_triton(kind):
  mask = MASKS[kind]
  jaxpr, arrays = _opened(lambda b, h, q, kv: mask(b, h, q, kv), *SPECS)
  got = np.asarray(jax.jit(lambda *a: _call(jaxpr, a, interpret=True))(*arrays))
  want = np.broadcast_to(np.asarray(mask.materialize(T, S, batch_size=B, num_heads=N)), got.shape)
  np.testing.assert_array_equal(got.astype(bool), want)
  assert _lowers_to_triton(jaxpr, arrays)


# The default run keeps a score function reading arrays and one of the user's; the others are
# exhaustive.
@pytest.mark.parametrize(
  "name",
  [
    n if n in ("relative", "custom") else pytest.param(n, marks=pytest.mark.exhaustive)
    for n in sorted(SCORE_FNS)
  ],
)
def test_every_score_function_is_exact_inside_a_kernel_and_lowers_to_triton(name):
  fn = SCORE_FNS[name]
  s_spec = jax.ShapeDtypeStruct((1, 1, BQ, BK), jnp.float32)
  jaxpr, arrays = _opened(lambda s, b, h, q, kv: fn(s, b, h, q, kv), s_spec, *SPECS)
  scores = array(np.random.default_rng(1).normal(size=(B, N, T, S)), jnp.float32)
  got = jax.jit(lambda s, *a: _call(jaxpr, a, s, interpret=True))(scores, *arrays)
  idx = [np.arange(B), np.arange(N), np.arange(T), np.arange(S)]
  idx = [x.reshape([-1 if a == i else 1 for a in range(4)]) for i, x in enumerate(idx)]
  want = fn(scores, *(array(x, jnp.int32) for x in idx))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert _lowers_to_triton(jaxpr, arrays, scores)


def test_gathers_that_fill_and_whole_array_reads():
  """A gather in fill mode reads the fill value out of range; an operation on a whole array
  (not a point gather) loads the whole ref first, and stays exact."""
  table = array(np.arange(T, dtype=np.float32) * 0.5)

  def fn(b, h, q, kv):
    shifted = table.at[q + kv - 8].get(mode="fill", fill_value=-1.0)  # past T: filled
    return shifted + jnp.sum(table) + b + h

  jaxpr, arrays = _opened(fn, *SPECS)
  got = np.asarray(jax.jit(lambda *a: _call(jaxpr, a, interpret=True))(*arrays))
  b, h, q, kv = (np.arange(n).reshape([-1 if a == i else 1 for a in range(4)]) for i, n in
                 enumerate((B, N, T, S)))  # fmt: skip
  pos = q + kv - 8
  pos = np.where(pos < 0, pos + T, pos)  # jnp indexing wraps negative indices once
  shifted = np.where((pos >= 0) & (pos < T), 0.5 * np.clip(pos, 0, T - 1), -1.0)
  assert (shifted == -1.0).any()
  np.testing.assert_allclose(got, shifted + np.sum(np.asarray(table)) + b + h, rtol=1e-6)


def test_reads_are_loads_from_the_refs():
  """The segment-id mask's jaxpr gathers from its id arrays; evaluated with refs, the kernel
  holds no gather, only loads at the gathered indices."""
  mask = MASKS["segments"]
  jaxpr, arrays = _opened(lambda b, h, q, kv: mask(b, h, q, kv), *SPECS)
  assert "gather" in {e.primitive.name for e in jaxpr.eqns}
  refs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    traced = jax.make_jaxpr(lambda *a: _call(jaxpr, a, interpret=False))(*refs)
  inner = next(e for e in traced.jaxpr.eqns if e.primitive.name == "pallas_call")
  kernel_jaxpr = inner.params["jaxpr"]
  names = {e.primitive.name for e in kernel_jaxpr.eqns}
  assert "gather" not in names and "get" in names


def test_static_slices_of_an_array_are_loads_at_offsets():
  """A row of a (B, T) array, a strided slice, an offset slice of a table: read from the
  ref at the slice's start and step (no whole (2, 32) array, which Triton could not form
  had it been (2, 40)), exact and lowered to Triton."""
  valid = array(np.random.default_rng(4).random((B, T)) < 0.5)
  table = array(np.arange(T * S, dtype=np.float32).reshape(T, S))

  def fn(b, h, q, kv):
    rows = valid[0][q].astype(jnp.float32) + 2.0 * valid[1, 1:][kv - 1]
    return rows + valid[1][::2][q // 2] + table[4:, 2:][q - 4, kv - 2] * 0.001

  jaxpr, arrays = _opened(fn, *SPECS)
  got = np.asarray(jax.jit(lambda *a: _call(jaxpr, a, interpret=True))(*arrays))
  v, t = np.asarray(valid), np.asarray(table)
  q, kv = np.arange(T)[:, None], np.arange(S)[None, :]
  sub = t[4:, 2:]
  want = v[0][q] + 2.0 * v[1, 1:][kv - 1] + v[1][::2][q // 2] + sub[q - 4, kv - 2] * 0.001
  np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)
  assert _lowers_to_triton(jaxpr, arrays)


def test_reads_at_a_scalar_index_are_loads_of_one_element():
  """``arr[i]`` at a traced scalar ``i`` (``jnp`` makes it a dynamic slice, not a gather):
  a per-head value and a whole row of a (N, T) table picked by the head, then indexed by
  the query; a negative scalar counts from the end, one past it is clamped as jnp clamps.
  Read element by element from the refs (no dynamic slice left in the kernel), exact, and
  lowered to Triton."""
  per_head = array(np.array([0.5, -2.0, 3.0][:N] + [1.0] * max(0, N - 3), np.float32))
  rows = array(np.arange(N * T, dtype=np.float32).reshape(N, T))

  def fn(b, h, q, kv):
    head = h.reshape(())
    last = per_head[head - N] + per_head[b.reshape(()) + N]  # wraps once; past the end clamps
    return per_head[head] * (kv - q) + rows[head][q] + last

  jaxpr, arrays = _opened(fn, *SPECS)
  assert "dynamic_slice" in {e.primitive.name for e in jaxpr.eqns}
  got = np.asarray(jax.jit(lambda *a: _call(jaxpr, a, interpret=True))(*arrays))
  p, r = np.asarray(per_head), np.asarray(rows)
  h = np.arange(N)[None, :, None, None]
  q, kv = np.arange(T)[:, None], np.arange(S)[None, :]
  want = p[h] * (kv - q) + r[h, q] + p[h] + p[N - 1]
  np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)
  refs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    traced = jax.make_jaxpr(lambda *a: _call(jaxpr, a, interpret=False))(*refs)
  inner = next(e for e in traced.jaxpr.eqns if e.primitive.name == "pallas_call")
  assert "dynamic_slice" not in {e.primitive.name for e in inner.params["jaxpr"].eqns}
  assert _lowers_to_triton(jaxpr, arrays)


class _RunsOnly:
  """A ref that answers reads of runs only (``ref.at[..., pl.ds(start, n)]``, then read
  whole), as Mosaic GPU's kernels read arrays along the positions: any other read fails."""

  def __init__(self, a):
    self.a, self.shape, self.dtype = np.asarray(a), np.shape(a), np.asarray(a).dtype
    self.runs = 0

  def __getitem__(self, index):
    raise AssertionError(f"a gather or element read at {index}, not a run")

  @property
  def at(self):
    outer = self

    class View:
      def __getitem__(self, index):
        outer.runs += 1
        index = tuple(
          slice(i.start, i.start + i.size) if isinstance(i, pl.Slice) else i for i in index
        )
        return jnp.asarray(outer.a)[index]

    return View()


def test_reads_along_the_positions_are_runs():
  """Query and key indices passed as Lines (a tile's positions from a first one, as the
  Hopper kernels pass them): per-query flags, per-row key flags at the batch row (a scalar
  index beside the run), a map to global positions read with .at[].get(mode="clip") (how
  masks.reindex reads one) and shifted, each a run of the array (the ref answers nothing
  else), a run shifted by a constant in an array long enough for it; the same values as the
  function outside. A filling read at a scalar index, which may fall outside, a read at
  computed positions (a distance), and shifted runs that would leave the array (past its
  end, or before its start, where jnp wraps a negative index) are not runs."""
  tile = (8, 8)
  q0, k0, b = 8, 16, 1
  q_flags = np.arange(32) % 3 > 0
  k_flags = np.random.default_rng(0).random((2, 32)) < 0.6
  positions = np.arange(32) * 2 + 5
  longer = np.arange(40) % 4 == 0

  def fn(bb, h, q, kv):
    mapped = jnp.asarray(positions).at[q].get(mode="clip") - 1
    shifted = jnp.asarray(longer)[q + 3]
    return (jnp.asarray(q_flags)[q] & jnp.asarray(k_flags)[bb, kv]) | (mapped > 2 * kv) | shifted

  def lines(q_tile, kv_tile):
    def load(axis):
      return lambda view: jax.lax.broadcast_in_dim(view, tile, [axis])

    return (
      _in_kernel.Line(q_tile, 0, jnp.int32(q0), 32, load(0)),
      _in_kernel.Line(kv_tile, 1, jnp.int32(k0), 32, load(1)),
    )

  q_tile = jax.lax.broadcasted_iota(jnp.int32, tile, 0) + q0
  kv_tile = jax.lax.broadcasted_iota(jnp.int32, tile, 1) + k0
  specs = (jax.ShapeDtypeStruct((), jnp.int32),) * 2 + (jax.ShapeDtypeStruct(tile, jnp.int32),) * 2
  jaxpr, arrays = _opened(fn, *specs)
  refs = [_RunsOnly(a) for a in arrays]
  (got,) = _in_kernel.evaluate(jaxpr, refs, jnp.int32(b), jnp.int32(0), *lines(q_tile, kv_tile))
  want = fn(jnp.int32(b), jnp.int32(0), q_tile, kv_tile)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert sum(r.runs for r in refs) == 4

  for other in (
    lambda bb, h, q, kv: jnp.asarray(k_flags).at[bb, kv].get(mode="fill", fill_value=False),
    lambda bb, h, q, kv: jnp.asarray(q_flags)[jnp.abs(q - kv)],
    lambda bb, h, q, kv: jnp.asarray(longer)[q + 9],  # 32 + 9 > 40
    lambda bb, h, q, kv: jnp.asarray(longer)[q - 2],
  ):
    jaxpr, arrays = _opened(other, *specs)
    with pytest.raises(AssertionError, match="not a run"):
      _in_kernel.evaluate(
        jaxpr, [_RunsOnly(a) for a in arrays], jnp.int32(b), jnp.int32(0),
        *lines(q_tile, kv_tile),
      )  # fmt: skip
