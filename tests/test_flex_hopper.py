"""flex's Hopper kernels (Mosaic GPU): values and gradients in Mosaic GPU's interpreter
(jax >= 0.11.2) against jax.nn in float32, their lowering for CUDA from this CPU, and the
forward's argument errors."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import array

import jattn
from jattn import masks, scores
from jattn.impl import flex_hopper as _hopper

B, T, N, K, H = 1, 128, 2, 1, 64
EVERY_THIRD = jnp.asarray(np.arange(256) % 3 > 0)  # read by a mask at each query position
NEAR = jnp.asarray(np.arange(256) < 40)  # read at a distance: a gather no load expresses
# Mosaic GPU's interpreter comes with jax 0.11.2 (importing mosaic_gpu, 0.3 s, waits for a test)
interpreter = pytest.mark.skipif(
  "not hasattr(__import__('jax.experimental.pallas.mosaic_gpu', fromlist=['_']), "
  "'InterpretGPUParams')",
  reason="Mosaic GPU's interpreter comes with jax 0.11.2",
)


def _against_xla(loss, args, wide, label, atol=2e-2):
  """``loss(implementation, *args) -> (scalar, output)``: through the table, flex's Hopper
  kernels (interpreted) on ``args`` against the xla path on ``wide`` (the same values in
  float32): the output within ``atol``, each argument's gradient within 1 % (relative
  norm). Returns the kernels' gradients."""
  n = tuple(range(len(args)))
  with jattn.testing.interpret_kernels():
    got, out = jax.jit(jax.grad(lambda *a: loss("flex_hopper", *a), n, has_aux=True))(*args)
  want, want_out = jax.grad(lambda *a: loss("xla", *a), n, has_aux=True)(*wide)
  np.testing.assert_allclose(np.float32(out), want_out, atol=atol, err_msg=label)
  for i, (g, w) in enumerate(zip(got, want)):
    rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
    assert rel < 1e-2, (label, f"argument {i}", rel)
  return got


def _bf16_inputs(seed, batch):
  """``(rng, (q, k, v), their float32 values, a cotangent for the output)``: bf16 inputs,
  ``batch`` rows of 128 positions, two query heads sharing one key/value head, H = 64."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, 128, 2, 64), (batch, 128, 1, 64), (batch, 128, 1, 64)]
  qkv = tuple(array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
  wide = [x.astype(jnp.float32) for x in qkv]
  return rng, qkv, wide, rng.standard_normal(shapes[0]).astype(np.float32)


def _inputs(dtype, T=T, H=H):
  rng = np.random.default_rng(T + H)
  shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H)]
  return [array(rng.standard_normal(s), dtype) for s in shapes]


@interpreter
def test_values_and_lse_match_jax_nn_in_float32():
  """Full and causal, grouped queries (two query heads share one key/value head), bf16 and
  f16 inputs: the output within the inputs' rounding of jax.nn's on the same values in
  float32, the log-sum-exp (natural) within float32's; causal rows of the first query tile
  see only part of their one key tile, the second tile's rows one full and one crossed."""
  for dtype, tol in ((jnp.bfloat16, 2e-2), (jnp.float16, 3e-3)):
    q, k, v = _inputs(dtype)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    for causal in (False, True):
      kernel = lambda q, k, v, c=causal: _hopper.forward(
        q, k, v, scale=H**-0.5, is_causal=c, interpret=True
      )
      out, lse = jax.jit(kernel)(q, k, v)
      want = jax.nn.dot_product_attention(*wide, is_causal=causal)
      np.testing.assert_allclose(np.float32(out), want, atol=tol, err_msg=f"{dtype} {causal}")
      logits = jnp.einsum("btnh,bsnh->bnts", wide[0], jnp.repeat(wide[1], N // K, 2)) * H**-0.5
      if causal:
        logits = jnp.where(np.tril(np.ones((T, T), bool)), logits, -jnp.inf)
      np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)


@interpreter
def test_masks_of_indices_walk_their_tile_schedule():
  """A sliding window (FULL, PARTIAL and EMPTY key tiles in each query tile's schedule), a
  strided mask and'ed with is_causal, and the strict upper triangle, whose last query row
  sees no key (zeros, lse -inf): values and lse against jax.nn's in float32 on the mask's
  dense form, bfloat16 inputs, no NaN anywhere."""
  q, k, v = _inputs(jnp.bfloat16)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  cases = [
    (masks.sliding_window(40, 0), False),
    (masks.strided(3), True),
    (~masks.causal(offset=-1), False),  # kv > q
  ]
  for mask, causal in cases:
    kernel = lambda q, k, v, m=mask, c=causal: _hopper.forward(
      q, k, v, scale=H**-0.5, is_causal=c, mask=m, interpret=True
    )
    out, lse = jax.jit(kernel)(q, k, v)
    full = mask & masks.causal() if causal else mask
    dense = np.asarray(full.materialize(T, T, batch_size=B, num_heads=N))
    want = jax.nn.dot_product_attention(*wide, mask=dense)
    seen = dense.any(-1).transpose(0, 2, 1)[..., None]  # (B, T, N, 1): rows with a key
    np.testing.assert_allclose(np.float32(out), np.where(seen, want, 0), atol=2e-2, err_msg=mask)
    logits = jnp.einsum("btnh,bsnh->bnts", wide[0], jnp.repeat(wide[1], N // K, 2)) * H**-0.5
    want_lse = jax.nn.logsumexp(jnp.where(dense, logits, -jnp.inf), -1)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5, err_msg=str(mask))
    assert not np.isnan(np.float32(out)).any()


@interpreter
def test_gradients_match_autodiff_of_jax_nn_in_float32():
  """attention()'s custom_vjp (the dQ kernel and the transposed dK/dV kernel) against
  jax.nn's autodiff on the same bf16-rounded inputs in float32, with grouped queries (dK and
  dV summed over two query heads), unmasked, causal, a window, and the strict upper triangle
  whose last row sees no key (it takes no gradient; no NaN). The kernels take 16-bit inputs
  only, so no float64 check_grads: each gradient is held to bf16's rounding instead
  (relative error under 1e-2, where a wrong term, a missing scale or a dropped tile gives
  order-one errors)."""
  q, k, v = _inputs(jnp.bfloat16)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  ct = np.random.default_rng(7).standard_normal((B, T, N, H)).astype(np.float32)
  cases = [(None, False), (None, True), (masks.sliding_window(40, 0), False)]
  cases.append((~masks.causal(offset=-1), False))
  for mask, causal in cases:
    attend = lambda q, k, v, m=mask, c=causal: _hopper.attention(
      q, k, v, scale=H**-0.5, is_causal=c, mask=m, interpret=True
    )[0]
    got = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32) * ct), (0, 1, 2)))(
      q, k, v
    )
    full = masks.causal() if causal else mask
    dense = None if full is None else np.asarray(full.materialize(T, T, batch_size=B, num_heads=N))
    ref = lambda *a: jnp.sum(jnp.nan_to_num(jax.nn.dot_product_attention(*a, mask=dense)) * ct)
    want = jax.grad(ref, (0, 1, 2))(*wide)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      g = np.float32(g)
      assert not np.isnan(g).any(), (mask, name)
      rel = np.linalg.norm(g - w) / np.linalg.norm(w)
      assert rel < 1e-2, (mask, causal, name, rel)


