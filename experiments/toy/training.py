"""Training one model with one backward rule: optimizer, loss, jitted step, evaluation.

Everything here is a pure function of the config, the task and the rule, so two
rules trained from the same config see the same initial parameters and the
same batches, in the same order. The model is split once into a static graph
and a parameter pytree; the train step is a plain ``jax.jit`` over pytrees,
compiled ahead of time so its buffer sizes can be read from XLA.

With a ``qk_clip`` threshold in the config, the attention layers sow their max
logits: every step records each layer's and head's largest logit, and a trainer
made with ``qk_clip=True`` clips the query and key projections after each
update (:mod:`experiments.toy.clip`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.toy import clip as clip_lib
from experiments.toy import model as model_lib
from experiments.toy.config import Config, OptimizerConfig
from experiments.toy.corpus import CharTask
from experiments.toy.tasks import Batch, Task

AnyTask = Task | CharTask


def make_optimizer(cfg: OptimizerConfig, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on a warmup + cosine schedule.

  Weight decay applies to matrices (embeddings, kernels), not to norm scales.
  """
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=min(cfg.warmup_steps, steps - 1) if steps > 1 else 0,
    decay_steps=steps,
    end_value=cfg.learning_rate * cfg.final_lr_fraction,
  )
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
    optax.clip_by_global_norm(cfg.clip_norm),
    optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
  )


def loss_and_metrics(logits: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
  """Mean cross-entropy over the answer tokens, token accuracy and exact match.

  ``logits[:, i]`` predicts ``tokens[:, i + 1]``. A row is an exact match when
  every answer token is the argmax given the true prefix, which is also what
  greedy decoding produces then.
  """
  targets, weights = batch.tokens[:, 1:], batch.answer[:, 1:]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  count = jnp.maximum(weights.sum(), 1)
  loss = jnp.where(weights, losses, 0.0).sum() / count
  correct = (logits.argmax(-1) == targets) | ~weights
  return loss, dict(
    token_accuracy=(correct & weights).sum() / count, exact_match=correct.all(-1).mean()
  )


@dataclasses.dataclass
class State:
  """What changes during training."""

  params: nnx.State
  opt_state: optax.OptState


class Trainer:
  """A model for one rule, its optimizer and its compiled step.

  Its layers sow their max logits when the config sets ``qk_clip.threshold``; then each
  step's record has ``max_logit`` (the largest over layers and heads) and
  ``max_logit_heads`` (L, N), and with ``qk_clip=True`` the step ends with QK-clip.
  """

  def __init__(self, cfg: Config, task: AnyTask, rule: str, *, qk_clip: bool = False):
    self.cfg, self.rule = cfg, rule
    self.sow_max_logit = cfg.qk_clip.threshold is not None
    if qk_clip and not self.sow_max_logit:
      raise ValueError("qk_clip=True needs a config with 'qk_clip.threshold' set")
    self.threshold = cfg.qk_clip.threshold if qk_clip else None  # τ of the clip, if it clips
    self.label = f"{rule}+qk_clip" if qk_clip else rule
    model = model_lib.build(
      cfg.model, task.vocab_size, rule, cfg.training.seed, sow_max_logit=self.sow_max_logit
    )
    split: Any = nnx.split(model, nnx.Param, ...)
    self.graphdef, params, self.rest = split
    self.optimizer = make_optimizer(cfg.optimizer, cfg.training.steps)
    self.state = State(params, self.optimizer.init(params))
    self._step = jax.jit(self._train_step)
    self._eval = jax.jit(self._eval_loss)
    self._grads = jax.jit(jax.grad(lambda p, b: self._loss(p, b)[0]))
    self.compiled: Any = None
    self.step_bytes: int | None = None  # XLA's buffer assignment for the compiled step

  def _model(self, params) -> model_lib.Transformer:
    return nnx.merge(self.graphdef, params, self.rest)

  def _loss(self, params, batch: Batch):
    """``loss, (metrics, each layer's max logits or None)``, as value_and_grad's has_aux
    takes it."""
    logits, max_logits = model_lib.forward(self._model(params), jnp.asarray(batch.tokens)[:, :-1])
    loss, metrics = loss_and_metrics(logits, batch)
    return loss, (metrics, max_logits)

  def _eval_loss(self, params, batch: Batch):
    loss, (metrics, _) = self._loss(params, batch)
    return loss, metrics

  def _train_step(self, params, opt_state, batch: Batch):
    grad_fn = jax.value_and_grad(self._loss, has_aux=True)
    (loss, (metrics, max_logits)), grads = grad_fn(params, batch)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), **metrics)
    if max_logits is not None:
      heads = clip_lib.head_max(max_logits)
      metrics.update(max_logit=heads.max(), max_logit_heads=heads)
    if self.threshold is not None:
      model = self._model(params)
      clip_lib.qk_clip(model, max_logits, self.threshold, alpha=self.cfg.qk_clip.alpha)
      params = nnx.state(model, nnx.Param)
    return params, opt_state, metrics

  def compile(self, batch: Batch):
    """Compiles the step for ``batch``'s shapes; returns XLA's memory figures (bytes)."""
    self.compiled = self._step.lower(self.state.params, self.state.opt_state, batch).compile()
    self.step_bytes = step_memory_bytes(self.compiled)
    return self.step_bytes

  def step(self, batch: Batch) -> dict:
    """One optimizer step; returns loss, grad norm, accuracies, the max logits if sown
    (floats, ``max_logit_heads`` a list of lists) and wall time (ms)."""
    step = self.compiled or self._step
    start = time.perf_counter()
    params, opt_state, metrics = step(self.state.params, self.state.opt_state, batch)
    metrics = {k: np.asarray(v).tolist() for k, v in metrics.items()}  # waits for the step
    metrics["step_ms"] = (time.perf_counter() - start) * 1e3
    self.state = State(params, opt_state)
    return metrics

  def gradients(self, batch: Batch):
    """Parameter gradients of the loss on ``batch`` at the current parameters."""
    return self._grads(self.state.params, batch)

  def evaluate(self, batches: list[Batch]) -> dict:
    """Loss (nats and bits per answer token), token accuracy and exact match over held-out
    batches (sample-weighted)."""
    totals: dict[str, float] = {}
    n = 0
    for batch in batches:
      loss, metrics = self._eval(self.state.params, batch)
      size = batch.tokens.shape[0]
      for k, v in dict(loss=loss, **metrics).items():
        totals[k] = totals.get(k, 0.0) + float(v) * size
      n += size
    out = {f"eval_{k}": v / n for k, v in totals.items()}
    out["eval_bits_per_token"] = out["eval_loss"] / math.log(2)
    return out


