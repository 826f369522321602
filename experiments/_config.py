"""Configs of the experiments: frozen dataclasses loaded from YAML, checked key by key.

One mechanism for the training run (``experiments/toy/config.py``) and the
benchmarks (``bench.py``, ``bench_scaling.py``, ``bench_parallel.py``). A config
is a frozen dataclass deriving from :class:`Section`:

- each field declares its checks with :func:`field` (``choices``, inclusive
  ``minimum``/``maximum``, exclusive ``above``; on every item of a list);
- its type annotation is checked (``int``, ``float | None``, ``list[int]``,
  ``tuple[str, ...]``; an int is taken as a float, a bool is never an int);
- a field whose type is another :class:`Section` is a nested section of the
  YAML file (``model: {d_model: 64}``), named by its ``SECTION`` prefix;
- ``check()`` holds the rules across fields.

YAML lists load as the field's type says: ``tuple[...]`` (the training config:
hashable, immutable) or ``list[...]`` (the benchmarks' grids, which their tests
and JSON records compare with lists; frozen as fields, not to be mutated).

Every check runs in ``__post_init__``, so a config built in code is checked
like one read from a file. :func:`load` reads the YAML, applies a script's
``quick`` settings, its command-line flags and ``--set key=value`` overrides,
rejects unknown keys and builds the dataclass. Errors are :class:`ConfigError`
(a ValueError) naming the key (``model.d_model``) and listing the valid keys or
choices.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

T = typing.TypeVar("T")


class ConfigError(ValueError):
  """A config that cannot be used; the message names the offending key."""


def field(
  default: Any = dataclasses.MISSING,
  *,
  choices: Sequence | None = None,
  minimum: float | None = None,
  maximum: float | None = None,
  above: float | None = None,
  factory: Any = dataclasses.MISSING,
  doc: str = "",
) -> Any:
  """A dataclass field with its checks (``choices``, inclusive ``minimum``/``maximum``,
  exclusive ``above``) and its ``doc`` kept as metadata; ``factory`` for list defaults."""
  meta = dict(choices=choices, minimum=minimum, maximum=maximum, above=above, doc=doc)
  if factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=factory, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


class Section:
  """Base of a config dataclass: ``__post_init__`` checks every field, then :meth:`check`.

  ``SECTION`` is the dotted prefix of its keys in messages (``"model."``; ``""`` at
  the top level). A section also reads like the mapping it is written as in YAML:
  ``cfg.memory["lengths"]`` is ``cfg.memory.lengths``.
  """

  SECTION: typing.ClassVar[str] = ""

  def __post_init__(self) -> None:
    _check_fields(self)
    self.check()

  def check(self) -> None:
    """Rules across fields; raise :class:`ConfigError` naming the keys."""

  def __getitem__(self, key: str) -> Any:
    if key not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
      raise KeyError(key)
    return getattr(self, key)


def _is_section(tp) -> bool:
  return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp) -> str:
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  if typing.get_origin(tp) in (tuple, list):
    return f"a list of {_type_name(typing.get_args(tp)[0])}"
  return "null" if tp is type(None) else tp.__name__


def _matches(value, tp) -> bool:
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in typing.get_args(tp))
  if origin in (tuple, list):
    item = typing.get_args(tp)[0]
    return isinstance(value, origin) and all(_matches(v, item) for v in value)
  if tp is type(None):
    return value is None
  if tp is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, tp)


def _sequence_type(tp) -> type | None:
  """``tuple`` or ``list`` when ``tp`` (or an arm of its union) is one: how YAML lists load."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    arms = [_sequence_type(a) for a in typing.get_args(tp)]
    return next((a for a in arms if a is not None), None)
  origin = typing.get_origin(tp)
  return origin if origin in (tuple, list) else None


def _check_fields(obj: Section) -> None:
  """Type, choice and range checks of every field of a config dataclass."""
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):  # type: ignore[arg-type]
    key, value, meta = f"{obj.SECTION}{f.name}", getattr(obj, f.name), f.metadata
    tp = hints[f.name]
    if tp is float and isinstance(value, str):
      # PyYAML reads 1e-3 (no dot in the mantissa) as a string; take it as the float it spells.
      try:
        value = float(value)
      except ValueError:
        pass
      else:
        object.__setattr__(obj, f.name, value)
    if _is_section(tp):
      if not isinstance(value, tp):
        raise ConfigError(f"'{key}' must be a mapping of {tp.__name__} keys, got {value!r}")
      continue
    if not _matches(value, tp):
      raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and isinstance(value, int):
      object.__setattr__(obj, f.name, float(value))
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if item is None:
        continue
      if meta.get("choices") is not None and item not in meta["choices"]:
        raise ConfigError(f"'{key}' must be one of {list(meta['choices'])}, got {item!r}")
      if isinstance(item, (int, float)):
        if not math.isfinite(item):
          raise ConfigError(f"'{key}' must be finite, got {item!r}")
        if meta.get("minimum") is not None and item < meta["minimum"]:
          raise ConfigError(f"'{key}' must be >= {meta['minimum']}, got {item!r}")
        if meta.get("maximum") is not None and item > meta["maximum"]:
          raise ConfigError(f"'{key}' must be <= {meta['maximum']}, got {item!r}")
        if meta.get("above") is not None and item <= meta["above"]:
          raise ConfigError(f"'{key}' must be > {meta['above']}, got {item!r}")


