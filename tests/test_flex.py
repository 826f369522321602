"""implementation="flex" (jattn.impl.flex and its kernels) against the xla implementation:
values and log-sum-exp in Pallas interpret mode, and the program lowered for CUDA from this
CPU holds the Triton custom call. Each case mixes what one kernel must handle: masks and
score functions that read arrays, GQA/MQA, Hv != H, lengths that are not whole tiles,
rows with nothing to attend to, FULL, PARTIAL and EMPTY tiles."""

import functools
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCORE_FNS, mask_kinds
from reference import array

import jattn
from jattn import _compat, masks
from jattn.impl import _chunks, _in_kernel, flex
from jattn.impl import flex_hopper as _hopper
from jattn.impl.flex import _backward as _flex_backward
from jattn.impl.flex import _kernels as fk

B, T, S, N, H, HV, BQ, BK = 2, 40, 40, 4, 8, 12, 16, 16
IDS = np.repeat(np.arange(5), 8)[None].repeat(B, 0)
IDS[1, 13:] = 9

CASES = {
  # causal, two empty key rows in batch row 1 (key length 0), ALiBi reading its slopes
  "causal_lengths_alibi_gqa": (
    masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0])),
    SCORE_FNS["alibi"],
    2,
  ),
  "segments_soft_cap_mqa": (masks.segments(IDS), SCORE_FNS["soft_cap"], 1),
  "window_or_dense_relative": (
    masks.sliding_window(3, 2) | masks.from_array(np.random.default_rng(3).random((T, S)) < 0.1),
    SCORE_FNS["relative"],
    4,
  ),
  "no_mask_custom_score": (None, SCORE_FNS["custom"], 2),
}


def _inputs(K):
  rng = np.random.default_rng(K)
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, HV)]
  return [array(rng.normal(size=s), jnp.float32) for s in shapes]


def _flex(q, k, v, mask, score_fn, *, interpret):
  specs = fk.index_specs(BQ, BK)
  s_spec = jax.ShapeDtypeStruct((1, 1, BQ, BK), jnp.float32)
  mask_f = None if mask is None else _in_kernel.Function.trace(lambda *i: mask(*i), *specs)
  score_f = (
    None if score_fn is None else _in_kernel.Function.trace(lambda *a: score_fn(*a), s_spec, *specs)
  )
  rows, _ = fk.schedules(mask, B, N, T, S, BQ, BK)
  settings = fk.Settings(H**-0.5, T, S, BQ, BK, num_warps=4, num_stages=2, interpret=interpret)
  out, m, log_l = fk.forward(q, k, v, rows, mask_f, score_f, settings)
  return out, fk.log_sum_exp(m, log_l)


# The default run keeps lengths emptying rows with a score function reading arrays under GQA;
# the others are exhaustive: the same forward kernel runs by default on MHA with a dense mask
# or'ed with a window (test_gradients_match_autodiff_of_xla) and reading a T5 table
# (test_learned_score_arrays_get_their_gradients), whose gradients, through the output and
# the lse, are compared with xla's there.
@pytest.mark.parametrize(
  "case",
  [
    c if c == "causal_lengths_alibi_gqa" else pytest.param(c, marks=pytest.mark.exhaustive)
    for c in sorted(CASES)
  ],
)
def test_forward_matches_xla_values_and_lse(case):
  mask, score_fn, K = CASES[case]
  q, k, v = _inputs(K)
  xla = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=mask, score_fn=score_fn, implementation="xla", return_residual=True
  )
  # One program for both (each compiled apart costs its own overheads).
  (out, lse), (want, want_lse) = jax.jit(
    lambda *a: (_flex(*a, mask, score_fn, interpret=True), xla(*a))
  )(q, k, v)
  assert out.shape == (B, T, N, HV) and lse.shape == (B, T, N)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  empty = np.isneginf(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
  np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(want_lse)[~empty], atol=2e-5)
  assert not np.asarray(out)[empty].any()  # rows with nothing to attend to are zeros
  if case.startswith("causal"):
    assert empty.any()


def test_forward_and_backward_lower_to_triton_for_cuda():
  mask, score_fn, K = GRAD_CASES["causal_lengths_custom_gqa"]
  q, k, v = _inputs(K)

  def step(q, k, v):
    attend = lambda *a: _flex_vjp(*a, mask, score_fn, interpret=False)
    return jax.value_and_grad(lambda *a: _loss(attend, *a), (0, 1, 2))(q, k, v)

  with warnings.catch_warnings(), _compat.gpu_target("NVIDIA A100"):
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
    text = jax.jit(step).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3
  for name in ("jattn_flex_forward", "jattn_flex_dq", "jattn_flex_dkv"):
    assert f'name = "{name}"' in text


GRAD_CASES = {
  "causal_lengths_custom_gqa": (
    masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0])),
    SCORE_FNS["custom"],
    2,
  ),
  "segments_soft_cap_mqa": (masks.segments(IDS), SCORE_FNS["soft_cap"], 1),
  "window_or_dense": CASES["window_or_dense_relative"][:1] + (None, 4),
  # constant slopes: read by the kernels, not differentiated
  "alibi_mqa": (None, SCORE_FNS["alibi"], 1),
}


def _loss(attend, q, k, v):
  out, lse = attend(q, k, v)
  w = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
  lse_w = jnp.sin(jnp.arange(lse.size, dtype=lse.dtype)).reshape(lse.shape)
  return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * lse_w)


