"""Train one toy transformer per backward rule from a config file and compare them.

    python -m experiments.train --config configs/compare_backward.yaml
    python -m experiments.train --config configs/copy.yaml --set training.steps=200 model.d_model=32
    python -m experiments.train --config configs/char_lm.yaml

For each rule in ``comparison.rules`` — ``autodiff`` (jattn xla + JAX
autodiff), ``custom_vjp`` (jattn xla + its explicit backward rule),
``blockwise`` (jattn blockwise + recompute) — the same model, from the same
initial parameters, is trained on the same batches of the configured task: a
toy task, or next-character prediction on a corpus (the held-out loss in nats
and bits per character). With ``qk_clip.threshold`` set, every layer sows its
max logits, and the model of ``qk_clip.rule`` is trained once more with
QK-clip after every step (:mod:`experiments.toy.clip`): the summary compares
the largest max logit and the losses without and with the clip. Then, if
``comparison.sweep.seq_lens`` is set, each rule's train step is timed and
measured at growing sequence lengths (see :mod:`experiments.toy.sweep`).

Writes under ``output_dir/name/``: ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per run and step), ``summary.json``,
``report.md``, ``loss_curves.png``, ``eval_curves.png`` (a corpus's held-out
loss per evaluation), ``qk_clip.png`` (with a clip run), ``length_sweep.png`` and
``attention_layer<i>.png`` (heat maps of the trained heads on a held-out
sample). A progress bar shows step, loss and speed. Memory is in MiB (2**20
bytes), in the tables and in the ``*_mb`` fields alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from experiments import _cli
from experiments.toy import clip, corpus, report, sweep, training
from experiments.toy import config as config_lib
from experiments.toy import model as model_lib


def parse_args(argv=None) -> argparse.Namespace:
  parser = _cli.parser("train", __doc__, config=False, quick=None, out_dir=None)
  parser.add_argument("--config", required=True, help="a YAML file, e.g. configs/copy.yaml")
  parser.add_argument(
    "--set",
    dest="overrides",
    nargs="+",
    action="extend",
    default=[],
    metavar="KEY=VALUE",
    help="override config keys, e.g. training.steps=100 task.length=8",
  )
  return parser.parse_args(argv)


def _progress(enabled: bool):
  from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
  )

  return Progress(
    TextColumn("{task.description:<10}"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("loss {task.fields[loss]:.3e}"),
    TextColumn("{task.fields[ms]:6.1f} ms/step"),
    TimeElapsedColumn(),
    TimeRemainingColumn(),
    disable=not enabled,
    transient=False,
  )


# Heat maps of a corpus model are drawn on this many characters of a held-out window.
HEAT_MAP_CHARS = 32


def heat_map_sample(cfg: config_lib.Config, held_out: list) -> np.ndarray:
  """The held-out sequence the heat maps show: the first one of a toy task; for a corpus,
  the first ``HEAT_MAP_CHARS + 1`` characters of the first batch's window that holds the
  most distinct characters (text rather than a run of spaces)."""
  rows = np.asarray(held_out[0].tokens)
  if not cfg.task.is_corpus:
    return rows[0]
  rows = rows[:, : HEAT_MAP_CHARS + 1]
  return rows[int(np.argmax([np.unique(row).size for row in rows]))]


def _largest_diff(records: list[dict], reference: list[dict] | None, key: str) -> float | None:
  """max |a − b| of ``key`` over the steps both runs recorded it, or None without ``reference``."""
  if reference is None:
    return None
  pairs = [(a[key], b[key]) for a, b in zip(records, reference) if key in a and key in b]
  return max(abs(a - b) for a, b in pairs) if pairs else None


def _rule_summary(
  records: list[dict],
  reference: list[dict] | None,
  grad_diff: float | None,
  step_bytes: int | None,
) -> dict:
  final = records[-1]
  summary = dict(
    final_accuracy=final["eval_exact_match"],
    final_token_accuracy=final["eval_token_accuracy"],
    final_loss=final["loss"],
    final_eval_loss=final["eval_loss"],
    final_eval_bits_per_token=final["eval_bits_per_token"],
    max_abs_loss_diff_vs_autodiff=_largest_diff(records, reference, "loss"),
    max_abs_eval_loss_diff_vs_autodiff=_largest_diff(records, reference, "eval_loss"),
    grad_rel_diff_step0=grad_diff,
    median_step_ms=statistics.median(r["step_ms"] for r in records),
    peak_mem_mb=None if step_bytes is None else step_bytes / 2**20,
  )
  if "max_logit" in final:
    summary["peak_max_logit"] = max(r["max_logit"] for r in records)
    summary["max_abs_max_logit_diff_vs_autodiff"] = _largest_diff(records, reference, "max_logit")
  return summary


def _spread(records: dict[str, list[dict]], key: str) -> float:
  """The largest difference between the runs' ``key`` at one step (max − min), over the
  steps where every run recorded it."""
  steps = zip(*records.values())
  return max(
    (max(v) - min(v) for v in ([r[key] for r in rs if key in r] for rs in steps) if v),
    default=0.0,
  )


def _clip_summary(cfg: config_lib.Config, records: dict[str, list[dict]]) -> dict | None:
  """The QK-clip run against its rule's run without the clip; None without a clip run."""
  qk = cfg.qk_clip
  if qk.threshold is None:
    return None
  return clip.compare(
    records[qk.rule],
    records[f"{qk.rule}+qk_clip"],
    threshold=qk.threshold,
    rule=qk.rule,
    alpha=qk.alpha,
  )


