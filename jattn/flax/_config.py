"""The Flax modules' constructor settings, checked: head layout, q/k norm, dropout, routing.

:mod:`jattn.nnx` and :mod:`jattn.linen` raise these at construction (Linen: at the first
call for what depends on the input width). Shape legend as in :mod:`jattn.attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jattn import _checks, positional
from jattn._validate.keywords import Routing, names, options_of
from jattn._validate.options import Options

NORMALIZE_QK = (False, True, "rms", "layernorm")


@dataclasses.dataclass(frozen=True)
class Heads:
  """Checked head layout of a multi-head attention module."""

  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  qkv_features: int  # N·H
  out_features: int
  value_head_dim: int = 0  # Hv (set to H when not given)

  def __post_init__(self) -> None:
    if not self.value_head_dim:
      object.__setattr__(self, "value_head_dim", self.head_dim)


@dataclasses.dataclass(frozen=True)
class Settings:
  """A module's settings of the attention step (checked by :meth:`Config.check`), read
  from its attributes by :meth:`of`."""

  rope: positional.Rotary | None
  dropout_rate: float
  broadcast_dropout: bool
  options: Options
  attention_fn: Callable | None  # Flax's contract, in place of jattn's attention

  @classmethod
  def of(cls, module: Any) -> Settings:  # a jattn.nnx or jattn.linen MultiHeadAttention
    """``module``'s: its ``options``, else an Options of its ``implementation``,
    ``backward``, ``block_q`` and ``block_kv`` (unset when options is)."""
    options = module.options
    if options is None:
      options = options_of({name: getattr(module, name) for name in names(Routing)})
    return cls(
      module.rope, module.dropout_rate, module.broadcast_dropout, options, module.attention_fn
    )


@dataclasses.dataclass(frozen=True)
class Config:
  """The constructor settings both modules have under these names (Linen as fields), as
  given; :meth:`check` checks them. ``in_features`` None: not known yet (Linen infers it
  from the first input)."""

  num_heads: int
  in_features: int | None
  num_kv_heads: int | None
  qkv_features: int | None
  out_features: int | None
  dropout_rate: float
  broadcast_dropout: bool
  deterministic: bool | None
  is_causal: bool
  rope: positional.Rotary | None
  normalize_qk: bool | str
  implementation: str | None
  backward: str | None
  block_q: int | None
  block_kv: int | None
  options: Options | None = None
  value_head_dim: int | None = None
  decode: bool | None = None
  attention_fn: Callable | None = None
  sinks: bool = False
  sow_max_logit: bool = False
  in_kv_features: int | None = None

  @classmethod
  def of(cls, module: Any, in_features: int | None) -> Config:
    """A module's (its attributes of these names; ``in_kv_features`` as the keys'
    width is inferred, None)."""
    taken = {f.name for f in dataclasses.fields(cls)} - {"in_features", "in_kv_features"}
    return cls(in_features=in_features, **{name: getattr(module, name) for name in taken})

  def check(self) -> Heads | None:
    """Every setting checked; raises with a clear message. Returns the head layout, or
    None when neither ``in_features`` nor ``qkv_features`` is known yet (Linen, before
    the first call)."""
    num_heads = _checks.integer("num_heads", self.num_heads, minimum=1)
    in_features = self.in_features
    if in_features is not None:
      in_features = _checks.integer("in_features", in_features, minimum=1)
    if self.in_kv_features is not None:
      _checks.integer("in_kv_features", self.in_kv_features, minimum=1)
    num_kv_heads = self.num_kv_heads
    if num_kv_heads is None:
      num_kv_heads = num_heads
    num_kv_heads = _checks.integer("num_kv_heads", num_kv_heads, minimum=1)
    if num_heads % num_kv_heads:
      raise ValueError(
        f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
      )
    self._check_settings()
    value_head_dim = self.value_head_dim
    if value_head_dim is not None:
      value_head_dim = _checks.integer("value_head_dim", value_head_dim, minimum=1)
    out_features = self.out_features
    if out_features is None:
      out_features = in_features
    else:
      out_features = _checks.integer("out_features", out_features, minimum=1)
    if self.qkv_features is None and in_features is None:
      return None  # Linen infers the widths from the first input
    qkv_features = _checks.integer(
      "qkv_features", in_features if self.qkv_features is None else self.qkv_features, minimum=1
    )
    if qkv_features % num_heads:
      raise ValueError(
        f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})"
      )
    head_dim = qkv_features // num_heads
    if self.rope is not None:
      try:
        self.rope.check_head_dim(head_dim)
      except ValueError as e:
        raise ValueError(f"rope: {e} (head_dim = qkv_features // num_heads = {head_dim})") from None
    # out_features is None only without in_features (Linen's check before the first call,
    # which discards these heads).
    width = out_features or 0
    return Heads(num_heads, num_kv_heads, head_dim, qkv_features, width, value_head_dim or 0)

  def _check_settings(self) -> None:
    """Dropout, the flags, rope, the q/k norm, the routing and ``attention_fn``."""
    _checks.dropout_rate(self.dropout_rate)
    _checks.flags(broadcast_dropout=self.broadcast_dropout, is_causal=self.is_causal)
    for name, flag in (("deterministic", self.deterministic), ("decode", self.decode)):
      if flag is not None and not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool or None, got {flag!r}")
    rope = self.rope
    if rope is not None and not isinstance(rope, positional.Rotary):
      raise TypeError(f"rope must be a jattn.positional.Rotary or None, got {type(rope).__name__}")
    normalize_qk = self.normalize_qk
    if not any(
      normalize_qk is v or (isinstance(v, str) and normalize_qk == v) for v in NORMALIZE_QK
    ):
      raise ValueError(f"normalize_qk must be one of {list(NORMALIZE_QK)}, got {normalize_qk!r}")
    options = options_of({name: getattr(self, name) for name in names(Routing)})
    _checks.boolean("sinks", self.sinks)
    _checks.boolean("sow_max_logit", self.sow_max_logit)
    check_attention_fn(
      self.attention_fn,
      **dataclasses.asdict(options),
      sinks=self.sinks,
      sow_max_logit=self.sow_max_logit,
    )


def qk_norm_kind(normalize_qk: bool | str) -> str | None:
  """None, "rms" or "layernorm" for a checked ``normalize_qk``; True is Flax's LayerNorm."""
  if normalize_qk is False:
    return None
  return "layernorm" if normalize_qk is True else normalize_qk


