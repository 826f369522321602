"""implementation="blockwise" against the materialised path and float64 references:
values, lse and every gradient, tile skipping, O(B·T·N·H) memory, the auto rule."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from cases import SCORE_FN_HEADS, SCORE_FNS, mask_kinds, score_fn_in
from jax.test_util import check_grads
from reference import (
  array,
  assert_close,
  attention_jnp,
  block_sparse_np,
  dilated_window_np,
  global_np,
  normal,
  tile_classes_np,
)

import jattn
from jattn import dropout, masks, scores
from jattn.impl import blockwise, tiling

# T and S are not multiples of the tiles, so every test also runs padded edge tiles.
B, T, S, N, K, H = 2, 7, 9, SCORE_FN_HEADS, 2, 4
BLOCKS = dict(block_q=3, block_kv=4)
IDS_Q = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 3, 3, 3, 4, 4, 7]])
IDS_KV = np.array([[0, 0, 1, 1, 1, 1, 2, 2, 2], [3, 3, 3, 4, 4, 5, 5, 5, 5]])

# Every mask kind, several of which leave some query rows with nothing to attend to, and
# the sparse patterns.
MASKS = {
  **mask_kinds(
    B,
    T,
    S,
    ids=(IDS_Q, IDS_KV),
    window=(2, 1),
    chunk=3,
    prefix=[4, 0],
    lengths=([5, 7], [0, 6]),
    num_global=2,
    stride=3,
  ),
  "causal_bottom_right": masks.causal(S - T),
  "longformer": masks.longformer(1, dilation=2),
  "bigbird": masks.bigbird(T, S, block_size=2, num_random_blocks=1, seed=0),
}


def _inputs(dtype, bias_shape=(1, N, T, S)):
  return (
    normal((B, T, N, H), dtype),
    normal((B, S, K, H), dtype, 1),
    normal((B, S, K, H), dtype, 2),
    normal(bias_shape, dtype, 3),
  )


def _finite(lse):
  return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _attn(implementation, mask=None, **kw):
  if implementation == "blockwise":
    kw = {**BLOCKS, **kw}
  else:
    kw = {"backward": "custom_vjp", **kw}

  def f(q, k, v, bias):
    out, lse = jattn.dot_product_attention(
      q, k, v, bias, mask=mask, return_residual=True, implementation=implementation, **kw
    )
    return out, _finite(lse)

  return f


def _value_and_grads(f, args, seed=11):
  """Outputs and gradients of a random projection of both outputs (exercises the lse cotangent)."""
  shapes = jax.eval_shape(f, *args)
  cots = [normal(o.shape, jnp.float32, seed + i) for i, o in enumerate(shapes)]

  @jax.jit
  def run(*args):
    loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(f(*a), cots))
    return f(*args), jax.grad(loss, tuple(range(len(args))))(*args)

  return run(*args)


def _assert_same(got, want, dtype, factor=5):
  (out, lse), grads = got
  (out_ref, lse_ref), grads_ref = want
  assert_close(out, out_ref, dtype, factor=factor, err_msg="out")
  assert_close(lse, lse_ref, dtype, factor=factor, err_msg="lse")
  for name, a, b in zip(["dq", "dk", "dv", "dbias", "d5", "d6"], grads, grads_ref):
    assert a.dtype == b.dtype, name
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert_close(a, b, dtype, factor=factor, err_msg=name)


# Every mask kind once, each with a bias shape, a score function, a head grouping, tiles, a
# dtype and dropout, spread so that every value of each of those appears two or more times
# (each was a test of its own, with one mask): each case compiles one blockwise forward and
# backward, checked against the float64 formula's values and autodiff gradients. Dropout
# (its keep mask regenerated in every tile, forward and backward) more than doubles a case's
# program, so it is on twice, once per dtype, once on rows left empty; its mask-independent
# draw is checked on every rule in test_dropout.py.
BIAS_SHAPES = [(B, N, T, S), (N, T, S), (1, 1, 1, S), (B, 1, T, 1), (T, S), (1, N, 1, 1)]
BNTS, NTS, S1, BT1, TS, N11 = BIAS_SHAPES
F32, F64 = np.float32, np.float64
# kind: (bias shape, score function, K, (block_q, block_kv), dtype, dropout)
SWEEP = {
  "none": (BNTS, None, 2, (3, 4), F64, False),
  "causal": (None, "alibi", 4, (1, 1), F32, False),
  "causal_empty_rows": (NTS, "relative", 2, (3, 4), F64, False),
  "causal_bottom_right": (S1, "soft_cap", 1, (7, 2), F32, False),
  "window": (BT1, "custom", 2, (64, 64), F64, False),
  "chunked": (TS, None, 4, (3, 4), F32, False),
  "prefix_lm": (N11, "alibi", 1, (3, 4), F64, False),
  "segments": (None, "relative", 2, (7, 2), F32, False),
  "lengths_empty_rows": (BNTS, "soft_cap", 4, (3, 4), F64, True),
  "global": (NTS, "custom", 1, (1, 1), F32, False),
  "strided": (S1, None, 2, (64, 64), F32, False),
  "from_array": (BT1, "alibi", 2, (3, 4), F64, False),
  "from_fn": (TS, "relative", 4, (3, 4), F32, True),
  "combined": (N11, "soft_cap", 2, (3, 4), F64, False),
  "longformer": (None, "custom", 2, (3, 4), F32, False),
  "bigbird": (BNTS, None, 1, (3, 4), F64, False),
}
# The default run keeps the kinds below, the others are exhaustive: every bias shape, score
# function, head grouping, tile shape, dtype and dropout setting of the sweep appears in at
# least one of them (in the whole sweep, at least twice; test_sweep_covers_every_mask_and_setting).
# Seven kinds, one per bias shape, are the fewest that can; a mask reaches blockwise as its tile
# classes and its values on each tile whatever its kind (from_fn and bigbird, exhaustive here,
# run through blockwise by default in test_paged.py's scores test and test_empty_tiles_are_
# never_computed).
DEFAULT_KINDS = (
  "causal",
  "causal_empty_rows",
  "causal_bottom_right",
  "window",
  "lengths_empty_rows",
  "chunked",
  "combined",
)
# The sparse patterns' reference masks come from their dense formulas, not materialize.
DENSE = {
  "longformer": dilated_window_np(T, S, 2, 2, 2) | global_np(T, S, 1),
  "bigbird": block_sparse_np(masks.bigbird_layout(4, 5, num_random_blocks=1, seed=0), 2, 2, T, S),
}
RATE, DROPOUT_RNG = 0.3, jax.random.key(5)


@functools.cache
def _keep():
  """The dropout keep mask of (DROPOUT_RNG, RATE) on the (B, N, T, S) grid."""
  grid = masks.index_grid(B, N, T, S)
  return np.asarray(jax.jit(dropout.keep_mask, static_argnums=1)(DROPOUT_RNG, RATE, *grid))


def _score(name, dtype):
  """The score function called name (or None), its parameters in the case's dtype."""
  return score_fn_in(SCORE_FNS.get(name), dtype)


