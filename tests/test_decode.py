"""jattn.decode: prefill, chunked prefill and decode steps against full causal attention;
ragged rows, jit without retracing, gradients, overflow, argument errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_jnp, attention_np, causal_np, normal

import jattn
from jattn import decode, masks, scores

B, S, H = 2, 12, 4  # S is the cache's max_length
L = 9  # tokens per row over a whole test: a prompt and some decode steps
IMPLS = {"xla": {}, "blockwise": dict(block_q=2, block_kv=4)}
STATIC = ("implementation", "block_q", "block_kv", "return_residual", "score_fn")


@functools.partial(jax.jit, static_argnames=STATIC)
def _step(query, key, value, cache, num_new=None, mask=None, bias=None, **kw):
  return decode.attention(query, key, value, cache, num_new=num_new, mask=mask, bias=bias, **kw)


def _sequence(N, K, length=L, seed=0):
  return (
    normal((B, length, N, H), seed=seed),
    normal((B, length, K, H), seed=seed + 1),
    normal((B, length, K, H), seed=seed + 2),
  )


def _full_causal(q, k, v, **kw):
  """Full causal attention through xla, as one jitted program (eagerly, each of its
  operations compiles alone for every new shape), on the host."""
  attend = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation="xla", **kw
  )
  return np.asarray(jax.jit(attend)(q, k, v))


def _host(tree):
  """Arrays on the host, to index and compare without compiling a program per slice."""
  return jax.tree.map(np.asarray, tree)


def _run_chunks(q, k, v, chunks, implementation, **kw):
  """Feed the sequence to a fresh cache chunk by chunk; returns (outputs (B, L, N, H), cache)."""
  cache = decode.init(B, S, k.shape[2], H)
  outs, start = [], 0
  for t in chunks:
    part = slice(start, start + t)
    out, cache = _step(
      q[:, part],
      k[:, part],
      v[:, part],
      cache,
      implementation=implementation,
      **IMPLS[implementation],
      **kw,
    )
    outs.append(out)
    start += t
  return jnp.concatenate(outs, axis=1), cache


# A prefill, a step, a chunk after it and consecutive steps, for every head grouping. The
# default run keeps MHA through xla and GQA through blockwise; the other cases are exhaustive.
@pytest.mark.parametrize(
  "N, K, implementation",
  [
    pytest.param(N, K, i, id=f"{name}-{i}", marks=() if i == kept else pytest.mark.exhaustive)
    for N, K, name, kept in [(2, 2, "mha", "xla"), (4, 2, "gqa", "blockwise"), (4, 1, "mqa", None)]
    for i in IMPLS
  ],
)
def test_prefill_chunks_and_decode_steps_equal_full_causal(N, K, implementation):
  q, k, v = _sequence(N, K)
  got, cache = _host(_run_chunks(q, k, v, [3, 1, 2, 1, 1, 1], implementation))
  assert_close(got, _full_causal(q, k, v))
  assert_close(got, attention_np(q, k, v, allowed=causal_np(L, L))[0])
  np.testing.assert_array_equal(cache.lengths, [L, L])
  np.testing.assert_array_equal(cache.key[:, :L], k)
  np.testing.assert_array_equal(cache.value[:, :L], v)
  np.testing.assert_array_equal(cache.key[:, L:], 0.0)


# The default run keeps blockwise (tiles over the ragged rows); xla is exhaustive.
@pytest.mark.parametrize(
  "implementation", [pytest.param("xla", marks=pytest.mark.exhaustive), "blockwise"]
)
def test_ragged_rows_equal_per_row_causal_attention(implementation):
  N, K, t = 4, 2, 5
  prompt = np.array([5, 2], np.int32)
  q, k, v = _host(_sequence(N, K))  # sliced on the host; the jitted steps take NumPy arrays
  kw = dict(implementation=implementation, **IMPLS[implementation], return_residual=True)
  cache = decode.init(B, S, K, H)
  np.testing.assert_array_equal(decode.positions(cache, 3), [[0, 1, 2], [0, 1, 2]])
  # Prefill: row 1's prompt is right-padded from 2 to 5 tokens (padding is garbage).
  (pre, lse), cache = _step(q[:, :t], k[:, :t], v[:, :t], cache, jnp.asarray(prompt), **kw)
  pre, lse = _host((pre, lse))
  np.testing.assert_array_equal(cache.lengths, prompt)
  np.testing.assert_array_equal(np.asarray(cache.key)[1, 2:], 0.0)  # padding is never written
  np.testing.assert_array_equal(pre[1, 2:], 0.0)  # padded query rows return zeros
  assert np.all(np.isneginf(lse[1, 2:])) and np.all(np.isfinite(lse[1, :2]))
  np.testing.assert_array_equal(decode.positions(cache, 3), [[5, 6, 7], [2, 3, 4]])
  # Decode: row b's i-th generated token is token prompt[b] + i of its own sequence.
  steps = []
  for i in range(3):
    tok = prompt + i
    pick = lambda x: x[np.arange(B), tok][:, None]
    (out, _), cache = _step(pick(q), pick(k), pick(v), cache, **kw)
    steps.append(np.asarray(out)[:, 0])
  # A step where row 1 is idle (num_new 0): nothing written, its output is zeros.
  (idle, _), cache = _step(q[:, 8:9], k[:, 8:9], v[:, 8:9], cache, np.array([1, 0], np.int32), **kw)
  idle, cache = _host((idle, cache))
  np.testing.assert_array_equal(cache.lengths, prompt + [4, 3])
  np.testing.assert_array_equal(idle[1], 0.0)
  for b in range(B):
    n = int(prompt[b]) + 3
    row = lambda x: x[b : b + 1, :n]
    want = _full_causal(row(q), row(k), row(v))[0]
    assert_close(pre[b, : prompt[b]], want[: prompt[b]])
    assert_close(np.stack([s[b] for s in steps]), want[prompt[b] :])
    np.testing.assert_array_equal(cache.key[b, :n], k[b, :n])
  assert_close(idle[0, 0], _full_causal(q[:1], k[:1], v[:1])[0, 8])


def test_update_writes_each_rows_first_num_new_tokens():
  cache = decode.init(B, 6, 1, 2)
  key = jnp.arange(1, 9, dtype=jnp.float32).reshape(B, 4, 1, 1) * jnp.ones((1, 1, 1, 2))
  cache = decode.update(cache, key, -key, num_new=np.array([3, 1]))
  cache = decode.update(cache, key[:, :2], -key[:, :2])
  np.testing.assert_array_equal(cache.key[..., 0, 0], [[1, 2, 3, 1, 2, 0], [5, 5, 6, 0, 0, 0]])
  np.testing.assert_array_equal(cache.value, -cache.key)
  np.testing.assert_array_equal(cache.lengths, [5, 3])
  assert cache.lengths.dtype == jnp.int32 and cache.max_length == 6


def test_jitted_decode_step_does_not_retrace():
  N, K = 4, 2
  q, k, v = _sequence(N, K)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(query, key, value, cache):
    return decode.attention(
      query, key, value, cache, implementation="blockwise", block_q=2, block_kv=4
    )

  _, cache = decode.attention(
    q[:, :5], k[:, :5], v[:, :5], decode.init(B, S, K, H), num_new=np.array([5, 3])
  )
  outs = []
  for i in range(5, L):
    out, cache = step(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], cache)
    outs.append(out)
  assert isinstance(cache, decode.KVCache)
  np.testing.assert_array_equal(cache.lengths, [L, 7])
  q, k, v = _host((q, k, v))
  assert_close(np.concatenate(_host(outs), axis=1)[:1], _full_causal(q[:1], k[:1], v[:1])[:, 5:])


def test_gradients_match_full_sequence_autodiff(implementation="blockwise"):
  """Through the cache's scatter and blockwise's custom_vjp, against plain jnp autodiff."""
  N, K = 4, 2
  q, k, v = _sequence(N, K)
  cot = normal((B, L, N, H), seed=7)

  def loss_decode(q, k, v):
    out, _ = _run_chunks(q, k, v, [6, 1, 2], implementation)
    return jnp.sum(out * cot)

  def loss_full(q, k, v):
    return jnp.sum(attention_jnp(q, k, v, allowed=causal_np(L, L))[0] * cot)

  got = jax.jit(jax.grad(loss_decode, (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss_full, (0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    assert_close(g, w, factor=5)


def test_position_dependent_scores_masks_and_bias_with_shifted_indices():
  """ALiBi, a sliding window and a bias, shifted by the old lengths as the docs say."""
  N, K, w = 4, 2, 3
  q, k, v = _host(_sequence(N, K))  # sliced on the host; the jitted chunks take NumPy arrays
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
  alibi = scores.alibi(slopes)
  bias = np.asarray(normal((B, N, L, L), seed=5))

  @jax.jit
  def chunk(q, k, v, cache, bias):
    lengths = cache.lengths
    shifted = lambda s, b, h, qi, kv: alibi(s, b, h, qi + lengths[b], kv)
    window = masks.from_fn(lambda b, h, qi, kv: kv >= qi + lengths[b] - w)
    return decode.attention(
      q,
      k,
      v,
      cache,
      score_fn=shifted,
      mask=window,
      bias=bias,
      implementation="blockwise",
      block_q=2,
      block_kv=4,
    )

  cache, outs, start = decode.init(B, S, K, H), [], 0
  for t in (6, 3):
    part = slice(start, start + t)
    b = np.pad(bias[:, :, part], ((0, 0), (0, 0), (0, 0), (0, S - L)))
    out, cache = chunk(q[:, part], k[:, part], v[:, part], cache, b)
    outs.append(out)
    start += t
  want = _full_causal(q, k, v, bias=bias, score_fn=alibi, local_window_size=(w, 0))
  assert_close(np.concatenate(_host(outs), axis=1), want)


@pytest.mark.parametrize("implementation", list(IMPLS))
def test_absolute_positions_give_the_whole_sequences_masks_and_scores(implementation):
  """absolute_positions=True: a window Mask and ALiBi see each query's place in its
  sequence, so chunks over the cache give full causal attention with them, no shifting."""
  N, K, w = 4, 2, 3
  q, k, v = _host(_sequence(N, K))
  alibi = scores.alibi(jnp.array([0.5, 0.25, 0.125, 0.0625]))
  window = masks.sliding_window(w)

  @jax.jit
  def chunk(q, k, v, cache):
    return decode.attention(
      q,
      k,
      v,
      cache,
      score_fn=alibi,
      mask=window,
      absolute_positions=True,
      implementation=implementation,
      **IMPLS[implementation],
    )

  cache, outs, start = decode.init(B, S, K, H), [], 0
  for t in (5, 1, 3):
    part = slice(start, start + t)
    out, cache = chunk(q[:, part], k[:, part], v[:, part], cache)
    outs.append(out)
    start += t
  want = _full_causal(q, k, v, score_fn=alibi, local_window_size=(w, 0))
  assert_close(np.concatenate(_host(outs), axis=1), want)
  with pytest.raises(TypeError, match="absolute_positions must be a bool"):
    decode.attention(q[:, :1], k[:, :1], v[:, :1], decode.init(B, S, K, H), absolute_positions=1)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_query_of_no_heads_gives_the_empty_output(paged):
  """N = 0 query heads: the empty output, log-sum-exp and max logit that
  dot_product_attention gives, and the new tokens written all the same."""
  cache = decode.init_paged(4, 4, B, 2, 1, H) if paged else decode.init(B, S, 1, H)
  q, kv = jnp.ones((B, 3, 0, H)), jnp.ones((B, 3, 1, H))
  (out, lse, top), cache = decode.attention(
    q, kv, kv, cache, return_residual=True, return_max_logit=True
  )
  want = jattn.dot_product_attention(q, kv, kv, return_residual=True, return_max_logit=True)
  for got, ref in zip((out, lse, top), want, strict=True):
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
  np.testing.assert_array_equal(cache.lengths, 3)


def test_overflow_raises_when_concrete():
  cache = decode.update(
    decode.init(B, 4, 1, H), *[normal((B, 3, 1, H))] * 2, num_new=np.array([1, 3])
  )
  with pytest.raises(
    ValueError,
    match=r"cache row 1 would overflow: it holds 3 tokens and 2 "
    r"new ones make 5 > max_length=4",
  ):
    decode.update(cache, *[normal((B, 2, 1, H))] * 2)
  with pytest.raises(ValueError, match=r"cache row 1 would overflow"):
    decode.attention(normal((B, 2, 2, H)), *[normal((B, 2, 1, H))] * 2, cache)
  cache = decode.update(cache, *[normal((B, 2, 1, H))] * 2, num_new=np.array([2, 1]))
  np.testing.assert_array_equal(cache.lengths, [3, 4])  # exactly full is fine


def test_overflow_under_jit_drops_tokens_and_saturates_lengths():
  first, second = normal((B, 3, 1, H)), normal((B, 3, 1, H), seed=1)
  update = jax.jit(decode.update)
  cache = update(update(decode.init(B, 4, 1, H), first, first), second, second)
  np.testing.assert_array_equal(cache.lengths, [4, 4])
  np.testing.assert_array_equal(cache.key[:, :3], first)
  np.testing.assert_array_equal(cache.key[:, 3], second[:, 0])  # the rest is dropped
  np.testing.assert_array_equal(cache.value, cache.key)


# Every way attention reads a contiguous cache: (options, storage dtype).
READS = {
  "xla": (dict(implementation="xla"), jnp.float32),
  "blockwise": (IMPLS["blockwise"], jnp.float32),
  "autodiff": (dict(backward="autodiff"), jnp.float32),
  "int8": (IMPLS["blockwise"], jnp.int8),
}


# The default run keeps blockwise's read with the cache built inside jit; the other cases
# (xla's read, int8 storage, caches built outside) are exhaustive.
@pytest.mark.parametrize(
  "read, built",
  [
    pytest.param(
      read,
      built,
      marks=() if (read, built) == ("blockwise", "inside_jit") else pytest.mark.exhaustive,
    )
    for read in READS
    for built in ("outside_jit", "inside_jit")
  ],
)
def test_overflow_under_jit_dropped_tokens_queries_return_zeros(read, built):
  """A query whose token overflowed max_length under jit returns zeros, like a padded row,
  and has zero gradient; the rest equal the same steps on a cache with room for everything,
  given only the tokens that were kept."""
  N, K, t = 4, 2, 3
  options, dtype = READS[read]
  q, k, v = _sequence(N, K, length=5 + t)
  hq, hk, hv = _host((q, k, v))  # sliced on the host
  prompt = np.array([3, 5])  # a cache of 6 slots: row 0 keeps all 3 new tokens, row 1 one
  kept = np.array([3, 1])
  cot = normal((B, t, N, H), seed=7)
  new = lambda x: x[:, 5:]

  def prefill(max_length):
    cache = decode.init(B, max_length, K, H, dtype=dtype)
    return decode.update(cache, k[:, :5], v[:, :5], num_new=prompt)

  def loss(step_q, step_k, step_v, cache, num_new):
    if cache is None:  # built inside jit
      cache = prefill(6)
    out, cache = decode.attention(step_q, step_k, step_v, cache, num_new=num_new, **options)
    return jnp.sum(out * cot), (out, cache.lengths)

  wrt = (0, 1, 2) if dtype == jnp.float32 else (0,)  # a quantized cache takes no gradient
  grad = jax.value_and_grad(loss, wrt, has_aux=True)
  (_, (got, lengths)), got_g = _host(
    jax.jit(grad)(new(hq), new(hk), new(hv), None if built == "inside_jit" else prefill(6), None)
  )
  np.testing.assert_array_equal(lengths, [6, 6])
  # The same steps on a cache with room for everything, given the kept tokens (one program).
  (_, (want, _)), want_g = _host(
    jax.jit(lambda q, k, v: grad(q, k, v, prefill(12), kept))(new(hq), new(hk), new(hv))
  )
  np.testing.assert_array_equal(got[1, 1:], 0.0)  # dropped: zeros, like padded rows
  assert_close(got, want)
  for g, w in zip(got_g, want_g):
    np.testing.assert_array_equal(g[1, 1:], 0.0)
    assert_close(g, w, factor=5)
  if dtype == jnp.float32:  # and the kept rows are causal attention over the kept tokens
    for b in range(B):
      n = prompt[b] + kept[b]
      seq = lambda x: np.concatenate([x[b : b + 1, : prompt[b]], x[b : b + 1, 5 : 5 + kept[b]]], 1)
      ref = attention_np(seq(hq), seq(hk), seq(hv), allowed=causal_np(n, n))[0][0, prompt[b] :]
      assert_close(got[b, : kept[b]], ref)


def _cache(**kw):
  return decode.init(B, 6, 2, H, **kw)


def _kv(t=2, K=2, h=H, b=B, dtype=np.float32):
  return jnp.zeros((b, t, K, h), dtype)


def _q(t=2, N=4, h=H, b=B, dtype=np.float32):
  return jnp.zeros((b, t, N, h), dtype)


ERRORS = [
  ("max_length", lambda: decode.init(B, 0, 2, H), ValueError, r"max_length must be >= 1, got 0"),
  ("batch_type", lambda: decode.init(2.0, 4, 2, H), TypeError, r"batch_size must be an int"),
  (
    "init_dtype",
    lambda: decode.init(B, 4, 2, H, dtype=jnp.int32),
    TypeError,
    r"dtype must be a floating dtype, int8 or float8_e4m3fn, got int32",
  ),
  (
    "cache_type",
    lambda: decode.update(tuple(_cache()), _kv(), _kv()),
    TypeError,
    r"cache must be a jattn.decode.KVCache",
  ),
  (
    "cache_lengths",
    lambda: decode.update(_cache()._replace(lengths=jnp.array([0, 7])), _kv(), _kv()),
    ValueError,
    r"cache.lengths must be in \[0, max_length=6\], got \[0, 7\]",
  ),
  (
    "key_rank",
    lambda: decode.update(_cache(), _kv()[0], _kv()[0]),
    ValueError,
    r"key must have shape \(B, t, K, H\)=\(2, t, 2, 4\) like the cache, got \(2, 2, 4\)",
  ),
  (
    "key_value_shapes",
    lambda: decode.update(_cache(), _kv(), _kv(t=3)),
    ValueError,
    r"key and value must have the same shape but for the head dimension, got key "
    r"\(2, 2, 2, 4\) and value \(2, 3, 2, 4\)",
  ),
  (
    "num_kv_heads",
    lambda: decode.update(_cache(), _kv(K=1), _kv(K=1)),
    ValueError,
    r"to match the cache's \(B, max_length, K, H\)=\(2, 6, 2, 4\), got \(2, 2, 1, 4\)",
  ),
  (
    "head_dim",
    lambda: decode.update(_cache(), _kv(h=8), _kv(h=8)),
    ValueError,
    r"to match the cache's \(B, max_length, K, H\)=\(2, 6, 2, 4\), got \(2, 2, 2, 8\)",
  ),
  (
    "batch",
    lambda: decode.update(_cache(), _kv(b=3), _kv(b=3)),
    ValueError,
    r"to match the cache's \(B, max_length, K, H\)=\(2, 6, 2, 4\), got \(3, 2, 2, 4\)",
  ),
  (
    "no_tokens",
    lambda: decode.update(_cache(), _kv(t=0), _kv(t=0)),
    ValueError,
    r"1 <= t <= max_length=6 new tokens, got t=0",
  ),
  (
    "too_many_tokens",
    lambda: decode.update(_cache(), _kv(t=7), _kv(t=7)),
    ValueError,
    r"1 <= t <= max_length=6 new tokens, got t=7",
  ),
  (
    "dtype",
    lambda: decode.update(_cache(), _kv(dtype=jnp.bfloat16), _kv(dtype=jnp.bfloat16)),
    TypeError,
    r"key must have the cache's dtype float32, got bfloat16",
  ),
  (
    "value_dtype",
    lambda: decode.update(_cache(), _kv(), _kv(dtype=jnp.float16)),
    TypeError,
    r"value must have key.s dtype float32, got float16",
  ),
  (
    "num_new_shape",
    lambda: decode.update(_cache(), _kv(), _kv(), num_new=np.array([1, 1, 1])),
    ValueError,
    r"num_new must have shape \(B,\)=\(2,\), got \(3,\)",
  ),
  (
    "num_new_rank",
    lambda: decode.update(_cache(), _kv(), _kv(), num_new=1),
    ValueError,
    r"num_new must have rank 1, got shape \(\)",
  ),
  (
    "num_new_dtype",
    lambda: decode.update(_cache(), _kv(), _kv(), num_new=np.array([1.0, 1.0])),
    TypeError,
    r"num_new must have an integer dtype, got float64",
  ),
  (
    "num_new_above_t",
    lambda: decode.update(_cache(), _kv(), _kv(), num_new=np.array([3, 0])),
    ValueError,
    r"num_new must be in \[0, t=2\] \(the new tokens given\), got \[3, 0\]",
  ),
  (
    "num_new_negative",
    lambda: decode.update(_cache(), _kv(), _kv(), num_new=np.array([1, -1])),
    ValueError,
    r"num_new must be in \[0, t=2\]",
  ),
  (
    "positions_negative",
    lambda: decode.positions(_cache(), -1),
    ValueError,
    r"num_new must be >= 0, got -1",
  ),
  (
    "query_rank",
    lambda: decode.attention(_q()[0], _kv(), _kv(), _cache()),
    ValueError,
    r"query must have shape \(B, t, N, H\)=\(2, 2, N, 4\) to match key",
  ),
  (
    "query_t",
    lambda: decode.attention(_q(t=3), _kv(), _kv(), _cache()),
    ValueError,
    r"query must have shape \(B, t, N, H\)=\(2, 2, N, 4\) .* got \(2, 3, 4, 4\)",
  ),
  (
    "query_heads",
    lambda: decode.attention(_q(N=3), _kv(), _kv(), _cache()),
    ValueError,
    r"number of query heads N \(3\) must be a multiple of the cache's number of key/value "
    r"heads K \(2\)",
  ),
  (
    "query_dtype",
    lambda: decode.attention(_q(dtype=jnp.float16), _kv(), _kv(), _cache()),
    TypeError,
    r"query must have the cache's dtype float32, got float16",
  ),
  (
    "mask_dtype",
    lambda: decode.attention(_q(), _kv(), _kv(), _cache(), mask=np.ones((2, 6), np.int32)),
    TypeError,
    r"mask must be a boolean array, got dtype int32",
  ),
  (
    "mask_batch",
    lambda: decode.attention(_q(), _kv(), _kv(), _cache(), mask=masks.lengths(np.array([1, 2, 3]))),
    ValueError,
    r"mask: cannot combine masks with different batch size",
  ),
  (
    "mask_shape",
    lambda: decode.attention(_q(), _kv(), _kv(), _cache(), mask=np.ones((2, 5), bool)),
    ValueError,
    r"key/value length S=6",
  ),
  (
    "bias_shape",
    lambda: decode.attention(_q(), _kv(), _kv(), _cache(), bias=np.zeros((2, 5), np.float32)),
    ValueError,
    r"bias must be broadcastable to \(B, N, T, S\)=\(2, 4, 2, 6\)",
  ),
]


@pytest.mark.parametrize("fn, error, match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(fn, error, match):
  with pytest.raises(error, match=match):
    fn()


# The default run keeps blockwise (whose tiles read the garbage slots); xla is exhaustive.
@pytest.mark.parametrize(
  "implementation", [pytest.param("xla", marks=pytest.mark.exhaustive), "blockwise"]
)
def test_garbage_past_the_lengths_never_reaches_outputs_or_gradients(implementation):
  """A cache whose unused slots hold NaN (uninitialised memory, a finished request) gives the
  same outputs and gradients as a clean one: the slots are masked and read as zeros."""
  N, K = 4, 2
  q, k, v = _sequence(N, K)
  clean = decode.init(B, S, K, H)
  dirty = decode.KVCache(
    jnp.full_like(clean.key, jnp.nan), jnp.full_like(clean.value, jnp.nan), clean.lengths
  )
  cot = normal((B, 5, N, H), seed=7)

  def loss(q, k, v, cache):
    out, _ = _step(
      q[:, :5], k[:, :5], v[:, :5], cache, implementation=implementation, **IMPLS[implementation]
    )
    return jnp.sum(out * cot), out

  # One program for both caches (eagerly, each operation of both passes compiles alone).
  value_and_grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
  (_, want), want_g = _host(value_and_grad(q, k, v, clean))
  (_, got), got_g = _host(value_and_grad(q, k, v, dirty))
  np.testing.assert_array_equal(got, want)
  assert_close(got, attention_np(q[:, :5], k[:, :5], v[:, :5], allowed=causal_np(5, 5))[0])
  for g, w in zip(got_g, want_g):
    np.testing.assert_array_equal(g, w)
