"""jattn.linen: the attention_fn adapter against Flax Linen's own attention, MultiHeadAttention
against Flax's parameters and a NumPy reference, decoding with the Linen cache, errors."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from reference import assert_close, attention_np, causal_np, normal, segments_np

import jattn.linen
from jattn import positional

B, T, S, F = 2, 6, 9, 16  # S: length of inputs_kv in cross-attention
MHA = jattn.linen.MultiHeadAttention
KEY = jax.random.key(0)


def _x(shape=(B, T, F), seed=0):
  return normal(shape, np.float32, seed)


def _fill(shapes, seed=1):
  """Random parameters for a tree of shapes: kernels N(0, 1/fan_in), biases N(0, 0.3²),
  norm scales 1 + N(0, 0.2²). (``init`` would compile jax.random for every new shape.)"""
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    n = rng.standard_normal(s.shape)
    name, owner = path[-1].key, path[-2].key
    if name == "kernel":
      n = n / np.sqrt(np.prod(s.shape[:2]) if owner == "out" else s.shape[0])
    elif name == "scale":
      n = 1 + 0.2 * n
    else:
      n = 0.3 * n
    return jnp.asarray(n, s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _abstract_init(module, *args, **kw):
  """The shapes ``module.init(KEY, *args, **kw)`` gives, without running it."""
  return jax.eval_shape(functools.partial(module.init, **kw), KEY, *args)


def _params(module, *args, seed=1, **kw):
  """{"params": random parameters} for ``module`` called on ``args``."""
  return {"params": _fill(_abstract_init(module, *args, **kw)["params"], seed)}


def _shapes(variables):
  return jax.tree.map(lambda a: (a.shape, a.dtype), variables)


def _assert_trees_close(actual, expected, tol=2e-5):
  """Leafwise close, with an absolute tolerance scaled by the largest value in the whole tree
  (some gradients, e.g. the key bias's, are zero up to rounding)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  size = max([1.0] + [float(np.max(np.abs(e))) for e in jax.tree.leaves(expected)])
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.shape == e.shape
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * size)


def _flax(**kw):
  return nn.MultiHeadDotProductAttention(num_heads=4, **kw)


def _adapted(fn=jattn.linen.attention_fn, **kw):
  return nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fn, **kw)


def _causal(shape):
  return nn.make_causal_mask(jnp.ones(shape))


def _kv_padding(q_len, kv_lens, kv_len):
  """(B, 1, q_len, kv_len) padding mask: every query keeps keys s < kv_lens[b] (all >= 1)."""
  q_valid = jnp.ones((len(kv_lens), q_len))
  kv_valid = jnp.asarray(np.arange(kv_len)[None] < np.asarray(kv_lens)[:, None], jnp.float32)
  return nn.make_attention_mask(q_valid, kv_valid)


BLOCKWISE = functools.partial(
  jattn.linen.attention_fn, implementation="blockwise", block_q=2, block_kv=3
)

# (id, attention_fn, inputs, call kwargs)
ADAPTER_CASES = [
  ("self", jattn.linen.attention_fn, lambda: (_x(),), {}),
  ("cross", jattn.linen.attention_fn, lambda: (_x(), _x((B, S, F), seed=1)), {}),
  ("causal_mask", jattn.linen.attention_fn, lambda: (_x(),), dict(mask=_causal((B, T)))),
  (
    "padding_mask_cross",
    jattn.linen.attention_fn,
    lambda: (_x(), _x((B, S, F), seed=1)),
    dict(mask=_kv_padding(T, [S, 3], S)),
  ),
  ("batch_dims", jattn.linen.attention_fn, lambda: (_x((2, 3, T, F)),), {}),
  (
    "batch_dims_mask",
    jattn.linen.attention_fn,
    lambda: (_x((2, 3, T, F)),),
    dict(mask=_causal((2, 3, T))),
  ),
  ("blockwise", BLOCKWISE, lambda: (_x(),), dict(mask=_causal((B, T)))),
  (
    "blockwise_cross_padding",
    BLOCKWISE,
    lambda: (_x(), _x((B, S, F), seed=1)),
    dict(mask=_kv_padding(T, [4, S], S)),
  ),
]


# --------------------------------------------------------------------------- adapter parity


@pytest.mark.parametrize(
  "fn, inputs, kwargs", [c[1:] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES]
)
def test_adapter_matches_flax(fn, inputs, kwargs):
  args = inputs()
  variables = _params(_flax(), *args, **kwargs)
  expected = _flax().apply(variables, *args, **kwargs)
  got = _adapted(fn).apply(variables, *args, **kwargs)
  assert got.shape == expected.shape == args[0].shape
  assert_close(got, expected, factor=0.5)


