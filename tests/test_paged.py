"""jattn.decode's paged and quantized caches: paged == contiguous == full causal attention
(MHA, GQA, MQA; chunk patterns; ragged rows), page allocation, release and reuse, running
out of pages, gradients (custom_vjp through the page gather), quantization error bounds,
and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_jnp, attention_np, causal_np, normal

import jattn
from jattn import decode, masks, scores

B, H, L = 2, 4, 9  # L tokens per row over a test: a prompt and decode steps
PAGE, PAGES_PER_ROW = 2, 6  # max_length 12
POOL = 10  # < B * PAGES_PER_ROW: exactly the 5 pages a row of 9 tokens needs, twice
STATIC = ("block_q", "block_kv", "return_residual", "score_fn", "implementation")


@functools.partial(jax.jit, static_argnames=STATIC)
def _step(query, key, value, cache, num_new=None, **kw):
  return decode.attention(query, key, value, cache, num_new=num_new, **kw)


def _sequence(N, K, length=L, seed=0, dtype=np.float32):
  """q, k, v as NumPy arrays: the tests slice them chunk by chunk, which on jax.Arrays
  would compile a program per slice."""
  return tuple(
    np.asarray(normal((B, length, n, H), dtype, seed=seed + i)) for i, n in enumerate((N, K, K))
  )


def _paged(K, *, pool=POOL, dtype=jnp.float32):
  return decode.init_paged(pool, PAGE, B, PAGES_PER_ROW, K, H, dtype=dtype)


def _run(q, k, v, cache, chunks, **kw):
  outs, start = [], 0
  for t in chunks:
    part = slice(start, start + t)
    out, cache = _step(q[:, part], k[:, part], v[:, part], cache, block_q=2, **kw)
    outs.append(out)
    start += t
  return jnp.concatenate(outs, axis=1), cache


def _rows(cache: decode.PagedKVCache, store):
  """Each row's slots in order, gathered through the page table: (B, max_length, K, h)."""
  pages = np.asarray(store)[np.maximum(np.asarray(cache.page_table), 0)]
  return pages.reshape(B, -1, *pages.shape[3:])


