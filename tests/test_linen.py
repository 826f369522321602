"""jattn.linen: the attention_fn adapter against Flax Linen's own attention, MultiHeadAttention
against Flax's parameters and a NumPy reference. Decoding: test_linen_decode.py; errors:
test_linen_errors.py."""

import dataclasses
import functools
import inspect

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax_helpers import (
  KEY,
  B,
  F,
  S,
  T,
  abstract_init,
  assert_takes_every_parameter,
  assert_trees_close,
  causal_mask,
  fill,
  kv_padding,
  linen_reference,
  random_params,
  same_default,
  sample,
  shapes_of,
)
from reference import array, assert_close, causal_np, normal, segments_np

import jattn
import jattn.linen
import jattn.nnx
from jattn import positional

MHA = jattn.linen.MultiHeadAttention


def _flax(**kw):
  return nn.MultiHeadDotProductAttention(num_heads=4, **kw)


def _adapted(fn=jattn.linen.attention_fn, **kw):
  return nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fn, **kw)


BLOCKWISE = functools.partial(
  jattn.linen.attention_fn, implementation="blockwise", block_q=2, block_kv=3
)

# (id, attention_fn, inputs, call kwargs)
ADAPTER_CASES = [
  ("self", jattn.linen.attention_fn, lambda: (sample(),), {}),
  ("cross", jattn.linen.attention_fn, lambda: (sample(), sample((B, S, F), seed=1)), {}),
  ("causal_mask", jattn.linen.attention_fn, lambda: (sample(),), dict(mask=causal_mask((B, T)))),
  (
    "padding_mask_cross",
    jattn.linen.attention_fn,
    lambda: (sample(), sample((B, S, F), seed=1)),
    dict(mask=kv_padding(T, [S, 3], S)),
  ),
  ("batch_dims", jattn.linen.attention_fn, lambda: (sample((2, 3, T, F)),), {}),
  (
    "batch_dims_mask",
    jattn.linen.attention_fn,
    lambda: (sample((2, 3, T, F)),),
    dict(mask=causal_mask((2, 3, T))),
  ),
  ("blockwise", BLOCKWISE, lambda: (sample(),), dict(mask=causal_mask((B, T)))),
  (
    "blockwise_cross_padding",
    BLOCKWISE,
    lambda: (sample(), sample((B, S, F), seed=1)),
    dict(mask=kv_padding(T, [4, S], S)),
  ),
]


# --------------------------------------------------------------------------- adapter parity


@pytest.mark.parametrize(
  "fn, inputs, kwargs", [c[1:] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES]
)
def test_adapter_matches_flax(fn, inputs, kwargs):
  args = inputs()
  variables = random_params(_flax(), *args, **kwargs)
  expected = _flax().apply(variables, *args, **kwargs)
  got = _adapted(fn).apply(variables, *args, **kwargs)
  assert got.shape == expected.shape == args[0].shape
  assert_close(got, expected, factor=0.5)


# blockwise is exhaustive: by default the xla case takes the adapter's gradients, test_nnx's
# adapter gradients run blockwise, and test_adapter_matches_flax runs blockwise's forward here.
@pytest.mark.parametrize(
  "fn",
  [jattn.linen.attention_fn, pytest.param(BLOCKWISE, marks=pytest.mark.exhaustive)],
  ids=["xla", "blockwise"],
)
def test_adapter_param_gradients_match_flax(fn):
  x, mask = sample(), causal_mask((B, T))
  variables = random_params(_flax(), x)

  def grads(module):
    loss = lambda v: jnp.sum(module.apply(v, x, mask=mask) ** 2)
    return jax.jit(jax.grad(loss))(variables)

  assert_trees_close(grads(_adapted(fn)), grads(_flax()), tol=4e-5)


def test_adapter_unbatched_input_matches_flax():
  x = sample((T, F))
  variables = random_params(_flax(), x)
  assert_close(_adapted().apply(variables, x), _flax().apply(variables, x), factor=0.5)


def test_adapter_precision_matches_flax():
  x = sample()
  variables = random_params(_flax(), x)
  highest = jax.lax.Precision.HIGHEST
  assert_close(
    _adapted(precision=highest).apply(variables, x),
    _flax(precision=highest).apply(variables, x),
    factor=0.5,
  )