@interpreter
def test_score_functions_of_indices_values_and_gradients():
  """A soft cap, and a score function of the indices (a distance penalty), with a window
  mask, against jattn's materialised path in float32 on the same bf16 inputs (itself checked
  against float64 formulas in test_xla and test_scores): output, lse and the three
  gradients, whose dS passes through the score function's derivative."""
  q, k, v = (x * 3 for x in _inputs(jnp.bfloat16))  # large enough scores for the cap to bend
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  ct = np.random.default_rng(8).standard_normal((B, T, N, H)).astype(np.float32)
  distance = scores.from_fn(lambda s, b, h, qi, ki: s - 0.05 * jnp.abs(qi - ki).astype(s.dtype))
  window = masks.sliding_window(40, 0)
  for score_fn, mask in ((scores.soft_cap(2.0), None), (distance, window)):
    kw = dict(scale=H**-0.5, mask=mask, score_fn=score_fn)
    hopper = lambda *a: _hopper.attention(*a, interpret=True, **kw)[0].astype(jnp.float32)
    xla = lambda *a, **more: jattn.dot_product_attention(*a, implementation="xla", **kw, **more)
    loss = lambda attend: lambda *a: jnp.sum(attend(*a) * ct)
    got = jax.jit(jax.value_and_grad(loss(hopper), (0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(loss(xla), (0, 1, 2))(*wide)
    _, lse = jax.jit(lambda *a: _hopper.forward(*a, interpret=True, **kw))(q, k, v)
    _, want_lse = xla(*wide, return_residual=True)
    np.testing.assert_allclose(lse, np.swapaxes(want_lse, 1, 2), rtol=1e-5, atol=1e-4)
    for name, g, w in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (score_fn, name, rel)


@interpreter
def test_the_warp_specialized_forward_matches_jax_nn():
  """forward(specialized=True): a copy warpgroup feeding two compute warpgroups that share
  each key/value tile and take turns on the tensor cores, over two 128-row blocks. Causal
  with grouped queries, a window (its block schedules hold tiles one half of the block does
  not need), the strict upper triangle (an empty last row: zeros, lse -inf), a soft cap
  over a window, causal packed documents with a key length (the copy warpgroup brings each
  key tile's ids with it): output and lse against jax.nn's (jattn's materialised path's for the soft
  cap) in float32 on the same bf16 inputs; and the gradient of attention(specialized=True),
  whose warp-specialised backward reads the specialised forward's lse; the max logits the
  forward kernel keeps, for the empty last row and the documents."""
  T2 = 2 * T
  q, k, v = _inputs(jnp.bfloat16, T2)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  window = masks.sliding_window(40, 0)
  ids = np.repeat(np.arange(4), [50, 100, 6, 100])[None]  # documents: the copy group's ids
  cases = [
    dict(is_causal=True),
    dict(mask=window),
    dict(mask=~masks.causal(offset=-1)),
    dict(mask=window, score_fn=scores.soft_cap(2.0)),
    dict(is_causal=True, mask=masks.segments(ids, ids) & masks.lengths(None, np.array([230]))),
  ]
  for kw in cases:
    kernel = lambda *a, kw=kw: _hopper.forward(
      *a, scale=H**-0.5, interpret=True, specialized=True, **kw
    )
    out, lse = jax.jit(kernel)(q, k, v)
    want, want_lse = jattn.dot_product_attention(
      *wide, scale=H**-0.5, implementation="xla", return_residual=True, **kw
    )
    np.testing.assert_allclose(np.float32(out), want, atol=2e-2, err_msg=str(kw))
    np.testing.assert_allclose(lse, np.swapaxes(want_lse, 1, 2), rtol=1e-5, atol=1e-4)
    assert not np.isnan(np.float32(out)).any()
  for kw in cases[2::2]:
    kernel = lambda *a, kw=kw: _hopper.attention(
      *a, scale=H**-0.5, interpret=True, specialized=True, **kw
    )[2]
    _, want = jattn.dot_product_attention(
      *wide, scale=H**-0.5, implementation="xla", return_max_logit=True, **kw
    )
    _assert_max_logits(jax.jit(kernel)(q, k, v), want)
  ct = np.random.default_rng(9).standard_normal((B, T2, N, H)).astype(np.float32)
  loss = lambda attend: lambda *a: jnp.sum(attend(*a).astype(jnp.float32) * ct)
  hopper = lambda *a: _hopper.attention(
    *a, scale=H**-0.5, is_causal=True, interpret=True, specialized=True
  )[0]
  got = jax.jit(jax.grad(loss(hopper), (0, 1, 2)))(q, k, v)
  want = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)), (0, 1, 2))(
    *wide
  )
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
    assert rel < 1e-2, (name, rel)


@pytest.mark.parametrize(
  "score_fn, specialized",
  [
    (None, False), (scores.soft_cap(30.0), False), (None, True), ("features", True),
    ("value_dim", False), ("value_dim", True),
  ],
  ids=[
    "plain", "soft_cap", "specialized", "specialized_features", "value_dim",
    "specialized_value_dim",
  ],
)  # fmt: skip
def test_the_gradient_lowers_for_cuda_to_three_mosaic_gpu_calls(score_fn, specialized):
  """The forward kernel (its float32 output for the backward's Δ), the dQ kernel and the
  dK/dV kernel, from a CPU, causal, bf16; with a soft cap (tanh and its derivative inside
  each kernel) and a window as well; with the warp-specialised kernels; and those with
  packed documents, a bf16 bias, dropout and ALiBi's slopes (each slot's ids and bias tile
  on its barrier, the slopes read in the kernels, the pattern drawn in each); and with values
  of a head dim of their own (queries and keys 192 wide, values 128), both arrangements."""
  q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _inputs(jnp.float32, 256, 128))
  mask = None if score_fn is None else masks.sliding_window(100, 0)
  kw = {}
  if score_fn == "value_dim":  # DeepSeek's shapes: queries and keys 192 wide, values 128
    q, k = (jax.ShapeDtypeStruct((*x.shape[:3], 192), jnp.bfloat16) for x in (q, k))
    mask = score_fn = None
  if score_fn == "features":
    docs = np.repeat(np.arange(2), 128)[None]
    mask, score_fn = masks.segments(docs, docs), scores.alibi(np.array([0.1, 0.2], np.float32))
    kw = dict(
      bias=jnp.zeros((1, 1, 256, 256), jnp.bfloat16), dropout_rate=0.1,
      dropout_rng=jax.random.key(0),
    )  # fmt: skip
  attend = lambda *a: _hopper.attention(
    *a, scale=0.1, is_causal=True, mask=mask, score_fn=score_fn, specialized=specialized, **kw
  )[0]
  loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32))
  step = jax.jit(jax.grad(loss, (0, 1, 2)))
  text = step.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("method", ["hopper", "hopper_ws"])
