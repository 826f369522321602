"""jattn.masks: constructors against literal 0/1 matrices, combinators, tile classification."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TILED, TILED_LENGTH
from reference import (
  assert_close,
  attention_np,
  block_sparse_np,
  causal_np,
  chunked_np,
  dilated_window_np,
  global_np,
  lengths_np,
  normal,
  prefix_np,
  segments_np,
  strided_np,
  tile_classes_np,
  window_np,
)

import jattn
from jattn import masks


def _dense(mask, T, S, **kw):
  return np.asarray(mask.materialize(T, S, **kw)).astype(int)


def _m(text):
  return np.array([[int(c) for c in row] for row in text.split()])


def test_causal_literal():
  np.testing.assert_array_equal(
    _dense(masks.causal(), 4, 5)[0, 0],
    _m("""
      10000
      11000
      11100
      11110"""),
  )
  # offset S - T aligns the diagonal bottom-right, for queries appended after a cache.
  np.testing.assert_array_equal(
    _dense(masks.causal(offset=2), 3, 5)[0, 0],
    _m("""
      11100
      11110
      11111"""),
  )


def test_causal_per_batch_offsets_literal():
  # Row 0 of a ragged KV cache holds 1 token, row 1 holds 3: two new queries each.
  dense = _dense(masks.causal(np.array([1, 3])), 2, 5)
  np.testing.assert_array_equal(
    dense[0, 0],
    _m("""
      11000
      11100"""),
  )
  np.testing.assert_array_equal(
    dense[1, 0],
    _m("""
      11110
      11111"""),
  )
  # Negative offsets are allowed, as for the int form: the first queries see nothing.
  dense = _dense(masks.causal(np.array([-1, 0])), 3, 3)
  np.testing.assert_array_equal(
    dense[0, 0],
    _m("""
      000
      100
      110"""),
  )
  np.testing.assert_array_equal(
    dense[1, 0],
    _m("""
      100
      110
      111"""),
  )


def test_causal_scalar_array_offset_is_the_int_form():
  for offset in (np.array(2), jnp.array(-1, jnp.int32)):
    np.testing.assert_array_equal(
      _dense(masks.causal(offset), 3, 5), _dense(masks.causal(int(offset)), 3, 5)
    )
  assert masks.causal(np.array(2)).extents == (None, None, None, None)


def test_int32_extreme_offsets_and_widths():
  """Offsets and widths anywhere in int32's range: q + offset would overflow int32 and wrap
  (causal(2**31 - 1) allowed nothing past row 0)."""
  big = 2**31 - 1
  ones, zeros = np.ones((1, 1, 3, 4), int), np.zeros((1, 1, 3, 4), int)
  np.testing.assert_array_equal(_dense(masks.causal(big), 3, 4), ones)
  np.testing.assert_array_equal(_dense(masks.causal(-big - 1), 3, 4), zeros)
  np.testing.assert_array_equal(
    _dense(masks.causal(np.array([big, 0], np.int32)), 3, 4)[0, 0], ones[0, 0]
  )
  np.testing.assert_array_equal(_dense(masks.sliding_window(big, big), 3, 4), ones)
  np.testing.assert_array_equal(
    _dense(masks.sliding_window(big, big, dilation=big), 3, 4)[0, 0], np.eye(3, 4, dtype=int)
  )
  view = masks.causal(big).block_view(3, 4, block_q=2, block_kv=2)
  assert np.all(view == masks.FULL)


def test_sliding_window_literal():
  np.testing.assert_array_equal(
    _dense(masks.sliding_window(1, 2), 5, 5)[0, 0],
    _m("""
      11100
      11110
      01111
      00111
      00011"""),
  )
  np.testing.assert_array_equal(
    _dense(masks.sliding_window(None, 0), 3, 3)[0, 0],
    _m("""
      100
      110
      111"""),
  )


def test_chunked_literal():
  np.testing.assert_array_equal(
    _dense(masks.chunked(2), 5, 5)[0, 0],
    _m("""
      11000
      11000
      00110
      00110
      00001"""),
  )


def test_prefix_lm_literal():
  dense = _dense(masks.prefix_lm(np.array([2, 0])), 4, 4)
  np.testing.assert_array_equal(
    dense[0, 0],
    _m("""
      1100
      1100
      1110
      1111"""),
  )
  np.testing.assert_array_equal(
    dense[1, 0],
    _m("""
      1000
      1100
      1110
      1111"""),
  )


def test_segments_literal():
  dense = _dense(masks.segments(np.array([[0, 0, 1, 1, 1]]), np.array([[0, 1, 1, 2]])), 5, 4)
  np.testing.assert_array_equal(
    dense[0, 0],
    _m("""
      1000
      1000
      0110
      0110
      0110"""),
  )


def test_lengths_literal():
  dense = _dense(masks.lengths(np.array([2, 3]), np.array([3, 1])), 3, 4)
  np.testing.assert_array_equal(
    dense[0, 0],
    _m("""
      1110
      1110
      0000"""),
  )
  np.testing.assert_array_equal(
    dense[1, 0],
    _m("""
      1000
      1000
      1000"""),
  )


def test_global_tokens_literal():
  np.testing.assert_array_equal(
    _dense(masks.global_tokens(1), 4, 4)[0, 0],
    _m("""
      1111
      1000
      1000
      1000"""),
  )


def test_strided_literal():
  np.testing.assert_array_equal(
    _dense(masks.strided(2), 4, 5)[0, 0],
    _m("""
      10101
      01010
      10101
      01010"""),
  )


def test_dilated_window_literal():
  np.testing.assert_array_equal(
    _dense(masks.sliding_window(4, 2, dilation=2), 6, 6)[0, 0],
    _m("""
      101000
      010100
      101010
      010101
      101010
      010101"""),
  )


def test_longformer_literal():
  # window 1 on each side, dilation 2 (reaching 2 away), position 0 global
  np.testing.assert_array_equal(
    _dense(masks.longformer(1, dilation=2), 6, 6)[0, 0],
    _m("""
      111111
      110100
      101010
      110101
      101010
      100101"""),
  )
  np.testing.assert_array_equal(
    _dense(masks.longformer((2, 0), num_global=0), 4, 4)[0, 0],
    _m("""
      1000
      1100
      1110
      0111"""),
  )


def test_block_sparse_literal():
  layout = np.array([[True, False], [True, True]])
  np.testing.assert_array_equal(
    _dense(masks.block_sparse(layout, (2, 3)), 4, 7)[0, 0],
    _m("""
      1110000
      1110000
      1111110
      1111110"""),
  )  # the 7th key is past the layout: masked


def test_bigbird_layout_has_window_global_and_seeded_random_blocks():
  n, w, g, r = 12, 3, 2, 2
  layout = masks.bigbird_layout(
    n, num_window_blocks=w, num_global_blocks=g, num_random_blocks=r, seed=7
  )
  i, j = np.arange(n)[:, None], np.arange(n)[None]
  base = (np.abs(i - j) <= w // 2) | (i < g) | (j < g)
  assert layout[base].all()
  assert layout[:g].all() and layout[:, :g].all()
  # every non-global row gets exactly r blocks beyond the window and global ones
  np.testing.assert_array_equal((layout & ~base).sum(axis=1), [0] * g + [r] * (n - g))
  np.testing.assert_array_equal(
    masks.bigbird_layout(n, seed=7, num_global_blocks=g, num_random_blocks=r), layout
  )
  assert not np.array_equal(
    masks.bigbird_layout(n, seed=8, num_global_blocks=g, num_random_blocks=r), layout
  )
  causal = masks.bigbird_layout(n, seed=3, causal=True, num_random_blocks=r)
  assert not causal[j > i].any()
  causal_base = (np.abs(i - j) <= 1) | (j < 1)  # the default one global block
  np.testing.assert_array_equal((causal & ~causal_base).sum(axis=1)[4:], [r] * (n - 4))
  # rectangular (cross attention), and more random blocks than free ones: all taken
  assert masks.bigbird_layout(3, 5, num_random_blocks=9).all()


def test_bigbird_mask_is_its_layout_expanded_and_causal_is_lower_triangular():
  T, block = 21, 4  # T not a multiple of the block
  layout = masks.bigbird_layout(6, seed=1)
  np.testing.assert_array_equal(
    masks.bigbird(T, block_size=block, seed=1).materialize(T, T)[0, 0],
    block_sparse_np(layout, block, block, T, T),
  )
  causal = masks.bigbird(T, block_size=block, seed=1, causal=True).materialize(T, T)[0, 0]
  np.testing.assert_array_equal(
    causal,
    block_sparse_np(masks.bigbird_layout(6, seed=1, causal=True), block, block, T, T)
    & causal_np(T, T),
  )


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: masks.sliding_window(2, 1, dilation=0), "dilation must be >= 1"),
    (lambda: masks.block_sparse(np.ones((2, 2), int), 2), "layout must be a boolean array"),
    (lambda: masks.block_sparse(np.ones(2, bool), 2), r"layout must have shape \(nqb, nkb\)"),
    (lambda: masks.block_sparse(np.ones((2, 2), bool), (2, 0)), r"block_size\[1\] must be >= 1"),
    (lambda: masks.block_sparse(np.ones((2, 2), bool), (1, 2, 3)), "block_size must be an int or"),
    (lambda: masks.longformer(-1), "window must be >= 0"),
    (lambda: masks.longformer((1, 2, 3)), "window must be an int or a pair"),
    (lambda: masks.longformer(2, num_global=-1), "num_global must be >= 0"),
    (lambda: masks.bigbird_layout(4, num_window_blocks=2), "num_window_blocks must be odd"),
    (lambda: masks.bigbird_layout(0), "num_q_blocks must be >= 1"),
    (lambda: masks.bigbird_layout(4, causal=1), "causal must be a bool"),
    (lambda: masks.bigbird(10, block_size=0), "block_size must be >= 1"),
  ],
)
def test_sparse_pattern_errors(make, match):
  with pytest.raises((ValueError, TypeError), match=match):
    make()


def test_from_array_and_from_fn():
  arr = np.array([[True, False, True], [False, False, True]])
  np.testing.assert_array_equal(_dense(masks.from_array(arr), 2, 3)[0, 0], arr.astype(int))
  diag = masks.from_fn(lambda b, h, q, kv: (q == kv) | (h == 1))
  dense = _dense(diag, 3, 3, num_heads=2)
  np.testing.assert_array_equal(dense[0, 0], np.eye(3, dtype=int))
  np.testing.assert_array_equal(dense[0, 1], np.ones((3, 3), int))


# Every constructor, with a NumPy formula for its dense (B, N, T, S) form. B=2, N=3.
IDS_Q = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [4, 4, 5, 5, 5, 5, 6, 7, 7]])
IDS_KV = np.array([[0, 1, 1, 1, 2, 2, 2], [4, 5, 5, 6, 6, 7, 7]])
PER_HEAD = np.random.default_rng(0).random((1, 3, 9, 7)) < 0.5
SPARSE = np.random.default_rng(1).random((3, 5, 2)) < 0.5  # per head; 2 kv blocks of 3 < S
KINDS = {
  "causal": (masks.causal(1), lambda T, S: causal_np(T, S, 1)),
  "causal_negative": (masks.causal(-2), lambda T, S: causal_np(T, S, -2)),
  "causal_per_batch": (
    masks.causal(np.array([-2, 3])),
    lambda T, S: np.stack([causal_np(T, S, -2), causal_np(T, S, 3)])[:, None],
  ),
  "window": (masks.sliding_window(2, 1), lambda T, S: window_np(T, S, 2, 1)),
  "window_left_only": (masks.sliding_window(3, None), lambda T, S: window_np(T, S, 3, None)),
  "chunked": (masks.chunked(3), lambda T, S: chunked_np(T, S, 3)),
  "prefix_lm": (masks.prefix_lm(np.array([3, 5])), lambda T, S: prefix_np(T, S, [3, 5])),
  "segments": (masks.segments(IDS_Q, IDS_KV), lambda T, S: segments_np(IDS_Q, IDS_KV)),
  "lengths": (
    masks.lengths(np.array([4, 9]), np.array([7, 2])),
    lambda T, S: lengths_np(T, S, [4, 9], [7, 2]),
  ),
  "kv_lengths": (
    masks.lengths(kv_lengths=np.array([0, 5])),
    lambda T, S: lengths_np(T, S, None, [0, 5]),
  ),
  "global": (masks.global_tokens(2), lambda T, S: global_np(T, S, 2)),
  "strided": (masks.strided(3), lambda T, S: strided_np(T, S, 3)),
  "from_array": (masks.from_array(PER_HEAD), lambda T, S: PER_HEAD),
  "dilated": (
    masks.sliding_window(5, 3, dilation=2),
    lambda T, S: dilated_window_np(T, S, 5, 3, 2),
  ),
  "dilated_unbounded": (
    masks.sliding_window(None, 1, dilation=3),
    lambda T, S: dilated_window_np(T, S, None, 1, 3),
  ),
  "longformer": (
    masks.longformer(1, num_global=1, dilation=2),
    lambda T, S: dilated_window_np(T, S, 2, 2, 2) | global_np(T, S, 1),
  ),
  "block_sparse": (
    masks.block_sparse(SPARSE, (2, 3)),
    lambda T, S: block_sparse_np(SPARSE, 2, 3, T, S),
  ),
  "bigbird": (
    masks.bigbird(9, 7, block_size=2, num_random_blocks=1, seed=4),
    lambda T, S: block_sparse_np(
      masks.bigbird_layout(5, 4, num_random_blocks=1, seed=4), 2, 2, T, S
    ),
  ),
  "from_fn": (
    masks.from_fn(lambda b, h, q, kv: (q + kv + h) % 4 != 0),
    lambda T, S: (np.add.outer(np.arange(T), np.arange(S)) + np.arange(3)[:, None, None]) % 4 != 0,
  ),
}
T_, S_ = 9, 7


def _expected(kind):
  return np.broadcast_to(KINDS[kind][1](T_, S_), (2, 3, T_, S_))


@pytest.mark.parametrize("kind", list(KINDS))
def test_materialize_matches_formula(kind):
  mask = KINDS[kind][0]
  np.testing.assert_array_equal(
    mask.materialize(T_, S_, batch_size=2, num_heads=3), _expected(kind)
  )
  # Calling the mask on a grid is the same function.
  grid = masks.index_grid(2, 3, T_, S_)
  np.testing.assert_array_equal(np.broadcast_to(mask(*grid), (2, 3, T_, S_)), _expected(kind))


@pytest.mark.parametrize(
  "a, b",
  list(
    itertools.combinations(
      [
        "causal",
        "causal_per_batch",
        "window",
        "segments",
        "global",
        "strided",
        "from_fn",
        "kv_lengths",
      ],
      2,
    )
  ),
)
def test_combinators_match_dense_logic(a, b):
  ma, mb = KINDS[a][0], KINDS[b][0]
  da, db = _expected(a), _expected(b)
  for mask, want in [
    (ma & mb, da & db),
    (ma | mb, da | db),
    (~ma, ~da),
    (~(ma & mb) | mb, ~(da & db) | db),
  ]:
    np.testing.assert_array_equal(mask.materialize(T_, S_, batch_size=2, num_heads=3), want)


BLOCKS = [(1, 1), (2, 3), (4, 2), (3, 7), (16, 16), (5, 4)]


@pytest.mark.parametrize("block_q, block_kv", BLOCKS)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "from_fn"])
def test_block_view_is_exact_for_constructors(kind, block_q, block_kv):
  view = KINDS[kind][0].block_view(
    T_, S_, block_q=block_q, block_kv=block_kv, batch_size=2, num_heads=3
  )
  assert isinstance(view, np.ndarray) and view.dtype == np.int8
  np.testing.assert_array_equal(view, tile_classes_np(_expected(kind), block_q, block_kv))


def _assert_conservative(view, exact):
  """PARTIAL is always safe; EMPTY and FULL must be right."""
  claimed = view != masks.PARTIAL
  np.testing.assert_array_equal(view[claimed], exact[claimed])


@pytest.mark.parametrize("block_q, block_kv", BLOCKS)
def test_block_view_combinations_and_fns_are_conservative(block_q, block_kv):
  for mask, want in [
    (KINDS["from_fn"][0], _expected("from_fn")),
    (KINDS["causal"][0] & KINDS["window"][0], _expected("causal") & _expected("window")),
    (KINDS["segments"][0] | KINDS["global"][0], _expected("segments") | _expected("global")),
    (~KINDS["chunked"][0] & KINDS["strided"][0], ~_expected("chunked") & _expected("strided")),
  ]:
    kw = dict(block_q=block_q, block_kv=block_kv, batch_size=2, num_heads=3)
    exact = tile_classes_np(want, block_q, block_kv)
    _assert_conservative(mask.block_view(T_, S_, **kw), exact)
    np.testing.assert_array_equal(mask.block_view(T_, S_, exact=True, **kw), exact)


# Masks with arrays along T or S: correct through reindex, but their tiles are all PARTIAL.
_HOLDS_SEQUENCE_ARRAYS = ("segments", "from_array")


@pytest.mark.parametrize("kind", list(KINDS))
def test_reindex_matches_indexing_the_dense_mask(kind):
  rng = np.random.default_rng(3)
  full = _expected(kind)  # (2, 3, T_, S_)
  maps = {
    # One device's shard of a sequence, as ring attention uses it: exact tile classes.
    "contiguous": (np.arange(3, 9), np.arange(1, 6)),
    "permuted": (rng.permutation(T_)[:6], rng.permutation(S_)[:5]),
  }
  batch, head = np.array([1, 0, 1]), np.array([2, 0])
  for name, (q, kv) in maps.items():
    mask = masks.reindex(KINDS[kind][0], batch=batch, head=head, q=q, kv=kv)
    want = full[batch][:, head][:, :, q][:, :, :, kv]
    np.testing.assert_array_equal(mask.materialize(6, 5), want)
    for block_q, block_kv in [(2, 3), (4, 4)]:
      view = mask.block_view(6, 5, block_q=block_q, block_kv=block_kv)
      exact = tile_classes_np(want, block_q, block_kv)
      if name == "contiguous" and kind not in _HOLDS_SEQUENCE_ARRAYS + ("from_fn",):
        np.testing.assert_array_equal(view, exact)
      else:
        _assert_conservative(view, exact)


@pytest.mark.parametrize("kind", list(KINDS))
def test_reindex_with_a_row_of_query_positions_per_batch_row(kind):
  """q as (B, L): row b's query i stands for position q[b, i] (a decode step's chunk after
  each row's own cached tokens), with or without a batch map; tile classes come from each
  tile's positions hulled over the rows: conservative, and exact where the rows agree."""
  full = _expected(kind)  # (2, 3, T_, S_)
  for batch, q in [
    (None, np.stack([np.arange(3, 9), np.arange(0, 6)])),
    (np.array([1, 0, 1]), np.stack([np.arange(2, 8), np.arange(0, 6), np.arange(3, 9)])),
  ]:
    rows = range(2) if batch is None else batch
    mask = masks.reindex(KINDS[kind][0], batch=batch, q=q)
    want = np.stack([full[b][:, q[i]] for i, b in enumerate(rows)])
    np.testing.assert_array_equal(mask.materialize(6, S_, num_heads=3), want)
    assert mask.extents[0] == len(q) and mask.extents[2] == 6
    for block_q, block_kv in [(2, 3), (4, 4)]:
      view = mask.block_view(6, S_, block_q=block_q, block_kv=block_kv, num_heads=3)
      _assert_conservative(view, tile_classes_np(want, block_q, block_kv))
  same = np.stack([np.arange(3, 9)] * 2)  # rows at the same positions: the 1-D map's classes
  view = masks.reindex(KINDS[kind][0], q=same).block_view(6, S_, block_q=2, block_kv=3)
  one = masks.reindex(KINDS[kind][0], q=same[0]).block_view(6, S_, block_q=2, block_kv=3)
  np.testing.assert_array_equal(view, np.broadcast_to(one, view.shape))
  with pytest.raises(ValueError, match="q must have a row of positions per batch row"):
    masks.reindex(KINDS[kind][0], batch=np.array([1, 0, 1]), q=q[:2])


