"""jattn.nnx: the attention_fn adapter and MultiHeadAttention against Flax NNX and the
module's math, errors. Decoding: test_nnx_decode.py."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_helpers import B, F, S, T, assert_takes_every_parameter, nnx_reference, sample, sown
from reference import RULES, array, assert_close, normal

import jattn
import jattn.nnx
from jattn import positional


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


# Flax's modules as references, each call one program: eagerly, each of their operations
# compiles alone (jattn's modules jit their attention inside and run eagerly here).
_flax_call = nnx.jit(lambda m, *args, **kw: m(*args, **kw), static_argnames=("is_causal",))
_flax_sown = nnx.jit(sown, static_argnames=("is_causal",))
_reference = nnx.jit(nnx_reference)  # the module's math written out, one program


def _padding_mask():
  keep = np.array([[1] * T, [1] * (T - 2) + [0, 0]], bool)  # row 1 has 2 padded keys
  return array(keep[:, None, None, :])


# --- the attention_fn adapter -------------------------------------------------------

ADAPTER_CASES = {
  "self": (dict(), dict()),
  "gqa": (dict(num_kv_heads=2), dict()),
  "mqa": (dict(num_kv_heads=1), dict()),
  "causal": (dict(), dict(is_causal=True)),
  "padding_mask": (dict(), dict(mask=_padding_mask())),
  "cross": (dict(in_kv_features=8), dict(inputs_k=sample((B, 9, 8), seed=3))),
  "qkv_out_features": (dict(qkv_features=8, out_features=12), dict()),
}


# Every case with the default rule; blockwise (its own forward) where masks, head grouping or
# cross-attention reach it; custom_vjp, whose forward is the default's, to show the adapter
# passes the rule on, twice. The default run keeps the cases of each rule's second list; the
# others are exhaustive.
ADAPTER_FNS = {
  "plain": (sorted(ADAPTER_CASES), ["causal", "gqa"]),
  "blockwise": (["causal", "cross", "gqa", "padding_mask"], ["padding_mask"]),
  "custom_vjp": (["padding_mask", "self"], ["self"]),
}


@pytest.mark.parametrize(
  "case, fn",
  [
    pytest.param(case, fn, marks=() if case in kept else pytest.mark.exhaustive)
    for fn, (cases, kept) in ADAPTER_FNS.items()
    for case in cases
  ],
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
  x = sample()
  assert_close(ours(x, **call), _flax_call(theirs, x, **call))


def test_adapter_parameter_gradients_match_flax():
  theirs = _flax_mha(num_kv_heads=2)
  ours = _with_adapter(
    theirs,
    functools.partial(jattn.nnx.attention_fn, implementation="blockwise", block_q=4, block_kv=4),
  )
  x = sample()
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
  mask = np.random.default_rng(0).random((2, 3, 1, T, 5)) < 0.7
  mask[..., 0] = True
  mask = array(mask)
  want = jax.jit(nnx.dot_product_attention)(q, k, v, mask=mask)
  assert_close(jattn.nnx.attention_fn(q, k, v, mask=mask), want)


def test_adapter_sows_flax_weights():
  theirs = _flax_mha()
  ours = _with_adapter(theirs)
  x = sample()
  w_theirs, w_ours = _flax_sown(theirs, x, is_causal=True), sown(ours, x, is_causal=True)
  assert_close(w_ours, w_theirs)


def _dropout_pair(broadcast: bool):
  kw = dict(dropout_rate=0.5, broadcast_dropout=broadcast, rngs=nnx.Rngs(0, dropout=1))
  return _with_adapter(_flax_mha(**kw))


def test_adapter_dropout_semantics():
  module = _dropout_pair(broadcast=True)
  x = jnp.broadcast_to(sample((1, T, F)), (B, T, F))  # identical batch rows
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
  x = sample()
  assert_close(ours(x), _flax_call(theirs, x))
  assert_close(ours(x, mask=_padding_mask()), _flax_call(theirs, x, mask=_padding_mask()))
  assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(
    nnx.state(theirs, nnx.Param)
  )


@pytest.mark.parametrize("K", [4, 2, 1])
def test_rope_gqa_matches_written_out_reference(K):
  m = jattn.nnx.MultiHeadAttention(
    4, F, num_kv_heads=K, is_causal=True, rope=positional.Rotary(base=100.0), rngs=nnx.Rngs(0)
  )
  x = sample()
  assert_close(m(x), _reference(m, x), factor=5)
  positions = array([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
  assert_close(m(x, positions=positions), _reference(m, x, positions=positions), factor=5)


@nnx.jit
def _values_and_parameter_grads(m, x, ids):
  """m(x, segment_ids=ids) and the gradients of its squares' sum in m's parameters, as one
  program (defined once, so the reference module's program is compiled once for every rule)."""
  loss = lambda m: jnp.sum(m(x, segment_ids=ids) ** 2)
  return m(x, segment_ids=ids), nnx.grad(loss)(m)


# The default run keeps xla's custom_vjp; autodiff, the rule the module's default call takes at
# these sizes in the file's other tests, and blockwise (test_sharding_explicit.py's NNX module
# runs it, values and parameter gradients) are exhaustive.
@pytest.mark.parametrize(
  "rule",
  [
    r if r == "custom_vjp" else pytest.param(r, marks=pytest.mark.exhaustive) for r in sorted(RULES)
  ],
)
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
  x = sample()
  ids = array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  got, got_grads = _values_and_parameter_grads(m, x, ids)
  want, want_grads = _values_and_parameter_grads(ref, x, ids)
  assert_close(got, want)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert_close(a, b, factor=10)


def test_options_give_what_the_same_keywords_give():
  tiles = dict(implementation="blockwise", block_q=2, block_kv=4)
  by_keywords = jattn.nnx.MultiHeadAttention(4, F, is_causal=True, **tiles, rngs=nnx.Rngs(0))
  options = jattn.Options(**tiles)
  m = jattn.nnx.MultiHeadAttention(4, F, is_causal=True, options=options, rngs=nnx.Rngs(0))
  assert m.options == by_keywords.options == options and m.block_kv == 4
  x = sample()
  np.testing.assert_array_equal(m(x), by_keywords(x))
  with pytest.raises(ValueError, match="block_kv must be a multiple of page_size=3"):
    m.init_cache((B, 8, F), page_size=3)  # the cache reads the tiles from options


def test_segment_ids_equal_the_block_diagonal_mask():
  m = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  mask = array(ids[:, None, :, None] == ids[:, None, None, :])
  x = sample()
  assert_close(m(x, segment_ids=array(ids)), m(x, mask=mask))


def test_rms_qk_norm_changes_the_output_and_has_scales():
  a = jattn.nnx.MultiHeadAttention(4, F, normalize_qk="rms", rngs=nnx.Rngs(0))
  b = jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))
  assert isinstance(a.query_ln, nnx.RMSNorm) and a.key_ln.scale.shape == (4,)
  x = sample()
  assert not np.allclose(a(x), b(x))
  # True is Flax's normalize_qk=True: LayerNorm without a bias
  flax_like = jattn.nnx.MultiHeadAttention(4, F, normalize_qk=True, rngs=nnx.Rngs(0))
  assert isinstance(flax_like.query_ln, nnx.LayerNorm) and flax_like.query_ln.bias is None


