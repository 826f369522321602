"""Adversarial draws over the paths a call can take, each against the one-device or xla call
on the same inputs (values, log-sum-exp and gradients), or a refusal that names its cause:

* soft caps through every ring pair kernel (the default, blockwise, splash, the default
  traced for a TPU) in every layout;
* from_fn masks that read arrays in every way jnp reads them, through every implementation
  and as the default traced for a GPU (flex only where its Triton kernels lower the mask);
* ring inputs in every placement, under Auto and Explicit mesh axes;
* every derivative a rule cannot take, on one device and on many;
* empty dimensions (B, T or S of 0) with every mask form.

Each sweep draws its secondary settings with hypothesis; sweeps whose cases compile much keep
a share in the default run, the rest marked exhaustive where the sweep is parametrized.
"""

import contextlib
import functools
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from reference import array

import jattn
from experiments.accuracy import max_abs_error

# --- one jitted loss of the output and lse, and its gradients ----------------------------


def _value_and_grads(attend, *arrays, argnums=(0, 1, 2), seed=0):
  """``attend(*arrays) -> out or (out, lse)``: out, lse (None without it), the gradients of
  sum(out * w) + sum(finite lse * w'), with fixed random cotangents, as NumPy float64, and
  the output's sharding, from one jitted program. The lse enters the loss where the call
  returns it: both enter the backward rule."""
  rng = np.random.default_rng(seed)
  shape = np.shape(arrays[0])
  w = np.asarray(rng.standard_normal(shape), np.float32)
  w_lse = np.asarray(rng.standard_normal(shape[:-1]), np.float32)

  def loss(*a):
    got = attend(*a)
    out, lse = got if isinstance(got, tuple) else (got, None)
    value = jnp.sum(out * w)
    if lse is not None:
      value = value + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * w_lse)
    return value, (out, lse)

  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*arrays)
  as64 = lambda x: None if x is None else np.asarray(np.asarray(x, np.float32), np.float64)
  return as64(out), as64(lse), [as64(g) for g in grads], out.sharding


def _assert_same(got, want, where, tol=2e-5):
  """Values, lse (its -inf rows exactly) and gradients of ``_value_and_grads`` agree."""
  (out, lse, grads), (w_out, w_lse, w_grads) = got[:3], want[:3]
  pairs = [("out", out, w_out)] + [
    (f"grad {i}", g, w) for i, (g, w) in enumerate(zip(grads, w_grads))
  ]
  if lse is not None:
    np.testing.assert_array_equal(
      np.isneginf(lse), np.isneginf(w_lse), err_msg=f"{where}: empty rows"
    )
    finite = np.isfinite(w_lse)
    pairs.append(("lse", np.where(finite, lse, 0), np.where(finite, w_lse, 0)))
  for name, g, w in pairs:
    assert g.shape == w.shape, f"{where}: {name} shape {g.shape}, want {w.shape}"
    assert not np.any(np.isnan(g)), f"{where}: NaN in {name}"
    size = max(1.0, float(np.max(np.abs(w), initial=0.0)))
    err = max_abs_error(g, w)
    assert err <= tol * size, f"{where}: {name} error {err:.3g} (largest |value| {size:.3g})"


def _normal(rng, shape, scale=1.0):
  return np.asarray(rng.standard_normal(shape) * scale, np.float32)


# --- soft caps through every ring pair kernel, in every layout --------------------------------
#
# A shard pair's kernel returns its log-sum-exp to the ring, and the log-sum-exp's gradient
# through a soft cap needs the capped logits, which splash does not give: splash pairs once
# gave wrong dq and dk under a soft cap. Whatever picks the pairs' kernel, the ring's values,
# lse and gradients must be the one-device call's, or an explicit splash must raise the
# one-device call's reason.

RING_PAIR_KERNELS = {
  "default": (None, None),  # the CPU's choice, kernels interpreted
  "blockwise": ("blockwise", None),
  "splash": ("splash", None),
  "default_on_tpu": (None, "tpu"),  # traced as on a TPU: splash where it expresses the pairs
}