@pytest.mark.parametrize("is_causal", [False, True, "window", "documents", "bias"])
def test_lowers_for_cuda_to_one_mosaic_gpu_call(is_causal, method):
  """From a CPU, at Hopper's shapes (H = 128, bf16, eight query tiles): one Mosaic GPU custom
  call holds the whole forward pass, as the GPU probe calls it, with one warpgroup or warp
  specialised (and with a window mask, packed documents, or a float32 bias)."""
  from experiments import gpu_probe

  q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _inputs(jnp.float32, 512, 128))
  f = jax.jit(gpu_probe.method(method, is_causal, 0.1))
  if is_causal in ("window", "documents", "bias"):
    mask = masks.sliding_window(100, 0)
    if is_causal == "documents":
      mask = masks.segments(*[np.repeat(np.arange(4), 128)] * 2) & masks.causal()
    bias = jnp.zeros((1, 1, 512, 512), jnp.float32) if is_causal == "bias" else None
    specialized = method == "hopper_ws"
    f = jax.jit(
      lambda q, k, v: _hopper.forward(
        q, k, v, scale=0.1, mask=mask, specialized=specialized, bias=bias
      )[0]
    )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(dtype=jnp.float32), r"query: the Hopper kernel takes float16 or bfloat16"),
    (  # a mask fixed to the lengths: not padded
      dict(T=96, kw=dict(mask=masks.reindex(masks.causal(), q=np.arange(96)))),
      r"query, key: lengths 96 and 96 must be multiples of 64",
    ),
    (dict(kw=dict(block_kv=96)), r"block_kv=96"),
    (
      dict(T=192, kw=dict(specialized=True, mask=masks.reindex(masks.causal(), q=np.arange(192)))),
      r"query: length 192 must be a multiple of 128",
    ),
    (dict(kv_len=64, kw=dict(is_causal=True)), r"is_causal: the Hopper kernel takes T = S"),
    (
      dict(kw=dict(mask=masks.from_fn(lambda b, h, qi, ki: NEAR[jnp.abs(qi - ki)]))),
      r"mask: the Hopper kernel takes masks reading arrays at the batch row and head or along "
      r"the positions .* reads an array of shape \(256,\) at each query or key position other "
      r"than as a run at the positions of one axis",
    ),
    (  # a run at the query positions, shorter than the queries (T = 128)
      dict(kw=dict(mask=masks.from_fn(lambda b, h, qi, ki: EVERY_THIRD[:100][qi]))),
      r"mask: .* reads an array of shape \(256,\) .* no shorter than it",
    ),
    (
      dict(kw=dict(score_fn=scores.relative_position_bias(np.zeros((32, N), np.float32)))),
      r"score_fn: the Hopper kernel takes score functions reading arrays at the batch row and "
      r"head or along the positions, and it reads an array of shape \(32, 2\)",
    ),
  ],
)
def test_bad_arguments_are_refused_by_name(change, match):
  dtype, T_, H_ = change.get("dtype", jnp.bfloat16), change.get("T", T), change.get("H", H)
  q, k, v = _inputs(dtype, T_, H_)
  if "kv_len" in change:
    k, v = k[:, : change["kv_len"]], v[:, : change["kv_len"]]
  if "Hv" in change:
    v = v[..., : change["Hv"]]
  with pytest.raises(ValueError, match=match):
    _hopper.forward(q, k, v, scale=1.0, **change.get("kw", {}))


# --- implementation="flex_hopper": the selection table's explicit opt-in -----------------


