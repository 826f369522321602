"""The selection table, read through jattn.explain with the backend named: every row.

Shapes are jax.ShapeDtypeStruct values, so nothing is computed (explain only checks and
routes). The cuDNN row's argument translation runs on CPU by standing jax.nn's XLA path
in for the cuDNN kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks
from jattn.impl import select

BF16 = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
F32 = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.float32)
SMALL = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
CROSS_KV = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
IDS = np.repeat(np.arange(4), 256)[None].repeat(2, 0)

# (id, backend, query, key/value, keywords, implementation, fragment of the reason)
ROUTES = [
  ("tpu_causal", "tpu", BF16, BF16, dict(is_causal=True), "splash", "fused kernel for TPU"),
  ("tpu_f32_window", "tpu", F32, F32, dict(local_window_size=(64, 0)), "splash", "fused"),
  ("tpu_docs", "tpu", BF16, BF16, dict(is_causal=True, segment_ids=IDS), "splash", "fused"),
  ("tpu_array", "tpu", BF16, BF16, dict(mask=np.tri(1024, dtype=bool)), "splash", "fused"),
  ("tpu_soft_cap", "tpu", BF16, BF16, dict(logits_soft_cap=30.0), "splash", "fused"),
  ("tpu_residual", "tpu", BF16, BF16, dict(return_residual=True), "splash", "fused"),
  ("tpu_tiles", "tpu", BF16, BF16, dict(block_q=256, block_kv=256), "splash", "fused"),
  ("tpu_bias", "tpu", BF16, BF16, dict(bias=np.zeros((1024, 1024), np.float32)), "xla", "bias"),
  ("tpu_score_fn", "tpu", BF16, BF16, dict(score_fn=lambda s, *i: s), "xla", "score_fn"),
  (
    "tpu_from_fn",
    "tpu",
    BF16,
    BF16,
    dict(mask=masks.from_fn(lambda b, h, q, k: q >= k)),
    "xla",
    "arbitrary index function",
  ),
  (
    "tpu_per_row_offset",
    "tpu",
    BF16,
    BF16,
    dict(mask=masks.causal(np.array([0, 5]))),
    "xla",
    "varies over the batch rows",
  ),
  (
    "tpu_f16",
    "tpu",
    BF16.update(dtype=jnp.float16),
    BF16.update(dtype=jnp.float16),
    {},
    "xla",
    "dtype float16",
  ),
  ("tpu_rule_named", "tpu", BF16, BF16, dict(backward="custom_vjp"), "xla", "own fused"),
  ("tpu_odd_tiles", "tpu", BF16, BF16, dict(block_q=100), "blockwise", "multiple of 128"),
  (
    "tpu_dropout",
    "tpu",
    BF16,
    BF16,
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "xla",
    "dropout",
  ),
  ("gpu_causal", "gpu", BF16, BF16, dict(is_causal=True), "cudnn", "fused kernel for GPU"),
  ("gpu_window", "gpu", BF16, BF16, dict(local_window_size=(64, 0)), "cudnn", "fused"),
  ("gpu_full_cross", "gpu", BF16, CROSS_KV, {}, "cudnn", "fused"),
  ("gpu_f32", "gpu", F32, F32, dict(is_causal=True), "flex", "dtype float32"),
  ("gpu_causal_cross", "gpu", BF16, CROSS_KV, dict(is_causal=True), "flex", "T=1024 != S=512"),
  (
    "gpu_lengths",
    "gpu",
    BF16,
    BF16,
    dict(key_value_seq_lengths=np.array([9, 1024])),
    "flex",
    "lengths can empty rows",
  ),
  ("gpu_mask_array", "gpu", BF16, BF16, dict(mask=np.tri(1024, dtype=bool)), "flex", "mask array"),
  ("gpu_residual", "gpu", BF16, BF16, dict(return_residual=True), "flex", "cotangent"),
  ("gpu_docs", "gpu", BF16, BF16, dict(segment_ids=IDS), "flex", "segment_ids"),
  (
    "gpu_head_dim",
    "gpu",
    BF16.update(shape=(2, 1024, 8, 192)),
    BF16.update(shape=(2, 1024, 8, 192)),
    {},
    "flex",
    "H=192 > 128",
  ),
  ("gpu_soft_cap", "gpu", BF16, BF16, dict(logits_soft_cap=30.0), "flex", "soft cap"),
  ("gpu_bias", "gpu", BF16, BF16, dict(bias=np.zeros((1024, 1024), np.float32)), "flex", "bias"),
  ("gpu_score_fn", "gpu", BF16, BF16, dict(score_fn=lambda s, *i: s), "flex", "score_fn"),
  (
    "gpu_from_fn",
    "gpu",
    BF16,
    BF16,
    dict(mask=masks.from_fn(lambda b, h, q, k: q >= k)),
    "flex",
    "mask",
  ),
  (
    "gpu_dropout",
    "gpu",
    BF16,
    BF16,
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "flex",
    "dropout",
  ),
  ("gpu_tiles", "gpu", BF16, BF16, dict(block_q=128, block_kv=64), "flex", "fused kernel for GPU"),
  ("gpu_rule_named", "gpu", BF16, BF16, dict(backward="custom_vjp"), "xla", "own fused"),
  ("gpu_odd_tiles", "gpu", BF16, BF16, dict(block_q=100), "blockwise", "powers of two"),
  ("cpu_small", "cpu", SMALL, SMALL, {}, "xla", "under 8 MiB on CPU"),
  ("cpu_large", "cpu", BF16, BF16, dict(is_causal=True), "blockwise", "at least 8 MiB"),
  ("cpu_tiles", "cpu", SMALL, SMALL, dict(block_q=16), "blockwise", "ask for tiles"),
  ("cpu_autodiff", "cpu", BF16, BF16, dict(backward="autodiff"), "xla", "autodiff"),
]


@pytest.mark.parametrize(
  "backend, q, kv, kw, implementation, why",
  [r[1:] for r in ROUTES],
  ids=[r[0] for r in ROUTES],
)
def test_every_row_of_the_table_routes_as_documented(backend, q, kv, kw, implementation, why):
  choice = jattn.explain(q, kv, kv, backend=backend, **kw)
  assert choice.implementation == implementation, str(choice)
  assert why in choice.reason, str(choice)
  assert choice.backend == backend
  assert sorted(choice.rejected) == sorted(set(select.TABLE) - {implementation})
  assert all(choice.rejected.values())
  fused = select.FUSED[backend]  # tried in this order
  if implementation in fused:
    assert choice.backward is None  # the kernel's own backward
  else:
    assert choice.backward is not None  # a jattn rule
  if fused and implementation != fused[0]:
    assert why in choice.rejected[fused[0]] or why in choice.reason


def test_explain_takes_arrays_and_checks_like_the_call():
  q = jnp.ones((1, 8, 2, 4))
  assert jattn.explain(q, q, q).implementation == "xla"  # CPU, tiny
  assert "xla" in str(jattn.explain(q, q, q, backend="tpu"))
  with pytest.raises(ValueError, match="backend must be one of"):
    jattn.explain(q, q, q, backend="metal")
  with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
    jattn.explain(q, q, q, causal=True)
  with pytest.raises(ValueError, match="key and value must have the same shape"):
    jattn.explain(q, q, q[:, :4])
  with pytest.raises(ValueError, match="implementation='cudnn' does not support segment_ids"):
    jattn.explain(BF16, BF16, BF16, implementation="cudnn", segment_ids=IDS, backend="gpu")
  with pytest.raises(ValueError, match="does not support dtype float32"):
    jattn.explain(F32, F32, F32, implementation="cudnn", backend="gpu")


def test_lowering_for_routes_traced_calls_as_on_that_backend():
  q = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  with jattn.testing.lowering_for("tpu"):
    choice = jattn.explain(q, q, q, is_causal=True)
    assert choice.implementation == "splash"
    assert choice.rejected["cudnn"] == "it runs on GPU, and the backend is 'tpu'"
  with jattn.testing.lowering_for("gpu"):
    assert jattn.explain(q, q, q, is_causal=True).implementation == "cudnn"
  assert jattn.explain(q, q, q, is_causal=True).implementation == "xla"
  with pytest.raises(ValueError, match="backend must be one of"):
    with jattn.testing.lowering_for("metal"):
      pass


def test_cudnn_arguments_translate_back_to_jax_nn(monkeypatch):
  """The cuDNN row's translation of the one combined mask into jax.nn's keywords, run with
  jax.nn's XLA path standing in for the kernel, against jattn's xla path."""
  calls = []
  real = jax.nn.dot_product_attention

  def stand_in(*args, implementation=None, **kw):
    assert implementation == "cudnn"
    calls.append({k: v for k, v in kw.items() if v is not None and v is not False})
    return real(*args, implementation="xla", **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))
  cases = [
    (dict(is_causal=True), {"is_causal"}),
    (dict(local_window_size=(3, 0)), {"local_window_size"}),
    (dict(is_causal=True, local_window_size=(3, 2)), {"is_causal", "local_window_size"}),
    (dict(key_value_seq_lengths=jnp.array([16, 12])), {"query_seq_lengths"}),
    (dict(mask=np.tri(16, dtype=bool), is_causal=True), {"mask", "is_causal"}),
    (dict(bias=jnp.zeros((16, 16), jnp.bfloat16)), set()),
  ]
  with jattn.testing.lowering_for("gpu"):
    for kw, names in cases:
      calls.clear()
      got = jattn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
      want = jattn.dot_product_attention(q, k, v, implementation="xla", **kw)
      np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2)
      assert names <= set(calls[0]), (kw, calls)
      assert calls[0]["scale"] == pytest.approx(8**-0.5)
      if "local_window_size" in names:
        assert calls[0]["local_window_size"] == (3, 0)
  with jattn.testing.lowering_for("gpu"):
    out, lse = jattn.dot_product_attention(q, k, v, implementation="cudnn", return_residual=True)
    _, want = jattn.dot_product_attention(q, k, v, implementation="xla", return_residual=True)
    np.testing.assert_allclose(np.float32(lse), np.float32(want), atol=2e-2)


def test_the_docs_routing_table_is_what_explain_says():
  """docs/implementations.md's table of typical calls, cell by cell."""
  import pathlib

  from jattn import scores

  text = (pathlib.Path(__file__).parents[1] / "docs" / "implementations.md").read_text()
  start = text.index("| call (B=2, T=S=1024, N=8, H=128) | CPU | GPU | TPU |")
  rows = [line for line in text[start:].splitlines()[2:] if line.startswith("|")]
  rows = rows[: next((i for i, r in enumerate(rows) if not r.startswith("| `")), len(rows))]
  assert len(rows) >= 12
  env = dict(
    np=np,
    masks=masks,
    scores=scores,
    ids=IDS,
    bias=np.zeros((1024, 1024), np.float32),
    slopes=np.linspace(0.1, 1, 8),
    fn=lambda b, h, q, k: q >= k,
    float32=jnp.float32,
    float16=jnp.float16,
    sinks=np.zeros(8, np.float32),
  )
  for row in rows:
    call, *cells = (c.strip() for c in row.strip("|").split("|"))
    kw = eval(f"dict({call.strip('`')})", env)
    dtype, length = kw.pop("dtype", jnp.bfloat16), 1024
    if "T" in kw:
      length = kw.pop("T")
      kw.pop("S")
    q = jax.ShapeDtypeStruct((2, length, 8, 128), dtype)
    for backend, want in zip(("cpu", "gpu", "tpu"), cells):
      got = jattn.explain(q, q, q, backend=backend, **kw)
      assert got.implementation == want, (call, backend, str(got))