@pytest.mark.parametrize("fn", [jattn.linen.attention_fn, BLOCKWISE], ids=["xla", "blockwise"])
def test_adapter_param_gradients_match_flax(fn):
  x, mask = _x(), _causal((B, T))
  variables = _params(_flax(), x)

  def grads(module):
    loss = lambda v: jnp.sum(module.apply(v, x, mask=mask) ** 2)
    return jax.jit(jax.grad(loss))(variables)

  _assert_trees_close(grads(_adapted(fn)), grads(_flax()), tol=4e-5)


def test_adapter_unbatched_input_matches_flax():
  x = _x((T, F))
  variables = _params(_flax(), x)
  assert_close(_adapted().apply(variables, x), _flax().apply(variables, x), factor=0.5)


def test_adapter_precision_matches_flax():
  x = _x()
  variables = _params(_flax(), x)
  highest = jax.lax.Precision.HIGHEST
  assert_close(
    _adapted(precision=highest).apply(variables, x),
    _flax(precision=highest).apply(variables, x),
    factor=0.5,
  )


def test_adapter_under_flax_decode_matches_flax():
  """Flax's own cache (decode=True) calls attention_fn with a (B, 1, 1, max_length) mask."""
  x = _x((B, 5, F), seed=2)

  def run(module):
    shapes = _abstract_init(module, x)
    variables = {
      "params": _fill(shapes["params"]),
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


def test_adapter_deterministic_dropout_equals_no_dropout():
  x = _x()
  variables = _params(_flax(), x)
  plain = _adapted().apply(variables, x)
  assert_close(_drop().apply(variables, x, deterministic=True), plain)
  assert_close(_drop(deterministic=True).apply(variables, x), plain)
  dropped = _drop().apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  assert dropped.shape == plain.shape
  assert np.all(np.isfinite(dropped))
  assert not np.allclose(dropped, plain, atol=1e-3)


def test_adapter_dropout_rng_reproducible():
  x = _x()
  variables = _params(_flax(), x)
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
  x = jnp.tile(_x((1, T, F)), (3, 1, 1))  # three identical batch rows
  module = _drop(broadcast_dropout=broadcast)
  variables = _params(_flax(), x)
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
  [((B, T, F), lambda: _causal((B, T))), ((2, 3, T, F), lambda: None), ((T, F), lambda: None)],
  ids=["causal", "batch_dims", "unbatched"],
)
def test_adapter_sow_weights_match_flax(shape, mask):
  x, mask = _x(shape), mask()
  variables = _params(_flax(), x)
  run = lambda module: module.apply(
    variables, x, mask=mask, sow_weights=True, mutable=["intermediates"]
  )
  expected, theirs = run(_flax())
  got, ours = run(_adapted())
  assert_close(got, expected, factor=0.5)
  weights = ours["intermediates"]["attention_weights"]
  assert isinstance(weights, tuple) and len(weights) == 1
  assert weights[0].shape == shape[:-2] + (4, T, T)
  _assert_trees_close(ours, theirs)


# --------------------------------------------------------------------------- MultiHeadAttention
#                                                                           vs Flax's module

# (id, Flax kwargs, our kwargs, inputs, call kwargs)
MHA_PARITY = [
  ("self", {}, {}, lambda: (_x(),), {}),
  ("cross", {}, {}, lambda: (_x(), _x((B, S, F), seed=1)), {}),
  ("mask", {}, {}, lambda: (_x(),), dict(mask=_causal((B, T)).astype(bool))),
  (
    "padding_cross",
    {},
    {},
    lambda: (_x(), _x((B, S, F), seed=1)),
    dict(mask=_kv_padding(T, [2, S], S).astype(bool)),
  ),
  ("unbatched", {}, {}, lambda: (_x((T, F)),), {}),
  (
    "widths",
    dict(qkv_features=24, out_features=12),
    dict(qkv_features=24, out_features=12),
    lambda: (_x(),),
    {},
  ),
  ("layernorm", dict(normalize_qk=True), dict(normalize_qk="layernorm"), lambda: (_x(),), {}),
  (
    "layernorm_widths_cross",
    dict(normalize_qk=True, qkv_features=32, out_features=8),
    dict(normalize_qk="layernorm", qkv_features=32, out_features=8),
    lambda: (_x(), _x((B, S, F), seed=1)),
    dict(mask=_kv_padding(T, [5, 1], S).astype(bool)),
  ),
  ("no_bias", dict(use_bias=False), dict(use_bias=False), lambda: (_x(),), {}),
]