# The default run keeps MQA's prefill; the other cases are exhaustive (this file's other tests
# decode through paged caches in steps by default).
@pytest.mark.parametrize(
  "chunks, N, K",
  [
    pytest.param(
      chunks, N, K, id=f"{name}-{heads}", marks=() if heads == kept else pytest.mark.exhaustive
    )
    for chunks, name, kept in [((3, 1, 1, 1, 3), "steps", None), ((9,), "prefill", "mqa")]
    for N, K, heads in [(2, 2, "mha"), (4, 2, "gqa"), (4, 1, "mqa")]
  ],
)
def test_paged_equals_contiguous_equals_full_causal(N, K, chunks):
  q, k, v = _sequence(N, K)
  want = attention_np(q, k, v, allowed=causal_np(L, L))[0]
  paged_out, paged = _run(q, k, v, _paged(K), chunks, block_kv=4)  # a tile is 2 pages
  dense_out, dense = _run(q, k, v, decode.init(B, PAGE * PAGES_PER_ROW, K, H), chunks)
  assert_close(paged_out, want)
  assert_close(dense_out, want)
  assert_close(paged_out, dense_out)
  np.testing.assert_array_equal(paged.lengths, [L, L])
  # Pages are taken in order as the rows grow, so the rows' pages interleave in the pool.
  table = np.asarray(paged.page_table)
  assert sorted(table[table >= 0].tolist()) == list(range(POOL))
  assert (table[:, 5:] == -1).all() and not np.asarray(paged.free).any()
  np.testing.assert_array_equal(_rows(paged, paged.key_pages)[:, :L], k)
  np.testing.assert_array_equal(_rows(paged, paged.value_pages)[:, :L], v)
  np.testing.assert_array_equal(dense.key[:, :L], k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_empty_caches_are_separate_buffers_a_step_may_donate(dtype):
  """init and init_paged make every array in one program: each its own buffer (a donated
  key must not free the value), zero, with no row's pages and every page free."""
  paged = decode.init_paged(6, 4, 2, 3, 2, 4, dtype=dtype, value_head_dim=5)
  flat = decode.init(2, 8, 2, 4, dtype=dtype, value_head_dim=5)
  for cache in (paged, flat):
    arrays = [x for x in cache if x is not None]
    assert len({x.unsafe_buffer_pointer() for x in arrays}) == len(arrays)
  shapes = [(6, 4, 2, 4), (6, 4, 2, 5), (2, 3), (2,), (6,)]
  shapes += [(6, 4, 2)] * 2 if dtype == jnp.int8 else []
  assert [x.shape for x in paged if x is not None] == shapes
  assert paged.key_pages.dtype == paged.value_pages.dtype == flat.key.dtype == dtype
  np.testing.assert_array_equal(paged.page_table, -np.ones((2, 3)))
  np.testing.assert_array_equal(paged.free, np.ones(6, bool))
  for x in (paged.key_pages, paged.value_pages, paged.lengths, flat.key, flat.value, flat.lengths):
    assert not np.asarray(x).astype(np.float32).any()
  k, v = normal((2, 3, 2, 4), seed=1), normal((2, 3, 2, 5), seed=2)
  written = jax.jit(decode.update, donate_argnums=0)(flat, k, v)  # the whole cache donated
  np.testing.assert_array_equal(written.lengths, [3, 3])
  if dtype == jnp.float32:
    np.testing.assert_array_equal(written.value[:, :3], v)
    assert not np.asarray(written.key[:, 3:]).any()


def test_ragged_rows_and_idle_rows():
  N, K, t = 4, 2, 5
  prompt = np.array([5, 2], np.int32)
  q, k, v = _sequence(N, K)
  (pre, lse), cache = _step(
    q[:, :t], k[:, :t], v[:, :t], _paged(K), jnp.asarray(prompt), return_residual=True
  )
  pre, lse = np.asarray(pre), np.asarray(lse)  # NumPy: indexing a jax.Array compiles
  np.testing.assert_array_equal(cache.lengths, prompt)
  np.testing.assert_array_equal(cache.page_table[:, :3], [[0, 1, 2], [3, -1, -1]])
  np.testing.assert_array_equal(pre[1, 2:], 0.0)  # padded query rows
  assert np.all(np.isneginf(lse[1, 2:])) and np.all(np.isfinite(lse[1, :2]))
  np.testing.assert_array_equal(decode.positions(cache, 2), [[5, 6], [2, 3]])
  steps = []
  for i in range(3):
    pick = lambda x: x[np.arange(B), prompt + i][:, None]
    out, cache = _step(pick(q), pick(k), pick(v), cache)
    steps.append(np.asarray(out)[:, 0])
  idle, cache = _step(q[:, 8:9], k[:, 8:9], v[:, 8:9], cache, jnp.array([1, 0], jnp.int32))
  idle = np.asarray(idle)
  np.testing.assert_array_equal(cache.lengths, prompt + [4, 3])
  np.testing.assert_array_equal(idle[1], 0.0)
  for b in range(B):
    n = int(prompt[b]) + 3
    row = lambda x: x[b : b + 1, :n]
    want = attention_np(row(q), row(k), row(v), allowed=causal_np(n, n))[0][0]
    assert_close(pre[b, : prompt[b]], want[: prompt[b]])
    assert_close(np.stack([s[b] for s in steps]), want[prompt[b] :])
  assert_close(idle[0, 0], attention_np(q[:1], k[:1], v[:1], allowed=causal_np(L, L))[0][0, 8])


def test_release_returns_pages_and_a_released_row_restarts_clean():
  """Row 0 finishes and is released; its pages, filled with NaN as a finished request's
  garbage could be, go to a new request in row 0 and to row 1 as it grows. Both rows then
  match attention over their own sequences, and the freed pages are the ones reused."""
  N, K = 4, 2
  q, k, v = _sequence(N, K)
  # Jitted: one program for every release of this cache (eagerly, one per operation; the
  # eager call runs in test_running_out_of_pages_under_jit_serves_rows_in_batch_order).
  release = jax.jit(decode.release)
  _, cache = _run(q, k, v, _paged(K), (6,))  # rows hold 6 tokens: 3 pages each
  freed = np.asarray(cache.page_table)[0, :3]
  cache = release(cache, jnp.array([True, False]))
  np.testing.assert_array_equal(cache.lengths, [0, 6])
  np.testing.assert_array_equal(cache.page_table[0], -1)
  assert np.asarray(cache.free)[freed].all() and int(np.asarray(cache.free).sum()) == POOL - 3
  garbage = {}
  for name in ("key_pages", "value_pages"):  # written by NumPy: no program per operation
    garbage[name] = np.array(getattr(cache, name))
    garbage[name][freed] = np.nan
  cache = cache._replace(**garbage)
  # A new request in row 0 (tokens 0..4 of another sequence) while row 1 goes on.
  q2, k2, v2 = _sequence(N, K, seed=10)
  prompt = lambda x, y: np.concatenate([x[:1, :3], y[1:, 6:9]])  # row 1: its tokens 6..8
  out, cache = _step(prompt(q2, q), prompt(k2, k), prompt(v2, v), cache)
  np.testing.assert_array_equal(cache.lengths, [3, 9])
  reused = np.asarray(cache.page_table)
  assert set(reused[reused >= 0].tolist()) & set(freed.tolist())  # freed pages taken again
  assert np.isfinite(out).all()
  fresh = attention_np(q2[:1, :3], k2[:1, :3], v2[:1, :3], allowed=causal_np(3, 3))[0]
  assert_close(out[:1], fresh)
  assert_close(out[1:], attention_np(q[1:], k[1:], v[1:], allowed=causal_np(L, L))[0][:, 6:])
  # Releasing nothing changes nothing; releasing an empty row is harmless.
  same = release(cache, jnp.array([False, False]))
  jax.tree.map(np.testing.assert_array_equal, same, cache)
  empty = release(release(cache, jnp.array([True, False])), jnp.array([True, False]))
  assert int(np.asarray(empty.free).sum()) == POOL - 5
  # The contiguous cache releases by resetting lengths.
  dense = release(
    decode.update(decode.init(B, 4, K, H), k[:, :2], v[:, :2]), np.array([False, True])
  )
  np.testing.assert_array_equal(dense.lengths, [2, 0])


def test_running_out_of_pages_raises_when_concrete():
  K = 1
  _, _, k = _sequence(1, K)
  cache = decode.update(_paged(K, pool=4), k[:, :3], k[:, :3])  # 2 pages a row: pool empty
  np.testing.assert_array_equal(cache.page_table[:, :2], [[0, 1], [2, 3]])
  with pytest.raises(
    ValueError,
    match=r"the paged cache is out of pages: the new tokens need 2 more pages \(per row "
    r"\[1, 1\]\) and 0 of num_pages=4 are free; release finished rows \(decode.release, or "
    r"the Flax modules' release_cache\)",
  ):
    decode.update(cache, k[:, :2], k[:, :2])
  # Filling the rows' last pages needs no new page.
  cache = decode.update(cache, k[:, :1], k[:, :1])
  np.testing.assert_array_equal(cache.lengths, [4, 4])


def test_running_out_of_pages_under_jit_serves_rows_in_batch_order():
  """Rows get pages in batch order; a row that finds the pool empty keeps what its pages
  hold and its length is capped there, like overflow."""
  K = 1
  _, _, k = _sequence(1, K)
  update = jax.jit(decode.update)
  cache = update(_paged(K, pool=3), k[:, :3], k[:, :3])  # row 0: pages 0, 1; row 1: 2
  np.testing.assert_array_equal(cache.page_table[:, :2], [[0, 1], [2, -1]])
  np.testing.assert_array_equal(cache.lengths, [3, 2])  # row 1 kept 2 of 3 tokens
  cache = update(cache, k[:, 3:6], k[:, 3:6])
  np.testing.assert_array_equal(cache.lengths, [4, 2])  # no pages left for anyone
  np.testing.assert_array_equal(_rows(cache, cache.key_pages)[0, :4], k[0, :4])
  np.testing.assert_array_equal(_rows(cache, cache.key_pages)[1, :2], k[1, :2])
  # Row 0 is released: its two pages go to its next request (3 tokens), none to row 1.
  cache = update(decode.release(cache, jnp.array([True, False])), k[:, 6:9], k[:, 6:9])
  np.testing.assert_array_equal(cache.lengths, [3, 2])
  np.testing.assert_array_equal(cache.page_table[:, :2], [[0, 1], [2, -1]])
  np.testing.assert_array_equal(_rows(cache, cache.key_pages)[0, :3], k[0, 6:9])


def _dropped_loss(q, k, v, cache, num_new, cot, dtype):
  if cache is None:  # built inside jit
    cache = _paged(2, pool=3, dtype=dtype)
  out, cache = decode.attention(q, k, v, cache, num_new=num_new, block_q=2, block_kv=4)
  return jnp.sum(out * cot), (out, cache.lengths)


@functools.partial(jax.jit, static_argnames="dtype")
def _dropped_grad(q, k, v, cache, num_new, cot, dtype):
  wrt = (0, 1, 2) if dtype == jnp.float32 else (0,)  # a quantized cache takes no gradient
  return jax.value_and_grad(_dropped_loss, wrt, has_aux=True)(q, k, v, cache, num_new, cot, dtype)


def _dropped_inputs():
  return (*_sequence(4, 2, length=4), normal((B, 4, 4, H), seed=7))


@functools.cache
def _dropped_want(dtype):
  """The reference of the cases below (the same whether the short pool is built inside jit
  or outside): a pool big enough, given only the kept tokens; one program per dtype."""
  q, k, v, cot = _dropped_inputs()
  return _dropped_grad(q, k, v, _paged(2, dtype=dtype), jnp.array([4, 2]), cot, dtype)


# The default run keeps float32 pages built inside jit; the other three are exhaustive (int8
# pages are read by default in test_quantized_caches_attend_close_to_the_float_cache).
@pytest.mark.parametrize(
  "dtype, built",
  [
    pytest.param(dtype, b, id=f"{name}-{b}", marks=() if b == kept else pytest.mark.exhaustive)
    for dtype, name, kept in [
      (jnp.float32, "float32", "inside_jit"),
      (jnp.int8, "int8", None),
    ]
    for b in ("outside_jit", "inside_jit")
  ],
)
def test_running_out_of_pages_under_jit_dropped_tokens_queries_return_zeros(dtype, built):
  """A query whose token found no page returns zeros, like a padded row, and has zero
  gradient (not attention over the kept keys plus the unwritten slot as a phantom key of
  logit 0); the rest equal attention on a pool big enough, given only the kept tokens."""
  q, k, v, cot = _dropped_inputs()
  num_new = np.array([4, 3])  # row 1: 3 real tokens, 1 padding
  kept = np.array([4, 2])  # a pool of 3 pages: row 0 takes 2, row 1 the last one
  cache = None if built == "inside_jit" else _paged(2, pool=3, dtype=dtype)
  (_, (got, lengths)), got_g = _dropped_grad(q, k, v, cache, jnp.asarray(num_new), cot, dtype)
  np.testing.assert_array_equal(lengths, kept)
  (_, (want, _)), want_g = _dropped_want(dtype)
  np.testing.assert_array_equal(got[1, 2:], 0.0)  # dropped and padded rows alike
  assert_close(got, want)
  for g, w in zip(got_g, want_g):
    np.testing.assert_array_equal(g[1, 2:], 0.0)
    assert_close(g, w, factor=5)
  if dtype == jnp.float32:  # the kept rows are causal attention over the kept tokens
    assert_close(
      got[1, :2], attention_np(q[1:, :2], k[1:, :2], v[1:, :2], allowed=causal_np(2, 2))[0][0]
    )


def test_gradients_match_autodiff():
  """Through the page writes and blockwise's custom_vjp, whose cotangent for the pages is
  scattered back through the page table."""
  N, K = 4, 2
  q, k, v = _sequence(N, K)
  cot = normal((B, L, N, H), seed=7)

  def loss_paged(q, k, v):
    out, _ = _run(q, k, v, _paged(K), (5, 4), block_kv=4)
    return jnp.sum(out * cot)

  def loss_full(q, k, v):
    return jnp.sum(attention_jnp(q, k, v, allowed=causal_np(L, L))[0] * cot)

  got = jax.jit(jax.grad(loss_paged, (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss_full, (0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    assert_close(g, w, factor=5)


# Exhaustive (4 CPU-seconds), for the README command's time bound: the default run compares
# the paged gradients with autodiff above, and checks blockwise's custom_vjp in float64 on
# contiguous keys (test_blockwise.py).
@pytest.mark.exhaustive
def test_check_grads_float64_with_the_pages_as_inputs():
  """check_grads in float64 with the pages as inputs: rows in interleaved pages, one row
  shorter than a whole tile, sinks."""
  N, K = 4, 2
  with jax.enable_x64(True):
    q64, k64, v64 = (x.astype(np.float64) for x in _sequence(N, K, length=5))
    cache = decode.update(_paged(K, dtype=jnp.float64), k64, v64, num_new=np.array([5, 3]))
    sinks = np.array([0.5, -1.0, 0.0, 2.0])

    def attend(q, key_pages, value_pages, sinks):
      paged = cache._replace(key_pages=key_pages, value_pages=value_pages)
      out, _ = decode.attention(q[:, :1], k64[:, 4:5], v64[:, 4:5], paged, sinks=sinks, block_kv=4)
      return out

    # Jitted: check_grads' evaluations reuse one compiled program instead of each running
    # the call's operations one by one.
    jax.test_util.check_grads(
      jax.jit(attend), (q64, cache.key_pages, cache.value_pages, sinks), order=1, modes=["rev"]
    )


def test_scores_masks_bias_and_sinks_on_a_paged_cache():
  """ALiBi and a window shifted by the old lengths, a bias and sinks: as contiguous."""
  N, K, w = 4, 2, 3
  q, k, v = _sequence(N, K)
  alibi = scores.alibi(jnp.array([0.5, 0.25, 0.125, 0.0625]))
  bias = np.asarray(normal((B, N, L, L), seed=5))  # NumPy: sliced and padded without programs
  sinks = jnp.array([0.0, 1.0, -1.0, 0.5])
  S = PAGE * PAGES_PER_ROW

  @jax.jit
  def chunk(q, k, v, cache, bias):
    lengths = cache.lengths
    shifted = lambda s, b, h, qi, kv: alibi(s, b, h, qi + lengths[b], kv)
    window = masks.from_fn(lambda b, h, qi, kv: kv >= qi + lengths[b] - w)
    return decode.attention(
      q, k, v, cache, score_fn=shifted, mask=window, bias=bias, sinks=sinks, block_kv=4
    )

  cache, outs, start = _paged(K), [], 0
  for t in (3, 3, 3):  # chunks of one length: one program decodes them all
    part = slice(start, start + t)
    b = np.pad(bias[:, :, part], ((0, 0), (0, 0), (0, 0), (0, S - L)))
    out, cache = chunk(q[:, part], k[:, part], v[:, part], cache, b)
    outs.append(out)
    start += t
  want = jattn.dot_product_attention(
    q, k, v, bias=bias, is_causal=True, score_fn=alibi, local_window_size=(w, 0), sinks=sinks
  )
  assert_close(np.concatenate(outs, axis=1), want)


# The default run keeps a mask and a bias in one call each; both with chunked decoding against a
# contiguous cache is exhaustive.
@pytest.mark.parametrize(
  "given", ["mask", "bias", pytest.param("both", marks=pytest.mark.exhaustive)]
)
def test_a_mask_or_bias_of_a_max_length_rounded_up_to_pages_fits(given):
  """Rows of 3 pages of 4 slots hold 12 tokens, but a mask or bias sized to 10 slots (the
  max_length a Flax module's init_cache(B, 10, page_size=4) asks for) fits: it is padded,
  slots 10 and 11 masked, and the outputs equal a contiguous cache of max_length 10.

  Each case checks 11 tokens in one call against the float64 formula (slot 10 masked by the
  mask's padding, the bias's, or both); "both" also decodes in chunks against a contiguous
  cache (the same padding of each array, step by step: six programs, not run three times)."""
  N, K, R = 4, 2, 10
  q, k, v = _sequence(N, K, length=11)
  rng = np.random.default_rng(0)
  mask = (rng.random((B, 1, 11, R)) < 0.6) | np.eye(11, R, dtype=bool)  # keeps each own token
  bias = normal((B, N, 11, R), seed=5)
  kw = lambda rows: {
    name: x[:, :, rows] for name, x in (("mask", mask), ("bias", bias)) if given in (name, "both")
  }
  paged = decode.init_paged(6, 4, B, 3, K, H)
  # Chunks of a 9-token sequence: as a contiguous cache of max_length 10.
  outs = {}
  caches = (("paged", paged), ("contiguous", decode.init(B, R, K, H)))
  for name, cache in caches if given == "both" else ():
    got, start = [], 0
    for t in (5, 1, 3):
      part = slice(start, start + t)
      out, cache = _step(q[:, part], k[:, part], v[:, part], cache, **kw(part), block_kv=4)
      got.append(out)
      start += t
    outs[name] = jnp.concatenate(got, axis=1)
  if outs:
    assert_close(outs["paged"], outs["contiguous"])
  # 11 tokens in the paged rows: no query sees slot 10, its own included.
  out, _ = _step(q, k, v, paged, **kw(slice(None)), block_kv=4)
  allowed = causal_np(11, 11) & (np.arange(11) < R)  # keys: the 11 tokens in slots 0..10
  padded = {name: np.pad(x, [(0, 0)] * 3 + [(0, 1)]) for name, x in kw(slice(None)).items()}
  if "mask" in padded:
    allowed = allowed & padded["mask"]
  want = attention_np(q, k, v, allowed=allowed, bias=padded.get("bias"))[0]
  assert_close(out, want)
  if outs:
    assert_close(outs["paged"], want[:, :9])


def test_work_grows_with_the_pages_in_use_not_the_table():
  """A step over a few pages of a long page table compiles to the same scratch memory as
  one over a short table: only visited tiles are gathered."""
  N, K = 4, 2
  q, k, v = _sequence(N, K, length=1)

  def temp_bytes(max_pages):
    cache = decode.init_paged(8, PAGE, B, max_pages, K, H)
    step = jax.jit(lambda q, k, v, c: decode.attention(q, k, v, c, block_kv=PAGE)[0])
    return step.lower(q, k, v, cache).compile().memory_analysis().temp_size_in_bytes

  short, long = temp_bytes(4), temp_bytes(1024)
  assert long < short + 64 * 1024, (short, long)  # the (B, M) table and schedule only


def _storage_bound(dtype, x):
  """The documented bound on each element's storage error (docs/decoding.md), with float32's
  rounding of the scale and the product on top."""
  top = np.max(np.abs(x), axis=-1, keepdims=True)
  if dtype == jnp.int8:
    return 0.5 / 127 * top * (1 + 1e-6)
  return (2.0**-4 * np.abs(x) + 2.0**-10 * top / 448) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_storage_error_bounds(dtype):
  """Each stored vector reads back within the format's rounding: int8 to 0.5/127 of the
  vector's largest element, float8 to 2^-4 of each element (3 mantissa bits) plus 2^-10 of
  the scale (e4m3's subnormal spacing, 2^-9, for elements below 2^-6 of the scale)."""
  K = 2
  _, k, v = _sequence(2, K, length=6)
  k = k * jnp.array([1.0, 100.0])[None, None, :, None]  # scales per head differ
  for cache in (decode.init(B, 8, K, H, dtype=dtype), _paged(K, dtype=dtype)):
    cache = decode.update(cache, k, v)
    if isinstance(cache, decode.PagedKVCache):
      stored = _rows(cache, cache.key_pages)[:, :6]
      scale = _rows(cache, cache.key_scale)[:, :6]
    else:
      stored, scale = cache.key[:, :6], cache.key_scale[:, :6]
    assert stored.dtype == dtype and scale.dtype == np.float32
    back = np.asarray(stored, np.float32) * np.asarray(scale)[..., None]
    err = np.abs(back - np.asarray(k))
    assert (err <= _storage_bound(dtype, np.asarray(k))).all()
  # Elements far below their vector's largest: e4m3's subnormals, where the relative
  # bound alone fails (2e-5 and 1e-6 come back 9% and 100% off) and the absolute term holds.
  small = np.full((B, 1, K, H), 1e-6, np.float32)
  small[..., 0], small[..., 1] = 1.0, 2e-5
  cache = decode.update(decode.init(B, 4, K, H, dtype=dtype), jnp.asarray(small), v[:, :1])
  back = np.asarray(cache.key[:, :1], np.float32) * np.asarray(cache.key_scale[:, :1])[..., None]
  err = np.abs(back - small)
  assert (err <= _storage_bound(dtype, small)).all()
  if dtype == jnp.float8_e4m3fn:
    assert (err[..., 1:] > 2.0**-4 * small[..., 1:]).any()  # the absolute term is needed
  zero = decode.update(decode.init(B, 4, K, H, dtype=dtype), jnp.zeros((B, 1, K, H)), v[:, :1])
  np.testing.assert_array_equal(zero.key_scale[:, 0], 0.0)
  np.testing.assert_array_equal(np.asarray(zero.key[:, 0], np.float32), 0.0)


# The default run keeps int8 storage (float8's rounding is bounded in the default run by
# test_quantized_storage_error_bounds); decoding through a float8 cache is exhaustive.
@pytest.mark.parametrize(
  "dtype, rel_rms",
  [
    pytest.param(jnp.int8, 1e-2, id="int8"),
    pytest.param(jnp.float8_e4m3fn, 6e-2, id="fp8", marks=pytest.mark.exhaustive),
  ],
)
def test_quantized_caches_attend_close_to_the_float_cache(dtype, rel_rms):
  """Decoding through an int8 / float8 cache (paged and contiguous; float32 and bfloat16
  activations) against the float32 formula: relative RMS error within what the storage's
  rounding allows (measured: see docs/decoding.md)."""
  N, K = 4, 2
  q, k, v = _sequence(N, K)
  want = attention_np(q, k, v, allowed=causal_np(L, L))[0]
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  # 12 slots in tiles of 8 (the last tile runs past the rows), and pages in tiles of 2; chunks
  # of one length, so that one program per cache decodes them all.
  for cache, block in ((decode.init(B, 12, K, H, dtype=dtype), 8), (_paged(K, dtype=dtype), 4)):
    got, cache = _run(q, k, v, cache, (3, 3, 3), block_kv=block)
    assert got.dtype == np.float32 and cache.lengths.tolist() == [L, L]
    assert rms(np.asarray(got) - want) < rel_rms * rms(want)
  got, _ = _run(*(x.astype(jnp.bfloat16) for x in (q, k, v)), _paged(K, dtype=dtype), (9,))
  assert got.dtype == jnp.bfloat16
  assert rms(np.asarray(got, np.float32) - want) < (rel_rms + 2**-8) * rms(want)


def test_quantized_cache_gradients_reach_the_query_only():
  """The query's gradient is that of attention over the dequantized keys and values; the
  keys and values written get none (a quantized cache is for inference)."""
  N, K = 4, 2
  q, k, v = _sequence(N, K, length=4)
  empty = decode.init(B, 4, K, H, dtype=jnp.int8)

  def loss(q, k, v):
    out, _ = decode.attention(q, k, v, empty)
    return jnp.sum(out * jnp.arange(H)[None, None, None, :])

  d_q, d_k, d_v = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  np.testing.assert_array_equal(d_k, 0.0)
  np.testing.assert_array_equal(d_v, 0.0)
  cache = decode.update(empty, k, v)
  k_read, v_read = (
    np.asarray(x, np.float32) * np.asarray(s)[..., None]
    for x, s in ((cache.key, cache.key_scale), (cache.value, cache.value_scale))
  )
  want = jax.jit(
    jax.grad(
      lambda q: jnp.sum(
        attention_jnp(q, k_read, v_read, allowed=causal_np(4, 4))[0]
        * jnp.arange(H)[None, None, None, :]
      )
    )
  )(q)
  assert_close(d_q, want)


def _good():
  return _paged(2)


ERRORS = [
  (
    "num_pages",
    lambda: decode.init_paged(0, 2, B, 3, 2, H),
    ValueError,
    r"num_pages must be >= 1, got 0",
  ),
  (
    "page_size",
    lambda: decode.init_paged(4, 1.5, B, 3, 2, H),
    TypeError,
    r"page_size must be an int, got 1.5",
  ),
  (
    "max_pages_per_seq",
    lambda: decode.init_paged(4, 2, B, 0, 2, H),
    ValueError,
    r"max_pages_per_seq must be >= 1, got 0",
  ),
  (
    "paged_dtype",
    lambda: decode.init_paged(4, 2, B, 3, 2, H, dtype=jnp.uint8),
    TypeError,
    r"dtype must be a floating dtype, int8 or float8_e4m3fn, got uint8",
  ),
  (
    "release_rows",
    lambda: decode.release(_good(), jnp.array([1, 0])),
    ValueError,
    r"rows must be a boolean array of shape \(B,\)=\(2,\), got int32\(2,\)",
  ),
  (
    "release_cache",
    lambda: decode.release((1, 2), jnp.array([True, False])),
    TypeError,
    r"cache must be a jattn.decode.KVCache or PagedKVCache",
  ),
  (
    "implementation",
    lambda: decode.attention(*_sequence(4, 2, length=1), _good(), implementation="xla"),
    ValueError,
    r"implementation='xla' cannot read a paged cache: attention over one runs blockwise",
  ),
  (
    "implementation_quantized",
    lambda: decode.attention(
      *_sequence(4, 2, length=1), decode.init(B, 4, 2, H, dtype=jnp.int8), implementation="xla"
    ),
    ValueError,
    r"implementation='xla' cannot read a quantized \(int8\) cache",
  ),
  (
    "autodiff_quantized",
    lambda: decode.attention(
      *_sequence(4, 2, length=1), decode.init(B, 4, 2, H, dtype=jnp.int8), backward="autodiff"
    ),
    ValueError,
    r"backward='autodiff' cannot read a quantized \(int8\) cache: attention over one runs "
    r"blockwise, reading it tile by tile, and has no autodiff rule",
  ),
  (
    "autodiff_paged",
    lambda: decode.attention(*_sequence(4, 2, length=1), _good(), backward="autodiff"),
    ValueError,
    r"backward='autodiff' cannot read a paged cache: .* \(backward=None or 'custom_vjp'\)",
  ),
  (
    "block_kv",
    lambda: decode.attention(*_sequence(4, 2, length=1), _good(), block_kv=3),
    ValueError,
    r"block_kv must be a multiple of the cache's page_size=2 \(a tile is whole pages\), got 3",
  ),
  (
    "page_table",
    lambda: decode.update(
      _good()._replace(page_table=jnp.full((B, 6), POOL)), *_sequence(2, 2, 1)[1:]
    ),
    ValueError,
    r"cache.page_table must hold page ids in \[0, num_pages=10\) or -1, got 10 .. 10",
  ),
  (
    "free",
    lambda: decode.update(_good()._replace(free=jnp.ones((3,), bool)), *_sequence(2, 2, 1)[1:]),
    ValueError,
    r"cache.free must be a boolean array of shape \(num_pages,\)=\(10,\), got bool\(3,\)",
  ),
  (
    "key_scale_missing",
    lambda: decode.update(
      decode.init(B, 4, 2, H, dtype=jnp.int8)._replace(key_scale=None), *_sequence(2, 2, 1)[1:]
    ),
    ValueError,
    r"cache.key_scale must be a float32 array of shape \(2, 4, 2\) for a int8 cache, got None",
  ),
  (
    "scale_on_float",
    lambda: decode.update(
      decode.init(B, 4, 2, H)._replace(value_scale=jnp.ones((B, 4, 2))), *_sequence(2, 2, 1)[1:]
    ),
    ValueError,
    r"cache.value_scale must be None for a float32 cache",
  ),
  (
    "quantized_input_dtype",
    lambda: decode.update(
      decode.init(B, 4, 2, H, dtype=jnp.int8), *[jnp.ones((B, 1, 2, H), jnp.int32)] * 2
    ),
    TypeError,
    r"key must have a floating dtype \(the cache quantizes it\), got int32",
  ),
  (
    "quantized_query_dtype",
    lambda: decode.attention(
      jnp.ones((B, 1, 4, H), jnp.bfloat16),
      *_sequence(2, 2, 1)[1:],
      decode.init(B, 4, 2, H, dtype=jnp.int8),
    ),
    TypeError,
    r"query must have key's dtype float32, got bfloat16",
  ),
]


@pytest.mark.parametrize("fn, error, match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(fn, error, match):
  with pytest.raises(error, match=match):
    fn()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=["float32", "int8"])
def test_the_interleaved_pool_holds_and_attends_as_the_separate_ones(dtype):
  """kv_layout="interleaved": one pool (P, page_size, 2K, H) with key head k at head 2k and
  its values at 2k + 1 (the layout JAX's TPU ragged paged attention reads). Writes put the
  same numbers where the separate pools put them; decode.attention, ragged_attention and
  their gradients give what the separate pools give."""
  K, N = 2, 4
  pools = [
    decode.init_paged(8, 2, B, 4, K, H, dtype=dtype, kv_layout=kv)
    for kv in ("separate", "interleaved")
  ]
  assert pools[1].key_pages.shape == (8, 2, 2 * K, H) and pools[1].value_pages is None
  assert pools[1].interleaved and not pools[0].interleaved
  q, k, v = normal((B, 3, N, H), seed=1), normal((B, 3, K, H), seed=2), normal((B, 3, K, H), seed=3)
  outs = []
  for i, cache in enumerate(pools):
    out, cache = decode.attention(q, k, v, cache, num_new=jnp.array([3, 2]))
    outs.append(out)
    pools[i] = cache
  np.testing.assert_array_equal(outs[0], outs[1])
  sep, inter = pools
  np.testing.assert_array_equal(inter.key_pages[:, :, 0::2], sep.key_pages)
  np.testing.assert_array_equal(inter.key_pages[:, :, 1::2], sep.value_pages)
  if dtype == jnp.int8:
    np.testing.assert_array_equal(inter.key_scale, sep.key_scale)
  tokens = normal((5, N, H), seed=4), normal((5, K, H), seed=5), normal((5, K, H), seed=6)
  cu = jnp.array([0, 1, 5])

  def step(cache):
    def loss(q, k, v):
      out, _ = decode.ragged_attention(q, k, v, cache, cu)
      return jnp.sum(out**2), out

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(*tokens)

  (_, got), grads = step(inter)
  (_, want), want_grads = step(sep)
  np.testing.assert_array_equal(got, want)
  for g, w in zip(grads, want_grads, strict=True):
    assert_close(g, w)
  with pytest.raises(ValueError, match="kv_layout must be 'separate' or 'interleaved'"):
    decode.init_paged(8, 2, B, 4, K, H, kv_layout="split")
  with pytest.raises(ValueError, match="value_head_dim must be head_dim"):
    decode.init_paged(8, 2, B, 4, K, H, value_head_dim=8, kv_layout="interleaved")
  odd = inter._replace(key_pages=inter.key_pages[:, :, :3])
  with pytest.raises(ValueError, match="an even number of heads in the interleaved layout"):
    decode.attention(q[:, :1], k[:, :1], v[:, :1], odd)
