"""jattn.nnx: the attention_fn adapter and MultiHeadAttention against Flax NNX, decoding, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import RULES, assert_close, normal

import jattn
import jattn.nnx
from jattn import positional

B, T, F = 2, 6, 16


def _x(shape=(B, T, F), seed=0):
  return normal(shape, np.float32, seed)


def _flax_mha(**kw):
  kw = dict(num_heads=4, in_features=F, decode=False, rngs=nnx.Rngs(0)) | kw
  return nnx.MultiHeadAttention(**kw)


def _ours_from(theirs, **kw):
  """A jattn module with theirs' configuration and parameters."""
  ours = jattn.nnx.MultiHeadAttention(
    theirs.num_heads,
    theirs.in_features,
    num_kv_heads=theirs.num_kv_heads,
    qkv_features=theirs.qkv_features,
    out_features=theirs.out_features,
    in_kv_features=theirs.in_kv_features,
    rngs=nnx.Rngs(7),
    **kw,
  )
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return ours


def _with_adapter(theirs, fn=jattn.nnx.attention_fn):
  twin = nnx.clone(theirs)
  twin.attention_fn = fn
  return twin


def _padding_mask():
  keep = np.array([[1] * T, [1] * (T - 2) + [0, 0]], bool)  # row 1 has 2 padded keys
  return jnp.asarray(keep[:, None, None, :])


# --- the attention_fn adapter -------------------------------------------------------

ADAPTER_CASES = {
  "self": (dict(), dict()),
  "gqa": (dict(num_kv_heads=2), dict()),
  "mqa": (dict(num_kv_heads=1), dict()),
  "causal": (dict(), dict(is_causal=True)),
  "padding_mask": (dict(), dict(mask=_padding_mask())),
  "cross": (dict(in_kv_features=8), dict(inputs_k=_x((B, 9, 8), seed=3))),
  "qkv_out_features": (dict(qkv_features=8, out_features=12), dict()),
}


# Every case with the default rule; blockwise (its own forward) where masks, head grouping or
# cross-attention reach it; custom_vjp, whose forward is the default's, to show the adapter
# passes the rule on, twice.
ADAPTER_FNS = {
  "plain": sorted(ADAPTER_CASES),
  "blockwise": ["causal", "cross", "gqa", "padding_mask"],
  "custom_vjp": ["padding_mask", "self"],
}


@pytest.mark.parametrize(
  "case, fn", [(case, fn) for fn, cases in ADAPTER_FNS.items() for case in cases]
)
def test_adapter_matches_flax_default(case, fn):
  ctor, call = ADAPTER_CASES[case]
  theirs = _flax_mha(**ctor)
  adapter = {
    "plain": jattn.nnx.attention_fn,
    "blockwise": functools.partial(
      jattn.nnx.attention_fn, implementation="blockwise", block_q=2, block_kv=4
    ),
    "custom_vjp": functools.partial(
      jattn.nnx.attention_fn, implementation="xla", backward="custom_vjp"
    ),
  }[fn]
  ours = _with_adapter(theirs, adapter)
  x = _x()
  assert_close(ours(x, **call), theirs(x, **call))


def test_adapter_parameter_gradients_match_flax():
  theirs = _flax_mha(num_kv_heads=2)
  ours = _with_adapter(
    theirs,
    functools.partial(jattn.nnx.attention_fn, implementation="blockwise", block_q=4, block_kv=4),
  )
  x = _x()
  loss = lambda m: jnp.sum(m(x, is_causal=True) ** 2)
  g_theirs = nnx.jit(nnx.grad(loss))(theirs)  # one program each, not one per operation
  g_ours = nnx.jit(nnx.grad(loss))(ours)
  for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs)):
    assert_close(a, b, factor=5)


def test_adapter_extra_batch_dimensions():
  q, k, v = (
    normal((2, 3, T, 4, 8)),
    normal((2, 3, 5, 2, 8), seed=1),
    normal((2, 3, 5, 2, 8), seed=2),
  )
  mask = jnp.asarray(np.random.default_rng(0).random((2, 3, 1, T, 5)) < 0.7).at[..., 0].set(True)
  want = nnx.dot_product_attention(q, k, v, mask=mask)
  assert_close(jattn.nnx.attention_fn(q, k, v, mask=mask), want)


