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

A character-level language model names a corpus as its task and may add a QK-clip
run (``configs/char_lm.yaml``)::

    task: {name: pydoc_topics, length: 128, holdout: 0.1}
    qk_clip: {threshold: 20.0, rule: blockwise}

Omitted keys take the defaults below. :func:`load` (the experiments' one config
loader, :mod:`experiments._config`) rejects unknown keys, wrong types and
out-of-range values with a :class:`ConfigError` that names the key
(``model.d_model``) and lists the valid keys or choices. Every check lives in the
dataclasses (field metadata and ``check()``), so a config built in code is checked
the same way as one read from a file.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Sequence

from experiments import _config
from experiments._config import ConfigError as ConfigError
from experiments._config import Section, field
from experiments._config import from_dict as from_dict
from experiments._config import to_dict as to_dict
from experiments.toy import corpus, tasks

RULES = ("autodiff", "custom_vjp", "blockwise")
TASKS = tasks.TASKS + corpus.CORPORA
"""Task names: the toy tasks, then the corpora of character-level language modelling."""


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
  """A decoder-only transformer (see :mod:`experiments.toy.model`)."""

  SECTION: typing.ClassVar[str] = "model."
  d_model: int = field(64, minimum=1, doc="residual width")
  num_heads: int = field(4, minimum=1, doc="query heads per layer")
  num_kv_heads: int | None = field(None, minimum=1, doc="key/value heads (GQA); null = num_heads")
  num_layers: int = field(2, minimum=1, doc="transformer blocks")
  mlp_ratio: int = field(4, minimum=1, doc="MLP hidden width / d_model")
  positions: str = field(
    "rope",
    choices=("rope", "sinusoidal"),
    doc="RoPE in every attention layer, or sinusoidal embeddings added once",
  )
  rope_base: float = field(10_000.0, above=1.0, doc="RoPE base wavelength")
  block_q: int | None = field(None, minimum=1, doc="blockwise query tile (null = jattn default)")
  block_kv: int | None = field(None, minimum=1, doc="blockwise key/value tile")

  def check(self) -> None:
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
class TaskConfig(Section):
  """Which task to train on: a toy task (:mod:`experiments.toy.tasks`) or next-character
  prediction on a corpus (:mod:`experiments.toy.corpus`)."""

  SECTION: typing.ClassVar[str] = "task."
  name: str = field("copy", choices=TASKS)
  length: int = field(
    12,
    minimum=1,
    doc="symbols to copy/reverse/sort, key-value pairs, body tokens of long_range, "
    "or a corpus's context (windows of length + 1 characters)",
  )
  num_symbols: int = field(16, minimum=2, doc="(toy tasks) distinct content symbols")
  holdout: float = field(
    0.1, above=0.0, maximum=0.5, doc="(corpus) the last fraction of the text, held out"
  )

  def check(self) -> None:
    try:
      self.make()
    except ValueError as e:  # the task's own range checks, e.g. recall needs distinct keys
      raise ConfigError(f"'task': {e}") from None

  @property
  def is_corpus(self) -> bool:
    """Whether the task is character-level language modelling on a corpus."""
    return self.name in corpus.CORPORA

  def make(self) -> tasks.Task | corpus.CharTask:
    if self.is_corpus:
      return corpus.CharTask(self.name, length=self.length, holdout=self.holdout)
    return tasks.make(self.name, length=self.length, num_symbols=self.num_symbols)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
  """AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

  SECTION: typing.ClassVar[str] = "optimizer."
  learning_rate: float = field(3e-3, above=0.0, doc="peak learning rate")
  warmup_steps: int = field(40, minimum=0, doc="linear warmup from 0 to the peak")
  final_lr_fraction: float = field(
    0.1, minimum=0.0, maximum=1.0, doc="cosine decays to this fraction of the peak"
  )
  weight_decay: float = field(0.01, minimum=0.0, doc="decoupled, on matrices only")
  b1: float = field(0.9, minimum=0.0, maximum=1.0)
  b2: float = field(0.98, minimum=0.0, maximum=1.0)
  clip_norm: float = field(1.0, above=0.0, doc="global gradient-norm clipping")


@dataclasses.dataclass(frozen=True)
class TrainingConfig(Section):
  """The training loop, shared by every rule."""

  SECTION: typing.ClassVar[str] = "training."
  steps: int = field(400, minimum=1)
  batch_size: int = field(32, minimum=1)
  seed: int = field(0, minimum=0, doc="parameters and batches")
  eval_every: int = field(100, minimum=1, doc="steps between held-out evaluations")
  eval_samples: int = field(256, minimum=1, doc="held-out sequences per evaluation")
  progress: bool = field(True, doc="show a progress bar")


@dataclasses.dataclass(frozen=True)
class SweepConfig(Section):
  """Step time and memory of each rule against sequence length."""

  SECTION: typing.ClassVar[str] = "comparison.sweep."
  seq_lens: tuple[int, ...] = field(
    factory=tuple, minimum=2, doc="sequence lengths; empty = no sweep"
  )
  batch_size: int = field(1, minimum=1)
  steps: int = field(3, minimum=1, doc="timed train steps per cell, after a warm-up step")
  memory_limit_mb: int = field(
    4096, minimum=512, doc="address-space cap of each cell's process, MiB"
  )
  timeout_s: float = field(120.0, above=0.0, doc="wall-clock cap of each cell's process")

  def check(self) -> None:
    if any(a >= b for a, b in zip(self.seq_lens, self.seq_lens[1:])):
      raise ConfigError(
        f"'comparison.sweep.seq_lens' must be increasing (a rule that fails "
        f"at one length is skipped at longer ones), got {list(self.seq_lens)}"
      )


@dataclasses.dataclass(frozen=True)
class ComparisonConfig(Section):
  """Which backward rules to train, and the sequence-length sweep."""

  SECTION: typing.ClassVar[str] = "comparison."
  rules: tuple[str, ...] = field(RULES, choices=RULES)
  sweep: SweepConfig = dataclasses.field(default_factory=SweepConfig)
  heatmap_rule: str | None = field(
    None, choices=RULES, doc="whose trained heads to plot; null = the last rule"
  )

  def check(self) -> None:
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
class QKClipConfig(Section):
  """A QK-clip run: the model of ``rule`` trained again, its query and key projections
  scaled after every step by :func:`jattn.qk_clip_scales` of the step's own max logits."""

  SECTION: typing.ClassVar[str] = "qk_clip."
  threshold: float | None = field(
    None, above=0.0, doc="τ, the largest logit a head may keep; null = no QK-clip run"
  )
  rule: str = field("blockwise", choices=RULES, doc="whose model is trained with the clip")
  alpha: float = field(0.5, minimum=0.0, maximum=1.0, doc="the query side's share of the clip")


