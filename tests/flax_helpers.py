"""What the Flax tests share (test_nnx*.py, test_linen*.py): shapes, inputs, random Linen
parameters without jax.random, and the modules' math written out with their own parameters.
Nothing here imports jattn, so a bug in jattn cannot hide in its own reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from reference import array, attention_np, normal

B, T, S, F = 2, 6, 9, 16  # S: length of the keys' input in cross-attention
KEY = jax.random.key(0)


def sample(shape=(B, T, F), seed=0):
  """A float32 input of ``shape``, standard normal."""
  return normal(shape, np.float32, seed)


# --- Linen parameters ---------------------------------------------------------------------


def fill(shapes, seed=1):
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
    return array(n, s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, shapes)


def abstract_init(module, *args, **kw):
  """The shapes ``module.init(KEY, *args, **kw)`` gives, without running it."""
  return jax.eval_shape(functools.partial(module.init, **kw), KEY, *args)


def random_params(module, *args, seed=1, **kw):
  """{"params": random parameters} for ``module`` called on ``args``."""
  return {"params": fill(abstract_init(module, *args, **kw)["params"], seed)}


def shapes_of(variables):
  return jax.tree.map(lambda a: (a.shape, a.dtype), variables)


def assert_trees_close(actual, expected, tol=2e-5):
  """Leafwise close, with an absolute tolerance scaled by the largest value in the whole tree
  (some gradients, e.g. the key bias's, are zero up to rounding)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  size = max([1.0] + [float(np.max(np.abs(e))) for e in jax.tree.leaves(expected)])
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.shape == e.shape
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * size)


# Flax's mask builders run eagerly, one compiled program per operation and shape: each mask is
# built once per shape and shared (jax arrays are immutable).
@functools.cache
def causal_mask(shape):
  """Flax's (..., 1, T, T) causal mask for inputs of ``shape`` (..., T)."""
  return nn.make_causal_mask(jnp.ones(shape))


def kv_padding(q_len, kv_lens, kv_len):
  """(B, 1, q_len, kv_len) padding mask: every query keeps keys s < kv_lens[b] (all >= 1)."""
  return _kv_padding(q_len, tuple(kv_lens), kv_len)


@functools.cache
def _kv_padding(q_len, kv_lens, kv_len):
  q_valid = jnp.ones((len(kv_lens), q_len))
  kv_valid = jnp.asarray(np.arange(kv_len)[None] < np.asarray(kv_lens)[:, None], jnp.float32)
  return nn.make_attention_mask(q_valid, kv_valid)


# --- the modules' math --------------------------------------------------------------------


def np_params(variables):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])


def project(p, x):
  """Projected (q, k, v) in float64 from a Linen module's own kernels."""
  x = np.asarray(x, np.float64)
  proj = lambda name: np.einsum("btf,fnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]
  return proj("query"), proj("key"), proj("value")


def _rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def linen_reference(variables, x, *, allowed=None, rope=None, rms=False):
  """A Linen module's output from the formula: project, (norm), (RoPE), attention,
  out-project, in float64."""
  p = np_params(variables)
  q, k, v = project(p, x)
  if rms:
    q, k = _rms(q, p["query_ln"]["scale"]), _rms(k, p["key_ln"]["scale"])
  if rope is not None:
    pos = jnp.arange(q.shape[1])
    q, k = (np.asarray(rope(jnp.asarray(a, jnp.float32), pos), np.float64) for a in (q, k))
  out, _ = attention_np(q, k, v, allowed=allowed)
  return np.einsum("btnh,nhf->btf", out, p["out"]["kernel"]) + p["out"]["bias"]


def nnx_reference(module, x, *, causal=True, positions=None, stored=lambda a: a, mask=None):
  """An NNX module's math written out with its own parameters: project, RoPE, softmax,
  project.

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
  return jnp.einsum("BTNH,NHF->BTF", o, p["out"]["kernel"]) + p["out"]["bias"][...][None, None]


def sown(module, *args, **kwargs):
  """The attention weights an NNX ``module`` sows in one call, captured with nnx.capture."""
  _, inter = nnx.capture(module, nnx.Intermediate)(*args, sow_weights=True, **kwargs)
  (weights,) = inter["attention_weights"].get_value()
  return weights


# --- Flax's signatures --------------------------------------------------------------------


def same_default(a, b) -> bool:
  """Two defaults are the same: equal, or initializers that draw the same values."""
  if a is b:
    return True
  if callable(a) and callable(b):  # an initializer made twice (lecun_normal())
    draw = lambda init: np.asarray(init(KEY, (3, 4), jnp.float32))
    return np.array_equal(draw(a), draw(b))
  return a == b


def assert_takes_every_parameter(theirs, ours, *, defaults_differ=()):
  """``ours`` (a mapping of inspect.Parameter) takes every parameter of ``theirs``: the
  same positional ones in the same order, each parameter of the same kind and default (a
  required one may get a default; ``defaults_differ`` names documented exceptions), and
  keyword-only parameters of its own."""
  positional = lambda params: [n for n, p in params.items() if p.kind != p.KEYWORD_ONLY]
  assert positional(ours) == positional(theirs)
  for name, p in theirs.items():
    assert name in ours and ours[name].kind == p.kind, name
    if p.default is not p.empty and name not in defaults_differ:
      assert same_default(ours[name].default, p.default), name
  for name in set(ours) - set(theirs):
    assert ours[name].kind == ours[name].KEYWORD_ONLY, name
