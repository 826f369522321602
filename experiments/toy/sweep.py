"""Step time and memory of each backward rule against sequence length.

Each (rule, sequence length) cell runs in a fresh process so that its peak
memory is its own, under two caps from ``comparison.sweep``: an address-space
limit (``memory_limit_mb``, set with ``RLIMIT_AS`` before JAX starts; it stands
in for an accelerator with that much memory) and a wall-clock limit
(``timeout_s``). A cell that hits either, or fails otherwise, is recorded with
its reason and the sweep goes on.

A cell builds the run's model for its rule and trains it for a warm-up step
plus ``steps`` timed steps on uniformly random tokens of length T with the
loss on every position: it measures cost, not learning. It reports the median
step time, XLA's buffer assignment for the step (arguments + outputs +
temporaries) and the process's peak resident memory (VmHWM).

    python -m experiments.toy.sweep RUN_DIR/config.yaml RULE T LIMIT_MIB   # one cell, prints JSON
"""

from __future__ import annotations

import json
import pathlib
import resource
import statistics
import subprocess
import sys

from experiments._memory import peak_rss_mb

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_cell(config_path: str, rule: str, seq_len: int) -> dict:
  """The body of one cell (in its own process): returns its measurements."""
  import numpy as np

  from experiments.toy import config as config_lib
  from experiments.toy import tasks as tasks_lib
  from experiments.toy import training

  cfg = config_lib.load(config_path)
  sweep = cfg.comparison.sweep
  task = cfg.task.make()
  trainer = training.Trainer(cfg, task, rule)
  rng = np.random.default_rng([cfg.training.seed, seq_len])
  tokens = rng.integers(0, task.vocab_size, (sweep.batch_size, seq_len + 1), dtype=np.int32)
  batch = training.as_jax(tasks_lib.Batch(tokens, np.ones_like(tokens, dtype=bool)))
  step_bytes = trainer.compile(batch)
  trainer.step(batch)  # warm-up
  times = [trainer.step(batch)["step_ms"] for _ in range(sweep.steps)]
  return dict(
    rule=rule,
    seq_len=seq_len,
    status="ok",
    median_step_ms=statistics.median(times),
    step_mem_mb=None if step_bytes is None else step_bytes / 2**20,
    peak_rss_mb=peak_rss_mb(),
  )


def limit_memory(limit_mb: int) -> None:
  """Caps this process's address space; allocations past it fail (JAX: out of memory)."""
  limit = limit_mb * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _failure(stderr: str) -> str:
  lines = [l.strip() for l in stderr.strip().splitlines() if l.strip()]
  text = "\n".join(lines)
  if "Out of memory" in text or "MemoryError" in text or "RESOURCE_EXHAUSTED" in text:
    return "out of memory"
  return f"failed: {lines[-1][:200]}" if lines else "failed"


def sweep(config_path: str | pathlib.Path, cfg, *, on_cell=lambda row: None) -> list[dict]:
  """Every (rule, seq_len) cell of ``cfg.comparison.sweep``, each in a capped subprocess.

  Once a rule fails at a length it is not tried at longer ones (recorded as
  ``skipped``): its cost only grows with T.
  """
  s = cfg.comparison.sweep
  rows: list[dict] = []
  failed: dict = {}
  for seq_len in s.seq_lens:
    for rule in cfg.comparison.rules:
      base = dict(
        rule=rule, seq_len=seq_len, median_step_ms=None, step_mem_mb=None, peak_rss_mb=None
      )
      if rule in failed:
        row = {**base, "status": f"skipped (failed at T={failed[rule]})"}
      else:
        cmd = [
          sys.executable,
          "-m",
          "experiments.toy.sweep",
          str(pathlib.Path(config_path).resolve()),
          rule,
          str(seq_len),
          str(s.memory_limit_mb),
        ]
        try:
          proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=s.timeout_s)
        except subprocess.TimeoutExpired:
          row = {**base, "status": f"timed out (> {s.timeout_s:g} s)"}
        else:
          if proc.returncode == 0:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
          else:
            reason = _failure(proc.stderr)
            if reason == "out of memory":
              reason += f" (cap {s.memory_limit_mb} MiB)"
            row = {**base, "status": reason}
        if row["status"] != "ok":
          failed[rule] = seq_len
      rows.append(row)
      on_cell(row)
  return rows


def main(argv=None) -> None:
  config_path, rule, seq_len, limit_mb = sys.argv[1:] if argv is None else argv
  limit_memory(int(limit_mb))  # before JAX is imported (run_cell imports it)
  print(json.dumps(run_cell(config_path, rule, int(seq_len))))


if __name__ == "__main__":
  main()