def _flex_vjp(q, k, v, mask, score_fn, interpret=True, bias=None, split_ds=True, grid_rows=T):
  specs = fk.index_specs(BQ, BK)
  s_spec = jax.ShapeDtypeStruct((1, 1, BQ, BK), q.dtype)
  mask_f = None if mask is None else _in_kernel.Function.trace(lambda *i: mask(*i), *specs)
  score_f = (
    None if score_fn is None else _in_kernel.Function.trace(lambda *a: score_fn(*a), s_spec, *specs)
  )
  grid = (
    None if score_fn is None else flex._grid_trace(score_fn, score_f, B, N, grid_rows, S, q.dtype)
  )
  rows, cols = fk.schedules(mask, B, N, T, S, BQ, BK)
  settings = fk.Settings(
    H**-0.5, T, S, BQ, BK, num_warps=4, num_stages=2, interpret=interpret, split_ds=split_ds
  )
  three = lambda x: (x, x, x)  # one tiling for the forward, dQ and dK/dV passes
  return _flex_backward.attention(
    q, k, v, (rows, rows, cols), three(mask_f), three(score_f), three(settings), bias=bias,
    score_grid=grid,
  )[:2]  # fmt: skip


# The default run keeps MHA with a dense mask or'ed with a window; the others are exhaustive.
# The causal mask with lengths and the custom score function under GQA has its q, k and v
# gradients checked by default in float64 (test_check_grads_float64, the same kernels).
@pytest.mark.parametrize(
  "case",
  [
    c if c == "window_or_dense" else pytest.param(c, marks=pytest.mark.exhaustive)
    for c in sorted(GRAD_CASES)
  ],
)
def test_gradients_match_autodiff_of_xla(case):
  mask, score_fn, K = GRAD_CASES[case]
  q, k, v = _inputs(K)
  flex = lambda q, k, v: _flex_vjp(q, k, v, mask, score_fn)
  xla = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=mask, score_fn=score_fn, implementation="xla", return_residual=True,
    backward="autodiff",
  )  # fmt: skip
  grads = lambda attend: jax.grad(lambda *a: _loss(attend, *a), (0, 1, 2))
  got, want = jax.jit(lambda *a: (grads(flex)(*a), grads(xla)(*a)))(q, k, v)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)
    assert np.isfinite(np.asarray(g)).all()


def _flex_and_xla(fn, *args):
  """``fn(implementation, *args)`` for flex (interpreted) and for xla, traced and compiled as
  one program (two would compile the xla side and the program's overheads apart)."""
  with jattn.testing.interpret_kernels():
    return jax.jit(lambda *a: (fn("flex", *a), fn("xla", *a)))(*args)


def _public_flex_matches_xla(q, k, v, bias=None, **kw):
  """The public call with ``return_residual``: the loss of its output and lse, and the
  gradients of q, k, v (and the bias, given), of flex (interpreted) equal xla's."""

  def run(impl, q, k, v, bias):
    def loss(q, k, v, bias):
      attend = lambda *a: jattn.dot_product_attention(
        *a, bias=bias, implementation=impl, return_residual=True, **kw
      )
      return _loss(attend, q, k, v)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    return jax.value_and_grad(loss, argnums)(q, k, v, bias)

  (loss, grads), (want_loss, want_grads) = _flex_and_xla(run, q, k, v, bias)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
    assert g.shape == w.shape, name
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


# Every mask kind of the catalogue at lengths that are not whole tiles (40 with 16-row
# tiles), several emptying rows, and sparse layouts.
CATALOGUE = {
  **mask_kinds(
    B,
    T,
    S,
    ids=(IDS, IDS),
    window=(5, 2),
    chunk=12,
    prefix=[7, 0],
    lengths=([33, 40], [40, 0]),
    num_global=3,
    stride=3,
  ),
  "longformer": masks.longformer(3, dilation=2),
  "bigbird": masks.bigbird(T, S, block_size=8, num_random_blocks=1, seed=0),
}


# The default run keeps two kinds: rows left empty at the start (EMPTY tiles first in a row),
# and &, | and ~ together; the others are exhaustive. By default flex also reads per-batch-row
# arrays (lengths, in the bias and learned-score tests) and runs functions of all four indices
# (from_fn, test_masks_reading_arrays_that_flex_takes_run_and_lower). Every kind's mask is also
# checked against its formula (test_masks.py), and cases.mask_kinds' inside a kernel
# (test_in_kernel.py).
@pytest.mark.parametrize(
  "kind",
  [
    k if k in ("causal_empty_rows", "combined") else pytest.param(k, marks=pytest.mark.exhaustive)
    for k in sorted(CATALOGUE)
  ],
)
def test_every_mask_kind_matches_xla_values_lse_and_gradients(kind):
  q, k, v = _inputs(2)
  _public_flex_matches_xla(q, k, v, mask=CATALOGUE[kind])


# The default run keeps a per-query column, whose gradient is summed; a full (B, N, T, S)
# bias's gradient is test_empty_rows_take_no_gradient_from_their_lse_cotangent's, and a
# key-padding row's (B, 1, 1, S) is test_learned_score_arrays_get_their_gradients' and
# test_each_pass_at_its_own_tiles_matches_xla's (by default too).
@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((B, N, T, S), marks=pytest.mark.exhaustive),
    pytest.param((B, 1, 1, S), marks=pytest.mark.exhaustive),
    (T, 1),
  ],
  ids=str,
)
def test_bias_of_each_broadcast_shape_and_its_gradient_match_xla(shape):
  """Per batch row and head, a key-padding row (B, 1, 1, S), a per-query column: the bias is
  read tile by tile, and its gradient is dS summed over the axes it broadcasts along."""
  q, k, v = _inputs(2)
  bias = array(np.random.default_rng(5).normal(size=shape), jnp.float32)
  mask = masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0]))
  _public_flex_matches_xla(q, k, v, bias, mask=mask)


def test_empty_rows_take_no_gradient_from_their_lse_cotangent():
  """A loss of sin(lse) sends NaN (cos(-inf)) down an empty row's lse: the rows have no
  gradient, as xla's, and the NaN reaches none of q, k, v or the bias."""
  q, k, v = _inputs(2)
  bias = array(np.random.default_rng(6).normal(size=(B, N, T, S)), jnp.float32)
  mask = masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0]))

  def run(impl, *args):
    def loss(q, k, v, bias):
      out, lse = jattn.dot_product_attention(
        q, k, v, bias, mask=mask, implementation=impl, return_residual=True
      )
      return jnp.sum(out**2) + jnp.sum(jnp.sin(lse))

    return jax.grad(loss, (0, 1, 2, 3))(*args)

  grads, want = _flex_and_xla(run, q, k, v, bias)
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want):
    assert np.isfinite(w).all(), name
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