def step_memory_bytes(compiled) -> int | None:
  """Bytes XLA's buffer assignment holds at once for a compiled step: arguments,
  outputs and temporaries, less outputs aliased to arguments. None when the
  backend does not report it."""
  try:
    m = compiled.memory_analysis()
  except (NotImplementedError, jax.errors.JaxRuntimeError):
    return None
  if m is None:
    return None
  return int(
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )


def train_batches(cfg: Config, task: AnyTask) -> Iterator[Batch]:
  """The training stream: batch i is fixed by (seed, "train", i)."""
  for i in range(cfg.training.steps):
    yield as_jax(task.batch(cfg.training.batch_size, seed=cfg.training.seed, index=i))


def eval_batches(cfg: Config, task: AnyTask, batch_size: int = 128) -> list[Batch]:
  """Held-out sequences from the "eval" stream, ``eval_samples`` of them."""
  out, left, i = [], cfg.training.eval_samples, 0
  while left > 0:
    size = min(batch_size, left)
    out.append(as_jax(task.batch(size, seed=cfg.training.seed, index=i, split="eval")))
    left, i = left - size, i + 1
  return out


def as_jax(batch: Batch) -> Batch:
  return Batch(jnp.asarray(batch.tokens), jnp.asarray(batch.answer))


def relative_difference(tree, reference) -> float:
  """‖tree − reference‖ / ‖reference‖ over all leaves, in float64."""
  num = sum(
    float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
  )
  den = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree.leaves(reference))
  return float(np.sqrt(num / den)) if den else float(np.sqrt(num))


def train(
  trainer: Trainer,
  batches: Iterator[Batch],
  held_out: list[Batch],
  *,
  eval_every: int,
  on_step: Callable[[dict], None] = lambda m: None,
) -> list[dict]:
  """Runs the loop; every record has rule, step, loss, grad_norm, accuracies, step_ms (and
  ``qk_clip``: τ, in a clipped run; the max logits where sown), and the held-out metrics on
  evaluation steps (every ``eval_every`` steps and the last)."""
  records = []
  batches = iter(batches)
  first = next(batches)
  trainer.compile(first)
  total = trainer.cfg.training.steps
  for i, batch in enumerate(itertools.chain([first], batches)):
    record = dict(rule=trainer.rule, step=i + 1)
    if trainer.threshold is not None:
      record["qk_clip"] = trainer.threshold
    record.update(trainer.step(batch))
    if (i + 1) % eval_every == 0 or i + 1 == total:
      record.update(trainer.evaluate(held_out))
    records.append(record)
    on_step(record)
  return records
