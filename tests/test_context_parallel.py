"""parallel.context_parallel_attention: the ring, all-gather and Ulysses strategies equal the
one-device call (values, log-sum-exp, every gradient, the dropout pattern) with every
argument at once, in every layout and both sharding modes; each moves what it says; the ring
strategy is ring_attention; bad arguments are refused by name."""

import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jattn
from experiments import _collectives
from jattn import masks, parallel, scores
from jattn.parallel import _choices

B, T, N, K, H = 2, 16, 8, 4, 8
SP = 4  # devices on the sequence axis


def _mesh(mode, shape=(SP, 2), names=("sp", "tp")):
  kind = AxisType.Explicit if mode == "explicit" else AxisType.Auto
  return jax.make_mesh(shape, names, (kind,) * len(shape), devices=jax.devices()[: np.prod(shape)])


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v = normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H)
  bias = normal(1, N, T, T)  # one bias for every batch row, per head
  slopes = jnp.linspace(0.05, 0.5, N)  # ALiBi's, differentiated
  sinks = jnp.linspace(-1.0, 2.0, N)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
  return (q, k, v, bias, slopes, sinks), ids


def _every_argument(ids, slopes, sinks):
  """Everything the call takes at once: causal, documents, lengths, a mask of indices, a
  score function of the positions, ALiBi (learned), a soft cap, sinks, dropout, the lse and
  the max logits."""
  return dict(
    is_causal=True,
    segment_ids=ids,
    key_value_seq_lengths=np.array([T, T - 3], np.int32),
    mask=masks.sliding_window(9),
    score_fn=scores.compose(
      lambda s, b, h, q, kv: s + 0.01 * (q % 3) - 0.02 * (kv % 2), scores.alibi(slopes)
    ),
    logits_soft_cap=8.0,
    sinks=sinks,
    dropout_rate=0.25,
    dropout_rng=jax.random.key(7),
    return_residual=True,
    return_max_logit=True,
  )


def _loss(attend, order=lambda x: x):
  """The loss's value and gradients; ``order`` lays its weights out as ``attend``'s output."""

  def loss(q, k, v, bias, slopes, sinks, ids):
    out, lse, top = attend(q, k, v, bias, **_every_argument(ids, slopes, sinks))
    w = order(np.sin(np.arange(out.size, dtype=np.float32)).reshape(out.shape))
    # The max logits are a statistic: their term adds no gradient anywhere.
    finite = jnp.where(jnp.isfinite(top), top, 0.0)
    return jnp.sum(out * w) + jnp.sum(jnp.cos(lse)) + jnp.sum(finite), (out, lse, top)

  return jax.value_and_grad(loss, argnums=range(6), has_aux=True)


