"""jattn.parallel: ring attention and sharded inputs, on 8 simulated CPU devices.

tests/conftest.py sets ``--xla_force_host_platform_device_count=8`` before JAX
starts. Every ring result is compared with the float64 NumPy formula (values
and lse) and with autodiff of it through jnp (gradients), in natural sequence
order, whatever layout the ring ran in.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import (
  array,
  assert_close,
  attention_jnp,
  attention_np,
  causal_np,
  lengths_np,
  normal,
  segments_np,
  window_np,
)

import jattn
from jattn import masks, parallel

pytestmark = pytest.mark.skipif(
  len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py simulates them)"
)


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


RING = _mesh((8,), ("sp",))
GRID = _mesh((2, 2, 2), ("dp", "sp", "tp"))  # batch x sequence x heads

B, T, N, K, H = 2, 32, 4, 2, 8  # shards of 4 rows on 8 devices; zig-zag chunks of 2


def _inputs(dtype=np.float64, T=T, S=T, seed=0):
  return (
    normal((B, T, N, H), dtype, seed),
    normal((B, S, K, H), dtype, seed + 1),
    normal((B, S, K, H), dtype, seed + 2),
  )


def _ring(q, k, v, *, layout, mesh=RING, **kwargs):
  """ring_attention on natural-order arrays: permute in, run, unpermute out."""
  size = mesh.shape["sp"]
  q, k, v = (parallel.permute(x, layout, size) for x in (q, k, v))
  out = parallel.ring_attention(q, k, v, mesh=mesh, axis_name="sp", layout=layout, **kwargs)
  if isinstance(out, tuple):
    return tuple(parallel.unpermute(x, layout, size) for x in out)
  return parallel.unpermute(out, layout, size)


def _run(attend, q, k, v):
  """Values and gradients of ``attend`` in one jitted program (eagerly, each would compile its
  forward twice and every operation). A cotangent on the lse as well as the output: both
  enter the backward rule."""
  w_out, w_lse = normal(q.shape, np.float64, 7), normal(q.shape[:3], np.float64, 8)

  def loss(q, k, v):
    o, l = attend(q, k, v)
    return jnp.sum(o * w_out) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0) * w_lse), (o, l)

  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def _reference(q, k, v, allowed, ref_kwargs=None):
  """The float64 formula's values and lse, and autodiff of it through jnp (gradients)."""
  want, want_lse = attention_np(q, k, v, allowed=allowed, **ref_kwargs or {})
  _, want_grads = _run(lambda *a: attention_jnp(*a, allowed=allowed, **ref_kwargs or {}), q, k, v)
  return want, want_lse, want_grads


def _check(q, k, v, allowed, *, layout, mesh=RING, ref_kwargs=None, reference=None, **kwargs):
  """Values, lse and gradients of the ring against the float64 formula (``reference``: what
  ``_reference`` gives for these arguments, computed once for several cases)."""
  want, want_lse, want_grads = reference or _reference(q, k, v, allowed, ref_kwargs)
  (out, lse), grads = _run(
    lambda *a: _ring(*a, layout=layout, mesh=mesh, return_residual=True, **kwargs), q, k, v
  )
  assert_close(out, want, np.float64)
  lse, want_lse = np.asarray(lse), np.asarray(want_lse)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))  # -inf: empty rows
  finite = np.isfinite(want_lse)
  assert_close(np.where(finite, lse, 0), np.where(finite, want_lse, 0), np.float64)
  for g, w in zip(grads, want_grads):
    assert_close(g, w, np.float64)


