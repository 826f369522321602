"""What each device of a sequence-parallel call runs, recorded while it is traced, for
:func:`jattn.parallel.explain` (the choices are made inside ``shard_map``, per device)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

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


def jit(**jit_kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """``jax.jit(fn, **jit_kwargs)``, but ``fn`` itself inside a :func:`recording` block: a
  compiled program found in jit's cache would skip the tracing that records the choices
  (explain's second call with the same arguments would see none)."""

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled = jax.jit(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
      return (fn if _RECORDED.get() is not None else compiled)(*args, **kwargs)

    return call

  return wrap
