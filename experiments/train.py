"""Train one toy transformer per backward rule from a config file and compare them.

    python -m experiments.train --config configs/compare_backward.yaml
    python -m experiments.train --config configs/copy.yaml --set training.steps=200 model.d_model=32

For each rule in ``comparison.rules`` — ``autodiff`` (jattn xla + JAX
autodiff), ``custom_vjp`` (jattn xla + its explicit backward rule),
``blockwise`` (jattn blockwise + recompute) — the same model, from the same
initial parameters, is trained on the same batches of the configured task.
Then, if ``comparison.sweep.seq_lens`` is set, each rule's train step is timed
and measured at growing sequence lengths (see :mod:`experiments.toy.sweep`).

Writes under ``output_dir/name/``: ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per rule and step), ``summary.json``,
``report.md``, ``loss_curves.png``, ``length_sweep.png`` and
``attention_layer<i>.png`` (heat maps of the trained heads on a held-out
sample). A progress bar shows step, loss and speed. Memory is in MiB (2**20
bytes), in the tables and in the ``*_mb`` fields alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import numpy as np
import yaml
from flax import nnx

from experiments import _cli
from experiments.toy import config as config_lib
from experiments.toy import model as model_lib
from experiments.toy import report, sweep, training


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


def _rule_summary(
  records: list[dict],
  reference: list[float] | None,
  grad_diff: float | None,
  step_bytes: int | None,
) -> dict:
  losses = [r["loss"] for r in records]
  final = records[-1]
  return dict(
    final_accuracy=final["eval_exact_match"],
    final_token_accuracy=final["eval_token_accuracy"],
    final_loss=losses[-1],
    final_eval_loss=final["eval_loss"],
    max_abs_loss_diff_vs_autodiff=(
      None if reference is None else max(abs(a - b) for a, b in zip(losses, reference))
    ),
    grad_rel_diff_step0=grad_diff,
    median_step_ms=statistics.median(r["step_ms"] for r in records),
    peak_mem_mb=None if step_bytes is None else step_bytes / 2**20,
  )


def heat_maps(
  cfg, task, trainer: training.Trainer, sequence: jax.Array, run_dir: pathlib.Path
) -> list[str]:
  """Each layer's heads on one held-out ``sequence`` (L,), as attention_layer<i>.png."""
  from jattn import viz

  tokens = sequence[None, :-1]
  # The weights are materialised, so read them through an xla model holding these params.
  viewer = model_lib.build(cfg.model, task.vocab_size, "autodiff", cfg.training.seed)
  nnx.update(viewer, trainer.state.params)
  names = task.token_names(tokens[0])
  files = []
  for layer, weights in enumerate(model_lib.attention_weights(viewer, tokens)):
    fig = viz.plot_attention(
      np.asarray(weights[0]),
      tokens=names,
      titles=[f"layer {layer} head {h}" for h in range(weights.shape[1])],
    )
    name = f"attention_layer{layer}.png"
    fig.savefig(run_dir / name, dpi=100)
    files.append(name)
  return files


def run(cfg: config_lib.Config, *, log=print) -> dict:
  """The whole experiment for a checked config; returns the summary it writes."""
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
  records: dict[str, list[dict]] = {}
  with (
    open(run_dir / "metrics.jsonl", "w") as metrics_file,
    _progress(cfg.training.progress) as progress,
  ):
    for rule, trainer in trainers.items():
      bar = progress.add_task(rule, total=cfg.training.steps, loss=float("nan"), ms=0.0)

      def on_step(record, bar=bar):
        metrics_file.write(json.dumps(record) + "\n")
        progress.update(bar, advance=1, loss=record["loss"], ms=record["step_ms"])

      start = time.perf_counter()
      records[rule] = training.train(
        trainer,
        training.train_batches(cfg, task),
        held_out,
        eval_every=cfg.training.eval_every,
        on_step=on_step,
      )
      if not cfg.training.progress:
        log(
          f"{rule}: {cfg.training.steps} steps in {time.perf_counter() - start:.1f} s, "
          f"exact match {records[rule][-1]['eval_exact_match']:.1%}"
        )

  reference = [r["loss"] for r in records["autodiff"]] if "autodiff" in records else None
  rules = {}
  for rule in trainers:
    grad_diff = (
      training.relative_difference(grads[rule], grads["autodiff"]) if "autodiff" in grads else None
    )
    rules[rule] = _rule_summary(records[rule], reference, grad_diff, trainers[rule].step_bytes)

  files = ["config.yaml", "metrics.jsonl", "summary.json", "report.md"]
  notes = []
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    have_plots = False
    notes.append('matplotlib is not installed, so no plots were drawn: pip install -e ".[viz]"')
  else:
    have_plots = True
    report.loss_curves(
      {r: [x["loss"] for x in recs] for r, recs in records.items()}, run_dir / "loss_curves.png"
    )
    files.append("loss_curves.png")
    heat_rule = cfg.comparison.heatmap_rule or cfg.comparison.rules[-1]
    files += heat_maps(cfg, task, trainers[heat_rule], held_out[0].tokens[0], run_dir)
    notes.append(f"Heat maps: the {heat_rule} model's heads on the first held-out sequence.")

  sweep_rows = []
  if cfg.comparison.sweep.seq_lens:
    log(
      f"sweep: {len(cfg.comparison.sweep.seq_lens)} lengths x {len(trainers)} rules, "
      "one process per cell"
    )
    sweep_rows = sweep.sweep(
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
    if have_plots:
      report.length_sweep(sweep_rows, list(trainers), run_dir / "length_sweep.png")
      files.append("length_sweep.png")

  summary = dict(
    config=config_lib.to_dict(cfg),
    platform=jax.devices()[0].platform,
    task=dict(
      seq_len=task.seq_len, num_answer_tokens=task.num_answer_tokens, vocab_size=task.vocab_size
    ),
    num_params=num_params,
    rules=rules,
    sweep=sweep_rows,
    files=files,
    notes=notes,
  )
  (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
  (run_dir / "report.md").write_text(report.markdown(summary))
  return summary


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = _cli.config_or_exit("train", lambda a: config_lib.load(a.config, a.overrides), args)
  summary = run(cfg)
  print()
  print(report.rules_table(summary["rules"]))
  if summary["sweep"]:
    print()
    print(report.sweep_table(summary["sweep"], list(summary["rules"])))
  print(f"\nwrote {cfg.run_dir}/: {', '.join(summary['files'])}")
  return summary


if __name__ == "__main__":
  main()
