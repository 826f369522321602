"""What each device of a sequence-parallel call runs, recorded while it is traced, for
:func:`jattn.parallel.explain` (the choices are made inside ``shard_map``, per device)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from jattn.impl.select import Choice

_RECORDED: contextvars.ContextVar[list[Choice] | None] = contextvars.ContextVar(
  "jattn_parallel_choices", default=None
)


_ONLY_CHOOSING: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jattn_parallel_only_choosing", default=False
)


@contextlib.contextmanager
def recording(*, run: bool = True) -> Iterator[list[Choice]]:
  """Collect the choices :func:`record` is given inside the block; with ``run=False`` the
  parts chosen are not traced (:func:`only_choosing`): explain needs the choice alone, and a
  kernel may be traceable only on its platform (jax.nn's cuDNN call looks for cuDNN)."""
  choices: list[Choice] = []
  token, only = _RECORDED.set(choices), _ONLY_CHOOSING.set(not run)
  try:
    yield choices
  finally:
    _RECORDED.reset(token)
    _ONLY_CHOOSING.reset(only)


def record(choice: Choice) -> None:
  """Keep ``choice`` if a :func:`recording` block is open."""
  if (choices := _RECORDED.get()) is not None:
    choices.append(choice)


def only_choosing() -> bool:
  """True inside ``recording(run=False)``: a part's call stands in zeros for its results."""
  return _ONLY_CHOOSING.get()