@dataclasses.dataclass(frozen=True)
class Config(Section):
  """A whole run."""

  SECTION: typing.ClassVar[str] = ""
  name: str = field("run", doc="run directory name under output_dir")
  output_dir: str = field("runs")
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
  comparison: ComparisonConfig = dataclasses.field(default_factory=ComparisonConfig)
  qk_clip: QKClipConfig = dataclasses.field(default_factory=QKClipConfig)

  def check(self) -> None:
    if not self.name or "/" in self.name or self.name in (".", ".."):
      raise ConfigError(f"'name' must be a plain directory name, got {self.name!r}")
    clip = self.qk_clip
    if clip.threshold is not None and clip.rule not in self.comparison.rules:
      raise ConfigError(
        f"'qk_clip.rule' ({clip.rule!r}) must be one of 'comparison.rules' "
        f"{list(self.comparison.rules)}: its run there is the run without the clip"
      )

  @property
  def run_dir(self) -> pathlib.Path:
    return pathlib.Path(self.output_dir) / self.name


def load(path: str | pathlib.Path | None, overrides: Sequence[str] = ()) -> Config:
  """Reads a YAML config, applies ``--set key=value`` overrides and checks everything.

  ``name`` defaults to the file's stem (``configs/copy.yaml`` runs as ``copy``).
  """
  defaults = None if path is None else {"name": pathlib.Path(path).stem}
  return _config.load(Config, path, defaults=defaults, overrides=overrides)