# Settings of jattn's own attention call, which a Flax-style ``attention_fn=`` replaces: the
# routing, the module's learned sinks, and sowing the max logits jattn's call returns.
_JATTN_ATTENTION = (*names(Routing), "sinks", "sow_max_logit")


def check_attention_fn(attention_fn: Callable | None, **jattn_settings: Any) -> None:
  """``attention_fn``: None (jattn's attention) or a function with Flax's ``attention_fn``
  contract, which then computes the attention and so takes none of jattn's routing
  settings (given as ``jattn_settings``, unset when None or False)."""
  if attention_fn is None:
    return
  if not callable(attention_fn):
    raise TypeError(
      f"attention_fn must be None (jattn's attention) or a function, got "
      f"{type(attention_fn).__name__}"
    )
  for name in _JATTN_ATTENTION:
    value = jattn_settings.get(name)
    if value is not None and value is not False:
      raise ValueError(
        f"{name}={value!r} applies to jattn's attention, which attention_fn replaces: bind "
        f"it into the function instead, e.g. functools.partial(jattn.nnx.attention_fn, "
        f"{name}=...)"
      )


def resolve(
  name: str, call_value: bool | None, module_value: bool | None, default: bool = False
) -> bool:
  """A call's bool flag (``decode``, ``is_causal``) over the module's, as Flax resolves them:
  the call's when given, else the module's, else ``default``."""
  value = call_value if call_value is not None else module_value
  if value is None:
    return default
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)