@st.composite
def soft_capped_ring_calls(draw, kernel):
  """Inputs in natural order and the keyword arguments of one soft-capped ring call: shards of
  1 to 4 rows over 2 or 4 devices, GQA or not, and any mix of causal, segment ids (one array
  or a pair), a window, key lengths (rows left empty), sinks and a scale."""
  P = draw(st.sampled_from([2, 4]))
  T = 2 * P * draw(st.integers(1, 2))  # zigzag needs 2P chunks
  B = draw(st.integers(1, 2))
  N, K = draw(st.sampled_from([(2, 1), (2, 2), (4, 2)]))
  H = draw(st.sampled_from([4, 8]))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  magnitude = draw(st.sampled_from([1.0, 4.0]))  # large scores: the cap bends most of them
  q, k = (_normal(rng, (B, T, n, H), magnitude) for n in (N, K))
  v = _normal(rng, (B, T, K, H))
  kw = dict(logits_soft_cap=draw(st.sampled_from([0.5, 2.0, 30.0])), is_causal=draw(st.booleans()))
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  segments = draw(st.sampled_from([None, "one", "pair"]))
  if segments == "one":
    kw["segment_ids"] = ids
  elif segments == "pair":  # some query ids no key has: those rows see nothing
    kw["segment_ids"] = (np.where(rng.random((B, T)) < 0.2, 7, ids).astype(np.int32), ids)
  if draw(st.booleans()):
    kw["local_window_size"] = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
  if draw(st.booleans()):
    kw["key_value_seq_lengths"] = rng.integers(0, T + 1, B).astype(np.int32)
  if draw(st.booleans()):
    kw["sinks"] = _normal(rng, (N,))
  if draw(st.booleans()):
    kw["scale"] = draw(st.sampled_from([0.1, 1.0]))
  if kernel == "blockwise" and draw(st.booleans()):
    kw["block_q"], kw["block_kv"] = draw(st.integers(1, 5)), draw(st.integers(1, 5))
  return (q, k, v), P, kw, draw(st.booleans())


def _ring_in_natural_order(mesh, layout, implementation, return_residual, kw):
  """ring_attention on natural-order arrays: inputs and ids permuted into ``layout``, output
  and lse permuted back."""
  P = mesh.shape["sp"]
  permute = functools.partial(jattn.parallel.permute, layout=layout, num_shards=P)
  if "segment_ids" in kw:  # ids travel in the inputs' order
    kw = dict(kw, segment_ids=jax.tree.map(permute, kw["segment_ids"]))

  def attend(q, k, v):
    got = jattn.parallel.ring_attention(
      *(permute(x) for x in (q, k, v)),
      mesh=mesh,
      axis_name="sp",
      layout=layout,
      implementation=implementation,
      return_residual=return_residual,
      **kw,
    )
    if return_residual:
      return tuple(jattn.parallel.unpermute(x, layout, P) for x in got)
    return jattn.parallel.unpermute(got, layout, P)

  return attend


@settings(max_examples=2, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
# The default run keeps splash's refusal (no kernel runs) in every layout; the cases that run a
# pair kernel (the default as traced for a TPU, where splash pairs once ran with wrong
# gradients, among them) are exhaustive: test_parallel's ring cases reach the same code with a
# soft cap by default. Each case draws its masking, shapes and cap.
@pytest.mark.parametrize(
  "kernel, layout",
  [
    pytest.param(
      kernel,
      layout,
      marks=() if kernel == "splash" else pytest.mark.exhaustive,
    )
    for kernel in RING_PAIR_KERNELS
    for layout in ("contiguous", "zigzag", "striped")
  ],
)
def test_soft_cap_through_every_ring_pair_kernel(kernel, layout, data):
  (q, k, v), P, kw, return_residual = data.draw(soft_capped_ring_calls(kernel))
  implementation, platform = RING_PAIR_KERNELS[kernel]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:P]), ("sp",))
  ring = _ring_in_natural_order(mesh, layout, implementation, return_residual, kw)
  where = f"{kernel} {layout} P={P} {sorted(kw)} return_residual={return_residual}"
  if implementation == "splash":
    with jattn.testing.interpret_kernels(), pytest.raises(ValueError) as info:
      ring(q, k, v)
    message = str(info.value)
    assert message.startswith("ring_attention(implementation='splash') does not support "), where
    if "key_value_seq_lengths" in kw:  # the ring's own refusal: lengths go in as ids there
      assert "lengths" in message, message
      return
    with jattn.testing.interpret_kernels(), pytest.raises(ValueError) as one:
      jattn.dot_product_attention(q, k, v, implementation="splash", return_residual=True, **kw)
    reason = str(one.value).split("does not support ", 1)[1]
    assert "logits_soft_cap" in message and reason in message, (where, message, reason)
    return
  one_device = functools.partial(
    jattn.dot_product_attention,
    implementation="xla",
    return_residual=return_residual,
    **{n: x for n, x in kw.items() if n not in ("block_q", "block_kv")},
  )
  want = _value_and_grads(one_device, q, k, v)
  platform_ctx = jattn.testing.lowering_for(platform) if platform else contextlib.nullcontext()
  with platform_ctx, jattn.testing.interpret_kernels():
    got = _value_and_grads(ring, q, k, v)
  _assert_same(got, want, where)