def heat_maps(
  cfg, task: training.AnyTask, trainer: training.Trainer, sequence: np.ndarray, run_dir
) -> list[str]:
  """Each layer's heads on one held-out ``sequence`` (L,), as attention_layer<i>.png."""
  from jattn import viz

  tokens = sequence[None, :-1]
  # The weights are materialised, so read them through an xla model holding these params.
  viewer = model_lib.build(cfg.model, task.vocab_size, "autodiff", cfg.training.seed)
  nnx.update(viewer, trainer.state.params)
  names = task.token_names(tokens[0])
  files = []
  for layer, weights in enumerate(model_lib.attention_weights(viewer, jnp.asarray(tokens))):
    fig = viz.plot_attention(
      np.asarray(weights[0]),
      tokens=names,
      titles=[f"layer {layer} head {h}" for h in range(weights.shape[1])],
    )
    name = f"attention_layer{layer}.png"
    fig.savefig(run_dir / name, dpi=100)
    files.append(name)
  return files


def _train_all(
  cfg: config_lib.Config,
  task: training.AnyTask,
  trainers: list[training.Trainer],
  held_out: list,
  run_dir: pathlib.Path,
  log,
) -> dict[str, list[dict]]:
  """Trains each trainer in turn on the same batches; its records by its label, written to
  ``metrics.jsonl`` as they come."""
  records: dict[str, list[dict]] = {}
  with (
    open(run_dir / "metrics.jsonl", "w") as metrics_file,
    _progress(cfg.training.progress) as progress,
  ):
    for trainer in trainers:
      bar = progress.add_task(trainer.label, total=cfg.training.steps, loss=float("nan"), ms=0.0)

      def on_step(record, bar=bar):
        metrics_file.write(json.dumps(record) + "\n")
        progress.update(bar, advance=1, loss=record["loss"], ms=record["step_ms"])

      start = time.perf_counter()
      records[trainer.label] = recs = training.train(
        trainer,
        training.train_batches(cfg, task),
        held_out,
        eval_every=cfg.training.eval_every,
        on_step=on_step,
      )
      if not cfg.training.progress:
        final = recs[-1]
        score = (
          f"held-out loss {final['eval_loss']:.3f} nats "
          f"({final['eval_bits_per_token']:.3f} bits) per character"
          if cfg.task.is_corpus
          else f"exact match {final['eval_exact_match']:.1%}"
        )
        log(
          f"{trainer.label}: {cfg.training.steps} steps in "
          f"{time.perf_counter() - start:.1f} s, {score}"
        )
  return records