def test_sweep_covers_every_mask_and_setting():
  assert set(SWEEP) == set(MASKS)
  for axis, values in enumerate(
    [
      BIAS_SHAPES + [None],
      [*SCORE_FNS, None],
      [4, 2, 1],
      [(3, 4), (1, 1), (7, 2), (64, 64)],
      [F32, F64],
      [True, False],
    ]
  ):
    for value in values:
      assert sum(case[axis] == value for case in SWEEP.values()) >= 2, (axis, value)
      assert any(SWEEP[kind][axis] == value for kind in DEFAULT_KINDS), (axis, value)


@pytest.mark.parametrize(
  "kind",
  [k if k in DEFAULT_KINDS else pytest.param(k, marks=pytest.mark.exhaustive) for k in SWEEP],
)
def test_every_mask_against_float64_formula(kind):
  bias_shape, score, kh, blocks, dtype, drop = SWEEP[kind]
  mask = MASKS[kind]
  rng = np.random.default_rng(list(SWEEP).index(kind))
  arrays = [rng.standard_normal(s) for s in [(B, T, N, H), (B, S, kh, H), (B, S, kh, H)]]
  bias = None if bias_shape is None else rng.standard_normal(bias_shape)
  cots = [rng.standard_normal((B, T, N, H)), rng.standard_normal((B, T, N))]
  if kind in DENSE:
    allowed = DENSE[kind]
  elif mask is not None:  # one compiled program, not one per operation
    allowed = np.asarray(jax.jit(lambda m: m.materialize(T, S, batch_size=B, num_heads=N))(mask))
  else:
    allowed = np.ones((T, S), bool)

  def run(f, args, cots):  # f's outputs and the gradients of a projection of them
    def outputs_and_grads(*a):  # one forward pass (grad of a loss would trace a second)
      out, pull = jax.vjp(f, *a)
      return out, pull(tuple(cots))

    return jax.jit(outputs_and_grads)(*args)

  with jax.enable_x64(dtype == F64):  # cast by NumPy: jnp would compile each conversion
    args = [array(np.asarray(x, dtype)) for x in arrays + ([] if bias is None else [bias])]
    keep = _keep() if drop else None
    kw = dict(dropout_rate=RATE, dropout_rng=DROPOUT_RNG) if drop else {}

    def ours(q, k, v, b=None):
      out, lse = jattn.dot_product_attention(
        q, k, v, b, mask=mask, score_fn=_score(score, dtype), return_residual=True,
        implementation="blockwise", block_q=blocks[0], block_kv=blocks[1], **kw,
      )  # fmt: skip
      return out, _finite(lse)

    (out, lse), grads = run(ours, args, [array(np.asarray(c, dtype)) for c in cots])
  with jax.enable_x64(True):

    def formula(q, k, v, b=None):
      b = None if b is None else b.reshape((1,) * (4 - b.ndim) + b.shape)
      out, lse = attention_jnp(
        q, k, v, b, allowed=allowed, score=_score(score, F64), keep=keep, rate=RATE
      )
      return out, _finite(lse)

    args64 = [array(np.asarray(x, F64)) for x in args]
    (want, want_lse), want_grads = run(formula, args64, [array(c) for c in cots])
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  np.testing.assert_array_equal(np.asarray(lse) == 0, np.asarray(want_lse) == 0)  # empty rows
  assert_close(out, want, dtype, factor=5, err_msg="out")
  assert_close(lse, want_lse, dtype, factor=5, err_msg="lse")
  for name, a, b in zip(["dq", "dk", "dv", "dbias"], grads, want_grads):
    assert_close(a, b, dtype, factor=5, err_msg=name)