def _dq_outputs(fn, *args):
  """How many outputs the dQ kernel's pallas_call has in ``fn``'s program."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call" and "jattn_flex_dq" in str(eqn.params):
        found.append(len(eqn.outvars))
      for inner in jax.extend.core.jaxprs_in_params(eqn.params):  # custom_vjp, pjit, cond
        walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_an_undifferentiated_bias_costs_no_score_gradient_buffer():
  q, k, v = _inputs(2)
  bias = jnp.zeros((1, N, T, S), jnp.float32)
  loss = lambda q, bias: _loss(lambda *a: _flex_vjp(*a, None, None, bias=bias), q, k, v)
  assert _dq_outputs(jax.grad(loss), q, bias) == [1]  # dq only
  assert _dq_outputs(jax.grad(loss, (0, 1)), q, bias) == [2]  # dq and the (B, N, T, S) dS


# Learned ALiBi slopes with a key-padding bias through the same mask are
# test_each_pass_at_its_own_tiles_matches_xla's by default: that case is exhaustive here.
@pytest.mark.parametrize(
  "learned", [pytest.param("alibi", marks=pytest.mark.exhaustive), "t5_table"]
)
def test_learned_score_arrays_get_their_gradients(learned):
  """Learned ALiBi slopes or a T5 relative-position table, differentiated with q, k, v and a
  key-padding bias, through a mask that empties rows: every gradient equals xla's."""
  q, k, v = _inputs(2)
  rng = np.random.default_rng(8)
  bias = array(rng.normal(size=(B, 1, 1, S)), jnp.float32)
  params = array(rng.uniform(0.05, 0.5, N) if learned == "alibi" else rng.normal(size=(8, N)))
  mask = masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0]))

  def run(impl, *args):
    def loss(q, k, v, bias, params):
      if learned == "alibi":
        score_fn = jattn.scores.alibi(params)
      else:
        score_fn = jattn.scores.relative_position_bias(params, num_buckets=8, max_distance=16)
      attend = lambda *a: jattn.dot_product_attention(
        *a, bias, mask=mask, score_fn=score_fn, implementation=impl, return_residual=True
      )
      return _loss(attend, q, k, v)

    return jax.grad(loss, (0, 1, 2, 3, 4))(*args)

  grads, want = _flex_and_xla(run, q, k, v, bias, params.astype(jnp.float32))
  for name, g, w in zip(("dq", "dk", "dv", "dbias", "dparams"), grads, want):
    assert g.shape == w.shape and np.abs(w).max() > 0, name
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


def test_each_pass_at_its_own_tiles_matches_xla(monkeypatch):
  """The forward, dQ and dK/dV kernels at three different tilings (the table's row patched:
  on this CPU it is the Ampere float32 row), lengths that are whole tiles of none of them:
  the values, the lse and every gradient (q, k, v, a bias, learned ALiBi slopes) equal
  xla's."""
  passes = flex.Passes(flex.Tiles(32, 16, 4, 2), flex.Tiles(16, 32, 4, 2), flex.Tiles(32, 64, 4, 2))
  monkeypatch.setitem(flex.TILES, ("sm_80", 64, 4), passes)
  assert flex.tiles_for(H, 4, "") == passes
  q, k, v = _inputs(2)
  rng = np.random.default_rng(12)
  bias = array(rng.normal(size=(B, 1, 1, S)), jnp.float32)
  slopes = array(rng.uniform(0.05, 0.5, N), jnp.float32)
  mask = masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0]))

  def run(impl, *args):
    def loss(q, k, v, bias, slopes):
      attend = lambda *a: jattn.dot_product_attention(
        *a, bias, mask=mask, score_fn=jattn.scores.alibi(slopes), implementation=impl,
        return_residual=True,
      )  # fmt: skip
      return _loss(attend, q, k, v)

    return jax.value_and_grad(loss, (0, 1, 2, 3, 4))(*args)

  got, want = _flex_and_xla(run, q, k, v, bias, slopes)
  np.testing.assert_allclose(got[0], want[0], atol=5e-5, rtol=5e-5)
  for name, g, w in zip(("dq", "dk", "dv", "dbias", "dslopes"), got[1], want[1]):
    assert g.shape == w.shape and np.abs(w).max() > 0, name
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


