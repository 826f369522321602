"""jattn.linen.MultiHeadAttention decoding with the Linen cache: contiguous, paged and
quantized caches against full causal attention and the formula, released rows, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax_helpers import (
  KEY,
  B,
  F,
  T,
  abstract_init,
  fill,
  linen_reference,
  np_params,
  project,
  random_params,
  sample,
  shapes_of,
)
from reference import array, assert_close, causal_np

import jattn.linen
import jattn.masks
from jattn import positional

MHA = jattn.linen.MultiHeadAttention


# --------------------------------------------------------------------------- decoding

L = 7  # tokens fed per row
MAX_LENGTH = 8


def _decoder(K, rope=positional.Rotary(), **kw):
  return MHA(num_heads=4, num_kv_heads=K, rope=rope, **kw)


def _decode_setup(module, **kw):
  """Random params and an empty cache, shaped by an init with decode=True on the full length:
  Flax's variables, with a length per row in place of cache_index for a ragged cache."""
  shapes = abstract_init(module, jnp.zeros((B, MAX_LENGTH, F)), decode=True, **kw)
  K = module.num_kv_heads or module.num_heads
  lengths = {"cache_lengths": ((B,), jnp.int32)} if module.ragged_cache else {}
  assert shapes_of(shapes["cache"]) == {
    "cached_key": ((B, MAX_LENGTH, K, 4), jnp.float32),
    "cached_value": ((B, MAX_LENGTH, K, 4), jnp.float32),
    **(lengths or {"cache_index": ((), jnp.int32)}),
  }
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
  return {"params": fill(shapes["params"])}, cache


def _numpy_init(key, shape, dtype=jnp.float32):
  """A kernel/bias initializer without jax.random (which would compile for every shape)."""
  del key
  return array(np.random.default_rng(shape).standard_normal(shape) / shape[0], dtype)


@pytest.mark.parametrize("ragged", [False, True], ids=["flax_cache", "ragged"])
def test_decode_init_allocates_empty_cache_and_attends_as_without_decode(ragged):
  module = _decoder(2, kernel_init=_numpy_init, bias_init=_numpy_init, ragged_cache=ragged)
  x = sample((B, MAX_LENGTH, F), seed=3)
  y, variables = module.init_with_output(KEY, x, decode=True)
  assert shapes_of(variables["cache"]) == shapes_of(_decode_setup(module)[1])
  for a in jax.tree.leaves(variables["cache"]):
    np.testing.assert_array_equal(a, 0)
  # the init pass writes nothing and attends as a call without decode, like Flax's
  assert_close(y, _decoder(2).apply({"params": variables["params"]}, x))
  assert not np.allclose(y, _decoder(2, is_causal=True).apply(variables, x), atol=1e-3)


def _decode_chunks(module, params, cache, x, chunks, *, jit=False, **kw):
  """Feed x's tokens in calls of ``chunks`` tokens each; outputs concatenated, final cache."""
  apply = functools.partial(module.apply, decode=True, mutable=["cache"], **kw)
  apply = jax.jit(apply) if jit else apply
  outs, start = [], 0
  for t in chunks:
    y, mutated = apply({**params, "cache": cache}, x[:, start : start + t])
    cache = mutated["cache"]
    outs.append(y)
    start += t
  return jnp.concatenate(outs, axis=1), cache