def _step(attend, w):
  """The jitted value and gradients in q, k, v of ``sum(out * w) + sum(sin(lse))``, with
  ``(out, lse)`` beside them: ``attend(q, k, v)`` returns both."""

  def loss(q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


def _one_device(q, k, v, bias, slopes, sinks, ids):
  return _loss(lambda *a, **kw: jattn.dot_product_attention(*a, implementation="xla", **kw))(
    q, k, v, bias, slopes, sinks, ids
  )


# The default run keeps one case per strategy, each with a permuted layout: the ring's in
# Explicit mode (its pairs run blockwise's tiles, dropout drawn at the pairs' positions; 8
# CPU-seconds), the others in Auto mode through the table's choice of each part (xla at these
# sizes; about 2 CPU-seconds each). The other cases, parts through blockwise's tiles among
# them (5 to 6 CPU-seconds each), are exhaustive.
# The mesh's second axis, "tp", shards the heads or the batch besides the sequence, or nothing.
CASES = [
  ("ring", "striped", "explicit", "batch", None, ()),
  ("all_gather", "striped", "auto", "batch", None, ()),
  ("ulysses", "striped", "auto", None, None, ()),
  ("ring", "zigzag", "auto", "heads", "blockwise", pytest.mark.exhaustive),
  ("ring", "contiguous", "auto", None, None, pytest.mark.exhaustive),
  ("all_gather", "zigzag", "explicit", "heads", "blockwise", pytest.mark.exhaustive),
  ("all_gather", "contiguous", "auto", None, None, pytest.mark.exhaustive),
  ("ulysses", "contiguous", "explicit", "heads", None, pytest.mark.exhaustive),
  ("ulysses", "zigzag", "explicit", "batch", "blockwise", pytest.mark.exhaustive),
  # USP on a (2, 2, 2) mesh: the ring over "sp", Ulysses over "uly" inside each step.
  ("usp", "zigzag", "explicit", "heads", None, ()),
  ("usp", "striped", "auto", "batch", None, ()),
  ("usp", "contiguous", "auto", None, "blockwise", pytest.mark.exhaustive),
  ("usp", "zigzag", "auto", "heads", "blockwise", pytest.mark.exhaustive),
]


@pytest.mark.parametrize(
  "strategy, layout, mode, tp, implementation",
  [pytest.param(*c[:5], id="-".join(map(str, c[:5])), marks=c[5]) for c in CASES],
)
def test_strategies_equal_the_one_device_call_with_every_argument(
  strategy, layout, mode, tp, implementation
):
  head_axis, batch_axis = ("tp" if tp == "heads" else None), ("tp" if tp == "batch" else None)
  (q, k, v, bias, slopes, sinks), ids = _inputs()
  if strategy == "ulysses" and head_axis:  # N and K over tp x sp: 2 x 4 devices
    q, k, v = q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  mesh, axis_name, shards = _mesh(mode), "sp", SP
  if strategy == "usp":  # a ring of 2 chunks, each over 2 Ulysses devices
    mesh, axis_name, shards = _mesh(mode, (2, 2, 2), ("sp", "uly", "tp")), ("sp", "uly"), 2
  perm = lambda x, axis=1: parallel.permute(x, layout, shards, axis=axis)
  unperm = lambda x: parallel.unpermute(np.asarray(x), layout, shards)

  def sharded(q, k, v, bias, **kw):
    kw["segment_ids"] = perm(kw["segment_ids"])
    return parallel.context_parallel_attention(
      perm(q),
      perm(k),
      perm(v),
      perm(perm(bias, 2), 3),
      mesh=mesh,
      axis_name=axis_name,
      strategy=strategy,
      layout=layout,
      head_axis=head_axis,
      batch_axis=batch_axis,
      implementation=implementation,
      block_q=4 if implementation else None,
      block_kv=4 if implementation else None,
      **kw,
    )

  with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
    (_, (out, lse, top)), grads = jax.jit(_loss(sharded, perm))(q, k, v, bias, slopes, sinks, ids)
  (_, (want, want_lse, want_top)), want_grads = _one_device(q, k, v, bias, slopes, sinks, ids)
  np.testing.assert_allclose(unperm(out), want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(unperm(lse), want_lse, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(unperm(top), want_top, atol=2e-5, rtol=2e-5)
  assert top.dtype == np.float32 and np.isfinite(want_top).all()
  names = ("dq", "dk", "dv", "dbias", "dslopes", "dsinks")
  for name, got, w in zip(names, grads, want_grads, strict=True):
    assert np.abs(np.asarray(w)).max() > 0, name
    np.testing.assert_allclose(got, w, atol=5e-5, rtol=5e-5, err_msg=name)


# Exhaustive: the strategies' cases above draw dropout too, and compare every value.
@pytest.mark.exhaustive
def test_dropout_pattern_is_the_one_device_calls():
  """With values of ones, a row's output is the kept weights' sum over 1 - rate: dropped
  positions show as the same holes on one device and on four, for both strategies."""
  mesh = _mesh("auto", (SP,), ("sp",))
  q = jnp.asarray(np.random.default_rng(1).normal(size=(1, T, SP, H)), jnp.float32)
  v = jnp.eye(T, dtype=jnp.float32)[None, :, None, :].repeat(SP, axis=2)  # one-hot values
  kw = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0), is_causal=True)
  want = jattn.dot_product_attention(q, q, v, implementation="xla", **kw)
  grid = _mesh("auto", (2, 2), ("sp", "uly"))
  for strategy in ("ring", "all_gather", "ulysses", "usp"):
    where = dict(mesh=grid, axis_name=("sp", "uly")) if strategy == "usp" else dict(mesh=mesh)
    where.setdefault("axis_name", "sp")
    got = parallel.context_parallel_attention(q, q, v, strategy=strategy, **where, **kw)
    np.testing.assert_array_equal(np.asarray(got) == 0, np.asarray(want) == 0, err_msg=strategy)
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=strategy)