@pytest.mark.parametrize(
  "theirs_kw, ours_kw, inputs, kwargs", [c[1:] for c in MHA_PARITY], ids=[c[0] for c in MHA_PARITY]
)
def test_mha_loads_flax_params_and_matches(theirs_kw, ours_kw, inputs, kwargs):
  args = inputs()
  theirs, ours = _flax(**theirs_kw), MHA(num_heads=4, **ours_kw)
  shapes = _abstract_init(theirs, *args, **kwargs)
  assert _shapes(_abstract_init(ours, *args, **kwargs)) == _shapes(shapes)  # same names, shapes
  variables = {"params": _fill(shapes["params"])}
  expected = theirs.apply(variables, *args, **kwargs)
  got = ours.apply(variables, *args, **kwargs)
  assert got.shape == expected.shape == args[0].shape[:-1] + (ours_kw.get("out_features", F),)
  assert_close(got, expected, factor=0.5)


def test_mha_param_gradients_match_flax():
  x, mask = _x(), _causal((B, T)).astype(bool)
  variables = _params(_flax(normalize_qk=True), x)

  def grads(module):
    return jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x, mask=mask) ** 2)))(variables)

  _assert_trees_close(
    grads(MHA(num_heads=4, normalize_qk="layernorm")), grads(_flax(normalize_qk=True)), tol=4e-5
  )


# --------------------------------------------------------------------------- MultiHeadAttention
#                                                                           vs NumPy reference


def _np_params(variables):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])


def _project(p, x):
  """Projected (q, k, v) in float64 from the module's own kernels."""
  x = np.asarray(x, np.float64)
  proj = lambda name: np.einsum("btf,fnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]
  return proj("query"), proj("key"), proj("value")


def _rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def _reference(variables, x, *, allowed=None, rope=None, rms=False):
  """The module's output from the formula: project, (norm), (RoPE), attention, out-project."""
  p = _np_params(variables)
  q, k, v = _project(p, x)
  if rms:
    q, k = _rms(q, p["query_ln"]["scale"]), _rms(k, p["key_ln"]["scale"])
  if rope is not None:
    pos = jnp.arange(q.shape[1])
    q, k = (np.asarray(rope(jnp.asarray(a, jnp.float32), pos), np.float64) for a in (q, k))
  out, _ = attention_np(q, k, v, allowed=allowed)
  return np.einsum("btnh,nhf->btf", out, p["out"]["kernel"]) + p["out"]["bias"]


@pytest.mark.parametrize("K", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [None, positional.Rotary()], ids=["plain", "rope"])
def test_mha_matches_reference_causal(K, rope):
  x = _x()
  module = MHA(num_heads=4, num_kv_heads=K, is_causal=True, rope=rope)
  variables = _params(module, x)
  assert variables["params"]["key"]["kernel"].shape == (F, K, 4)
  assert variables["params"]["value"]["kernel"].shape == (F, K, 4)
  expected = _reference(variables, x, allowed=causal_np(T, T), rope=rope)
  assert_close(module.apply(variables, x), expected)


def test_mha_rope_partial_rotation_and_positions():
  x = _x()
  rope = positional.Rotary(base=100.0, rotary_fraction=0.5)
  module = MHA(num_heads=2, rope=rope)  # head_dim 8, 4 channels rotate
  variables = _params(module, x)
  assert_close(module.apply(variables, x), _reference(variables, x, rope=rope))
  # Shifting every position by the same amount leaves RoPE's logits unchanged.
  shifted = module.apply(variables, x, positions=jnp.arange(T) + 5)
  assert_close(shifted, module.apply(variables, x), factor=5)


def test_mha_rms_norm_matches_reference_and_differs_from_none():
  x = _x()
  module = MHA(num_heads=4, normalize_qk="rms", is_causal=True)
  variables = _params(module, x)
  assert set(variables["params"]) == {"query", "key", "value", "out", "query_ln", "key_ln"}
  assert variables["params"]["query_ln"]["scale"].shape == (4,)
  got = module.apply(variables, x)
  assert_close(got, _reference(variables, x, allowed=causal_np(T, T), rms=True), factor=2)
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
  x = _x()
  ids = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]], np.int32)
  module = MHA(num_heads=4, is_causal=True)
  variables = _params(module, x)
  got = module.apply(variables, x, segment_ids=jnp.asarray(ids))
  allowed = segments_np(ids, ids) & causal_np(T, T)
  assert_close(got, module.apply(variables, x, mask=jnp.asarray(segments_np(ids, ids))))
  assert_close(got, _reference(variables, x, allowed=allowed))
  assert not np.allclose(got, module.apply(variables, x), atol=1e-3)


