"""Whether a mask and score function can run inside flex's kernels: what Pallas' Triton
lowering takes, checked on the kernel body they would be traced into.

flex traces the call's mask and score function into its kernels (:class:`Scorer`, through
:func:`jattn.impl._in_kernel.evaluate`, which turns point gathers from the arrays they read
into loads from memory). What is left must lower to Triton, and much that ``jnp`` allows
does not: a gather from an array held in registers (``jnp.searchsorted``, or indexing an
array the function computed, as ``valid.sum(-1)[b]``), a sort, a cumulative sum, or any
array whose dimensions are not powers of two (Triton's tensors are; a captured array read
whole, as ``valid.sum(-1)`` reads a (B, 40) one, is such an array). :func:`why_not` traces
a one-tile probe kernel that evaluates the mask and the score function (with the
derivative the backward kernels take) exactly as the kernels do, and checks every
operation in its body against :data:`TRITON_PRIMITIVES` and the shape rules; it never
lowers or compiles, so it runs on any backend, in selection and ``explain``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from jattn import _checks, _compat
from jattn.impl import _in_kernel
from jattn.impl.flex import _kernels as _kernels
from jattn.masks import core as masks_core

# Primitives with a rule in Pallas' Triton lowering (jax/_src/pallas/triton/lowering.py) in
# every JAX release jattn supports, from 0.10 to the newest, that has them: closed_call is
# gone from the newest, log2 and one_minus_square (tanh's derivative) are new in it.
# tests/test_flex.py checks each one the installed JAX defines is registered there. An
# allow-list: a primitive a new JAX adds stays refused until it is listed here. Left out
# though registered: those that lower only in narrow forms jattn's functions have no use
# for (concatenate, stack, unstack and split of two pieces along the last axis, cumsum),
# and eval_jaxpr (which JAX 0.10 defines without a Triton rule).
TRITON_PRIMITIVES = frozenset(
  {
    # elementwise
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bitcast_convert_type", "cbrt", "ceil", "clamp", "clz", "convert_element_type", "cos",
    "cosh", "div", "eq", "erf_inv", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
    "is_finite", "le", "log", "log1p", "log2", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "nextafter", "not", "one_minus_square", "or", "population_count", "pow", "rem",
    "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
    "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor",
    # shapes
    "broadcast_in_dim", "iota", "reshape", "squeeze", "transpose",
    # reductions and products
    "argmax", "argmin", "dot_general", "reduce_max", "reduce_min", "reduce_sum",
    # calls and control flow (their bodies checked in turn)
    "closed_call", "cond", "custom_jvp_call", "jit", "remat2", "scan", "stop_gradient", "while",
    # the kernel's own: loads and stores at refs, program ids
    "addupdate", "get", "masked_load", "masked_swap", "multiple_of", "num_programs",
    "program_id", "swap",
  }
)  # fmt: skip

# What a refused primitive usually comes from, for the reason given.
_HINTS = {
  "gather": (
    "a gather from an array in registers, as jnp.searchsorted makes, or indexing an array "
    "the function computed (valid.sum(-1)[b]); flex loads a captured array only where it "
    "is indexed by the index arguments (arr[b, q_idx])"
  ),
  "dynamic_slice": "a slice at a traced offset of an array held in registers",
  "sort": "a sort",
  "cumsum": "a cumulative sum",
  "scatter": "an update of an array (x.at[i].set)",
}


def why_not(
  mask: Any, score_fn: Any, block_q: int, block_kv: int, head_dim: int, dtype: Any
) -> str | None:
  """Why flex's kernels cannot take ``mask`` and ``score_fn`` (either None) at tiles of
  ``block_q`` x ``block_kv`` for inputs of ``dtype``; None when they can. Names the part of
  the mask (the conjunct) or the score function at fault."""
  tiles = (block_q, block_kv, head_dim, dtype)
  reason = _probe(mask, score_fn, *tiles)
  if reason is None:
    return None
  # Apart, to name the one at fault (a conjunct of the mask, or the score function).
  if score_fn is not None and (alone := _probe(None, score_fn, *tiles)):
    return f"score_fn {_name(score_fn)}: {alone}"
  for part in masks_core.conjuncts(mask):
    if alone := _probe(part, None, *tiles):
      return f"mask {part!r}: {alone}"
  return f"mask {mask!r}: {reason}"


def _name(fn: Any) -> str:
  return getattr(fn, "__name__", None) or repr(fn)


def _probe(
  mask: Any, score_fn: Any, block_q: int, block_kv: int, head_dim: int, dtype: Any
) -> str | None:
  """The first thing in the probe kernel's body Triton cannot lower, or None."""
  if mask is None and score_fn is None:
    return None
  # Traced on the arrays' shapes and dtypes alone: the kernel reads each device's share,
  # so a sharding the arrays carry (Explicit mesh axes) is not the kernel's concern. The
  # answer depends on nothing else, so it is kept per structure (the kinds, settings and user
  # functions of the mask and score function) and avals, as jit keeps a trace.
  leaves, tree = jax.tree.flatten((mask, score_fn))
  avals = tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves)
  # A setting that cannot be hashed (an unhashable callable) is probed without the cache.
  probe = _probe_structure if _checks.hashable(tree) else _probe_structure.__wrapped__
  return probe(tree, avals, block_q, block_kv, head_dim, np.dtype(dtype))


