"""jattn.nnx.MultiHeadAttention decoding: prefill and steps against full causal attention,
ragged rows, paged and quantized caches, released rows, init_cache's errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_helpers import B, F, T, nnx_reference, sample
from reference import array, assert_close

import jattn
import jattn.nnx
from jattn import masks, positional

# --- decoding ----------------------------------------------------------------------------


def _decoder(K, **kw):
  return jattn.nnx.MultiHeadAttention(
    4, F, num_kv_heads=K, is_causal=True, rope=positional.Rotary(), rngs=nnx.Rngs(0), **kw
  )


# Each head grouping decodes a schedule with a prefill, consecutive one-token steps and a
# chunk after steps, ending at T; the whole prompt as one prefill needs no other grouping. The
# default run keeps the prefill; the schedules are exhaustive (test_linen_decode.py decodes GQA
# with rope in that schedule by default, and the file's other tests decode in steps).
@pytest.mark.parametrize(
  "K, chunks",
  [
    pytest.param(4, (2, 1, 1, 2), marks=pytest.mark.exhaustive),
    pytest.param(2, (2, 1, 1, 2), marks=pytest.mark.exhaustive),
    pytest.param(1, (2, 1, 1, 2), marks=pytest.mark.exhaustive),
    (2, (6,)),
  ],
)
def test_prefill_and_decode_equal_full_causal_attention(K, chunks):
  m = _decoder(K)
  x = sample()
  full = m(x)
  m.init_cache(B, 10)
  outs, start = [], 0
  for n in chunks:
    outs.append(m(x[:, start : start + n], decode=True))
    start += n
  assert_close(jnp.concatenate(outs, axis=1), full, factor=5)
  np.testing.assert_array_equal(m.cache.lengths, [T, T])


def test_ragged_prefill_then_decode_under_nnx_jit():
  m = _decoder(2, implementation="blockwise", block_q=2, block_kv=4)
  x = sample()
  lengths = np.array([4, 2])  # prompts, right-padded to 4
  m.init_cache(B, 8, ragged=True)  # a length per row: cache_lengths, not cache_index
  prompt = m(x[:, :4], decode=True, num_new=array(lengths))
  step = nnx.jit(lambda m, tok: m(tok, decode=True))
  # Feed each row its own next tokens: row 0 continues at 4, row 1 at 2.
  steps = []
  for i in range(2):
    tok = jnp.stack([x[0, 4 + i], x[1, 2 + i]])[:, None]
    steps.append(step(m, tok))
  np.testing.assert_array_equal(m.cache.lengths, lengths + 2)
  for b, n in enumerate(lengths):
    row = x[b : b + 1, : n + 2]
    want = _decoder(2)(row)[0]
    got = jnp.concatenate([prompt[b, :n], steps[0][b], steps[1][b]])
    assert_close(got, want, factor=5)
  # Padded prompt rows attend to nothing: their output is the out projection's bias.
  assert_close(prompt[1, 2:], jnp.broadcast_to(m.out.bias[...], (2, F)))


def test_decode_overflow_and_missing_cache_raise():
  m = _decoder(2)
  with pytest.raises(ValueError, match="init_cache"):
    m(sample(), decode=True)
  m.init_cache(B, 5)
  m(sample()[:, :4], decode=True)
  with pytest.raises(ValueError, match="max_length"):
    m(sample()[:, :2], decode=True)


# --- paged and quantized caches -------------------------------------------------------------

# One jitted decode step for every test below: a program per (chunk length, cache layout),
# shared across tests. num_new is always given, so release-and-reuse needs no other program.
_STEP = nnx.jit(lambda m, x, num_new: m(x, decode=True, num_new=jnp.asarray(num_new)))
PAGED = dict(page_size=2, num_pages=6)  # 4 pages a row (max_length 7 -> 8), 6 in the pool


def _decode_steps(m, x, chunks=(4, 1, 1)):
  """Feed every row x's tokens in calls of ``chunks`` tokens; outputs concatenated."""
  outs, start = [], 0
  for n in chunks:
    outs.append(_STEP(m, x[:, start : start + n], np.full(B, n)))
    start += n
  return jnp.concatenate(outs, axis=1)