def test_adapter_under_flax_decode_matches_flax():
  """Flax's own cache (decode=True) calls attention_fn with a (B, 1, 1, max_length) mask."""
  x = sample((B, 5, F), seed=2)

  def run(module):
    shapes = abstract_init(module, x)
    variables = {
      "params": fill(shapes["params"]),
      "cache": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"]),
    }
    outs = []
    for i in range(x.shape[1]):
      y, mutated = module.apply(variables, x[:, i : i + 1], mutable=["cache"])
      variables = {**variables, **mutated}
      outs.append(y)
    return jnp.concatenate(outs, axis=1)

  assert_close(run(_adapted(decode=True)), run(_flax(decode=True)), factor=0.5)


# --------------------------------------------------------------------------- adapter dropout


def _drop(**kw):
  return _adapted(dropout_rate=0.5, **kw)


@pytest.mark.parametrize("adapter", [jattn.linen.attention_fn, jattn.nnx.attention_fn])
def test_adapters_take_the_calls_scoring_and_routing_keywords(adapter):
  """Bound with functools.partial, the adapters take jattn's Scoring and Routing keywords
  (scale and options among them) with dot_product_attention's meanings; values and
  gradients are the call's, on a float64 NumPy reference for the scale."""
  q, k, v = (normal((2, 5, 4, 8), seed=i) for i in range(3))
  fast = jattn.Options(implementation="blockwise", block_q=2, block_kv=3)
  bound = functools.partial(adapter, scale=0.3, options=fast, logits_soft_cap=5.0)
  want = jattn.dot_product_attention(q, k, v, scale=0.3, logits_soft_cap=5.0, is_causal=True)
  assert_close(bound(q, k, v, is_causal=True), want, dtype=np.float32)
  s = 5.0 * np.tanh(0.3 * np.einsum("btnh,bsnh->bnts", array(q), array(k)) / 5.0)
  s = np.where(causal_np(5, 5), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  assert_close(want, np.einsum("bnts,bsnh->btnh", p, array(v)), dtype=np.float32)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) ** 2)
  got = jax.grad(loss(lambda *a: bound(*a, is_causal=True)), (0, 1, 2))(q, k, v)
  plain = lambda *a: jattn.dot_product_attention(
    *a, scale=0.3, logits_soft_cap=5.0, is_causal=True, implementation="xla"
  )
  for g, w in zip(got, jax.grad(loss(plain), (0, 1, 2))(q, k, v)):
    assert_close(g, w, dtype=np.float32)
  with pytest.raises(ValueError, match="implementation given both as a keyword and in options"):
    functools.partial(adapter, options=fast, implementation="xla")(q, k, v)


def test_adapter_deterministic_dropout_equals_no_dropout():
  x = sample()
  variables = random_params(_flax(), x)
  plain = _adapted().apply(variables, x)
  assert_close(_drop().apply(variables, x, deterministic=True), plain)
  assert_close(_drop(deterministic=True).apply(variables, x), plain)
  dropped = _drop().apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  assert dropped.shape == plain.shape
  assert np.all(np.isfinite(dropped))
  assert not np.allclose(dropped, plain, atol=1e-3)


def test_adapter_dropout_rng_reproducible():
  x = sample()
  variables = random_params(_flax(), x)
  run = lambda seed: np.asarray(
    _drop().apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
  )
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.allclose(run(1), run(2), atol=1e-3)
  # Flax's dropout_rng= call argument takes precedence over the 'dropout' stream.
  direct = lambda seed, stream: np.asarray(
    _drop().apply(
      variables,
      x,
      deterministic=False,
      dropout_rng=jax.random.key(seed),
      rngs={"dropout": jax.random.key(stream)},
    )
  )
  np.testing.assert_array_equal(direct(3, 1), direct(3, 2))
  assert not np.allclose(direct(3, 1), direct(4, 1), atol=1e-3)


@pytest.mark.parametrize("broadcast", [True, False])
def test_adapter_broadcast_dropout_shares_pattern_across_batch(broadcast):
  x = jnp.tile(sample((1, T, F)), (3, 1, 1))  # three identical batch rows
  module = _drop(broadcast_dropout=broadcast)
  variables = random_params(_flax(), x)
  out = np.asarray(
    module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  )
  same = [np.allclose(out[0], out[b], rtol=1e-6, atol=1e-6) for b in (1, 2)]
  assert same == ([True, True] if broadcast else [False, False])


