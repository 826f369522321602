"""jattn.decode.ragged_attention, the continuous-batching step: packed prefill chunks and
decode tokens of several requests against a float64 formula per request, over contiguous,
paged and quantized caches; the writes; padding and empty requests; one trace for any
split; masks and score functions at positions; gradients; errors naming the argument."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import assert_close, attention_jnp, attention_np, causal_np, normal

import jattn
from jattn import decode, masks, scores, testing

B, S, K, N, H = 3, 16, 2, 4, 8  # cache rows, max_length, heads, head dim
T = 8  # the step's token budget
# Steps of one run: a prefill chunk and a short prompt; then decode tokens beside an empty
# request and a new prompt; then one token each; padding past the last offset in each.
STEPS = ([0, 5, 7], [0, 1, 1, 4], [0, 1, 2, 3])
STATIC = ("implementation", "block_q", "return_residual", "return_max_logit", "absolute_positions")


@functools.partial(jax.jit, static_argnames=STATIC + ("mask", "score_fn", "logits_soft_cap"))
def _step(q, k, v, cache, cu, **kw):
  return decode.ragged_attention(q, k, v, cache, cu, **kw)


def _cache(kind):
  if kind == "paged":
    return decode.init_paged(12, 4, B, 4, K, H)
  dtype = {"int8": jnp.int8, "float8": jnp.float8_e4m3fn}.get(kind, jnp.float32)
  return decode.init(B, S, K, H, dtype=dtype)


def _held(cache):
  """Each row's tokens as float64 NumPy (keys, values), dequantized: what the row holds."""
  lengths = np.asarray(cache.lengths)
  if isinstance(cache, decode.PagedKVCache):
    table = np.maximum(np.asarray(cache.page_table), 0)
    kv = [np.asarray(x, np.float64)[table].reshape(B, -1, K, H) for x in cache[:2]]
  else:
    kv = [np.asarray(x, np.float64) for x in cache[:2]]
    if cache.key_scale is not None:
      kv = [x * np.asarray(s)[..., None] for x, s in zip(kv, cache[3:])]
  return [[x[b, : lengths[b]] for b in range(B)] for x in kv]


def _tokens(seed):
  return tuple(normal((T, n, H), seed=seed + i) for i, n in enumerate((N, K, K)))


def _formula(q, k, v, before, cu, *, score=None, allowed=None, xp=np, stored=None):
  """Float64 outputs and lse (T, N) per request from the formula: request r's queries over
  what row r held before and its own new keys, causally (bottom-right), padding zero.
  ``allowed(r, qpos, kvpos)`` and ``score`` (on absolute positions) optional; ``stored``,
  the rows after the step (:func:`_held`), stands for the new keys and values where the
  cache rounds them (int8)."""
  attend = attention_np if xp is np else attention_jnp
  outs, lses = [], []
  for r in range(len(cu) - 1):
    a, b = cu[r], cu[r + 1]
    if a == b:
      continue
    old_k, old_v = before[0][r], before[1][r]
    keys = xp.concatenate([xp.asarray(old_k, k.dtype), k[a:b]])[None]
    vals = xp.concatenate([xp.asarray(old_v, v.dtype), v[a:b]])[None]
    old, n = len(old_k), b - a
    if stored is not None:
      keys, vals = (x[r][None, : old + n] for x in stored)
    ok = causal_np(n, old + n, old)
    if allowed is not None:
      ok = ok & allowed(r, old + np.arange(n)[:, None], np.arange(old + n)[None, :])
    shifted = (
      None if score is None else (lambda s, _b, h, i, j, o=old, r=r: score(s, r, h, i + o, j))
    )
    out, lse = attend(q[a:b][None], keys, vals, allowed=ok, score=shifted)
    outs.append(out[0])
    lses.append(lse[0])
  pad = T - cu[-1]
  outs.append(xp.zeros((pad, N, H)))
  lses.append(xp.full((pad, N), -xp.inf))
  return xp.concatenate(outs), xp.concatenate(lses)


