"""jattn.varlen_attention: sequences packed along one token axis (THD), each attending to
its own keys, against a float64 NumPy formula run sequence by sequence (values, lse, max
logits) and autodiff of the same per sequence (gradients); bottom-right alignment where a
sequence's query and key lengths differ; padding; traced offsets (one compile), jit, grad,
vmap; tiles across sequences skipped; splash where its causal mask is the call's; bad
offsets refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import array, assert_close, attention_jnp, attention_np

import jattn
from jattn import masks, scores

N, K, H = 4, 2, 8
# Three sequences (query lengths 5, 0, 6; key lengths 3, 2, 6), then padding: 2 queries, 1 key.
CU_Q = np.array([0, 5, 5, 11], np.int32)
CU_K = np.array([0, 3, 5, 11], np.int32)
TQ, TK = 13, 12
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])


def _inputs(dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: rng.standard_normal(shape).astype(dtype)
  return draw(TQ, N, H), draw(TK, K, H), draw(TK, K, H)


def _allowed(t, s, causal, window):
  """(t, s) bool: bottom-right aligned causal and window within one sequence."""
  i = np.arange(t)[:, None] + s - t  # each query's place on the key axis
  j = np.arange(s)[None, :]
  ok = np.ones((t, s), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (i - window[0] <= j) & (j <= i + window[1])
  return ok


def _per_sequence(attend, q, k, v, cu_q, cu_k, causal, window, score):
  """``attend(q, k, v, allowed, score)`` on each sequence, stitched back; padding rows and
  rows that see no key zero (their lse -inf)."""
  outs, lses = [], []
  for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
    t, s = b - a, d - c
    if t == 0:
      continue
    aligned = None
    if score is not None:  # on the positions within the sequence, the query's aligned
      aligned = lambda x, bb, h, qq, kk, shift=s - t: score(x, bb, h, qq + shift, kk)
    out, lse = attend(
      q[None, a:b], k[None, c:d], v[None, c:d], _allowed(t, s, causal, window), aligned
    )
    outs.append(out[0])
    lses.append(lse[0])
  pad = q.shape[0] - cu_q[-1]
  xp = np if isinstance(outs[0], np.ndarray) else jnp
  outs.append(xp.zeros((pad, N, H), outs[0].dtype))
  lses.append(xp.full((pad, N), -np.inf, lses[0].dtype))
  return xp.concatenate(outs), xp.concatenate(lses)


def _alibi_np(s, b, h, q, kv):
  return s - SLOPES[h] * np.abs(q - kv)


RULES = {
  "autodiff": dict(implementation="xla", backward="autodiff"),
  "custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=4, block_kv=3),
  "flex": dict(implementation="flex"),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("causal, window", [(True, None), (False, (2, 1))])
def test_each_sequence_attends_to_its_own_keys(rule, causal, window):
  """Values, lse and max logits against the formula per sequence, with ALiBi on the
  positions within the sequence and a soft cap; gradients against autodiff of the same per
  sequence; padding rows zero, their gradients too."""
  q, k, v = _inputs()
  kw = dict(
    is_causal=causal,
    local_window_size=window,
    score_fn=scores.alibi(jnp.asarray(SLOPES, jnp.float32), bidirectional=True),
    logits_soft_cap=6.0,
  )
  score = lambda s, b, h, qq, kk: 6.0 * np.tanh(_alibi_np(s, b, h, qq, kk) / 6.0)
  with jattn.testing.interpret_kernels():
    out, lse, top = jattn.varlen_attention(
      q, k, v, CU_Q, CU_K, return_residual=True, return_max_logit=True, **kw, **RULES[rule]
    )
  ref = lambda q, k, v, allowed, score: attention_np(q, k, v, allowed=allowed, score=score)
  want, want_lse = _per_sequence(ref, q, k, v, CU_Q, CU_K, causal, window, score)
  assert_close(out, want, np.float32)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  live = np.isfinite(want_lse)
  assert_close(np.asarray(lse)[live], np.asarray(want_lse)[live], np.float32)
  assert np.isneginf(want_lse[TQ - 2 :]).all() and not np.any(out[TQ - 2 :])  # padding
  if causal:  # the first two queries of the 5-query, 3-key sequence see no key
    assert np.isneginf(want_lse[:2]).all()
  np.testing.assert_array_equal(np.isneginf(top), ~live)

  ct = np.sin(np.arange(out.size, dtype=np.float32)).reshape(out.shape)
  loss = lambda o: jnp.sum(o * ct)

  def ours(q, k, v):
    with jattn.testing.interpret_kernels():
      return loss(jattn.varlen_attention(q, k, v, CU_Q, CU_K, **kw, **RULES[rule]))

  def theirs(q, k, v):
    score_jnp = lambda s, b, h, qq, kk: 6.0 * jnp.tanh((s - SLOPES[h] * jnp.abs(qq - kk)) / 6.0)
    ref = lambda q, k, v, allowed, score: attention_jnp(q, k, v, allowed=allowed, score=score)
    return loss(_per_sequence(ref, q, k, v, CU_Q, CU_K, causal, window, score_jnp)[0])

  got = jax.grad(ours, (0, 1, 2))(q, k, v)
  for name, g, w in zip("qkv", got, jax.grad(theirs, (0, 1, 2))(q, k, v)):
    assert_close(g, w, np.float32, err_msg=f"d{name}")
  assert not np.any(got[0][TQ - 2 :]) and not np.any(got[1][TK - 1 :])  # padding: none


def test_traced_offsets_compile_once_for_any_boundaries():
  """Under jit the offsets are traced: one program serves any split of the tokens (equal
  query and key offsets here, as self-attention packs them), each split's values its own."""
  q, k, v = _inputs()
  k, v = (np.concatenate([x, x[:1]]) for x in (k, v))  # TK + 1 = TQ keys
  traces = []

  @jax.jit
  def step(q, k, v, cu):
    traces.append(1)
    return jattn.varlen_attention(q, k, v, cu, cu, is_causal=True, implementation="blockwise")

  for cu in (np.array([0, 4, 9, 13]), np.array([0, 1, 2, 11]), np.array([0, 13, 13, 13])):
    got = step(q, k, v, cu.astype(np.int32))
    ref = lambda q, k, v, allowed, score: attention_np(q, k, v, allowed=allowed)
    want, _ = _per_sequence(ref, q, k, v, cu, cu, True, None, None)
    assert_close(got, want, np.float32, err_msg=str(cu))
  assert len(traces) == 1