# Without a mask the layout only permutes rows, so one non-causal case is enough. The default run
# keeps the zig-zag layout of the causal ones; the others are exhaustive (the contiguous layout
# runs by default in test_ring_cross_attention_soft_cap_and_scale).
@pytest.mark.parametrize(
  "layout, is_causal",
  [
    pytest.param("contiguous", False, marks=pytest.mark.exhaustive),
    *(
      (layout, True)
      if layout == "zigzag"
      else pytest.param(layout, True, marks=pytest.mark.exhaustive)
      for layout in parallel.LAYOUTS
    ),
  ],
)
def test_ring_matches_formula(x64, layout, is_causal):
  # GQA (N=4 on K=2); tiles of 3 x 5 do not divide the 4-row shards.
  q, k, v = _inputs()
  allowed = causal_np(T, T) if is_causal else None
  reference = _causal_reference() if is_causal else None  # the layouts' one reference
  _check(
    q, k, v, allowed, layout=layout, is_causal=is_causal, block_q=3, block_kv=5, reference=reference
  )


@functools.cache
def _causal_reference():
  with jax.enable_x64(True):
    return _reference(*_inputs(), causal_np(T, T))


# Exhaustive: the default run moves segment ids around the ring elsewhere, in the same zig-zag
# layout, causal, each key/value shard's ids travelling with it (test_ring_reshards_inputs_in_
# any_placement[auto], against the one-device call; test_ring_float32_fully_masked_rows_are_
# zero_and_finite takes a pair of ids); this case repeats it against the float64 formula.
@pytest.mark.exhaustive
def test_ring_segment_ids_travel_with_their_shard(x64):
  # Packed documents of uneven lengths, causal within each, in the zig-zag layout: the
  # ids are permuted with the inputs and the key/value ids move around the ring.
  q, k, v = _inputs()
  ids = np.stack([np.repeat(np.arange(4), [5, 11, 9, 7]), np.repeat(np.arange(2), [20, 12])])
  permuted = parallel.permute(ids, "zigzag", 8)
  _check(
    q,
    k,
    v,
    segments_np(ids, ids) & causal_np(T, T),
    layout="zigzag",
    is_causal=True,
    segment_ids=permuted,
    block_q=2,
    block_kv=2,
  )