def test_mha_sow_weights():
  x = _x()
  module = MHA(num_heads=4, num_kv_heads=2, is_causal=True)
  variables = _params(module, x)
  out, state = module.apply(variables, x, sow_weights=True, mutable=["intermediates"])
  assert_close(out, module.apply(variables, x))
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (B, 4, T, T)
  assert_close(weights.sum(-1), np.ones((B, 4, T)))
  assert np.all(np.asarray(weights)[..., ~causal_np(T, T)] == 0)
  # Cross-attention weights are (B, N, T, S).
  xkv = _x((B, S, F), seed=1)
  cross = MHA(num_heads=4)
  _, state = cross.apply(
    _params(cross, x, inputs_kv=xkv), x, xkv, sow_weights=True, mutable=["intermediates"]
  )
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (B, 4, T, S)
  assert_close(weights.sum(-1), np.ones((B, 4, T)))
  # Without sow_weights nothing is sown.
  _, state = module.apply(variables, x, mutable=["intermediates"])
  assert "attention_weights" not in state.get("intermediates", {})


def test_mha_dropout_determinism_and_rng():
  x = _x()
  module = MHA(num_heads=4, dropout_rate=0.5)
  variables = _params(module, x, deterministic=True)
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
  x = jnp.tile(_x((1, T, F)), (3, 1, 1))
  module = MHA(num_heads=4, dropout_rate=0.5, broadcast_dropout=broadcast)
  variables = _params(module, x, deterministic=True)
  out = np.asarray(
    module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  )
  same = [np.allclose(out[0], out[b], rtol=1e-6, atol=1e-6) for b in (1, 2)]
  assert same == ([True, True] if broadcast else [False, False])


def test_mha_blockwise_matches_xla():
  x = _x()
  xla = MHA(num_heads=4, num_kv_heads=2, is_causal=True, implementation="xla")
  blockwise = MHA(
    num_heads=4, num_kv_heads=2, is_causal=True, implementation="blockwise", block_q=2, block_kv=4
  )
  variables = _params(xla, x)
  assert_close(blockwise.apply(variables, x), xla.apply(variables, x))


def test_mha_jit_apply():
  x = _x()
  module = MHA(num_heads=4, num_kv_heads=2, is_causal=True, rope=positional.Rotary())
  variables = _params(module, x)
  assert_close(jax.jit(module.apply)(variables, x), module.apply(variables, x))


# --------------------------------------------------------------------------- decoding

L = 7  # tokens fed per row
MAX_LENGTH = 8


def _decoder(K, rope=positional.Rotary(), **kw):
  return MHA(num_heads=4, num_kv_heads=K, rope=rope, **kw)


def _decode_setup(module, **kw):
  """Random params and an empty cache, shaped by an init with decode=True on the full length."""
  shapes = _abstract_init(module, jnp.zeros((B, MAX_LENGTH, F)), decode=True, **kw)
  K = module.num_kv_heads or module.num_heads
  assert _shapes(shapes["cache"]) == {
    "cached_key": ((B, MAX_LENGTH, K, 4), jnp.float32),
    "cached_value": ((B, MAX_LENGTH, K, 4), jnp.float32),
    "cache_lengths": ((B,), jnp.int32),
  }
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
  return {"params": _fill(shapes["params"])}, cache


def _numpy_init(key, shape, dtype=jnp.float32):
  """A kernel/bias initializer without jax.random (which would compile for every shape)."""
  del key
  return jnp.asarray(np.random.default_rng(shape).standard_normal(shape) / shape[0], dtype)


def test_decode_init_allocates_empty_cache_and_attends_causally():
  module = _decoder(2, kernel_init=_numpy_init, bias_init=_numpy_init)
  x = _x((B, MAX_LENGTH, F), seed=3)
  y, variables = module.init_with_output(KEY, x, decode=True)
  assert _shapes(variables["cache"]) == _shapes(_decode_setup(module)[1])
  for name in ("cached_key", "cached_value", "cache_lengths"):
    np.testing.assert_array_equal(variables["cache"][name], 0)
  # the init pass attends causally, like Flax's decode init
  assert_close(y, _decoder(2, is_causal=True).apply({"params": variables["params"]}, x))


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
# overflow tests decode eagerly.
DECODE_CASES = [
  ("mha_chunked", 4, None, [3, 1, 1, 2]),
  ("gqa_rope_chunked", 2, positional.Rotary(), [3, 1, 1, 2]),
  ("mqa_rope_chunked", 1, positional.Rotary(), [3, 1, 1, 2]),
  ("gqa_rope_prefill", 2, positional.Rotary(), [L]),
]