# --- masks that read arrays, in every way jnp reads them, through every implementation --------
#
# A from_fn mask may read the arrays it closes over by any jnp operation. xla and blockwise
# evaluate it on the grid or per tile and take anything; flex traces it into Triton kernels,
# which load an array where the mask indexes it elementwise by its index arguments and lower
# little else (no gather from registers, no sort or cumulative sum, power-of-two shapes);
# splash tabulates only masks it can build. Each implementation must match xla or refuse
# naming the mask, and the default on a GPU must not pick flex for a mask it cannot lower.


def _array_reads(rng, B, N, T, S):
  """Each way of reading an array, as a mask function of (b, h, q, kv) broadcast indices."""
  offsets = array(np.sort(rng.choice(np.arange(1, T), 2, replace=False)))
  ends = lambda n: array(np.sort(rng.integers(0, T + 1, n)))
  doc_of = array(rng.integers(0, 4, T).astype(np.int32))
  lens = array(rng.integers(0, S + 1, B).astype(np.int32))
  reach = array(rng.integers(0, 4, N).astype(np.int32))
  keep_q, keep_kv = array(rng.random(T) < 0.5), array(rng.random(S) < 0.5)
  valid = array(rng.random((B, S)) < 0.7)
  dense = array(rng.random((B, N, T, S)) < 0.6)
  table = array(rng.random((T, S)) < 0.5)
  same_doc = array((rng.random((4, 4)) < 0.5) | np.eye(4, dtype=bool))
  position = array(rng.permutation(max(T, S)).astype(np.float32))

  def boundaries(i, e):  # how many of the ends each position has passed: a (..., n) compare
    return jnp.sum(i[..., None] >= e.reshape((1,) * i.ndim + (-1,)), axis=-1)

  e4, e5 = ends(4), ends(5)
  return {
    "searchsorted": lambda b, h, q, kv: (
      jnp.searchsorted(offsets, q, side="right") == jnp.searchsorted(offsets, kv, side="right")
    ),
    "sum_then_index": lambda b, h, q, kv: kv < valid.sum(-1)[b],
    "cumsum_then_index": lambda b, h, q, kv: kv < jnp.cumsum(lens)[b] % (S + 1),
    "sort_then_index": lambda b, h, q, kv: kv < jnp.sort(lens)[b],
    "rolled_then_index": lambda b, h, q, kv: jnp.roll(keep_q, 1)[q],
    "take_by_batch": lambda b, h, q, kv: kv < jnp.take(lens, b),
    "take_by_head": lambda b, h, q, kv: jnp.abs(q - kv) <= jnp.take(reach, h),
    "index_by_batch_and_head": lambda b, h, q, kv: dense[b, h, q, kv],
    "row_of_batch_at_kv": lambda b, h, q, kv: valid[b, kv],
    "static_row_then_index": lambda b, h, q, kv: valid[0][kv] | valid[B - 1][kv],
    "strided_slice_then_index": lambda b, h, q, kv: keep_q[::2][q // 2],
    "vector_at_q": lambda b, h, q, kv: keep_q[q] | keep_kv[kv],
    "boolean_table": lambda b, h, q, kv: table[q, kv],
    "table_at_ids_read_by_index": lambda b, h, q, kv: same_doc[doc_of[q], doc_of[kv % T]],
    "negative_index_wraps": lambda b, h, q, kv: keep_kv[kv - S],
    "clipped_index": lambda b, h, q, kv: keep_q.at[q + 3].get(mode="clip"),
    "filled_index": lambda b, h, q, kv: keep_kv.at[kv + 2].get(mode="fill", fill_value=False),
    "float_array_compared": lambda b, h, q, kv: position[q] >= position[kv],
    "where_of_reads": lambda b, h, q, kv: jnp.where(keep_q[q], table[q, kv], valid[b, kv]),
    "compared_with_4_boundaries": lambda b, h, q, kv: boundaries(q, e4) == boundaries(kv, e4),
    "compared_with_5_boundaries": lambda b, h, q, kv: boundaries(q, e5) == boundaries(kv, e5),
  }


READ_NAMES = list(_array_reads(np.random.default_rng(0), 2, 2, 8, 8))


@st.composite
def masks_reading_arrays(draw):
  """(q, k, v) and a mask: one or two array reads (two masks joined by & or |, or one function
  xor-ing both), maybe negated, and-ed with an index mask (causal, a window, or all)."""
  B, T, S, N, K, H = draw(st.sampled_from([(2, 24, 24, 2, 1, 8), (1, 16, 24, 4, 2, 8)]))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  reads = _array_reads(rng, B, N, T, S)
  names = draw(st.lists(st.sampled_from(READ_NAMES), min_size=1, max_size=2, unique=True))
  f = reads[names[0]]
  mask = jattn.masks.from_fn(f)
  if len(names) == 2:  # two masks, or one function reading both arrays
    g = reads[names[1]]
    other = jattn.masks.from_fn(g)
    both = jattn.masks.from_fn(lambda *i: f(*i) ^ g(*i))
    mask = draw(st.sampled_from([mask & other, mask | other, both]))
  if draw(st.booleans()):
    mask = ~mask
  mask = mask & draw(
    st.sampled_from(
      [
        jattn.masks.causal(),
        jattn.masks.sliding_window(5, 1),
        jattn.masks.causal() | ~jattn.masks.causal(),
      ]
    )
  )
  q, k, v = (_normal(rng, (B, n, h, H)) for n, h in ((T, N), (S, K), (S, K)))
  return (q, k, v), mask, names


ARRAY_MASK_RULES = {
  "default": dict(),
  "xla/custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=8, block_kv=8),
  "flex": dict(implementation="flex"),
  "splash": dict(implementation="splash"),
}


def _attend_with(mask, **rule):
  return lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=mask, return_residual=True, **rule
  )