def test_ring_masks_and_lengths_with_batch_and_head_sharding(x64):
  # A (2, 2, 2) mesh: batch over "dp", sequence over "sp", heads over "tp". Per-batch
  # lengths and a per-head layout must be looked up with global batch and head indices.
  q, k, v = _inputs()
  layout = np.random.default_rng(0).random((N, T // 4, T // 4)) < 0.6
  mask = masks.sliding_window(9, 2) & masks.block_sparse(layout, 4)
  q_lens, kv_lens = np.array([32, 21]), np.array([0, 27])  # row 0 attends to nothing
  allowed = (
    window_np(T, T, 9, 2)[None, None]
    & np.asarray(masks.block_sparse(layout, 4).materialize(T, T))
    & lengths_np(T, T, q_lens, kv_lens)
  )
  _check(
    q,
    k,
    v,
    allowed,
    layout="striped",
    mesh=GRID,
    mask=mask,
    query_seq_lengths=q_lens,
    key_value_seq_lengths=kv_lens,
    batch_axis="dp",
    head_axis="tp",
    block_q=4,
    block_kv=4,
  )


def test_ring_cross_attention_soft_cap_and_scale(x64):
  # S != T, a local window (in global positions) and logit soft-capping.
  q, k, v = _inputs(S=16)
  cap, scale = 2.0, 0.7

  def score(s, *idx):
    tanh = np.tanh if isinstance(s, np.ndarray) else jnp.tanh
    return cap * tanh(s / cap)

  _check(
    q,
    k,
    v,
    window_np(T, 16, 3, 3),
    layout="contiguous",
    local_window_size=3,
    logits_soft_cap=cap,
    scale=scale,
    ref_kwargs=dict(score=score, scale=scale),
  )


def _learned_scores(table, slopes):
  """A relative-position table (closed over) and ALiBi slopes (a pytree leaf): both learned."""
  rel = lambda q, kv: jnp.clip(q - kv, -3, 3) + 3
  return jattn.scores.compose(
    lambda s, b, h, q, kv: s + table[h, rel(q, kv)], jattn.scores.alibi(slopes)
  )


# Exhaustive (6 CPU-seconds), for the README command's time bound: the default run checks the
# ring's bias and learned ALiBi slopes against the one-device call, with every other argument
# (test_context_parallel.py); this adds a table the score function closes over, in float64.
@pytest.mark.exhaustive
def test_ring_bias_and_learned_score_function_match_the_formula(x64):
  """A bias broadcast over the batch, split by query rows with every key column on each
  device, and a score function whose arrays (a table it closes over, ALiBi slopes) are the
  ring's custom_vjp inputs: values, lse and the gradients of all five match the float64
  formula and its autodiff, under zig-zag with the heads sharded too."""
  q, k, v = _inputs(T=16, S=16)
  rng = np.random.default_rng(3)
  bias = rng.normal(size=(1, N, 16, 16))
  table, slopes = rng.normal(size=(N, 7)), np.linspace(0.1, 0.4, N)
  mesh = _mesh((4, 2), ("sp", "tp"))
  perm = lambda x, axis=1: parallel.permute(x, "zigzag", 4, axis=axis)
  weights = np.cos(np.arange(B * 16 * N * H)).reshape(B, 16, N, H)

  def ring(q, k, v, bias, table, slopes):
    out, lse = parallel.ring_attention(
      *(perm(x) for x in (q, k, v)),
      mesh=mesh,
      axis_name="sp",
      head_axis="tp",
      layout="zigzag",
      bias=perm(perm(bias, 2), 3),
      is_causal=True,
      score_fn=_learned_scores(table, slopes),
      return_residual=True,
      block_q=2,
      block_kv=2,
    )
    out, lse = (parallel.unpermute(x, "zigzag", 4) for x in (out, lse))
    return jnp.sum(out * weights) + jnp.sum(jnp.sin(lse)), (out, lse)

  def formula(q, k, v, bias, table, slopes):
    score = lambda s, b, h, q, kv: _learned_scores(table, slopes)(s, b, h, q, kv)
    out, lse = attention_jnp(q, k, v, bias, allowed=causal_np(16, 16), score=score)
    return jnp.sum(out * weights) + jnp.sum(jnp.sin(lse)), (out, lse)

  args = (q, k, v, bias, table, slopes)
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(ring, range(6), has_aux=True))(*args)
  want_out, want_lse = attention_np(
    q, k, v, bias=bias, allowed=causal_np(16, 16), score=_learned_scores(table, slopes)
  )
  assert_close(out, want_out, np.float64)
  assert_close(lse, want_lse, np.float64)
  want = jax.grad(lambda *a: formula(*a)[0], range(6))(*args)
  for name, g, w in zip(("dq", "dk", "dv", "dbias", "dtable", "dslopes"), grads, want):
    assert np.abs(w).max() > 0, name
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9, err_msg=name)


# Exhaustive: finite differences repeat, at the cost of three ring programs (the call, its
# forward pass with residuals and its backward pass), what the default run checks more tightly:
# test_ring_matches_formula (causal, zig-zag, GQA), test_ring_masks_and_lengths_with_batch_and_
# head_sharding and test_ring_cross_attention_soft_cap_and_scale hold the ring's float64
# gradients to autodiff of the formula.
@pytest.mark.exhaustive
def test_ring_check_grads(x64):
  q, k, v = _inputs(T=16, S=16)
  mesh = _mesh((4,), ("sp",))
  rng = np.random.default_rng(4)
  bias, table, slopes = rng.normal(size=(B, 1, 16, 16)), rng.normal(size=(N, 7)), np.ones(N)
  f = jax.jit(
    lambda q, k, v, bias, table, slopes: parallel.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      bias=bias,
      score_fn=_learned_scores(table, 0.1 * slopes),
      is_causal=True,
      layout="zigzag",
      block_q=1,
      block_kv=2,
    )
  )
  jax.test_util.check_grads(f, (q, k, v, bias, table, slopes), order=1, modes=["rev"])