def test_vmap_over_packed_batches_and_check_grads(x64):
  """vmap over a leading axis of packed batches, each with its own offsets; the blockwise
  custom_vjp's gradients through varlen in float64 (check_grads, reverse mode)."""
  q, k, v = _inputs(np.float64)
  cus = (
    np.array([[0, 5, 5, 11], [0, 2, 9, 13]], np.int32),
    np.array([[0, 3, 5, 11], [0, 2, 9, 12]], np.int32),
  )
  attend = lambda q, k, v, cu_q, cu_k: jattn.varlen_attention(
    q, k, v, cu_q, cu_k, is_causal=True, implementation="blockwise", block_q=4, block_kv=4
  )
  got = jax.vmap(attend)(*(np.stack([x, x[::-1]]) for x in (q, k, v)), *cus)
  for i in range(2):
    ref = lambda q, k, v, allowed, score: attention_np(q, k, v, allowed=allowed)
    xs = [x if i == 0 else x[::-1] for x in (q, k, v)]
    want, _ = _per_sequence(ref, *xs, cus[0][i], cus[1][i], True, None, None)
    assert_close(got[i], want, np.float64)
  small = [array(x[:8]) for x in (q, k, v)]
  cu = np.array([0, 3, 8], np.int32)
  check_grads(lambda *a: attend(*a, cu, cu), small, order=1, modes=["rev"])


def test_tiles_across_sequences_and_above_each_diagonal_are_skipped():
  """The mask's tile classes: EMPTY across sequences and above each sequence's aligned
  diagonal, FULL below it; known when the call is traced for concrete offsets."""
  cu_q = np.array([0, 8, 16, 32], np.int32)
  cu_k = np.array([0, 8, 24, 32], np.int32)  # 8 queries to 16 keys, then 16 queries to 8
  tokens = jattn.varlen.Tokens.of(cu_q, cu_k, 32, 32)
  mask = tokens.mask(True, None, False)
  classes = np.asarray(mask.block_view(32, 32, block_q=8, block_kv=8))[0, 0]
  want = np.array(
    [
      [masks.PARTIAL, masks.EMPTY, masks.EMPTY, masks.EMPTY],
      [masks.EMPTY, masks.FULL, masks.PARTIAL, masks.EMPTY],
      [masks.EMPTY, masks.EMPTY, masks.EMPTY, masks.EMPTY],  # aligned before its keys
      [masks.EMPTY, masks.EMPTY, masks.EMPTY, masks.PARTIAL],
    ]
  )
  np.testing.assert_array_equal(classes, want)
  dense = np.asarray(mask.materialize(32, 32))[0, 0]
  for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
    np.testing.assert_array_equal(dense[a:b, c:d], _allowed(b - a, d - c, True, None))
    assert dense[a:b].sum() == dense[a:b, c:d].sum()