@settings(max_examples=2, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
# The default run keeps flex (run where it takes the mask, else refused by name) and splash's
# refusal; the others are exhaustive, the default traced for a GPU too (flex where it lowers:
# test_flex.py's test_masks_reading_arrays_that_flex_takes_run_and_lower by default).
@pytest.mark.parametrize(
  "rule",
  [
    r if r in ("flex", "splash") else pytest.param(r, marks=pytest.mark.exhaustive)
    for r in [*ARRAY_MASK_RULES, "default_on_gpu"]
  ],
)
def test_masks_reading_arrays_match_xla_or_are_refused_by_name(rule, data):
  (q, k, v), mask, names = data.draw(masks_reading_arrays())
  where = f"{rule} {names} {mask!r}"
  # xla's values, where a call's are compared with them (not for a refusal: a program less).
  want = lambda: _value_and_grads(_attend_with(mask, implementation="xla"), q, k, v)
  if rule == "default_on_gpu":
    _check_gpu_default_lowers(q, k, v, mask, want, where)
    return
  kw = ARRAY_MASK_RULES[rule]
  try:
    with jattn.testing.interpret_kernels():
      got = _value_and_grads(_attend_with(mask, **kw), q, k, v)
  except ValueError as e:  # fused kernels only, naming the mask
    assert kw.get("implementation") in ("flex", "splash"), f"{where}: {e}"
    assert str(e).startswith(f"implementation='{kw['implementation']}' does not support mask"), e
    return
  _assert_same(got, want(), where, tol=5e-5)


def _check_gpu_default_lowers(q, k, v, mask, want, where):
  """Traced as on a GPU: the default picks flex only where flex takes the mask (an explicit
  flex call in interpret mode stands for the GPU's check), and the training step then lowers
  for CUDA, with flex's three Triton kernels or none; a fallback's values equal xla's
  (``want()``)."""
  try:
    with jattn.testing.interpret_kernels():
      jax.jit(_attend_with(mask, implementation="flex")).trace(q, k, v)
    flex_takes = True
  except ValueError as e:
    assert str(e).startswith("implementation='flex' does not support mask"), f"{where}: {e}"
    flex_takes = False
  choice = jattn.explain(q, k, v, mask=mask, backend="gpu")
  assert flex_takes or choice.implementation != "flex", f"{where}: {choice}"
  if not flex_takes:
    assert "flex does not: mask" in choice.reason, f"{where}: {choice.reason}"
  loss = lambda q, k, v: jnp.sum(_attend_with(mask)(q, k, v)[0])
  with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecations
    step = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v)
    text = step.lower(lowering_platforms=("cuda",)).as_text()
  kernels = text.count("__gpu$xla.gpu.triton")
  assert kernels == (3 if choice.implementation == "flex" else 0), f"{where}: {kernels} kernels"
  if choice.implementation != "flex":  # xla or blockwise: they run on this CPU as on a GPU
    with jattn.testing.lowering_for("gpu"):
      got = _value_and_grads(_attend_with(mask), q, k, v)
    _assert_same(got, want(), where, tol=5e-5)