# (heads K, rope, token counts per call): every grouping decodes a prefill, consecutive
# one-token steps and a chunk after steps; the whole sequence as one prefill needs no other.
# Jitted calls (one program per chunk length); test_decode_ragged_rows and the dropout and
# overflow tests decode eagerly. The default run keeps GQA with rope, in chunks and as one prefill.
@pytest.mark.parametrize(
  "K, rope, chunks",
  [
    pytest.param(4, None, [3, 1, 1, 2], id="mha_chunked", marks=pytest.mark.exhaustive),
    pytest.param(2, positional.Rotary(), [3, 1, 1, 2], id="gqa_rope_chunked"),
    pytest.param(
      1, positional.Rotary(), [3, 1, 1, 2], id="mqa_rope_chunked", marks=pytest.mark.exhaustive
    ),
    pytest.param(2, positional.Rotary(), [L], id="gqa_rope_prefill"),
  ],
)
def test_decode_equals_full_causal(K, rope, chunks):
  x = sample((B, L, F), seed=3)
  module = _decoder(K, rope)
  params, cache = _decode_setup(module)
  got, cache = _decode_chunks(module, params, cache, x, chunks, jit=True)
  expected = jax.jit(_decoder(K, rope, is_causal=True).apply)(params, x)
  assert_close(got, expected)
  np.testing.assert_array_equal(cache["cache_index"], L)
  # the cache holds the (rotated) keys and the values of the L tokens, zeros after
  _, k, v = project(np_params(params), x)
  if rope is not None:
    k = np.asarray(rope(array(k, jnp.float32), jnp.arange(L)))
  assert_close(cache["cached_key"][:, :L], k)
  assert_close(cache["cached_value"][:, :L], v)
  np.testing.assert_array_equal(cache["cached_key"][:, L:], 0.0)
  np.testing.assert_array_equal(cache["cached_value"][:, L:], 0.0)


def test_decode_ragged_rows():
  lens, steps, t = [3, 1], 2, 3  # prompts of 3 and 1 tokens right-padded to t, then 2 steps
  full = sample((B, L, F), seed=4)  # row b's sequence: full[b, :lens[b] + steps]
  prompt = np.array(full[:, :t])
  prompt[1, lens[1] :] = 9.0  # row 1's padding: must be ignored
  module = _decoder(2, ragged_cache=True)
  params, cache = _decode_setup(module)
  y, mutated = module.apply(
    {**params, "cache": cache},
    array(prompt),
    decode=True,
    num_new=array(lens, jnp.int32),
    mutable=["cache"],
  )
  cache = mutated["cache"]
  np.testing.assert_array_equal(cache["cache_lengths"], lens)
  np.testing.assert_array_equal(cache["cached_key"][1, lens[1] :], 0.0)
  outs = [[y[b, : lens[b]]] for b in range(B)]
  # padded query rows attend to nothing: their output is the out-projection bias alone
  bias = params["params"]["out"]["bias"]
  assert_close(y[1, lens[1] :], np.broadcast_to(bias, (t - lens[1], F)))
  for i in range(steps):
    token = jnp.stack([full[b, lens[b] + i] for b in range(B)])[:, None]
    y, mutated = module.apply({**params, "cache": cache}, token, decode=True, mutable=["cache"])
    cache = mutated["cache"]
    for b in range(B):
      outs[b].append(y[b])
  np.testing.assert_array_equal(cache["cache_lengths"], [n + steps for n in lens])
  # Causal: row b's first n outputs over the whole of full are those of its first n tokens alone.
  expected = _decoder(2, is_causal=True).apply(params, full)
  for b in range(B):
    assert_close(
      jnp.concatenate(outs[b], axis=0), expected[b, : lens[b] + steps], err_msg=f"row {b}"
    )


def test_decode_dropout_uses_the_dropout_stream():
  x = sample((B, 3, F), seed=3)
  module = _decoder(2, dropout_rate=0.5)
  params, cache = _decode_setup(module, deterministic=True)

  def run(**kw):
    return np.asarray(_decode_chunks(module, params, cache, x, [3], **kw)[0])

  plain = run(deterministic=True)
  assert_close(plain, _decoder(2, is_causal=True).apply(params, x))
  with pytest.raises(ValueError, match="needs deterministic"):
    run()
  dropped = run(deterministic=False, rngs={"dropout": jax.random.key(1)})
  np.testing.assert_array_equal(
    dropped, run(deterministic=False, rngs={"dropout": jax.random.key(1)})
  )
  assert not np.allclose(dropped, plain, atol=1e-3)


