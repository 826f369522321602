"""The run's report: summary tables in Markdown and the loss-curve and sweep plots.

Plots need matplotlib (``pip install -e ".[viz]"``); without it the report
says so and the numbers are still written. Figures are built with
``matplotlib.figure.Figure`` directly, so no display backend is involved.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments._timing import fmt


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


def markdown(summary: dict) -> str:
  cfg = summary["config"]
  m, t, tr = cfg["model"], cfg["task"], cfg["training"]
  task = summary["task"]
  out = [
    f"# {cfg['name']}: backward rules compared",
    "",
    f"Task `{t['name']}` (length {t['length']}, {t['num_symbols']} symbols; sequences of "
    f"{task['seq_len']} tokens, {task['num_answer_tokens']} answer token(s)). Model: "
    f"{m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads, "
    f"{m['positions']} positions, {summary['num_params']:,} parameters. "
    f"{tr['steps']} steps of batch {tr['batch_size']}, seed {tr['seed']}; every rule starts "
    f"from the same parameters and sees the same batches. Exact match is over "
    f"{tr['eval_samples']} held-out sequences. Platform: {summary['platform']}.",
    "",
    rules_table(summary["rules"]),
    "",
    "Step memory is XLA's buffer assignment for one compiled train step (arguments, "
    "outputs and temporaries live at once). Gradient difference: ‖g − g_autodiff‖ / "
    "‖g_autodiff‖ over all parameters on the first batch.",
  ]
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