# --- ring inputs in every placement, under Auto and Explicit mesh axes ------------------------
#
# ring_attention reshards whatever arrives to its layout: NumPy arrays, arrays on the default
# device, replicated, already in the layout, or sharded over the wrong mesh axes; the query,
# key, value, segment ids, lengths and sinks each placed on their own. Under Explicit axes an
# array's sharding is its type, and shard_map once refused every input not in the layout.

PLACEMENT_AXES = {"sp": 4, "tp": 2}  # a 4 x 2 mesh, the ring over "sp"
SPECS = [(), ("sp",), ("tp",), (None, "sp"), (None, "tp"), ("tp", "sp"), (None, "sp", "tp")]
SPECS += [(None, None, "sp"), (None, None, "tp"), ("sp", None, "tp")]


def _placement(draw, shape):
  """None (a NumPy array), "default" (jax.device_put, no sharding) or a PartitionSpec's axes
  that divide ``shape``."""
  fits = lambda spec: (
    len(spec) <= len(shape)
    and all(a is None or shape[i] % PLACEMENT_AXES[a] == 0 for i, a in enumerate(spec))
  )
  return draw(st.sampled_from([None, "default", *filter(fits, SPECS)]))


@st.composite
def placed_ring_calls(draw):
  """Natural-order NumPy arrays, each argument's placement, and the call's settings."""
  B, T, N, K, H = 4, 16, 4, 2, 8
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  q, k, v = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, K, H)), _normal(rng, (B, T, K, H))
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  args = dict(
    q=q,
    k=k,
    v=v,
    sinks=_normal(rng, (N,)) if draw(st.booleans()) else None,
    ids={None: None, "one": ids, "pair": (ids, ids[:, ::-1].copy())}[
      draw(st.sampled_from([None, "one", "pair"]))
    ],
    lens=rng.integers(0, T + 1, B).astype(np.int32) if draw(st.booleans()) else None,
  )
  placement = {
    name: jax.tree.map(lambda x: _placement(draw, x.shape), x) for name, x in args.items()
  }
  settings_ = dict(
    layout=draw(st.sampled_from(["contiguous", "zigzag", "striped"])),
    axes=draw(st.sampled_from([(None, None), (None, "tp"), ("tp", None)])),  # batch, heads
    is_causal=draw(st.booleans()),
    lengths=draw(st.sampled_from(["query_seq_lengths", "key_value_seq_lengths"])),
    return_residual=draw(st.booleans()),
  )
  return args, placement, settings_


def _place(x, where, mesh):
  if where is None:
    return x
  if where == "default":
    return jax.device_put(x)
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*where)))


@settings(max_examples=2, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
# Exhaustive in both modes (6 CPU-seconds each, for the README command's time bound): the
# default run reshards fixed placements of the ring's inputs in Auto mode (test_parallel.py)
# and of the other strategies' in Explicit mode (test_context_parallel.py).
@pytest.mark.exhaustive
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_ring_takes_inputs_in_every_placement(mode, data):
  args, placement, kw = data.draw(placed_ring_calls())
  kind = getattr(jax.sharding.AxisType, mode.capitalize())
  mesh = jax.make_mesh((4, 2), ("sp", "tp"), (kind, kind), devices=jax.devices()[:8])
  layout, (batch_axis, head_axis) = kw["layout"], kw["axes"]
  permute = functools.partial(jattn.parallel.permute, layout=layout, num_shards=4)
  unpermute = functools.partial(jattn.parallel.unpermute, layout=layout, num_shards=4)
  # The ring takes arrays in its layout's order; lengths and sinks have no sequence axis.
  args = {n: x if n in ("sinks", "lens") else jax.tree.map(permute, x) for n, x in args.items()}
  where = f"{mode} {kw} {placement}"

  def ring(q, k, v, sinks, ids, lens):
    return jattn.parallel.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      batch_axis=batch_axis,
      head_axis=head_axis,
      layout=layout,
      is_causal=kw["is_causal"],
      segment_ids=ids,
      sinks=sinks,
      return_residual=kw["return_residual"],
      **{kw["lengths"]: lens},
    )

  def one_device(q, k, v, sinks, ids, lens):
    got = jattn.dot_product_attention(
      *(unpermute(x) for x in (q, k, v)),
      is_causal=kw["is_causal"],
      segment_ids=jax.tree.map(unpermute, ids),
      sinks=sinks,
      return_residual=kw["return_residual"],
      implementation="xla",
      **{kw["lengths"]: lens},
    )
    return jax.tree.map(permute, got)

  order = ("q", "k", "v", "sinks", "ids", "lens")
  argnums = (0, 1, 2, 3) if args["sinks"] is not None else (0, 1, 2)
  want = _value_and_grads(one_device, *(args[n] for n in order), argnums=argnums)
  placed = [jax.tree.map(lambda x, p: _place(x, p, mesh), args[n], placement[n]) for n in order]
  with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
    got = _value_and_grads(ring, *placed, argnums=argnums)
  _assert_same(got, want, where)
  layout_spec = jax.sharding.PartitionSpec(batch_axis, "sp", head_axis)
  assert got[3].is_equivalent_to(jax.sharding.NamedSharding(mesh, layout_spec), 4), where


