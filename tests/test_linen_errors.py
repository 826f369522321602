"""jattn.linen.MultiHeadAttention's errors: bad settings raise at construction, bad calls
before anything compiles, each naming the argument, what was expected and what arrived."""

import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax_helpers import B, F, S, T, abstract_init, sample

import jattn
import jattn.linen
from jattn import positional

MHA = jattn.linen.MultiHeadAttention


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
    r"implementation must be one of \['blockwise', 'cudnn', 'flex', 'flex_decode', "
    r"'flex_hopper', 'ragged_paged', 'splash', 'xla'\] or None, "
    r"got 'flash'",
  ),
  ("backward", dict(num_heads=2, backward="manual"), ValueError, r"backward must be one of"),
  (
    "block_q_xla",
    dict(num_heads=2, implementation="xla", block_q=2),
    ValueError,
    r"block_q and block_kv apply only to implementation='blockwise', 'splash' or 'flex'",
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
  ("decode_type", dict(num_heads=2, decode="yes"), TypeError, r"decode must be a bool or None"),
  (
    "options_and_keyword",
    dict(num_heads=2, options=jattn.Options(implementation="xla"), implementation="xla"),
    ValueError,
    r"implementation given both as a keyword and in options=",
  ),
  (
    "options_paged_xla",
    dict(num_heads=2, options=jattn.Options(implementation="xla"), page_size=4),
    ValueError,
    r"a paged \(page_size=4\) cache is read by blockwise attention alone",
  ),
  (
    "einsum_alone",
    dict(num_heads=2, qk_attn_weights_einsum_cls=lambda: jnp.einsum),
    ValueError,
    r"qk_attn_weights_einsum_cls needs its partner: qk_attn_weights_einsum_cls and "
    r"attn_weights_value_einsum_cls are given together",
  ),
  (
    "einsums_and_implementation",
    dict(
      num_heads=2,
      implementation="xla",
      qk_attn_weights_einsum_cls=lambda: jnp.einsum,
      attn_weights_value_einsum_cls=lambda: jnp.einsum,
    ),
    ValueError,
    r"implementation='xla' applies to jattn's attention, but the einsum factories",
  ),
  (
    "ragged_cache_not_bool",
    dict(num_heads=2, ragged_cache=1),
    TypeError,
    r"ragged_cache must be a bool",
  ),
  (
    "attention_fn_and_implementation",
    dict(num_heads=2, attention_fn=nn.dot_product_attention, implementation="xla"),
    ValueError,
    r"implementation='xla' applies to jattn's attention, which attention_fn replaces",
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


# (id, constructor kwargs, call kwargs (inputs_q default sample()), exception, message fragment)
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
    "rank_1",
    dict(num_heads=2),
    dict(inputs_q=sample((F,))),
    ValueError,
    r"inputs_q must have shape \(batch\.\.\., length, features\), got \(16,\)",
  ),
  (
    "kv_rank",
    dict(num_heads=2),
    dict(inputs_k=sample((S, F))),
    ValueError,
    r"inputs_q and inputs_k must have the same batch dimensions, got \(2, 6, 16\) and "
    r"\(9, 16\)",
  ),
  (
    "kv_batch",
    dict(num_heads=2),
    dict(inputs_k=sample((B + 1, S, F))),
    ValueError,
    r"same batch dimensions",
  ),
  (
    "rope_cross",
    dict(num_heads=2, rope=positional.Rotary()),
    dict(inputs_k=sample((B, S, F))),
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
  (
    "kv_both",
    dict(num_heads=2),
    dict(inputs_k=sample((B, S, F)), inputs_kv=sample((B, S, F))),
    ValueError,
    r"give inputs_kv \(keys and values from one input\) or inputs_k and inputs_v, not both",
  ),
  (
    "v_alone",
    dict(num_heads=2),
    dict(inputs_v=sample((B, S, F))),
    ValueError,
    "`inputs_k` cannot be None if `inputs_v` is not None",
  ),
  (
    "kv_lengths",
    dict(num_heads=2),
    dict(inputs_k=sample((B, S, F)), inputs_v=sample((B, S + 1, F))),
    ValueError,
    r"inputs_k and inputs_v must have the same length",
  ),
  ("decode_type", dict(num_heads=2), dict(decode=1), TypeError, r"decode must be a bool, got 1"),
  (
    "causal_attention_fn",
    dict(num_heads=2, attention_fn=nn.dot_product_attention, is_causal=True),
    {},
    ValueError,
    r"is_causal needs an attention_fn that takes is_causal",
  ),
]


@pytest.mark.parametrize(
  "ctor, call, error, match", [pytest.param(*c[1:5], id=c[0], marks=c[5:]) for c in BAD_CALLS]
)
def test_bad_call_raises(ctor, call, error, match):
  module = MHA(**ctor)
  call = dict(call)
  inputs_q = call.pop("inputs_q", sample())
  with pytest.raises(error, match=match):
    abstract_init(module, inputs_q, **call)