def test_each_strategy_moves_what_it_says():
  """all_gather gathers keys and values (its backward scatters their gradients) and never
  moves queries; Ulysses trades sequence for heads with all-to-alls and gathers nothing; the
  ring passes key/value shards (and their gradients) point to point, its bias staying put."""
  mesh = _mesh("auto", (SP,), ("sp",))
  (q, k, v, bias, *_), _ = _inputs()
  text = {}
  for strategy in ("ring", "all_gather", "ulysses"):
    f = lambda q, k, v, bias, s=strategy: jnp.sum(
      parallel.context_parallel_attention(
        q, k, v, bias if s == "ring" else None, mesh=mesh, axis_name="sp", strategy=s
      )
    )
    step = jax.jit(jax.grad(f, (0, 1, 2, 3)))
    text[strategy] = step.lower(q, k, v, bias).compile().as_text()
  assert "collective-permute" in text["ring"]
  assert not re.search(r"all-gather(-start)?\(|all-to-all|reduce-scatter", text["ring"])
  # Inside the ring's loops every hop carries what the next step reads (a key/value shard, or
  # its gradient accumulators), so it can overlap the whole step; the backward's last hop
  # home is outside a loop. The other strategies' collectives feed, or take, the compute.
  sent, free = _collectives.traffic(text["ring"]), _collectives.overlappable(text["ring"])
  assert 0 < free["collective-permute"] < sent["collective-permute"]
  assert not _collectives.overlappable(text["all_gather"])
  assert not _collectives.overlappable(text["ulysses"])
  gathered = re.findall(r"all-gather(?:-start)?\(", text["all_gather"])
  assert gathered and "all-to-all" not in text["all_gather"]
  assert "reduce-scatter" in text["all_gather"] or "all-reduce" in text["all_gather"]
  assert "all-to-all" in text["ulysses"] and not re.search(
    r"all-gather(-start)?\(", text["ulysses"]
  )
  # USP: all-to-alls over the Ulysses axis around the ring, whose hops cross the ring axis.
  grid = _mesh("auto", (SP, 2), ("sp", "uly"))
  usp = lambda q, k, v, bias: jnp.sum(
    parallel.context_parallel_attention(
      q, k, v, bias, mesh=grid, axis_name=("sp", "uly"), strategy="usp"
    )
  )
  text = jax.jit(jax.grad(usp, (0, 1, 2, 3))).lower(q, k, v, bias).compile().as_text()
  sent = _collectives.traffic(text)
  assert sent.get("all-to-all") and sent.get("collective-permute")
  assert 0 < _collectives.overlappable(text)["collective-permute"]
  assert not re.search(r"all-gather(-start)?\(", text)


def test_ring_strategy_is_ring_attention():
  mesh = _mesh("auto", (SP,), ("sp",))
  (q, k, v, *_), ids = _inputs()
  kw = dict(is_causal=True, segment_ids=ids, logits_soft_cap=5.0, return_residual=True)
  got = parallel.context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp", **kw)
  want = parallel.ring_attention(q, k, v, mesh=mesh, axis_name="sp", **kw)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