@pytest.mark.parametrize("broadcast", [True, False])
def test_adapter_broadcast_dropout_shares_pattern_across_heads(broadcast):
  # Every batch row and head sees the same q, k, v: only the dropout pattern can differ.
  q = jnp.broadcast_to(normal((1, T, 1, 8), seed=1), (2, T, 4, 8))
  k = jnp.broadcast_to(normal((1, T, 1, 8), seed=2), (2, T, 4, 8))
  v = jnp.broadcast_to(normal((1, T, 1, 8), seed=3), (2, T, 4, 8))
  out = np.asarray(
    jattn.linen.attention_fn(
      q,
      k,
      v,
      dropout_rng=jax.random.key(0),
      dropout_rate=0.5,
      deterministic=False,
      broadcast_dropout=broadcast,
    )
  )
  first = np.broadcast_to(out[:1, :, :1], out.shape)
  if broadcast:
    np.testing.assert_allclose(out, first, rtol=1e-6, atol=1e-6)
  else:
    differs = ~np.isclose(out, first, rtol=1e-6, atol=1e-6).all(axis=(1, 3))  # (B, N)
    assert differs.sum() == differs.size - 1  # all but (b, n) = (0, 0) itself


def test_adapter_dropout_needs_rng_when_called_directly():
  q = normal((B, T, 4, 8))
  with pytest.raises(ValueError, match="needs dropout_rng"):
    jattn.linen.attention_fn(q, q, q, dropout_rate=0.5, deterministic=False)
  # deterministic or rate 0: no rng needed, same as without dropout
  plain = jattn.linen.attention_fn(q, q, q)
  assert_close(jattn.linen.attention_fn(q, q, q, dropout_rate=0.5, deterministic=True), plain)


@pytest.mark.parametrize(
  "shape, mask",
  [((B, T, F), lambda: causal_mask((B, T))), ((2, 3, T, F), lambda: None), ((T, F), lambda: None)],
  ids=["causal", "batch_dims", "unbatched"],
)
def test_adapter_sow_weights_match_flax(shape, mask):
  x, mask = sample(shape), mask()
  variables = random_params(_flax(), x)
  run = lambda module: module.apply(
    variables, x, mask=mask, sow_weights=True, mutable=["intermediates"]
  )
  expected, theirs = run(_flax())
  got, ours = run(_adapted())
  assert_close(got, expected, factor=0.5)
  weights = ours["intermediates"]["attention_weights"]
  assert isinstance(weights, tuple) and len(weights) == 1
  assert weights[0].shape == shape[:-2] + (4, T, T)
  assert_trees_close(ours, theirs)


# --------------------------------------------------------------------------- MultiHeadAttention
#                                                                           vs Flax's module

# (id, Flax kwargs, our kwargs, inputs, call kwargs)
MHA_PARITY = [
  ("self", {}, {}, lambda: (sample(),), {}),
  ("cross", {}, {}, lambda: (sample(), sample((B, S, F), seed=1)), {}),
  ("mask", {}, {}, lambda: (sample(),), dict(mask=causal_mask((B, T)).astype(bool))),
  (
    "padding_cross",
    {},
    {},
    lambda: (sample(), sample((B, S, F), seed=1)),
    dict(mask=kv_padding(T, [2, S], S).astype(bool)),
  ),
  ("unbatched", {}, {}, lambda: (sample((T, F)),), {}),
  (
    "widths",
    dict(qkv_features=24, out_features=12),
    dict(qkv_features=24, out_features=12),
    lambda: (sample(),),
    {},
  ),
  ("layernorm", dict(normalize_qk=True), dict(normalize_qk="layernorm"), lambda: (sample(),), {}),
  (
    "layernorm_widths_cross",
    dict(normalize_qk=True, qkv_features=32, out_features=8),
    dict(normalize_qk="layernorm", qkv_features=32, out_features=8),
    lambda: (sample(), sample((B, S, F), seed=1)),
    dict(mask=kv_padding(T, [5, 1], S).astype(bool)),
  ),
  ("no_bias", dict(use_bias=False), dict(use_bias=False), lambda: (sample(),), {}),
]


@pytest.mark.parametrize(
  "theirs_kw, ours_kw, inputs, kwargs", [c[1:] for c in MHA_PARITY], ids=[c[0] for c in MHA_PARITY]
)
def test_mha_loads_flax_params_and_matches(theirs_kw, ours_kw, inputs, kwargs):
  args = inputs()
  theirs, ours = _flax(**theirs_kw), MHA(num_heads=4, **ours_kw)
  shapes = abstract_init(theirs, *args, **kwargs)
  assert shapes_of(abstract_init(ours, *args, **kwargs)) == shapes_of(shapes)  # same names, shapes
  variables = {"params": fill(shapes["params"])}
  expected = theirs.apply(variables, *args, **kwargs)
  got = ours.apply(variables, *args, **kwargs)
  assert got.shape == expected.shape == args[0].shape[:-1] + (ours_kw.get("out_features", F),)
  assert_close(got, expected, factor=0.5)


