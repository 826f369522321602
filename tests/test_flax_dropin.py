"""jattn's Flax modules in place of Flax's own, on the same inputs and parameters: Flax's
float 0/1 masks, several batch dimensions or none, Linen's three class names and their
automatic names, checkpoints both ways, sown weights and their dtype, Flax's cache variables
step by step while decoding, and complex inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax_helpers import KEY, abstract_init, assert_trees_close, fill, sample, shapes_of
from reference import assert_close

import jattn.linen
import jattn.nnx

F = 8  # small: every case here compiles its own programs


def _flax_apply(module, *args, **kw):
  """Flax's Linen module (the reference) applied as one program: eagerly, each of its
  operations compiles alone."""
  return jax.jit(functools.partial(module.apply, **kw))(*args)


# Flax's NNX module (the reference) called as one program.
_flax_call = nnx.jit(lambda m, *args, **kw: m(*args, **kw), static_argnames=("decode",))


def _linen_pair(**kw):
  return nn.MultiHeadDotProductAttention(2, **kw), jattn.linen.MultiHeadDotProductAttention(2, **kw)


# --------------------------------------------------------------------------- Linen


# The default run keeps two batch dimensions for Linen and none for NNX (below); the other
# shape of each is exhaustive.
@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((2, 3, 5, F), id="two_batch_dims"),
    pytest.param((5, F), id="unbatched", marks=pytest.mark.exhaustive),
  ],
)
def test_linen_float_masks_and_batch_dims_give_flaxs_outputs(shape):
  theirs, ours = _linen_pair()
  x = sample(shape)
  mask = nn.make_causal_mask(jnp.ones(shape[:-1]))  # float32 0/1, [batch..., 1, T, T]
  assert mask.dtype == jnp.float32
  shapes = abstract_init(theirs, x)
  assert shapes_of(abstract_init(ours, x)) == shapes_of(shapes)
  variables = {"params": fill(shapes["params"])}
  want = _flax_apply(theirs, variables, x, mask=mask)
  assert_close(ours.apply(variables, x, mask=mask), want, factor=0.5)
  # a 0/1 mask of another dtype reads the same: non-zero attends
  assert_close(ours.apply(variables, x, mask=mask.astype(jnp.int8)), want, factor=0.5)
  unmasked = _flax_apply(theirs, variables, x)
  assert not np.allclose(want, unmasked, atol=1e-3)  # the mask does mask


class _Parent(nn.Module):
  """Three unnamed attention submodules, of the classes ``classes`` gives."""

  classes: tuple

  @nn.compact
  def __call__(self, x):
    dot, alias, self_attn = self.classes
    y = dot(num_heads=2)(x)
    y = alias(num_heads=2)(y, x)
    with pytest.warns(DeprecationWarning, match="SelfAttention will be deprecated soon"):
      return self_attn(num_heads=2)(y)


FLAX_CLASSES = (nn.MultiHeadDotProductAttention, nn.MultiHeadAttention, nn.SelfAttention)
JATTN_CLASSES = (
  jattn.linen.MultiHeadDotProductAttention,
  jattn.linen.MultiHeadAttention,
  jattn.linen.SelfAttention,
)


def test_linen_classes_name_themselves_as_flaxs_and_checkpoints_go_both_ways():
  x = sample((2, 5, F))
  theirs, ours = _Parent(FLAX_CLASSES), _Parent(JATTN_CLASSES)
  flax_vars = theirs.init(KEY, x)
  jattn_vars = ours.init(KEY, x)
  assert set(flax_vars["params"]) == {
    "MultiHeadDotProductAttention_0",
    "MultiHeadAttention_0",
    "SelfAttention_0",
  }
  # The same paths, shapes and (from the same key, the rngs being split by those names)
  # values: a checkpoint of either restores into the other.
  assert_trees_close(jattn_vars, flax_vars, tol=0)
  checkpoint = {"params": fill(shapes_of_tree(flax_vars["params"]), seed=3)}
  want = _flax_apply(theirs, checkpoint, x)
  assert_close(ours.apply(checkpoint, x), want, factor=0.5)
  # and back: jattn's parameters, written out as they are, into Flax's module
  restored = jax.tree.map(np.asarray, checkpoint)
  assert_close(_flax_apply(theirs, restored, x), ours.apply(restored, x), factor=0.5)


def shapes_of_tree(tree):
  return jax.eval_shape(lambda t: t, tree)


@pytest.mark.parametrize("force_fp32", [True, False])
def test_linen_sown_weights_have_flaxs_dtype(force_fp32):
  theirs, ours = _linen_pair(dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32)
  x = sample((2, 4, F))
  variables = {"params": fill(abstract_init(theirs, x)["params"])}
  sown = {}
  for name, apply in (("theirs", functools.partial(_flax_apply, theirs)), ("ours", ours.apply)):
    _, state = apply(variables, x, sow_weights=True, mutable=["intermediates"])
    (sown[name],) = state["intermediates"]["attention_weights"]
  assert sown["ours"].dtype == sown["theirs"].dtype
  assert sown["ours"].dtype == (jnp.float32 if force_fp32 else jnp.bfloat16)
  assert sown["ours"].shape == sown["theirs"].shape == (2, 2, 4, 4)
  np.testing.assert_allclose(
    np.asarray(sown["ours"], np.float32), np.asarray(sown["theirs"], np.float32), atol=2e-2
  )


# The default run keeps one batch dimension; none and two are exhaustive.
@pytest.mark.parametrize(
  "batch",
  [
    pytest.param((2,), id="batched"),
    pytest.param((), id="unbatched", marks=pytest.mark.exhaustive),
    pytest.param((2, 3), id="two_batch_dims", marks=pytest.mark.exhaustive),
  ],
)
def test_linen_decoding_keeps_flaxs_cache_variables_step_by_step(batch):
  theirs, ours = _linen_pair(decode=True)
  L = 4
  x = sample(batch + (L, F), seed=2)
  # Flax's init takes inputs_k and inputs_v too: init(rng, x, x, x)
  flax_vars = theirs.init(KEY, x, x, x)
  jattn_vars = ours.init(KEY, x, x, x)
  assert_trees_close(jattn_vars, flax_vars, tol=0)  # params and the empty cache
  assert shapes_of(jattn_vars["cache"]) == {
    "cached_key": (batch + (L, 2, 4), jnp.float32),
    "cached_value": (batch + (L, 2, 4), jnp.float32),
    "cache_index": ((), jnp.int32),
  }
  params = {"params": fill(shapes_of_tree(flax_vars["params"]))}
  caches = [flax_vars["cache"], jattn_vars["cache"]]
  # Flax's steps as one program (eagerly, each of its operations compiles alone), jattn's eager
  applies = [jax.jit(functools.partial(theirs.apply, mutable=["cache"])), ours.apply]
  for t in range(L):
    token = x[..., t : t + 1, :]
    outs = []
    for i, apply in enumerate(applies):
      kw = {} if i == 0 else dict(mutable=["cache"])
      y, mutated = apply({**params, "cache": caches[i]}, token, **kw)
      caches[i] = mutated["cache"]
      outs.append(y)
    assert_close(outs[1], outs[0], factor=0.5)
    assert_trees_close(caches[1], caches[0], tol=1e-6)
  np.testing.assert_array_equal(caches[1]["cache_index"], L)


# --------------------------------------------------------------------------- NNX


def _nnx_pair(**kw):
  theirs = nnx.MultiHeadAttention(2, F, decode=False, rngs=nnx.Rngs(0), **kw)
  ours = jattn.nnx.MultiHeadAttention(2, F, rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(theirs, nnx.Param))  # Flax's checkpoint, restored into jattn's
  return theirs, ours


@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((2, 3, 5, F), id="two_batch_dims", marks=pytest.mark.exhaustive),
    pytest.param((5, F), id="unbatched"),
  ],
)
def test_nnx_float_masks_and_batch_dims_give_flaxs_outputs(shape):
  theirs, ours = _nnx_pair()
  x = sample(shape)
  mask = nnx.make_causal_mask(jnp.ones(shape[:-1]))
  want = _flax_call(theirs, x, mask=mask)
  assert_close(ours(x, mask=mask), want, factor=0.5)
  assert not np.allclose(want, _flax_call(theirs, x), atol=1e-3)
  weights = {}
  capture = lambda m, x, mask: nnx.capture(m, nnx.Intermediate)(x, mask=mask, sow_weights=True)
  for name, m in (("theirs", theirs), ("ours", ours)):
    # Flax's as one program (eagerly, each of its operations compiles alone)
    _, inter = (nnx.jit(capture) if m is theirs else capture)(m, x, mask)
    (weights[name],) = inter["attention_weights"].get_value()
  assert weights["ours"].dtype == weights["theirs"].dtype
  assert_close(weights["ours"], weights["theirs"], factor=0.5)


def test_nnx_checkpoint_goes_both_ways():
  theirs, ours = _nnx_pair()
  x = sample((2, 5, F))
  flax_state = nnx.state(theirs, nnx.Param)
  ours_state = nnx.state(ours, nnx.Param)
  assert jax.tree.structure(ours_state) == jax.tree.structure(flax_state)
  # jattn's parameters (moved away from Flax's) back into Flax's module
  moved = jax.tree.map(lambda a: a * 1.5 + 0.1, ours_state)
  nnx.update(ours, moved)
  nnx.update(theirs, nnx.state(ours, nnx.Param))
  assert_close(ours(x), _flax_call(theirs, x), factor=0.5)


# The default run keeps the batched input; the unbatched one is exhaustive.
@pytest.mark.parametrize(
  "input_shape",
  [
    pytest.param((2, 4, F), id="batched"),
    pytest.param((4, F), id="unbatched", marks=pytest.mark.exhaustive),
  ],
)
def test_nnx_decoding_keeps_flaxs_cache_attributes_step_by_step(input_shape):
  theirs, ours = _nnx_pair()
  x = sample(input_shape, seed=2)
  for m in (theirs, ours):
    m.init_cache(input_shape)
  assert ours.cached_key.shape == theirs.cached_key.shape == input_shape[:-1] + (2, 4)
  for t in range(input_shape[-2]):
    token = x[..., t : t + 1, :]
    assert_close(ours(token, decode=True), _flax_call(theirs, token, decode=True), factor=0.5)
    assert int(ours.cache_index[...]) == int(theirs.cache_index[...]) == t + 1
    assert_trees_close(nnx.state(ours, nnx.Cache), nnx.state(theirs, nnx.Cache), tol=1e-6)


# --------------------------------------------------------------------------- complex inputs


def test_complex_inputs_run_as_flaxs():
  # Flax's own function runs them: the same operations, so equal up to float32 rounding
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  x = (sample((2, 4, F)) + 1j * sample((2, 4, F), seed=1)).astype(jnp.complex64)
  theirs, ours = _linen_pair()
  variables = theirs.init(KEY, x)  # complex inputs, float32 parameters
  want = theirs.apply(variables, x)
  got = ours.apply(variables, x)
  assert got.dtype == want.dtype == jnp.complex64
  close(got, want)
  theirs_nnx, ours_nnx = _nnx_pair()
  mask = nnx.make_causal_mask(jnp.ones((2, 4)))
  # Flax's NNX module computes complex inputs in its materialised branch when it sows (its
  # other one casts them to real, with a warning): jattn's runs that branch.
  want, _ = nnx.capture(theirs_nnx, nnx.Intermediate)(x, mask=mask, sow_weights=True)
  assert ours_nnx(x, mask=mask).dtype == jnp.complex64
  close(ours_nnx(x, mask=mask), want)
  # the adapter too: Flax's own function computes what jattn's kernels do not take
  q = x.reshape(2, 4, 2, 4)
  close(jattn.linen.attention_fn(q, q, q), nn.dot_product_attention(q, q, q))
  with pytest.raises(TypeError, match="takes no segment_ids"):
    ours_nnx(x, segment_ids=jnp.zeros((2, 4), jnp.int32))


def test_adapters_take_flaxs_float_masks():
  q, k = sample((2, 5, 2, 4)), sample((2, 7, 2, 4), seed=1)
  mask = nn.make_attention_mask(jnp.ones((2, 5)), (jnp.arange(7) < 4)[None].repeat(2, 0))
  want = jax.jit(nn.dot_product_attention)(q, k, k, mask=mask)  # one program
  for fn in (jattn.linen.attention_fn, jattn.nnx.attention_fn):
    assert_close(fn(q, k, k, mask=mask), want, factor=0.5)