def test_sow_weights_and_eval_turns_dropout_off():
  m = jattn.nnx.MultiHeadAttention(
    4, F, is_causal=True, dropout_rate=0.3, rngs=nnx.Rngs(0, dropout=1)
  )
  x = sample()
  with pytest.raises(ValueError, match="needs deterministic"):
    m(x)
  m.eval()
  y = m(x)
  w = sown(m, x)
  assert w.shape == (B, 4, T, T)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(np.triu(np.asarray(w)[0, 0], 1), 0.0)
  m.train()
  assert not np.allclose(m(x), y)
  assert_close(m(x, deterministic=True), y)


def test_sow_weights_needs_the_materialised_implementation():
  m = jattn.nnx.MultiHeadAttention(4, F, implementation="blockwise", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sow_weights needs the materialised weights"):
    m(sample(), sow_weights=True)


def test_unbatched_inputs():
  m = jattn.nnx.MultiHeadAttention(4, F, is_causal=True, rope=positional.Rotary(), rngs=nnx.Rngs(0))
  x = sample()
  assert_close(m(x[1]), m(x)[1])


# --- a drop-in for flax.nnx.MultiHeadAttention --------------------------------------------

# Defaults that differ from Flax's, as docs/flax.md says: attention_fn None is jattn's
# attention; the call's is_causal None is the module's; init_cache's dtype None is the
# module's dtype (float32 when it has none, as Flax's).
DEFAULTS_DIFFER = {"__init__": {"attention_fn"}, "__call__": {"is_causal"}, "init_cache": {"dtype"}}


@pytest.mark.parametrize("method", sorted(DEFAULTS_DIFFER))
def test_takes_every_argument_of_flaxs_module(method):
  theirs, ours = (
    inspect.signature(getattr(cls, method)).parameters
    for cls in (nnx.MultiHeadAttention, jattn.nnx.MultiHeadAttention)
  )
  assert_takes_every_parameter(theirs, ours, defaults_differ=DEFAULTS_DIFFER[method])


# (positional arguments, keywords) of both classes
SWAP_CASES = {
  "defaults": ((4, F), {}),
  "positional_widths": ((4, F, 8, 12, 2, 10), {}),  # qkv, out, num_kv_heads, in_kv_features
  "flax_options": (
    (2, F),
    dict(
      normalize_qk=True,
      use_bias=False,
      out_kernel_init=nnx.initializers.normal(0.3),
      broadcast_dropout=False,
      precision="highest",
    ),
  ),
}


def _params_equal(a, b):
  a, b = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# The default run keeps the defaults and Flax's options; the positional widths are exhaustive.
@pytest.mark.parametrize(
  "case",
  [
    pytest.param(c, marks=pytest.mark.exhaustive) if c == "positional_widths" else c
    for c in sorted(SWAP_CASES)
  ],
)
def test_swapping_flaxs_module_for_jattns_changes_nothing(case):
  args, kw = SWAP_CASES[case]
  make = lambda cls, seed: cls(*args, **kw, decode=False, rngs=nnx.Rngs(seed))
  theirs, ours = make(nnx.MultiHeadAttention, 0), make(jattn.nnx.MultiHeadAttention, 0)
  # The same parameter tree and, from the same seed, the same parameters ...
  assert _params_equal(ours, theirs)
  # ... and a checkpoint of either loads into the other.
  loaded, theirs_loaded = make(jattn.nnx.MultiHeadAttention, 1), make(nnx.MultiHeadAttention, 1)
  assert not _params_equal(loaded, theirs)
  nnx.update(loaded, nnx.state(theirs, nnx.Param))
  nnx.update(theirs_loaded, nnx.state(ours, nnx.Param))
  assert _params_equal(loaded, theirs) and _params_equal(theirs_loaded, ours)
  F_kv = theirs.in_kv_features
  x, k_in, v_in = sample(), sample((B, S, F_kv), seed=1), sample((B, S, F_kv), seed=2)
  mask = np.random.default_rng(0).random((B, 1, T, S)) < 0.6
  mask[..., 0] = True
  mask = array(mask)
  self_attention = [((x,), {}), ((x,), dict(is_causal=True))] if F_kv == F else []
  calls = self_attention + [
    ((x, k_in, v_in), {}),
    ((x, k_in), {}),
    ((), dict(inputs_q=x, inputs_k=k_in, inputs_v=v_in, mask=mask, deterministic=True)),
  ]
  for args_, kw_ in calls:
    assert_close(loaded(*args_, **kw_), _flax_call(theirs, *args_, **kw_), err_msg=str(kw_))
  assert_close(loaded(x, inputs_kv=k_in), _flax_call(theirs, x, k_in))  # jattn's inputs_k
  want = _flax_sown(theirs, x, k_in, v_in, mask=mask)
  assert_close(sown(loaded, x, k_in, v_in, mask=mask), want)


def test_decoding_after_flaxs_init_cache_equals_flaxs():
  """One token a call, as Flax decodes, with a mask over the cache's max_length slots."""
  make = lambda cls: cls(4, F, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
  theirs, ours = make(nnx.MultiHeadAttention), make(jattn.nnx.MultiHeadAttention)
  x = sample()
  theirs.init_cache(x.shape)
  ours.init_cache(x.shape, jnp.float32)
  keep = np.random.default_rng(1).random((B, 1, T, T)) < 0.6
  keep |= np.eye(T, dtype=bool)  # each query keeps its own token
  step = nnx.jit(lambda m, token, mask: m(token, mask=mask))  # a program per module, every t
  for t in range(T):
    mask = array(keep[:, :, t : t + 1])
    assert_close(step(ours, x[:, t : t + 1], mask), step(theirs, x[:, t : t + 1], mask))
  np.testing.assert_array_equal(ours.cache.lengths, [T, T])


def test_a_flax_attention_fn_computes_the_attention():
  x, mask = sample(), jnp.ones((B, 1, T, T), bool).at[1, :, 2].set(False)  # a row sees nothing
  theirs = nnx.MultiHeadAttention(4, F, decode=False, rngs=nnx.Rngs(0))
  ours = jattn.nnx.MultiHeadAttention(
    4, F, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0)
  )
  want = np.asarray(_flax_call(theirs, x, mask=mask))
  assert_close(ours(x, mask=mask), want)  # Flax's mean where nothing is seen
  jattns = np.asarray(jattn.nnx.MultiHeadAttention(4, F, rngs=nnx.Rngs(0))(x, mask=mask))
  assert not np.allclose(jattns[1, 2], want[1, 2], atol=1e-3)  # jattn's zeros
  assert_close(jattns[0], want[0])
  with pytest.raises(ValueError, match="segment_ids needs jattn's attention"):
    ours(x, segment_ids=jnp.zeros((B, T), jnp.int32))
  ours.init_cache((B, T, F))
  with pytest.raises(ValueError, match="decode=True attends over the KV cache"):
    ours(x[:, :1], decode=True)


def test_flaxs_modes_set_decode_and_deterministic():
  m = jattn.nnx.MultiHeadAttention(4, F, dropout_rate=0.5, rngs=nnx.Rngs(0, dropout=1))
  x = sample()
  view = nnx.view(m, deterministic=True, decode=True, batch_size=B, max_length=T)
  assert_close(view(x[:, :4]), m(x, deterministic=True, is_causal=True)[:, :4])
  np.testing.assert_array_equal(view.cache.lengths, [4, 4])
  m.set_attributes(decode=True, deterministic=True)  # as Flax's modules take them
  m.init_cache((B, T, F))
  assert_close(m(x[:, :2]), view(x[:, :2], decode=False, is_causal=True)[:, :2])


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
  (dict(decode="yes"), TypeError, "decode must be a bool or None, got 'yes'"),
  (
    dict(options=jattn.Options(block_q=8), block_q=8),
    ValueError,
    r"block_q given both as a keyword and in options=",
  ),
  (dict(options="xla"), TypeError, "options must be a jattn.Options or None, got str"),
  (
    dict(attention_fn="dot"),
    TypeError,
    r"attention_fn must be None \(jattn's attention\) or a function, got str",
  ),
  (
    dict(attention_fn=nnx.dot_product_attention, implementation="blockwise", block_q=8),
    ValueError,
    r"implementation='blockwise' applies to jattn's attention, which attention_fn replaces",
  ),
  (
    dict(attention_fn=nnx.dot_product_attention, sinks=True),
    ValueError,
    "sinks=True applies to jattn's attention",
  ),
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
  (dict(inputs_q=np.zeros((F,), np.float32)), ValueError, r"\(batch\.\.\., length, features\)"),
  (dict(inputs_q=np.zeros((2, 3, F + 1), np.float32)), ValueError, "16 features"),
  (dict(inputs_kv=np.zeros((3, 3, F), np.float32)), ValueError, "same batch dimensions"),
  (dict(num_new=np.array([1, 1])), ValueError, "num_new applies only with decode=True"),
  (
    dict(decode=True, inputs_kv=np.zeros((2, 4, F), np.float32)),
    ValueError,
    r"decode=True writes inputs_kv's tokens to the cache beside inputs_q's: they must have the "
    r"same length, got \(2, 4, 16\) and inputs_q \(2, 3, 16\)",
  ),
  (dict(positions=np.arange(3)), ValueError, "positions are used only by rope"),
  (dict(sow_weights=1), TypeError, "sow_weights must be a bool"),
  (dict(decode="yes"), TypeError, "decode must be a bool, got 'yes'"),
  (dict(is_causal=1), TypeError, "is_causal must be a bool, got 1"),
  (
    dict(inputs_k=np.zeros((2, 4, F), np.float32), inputs_kv=np.zeros((2, 4, F), np.float32)),
    ValueError,
    "give inputs_kv .* or inputs_k and inputs_v, not both",
  ),
  (
    dict(inputs_v=np.zeros((2, 4, F), np.float32)),
    ValueError,
    "`inputs_k` cannot be None if `inputs_v` is not None",
  ),
  (
    dict(inputs_k=np.zeros((2, 4, F), np.float32), inputs_v=np.zeros((2, 5, F), np.float32)),
    ValueError,
    r"inputs_k and inputs_v must have the same length, got \(2, 4, 16\) and \(2, 5, 16\)",
  ),
  (
    dict(decode=True, inputs_k=np.zeros((2, 5, F), np.float32)),
    ValueError,
    "decode=True writes inputs_k's tokens to the cache beside inputs_q's",
  ),
  (
    dict(decode=True, inputs_q=np.zeros((3, 1, F), np.float32)),
    ValueError,
    r"inputs_q has batch dimensions \(3,\) \(shape \(3, 1, 16\)\) but the cache was made for "
    r"\(2,\)",
  ),
  (
    dict(decode=True, num_new=np.array([1, 1])),
    ValueError,
    r"num_new needs a cache with one length per row, but this one keeps Flax's one "
    r"cache_index for all rows: call init_cache\(\.\.\., ragged=True\)",
  ),
  (
    dict(positions=np.arange(3), input_positions=np.arange(3)),
    ValueError,
    "positions and input_positions are one argument",
  ),
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
    m(sample(), positions=np.arange(T + 1))


def test_rope_with_cross_attention_is_an_error():
  m = jattn.nnx.MultiHeadAttention(4, F, rope=positional.Rotary(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rope applies to self-attention"):
    m(sample(), sample(seed=1))
