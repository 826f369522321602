"""Which implementation runs a call: the one selection table, and the rule that reads it.

:data:`TABLE` says, for each implementation, where it runs and what it expresses exactly.
:func:`choose` reads it for a checked call: an explicit ``implementation`` that cannot
express the call raises naming the feature; ``implementation=None`` takes the backend's
first fused kernel, in table order, that expresses the call and is not an opt-in, and
otherwise the materialised ``"xla"`` path or the tiled ``"blockwise"`` loop by the size of
the scores. ``docs/implementations.md`` shows the table, generated from it.
:func:`jattn.explain` shows the same decision, with the reason for each implementation
not taken. Arguments arrive checked from :func:`jattn._validate.build`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jattn.impl import blockwise, cudnn, flex, flex_decode, flex_hopper, ragged_paged, splash, xla
from jattn.impl.contract import BACKENDS, BACKWARDS, Call, Implementation

__all__ = ["BACKENDS", "BACKWARDS", "Call", "Implementation", "TABLE", "Choice", "choose"]

# One row per implementation, each declared in its own module (see jattn.impl.contract); the
# order is implementation=None's order of trying the fused kernels on a backend.
TABLE: dict[str, Implementation] = {
  row.name: row
  for row in (
    xla.IMPLEMENTATION,
    blockwise.IMPLEMENTATION,
    splash.IMPLEMENTATION,
    cudnn.IMPLEMENTATION,
    flex.IMPLEMENTATION,
    flex_hopper.IMPLEMENTATION,  # an explicit opt-in until a GPU record (OPT_IN)
    ragged_paged.IMPLEMENTATION,  # decode.ragged_attention's step on TPU; opt-in (no record)
    flex_decode.IMPLEMENTATION,  # decode.ragged_attention's step on GPU; opt-in (no record)
  )
}

IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {name: row.backwards for name, row in TABLE.items()}
TILED = tuple(name for name, row in TABLE.items() if row.tiles)
# What may run a ring's shard pairs besides its own blockwise loops: kernels that tabulate
# their masks per pair (splash), and kernels run per pair through the table (flex).
STATIC_MASKS = tuple(name for name, row in TABLE.items() if row.static_masks)
RING_PAIRS = tuple(name for name, row in TABLE.items() if row.ring_pairs)

# implementation=None, per backend: the fused kernels to try, first to last (table order).
FUSED: dict[str, tuple[str, ...]] = {
  backend: tuple(n for n, row in TABLE.items() if row.fused and backend in row.runs_on)
  for backend in BACKENDS
}

# Without a fused kernel, implementation=None picks "blockwise" once the materialised
# (B, N, T, S) float32 scores would reach this many bytes, and "xla" below it. CPU: the
# crossover measured with experiments/bench.py; accelerators: the materialised path is fast
# there until memory runs short.
AUTO_BLOCKWISE_BYTES = {"cpu": 8 * 2**20, "gpu": 2**30, "tpu": 2**30}


@dataclasses.dataclass(frozen=True)
class Choice:
  """What a call runs (see :func:`jattn.explain`)."""

  implementation: str
  backward: str | None  # the jattn rule; None for a fused kernel's own backward
  reason: str
  rejected: dict[str, str]  # every other implementation -> why not
  backend: str = ""

  def __str__(self) -> str:
    rule = self.backward or "its own fused backward"
    lines = [f"{self.implementation} ({rule}) on {self.backend.upper()}: {self.reason}"]
    lines += [f"  not {name}: {why}" for name, why in self.rejected.items()]
    return "\n".join(lines)


def check_choices(implementation: Any, backward: Any) -> tuple[str | None, str | None]:
  """(implementation, backward) checked as names; (None, backward) while auto is to choose."""
  if implementation is None:
    if backward is not None and backward not in BACKWARDS:
      raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
    return None, backward
  if implementation not in TABLE:
    raise ValueError(
      f"implementation must be one of {sorted(TABLE)} or None, got {implementation!r}"
    )
  supported = TABLE[implementation].backwards
  if backward is None:
    return implementation, (supported[0] if supported else None)
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
  if backward not in supported:
    rules = (
      f"supports only {list(supported)}"
      if supported
      else "has its own fused backward; leave backward=None"
    )
    raise ValueError(
      f"implementation={implementation!r} does not support "
      f"backward={backward!r}: it {rules}"
      f"{TABLE[implementation].backward_note(backward)}"
    )
  return implementation, backward


def default_backward(implementation: str | None, backward: str | None) -> str | None:
  """The rule a checked (implementation, backward) pair runs: the named one, or the
  implementation's default (None while implementation=None is still to choose)."""
  if backward is not None or implementation is None:
    return backward
  supported = TABLE[implementation].backwards
  return supported[0] if supported else None


def why_not(name: str, call: Call, *, interpret: bool = False, device: bool = True) -> str | None:
  """Why implementation ``name`` cannot run ``call`` exactly; None when it can (its row's
  :meth:`~jattn.impl.contract.Implementation.why_not`)."""
  return TABLE[name].why_not(call, interpret=interpret, device=device)


def _nothing_to_tile(name: str, call: Call) -> bool:
  """A tiled implementation given an empty output, no keys or H == 0: xla runs it."""
  s = call.spec
  return TABLE[name].tiles and not (all(s.bnts) and s.H)


