"""Derivatives a rule cannot take: a backward pass that cannot be differentiated, and forward
mode through a custom_vjp, say so in jattn's words.

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

Forward mode is the dual: a ``jax.custom_vjp`` has none, and JAX refuses ``jax.jvp`` of it
with ``can't apply forward-mode autodiff (jvp) to a custom_vjp function``. Each rule is a
:class:`reverse_only` instead, a drop-in for ``jax.custom_vjp`` whose tangent map is
``_reverse_only_p``: a linear primitive that reverse mode only transposes (into the rule's
backward pass) and batches, and whose evaluation and lowering (what forward mode does)
raise a ValueError naming the rule and the way out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jattn import _compat

__all__ = [
  "TILE_LOOPS",
  "FUSED",
  "WAY_OUT",
  "first_order",
  "KERNEL_RULE",
  "FORWARD_WAY_OUT",
  "reverse_only",
  "reverse_once",
]

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


# --- forward mode through a custom_vjp rule ------------------------------------------------

KERNEL_RULE = "its kernel's backward (a custom_vjp)"
FORWARD_WAY_OUT = (
  "use implementation='xla' with backward='autodiff', which differentiates in both modes; "
  "see docs/backward.md"
)


def _forward_message(who: str, rule: str, way_out: str) -> str:
  return (
    f"{who} gives reverse-mode derivatives only: {rule} has no forward mode, so jax.jvp, "
    "jax.jacfwd and jax.linearize cannot differentiate it (jax.grad, jax.vjp and jax.jacrev "
    f"can). For forward mode, {way_out}"
  )


class _Linear:
  """The tangent map of one call through a :func:`reverse_only` rule, known only by its
  transpose: ``backward(residuals, cotangents)`` gives the cotangents of the perturbed inputs
  (None for a zero) from the outputs' (None for a zero). Hashable by identity, as a
  primitive's parameter must be."""

  def __init__(
    self,
    backward: Callable[[list[Any], list[Any]], list[Any]],
    num_res: int,
    out_avals: tuple[Any, ...],
    message: str,
  ) -> None:
    self.backward, self.num_res, self.out_avals, self.message = (
      backward,
      num_res,
      out_avals,
      message,
    )

  def __repr__(self) -> str:  # as jaxprs print it
    return f"<{self.message.split(':')[0]}>"

  def batched(self, size: int, res_axes: tuple[int | None, ...], axis_data: Any) -> _Linear:
    """The map of a vmap over ``size`` (residuals batched at ``res_axes``, the tangents and
    the outputs at 0)."""
    spmd = getattr(axis_data, "spmd_name", None)
    mesh_axis = getattr(axis_data, "explicit_mesh_axis", None)
    backward = jax.vmap(
      self.backward,
      in_axes=(list(res_axes), 0),
      out_axes=0,
      axis_size=size,
      spmd_axis_name=spmd if spmd is not None else mesh_axis,
    )
    avals = tuple(_compat.batched_aval(size, a, mesh_axis) for a in self.out_avals)
    return _Linear(backward, self.num_res, avals, self.message)


_reverse_only_p = jex_core.Primitive("jattn_reverse_only")
_reverse_only_p.multiple_results = True


def _reverse_only_impl(*args: Any, linear: _Linear) -> Any:
  del args
  raise ValueError(linear.message)


def _reverse_only_lowering(ctx: Any, *args: Any, linear: _Linear) -> Any:
  del ctx, args
  raise ValueError(linear.message)


def _reverse_only_transpose(cotangents: Any, *args: Any, linear: _Linear) -> list[Any]:
  tangents = args[linear.num_res :]
  none = [None] * len(args)
  if all(type(c) is ad.Zero for c in cotangents):
    return none
  cotangents = [None if type(c) is ad.Zero else c for c in cotangents]
  d_tangents = linear.backward(list(args[: linear.num_res]), cotangents)
  d_tangents = [
    _like(d, t.aval) if d is not None and ad.is_undefined_primal(t) else None
    for d, t in zip(d_tangents, tangents, strict=True)
  ]
  return none[: linear.num_res] + d_tangents


def _like(ct: Any, aval: Any) -> Any:
  """``ct`` in the dtype of the tangent ``aval`` it is the cotangent of."""
  return ct if ct.dtype == aval.dtype else ct.astype(aval.dtype)