# --- refusals on one device and on many --------------------------------------------------------
#
# A rule that cannot take a derivative raises jattn's ValueError naming itself, the cause and
# the way out (docs/backward.md's table), on every path a call can take: one device (no
# partitioning rule: JAX's device count patched to 1, or inputs committed to one device),
# many devices unsharded or batch-sharded under Auto axes (fused kernels get a partitioning
# rule) and under Explicit axes (shard_map). flex once raised a bare AssertionError from inside
# Pallas on one device only.

TRANSFORMS = {
  # second order: reverse over reverse, forward over reverse
  "grad_of_grad": lambda f: jax.grad(
    lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(f(q) ** 2))(q) ** 2)
  ),
  "hessian_vector": lambda f: (
    lambda q: jax.jvp(jax.grad(lambda q: jnp.sum(f(q) ** 2)), (q,), (jnp.cos(q),))[1]
  ),
  # forward mode
  "jvp": lambda f: lambda q: jax.jvp(f, (q,), (jnp.cos(q),))[1],
  "jacfwd": lambda f: jax.jacfwd(lambda q: jnp.sum(f(q))),  # refused by every rule here
  "linearize": lambda f: lambda q: jax.linearize(f, q)[1](jnp.cos(q)),
  "vmap_of_jvp": lambda f: (
    lambda q: jax.vmap(lambda t: jax.jvp(f, (q,), (t,))[1])(jnp.stack([q, jnp.cos(q)]))
  ),
}
ORDERS = {
  "second_order": ("grad_of_grad", "hessian_vector"),
  "forward_mode": ("jvp", "jacfwd", "linearize", "vmap_of_jvp"),
}
# What each rule takes (docs/backward.md); the rest it refuses. "who" opens its message.
DERIVATIVE_RULES = {
  "xla/custom_vjp": (
    dict(implementation="xla", backward="custom_vjp"),
    {"grad_of_grad", "hessian_vector"},
  ),
  "blockwise": (dict(implementation="blockwise"), {"hessian_vector"}),
  "flex": (dict(implementation="flex"), set()),
  "splash": (dict(implementation="splash"), set()),
  "ring/blockwise": (dict(implementation="blockwise"), {"hessian_vector"}),
  "ring/splash": (dict(implementation="splash"), set()),
}
CALL_PATHS = ["one_device_count", "one_device_placed", "many", "auto_sharded", "explicit"]
RING_PATHS = ["one_device_ring", "many", "explicit"]


def _derivative_call(rule, path, is_causal, return_residual):
  """q -> attention(q, q / 2, cos q) of ``rule`` (its output plus its lse when returned), the
  contexts its ``path`` runs in, and how q is placed."""
  kw = dict(DERIVATIVE_RULES[rule][0], is_causal=is_causal, return_residual=return_residual)
  kind = jax.sharding.AxisType.Explicit if path == "explicit" else jax.sharding.AxisType.Auto
  contexts, place = [jattn.testing.interpret_kernels()], lambda q: q
  if rule.startswith("ring"):
    devices = jax.devices()[: 1 if path == "one_device_ring" else 2]
    mesh = jax.make_mesh((len(devices),), ("sp",), (kind,), devices=devices)
    attend = functools.partial(jattn.parallel.ring_attention, mesh=mesh, axis_name="sp", **kw)
  else:
    mesh = jax.make_mesh((2,), ("b",), (kind,), devices=jax.devices()[:2])
    attend = functools.partial(jattn.dot_product_attention, **kw)
    if path in ("auto_sharded", "explicit"):
      batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b"))
      place = lambda q: jax.device_put(q, batch)
    elif path == "one_device_placed":
      place = lambda q: jax.device_put(q, jax.devices()[1])
    elif path == "one_device_count":
      contexts.append(mock.patch.object(jax, "device_count", lambda *a: 1))
  if path == "explicit":
    contexts.append(jax.set_mesh(mesh))

  def f(q):
    got = attend(q, q * 0.5, jnp.cos(q))
    return got[0] + got[1][..., None] if return_residual else got

  return f, contexts, place


