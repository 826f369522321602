"""Explicit sharding (sharding in types) on 8 simulated CPU devices: batch over "data" (4),
heads over "model" (2), under ``jax.set_mesh`` with Explicit axes.

Each case is compiled once; its outputs and gradients are compared with the float64 NumPy
formula (tests/reference.py) or with the same call on unsharded inputs, their shardings
with the inputs', and the compiled program is searched for collectives: none may move
activations between devices.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import assert_close, attention_jnp, attention_np, causal_np, normal, segments_np

import jattn
import jattn.linen
import jattn.nnx
from jattn import decode

pytestmark = pytest.mark.skipif(
  len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py simulates them)"
)

B, T, N, K, H, F = 4, 24, 4, 2, 8, 16
BLOCKS = dict(block_q=8, block_kv=8)
COLLECTIVE = r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\("


def _mesh():
  devices = jax.devices()[:8]
  return jax.make_mesh((4, 2), ("data", "model"), (AxisType.Explicit,) * 2, devices=devices)


def _collectives(compiled) -> list[str]:
  return [line.strip() for line in compiled.as_text().splitlines() if re.search(COLLECTIVE, line)]


def _put(mesh, spec, *xs):
  return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def _spec(x):
  return tuple(jax.typeof(x).sharding.spec)


def _close(actual, expected, **kwargs):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert_close(a, e, np.float32, **kwargs)


# --- jattn.dot_product_attention ------------------------------------------------------


# The default run keeps each kind of rows with one implementation; the other two are exhaustive.
@pytest.mark.parametrize(
  "rows, implementation",
  [
    ("segment_ids", "blockwise"),
    pytest.param("segment_ids", "xla", marks=pytest.mark.exhaustive),
    pytest.param("lengths", "blockwise", marks=pytest.mark.exhaustive),
    ("lengths", "xla"),
  ],
)
def test_attention_keeps_batch_and_head_sharding(implementation, rows):
  # Causal attention with per-row segment ids (B, T) or lengths (B,) sharded over "data";
  # GQA: N=4 query heads, K=2 key/value heads, both sharded over "model".
  q, k, v, w = (normal(shape, np.float32, s) for s, shape in enumerate([(B, T, N, H)] * 4))
  k, v = k[:, :, :K], v[:, :, :K]
  ids = np.sort(np.random.default_rng(0).integers(0, 3, (B, T)), axis=1)
  lengths = np.array([24, 17, 9, 1])
  if rows == "segment_ids":
    allowed = segments_np(ids, ids) & causal_np(T, T)
  else:
    valid = np.arange(T)[None, :] < lengths[:, None]
    allowed = (valid[:, None, :, None] & valid[:, None, None, :]) & causal_np(T, T)
  options = dict(is_causal=True, implementation=implementation)
  if implementation == "blockwise":
    options.update(BLOCKS)

  def loss(q, k, v, w, row_info):
    kwargs = (
      dict(segment_ids=row_info)
      if rows == "segment_ids"
      else dict(query_seq_lengths=row_info, key_value_seq_lengths=row_info)
    )
    out = jattn.dot_product_attention(q, k, v, **kwargs, **options)
    return jnp.sum(out * w), out

  # Ground truth: the float64 formula, and autodiff of it in jnp on one device.
  want, _ = attention_np(q, k, v, allowed=allowed)
  ref = lambda q, k, v: jnp.sum(attention_jnp(q, k, v, allowed=allowed)[0] * w)
  want_grads = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)  # one program, not one per op

  mesh = _mesh()
  heads = P("data", None, "model", None)
  with jax.set_mesh(mesh):
    q, k, v, w = _put(mesh, heads, q, k, v, w)
    row_info = ids if rows == "segment_ids" else lengths
    (row_info,) = _put(mesh, P("data", *(None,) * (row_info.ndim - 1)), row_info)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    compiled = step.lower(q, k, v, w, row_info).compile()
    grads, out = compiled(q, k, v, w, row_info)

  assert_close(out, want, np.float32)
  _close(grads, want_grads)
  assert _spec(out) == tuple(heads)
  assert all(_spec(g) == tuple(heads) for g in grads)
  for line in _collectives(compiled):
    # Blockwise agrees on one tile schedule for the whole batch: an all-reduce of the
    # (3 x 3) int8 tile classes (a min and a max over the rows). Nothing else crosses.
    assert implementation == "blockwise" and re.search(r"= s8\[3,3\]\S* all-reduce", line), line


# --- jattn.decode ---------------------------------------------------------------------


# Blockwise reads the cache tile by tile (float or quantized), xla reads a zeroed copy. The
# default run keeps the float caches; the quantized one is exhaustive (test_paged reads int8
# caches, unsharded, by default).
@pytest.mark.parametrize(
  "implementation, dtype",
  [
    (None, jnp.float32),
    pytest.param(None, jnp.int8, marks=pytest.mark.exhaustive),
    ("xla", jnp.float32),
  ],
)
def test_decode_cache_takes_the_sharding_of_its_keys(implementation, dtype):
  q, k, v = (
    normal(shape, np.float32, s) for s, shape in enumerate([(B, 5, N, H)] + [(B, 5, K, H)] * 2)
  )

  def run(q, k, v):
    # A prefill of 4 tokens, then one decode step.
    cache = decode.init(B, 16, K, H, dtype=dtype)
    first, cache = decode.attention(
      q[:, :4], k[:, :4], v[:, :4], cache, implementation=implementation
    )
    step, cache = decode.attention(
      q[:, 4:], k[:, 4:], v[:, 4:], cache, implementation=implementation
    )
    return first, step, cache

  want = jax.jit(run)(q, k, v)
  mesh = _mesh()
  heads = P("data", None, "model", None)
  with jax.set_mesh(mesh):
    q, k, v = _put(mesh, heads, q, k, v)
    compiled = jax.jit(run).lower(q, k, v).compile()
    first, step, cache = compiled(q, k, v)

  assert not _collectives(compiled)
  _close((first, step), want[:2])
  np.testing.assert_array_equal(cache.key, want[2].key)
  np.testing.assert_array_equal(cache.lengths, want[2].lengths)
  assert _spec(first) == _spec(step) == _spec(cache.key) == _spec(cache.value) == tuple(heads)
  if dtype == jnp.int8:
    assert _spec(cache.key_scale) == ("data", None, "model")


def test_paged_cache_shards_heads_and_gathers_only_the_new_tokens():
  # A paged cache's pool is shared by every row: the new tokens are gathered over "data" to
  # be written into it (the only collectives), and its heads take the keys' "model" sharding.
  q, k, v = (
    normal(shape, np.float32, s) for s, shape in enumerate([(B, 5, N, H)] + [(B, 5, K, H)] * 2)
  )

  def run(q, k, v):
    cache = decode.init_paged(16, 4, B, 4, K, H)
    first, cache = decode.attention(q[:, :4], k[:, :4], v[:, :4], cache)
    step, cache = decode.attention(q[:, 4:], k[:, 4:], v[:, 4:], cache)
    return first, step, cache

  want = jax.jit(run)(q, k, v)
  mesh = _mesh()
  heads = P("data", None, "model", None)
  with jax.set_mesh(mesh):
    q, k, v = _put(mesh, heads, q, k, v)
    compiled = jax.jit(run).lower(q, k, v).compile()
    first, step, cache = compiled(q, k, v)

  assert all(
    re.search(r"= f32\[4,[41],1,8\]\S* all-gather", line) for line in _collectives(compiled)
  )
  _close((first, step), want[:2])
  np.testing.assert_array_equal(cache.key_pages, want[2].key_pages)
  assert _spec(first) == _spec(step) == tuple(heads)
  assert _spec(cache.key_pages) == (None, None, "model", None)


# --- Flax modules ---------------------------------------------------------------------


def _module_grads(loss, params, x, w):
  """(grads, out) of ``loss(params, x, w) -> (scalar, out)``: unsharded, then with x and w
  sharded over "data" under an Explicit mesh."""
  step = jax.jit(jax.grad(loss, has_aux=True))
  want = step(params, x, w)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    x, w = _put(mesh, P("data", None, None), x, w)
    got = step(params, x, w)
  return got, want


def test_nnx_module_forward_and_gradients():
  model = jattn.nnx.MultiHeadAttention(
    N, F, num_kv_heads=K, is_causal=True, implementation="blockwise", **BLOCKS, rngs=nnx.Rngs(0)
  )
  graphdef, params = nnx.split(model)

  def loss(params, x, w):
    out = nnx.merge(graphdef, params)(x)
    return jnp.sum(out * w), out

  x, w = normal((B, T, F), np.float32, 0), normal((B, T, F), np.float32, 1)
  (grads, out), want = _module_grads(loss, params, x, w)
  _close((grads, out), want)
  assert _spec(out) == ("data", None, None)


# Exhaustive: the Linen module's sharded step compiles what the NNX module's above does (both
# share jattn.flax's attention); the default run keeps the NNX one.
@pytest.mark.exhaustive
def test_linen_module_forward_and_gradients():
  model = jattn.linen.MultiHeadAttention(
    N, num_kv_heads=K, is_causal=True, implementation="blockwise", **BLOCKS
  )
  x, w = normal((B, T, F), np.float32, 0), normal((B, T, F), np.float32, 1)
  params = model.init(jax.random.key(0), x)["params"]

  def loss(params, x, w):
    out = model.apply({"params": params}, x)
    return jnp.sum(out * w), out

  (grads, out), want = _module_grads(loss, params, x, w)
  _close((grads, out), want)
  assert _spec(out) == ("data", None, None)


def test_nnx_out_and_qkv_sharding():
  # As in Flax's nnx.MultiHeadAttention: qkv_sharding is the q/k/v projections'
  # out_sharding, out_sharding the output projection's. Heads sharded over "model" here.
  model = jattn.nnx.MultiHeadAttention(
    N, F, num_kv_heads=K, implementation="blockwise", **BLOCKS, rngs=nnx.Rngs(0)
  )
  x = normal((B, T, F), np.float32, 0)
  want = model(x)
  seen = {}

  def attend(*args, **kwargs):
    seen["q"] = _spec(args[0])
    return jattn.dot_product_attention(*args, **kwargs)

  mesh = _mesh()
  with jax.set_mesh(mesh):
    (x,) = _put(mesh, P("data", None, None), x)
    call = lambda model, x: model(
      x, qkv_sharding=P("data", None, "model", None), out_sharding=P("data", None, "model")
    )
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(jattn.attention, "dot_product_attention", attend)
      out = nnx.jit(call)(model, x)
  assert seen["q"] == ("data", None, "model", None)
  assert _spec(out) == ("data", None, "model")
  assert_close(out, want, np.float32)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(qkv_sharding="model"), TypeError, "qkv_sharding must be None, a jax.sharding"),
    (dict(out_sharding=P(None, None, None, None)), ValueError, r"out_sharding .* 3 entries"),
    (dict(qkv_sharding=P(None, None, None, None, None)), ValueError, r"\(B, T, N, H\)"),
  ],
)
def test_nnx_sharding_arguments_are_checked(kwargs, error, match):
  model = jattn.nnx.MultiHeadAttention(N, F, rngs=nnx.Rngs(0))
  with pytest.raises(error, match=match):
    model(jnp.ones((B, T, F)), **kwargs)


def test_nnx_decode_cache_takes_the_sharding_of_its_keys():
  model = jattn.nnx.MultiHeadAttention(N, F, num_kv_heads=K, rngs=nnx.Rngs(0))
  x = normal((B, 5, F), np.float32, 0)
  step = nnx.jit(lambda model, x: model(x, decode=True))
  model.init_cache(B, 16)
  want = (step(model, x[:, :4]), step(model, x[:, 4:]))
  mesh = _mesh()
  with jax.set_mesh(mesh):
    (x,) = _put(mesh, P("data", None, None), x)
    model.init_cache(B, 16)
    got = (step(model, x[:, :4]), step(model, x[:, 4:]))
  _close(got, want)
  assert _spec(model.cache.key) == ("data", None, None, None)
