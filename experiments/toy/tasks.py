"""Toy sequence tasks for the small training experiment, generated on the fly.

Every task is a fixed-length token sequence whose last tokens (the *answer*)
are a function of the tokens before them. A :class:`Task` holds the static
settings; :meth:`Task.batch` draws a :class:`Batch` with NumPy, deterministic
in ``(seed, split, index)``. Content symbols are ``0 .. num_symbols - 1``;
two more tokens follow them in the vocabulary: ``SEP = num_symbols`` (ends
the question) and ``MARK = num_symbols + 1`` (long_range's marker). With
``x`` a row of ``length`` uniform random symbols:

* ``"copy"`` — ``[x, SEP, x]``; the answer is the second ``x``.
* ``"reverse"`` — ``[x, SEP, reversed(x)]``.
* ``"sort"`` — ``[x, SEP, sorted(x)]`` (ascending).
* ``"associative_recall"`` — ``length`` = P key–value pairs:
  ``[k1, v1, ..., kP, vP, SEP, kq, vq]``; the answer is the value ``vq``
  paired with the queried key ``kq``. Keys and values come from separate
  halves of the symbols, as in the classic formulation (letters as keys,
  digits as values): the P keys are distinct symbols below
  ``num_symbols // 2``, the values any symbols from ``num_symbols // 2`` up,
  so a value never looks like a key.
* ``"long_range"`` — ``length`` = L body symbols with one MARK at a position
  ``p < L // 4`` followed by a "needle" symbol: ``[body, SEP, needle]``; the
  answer, the needle, lies at least ``3L/4`` tokens before the SEP.

Scoring: a row counts as solved when every answer token is the argmax of
the model's prediction given the *true* prefix (teacher forcing). This
exact-match accuracy equals that of greedy decoding from the question: a
greedy decode that gets every answer token right feeds itself exactly the
true prefix at every step, so it makes the same predictions as teacher
forcing; and at the first answer token where teacher forcing is wrong,
greedy decoding (which has seen the true prefix up to there) is wrong too.

Example::

    >>> from experiments.toy import tasks
    >>> task = tasks.make("copy", length=4, num_symbols=8)
    >>> b = task.batch(2, seed=0, index=0)
    >>> b.tokens.shape, b.answer.sum(axis=1).tolist()
    ((2, 9), [4, 4])
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

TASKS = ("copy", "reverse", "sort", "associative_recall", "long_range")
"""The task names :class:`Task` accepts."""

SPLITS = {"train": 0, "eval": 1}
"""Data streams and the word each mixes into the random seed; "eval" is held out."""

_MIN_LENGTH = {"copy": 1, "reverse": 1, "sort": 1, "associative_recall": 1, "long_range": 8}
_MIN_SYMBOLS = 2


def _integer(name: str, value: Any, *, minimum: int) -> int:
  """``value`` as a Python int >= ``minimum``; bools are rejected."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
  value = int(value)
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return value


class Batch(NamedTuple):
  """One batch of whole sequences.

  Attributes:
    tokens: (B, seq_len) int32, every token in ``[0, vocab_size)``.
    answer: (B, seq_len) bool, True at the answer tokens: those the model
      must predict from the tokens before them (the last
      :attr:`Task.num_answer_tokens` positions of every row).
  """

  tokens: np.ndarray | jax.Array
  answer: np.ndarray | jax.Array