def test_learned_arrays_vjp_is_taken_a_chunk_of_query_rows_at_a_time():
  """The score function's VJP flex leaves to XLA (its learned arrays' and a bias's gradients
  from the dQ kernel's dS), its jaxpr traced at 64 of T = 512 query rows: equal to jax.vjp
  of the same function on the whole grid (a bias with a query axis, learned slopes), and
  the compiled program's temporaries under half those of the whole grid's trace."""
  B_, T_, N_ = 1, 512, 2
  rng = np.random.default_rng(4)
  q, k = (array(rng.standard_normal((B_, T_, N_, 8)), jnp.float32) for _ in range(2))
  bias = array(rng.standard_normal((1, N_, T_, T_)), jnp.float32)
  ds = array(rng.standard_normal((B_, N_, T_, T_)), jnp.float32)
  slopes = array([0.5, 0.2], jnp.float32)
  score_fn = lambda s, b, h, qi, kv: s - slopes[h] * jnp.abs(qi - kv) + 0.1 * jnp.sin(s)

  def want(bias, slopes):  # the whole grid, by hand
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * 0.5 + bias
    b, h, qi, kv = masks.index_grid(B_, N_, T_, T_)
    return s - slopes[h] * jnp.abs(qi - kv) + 0.1 * jnp.sin(s)

  want_bias, want_slopes = jax.vjp(want, bias, slopes)[1](ds)
  specs = fk.index_specs(BQ, BK)
  s_spec = jax.ShapeDtypeStruct((1, 1, BQ, BK), jnp.float32)
  tile = _in_kernel.Function.trace(lambda *a: score_fn(*a), s_spec, *specs)
  settings = fk.Settings(0.5, T_, T_, BQ, BK, num_warps=4, num_stages=2, interpret=True)
  compiled = []
  for rows in (64, T_):
    grid = flex._grid_trace(score_fn, tile, B_, N_, rows, T_, jnp.float32)
    assert grid is not None and grid.invars[-2].aval.shape == (1, 1, rows, 1)
    vjp = lambda q, k, bias, ds, grid=grid: _flex_backward._score_grid_vjp(
      grid, settings, q, k, bias, tile.arrays, [0], fk.kernel_scalars(None, None), ds, True
    )
    compiled.append(jax.jit(vjp).lower(q, k, bias, ds).compile())
    d_bias, (d_slopes,) = compiled[-1](q, k, bias, ds)
    np.testing.assert_allclose(d_bias, want_bias, atol=1e-5, err_msg=str(rows))
    np.testing.assert_allclose(d_slopes, want_slopes, rtol=1e-4, err_msg=str(rows))
  temp = [c.memory_analysis().temp_size_in_bytes for c in compiled]
  assert temp[0] < temp[1] / 2, temp
  # How many rows at a time: the most whose float32 (B, N, rows, S) array is under 256 MiB,
  # a divisor of T (a multiple of 64 for the Hopper kernels), or the least divisor from 64.
  assert _chunks.rows(1, 16, 16384, 16384) == 256 == _chunks.rows(1, 16, 16384, 16384, 64)
  assert _chunks.rows(2, 2, 40, 40) == 40 and _chunks.rows(8, 64, 640, 10**6, 64) == 64
  assert _chunks.rows(1, 16, 1000, 10**6) == 100 and _chunks.rows(1, 16, 16381, 10**6) == 16381
  with pytest.raises(ValueError, match="count: must divide T = 40, got 16"):
    _chunks.over_rows(lambda first: ([], None), 40, 16, [], None)


def test_check_grads_float64(x64):
  """Query, key, value, a bias broadcast over the queries (1, N, 1, S) and a score function's
  learned slopes (differentiated on the grid, 8 query rows at a time), through a mask, in
  float64: one check, as every argument's cotangent comes from the same backward."""
  mask = masks.causal() & masks.lengths(np.array([33, 40]), np.array([40, 0]))
  q, k, v = (x.astype(jnp.float64) for x in _inputs(2))
  bias = array(np.random.default_rng(2).normal(size=(1, N, 1, S)))

  def f(q, k, v, bias, slopes):
    score_fn = lambda s, b, h, qi, kv: s - slopes[h] * jnp.abs(qi - kv) + 0.1 * jnp.sin(s)
    return _loss(lambda *a: _flex_vjp(*a, mask, score_fn, bias=bias, grid_rows=8), q, k, v)

  slopes = array([0.5, 0.2, 0.1, 0.05])
  jax.test_util.check_grads(
    jax.jit(f), (q, k, v, bias, slopes), order=1, modes=["rev"], atol=1e-5, rtol=1e-5
  )


# --- implementation="flex" through the public call ---------------------------------------


def test_dot_product_attention_runs_flex_by_name():
  """Segment ids, causal, a soft cap, sinks and return_residual, GQA: the values, the lse and
  the gradients (the lse's included) of implementation='flex' equal xla's."""
  q, k, v = _inputs(2)
  _public_flex_matches_xla(
    q,
    k,
    v,
    is_causal=True,
    segment_ids=array(IDS),
    logits_soft_cap=2.0,
    sinks=array([0.5, -1.0, 0.0, 2.0]),
  )
  choice = jattn.explain(q, k, v, implementation="flex", backend="gpu", is_causal=True)
  assert (choice.implementation, choice.backward) == ("flex", None)


@pytest.mark.parametrize(
  "kw, message",
  [
    (dict(block_q=24), r"block_q=24 \(flex's tiles are powers of two, at least 16\)"),
    (dict(backward="custom_vjp"), "flex.*does not support backward=.custom_vjp.*own fused"),
  ],
  ids=["block", "backward"],
)
def test_what_flex_cannot_take_is_refused_by_name(kw, message):
  q, k, v = _inputs(2)
  with jattn.testing.interpret_kernels(), pytest.raises(ValueError, match=message):
    jattn.dot_product_attention(q, k, v, implementation="flex", **kw)


# The default run keeps one pattern shared by every batch row and head; a pattern per
# (batch, head) is exhaustive here: test_sharded_kernels.py's
# test_flex_runs_each_devices_share_on_global_indices draws it by default under GQA, values,
# lse and gradients against xla's.
@pytest.mark.parametrize("broadcast", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_dropout_is_the_pattern_every_implementation_draws(broadcast):
  """The same rng drops the same weights as xla's, forward and backward (dropout's pattern is
  a function of (rng, batch, head, q, kv)), per (batch, head) or shared."""
  q, k, v = _inputs(2)
  _public_flex_matches_xla(
    q,
    k,
    v,
    is_causal=True,
    dropout_rate=0.3,
    dropout_rng=jax.random.key(7),
    broadcast_dropout=broadcast,
  )


def test_flex_needs_a_gpu_or_interpret_mode():
  q, k, v = _inputs(2)
  with pytest.raises(ValueError, match=r"implementation='flex' needs an NVIDIA GPU; .*interpret"):
    jattn.dot_product_attention(q, k, v, implementation="flex")


def test_second_derivatives_are_refused_naming_the_rule():
  q, k, v = _inputs(2)
  loss = lambda q: jnp.sum(jattn.dot_product_attention(q, k, v, implementation="flex") ** 2)
  with jattn.testing.interpret_kernels(), pytest.raises(ValueError, match="implementation='flex'"):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)