def test_flex_hopper_is_reached_only_by_name():
  """On a Hopper GPU (lowered for CUDA from this CPU), implementation=None never picks the
  Hopper kernels, and explain says why and how to opt in; named, the gradient lowers to its
  three Mosaic GPU calls (with packed documents too, prefix lengths with ALiBi, dropout, a
  bias, a dense mask, flags read along the query positions); what
  it does not take is refused by name, as is an Ampere GPU."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  capped = dict(is_causal=True, logits_soft_cap=30.0)  # cuDNN takes no soft cap: flex's turn
  with jattn.testing.lowering_for("gpu", "NVIDIA H100 80GB HBM3"):
    choice = jattn.explain(q, q, q, **capped)
    assert choice.implementation == "flex"
    assert "implementation='flex_hopper' opts in" in choice.rejected["flex_hopper"]
    documents = dict(is_causal=True, segment_ids=np.repeat(np.arange(4), 64)[None])
    # arrays read at the batch row and head: kernel inputs, read an element at a time
    alibi = dict(mask=masks.prefix_lm(np.array([100])), score_fn=scores.alibi(np.ones(4)))
    dropped = dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    biased = dict(bias=jnp.zeros((256, 256), jnp.bfloat16), is_causal=True)
    dense = dict(mask=np.tri(256, dtype=bool) & (np.arange(256) % 5 > 0))
    # an array read along the query positions: one vector load a tile
    flags = dict(is_causal=True, mask=masks.from_fn(lambda b, h, qi, ki: EVERY_THIRD[qi]))
    for kw in (capped, documents, alibi, dropped, biased, dense, flags):
      attend = lambda *a, kw=kw: jattn.dot_product_attention(*a, implementation="flex_hopper", **kw)
      step = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), (0, 1, 2)))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = step.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("custom_call @mosaic_gpu") == 3, kw
    refused = [
      (
        dict(mask=masks.from_fn(lambda b, h, qi, ki: NEAR[jnp.abs(qi - ki)])),
        r"does not support mask .* at each query or key",
      ),
      (  # a run past the array's end: 256 queries, 200 flags
        dict(mask=masks.from_fn(lambda b, h, qi, ki: EVERY_THIRD[:200][qi])),
        r"does not support mask .* no shorter than it",
      ),
      (
        dict(score_fn=scores.relative_position_bias(np.zeros((32, 4), np.float32))),
        r"does not support score_fn relative_position_bias.* at each query or key",
      ),
    ]
    for kw, match in refused:
      with pytest.raises(ValueError, match=match):
        jattn.explain(q, q, q, implementation="flex_hopper", **kw)
    wide = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    with pytest.raises(ValueError, match=r"does not support dtype float32"):
      jattn.explain(wide, wide, wide, implementation="flex_hopper")
  with jattn.testing.lowering_for("gpu", "NVIDIA A100-SXM4-80GB"):
    with pytest.raises(ValueError, match=r"needs a Hopper GPU \(sm_90\), and 'NVIDIA A100"):
      jattn.explain(q, q, q, implementation="flex_hopper")


@interpreter
def test_flex_hopper_values_and_gradients_through_the_call():
  """jattn.dot_product_attention(implementation="flex_hopper") in Mosaic GPU's interpreter:
  two batch rows, grouped queries, causal with a soft cap; a mask of the batch row's and
  head's indices (their programs see their own b and h); packed documents (segment ids
  that differ between the batch rows) with key lengths, causal, where the kernels read the
  ids of each tile's rows and columns: output and the three gradients against the xla path
  on the same bf16 inputs in float32."""
  rng, (q, k, v), wide, ct = _bf16_inputs(12, batch=2)
  staggered = masks.from_fn(lambda b, h, qi, ki: ki <= qi + 17 * b + 40 * h)
  ids = np.sort(rng.integers(0, 4, (2, 128)), axis=1).astype(np.int32)
  documents = dict(is_causal=True, segment_ids=ids, key_value_seq_lengths=np.array([100, 128]))
  for kw in (dict(is_causal=True, logits_soft_cap=2.0), dict(mask=staggered), documents):
    attend = lambda impl, kw=kw: (
      lambda *a: jattn.dot_product_attention(*a, implementation=impl, **kw).astype(jnp.float32)
    )
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    with jattn.testing.interpret_kernels():
      out = jax.jit(attend("flex_hopper"))(q, k, v)
      got = jax.jit(jax.grad(loss(attend("flex_hopper")), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, attend("xla")(*wide), atol=2e-2, err_msg=str(kw))
    want = jax.grad(loss(attend("xla")), (0, 1, 2))(*wide)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (kw, name, rel)
  with jattn.testing.interpret_kernels():  # the max logits, through the call (and its row)
    top = jattn.dot_product_attention(
      q, k, v, implementation="flex_hopper", return_max_logit=True, **documents
    )[1]
  _, want = jattn.dot_product_attention(
    *wide, implementation="xla", return_max_logit=True, **documents
  )
  _assert_max_logits(top, want)


def _assert_max_logits(got, want):
  """The kernels' max logits against the xla path's on the same (bf16) inputs in float32:
  -inf on the same rows, the finite ones to float32 rounding."""
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  assert finite.any()
  np.testing.assert_allclose(
    np.asarray(got)[finite], np.asarray(want)[finite], rtol=1e-5, atol=1e-5
  )


@interpreter
def test_a_shard_sees_its_global_batch_row_and_heads():
  """One device's share of a batch- and head-sharded call (batch row 1, query heads 2-3
  and their key/value head) run with offsets (1, 2): its output and gradients are the
  whole call's at those rows and heads, under a mask of the batch row and head, so the
  forward, dQ and dK/dV kernels all read the offsets (Mosaic GPU's interpreter runs on one
  device here; the table passes the offsets each device's shard_map part computes); and
  with a dense mask of every row and head (whole on each device, read at the global row
  and head) and a bias (sharded as the query is, read at the local ones)."""
  rng = np.random.default_rng(13)
  shapes = [(2, 128, 4, 64), (2, 128, 2, 64), (2, 128, 2, 64)]
  q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  ct = np.zeros(shapes[0], np.float32)
  ct[1:, :, 2:] = rng.standard_normal((1, 128, 2, 64))  # only the shard's rows and heads
  staggered = masks.from_fn(lambda b, h, qi, ki: ki <= qi + 17 * b + 40 * h - 60)
  dense = rng.random((2, 4, 128, 128)) < 0.7
  bias = array(rng.standard_normal((2, 4, 128, 128)), jnp.float32)
  share = lambda x: x[1:, :, (2 if x.shape[2] == 4 else 1) :]
  for mask, bias_ in ((staggered, None), (staggered & masks.from_array(dense), bias)):
    whole = lambda *a, m=mask, b=bias_: jattn.dot_product_attention(
      *a, b, mask=m, implementation="xla"
    )
    want = whole(*wide)[1:, :, 2:]
    want_grads = jax.grad(lambda *a: jnp.sum(whole(*a) * ct), (0, 1, 2))(*wide)
    local = None if bias_ is None else bias_[1:, 2:]
    shard = lambda *a, m=mask, b=local: _hopper.attention(
      *a, scale=H**-0.5, mask=m, bias=b, interpret=True, offsets=jnp.array([1, 2]),
      batch_heads=(2, 4),
    )[0]  # fmt: skip
    out = jax.jit(shard)(*map(share, (q, k, v)))
    np.testing.assert_allclose(np.float32(out), want, atol=2e-2, err_msg=str(mask))
    loss = lambda *a, f=shard: jnp.sum(f(*a).astype(jnp.float32) * share(ct))
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(*map(share, (q, k, v)))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
      w = share(w)
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (mask, name, rel)


def test_sharded_batch_and_heads_lower_to_one_part_per_device():
  """Explicit mesh axes over the batch and the heads: the gradient lowers for CUDA (an H100)
  to the three Mosaic GPU kernels inside one manual computation, each device's part given its
  global rows (the offsets checked above), and nothing gathered; with segment ids and a
  dense mask per batch row too (whole on each device, the schedule over every row)."""
  mesh = jax.make_mesh(
    (2, 2), ("data", "model"), (jax.sharding.AxisType.Explicit,) * 2, devices=jax.devices()[:4]
  )
  staggered = masks.from_fn(lambda b, h, qi, ki: ki <= qi + 17 * b + 40 * h - 60)
  ids = np.repeat(np.arange(4), 64)[None].repeat(2, 0)
  ids[1, 200:] = 9
  dense = np.tri(256, dtype=bool)[None, None].repeat(2, 0)
  rows = masks.segments(ids, ids) & masks.from_array(dense)
  for mask in (staggered, rows):
    attend = lambda *a, m=mask: jattn.dot_product_attention(
      *a, mask=m, implementation="flex_hopper"
    )
    step = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), (0, 1, 2)))
    with jax.set_mesh(mesh):
      split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "model"))
      q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16, sharding=split)
      kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16, sharding=split)
      with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = step.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3, mask
    assert "sdy.manual_computation" in text and "all-gather" not in text, mask


@interpreter
def test_arrays_read_at_the_batch_row_and_head_are_kernel_inputs():
  """Masks and score functions reading arrays at the batch row and head, the arrays traced
  (jit arguments) so the kernels must take them as inputs: per-row prefix lengths with
  ALiBi's per-head slopes; per-row causal offsets with a per-head temperature a score
  function closes over. Output and the gradients of query, key, value and of the floating
  arrays (slopes, temperatures: the score function's VJP on the whole grid) against the xla
  path on the same bf16 inputs in float32."""
  rng, (q, k, v), wide, ct = _bf16_inputs(14, batch=2)

  def prefix_alibi(prefix, slopes):
    return dict(mask=masks.prefix_lm(prefix), score_fn=scores.alibi(slopes))

  def offset_temperature(offset, temps):
    warm = scores.from_fn(lambda s, b, h, qi, ki: s * temps[h])
    return dict(mask=masks.causal(offset), score_fn=warm)

  cases = [
    (prefix_alibi, np.array([40, 100], np.int32), np.array([0.3, 0.05], np.float32)),
    (offset_temperature, np.array([-20, 30], np.int32), np.array([1.5, 0.5], np.float32)),
  ]
  for make, ints, floats in cases:

    def loss(impl, q, k, v, floats, make=make, ints=ints):
      out = jattn.dot_product_attention(q, k, v, implementation=impl, **make(ints, floats))
      return jnp.sum(out.astype(jnp.float32) * ct), out

    _against_xla(loss, (q, k, v, floats), (*wide, floats), make.__name__)


@interpreter
def test_arrays_read_along_the_positions_are_one_load_a_tile():
  """Masks and score functions reading an array along the query or key positions, each
  tile's run loaded as one vector (Mosaic GPU has no gather): per-query flags and each batch
  row's per-key flags (booleans, held as int32) with causal; a shard of a causal mask,
  reindexed to its global positions (how a sequence-parallel part sees its mask); a learned
  per-key bias a score function adds (its gradient from the grid VJP). Two batch rows,
  grouped queries: output and the gradients of query, key, value (and the key bias) against
  the xla path on the same bf16 inputs in float32; a mutation that reads each run at the
  wrong offset moves the outputs by order one."""
  rng, (q, k, v), wide, ct = _bf16_inputs(22, batch=2)
  q_flags = jnp.asarray(rng.random(128) < 0.8)
  k_flags = jnp.asarray(rng.random((2, 128)) < 0.7)  # each batch row's

  def flagged(extra):
    keep = lambda b, h, qi, ki: (q_flags[qi] & k_flags[b, ki]) | (qi == ki)
    return dict(is_causal=True, mask=masks.from_fn(keep))

  def shard(extra):  # rows 256-383 of a causal mask over keys 192-319
    return dict(mask=masks.reindex(masks.causal(), q=np.arange(128) + 256, kv=np.arange(128) + 192))

  def key_bias(extra):
    return dict(is_causal=True, score_fn=scores.from_fn(lambda s, b, h, qi, ki: s + extra[ki]))

  cases = [(flagged, None), (shard, None), (key_bias, rng.standard_normal(128).astype(np.float32))]
  for make, learned in cases:
    extra = () if learned is None else (learned,)

    def loss(impl, q, k, v, *x, make=make):
      out = jattn.dot_product_attention(q, k, v, implementation=impl, **make(x[0] if x else None))
      return jnp.sum(out.astype(jnp.float32) * ct), out

    _against_xla(loss, (q, k, v, *extra), (*wide, *extra), make.__name__)


@interpreter
def test_a_sequence_parallel_parts_dropout_is_drawn_at_its_global_positions():
  """A part of a sequence-parallel call, its query rows zig-zag's chunks (positions 192-255,
  then 0-63, of 256): its mask and score function reindexed to those positions, its dropout
  drawn there (the kernels read the part's map a run a tile, the grid VJP of learned ALiBi
  slopes through the same map). Output and the gradients of query, key, value and the
  slopes equal the one-device call's on those rows (the xla path, the same key, float32);
  drawn at the part's own row indices, the pattern differs and so does the output."""
  rng = np.random.default_rng(23)
  shapes = [(1, 256, 2, 64), (1, 256, 1, 64), (1, 256, 1, 64)]
  q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  rows = np.concatenate([np.arange(192, 256), np.arange(64)]).astype(np.int32)
  ct = rng.standard_normal((1, 128, 2, 64)).astype(np.float32)
  drop = dict(dropout_rate=0.25, dropout_rng=jax.random.key(7))
  slopes = np.array([0.2, 0.05], np.float32)

  def part(q, k, v, slopes, positions=(None, None, jnp.asarray(rows), None)):
    out = _hopper.attention(
      q[:, rows], k, v, scale=H**-0.5, mask=masks.reindex(masks.causal(), q=rows),
      score_fn=scores.reindex(scores.alibi(slopes), q=rows), interpret=True,
      positions=positions, **drop,
    )[0]  # fmt: skip
    return jnp.sum(out.astype(jnp.float32) * ct), out

  def whole(q, k, v, slopes):
    out = jattn.dot_product_attention(
      q, k, v, is_causal=True, score_fn=scores.alibi(slopes), implementation="xla", **drop
    )[:, rows]
    return jnp.sum(out.astype(jnp.float32) * ct), out

  args = (0, 1, 2, 3)
  got, out = jax.jit(jax.grad(part, args, has_aux=True))(q, k, v, slopes)
  want, want_out = jax.grad(whole, args, has_aux=True)(*wide, slopes)
  np.testing.assert_allclose(np.float32(out), want_out, atol=3e-2)
  for name, g, w in zip(("dq", "dk", "dv", "d_slopes"), got, want):
    rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
    assert rel < 1e-2, (name, rel)
  local = jax.jit(lambda *a: part(*a, positions=None)[1])(q, k, v, slopes)
  assert np.abs(np.float32(local) - want_out).max() > 0.3


@interpreter
def test_values_may_have_a_head_dim_of_their_own():
  """Values of head dim 64 against queries' and keys' 128 (through the table, one
  warpgroup) and 128 against 64 (the warp-specialised kernels), and head dims off the
  kernels' multiples of 64, 40 against 96 (run padded to 64 and 128, the padding cut),
  causal with grouped queries: output and the gradients of query, key and value against the
  xla path on the same bf16 inputs in float32, each gradient in its own input's shape."""
  rng = np.random.default_rng(24)
  cases = ((128, 64, 128, False), (64, 128, 256, True), (96, 40, 128, False))
  for H_, Hv, T_, specialized in cases:
    shapes = [(1, T_, 2, H_), (1, T_, 1, H_), (1, T_, 1, Hv)]
    q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    ct = rng.standard_normal((1, T_, 2, Hv)).astype(np.float32)

    def hopper(q, k, v, specialized=specialized, H_=H_):
      if specialized:
        return _hopper.attention(
          q, k, v, scale=H_**-0.5, is_causal=True, interpret=True, specialized=True
        )[0]
      with jattn.testing.interpret_kernels():
        return jattn.dot_product_attention(q, k, v, is_causal=True, implementation="flex_hopper")

    xla = lambda *a: jattn.dot_product_attention(*a, is_causal=True, implementation="xla")
    loss = lambda attend: lambda *a: (jnp.sum(attend(*a).astype(jnp.float32) * ct), attend(*a))
    got, out = jax.jit(jax.grad(loss(hopper), (0, 1, 2), has_aux=True))(q, k, v)
    want, want_out = jax.grad(loss(xla), (0, 1, 2), has_aux=True)(*wide)
    np.testing.assert_allclose(np.float32(out), want_out, atol=2e-2, err_msg=str((H_, Hv)))
    for name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
      assert g.shape == x.shape, (name, g.shape)
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (H_, Hv, name, rel)


@interpreter
def test_lengths_off_the_tiles_run_padded():
  """Lengths that are not whole tiles run on inputs padded to them, the padded keys masked,
  the padded rows cut: 100 queries and keys, causal packed documents with a learned float32
  bias (padded with the inputs, its gradient cut back to its shape); 70 queries against 150
  keys under a window reaching past the last key (an unmasked key padding would show), with
  dropout (the pattern drawn at the same global indices); and 200 causal through the
  warp-specialised kernels (padded to two 128-row blocks). Output and the gradients against
  the xla path on the same bf16 inputs in float32, each gradient in its input's shape."""
  rng = np.random.default_rng(25)
  ids = np.repeat(np.arange(3), [30, 50, 20])[None].repeat(2, 0)
  drop = dict(dropout_rate=0.2, dropout_rng=jax.random.key(11))
  cases = [  # (T, S, keywords, with a learned bias)
    (100, 100, dict(is_causal=True, segment_ids=ids), True),
    (70, 150, dict(mask=masks.sliding_window(30, 200), **drop), False),
  ]
  for T_, S_, kw, biased in cases:
    shapes = [(2, T_, 2, 64), (2, S_, 1, 64), (2, S_, 1, 64)]
    q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    ct = rng.standard_normal(shapes[0]).astype(np.float32)
    extra = (array(rng.standard_normal((2, 1, T_, S_)), jnp.float32),) if biased else ()

    def loss(impl, q, k, v, *bias, kw=kw):
      out = jattn.dot_product_attention(q, k, v, *bias, implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * ct), out

    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    got = _against_xla(loss, (q, k, v, *extra), (*wide, *extra), f"{T_}x{S_}", atol=3e-2)
    assert [g.shape for g in got] == [x.shape for x in (q, k, v, *extra)]
  q, k, v = (
    array(rng.standard_normal(s), jnp.bfloat16)
    for s in [(1, 200, 2, 64), (1, 200, 1, 64), (1, 200, 1, 64)]
  )
  ct = rng.standard_normal((1, 200, 2, 64)).astype(np.float32)
  ws = lambda *a: _hopper.attention(
    *a, scale=0.125, is_causal=True, interpret=True, specialized=True
  )[0]
  xla = lambda *a: jattn.dot_product_attention(*a, is_causal=True, implementation="xla")
  loss = lambda attend: lambda *a: jnp.sum(attend(*a).astype(jnp.float32) * ct)
  got = jax.jit(jax.grad(loss(ws), (0, 1, 2)))(q, k, v)
  want = jax.grad(loss(xla), (0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
    assert rel < 1e-2, (name, rel)


def test_a_gradient_at_lengths_off_the_tiles_lowers_padded():
  """1,000 queries and keys, causal, head dims 80 (queries, keys) and 40 (values), through
  the table on a Hopper GPU: padded to 1,024 and to 128 and 64, the gradient lowers for CUDA
  from this CPU to the forward, dQ and dK/dV Mosaic GPU calls; a mask fixed to the lengths
  cannot be padded and is refused by name."""
  q = jax.ShapeDtypeStruct((1, 1000, 2, 80), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1000, 2, 40), jnp.bfloat16)
  attend = lambda *a: jattn.dot_product_attention(*a, is_causal=True, implementation="flex_hopper")
  step = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), (0, 1, 2)))
  with jattn.testing.lowering_for("gpu", "NVIDIA H100 80GB HBM3"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    text = step.trace(q, q, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3
    assert "1x1024x2x128xbf16" in text and "1x1024x2x64xbf16" in text  # the padded inputs
    fixed = masks.reindex(masks.causal(), q=np.arange(1000) + 24)
    with pytest.raises(ValueError, match=r"lengths T=1000, S=1000 with a mask fixed to them"):
      jattn.explain(q, q, q, mask=fixed, implementation="flex_hopper")


@interpreter
def test_the_log_sum_exp_and_sinks_carry_gradients():
  """return_residual=True: the log-sum-exp (B, T, N) and its cotangent, which enters dS as Δ
  does; and sinks, which the table adds around the kernels through that log-sum-exp (a
  window whose first rows see few keys, causal packed documents): output, lse and the
  gradients of query, key, value and the sinks against the xla path on the same bf16 inputs
  in float32 (a loss reading the lse too; without its cotangent dQ and dK are off by
  order one)."""
  rng = np.random.default_rng(15)
  shapes = [(1, 128, 2, 64), (1, 128, 1, 64), (1, 128, 1, 64)]
  q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
  wide = [x.astype(jnp.float32) for x in (q, k, v)]
  ct, ct_lse = rng.standard_normal(shapes[0]).astype(np.float32), rng.standard_normal((1, 128, 2))
  ids = np.repeat(np.arange(3), [30, 70, 28])[None].astype(np.int32)
  cases = [
    dict(mask=masks.sliding_window(20, 0), return_residual=True),
    dict(is_causal=True, segment_ids=ids, sinks=np.array([0.5, -1.0], np.float32)),
  ]
  for kw in cases:

    def loss(impl, q, k, v, sinks=None, kw=kw):
      more = {} if sinks is None else dict(sinks=sinks)
      kw_ = {key: val for key, val in kw.items() if key != "sinks"}
      got = jattn.dot_product_attention(q, k, v, implementation=impl, **kw_, **more)
      out, lse = got if kw.get("return_residual") else (got, jnp.zeros((1, 128, 2)))
      return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(lse * ct_lse), (out, lse)

    args = (0, 1, 2) if "sinks" not in kw else (0, 1, 2, 3)
    extra = () if "sinks" not in kw else (kw["sinks"],)
    with jattn.testing.interpret_kernels():
      got, (out, lse) = jax.jit(jax.grad(lambda *a: loss("flex_hopper", *a), args, has_aux=True))(
        q, k, v, *extra
      )
    want, (want_out, want_lse) = jax.grad(lambda *a: loss("xla", *a), args, has_aux=True)(
      *wide, *extra
    )
    np.testing.assert_allclose(np.float32(out), want_out, atol=2e-2, err_msg=str(kw))
    # the lse comes in the inputs' dtype, as jax.nn's: bf16's rounding at |lse| < 4
    np.testing.assert_allclose(np.float32(lse), want_lse, atol=1.6e-2, err_msg=str(kw))
    for name, g, w in zip(("dq", "dk", "dv", "d_sinks"), got, want):
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (kw, name, rel)


@interpreter
def test_dropout_draws_the_pattern_every_implementation_draws():
  """Dropout in the forward, dQ and dK/dV kernels (the pattern regenerated from the seed at
  each element's global indices, in the transposed dK/dV kernel too): causal with grouped
  queries over two batch rows; a pattern shared by the batch rows and heads over a window;
  learned ALiBi slopes, whose grid VJP draws the same pattern. Output and the gradients
  against the xla path with the same key on the same bf16 inputs in float32; and the
  warp-specialised forward's output. A pattern drawn elsewhere (at local indices, or a
  different key) fails this at order one."""
  rng, (q, k, v), wide, ct = _bf16_inputs(16, batch=2)
  drop = dict(dropout_rate=0.25, dropout_rng=jax.random.key(5))
  slopes = np.array([0.2, 0.05], np.float32)
  cases = [
    (dict(is_causal=True, **drop), None),
    (dict(mask=masks.sliding_window(30, 10), broadcast_dropout=True, **drop), None),
    (dict(is_causal=True, **drop), slopes),
  ]
  for kw, learned in cases:

    def loss(impl, q, k, v, *sl, kw=kw):
      more = dict(score_fn=scores.alibi(sl[0])) if sl else {}
      out = jattn.dot_product_attention(q, k, v, implementation=impl, **kw, **more)
      return jnp.sum(out.astype(jnp.float32) * ct), out

    extra = () if learned is None else (learned,)
    _against_xla(loss, (q, k, v, *extra), (*wide, *extra), str(kw), atol=3e-2)
  kw = dict(is_causal=True, **drop)
  ws = jax.jit(
    lambda *a: _hopper.forward(*a, scale=H**-0.5, interpret=True, specialized=True, **kw)
  )
  out, _ = ws(q, k, v)
  want = jattn.dot_product_attention(*wide, implementation="xla", **kw)
  np.testing.assert_allclose(np.float32(out), want, atol=3e-2)


def _grads_f64(q, k, v, ct, allowed):
  """dq, dk, dv of sum(out * ct) in float64 NumPy (grouped queries), the textbook backward:
  P = softmax(S), dP = ct Vᵀ, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dSᵀ Q,
  dV = Pᵀ ct."""
  q, k, v, ct = (np.asarray(np.float32(x), np.float64) for x in (q, k, v, ct))
  B, T, N, H = q.shape
  K = k.shape[2]
  kr, vr = np.repeat(k, N // K, 2), np.repeat(v, N // K, 2)
  s = np.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(H)
  s = np.where(allowed, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dp = np.einsum("btnh,bsnh->bnts", ct, vr)
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) / np.sqrt(H)
  group = lambda x: x.reshape(B, -1, K, N // K, H).sum(3)
  dk = group(np.einsum("bnts,btnh->bsnh", ds, q) / np.sqrt(H))
  dv = group(np.einsum("bnts,btnh->bsnh", p, ct))
  return dq, dk, dv


@interpreter
def test_saturated_rows_keep_their_gradients_accurate():
  """Large scores (query and key x10, causal, grouped queries): nearly one-hot rows, where
  dP - Δ cancels. The forward keeps its output unrounded (float32) for Δ, so the gradients'
  errors against a float64 reference stay within 2.2x jax.nn's (XLA on this CPU, which
  sums dS in float32 where the kernels round it to bf16 once for the tensor cores, as
  cuDNN does); measured 1.85x, 1.64x and 1.23x for dq, dk and dv, where Δ taken from the
  bf16 output left dK at 3.7x."""
  rng = np.random.default_rng(20)
  shapes = [(1, 128, 2, 64), (1, 128, 1, 64), (1, 128, 1, 64)]
  q, k, v = (
    array(rng.standard_normal(s) * (10.0 if i < 2 else 1.0), jnp.bfloat16)
    for i, s in enumerate(shapes)
  )
  ct = rng.standard_normal(shapes[0]).astype(np.float32)
  want = _grads_f64(q, k, v, ct, np.tril(np.ones((128, 128), bool)))

  def grads(impl):
    loss = lambda *a: jnp.sum(
      jattn.dot_product_attention(*a, is_causal=True, implementation=impl).astype(jnp.float32) * ct
    )
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

  with jattn.testing.interpret_kernels():
    got = grads("flex_hopper")
  peer = grads("xla")
  for name, g, p, w in zip(("dq", "dk", "dv"), got, peer, want):
    err = np.max(np.abs(np.float64(np.float32(g)) - w))
    peer_err = np.max(np.abs(np.float64(np.float32(p)) - w))
    assert err <= 2.2 * peer_err, (name, err, peer_err)


@interpreter
def test_forward_mode_and_second_derivatives_are_refused_naming_the_rule():
  """The Hopper kernels give first-order reverse-mode gradients: a gradient of a gradient
  (which would differentiate the kernels) and jax.jvp raise jattn's ValueError naming
  implementation='flex_hopper' and the way out, not an error from inside Pallas."""
  q = _inputs(jnp.bfloat16, 64)[0]
  fn = lambda q: jattn.dot_product_attention(
    q, q * 0.5, jnp.cos(q), is_causal=True, implementation="flex_hopper"
  ).astype(jnp.float32)
  first = lambda q: jax.grad(lambda q: fn(q).sum())(q).astype(jnp.float32)
  with jattn.testing.interpret_kernels():
    with pytest.raises(ValueError, match=r"implementation='flex_hopper' gives first-order"):
      jax.jit(jax.grad(lambda q: (first(q) ** 2).sum()))(q)
    with pytest.raises(ValueError, match=r"implementation='flex_hopper' gives reverse-mode"):
      jax.jit(lambda q: jax.jvp(fn, (q,), (q,))[1])(q)


def test_the_grid_gradients_are_taken_a_chunk_of_query_rows_at_a_time():
  """The gradients the Hopper kernels leave to XLA (a bias's, learned arrays'), taken 64
  query rows at a time, against jax.vjp of the xla path in float32 on the same bf16 values:
  (1) a bias with a query axis (each chunk's rows of its gradient) and learned ALiBi slopes
  (summed over the chunks) under a causal mask with dropout, T = 512; the compiled program's
  temporary buffers under half the whole grid's; (2) a key bias, no query axis (summed over
  the chunks), with packed documents, T = 256. No kernel runs: both Pythons check it."""
  from jattn.impl.flex_hopper import _call, _grid

  rng = np.random.default_rng(5)
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)
  cases = [
    (512, dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(3)), (1, 2, 512, 512)),
    (256, dict(mask=masks.segments(jnp.asarray(np.repeat([[0, 1, 2, 3]], 64, 1)))), (1, 1, 1, 256)),
  ]  # fmt: skip
  for T_, kw, bias_shape in cases:
    shapes = [(1, T_, 2, 64), (1, T_, 1, 64), (1, T_, 1, 64)]
    qkv = [array(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
    d_out = array(rng.standard_normal(shapes[0]), jnp.float32)
    bias = array(rng.standard_normal(bias_shape), jnp.float32)
    learned = kw.get("is_causal", False)  # the first case learns the slopes too

    def xla(q, k, v, bias, slopes, kw=kw, learned=learned):
      score_fn = scores.alibi(slopes) if learned else None
      return jattn.dot_product_attention(
        q, k, v, bias, scale=0.125, score_fn=score_fn, implementation="xla",
        return_residual=True, **kw,
      )  # fmt: skip

    (_, lse), vjp = jax.vjp(xla, *(x.astype(jnp.float32) for x in qkv), bias, slopes)
    *_, want_bias, want_slopes = vjp((d_out, jnp.zeros_like(lse)))
    options = {"is_causal": False, "mask": None, **kw}
    arrays, static = _call.prepare(
      *qkv, backward=True, scale=0.125, score_fn=scores.alibi(slopes) if learned else None,
      block_kv=64, stages=2, interpret=False, specialized=False, offsets=None, bias=bias,
      **options,
    )  # fmt: skip
    chosen = [i for i, a in enumerate(arrays.score) if a.shape == slopes.shape]
    args = (*qkv, jnp.swapaxes(lse, 1, 2) * np.log2(np.e), d_out, jnp.zeros((1, 2, T_)))

    def grads(rows, *args, arrays=arrays, static=static, chosen=chosen):
      return _grid.grid_grads(*args, arrays, static, chosen, True, rows=rows)

    chunked = jax.jit(functools.partial(grads, 64)).lower(*args).compile()
    d_slopes, d_bias = chunked(*args)
    assert d_bias.shape == bias.shape, d_bias.shape
    rel = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel(d_bias, want_bias) < 1e-5, (T_, rel(d_bias, want_bias))
    if learned:
      assert rel(d_slopes[0], want_slopes) < 1e-5, rel(d_slopes[0], want_slopes)
      whole = jax.jit(functools.partial(grads, T_)).lower(*args).compile()
      temp = [c.memory_analysis().temp_size_in_bytes for c in (chunked, whole)]
      assert temp[0] < temp[1] / 2, temp
  with pytest.raises(ValueError, match="rows: a multiple of 64 that divides T = 256, got 96"):
    grads(96, *args)


@interpreter
def test_a_bias_is_read_tile_by_tile_and_differentiated():
  """A bias added to the scaled scores, read tile by tile in every kernel (transposed in
  dK/dV): a float32 one per batch row over causal grouped queries, and a bf16 per-head key
  bias (its query axis broadcast) under a soft cap, through the table in the interpreter:
  output and the gradients of query, key, value and the bias (summed over the axes it
  broadcasts) against the xla path in float32; and the warp-specialised forward's output
  (the copy warpgroup brings each slot's bias tile)."""
  rng, (q, k, v), wide, ct = _bf16_inputs(17, batch=2)
  cases = [
    (dict(is_causal=True), array(rng.standard_normal((2, 1, 128, 128)), jnp.float32)),
    (dict(logits_soft_cap=3.0), array(rng.standard_normal((1, 2, 1, 128)), jnp.bfloat16)),
  ]
  for kw, bias in cases:

    def loss(impl, q, k, v, bias, kw=kw):
      out = jattn.dot_product_attention(q, k, v, bias, implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * ct), out

    got = _against_xla(loss, (q, k, v, bias), (*wide, bias.astype(jnp.float32)), str(kw))
    assert got[3].shape == bias.shape and got[3].dtype == bias.dtype
  bias = cases[0][1]
  ws = lambda *a: _hopper.forward(
    *a, scale=H**-0.5, is_causal=True, bias=bias, interpret=True, specialized=True
  )
  out, _ = jax.jit(ws)(q, k, v)
  want = jattn.dot_product_attention(*wide, bias, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.float32(out), want, atol=2e-2)


@interpreter
def test_a_dense_mask_is_read_tile_by_tile_on_partial_tiles():
  """A dense boolean mask, as jax.nn takes one: its tiles stream beside the key tiles on
  PARTIAL tiles only (FULL and EMPTY ones come from its tile classes), and'ed with causal,
  per batch row, a row left empty (zeros, lse -inf); through the table in the interpreter,
  output, lse and the gradients of query, key and value against the xla path in float32;
  and the warp-specialised forward's output."""
  rng, (q, k, v), wide, ct = _bf16_inputs(18, batch=2)
  dense = rng.random((2, 1, 128, 128)) < 0.6
  dense[:, :, :, 64:] = False  # the second key tile: EMPTY for every query tile
  dense[1, :, 70, :] = False  # a row that sees no key
  kw = dict(mask=dense, is_causal=True, return_residual=True)

  def loss(impl, q, k, v):
    out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, **kw)
    return jnp.sum(out.astype(jnp.float32) * ct), (out, lse)

  with jattn.testing.interpret_kernels():
    got, (out, lse) = jax.jit(
      jax.grad(lambda *a: loss("flex_hopper", *a), (0, 1, 2), has_aux=True)
    )(q, k, v)
  want, (want_out, want_lse) = jax.grad(lambda *a: loss("xla", *a), (0, 1, 2), has_aux=True)(*wide)
  np.testing.assert_allclose(np.float32(out), want_out, atol=2e-2)
  assert np.isneginf(np.float32(lse)[1, 70]).all() and not np.float32(out)[1, 70].any()
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(np.float32(lse)[finite], want_lse[finite], atol=1.6e-2)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
    assert rel < 1e-2, (name, rel)
  ws = lambda *a: _hopper.forward(
    *a, scale=H**-0.5, is_causal=True, mask=masks.from_array(dense), interpret=True,
    specialized=True,
  )  # fmt: skip
  out, _ = jax.jit(ws)(q, k, v)
  np.testing.assert_allclose(np.float32(out), want_out, atol=2e-2)


@interpreter
def test_the_warp_specialized_backward_matches_the_xla_path():
  """attention(specialized=True)'s backward: dQ and dK/dV kernels whose copy warpgroup
  streams tiles into shared-memory slots that two compute warpgroups (64 rows each of a
  128-row block) share, over two blocks each way. Causal packed documents with the
  log-sum-exp's cotangent (each slot brings the streamed axis's segment ids); a window (its
  block schedules list tiles one half does not need) with dropout over grouped queries and
  learned ALiBi slopes read in the kernels; a float32 bias per batch row, differentiated,
  with a dense mask per batch row that leaves a row empty. Output, lse and the gradients of
  query, key, value and the learned arrays against the xla path on the same bf16 inputs in
  float32."""
  rng = np.random.default_rng(21)
  T2 = 2 * T
  ids = np.repeat(np.arange(4), [60, 100, 40, 56])[None].astype(np.int32)
  dense = rng.random((2, 1, T2, T2)) < 0.7
  dense[1, :, 150, :] = False  # a row that sees no key
  drop = dict(dropout_rate=0.2, dropout_rng=jax.random.key(3))
  window = dict(mask=masks.sliding_window(40, 0), **drop)
  cases = [  # (batch, xla's keywords, the kernels' keywords, learned arrays)
    (1, dict(is_causal=True, segment_ids=ids), dict(is_causal=True, mask=masks.segments(ids, ids)),
     ()),
    (1, window, window, (np.array([0.3, 0.05], np.float32),)),
    (2, dict(mask=dense, is_causal=True), dict(mask=masks.from_array(dense), is_causal=True),
     (array(rng.standard_normal((2, 1, T2, T2)), jnp.float32),)),
  ]  # fmt: skip
  for batch, xla_kw, kw, learned in cases:
    shapes = [(batch, T2, N, H), (batch, T2, K, H), (batch, T2, K, H)]
    q, k, v = (array(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    ct, ct_lse = rng.standard_normal(shapes[0]), rng.standard_normal((batch, T2, N))
    biased = len(learned) and learned[0].ndim == 4

    def extra(arrays):  # the learned arrays as each path takes them
      if not arrays:
        return {}
      return dict(bias=arrays[0]) if biased else dict(score_fn=scores.alibi(arrays[0]))

    def hopper(q, k, v, *arrays, kw=kw):
      return _hopper.attention(
        q, k, v, scale=H**-0.5, interpret=True, specialized=True, **kw, **extra(arrays)
      )[:2]

    def xla(q, k, v, *arrays, xla_kw=xla_kw):
      more = extra(arrays)
      bias = more.pop("bias", None)
      return jattn.dot_product_attention(
        q, k, v, bias, implementation="xla", return_residual=True, **xla_kw, **more
      )

    def loss(attend):
      def f(*a):
        out, lse = attend(*a)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(finite * ct_lse), (out, lse)

      return jax.grad(f, tuple(range(3 + len(learned))), has_aux=True)

    got, (out, lse) = jax.jit(loss(hopper))(q, k, v, *learned)
    want, (want_out, want_lse) = loss(xla)(*wide, *learned)
    np.testing.assert_allclose(np.float32(out), want_out, atol=3e-2, err_msg=str(kw))
    finite = np.isfinite(want_lse)
    assert (np.isfinite(lse) == finite).all(), kw
    np.testing.assert_allclose(np.float32(lse)[finite], want_lse[finite], atol=1e-4)
    for name, g, w in zip(("dq", "dk", "dv", "d_learned"), got, want):
      rel = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
      assert rel < 1e-2, (kw, name, rel)


@pytest.mark.parametrize("specialized", [False, True])
def test_heavy_causal_tiles_launch_first(specialized):
  """Causal query tiles grow heavier along the sequence, so the forward's and dQ's programs
  take their tiles last first (the longest launch first, the short ones fill the end, as
  flex's Triton kernels order theirs), while dK/dV's key tiles, heaviest first already,
  keep their order; an unmasked call keeps every order. (Values under the reversed order:
  every causal test in this file.)"""
  from jattn.impl.flex_hopper import _call

  q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  orders = {}
  for causal in (True, False):
    _, static = _call.prepare(
      q, q, q, scale=0.1, is_causal=causal, mask=None, score_fn=None, block_kv=64, stages=2,
      interpret=False, specialized=specialized, offsets=None, backward=True,
    )  # fmt: skip
    orders[causal] = static.from_last
  assert orders == {True: (True, True, False), False: (False, False, False)}


def test_each_warp_specialized_backward_kernel_checks_its_shared_memory():
  """At head dim 256 the warp-specialised dQ kernel's buffers (both groups' query, dO,
  log-sum-exp and Δ tiles; two key and value slots) take 263,168 bytes, past Hopper's
  232,448: refused by name before the kernel is built."""
  from jattn.impl.flex_hopper import _backward, _call

  q = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)
  arrays, static = _call.prepare(
    q, q, q, scale=0.1, is_causal=True, mask=None, score_fn=None, block_kv=64, stages=2,
    interpret=False, specialized=True, offsets=None, backward=True,
  )  # fmt: skip
  lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
  run = lambda q, lse: _backward.specialized(q, q, q, q, lse, q, lse, arrays, static)
  with pytest.raises(ValueError, match=r"warp-specialised dQ kernel would need 263168 bytes"):
    jax.eval_shape(run, q, lse)


def test_the_warp_specialized_forward_refuses_what_overflows_shared_memory():
  """Two query tiles, two key/value slots, the float32 output for the backward's Δ, a
  float32 bias's and a dense mask's tiles at head dim 128: 256 KiB, past Hopper's 227,
  refused by name with the way out (a bfloat16 bias fits: 224 KiB) before any kernel is
  built, rather than left to fail in compilation on the GPU."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  dense = masks.from_array(np.tri(256, dtype=bool))

  def step(bias_dtype):
    bias = jnp.zeros((1, 1, 256, 256), bias_dtype)
    attend = lambda *a: _hopper.attention(*a, scale=0.1, bias=bias, mask=dense, specialized=True)[0]
    loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32))
    return jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, q, q)

  with pytest.raises(ValueError, match=r"specialized: .* need 262656 bytes .* past Hopper's"):
    step(jnp.float32)
  step(jnp.bfloat16)


def test_the_kernels_refuse_what_overflows_shared_memory_by_name():
  """Head dim 256 in training: the one-warpgroup forward holds a query tile and its float32
  output, and two slots each of key and value tiles (224 KiB); a float32 bias's tiles take
  it past 227 KiB, refused by name before any kernel is built, and by the selection table
  (explain); without a bias it traces."""
  q = jax.ShapeDtypeStruct((1, 128, 1, 256), jnp.bfloat16)

  def step(bias):
    attend = lambda *a: _hopper.attention(*a, scale=0.1, bias=bias)[0]
    loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32))
    return jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, q, q)

  with pytest.raises(ValueError, match=r"query: at head dim 256 the forward kernel would need"):
    step(jnp.zeros((1, 1, 128, 128), jnp.float32))
  step(None)
  with jattn.testing.lowering_for("gpu", "NVIDIA H100"):  # the table refuses it by name
    with pytest.raises(ValueError, match=r"flex_hopper' does not support .* head dim 256"):
      jattn.explain(q, q, q, jnp.zeros((128, 128), jnp.float32), implementation="flex_hopper")