@dataclasses.dataclass(frozen=True)
class Task:
  """A toy task's static settings; :meth:`batch` draws its data.

  Attributes:
    name: one of :data:`TASKS`.
    length: the size of the question: the number of symbols to copy, reverse
      or sort (>= 1), of key–value pairs for associative_recall (>= 1, and
      at most ``num_symbols // 2``: the keys are distinct symbols from the
      lower half), of body tokens for
      long_range (>= 8).
    num_symbols: content symbols are ``0 .. num_symbols - 1``; >= 2.
  """

  name: str
  length: int
  num_symbols: int

  def __post_init__(self):
    if not isinstance(self.name, str):
      raise TypeError(f"name must be a str, one of {list(TASKS)}, got {self.name!r}")
    if self.name not in TASKS:
      raise ValueError(f"name must be one of {list(TASKS)}, got {self.name!r}")
    length = _integer("length", self.length, minimum=1)
    num_symbols = _integer("num_symbols", self.num_symbols, minimum=1)
    if length < _MIN_LENGTH[self.name]:
      raise ValueError(
        f"length must be >= {_MIN_LENGTH[self.name]} for task {self.name!r}, got {length}"
      )
    if num_symbols < _MIN_SYMBOLS:
      raise ValueError(f"num_symbols must be >= {_MIN_SYMBOLS}, got {num_symbols}")
    if self.name == "associative_recall" and num_symbols < 2 * length:
      raise ValueError(
        f"num_symbols ({num_symbols}) must be >= 2 * length ({2 * length}) "
        f"for associative_recall: the {length} keys are distinct symbols "
        f"from the lower half"
      )
    object.__setattr__(self, "length", length)  # normalised to Python ints: hashable
    object.__setattr__(self, "num_symbols", num_symbols)

  @property
  def sep(self) -> int:
    """The separator token that ends the question, ``num_symbols``."""
    return self.num_symbols

  @property
  def mark(self) -> int:
    """long_range's marker token, ``num_symbols + 1`` (in every task's vocabulary)."""
    return self.num_symbols + 1

  @property
  def vocab_size(self) -> int:
    """``num_symbols + 2``: the symbols, SEP and MARK, whatever the task."""
    return self.num_symbols + 2

  @property
  def seq_len(self) -> int:
    """The length of every sequence of this task."""
    if self.name == "associative_recall":
      return 2 * self.length + 3
    if self.name == "long_range":
      return self.length + 2
    return 2 * self.length + 1

  @property
  def num_answer_tokens(self) -> int:
    """How many tokens end each row as its answer: ``length`` for copy, reverse, sort, else 1."""
    return self.length if self.name in ("copy", "reverse", "sort") else 1

  def batch(self, batch_size: int, *, seed: int, index: int, split: str = "train") -> Batch:
    """Draws batch number ``index`` of the ``split`` stream of ``seed``.

    The generator is ``np.random.default_rng([seed, SPLITS[split], index])``,
    so each ``(seed, split, index)`` gives one fixed batch, drawn without
    drawing batches ``0 .. index - 1``, and train and eval are disjoint
    streams. (Rows depend on ``batch_size``: a batch of 8 is not the first
    8 rows of a batch of 16.)

    Args:
      batch_size: rows B, >= 1.
      seed: the experiment's seed, >= 0.
      index: which batch of the stream, >= 0.
      split: a key of :data:`SPLITS`.

    Returns:
      A :class:`Batch` of (B, :attr:`seq_len`) arrays.
    """
    batch_size = _integer("batch_size", batch_size, minimum=1)
    seed = _integer("seed", seed, minimum=0)
    index = _integer("index", index, minimum=0)
    if not isinstance(split, str) or split not in SPLITS:
      raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    rng = np.random.default_rng([seed, SPLITS[split], index])
    tokens = _GENERATORS[self.name](self, rng, batch_size).astype(np.int32, copy=False)
    answer = np.zeros(tokens.shape, bool)
    answer[:, -self.num_answer_tokens :] = True
    return Batch(tokens, answer)

  def token_names(self, tokens: Sequence[int] | np.ndarray) -> list[str]:
    """Readable labels of a 1-D token sequence: symbols as ``str(int)``, SEP ``"|"``, MARK ``"*"``.

    Args:
      tokens: a 1-D sequence of tokens in ``[0, vocab_size)``.

    Returns:
      One label per token.
    """
    array = np.asarray(tokens)
    if array.ndim != 1:
      raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise TypeError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
      raise ValueError(
        f"tokens must lie in [0, {self.vocab_size}), got values from {array.min()} to {array.max()}"
      )
    special = {self.sep: "|", self.mark: "*"}
    return [special.get(t, str(t)) for t in array.tolist()]


def make(name: str, *, length: int, num_symbols: int) -> Task:
  """The :class:`Task` ``name`` with these settings (validated as there)."""
  return Task(name=name, length=length, num_symbols=num_symbols)


# --------------------------------------------------------------------------- generators
# Each returns (B, seq_len) integer tokens; arguments are already validated.


def _with_sep(task: Task, question: np.ndarray, answer: np.ndarray) -> np.ndarray:
  sep = np.full((question.shape[0], 1), task.sep, question.dtype)
  return np.concatenate([question, sep, answer], axis=1)


def _symbols(task: Task, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  return rng.integers(0, task.num_symbols, shape, dtype=np.int32)


def _copy(task: Task, rng: np.random.Generator, batch_size: int) -> np.ndarray:
  x = _symbols(task, rng, (batch_size, task.length))
  return _with_sep(task, x, x)


def _reverse(task: Task, rng: np.random.Generator, batch_size: int) -> np.ndarray:
  x = _symbols(task, rng, (batch_size, task.length))
  return _with_sep(task, x, x[:, ::-1])


def _sort(task: Task, rng: np.random.Generator, batch_size: int) -> np.ndarray:
  x = _symbols(task, rng, (batch_size, task.length))
  return _with_sep(task, x, np.sort(x, axis=1))


def _associative_recall(task: Task, rng: np.random.Generator, batch_size: int) -> np.ndarray:
  pairs, half = task.length, task.num_symbols // 2
  everything = np.broadcast_to(np.arange(half, dtype=np.int32), (batch_size, half))
  keys = rng.permuted(everything, axis=1)[:, :pairs]  # a random ordered subset per row
  values = rng.integers(half, task.num_symbols, (batch_size, pairs), dtype=np.int32)
  q = rng.integers(0, pairs, batch_size)
  rows = np.arange(batch_size)
  context = np.stack([keys, values], axis=2).reshape(batch_size, 2 * pairs)
  query = np.stack([keys[rows, q], values[rows, q]], axis=1)
  return _with_sep(task, context, query)


def _long_range(task: Task, rng: np.random.Generator, batch_size: int) -> np.ndarray:
  body = _symbols(task, rng, (batch_size, task.length))
  p = rng.integers(0, task.length // 4, batch_size)
  needle = _symbols(task, rng, (batch_size,))
  rows = np.arange(batch_size)
  body[rows, p] = task.mark
  body[rows, p + 1] = needle
  return _with_sep(task, body, needle[:, None])


_GENERATORS = {
  "copy": _copy,
  "reverse": _reverse,
  "sort": _sort,
  "associative_recall": _associative_recall,
  "long_range": _long_range,
}