def test_the_public_call_lowers_for_cuda_with_dropout_segments_and_a_soft_cap():
  """Traced as on a GPU (lowering_for), the training step lowers to the three Triton kernels:
  the dropout hash (uint32 shifts and xors), the segment ids' loads, and a differentiated
  bias (read per tile; its gradient's buffer aliased into the dQ kernel) included."""
  q, k, v = _inputs(2)
  kw = dict(
    is_causal=True,
    segment_ids=array(IDS),
    logits_soft_cap=2.0,
    dropout_rate=0.2,
    dropout_rng=jax.random.key(0),
  )
  bias = jnp.zeros((1, N, T, S), jnp.float32)
  loss = lambda *a: jnp.sum(
    jattn.dot_product_attention(*a[:3], bias=a[3], implementation="flex", **kw)
  )
  step = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
  with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
    text = step.trace(q, k, v, bias).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3
  assert "output_operand_aliases" in text


def test_lowering_for_a_named_gpu_takes_its_generations_tiles():
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(2))
  fn = jax.jit(lambda *a: jattn.dot_product_attention(*a, implementation="flex"))
  for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"):
    row = flex.tiles_for(H, 2, kind).forward
    with jattn.testing.lowering_for("gpu", kind), warnings.catch_warnings():
      warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
      text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert f"num_stages = {row.num_stages} : i32" in text, kind
    assert f"num_warps = {row.num_warps} : i32" in text, kind
  assert flex.tiles_for(H, 2, "NVIDIA A100") != flex.tiles_for(H, 2, "NVIDIA H100")
  with pytest.raises(ValueError, match="device_kind"), jattn.testing.lowering_for("tpu", "H100"):
    pass


def test_the_tile_table_by_generation_head_dim_and_dtype():
  assert flex.generation("NVIDIA H100 80GB HBM3") == "sm_90"
  assert flex.generation("NVIDIA A100-SXM4-40GB") == "sm_80"
  assert flex.generation("") == "sm_80"  # no GPU here: the Ampere row
  h100 = flex.tiles_for(96, 2, "NVIDIA H100 80GB HBM3")  # H = 96 takes the 128 row
  assert h100 == flex.TILES[("sm_90", 128, 2)]
  assert flex.tiles_for(16, 4, "NVIDIA A100-SXM4-40GB") == flex.TILES[("sm_80", 64, 4)]
  assert flex.tiles_for(512, 2, "NVIDIA H100") == flex.FALLBACK
  for passes in (*flex.TILES.values(), flex.FALLBACK):
    for row in passes:  # forward, dQ, dK/dV
      for block in (row.block_q, row.block_kv):
        assert block >= 16 and block & (block - 1) == 0, row  # what _check asks of callers
      assert row.num_warps in (4, 8) and row.num_stages >= 1


# A study's smoke test (flex interpreted at the table's tiles and at 16 x 16, forward and
# backward: four programs), exhaustive as the GPU probe's below; the default run checks flex
# at the table's tiles and at others throughout this file.
@pytest.mark.exhaustive
def test_the_tuning_script_times_the_table_and_each_candidate():
  from experiments import tune_flex

  rows = tune_flex.main(["--quick"])
  assert [(r["block_q"], r["block_kv"]) for r in rows] == [(None, None), (16, 16)]
  assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)


def test_the_probe_keeps_ptxas_reports_from_its_own_output(capfd):
  """On a GPU the probe keeps ptxas's report of each Mosaic GPU kernel (registers, spill
  bytes), which Mosaic GPU prints from C++ to the process's output when
  MOSAIC_GPU_DUMP_PTXAS is set: text printed by C code inside the probe's capture (set for
  it, unset after) is parsed per function and echoed; a row without a report says so."""
  import ctypes
  import os

  from experiments import gpu_probe

  report = (
    "ptxas info    : Compiling entry function 'mosaic_gpu_dq' for 'sm_90a'\n"
    "ptxas info    : Function properties for mosaic_gpu_dq\n"
    "    0 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
    "ptxas info    : Used 232 registers, used 16 barriers, 424 bytes cmem[0]\n"
    "ptxas info    : Compiling entry function 'mosaic_gpu_dkv' for 'sm_90a'\n"
    "ptxas info    : Used 168 registers, used 1 barriers, 424 bytes cmem[0]\n"
  )
  row: dict = {}
  libc = ctypes.CDLL(None)
  with gpu_probe.mosaic_ptxas(row):
    assert os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "1"
    libc.printf(b"%s", report.encode())
  assert "MOSAIC_GPU_DUMP_PTXAS" not in os.environ
  assert row["ptxas"] == [
    {"function": "mosaic_gpu_dq", "spill_stores": 24, "spill_loads": 16, "registers": 232},
    {"function": "mosaic_gpu_dkv", "registers": 168},
  ]
  assert "Used 168 registers" in capfd.readouterr().out
  quiet: dict = {}
  with gpu_probe.mosaic_ptxas(quiet):
    pass
  assert quiet["ptxas"] == "no ptxas report in the output"


@pytest.mark.exhaustive
def test_the_gpu_probe_runs_interpreted_and_writes_one_record(tmp_path):
  """The probe's smoke test (interpret mode): candidate tilings, the table's variants, the
  stressed inputs' errors and the table's baseline, each timed and checked against float32
  (bf16 errors, not zero, well under 1e-2; at scale 1e3 the rows are one-hot at this size)."""
  from experiments import gpu_probe

  record = gpu_probe.main(["--quick", "--out", str(tmp_path / "probe.json")])
  assert (tmp_path / "probe.json").exists() and not record["skipped"]
  sections = [r["section"] for r in record["rows"]]
  # With Mosaic GPU's interpreter (jax >= 0.11.2), the Hopper kernels' rows too (causal).
  hopper = ["hopper", "hopper_ws"] if _hopper.has_interpreter() else []
  assert sections == (
    ["forward"] * 2
    + ["backward"]
    + ["variant"] * 3
    + ["stress"] * 9
    + ["baseline"] * (2 + len(hopper))
  )
  assert [r["method"] for r in record["rows"][17:]] == hopper
  assert [r["variant"] for r in record["rows"][3:6]] == ["table", "natural_order", "one_part_ds"]
  for r in record["rows"]:
    assert "error" not in r, r
    for key in ("err_out", "err_dq", "err_dk", "err_dv"):
      if key in r:
        exact = r.get("case") == "scale_1e3"
        assert r[key]["finite"] and (0 <= r[key]["rel"] if exact else 0 < r[key]["rel"] < 1e-2)
  assert record["rows"][2]["tiles"] == [[16, 32, 4, 2], [32, 16, 4, 2]]
  stress = {(r["case"], r.get("variant")): r for r in record["rows"] if r["section"] == "stress"}
  one, two = stress["peaked_x2", "one_part_ds"], stress["peaked_x2", "table"]
  assert one["err_dk"] != two["err_dk"] and one["err_dq"] == two["err_dq"]


