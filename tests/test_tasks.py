"""experiments.toy.tasks: shapes, determinism, every task's labels checked row by row in
plain Python, the answer masks, token names, and every error path."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.toy import tasks

B = 16
SETTINGS = {  # name -> (length, num_symbols)
  "copy": (7, 10),
  "reverse": (7, 10),
  "sort": (7, 10),
  "associative_recall": (6, 12),
  "long_range": (20, 10),
}


def make(name):
  length, num_symbols = SETTINGS[name]
  return tasks.make(name, length=length, num_symbols=num_symbols)


@pytest.fixture(params=tasks.TASKS)
def task(request):
  return make(request.param)


# ----------------------------------------------------------------- shapes and vocabulary


def test_task_list_and_splits():
  assert tasks.TASKS == ("copy", "reverse", "sort", "associative_recall", "long_range")
  assert tasks.SPLITS == {"train": 0, "eval": 1}
  assert set(SETTINGS) == set(tasks.TASKS)


def test_make_constructs_task():
  task = tasks.make("sort", length=5, num_symbols=9)
  assert task == tasks.Task("sort", 5, 9)
  assert (task.name, task.length, task.num_symbols) == ("sort", 5, 9)
  assert hash(task) == hash(tasks.Task("sort", 5, 9))


def test_numpy_ints_are_normalised():
  task = tasks.Task("copy", np.int64(3), np.int32(4))
  assert type(task.length) is int and type(task.num_symbols) is int
  assert task == tasks.Task("copy", 3, 4)


def test_special_tokens_and_vocab(task):
  s = task.num_symbols
  assert (task.sep, task.mark, task.vocab_size) == (s, s + 1, s + 2)


@pytest.mark.parametrize(
  "name, length, seq_len, num_answer",
  [
    ("copy", 7, 15, 7),
    ("reverse", 7, 15, 7),
    ("sort", 7, 15, 7),
    ("associative_recall", 6, 15, 1),
    ("long_range", 20, 22, 1),
  ],
)
def test_seq_len_and_num_answer_tokens(name, length, seq_len, num_answer):
  task = make(name)
  assert task.length == length
  assert task.seq_len == seq_len
  assert task.num_answer_tokens == num_answer


def test_batch_shapes_dtypes_range(task):
  batch = task.batch(B, seed=0, index=0)
  assert isinstance(batch, tasks.Batch)
  tokens, answer = batch
  assert tokens.shape == answer.shape == (B, task.seq_len)
  assert tokens.dtype == np.int32 and answer.dtype == np.bool_
  assert tokens.min() >= 0 and tokens.max() < task.vocab_size
  assert task.batch(1, seed=0, index=0).tokens.shape == (1, task.seq_len)


def test_answer_mask(task):
  answer = task.batch(B, seed=3, index=2).answer
  expected = [False] * (task.seq_len - task.num_answer_tokens) + [True] * task.num_answer_tokens
  for row in answer.tolist():
    assert row == expected
  answer[0, 0] = True  # a fresh writable array, not a shared view
  assert not task.batch(B, seed=3, index=2).answer[0, 0]


# ----------------------------------------------------------------- determinism


def test_deterministic(task):
  a = task.batch(B, seed=5, index=3, split="eval")
  b = make(task.name).batch(B, seed=5, index=3, split="eval")
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.answer, b.answer)


def test_default_split_is_train(task):
  np.testing.assert_array_equal(
    task.batch(B, seed=1, index=0).tokens, task.batch(B, seed=1, index=0, split="train").tokens
  )


@pytest.mark.parametrize(
  "change", [dict(index=1), dict(seed=1), dict(split="eval"), dict(index=2**40), dict(seed=2**40)]
)
def test_different_streams_differ(task, change):
  base = dict(seed=0, index=0, split="train")
  a = task.batch(B, **base).tokens
  b = task.batch(B, **{**base, **change}).tokens
  assert not np.array_equal(a, b)


def test_index_is_random_access(task):
  """Batch 3 is the same whether or not batches 0..2 were drawn first."""
  direct = task.batch(B, seed=7, index=3).tokens
  for i in range(3):
    task.batch(B, seed=7, index=i)
  np.testing.assert_array_equal(direct, task.batch(B, seed=7, index=3).tokens)


# ----------------------------------------------------------------- labels, row by row


def _rows(task, seed=0, index=0, split="train", batch_size=64):
  return task.batch(batch_size, seed=seed, index=index, split=split).tokens.tolist()


@pytest.mark.parametrize("split", tasks.SPLITS)
@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_sequence_tasks(name, split):
  task = make(name)
  n, sep = task.length, task.sep
  for row in _rows(task, split=split):
    x, middle, y = row[:n], row[n], row[n + 1 :]
    assert middle == sep
    assert all(0 <= t < task.num_symbols for t in x + y)
    if name == "copy":
      assert y == x
    elif name == "reverse":
      assert y == x[::-1]
    else:
      assert all(y[i] <= y[i + 1] for i in range(n - 1))
      assert sorted(y) == sorted(x)  # a permutation of x


@pytest.mark.parametrize("split", tasks.SPLITS)
def test_associative_recall(split):
  task = make("associative_recall")
  pairs = task.length
  queried = set()
  for row in _rows(task, split=split):
    keys, values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
    assert len(set(keys)) == pairs  # distinct keys
    half = task.num_symbols // 2  # keys from the lower half, values from the upper
    assert all(0 <= t < half for t in keys) and all(half <= t < task.num_symbols for t in values)
    assert row[2 * pairs] == task.sep
    query_key, answer = row[2 * pairs + 1], row[2 * pairs + 2]
    assert query_key in keys
    q = keys.index(query_key)
    assert answer == values[q]
    queried.add(q)
  assert len(queried) > 1  # not always the same pair


def test_associative_recall_keys_use_every_key_symbol():
  """With num_symbols == 2P (or 2P + 1) the keys are a permutation of the lower half."""
  for num_symbols in (10, 11):
    task = tasks.make("associative_recall", length=5, num_symbols=num_symbols)
    for row in _rows(task):
      assert sorted(row[0:10:2]) == list(range(5))


@pytest.mark.parametrize("split", tasks.SPLITS)
@pytest.mark.parametrize("length", [8, 9, 20, 33])
def test_long_range(length, split):
  task = tasks.make("long_range", length=length, num_symbols=6)
  positions = set()
  for row in _rows(task, split=split):
    body = row[:length]
    assert body.count(task.mark) == 1
    assert task.sep not in body
    assert row.count(task.sep) == 1 and row[length] == task.sep
    p = body.index(task.mark)
    assert p < length // 4
    assert 0 <= body[p + 1] < task.num_symbols
    assert row[-1] == body[p + 1]
    assert length - (p + 1) >= 3 * length / 4  # the needle is far from the SEP
    assert all(0 <= t < task.num_symbols for i, t in enumerate(body) if i != p)
    positions.add(p)
  assert positions == set(range(length // 4))  # every allowed position turns up


def test_symbols_are_spread(task):
  """Content symbols cover the whole range (uniform draws, not a constant)."""
  tokens = task.batch(256, seed=0, index=0).tokens
  content = tokens[tokens < task.num_symbols]
  assert set(content.tolist()) == set(range(task.num_symbols))


# ----------------------------------------------------------------- token names


def test_token_names():
  task = tasks.make("long_range", length=8, num_symbols=12)
  assert task.token_names([0, 11, 12, 13, 5]) == ["0", "11", "|", "*", "5"]
  assert task.token_names(np.array([3, 12], np.int32)) == ["3", "|"]
  assert task.token_names([]) == []


def test_token_names_of_batch(task):
  row = task.batch(2, seed=0, index=0).tokens[0]
  names = task.token_names(row)
  assert len(names) == task.seq_len
  assert names.count("|") == 1
  assert names.count("*") == (1 if task.name == "long_range" else 0)
  assert all(n in ("|", "*") or 0 <= int(n) < task.num_symbols for n in names)


@pytest.mark.parametrize(
  "tokens, error, match",
  [
    ([[1, 2]], ValueError, "tokens must be 1-D"),
    (5, ValueError, "tokens must be 1-D"),
    ([1, 14], ValueError, r"tokens must lie in \[0, 14\)"),
    ([-1, 2], ValueError, r"tokens must lie in \[0, 14\)"),
    ([1.0, 2.0], TypeError, "tokens must be integers"),
  ],
)
def test_token_names_errors(tokens, error, match):
  task = tasks.make("copy", length=3, num_symbols=12)
  with pytest.raises(error, match=match):
    task.token_names(tokens)


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "name, length, num_symbols, error, match",
  [
    (
      "copies",
      3,
      4,
      ValueError,
      r"name must be one of \['copy', 'reverse', 'sort', "
      r"'associative_recall', 'long_range'\]",
    ),
    ("", 3, 4, ValueError, "name must be one of"),
    (None, 3, 4, TypeError, "name must be a str"),
    (0, 3, 4, TypeError, "name must be a str"),
    ("copy", 0, 4, ValueError, "length must be >= 1"),
    ("copy", -2, 4, ValueError, "length must be >= 1"),
    ("copy", 2.0, 4, TypeError, "length must be an int"),
    ("copy", "3", 4, TypeError, "length must be an int"),
    ("copy", True, 4, TypeError, "length must be an int"),
    ("copy", np.bool_(True), 4, TypeError, "length must be an int"),
    ("copy", 3, 0, ValueError, "num_symbols must be >= 1"),
    ("copy", 3, -1, ValueError, "num_symbols must be >= 1"),
    ("copy", 3, 1, ValueError, "num_symbols must be >= 2"),
    ("copy", 3, 4.5, TypeError, "num_symbols must be an int"),
    ("copy", 3, False, TypeError, "num_symbols must be an int"),
    ("copy", 3, None, TypeError, "num_symbols must be an int"),
    ("reverse", 0, 4, ValueError, "length must be >= 1"),
    ("sort", 3, 1, ValueError, "num_symbols must be >= 2"),
    ("associative_recall", 0, 4, ValueError, "length must be >= 1"),
    (
      "associative_recall",
      5,
      9,
      ValueError,
      r"num_symbols \(9\) must be >= 2 \* length \(10\) for associative_recall",
    ),
    ("associative_recall", 1, 1, ValueError, "num_symbols must be >= 2"),
    ("long_range", 7, 4, ValueError, "length must be >= 8 for task 'long_range', got 7"),
    ("long_range", 1, 4, ValueError, "length must be >= 8"),
    ("long_range", 8, 1, ValueError, "num_symbols must be >= 2"),
  ],
)
def test_task_errors(name, length, num_symbols, error, match):
  with pytest.raises(error, match=match):
    tasks.Task(name, length, num_symbols)
  with pytest.raises(error, match=match):
    tasks.make(name, length=length, num_symbols=num_symbols)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
    (dict(batch_size=-3), ValueError, "batch_size must be >= 1"),
    (dict(batch_size=2.0), TypeError, "batch_size must be an int"),
    (dict(batch_size=True), TypeError, "batch_size must be an int"),
    (dict(seed=-1), ValueError, "seed must be >= 0, got -1"),
    (dict(seed=0.5), TypeError, "seed must be an int"),
    (dict(seed=None), TypeError, "seed must be an int"),
    (dict(seed=False), TypeError, "seed must be an int"),
    (dict(index=-1), ValueError, "index must be >= 0, got -1"),
    (dict(index=1.0), TypeError, "index must be an int"),
    (dict(index=True), TypeError, "index must be an int"),
    (dict(split="test"), ValueError, r"split must be one of \['train', 'eval'\], got 'test'"),
    (dict(split="Train"), ValueError, "split must be one of"),
    (dict(split=0), ValueError, "split must be one of"),
    (dict(split=["train"]), ValueError, "split must be one of"),
  ],
)
def test_batch_errors(task, kwargs, error, match):
  args = {"batch_size": 4, "seed": 0, "index": 0, **kwargs}
  with pytest.raises(error, match=match):
    task.batch(args.pop("batch_size"), **args)


def test_batch_accepts_numpy_ints(task):
  a = task.batch(np.int64(4), seed=np.uint32(2), index=np.int16(1), split="eval").tokens
  np.testing.assert_array_equal(a, task.batch(4, seed=2, index=1, split="eval").tokens)