def test_decode_broadcast_dropout_shares_pattern_across_batch():
  x = jnp.tile(sample((1, 3, F), seed=3), (B, 1, 1))  # identical batch rows
  module = _decoder(2, dropout_rate=0.5, broadcast_dropout=True)
  params, cache = _decode_setup(module, deterministic=True)
  out, _ = _decode_chunks(
    module, params, cache, x, [3], deterministic=False, rngs={"dropout": jax.random.key(1)}
  )
  np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)


def test_decode_jit_steps():
  x = sample((B, L, F), seed=3)
  module = _decoder(2)
  params, cache = _decode_setup(module)
  traces = []

  @jax.jit
  def step(variables, token):
    traces.append(token.shape)
    return module.apply(variables, token, decode=True, mutable=["cache"])

  got, cache = _decode_chunks(module, params, cache, x, [3])
  outs = [got]
  for i in range(3, L):
    y, mutated = step({**params, "cache": cache}, x[:, i : i + 1])
    cache = mutated["cache"]
    outs.append(y)
  assert_close(jnp.concatenate(outs, axis=1), _decoder(2, is_causal=True).apply(params, x))
  assert len(traces) == 1  # one trace for every step


def test_decode_overflow_raises():
  x = sample((B, MAX_LENGTH + 1, F), seed=3)
  module = _decoder(2)
  params, cache = _decode_setup(module)
  _, cache = _decode_chunks(module, params, cache, x, [3, 3])
  with pytest.raises(
    ValueError,
    match=r"cache row 0 would overflow: it holds 6 tokens and 3 "
    r"new ones make 9 > max_length=8",
  ):
    _decode_chunks(module, params, cache, x[:, 6:], [3])
  with pytest.raises(ValueError, match="more than the cache's max_length 8"):
    _decode_chunks(module, params, cache, x, [MAX_LENGTH + 1])
  # filling it exactly is fine
  _, cache = _decode_chunks(module, params, cache, x[:, 6:], [2])
  np.testing.assert_array_equal(cache["cache_index"], 8)


# --------------------------------------------------------------- paged and quantized caches

PAGED = dict(page_size=2, num_pages=6)  # 4 pages a row (max_length 7 -> 8), 6 in the pool


