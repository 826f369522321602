"""The call contract: :class:`CallSpec` (one validated call), :class:`Call` (what the table
looks at) and :class:`Implementation` (one row of the selection table, declared in its own
module). This module imports only masks, scores and ``_compat`` (a leaf: JAX's spellings):
everything else builds on it.

Each implementation module (``xla``, ``blockwise``, ``splash``, ``cudnn``) ends with
``IMPLEMENTATION = Implementation(...)``: where it runs, which backward rules it has, the
features it cannot express (a reason each), and three answers:

* :meth:`Implementation.why_not` ``(call)``: every reason it cannot run a checked
  :class:`Call` exactly, the backend included, or None;
* :meth:`Implementation.prepare` ``(spec, blocks, backend)``: the spec completed for it on
  that backend (tile sizes, splash's mask split);
* :meth:`Implementation.run` ``(q, k, v, spec)``: ``(out, lse, max_logit)`` on rank-4
  inputs, ``max_logit`` None unless ``spec.return_max_logit`` asks for it.

:mod:`jattn.impl.select` collects the rows into the table and owns every choice and
fallback; adding an implementation is one module plus one entry there (docs/layout.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jattn import _compat, masks, scores
from jattn.scores import SoftCap

__all__ = ["BACKWARDS", "BACKENDS", "CallSpec", "Call", "Implementation", "rank4"]

BACKWARDS = ("autodiff", "custom_vjp")  # the jattn rules, by name
BACKENDS = ("cpu", "gpu", "tpu")


# A CallSpec field that is part of its treedef (a setting), not a leaf.
_STATIC = {"static": True}


@_compat.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallSpec:
  """One validated attention call: everything but the query, key and value.

  A pytree: its arrays (the bias, the mask's and score function's arrays, the
  dropout key) are leaves and its settings are static, so a jitted function that
  takes a spec compiles once per set of settings and shapes.
  """

  # The legend's sizes. B is 1 for unbatched inputs; Hv is the value's and the output's head
  # dimension (H unless the value says otherwise).
  B: int = dataclasses.field(metadata=_STATIC)
  T: int = dataclasses.field(metadata=_STATIC)
  S: int = dataclasses.field(metadata=_STATIC)
  N: int = dataclasses.field(metadata=_STATIC)
  K: int = dataclasses.field(metadata=_STATIC)
  H: int = dataclasses.field(metadata=_STATIC)
  Hv: int = dataclasses.field(metadata=_STATIC)
  # The inputs came as (T, N, H): the core adds and drops the batch axis.
  unbatched: bool = dataclasses.field(metadata=_STATIC)
  bias: Any  # None, or a float array broadcastable to (B, N, T, S); rank 4 in the core
  mask: masks.Mask | None  # every way of masking, combined
  score_fn: scores.ScoreFn | None  # score_fn, then the soft cap
  dropout_rng: Any  # a PRNG key when dropout_rate > 0, else None
  scale: float = dataclasses.field(metadata=_STATIC)
  dropout_rate: float = dataclasses.field(metadata=_STATIC)
  broadcast_dropout: bool = dataclasses.field(metadata=_STATIC)
  # A key of jattn.impl.select.TABLE, and one of its backward rules (None: a fused kernel's
  # own); the tiles of the tiled implementations (their defaults unless given).
  implementation: str = dataclasses.field(metadata=_STATIC)
  backward: str | None = dataclasses.field(metadata=_STATIC)
  block_q: int | None = dataclasses.field(metadata=_STATIC)
  block_kv: int | None = dataclasses.field(metadata=_STATIC)
  return_residual: bool = dataclasses.field(metadata=_STATIC)
  # Also return each row's largest logit (run's third result; None when not asked).
  return_max_logit: bool = dataclasses.field(default=False, metadata=_STATIC)
  # Pallas kernels in interpret mode (jattn.testing.interpret_kernels).
  interpret: bool = dataclasses.field(default=False, metadata=_STATIC)
  sinks: Any = None  # None, or per-head sink logits (N,), a floating array
  # splash: the conjuncts it tabulates (the mask keeps the rest).
  static_mask: Any = dataclasses.field(default=None, metadata=_STATIC)
  # xla and blockwise compute in it (common.compute_dtype).
  compute_dtype: Any = dataclasses.field(default=None, metadata=_STATIC)
  # Inside a kernel's per-device call, for kernels whose mask and score function see global
  # indices (sharded.per_shard(global_index=True)): (2,) int32, the global index of the
  # device's first batch row and query head. None everywhere else.
  shard_offsets: Any = None
  # Inside a device's part of a sequence-parallel call (jattn.parallel.context): the global
  # (batch, head, query, key) index of each local one, four int32 (L,) maps or None (the
  # identity), at which dropout is drawn, so the pattern is the one-device call's. Masks and
  # score functions come reindexed already (masks.reindex, scores.reindex). None elsewhere.
  positions: Any = None

  @property
  def bnts(self) -> tuple[int, int, int, int]:
    return (self.B, self.N, self.T, self.S)


@dataclasses.dataclass(frozen=True)
class Call:
  """What the table looks at: the checked spec's settings, and what the caller named."""

  spec: CallSpec  # before its implementation is chosen
  dtype: np.dtype
  backend: str
  backward_named: bool  # the caller gave backward=
  blocks_named: bool  # the caller gave block_q= or block_kv=
  sequence_sharded: tuple = ()  # mesh axes sharding T or S (Explicit sharding mode)
  varying: tuple = ()  # manual mesh axes the inputs vary over (a shard_map checking them)


