"""Character-level language modelling on text every Python installation ships.

The corpus ``"pydoc_topics"`` is the standard library's ``pydoc_data.topics``: the
documentation's topics (what ``help("if")`` prints), its ``topics`` dict's values joined
in sorted-key order (465,000 characters on Python 3.11, a few more on 3.12). The
:class:`Vocabulary` is the corpus's distinct characters in code-point order; token ``i``
is ``vocab.chars[i]``.

A :class:`CharTask` cuts the text once: the first ``1 - holdout`` of it is the "train"
split, the rest the held-out "eval" split. A batch is ``B`` windows of ``length + 1``
characters, each wholly inside its split, at offsets drawn from
``np.random.default_rng([seed, SPLITS[split], index])`` as the toy tasks draw theirs
(:mod:`experiments.toy.tasks`), so each ``(seed, split, index)`` gives one fixed batch and
no train window shares a character with an eval window. Every character of a window after
the first is a target: the model predicts each next character from those before it.

Example::

    >>> from experiments.toy import corpus
    >>> task = corpus.CharTask("pydoc_topics", length=8)
    >>> b = task.batch(2, seed=0, index=0)
    >>> b.tokens.shape, int(b.answer.sum())
    ((2, 9), 16)
    >>> task.vocab.decode(task.vocab.encode("def f(x):"))
    'def f(x):'
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence

import numpy as np

from experiments.toy.tasks import SPLITS, Batch, _integer

CORPORA = ("pydoc_topics",)
"""The corpus names :class:`CharTask` accepts."""

# Whitespace drawn visibly in token labels (heat-map ticks).
_VISIBLE = {"\n": "↵", " ": "␣", "\t": "⇥"}


def pydoc_topics() -> str:
  """The text of ``pydoc_data.topics``: its topics' texts joined in sorted-key order."""
  from pydoc_data import topics

  return "".join(topics.topics[key] for key in sorted(topics.topics))


_TEXTS = {"pydoc_topics": pydoc_topics}


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Characters ↔ token ids: ``chars`` holds each distinct character once, in code-point order."""

  chars: str

  @classmethod
  def of(cls, text: str) -> Vocabulary:
    """The distinct characters of ``text``, sorted by code point."""
    return cls("".join(sorted(set(text))))

  @property
  def size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """``text`` as int32 token ids (T,); raises ValueError naming a character not in ``chars``."""
    codes = _code_points(text)
    table = _code_points(self.chars)
    ids = np.searchsorted(table, codes).astype(np.int32)
    bad = (ids >= table.size) | (table[np.minimum(ids, table.size - 1)] != codes)
    if bad.any():
      raise ValueError(f"character {text[int(np.argmax(bad))]!r} is not in the vocabulary")
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """The characters of 1-D token ids."""
    return "".join(self.chars[i] for i in np.asarray(ids).tolist())


def _code_points(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-32-le"), np.uint32)


@functools.cache
def load(name: str) -> tuple[str, Vocabulary, np.ndarray]:
  """Corpus ``name``'s text, its vocabulary and the text's token ids (read once per process)."""
  if name not in _TEXTS:
    raise ValueError(f"corpus must be one of {list(CORPORA)}, got {name!r}")
  text = _TEXTS[name]()
  vocab = Vocabulary.of(text)
  ids = vocab.encode(text)
  ids.flags.writeable = False
  return text, vocab, ids


@dataclasses.dataclass(frozen=True)
class CharTask:
  """Next-character prediction on windows of a corpus; :meth:`batch` draws them.

  Attributes:
    name: the corpus, one of :data:`CORPORA`.
    length: the context T: a window holds ``length + 1`` characters, >= 1.
    holdout: the fraction of the text at its end held out as the "eval" split, in (0, 1);
      each split must hold at least one window.
  """

  name: str
  length: int
  holdout: float = 0.1

  def __post_init__(self):
    if not isinstance(self.name, str) or self.name not in CORPORA:
      raise ValueError(f"name must be one of {list(CORPORA)}, got {self.name!r}")
    object.__setattr__(self, "length", _integer("length", self.length, minimum=1))
    if isinstance(self.holdout, bool) or not isinstance(self.holdout, numbers.Real):
      raise TypeError(f"holdout must be a float, got {self.holdout!r}")
    if not 0.0 < self.holdout < 1.0:
      raise ValueError(f"holdout must be in (0, 1), got {self.holdout}")
    for split in SPLITS:
      start, stop = self.bounds(split)
      if stop - start < self.seq_len:
        raise ValueError(
          f"the {split} split holds {stop - start} characters, fewer than one window of "
          f"length + 1 = {self.seq_len}"
        )

  @property
  def text(self) -> str:
    return load(self.name)[0]

  @property
  def vocab(self) -> Vocabulary:
    return load(self.name)[1]

  @property
  def ids(self) -> np.ndarray:
    """The whole text as token ids (read-only)."""
    return load(self.name)[2]

  @property
  def vocab_size(self) -> int:
    return self.vocab.size

  @property
  def seq_len(self) -> int:
    """Characters per window, ``length + 1``."""
    return self.length + 1

  @property
  def num_answer_tokens(self) -> int:
    """Targets per window: every character after the first."""
    return self.length

  def bounds(self, split: str) -> tuple[int, int]:
    """``(start, stop)``: the characters ``text[start:stop]`` of ``split``."""
    cut = round(len(self.ids) * (1.0 - self.holdout))
    return (0, cut) if split == "train" else (cut, len(self.ids))

  def starts(self, batch_size: int, *, seed: int, index: int, split: str = "train") -> np.ndarray:
    """The offsets (B,) of batch ``index``'s windows in the text (arguments as :meth:`batch`)."""
    batch_size = _integer("batch_size", batch_size, minimum=1)
    seed = _integer("seed", seed, minimum=0)
    index = _integer("index", index, minimum=0)
    if not isinstance(split, str) or split not in SPLITS:
      raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    start, stop = self.bounds(split)
    rng = np.random.default_rng([seed, SPLITS[split], index])
    return rng.integers(start, stop - self.seq_len, batch_size, endpoint=True)

  def batch(self, batch_size: int, *, seed: int, index: int, split: str = "train") -> Batch:
    """Batch ``index`` of the ``split`` stream of ``seed``: (B, length + 1) windows, every
    position after the first an answer (a target of the loss)."""
    offsets = self.starts(batch_size, seed=seed, index=index, split=split)
    tokens = self.ids[offsets[:, None] + np.arange(self.seq_len)]
    answer = np.ones(tokens.shape, bool)
    answer[:, 0] = False
    return Batch(tokens, answer)

  def token_names(self, tokens: Sequence[int] | np.ndarray) -> list[str]:
    """The characters of 1-D tokens, whitespace drawn visibly (``↵``, ``␣``, ``⇥``)."""
    return [_VISIBLE.get(c, c) for c in self.vocab.decode(tokens)]

  def facts(self) -> dict:
    """What a run's summary records about the corpus."""
    train, held_out = self.bounds("train"), self.bounds("eval")
    return dict(
      corpus=self.name,
      chars=len(self.ids),
      train_chars=train[1] - train[0],
      eval_chars=held_out[1] - held_out[0],
    )
