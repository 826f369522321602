"""How a call runs, as one value: :class:`Options`.

``implementation``, ``backward``, ``block_q`` and ``block_kv`` say how attention is
computed, never what it computes. Every front end (:func:`jattn.dot_product_attention`,
:func:`jattn.explain`, :func:`jattn.decode.attention`,
:func:`jattn.parallel.ring_attention`, the Flax modules) takes them as keywords, for the
drop-in call, or as one ``options=Options(...)``, which it passes down whole. An Options
is frozen and hashable, so it can sit in a module's configuration or a jit's static
arguments, and it is checked when it is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jattn import _checks
from jattn.impl import select

__all__ = ["Options"]


@dataclasses.dataclass(frozen=True)
class Options:
  """How attention runs; every field None takes the default.

  Args:
    implementation: a name of the selection table (:data:`jattn.attention.IMPLEMENTATIONS`;
      docs/implementations.md lists them) or None (the table chooses; see
      :func:`jattn.explain`).
    backward: ``"autodiff"``, ``"custom_vjp"`` or None (the implementation's default).
    block_q, block_kv: tile sizes of the tiled implementations, each by its own rule
      (blockwise takes any); sizes the named implementation cannot take raise ValueError
      here, naming them.

  Example::

    >>> import jax.numpy as jnp, jattn
    >>> fast = jattn.Options(implementation="blockwise", block_q=64, block_kv=64)
    >>> q = jnp.ones((1, 128, 2, 16))
    >>> jattn.dot_product_attention(q, q, q, is_causal=True, options=fast).shape
    (1, 128, 2, 16)
  """

  implementation: str | None = None
  backward: str | None = None
  block_q: int | None = None
  block_kv: int | None = None

  def __post_init__(self) -> None:
    select.check_choices(self.implementation, self.backward)
    tile_sizes(self.implementation, self.block_q, self.block_kv)

  @classmethod
  def of(cls, options: Options | None, **keywords: Any) -> Options:
    """``options``, or one made of ``keywords`` (the same fields given one by one); both
    at once raise, naming the field given twice."""
    if options is None:
      return cls(**keywords)
    if not isinstance(options, Options):
      raise TypeError(f"options must be a jattn.Options or None, got {type(options).__name__}")
    given = [name for name, value in keywords.items() if value is not None]
    if given:
      raise ValueError(
        f"{given[0]} given both as a keyword and in options={options!r}: pass it in one place"
      )
    return options


def tile_sizes(
  implementation: str | None, block_q: Any, block_kv: Any
) -> tuple[int | None, int | None]:
  """Tile sizes checked: positive integers, which the named implementation's row takes (its
  own tile rule; with implementation=None the table excludes the untiled ones, see
  :func:`jattn.impl.select.choose`)."""
  blocks = (
    None if block_q is None else _checks.integer("block_q", block_q, minimum=1),
    None if block_kv is None else _checks.integer("block_kv", block_kv, minimum=1),
  )
  if implementation is None or blocks == (None, None):
    return blocks
  row = select.TABLE[implementation]
  if not row.tiles:
    tiled = select.TILED
    names = ", ".join(repr(n) for n in tiled[:-1]) + f" or {tiled[-1]!r}"
    raise ValueError(
      f"block_q and block_kv apply only to implementation={names}, got "
      f"implementation={implementation!r}"
    )
  reason = row.tiles_reason(*blocks)
  if reason is not None:
    raise ValueError(f"implementation={implementation!r} does not support {reason}")
  return blocks