def test_bad_arguments_are_refused_by_name():
  mesh = _mesh("auto", (SP,), ("sp",))
  (q, k, v, bias, *_), _ = _inputs()
  call = lambda *a, mesh=mesh, **kw: parallel.context_parallel_attention(
    *a, mesh=mesh, axis_name="sp", **kw
  )
  with pytest.raises(
    TypeError, match=r"context_parallel_attention\(\) got an unexpected keyword argument 'dropout'"
  ):
    call(q, k, v, strategy="all_gather", dropout=0.1)
  with pytest.raises(ValueError, match=r"strategy must be one of .* got 'allgather'"):
    call(q, k, v, strategy="allgather")
  with pytest.raises(ValueError, match=r"backward must be None with strategy='ring', whose "):
    call(q, k, v, bias, backward="custom_vjp")
  # Arrays given in a permuted layout are checked by the call's own names, not the layout's.
  for strategy in ("ring", "all_gather"):
    zigzag = dict(strategy=strategy, layout="zigzag")
    with pytest.raises(ValueError, match=r"mask from_array\(shape=\(16, 17\)\) holds arrays"):
      call(q, k, v, mask=np.ones((T, T + 1), bool), **zigzag)
    with pytest.raises(ValueError, match=r"segment_ids \(q_segment_ids\) must have length 16"):
      call(q, k, v, segment_ids=np.zeros((B, 12), np.int32), **zigzag)
  with pytest.raises(ValueError, match=r"key/value heads K=4 does not divide by 8: use "):
    call(q, k, v, strategy="ulysses", head_axis="tp", mesh=_mesh("auto"))
  with pytest.raises(ValueError, match=r"query length T must be divisible"):
    call(q[:, :6], k[:, :6], v[:, :6], strategy="all_gather")
  grid = _mesh("auto", (SP, 2), ("sp", "uly"))
  usp = lambda *a, **kw: parallel.context_parallel_attention(*a, mesh=grid, strategy="usp", **kw)
  with pytest.raises(TypeError, match=r"axis_name must be a pair \(ring_axis, ulysses_axis\)"):
    usp(q, k, v, axis_name="sp")
  with pytest.raises(TypeError, match=r"axis_name must be one mesh axis without strategy='usp'"):
    parallel.context_parallel_attention(q, k, v, mesh=grid, axis_name=("sp", "uly"))
  with pytest.raises(ValueError, match=r"axis_name='sp2': unknown mesh axis"):
    usp(q, k, v, axis_name=("sp", "sp2"))
  with pytest.raises(ValueError, match=r"usp.* query length T=12 .* 3 tokens a chunk do not"):
    usp(q[:, :12], k[:, :12], v[:, :12], axis_name=("sp", "uly"))
  with pytest.raises(ValueError, match=r"key/value heads K=1 does not divide by 2: use strategy"):
    usp(q, k[:, :, :1], v[:, :, :1], axis_name=("sp", "uly"))
  with pytest.raises(ValueError, match=r"pairs through implementation='flex' take no block_q"):
    usp(q, k, v, axis_name=("sp", "uly"), implementation="flex", block_q=16)
  with pytest.raises(ValueError, match=r"implementation='splash' does not support"):
    call(
      q,
      k,
      v,
      strategy="ulysses",
      implementation="splash",
      dropout_rate=0.1,
      dropout_rng=jax.random.key(0),
    )


@pytest.mark.parametrize("strategy", parallel.STRATEGIES)
def test_explain_takes_shapes_for_every_array_argument(strategy):
  """parallel.explain, as jattn.explain, takes a jax.ShapeDtypeStruct for every array
  argument (segment ids and their pair, lengths, sinks, dropout's key, a mask array), and
  says what the call with those arrays runs."""
  mesh = (
    _mesh("auto", (SP, 2), ("sp", "uly")) if strategy == "usp" else _mesh("auto", (SP,), ("sp",))
  )
  axis_name = ("sp", "uly") if strategy == "usp" else "sp"
  shape = lambda *s, dtype=jnp.int32: jax.ShapeDtypeStruct(s, dtype)
  q = shape(2, 64, 8, 16, dtype=jnp.float32)
  ids = shape(2, 64)
  arrays = dict(
    segment_ids=(ids, ids),
    key_value_seq_lengths=shape(2),
    query_seq_lengths=shape(2),
    sinks=shape(8, dtype=jnp.float32),
    dropout_rate=0.1,
    dropout_rng=jax.eval_shape(lambda: jax.random.key(0)),
  )
  kw = dict(mesh=mesh, axis_name=axis_name, strategy=strategy, is_causal=True, backend="cpu")
  got = parallel.explain(q, q, q, **kw, **arrays)
  concrete = dict(arrays, segment_ids=(np.zeros((2, 64), np.int32),) * 2)
  concrete.update(key_value_seq_lengths=np.full(2, 64), query_seq_lengths=np.full(2, 64))
  concrete.update(sinks=np.zeros(8, np.float32), dropout_rng=jax.random.key(0))
  x = np.zeros((2, 64, 8, 16), np.float32)
  assert got == parallel.explain(x, x, x, **kw, **concrete)
  assert got == parallel.explain(q, q, q, **kw, **arrays)  # asked again: the same answer
  dense = parallel.explain(q, q, q, mask=shape(64, 64, dtype=jnp.bool_), **kw)
  same = parallel.explain(x, x, x, mask=np.tri(64, dtype=bool), **kw)
  assert (
    dense.implementation
    == same.implementation
    == ("blockwise" if strategy in ("ring", "usp") else "xla")
  )