@pytest.mark.parametrize(
  "K, rope, chunks", [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES]
)
def test_decode_equals_full_causal(K, rope, chunks):
  x = _x((B, L, F), seed=3)
  module = _decoder(K, rope)
  params, cache = _decode_setup(module)
  got, cache = _decode_chunks(module, params, cache, x, chunks, jit=True)
  expected = jax.jit(_decoder(K, rope, is_causal=True).apply)(params, x)
  assert_close(got, expected)
  np.testing.assert_array_equal(cache["cache_lengths"], [L, L])
  # the cache holds the (rotated) keys and the values of the L tokens, zeros after
  _, k, v = _project(_np_params(params), x)
  if rope is not None:
    k = np.asarray(rope(jnp.asarray(k, jnp.float32), jnp.arange(L)))
  assert_close(cache["cached_key"][:, :L], k)
  assert_close(cache["cached_value"][:, :L], v)
  np.testing.assert_array_equal(cache["cached_key"][:, L:], 0.0)
  np.testing.assert_array_equal(cache["cached_value"][:, L:], 0.0)


def test_decode_ragged_rows():
  lens, steps, t = [3, 1], 2, 3  # prompts of 3 and 1 tokens right-padded to t, then 2 steps
  full = _x((B, L, F), seed=4)  # row b's sequence: full[b, :lens[b] + steps]
  prompt = np.array(full[:, :t])
  prompt[1, lens[1] :] = 9.0  # row 1's padding: must be ignored
  module = _decoder(2)
  params, cache = _decode_setup(module)
  y, mutated = module.apply(
    {**params, "cache": cache},
    jnp.asarray(prompt),
    decode=True,
    num_new=jnp.asarray(lens, jnp.int32),
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
  x = _x((B, 3, F), seed=3)
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
  x = jnp.tile(_x((1, 3, F), seed=3), (B, 1, 1))  # identical batch rows
  module = _decoder(2, dropout_rate=0.5, broadcast_dropout=True)
  params, cache = _decode_setup(module, deterministic=True)
  out, _ = _decode_chunks(
    module, params, cache, x, [3], deterministic=False, rngs={"dropout": jax.random.key(1)}
  )
  np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)


def test_decode_jit_steps():
  x = _x((B, L, F), seed=3)
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
  x = _x((B, MAX_LENGTH + 1, F), seed=3)
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
  np.testing.assert_array_equal(cache["cache_lengths"], [8, 8])


# --------------------------------------------------------------- paged and quantized caches

PAGED = dict(page_size=2, num_pages=6)  # 4 pages a row (max_length 7 -> 8), 6 in the pool


@functools.partial(jax.jit, static_argnums=0)
def _step(module, variables, x, num_new):
  """One decode call; a program per (module, chunk length), shared by the tests below."""
  return module.apply(variables, x, decode=True, num_new=num_new, mutable=["cache"])


def _empty_cache(module, params, max_length=7):
  """The cache the init pass (decode=True) allocates, run with given params (no jax.random).
  A paged cache must come from there: its free_pages start True and its page_table -1."""
  _, mutated = module.apply(params, jnp.zeros((B, max_length, F)), decode=True, mutable=["cache"])
  return mutated["cache"]


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