def test_mha_param_gradients_match_flax():
  x, mask = sample(), causal_mask((B, T)).astype(bool)
  variables = random_params(_flax(normalize_qk=True), x)

  def grads(module):
    return jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x, mask=mask) ** 2)))(variables)

  assert_trees_close(
    grads(MHA(num_heads=4, normalize_qk="layernorm")), grads(_flax(normalize_qk=True)), tol=4e-5
  )


# --------------------------------------------------------------------------- a drop-in for
#                                                           linen.MultiHeadDotProductAttention


def _fields(cls):
  return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}


def test_takes_every_field_and_argument_of_flaxs_module():
  theirs, ours = _fields(nn.MultiHeadDotProductAttention), _fields(MHA)
  assert list(ours)[: len(theirs)] == list(theirs)  # Flax's fields first, in Flax's order
  for name, default in theirs.items():
    if name != "attention_fn":  # None: jattn's attention, as docs/flax.md says
      assert same_default(ours[name], default), name
  assert_takes_every_parameter(
    inspect.signature(nn.MultiHeadDotProductAttention.__call__).parameters,
    inspect.signature(MHA.__call__).parameters,
  )


def test_the_same_key_initialises_the_same_parameters():
  x = sample()
  theirs, ours = nn.MultiHeadDotProductAttention(4, normalize_qk=True), MHA(4, normalize_qk=True)
  assert_trees_close(ours.init(KEY, x), theirs.init(KEY, x), tol=0)


# Fields of both classes
SWAP_CASES = {
  "defaults": {},
  "widths_layernorm": dict(qkv_features=8, out_features=12, normalize_qk=True),
  "flax_options": dict(
    use_bias=False,
    broadcast_dropout=False,
    force_fp32_for_softmax=True,
    out_kernel_init=nn.initializers.normal(0.3),
    precision="highest",
  ),
}


# The default run keeps the defaults and Flax's options; the widths with a layer norm are
# exhaustive.
@pytest.mark.parametrize(
  "case",
  [
    pytest.param(c, marks=pytest.mark.exhaustive) if c == "widths_layernorm" else c
    for c in sorted(SWAP_CASES)
  ],
)
def test_swapping_flaxs_module_for_jattns_changes_nothing(case):
  theirs, ours = nn.MultiHeadDotProductAttention(4, **SWAP_CASES[case]), MHA(4, **SWAP_CASES[case])
  x, k_in, v_in = sample(), sample((B, S, F), seed=1), sample((B, S, F), seed=2)
  # The same parameter tree: a checkpoint of either loads into the other as it is.
  shapes = abstract_init(theirs, x, k_in, v_in)
  assert shapes_of(abstract_init(ours, x, k_in, v_in)) == shapes_of(shapes)
  variables = {"params": fill(shapes["params"])}
  mask = np.random.default_rng(0).random((B, 1, T, S)) < 0.6
  mask[..., 0] = True
  mask = array(mask)
  for args, kwargs in [
    ((x,), {}),
    ((x, k_in, v_in), {}),
    ((x, k_in), {}),
    ((), dict(inputs_q=x, inputs_k=k_in, inputs_v=v_in, mask=mask, deterministic=True)),
  ]:
    want = theirs.apply(variables, *args, **kwargs)
    assert_close(ours.apply(variables, *args, **kwargs), want, factor=0.5, err_msg=str(kwargs))
  for m in (theirs, ours):  # the same warning
    with pytest.warns(DeprecationWarning, match="The inputs_kv arg will be deprecated soon"):
      got = m.apply(variables, x, inputs_kv=k_in)
    assert_close(got, theirs.apply(variables, x, k_in), factor=0.5)
  run = lambda m: m.apply(
    variables, x, k_in, v_in, mask=mask, sow_weights=True, mutable=["intermediates"]
  )[1]
  assert_trees_close(run(ours), run(theirs))