def _plots(
  cfg: config_lib.Config,
  task: training.AnyTask,
  trainers: dict[str, training.Trainer],
  records: dict[str, list[dict]],
  sample: np.ndarray,
  run_dir: pathlib.Path,
) -> tuple[list[str], list[str]]:
  """The loss curves, the QK-clip comparison and the heat maps; (files, notes)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return [], ['matplotlib is not installed, so no plots were drawn: pip install -e ".[viz]"']
  rules = {rule: records[rule] for rule in trainers}
  report.loss_curves(
    {r: [x["loss"] for x in recs] for r, recs in rules.items()}, run_dir / "loss_curves.png"
  )
  files = ["loss_curves.png"]
  if cfg.task.is_corpus:
    report.eval_curves(rules, run_dir / "eval_curves.png")
    files.append("eval_curves.png")
  if cfg.qk_clip.threshold is not None:
    rule = cfg.qk_clip.rule
    report.qk_clip_curves(
      records[rule], records[f"{rule}+qk_clip"], cfg.qk_clip.threshold, run_dir / "qk_clip.png"
    )
    files.append("qk_clip.png")
  heat_rule = cfg.comparison.heatmap_rule or cfg.comparison.rules[-1]
  files += heat_maps(cfg, task, trainers[heat_rule], sample, run_dir)
  which = "a" if cfg.task.is_corpus else "the first"
  return files, [f"Heat maps: the {heat_rule} model's heads on {which} held-out sequence."]


def _sweep(cfg: config_lib.Config, config_path: pathlib.Path, run_dir, rules, plots, log):
  """The sequence-length sweep's rows (none without ``comparison.sweep.seq_lens``) and its
  plot's file name, if drawn."""
  if not cfg.comparison.sweep.seq_lens:
    return [], []
  log(
    f"sweep: {len(cfg.comparison.sweep.seq_lens)} lengths x {len(rules)} rules, "
    "one process per cell"
  )
  rows = sweep.sweep(
    config_path,
    cfg,
    on_cell=lambda r: log(
      f"  T={r['seq_len']:>6} {r['rule']:<10} {r['status']}"
      + (
        f"  {r['median_step_ms']:.0f} ms/step, step memory {r['step_mem_mb']:.0f} MiB, "
        f"peak RSS {r['peak_rss_mb']:.0f} MiB"
        if r["status"] == "ok"
        else ""
      )
    ),
  )
  if not plots:
    return rows, []
  report.length_sweep(rows, list(rules), run_dir / "length_sweep.png")
  return rows, ["length_sweep.png"]


def _task_facts(task: training.AnyTask) -> dict:
  facts = dict(
    seq_len=task.seq_len, num_answer_tokens=task.num_answer_tokens, vocab_size=task.vocab_size
  )
  return {**facts, **task.facts()} if isinstance(task, corpus.CharTask) else facts


def run(cfg: config_lib.Config, *, log=print) -> dict:
  """The whole experiment for a checked config; returns the summary it writes."""
  began = time.perf_counter()
  run_dir = cfg.run_dir
  run_dir.mkdir(parents=True, exist_ok=True)
  config_path = run_dir / "config.yaml"
  config_path.write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
  task = cfg.task.make()
  held_out = training.eval_batches(cfg, task)
  first = training.as_jax(task.batch(cfg.training.batch_size, seed=cfg.training.seed, index=0))

  trainers = {rule: training.Trainer(cfg, task, rule) for rule in cfg.comparison.rules}
  grads = {rule: t.gradients(first) for rule, t in trainers.items()}
  num_params = sum(
    int(np.size(p)) for p in jax.tree.leaves(next(iter(trainers.values())).state.params)
  )
  clipped = []
  if cfg.qk_clip.threshold is not None:
    clipped.append(training.Trainer(cfg, task, cfg.qk_clip.rule, qk_clip=True))
  records = _train_all(cfg, task, [*trainers.values(), *clipped], held_out, run_dir, log)

  reference = records.get("autodiff")
  rules = {}
  for rule in trainers:
    grad_diff = (
      training.relative_difference(grads[rule], grads["autodiff"]) if "autodiff" in grads else None
    )
    rules[rule] = _rule_summary(records[rule], reference, grad_diff, trainers[rule].step_bytes)

  plots, notes = _plots(cfg, task, trainers, records, heat_map_sample(cfg, held_out), run_dir)
  sweep_rows, sweep_plot = _sweep(cfg, config_path, run_dir, trainers, bool(plots), log)
  by_rule = {rule: records[rule] for rule in trainers}
  summary = dict(
    config=config_lib.to_dict(cfg),
    platform=jax.devices()[0].platform,
    python=platform.python_version(),
    jax=jax.__version__,
    task=_task_facts(task),
    num_params=num_params,
    rules=rules,
    rules_spread=dict(loss=_spread(by_rule, "loss"), eval_loss=_spread(by_rule, "eval_loss")),
    qk_clip=_clip_summary(cfg, records),
    sweep=sweep_rows,
    files=["config.yaml", "metrics.jsonl", "summary.json", "report.md", *plots, *sweep_plot],
    notes=notes,
    wall_s=time.perf_counter() - began,
  )
  (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
  (run_dir / "report.md").write_text(report.markdown(summary))
  return summary


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = _cli.config_or_exit("train", lambda a: config_lib.load(a.config, a.overrides), args)
  summary = run(cfg)
  print()
  print(report.tables(summary))
  if summary["sweep"]:
    print()
    print(report.sweep_table(summary["sweep"], list(summary["rules"])))
  print(f"\nwrote {cfg.run_dir}/: {', '.join(summary['files'])}")
  return summary


if __name__ == "__main__":
  main()