def test_paged_cache_decodes_like_contiguous_and_full_causal():
  m = _decoder(2)  # GQA, RoPE
  x = sample()
  full = m(x)
  m.init_cache(B, 7, ragged=True)
  contiguous = _decode_steps(m, x)
  m.init_cache(B, 7, **PAGED)
  cache = m.cache
  assert isinstance(cache, jattn.decode.PagedKVCache)
  assert (cache.key_pages.shape, cache.page_table.shape) == ((6, 2, 2, 4), (B, 4))
  paged = _decode_steps(m, x)
  assert_close(paged, contiguous)
  assert_close(paged, full, factor=5)
  np.testing.assert_array_equal(m.cache.lengths, [T, T])
  np.testing.assert_array_equal(m.cache.free, False)  # 3 pages a row: the pool is used up
  assert sorted(np.asarray(m.cache.page_table)[:, :3].ravel()) == list(range(6))


def _decoding_mask(max_length, seed=0):
  """(B, 1, max_length, max_length) bool: a random pattern over the keys that keeps each
  query's own token (no row fully masked)."""
  rng = np.random.default_rng(seed)
  mask = rng.random((B, 1, max_length, max_length)) < 0.6
  return mask | np.eye(max_length, dtype=bool)


# The default run keeps the steps here and the prefill in test_linen_decode.py's twin; the
# prefill is exhaustive here.
@pytest.mark.parametrize(
  "chunks",
  [
    pytest.param((4, 1, 1), id="steps"),
    pytest.param((6,), id="prefill", marks=pytest.mark.exhaustive),
  ],
)
def test_a_mask_of_the_requested_max_length_fits_either_cache(chunks):
  """init_cache(B, 7, page_size=2) rounds rows up to 8 slots, but a mask sized to the 7 asked
  for works as with a contiguous cache: the same outputs, which equal the module's math."""
  m = _decoder(2)
  x = sample()
  mask = _decoding_mask(7)
  outs = {}
  for name, kw in (("contiguous", {}), ("paged", PAGED)):
    m.init_cache(B, 7, **kw)
    got, start = [], 0
    for n in chunks:
      got.append(m(x[:, start : start + n], decode=True, mask=mask[:, :, start : start + n]))
      start += n
    outs[name] = jnp.concatenate(got, axis=1)
  assert m.cache.max_length == 8
  assert_close(outs["paged"], outs["contiguous"])
  want = nnx_reference(m, x, mask=mask[:, :, :T, :T])
  assert_close(outs["paged"], want, factor=5)
  assert_close(m(x, mask=mask[:, :, :T, :T]), want, factor=5)  # the mask does mask
  assert float(jnp.abs(want - nnx_reference(m, x)).max()) > 0.1


def _int8_roundtrip(a):
  """What an int8 cache gives back, from the formula: per (token, head) absmax scale."""
  a = np.asarray(a, np.float64)
  scale = np.abs(a).max(-1, keepdims=True) / 127
  return array(np.round(a / np.where(scale > 0, scale, 1)) * scale, jnp.float32)


def test_int8_cache_is_close_to_the_float_cache():
  m = _decoder(2)
  x = sample()
  m.init_cache(B, 7, ragged=True)
  exact = _decode_steps(m, x)
  # the module computes in float32, the cache holds int8
  m.init_cache(batch_size=B, max_length=7, dtype=jnp.int8, ragged=True)
  assert m.cache.key.dtype == jnp.int8 and m.cache.key_scale.shape == (B, 7, 2)
  got = _decode_steps(m, x)
  # Against the module's math on int8-rounded keys and values: equal up to float32 rounding.
  assert_close(got, nnx_reference(m, x, stored=_int8_roundtrip), factor=5)
  # Against the float cache: each stored element is off by at most half a step, 1/254 of its
  # vector's largest element (0.4%); logits and values carry that error into the output, which
  # the projections mix, so 2% of the output's size bounds it with room. It is not zero: the
  # cache did round.
  error = float(jnp.abs(got - exact).max()) / float(jnp.abs(exact).max())
  assert 1e-4 < error < 0.02, error