def choose(
  call: Call,
  implementation: str | None,
  backward: str | None,
  *,
  interpret: bool = False,
  detail: bool = False,
  fused: bool = True,
) -> Choice:
  """The :class:`Choice` for a checked call; raises when an explicit implementation cannot
  express it (naming the feature). ``detail``: fill in ``rejected`` (for explain).
  ``fused=False``: leave the backend's fused kernel out (the portable choice)."""

  def _rejected(chosen: str) -> dict[str, str]:
    return _reasons(call, chosen) if detail else {}

  if implementation is not None:
    row = TABLE[implementation]
    reason = row.why_not(call, device=False)
    if reason is not None:
      raise ValueError(f"implementation={implementation!r} does not support {reason}")
    if not row.runs_on_backend(call.backend, interpret=interpret):
      raise ValueError(_no_device(implementation, call.backend))
    if _nothing_to_tile(implementation, call):
      return _empty(call, f"{implementation} named by the caller", _rejected)
    rejected = _rejected(implementation)
    return Choice(implementation, backward, "named by the caller", rejected, call.backend)
  refused: list[str] = []  # "<fused kernel> does not: <why>", in the order tried
  for kernel in FUSED.get(call.backend, ()) if fused else ():
    reason = why_not(kernel, call)
    auto_check = TABLE[kernel].auto_check
    if reason is None and auto_check is not None:
      reason = auto_check(call)
    if reason is None and TABLE[kernel].opt_in is not None:
      reason = TABLE[kernel].opt_in
    if reason is not None:
      refused.append(f"{kernel} does not: {reason}")
      continue
    which = "the next fused kernel" if refused else "the fused kernel"
    why = f"{kernel} is {which} for {call.backend.upper()}"
    if _nothing_to_tile(kernel, call):
      return _empty(call, why, _rejected)
    why = "; ".join([f"{why} and expresses the call", *refused])
    return Choice(kernel, None, why, _rejected(kernel), call.backend)
  if call.blocks_named:
    impl, why = "blockwise", "block_q/block_kv ask for tiles"
  elif backward == "autodiff":
    impl, why = "xla", "backward='autodiff' differentiates the materialised path"
  else:
    s = call.spec
    limit = AUTO_BLOCKWISE_BYTES.get(call.backend, AUTO_BLOCKWISE_BYTES["gpu"])
    size = 4 * s.B * s.N * s.T * s.S
    big = size >= limit
    impl = "blockwise" if big else "xla"
    why = (
      f"the float32 scores would take {_mib(size)}, "
      f"{'at least' if big else 'under'} {_mib(limit)} on {call.backend.upper()}"
    )
  why = "; ".join([why, *refused])
  if _nothing_to_tile(impl, call):
    return _empty(call, why, _rejected)
  rule = check_choices(impl, backward)[1]
  return Choice(impl, rule, why, _rejected(impl), call.backend)


def _empty(call: Call, why: str, rejected: Callable[[str], dict[str, str]]) -> Choice:
  """The choice for a call with nothing to tile (an empty output, no keys, or H == 0): the
  materialised path, differentiated by autodiff, gives its zeros and empty gradients."""
  why = f"{why}, but there is nothing to tile (B, N, T, S or H is 0)"
  return Choice("xla", "autodiff", why, rejected("xla"), call.backend)


# The implementations that read a KV cache tile by tile, in table order.
CACHE_READERS = tuple(name for name, row in TABLE.items() if row.read_cache is not None)


def cache_reader(implementation: str | None, backward: str | None, what: str) -> Implementation:
  """The row that reads a ``what`` cache (e.g. "paged") tile by tile for this implementation
  and backward rule: the named one, or the table's first reader for None; raises naming the
  readers when the named implementation or rule reads none."""
  names = " or ".join(CACHE_READERS)
  readers = " or ".join(repr(n) for n in CACHE_READERS)
  if implementation is not None and implementation not in CACHE_READERS:
    raise ValueError(
      f"implementation={implementation!r} cannot read a {what} cache: attention over one "
      f"runs {names}, reading it tile by tile (implementation=None or {readers})"
    )
  row = TABLE[implementation or CACHE_READERS[0]]
  if backward is not None and backward not in row.backwards:
    rules = " or ".join(repr(b) for b in row.backwards)
    raise ValueError(
      f"backward={backward!r} cannot read a {what} cache: attention over one runs "
      f"{row.name}, reading it tile by tile, and has no {backward} rule "
      f"(backward=None or {rules})"
    )
  return row


def reads_cache(implementation: str | None, backward: str | None) -> bool:
  """Whether a call with these settings reads a KV cache tile by tile (rather than taking
  its keys and values whole, materialised)."""
  row = TABLE[implementation or CACHE_READERS[0]]
  return row.read_cache is not None and (backward is None or backward in row.backwards)


def _reasons(call: Call, chosen: str) -> dict[str, str]:
  out = {}
  for name in TABLE:
    if name != chosen:
      reason = why_not(name, call)
      if reason is None and TABLE[name].opt_in is not None:
        reason = f"expresses the call, but {TABLE[name].opt_in}"
      out[name] = reason if reason else f"expresses the call; {chosen} is preferred here"
  return out


def _mib(n: int) -> str:
  mib = n / 2**20
  return f"{mib:,.0f} MiB" if mib >= 10 else f"{mib:.3g} MiB"


_DEVICES = {"gpu": "an NVIDIA GPU", "tpu": "a TPU", "cpu": "a CPU"}


def _no_device(name: str, backend: str) -> str:
  row = TABLE[name]
  device = " or ".join(_DEVICES[b] for b in row.runs_on)
  hint = ""
  if row.interpretable:
    hint = " (jattn.testing.interpret_kernels() runs it in Pallas interpret mode, for tests)"
  return f"implementation={name!r} needs {device}; the default backend is {backend!r}{hint}"


def default_backend() -> str:
  return jax.default_backend()


def check_backend(backend: Any) -> None:
  """An explain's ``backend``: one of BACKENDS, or None (JAX's default)."""
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend must be one of {list(BACKENDS)} or None, got {backend!r}")