def test_ring_float32_fully_masked_rows_are_zero_and_finite():
  q, k, v = _inputs(np.float32)
  ids = np.stack([np.repeat([0, 1], 16), np.repeat([0, 1], 16)])
  kv_ids = np.where(ids == 1, 2, ids)  # queries of segment 1 find no key
  f = functools.partial(
    parallel.ring_attention,
    mesh=RING,
    axis_name="sp",
    segment_ids=(ids, kv_ids),
    block_q=2,
    block_kv=2,
  )
  out = f(q, k, v)  # called eagerly here; under jit in the other tests
  want, _ = attention_np(q, k, v, allowed=segments_np(ids, kv_ids))
  assert_close(out, want, np.float32)
  np.testing.assert_array_equal(np.asarray(out)[:, 16:], 0)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v)
  assert all(np.isfinite(g).all() for g in grads)
  np.testing.assert_array_equal(np.asarray(grads[0])[:, 16:], 0)


def test_ring_bfloat16_and_inputs_stay_sharded():
  rounded = [np.asarray(x).astype(jnp.bfloat16) for x in _inputs(np.float32)]  # NumPy: no program
  sharding = NamedSharding(RING, P(None, "sp", None, None))
  q, k, v = (jax.device_put(x, sharding) for x in rounded)

  def loss(q, k, v):
    out = parallel.ring_attention(q, k, v, mesh=RING, axis_name="sp", is_causal=True)
    return jnp.sum(out.astype(jnp.float32)), out

  # The output and the gradients from one training step, compiled once, inspected and run (a
  # forward program of its own would compile the ring's forward pass again).
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  step = step.lower(q, k, v).compile()
  # The step is a ring, forward and backward: K/V move by collective permutes and nothing is
  # gathered.
  hlo = step.as_text()
  assert "collective-permute" in hlo
  assert not re.search(r"all-gather|all-to-all", hlo)
  (_, out), grads = step(q, k, v)
  assert out.dtype == jnp.bfloat16 and out.sharding.is_equivalent_to(sharding, 4)
  want, _ = attention_np(*(x.astype(np.float32) for x in rounded), allowed=causal_np(T, T))
  assert_close(out, want, jnp.bfloat16)
  assert all(g.sharding.is_equivalent_to(sharding, 4) for g in grads)