# The default run keeps the contiguous cache here (test_linen_decode.py's twin runs both); the
# paged one is exhaustive here.
@pytest.mark.parametrize(
  "paged",
  [
    pytest.param(False, id="contiguous"),
    pytest.param(True, id="paged", marks=pytest.mark.exhaustive),
  ],
)
def test_released_rows_restart_like_a_fresh_cache(paged):
  m = _decoder(2)
  x, z = sample(), sample(seed=5)  # row 0 serves x[0], then a new request z[0]; row 1 serves x[1]
  kw = PAGED if paged else dict(ragged=True)
  m.init_cache(B, 7, **kw)
  _decode_steps(m, x, (4, 1))
  if paged:  # 3 pages a row hold 6 tokens: the pool has none for a 7th
    with pytest.raises(ValueError, match="out of pages"):
      m(x[:, :2], decode=True)
  m.release_cache(array([True, False]))
  np.testing.assert_array_equal(m.cache.lengths, [0, 5])
  if paged:
    np.testing.assert_array_equal(np.asarray(m.cache.free).sum(), 3)
    np.testing.assert_array_equal(np.asarray(m.cache.page_table)[0], -1)
  # Row 0 prefills 4 tokens of z, row 1 appends its 6th token (padded to 4); then a step of
  # row 0 alone.
  prompt = jnp.stack([z[0, :4], jnp.pad(x[1, 5:6], ((0, 3), (0, 0)))])
  reused = [_STEP(m, prompt, [4, 1]), _STEP(m, z[:, 4:5], [1, 0])]
  np.testing.assert_array_equal(m.cache.lengths, [5, 6])
  m.init_cache(B, 7, **kw)
  fresh = [_STEP(m, prompt, [4, 0]), _STEP(m, z[:, 4:5], [1, 0])]
  for a, b in zip(reused, fresh):
    assert_close(a[0], b[0])
  full_z, full_x = m(z), m(x)
  assert_close(jnp.concatenate([reused[0][0], reused[1][0]]), full_z[0, :5], factor=5)
  assert_close(reused[0][1, 0], full_x[1, 5], factor=5)


def test_init_cache_takes_flaxs_input_shape_or_jattns_sizes():
  m = jattn.nnx.MultiHeadAttention(4, F, num_kv_heads=2, rngs=nnx.Rngs(0))
  made = []
  for args, kwargs in (
    (((B, 8, F),), {}),  # Flax's: a full-length input's shape
    (((B, 8, F), jnp.float32), {}),
    ((), dict(batch_size=B, max_length=8)),
    ((B, 8), {}),
  ):
    m.init_cache(*args, **kwargs)
    made.append((m.cache.key.shape, m.cache.key.dtype, m.cache.max_length))
  assert made == [((B, 8, 2, 4), jnp.float32, 8)] * 4


INIT_CACHE_FORM_ERRORS = [
  ((), {}, TypeError, r"init_cache needs input_shape \(batch\.\.\., max_length, features\), or"),
  (
    ((8,),),
    {},
    ValueError,
    r"input_shape must be \(batch\.\.\., max_length, features\) of positive ints, as in "
    r"Flax's init_cache, got \(8,\)",
  ),
  (((B, 0, F),), {}, ValueError, r"input_shape must be .* of positive ints.*got \(2, 0, 16\)"),
  ((B,), {}, ValueError, r"input_shape must be \(batch\.\.\., max_length, features\).*got 2"),
  (((B, 8, F),), dict(max_length=4), TypeError, "input_shape or batch_size= and max_length="),
  ((), dict(batch_size=B), TypeError, "init_cache needs input_shape"),
  (((2, B, 8, F),), dict(ragged=True), ValueError, "a ragged cache .* exactly one batch dim"),
  (((8, F),), dict(page_size=2), ValueError, "a paged cache .* exactly one batch dimension"),
]


