"""Configuration of the toy training experiment: frozen dataclasses loaded from YAML.

A config file has one section per dataclass below plus ``name`` and
``output_dir``::

    name: compare_backward
    output_dir: runs
    model: {d_model: 64, num_heads: 4, num_layers: 2}
    task: {name: copy, length: 12, num_symbols: 16}
    optimizer: {learning_rate: 3.0e-3, warmup_steps: 40}
    training: {steps: 400, batch_size: 32}
    comparison:
      rules: [autodiff, custom_vjp, blockwise]
      sweep: {seq_lens: [256, 1024, 4096]}

Omitted keys take the defaults below. :func:`load` rejects unknown keys,
wrong types and out-of-range values with a :class:`ConfigError` that names the
key (``model.d_model``) and lists the valid keys or choices. Every check lives
in the dataclasses' ``__post_init__``, so a config built in code is checked
the same way as one read from a file.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import types
import typing
from typing import Any

import yaml

from experiments.toy import tasks

RULES = ("autodiff", "custom_vjp", "blockwise")


class ConfigError(ValueError):
  """A config that cannot be used; the message names the offending key."""


def _field(
  default: Any = dataclasses.MISSING,
  *,
  choices: tuple | None = None,
  minimum: float | None = None,
  maximum: float | None = None,
  above: float | None = None,
  factory: Any = dataclasses.MISSING,
  doc: str = "",
):
  """A dataclass field with its checks (choices, inclusive ``minimum``/``maximum``,
  exclusive ``above``) kept as metadata for :func:`_check_fields`."""
  meta = dict(choices=choices, minimum=minimum, maximum=maximum, above=above, doc=doc)
  if factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=factory, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def _type_name(tp) -> str:
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  if typing.get_origin(tp) is tuple:
    return f"a list of {_type_name(typing.get_args(tp)[0])}"
  return "null" if tp is type(None) else tp.__name__


def _matches(value, tp) -> bool:
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in typing.get_args(tp))
  if origin is tuple:
    return isinstance(value, tuple) and all(_matches(v, typing.get_args(tp)[0]) for v in value)
  if tp is type(None):
    return value is None
  if tp is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, tp)


def _check_fields(obj) -> None:
  """Type, choice and range checks of every field of a config dataclass."""
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
      if not isinstance(value, tp):
        raise ConfigError(f"'{key}' must be a mapping of {tp.__name__} keys, got {value!r}")
      continue
    if not _matches(value, tp):
      raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and isinstance(value, int):
      object.__setattr__(obj, f.name, float(value))
    items = value if isinstance(value, tuple) else (value,)
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


class _Section:
  """Runs the field checks, then the section's own cross-field checks (``_check``)."""

  SECTION: typing.ClassVar[str] = ""

  def __post_init__(self):
    _check_fields(self)
    self._check()

  def _check(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
  """A decoder-only transformer (see :mod:`experiments.toy.model`)."""

  SECTION: typing.ClassVar[str] = "model."
  d_model: int = _field(64, minimum=1, doc="residual width")
  num_heads: int = _field(4, minimum=1, doc="query heads per layer")
  num_kv_heads: int | None = _field(None, minimum=1, doc="key/value heads (GQA); null = num_heads")
  num_layers: int = _field(2, minimum=1, doc="transformer blocks")
  mlp_ratio: int = _field(4, minimum=1, doc="MLP hidden width / d_model")
  positions: str = _field(
    "rope",
    choices=("rope", "sinusoidal"),
    doc="RoPE in every attention layer, or sinusoidal embeddings added once",
  )
  rope_base: float = _field(10_000.0, above=1.0, doc="RoPE base wavelength")
  block_q: int | None = _field(None, minimum=1, doc="blockwise query tile (null = jattn default)")
  block_kv: int | None = _field(None, minimum=1, doc="blockwise key/value tile")

  def _check(self) -> None:
    if self.d_model % self.num_heads:
      raise ConfigError(
        f"'model.d_model' ({self.d_model}) must be a multiple of "
        f"'model.num_heads' ({self.num_heads})"
      )
    if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"'model.num_heads' ({self.num_heads}) must be a multiple of "
        f"'model.num_kv_heads' ({self.num_kv_heads})"
      )
    head_dim = self.d_model // self.num_heads
    if head_dim % 2:
      raise ConfigError(
        f"the head size 'model.d_model' / 'model.num_heads' = {head_dim} "
        "must be even (RoPE and sinusoidal tables pair channels)"
      )


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Section):
  """Which toy task to train on (see :mod:`experiments.toy.tasks`)."""

  SECTION: typing.ClassVar[str] = "task."
  name: str = _field("copy", choices=tasks.TASKS)
  length: int = _field(
    12, minimum=1, doc="symbols to copy/reverse/sort, key-value pairs, or body tokens of long_range"
  )
  num_symbols: int = _field(16, minimum=2, doc="distinct content symbols")

  def _check(self) -> None:
    try:
      self.make()
    except ValueError as e:  # the task's own range checks, e.g. recall needs distinct keys
      raise ConfigError(f"'task': {e}") from None

  def make(self) -> tasks.Task:
    return tasks.make(self.name, length=self.length, num_symbols=self.num_symbols)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Section):
  """AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

  SECTION: typing.ClassVar[str] = "optimizer."
  learning_rate: float = _field(3e-3, above=0.0, doc="peak learning rate")
  warmup_steps: int = _field(40, minimum=0, doc="linear warmup from 0 to the peak")
  final_lr_fraction: float = _field(
    0.1, minimum=0.0, maximum=1.0, doc="cosine decays to this fraction of the peak"
  )
  weight_decay: float = _field(0.01, minimum=0.0, doc="decoupled, on matrices only")
  b1: float = _field(0.9, minimum=0.0, maximum=1.0)
  b2: float = _field(0.98, minimum=0.0, maximum=1.0)
  clip_norm: float = _field(1.0, above=0.0, doc="global gradient-norm clipping")


@dataclasses.dataclass(frozen=True)
class TrainingConfig(_Section):
  """The training loop, shared by every rule."""

  SECTION: typing.ClassVar[str] = "training."
  steps: int = _field(400, minimum=1)
  batch_size: int = _field(32, minimum=1)
  seed: int = _field(0, minimum=0, doc="parameters and batches")
  eval_every: int = _field(100, minimum=1, doc="steps between held-out evaluations")
  eval_samples: int = _field(256, minimum=1, doc="held-out sequences per evaluation")
  progress: bool = _field(True, doc="show a progress bar")


@dataclasses.dataclass(frozen=True)
class SweepConfig(_Section):
  """Step time and memory of each rule against sequence length."""

  SECTION: typing.ClassVar[str] = "comparison.sweep."
  seq_lens: tuple[int, ...] = _field(
    factory=tuple, minimum=2, doc="sequence lengths; empty = no sweep"
  )
  batch_size: int = _field(1, minimum=1)
  steps: int = _field(3, minimum=1, doc="timed train steps per cell, after a warm-up step")
  memory_limit_mb: int = _field(4096, minimum=512, doc="address-space cap of each cell's process")
  timeout_s: float = _field(120.0, above=0.0, doc="wall-clock cap of each cell's process")

  def _check(self) -> None:
    if any(a >= b for a, b in zip(self.seq_lens, self.seq_lens[1:])):
      raise ConfigError(
        f"'comparison.sweep.seq_lens' must be increasing (a rule that fails "
        f"at one length is skipped at longer ones), got {list(self.seq_lens)}"
      )


@dataclasses.dataclass(frozen=True)
class ComparisonConfig(_Section):
  """Which backward rules to train, and the sequence-length sweep."""

  SECTION: typing.ClassVar[str] = "comparison."
  rules: tuple[str, ...] = _field(RULES, choices=RULES)
  sweep: SweepConfig = dataclasses.field(default_factory=SweepConfig)
  heatmap_rule: str | None = _field(
    None, choices=RULES, doc="whose trained heads to plot; null = the last rule"
  )

  def _check(self) -> None:
    if not self.rules or len(set(self.rules)) != len(self.rules):
      raise ConfigError(
        f"'comparison.rules' must be a non-empty list of distinct rules from "
        f"{list(RULES)}, got {list(self.rules)}"
      )
    if self.heatmap_rule is not None and self.heatmap_rule not in self.rules:
      raise ConfigError(
        f"'comparison.heatmap_rule' ({self.heatmap_rule!r}) must be one of "
        f"'comparison.rules' {list(self.rules)}"
      )


@dataclasses.dataclass(frozen=True)
class Config(_Section):
  """A whole run."""

  SECTION: typing.ClassVar[str] = ""
  name: str = _field("run", doc="run directory name under output_dir")
  output_dir: str = _field("runs")
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
  comparison: ComparisonConfig = dataclasses.field(default_factory=ComparisonConfig)

  def _check(self) -> None:
    if not self.name or "/" in self.name or self.name in (".", ".."):
      raise ConfigError(f"'name' must be a plain directory name, got {self.name!r}")

  @property
  def run_dir(self) -> pathlib.Path:
    return pathlib.Path(self.output_dir) / self.name


def _valid_keys(cls) -> str:
  return ", ".join(f.name for f in dataclasses.fields(cls))


def from_dict(cls, data: Any, prefix: str = ""):
  """Builds ``cls`` from nested mappings; lists become tuples. Raises ConfigError."""
  section = prefix.rstrip(".") or "the config"
  if not isinstance(data, dict):
    raise ConfigError(
      f"{section!r} must be a mapping with keys {_valid_keys(cls)}, "
      f"got {type(data).__name__} {data!r}"
    )
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in data.items():
    if key not in names:
      raise ConfigError(f"unknown key '{prefix}{key}'; valid keys of {section}: {_valid_keys(cls)}")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      value = from_dict(tp, {} if value is None else value, f"{prefix}{key}.")
    elif isinstance(value, list):
      value = tuple(value)
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


def _apply_override(data: dict, assignment: str) -> None:
  """``a.b=value`` into nested ``data``; the value is parsed as YAML (``3``, ``[1, 2]``)."""
  key, sep, raw = assignment.partition("=")
  if not sep or not key:
    raise ConfigError(f"--set expects key=value (e.g. training.steps=100), got {assignment!r}")
  path = key.strip().split(".")
  cls: type = Config
  node = data
  for i, part in enumerate(path):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dotted = ".".join(path[: i + 1])
    if part not in fields:
      where = ".".join(path[:i]) or "the config"
      raise ConfigError(
        f"unknown key '{dotted}' in --set; valid keys of {where}: {_valid_keys(cls)}"
      )
    tp = typing.get_type_hints(cls)[part]
    if i == len(path) - 1:
      if dataclasses.is_dataclass(tp):
        raise ConfigError(f"--set {dotted} names a section; set one of its keys: {_valid_keys(tp)}")
      node[part] = yaml.safe_load(raw)
      return
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
      raise ConfigError(f"'{dotted}' is not a section and has no key '{path[i + 1]}'")
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    if not isinstance(child, dict):
      raise ConfigError(f"'{dotted}' must be a mapping, got {child!r}")
    cls, node = tp, child


def load(path: str | pathlib.Path | None, overrides: typing.Sequence[str] = ()) -> Config:
  """Reads a YAML config, applies ``--set key=value`` overrides and checks everything.

  ``name`` defaults to the file's stem (``configs/copy.yaml`` runs as ``copy``).
  """
  data: Any = {}
  if path is not None:
    path = pathlib.Path(path)
    try:
      data = yaml.safe_load(path.read_text())
    except OSError as e:
      raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
      raise ConfigError(f"{path}: not valid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
      raise ConfigError(f"{path}: the top level must be a mapping with keys {_valid_keys(Config)}")
    data.setdefault("name", path.stem)
  for assignment in overrides:
    _apply_override(data, assignment)
  return from_dict(Config, data)