def test_layout_positions_and_permutations():
  np.testing.assert_array_equal(parallel.positions("contiguous", 6, 3), np.arange(6))
  np.testing.assert_array_equal(parallel.positions("zigzag", 8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(parallel.positions("striped", 6, 3), [0, 3, 1, 4, 2, 5])
  x = np.arange(2 * 24).reshape(2, 24)
  for layout in parallel.LAYOUTS:
    y = parallel.permute(x, layout, 4)
    np.testing.assert_array_equal(y, x[:, parallel.positions(layout, 24, 4)])
    np.testing.assert_array_equal(parallel.unpermute(y, layout, 4), x)
    np.testing.assert_array_equal(parallel.unpermute(array(y), layout, 4), x)
  # Zig-zag and striped even out causal work: every shard holds positions summing alike.
  for layout in ("zigzag", "striped"):
    sums = parallel.positions(layout, 64, 8).reshape(8, 8).sum(axis=1)
    assert sums.max() - sums.min() <= (0 if layout == "zigzag" else 56)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_permutations_keep_a_sequence_sharded_over_explicit_axes(layout):
  """permute and unpermute take an array whose sequence is sharded over Explicit mesh axes
  (context_parallel_attention's output is one): the rows move between devices and the
  result keeps the input's sharding; gradients flow back through the gather."""
  mesh = jax.make_mesh((4,), ("sp",), (jax.sharding.AxisType.Explicit,))
  q, k, v = _inputs(np.float32)
  want = attention_np(q, k, v, allowed=causal_np(T, T))[0]
  seq = P(None, "sp", None, None)
  with jax.set_mesh(mesh):
    q, k, v = (jax.device_put(parallel.permute(x, layout, 4), seq) for x in (q, k, v))
    assert q.sharding.spec == seq
    step = jax.jit(
      lambda q, k, v: parallel.unpermute(
        parallel.context_parallel_attention(
          q, k, v, mesh=mesh, axis_name="sp", layout=layout, is_causal=True
        ),
        layout,
        4,
      )
    )
    out = step(q, k, v)
    assert out.sharding.spec == seq
    assert_close(out, want, np.float32)
    natural = parallel.unpermute(q, layout, 4)
    assert natural.sharding.spec == seq
    np.testing.assert_array_equal(parallel.permute(natural, layout, 4), q)
    grad = jax.grad(
      lambda x: jnp.sum(parallel.unpermute(x, layout, 4) * jnp.arange(T)[None, :, None, None])
    )
    g = grad(q)
    expect = np.broadcast_to(parallel.positions(layout, T, 4)[:, None, None], q.shape[1:])
    np.testing.assert_array_equal(g[0], expect)


@pytest.mark.parametrize(
  "call, error, match",
  [
    (
      lambda q, k, v: parallel.ring_attention(q, k, v, mesh=RING, axis_name="seq"),
      ValueError,
      r"axis_name='seq': unknown mesh axis 'seq'; the mesh has axes \('sp',\)",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q[:, :12], k[:, :12], v[:, :12], mesh=RING, axis_name="sp"
      ),
      ValueError,
      "query length T must be divisible by the number of shards: 12 does not split into 8 devices",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q[:, :24], k[:, :24], v[:, :24], mesh=RING, axis_name="sp", layout="zigzag"
      ),
      ValueError,
      "24 does not split into 2 x 8 zig-zag chunks",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q, k[:, :20], v[:, :20], mesh=RING, axis_name="sp"),
      ValueError,
      "key/value length S must be divisible",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q, k, v, mesh=RING, axis_name="sp", layout="spiral"),
      ValueError,
      "layout must be one of",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q, k, v, mesh=GRID, axis_name="sp", batch_axis="sp"),
      ValueError,
      "must name different mesh axes",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q[:1], k[:1], v[:1], mesh=GRID, axis_name="sp", batch_axis="dp"
      ),
      ValueError,
      r"batch size B \(1\) must be divisible by the 2 devices of mesh axes \('dp',\)",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k[:, :, :1], v[:, :, :1], mesh=GRID, axis_name="sp", head_axis="tp"
      ),
      ValueError,
      r"number of key/value heads K \(1\) must be divisible",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q, k, v, mesh="mesh", axis_name="sp"),
      TypeError,
      "mesh must be a jax.sharding.Mesh, got str",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k, v, mesh=RING, axis_name="sp", bias=np.ones((1, 1, T, T + 1))
      ),
      ValueError,
      r"bias must be broadcastable to \(B, N, T, S\)",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k, v, mesh=RING, axis_name="sp", implementation="splash", dropout_rate=0.1
      ),
      ValueError,
      r"dropout_rate=0.1 needs dropout_rng",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k, v, mesh=RING, axis_name="sp", implementation="splash", bias=np.ones((T, T))
      ),
      ValueError,
      r"ring_attention\(implementation='splash'\) does not support a bias",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q[0], k[0], v[0], mesh=RING, axis_name="sp"),
      ValueError,
      r"needs batched inputs: query \(B, T, N, H\)",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k.astype(jnp.float16), v, mesh=RING, axis_name="sp"
      ),
      TypeError,
      "query, key and value must have the same dtype",
    ),
    (
      lambda q, k, v: parallel.ring_attention(
        q, k, v, mesh=RING, axis_name="sp", segment_ids=np.zeros((B, 8), np.int32)
      ),
      ValueError,
      "segment_ids",
    ),
    (
      lambda q, k, v: parallel.ring_attention(q, k, v, mesh=RING, axis_name="sp", block_q=0),
      ValueError,
      "block_q must be >= 1",
    ),
    (
      lambda q, k, v: parallel.permute(q, "zigzag", 3),
      ValueError,
      "length must be divisible by the number of shards: 32 does not split into "
      "2 x 3 zig-zag chunks",
    ),
    (
      lambda q, k, v: parallel.permute(q, "zigzag", 2, axis=4),
      ValueError,
      "axis 4 is out of range",
    ),
  ],
)
def test_errors(call, error, match):
  q, k, v = _inputs(np.float32)
  with pytest.raises(error, match=match):
    call(q, k, v)