def test_the_compile_check_reads_registers_and_spills_for_sm_90():
  """The optional check (the gpu extra: standalone triton): each of the three kernels at the
  table's Hopper row compiles for sm_90 without spills, registers read from ptxas."""
  pytest.importorskip("triton")
  from experiments import check_flex_compile

  rows = check_flex_compile.main(["--quick"])
  assert [r["kernel"] for r in rows] == ["jattn_flex_forward", "jattn_flex_dq", "jattn_flex_dkv"]
  passes = flex.TILES[("sm_90", 64, 2)]
  for r, row in zip(rows, passes):
    assert (r["block_q"], r["block_kv"], r["num_warps"]) == row[:3], r
    assert r["num_stages"] == row.num_stages and 0 < r["registers"] <= 255, r
    assert r["spill_stores"] == r["spill_loads"] == 0 and not r["problem"], r
    # Hopper's warpgroup matrix instructions, in the FULL tiles' loop too.
    assert r["wgmma"] > 0 and r["loop_matmul"] > 0 and r["loop_other_per_column"] > 0, r


# --- masks and score functions that read arrays, in every way jnp indexes them -----------
#
# flex traces them into its Triton kernels, which load a captured array where the function
# indexes it elementwise by its index arguments; anything else (a gather from an array in
# registers, an array read whole whose shape is not a power of two, a sort or a cumulative
# sum) has no Triton lowering, and flex's row of the table says so, so that the default
# falls back. Each accepted case runs in interpret mode against xla and lowers for CUDA;
# each refused one is refused by name, and the default's fallback matches xla.

_rng = np.random.default_rng(11)
OFFSETS = array([0, 7, 19, T])  # document boundaries
VALID = array(_rng.random((B, S)) < 0.7)
DENSE = array(_rng.random((B, N, T, S)) < 0.6)
KEEP = array(_rng.random(T) < 0.5)
TABLE = array(_rng.random((T, S)) < 0.5)
LENS = array([33, 25])
DOC_OF = array(np.searchsorted(np.asarray(OFFSETS), np.arange(T), side="right"))
SAME = array(np.eye(4, dtype=bool) | (np.arange(4)[:, None] == 3))  # doc 3 sees all
ENDS4 = array([7, 19, 30, T])  # 4 (a power of two) boundaries, compared with all
ENDS5 = array([7, 19, 25, 30, T])  # 5 boundaries: a (..., 5) array in the kernel


def _doc(q, ends=ENDS4):
  """The document of each position: how many boundaries it has reached (compared with all)."""
  return jnp.sum(q[..., None] >= ends.reshape(1, 1, 1, 1, -1), axis=-1)