def test_decoding_after_flaxs_init_equals_flaxs():
  """Flax's way: init with decode=True on a full-length input, then a token a call, with a
  mask over the cache's max_length slots."""
  theirs, ours = nn.MultiHeadDotProductAttention(4, decode=True), MHA(4, decode=True)
  x = sample()
  shapes = abstract_init(theirs, x)
  params = {"params": fill(shapes["params"])}
  empty = lambda m: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_init(m, x))
  caches = [empty(m)["cache"] for m in (theirs, ours)]
  keep = np.random.default_rng(1).random((B, 1, T, T)) < 0.6
  keep |= np.eye(T, dtype=bool)  # each query keeps its own token
  for t in range(T):
    outs = []
    for i, m in enumerate((theirs, ours)):
      y, mutated = m.apply(
        {**params, "cache": caches[i]},
        x[:, t : t + 1],
        mask=array(keep[:, :, t : t + 1], jnp.float32),  # Flax's 0/1 float mask
        mutable=["cache"],
      )
      caches[i] = mutated["cache"]
      outs.append(y)
    assert_close(outs[1], outs[0], factor=0.5)
    # the same cache variables, step by step
    assert_trees_close(caches[1], caches[0], tol=1e-6)
  np.testing.assert_array_equal(caches[1]["cache_index"], T)


def test_a_flax_attention_fn_computes_the_attention():
  x, mask = sample(), jnp.ones((B, 1, T, T), bool).at[1, :, 2].set(False)  # a row sees nothing
  theirs = nn.MultiHeadDotProductAttention(4)
  variables = random_params(theirs, x)
  want = theirs.apply(variables, x, mask=mask)
  got = MHA(4, attention_fn=nn.dot_product_attention).apply(variables, x, mask=mask)
  assert_close(got, want, factor=0.5)  # Flax's mean of the values where nothing is seen
  jattns = MHA(4).apply(variables, x, mask=mask)
  assert not np.allclose(jattns[1, 2], want[1, 2], atol=1e-3)  # jattn's zeros
  # is_causal reaches an attention_fn that takes it
  causal = MHA(4, attention_fn=jattn.linen.attention_fn, is_causal=True).apply(variables, x)
  assert_close(causal, MHA(4, is_causal=True).apply(variables, x))


# --------------------------------------------------------------------------- MultiHeadAttention
#                                                                           vs NumPy reference


@pytest.mark.parametrize("K", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [None, positional.Rotary()], ids=["plain", "rope"])
def test_mha_matches_reference_causal(K, rope):
  x = sample()
  module = MHA(num_heads=4, num_kv_heads=K, is_causal=True, rope=rope)
  variables = random_params(module, x)
  assert variables["params"]["key"]["kernel"].shape == (F, K, 4)
  assert variables["params"]["value"]["kernel"].shape == (F, K, 4)
  expected = linen_reference(variables, x, allowed=causal_np(T, T), rope=rope)
  assert_close(module.apply(variables, x), expected)


def test_mha_rope_partial_rotation_and_positions():
  x = sample()
  rope = positional.Rotary(base=100.0, rotary_fraction=0.5)
  module = MHA(num_heads=2, rope=rope)  # head_dim 8, 4 channels rotate
  variables = random_params(module, x)
  assert_close(module.apply(variables, x), linen_reference(variables, x, rope=rope))
  # Shifting every position by the same amount leaves RoPE's logits unchanged.
  shifted = module.apply(variables, x, positions=jnp.arange(T) + 5)
  assert_close(shifted, module.apply(variables, x), factor=5)


def test_mha_rms_norm_matches_reference_and_differs_from_none():
  x = sample()
  module = MHA(num_heads=4, normalize_qk="rms", is_causal=True)
  variables = random_params(module, x)
  assert set(variables["params"]) == {"query", "key", "value", "out", "query_ln", "key_ln"}
  assert variables["params"]["query_ln"]["scale"].shape == (4,)
  got = module.apply(variables, x)
  assert_close(got, linen_reference(variables, x, allowed=causal_np(T, T), rms=True), factor=2)
  plain = {"params": {k: v for k, v in variables["params"].items() if not k.endswith("_ln")}}
  unnormed = MHA(num_heads=4, is_causal=True).apply(plain, x)
  assert not np.allclose(got, unnormed, atol=1e-3)
  # True is Flax's normalize_qk=True, LayerNorm without a bias: another output
  layernorm = MHA(num_heads=4, normalize_qk=True, is_causal=True).apply(variables, x)
  assert_close(
    layernorm, MHA(num_heads=4, normalize_qk="layernorm", is_causal=True).apply(variables, x)
  )
  assert not np.allclose(layernorm, got, atol=1e-3)