def test_explain_says_what_each_device_runs():
  """Each device's part goes through the selection table for the backend that traces it:
  flex on a GPU (its mask, score function and dropout read the part's positions), the
  materialised or tiled path on a CPU; the ring's pairs likewise (flex on a GPU, blockwise on
  a CPU or with a score function closing over a traced array)."""
  mesh = _mesh("auto", (SP,), ("sp",))
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  explain = lambda strategy, backend, **kw: parallel.explain(
    q, q, q, mesh=mesh, axis_name="sp", strategy=strategy, is_causal=True, backend=backend, **kw
  )
  for strategy in ("all_gather", "ulysses"):
    assert explain(strategy, "gpu", score_fn=scores.soft_cap(30.0)).implementation == "flex"
    assert explain(strategy, "cpu").implementation == "xla"
    dropout = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert explain(strategy, "gpu", **dropout).implementation == "flex"
  # Ulysses' devices see the whole sequence: in the contiguous layout their part's mask is
  # the call's own causal mask, which cuDNN takes (explain traces no kernel, so it says so
  # on a machine without cuDNN); the all-gather's parts are offset, cuDNN's causal is not.
  assert explain("ulysses", "gpu").implementation == "cudnn"
  assert "cudnn does not" in explain("all_gather", "gpu").reason
  ring = explain("ring", "gpu", score_fn=scores.alibi(jnp.linspace(0.1, 0.8, 8)))
  assert ring.implementation == "flex" and "flex runs each shard pair" in ring.reason
  ring = explain("ring", "gpu", dropout_rate=0.1, dropout_rng=jax.random.key(0))
  assert ring.implementation == "flex"
  ring = explain("ring", "cpu")
  assert ring.implementation == "blockwise" and "not on a TPU" in ring.reason
  # USP's ring steps run as the ring's do, on each Ulysses device's share of the heads.
  grid = _mesh("auto", (SP, 2), ("sp", "uly"))
  usp = lambda backend, **kw: parallel.explain(
    q, q, q, mesh=grid, axis_name=("sp", "uly"), strategy="usp", is_causal=True,
    backend=backend, **kw,
  )  # fmt: skip
  assert usp("gpu").implementation == "flex" and "flex runs each shard pair" in usp("gpu").reason
  assert usp("cpu").implementation == "blockwise"

  @jax.jit
  def closed_over(table):  # a learned table the score function captures, not a pytree leaf
    ring = explain("ring", "gpu", score_fn=lambda s, b, h, q, kv: s + table[h])
    assert ring.implementation == "blockwise" and "closes over traced arrays" in ring.reason
    return table

  closed_over(jnp.ones(8))


# --- splash per device on a TPU ----------------------------------------------------------


def test_splash_runs_each_devices_part_on_a_tpu():
  """Splash tabulates its masks when its kernel is built, so each device's part reaches it
  with its mask seen through NumPy maps: the same part on every Ulysses device (the whole
  sequence in the layout's order), the all-gather's by each device's query positions (the
  device picks its kernel with a switch). The training step lowers for a TPU with splash's
  three kernels; a mask splash cannot tabulate per device is refused by name."""
  mesh = _mesh("auto", (SP,), ("sp",))
  q = jnp.zeros((1, 1024, 4, 128), jnp.bfloat16)
  call = lambda q, k, v, **kw: parallel.context_parallel_attention(
    q, k, v, mesh=mesh, axis_name="sp", is_causal=True, **kw
  )
  for strategy in ("all_gather", "ulysses"):
    for layout in parallel.LAYOUTS:
      choice = parallel.explain(
        q,
        q,
        q,
        mesh=mesh,
        axis_name="sp",
        strategy=strategy,
        layout=layout,
        backend="tpu",
        is_causal=True,
        mask=masks.sliding_window(300),
      )
      assert choice.implementation == "splash", (strategy, layout, choice)
    loss = lambda q, k, v, s=strategy: jnp.sum(call(q, k, v, strategy=s, layout="zigzag"))
    with jattn.testing.lowering_for("tpu"):
      step = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, q, q)
      text = step.lower(lowering_platforms=("tpu",)).as_text()
    kernels = set(re.findall(r'kernel_name = "splash_\w+_(fwd|dq|dkv)_', text))
    assert kernels == {"fwd", "dq", "dkv"}, strategy
    assert ("stablehlo.case" in text) == (strategy == "all_gather")
  per_head = masks.from_array(np.arange(1024)[:, None] + np.arange(4)[:, None, None] > 9)
  with pytest.raises(ValueError, match=r"does not support mask .* which varies over the heads"):
    call(q, q, q, strategy="ulysses", mask=per_head, implementation="splash")


