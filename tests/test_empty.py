"""Empty dimensions: every mask form with no queries (T = 0), no keys (S = 0) or no batch rows
(B = 0). Materialised, each mask is a (B, N, T, S) boolean array with nothing in it; in the
call, the output has the query's shape and gradients the inputs' shapes, and both equal jax.nn's
on the same inputs (empty, or for S = 0 rows that attend to nothing: zeros), checked for the
keyword forms jax.nn shares."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks

N, K, H = 4, 2, 8
SHAPES = [(2, 0, 8), (2, 8, 0), (0, 8, 8), (2, 0, 0)]  # (B, T, S)
IDS = [f"B{b}T{t}S{s}" for b, t, s in SHAPES]


def every_mask(B: int, T: int, S: int) -> dict:
  """Every constructor of jattn.masks, with arrays sized for (B, T, S) where it holds any."""
  rng = np.random.default_rng(0)
  q_ids = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 3, (B, S)), axis=1).astype(np.int32)
  found = {
    "causal": masks.causal(),
    "causal_offset": masks.causal(3),
    "causal_per_row": masks.causal(np.arange(B, dtype=np.int32)),
    "sliding_window": masks.sliding_window(2, 1),
    "sliding_window_dilated": masks.sliding_window(2, 1, dilation=2),
    "chunked": masks.chunked(4),
    "prefix_lm": masks.prefix_lm(np.full((B,), 3, np.int32)),
    "segments_pair": masks.segments(q_ids, kv_ids),
    "segments_pair_shared_batch": masks.segments(np.zeros(T, np.int32), np.zeros(S, np.int32)),
    "lengths": masks.lengths(np.full((B,), 3, np.int32), np.full((B,), 5, np.int32)),
    "lengths_kv": masks.lengths(kv_lengths=np.full((B,), 5, np.int32)),
    "global_tokens": masks.global_tokens(2),
    "strided": masks.strided(3),
    "from_array": masks.from_array(rng.random((B, 1, T, S)) < 0.5),
    "from_array_shared": masks.from_array(rng.random((T, S)) < 0.5),
    "from_fn": masks.from_fn(lambda b, h, q, kv: (q + kv) % 3 != 0),
    "block_sparse": masks.block_sparse(np.eye(2, dtype=bool), 4),
    "longformer": masks.longformer(2),
    "bigbird": masks.bigbird(8, 8, block_size=4),
    "reindex": masks.reindex(
      masks.causal(), q=np.arange(T, dtype=np.int32) + 2, kv=np.arange(S, dtype=np.int32)
    ),
    "all_of": masks.all_of(masks.causal(), masks.strided(2)),
    "combined": (masks.causal() | masks.global_tokens(1)) & ~masks.strided(4),
  }
  if T == S:
    found["segments"] = masks.segments(q_ids)
  return found


def inputs(B: int, T: int, S: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k1, (B, T, N, H))
  return q, jax.random.normal(k2, (B, S, K, H)), jax.random.normal(k3, (B, S, K, H))


def attend_and_grads(B, T, S, *call_sets):
  """For each set of named calls (functions of q, k and v), the output and (dq, dk, dv) of
  one jax.vjp of each call, for a cotangent of ones. One jitted program for them all: one
  compilation instead of a program for each operation of each call; the arrays the calls
  close over (masks, ids, lengths) stay concrete constants, as in an eager call."""

  def run(q, k, v):
    sets = []
    for calls in call_sets:
      results = {}
      for name, attend in calls.items():
        try:
          out, vjp = jax.vjp(attend, q, k, v)
        except Exception as e:
          raise AssertionError(f"{name}: {type(e).__name__}: {e}") from e
        results[name] = out, vjp(jnp.ones_like(out))
      sets.append(results)
    return sets

  return jax.jit(run)(*inputs(B, T, S))


def check(B, T, S, implementation, forms):
  """For each named form (jattn's keyword arguments, and jax.nn's for the same masking or
  None), jattn's output and gradients have the inputs' shapes and are zero (for S = 0: rows
  that attend to nothing give zeros) or empty; where jax.nn's are given, they equal jax.nn's
  too."""
  ours, theirs = attend_and_grads(
    B,
    T,
    S,
    {
      name: functools.partial(jattn.dot_product_attention, implementation=implementation, **kw)
      for name, (kw, _) in forms.items()
    },
    {
      name: functools.partial(jax.nn.dot_product_attention, **kw)
      for name, (_, kw) in forms.items()
      if kw is not None
    },
  )
  for name, (out, grads) in ours.items():
    assert out.shape == (B, T, N, H), name
    np.testing.assert_array_equal(out, np.zeros(out.shape), err_msg=name)
    for g, shape in zip(grads, [(B, T, N, H), (B, S, K, H), (B, S, K, H)]):
      assert g.shape == shape, name
      np.testing.assert_array_equal(g, np.zeros(shape), err_msg=name)
    if name in theirs:
      want, want_grads = theirs[name]
      np.testing.assert_array_equal(out, want, err_msg=name)
      for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("B,T,S", SHAPES, ids=IDS)
def test_every_mask_materializes_with_empty_dimensions(B, T, S):
  found = every_mask(B, T, S)
  # Every mask's dense form in one jitted program (materialize is staged into a trace): one
  # compilation, not one for each mask.
  dense_of = jax.jit(
    lambda: {
      name: mask.materialize(T, S, batch_size=B, num_heads=N) for name, mask in found.items()
    }
  )()
  for name, mask in found.items():
    dense = dense_of[name]
    assert dense.shape == (B, N, T, S) and dense.dtype == bool, name
    view = np.asarray(mask.block_view(T, S, block_q=4, block_kv=4, batch_size=B))
    assert view.shape[0] in (1, B) and view.shape[2:] == (-(-T // 4), -(-S // 4)), name


# xla's cases are exhaustive: test_every_keyword_mask_attends_with_empty_dimensions runs xla at
# every empty shape by default, and test_every_mask_materializes_with_empty_dimensions evaluates
# every mask densely there, as xla does. blockwise keeps no keys (every row empty) by default;
# no queries and no batch rows are exhaustive (the keyword test runs blockwise at each).
@pytest.mark.parametrize(
  "B,T,S,implementation",
  [
    pytest.param(*shape, impl, id=f"{name}-{impl}", marks=marks)
    for shape, name in zip(SHAPES[:3], IDS[:3])  # T = S = 0 adds no path here
    for impl in ["xla", "blockwise"]
    for marks in [() if (impl, shape[2]) == ("blockwise", 0) else pytest.mark.exhaustive]
  ],
)
def test_every_mask_attends_with_empty_dimensions(B, T, S, implementation):
  forms = {f"mask {name}": (dict(mask=mask), None) for name, mask in every_mask(B, T, S).items()}
  check(B, T, S, implementation, forms)


def keyword_forms(B: int, T: int, S: int) -> dict:
  """(jattn's keywords, jax.nn's for the same masking) for every keyword mask form."""
  q_ids, kv_ids = np.zeros((B, T), np.int32), np.zeros((B, S), np.int32)
  q_len, kv_len = np.full((B,), min(T, 3), np.int32), np.full((B,), min(S, 3), np.int32)
  ids_mask = (q_ids[:, None, :, None] == kv_ids[:, None, None, :]).astype(bool)
  forms = {
    "is_causal": (dict(is_causal=True), dict(is_causal=True)),
    "local_window_size": (dict(local_window_size=(2, 1)), dict(local_window_size=(2, 1))),
    "segment_ids_pair": (dict(segment_ids=(q_ids, kv_ids)), dict(mask=ids_mask)),
    "query_seq_lengths": (dict(query_seq_lengths=q_len), dict(query_seq_lengths=q_len)),
    "key_value_seq_lengths": (
      dict(key_value_seq_lengths=kv_len),
      dict(key_value_seq_lengths=kv_len),
    ),
    "mask_array": (dict(mask=np.ones((B, 1, T, S), bool)), dict(mask=np.ones((B, 1, T, S), bool))),
    "bias": (dict(bias=np.ones((B, N, T, S), np.float32)), dict(bias=np.ones((B, N, T, S)))),
  }
  if T == S:
    forms["segment_ids"] = (dict(segment_ids=q_ids), dict(mask=ids_mask))
  return forms


# implementation=None picks xla for every empty shape (the same program as the xla cases): the
# default run keeps it for no queries and no keys (T = S = 0), the other shapes exhaustive.
@pytest.mark.parametrize(
  "B,T,S,implementation",
  [
    pytest.param(*shape, impl, id=f"{name}-{impl}", marks=marks)
    for shape, name in zip(SHAPES, IDS)
    for impl in ["xla", "blockwise", None]
    for marks in [pytest.mark.exhaustive if impl is None and shape != (2, 0, 0) else ()]
  ],
)
def test_every_keyword_mask_attends_with_empty_dimensions(B, T, S, implementation):
  check(B, T, S, implementation, keyword_forms(B, T, S))