@pytest.mark.parametrize(
  "kind, implementation",
  [
    ("contiguous", "xla"),
    ("contiguous", "blockwise"),
    ("paged", None),
    ("int8", None),
    pytest.param("float8", None, marks=pytest.mark.exhaustive),  # int8's path, other rounding
  ],
)
def test_steps_of_mixed_requests_equal_the_formula_per_request(kind, implementation):
  """Three steps (prefill chunk, short prompt; decode tokens, an empty request, a new
  prompt; one token each) with padding: outputs and lse against the formula on what each
  row held, the rows then holding exactly the tokens given, the lengths grown."""
  cache = _cache(kind)
  kw = {} if implementation is None else dict(implementation=implementation)
  given = [[[] for _ in range(B)] for _ in range(2)]
  for i, cu in enumerate(STEPS):
    q, k, v = _tokens(10 * i)
    before = _held(cache)
    (out, lse), cache = _step(q, k, v, cache, jnp.asarray(cu), return_residual=True, **kw)
    # int8 and float8 round the new keys and values as they store them: the formula reads
    # them stored.
    stored = _held(cache) if kind in ("int8", "float8") else None
    want, want_lse = _formula(q, k, v, before, cu, stored=stored)
    assert_close(out, want)
    live = np.asarray(cu[-1] > np.arange(T))
    assert_close(np.asarray(lse)[live], want_lse[live])
    np.testing.assert_array_equal(np.asarray(out)[~live], 0.0)
    for r in range(len(cu) - 1):
      given[0][r].append(np.asarray(k[cu[r] : cu[r + 1]]))
      given[1][r].append(np.asarray(v[cu[r] : cu[r + 1]]))
  held = _held(cache)
  for which in range(2):
    for r in range(B):
      want = np.concatenate(given[which][r])
      tol = {"int8": 2e-2, "float8": 7e-2}.get(kind, 0) * np.abs(want).max()
      np.testing.assert_allclose(held[which][r], want, atol=tol)
  np.testing.assert_array_equal(cache.lengths, [7, 3, 4])


def test_one_trace_serves_any_split_and_matches_decode_attention():
  """Traced offsets: three splits of the budget, one trace (offsets of one length, B + 1:
  the requests a step lacks are empty). Each step equals decode.attention on the same
  requests padded to a (B, t) batch, sinks included."""
  traces = []
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0])

  @jax.jit
  def step(q, k, v, cache, cu):
    traces.append(1)
    return decode.ragged_attention(q, k, v, cache, cu, sinks=sinks)

  @jax.jit
  def padded(q, k, v, cache, num_new):
    return decode.attention(q, k, v, cache, num_new=num_new, sinks=sinks)

  cache = ref = _cache("paged")
  for i, cu in enumerate(STEPS):
    q, k, v = _tokens(10 * i)
    cu = cu + [cu[-1]] * (B + 1 - len(cu))
    out, cache = step(q, k, v, cache, jnp.asarray(cu))
    n = np.diff(cu).tolist()
    t = max(n)
    rows = [np.pad(np.arange(cu[r], cu[r] + n[r]), (0, t - n[r])) for r in range(B)]
    idx = np.stack([np.minimum(r, T - 1) for r in rows]).astype(np.int32)
    want, ref = padded(q[idx], k[idx], v[idx], ref, jnp.asarray(n))
    for r in range(len(cu) - 1):
      assert_close(out[cu[r] : cu[r + 1]], want[r, : n[r]])
  assert len(traces) == 1
  np.testing.assert_array_equal(cache.page_table, ref.page_table)