# --- jattn.dot_product_attention on batch- and head-sharded inputs ----------------

COLLECTIVE = r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"


# blockwise's case is exhaustive: test_sharding_explicit keeps blockwise's batch and head
# sharding on a mesh by default, and its tiles run per device as xla's program does here.
@pytest.mark.parametrize(
  "implementation", ["xla", pytest.param("blockwise", marks=pytest.mark.exhaustive)]
)
def test_dot_product_attention_on_batch_and_head_sharded_inputs(implementation):
  # Batch over 4 devices, heads over 2: attention is independent per (batch, head), so the
  # compiled program must move no activations between devices, forward or backward.
  mesh = _mesh((4, 2), ("data", "model"))
  sharding = NamedSharding(mesh, P("data", None, "model", None))
  q, k, v = (normal((4, 24, N, H), np.float32, s) for s in range(3))
  ids = np.sort(np.random.default_rng(0).integers(0, 3, (4, 24)), axis=1)
  q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
  ids = jax.device_put(ids, NamedSharding(mesh, P("data", None)))
  blocks = dict(block_q=8, block_kv=8) if implementation == "blockwise" else {}

  def attend(q, k, v, ids):
    return jattn.dot_product_attention(
      q, k, v, segment_ids=ids, is_causal=True, implementation=implementation, **blocks
    )

  def loss(q, k, v, ids):
    return jnp.sum(attend(q, k, v, ids) ** 2)

  # Compiled once each, inspected and run.
  fwd, step = (
    jax.jit(fn).lower(q, k, v, ids).compile() for fn in (attend, jax.grad(loss, argnums=(0, 1, 2)))
  )
  for fn in (fwd, step):
    hlo = fn.as_text()
    for line in hlo.splitlines():
      if re.search(COLLECTIVE + r"\(", line):
        # Blockwise agrees on one tile schedule for the whole batch: an all-reduce of the
        # (tiles x tiles) int8 tile classes. Nothing else may cross devices.
        assert implementation == "blockwise" and re.search(r"= s8\[3,3\]\S* all-reduce", line), line
  out = fwd(q, k, v, ids)
  assert out.sharding.is_equivalent_to(sharding, 4)
  want, _ = attention_np(q, k, v, allowed=segments_np(ids, ids) & causal_np(24, 24))
  assert_close(out, want, np.float32)
  assert all(g.sharding.is_equivalent_to(sharding, 4) for g in step(q, k, v, ids))


# --- ring attention with splash per shard pair ---------------------------------------