def test_adapter_sows_flax_weights():
  theirs = _flax_mha()
  ours = _with_adapter(theirs)
  x = _x()
  w_theirs, w_ours = (_sown(m, x, is_causal=True) for m in (theirs, ours))
  assert_close(w_ours, w_theirs)


def _sown(module, *args, **kwargs):
  """The attention weights ``module`` sows in one call, captured with nnx.capture."""
  _, inter = nnx.capture(module, nnx.Intermediate)(*args, sow_weights=True, **kwargs)
  (weights,) = inter["attention_weights"].get_value()
  return weights


def _dropout_pair(broadcast: bool):
  kw = dict(dropout_rate=0.5, broadcast_dropout=broadcast, rngs=nnx.Rngs(0, dropout=1))
  return _with_adapter(_flax_mha(**kw))


def test_adapter_dropout_semantics():
  module = _dropout_pair(broadcast=True)
  x = jnp.broadcast_to(_x((1, T, F)), (B, T, F))  # identical batch rows
  plain = nnx.clone(module)
  assert_close(module(x, deterministic=True), plain(x, deterministic=True))
  y1 = module(x, deterministic=False, rngs=nnx.Rngs(dropout=5))
  y2 = module(x, deterministic=False, rngs=nnx.Rngs(dropout=5))
  y3 = module(x, deterministic=False, rngs=nnx.Rngs(dropout=6))
  np.testing.assert_array_equal(y1, y2)
  assert not np.allclose(y1, y3)
  assert not np.allclose(y1, module(x, deterministic=True))
  # broadcast_dropout=True: one pattern for every batch row (and head), as Flax.
  np.testing.assert_array_equal(y1[0], y1[1])
  per_row = _dropout_pair(broadcast=False)(x, deterministic=False, rngs=nnx.Rngs(dropout=5))
  assert not np.allclose(per_row[0], per_row[1])


def test_adapter_dropout_is_unbiased():
  q, k, v = normal((1, 3, 2, 4)), normal((1, 8, 2, 4), seed=1), normal((1, 8, 2, 4), seed=2)
  f = jax.jit(
    jax.vmap(
      lambda rng: jattn.nnx.attention_fn(
        q, k, v, dropout_rng=rng, dropout_rate=0.3, deterministic=False
      )
    )
  )
  mean = np.asarray(f(jax.random.split(jax.random.key(0), 2000))).mean(0)
  np.testing.assert_allclose(mean, jattn.nnx.attention_fn(q, k, v), atol=0.04)


def test_adapter_needs_rng_for_dropout():
  q = normal((1, 3, 2, 4))
  with pytest.raises(ValueError, match="needs dropout_rng"):
    jattn.nnx.attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)


# --- MultiHeadAttention ---------------------------------------------------------------

PARITY_CASES = {
  "mha": dict(),
  "gqa": dict(num_kv_heads=2),
  "mqa": dict(num_kv_heads=1),
  "widths": dict(qkv_features=8, out_features=12),
  "no_bias": dict(use_bias=False),
  "layernorm_qk": dict(normalize_qk=True),
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_loads_flax_parameters_and_matches(case):
  kw = PARITY_CASES[case]
  theirs = _flax_mha(**kw)
  ours = _ours_from(
    theirs,
    normalize_qk="layernorm" if kw.get("normalize_qk") else False,
    **{k: v for k, v in kw.items() if k == "use_bias"},
  )
  x = _x()
  assert_close(ours(x), theirs(x))
  assert_close(ours(x, mask=_padding_mask()), theirs(x, mask=_padding_mask()))
  assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(
    nnx.state(theirs, nnx.Param)
  )


def _reference(module, x, *, causal=True, positions=None, stored=lambda a: a, mask=None):
  """The module's math written out with its own parameters: project, RoPE, softmax, project.

  ``stored`` maps the (rotated) keys and the values to what a cache gives back; ``mask``
  (B, 1, T, T) restricts the (causal) attention further."""
  p = nnx.state(module, nnx.Param)
  proj = lambda name: (
    jnp.einsum("BTF,FNH->BTNH", x, p[name]["kernel"][...]) + p[name]["bias"][...][None, None]
  )
  q, k, v = proj("query"), proj("key"), proj("value")
  if module.rope is not None:
    pos = jnp.arange(x.shape[1]) if positions is None else positions
    q, k = module.rope(q, pos), module.rope(k, pos)
  k, v = stored(k), stored(v)
  G = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(q.shape[-1])
  if causal:
    s = jnp.where(np.tril(np.ones((1, 1, x.shape[1], x.shape[1]), bool)), s, -1e30)
  if mask is not None:
    s = jnp.where(mask, s, -1e30)
  o = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s), v)
  return jnp.einsum("BTNH,NHF->BTF", o, p["out"]["kernel"][...]) + p["out"]["bias"][...][None, None]