@pytest.mark.parametrize("args, kwargs, error, match", INIT_CACHE_FORM_ERRORS)
def test_init_cache_form_errors(args, kwargs, error, match):
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  with pytest.raises(error, match=match):
    m.init_cache(*args, **kwargs)
  assert m.cache is None


INIT_CACHE_ERRORS = [
  (dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
  (dict(page_size=2.0), TypeError, "page_size must be an int"),
  (dict(page_size=2, num_pages=0), ValueError, "num_pages must be >= 1, got 0"),
  (dict(num_pages=4), ValueError, "num_pages applies only to a paged cache: give page_size"),
  (
    dict(dtype=jnp.int32),
    TypeError,
    "dtype must be a floating dtype, int8 or float8_e4m3fn, got int32",
  ),
  (dict(dtype="nope"), TypeError, "dtype must be a floating dtype"),
  (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
  (dict(max_length=2.5), TypeError, "max_length must be an int"),
]


@pytest.mark.parametrize("kwargs, error, match", INIT_CACHE_ERRORS)
def test_init_cache_errors(kwargs, error, match):
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  kwargs = dict(batch_size=2, max_length=8) | kwargs
  with pytest.raises(error, match=match):
    m.init_cache(**kwargs)
  assert m.cache is None


def test_paged_and_quantized_caches_need_blockwise_whole_page_tiles():
  xla = jattn.nnx.MultiHeadAttention(4, F, implementation="xla", rngs=nnx.Rngs(0))
  for kw, kind in ((dict(page_size=4), "paged"), (dict(dtype=jnp.int8), "quantized")):
    with pytest.raises(ValueError, match=f"a {kind} .* cache is read by blockwise attention"):
      xla.init_cache(batch_size=2, max_length=8, **kw)
  xla.init_cache((2, 8, F), jnp.float32)  # contiguous float: any implementation
  tiles = jattn.nnx.MultiHeadAttention(4, F, block_kv=6, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="block_kv must be a multiple of page_size=4"):
    tiles.init_cache(2, 8, page_size=4)
  tiles.init_cache(2, 8, page_size=3)
  assert tiles.cache.num_pages == 2 * 3  # the default pool: every row can fill


def test_release_cache_errors():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no KV cache to release rows of: call init_cache"):
    m.release_cache(array([True, False]))
  m.init_cache(2, 8, page_size=4)
  with pytest.raises(ValueError, match=r"rows must be a boolean array of shape \(B,\)=\(2,\)"):
    m.release_cache(array([1, 0]))
  m.init_cache((2, 8, F))  # Flax's cache: one cache_index for both rows
  with pytest.raises(
    ValueError,
    match=r"releasing rows needs a cache with one length per row, but this one keeps Flax's "
    r"one cache_index for all rows: call init_cache\(\.\.\., ragged=True\)",
  ):
    m.release_cache(array([True, False]))


@pytest.mark.parametrize(
  "layout", [{}, dict(ragged=True), PAGED], ids=["contiguous", "ragged", "paged"]
)
def test_a_mask_object_sees_each_query_where_it_sits_in_the_sequence(layout):
  """A jattn.masks.Mask given to decode=True calls (a window and a score function, both of
  positions) gives what the same mask gives over the whole sequence: the module decodes
  with absolute positions, so a query of a later chunk is not read as the chunk's first."""
  m = _decoder(2)
  x = sample()
  window = masks.sliding_window(2)
  full = m(x, mask=window)
  m.init_cache(B, 7, **layout)
  outs, start = [], 0
  for n in (3, 1, 2):  # a prefill, a step, a chunk after it
    outs.append(m(x[:, start : start + n], mask=window, decode=True))
    start += n
  assert_close(jnp.concatenate(outs, axis=1), full)