@functools.partial(jax.jit, static_argnums=0)
def _step(module, variables, x, num_new):
  """One decode call; a program per (module, chunk length), shared by the tests below."""
  return module.apply(variables, x, decode=True, num_new=num_new, mutable=["cache"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _empty_cache(module, params, max_length=7):
  """The cache the init pass (decode=True) allocates, run with given params (no jax.random).
  A paged cache must come from there: its free_pages start True and its page_table -1.
  One program per module, shared by the tests below."""
  _, mutated = module.apply(params, jnp.zeros((B, max_length, F)), decode=True, mutable=["cache"])
  return mutated["cache"]


@functools.partial(jax.jit, static_argnums=0)
def _masked_step(module, variables, x, mask):
  """One decode call with a mask; a program per (module, chunk length)."""
  return module.apply(variables, x, decode=True, mask=mask, mutable=["cache"])


def _steps(module, params, cache, x, chunks=(4, 1, 1), num_new=None):
  """Feed x's tokens in calls of ``chunks`` tokens; outputs concatenated, final cache."""
  outs, start = [], 0
  for n in chunks:
    n_new = jnp.full((B,), n, jnp.int32) if num_new is None else num_new
    y, mutated = _step(module, {**params, "cache": cache}, x[:, start : start + n], n_new)
    cache = mutated["cache"]
    outs.append(y)
    start += n
  return jnp.concatenate(outs, axis=1), cache


# Exhaustive here: test_nnx_decode.py's twin runs by default, and the Linen paged cache decodes
# by default in the mask and released-rows cases.
@pytest.mark.exhaustive
def test_paged_cache_decodes_like_contiguous_and_full_causal():
  x = sample(seed=3)  # (B, T, F), T = 6
  contiguous, paged = _decoder(2, ragged_cache=True), _decoder(2, **PAGED)
  params = random_params(contiguous, x)
  cache = _empty_cache(paged, params)
  assert shapes_of(cache) == {
    "cached_key_pages": ((6, 2, 2, 4), jnp.float32),
    "cached_value_pages": ((6, 2, 2, 4), jnp.float32),
    "page_table": ((B, 4), jnp.int32),
    "free_pages": ((6,), jnp.bool_),
    "cache_lengths": ((B,), jnp.int32),
  }
  np.testing.assert_array_equal(cache["page_table"], -1)
  np.testing.assert_array_equal(cache["free_pages"], True)
  got, cache = _steps(paged, params, cache, x)
  want, _ = _steps(contiguous, params, _empty_cache(contiguous, params), x)
  assert_close(got, want)
  assert_close(got, _decoder(2, is_causal=True).apply(params, x))
  np.testing.assert_array_equal(cache["cache_lengths"], [T, T])
  np.testing.assert_array_equal(cache["free_pages"], False)  # 3 pages a row: all 6 used


# The default run keeps the prefill here and the steps in test_nnx_decode.py's twin; the steps
# are exhaustive here.
@pytest.mark.parametrize(
  "chunks",
  [
    pytest.param((4, 1, 1), id="steps", marks=pytest.mark.exhaustive),
    pytest.param((6,), id="prefill"),
  ],
)
def test_a_mask_of_the_requested_max_length_fits_either_cache(chunks):
  """The init pass on (B, 7, F) with page_size=2 rounds rows up to 8 slots, but a mask sized
  to the 7 asked for works as with a contiguous cache: the same outputs, and the formula's."""
  x = sample(seed=3)  # (B, T, F), T = 6
  rng = np.random.default_rng(0)
  mask = (rng.random((B, 1, 7, 7)) < 0.6) | np.eye(7, dtype=bool)  # keeps each own token
  outs = {}
  for name, module in (("contiguous", _decoder(2)), ("paged", _decoder(2, **PAGED))):
    params = random_params(module, x)
    cache, got, start = _empty_cache(module, params), [], 0
    for n in chunks:
      y, mutated = _masked_step(
        module, {**params, "cache": cache}, x[:, start : start + n], mask[:, :, start : start + n]
      )
      cache = mutated["cache"]
      got.append(y)
      start += n
    outs[name] = jnp.concatenate(got, axis=1)
  assert cache["page_table"].shape == (B, 4)  # 8 slots a row
  assert_close(outs["paged"], outs["contiguous"])
  allowed = causal_np(T, T) & mask[:, :, :T, :T]
  want = linen_reference(params, x, allowed=allowed, rope=positional.Rotary())
  assert_close(outs["paged"], want)
  unmasked = linen_reference(params, x, allowed=causal_np(T, T), rope=positional.Rotary())
  assert np.abs(want - unmasked).max() > 0.1  # the mask does mask


# Exhaustive here: test_nnx_decode.py's int8 twin and test_paged's int8 cases run by default.
@pytest.mark.exhaustive
def test_int8_paged_cache_is_close_to_the_float_cache():
  x = sample(seed=3)
  module = _decoder(2, cache_dtype=jnp.int8, page_size=2)
  params = random_params(module, x)
  cache = _empty_cache(module, params)
  assert shapes_of(cache)["cached_key_pages"] == ((8, 2, 2, 4), jnp.int8)  # pool: every row full
  assert shapes_of(cache)["cached_key_scale"] == ((8, 2, 2), jnp.float32)
  got, cache = _steps(module, params, cache, x)
  ragged = _decoder(2, ragged_cache=True)
  exact, _ = _steps(ragged, params, _empty_cache(ragged, params), x)
  # Each stored element is off by at most half an int8 step, 1/254 of its (token, head)
  # vector's largest element: so the cache holds, checked from the formula,
  _, k, v = project(np_params(params), x)
  k = np.asarray(positional.Rotary()(array(k, jnp.float32), jnp.arange(T)))
  pages = np.asarray(cache["page_table"])[:, :3].reshape(-1)  # 3 pages a row, in order
  for name, want in (("key", k), ("value", v)):
    stored = np.asarray(cache[f"cached_{name}_pages"], np.float64)[pages]
    stored = stored * np.asarray(cache[f"cached_{name}_scale"])[pages][..., None]
    bound = np.abs(want).max(-1, keepdims=True) / 254 * (1 + 1e-5)
    assert np.all(np.abs(stored.reshape(want.shape) - want) <= bound), name
  # ... and the outputs: logits and values carry that 0.4% into the output, which the
  # projections mix; 2% of the output's size bounds it with room. Not zero: it did round.
  error = float(jnp.abs(got - exact).max()) / float(jnp.abs(exact).max())
  assert 1e-4 < error < 0.02, error


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_released_rows_restart_like_a_fresh_cache(paged):
  x, z = sample(seed=3), sample(seed=5)  # row 0 serves x[0], then a new request z[0]; row 1 x[1]
  module = _decoder(2, **(PAGED if paged else dict(ragged_cache=True)))
  params = random_params(module, x)
  empty = _empty_cache(module, params)
  _, cache = _steps(module, params, empty, x, (4, 1))
  cache = jattn.linen.release_cache(cache, array([True, False]))
  np.testing.assert_array_equal(cache["cache_lengths"], [0, 5])
  if paged:
    np.testing.assert_array_equal(np.sum(cache["free_pages"]), 3)
    np.testing.assert_array_equal(cache["page_table"][0], -1)
  # Row 0 prefills 4 tokens of z, row 1 appends its 6th token (padded to 4); then row 0 alone.
  prompt = jnp.stack([z[0, :4], jnp.pad(x[1, 5:6], ((0, 3), (0, 0)))])

  def serve(cache, row_1):
    first, cache = _steps(module, params, cache, prompt, (4,), array([4, row_1]))
    second, cache = _steps(module, params, cache, z[:, 4:5], (1,), array([1, 0]))
    return first, second, cache

  first, second, cache = serve(cache, 1)
  np.testing.assert_array_equal(cache["cache_lengths"], [5, 6])
  fresh_first, fresh_second, _ = serve(empty, 0)
  assert_close(first[0], fresh_first[0])
  assert_close(second[0], fresh_second[0])
  full = _decoder(2, is_causal=True)
  assert_close(jnp.concatenate([first[0], second[0]]), full.apply(params, z)[0, :5])
  assert_close(first[1, 0], full.apply(params, x)[1, 5])


def test_a_float_cache_of_another_dtype_is_an_error():
  module = _decoder(2, cache_dtype=jnp.bfloat16)  # the module computes in float32
  params = random_params(module, sample())
  cache = _empty_cache(module, params)
  assert shapes_of(cache)["cached_key"] == ((B, 7, 2, 4), jnp.bfloat16)
  with pytest.raises(
    TypeError,
    match=r"the KV cache holds bfloat16 keys and values, but this module computes them in "
    r"float32 \(dtype=None, param_dtype=float32, inputs float32\); set cache_dtype=float32",
  ):
    module.apply({**params, "cache": cache}, sample((B, 1, F)), decode=True, mutable=["cache"])


def test_release_cache_walks_a_models_cache_collection():
  contiguous = jattn.decode.init(B, 4, 1, 2)._replace(lengths=array([3, 2]))
  paged = jattn.decode.init_paged(4, 2, B, 2, 1, 2, dtype=jnp.int8)
  paged = jattn.decode.update(paged, jnp.ones((B, 3, 1, 2)), jnp.ones((B, 3, 1, 2)))
  names = jattn.linen.CACHE_NAMES
  as_vars = lambda c: {names[f]: a for f, a in c._asdict().items() if a is not None}
  other = {"count": jnp.asarray(3)}  # not an attention cache: kept
  tree = {"block_0": {"attn": as_vars(contiguous)}, "block_1": {"attn": as_vars(paged)}}
  tree["block_1"]["other"] = other
  rows = array([True, False])
  release = jattn.linen.release_cache
  for out in (release(tree, rows), jax.jit(release)(tree, rows)):
    want = {
      "block_0": {"attn": as_vars(jattn.decode.release(contiguous, rows))},
      "block_1": {"attn": as_vars(jattn.decode.release(paged, rows)), "other": other},
    }
    assert jax.tree.structure(out) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(out["block_1"]["attn"]["free_pages"], [True, True, False, False])
  with pytest.raises(TypeError, match="cache must be a cache collection"):
    jattn.linen.release_cache([tree], rows)
  # Flax's cache (one cache_index for every row) cannot release rows: named by its path
  flax_cache = {"cached_key": jnp.ones((B, 4, 1, 2)), "cached_value": jnp.ones((B, 4, 1, 2))}
  tree["block_1"]["flax_attn"] = flax_cache | {"cache_index": jnp.asarray(3)}
  with pytest.raises(ValueError, match=r"keeps Flax's one cache_index .* 'block_1/flax_attn'"):
    jattn.linen.release_cache(tree, rows)


# (id, call kwargs, exception, message fragment) on a module whose cache is initialised
BAD_DECODE_CALLS = [
  (
    "inputs_k_length",
    dict(inputs_k=sample((B, 2, F))),
    ValueError,
    r"decode=True writes inputs_k's tokens to the cache beside inputs_q's: they must have the "
    r"same length, got \(2, 2, 16\) and inputs_q \(2, 1, 16\)",
  ),
  ("positions", dict(positions=jnp.arange(1)), ValueError, r"decode=True does not take positions"),
  (
    "segment_ids",
    dict(segment_ids=jnp.zeros((B, 1), jnp.int32)),
    ValueError,
    r"decode=True does not take segment_ids",
  ),
  ("sow_weights", dict(sow_weights=True), ValueError, r"decode=True does not take sow_weights"),
  (
    "unbatched",
    dict(inputs_q=sample((1, F))),
    ValueError,
    r"inputs_q has batch dimensions \(\) \(shape \(1, 16\)\) but the cache was made for \(2,\)",
  ),
  (
    "batch_size",
    dict(inputs_q=sample((B + 1, 1, F))),
    ValueError,
    r"inputs_q has batch dimensions \(3,\) \(shape \(3, 1, 16\)\) but the cache was made for",
  ),
  (
    "num_new_shape",
    dict(num_new=array([1, 1, 1])),
    ValueError,
    r"num_new must have shape \(B,\)=\(2,\)",
  ),
  ("num_new_range", dict(num_new=array([2, 0])), ValueError, r"num_new must be in \[0, t=1\]"),
]


@pytest.mark.parametrize(
  "call, error, match", [c[1:] for c in BAD_DECODE_CALLS], ids=[c[0] for c in BAD_DECODE_CALLS]
)
def test_bad_decode_call_raises(call, error, match):
  module = MHA(num_heads=4, num_kv_heads=2, ragged_cache=True)
  params, cache = _decode_setup(module)
  call = dict(call)
  inputs_q = call.pop("inputs_q", sample((B, 1, F)))
  with pytest.raises(error, match=match):
    module.apply({**params, "cache": cache}, inputs_q, decode=True, mutable=["cache"], **call)


def test_num_new_needs_a_cache_with_a_length_per_row():
  module = MHA(num_heads=4, num_kv_heads=2)
  params, cache = _decode_setup(module)
  with pytest.raises(
    ValueError,
    match=r"num_new needs a cache with one length per row, but this one keeps Flax's one "
    r"cache_index for all rows: make the module with ragged_cache=True",
  ):
    module.apply(
      {**params, "cache": cache},
      sample((B, 1, F)),
      decode=True,
      num_new=array([1, 1]),
      mutable=["cache"],
    )


def test_a_mask_object_sees_each_query_where_it_sits_in_the_sequence():
  """As test_nnx_decode.py's twin: a window Mask in decode calls equals it over the whole
  sequence (the query index is the absolute position, not the chunk's)."""
  x = sample((B, L, F), seed=5)
  window = jattn.masks.sliding_window(2)
  module = _decoder(2)
  params, cache = _decode_setup(module)
  got, _ = _decode_chunks(module, params, cache, x, [3, 1, 3], mask=window)
  expected = _decoder(2, is_causal=True).apply(params, x, mask=window)
  assert_close(got, expected)