# Exhaustive: the interpreted kernels' forward and backward on each device (5 CPU-seconds a
# case); the default run keeps the all-gather's switch between its devices' kernels.
@pytest.mark.parametrize(
  "strategy, layout",
  [
    ("all_gather", "zigzag"),
    pytest.param("all_gather", "contiguous", marks=pytest.mark.exhaustive),
    pytest.param("ulysses", "contiguous", marks=pytest.mark.exhaustive),
    pytest.param("ulysses", "striped", marks=pytest.mark.exhaustive),
  ],
)
def test_splash_parts_equal_the_one_device_call_interpreted(strategy, layout):
  """Values, lse and the gradients of q, k and v (GQA, causal documents and a window) with
  splash run interpreted on each of two devices' parts, against the one-device xla call."""
  mesh = _mesh("auto", (2,), ("sp",))
  rng = np.random.default_rng(11)
  q = jnp.asarray(rng.normal(size=(1, 256, 4, 64)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 256, 2, 64)), jnp.float32) for _ in "kv")
  ids = np.array([[0] * 100 + [1] * 156], np.int32)
  w = np.sin(np.arange(q.size, dtype=np.float32)).reshape(q.shape)
  kw = dict(is_causal=True, mask=masks.sliding_window(150), return_residual=True)
  perm = lambda x: parallel.permute(x, layout, 2)
  unperm = lambda x: parallel.unpermute(x, layout, 2)

  step = lambda attend: _step(attend, w)

  def sharded(q, k, v):
    out, lse = parallel.context_parallel_attention(
      *map(perm, (q, k, v)),
      mesh=mesh,
      axis_name="sp",
      strategy=strategy,
      layout=layout,
      segment_ids=perm(ids),
      implementation="splash",
      **kw,
    )
    return unperm(out), unperm(lse)

  one = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, segment_ids=ids, implementation="xla", **kw
  )
  (_, want), want_grads = step(one)(q, k, v)
  with jattn.testing.interpret_kernels(), _choices.recording() as choices:
    (_, got), grads = step(sharded)(q, k, v)
  assert {c.implementation for c in choices} == {"splash"}
  for name, g, x in zip(("out", "lse", "dq", "dk", "dv"), (*got, *grads), (*want, *want_grads)):
    np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5, err_msg=name)


# From JAX 0.11 (0.11.2 and 0.12 seen), Pallas' Triton lowering reads the GPU's compute
# capability from the devices of the mesh it is lowered in; inside a shard_map over this
# machine's CPU devices there is none (jattn.testing.lowering_for names one only outside a
# mesh). On a GPU mesh it is there.
@pytest.mark.skipif(
  jax.__version_info__ >= (0, 11),
  reason="JAX >= 0.11 lowers Triton kernels inside a shard_map only over GPU devices",
)
# all_gather: forward, dQ, dK/dV. The ring: a pair's forward in the scan's body and for the
# last step; in the backward pass, in both places, each pair's forward again with its dQ and
# dK/dV. (Through a partitioning rule, which a call inside a shard_map no longer takes, the
# backward ran each pair's forward twice: 10 kernels.) With dropout, the kernels read the
# map to its global positions (zig-zag's) from memory, as Triton lowers them.
@pytest.mark.parametrize("strategy, kernels", [("all_gather", 3), ("ring", 2 + 2 * 3)])
def test_the_gpu_program_holds_flexs_kernels_on_every_device(strategy, kernels):
  mesh = _mesh("auto", (SP,), ("sp",))
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  dropout = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))

  def loss(q, k, v):
    out = parallel.context_parallel_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      strategy=strategy,
      layout="zigzag",
      is_causal=True,
      **dropout,
    )
    return jnp.sum(out.astype(jnp.float32))

  with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecations
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q)
    text = step.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == kernels