def test_splash_runs_packed_sequences():
  """Splash takes the call: its segment ids are the sequences, and its causal mask is the
  call's own where every sequence has as many queries as keys (the same offsets, traced or
  not); with concrete offsets it tabulates the aligned causal mask of any lengths. Traced
  offsets that differ need the aligned mask at positions known only on the device, which
  splash cannot tabulate: the table runs another implementation then."""
  q, k, v = _inputs()
  k, v = (np.concatenate([x, x[:1]]) for x in (k, v))
  ref = lambda q, k, v, allowed, score: attention_np(q, k, v, allowed=allowed)
  for cu_q, cu_k in ((np.array([0, 5, 9, 13]),) * 2, (np.array([0, 5, 13]), np.array([0, 3, 13]))):
    cu_q, cu_k = cu_q.astype(np.int32), cu_k.astype(np.int32)
    with jattn.testing.interpret_kernels():
      got = jattn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, implementation="splash")
    assert_close(got, _per_sequence(ref, q, k, v, cu_q, cu_k, True, None, None)[0], np.float32)

  x = jnp.zeros((512, 8, 128), jnp.bfloat16)
  attend = lambda x, cu_q, cu_k: jattn.varlen_attention(x, x, x, cu_q, cu_k, is_causal=True)
  cu, other = jnp.array([0, 128, 512]), jnp.array([0, 256, 512])
  with jattn.testing.lowering_for("tpu"):
    same = jax.jit(lambda x, cu: attend(x, cu, cu)).trace(x, cu)
    differ = jax.jit(attend).trace(x, cu, other)
  hlo = lambda traced: traced.lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in hlo(same) and "tpu_custom_call" not in hlo(differ)


@pytest.mark.parametrize(
  "cu_q, cu_k, error, match",
  [
    ([0, 5, 3], [0, 5, 3], ValueError, r"cu_seqlens_q must be nondecreasing, got \[0, 5, 3\]"),
    ([0, 5, 13], [0, 5], ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
    ([0, 5, 14], [0, 5, 12], ValueError, r"cu_seqlens_q ends at 14, past the 13 query tokens"),
    ([0, 5, 13], [0, 5, 13], ValueError, r"cu_seqlens_k ends at 13, past the 12 key tokens"),
    ([1, 5, 13], [0, 5, 12], ValueError, r"cu_seqlens_q must start at 0"),
    ([0.0, 13.0], [0, 12], TypeError, r"cu_seqlens_q must be an int array of offsets"),
    ([[0, 13]], [0, 12], ValueError, r"cu_seqlens_q must have shape \(num_seqs \+ 1,\)"),
  ],
)
def test_bad_offsets_are_refused_by_name(cu_q, cu_k, error, match):
  q, k, v = _inputs()
  with pytest.raises(error, match=match):
    jattn.varlen_attention(q, k, v, np.asarray(cu_q), np.asarray(cu_k))


def test_bad_arguments_are_refused_by_name():
  q, k, v = _inputs()
  with pytest.raises(
    TypeError, match=r"varlen_attention\(\) got an unexpected keyword argument 'segment_ids'"
  ):
    jattn.varlen_attention(q, k, v, CU_Q, CU_K, segment_ids=np.zeros((TQ,), np.int32))
  with pytest.raises(ValueError, match=r"query must have shape \(total_q, N, H\)"):
    jattn.varlen_attention(q[None], k, v, CU_Q, CU_K)
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    jattn.varlen_attention(q, k, v, CU_Q, CU_K, is_causal="yes")
  with pytest.raises(TypeError, match="local_window_size must be an int or a"):
    jattn.varlen_attention(q, k, v, CU_Q, CU_K, local_window_size="wide")