@functools.lru_cache(maxsize=512)
def _probe_structure(
  tree: Any, avals: tuple[Any, ...], block_q: int, block_kv: int, head_dim: int, dtype: Any
) -> str | None:
  bodies = []

  def trace(*leaves: Any) -> tuple[()]:
    traced_mask, traced_score_fn = jax.tree.unflatten(tree, leaves)
    body = probe_kernel(traced_mask, traced_score_fn, block_q, block_kv, head_dim, dtype)
    bodies.append(body)
    return ()

  try:
    jax.make_jaxpr(trace)(*avals)
  except Exception as e:  # noqa: BLE001 - the function cannot be traced into a kernel
    return f"it cannot be traced into flex's kernel ({type(e).__name__}: {e})"
  return _first_problem(bodies[0])


def probe_kernel(
  mask: Any, score_fn: Any, block_q: int, block_kv: int, head_dim: int, dtype: Any
) -> Any:
  """The body (a Jaxpr) of a kernel scoring one (block_q, block_kv) tile as flex's kernels
  do: the scores, the score function and its derivative, the mask (with the bounds on the
  lengths), its arrays read from refs; traced, not lowered."""
  specs = _kernels.index_specs(block_q, block_kv)
  f = jnp.promote_types(dtype, jnp.float32)
  mask_f = score_f = None
  if mask is not None:
    mask_f = _in_kernel.Function.trace(lambda b, h, q, kv: mask(b, h, q, kv), *specs)
  if score_fn is not None:
    s_spec = jax.ShapeDtypeStruct((1, 1, block_q, block_kv), f)
    score_f = _in_kernel.Function.trace(
      lambda s, b, h, q, kv: score_fn(s, b, h, q, kv), s_spec, *specs
    )
  mask_arrays = mask_f.arrays if mask_f else ()
  score_arrays = score_f.arrays if score_f else ()
  n_mask, n_arrays = len(mask_arrays), len(mask_arrays) + len(score_arrays)
  settings = _kernels.Settings(1.0, block_q, block_kv, block_q, block_kv, 4, 1, False)
  jaxprs = (mask_f.jaxpr if mask_f else None, score_f.jaxpr if score_f else None, None)

  def kernel(*refs: Any) -> None:
    arrays, (q_ref, k_ref, s_ref, slope_ref) = refs[:n_arrays], refs[n_arrays:]
    scorer = _kernels.Scorer(settings, jaxprs, arrays[:n_mask], arrays[n_mask:])
    i, j, b, n = (pl.program_id(a) for a in range(4))
    q_idx = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    kv_idx = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    batch, head = _kernels.scalar_index(b), _kernels.scalar_index(n)
    s, slope = scorer(q_ref[...], k_ref[...], q_idx, kv_idx, batch, head, True, True)
    s_ref[...] = s
    if slope is not None:
      slope_ref[...] = slope

  width = max(16, _kernels.pow2(head_dim))
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*mask_arrays, *score_arrays)]
  avals += [
    jax.ShapeDtypeStruct((block_q, width), dtype),
    jax.ShapeDtypeStruct((block_kv, width), dtype),
  ]
  tile = jax.ShapeDtypeStruct((block_q, block_kv), f)
  call = pl.pallas_call(kernel, grid=(1, 1, 1, 1), out_shape=[tile, tile], interpret=False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
    closed = jax.make_jaxpr(call)(*avals)
  return next(e for e in _equations(closed.jaxpr) if e.primitive.name == "pallas_call").params[
    "jaxpr"
  ]


def _equations(jaxpr: Any) -> Iterator[Any]:
  """The equations of ``jaxpr`` and of every jaxpr nested in their parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from _equations(sub)


def _first_problem(body: Any) -> str | None:
  for eqn in _equations(body):
    name = eqn.primitive.name
    if name not in TRITON_PRIMITIVES:
      hint = _HINTS.get(name)
      where = f" ({hint})" if hint else ""
      return f"it uses `{name}`{where}, which Pallas' Triton lowering does not implement"
    for v in eqn.outvars:
      if (shape := _value_shape(v.aval)) is not None and not all(_pow2(n) for n in shape):
        return (
          f"it forms a {shape} {np.dtype(v.aval.dtype).name} array in the kernel (`{name}`), and "
          "Triton's arrays have power-of-two dimensions: a captured array read whole "
          "(arr.sum(-1), jnp.roll(arr, 1), comparing with every element) rather than indexed "
          "by the index arguments"
        )
    if reason := _form(eqn):
      return f"it uses `{name}` {reason}, which Pallas' Triton lowering does not implement"
  return None


def _form(eqn: Any) -> str | None:
  """Why an allowed primitive's form does not lower (None where it does)."""
  name, params = eqn.primitive.name, eqn.params
  closed = [p for p in params.values() if isinstance(p, jex_core.ClosedJaxpr)]
  closed += [b for p in params.values() if isinstance(p, tuple) for b in p]
  if any(isinstance(c, jex_core.ClosedJaxpr) and c.consts for c in closed):
    return "with constants in its body"
  if name == "scan":
    inner = params["jaxpr"].jaxpr
    num_consts, num_carry = _compat.scan_counts(params)
    if params["reverse"] or params["unroll"] not in (1, True):
      return "reversed or unrolled"
    if len(inner.invars) != num_consts + num_carry or len(inner.outvars) != num_carry:
      return "over arrays (only a loop with a carry, as lax.fori_loop makes)"
  if name == "dot_general" and any(len(v.aval.shape) != 2 for v in eqn.invars):
    return "on operands that are not matrices"
  if name in ("argmax", "argmin") and (
    len(params["axes"]) != 1 or np.dtype(params["index_dtype"]) != np.int32
  ):
    return "over several axes or with a non-int32 index"
  return None


def _value_shape(aval: Any) -> tuple[int, ...] | None:
  """An array value's shape (None for refs and tokens)."""
  if not isinstance(aval, jax.core.ShapedArray):
    return None
  return tuple(aval.shape)


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0
