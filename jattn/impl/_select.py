"""Which implementation runs a call: the one selection table, and the rule that reads it.

:data:`TABLE` says, for each implementation, where it runs and what it expresses exactly.
:func:`choose` reads it for a checked call: an explicit ``implementation`` that cannot
express the call raises naming the feature; ``implementation=None`` takes the backend's
fused kernel when it expresses the call (splash on TPU, cuDNN on GPU) and otherwise the
materialised ``"xla"`` path or the tiled ``"blockwise"`` loop by the size of the scores.
:func:`jattn.explain` shows the same decision, with the reason for each implementation
not taken. Arguments arrive checked from :func:`jattn._spec.build`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jattn.impl import blockwise, cudnn, splash, xla

BACKWARDS = ("autodiff", "custom_vjp")
BACKENDS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Call:
  """What the table looks at: the checked spec's settings, and what the caller named."""

  spec: Any  # a jattn._spec.CallSpec, before its implementation is chosen
  dtype: np.dtype
  backend: str
  backward_named: bool  # the caller gave backward=
  blocks_named: bool  # the caller gave block_q= or block_kv=
  sequence_sharded: tuple = ()  # mesh axes sharding T or S (Explicit sharding mode)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One row of the table. ``None`` in a feature column means "expresses it"."""

  runs_on: tuple[str, ...]
  backwards: tuple[str, ...]  # jattn rules it supports, default first; () = its own fused one
  masks: str  # what it expresses, for the docs and explain
  dtypes: tuple[str, ...] | None = None  # None: any floating dtype
  bias: str | None = None  # why not, or None
  score_fn: str | None = None
  soft_cap: str | None = None
  dropout: str | None = None
  residual: str | None = None  # return_residual with a differentiable log-sum-exp
  sinks: str | None = None
  tiles: bool = False  # takes block_q / block_kv
  fused: bool = False  # one kernel per device: needs whole sequences there
  check: Callable[[Call], str | None] | None = None  # masks, head dims, lengths, tiles


def _splash_check(call: Call) -> str | None:
  s = call.spec
  if reason := splash.mask_reason(s.mask):
    return reason
  if s.return_residual and s.score_fn is not None:
    return (
      "return_residual with logits_soft_cap (the log-sum-exp's gradient through the cap "
      "needs the capped logits, which the kernel does not return)"
    )
  if call.blocks_named:
    bq, bkv = splash.resolve_blocks(s.block_q, s.block_kv, s.T, s.S)
    return splash.blocks_reason(bq, bkv)
  return None


TABLE: dict[str, Implementation] = {
  "xla": Implementation(
    runs_on=BACKENDS,
    backwards=xla.BACKWARDS,
    masks="every mask",
  ),
  "blockwise": Implementation(
    runs_on=BACKENDS,
    backwards=blockwise.BACKWARDS,
    masks="every mask (skips the tiles it empties)",
    tiles=True,
  ),
  "splash": Implementation(
    runs_on=("tpu",),
    backwards=splash.BACKWARDS,
    masks=(
      "masks the same for every batch row with known values (causal with any offset, "
      "windows, chunks, arrays, per-head arrays, global tokens, strides, block-sparse "
      "layouts, and their & | ~), segment ids, lengths"
    ),
    dtypes=("float32", "bfloat16"),
    bias="splash adds no bias",
    score_fn="splash has no score function (logits_soft_cap it has)",
    dropout="splash has no dropout",
    tiles=True,
    fused=True,
    check=_splash_check,
  ),
  "cudnn": Implementation(
    runs_on=("gpu",),
    backwards=cudnn.BACKWARDS,
    masks=(
      "jax.nn's: a boolean array, causal (offset 0), a left window, lengths; auto routes "
      "only bfloat16 calls with no mask, or causal/left windows with T == S (no empty rows)"
    ),
    dtypes=("bfloat16", "float16"),
    score_fn="cuDNN has no score function",
    soft_cap="cuDNN has no soft cap",
    dropout="jax.nn's cuDNN call has no dropout",
    sinks="jax.nn's cuDNN call has no sinks",
    fused=True,
    check=lambda call: cudnn.reason(call.spec),
  ),
}

IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {name: row.backwards for name, row in TABLE.items()}

# implementation=None, per backend: the fused kernel to try first, if any.
FUSED = {"cpu": None, "gpu": "cudnn", "tpu": "splash"}

# Without a fused kernel, implementation=None picks "blockwise" once the materialised
# (B, N, T, S) float32 scores would reach this many bytes, and "xla" below it. CPU: the
# crossover measured with experiments/bench.py; accelerators: the materialised path is fast
# there until memory runs short.
AUTO_BLOCKWISE_BYTES = {"cpu": 8 * 2**20, "gpu": 2**30, "tpu": 2**30}

_WHY_NOT = {
  ("blockwise", "autodiff"): " (JAX cannot reverse-differentiate its tile loops, whose trip "
  "counts depend on the mask, and autodiff would store every "
  "tile's probabilities, O(T·S) memory)",
}


@dataclasses.dataclass(frozen=True)
class Choice:
  """What a call runs (see :func:`jattn.explain`)."""

  implementation: str
  backward: str | None  # the jattn rule; None for a fused kernel's own backward
  reason: str
  rejected: dict[str, str]  # every other implementation -> why not
  backend: str = ""
  # Where the program is lowered for another platform: that platform -> what runs there.
  elsewhere: dict[str, str] = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    rule = self.backward or "its own fused backward"
    lines = [f"{self.implementation} ({rule}) on {self.backend.upper()}: {self.reason}"]
    lines += [f"  not {name}: {why}" for name, why in self.rejected.items()]
    lines += [f"  lowered for {p}: {what}" for p, what in self.elsewhere.items()]
    return "\n".join(lines)


