"""Higher-order derivatives: a backward pass that cannot be differentiated says so in jattn's words.

Blockwise's backward runs ``while`` loops whose trip counts are the tiles the mask leaves,
and a fused kernel's backward (splash, and so ring attention with splash; cuDNN) is one call:
JAX can take neither through a second reverse pass, and says so in terms of its own
internals (``lax.while_loop ... with dynamic start/stop values``) or with an empty
NotImplementedError. :func:`first_order` wraps such a backward so that differentiating it
in reverse mode raises a ValueError that names the implementation, the cause and the way
out, while every first-order use is untouched.

``forward=True`` keeps forward mode through the backward pass (blockwise's loops take
JVPs), so ``jax.jacfwd(jax.grad(f))`` and ``jax.hessian(f)`` still work; ``forward=False``
(a Pallas kernel) refuses those too, with the same message.

How it works: the backward becomes a ``custom_jvp`` function whose JVP rule takes the JVP
of the backward and passes the tangent through ``_refuse_transpose_p``, an identity that is
linear for JAX but whose transpose raises. A second reverse pass transposes that identity
first (it is the last operation on the tangent), so the message comes before JAX reaches
the loops.

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

TILE_LOOPS = "loops over as many tiles as the mask leaves (lax.while_loop)"
FUSED = "is a fused kernel"
WAY_OUT = (
  "implementation='xla' differentiates to any order (backward='autodiff' in both modes, "
  "backward='custom_vjp' by reverse over reverse); see docs/backward.md"
)

_refuse_transpose_p = jex_core.Primitive("jattn_refuse_transpose")
_refuse_transpose_p.def_impl(lambda x, *, message: x)
_refuse_transpose_p.def_abstract_eval(lambda x, *, message: x)
mlir.register_lowering(_refuse_transpose_p, lambda ctx, x, *, message: [x])
batching.defvectorized(_refuse_transpose_p)


def _refuse(cotangent: Any, x: Any, *, message: str) -> Any:
  del cotangent, x
  raise ValueError(message)


ad.deflinear2(_refuse_transpose_p, _refuse)


def _refuse_transpose(tree: Any, message: str) -> Any:
  def one(x: Any) -> Any:
    if not jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact):
      return x  # float0 and integer tangents carry nothing to transpose
    return _refuse_transpose_p.bind(x, message=message)

  return jax.tree.map(one, tree)


def _message(who: str, cause: str, forward: bool, way_out: str) -> str:
  return (
    f"{who} gives first-order gradients"
    + (" (and forward-over-reverse ones: jax.jacfwd(jax.grad(f)), jax.hessian)" if forward else "")
    + f": its backward pass {cause}, which JAX cannot differentiate"
    + (" in reverse mode" if forward else "")
    + f". For higher-order derivatives, {way_out}"
  )


def first_order(
  fn: Callable[..., Any], who: str, cause: str, *, forward: bool, way_out: str = WAY_OUT
) -> Callable[..., Any]:
  """``fn`` (a backward pass), made to refuse a second reverse pass with a ValueError; with
  ``forward=False`` any derivative of it at all (also for a fused kernel's forward pass
  inside a custom_vjp, which a second derivative differentiates for the residuals it keeps).

  Args:
    fn: the backward pass, a function of arrays (pytrees of arrays) only.
    who: what the message names, e.g. ``"implementation='blockwise'"``.
    cause: why it cannot be differentiated, completing "its backward pass ...", e.g.
      :data:`TILE_LOOPS` or :data:`FUSED`.
    forward: whether forward mode (a JVP of the backward pass) works and is kept.
    way_out: what to use instead, completing "For higher-order derivatives, ...".
  """
  message = _message(who, cause, forward, way_out)

  @jax.custom_jvp
  def wrapped(*args: Any) -> Any:
    return fn(*args)

  @wrapped.defjvp
  def _jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    if not forward:
      raise ValueError(message)
    out, out_dot = jax.jvp(fn, primals, tangents)
    return out, _refuse_transpose(out_dot, message)

  return wrapped


def reverse_once(fn: Callable[..., Any], who: str, cause: str) -> Callable[..., Any]:
  """``fn`` with its own reverse-mode rule, ``jax.vjp(fn)``'s, whose forward and backward
  passes refuse any derivative of their own (:func:`first_order` with ``forward=False``):
  for a function whose backward is not jattn's to wrap (the splash kernel's own custom_vjp).
  Integer arguments get no cotangent."""

  @jax.custom_vjp
  def wrapped(*args: Any) -> Any:
    return fn(*args)

  forward = first_order(lambda *args: jax.vjp(fn, *args), who, cause, forward=False)
  backward = first_order(lambda vjp, ct: vjp(ct), who, cause, forward=False)
  wrapped.defvjp(forward, backward)
  return wrapped