# Exhaustive: the interpreted kernels' forward and backward compile for half a minute. The
# default run lowers the ring's splash pairs for a TPU (below) and refuses what they cannot do.
@pytest.mark.exhaustive
def test_ring_runs_splash_per_shard_pair():
  # Two devices, zig-zag, causal packed documents, MQA: every pair's mask is tabulated and
  # runs splash (interpreted); values, lse and gradients as the unsharded xla path. One batch
  # row: the program's compilation grows with the batch (splash runs per row, vmapped, and
  # test_splash.py and test_sharded_kernels.py check that on several rows).
  mesh = _mesh((2,), ("sp",))
  rng = np.random.default_rng(0)
  q = array(rng.normal(size=(1, 256, 2, 64)), jnp.float32)
  k, v = (array(rng.normal(size=(1, 256, 1, 64)), jnp.float32) for _ in range(2))
  ids = array([[0] * 100 + [1] * 156], jnp.int32)
  w = array(rng.normal(size=(1, 256, 2, 64)), jnp.float32)

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

  def ring(q, k, v):
    perm = lambda x: parallel.permute(x, "zigzag", 2)
    out, lse = parallel.ring_attention(
      *map(perm, (q, k, v)),
      mesh=mesh,
      axis_name="sp",
      is_causal=True,
      segment_ids=perm(ids),
      layout="zigzag",
      implementation="splash",
      return_residual=True,
    )
    return parallel.unpermute(out, "zigzag", 2), parallel.unpermute(lse, "zigzag", 2)

  def plain(q, k, v):
    return jattn.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, implementation="xla", return_residual=True
    )

  grad = lambda f: jax.jit(jax.value_and_grad(lambda *a: loss(f, *a), (0, 1, 2), has_aux=True))
  (_, want), want_grads = grad(plain)(q, k, v)
  with jattn.testing.interpret_kernels():
    (_, got), got_grads = grad(ring)(q, k, v)
  for a, b in zip((*got, *got_grads), (*want, *want_grads)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_ring_lowers_splash_for_tpu_and_refuses_what_it_cannot():
  mesh = _mesh((4,), ("sp",))
  q = jnp.zeros((1, 512, 2, 128), jnp.bfloat16)

  def ring(q, **kw):
    return parallel.ring_attention(q, q, q, mesh=mesh, axis_name="sp", is_causal=True, **kw)

  with jattn.testing.lowering_for("tpu"):  # None picks splash there: causal pairs
    text = jax.jit(ring).trace(q).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text
  assert "tpu_custom_call" not in jax.jit(ring).trace(q).lower().as_text()  # CPU: blockwise
  with pytest.raises(ValueError, match="needs a TPU"):
    ring(q, implementation="splash")
  with pytest.raises(ValueError, match="does not support lengths"):
    ring(q, implementation="splash", query_seq_lengths=array([3]))
  with pytest.raises(ValueError, match="implementation must be one of"):
    ring(q, implementation="xla")
  # A soft cap: splash's pairs cannot give its log-sum-exp's gradient, so None lowers
  # blockwise pairs for the TPU (the soft-cap tests below check their values).
  with jattn.testing.lowering_for("tpu"):
    capped = functools.partial(ring, logits_soft_cap=2.0)
    text = jax.jit(capped).trace(q).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" not in text


# --- a soft cap through the shard pairs ----------------------------------------------

CAP = 2.0


def _cap_score(s, *idx):
  tanh = np.tanh if isinstance(s, np.ndarray) else jnp.tanh
  return CAP * tanh(s / CAP)


@functools.cache
def _soft_cap_reference():
  """The float64 formula (values, lse, gradients) on the float32 inputs, causal, soft cap."""
  with jax.enable_x64(True):
    inputs = (np.asarray(x, np.float64) for x in _inputs(np.float32))
    return _reference(*inputs, causal_np(T, T), dict(score=_cap_score))


# Exhaustive: test_adversarial_paths.py's test_soft_cap_through_every_ring_pair_kernel
# [default_on_tpu-zigzag] runs the same path by default (implementation=None traced for a TPU,
# kernels interpreted, a soft cap: exact pairs), its values, lse and gradients against the
# one-device call; these cases repeat it in each layout against the float64 formula.
@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_ring_soft_cap_on_tpu_runs_exact_pairs(layout):
  # implementation=None as on a TPU, Pallas kernels interpreted: splash would run every pair
  # if it expressed the call, and the pairs' log-sum-exp gradient through the cap is beyond
  # it (the one-device call refuses splash with a soft cap and return_residual). The ring's
  # values, lse and gradients must be the formula's, in every layout.
  q, k, v = _inputs(np.float32)
  want, want_lse, want_grads = _soft_cap_reference()
  with jattn.testing.lowering_for("tpu"), jattn.testing.interpret_kernels():
    (out, lse), grads = _run(
      lambda *a: _ring(
        *a, layout=layout, is_causal=True, logits_soft_cap=CAP, return_residual=True
      ),
      q,
      k,
      v,
    )
  assert_close(out, want, np.float32)
  assert_close(lse, want_lse, np.float32)
  for g, w in zip(grads, want_grads):
    assert_close(g, w, np.float32)


def test_ring_splash_refuses_a_soft_cap_as_the_one_device_call_does():
  q, k, v = _inputs(np.float32)
  with jattn.testing.interpret_kernels():
    with pytest.raises(ValueError, match="implementation='splash' does not support") as one:
      jattn.dot_product_attention(
        q, k, v, logits_soft_cap=CAP, return_residual=True, implementation="splash"
      )
    reason = str(one.value).split("does not support ", 1)[1]
    for layout in parallel.LAYOUTS:
      for return_residual in (False, True):  # the pairs return their lse either way
        with pytest.raises(ValueError) as ring:
          parallel.ring_attention(  # refused before anything runs: no need to permute
            q,
            k,
            v,
            mesh=RING,
            axis_name="sp",
            layout=layout,
            is_causal=True,
            logits_soft_cap=CAP,
            return_residual=return_residual,
            implementation="splash",
          )
        message = str(ring.value)
        assert message.startswith(
          "ring_attention(implementation='splash') does not support logits_soft_cap"
        ), message
        assert reason in message


# --- inputs in any placement, in both sharding modes ------------------------------------


# The default run keeps Auto mode (test_adversarial_paths.py draws placements in Explicit mode
# by default); Explicit is exhaustive here.
@pytest.mark.parametrize("mode", ["auto", pytest.param("explicit", marks=pytest.mark.exhaustive)])
def test_ring_reshards_inputs_in_any_placement(mode):
  # A 4 x 2 mesh, the ring over "sp" and the heads over "tp". No input is in the ring's
  # layout P(None, "sp", "tp", None): the query is NumPy, the key's sequence is split over
  # the wrong axis, the value's batch over the ring axis, the segment ids are NumPy (as in
  # docs/parallel.md), the lengths (a mask's array) are split over "tp" and the sinks over
  # "sp". The ring reshards them all; values and gradients are the one-device call's.
  kind = jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("sp", "tp"), (kind, kind), devices=jax.devices()[:8])
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  Bp, Tp, Np = 4, 16, 4
  q = np.asarray(normal((Bp, Tp, Np, H), np.float32, 0))
  k, v = (np.asarray(normal((Bp, Tp, 2, H), np.float32, s)) for s in (1, 2))
  ids = np.repeat([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 2, 2]], 4, axis=1)
  lens = np.array([16, 11, 5, 0], np.int32)  # the last row attends to nothing
  sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
  w = np.asarray(normal((Bp, Tp, Np, H), np.float32, 3))

  def loss(attend, q, k, v, sinks, ids, lens):
    out = attend(q, k, v, sinks, ids, lens)
    return jnp.sum(out * w), out

  def ring(q, k, v, sinks, ids, lens):
    return parallel.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      head_axis="tp",
      layout="zigzag",
      is_causal=True,
      segment_ids=ids,
      query_seq_lengths=lens,
      sinks=sinks,
      block_q=2,
      block_kv=2,
    )

  def one_device(q, k, v, sinks, ids, lens):
    # The inputs and ids are in the zig-zag layout; lengths count natural positions.
    return parallel.permute(
      jattn.dot_product_attention(
        *(parallel.unpermute(x, "zigzag", 4) for x in (q, k, v)),
        is_causal=True,
        segment_ids=parallel.unpermute(ids, "zigzag", 4),
        query_seq_lengths=lens,
        sinks=sinks,
        implementation="xla",
      ),
      "zigzag",
      4,
    )

  step = lambda f: jax.jit(jax.value_and_grad(functools.partial(loss, f), (0, 1, 2, 3), True))
  (_, want), want_grads = step(one_device)(q, k, v, sinks, ids, lens)
  placed = (q, put(k, None, "tp"), put(v, "sp"), put(sinks, "sp"), ids, put(lens, "tp"))
  with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
    (_, out), grads = step(ring)(*placed)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "sp", "tp")), 4)
  assert_close(out, want, np.float32)
  for g, w_g in zip(grads, want_grads, strict=True):
    assert_close(g, w_g, np.float32)
