"""Accuracy against jax.nn: the cells of experiments/accuracy.py meet their target.

Each cell (dtype, case, rule) is one jax.vjp; every quantity (out, lse, dq, dk, dv, dbias)
must be within ``accuracy.meets_target`` of jax.nn's own error against a float64 NumPy
reference (float32 cells: means over head-dimension orders, see test_meets_target). CI
checks the script's --quick subset (bfloat16 and float32; a bias, a saturated softmax, an
additive -1e9 mask; xla/autodiff and blockwise with odd tiles); the whole table (``python -m
experiments.accuracy``, about 2.5 minutes) is in the README. Cells are computed once and
cached, so the per-quantity tests cost nothing beyond the first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import accuracy as acc

CELLS = [
  (d, c, r, q)
  for d in acc.QUICK["dtypes"]
  for c in acc.QUICK["cases"]
  for r in acc.QUICK["rules"]
  for q in acc.CASES[c].quantities
]
# flex, compiled on a GPU only, runs here in Pallas interpret mode (the same arithmetic) on the
# three cells its backward once missed by 20x to 10^7x: a whole row under an additive -1e30
# mask (probabilities recomputed from the rounded log-sum-exp, not from m and log l apart),
# saturated bfloat16 rows (Δ from the bfloat16 output) and scale 1e3 (dS rounded to bfloat16
# alone for dK).
CELLS += [
  (d, c, "flex", q)
  for d, c in [("f32", "mask_1e30"), ("bf16", "saturated_x10"), ("bf16", "scale_1e3")]
  for q in acc.CASES[c].quantities
]


@pytest.mark.parametrize("dtype,case,rule,quantity", CELLS)
def test_meets_target(dtype, case, rule, quantity):
  e = acc.evaluate(case, dtype, rule)[quantity]
  assert e["error"] is None, f"{dtype} {case} {rule}: raises {e['error']}"
  if dtype == "f32":
    # In float32 both errors sit at the rounding floor, where the dot order XLA picks (it
    # changed between jaxlib 0.10 and 0.12) and the machine's FMA contraction and vector width
    # decide the last bits: one order of the sums is one draw. The cell compares the rule's
    # mean error over acc.DRAWS head-dimension orders with jax.nn's over the same orders (see
    # acc.mean_errors), with two ulps of room for the machine: the same code measured blockwise
    # dq 1.23x jax.nn's error on one x86 CPU and 1.6x on an AMD EPYC (7.8e-7, 6.6 ulps of its
    # largest |reference| 1.92). The bfloat16 cells, whose error the inputs' rounding sets,
    # keep the given order.
    err = acc.mean_errors(case, dtype, rule)[quantity]
    jax_nn_err = acc.mean_errors(case, dtype, None)[quantity]
    judged = f"mean over {acc.DRAWS} head orders"
    room = 2 * acc.ulp(e["size"], np.float32)
  else:
    err, jax_nn_err, judged, room = e["err"], e["jax_nn_err"], "in the given order", 0.0
  allowed = acc.target(jax_nn_err, e["size"], acc.DTYPES[dtype]) + room
  assert err <= allowed, (
    f"{dtype} {case} {rule} {quantity}, {judged}: error {err:.3g} vs jax.nn's "
    f"{jax_nn_err:.3g} (ratio {err / jax_nn_err if jax_nn_err else np.inf:.3g}); allowed "
    f"{allowed:.3g} (largest |reference| {e['size']:.3g})"
  )


@pytest.mark.parametrize("case", ["bias", "qkv_same_shared_bias"])
def test_reordering_is_exact_and_spreads_jax_nns_error(case):
  """Every reordering gives jax.nn the same attention (within rounding), restored to the given
  order, and its error is the largest over them, never below the error in the given order.
  Key reorderings apply only where nothing depends on positions."""
  a = acc.inputs(case, "f32")
  c = acc.CASES[case]
  fn = acc._baseline_vjp(c.program, "f32")
  given = acc._numpy(fn(a))
  for r in acc.REORDERINGS:
    assert acc.applies(c, r)
    other = acc.restored(c, acc._numpy(fn(acc.reordered(c, a, r))), r)
    for name in given:
      np.testing.assert_allclose(other[name], given[name], rtol=1e-5, atol=1e-5, err_msg=name)
  base = acc.evaluate_case(case, "f32")
  assert all(base["jax_nn_err"][q] >= base["jax_nn_err_as_given"][q] > 0 for q in base["size"])
  assert [r[0] for r in acc.REORDERINGS if acc.applies(acc.CASES["alibi_causal"], r)] == [
    "head",
    "head",
  ]


# --- the harness itself ----------------------------------------------------------------------


def test_target_arithmetic():
  assert acc.ulp(1.0, jnp.bfloat16) == 2.0**-7 and acc.ulp(3.0, np.float16) == 2.0**-9
  assert acc.ulp(1e-3, np.float32) == 2.0**-10 * 2.0**-23
  assert acc.meets_target(1.5e-3, 1e-3, 0.0, np.float32)
  assert not acc.meets_target(1.6e-3, 1e-3, 0.0, np.float32)
  assert acc.meets_target(0.05 * 2**-7, 0.0, 1.0, jnp.bfloat16)  # within a tenth of an ulp
  assert not acc.meets_target(0.2 * 2**-7, 0.0, 1.0, jnp.bfloat16)
  assert not acc.meets_target(float("nan"), 1.0, 1.0, np.float32)
  assert acc.max_abs_error([0.0, -np.inf, 2.0], [0.5, -np.inf, 1.0]) == 1.0
  assert acc.max_abs_error([np.nan], [0.0]) == np.inf
  assert acc.max_abs_error([-np.inf], [0.0]) == np.inf


def test_jax_nn_style_baseline_is_jax_nn():
  """The baseline used for features jax.nn lacks computes what jax.nn computes without them."""
  a = acc.inputs("bias", "bf16")
  args = (a["q"], a["k"], a["v"], a["bias"])
  for causal in (False, True):
    want = jax.jit(
      lambda *args: jax.nn.dot_product_attention(*args, is_causal=causal, return_residual=True)
    )(*args)
    allowed = np.tril(np.ones((acc.T, acc.S), bool))[None, None] if causal else None
    got = jax.jit(lambda *args: acc.jax_nn_style(*args, scale=1 / np.sqrt(acc.H), allowed=allowed))(
      *args
    )
    for x, y in zip(got, want):
      assert x.dtype == y.dtype
      np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2**-7, atol=2**-9
      )


def test_reference_matches_float64_autodiff(x64):
  """The NumPy reference's hand-written backward against jax.grad of the same formula."""
  case = acc.CASES["gqa_window_soft_cap"]
  a = acc.inputs(case.name, "f32")
  ref = acc.reference(case, a, np.float64)
  q, k, v, ct = (jnp.asarray(np.asarray(a[n]), jnp.float64) for n in ("q", "k", "v", "ct"))
  allowed = jnp.asarray(acc.allowed_np(case))

  def f(q, k, v):
    kr, vr = (jnp.repeat(x, acc.N // acc.K, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(acc.H)
    s = case.soft_cap * jnp.tanh(s / case.soft_cap)
    p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf))
    return jnp.sum(jnp.einsum("bnts,bsnh->btnh", p, vr) * ct)

  grads = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)  # one program, not one per operation
  for name, g in zip(("dq", "dk", "dv"), grads):
    np.testing.assert_allclose(ref[name], g, rtol=1e-10, atol=1e-12, err_msg=name)