@settings(max_examples=3, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
# The default run keeps the fused kernels' refused derivatives of both orders (traced and
# lowered, nothing runs) and forward mode through the other rules but the ring's; the rules'
# supported second derivatives (which run) and the ring's cases are exhaustive (test_orders.py
# refuses forward mode through ring/blockwise by default).
@pytest.mark.parametrize(
  "rule, order",
  [
    pytest.param(
      rule,
      order,
      id=f"{rule}-{order}",
      marks=()
      if rule in ("flex", "splash") or (order == "forward_mode" and not rule.startswith("ring/"))
      else pytest.mark.exhaustive,
    )
    for rule in DERIVATIVE_RULES
    for order in ORDERS
  ],
)
def test_derivatives_a_rule_cannot_take_raise_its_error_on_every_path(rule, order, data):
  transform = data.draw(st.sampled_from(ORDERS[order]))
  path = data.draw(st.sampled_from(RING_PATHS if rule.startswith("ring") else CALL_PATHS))
  is_causal, return_residual = data.draw(st.booleans()), data.draw(st.booleans())
  shape = (2, 128, 2, 128) if rule == "splash" else (2, 16, 2, 4)  # splash: whole blocks
  if path == "one_device_count":
    # A batch of its own: the jitted call's trace cache does not key on the patched device
    # count, so another path's call of the same shapes would rerun its one-device trace.
    shape = (1, *shape[1:])
  q = np.asarray(
    np.random.default_rng(data.draw(st.integers(0, 2**16))).standard_normal(shape), np.float32
  )
  f, contexts, place = _derivative_call(rule, path, is_causal, return_residual)
  where = f"{rule} {transform} {path} causal={is_causal} return_residual={return_residual}"
  with contextlib.ExitStack() as stack:
    for c in contexts:
      stack.enter_context(c)
    step = jax.jit(TRANSFORMS[transform](f))
    if transform not in DERIVATIVE_RULES[rule][1]:
      with pytest.raises(ValueError) as info:
        step.trace(place(q)).lower()  # refused while tracing or lowering: nothing runs
      message = str(info.value)
      who = f"implementation={DERIVATIVE_RULES[rule][0]['implementation']!r}"
      who = f"ring_attention({who})" if rule.startswith("ring") else who
      what = "first-order gradients" if order == "second_order" else "reverse-mode derivatives only"
      assert message.startswith(f"{who} gives {what}"), f"{where}: {message}"
      assert "implementation='xla'" in message, f"{where}: no way out in {message}"
      return
    got = np.asarray(step(place(q)), np.float64)
  xla = lambda q: jattn.dot_product_attention(
    q,
    q * 0.5,
    jnp.cos(q),
    is_causal=is_causal,
    return_residual=return_residual,
    implementation="xla",
    backward="autodiff",
  )
  plain = (lambda q: xla(q)[0] + xla(q)[1][..., None]) if return_residual else xla
  want = np.asarray(jax.jit(TRANSFORMS[transform](plain))(q), np.float64)
  size = max(1.0, float(np.max(np.abs(want))))
  assert max_abs_error(got, want) <= 1e-4 * size, where


# --- empty dimensions with every mask form, every implementation -----------------------------
#
# No batch rows, no queries or no keys: whatever masks the call, the output has the query's
# shape and is zeros (a row with no key attends to nothing), the lse -inf, the gradients
# zeros of the inputs' shapes; a fused kernel may refuse a form, naming it. Segment-id pairs
# once failed with a shape error when a sequence was empty.

EMPTY_SHAPES = [(0, 8, 8), (2, 0, 8), (2, 8, 0), (2, 0, 0)]  # (B, T, S)
EMPTY_RULES = {
  "default": dict(),
  "xla": dict(implementation="xla"),
  "xla/custom_vjp": dict(implementation="xla", backward="custom_vjp"),
  "blockwise": dict(implementation="blockwise", block_q=4, block_kv=4),
  "flex": dict(implementation="flex"),
  "splash": dict(implementation="splash"),
  "ring": dict(),
}


def _mask_forms(B, T, S, rng):
  """Every way to mask a call, as keyword arguments, with arrays sized for (B, T, S)."""
  m = jattn.masks
  q_ids = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 3, (B, S)), axis=1).astype(np.int32)
  per_row = lambda hi: rng.integers(0, hi + 1, B).astype(np.int32)
  keep = array(rng.random(S) < 0.5)
  forms = {
    "is_causal": dict(is_causal=True),
    "local_window_size": dict(local_window_size=(2, 1)),
    "segment_ids_pair": dict(segment_ids=(q_ids, kv_ids)),
    "query_seq_lengths": dict(query_seq_lengths=per_row(T)),
    "key_value_seq_lengths": dict(key_value_seq_lengths=per_row(S)),
    "mask_array": dict(mask=rng.random((B, 1, T, S)) < 0.5),
    "bias": dict(bias=_normal(rng, (B, 1, T, S))),
    "causal": dict(mask=m.causal()),
    "causal_per_row": dict(mask=m.causal(per_row(3))),
    "sliding_window": dict(mask=m.sliding_window(2, 1, dilation=2)),
    "chunked": dict(mask=m.chunked(4)),
    "prefix_lm": dict(mask=m.prefix_lm(per_row(T))),
    "segments": dict(mask=m.segments(q_ids, kv_ids)),
    "segments_shared_batch": dict(mask=m.segments(q_ids[:1].reshape(T), kv_ids[:1].reshape(S)))
    if B
    else dict(mask=m.segments(np.zeros(T, np.int32), np.zeros(S, np.int32))),
    "lengths": dict(mask=m.lengths(per_row(T), per_row(S))),
    "global_tokens": dict(mask=m.global_tokens(2)),
    "strided": dict(mask=m.strided(3)),
    "from_array": dict(mask=m.from_array(rng.random((T, S)) < 0.5)),
    "from_fn_reading_an_array": dict(mask=m.from_fn(lambda b, h, q, kv: keep[kv] | (q == kv))),
    "block_sparse": dict(mask=m.block_sparse(np.eye(2, dtype=bool), 4)),
    "reindex": dict(
      mask=m.reindex(
        m.causal(), q=np.arange(T, dtype=np.int32) + 2, kv=np.arange(S, dtype=np.int32)
      )
    ),
    "combined": dict(mask=(m.causal() | m.global_tokens(1)) & ~m.strided(4)),
  }
  if T == S:
    forms["segment_ids"] = dict(segment_ids=q_ids)
  return forms