def test_flex_hoppers_kernels_take_a_parts_mask_through_its_position_map():
  """Named, flex's Hopper kernels run each device's part of an all-gather call (zig-zag,
  causal, dropout): the part's mask reads its rows' global positions from the layout's map,
  one vector a tile, and its dropout is drawn there, so the gradient lowers for CUDA to the
  forward, dQ and dK/dV Mosaic GPU calls on every device (values of such a part:
  tests/test_flex_hopper.py)."""
  mesh = _mesh("auto", (SP,), ("sp",))
  q = jax.ShapeDtypeStruct((2, 512, 8, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = parallel.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", strategy="all_gather", layout="zigzag",
      is_causal=True, implementation="flex_hopper", dropout_rate=0.1,
      dropout_rng=jax.random.key(0),
    )  # fmt: skip
    return jnp.sum(out.astype(jnp.float32))

  with jattn.testing.lowering_for("gpu", "NVIDIA H100"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q)
    text = step.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3


def test_flex_draws_each_parts_dropout_at_its_global_positions():
  """The all-gather's parts through flex's interpreted kernels, zig-zag, causal, dropout:
  values, lse and the gradients of q, k and v are the one-device call's, so each kernel
  (forward, dQ, dK/dV) draws every weight's keep bit where the one device draws it."""
  mesh = _mesh("auto", (SP,), ("sp",))
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 64, 2, 16)), jnp.float32) for _ in "qkv")
  w = np.cos(np.arange(q.size, dtype=np.float32)).reshape(q.shape)
  kw = dict(is_causal=True, dropout_rate=0.4, dropout_rng=jax.random.key(2), return_residual=True)
  perm = lambda x: parallel.permute(x, "zigzag", SP)
  unperm = lambda x: parallel.unpermute(x, "zigzag", SP)

  step = lambda attend: _step(attend, w)

  def sharded(q, k, v):
    out, lse = parallel.context_parallel_attention(
      *map(perm, (q, k, v)),
      mesh=mesh,
      axis_name="sp",
      strategy="all_gather",
      layout="zigzag",
      implementation="flex",
      block_q=16,
      block_kv=16,
      **kw,
    )
    return unperm(out), unperm(lse)

  one = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="xla", **kw)
  (_, want), want_grads = step(one)(q, k, v)
  with jattn.testing.interpret_kernels():
    (_, got), grads = step(sharded)(q, k, v)
  assert np.mean(np.asarray(want[0]) == 0) < 0.1  # dropout drops weights, not whole rows
  for name, g, x in zip(("out", "lse", "dq", "dk", "dv"), (*got, *grads), (*want, *want_grads)):
    np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5, err_msg=name)


def test_usp_runs_each_ring_pair_through_the_fused_kernels():
  """USP's pairs (a ring of two over pairs of Ulysses devices, zig-zag) through flex's
  interpreted kernels: values, lse, max logits and the gradients of q, k and v equal the
  one-device call's, GQA, documents, causal, a soft cap; for a TPU the training step lowers
  with splash's kernels on each pair, between the all-to-alls."""
  grid = _mesh("auto", (2, 2), ("sp", "uly"))
  rng = np.random.default_rng(8)
  q = jnp.asarray(rng.normal(size=(1, 64, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 64, 2, 16)), jnp.float32) for _ in "kv")
  ids = np.sort(rng.integers(0, 3, (1, 64)), axis=1).astype(np.int32)
  w = np.cos(np.arange(q.size, dtype=np.float32)).reshape(q.shape)
  kw = dict(is_causal=True, logits_soft_cap=6.0, return_residual=True, return_max_logit=True)
  perm = lambda x: parallel.permute(x, "zigzag", 2)
  unperm = lambda x: parallel.unpermute(x, "zigzag", 2)

  def attend(q, k, v, *, sharded):
    if not sharded:
      return jattn.dot_product_attention(q, k, v, segment_ids=ids, implementation="xla", **kw)
    out, lse, top = parallel.context_parallel_attention(
      *map(perm, (q, k, v)), mesh=grid, axis_name=("sp", "uly"), strategy="usp",
      layout="zigzag", segment_ids=perm(ids), implementation="flex", **kw,
    )  # fmt: skip
    return unperm(out), unperm(lse), unperm(top)

  def loss(q, k, v, sharded):
    out, lse, top = attend(q, k, v, sharded=sharded)
    return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse, top)

  step = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)
  (_, want), want_grads = step(q, k, v, False)
  with jattn.testing.interpret_kernels(), _choices.recording() as choices:
    (_, got), grads = step(q, k, v, True)
  assert {c.implementation for c in choices} == {"flex"}
  names = ("out", "lse", "max_logit", "dq", "dk", "dv")
  for name, g, x in zip(names, (*got, *grads), (*want, *want_grads), strict=True):
    np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5, err_msg=name)

  x = jnp.zeros((1, 1024, 4, 128), jnp.bfloat16)
  tpu = lambda q: jnp.sum(
    parallel.context_parallel_attention(
      q, q, q, mesh=grid, axis_name=("sp", "uly"), strategy="usp", is_causal=True
    ).astype(jnp.float32)
  )
  with jattn.testing.lowering_for("tpu"):
    text = jax.jit(jax.grad(tpu)).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text and "all_to_all" in text