# Finite differences (the formula above checks every mask's gradients) on empty rows, a
# combined mask, a learned score function, a bias and partial tiles.
def test_check_grads_float64(x64):
  fn = _score("relative", F64)
  mask = MASKS["lengths_empty_rows"] & MASKS["combined"]
  f = jax.jit(_attn("blockwise", mask, score_fn=fn))  # jitted: one program for every evaluation
  check_grads(f, _inputs(jnp.float64), order=1, modes=["rev"])


def test_learned_score_parameters_get_tile_summed_gradients():
  """A relative-position table closed over under grad(jit) gets the materialised path's gradient."""
  q, k, v, bias = _inputs(jnp.float32)
  table = normal((16, N), jnp.float32, 9)

  def loss(implementation, table, q):
    fn = scores.relative_position_bias(table, num_buckets=16, max_distance=8)
    return jnp.sum(_attn(implementation, masks.causal(), score_fn=fn)(q, k, v, bias)[0] ** 2)

  got = jax.jit(jax.grad(functools.partial(loss, "blockwise"), (0, 1)))(table, q)
  want = jax.jit(jax.grad(functools.partial(loss, "xla"), (0, 1)))(table, q)
  for a, b in zip(got, want):
    assert_close(a, b, factor=5)


# Exhaustive: finite differences repeat, at the cost of three programs, what the default run
# checks more tightly: test_every_mask_against_float64_formula[lengths_empty_rows] holds dropout
# and a soft cap (logits_soft_cap is scores.soft_cap) to autodiff of the float64 formula, and
# test_check_grads_float64 keeps finite differences on blockwise by default.
@pytest.mark.exhaustive
def test_check_grads_float64_dropout_and_soft_cap(x64):
  f = _attn(
    "blockwise",
    masks.causal(),
    dropout_rate=0.3,
    dropout_rng=jax.random.key(2),
    logits_soft_cap=3.0,
  )
  check_grads(jax.jit(f), _inputs(jnp.float64), order=1, modes=["rev"])