@pytest.mark.parametrize("K", [4, 2, 1])
def test_rope_gqa_matches_written_out_reference(K):
  m = jattn.nnx.MultiHeadAttention(
    4, F, num_kv_heads=K, is_causal=True, rope=positional.Rotary(base=100.0), rngs=nnx.Rngs(0)
  )
  x = _x()
  assert_close(m(x), _reference(m, x), factor=5)
  positions = jnp.asarray([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
  assert_close(m(x, positions=positions), _reference(m, x, positions=positions), factor=5)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_gives_the_same_values_and_parameter_gradients(rule):
  ref = jattn.nnx.MultiHeadAttention(
    4,
    F,
    num_kv_heads=2,
    is_causal=True,
    rope=positional.Rotary(),
    normalize_qk=True,
    rngs=nnx.Rngs(0),
  )
  m = jattn.nnx.MultiHeadAttention(
    4,
    F,
    num_kv_heads=2,
    is_causal=True,
    rope=positional.Rotary(),
    normalize_qk=True,
    rngs=nnx.Rngs(0),
    **RULES[rule],
  )
  x = _x()
  ids = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  loss = lambda m: jnp.sum(m(x, segment_ids=ids) ** 2)
  assert_close(m(x, segment_ids=ids), ref(x, segment_ids=ids))
  for a, b in zip(jax.tree.leaves(nnx.grad(loss)(m)), jax.tree.leaves(nnx.grad(loss)(ref))):
    assert_close(a, b, factor=10)


def test_segment_ids_equal_the_block_diagonal_mask():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  mask = jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])
  x = _x()
  assert_close(m(x, segment_ids=jnp.asarray(ids)), m(x, mask=mask))


def test_rms_qk_norm_changes_the_output_and_has_scales():
  a = jattn.nnx.MultiHeadAttention(4, F, normalize_qk="rms", rngs=nnx.Rngs(0))
  b = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  assert isinstance(a.query_ln, nnx.RMSNorm) and a.key_ln.scale.shape == (4,)
  x = _x()
  assert not np.allclose(a(x), b(x))
  # True is Flax's normalize_qk=True: LayerNorm without a bias
  flax_like = jattn.nnx.MultiHeadAttention(4, F, normalize_qk=True, rngs=nnx.Rngs(0))
  assert isinstance(flax_like.query_ln, nnx.LayerNorm) and flax_like.query_ln.bias is None


def test_sow_weights_and_eval_turns_dropout_off():
  m = jattn.nnx.MultiHeadAttention(
    4, F, is_causal=True, dropout_rate=0.3, rngs=nnx.Rngs(0, dropout=1)
  )
  x = _x()
  with pytest.raises(ValueError, match="needs deterministic"):
    m(x)
  m.eval()
  y = m(x)
  w = _sown(m, x)
  assert w.shape == (B, 4, T, T)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(np.triu(np.asarray(w)[0, 0], 1), 0.0)
  m.train()
  assert not np.allclose(m(x), y)
  assert_close(m(x, deterministic=True), y)


