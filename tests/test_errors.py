"""Bad input raises at the public boundary, before anything is compiled, with a clear message."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import array

import jattn
from jattn import masks, scores

B, T, S, N, K, H = 2, 5, 6, 4, 2, 8


# Inputs made on the host (reference.array): jnp.zeros would compile a program per shape and
# dtype, some forty when this module is collected.
def _zeros(shape, dtype=np.float32):
  return array(np.zeros(shape), dtype)


def _ones(shape, dtype=np.float32):
  return array(np.ones(shape), dtype)


Q = _zeros((B, T, N, H))
KV = _zeros((B, S, K, H))


def call(**overrides):
  args = dict(query=Q, key=KV, value=KV)
  args.update(overrides)
  q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
  return jattn.dot_product_attention(q, k, v, **args)


# (id, overrides, exception, message fragment)
BAD_INPUTS = [
  (
    "query_rank",
    dict(query=_zeros((T, N * H))),
    ValueError,
    r"query must have shape \(B, T, N, H\) or \(T, N, H\), got \(5, 32\)",
  ),
  (
    "key_rank",
    dict(key=_zeros((S, K, H)), value=_zeros((S, K, H))),
    ValueError,
    r"key must have shape \(B, S, K, H\)",
  ),
  (
    "kv_shapes",
    dict(value=_zeros((B, S + 1, K, H // 2))),
    ValueError,
    r"key and value must have the same shape but for the head dimension, got key "
    r"\(2, 6, 2, 8\) and value \(2, 7, 2, 4\)",
  ),
  ("head_dim", dict(query=_zeros((B, T, N, H + 1))), ValueError, r"same head dimension H"),
  ("batch", dict(query=_zeros((B + 1, T, N, H))), ValueError, r"same batch size B"),
  (
    "heads_divisible",
    dict(query=_zeros((B, T, 3, H))),
    ValueError,
    r"number of query heads N \(3\) must be a multiple of the number of key/value heads K \(2\)",
  ),
  (
    "int_inputs",
    dict(query=_zeros((B, T, N, H), jnp.int32)),
    TypeError,
    r"query must have a floating dtype, got int32",
  ),
  (
    "dtype_mismatch",
    dict(key=_zeros((B, S, K, H), jnp.bfloat16)),
    TypeError,
    r"same dtype, got query float32, key bfloat16 and value float32",
  ),
  ("not_array", dict(query="abc"), TypeError, r"query must be an array, got str"),
  (
    "bias_shape",
    dict(bias=_zeros((B, N, T, S + 1))),
    ValueError,
    r"bias must be broadcastable to \(B, N, T, S\)=\(2, 4, 5, 6\)",
  ),
  ("bias_rank", dict(bias=_zeros((1, B, N, T, S))), ValueError, r"bias must be broadcastable"),
  (
    "bias_bool",
    dict(bias=_zeros((T, S), bool)),
    TypeError,
    r"bias must have a floating or integer dtype, got bool; pass boolean masks as mask",
  ),
  (
    "mask_dtype",
    dict(mask=_zeros((T, S), jnp.int32)),
    TypeError,
    r"mask must be a boolean array, got dtype int32",
  ),
  (
    "mask_shape",
    dict(mask=_ones((B, N, T + 1, S), bool)),
    ValueError,
    r"query length T=6, but the inputs have query length T=5",
  ),
  ("mask_type", dict(mask="causal"), TypeError, r"mask must be a boolean array or a"),
  (
    "mask_fn_not_bool",
    dict(mask=masks.from_fn(lambda b, h, q, kv: q - kv)),
    TypeError,
    r"must evaluate to bool, got int32",
  ),
  (
    "segments_batch",
    dict(
      segment_ids=_zeros((B + 1, T), jnp.int32),
      query=_zeros((B, T, N, H)),
      key=_zeros((B, T, K, H)),
      value=_zeros((B, T, K, H)),
    ),
    ValueError,
    r"batch size B=3, but the inputs have batch size B=2",
  ),
  (
    "segments_T_ne_S",
    dict(segment_ids=_zeros((B, T), jnp.int32)),
    ValueError,
    r"segment_ids as one array needs T == S, got T=5 and S=6",
  ),
  (
    "segments_dtype",
    dict(segment_ids=(_zeros((B, T)), _zeros((B, S)))),
    TypeError,
    r"segment_ids \(q_segment_ids\) must have an integer dtype, got float32",
  ),
  (
    "segments_length",
    dict(segment_ids=(_zeros((B, T), int), _zeros((B, S - 1), int))),
    ValueError,
    r"segment_ids \(kv_segment_ids\) must have length 6",
  ),
  (
    "q_lengths_shape",
    dict(query_seq_lengths=jnp.array([3], jnp.int32)),
    ValueError,
    r"query_seq_lengths must have shape \(B,\)=\(2,\), got \(1,\)",
  ),
  (
    "kv_lengths_dtype",
    dict(key_value_seq_lengths=jnp.array([3.0, 4.0])),
    TypeError,
    r"key_value_seq_lengths must have an integer dtype, got float32",
  ),
  (
    "negative_lengths",
    dict(key_value_seq_lengths=np.array([3, -1])),
    ValueError,
    r"key_value_seq_lengths must be non-negative, got \[3, -1\]",
  ),
  (
    "lengths_int64_2_32",
    dict(query_seq_lengths=np.array([3, 2**32], np.int64)),
    ValueError,
    r"query_seq_lengths must be at most 2\*\*31 - 1 = 2147483647 \(jattn's positions and ids "
    r"are int32\), got 4294967296",
  ),
  (
    "lengths_uint32",
    dict(key_value_seq_lengths=jnp.array([3, 2**31], jnp.uint32)),
    ValueError,
    r"key_value_seq_lengths must be at most 2\*\*31 - 1 = 2147483647",
  ),
  (
    "segments_int64",
    dict(segment_ids=(np.zeros((B, T), np.int64), np.full((B, S), 2**32, np.int64))),
    ValueError,
    r"segment_ids \(kv_segment_ids\) must be at most 2\*\*31 - 1",
  ),
  (
    "segments_int64_negative",
    dict(segment_ids=(np.full((B, T), -(2**32), np.int64), np.zeros((B, S), np.int64))),
    ValueError,
    r"segment_ids \(q_segment_ids\) must be at least -2\*\*31 = -2147483648 \(jattn's "
    r"positions and ids are int32\), got -4294967296",
  ),
  (
    "window_2_31",
    dict(local_window_size=(2**31, 0)),
    ValueError,
    r"local_window_size\[0\] must be at most 2\*\*31 - 1",
  ),
  (
    "negative_window",
    dict(local_window_size=(2, -1)),
    ValueError,
    r"local_window_size\[1\] must be >= 0, got -1",
  ),
  (
    "window_type",
    dict(local_window_size=(1, 2, 3)),
    TypeError,
    r"local_window_size must be an int or a \(left, right\) tuple",
  ),
  ("is_causal_type", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
  ("scale_type", dict(scale="big"), TypeError, r"scale must be a real number"),
  ("scale_inf", dict(scale=float("inf")), ValueError, r"scale must be finite, got inf"),
  (
    "scale_complex",
    dict(scale=1j),
    TypeError,
    r"scale must be a real number, got 1j of type complex",
  ),
  (
    "scale_numpy_complex",
    dict(scale=np.complex64(2)),
    TypeError,
    r"scale must be a real number, got np.complex64\(2\+0j\) of type complex64",
  ),
  (
    "dropout_rate_high",
    dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
    ValueError,
    r"dropout_rate must be in \[0, 1\), got 1.0",
  ),
  (
    "dropout_rate_negative",
    dict(dropout_rate=-0.1),
    ValueError,
    r"dropout_rate must be in \[0, 1\), got -0.1",
  ),
  (
    "dropout_no_rng",
    dict(dropout_rate=0.1),
    ValueError,
    r"dropout_rate=0.1 needs dropout_rng, got None",
  ),
  (
    "dropout_bad_rng",
    dict(dropout_rate=0.1, dropout_rng=_zeros(3)),
    TypeError,
    r"dropout_rng must be a single jax.random.key or PRNGKey",
  ),
  (
    "unknown_implementation",
    dict(implementation="flash"),
    ValueError,
    r"implementation must be one of \['blockwise', 'cudnn', 'flex', 'flex_decode', "
    r"'flex_hopper', 'ragged_paged', 'splash', 'xla'\] or None, "
    r"got 'flash'",
  ),
  (
    "unknown_backward",
    dict(backward="manual"),
    ValueError,
    r"backward must be one of \['autodiff', 'custom_vjp'\] or None, got 'manual'",
  ),
  (
    "unsupported_backward",
    dict(implementation="cudnn", backward="custom_vjp"),
    ValueError,
    r"implementation='cudnn' does not support backward='custom_vjp'",
  ),
  (
    "blockwise_autodiff",
    dict(implementation="blockwise", backward="autodiff"),
    ValueError,
    r"implementation='blockwise' does not support backward='autodiff': it supports only "
    r"\['custom_vjp'\] \(JAX cannot reverse-differentiate its tile loops",
  ),
  (
    "blocks_with_xla",
    dict(implementation="xla", block_q=64),
    ValueError,
    r"block_q and block_kv apply only to implementation='blockwise', 'splash' or 'flex', "
    r"got implementation='xla'",
  ),
  (
    "blocks_with_autodiff",
    dict(block_kv=64, backward="autodiff"),
    ValueError,
    r"implementation='blockwise' does not support backward='autodiff'",
  ),
  (
    "block_q_zero",
    dict(implementation="blockwise", block_q=0),
    ValueError,
    r"block_q must be >= 1, got 0",
  ),
  ("block_kv_float", dict(block_kv=64.0), TypeError, r"block_kv must be an int"),
  (
    "unknown_backward_auto",
    dict(backward="manual", block_q=8),
    ValueError,
    r"backward must be one of",
  ),
  (
    "cudnn_score_fn",
    dict(implementation="cudnn", score_fn=lambda s, *i: s),
    ValueError,
    r"implementation='cudnn' does not support score_fn",
  ),
  ("score_fn_type", dict(score_fn=3), TypeError, r"score_fn must be callable"),
  (
    "score_fn_shape",
    dict(score_fn=lambda s, b, h, q, kv: s[0]),
    ValueError,
    r"score_fn must return a float array of the score's shape \(B, N, T, S\)=\(2, 4, 5, 6\)",
  ),
  (
    "score_fn_int",
    dict(score_fn=lambda s, b, h, q, kv: (s > 0).astype(jnp.int32)),
    TypeError,
    r"score_fn must return a floating array \(computed in any float dtype, cast back to the "
    r"score's float32\), got int32",
  ),
  (
    "score_fn_tuple",
    dict(score_fn=lambda s, b, h, q, kv: (s, s)),
    TypeError,
    r"score_fn must return one float array of the score's shape \(B, N, T, S\)=\(2, 4, 5, 6\), "
    r"got tuple",
  ),
  (
    "alibi_too_few_slopes",
    dict(score_fn=scores.alibi(np.ones(1, np.float32))),
    ValueError,
    r"score_fn alibi\(slopes shape=\(1,\), bidirectional=False\) has per-head parameters for "
    r"1 query heads, but the query has number of heads N=4",
  ),
  (
    "alibi_too_many_slopes",
    dict(score_fn=scores.alibi(np.ones(5, np.float32)), logits_soft_cap=30.0),
    ValueError,
    r"has per-head parameters for 5 query heads, but the query has number of heads N=4",
  ),
  (
    "t5_table_one_column",
    dict(score_fn=scores.relative_position_bias(np.ones((32, 1), np.float32))),
    ValueError,
    r"score_fn relative_position_bias\(table shape=\(32, 1\).* has per-head parameters for 1 "
    r"query heads, but the query has number of heads N=4",
  ),
  (
    "soft_cap",
    dict(logits_soft_cap=0.0),
    ValueError,
    r"logits_soft_cap: cap must be a positive finite number, got 0.0",
  ),
  (
    "mask_object_heads",
    dict(mask=masks.from_array(_ones((1, 3, T, S), bool))),
    ValueError,
    r"number of heads N=3, but the inputs have number of heads N=4",
  ),
]


@contextlib.contextmanager
def compile_events():
  """Collects the names of XLA compilations that happen inside the block."""
  events = []
  listener = lambda name, *args, **kwargs: events.append(name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _compiles(events):
  return [e for e in events if "backend_compile" in e]


@pytest.mark.parametrize(
  "overrides, error, message",
  [case[1:] for case in BAD_INPUTS],
  ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_raises_before_compiling(overrides, error, message):
  with compile_events() as events, pytest.raises(error, match=message):
    call(**overrides)
  assert not _compiles(events)


def test_compile_events_are_seen():
  """The check above can fail: a good call with new shapes does compile."""
  with compile_events() as events:
    call(query=_zeros((1, 3, 2, 4)), key=_zeros((1, 3, 2, 4)), value=_zeros((1, 3, 2, 4)))
  assert _compiles(events)


def test_traced_settings_are_rejected():
  with pytest.raises(TypeError, match="scale must be a concrete Python or NumPy number"):
    jax.jit(lambda s: call(scale=s))(0.5)
  with pytest.raises(TypeError, match="dropout_rate must be a concrete"):
    jax.jit(lambda r: call(dropout_rate=r, dropout_rng=jax.random.key(0)))(0.5)


def test_table_is_long_enough():
  assert len(BAD_INPUTS) >= 20


def test_fused_kernels_need_their_device():
  bf16 = dict(query=Q.astype(jnp.bfloat16), key=KV.astype(jnp.bfloat16))
  bf16["value"] = bf16["key"]
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="implementation='cudnn' needs an NVIDIA GPU"):
      call(implementation="cudnn", **bf16)
  if jax.default_backend() != "tpu":
    with pytest.raises(ValueError, match=r"implementation='splash' needs a TPU.*interpret_kernels"):
      call(implementation="splash", **bf16)


# (id, constructor call, exception, message fragment) for the mask and score constructors.
BAD_CONSTRUCTORS = [
  ("causal_offset", lambda: masks.causal(1.5), TypeError, r"offset must be an int, got 1.5"),
  ("window_negative", lambda: masks.sliding_window(-1), ValueError, r"left must be >= 0"),
  ("chunk_zero", lambda: masks.chunked(0), ValueError, r"size must be >= 1, got 0"),
  ("stride_zero", lambda: masks.strided(0), ValueError, r"stride must be >= 1"),
  ("global_negative", lambda: masks.global_tokens(-2), ValueError, r"n must be >= 0"),
  (
    "prefix_negative",
    lambda: masks.prefix_lm(np.array([2, -1])),
    ValueError,
    r"prefix_lengths must be non-negative",
  ),
  ("prefix_float", lambda: masks.prefix_lm(2.5), TypeError, r"prefix_lengths must be an integer"),
  (
    "prefix_2_32",
    lambda: masks.prefix_lm(2**32),
    ValueError,
    r"prefix_lengths must be at most 2\*\*31 - 1 = 2147483647 \(jattn's positions and ids are "
    r"int32\), got 4294967296",
  ),
  ("causal_2_31", lambda: masks.causal(2**31), ValueError, r"offset must be at most 2\*\*31 - 1"),
  (
    "causal_np_int64",
    lambda: masks.causal(np.int64(-(2**31) - 1)),
    ValueError,
    r"offset must be at least -2\*\*31",
  ),
  (
    "causal_array_2_32",
    lambda: masks.causal(np.array([0, 2**32])),
    ValueError,
    r"offset must be at most 2\*\*31 - 1 = 2147483647 \(jattn's positions and ids are int32\), "
    r"got 4294967296",
  ),
  (
    "window_2_31",
    lambda: masks.sliding_window(4, 2**31),
    ValueError,
    r"right must be at most 2\*\*31 - 1",
  ),
  (
    "dilation_2_31",
    lambda: masks.sliding_window(4, dilation=2**31),
    ValueError,
    r"dilation must be at most 2\*\*31 - 1",
  ),
  ("chunk_2_31", lambda: masks.chunked(2**31), ValueError, r"size must be at most 2\*\*31 - 1"),
  ("global_2_31", lambda: masks.global_tokens(2**31), ValueError, r"n must be at most 2\*\*31 - 1"),
  ("stride_2_31", lambda: masks.strided(2**40), ValueError, r"stride must be at most 2\*\*31 - 1"),
  (
    "lengths_2_31",
    lambda: masks.lengths(kv_lengths=np.array([1, 2**31])),
    ValueError,
    r"kv_lengths must be at most 2\*\*31 - 1",
  ),
  (
    "segments_uint64",
    lambda: masks.segments(np.array([0, 2**63], np.uint64)),
    ValueError,
    r"q_segment_ids must be at most 2\*\*31 - 1",
  ),
  (
    "reindex_int64",
    lambda: masks.reindex(masks.causal(), q=np.array([0, 2**31])),
    ValueError,
    r"q must be at most 2\*\*31 - 1",
  ),
  (
    "block_size_2_31",
    lambda: masks.block_sparse(np.ones((1, 1), bool), (2, 2**31)),
    ValueError,
    r"block_size\[1\] must be at most 2\*\*31 - 1",
  ),
  (
    "longformer_reach",
    lambda: masks.longformer(2**30, dilation=2),
    ValueError,
    r"window times dilation must be at most 2\*\*31 - 1 = 2147483647 \(jattn's positions and "
    r"ids are int32\), got 2147483648",
  ),
  (
    "segments_rank",
    lambda: masks.segments(_zeros((1, 2, 3), int)),
    ValueError,
    r"q_segment_ids must have rank 1 or 2, got shape \(1, 2, 3\)",
  ),
  (
    "segments_batches",
    lambda: masks.segments(_zeros((2, 3), int), _zeros((3, 3), int)),
    ValueError,
    r"same batch size",
  ),
  ("lengths_none", lambda: masks.lengths(), ValueError, r"needs q_lengths, kv_lengths or both"),
  (
    "lengths_batches",
    lambda: masks.lengths(np.array([1, 2]), np.array([1, 2, 3])),
    ValueError,
    r"same batch size",
  ),
  (
    "array_float",
    lambda: masks.from_array(np.zeros((2, 2))),
    TypeError,
    r"mask must be a boolean array, got dtype float64",
  ),
  (
    "array_rank",
    lambda: masks.from_array(np.zeros((1, 1, 1, 2, 2), bool)),
    ValueError,
    r"rank <= 4",
  ),
  ("fn_not_callable", lambda: masks.from_fn(3), TypeError, r"from_fn needs a callable"),
  (
    "combine_conflict",
    lambda: masks.segments(_zeros((2, 4), int)) & masks.lengths(np.array([1, 2, 3])),
    ValueError,
    r"different batch size in a combined mask",
  ),
  (
    "combine_non_mask",
    lambda: masks.causal() & True,
    TypeError,
    r"'&' combines a jattn.masks.Mask only with another Mask, got bool True",
  ),
  (
    "combine_jax_array",
    lambda: masks.causal() & _ones((T, S), bool),
    TypeError,
    r"'&' combines a jattn.masks.Mask only with another Mask, got an array of shape \(5, 6\) "
    r"\(ArrayImpl\); wrap a boolean array with masks.from_array\(...\) first",
  ),
  (
    "combine_numpy_array_left",
    lambda: np.ones((T, S), bool) & masks.causal(),
    TypeError,
    r"'&' combines a jattn.masks.Mask only with another Mask, got an array of shape \(5, 6\) "
    r"\(ndarray\); wrap a boolean array with masks.from_array",
  ),
  (
    "combine_jax_array_left_or",
    lambda: _ones((T, S), bool) | masks.causal(),
    TypeError,
    r"'\|' combines a jattn.masks.Mask only with another Mask, got an array",
  ),
  (
    "materialize_length",
    lambda: masks.segments(_zeros((4,), int)).materialize(5, 4),
    ValueError,
    r"q_len is 5 but the mask holds arrays for length 4",
  ),
  (
    "block_size",
    lambda: masks.causal().block_view(4, 4, block_q=0, block_kv=2),
    ValueError,
    r"block_q must be >= 1",
  ),
  (
    "alibi_int",
    lambda: scores.alibi(np.array([1, 2])),
    TypeError,
    r"slopes must have a floating dtype",
  ),
  ("alibi_rank", lambda: scores.alibi(np.ones((2, 2))), ValueError, r"slopes must have rank 1"),
  ("soft_cap_negative", lambda: scores.soft_cap(-1.0), ValueError, r"positive finite"),
  (
    "relative_table",
    lambda: scores.relative_position_bias(np.ones((8, 2)), num_buckets=32),
    ValueError,
    r"table must have shape \(num_buckets=32, N\)",
  ),
  (
    "relative_distance",
    lambda: scores.relative_position_bias(np.ones((32, 2)), num_buckets=32, max_distance=4),
    ValueError,
    r"max_distance \(4\)",
  ),
  ("compose_empty", lambda: scores.compose(), ValueError, r"at least one"),
  (
    "compose_heads",
    lambda: scores.compose(
      scores.alibi(np.ones(2, np.float32)), scores.relative_position_bias(np.ones((32, 3)))
    ),
    ValueError,
    r"compose needs score functions for the same number of heads, got "
    r"alibi\(slopes shape=\(2,\), bidirectional=False\) for 2 and relative_position_bias",
  ),
  (
    "t5_buckets",
    lambda: scores.t5_bucket(jnp.arange(3), num_buckets=1, max_distance=4, bidirectional=True),
    ValueError,
    r"num_buckets must be >= 2",
  ),
  ("grid_negative", lambda: masks.index_grid(1, 1, -1, 2), ValueError, r"q_len must be >= 0"),
  (
    "dropout_rate",
    lambda: jattn.dropout.keep_mask(jax.random.key(0), 1.5, 0, 0, 0, 0),
    ValueError,
    r"rate must be in \[0, 1\), got 1.5",
  ),
]


@pytest.mark.parametrize(
  "build, error, message", [c[1:] for c in BAD_CONSTRUCTORS], ids=[c[0] for c in BAD_CONSTRUCTORS]
)
def test_bad_constructor_arguments(build, error, message):
  with pytest.raises(error, match=message):
    build()


# --- explain with jax.ShapeDtypeStruct for every array argument ---------------------------------

# Every array argument of dot_product_attention, as real arrays (T != S: a pair's two ids differ).
ARRAY_ARGUMENTS = {
  "bias": dict(bias=_zeros((B, N, T, S))),
  "mask_array": dict(mask=_ones((B, 1, T, S), bool)),
  "segment_ids_pair": dict(segment_ids=(_zeros((B, T), jnp.int32), _zeros((B, S), jnp.int32))),
  "query_seq_lengths": dict(query_seq_lengths=jnp.full((B,), T, jnp.int32)),
  "key_value_seq_lengths": dict(key_value_seq_lengths=jnp.full((B,), S, jnp.int32)),
  "sinks": dict(sinks=_zeros((N,))),
  "dropout_rng": dict(dropout_rate=0.25, dropout_rng=jax.random.key(0)),
  "raw_dropout_rng": dict(dropout_rate=0.25, dropout_rng=jax.random.PRNGKey(0)),
}


def shapes(tree):
  """``tree`` with every array replaced by its jax.ShapeDtypeStruct."""
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
  return jax.tree_util.tree_map(shape, tree)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("name", list(ARRAY_ARGUMENTS))
def test_explain_takes_shape_dtype_structs_for_every_array(name, backend):
  """explain with ShapeDtypeStructs chooses what it chooses for the arrays they describe."""
  kwargs = ARRAY_ARGUMENTS[name]
  want = jattn.explain(Q, KV, KV, backend=backend, **kwargs)
  got = jattn.explain(*shapes((Q, KV, KV)), backend=backend, **shapes(kwargs))
  assert (got.implementation, got.backward) == (want.implementation, want.backward)
  assert set(got.rejected) == set(want.rejected)


def test_explain_takes_shape_dtype_struct_self_attention_segment_ids():
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
  for backend in ("cpu", "gpu", "tpu"):
    want = jattn.explain(q, q, q, segment_ids=_zeros((B, T), jnp.int32), backend=backend)
    assert jattn.explain(q, q, q, segment_ids=ids, backend=backend).implementation == (
      want.implementation
    )


# A ShapeDtypeStruct of the wrong shape or dtype raises what the array it describes raises.
BAD_SHAPES = [
  ("bias", dict(bias=_zeros((B, N, T, S + 1)))),
  ("mask_array", dict(mask=_ones((B, 1, T + 1, S), bool))),
  ("segment_ids", dict(segment_ids=_zeros((B, T + 1), jnp.int32))),
  ("segment_ids_pair", dict(segment_ids=(_zeros((B, T)), _zeros((B, S), jnp.int32)))),
  ("query_seq_lengths", dict(query_seq_lengths=jnp.full((B + 1,), T, jnp.int32))),
  ("key_value_seq_lengths", dict(key_value_seq_lengths=jnp.full((B,), 1.0))),
  ("sinks", dict(sinks=_zeros((N + 1,)))),
  ("dropout_rng", dict(dropout_rate=0.25, dropout_rng=_zeros((3,), jnp.uint32))),
]


@pytest.mark.parametrize("name,kwargs", BAD_SHAPES, ids=[b[0] for b in BAD_SHAPES])
def test_explain_checks_shape_dtype_structs_as_arrays(name, kwargs):
  with pytest.raises((ValueError, TypeError)) as want:
    jattn.explain(Q, KV, KV, **kwargs)
  message = str(want.value).splitlines()[0]  # JAX appends a note on its filtered frames
  with pytest.raises(want.type, match=f"^{re.escape(message)}"):
    jattn.explain(*shapes((Q, KV, KV)), **shapes(kwargs))