def test_mha_segment_ids_equal_mask():
  x = sample()
  ids = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]], np.int32)
  module = MHA(num_heads=4, is_causal=True)
  variables = random_params(module, x)
  got = module.apply(variables, x, segment_ids=array(ids))
  allowed = segments_np(ids, ids) & causal_np(T, T)
  assert_close(got, module.apply(variables, x, mask=array(segments_np(ids, ids))))
  assert_close(got, linen_reference(variables, x, allowed=allowed))
  assert not np.allclose(got, module.apply(variables, x), atol=1e-3)


def test_mha_sow_weights():
  x = sample()
  module = MHA(num_heads=4, num_kv_heads=2, is_causal=True)
  variables = random_params(module, x)
  out, state = module.apply(variables, x, sow_weights=True, mutable=["intermediates"])
  assert_close(out, module.apply(variables, x))
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (B, 4, T, T)
  assert_close(weights.sum(-1), np.ones((B, 4, T)))
  assert np.all(np.asarray(weights)[..., ~causal_np(T, T)] == 0)
  # Cross-attention weights are (B, N, T, S).
  xkv = sample((B, S, F), seed=1)
  cross = MHA(num_heads=4)
  _, state = cross.apply(
    random_params(cross, x, xkv), x, xkv, sow_weights=True, mutable=["intermediates"]
  )
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (B, 4, T, S)
  assert_close(weights.sum(-1), np.ones((B, 4, T)))
  # Without sow_weights nothing is sown.
  _, state = module.apply(variables, x, mutable=["intermediates"])
  assert "attention_weights" not in state.get("intermediates", {})


def test_mha_dropout_determinism_and_rng():
  x = sample()
  module = MHA(num_heads=4, dropout_rate=0.5)
  variables = random_params(module, x, deterministic=True)
  plain = MHA(num_heads=4).apply(variables, x)
  with pytest.raises(ValueError, match="dropout_rate > 0 needs deterministic"):
    module.apply(variables, x)
  assert_close(module.apply(variables, x, deterministic=True), plain)
  assert_close(MHA(num_heads=4, dropout_rate=0.5, deterministic=True).apply(variables, x), plain)
  with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
    module.apply(variables, x, deterministic=False)
  run = lambda seed: np.asarray(
    module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
  )
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.allclose(run(1), run(2), atol=1e-3)
  assert not np.allclose(run(1), plain, atol=1e-3)
  # the call's deterministic overrides the constructor's
  trained = MHA(num_heads=4, dropout_rate=0.5, deterministic=True)
  np.testing.assert_array_equal(
    trained.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)}), run(1)
  )
  # dropout_rng= replaces the stream
  direct = lambda seed: np.asarray(
    module.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(seed))
  )
  np.testing.assert_array_equal(direct(5), direct(5))
  assert not np.allclose(direct(5), direct(6), atol=1e-3)


@pytest.mark.parametrize("broadcast", [True, False])
def test_mha_broadcast_dropout(broadcast):
  x = jnp.tile(sample((1, T, F)), (3, 1, 1))
  module = MHA(num_heads=4, dropout_rate=0.5, broadcast_dropout=broadcast)
  variables = random_params(module, x, deterministic=True)
  out = np.asarray(
    module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  )
  same = [np.allclose(out[0], out[b], rtol=1e-6, atol=1e-6) for b in (1, 2)]
  assert same == ([True, True] if broadcast else [False, False])


def test_mha_blockwise_matches_xla():
  x = sample()
  xla = MHA(num_heads=4, num_kv_heads=2, is_causal=True, implementation="xla")
  blockwise = MHA(
    num_heads=4, num_kv_heads=2, is_causal=True, implementation="blockwise", block_q=2, block_kv=4
  )
  variables = random_params(xla, x)
  assert_close(blockwise.apply(variables, x), xla.apply(variables, x))


def test_mha_options_give_what_the_same_keywords_give():
  x = sample()
  tiles = dict(implementation="blockwise", block_q=2, block_kv=4)
  by_keywords = MHA(num_heads=4, num_kv_heads=2, is_causal=True, **tiles)
  by_options = MHA(num_heads=4, num_kv_heads=2, is_causal=True, options=jattn.Options(**tiles))
  variables = random_params(by_keywords, x)
  np.testing.assert_array_equal(by_options.apply(variables, x), by_keywords.apply(variables, x))


def test_mha_jit_apply():
  x = sample()
  module = MHA(num_heads=4, num_kv_heads=2, is_causal=True, rope=positional.Rotary())
  variables = random_params(module, x)
  assert_close(jax.jit(module.apply)(variables, x), module.apply(variables, x))