def test_reindex_of_a_causal_shard_skips_what_causal_skips():
  # Shard 1 of 2 (rows 4-7) against shard 0 (columns 0-3): every tile below the diagonal.
  mask = masks.reindex(masks.causal(), q=np.arange(4, 8), kv=np.arange(0, 4))
  assert (mask.block_view(4, 4, block_q=2, block_kv=2) == masks.FULL).all()
  mask = masks.reindex(masks.causal(), q=np.arange(0, 4), kv=np.arange(4, 8))
  assert (mask.block_view(4, 4, block_q=2, block_kv=2) == masks.EMPTY).all()


def test_reindex_with_traced_maps_and_errors():
  @jax.jit
  def view(offset):
    q = offset + jnp.arange(4, dtype=jnp.int32)
    mask = masks.reindex(masks.causal(), q=q, kv=jnp.arange(4, dtype=jnp.int32))
    return mask.block_view(4, 4, block_q=2, block_kv=2), mask.materialize(4, 4)

  tiles, dense = view(2)
  # Rows 2-5 against columns 0-3 of causal(): only the top-right tile is cut by the diagonal.
  np.testing.assert_array_equal(
    tiles[0, 0], [[masks.FULL, masks.PARTIAL], [masks.FULL, masks.FULL]]
  )
  np.testing.assert_array_equal(dense[0, 0], causal_np(4, 4, 2))
  assert (
    repr(masks.reindex(masks.causal(), q=np.arange(3))) == "reindex(causal(offset=0), q shape=(3,))"
  )
  assert masks.reindex(masks.causal(), q=np.arange(3)).extents == (None, None, 3, None)
  with pytest.raises(TypeError, match="reindex needs a jattn.masks.Mask"):
    masks.reindex(np.ones((2, 2), bool), q=np.arange(2))
  with pytest.raises(TypeError, match="q must have an integer dtype"):
    masks.reindex(masks.causal(), q=np.arange(2.0))
  with pytest.raises(ValueError, match="kv must have rank 1"):
    masks.reindex(masks.causal(), kv=np.zeros((2, 2), int))
  with pytest.raises(ValueError, match="q_len is 5 but the mask holds arrays for length 3"):
    masks.reindex(masks.causal(), q=np.arange(3)).materialize(5, 5)