def valid_keys(cls) -> str:
  """The field names of a config class, comma-separated (for messages)."""
  return ", ".join(f.name for f in dataclasses.fields(cls))


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
  """Builds ``cls`` from nested mappings; YAML lists become the field's list or tuple.
  Raises ConfigError."""
  section = prefix.rstrip(".") or "the config"
  if not isinstance(data, dict):
    raise ConfigError(
      f"{section!r} must be a mapping with keys {valid_keys(cls)}, "
      f"got {type(data).__name__} {data!r}"
    )
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
  kwargs = {}
  for key, value in data.items():
    if key not in names:
      raise ConfigError(f"unknown key '{prefix}{key}'; valid keys of {section}: {valid_keys(cls)}")
    tp = hints[key]
    if _is_section(tp):
      value = from_dict(tp, {} if value is None else value, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)) and _sequence_type(tp) is not None:
      value = _sequence_type(tp)(value)  # type: ignore[misc]
    kwargs[key] = value
  return cls(**kwargs)


def to_dict(cfg) -> dict:
  """The resolved config as plain YAML/JSON-ready data (tuples become lists)."""

  def plain(x):
    if isinstance(x, dict):
      return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [plain(v) for v in x]
    return x

  return plain(dataclasses.asdict(cfg))


def _assign(cls, data: dict, key: str, value: Any, source: str) -> None:
  """Sets the dotted ``key`` of nested ``data`` (a config of ``cls`` being assembled) to
  ``value``. A mapping given for a section is merged into it key by key, except from
  ``--set``, which names single keys."""
  path = key.strip().split(".")
  node = data
  for i, part in enumerate(path):
    fields = {f.name for f in dataclasses.fields(cls)}
    dotted = ".".join(path[: i + 1])
    if part not in fields:
      where = ".".join(path[:i]) or "the config"
      raise ConfigError(
        f"unknown key '{dotted}' in {source}; valid keys of {where}: {valid_keys(cls)}"
      )
    tp = typing.get_type_hints(cls)[part]
    if i == len(path) - 1:
      if not _is_section(tp):
        node[part] = value
      elif source == "--set":
        raise ConfigError(f"--set {dotted} names a section; set one of its keys: {valid_keys(tp)}")
      elif isinstance(value, Mapping):
        for sub, sub_value in value.items():
          _assign(cls, data, f"{dotted}.{sub}", sub_value, source)
      else:
        node[part] = value  # from_dict names the section that is not a mapping
      return
    if not _is_section(tp):
      raise ConfigError(f"'{dotted}' is not a section and has no key '{path[i + 1]}'")
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    if not isinstance(child, dict):
      raise ConfigError(f"'{dotted}' must be a mapping, got {child!r}")
    cls, node = tp, child


def _merge(base: dict, update: Mapping) -> None:
  """``update`` into ``base``, mapping into mapping."""
  for key, value in update.items():
    if isinstance(value, Mapping) and isinstance(base.get(key), dict):
      _merge(base[key], value)
    else:
      base[key] = value


def read_yaml(cls, path: str | pathlib.Path) -> dict:
  """The mapping in the YAML file at ``path``, for a config of ``cls`` (whose keys the
  message lists when the file holds something else)."""
  path = pathlib.Path(path)
  try:
    data = yaml.safe_load(path.read_text())
  except OSError as e:
    raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML: {e}") from None
  data = {} if data is None else data
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: the top level must be a mapping with keys {valid_keys(cls)}")
  return data


def load(
  cls: type[T],
  path: str | pathlib.Path | None = None,
  *,
  defaults: Mapping[str, Any] | None = None,
  quick: Mapping[str, Any] | None = None,
  flags: Mapping[str, Any] | None = None,
  overrides: Sequence[str] = (),
) -> T:
  """The checked config ``cls``. Later sources win:

  1. the dataclass defaults, then ``defaults`` (e.g. a run name from the file name);
  2. the YAML file at ``path`` (if any);
  3. ``quick``: a script's smoke-test settings (nested mappings merge into sections);
  4. ``flags``: command-line values, ``None`` meaning not given (dotted keys reach into
     sections: ``{"memory.lengths": [64]}``);
  5. ``overrides``: ``--set key=value`` strings, the value read as YAML (``3``, ``[1, 2]``).

  Raises ConfigError naming the key for an unknown key, a wrong type or a value out of range.
  """
  data: dict = {}
  for key, value in (defaults or {}).items():
    _assign(cls, data, key, value, "defaults")
  if path is not None:  # read whole: from_dict names an unknown key by where it sits
    _merge(data, read_yaml(cls, path))
  for key, value in (quick or {}).items():
    _assign(cls, data, key, value, "quick")
  for key, value in (flags or {}).items():
    if value is not None:
      _assign(cls, data, key, value, "flags")
  for assignment in overrides:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
      raise ConfigError(f"--set expects key=value (e.g. training.steps=100), got {assignment!r}")
    _assign(cls, data, key, yaml.safe_load(raw), "--set")
  return from_dict(cls, data)