def test_bfloat16():
  args = _inputs(jnp.bfloat16)
  mask = masks.causal() & masks.segments(IDS_Q, IDS_KV)
  got = _value_and_grads(_attn("blockwise", mask), args)
  want = _value_and_grads(_attn("xla", mask), args)
  assert got[0][0].dtype == jnp.bfloat16
  _assert_same(got, want, jnp.bfloat16, factor=2)


def test_traced_mask_arrays_under_jit_and_vmap():
  """Segment ids that are traced make the tile schedule data-dependent; results still agree."""
  q, k, v, _ = _inputs(jnp.float32)

  def one(q, k, v, ids_q, ids_kv, implementation):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      segment_ids=(ids_q, ids_kv),
      is_causal=True,
      implementation=implementation,
      **(BLOCKS if implementation == "blockwise" else {}),
    )

  run = jax.jit(jax.vmap(one, (0, 0, 0, 0, 0, None)), static_argnums=5)
  assert_close(run(q, k, v, IDS_Q, IDS_KV, "blockwise"), run(q, k, v, IDS_Q, IDS_KV, "xla"))


def test_fully_masked_rows_follow_the_numerics_contract():
  q, k, v, bias = _inputs(jnp.float32)
  mask = masks.lengths(np.array([7, 4]), np.array([0, 5]))  # batch 0: no keys
  f = _attn("blockwise", mask)
  with jax.debug_nans(True), jax.debug_infs(True):
    (out, _), grads = _value_and_grads(f, (q, k, v, bias))
  out_raw, lse = jattn.dot_product_attention(
    q, k, v, bias, mask=mask, return_residual=True, implementation="blockwise", **BLOCKS
  )
  # Indexed as NumPy arrays (a jax.Array compiles a program for each index).
  out, lse, grads = np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]
  np.testing.assert_array_equal(out[0], 0.0)
  np.testing.assert_array_equal(out[1, 4:], 0.0)  # rows past the query length
  assert np.all(np.isneginf(lse[0])) and np.all(np.isneginf(lse[1, 4:]))
  assert np.all(np.isfinite(lse[1, :4]))
  for g in grads[:3]:  # dq, dk, dv of batch 0
    np.testing.assert_array_equal(g[0], 0.0)
  np.testing.assert_array_equal(grads[0][1, 4:], 0.0)
  np.testing.assert_array_equal(out_raw, out)


def test_minus_inf_bias_rows_give_zeros():
  q, k, v, _ = _inputs(jnp.float32)
  bias = np.zeros((1, 1, T, S), np.float32)  # NumPy: no program per operation
  bias[:, :, 2] = -np.inf
  out, lse = map(
    np.asarray,
    jattn.dot_product_attention(
      q, k, v, bias, return_residual=True, implementation="blockwise", **BLOCKS
    ),
  )
  np.testing.assert_array_equal(out[:, 2], 0.0)
  assert np.all(np.isneginf(lse[:, 2]))
  assert np.all(np.isfinite(out))


def _visited(mask, T_, S_, bq, bk):
  """The (q tile, kv tile) pairs blockwise's forward pass computes, recorded by a score_fn."""
  seen = []

  def record(s, b, h, q, kv):
    jax.debug.callback(
      lambda qi, ki: seen.append((int(qi), int(ki))), q[0, 0, 0, 0] // bq, kv[0, 0, 0, 0] // bk
    )
    return s

  q = normal((1, T_, 2, 4))
  k = normal((1, S_, 2, 4), seed=1)
  jattn.dot_product_attention(
    q, k, k, mask=mask, score_fn=record, implementation="blockwise", block_q=bq, block_kv=bk
  ).block_until_ready()
  return sorted(seen)