@st.composite
def empty_calls(draw, rule):
  B, T, S = draw(st.sampled_from(EMPTY_SHAPES))
  N, K, H = 2, 1, 4
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  forms = _mask_forms(B, T, S, rng)
  if rule == "ring":  # ring attention takes masks as Mask objects, and no bias
    forms = {n: f for n, f in forms.items() if n not in ("mask_array", "bias")}
  names = draw(st.lists(st.sampled_from(sorted(forms)), min_size=1, max_size=2, unique=True))
  kw = {}
  for name in names:
    for key, x in forms[name].items():
      if key == "mask" and key in kw:  # two masks: both as Mask objects, and-ed
        as_mask = lambda x: x if isinstance(x, jattn.masks.Mask) else jattn.masks.from_array(x)
        x = as_mask(kw[key]) & as_mask(x)
      kw[key] = x
  q, k, v = (_normal(rng, (B, n, h, H)) for n, h in ((T, N), (S, K), (S, K)))
  return (q, k, v), kw, names


@settings(max_examples=3, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
@pytest.mark.parametrize(
  "rule",
  EMPTY_RULES,
)
def test_empty_dimensions_with_every_mask_form(rule, data):
  (q, k, v), kw, names = data.draw(empty_calls(rule))
  where = f"{rule} {q.shape} {k.shape} {names}"
  if rule == "ring":
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sp",))
    attend = functools.partial(
      jattn.parallel.ring_attention, mesh=mesh, axis_name="sp", return_residual=True, **kw
    )
  else:
    attend = functools.partial(
      jattn.dot_product_attention, return_residual=True, **EMPTY_RULES[rule], **kw
    )
  try:
    with jattn.testing.interpret_kernels():
      out, lse, grads, _ = _value_and_grads(attend, q, k, v)
  except ValueError as e:  # fused kernels only, naming what they do not support
    name = EMPTY_RULES[rule].get("implementation")
    assert name in ("flex", "splash"), f"{where}: {e}"
    assert str(e).startswith(f"implementation='{name}' does not support"), f"{where}: {e}"
    return
  B, T, N, H = q.shape
  assert out.shape == (B, T, N, H) and lse.shape == (B, T, N), where
  assert not out.any() and np.all(np.isneginf(lse)), f"{where}: rows that attend to nothing"
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and not g.any(), f"{where}: gradient"