def test_masks_and_score_functions_see_positions():
  """A window Mask, ALiBi with a term of the batch index (the request's cache row) and a
  soft cap: by default at the token's index among its request's new tokens; with
  absolute_positions at its place in the sequence. The max logit too, against the
  formula's."""
  slopes = np.array([0.5, 0.25, 0.125, 0.0625])
  alibi = scores.alibi(jnp.asarray(slopes))
  by_row = lambda s, b, h, i, j: alibi(s, b, h, i, j) + 0.3 * b * (j % 3)  # b: the cache row
  window = masks.sliding_window(2)
  alibi_np = lambda s, b, h, i, j: s - slopes[h] * np.abs(i - j) + 0.3 * b * (j % 3)
  for absolute in (True, False):
    cache = _cache("contiguous")
    for i, cu in enumerate(STEPS[:2]):
      q, k, v = _tokens(10 * i)
      before = _held(cache)
      (out, top), cache = _step(
        q,
        k,
        v,
        cache,
        jnp.asarray(cu),
        mask=window,
        score_fn=by_row,
        absolute_positions=absolute,
        return_max_logit=True,
      )
      old = [len(x) for x in before[0]]
      # Without absolute positions the functions see i - old (the index among the new tokens).
      at = lambda r, i, o=old, a=absolute: i if a else i - o[r]
      ok = lambda r, i, j, at=at: (j >= at(r, i) - 2) & (j <= at(r, i))
      score = lambda s, r, h, i, j, at=at: alibi_np(s, r, h, at(r, i), j)
      want, _ = _formula(q, k, v, before, cu, score=score, allowed=ok)
      assert_close(out, want)
      logits = []
      for r in range(len(cu) - 1):
        for t in range(cu[r], cu[r + 1]):
          keys = np.concatenate([before[0][r], np.asarray(k[cu[r] : t + 1], np.float64)])
          s = np.einsum("nh,snh->ns", np.asarray(q[t], np.float64), np.repeat(keys, N // K, 1))
          s = s / np.sqrt(H)
          pos = old[r] + t - cu[r]
          s = score(s, r, np.arange(N)[:, None], pos, np.arange(pos + 1)[None])
          logits.append(np.where(ok(r, pos, np.arange(pos + 1))[None], s, -np.inf).max(-1))
      assert_close(np.asarray(top)[: cu[-1]], np.stack(logits))
  capped = _step(q, k, v, _cache("paged"), jnp.asarray([0, 3]), logits_soft_cap=0.5)[0]
  want, _ = _formula(
    q, k, v, [[np.zeros((0, K, H))] * B] * 2, [0, 3], score=lambda s, *_: 0.5 * np.tanh(s / 0.5)
  )
  assert_close(capped[:3], want[:3])


def test_gradients_match_autodiff_of_the_formula(x64):
  """Gradients of query, key and value through the write and the tile-by-tile read (a
  contiguous cache's rows shared by query tiles, a paged one's pages) against autodiff of
  the formula; check_grads in float64."""
  cu = [0, 3, 4, 7]
  for kind in ("contiguous", "paged"):
    cache = decode.init_paged(12, 4, B, 4, K, H, dtype=jnp.float64) if kind == "paged" else None
    cache = cache or decode.init(B, S, K, H, dtype=jnp.float64)
    warm = tuple(x.astype(jnp.float64) for x in _tokens(50))
    _, cache = decode.ragged_attention(*warm, cache, jnp.asarray([0, 2, 2, 5]))
    before = _held(cache)
    q, k, v = (x.astype(jnp.float64) for x in _tokens(60))
    w = normal((T, N, H), seed=7).astype(np.float64)

    def ours(q, k, v):
      out, _ = decode.ragged_attention(q, k, v, cache, jnp.asarray(cu), block_q=2)
      return jnp.sum(out * w)

    def plain(q, k, v):
      return jnp.sum(_formula(q, k, v, before, cu, xp=jnp)[0] * w)

    got = jax.grad(ours, (0, 1, 2))(q, k, v)
    want = jax.grad(plain, (0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
      np.testing.assert_allclose(g, r, atol=1e-10)
    check_grads(ours, (q, k, v), order=1, modes=["rev"])


def test_padding_empty_and_dropped_tokens():
  """Tokens past the last offset are not written and return zeros; a request of no tokens
  leaves its row; under jit, tokens past a row's room are dropped and their queries return
  zeros while the rest attend as without them."""
  cache = _cache("contiguous")
  q, k, v = _tokens(0)
  out, new = _step(q, k, v, cache, jnp.asarray([0, 0, 2]))
  np.testing.assert_array_equal(new.lengths, [0, 2, 0])
  np.testing.assert_array_equal(np.asarray(out)[2:], 0.0)
  np.testing.assert_array_equal(np.asarray(new.key[1, 2:]), 0.0)
  full = decode.init(B, S, K, H)._replace(lengths=jnp.array([S - 2, 0, 0], jnp.int32))
  out, new = _step(q, k, v, full, jnp.asarray([0, 5, 6]))
  np.testing.assert_array_equal(new.lengths, [S, 1, 0])
  np.testing.assert_array_equal(np.asarray(out)[2:5], 0.0)  # no room for them
  assert np.all(np.abs(np.asarray(out)[:2]) > 0) and np.all(np.abs(np.asarray(out)[5]) > 0)


@pytest.mark.parametrize(
  "change, error, match",
  [
    (dict(cu=[1, 3]), ValueError, "cu_seqlens must start at 0"),
    (dict(cu=[0, 3, 2]), ValueError, "cu_seqlens must be nondecreasing"),
    (dict(cu=[0, 9]), ValueError, "cu_seqlens ends at 9, past the T=8"),
    (dict(cu=[0, 1, 2, 3, 4]), ValueError, r"cu_seqlens must have shape \(R \+ 1,\) for R <= B=3"),
    (dict(cu=np.array([0.0, 2.0])), TypeError, "cu_seqlens must be an int array"),
    (dict(lengths=[12, 0, 0], cu=[0, 8]), ValueError, "cache row 0 would overflow"),
    (dict(cache=decode.init_paged(2, 4, B, 4, K, H), cu=[0, 5, 8]), ValueError, "out of pages"),
    (dict(mask=np.ones((T, S), bool)), TypeError, "mask must be a jattn.masks.Mask"),
    (dict(query=jnp.ones((1, T, N, H))), ValueError, r"query must have shape \(T, N, H\)"),
    (dict(key=jnp.ones((T, 1, H))), ValueError, r"key and value must have shapes \(T, K, H\)"),
    (dict(query=jnp.ones((T, 3, H))), ValueError, "must be a multiple of the cache's number"),
    (dict(is_causal=True), TypeError, "unexpected keyword argument 'is_causal'"),
    (dict(absolute_positions="yes"), TypeError, "absolute_positions must be a bool"),
  ],
)
def test_errors(change, error, match):
  args = dict(query=jnp.ones((T, N, H)), key=jnp.ones((T, K, H)), value=jnp.ones((T, K, H)))
  args["cache"] = _cache("contiguous")
  if "lengths" in change:
    args["cache"] = args["cache"]._replace(lengths=jnp.asarray(change.pop("lengths")))
  args.update(change)
  args["cu_seqlens"] = np.asarray(args.pop("cu", [0, 2]))
  with pytest.raises(error, match=match):
    decode.ragged_attention(**args)


# --- implementation="ragged_paged": JAX's TPU kernel ---------------------------------------

HK, TK = 128, 16  # the kernel's head dim (its lanes); the steps' token budget


def _kernel_cache():
  return decode.init_paged(16, 16, B, 4, K, HK, kv_layout="interleaved")


def _kernel_tokens(seed):
  return tuple(normal((TK, n, HK), seed=seed + i) for i, n in enumerate((N, K, K)))


def test_the_tpu_kernel_step_equals_the_blockwise_one():
  """implementation="ragged_paged" on an interleaved pool: three steps (a prompt chunk and
  short prompts; decode tokens beside an empty request; a soft cap; a window over absolute
  positions) equal the blockwise step on the same cache, and write the same rows. Here, under
  interpret_kernels, JAX's reference of the kernel runs on the very arguments the kernel
  would get (neither Pallas interpreter runs the kernel itself)."""
  ours = theirs = _kernel_cache()
  steps = [
    ([0, 9, 10, 14], {}),
    ([0, 1, 2, 3], dict(logits_soft_cap=2.0, scale=0.05)),
    ([0, 0, 5, 6], dict(mask=masks.sliding_window(3), absolute_positions=True)),
  ]
  for i, (cu, kw) in enumerate(steps):
    q, k, v = _kernel_tokens(10 * i)
    with testing.interpret_kernels():
      got, ours = decode.ragged_attention(
        q, k, v, ours, np.array(cu), implementation="ragged_paged", **kw
      )
    want, theirs = decode.ragged_attention(q, k, v, theirs, np.array(cu), **kw)
    assert_close(got, want)
    np.testing.assert_array_equal(np.asarray(got)[cu[-1] :], 0.0)
    np.testing.assert_array_equal(ours.lengths, theirs.lengths)
  np.testing.assert_array_equal(ours.key_pages, theirs.key_pages)


def test_the_tpu_kernel_step_lowers_to_its_kernel_and_is_an_opt_in():
  """Lowered for a TPU (v5e named, as the kernel's lowering reads the chip), the step holds
  the kernel's Mosaic call; implementation=None does not pick it (no TPU record yet)."""
  q, k, v = _kernel_tokens(0)
  cache, cu = _kernel_cache(), jnp.array([0, 9, 10, 14])

  def lowered(**kw):
    step = lambda q, k, v, c, cu: decode.ragged_attention(q, k, v, c, cu, **kw)[0]
    with testing.lowering_for("tpu", device_kind="TPU v5 lite"):
      traced = jax.jit(step).trace(q, k, v, cache, cu)
      return traced.lower(lowering_platforms=("tpu",)).as_text()

  assert "tpu_custom_call" in lowered(implementation="ragged_paged")
  assert "tpu_custom_call" not in lowered()
  choice = jattn.explain(q[None], k[None], v[None], backend="tpu")
  assert "ragged_paged" in choice.rejected
  assert (
    "decode.ragged_attention's continuous-batching step only" in choice.rejected["ragged_paged"]
  )


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(cache="separate"), "the interleaved layout"),
    (dict(cache="int8"), "float storage"),
    (dict(mask=masks.causal()), r"mask \(but masks.sliding_window"),
    (dict(mask=masks.sliding_window(2)), r"mask \(but masks.sliding_window"),  # relative
    (dict(score_fn=scores.alibi(jnp.ones(N))), r"score_fn \(but logits_soft_cap\)"),
    (dict(sinks=jnp.zeros(N)), "sinks: the kernel has none"),
    (dict(return_max_logit=True), "return_max_logit: the kernel has none"),
    (dict(block_kv=24), "block_kv must be a multiple of the cache's page_size=16"),
    (dict(backend="cpu"), "runs on TPU, and the backend is 'cpu'"),
  ],
)
def test_the_tpu_kernel_step_refuses_what_the_kernel_cannot_take(change, match):
  change = dict(change)
  q, k, v = (jnp.ones((TK, n, HK)) for n in (N, K, K))
  layout = change.pop("cache", "interleaved")
  cache = {
    "separate": lambda: decode.init_paged(16, 16, B, 4, K, HK),
    "int8": lambda: decode.init_paged(16, 16, B, 4, K, HK, dtype=jnp.int8, kv_layout="interleaved"),
  }.get(layout, _kernel_cache)()
  backend = change.pop("backend", "tpu")
  with testing.lowering_for(backend), pytest.raises(ValueError, match=match):
    decode.ragged_attention(
      q, k, v, cache, np.array([0, 2]), implementation="ragged_paged", **change
    )


# --- implementation="flex_decode": jattn's split-KV GPU kernel -----------------------------


@pytest.mark.parametrize("kv_layout", ["separate", "interleaved"])
def test_the_gpu_kernel_step_equals_the_blockwise_one(kv_layout):
  """implementation="flex_decode" in Pallas' interpreter: three steps (a prompt chunk and
  short prompts; decode tokens beside an empty request with a soft cap and a scale; a window
  over absolute positions), each row's pages split one per program (block_kv = the page
  size: four splits merged), equal the blockwise step on the same cache, either layout."""
  ours = theirs = decode.init_paged(16, 16, B, 4, K, 16, kv_layout=kv_layout)
  steps = [
    ([0, 9, 10, 14], {}),
    ([0, 1, 2, 3], dict(logits_soft_cap=2.0, scale=0.05)),
    ([0, 0, 5, 6], dict(mask=masks.sliding_window(3), absolute_positions=True)),
  ]
  for i, (cu, kw) in enumerate(steps):
    q, k, v = (normal((TK, n, 16), seed=10 * i + j) for j, n in enumerate((N, K, K)))
    with testing.interpret_kernels():
      got, ours = decode.ragged_attention(
        q, k, v, ours, np.array(cu), implementation="flex_decode", block_kv=16, **kw
      )
    want, theirs = decode.ragged_attention(q, k, v, theirs, np.array(cu), **kw)
    assert_close(got, want)
    np.testing.assert_array_equal(np.asarray(got)[cu[-1] :], 0.0)
  np.testing.assert_array_equal(ours.key_pages, theirs.key_pages)


def test_the_gpu_kernel_step_lowers_to_its_kernel_and_is_an_opt_in():
  """Lowered for CUDA, the step holds one Triton call, the kernel's; implementation=None does
  not pick it (no GPU record yet), and explain says why a dot_product_attention call is not
  its."""
  q, k, v = _kernel_tokens(0)
  cache, cu = decode.init_paged(16, 16, B, 4, K, HK), jnp.array([0, 9, 10, 14])

  def lowered(**kw):
    step = lambda q, k, v, c, cu: decode.ragged_attention(q, k, v, c, cu, **kw)[0]
    with testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
      warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
      traced = jax.jit(step).trace(q, k, v, cache, cu)
      return traced.lower(lowering_platforms=("cuda",)).as_text()

  text = lowered(implementation="flex_decode")
  assert text.count("__gpu$xla.gpu.triton") == 1 and "jattn_flex_decode" in text
  assert "__gpu$xla.gpu.triton" not in lowered()
  choice = jattn.explain(q[None], k[None], v[None], backend="gpu")
  assert "decode.ragged_attention's continuous-batching step only" in choice.rejected["flex_decode"]


@pytest.mark.parametrize(
  "cache, change, match",
  [
    ("contiguous", {}, "a paged cache"),
    ("int8", {}, "float storage"),
    ("head_dim_24", {}, "a power-of-two head dim of at least 16"),
    ("pages_of_8", {}, "pages of a power of two of at least 16 slots"),
    ("paged", dict(sinks=jnp.zeros(N)), "sinks: the kernel has none"),
    ("paged", dict(mask=masks.causal(), absolute_positions=True), r"mask \(but"),
    ("paged", dict(backend="tpu"), "runs on GPU, and the backend is 'tpu'"),
  ],
)
def test_the_gpu_kernel_step_refuses_what_the_kernel_cannot_take(cache, change, match):
  change = dict(change)
  H = 24 if cache == "head_dim_24" else 16
  q, k, v = (jnp.ones((TK, n, H)) for n in (N, K, K))
  made = {
    "contiguous": lambda: decode.init(B, 64, K, H),
    "int8": lambda: decode.init_paged(16, 16, B, 4, K, H, dtype=jnp.int8),
    "pages_of_8": lambda: decode.init_paged(16, 8, B, 8, K, H),
  }.get(cache, lambda: decode.init_paged(16, 16, B, 4, K, H))()
  backend = change.pop("backend", "gpu")
  with testing.lowering_for(backend), pytest.raises(ValueError, match=match):
    decode.ragged_attention(q, k, v, made, np.array([0, 2]), implementation="flex_decode", **change)


def test_explain_ragged_says_what_the_step_runs_and_why_not_each_kernel():
  """decode.explain_ragged: the blockwise step by default on every backend, with each fused
  kernel's reason: the opt-in on its own backend, its backend elsewhere, what it cannot take
  (sinks, the separate layout); a named kernel is the choice, or raises as the step would."""
  q, k, v = _kernel_tokens(0)
  cache, cu = _kernel_cache(), jnp.array([0, 9, 10, 14])
  for backend, own, other in (
    ("tpu", "ragged_paged", "flex_decode"),
    ("gpu", "flex_decode", "ragged_paged"),
  ):
    choice = decode.explain_ragged(q, k, v, cache, cu, backend=backend)
    assert (choice.implementation, choice.backward, choice.backend) == (
      "blockwise",
      "custom_vjp",
      backend,
    )
    assert (
      "not yet run on" in choice.rejected[own] and "reached only by name" in choice.rejected[own]
    )
    assert f"and the backend is {backend!r}" in choice.rejected[other]
  choice = decode.explain_ragged(q, k, v, cache, cu, backend="tpu", sinks=jnp.zeros(N))
  assert choice.rejected["ragged_paged"].endswith("sinks: the kernel has none")
  separate = decode.init_paged(16, 16, B, 4, K, HK)
  choice = decode.explain_ragged(q, k, v, separate, cu, backend="tpu")
  assert "the interleaved layout" in choice.rejected["ragged_paged"]
  named = decode.explain_ragged(q, k, v, cache, cu, backend="tpu", implementation="ragged_paged")
  assert (named.implementation, named.reason) == ("ragged_paged", "named by the caller")
  with pytest.raises(ValueError, match="it needs a paged cache in the interleaved layout"):
    decode.explain_ragged(q, k, v, separate, cu, backend="tpu", implementation="ragged_paged")
  xla = decode.explain_ragged(
    q[:, :, :16], k[:, :, :16], v[:, :, :16], decode.init(B, 32, K, 16), cu, implementation="xla"
  )
  assert xla.implementation == "xla" and "materialised" in xla.reason
  with pytest.raises(
    TypeError, match="explain_ragged\\(\\) got an unexpected keyword argument 'is_causal'"
  ):
    decode.explain_ragged(q, k, v, cache, cu, is_causal=True)
  # The step's own checks: a mask array (no grid to lay it over), a row without room.
  with pytest.raises(TypeError, match="mask must be a jattn.masks.Mask"):
    decode.explain_ragged(q, k, v, cache, cu, mask=jnp.ones((14, 64), bool))
  small = decode.init(B, 8, K, 16)
  with pytest.raises(ValueError, match="cache row 0 would overflow"):
    decode.explain_ragged(q[:, :, :16], k[:, :, :16], v[:, :, :16], small, cu)
