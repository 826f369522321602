"""The keywords of an attention call, listed once: :class:`Keywords`.

Every front end takes them or builds them from this list: :func:`jattn.dot_product_attention`
(its jax.nn-compatible signature spelled out for ``help()`` and IDEs, checked against this
list by the suite), :func:`jattn.attention_weights`, :func:`jattn.explain`,
:func:`jattn.decode.attention`, :func:`jattn.parallel.context_parallel_attention`, the Flax
adapters and modules. They take ``**keywords: Unpack[...]`` of the groups that apply to
them, and :func:`checked` refuses a name outside those groups as Python refuses an
unexpected keyword argument. :func:`jattn._validate.build` checks the values. Adding a
keyword touches its group here, its check in ``build`` and the implementation rows that
read it.

A keyword left out takes its default: :data:`DEFAULTS`, else None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import jax

from jattn._validate.options import Options

__all__ = [
  "Scoring",
  "Causal",
  "Packing",
  "Masking",
  "Dropout",
  "Outputs",
  "Routing",
  "Positions",
  "Weights",
  "Keywords",
  "Adapted",
  "Varlen",
  "Decoding",
  "DEFAULTS",
  "names",
  "checked",
  "options_of",
]


class Scoring(TypedDict, total=False):
  """How each logit is formed: ``scale · q·k + bias``, then ``score_fn`` and the soft cap;
  ``sinks`` adds one logit per head to each row's softmax."""

  scale: float | None
  score_fn: Callable[..., jax.Array] | None
  logits_soft_cap: float | None
  sinks: jax.typing.ArrayLike | None


class Causal(TypedDict, total=False):
  """Which keys each query may attend to by position: causal, a local window."""

  is_causal: bool
  local_window_size: int | tuple[int, int] | None


class Packing(TypedDict, total=False):
  """Which keys each query may attend to by sequence: lengths (padding), documents."""

  query_seq_lengths: jax.typing.ArrayLike | None
  key_value_seq_lengths: jax.typing.ArrayLike | None
  segment_ids: Any  # an int array, or a (query ids, key/value ids) pair


class Masking(Causal, Packing, total=False):
  """Which keys each query may attend to, besides ``mask``."""


class Dropout(TypedDict, total=False):
  """Dropout on the attention weights."""

  dropout_rate: float
  dropout_rng: jax.Array | None
  broadcast_dropout: bool


class Outputs(TypedDict, total=False):
  """What the call returns besides the output."""

  return_residual: bool
  return_max_logit: bool


class Routing(TypedDict, total=False):
  """How the call runs, never what it computes: :class:`jattn.Options`'s fields, one by one
  or as ``options``."""

  implementation: str | None
  backward: str | None
  block_q: int | None
  block_kv: int | None
  options: Options | None


class Weights(Scoring, Masking, total=False):
  """What shapes the probabilities (:func:`jattn.attention_weights`)."""


class Keywords(Scoring, Masking, Dropout, Outputs, Routing, total=False):
  """Every keyword of :func:`jattn.dot_product_attention`."""


class Adapted(Scoring, Routing, total=False):
  """jattn's settings a Flax ``attention_fn`` adapter takes, bound with
  ``functools.partial``, beside the arguments of Flax's contract (the mask, dropout and
  ``is_causal`` come from Flax's call)."""


class Varlen(Scoring, Causal, Dropout, Outputs, Routing, total=False):
  """What :func:`jattn.varlen_attention` takes: the offsets set the sequences (no lengths,
  no segment ids); causal and windows apply within each sequence."""


class Positions(TypedDict, total=False):
  """Which query positions masks and score functions see over a KV cache."""

  absolute_positions: bool


class Decoding(Scoring, Dropout, Outputs, Routing, Positions, total=False):
  """What :func:`jattn.decode.attention` and :func:`jattn.decode.ragged_attention` take: the
  cache sets the masking (causal over what each row holds)."""


# The defaults that are not None.
DEFAULTS: Keywords = Keywords(
  is_causal=False,
  dropout_rate=0.0,
  broadcast_dropout=False,
  return_residual=False,
  return_max_logit=False,
)


def names(group: type) -> tuple[str, ...]:
  """The keywords of a group (a TypedDict above, its bases' first), in the order listed."""
  return tuple(group.__annotations__)


def checked(who: str, keywords: Mapping[str, Any], group: type) -> dict[str, Any]:
  """``keywords`` as a dict, after refusing any name not in ``group`` as Python refuses an
  unexpected keyword argument of ``who`` (a function's name)."""
  allowed = set(names(group))
  for name in keywords:
    if name not in allowed:
      raise TypeError(f"{who}() got an unexpected keyword argument {name!r}")
  return dict(keywords)


def options_of(keywords: dict[str, Any]) -> Options:
  """The :class:`Routing` keywords taken out of ``keywords`` as one checked
  :class:`jattn.Options` (a field given one by one and in ``options`` raises, naming it)."""
  fields = {f.name: keywords.pop(f.name, None) for f in dataclasses.fields(Options)}
  return Options.of(keywords.pop("options", None), **fields)