def test_sow_weights_needs_the_materialised_implementation():
  m = jattn.nnx.MultiHeadAttention(4, F, implementation="blockwise", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sow_weights needs the materialised weights"):
    m(_x(), sow_weights=True)


def test_unbatched_inputs():
  m = jattn.nnx.MultiHeadAttention(4, F, is_causal=True, rope=positional.Rotary(), rngs=nnx.Rngs(0))
  x = _x()
  assert_close(m(x[1]), m(x)[1])


# --- decoding ----------------------------------------------------------------------------


def _decoder(K, **kw):
  return jattn.nnx.MultiHeadAttention(
    4, F, num_kv_heads=K, is_causal=True, rope=positional.Rotary(), rngs=nnx.Rngs(0), **kw
  )


# Each head grouping decodes a schedule with a prefill, consecutive one-token steps and a
# chunk after steps, ending at T; the whole prompt as one prefill needs no other grouping.
@pytest.mark.parametrize(
  "K, chunks", [(4, (2, 1, 1, 2)), (2, (2, 1, 1, 2)), (1, (2, 1, 1, 2)), (2, (6,))]
)
def test_prefill_and_decode_equal_full_causal_attention(K, chunks):
  m = _decoder(K)
  x = _x()
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
  x = _x()
  lengths = np.array([4, 2])  # prompts, right-padded to 4
  m.init_cache(B, 8)
  prompt = m(x[:, :4], decode=True, num_new=jnp.asarray(lengths))
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
    m(_x(), decode=True)
  m.init_cache(B, 5)
  m(_x()[:, :4], decode=True)
  with pytest.raises(ValueError, match="max_length"):
    m(_x()[:, :2], decode=True)


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
  x = _x()
  full = m(x)
  m.init_cache(B, 7)
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


@pytest.mark.parametrize("chunks", [(4, 1, 1), (6,)], ids=["steps", "prefill"])
def test_a_mask_of_the_requested_max_length_fits_either_cache(chunks):
  """init_cache(B, 7, page_size=2) rounds rows up to 8 slots, but a mask sized to the 7 asked
  for works as with a contiguous cache: the same outputs, which equal the module's math."""
  m = _decoder(2)
  x = _x()
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
  want = _reference(m, x, mask=mask[:, :, :T, :T])
  assert_close(outs["paged"], want, factor=5)
  assert_close(m(x, mask=mask[:, :, :T, :T]), want, factor=5)  # the mask does mask
  assert float(jnp.abs(want - _reference(m, x)).max()) > 0.1


def _int8_roundtrip(a):
  """What an int8 cache gives back, from the formula: per (token, head) absmax scale."""
  a = np.asarray(a, np.float64)
  scale = np.abs(a).max(-1, keepdims=True) / 127
  return jnp.asarray(np.round(a / np.where(scale > 0, scale, 1)) * scale, jnp.float32)


def test_int8_cache_is_close_to_the_float_cache():
  m = _decoder(2)
  x = _x()
  m.init_cache(B, 7)
  exact = _decode_steps(m, x)
  m.init_cache(
    batch_size=B, max_length=7, dtype=jnp.int8
  )  # the module computes in float32, the cache holds int8
  assert m.cache.key.dtype == jnp.int8 and m.cache.key_scale.shape == (B, 7, 2)
  got = _decode_steps(m, x)
  # Against the module's math on int8-rounded keys and values: equal up to float32 rounding.
  assert_close(got, _reference(m, x, stored=_int8_roundtrip), factor=5)
  # Against the float cache: each stored element is off by at most half a step, 1/254 of its
  # vector's largest element (0.4%); logits and values carry that error into the output, which
  # the projections mix, so 2% of the output's size bounds it with room. It is not zero: the
  # cache did round.
  error = float(jnp.abs(got - exact).max()) / float(jnp.abs(exact).max())
  assert 1e-4 < error < 0.02, error


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_released_rows_restart_like_a_fresh_cache(paged):
  m = _decoder(2)
  x, z = _x(), _x(seed=5)  # row 0 serves x[0], then a new request z[0]; row 1 serves x[1]
  kw = PAGED if paged else {}
  m.init_cache(B, 7, **kw)
  _decode_steps(m, x, (4, 1))
  if paged:  # 3 pages a row hold 6 tokens: the pool has none for a 7th
    with pytest.raises(ValueError, match="out of pages"):
      m(x[:, :2], decode=True)
  m.release_cache(jnp.asarray([True, False]))
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
    m.release_cache(jnp.asarray([True, False]))
  m.init_cache(2, 8, page_size=4)
  with pytest.raises(ValueError, match=r"rows must be a boolean array of shape \(B,\)=\(2,\)"):
    m.release_cache(jnp.asarray([1, 0]))


# --- errors --------------------------------------------------------------------------------

CONSTRUCTOR_ERRORS = [
  (dict(num_heads=3, num_kv_heads=2), ValueError, r"num_heads \(3\) must be a multiple"),
  (dict(num_heads=3), ValueError, r"qkv_features \(16\) must be divisible by num_heads"),
  (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
  (
    dict(qkv_features=20, num_heads=2, rope=positional.Rotary(rotary_fraction=0.5)),
    ValueError,
    "rope",
  ),
  (dict(rope="yes"), TypeError, "rope must be a jattn.positional.Rotary"),
  (dict(normalize_qk="batchnorm"), ValueError, "normalize_qk must be one of"),
  (dict(implementation="flash"), ValueError, "implementation must be one of"),
  (dict(implementation="blockwise", backward="autodiff"), ValueError, "does not support"),
  (dict(implementation="xla", block_q=8), ValueError, "block_q and block_kv apply only"),
  (dict(dropout_rate=1.0), ValueError, r"dropout_rate must be in \[0, 1\)"),
  (dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
]


@pytest.mark.parametrize("kwargs, error, match", CONSTRUCTOR_ERRORS)
def test_constructor_errors(kwargs, error, match):
  kwargs = dict(num_heads=4, in_features=F) | kwargs
  with pytest.raises(error, match=match):
    jattn.nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))


def test_unknown_rope_scaling_is_rejected_at_construction():
  with pytest.raises(ValueError, match="kind"):
    positional.Rotary(scaling=positional.RopeScaling("cubic", 2.0))


CALL_ERRORS = [
  (dict(inputs_q=np.zeros((2, 3, 4, F), np.float32)), ValueError, r"\(B, T, F\) or \(T, F\)"),
  (dict(inputs_q=np.zeros((2, 3, F + 1), np.float32)), ValueError, "16 features"),
  (dict(inputs_kv=np.zeros((3, 3, F), np.float32)), ValueError, "same batch size"),
  (dict(num_new=np.array([1, 1])), ValueError, "num_new applies only with decode=True"),
  (
    dict(decode=True, inputs_kv=np.zeros((2, 3, F), np.float32)),
    ValueError,
    "decode=True does not take inputs_kv",
  ),
  (dict(positions=np.arange(3)), ValueError, "positions are used only by rope"),
  (dict(sow_weights=1), TypeError, "sow_weights must be a bool"),
  (
    dict(decode=True, cache_dtype=jnp.bfloat16),
    TypeError,
    r"the KV cache holds bfloat16 keys and values \(init_cache's dtype\), but this module "
    r"computes them in float32 \(module dtype=None, param_dtype=float32, inputs float32\); "
    r"call init_cache\(input_shape, dtype=float32\)",
  ),
]


@pytest.mark.parametrize("kwargs, error, match", CALL_ERRORS)
def test_call_errors(kwargs, error, match):
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  kwargs = dict(inputs_q=np.zeros((2, 3, F), np.float32)) | kwargs
  m.init_cache((2, 8, F), kwargs.pop("cache_dtype", None))
  with pytest.raises(error, match=match):
    m(**kwargs)


def test_positions_must_match_the_queries():
  m = jattn.nnx.MultiHeadAttention(4, F, rope=positional.Rotary(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="positions must have shape"):
    m(_x(), positions=np.arange(T + 1))


def test_rope_with_cross_attention_is_an_error():
  m = jattn.nnx.MultiHeadAttention(4, F, rope=positional.Rotary(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rope applies to self-attention"):
    m(_x(), _x(seed=1))