def test_paged_cache_decodes_like_contiguous_and_full_causal():
  x = _x(seed=3)  # (B, T, F), T = 6
  contiguous, paged = _decoder(2), _decoder(2, **PAGED)
  params = _params(contiguous, x)
  cache = _empty_cache(paged, params)
  assert _shapes(cache) == {
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


@pytest.mark.parametrize("chunks", [(4, 1, 1), (6,)], ids=["steps", "prefill"])
def test_a_mask_of_the_requested_max_length_fits_either_cache(chunks):
  """The init pass on (B, 7, F) with page_size=2 rounds rows up to 8 slots, but a mask sized
  to the 7 asked for works as with a contiguous cache: the same outputs, and the formula's."""
  x = _x(seed=3)  # (B, T, F), T = 6
  rng = np.random.default_rng(0)
  mask = (rng.random((B, 1, 7, 7)) < 0.6) | np.eye(7, dtype=bool)  # keeps each own token
  outs = {}
  for name, module in (("contiguous", _decoder(2)), ("paged", _decoder(2, **PAGED))):
    params = _params(module, x)
    cache, got, start = _empty_cache(module, params), [], 0
    for n in chunks:
      y, mutated = module.apply(
        {**params, "cache": cache},
        x[:, start : start + n],
        decode=True,
        mask=mask[:, :, start : start + n],
        mutable=["cache"],
      )
      cache = mutated["cache"]
      got.append(y)
      start += n
    outs[name] = jnp.concatenate(got, axis=1)
  assert cache["page_table"].shape == (B, 4)  # 8 slots a row
  assert_close(outs["paged"], outs["contiguous"])
  allowed = causal_np(T, T) & mask[:, :, :T, :T]
  want = _reference(params, x, allowed=allowed, rope=positional.Rotary())
  assert_close(outs["paged"], want)
  unmasked = _reference(params, x, allowed=causal_np(T, T), rope=positional.Rotary())
  assert np.abs(want - unmasked).max() > 0.1  # the mask does mask


def test_int8_paged_cache_is_close_to_the_float_cache():
  x = _x(seed=3)
  module = _decoder(2, cache_dtype=jnp.int8, page_size=2)
  params = _params(module, x)
  cache = _empty_cache(module, params)
  assert _shapes(cache)["cached_key_pages"] == ((8, 2, 2, 4), jnp.int8)  # pool: every row full
  assert _shapes(cache)["cached_key_scale"] == ((8, 2, 2), jnp.float32)
  got, cache = _steps(module, params, cache, x)
  exact, _ = _steps(_decoder(2), params, _empty_cache(_decoder(2), params), x)
  # Each stored element is off by at most half an int8 step, 1/254 of its (token, head)
  # vector's largest element: so the cache holds, checked from the formula,
  _, k, v = _project(_np_params(params), x)
  k = np.asarray(positional.Rotary()(jnp.asarray(k, jnp.float32), jnp.arange(T)))
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
  x, z = _x(seed=3), _x(seed=5)  # row 0 serves x[0], then a new request z[0]; row 1 x[1]
  module = _decoder(2, **(PAGED if paged else {}))
  params = _params(module, x)
  empty = _empty_cache(module, params)
  _, cache = _steps(module, params, empty, x, (4, 1))
  cache = jattn.linen.release_cache(cache, jnp.asarray([True, False]))
  np.testing.assert_array_equal(cache["cache_lengths"], [0, 5])
  if paged:
    np.testing.assert_array_equal(np.sum(cache["free_pages"]), 3)
    np.testing.assert_array_equal(cache["page_table"][0], -1)
  # Row 0 prefills 4 tokens of z, row 1 appends its 6th token (padded to 4); then row 0 alone.
  prompt = jnp.stack([z[0, :4], jnp.pad(x[1, 5:6], ((0, 3), (0, 0)))])

  def serve(cache, row_1):
    first, cache = _steps(module, params, cache, prompt, (4,), jnp.asarray([4, row_1]))
    second, cache = _steps(module, params, cache, z[:, 4:5], (1,), jnp.asarray([1, 0]))
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
  params = _params(module, _x())
  cache = _empty_cache(module, params)
  assert _shapes(cache)["cached_key"] == ((B, 7, 2, 4), jnp.bfloat16)
  with pytest.raises(
    TypeError,
    match=r"the KV cache holds bfloat16 keys and values, but this module computes them in "
    r"float32 \(dtype=None, param_dtype=float32, inputs float32\); set cache_dtype=float32",
  ):
    module.apply({**params, "cache": cache}, _x((B, 1, F)), decode=True, mutable=["cache"])


def test_release_cache_walks_a_models_cache_collection():
  contiguous = jattn.decode.init(B, 4, 1, 2)._replace(lengths=jnp.asarray([3, 2]))
  paged = jattn.decode.init_paged(4, 2, B, 2, 1, 2, dtype=jnp.int8)
  paged = jattn.decode.update(paged, jnp.ones((B, 3, 1, 2)), jnp.ones((B, 3, 1, 2)))
  names = jattn.linen.CACHE_NAMES
  as_vars = lambda c: {names[f]: a for f, a in c._asdict().items() if a is not None}
  flax_own = {"cached_key": jnp.ones(3), "cache_index": jnp.asarray(3)}  # not jattn's: kept
  tree = {"block_0": {"attn": as_vars(contiguous)}, "block_1": {"attn": as_vars(paged)}}
  tree["block_1"]["flax_attn"] = flax_own
  rows = jnp.asarray([True, False])
  release = jattn.linen.release_cache
  for out in (release(tree, rows), jax.jit(release)(tree, rows)):
    want = {
      "block_0": {"attn": as_vars(jattn.decode.release(contiguous, rows))},
      "block_1": {"attn": as_vars(jattn.decode.release(paged, rows)), "flax_attn": flax_own},
    }
    assert jax.tree.structure(out) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(out["block_1"]["attn"]["free_pages"], [True, True, False, False])
  with pytest.raises(TypeError, match="cache must be a cache collection"):
    jattn.linen.release_cache([tree], rows)


# --------------------------------------------------------------------------- errors

# (id, constructor kwargs, exception, message fragment): construction itself raises.
BAD_CONFIG = [
  (
    "kv_heads",
    dict(num_heads=4, num_kv_heads=3),
    ValueError,
    r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
  ),
  (
    "qkv_features",
    dict(num_heads=3, qkv_features=16),
    ValueError,
    r"qkv_features \(16\) must be divisible by num_heads \(3\)",
  ),
  (
    "odd_rotary_dim",
    dict(num_heads=2, qkv_features=20, rope=positional.Rotary(rotary_fraction=0.5)),
    ValueError,
    r"rotary_dim=5; it must be even.*head_dim = qkv_features // num_heads = 10",
  ),
  (
    "rope_type",
    dict(num_heads=2, rope="rotary"),
    TypeError,
    r"rope must be a jattn.positional.Rotary",
  ),
  (
    "normalize_qk",
    dict(num_heads=2, normalize_qk="l2"),
    ValueError,
    r"normalize_qk must be one of \[False, True, 'rms', 'layernorm'\], got 'l2'",
  ),
  (
    "normalize_qk_int",
    dict(num_heads=2, normalize_qk=1),
    ValueError,
    r"normalize_qk must be one of",
  ),
  (
    "implementation",
    dict(num_heads=2, implementation="flash"),
    ValueError,
    r"implementation must be one of \['blockwise', 'cudnn', 'splash', 'xla'\] or None, got 'flash'",
  ),
  ("backward", dict(num_heads=2, backward="manual"), ValueError, r"backward must be one of"),
  (
    "block_q_xla",
    dict(num_heads=2, implementation="xla", block_q=2),
    ValueError,
    r"block_q and block_kv apply only to implementation='blockwise' or 'splash'",
  ),
  (
    "dropout_high",
    dict(num_heads=2, dropout_rate=1.0),
    ValueError,
    r"dropout_rate must be in \[0, 1\), got 1.0",
  ),
  (
    "dropout_negative",
    dict(num_heads=2, dropout_rate=-0.1),
    ValueError,
    r"dropout_rate must be in \[0, 1\)",
  ),
  ("num_heads", dict(num_heads=0), ValueError, r"num_heads"),
  (
    "deterministic_type",
    dict(num_heads=2, deterministic="yes"),
    TypeError,
    r"deterministic must be a bool or None",
  ),
  ("out_features", dict(num_heads=2, out_features=0), ValueError, r"out_features"),
  ("page_size", dict(num_heads=2, page_size=0), ValueError, r"page_size must be >= 1, got 0"),
  ("page_size_type", dict(num_heads=2, page_size="4"), TypeError, r"page_size must be an int"),
  (
    "num_pages",
    dict(num_heads=2, page_size=4, num_pages=0),
    ValueError,
    r"num_pages must be >= 1, got 0",
  ),
  (
    "num_pages_unpaged",
    dict(num_heads=2, num_pages=8),
    ValueError,
    r"num_pages applies only to a paged cache: give page_size too, got num_pages=8",
  ),
  (
    "cache_dtype",
    dict(num_heads=2, cache_dtype=jnp.int32),
    TypeError,
    r"cache_dtype must be a floating dtype, int8 or float8_e4m3fn, got int32",
  ),
  (
    "paged_xla",
    dict(num_heads=2, page_size=4, implementation="xla"),
    ValueError,
    r"a paged \(page_size=4\) cache is read by blockwise attention alone, but this module has "
    r"implementation='xla'",
  ),
  (
    "quantized_splash",
    dict(num_heads=2, cache_dtype=jnp.float8_e4m3fn, implementation="splash"),
    ValueError,
    r"a quantized \(cache_dtype=float8_e4m3fn\) cache is read by blockwise attention alone",
  ),
  (
    "page_tiles",
    dict(num_heads=2, page_size=4, block_kv=6),
    ValueError,
    r"block_kv must be a multiple of page_size=4 \(a paged cache is read in tiles of whole "
    r"pages\), got block_kv=6",
  ),
]


@pytest.mark.parametrize(
  "kwargs, error, match", [pytest.param(*c[1:4], id=c[0], marks=c[4:]) for c in BAD_CONFIG]
)
def test_bad_config_raises_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    MHA(**kwargs)


def test_unknown_rope_scaling_kind_raises():
  with pytest.raises(
    ValueError,
    match=r"kind must be one of \['linear', 'ntk', 'llama3', "
    r"'yarn'\], got 'cubic'",
  ):
    MHA(num_heads=2, rope=positional.Rotary(scaling=positional.RopeScaling("cubic", 2.0)))


# (id, constructor kwargs, call kwargs (inputs_q default _x()), exception, message fragment)
BAD_CALLS = [
  (
    "qkv_from_input",
    dict(num_heads=3),
    {},
    ValueError,
    r"qkv_features \(16\) must be divisible by num_heads \(3\)",
  ),
  (
    "odd_rotary_from_input",
    dict(num_heads=2, rope=positional.Rotary(rotary_fraction=0.625)),
    {},
    ValueError,
    r"rotary_dim=5",
  ),
  (
    "rank_4",
    dict(num_heads=2),
    dict(inputs_q=_x((2, 1, T, F))),
    ValueError,
    r"inputs_q must have shape \(B, T, F\) or \(T, F\), got \(2, 1, 6, 16\)",
  ),
  (
    "rank_1",
    dict(num_heads=2),
    dict(inputs_q=_x((F,))),
    ValueError,
    r"inputs_q must have shape \(B, T, F\) or \(T, F\)",
  ),
  (
    "kv_rank",
    dict(num_heads=2),
    dict(inputs_kv=_x((S, F))),
    ValueError,
    r"inputs_kv must have the rank of inputs_q",
  ),
  (
    "kv_batch",
    dict(num_heads=2),
    dict(inputs_kv=_x((B + 1, S, F))),
    ValueError,
    r"same batch size",
  ),
  (
    "rope_cross",
    dict(num_heads=2, rope=positional.Rotary()),
    dict(inputs_kv=_x((B, S, F))),
    ValueError,
    r"rope applies to self-attention",
  ),
  (
    "sow_blockwise",
    dict(num_heads=2, implementation="blockwise"),
    dict(sow_weights=True),
    ValueError,
    r"sow_weights needs the materialised weights",
  ),
  (
    "positions_shape",
    dict(num_heads=2, rope=positional.Rotary()),
    dict(positions=jnp.arange(T + 1)),
    ValueError,
    r"positions must have shape",
  ),
  (
    "dropout_needs_deterministic",
    dict(num_heads=2, dropout_rate=0.1),
    {},
    ValueError,
    r"needs deterministic",
  ),
  (
    "num_new_without_decode",
    dict(num_heads=2),
    dict(num_new=jnp.array([1, 1])),
    ValueError,
    r"num_new applies only with decode=True",
  ),
  (
    "positions_without_rope",
    dict(num_heads=2),
    dict(positions=jnp.arange(T)),
    ValueError,
    r"positions are used only by rope",
  ),
]


@pytest.mark.parametrize(
  "ctor, call, error, match", [pytest.param(*c[1:5], id=c[0], marks=c[5:]) for c in BAD_CALLS]
)
def test_bad_call_raises(ctor, call, error, match):
  module = MHA(**ctor)
  call = dict(call)
  inputs_q = call.pop("inputs_q", _x())
  with pytest.raises(error, match=match):
    _abstract_init(module, inputs_q, **call)


# (id, call kwargs, exception, message fragment) on a module whose cache is initialised
BAD_DECODE_CALLS = [
  ("inputs_kv", dict(inputs_kv=_x((B, 1, F))), ValueError, r"decode=True does not take inputs_kv"),
  ("positions", dict(positions=jnp.arange(1)), ValueError, r"decode=True does not take positions"),
  (
    "segment_ids",
    dict(segment_ids=jnp.zeros((B, 1), jnp.int32)),
    ValueError,
    r"decode=True does not take segment_ids",
  ),
  ("sow_weights", dict(sow_weights=True), ValueError, r"decode=True does not take sow_weights"),
  ("unbatched", dict(inputs_q=_x((1, F))), ValueError, r"decode=True needs batched inputs"),
  (
    "batch_size",
    dict(inputs_q=_x((B + 1, 1, F))),
    ValueError,
    r"inputs_q has batch size 3 but the cache was made for 2",
  ),
  (
    "num_new_shape",
    dict(num_new=jnp.array([1, 1, 1])),
    ValueError,
    r"num_new must have shape \(B,\)=\(2,\)",
  ),
  ("num_new_range", dict(num_new=jnp.array([2, 0])), ValueError, r"num_new must be in \[0, t=1\]"),
]


@pytest.mark.parametrize(
  "call, error, match", [c[1:] for c in BAD_DECODE_CALLS], ids=[c[0] for c in BAD_DECODE_CALLS]
)
def test_bad_decode_call_raises(call, error, match):
  module = MHA(num_heads=4, num_kv_heads=2)
  params, cache = _decode_setup(module)
  call = dict(call)
  inputs_q = call.pop("inputs_q", _x((B, 1, F)))
  with pytest.raises(error, match=match):
    module.apply({**params, "cache": cache}, inputs_q, decode=True, mutable=["cache"], **call)
