"""The run's report: summary tables in Markdown and the loss-curve, QK-clip and sweep plots.

Plots need matplotlib (``pip install -e ".[viz]"``); without it the report
says so and the numbers are still written. Figures are built with
``matplotlib.figure.Figure`` directly, so no display backend is involved.
A corpus run's summary (its ``task`` has a ``corpus``) is reported per
character: held-out loss in nats and bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from experiments._timing import fmt

LN2 = math.log(2)


def rules_table(rules: dict) -> str:
  lines = [
    "| rule | final exact match | final loss | max \\|Δloss\\| vs autodiff "
    "| grad rel. diff (step 0) | median step ms | step memory MiB |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, r in rules.items():
    lines.append(
      f"| {name} | {fmt(r['final_accuracy'], '.1%')} | {fmt(r['final_loss'], '.2e')} | "
      f"{fmt(r['max_abs_loss_diff_vs_autodiff'], '.1e')} | "
      f"{fmt(r['grad_rel_diff_step0'], '.1e')} | {fmt(r['median_step_ms'], '.1f')} | "
      f"{fmt(r['peak_mem_mb'], '.1f')} |"
    )
  return "\n".join(lines)


def lm_rules_table(rules: dict) -> str:
  """A corpus run's rules: held-out loss per character, and how far each is from autodiff."""
  lines = [
    "| rule | held-out loss (nats/char) | bits/char | final train loss "
    "| max \\|Δloss\\| vs autodiff | max \\|Δ held-out loss\\| vs autodiff "
    "| grad rel. diff (step 0) | median step ms | step memory MiB |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in rules.items():
    lines.append(
      f"| {name} | {fmt(r['final_eval_loss'], '.4f')} | "
      f"{fmt(r['final_eval_bits_per_token'], '.4f')} | {fmt(r['final_loss'], '.4f')} | "
      f"{fmt(r['max_abs_loss_diff_vs_autodiff'], '.1e')} | "
      f"{fmt(r['max_abs_eval_loss_diff_vs_autodiff'], '.1e')} | "
      f"{fmt(r['grad_rel_diff_step0'], '.1e')} | {fmt(r['median_step_ms'], '.1f')} | "
      f"{fmt(r['peak_mem_mb'], '.1f')} |"
    )
  return "\n".join(lines)


def clip_table(qk: dict) -> str:
  """The QK-clip run against the same rule without the clip: max logits and losses."""
  lines = [
    "| run | peak max logit (step) | final max logit | steps above τ | largest rise in a step "
    "| final train loss | held-out loss (nats/char) | bits/char |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, side in ((f"{qk['rule']}", qk["without"]), (f"{qk['rule']} + QK-clip", qk["clipped"])):
    lines.append(
      f"| {name} | {side['peak_max_logit']:.2f} ({side['peak_step']}) | "
      f"{side['final_max_logit']:.2f} | {side['steps_above_threshold']} | "
      f"{side['largest_rise_per_step']:.2f} | {side['final_loss']:.4f} | "
      f"{side['final_eval_loss']:.4f} | {side['final_eval_bits_per_token']:.4f} |"
    )
  return "\n".join(lines)


def tables(summary: dict) -> str:
  """The rules' table (per character for a corpus), then the QK-clip table if there is one."""
  rules = summary["rules"]
  out = [lm_rules_table(rules) if "corpus" in summary["task"] else rules_table(rules)]
  if summary.get("qk_clip"):
    out += ["", clip_table(summary["qk_clip"])]
  return "\n".join(out)


def sweep_table(rows: Sequence[dict], rules: Sequence[str]) -> str:
  """One row per length, one column per rule: 'ms / MiB (peak RSS MiB)' or the failure."""
  lengths = sorted({r["seq_len"] for r in rows})
  lines = ["| T | " + " | ".join(rules) + " |", "|---|" + "---|" * len(rules)]
  for T in lengths:
    cells = []
    for rule in rules:
      row = next((r for r in rows if r["seq_len"] == T and r["rule"] == rule), None)
      if row is None:
        cells.append("—")
      elif row["status"] != "ok":
        cells.append(row["status"])
      else:
        cells.append(
          f"{row['median_step_ms']:.0f} ms, {fmt(row['step_mem_mb'], '.0f')} MiB "
          f"(RSS {row['peak_rss_mb']:.0f} MiB)"
        )
    lines.append(f"| {T} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def setting(summary: dict) -> str:
  """The paragraph that says what was trained on what."""
  cfg = summary["config"]
  m, t, tr = cfg["model"], cfg["task"], cfg["training"]
  task = summary["task"]
  model = (
    f"Model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads, "
    f"{m['positions']} positions, {summary['num_params']:,} parameters. "
    f"{tr['steps']} steps of batch {tr['batch_size']}, seed {tr['seed']}; every rule starts "
    f"from the same parameters and sees the same batches."
  )
  if "corpus" not in task:
    return (
      f"Task `{t['name']}` (length {t['length']}, {t['num_symbols']} symbols; sequences of "
      f"{task['seq_len']} tokens, {task['num_answer_tokens']} answer token(s)). {model} "
      f"Exact match is over {tr['eval_samples']} held-out sequences. "
      f"Platform: {summary['platform']}."
    )
  return (
    f"Corpus `{task['corpus']}` on Python {summary['python']}: {task['chars']:,} characters, "
    f"{task['vocab_size']} distinct; the first {task['train_chars']:,} for training, the last "
    f"{task['eval_chars']:,} held out. Windows of {task['seq_len']} characters, the "
    f"loss on every next character. {model} Held-out loss over {tr['eval_samples']} "
    f"windows every {tr['eval_every']} steps; platform {summary['platform']}, jax "
    f"{summary['jax']}, {summary['wall_s']:.0f} s in all."
  )


def spread_line(summary: dict) -> str:
  """How far apart the rules' losses came at any one step."""
  s = summary["rules_spread"]
  return (
    f"The rules' losses differ by at most {s['loss']:.1e} (training) and "
    f"{s['eval_loss']:.1e} (held out) at any one step."
  )


def clip_line(qk: dict) -> str:
  """What the QK-clip run did, in one paragraph of numbers."""
  without, clipped = qk["without"], qk["clipped"]
  return (
    f"The {qk['rule']} model trained again with QK-clip at τ = {qk['threshold']:g} "
    f"(α = {qk['alpha']:g}): after every update, each head whose largest logit in that "
    f"step's forward pass exceeded τ has its query and key projections scaled down by "
    f"τ / max. Without the clip the largest max logit reached {without['peak_max_logit']:.2f} "
    f"(step {without['peak_step']}), above τ in {without['steps_above_threshold']} steps; "
    f"with it {clipped['peak_max_logit']:.2f} (step {clipped['peak_step']}), "
    f"{clipped['final_max_logit']:.2f} at the end. Held-out loss "
    f"{without['final_eval_loss']:.4f} without, {clipped['final_eval_loss']:.4f} with the clip."
  )


def markdown(summary: dict) -> str:
  cfg = summary["config"]
  corpus = "corpus" in summary["task"]
  title = "a character-level language model" if corpus else "backward rules compared"
  out = [
    f"# {cfg['name']}: {title}",
    "",
    setting(summary),
    "",
    tables({**summary, "qk_clip": None}),
    "",
    *([spread_line(summary), ""] if corpus else []),
    "Step memory is XLA's buffer assignment for one compiled train step (arguments, "
    "outputs and temporaries live at once). Gradient difference: ‖g − g_autodiff‖ / "
    "‖g_autodiff‖ over all parameters on the first batch.",
  ]
  if summary.get("qk_clip"):
    out += ["", "## QK-clip", "", clip_line(summary["qk_clip"]), "", clip_table(summary["qk_clip"])]
  if summary.get("sweep"):
    s = cfg["comparison"]["sweep"]
    out += [
      "",
      "## Sequence-length sweep",
      "",
      f"Median of {s['steps']} train steps at batch {s['batch_size']} on random tokens, "
      f"each cell in a fresh process capped at {s['memory_limit_mb']} MiB of address "
      f"space and {s['timeout_s']:g} s.",
      "",
      sweep_table(summary["sweep"], list(summary["rules"])),
    ]
  out += ["", "## Files", ""]
  out += [f"- `{name}`" for name in summary["files"]]
  if summary.get("notes"):
    out += ["", "## Notes", ""] + [f"- {n}" for n in summary["notes"]]
  return "\n".join(out) + "\n"


def _figure(ncols: int):
  from matplotlib.figure import Figure

  fig = Figure(figsize=(5.2 * ncols, 3.8), layout="constrained")
  return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def loss_curves(losses: dict, path) -> None:
  """Loss per step for each rule, and each rule's |loss − autodiff loss|."""
  fig, (ax, diff) = _figure(2)
  colors = {rule: f"C{i}" for i, rule in enumerate(losses)}
  for rule, values in losses.items():
    ax.plot(range(1, len(values) + 1), values, label=rule, lw=1.2, color=colors[rule])
  ax.set(yscale="log", xlabel="step", ylabel="training loss (answer tokens)", title="loss per step")
  ax.legend()
  reference = losses.get("autodiff")
  if reference is not None:
    for rule, values in losses.items():
      if rule == "autodiff":
        continue
      d = [abs(a - b) for a, b in zip(values, reference)]
      diff.plot(
        range(1, len(d) + 1),
        [x if x > 0 else float("nan") for x in d],
        ".",
        label=rule,
        ms=3,
        color=colors[rule],
      )
    diff.set(
      yscale="log",
      xlabel="step",
      ylabel="|loss − autodiff loss|",
      title="difference from autodiff (zeros not drawn)",
    )
    if len(losses) > 1:
      diff.legend()
  else:
    diff.set_axis_off()
  fig.savefig(path, dpi=120)


def _held_out(records: Sequence[dict]) -> tuple[list[int], list[float]]:
  """The steps with a held-out evaluation and their losses."""
  evals = [r for r in records if "eval_loss" in r]
  return [r["step"] for r in evals], [r["eval_loss"] for r in evals]


def _bits_axis(ax) -> None:
  """A right-hand axis in bits for a left-hand axis in nats."""
  ax.secondary_yaxis("right", functions=(lambda x: x / LN2, lambda b: b * LN2)).set_ylabel(
    "bits per character"
  )


def eval_curves(records: dict, path) -> None:
  """Held-out loss per evaluation (markers) over the training loss per step (faint), per rule."""
  fig, (ax,) = _figure(1)
  fig.set_size_inches(7.0, 4.2)
  for i, (rule, recs) in enumerate(records.items()):
    steps = [r["step"] for r in recs]
    ax.plot(steps, [r["loss"] for r in recs], lw=0.8, alpha=0.35, color=f"C{i}")
    size = 3.5 + 2.5 * (len(records) - 1 - i)  # the first rule's markers largest: equal curves
    ax.plot(*_held_out(recs), "o-", ms=size, lw=1.2, color=f"C{i}", label=f"{rule} (held out)")
  ax.set(xlabel="step", ylabel="loss (nats per character)", title="held-out and training loss")
  _bits_axis(ax)
  ax.legend(title="faint: training loss per step", title_fontsize=8)
  fig.savefig(path, dpi=120)


def qk_clip_curves(without: Sequence[dict], clipped: Sequence[dict], threshold: float, path):
  """Loss, and the largest max logit per step (each layer's faint), without and with QK-clip."""
  fig, (loss_ax, logit_ax) = _figure(2)
  runs = (("no clip", without, "C0"), (f"QK-clip τ = {threshold:g}", clipped, "C3"))
  for name, recs, color in runs:
    steps = [r["step"] for r in recs]
    loss_ax.plot(steps, [r["loss"] for r in recs], lw=0.8, alpha=0.35, color=color)
    loss_ax.plot(*_held_out(recs), "o-", ms=3.5, lw=1.2, color=color, label=f"{name} (held out)")
    logit_ax.plot(steps, [r["max_logit"] for r in recs], lw=1.4, color=color, label=name)
    for layer in zip(*(r["max_logit_heads"] for r in recs)):
      logit_ax.plot(steps, [max(h) for h in layer], lw=0.7, alpha=0.4, color=color)
  loss_ax.set(xlabel="step", ylabel="loss (nats per character)", title="loss (faint: training)")
  _bits_axis(loss_ax)
  loss_ax.legend()
  logit_ax.axhline(threshold, color="k", ls="--", lw=1.0, label=f"τ = {threshold:g}")
  logit_ax.set(
    xlabel="step",
    ylabel="largest attention logit",
    title="largest max logit (faint: each layer's)",
  )
  logit_ax.legend()
  fig.savefig(path, dpi=120)


def length_sweep(rows: Sequence[dict], rules: Sequence[str], path) -> None:
  """Step time and step memory against T (log-log); failures listed under the axes."""
  fig, (time_ax, mem_ax) = _figure(2)
  failures = []
  for rule in rules:
    ok = [r for r in rows if r["rule"] == rule and r["status"] == "ok"]
    bad = [
      r
      for r in rows
      if r["rule"] == rule and r["status"] != "ok" and not r["status"].startswith("skipped")
    ]
    failures += [f"{rule}: {r['status']} at T={r['seq_len']}" for r in bad]
    if ok:
      T = [r["seq_len"] for r in ok]
      time_ax.plot(T, [r["median_step_ms"] for r in ok], "o-", label=rule)
      if all(r["step_mem_mb"] is not None for r in ok):
        mem_ax.plot(T, [r["step_mem_mb"] for r in ok], "o-", label=rule)
  time_ax.set(
    xscale="log",
    yscale="log",
    xlabel="sequence length T",
    ylabel="median train step (ms)",
    title="step time",
  )
  mem_ax.set(
    xscale="log",
    yscale="log",
    xlabel="sequence length T",
    ylabel="XLA step memory (MiB)",
    title="step memory",
  )
  for ax in (time_ax, mem_ax):
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  if failures:
    fig.suptitle("; ".join(failures), fontsize=8)
  fig.savefig(path, dpi=120)