# Exhaustive: flex's interpreted kernels on every device's part (5 CPU-seconds a strategy).
@pytest.mark.exhaustive
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_flex_runs_each_devices_part_interpreted(strategy):
  mesh = _mesh("auto", (SP,), ("sp",))
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 64, 4, 16)), jnp.float32) for _ in "qkv")
  kw = dict(
    is_causal=True,
    mask=masks.sliding_window(20),
    score_fn=scores.alibi(jnp.array([0.5, 0.25, 0.1, 0.05])),
    dropout_rate=0.2,
    dropout_rng=jax.random.key(9),
    return_residual=True,
  )
  want = jattn.dot_product_attention(q, k, v, implementation="xla", **kw)
  with jattn.testing.interpret_kernels():
    got = parallel.context_parallel_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      strategy=strategy,
      implementation="flex",
      block_q=16,
      block_kv=16,
      **kw,
    )
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


# Exhaustive: flex's interpreted kernels on every shard pair of the ring, forward and backward
# (14 CPU-seconds).
@pytest.mark.exhaustive
def test_flex_runs_each_ring_pair_interpreted():
  """The ring's pairs through flex: values, lse and the gradients of q, k, v, a bias and
  learned ALiBi slopes (the score function's leaves, differentiated by flex's own rule) equal
  the one-device call's, with documents, causal masking, a soft cap and dropout (drawn at
  each pair's global positions)."""
  mesh = _mesh("auto", (SP,), ("sp",))
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(1, 64, 2, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 64, 1, 16)), jnp.float32) for _ in "kv")
  bias = jnp.asarray(rng.normal(size=(1, 2, 64, 64)), jnp.float32)
  ids = np.sort(rng.integers(0, 3, (1, 64)), axis=1).astype(np.int32)
  kw = dict(
    is_causal=True,
    segment_ids=ids,
    logits_soft_cap=8.0,
    dropout_rate=0.25,
    dropout_rng=jax.random.key(1),
    return_residual=True,
  )

  def loss(attend):
    def value(q, k, v, bias, slopes):
      out, lse = attend(q, k, v, bias, score_fn=scores.alibi(slopes), **kw)
      w = np.sin(np.arange(out.size, dtype=np.float32)).reshape(out.shape)
      return jnp.sum(out * w) + jnp.sum(jnp.cos(lse)), (out, lse)

    return jax.value_and_grad(value, argnums=range(5), has_aux=True)

  args = (q, k, v, bias, jnp.array([0.1, 0.3]))
  one = lambda *a, **kw: jattn.dot_product_attention(*a, implementation="xla", **kw)
  (_, want), want_grads = loss(one)(*args)
  with jattn.testing.interpret_kernels(), _choices.recording() as choices:
    ring = lambda q, k, v, bias, **kw: parallel.ring_attention(
      q, k, v, mesh=mesh, axis_name="sp", bias=bias, implementation="flex", **kw
    )
    (_, got), grads = jax.jit(loss(ring))(*args)
  assert {c.implementation for c in choices} == {"flex"}
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
  for name, g, w in zip(("dq", "dk", "dv", "dbias", "dslopes"), grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)