READS_ACCEPTED = {
  "take_by_batch": lambda b, h, q, kv: kv < jnp.take(LENS, b),
  "dense_at_traced_batch_and_head": lambda b, h, q, kv: DENSE[b, h, q, kv],
  "vector_at_q_and_kv": lambda b, h, q, kv: KEEP[q] | KEEP[kv] | (q == kv),
  "boolean_table": lambda b, h, q, kv: TABLE[q, kv] | (q == kv),
  "table_at_loaded_ids": lambda b, h, q, kv: SAME[DOC_OF[q], DOC_OF[kv]],
  "negative_wrapped_and_clipped": (
    lambda b, h, q, kv: KEEP[kv - S] ^ KEEP.at[q + 7].get(mode="clip")
  ),
  "batch_row_at_kv": lambda b, h, q, kv: VALID[b, kv] & (kv <= q + 3),
  "compare_with_every_boundary": lambda b, h, q, kv: _doc(q) == _doc(kv),
  "static_rows_and_strided_slices": (
    lambda b, h, q, kv: (VALID[0][q] & VALID[1][kv]) | KEEP[::2][q // 2] | TABLE[3:][q - 3, kv]
  ),
}

READS_REFUSED = {
  "searchsorted": (
    lambda b, h, q, kv: (
      jnp.searchsorted(OFFSETS, q, side="right") == jnp.searchsorted(OFFSETS, kv, side="right")
    ),
    "it uses `(gather|call_hi_primitive)`",
  ),
  "sum_then_index": (
    lambda b, h, q, kv: kv < VALID.sum(-1)[b],
    r"it forms a \(2, 40\) bool array",
  ),
  "rolled_then_index": (
    lambda b, h, q, kv: jnp.roll(KEEP, 3)[q] | (q == kv),
    r"it forms a \(\d+,\) bool array",
  ),
  "cumsum_then_index": (
    lambda b, h, q, kv: kv < jnp.cumsum(LENS // 2)[b] + 9,
    "it uses `cumsum` \\(a cumulative sum\\)",
  ),
  "sort_then_index": (
    lambda b, h, q, kv: kv <= jnp.sort(LENS)[b],
    "it uses `(sort|gather)`",
  ),
  "compare_with_5_boundaries": (
    lambda b, h, q, kv: _doc(q, ENDS5) == _doc(kv, ENDS5),
    r"it forms a \(5,\) int32 array",
  ),
}


def test_the_allow_list_holds_on_the_installed_jax():
  """Every primitive flex lets into its kernels that this JAX defines has a rule in Pallas'
  Triton lowering here (the list spans JAX 0.10 to the newest: some exist in one only)."""
  from jax._src.pallas.triton import lowering

  from jattn.impl.flex import _lowers as _flex_lowers

  registered = {p.name for p in lowering.triton_lowering_rules}
  defined = {
    x.name
    for name, module in list(sys.modules.items())
    if name.split(".")[0] == "jax"
    for x in list(vars(module).values())
    if isinstance(x, jax.extend.core.Primitive)
  }
  assert {"gather", "sort", "cumsum", "dynamic_slice"} <= defined
  assert not (_flex_lowers.TRITON_PRIMITIVES & {"gather", "sort", "cumsum", "scatter"})
  missing = (_flex_lowers.TRITON_PRIMITIVES & defined) - registered
  assert not missing, f"allowed but not lowered by this JAX's Pallas Triton: {missing}"


def test_a_scans_constants_and_carry_are_read_from_its_parameters():
  """jattn._compat.scan_counts: a scan's body inputs split into constants, carried values
  and scanned arrays, from the parameters of the installed JAX (num_consts and num_carry in
  0.10, ft_in from 0.11), as flex's lowering check reads them: one constant (z), two carried
  values, one scanned array."""
  body = lambda c, y, z: ((c[0] + y * z, c[1] * z), c[0])
  scan = lambda x, z: jax.lax.scan(lambda c, y: body(c, y, z), (x, x + 1), jnp.arange(3.0))
  (eqn,) = [e for e in jax.make_jaxpr(scan)(1.0, 2.0).jaxpr.eqns if e.primitive.name == "scan"]
  assert _compat.scan_counts(eqn.params) == (1, 2)
  assert len(eqn.params["jaxpr"].jaxpr.invars) == 1 + 2 + 1

  # A mask counting with a fori_loop (a scan with a carry only) is flex's on a GPU; one that
  # scans over an array is refused by name (before, jax >= 0.11 failed with a KeyError).
  def counted(b, h, q, kv):
    body = lambda i, c: c + (q > kv + i).astype(jnp.int32)
    return jax.lax.fori_loop(0, 3, body, jnp.zeros_like(q - kv)) < 2

  def scanned(b, h, q, kv):
    total, _ = jax.lax.scan(lambda c, y: (c + y, None), q - kv, jnp.arange(4))
    return total > 0

  x = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
  choice = jattn.explain(x, x, x, mask=masks.from_fn(counted), backend="gpu")
  assert choice.implementation == "flex", str(choice)
  with pytest.raises(ValueError, match=r"`scan` over arrays"):
    jattn.explain(x, x, x, mask=masks.from_fn(scanned), backend="gpu", implementation="flex")


# By default: loaded ids then a table; the rest are the exhaustive tier (a read at traced batch
# and head reaches no line of jattn the default run leaves unreached, by coverage's per-test
# arcs). Static rows and strided slices read inside a kernel, exact and lowered to Triton, are
# test_in_kernel.py's test_static_slices_of_an_array_are_loads_at_offsets.
_READS_KEPT = {"table_at_loaded_ids"}


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=[] if n in _READS_KEPT else [pytest.mark.exhaustive])
    for n in sorted(READS_ACCEPTED)
  ],
)
def test_masks_reading_arrays_that_flex_takes_run_and_lower(name):
  """Chosen by the default on a GPU, equal to xla in interpret mode (values, lse and every
  gradient), and the training step lowers for CUDA to the three Triton kernels."""
  mask = masks.from_fn(READS_ACCEPTED[name])
  q, k, v = _inputs(2)
  assert jattn.explain(q, k, v, mask=mask, backend="gpu").implementation == "flex"
  _public_flex_matches_xla(q, k, v, mask=mask)
  loss = lambda *a: jnp.sum(jattn.dot_product_attention(*a, mask=mask, implementation="flex"))
  with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
    step = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v)
    text = step.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3


# By default: an array the mask computes, then indexes (its shape not a power of two). The
# others are exhaustive: a primitive Triton cannot lower is refused by the same check by
# default in test_a_score_function_that_indexes_a_computed_array_is_refused_by_name (cumsum),
# and the fallback is the same; searchsorted's mask alone takes seconds to trace.
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=[] if n == "sum_then_index" else [pytest.mark.exhaustive])
    for n in sorted(READS_REFUSED)
  ],
)
def test_masks_reading_arrays_that_flex_cannot_lower_are_refused_by_name(name):
  """Named, flex refuses the mask with what in it has no Triton lowering (interpret mode
  too: it stands for the GPU); the default on a GPU falls back, to xla or (tiles asked
  for) blockwise, and its values and gradients equal xla's."""
  fn, why = READS_REFUSED[name]
  mask = masks.causal(5) & masks.from_fn(fn)
  q, k, v = _inputs(2)
  message = rf"implementation='flex' does not support mask from_fn\(<lambda>\): {why}"
  with jattn.testing.interpret_kernels(), pytest.raises(ValueError, match=message):
    jattn.dot_product_attention(q, k, v, mask=mask, implementation="flex")
  loss = lambda q, k, v, **kw: _loss(
    lambda *a: jattn.dot_product_attention(*a, mask=mask, return_residual=True, **kw), q, k, v
  )
  fallbacks = (({}, "xla"), (dict(block_q=16, block_kv=16), "blockwise"))
  for tiles, fallback in fallbacks:
    choice = jattn.explain(q, k, v, mask=mask, backend="gpu", **tiles)
    assert choice.implementation == fallback
    assert re.search(f"flex does not: mask from_fn\\(<lambda>\\): {why}", choice.reason)

  def xla_and_fallbacks(q, k, v):  # one program: xla's, then each fallback traced as on a GPU
    grad = lambda **kw: jax.value_and_grad(functools.partial(loss, **kw), (0, 1, 2))(q, k, v)
    want = grad(implementation="xla")
    with jattn.testing.lowering_for("gpu"):
      return want, [grad(**tiles) for tiles, _ in fallbacks]

  want, gots = jax.jit(xla_and_fallbacks)(q, k, v)
  for got in gots:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_choosing_for_a_gpu_traces_a_mask_once_per_structure():
  """The first choice traces the mask's function (its shapes, its probes on small grids, and
  a probe kernel of flex's tiles for whether Triton lowers it); a later call with a mask built
  anew from the same function, and arrays of the same shapes, traces nothing: refusals too."""
  calls = []

  def reads(b, h, q, kv):
    calls.append(q.shape)
    return KEEP[q] | (q == kv)

  def sums(b, h, q, kv):
    calls.append(q.shape)
    return kv < VALID.sum(-1)[b]

  q, k, v = _inputs(2)
  for fn, want in ((reads, "flex"), (sums, "xla")):
    traced = []
    for _ in range(2):
      del calls[:]
      assert jattn.explain(q, k, v, mask=masks.from_fn(fn), backend="gpu").implementation == want
      traced.append(list(calls))
    assert traced[0] and not traced[1], (fn.__name__, traced)