def _reverse_only_batch(
  axis_data: Any, args: Any, dims: Any, *, linear: _Linear
) -> tuple[list[Any], list[Any]]:
  if all(d is None for d in dims):
    outs = _reverse_only_p.bind(*args, linear=linear)
    return outs, [None] * len(outs)
  size = axis_data.size
  res, res_dims = args[: linear.num_res], dims[: linear.num_res]
  res = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(res, res_dims)]
  res_axes = tuple(None if d is None else 0 for d in res_dims)
  tangents = [
    jax.numpy.broadcast_to(x, (size, *x.shape)) if d is None else jax.numpy.moveaxis(x, d, 0)
    for x, d in zip(args[linear.num_res :], dims[linear.num_res :])
  ]
  batched = linear.batched(size, res_axes, axis_data)
  outs = _reverse_only_p.bind(*res, *tangents, linear=batched)
  return outs, [0] * len(outs)


_reverse_only_p.def_impl(_reverse_only_impl)
_reverse_only_p.def_abstract_eval(lambda *args, linear: linear.out_avals)
mlir.register_lowering(_reverse_only_p, _reverse_only_lowering)
ad.primitive_transposes[_reverse_only_p] = _reverse_only_transpose
batching.fancy_primitive_batchers[_reverse_only_p] = _reverse_only_batch


def _inexact(x: Any) -> bool:
  return bool(jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact))


class reverse_only:  # noqa: N801 (a decorator, spelt as jax.custom_vjp)
  """``jax.custom_vjp``, with forward mode refused in jattn's words.

  Reverse mode takes the rule exactly as ``jax.custom_vjp`` does: ``defvjp(fwd, bwd,
  symbolic_zeros=...)`` and ``nondiff_argnums`` mean the same, and ``jax.grad``, ``jax.vjp``,
  ``vmap`` both ways round, ``remat``, ``scan``, ``shard_map`` and higher derivatives see
  the same forward and backward passes. ``jax.jvp``, ``jax.jacfwd`` and ``jax.linearize``'s
  linear map raise a ValueError that names the rule and the way out, where JAX raises
  ``can't apply forward-mode autodiff (jvp) to a custom_vjp function``.

  How: the function is a ``jax.custom_jvp`` whose JVP runs ``fwd`` and maps the tangents
  through ``_reverse_only_p``, a linear primitive holding the residuals whose transpose is
  ``bwd`` and whose batching rule vmaps ``bwd``; evaluating or lowering it (what forward
  mode does, and reverse mode never does: it only transposes it) raises the message.
  ``jax.custom_vjp``'s own tangent map (JAX's ``custom_lin``) has no batching rule, so a
  wrapper around it broke ``jax.grad(jax.vmap(f))``.

  Args:
    fun: the function, as for ``jax.custom_vjp``.
    nondiff_argnums: its static (hashable, non-array) arguments, passed first to ``bwd``.
    who: what the message names, e.g. ``"implementation='blockwise'"``, or a function of the
      ``nondiff_argnums`` arguments that says it.
    rule: its backward, completing "... has no forward mode".
    way_out: what to use instead, completing "For forward mode, ...".
  """

  def __init__(
    self,
    fun: Callable[..., Any],
    nondiff_argnums: tuple[int, ...] = (),
    *,
    who: str | Callable[..., str],
    rule: str = "its backward rule (a custom_vjp)",
    way_out: str = FORWARD_WAY_OUT,
  ) -> None:
    functools.update_wrapper(self, fun)
    self.fun, self.nondiff_argnums = fun, tuple(nondiff_argnums)
    self.who, self.rule, self.way_out = who, rule, way_out
    self.fwd: Callable[..., Any] | None = None
    self.bwd: Callable[..., Any] | None = None
    self.symbolic_zeros = False

  def defvjp(
    self, fwd: Callable[..., Any], bwd: Callable[..., Any], symbolic_zeros: bool = False
  ) -> None:
    self.fwd, self.bwd, self.symbolic_zeros = fwd, bwd, symbolic_zeros

  def __call__(self, *args: Any) -> Any:
    assert self.fwd is not None and self.bwd is not None, "defvjp first"
    fwd, bwd = self.fwd, self.bwd
    static = {i: args[i] for i in self.nondiff_argnums}
    leaves, tree = jax.tree.flatten(tuple(a for i, a in enumerate(args) if i not in static))
    nondiff = [static[i] for i in sorted(static)]
    who = self.who if isinstance(self.who, str) else self.who(*nondiff)
    message = _forward_message(who, self.rule, self.way_out)

    def full(diff: tuple[Any, ...]) -> list[Any]:
      it = iter(diff)
      return [static[i] if i in static else next(it) for i in range(len(args))]

    @jax.custom_jvp
    def call(*leaves: Any) -> Any:
      return self.fun(*full(jax.tree.unflatten(tree, leaves)))

    def jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
      zero = jax.custom_derivatives.SymbolicZero
      moving = [
        i
        for i, (p, t) in enumerate(zip(primals, tangents))
        if not isinstance(t, zero) and _inexact(p)
      ]
      inputs = list(primals)
      if self.symbolic_zeros:
        inputs = [
          jax.custom_derivatives.CustomVJPPrimal(p, i in moving) for i, p in enumerate(primals)
        ]
      out, res = fwd(*full(jax.tree.unflatten(tree, inputs)))
      out_leaves, out_tree = jax.tree.flatten(out)
      out_avals = tuple(jax.typeof(o).to_tangent_aval() for o in out_leaves)
      if not moving:
        return out, jax.tree.unflatten(out_tree, [zero(a) for a in out_avals])
      res_leaves, res_tree = jax.tree.flatten(res)

      def backward(res_leaves: list[Any], cotangents: list[Any]) -> list[Any]:
        def fill(c: Any, aval: Any) -> Any:
          if c is not None:
            return c
          return zero(aval) if self.symbolic_zeros else ad.zeros_like_aval(aval)

        cts = jax.tree.unflatten(out_tree, [fill(c, a) for c, a in zip(cotangents, out_avals)])
        d = bwd(*nondiff, jax.tree.unflatten(res_tree, res_leaves), cts)
        d_leaves = _per_leaf(d, tree)
        return [None if isinstance(d_leaves[i], zero) else d_leaves[i] for i in moving]

      linear = _Linear(backward, len(res_leaves), out_avals, message)
      t_out = _reverse_only_p.bind(*res_leaves, *(tangents[i] for i in moving), linear=linear)
      return out, jax.tree.unflatten(out_tree, t_out)

    call.defjvp(jvp, symbolic_zeros=True)
    return call(*leaves)


