"""implementation="blockwise" against the materialised path and float64 references:
values, lse and every gradient, tile skipping, O(B·T·N·H) memory, the auto rule."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import (
  assert_close,
  attention_np,
  block_sparse_np,
  dilated_window_np,
  global_np,
  normal,
  tile_classes_np,
)
from test_xla import SCORE_FNS  # the same score functions, for the same N

import jattn
from jattn import masks, scores
from jattn.impl import _tiling, blockwise

# T and S are not multiples of the tiles, so every test also runs padded edge tiles.
B, T, S, N, K, H = 2, 7, 9, 4, 2, 4  # N as in test_xla, whose SCORE_FNS are reused
BLOCKS = dict(block_q=3, block_kv=4)
IDS_Q = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 3, 3, 3, 4, 4, 7]])
IDS_KV = np.array([[0, 0, 1, 1, 1, 1, 2, 2, 2], [3, 3, 3, 4, 4, 5, 5, 5, 5]])

# Every mask kind; several leave some query rows with nothing to attend to.
MASKS = {
  "none": None,
  "causal": masks.causal(),
  "causal_empty_rows": masks.causal(-2),
  "causal_bottom_right": masks.causal(S - T),
  "window": masks.sliding_window(2, 1),
  "chunked": masks.chunked(3),
  "prefix_lm": masks.prefix_lm(np.array([4, 0])),
  "segments": masks.segments(IDS_Q, IDS_KV),
  "lengths_empty_rows": masks.lengths(np.array([5, 7]), np.array([0, 6])),
  "global": masks.global_tokens(2),
  "strided": masks.strided(3),
  "from_array": masks.from_array(np.random.default_rng(0).random((B, 1, T, S)) < 0.5),
  "from_fn": masks.from_fn(lambda b, h, q, kv: (q + kv + b + h) % 3 != 0),
  "combined": (masks.causal(1) & ~masks.strided(3)) | masks.global_tokens(1),
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


@pytest.mark.parametrize("kind", list(MASKS))
def test_matches_xla_for_every_mask(kind):
  args = _inputs(jnp.float32)
  got = _value_and_grads(_attn("blockwise", MASKS[kind]), args)
  want = _value_and_grads(_attn("xla", MASKS[kind]), args)
  _assert_same(got, want, np.float32)


@pytest.mark.parametrize("kind", ["none", "causal_empty_rows", "segments", "combined"])
def test_against_float64_numpy(kind):  # every kind: test_properties, with random tiles
  q, k, v, bias = _inputs(jnp.float32)
  mask = MASKS[kind]
  allowed = None if mask is None else np.asarray(mask.materialize(T, S, batch_size=B, num_heads=N))
  out, lse = jattn.dot_product_attention(
    q, k, v, bias, mask=mask, return_residual=True, implementation="blockwise", **BLOCKS
  )
  out_np, lse_np = attention_np(q, k, v, bias=bias, allowed=allowed)
  assert_close(out, out_np)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_np))
  assert_close(_finite(lse), np.where(np.isfinite(lse_np), lse_np, 0.0))


@pytest.mark.parametrize(
  "kind, dense",
  [
    ("longformer", dilated_window_np(T, S, 2, 2, 2) | global_np(T, S, 1)),
    (
      "bigbird",
      block_sparse_np(masks.bigbird_layout(4, 5, num_random_blocks=1, seed=0), 2, 2, T, S),
    ),
  ],
)
def test_sparse_patterns_equal_their_dense_formula(kind, dense):
  q, k, v, bias = _inputs(jnp.float32)
  out = jattn.dot_product_attention(
    q, k, v, bias, mask=MASKS[kind], implementation="blockwise", **BLOCKS
  )
  assert_close(out, attention_np(q, k, v, bias=bias, allowed=dense)[0])


# Finite differences for the masks that exercise distinct paths (empty rows, traced ids,
# per-batch arrays, functions, combinations, block layouts); test_matches_xla_for_every_mask
# checks every mask's gradients against the materialised custom_vjp, itself check_grads-tested.
@pytest.mark.parametrize(
  "kind",
  [
    "none",
    "causal_empty_rows",
    "segments",
    "lengths_empty_rows",
    "from_array",
    "from_fn",
    "combined",
    "bigbird",
  ],
)
def test_check_grads_float64(kind, x64):
  check_grads(_attn("blockwise", MASKS[kind]), _inputs(jnp.float64), order=1, modes=["rev"])


BIAS_SHAPES = [(B, N, T, S), (N, T, S), (1, 1, 1, S), (B, 1, T, 1), (T, S), (1, N, 1, 1)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
def test_bias_shapes_read_and_differentiated_tile_by_tile(shape):
  args = _inputs(jnp.float32, shape)
  mask = masks.causal(2)
  _assert_same(
    _value_and_grads(_attn("blockwise", mask), args),
    _value_and_grads(_attn("xla", mask), args),
    np.float32,
  )


@pytest.mark.parametrize("name", list(SCORE_FNS))
def test_score_fns(name):
  args = _inputs(jnp.float32)
  kw = dict(mask=masks.causal(1), score_fn=SCORE_FNS[name])
  _assert_same(
    _value_and_grads(_attn("blockwise", **kw), args),
    _value_and_grads(_attn("xla", **kw), args),
    np.float32,
  )


@pytest.mark.parametrize("name", list(SCORE_FNS))
def test_check_grads_float64_score_fns(name, x64):
  fn = SCORE_FNS[name]
  if isinstance(fn, jattn.ScoreFn):  # float64 parameters
    fn = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), fn)
  check_grads(
    _attn("blockwise", masks.causal(), score_fn=fn), _inputs(jnp.float64), order=1, modes=["rev"]
  )


def test_learned_score_parameters_get_tile_summed_gradients():
  """A relative-position table closed over under grad(jit) gets the materialised path's gradient."""
  q, k, v, bias = _inputs(jnp.float32)
  table = normal((16, N), jnp.float32, 9)

  def loss(implementation, table, q):
    fn = scores.relative_position_bias(table, num_buckets=16, max_distance=8)
    return jnp.sum(_attn(implementation, masks.causal(), score_fn=fn)(q, k, v, bias)[0] ** 2)

  for argnum in (0, 1):
    got = jax.jit(jax.grad(functools.partial(loss, "blockwise"), argnum))(table, q)
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnum))(table, q)
    assert_close(got, want, factor=5)