def test_reference_contract_for_masked_rows():
  """-inf scores are excluded (a row of them gives zeros and lse -inf); finite ones, however
  negative, take part."""
  case = acc.CASES["bias"]
  a = dict(acc.inputs("bias", "f32"))
  bias = np.zeros((acc.B, acc.N, acc.T, acc.S), np.float32)
  bias[0, 0, 0] = -np.inf
  bias[0, 0, 1] = np.finfo(np.float32).min
  a["bias"] = bias
  ref = acc.reference(case, a, np.float64)
  assert np.all(ref["out"][0, 0, 0] == 0) and ref["lse"][0, 0, 0] == -np.inf
  assert np.all(ref["dq"][0, 0, 0] == 0) and np.all(ref["dbias"][0, 0, 0] == 0)
  v = np.asarray(a["v"], np.float64)[0, :, 0]  # head 0 uses key/value head 0
  np.testing.assert_allclose(ref["out"][0, 1, 0], v.mean(0), rtol=1e-12)


def test_script_quick_prints_a_table(capsys):
  rows = [r for r in acc.main(["--quick"]) if r["rule"] not in acc.PEERS]  # peers: on a GPU
  assert len(rows) == 2 * 3 * 2
  out = capsys.readouterr().out
  assert "| bf16 | bias | jax.nn (abs err) |" in out and "| f32 | bias | blockwise/16x16 |" in out
  assert "cells meet the target" in out