def test_block_view_from_fn_is_all_partial_unless_exact():
  view = KINDS["from_fn"][0].block_view(8, 8, block_q=4, block_kv=4)
  assert (view == masks.PARTIAL).all()


def test_block_view_causal_skips_upper_triangle():
  view = masks.causal().block_view(8, 8, block_q=2, block_kv=2)[0, 0]
  np.testing.assert_array_equal(
    view, np.array([[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])
  )


@pytest.mark.parametrize("block", [1, 2, 3, 5])
def test_segments_sorted_self_attention_ids_with_gaps_are_exact(block):
  ids = np.array([[0, 0, 2, 2, 5, 5, 5, 9, 9, 12]])
  view = masks.segments(ids).block_view(10, 10, block_q=block, block_kv=block)
  np.testing.assert_array_equal(view, tile_classes_np(segments_np(ids, ids), block, block))


def test_segments_unsorted_ids_are_conservative():
  ids = np.array([[3, 0, 3, 1, 2, 0, 2, 1]])
  mask = masks.segments(ids)
  exact = tile_classes_np(segments_np(ids, ids), 2, 2)
  view = mask.block_view(8, 8, block_q=2, block_kv=2)
  _assert_conservative(view, exact)
  assert (view != exact).any()  # min/max bounds cannot see that {3, 0} and {1, 2} are disjoint


def test_block_view_with_traced_arrays():
  """Inside jit, data-dependent masks classify tiles with traced arrays."""

  @jax.jit
  def view(lengths):
    return masks.lengths(kv_lengths=lengths).block_view(4, 8, block_q=2, block_kv=4)

  np.testing.assert_array_equal(view(jnp.array([8, 3]))[:, 0], [[[2, 2], [2, 2]], [[1, 0], [1, 0]]])


@pytest.mark.parametrize("block_q, block_kv", BLOCKS)
def test_causal_per_batch_block_view_traced_matches_dense(block_q, block_kv):
  """Traced offsets (a KV cache's lengths under jit) classify tiles exactly."""
  offsets = np.array([[0, 4], [-3, 8], [5, -1]], np.int32)
  view = jax.jit(
    lambda off: masks.causal(off).block_view(
      T_, S_, block_q=block_q, block_kv=block_kv, num_heads=3
    )
  )
  for off in offsets:
    exact = masks.causal(off).block_view(
      T_, S_, block_q=block_q, block_kv=block_kv, num_heads=3, exact=True
    )
    np.testing.assert_array_equal(view(jnp.asarray(off)), exact)
    np.testing.assert_array_equal(
      exact,
      tile_classes_np(
        np.stack([causal_np(T_, S_, o) for o in off])[:, None].repeat(3, axis=1), block_q, block_kv
      ),
    )


# Combinations whose bounds mix kinds: each kind's bounds evaluated with either array module.
COMBINED = {
  "causal_not_strided_or_global": (KINDS["causal"][0] & ~KINDS["strided"][0]) | KINDS["global"][0],
  "segments_and_kv_lengths": KINDS["segments"][0] & KINDS["kv_lengths"][0],
  "block_sparse_or_prefix_lm": KINDS["block_sparse"][0] | KINDS["prefix_lm"][0],
}


@pytest.mark.parametrize("name", list(KINDS) + list(COMBINED))
def test_tile_bounds_with_numpy_and_with_jax_numpy_agree(name):
  """Bounds of a concrete mask are computed with NumPy (and stay NumPy), those of a traced one
  with jax.numpy: the same bounds for tiles that divide the lengths or not, also through a
  reindex (a shard and a permutation, as ring attention reads a mask)."""
  mask = KINDS[name][0] if name in KINDS else COMBINED[name]
  shard = masks.reindex(mask, batch=np.array([1, 0, 1]), q=np.arange(3, 9), kv=np.arange(1, 6))
  permuted = masks.reindex(mask, q=np.array([8, 0, 4, 2, 7, 1]), kv=np.array([6, 3, 0, 5, 1]))
  cases = [(T_, S_, (2, 3)), (T_, S_, (5, 4)), (T_, S_, (16, 16)), (6, 5, (2, 3)), (6, 5, (4, 4))]
  on = [mask, mask, mask, shard, permuted]

  def bounds(ms, xp):
    return [m.tile_bounds(masks.tiles.grid_tiles(T, S, *b, xp)) for m, (T, S, b) in zip(ms, cases)]

  with_jnp = jax.jit(lambda ms: bounds(ms, jnp))(on)
  for got_np, got_jnp in zip(bounds([masks.tiles.on_host(m) for m in on], np), with_jnp):
    for np_bound, jnp_bound in zip(got_np, got_jnp):
      assert isinstance(np_bound, np.ndarray)
      np.testing.assert_array_equal(np_bound, np.asarray(jnp_bound), strict=True)


def _compiling(f):
  """``f()`` and the number of XLA programs compiled while it ran."""
  events = []
  listen = lambda event, *a, **k: events.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    out = f()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return out, events.count("/jax/core/compile/backend_compile_duration")


def test_concrete_block_views_are_numpy_arrays_computed_without_compiling():
  mask = (
    masks.reindex(KINDS["segments"][0], kv=np.arange(S_))
    | (KINDS["block_sparse"][0] & KINDS["prefix_lm"][0])
    | masks.from_array(np.eye(T_, S_, dtype=bool))
  )
  kw = dict(block_q=2, block_kv=3, num_heads=3)
  view, compiled = _compiling(lambda: mask.block_view(T_, S_, **kw))
  assert not compiled and isinstance(view, np.ndarray) and view.dtype == np.int8
  want = segments_np(IDS_Q, IDS_KV) | np.eye(T_, S_, dtype=bool)
  want = want | (block_sparse_np(SPARSE, 2, 3, T_, S_) & prefix_np(T_, S_, [3, 5]))
  exact = tile_classes_np(np.broadcast_to(want, (2, 3, T_, S_)), 2, 3)
  _assert_conservative(view, exact)
  # While the caller is traced the classes of a concrete mask stay NumPy (a static schedule),
  # exact ones too; those of a traced mask are traced.
  seen = {}

  def inside(ids):
    seen.update(
      bounds=mask.block_view(T_, S_, **kw), exact=mask.block_view(T_, S_, exact=True, **kw)
    )
    seen["traced"] = masks.segments(ids).block_view(T_, T_, block_q=2, block_kv=3)
    return seen["traced"]

  traced = jax.jit(inside)(IDS_Q)
  assert isinstance(seen["exact"], np.ndarray) and isinstance(seen["traced"], jax.core.Tracer)
  np.testing.assert_array_equal(seen["bounds"], view)
  np.testing.assert_array_equal(seen["exact"], exact)
  want = masks.segments(IDS_Q).block_view(T_, T_, block_q=2, block_kv=3)
  np.testing.assert_array_equal(traced, want)


def test_materialize_compiles_one_program_per_structure_and_sizes():
  """Masks of one kind, settings and array shapes share one compiled program; the result is
  the same outside jit, inside it on concrete arrays, and on traced ones."""
  dense_of = lambda m: m.materialize(T_, S_, num_heads=2)  # noqa: E731
  rebuilt = masks.segments(IDS_Q[::-1], IDS_KV + 3) & masks.causal(2)
  _, compiled = _compiling(lambda: dense_of(masks.segments(IDS_Q, IDS_KV) & masks.causal(2)))
  assert compiled <= 1  # one program, or none when an earlier test compiled it
  dense, compiled = _compiling(lambda: dense_of(rebuilt))
  assert not compiled and isinstance(dense, jax.Array) and dense.dtype == np.bool_
  want = segments_np(IDS_Q[::-1], IDS_KV + 3) & causal_np(T_, S_, 2)
  np.testing.assert_array_equal(dense, np.broadcast_to(want, (2, 2, T_, S_)))
  for got in (jax.jit(lambda: dense_of(rebuilt))(), jax.jit(dense_of)(rebuilt)):
    np.testing.assert_array_equal(got, dense)


@pytest.mark.parametrize(
  "implementation, blocks", [("xla", {}), ("blockwise", dict(block_q=2, block_kv=3))]
)
def test_causal_per_batch_in_attention_matches_dense_mask(implementation, blocks):
  B, T, S, N, K, H = 2, 5, 7, 4, 2, 4
  q, k, v = normal((B, T, N, H)), normal((B, S, K, H), seed=1), normal((B, S, K, H), seed=2)
  offsets = np.array([2, -1], np.int32)  # row 1's first query sees nothing: zeros
  dense = np.stack([causal_np(T, S, o) for o in offsets])[:, None]
  want = attention_np(q, k, v, allowed=dense)
  attend = lambda mask: jattn.dot_product_attention(
    q, k, v, mask=mask, implementation=implementation, return_residual=True, **blocks
  )
  for got in (
    attend(masks.causal(offsets)),
    attend(dense),
    jax.jit(lambda off: attend(masks.causal(off)))(jnp.asarray(offsets)),
  ):
    assert_close(got[0], want[0])
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
    assert_close(np.where(np.isinf(got[1]), 0, got[1]), np.where(np.isinf(want[1]), 0, want[1]))
  np.testing.assert_array_equal(got[0][1, 0], 0.0)


@pytest.mark.parametrize(
  "offset, error, match",
  [
    (1.5, TypeError, r"offset must be an int, got 1.5 of type float"),
    (True, TypeError, r"offset must be an int, got True of type bool"),
    (np.array([1.0, 2.0]), TypeError, r"offset must have an integer dtype, got float64"),
    (np.array([[1, 2]]), ValueError, r"offset must have rank 0 or 1, got shape \(1, 2\)"),
    ("2", TypeError, r"offset must be an integer array, got str"),
  ],
)
def test_causal_offset_errors(offset, error, match):
  with pytest.raises(error, match=match):
    masks.causal(offset)


def test_causal_per_batch_extents_repr_and_pytree():
  mask = masks.causal(np.array([1, 2]))
  assert mask.extents == (2, None, None, None)
  assert repr(mask) == "causal(offset shape=(2,))"
  assert repr(masks.causal(3)) == "causal(offset=3)" and masks.causal(3).children == ()
  with pytest.raises(ValueError, match="different batch size in a combined mask: 2 and 3"):
    mask & masks.lengths(np.array([1, 2, 3]))
  with pytest.raises(ValueError, match="batch_size is 3 but the mask holds arrays for 2"):
    mask.materialize(2, 4, batch_size=3)
  leaves, treedef = jax.tree_util.tree_flatten(mask)
  assert len(leaves) == 1
  assert jax.tree_util.tree_structure(masks.causal(np.array([5, 0]))) == treedef
  got = jax.jit(lambda m: m.materialize(3, 4))(mask)
  np.testing.assert_array_equal(got, mask.materialize(3, 4))


def test_masks_are_pytrees():
  mask = masks.causal(1) & masks.segments(IDS_Q, IDS_KV)
  leaves, treedef = jax.tree_util.tree_flatten(mask)
  assert len(leaves) == 2
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  np.testing.assert_array_equal(rebuilt.materialize(T_, S_), mask.materialize(T_, S_))
  # Equal settings give equal treedefs: jit does not recompile for a rebuilt mask.
  assert (
    jax.tree_util.tree_structure(masks.causal(1) & masks.segments(IDS_Q + 1, IDS_KV)) == treedef
  )
  got = jax.jit(lambda m: m.materialize(T_, S_))(mask)
  np.testing.assert_array_equal(got, mask.materialize(T_, S_))


def test_the_treedefs_of_two_kinds_never_compare_equal():
  # jit keys its compiled programs on the arguments' treedefs. Masks of different kinds with
  # equal settings, or the same operands under & and |, must not share one: with jax's own
  # register_dataclass they compared equal, and now and then (a hash-table collision in jit's
  # cache) materialize returned the & of two masks for their |.
  g, k = masks.global_tokens(2), masks.lengths(kv_lengths=np.array([0, 5]))
  one_setting = [masks.causal(1), masks.global_tokens(1), masks.strided(1), masks.chunked(1)]
  one_child = [masks.causal(np.array([1, 2])), masks.prefix_lm(np.array([1, 2])), ~g]
  for group in ([g & k, g | k], one_setting, one_child):
    structures = [jax.tree_util.tree_structure(m) for m in group]
    for (i, a), (j, b) in itertools.combinations(enumerate(structures), 2):
      assert a != b, (group[i], group[j])
    # the same kind and settings still share one (no recompilation for a rebuilt mask)
    assert all(
      s == jax.tree_util.tree_structure(jax.tree.map(lambda x: x, m))
      for s, m in zip(structures, group)
    )
  dense = jax.jit(lambda m: m.materialize(9, 7, batch_size=2))
  want_g, want_k = global_np(9, 7, 2), lengths_np(9, 7, None, [0, 5])
  np.testing.assert_array_equal(dense(g & k), want_g & want_k)
  np.testing.assert_array_equal(dense(g | k), want_g | want_k)


def test_repr_names_the_parts():
  mask = (masks.causal() & ~masks.chunked(4)) | masks.global_tokens(1)
  assert repr(mask) == "((causal(offset=0) & ~chunked(size=4)) | global_tokens(n=1))"


def test_mask_is_immutable():
  with pytest.raises(AttributeError):
    masks.causal().params = (3,)


def test_extents_and_batch_defaults():
  mask = masks.segments(IDS_Q, IDS_KV) & masks.causal()
  assert mask.extents == (2, None, T_, S_)
  assert mask.materialize(T_, S_).shape == (2, 1, T_, S_)
  with pytest.raises(ValueError, match="batch_size is 3 but the mask holds arrays for 2"):
    mask.materialize(T_, S_, batch_size=3)


L = TILED_LENGTH  # TILED's blockwise evaluates masks on 2 x 2 tiles of 4 x 4
ALLOWED_LL = np.tril(np.ones((L, L), bool)) | (np.arange(L)[None] % 3 == 0)

MASK_FNS_NOT_FROM_INDICES = {
  # A captured (T, S) array combined with the indices by broadcasting.
  "captured_table": lambda b, h, qi, kv: jnp.asarray(ALLOWED_LL) & (qi >= 0),
  "positions_from_shape": lambda b, h, qi, kv: jnp.arange(kv.shape[-1]).reshape(1, 1, 1, -1) <= qi,
}


@pytest.mark.parametrize("implementation", list(TILED) + ["attention_weights"])
@pytest.mark.parametrize("name", list(MASK_FNS_NOT_FROM_INDICES))
def test_mask_fn_that_does_not_compute_from_its_indices_is_rejected(name, implementation):
  q = k = v = normal((1, L, 2, 4))
  mask = masks.causal() & masks.from_fn(MASK_FNS_NOT_FROM_INDICES[name])
  match = (
    r"mask from_fn\(<lambda>\) must compute from its index arguments \(batch, head, "
    r"q_idx, kv_idx\)"
  )
  with jax.numpy_rank_promotion("allow"), pytest.raises(ValueError, match=match):
    if implementation == "attention_weights":
      jattn.attention_weights(q, k, mask=mask)
    else:
      jattn.dot_product_attention(q, k, v, mask=mask, **TILED[implementation])


def test_a_mask_fn_is_probed_once_per_grid_and_a_bad_one_every_time():
  calls = []

  def banded(b, h, qi, kv):
    calls.append((b.shape[0], qi.shape[2]))
    return jnp.abs(qi - kv) <= 2

  q = normal((1, L, 2, 4))
  run = lambda mask, q: jattn.dot_product_attention(q, q, q, mask=mask, implementation="xla")
  out = run(masks.from_fn(banded), q)
  allowed = np.abs(np.arange(L)[:, None] - np.arange(L)[None]) <= 2
  assert_close(out, attention_np(q, q, q, allowed=allowed)[0])
  # The probes evaluate the function on a tile of 2 queries and a grid of 3 (of batch 1
  # here); a second call, from a mask built anew from the same function, probes nothing.
  assert {(1, 2), (1, 3)} <= set(calls)
  del calls[:]
  run(masks.from_fn(banded), q)
  assert (1, 2) not in calls and (1, 3) not in calls
  del calls[:]
  run(masks.from_fn(banded), jnp.concatenate([q, q]))  # B = 2: other grids, probed again
  assert {(1, 2), (2, 3)} <= set(calls)

  bad = masks.from_fn(MASK_FNS_NOT_FROM_INDICES["positions_from_shape"])
  for attend in (run, jax.jit(run, static_argnums=0)):  # refused on every call, traced or not
    for _ in range(2):
      with jax.numpy_rank_promotion("allow"), pytest.raises(ValueError, match="other values"):
        attend(bad, q)


@pytest.mark.parametrize("implementation", list(TILED))
def test_mask_fns_that_compute_from_their_indices_work_everywhere(implementation):
  q, k, v = normal((2, L, 2, 4)), normal((2, L, 2, 4), seed=1), normal((2, L, 2, 4), seed=2)
  table = masks.from_fn(lambda b, h, qi, kv: jnp.asarray(ALLOWED_LL)[qi, kv])
  out = jattn.dot_product_attention(q, k, v, mask=table, **TILED[implementation])
  assert_close(out, attention_np(q, k, v, allowed=ALLOWED_LL)[0])

  @jax.jit
  def closure(offsets):  # closes over a traced array: values cannot be probed
    fn = masks.from_fn(lambda b, h, qi, kv: kv <= qi + offsets[b])
    return jattn.dot_product_attention(q, k, v, mask=fn, **TILED[implementation])

  offsets = np.array([0, 2])
  assert_close(
    closure(jnp.asarray(offsets)),
    attention_np(q, k, v, allowed=np.stack([causal_np(L, L, o) for o in offsets])[:, None])[0],
  )