def _keep(spec: Any, blocks: tuple[int | None, int | None], backend: str) -> Any:
  del blocks, backend
  return spec


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One row of the table. ``None`` in a feature column means "expresses it"."""

  name: str
  runs_on: tuple[str, ...]
  backwards: tuple[str, ...]  # jattn rules it supports, default first; () = its own fused one
  masks: str  # what it expresses, for the docs and explain
  # (q, k, v, spec) -> (out, lse, max_logit) on rank-4 inputs, max_logit None unless
  # spec.return_max_logit: each row's largest logit, -inf where it sees no key.
  run: Callable[..., tuple[Any, Any, Any]]
  prepare: Callable[[Any, tuple[int | None, int | None], str], Any] = _keep
  dtypes: tuple[str, ...] | None = None  # None: any floating dtype
  bias: str | None = None  # why not, or None
  score_fn: str | None = None
  soft_cap: str | None = None
  dropout: str | None = None
  residual: str | None = None  # return_residual with a differentiable log-sum-exp
  max_logit: str | None = None  # return_max_logit: each row's running max
  sinks: str | None = None
  # Dropout drawn at the global positions a sequence-parallel shard maps its indices to
  # (CallSpec.positions): why not, or None.
  positions: str | None = "it draws dropout at its own indices only"
  tiles: bool = False  # takes block_q / block_kv, and needs something to tile
  # Why it cannot take these tile sizes (None where a size is not given: its default), or
  # None; checked when an Options naming it is made. None: it takes any sizes.
  tile_rule: Callable[[int | None, int | None], str | None] | None = None
  fused: bool = False  # one kernel per device: needs whole sequences there
  takes_sinks: bool = False  # its kernel adds the sinks itself
  interpretable: bool = False  # runs anywhere in Pallas interpret mode
  check: Callable[[Call], str | None] | None = None  # masks, head dims, lengths, tiles
  # Why implementation=None does not pick it where it could run the call (None: it does).
  auto_check: Callable[[Call], str | None] | None = None
  # Why implementation=None never picks it: a kernel reached only when named (one verified
  # by lowering and interpreting, not yet run on its hardware). None: not an opt-in.
  opt_in: str | None = None
  # Appended to the error for a backward rule it lacks: why it lacks it.
  backward_notes: tuple[tuple[str, str], ...] = ()
  # A ring's shard pairs (jattn.parallel) may run on it, each pair's call through this row
  # and differentiated by its own rule given the ring's merged log-sum-exp.
  ring_pairs: bool = False
  # It tabulates its masks when its kernel is built (splash): a sequence-parallel call hands
  # it each device's part of the mask at positions known when the call is traced.
  static_masks: bool = False
  # Reads a KV cache tile by tile (paged or quantized storage, no copy): (query, tiles,
  # spec) -> (out, lse, max_logit), the tiles a jattn.impl.kv_tiles.CacheTiles. None: it reads
  # no cache.
  read_cache: Callable[..., tuple[Any, Any, Any]] | None = None
  # Runs jattn.decode.ragged_attention's continuous-batching step only, as one fused kernel
  # (what it runs it over, e.g. "query tiles over a paged pool"), never a call of
  # dot_product_attention: run with step_only(name). None: a row of dot_product_attention.
  ragged_only: str | None = None

  def why_not(self, call: Call, *, interpret: bool = False, device: bool = True) -> str | None:
    """Why it cannot run ``call`` exactly; None when it can. ``device``: also whether it
    runs on ``call.backend`` (see :meth:`runs_on_backend`)."""
    s = call.spec
    if call.backward_named and not self.backwards:
      return f"backward= names a jattn rule, and {self.name} has its own fused backward"
    if call.blocks_named and not self.tiles:
      return f"block_q and block_kv apply to tiled implementations, and {self.name} has none"
    features = (
      (self.bias, s.bias is not None, "bias"),
      (self.score_fn, s.score_fn is not None and not isinstance(s.score_fn, SoftCap), "score_fn"),
      (self.soft_cap, s.score_fn is not None, "logits_soft_cap"),
      (self.dropout, s.dropout_rate > 0, "dropout_rate > 0"),
      (self.residual, s.return_residual, "return_residual"),
      (self.max_logit, s.return_max_logit, "return_max_logit"),
      (self.sinks, s.sinks is not None, "sinks"),
      (
        self.positions,
        s.positions is not None and s.dropout_rate > 0,
        "dropout_rate > 0 on a shard of a sequence-parallel call",
      ),
    )
    for reason, used, feature in features:
      if reason is not None and used:
        return f"{feature}: {reason}"
    if self.fused and call.sequence_sharded:
      return (
        f"the sequence axis is sharded over mesh axes {call.sequence_sharded} (a fused kernel "
        "needs each device's sequences whole: shard the batch and heads, or use "
        "jattn.parallel.ring_attention)"
      )
    if self.interpretable and call.varying:
      return (
        f"the inputs vary over manual mesh axes {call.varying} (inside a jax.shard_map that "
        "checks them; a Pallas kernel's results carry no such types): pass check_vma=False "
        "to jax.shard_map"
      )
    if self.ragged_only is not None:
      return (
        f"it runs decode.ragged_attention's continuous-batching step only ({self.ragged_only}), "
        "not a call of dot_product_attention"
      )
    if self.check is not None and (reason := self.check(call)):
      return reason
    if self.dtypes is not None and call.dtype.name not in self.dtypes:
      return f"dtype {call.dtype.name} (it takes {', '.join(self.dtypes)})"
    if device and not self.runs_on_backend(call.backend, interpret=interpret):
      where = " or ".join(self.runs_on)
      return f"it runs on {where.upper()}, and the backend is {call.backend!r}"
    return None

  def tiles_reason(self, block_q: int | None, block_kv: int | None) -> str | None:
    """Why it cannot take tiles ``block_q`` by ``block_kv`` (None: not given), or None."""
    if (block_q, block_kv) == (None, None):
      return None
    if not self.tiles:
      return f"block_q and block_kv: {self.name} takes no tiles"
    return None if self.tile_rule is None else self.tile_rule(block_q, block_kv)

  def runs_on_backend(self, backend: str, *, interpret: bool = False) -> bool:
    """Whether it runs on ``backend`` (a Pallas kernel anywhere when interpreted)."""
    return backend in self.runs_on or (self.interpretable and interpret)

  def backward_note(self, backward: str) -> str:
    return dict(self.backward_notes).get(backward, "")


def step_only(name: str) -> Callable[..., tuple[Any, Any, Any]]:
  """The ``run`` of a ``ragged_only`` row: it refuses, as :meth:`Implementation.why_not`
  does before it is reached."""

  def refuse(*args: Any) -> tuple[Any, Any, Any]:
    raise ValueError(f"{name} runs jattn.decode.ragged_attention's step only")

  return refuse


def rank4(spec: CallSpec) -> CallSpec:
  """The spec with its bias as a rank-4 array (leading 1s), as the implementations take it."""
  bias = spec.bias
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  return dataclasses.replace(spec, bias=bias)