def test_soft_cap_and_dropout_match_xla():
  """Dropout is regenerated tile by tile from (rng, b, h, q, kv): the same mask as xla's."""
  args = _inputs(jnp.float32)
  kw = dict(
    mask=masks.sliding_window(3, 0),
    logits_soft_cap=2.0,
    dropout_rate=0.4,
    dropout_rng=jax.random.key(5),
  )
  _assert_same(
    _value_and_grads(_attn("blockwise", **kw), args),
    _value_and_grads(_attn("xla", **kw), args),
    np.float32,
  )


def test_check_grads_float64_dropout_and_soft_cap(x64):
  f = _attn(
    "blockwise",
    masks.causal(),
    dropout_rate=0.3,
    dropout_rng=jax.random.key(2),
    logits_soft_cap=3.0,
  )
  check_grads(f, _inputs(jnp.float64), order=1, modes=["rev"])


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_gqa_and_mqa(heads):
  n, kh = heads
  q = normal((B, T, n, H))
  k, v = normal((B, S, kh, H), seed=1), normal((B, S, kh, H), seed=2)
  f = lambda implementation: lambda q, k, v: _attn(implementation, masks.causal(1))(q, k, v, None)
  _assert_same(
    _value_and_grads(f("blockwise"), (q, k, v)), _value_and_grads(f("xla"), (q, k, v)), np.float32
  )


def test_bfloat16():
  args = _inputs(jnp.bfloat16)
  mask = masks.causal() & masks.segments(IDS_Q, IDS_KV)
  got = _value_and_grads(_attn("blockwise", mask), args)
  want = _value_and_grads(_attn("xla", mask), args)
  assert got[0][0].dtype == jnp.bfloat16
  _assert_same(got, want, jnp.bfloat16, factor=2)


@pytest.mark.parametrize("blocks", [(1, 1), (7, 2), (64, 64)], ids=str)
def test_tile_sizes(blocks):
  """Any tiles, including ones larger than T and S, give the same result."""
  args = _inputs(jnp.float32)
  mask = masks.causal() | masks.global_tokens(1)
  got = _value_and_grads(_attn("blockwise", mask, block_q=blocks[0], block_kv=blocks[1]), args)
  _assert_same(got, _value_and_grads(_attn("xla", mask), args), np.float32)


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
  bias = jnp.zeros((1, 1, T, S)).at[:, :, 2].set(-jnp.inf)
  out, lse = jattn.dot_product_attention(
    q, k, v, bias, return_residual=True, implementation="blockwise", **BLOCKS
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


@pytest.mark.parametrize(
  "name, mask",
  [
    ("causal", masks.causal()),
    ("window", masks.sliding_window(4, 0)),
    ("segments", masks.segments(np.array([[0] * 8 + [1] * 8 + [2] * 8]))),
    ("chunked_or_global", masks.chunked(8) | masks.global_tokens(1)),
    ("longformer", masks.longformer(2, num_global=2, dilation=3)),
    ("bigbird", masks.bigbird(24, block_size=3, num_random_blocks=1, seed=2)),
  ],
)
def test_empty_tiles_are_never_computed(name, mask):
  T_, bq, bk = 24, 4, 4
  dense = np.asarray(mask.materialize(T_, T_, batch_size=1, num_heads=2))
  classes = tile_classes_np(dense, bq, bk).max(axis=(0, 1))
  want = sorted(zip(*np.nonzero(classes)))
  assert _visited(mask, T_, T_, bq, bk) == [(int(i), int(j)) for i, j in want]


def test_causal_visits_about_half_the_tiles_and_a_window_grows_linearly():
  assert len(_visited(masks.causal(), 32, 32, 4, 4)) == 8 * 9 // 2
  for length in (32, 64):
    n = len(_visited(masks.sliding_window(3, 0), length, length, 4, 4))
    assert n == 2 * (length // 4) - 1  # the diagonal and the one tile left of it


def test_schedule_puts_full_tiles_first_and_skips_empty():
  view = np.array([[1, 0, 2, 2], [0, 0, 0, 0], [2, 1, 1, 0]], np.int8)
  sched = _tiling.schedule(view)
  np.testing.assert_array_equal(sched.num_full, [2, 0, 1])
  np.testing.assert_array_equal(sched.num_partial, [1, 0, 2])
  np.testing.assert_array_equal(sched.order[0, :3], [2, 3, 0])
  np.testing.assert_array_equal(sched.order[2, :3], [0, 1, 2])


def test_padded_edge_tiles_are_partial():
  view = _tiling.tile_classes(None, 1, 1, 7, 9, 3, 4)
  np.testing.assert_array_equal(view, [[2, 2, 1], [2, 2, 1], [1, 1, 1]])
  view = _tiling.tile_classes(masks.causal(), 1, 1, 8, 8, 4, 4)
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