def _per_leaf(cotangents: Any, tree: Any) -> list[Any]:
  """A backward rule's cotangents (a tuple, one per differentiable argument, None for a
  whole argument's zero) as one per leaf of the arguments' ``tree``, None where zero."""
  if isinstance(cotangents, list):
    cotangents = tuple(cotangents)
  missing = object()  # not a pytree: stands for each leaf of an argument whose cotangent is None
  dummy = jax.tree.unflatten(tree, [object()] * tree.num_leaves)
  flat: list[Any] = []

  def append(c: Any, d: Any) -> None:
    n = len(jax.tree.leaves(d))
    flat.extend([missing if c is None else c] * n)

  jax.tree.map(append, cotangents, dummy, is_leaf=lambda x: x is None)
  assert len(flat) == tree.num_leaves, (len(flat), tree)
  return [None if c is missing else c for c in flat]


def reverse_once(fn: Callable[..., Any], who: str, cause: str) -> Callable[..., Any]:
  """``fn`` with its own reverse-mode rule, ``jax.vjp(fn)``'s, whose forward and backward
  passes refuse any derivative of their own (:func:`first_order` with ``forward=False``),
  and which refuses forward mode (:class:`reverse_only`): for a function whose backward is
  not jattn's to wrap (the splash kernel's own custom_vjp, jax.nn's cuDNN call). Integer
  arguments get no cotangent."""

  @functools.partial(reverse_only, who=who, rule=KERNEL_RULE)
  def wrapped(*args: Any) -> Any:
    return fn(*args)

  forward = first_order(lambda *args: jax.vjp(fn, *args), who, cause, forward=False)
  backward = first_order(lambda vjp, ct: vjp(ct), who, cause, forward=False)
  wrapped.defvjp(forward, backward)
  return wrapped
