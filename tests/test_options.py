"""jattn.Options: how a call runs, as one hashable value every front end takes whole."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from reference import normal

import jattn

FIELDS = dict(implementation="blockwise", backward="custom_vjp", block_q=4, block_kv=8)


def _qkv(T=16):
  return tuple(normal((2, T, 2, 8), jnp.float32, seed) for seed in range(3))


def test_options_are_frozen_hashable_and_a_static_argument():
  a, b = jattn.Options(**FIELDS), jattn.Options(**FIELDS)
  assert a == b and hash(a) == hash(b) and a != jattn.Options()
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.block_q = 2  # type: ignore[misc]
  q, k, v = _qkv()
  f = jax.jit(
    lambda q, options: jattn.dot_product_attention(q, k, v, options=options), static_argnums=1
  )
  np.testing.assert_array_equal(f(q, a), f(q, b))


def test_options_give_what_the_same_keywords_give():
  q, k, v = _qkv()
  kw = dict(is_causal=True, return_residual=True)
  by_keywords = jattn.dot_product_attention(q, k, v, **kw, **FIELDS)
  by_options = jattn.dot_product_attention(q, k, v, **kw, options=jattn.Options(**FIELDS))
  for x, y in zip(by_keywords, by_options):
    np.testing.assert_array_equal(x, y)
  grads = [
    jax.grad(lambda q: jattn.dot_product_attention(q, k, v, **extra).sum())(q)
    for extra in (FIELDS, dict(options=jattn.Options(**FIELDS)))
  ]
  np.testing.assert_array_equal(*grads)
  assert jattn.explain(q, k, v, options=jattn.Options(**FIELDS)) == jattn.explain(q, k, v, **FIELDS)


def test_ring_attention_takes_options():
  mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
  q, k, v = _qkv()
  ring = lambda **kw: jattn.parallel.ring_attention(
    q, k, v, mesh=mesh, axis_name="sp", is_causal=True, **kw
  )
  got = ring(options=jattn.Options(implementation="blockwise", block_q=4, block_kv=4))
  np.testing.assert_array_equal(got, ring(implementation="blockwise", block_q=4, block_kv=4))
  with pytest.raises(ValueError, match="options.backward must be None: ring attention has its own"):
    ring(options=jattn.Options(backward="custom_vjp"))
  pairs = r"implementation must be one of \['blockwise', 'splash', 'flex'\] or None, got 'xla'"
  with pytest.raises(ValueError, match=pairs):
    ring(options=jattn.Options(implementation="xla"))


@pytest.mark.parametrize(
  "make, error, match",
  [
    (lambda: jattn.Options(implementation="fast"), ValueError, "implementation must be one of"),
    (lambda: jattn.Options(backward="manual"), ValueError, "backward must be one of"),
    (
      lambda: jattn.Options(implementation="blockwise", backward="autodiff"),
      ValueError,
      "implementation='blockwise' does not support backward='autodiff'",
    ),
    (lambda: jattn.Options(block_q=0), ValueError, "block_q must be >= 1, got 0"),
    (
      lambda: jattn.Options(implementation="xla", block_kv=4),
      ValueError,
      "block_q and block_kv apply only to implementation='blockwise', 'splash' or 'flex'",
    ),
    (
      lambda: jattn.dot_product_attention(*_qkv(), block_q=4, options=jattn.Options(block_q=8)),
      ValueError,
      r"block_q given both as a keyword and in options=Options\(",
    ),
    (
      lambda: jattn.dot_product_attention(*_qkv(), options={"implementation": "xla"}),
      TypeError,
      "options must be a jattn.Options or None, got dict",
    ),
  ],
  ids=["implementation", "backward", "pair", "block_q", "tiles_for_xla", "twice", "type"],
)
def test_bad_options_raise_naming_the_field(make, error, match):
  with pytest.raises(error, match=match):
    make()


# Tile sizes a fused kernel cannot take raise when the Options is made, naming the size and the
# kernel's rule (flex: Triton's blocks, powers of two from 16; splash: multiples of the TPU's 128
# lanes), as they would at the call; a size not given takes the kernel's default.
BAD_TILES = [
  ("flex", dict(block_q=24), r"block_q=24 \(flex's tiles are powers of two, at least 16\)"),
  ("flex", dict(block_q=8), r"block_q=8 \(flex's tiles are powers of two, at least 16\)"),
  ("flex", dict(block_q=32, block_kv=48), r"block_kv=48 \(flex's tiles are powers of two"),
  ("splash", dict(block_q=64), r"block_q=64 not a multiple of 128"),
  ("splash", dict(block_kv=200), r"block_kv=200 not a multiple of 128"),
  ("splash", dict(block_q=64, block_kv=100), r"block_q=64 and block_kv=100 not a multiple of 128"),
]


@pytest.mark.parametrize(
  "implementation, blocks, match", BAD_TILES, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_TILES)]
)
def test_tile_sizes_a_kernel_cannot_take_raise_when_options_are_made(implementation, blocks, match):
  message = f"^implementation={implementation!r} does not support {match}"
  with pytest.raises(ValueError, match=message):
    jattn.Options(implementation=implementation, **blocks)
  with pytest.raises(ValueError, match=message):  # the keywords make an Options too
    jattn.explain(*_qkv(), implementation=implementation, backend="gpu", **blocks)


@pytest.mark.parametrize(
  "implementation, blocks",
  [
    ("flex", dict(block_q=16, block_kv=1024)),
    ("flex", dict(block_kv=64)),
    ("splash", dict(block_q=128, block_kv=512)),
    ("splash", dict(block_q=256)),
    ("blockwise", dict(block_q=24, block_kv=7)),
    (None, dict(block_q=24)),  # routing decides; blockwise takes it where a kernel cannot
  ],
)
def test_tile_sizes_a_kernel_takes_make_options(implementation, blocks):
  options = jattn.Options(implementation=implementation, **blocks)
  assert (options.block_q, options.block_kv) == (blocks.get("block_q"), blocks.get("block_kv"))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_attention_takes_options(paged):
  q, k, v = _qkv(T=4)
  cache = jattn.decode.init_paged(8, 4, 2, 2, 2, 8) if paged else jattn.decode.init(2, 8, 2, 8)
  fields = dict(implementation="blockwise", block_q=2, block_kv=4)
  want, _ = jattn.decode.attention(q, k, v, cache, **fields)
  got, new = jattn.decode.attention(q, k, v, cache, options=jattn.Options(**fields))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(new.lengths, [4, 4])
  if not paged:
    materialised = jattn.Options(implementation="xla", backward="custom_vjp")
    got, _ = jattn.decode.attention(q, k, v, cache, options=materialised)
    np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match="block_kv given both as a keyword and in options"):
    jattn.decode.attention(q, k, v, cache, block_kv=4, options=jattn.Options(block_kv=4))