def test_a_score_function_that_indexes_a_computed_array_is_refused_by_name():
  slopes = array([0.5, 0.2, 0.1, 0.05])

  def cumulative(s, b, h, q, kv):
    return s - jnp.cumsum(slopes)[h] * jnp.abs(q - kv)

  q, k, v = _inputs(2)
  with (
    jattn.testing.interpret_kernels(),
    pytest.raises(
      ValueError, match=r"does not support score_fn from_fn\(cumulative\): it uses `cumsum`"
    ),
  ):
    jattn.dot_product_attention(q, k, v, score_fn=cumulative, implementation="flex")
  choice = jattn.explain(q, k, v, score_fn=cumulative, is_causal=True, backend="gpu")
  assert choice.implementation == "xla" and "score_fn from_fn(cumulative)" in choice.reason


def test_dk_sums_ds_in_one_or_two_narrow_parts_as_the_gpus_row_says(monkeypatch):
  """flex.SPLIT_DS: the dK/dV kernel rounds dS once to bf16 on Hopper (measured on an H200:
  dK's error no worse than cuDNN's or jax.nn XLA's, docs/gpu/gpu_probe_h200_variants.json)
  and sums it as hi + lo on Ampere. Traced as on each GPU, the kernels' settings say so.
  Interpreted, both ways give dK within bf16's error of XLA's in float32, the two parts
  closer to it; dQ and dV are the same either way."""
  seen = []
  attention = _flex_backward.attention
  monkeypatch.setattr(
    _flex_backward, "attention", lambda *a: seen.append({s.split_ds for s in a[6]}) or attention(*a)
  )
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(2))
  loss = lambda *a: jnp.sum(jattn.dot_product_attention(*a, implementation="flex"))
  step = jax.jit(jax.grad(loss, (0, 1, 2)))
  for kind, split in (("NVIDIA A100-SXM4-80GB", True), ("NVIDIA H200", False)):
    seen.clear()
    with jattn.testing.lowering_for("gpu", kind):
      step.trace(q, k, v)
    assert seen and all(x == {split} for x in seen), (kind, seen)
  monkeypatch.undo()

  def grads(attend, *args):  # of a loss weighted in float32 whatever the inputs' dtype
    wide = lambda *a: [x.astype(jnp.float32) for x in attend(*a)]
    return jax.grad(lambda *a: _loss(wide, *a), (0, 1, 2))(*args)

  xla = lambda *a: jattn.dot_product_attention(*a, implementation="xla", return_residual=True)
  two, one, want = jax.jit(
    lambda q, k, v: (
      [
        grads(lambda *a: _flex_vjp(*a, None, None, split_ds=split), q, k, v)
        for split in (True, False)
      ]
      + [grads(xla, *(x.astype(jnp.float32) for x in (q, k, v)))]
    )
  )(q, k, v)
  for i in (0, 2):  # dQ, dV
    np.testing.assert_array_equal(two[i], one[i])
  rel = lambda x: np.linalg.norm(np.float32(x) - want[1]) / np.linalg.norm(want[1])
  assert rel(two[1]) < rel(one[1]) < 1e-2


# Exhaustive (6 CPU-seconds of interpreted kernels), for the README command's time bound.
@pytest.mark.exhaustive
def test_rows_that_grow_heavier_launch_from_the_last(monkeypatch):
  """A causal mask's query tiles grow heavier along the sequence: the forward and dQ kernels
  take them from the last (the longest programs start first, the short ones fill the end)
  and dK/dV, whose key tiles grow lighter, in order; an upper-triangular mask the other way
  round; an even spread and a traced schedule in order. Values and gradients match XLA's."""
  from jattn.impl import tiling

  causal, upper = masks.causal(), ~masks.causal(offset=-1)  # kv <= q, kv >= q
  for mask, want in ((causal, (True, False)), (upper, (False, True)), (None, (False, False))):
    rows, cols = fk.schedules(mask, B, N, T, S, BQ, BK)
    assert (tiling.heaviest_last(rows), tiling.heaviest_last(cols)) == want
  seen = []
  view = tiling.tile_classes(causal, B, N, T, S, BQ, BK)
  jax.make_jaxpr(lambda x: seen.append(tiling.heaviest_last(tiling.schedule(x))) or x)(view)
  assert seen == [False]

  # The three kernels' settings (forward, dQ, dK/dV), as flex's backward rule receives them.
  orders = []
  attention = _flex_backward.attention

  def spy(*args):
    orders.append([s.from_last for s in args[6]])
    return attention(*args)

  monkeypatch.setattr(_flex_backward, "attention", spy)
  q, k, v = _inputs(2)
  for mask, want in ((causal, [True, True, False]), (upper, [False, False, True])):
    orders.clear()
    # jattn's jitted core is cached by its settings: forget its traces (not, as
    # jax.clear_caches() would, every program this worker compiled for the tests after it)
    jattn.attention.attend.clear_cache()

    def run(impl, *args, mask=mask):
      tiles = dict(block_q=BQ, block_kv=BK) if impl == "flex" else {}
      attend = lambda *a: jattn.dot_product_attention(*a, mask=mask, implementation=impl, **tiles)
      return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(attend(*a))), (0, 1, 2))(*args)

    got, ref = _flex_and_xla(run, q, k, v)
    assert orders and all(o == want for o in orders), orders
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
