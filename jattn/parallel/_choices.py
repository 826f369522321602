"""What each device of a sequence-parallel call runs, recorded while it is traced, for
:func:`jattn.parallel.explain` (the choices are made inside ``shard_map``, per device)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from jattn.impl._select import Choice

_RECORDED: contextvars.ContextVar[list[Choice] | None] = contextvars.ContextVar(
  "jattn_parallel_choices", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Choice]]:
  """Collect the choices :func:`record` is given inside the block."""
  choices: list[Choice] = []
  token = _RECORDED.set(choices)
  try:
    yield choices
  finally:
    _RECORDED.reset(token)


def record(choice: Choice) -> None:
  """Keep ``choice`` if a :func:`recording` block is open."""
  if (choices := _RECORDED.get()) is not None:
    choices.append(choice)