def check_choices(implementation, backward) -> tuple[str | None, str | None]:
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
      f"{_WHY_NOT.get((implementation, backward), '')}"
    )
  return implementation, backward


def why_not(name: str, call: Call, *, interpret: bool = False, device: bool = True) -> str | None:
  """Why implementation ``name`` cannot run ``call`` exactly; None when it can. ``device``:
  also whether it runs on ``call.backend`` (see :func:`runs_on`)."""
  row, s = TABLE[name], call.spec
  if call.backward_named and not row.backwards:
    return f"backward= names a jattn rule, and {name} has its own fused backward"
  if call.blocks_named and not row.tiles:
    return f"block_q and block_kv apply to tiled implementations, and {name} has none"
  features = (
    (row.bias, s.bias is not None, "bias"),
    (row.score_fn, _has_score_fn(s.score_fn), "score_fn"),
    (row.soft_cap, s.score_fn is not None, "logits_soft_cap"),
    (row.dropout, s.dropout_rate > 0, "dropout_rate > 0"),
    (row.residual, s.return_residual, "return_residual"),
    (row.sinks, s.sinks is not None, "sinks"),
  )
  for reason, used, feature in features:
    if reason is not None and used:
      return f"{feature}: {reason}"
  if row.fused and call.sequence_sharded:
    return (
      f"the sequence axis is sharded over mesh axes {call.sequence_sharded} (a fused kernel "
      "needs each device's sequences whole: shard the batch and heads, or use "
      "jattn.parallel.ring_attention)"
    )
  if row.check is not None and (reason := row.check(call)):
    return reason
  if row.dtypes is not None and call.dtype.name not in row.dtypes:
    return f"dtype {call.dtype.name} (it takes {', '.join(row.dtypes)})"
  if device and not runs_on(name, call.backend, interpret=interpret):
    where = " or ".join(row.runs_on)
    return f"it runs on {where.upper()}, and the backend is {call.backend!r}"
  return None


def runs_on(name: str, backend: str, *, interpret: bool = False) -> bool:
  """Whether implementation ``name`` runs on ``backend`` (splash anywhere when interpreted)."""
  return backend in TABLE[name].runs_on or (name == "splash" and interpret)


def _has_score_fn(fn) -> bool:
  """A score function other than exactly ``logits_soft_cap``."""
  return fn is not None and fn.rule.name != "soft_cap"


def choose(
  call: Call,
  implementation: str | None,
  backward: str | None,
  *,
  interpret=False,
  detail=False,
  fused=True,
) -> Choice:
  """The :class:`Choice` for a checked call; raises when an explicit implementation cannot
  express it (naming the feature). ``detail``: fill in ``rejected`` (for explain).
  ``fused=False``: leave the backend's fused kernel out (the portable choice)."""

  def _rejected(chosen: str) -> dict[str, str]:
    return _reasons(call, chosen) if detail else {}

  if implementation is not None:
    reason = why_not(implementation, call, device=False)
    if reason is not None:
      raise ValueError(f"implementation={implementation!r} does not support {reason}")
    if not runs_on(implementation, call.backend, interpret=interpret):
      raise ValueError(_no_device(implementation, call.backend))
    rejected = _rejected(implementation)
    return Choice(implementation, backward, "named by the caller", rejected, call.backend)
  fused = FUSED.get(call.backend) if fused else None
  if fused is not None and (reason := why_not(fused, call)) is None:
    if not (fused == "cudnn" and (why := cudnn.auto_reason(call.spec, call.dtype))):
      return Choice(
        fused,
        None,
        f"{fused} is the fused kernel for {call.backend.upper()} and expresses the call",
        _rejected(fused),
        call.backend,
      )
    reason = why
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
  if fused is not None:
    why = f"{why}; {fused} does not: {reason}"
  rule = check_choices(impl, backward)[1]
  return Choice(impl, rule, why, _rejected(impl), call.backend)


# The platform names of jax.lax.platform_dependent and of lowering, per backend.
PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def routes(call: Call, backward: str | None, *, traceable_gpu: bool) -> dict[str, Choice]:
  """``implementation=None``'s fused kernels per lowering platform, beside the portable
  choice (``choose(..., fused=False)``) that every other platform runs.

  A program follows the platform it is lowered for: splash where it is lowered for a TPU,
  cuDNN where it is lowered for CUDA; ``traceable_gpu``: whether cuDNN can be traced here
  (it needs cuDNN on the tracing host, so a CPU host's programs take the portable choice on
  GPUs).
  """
  out = {}
  for backend, fused in FUSED.items():
    if fused is None or (backend == "gpu" and not traceable_gpu):
      continue
    choice = choose(dataclasses.replace(call, backend=backend), None, backward)
    if choice.implementation == fused:
      out[PLATFORMS[backend][0]] = choice
  return out


def _reasons(call: Call, chosen: str) -> dict[str, str]:
  out = {}
  for name in TABLE:
    if name != chosen:
      reason = why_not(name, call)
      out[name] = reason if reason else f"expresses the call; {chosen} is preferred here"
  return out


def _mib(n: int) -> str:
  mib = n / 2**20
  return f"{mib:,.0f} MiB" if mib >= 10 else f"{mib:.3g} MiB"


def _no_device(name: str, backend: str) -> str:
  if name == "cudnn":
    return f"implementation='cudnn' needs an NVIDIA GPU; the default backend is {backend!r}"
  return (
    f"implementation={name!r} needs a TPU; the default backend is {backend!r} "
    "(jattn.testing.interpret_kernels() runs it in Pallas interpret mode, for tests)"
  )


def default_backend() -> str:
  return jax.default_backend()