# (name, mask, T = S, tiles visited or None): with 4 x 4 tiles, causal visits about half the
# tiles and a window the diagonal and the one tile left of it, 2 per row at any length.
@pytest.mark.parametrize(
  "name, mask, length, count",
  [
    ("causal", masks.causal(), 32, 8 * 9 // 2),
    ("window", masks.sliding_window(3, 0), 24, 2 * 6 - 1),
    ("window_longer", masks.sliding_window(3, 0), 64, 2 * 16 - 1),
    ("segments", masks.segments(np.array([[0] * 8 + [1] * 8 + [2] * 8])), 24, None),
    ("chunked_or_global", masks.chunked(8) | masks.global_tokens(1), 24, None),
    ("longformer", masks.longformer(2, num_global=2, dilation=3), 24, None),
    ("bigbird", masks.bigbird(24, block_size=3, num_random_blocks=1, seed=2), 24, None),
  ],
)
def test_empty_tiles_are_never_computed(name, mask, length, count):
  bq = bk = 4
  dense = np.asarray(mask.materialize(length, length, batch_size=1, num_heads=2))
  classes = tile_classes_np(dense, bq, bk).max(axis=(0, 1))
  want = sorted(zip(*np.nonzero(classes)))
  visited = _visited(mask, length, length, bq, bk)
  assert visited == [(int(i), int(j)) for i, j in want]
  assert count is None or len(visited) == count


def test_schedule_puts_full_tiles_first_and_skips_empty():
  view = np.array([[1, 0, 2, 2], [0, 0, 0, 0], [2, 1, 1, 0]], np.int8)
  sched = tiling.schedule(view)
  np.testing.assert_array_equal(sched.num_full, [2, 0, 1])
  np.testing.assert_array_equal(sched.num_partial, [1, 0, 2])
  np.testing.assert_array_equal(sched.order[0, :3], [2, 3, 0])
  np.testing.assert_array_equal(sched.order[2, :3], [0, 1, 2])


def test_padded_edge_tiles_are_partial():
  view = tiling.tile_classes(None, 1, 1, 7, 9, 3, 4)
  np.testing.assert_array_equal(view, [[2, 2, 1], [2, 2, 1], [1, 1, 1]])
  view = tiling.tile_classes(masks.causal(), 1, 1, 8, 8, 4, 4)
  np.testing.assert_array_equal(view, [[1, 0], [2, 1]])


def _largest_intermediate(f, *args) -> int:
  """Elements of the largest array any equation of f's jaxpr (sub-jaxprs included) makes."""

  def walk(jaxpr):
    biggest = 0
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64)))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        biggest = max(biggest, walk(sub))
    return biggest

  return walk(jax.make_jaxpr(f)(*args).jaxpr)


def test_training_step_memory_is_linear_in_sequence_length():
  """No array of the forward or backward pass holds the (T, S) scores: only tiles."""
  T_, bq, bk = 512, 64, 32
  q = jax.ShapeDtypeStruct((1, T_, 2, 8), jnp.float32)

  def step(implementation, q):
    kw = dict(block_q=bq, block_kv=bk) if implementation == "blockwise" else {}
    f = lambda q: jnp.sum(
      jattn.dot_product_attention(q, q, q, is_causal=True, implementation=implementation, **kw) ** 2
    )
    return jax.grad(f)(q)

  # The largest arrays are the (1, T, 2, 8) inputs and their gradients.
  assert _largest_intermediate(functools.partial(step, "blockwise"), q) <= 2 * T_ * 8
  assert _largest_intermediate(functools.partial(step, "xla"), q) >= 2 * T_ * T_


def test_auto_rule():
  q_small = jax.ShapeDtypeStruct((1, 128, 8, 64), jnp.float32)
  q_large = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.float32)

  def uses_loops(q, **kw):
    jaxpr = jax.make_jaxpr(lambda q: jattn.dot_product_attention(q, q, q, **kw))(q)
    return "while" in str(jaxpr)

  assert jax.default_backend() != "cpu" or jattn.attention.AUTO_BLOCKWISE_BYTES["cpu"] == 2**23
  assert not uses_loops(q_small)
  assert uses_loops(q_large) == (jax.default_backend() == "cpu")
  assert not uses_loops(q_large, backward="autodiff")  # blockwise has no autodiff rule
  assert uses_loops(q_small, block_q=64)  # asking for tiles asks for blockwise
  assert not uses_loops(q_large, implementation="xla")


def test_default_blocks_per_backend():
  assert blockwise.default_blocks("cpu") == blockwise.DEFAULT_BLOCKS["cpu"]
  assert blockwise.default_blocks("some_new_backend") == blockwise.DEFAULT_BLOCKS["cpu"]
  for bq, bk in blockwise.DEFAULT_BLOCKS.values():
    assert bq >= 1 and bk >= 1
