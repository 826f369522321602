"""The toy training experiment: configs, model, training step, the three-rule run and its files."""

import contextlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from experiments import train as train_cli
from experiments.toy import config, model, report, sweep, tasks, training

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TRAIN_CONFIGS = [p for p in CONFIGS if not p.name.startswith("bench")]  # benchmark grids

TINY = dict(
  model=dict(d_model=16, num_heads=2, num_layers=1, mlp_ratio=2),
  task=dict(name="copy", length=4, num_symbols=4),
  optimizer=dict(learning_rate=1e-2, warmup_steps=2),
  training=dict(steps=20, batch_size=16, eval_every=10, eval_samples=32, progress=False),
)


def tiny(**sections) -> config.Config:
  data = {k: dict(v) for k, v in TINY.items()}
  for key, value in sections.items():
    data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
  return config.from_dict(config.Config, data)


# ------------------------------------------------------------------ configs


def test_every_task_has_a_config_and_all_load():
  names = {p.stem for p in TRAIN_CONFIGS}
  assert "compare_backward" in names
  loaded = [config.load(p) for p in TRAIN_CONFIGS]
  assert {c.task.name for c in loaded} == set(config.TASKS) > set(tasks.TASKS)
  assert all(c.name == p.stem for c, p in zip(loaded, TRAIN_CONFIGS))


def test_compare_backward_config_is_the_documented_demo():
  cfg = config.load(ROOT / "configs" / "compare_backward.yaml")
  assert cfg.comparison.rules == ("autodiff", "custom_vjp", "blockwise")
  assert cfg.task.name in ("copy", "associative_recall")
  assert len(cfg.comparison.sweep.seq_lens) >= 2


def test_defaults_and_overrides(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text("model: {d_model: 32}\ntask: {name: reverse}\n")
  cfg = config.load(
    path,
    [
      "training.steps=7",
      "comparison.sweep.seq_lens=[64, 128]",
      "optimizer.learning_rate=1",
      "model.num_kv_heads=2",
      "optimizer.weight_decay=1e-3",
    ],
  )
  assert cfg.name == "mine" and cfg.model.d_model == 32 and cfg.task.name == "reverse"
  assert cfg.training.steps == 7 and cfg.comparison.sweep.seq_lens == (64, 128)
  assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)
  assert cfg.optimizer.weight_decay == 0.001  # PyYAML reads 1e-3 as a string
  assert cfg.model.num_kv_heads == 2 and cfg.model.num_layers == config.ModelConfig().num_layers
  assert cfg.run_dir == pathlib.Path("runs") / "mine"


def test_resolved_config_round_trips():
  cfg = tiny(comparison=dict(sweep=dict(seq_lens=[8, 16])))
  assert config.from_dict(config.Config, config.to_dict(cfg)) == cfg
  assert config.to_dict(cfg)["comparison"]["sweep"]["seq_lens"] == [8, 16]


@pytest.mark.parametrize(
  "overrides, match",
  [
    # unknown keys: named, with the valid ones listed
    (["colour=red"], r"unknown key 'colour'.*valid keys of the config: name, output_dir, model"),
    (["model.width=3"], r"unknown key 'model.width'.*valid keys of model: d_model, num_heads"),
    (["comparison.sweep.lengths=[1]"], r"'comparison.sweep.lengths'.*seq_lens, batch_size"),
    (["model=3"], r"--set model names a section; set one of its keys: d_model"),
    (["training.steps.x=1"], r"'training.steps' is not a section"),
    (["training.steps"], r"--set expects key=value"),
    # wrong types
    (["model.d_model=abc"], r"'model.d_model' must be int, got str 'abc'"),
    (["model.d_model=64.0"], r"'model.d_model' must be int, got float"),
    (["training.batch_size=true"], r"'training.batch_size' must be int, got bool"),
    (["training.progress=1"], r"'training.progress' must be bool, got int"),
    (["task.name=[copy]"], r"'task.name' must be str"),
    (["comparison.rules=autodiff"], r"'comparison.rules' must be a list of str"),
    (["comparison.sweep.seq_lens=[64, x]"], r"'comparison.sweep.seq_lens' must be a list of int"),
    (["optimizer.learning_rate=fast"], r"'optimizer.learning_rate' must be float"),
    (["model.num_kv_heads=2.5"], r"'model.num_kv_heads' must be int or null"),
    (["comparison.sweep=[1]"], r"--set comparison.sweep names a section"),
    # out of range and choices
    (["model.d_model=0"], r"'model.d_model' must be >= 1, got 0"),
    (["model.positions=alibi"], r"'model.positions' must be one of \['rope', 'sinusoidal'\]"),
    (["model.d_model=30"], r"'model.d_model' \(30\) must be a multiple of 'model.num_heads'"),
    (["model.num_kv_heads=3"], r"'model.num_heads' \(4\) must be a multiple of 'model.num_kv_"),
    (["model.d_model=36"], r"head size .* = 9 must be even"),
    (["model.rope_base=1"], r"'model.rope_base' must be > 1.0"),
    (
      ["task.name=parity"],
      r"'task.name' must be one of \['copy', 'reverse', 'sort', "
      r"'associative_recall', 'long_range', 'pydoc_topics'\]",
    ),
    (
      ["task.name=associative_recall", "task.length=5", "task.num_symbols=8"],
      r"'task': num_symbols \(8\) must be >= 2 \* length \(10\)",
    ),
    (["task.name=long_range", "task.length=4"], r"'task': length must be >= 8"),
    (["task.num_symbols=1"], r"'task.num_symbols' must be >= 2"),
    (["optimizer.learning_rate=0"], r"'optimizer.learning_rate' must be > 0.0"),
    (["optimizer.learning_rate=.nan"], r"'optimizer.learning_rate' must be finite"),
    (["optimizer.final_lr_fraction=1.5"], r"'optimizer.final_lr_fraction' must be <= 1.0"),
    (["optimizer.warmup_steps=-1"], r"'optimizer.warmup_steps' must be >= 0"),
    (["training.steps=0"], r"'training.steps' must be >= 1"),
    (["comparison.rules=[]"], r"'comparison.rules' must be a non-empty list"),
    (["comparison.rules=[autodiff, autodiff]"], r"non-empty list of distinct rules"),
    (
      ["comparison.rules=[flash]"],
      r"'comparison.rules' must be one of \['autodiff', "
      r"'custom_vjp', 'blockwise'\], got 'flash'",
    ),
    (
      ["comparison.rules=[blockwise]", "comparison.heatmap_rule=autodiff"],
      r"'comparison.heatmap_rule' \('autodiff'\) must be one of 'comparison.rules'",
    ),
    (["comparison.sweep.seq_lens=[64, 1]"], r"'comparison.sweep.seq_lens' must be >= 2, got 1"),
    (["comparison.sweep.seq_lens=[64, 32]"], r"'comparison.sweep.seq_lens' must be increasing"),
    (["comparison.sweep.memory_limit_mb=10"], r"'comparison.sweep.memory_limit_mb' must be >= 512"),
    (["comparison.sweep.timeout_s=0"], r"'comparison.sweep.timeout_s' must be > 0.0"),
    (["name=a/b"], r"'name' must be a plain directory name"),
  ],
)
def test_bad_configs_are_rejected_naming_the_key(overrides, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(None, overrides)


@pytest.mark.parametrize(
  "text, match",
  [
    ("model: [1, 2]\n", r"'model' must be a mapping with keys d_model, num_heads"),
    ("- 1\n- 2\n", r"top level must be a mapping with keys name, output_dir"),
    ("model: {d_model: 64\n", r"not valid YAML"),
    ("training: {stepz: 3}\n", r"unknown key 'training.stepz'; valid keys of training: steps"),
  ],
)
def test_bad_files_are_rejected(tmp_path, text, match):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(config.ConfigError, match=match):
    config.load(path)


def test_missing_file_and_dataclass_checks():
  with pytest.raises(config.ConfigError, match=r"cannot read config '.*nope.yaml'"):
    config.load("nope.yaml")
  with pytest.raises(config.ConfigError, match=r"'model.num_layers' must be >= 1"):
    config.ModelConfig(num_layers=0)  # the checks run for configs built in code too
  with pytest.raises(
    config.ConfigError,
    match=r"'comparison.sweep' must be a mapping of "
    r"SweepConfig keys",
  ):
    config.ComparisonConfig(sweep={"seq_lens": (8,)})


def test_cli_reports_config_errors(capsys):
  with pytest.raises(SystemExit, match=r"error: unknown key 'model.depth'.*d_model"):
    train_cli.main(["--config", str(ROOT / "configs" / "copy.yaml"), "--set", "model.depth=2"])


# ------------------------------------------------------------------ model and step


def test_every_rule_starts_from_the_same_parameters():
  cfg = tiny(model=dict(num_kv_heads=1, positions="sinusoidal"))
  states = [nnx.state(model.build(cfg.model, 6, rule, seed=3), nnx.Param) for rule in model.RULES]
  for other in states[1:]:
    jax.tree.map(np.testing.assert_array_equal, states[0], other)
  different = nnx.state(model.build(cfg.model, 6, "autodiff", seed=4), nnx.Param)
  assert not np.array_equal(
    states[0]["embed"]["embedding"][...], different["embed"]["embedding"][...]
  )
  with pytest.raises(ValueError, match=r"unknown rule 'flash'; choose from \['autodiff'"):
    model.build(cfg.model, 6, "flash", seed=0)


@pytest.mark.parametrize("positions", ["rope", "sinusoidal"])
def test_model_is_causal_and_its_weights_are_probabilities(positions):
  cfg = tiny(model=dict(positions=positions, num_layers=2))
  m = model.build(cfg.model, 6, "autodiff", seed=0)
  forward = nnx.jit(lambda m, tokens: m(tokens))  # one program, not one per operation
  tokens = jnp.array([[0, 1, 2, 3, 4, 5, 0, 1]])
  logits = forward(m, tokens)
  assert logits.shape == (1, 8, 6)
  changed = forward(m, tokens.at[0, 5].set(0))  # a later token cannot change earlier predictions
  np.testing.assert_allclose(changed[0, :5], logits[0, :5], atol=1e-6)
  assert not np.allclose(changed[0, 5:], logits[0, 5:])
  weights = model.attention_weights(m, tokens)
  assert len(weights) == 2 and weights[0].shape == (1, 2, 8, 8)
  w = np.asarray(weights[1])
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
  assert np.all(np.triu(w[0, 0], k=1) == 0)


def test_loss_and_metrics_on_a_literal_example():
  # Two rows of four tokens; the answer is the last two tokens of each row.
  tokens = jnp.array([[0, 1, 2, 0], [1, 0, 1, 2]])
  answer = jnp.array([[False, False, True, True]] * 2)
  logits = jnp.full((2, 3, 3), -10.0)
  # row 0 predicts 1, 2, 0 (all right); row 1 predicts 0, 1, 1 (last answer wrong)
  logits = logits.at[0, [0, 1, 2], [1, 2, 0]].set(10.0).at[1, [0, 1, 2], [0, 1, 1]].set(10.0)
  loss, metrics = jax.jit(training.loss_and_metrics)(logits, tasks.Batch(tokens, answer))
  assert float(metrics["exact_match"]) == 0.5
  assert float(metrics["token_accuracy"]) == 0.75
  # three confident right answers (≈0 loss) and one wrong by a margin of 20 (≈20)
  lse = np.log(np.exp(10) + 2 * np.exp(-10))
  expected = (3 * (lse - 10) + (lse + 10)) / 4
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_schedule_warms_up_then_decays_to_the_final_fraction():
  cfg = config.OptimizerConfig(learning_rate=0.5, warmup_steps=4, final_lr_fraction=0.2)
  tx = training.make_optimizer(cfg, steps=20)
  update = jax.jit(tx.update)  # one program, not one per operation
  params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
  state = tx.init(params)
  grads = {"w": jnp.full((2, 2), 1e-3), "scale": jnp.full((2,), 1e-3)}
  sizes = []
  for _ in range(20):
    updates, state = update(grads, state, params)
    sizes.append(float(jnp.abs(updates["scale"][0])))  # no weight decay on vectors
  assert sizes[0] == 0.0  # warmup starts at 0
  assert sizes[4] == pytest.approx(0.5, rel=1e-2)  # Adam's first step moves ≈ lr
  assert sizes[-1] < sizes[10] < sizes[4]  # cosine decay
  # big gradients are clipped to norm 1 before Adam (which is scale-free anyway)
  assert jnp.isfinite(update({k: v * 1e9 for k, v in grads.items()}, state, params)[0]["w"]).all()


# ------------------------------------------------------------------ the experiment


@contextlib.contextmanager
def compilation_cache(path: pathlib.Path):
  """JAX's persistent compilation cache in ``path`` for this process and the processes it
  starts, every program written to it; the settings before are restored after."""
  settings = {
    "jax_compilation_cache_dir": str(path),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  saved = {name: getattr(jax.config, name) for name in settings}
  saved_env = {name.upper(): os.environ.get(name.upper()) for name in settings}
  try:
    for name, value in settings.items():
      jax.config.update(name, value)
      os.environ[name.upper()] = str(value)
    jax_cache.reset_cache()  # re-read the settings at the next compile
    yield
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    for name, value in saved_env.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    jax_cache.reset_cache()


def _tiny_run(tmp_path_factory, swept):
  """One tiny three-rule run through the CLI (compiling three rules is the expensive part),
  with a one-length sweep if ``swept`` (a process per cell, each starting JAX: the other).

  The sweep's cells step the run's own shapes (its batch size, and T = the task's length
  less one, as the model sees it), and the run keeps a compilation cache: each cell's
  process loads the train step its rule compiled in the run instead of compiling it
  again, and still builds, steps and measures its model on its own."""
  out = tmp_path_factory.mktemp("runs")
  path = out / "tiny.yaml"
  T = tiny().task.make().seq_len - 1
  sweep_cfg = dict(seq_lens=[T] if swept else [], batch_size=TINY["training"]["batch_size"])
  cfg = tiny(output_dir=str(out), comparison=dict(sweep=dict(sweep_cfg, steps=1)))
  path.write_text(yaml.safe_dump(config.to_dict(cfg)))
  with compilation_cache(out / "xla-cache") if swept else contextlib.nullcontext():
    summary = train_cli.main(
      ["--config", str(path), "--set", "name=tiny", "training.progress=true"]
    )
  return out / "tiny", summary


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """The run without its sweep, for the default run's test of the training itself (the sweep
  adds nothing to its metrics or summary's rules)."""
  return _tiny_run(tmp_path_factory, swept=False)


@pytest.fixture(scope="module")
def tiny_run_swept(tmp_path_factory):
  """The run with its one-length sweep, shared by the exhaustive tests of the sweep and of
  every file (the sweep's plot and table among them)."""
  return _tiny_run(tmp_path_factory, swept=True)


def test_tiny_run_losses_fall_and_rules_agree(tiny_run):
  run_dir, summary = tiny_run
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert len(records) == 3 * 20
  by_rule = {rule: [r for r in records if r["rule"] == rule] for rule in model.RULES}
  for rule, recs in by_rule.items():
    losses = [r["loss"] for r in recs]
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), rule
    assert ["eval_exact_match" in r for r in recs].count(True) == 2  # steps 10 and 20
    s = summary["rules"][rule]
    assert s["final_accuracy"] == recs[-1]["eval_exact_match"]
    assert s["max_abs_loss_diff_vs_autodiff"] == pytest.approx(
      max(abs(a["loss"] - b["loss"]) for a, b in zip(recs, by_rule["autodiff"]))
    )
    assert s["max_abs_loss_diff_vs_autodiff"] < 1e-4
    assert s["grad_rel_diff_step0"] < 1e-5
    assert s["median_step_ms"] > 0 and s["peak_mem_mb"] > 0
  assert summary["rules"]["autodiff"]["grad_rel_diff_step0"] == 0.0


# The sweep's three cells each start a process that imports JAX and Flax and builds its model
# (about 19 CPU-seconds together, most of the file's time), so the tests that need the sweep
# are exhaustive. The default run trains the three rules through the CLI above, writing the
# same report and plots but the sweep's; test_sweep_records_failures_instead_of_crashing
# runs the sweep's loop, its processes and its table by default.
@pytest.mark.exhaustive
def test_tiny_run_writes_every_file(tiny_run_swept):
  run_dir, summary = tiny_run_swept
  expected = {
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "report.md",
    "loss_curves.png",
    "length_sweep.png",
    "attention_layer0.png",
  }
  assert expected == set(summary["files"])
  for name in expected:
    assert (run_dir / name).stat().st_size > 0, name
  for name in expected:
    if name.endswith(".png"):
      assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  saved = json.loads((run_dir / "summary.json").read_text())
  assert set(saved["rules"]) == {"autodiff", "custom_vjp", "blockwise"}
  for fields in saved["rules"].values():
    assert {
      "final_accuracy",
      "max_abs_loss_diff_vs_autodiff",
      "grad_rel_diff_step0",
      "median_step_ms",
      "peak_mem_mb",
    } <= set(fields)
  assert config.load(run_dir / "config.yaml", ["name=tiny"]) == config.load(
    run_dir / "config.yaml"
  )  # the resolved config reloads as is
  text = (run_dir / "report.md").read_text()
  assert "| blockwise |" in text and "## Sequence-length sweep" in text


@pytest.mark.exhaustive  # the sweep's processes, as above
def test_tiny_run_sweep_measured_every_cell(tiny_run_swept):
  _, summary = tiny_run_swept
  cells = {(r["rule"], r["seq_len"]): r for r in summary["sweep"]}
  T = summary["task"]["seq_len"] - 1
  assert set(cells) == {(rule, T) for rule in model.RULES}
  for r in cells.values():
    assert r["status"] == "ok", r
    assert r["median_step_ms"] > 0 and r["peak_rss_mb"] > 0 and r["step_mem_mb"] > 0


def test_sweep_records_failures_instead_of_crashing(tmp_path):
  cfg = tiny(
    output_dir=str(tmp_path), comparison=dict(sweep=dict(seq_lens=[16, 32], timeout_s=0.001))
  )
  rows = sweep.sweep(tmp_path / "missing.yaml", cfg)
  assert [(r["rule"], r["seq_len"]) for r in rows] == [
    (rule, T) for T in (16, 32) for rule in model.RULES
  ]
  assert all(r["status"] == "timed out (> 0.001 s)" for r in rows[:3])
  assert all(r["status"] == "skipped (failed at T=16)" for r in rows[3:])
  assert all(r["median_step_ms"] is None for r in rows)
  table = report.sweep_table(rows, list(model.RULES))
  assert "| 32 | skipped (failed at T=16) |" in table


def test_sweep_names_the_failure():
  oom = (
    "Traceback...\njax.errors.JaxRuntimeError: INTERNAL: Out of memory allocating 3221422080 bytes."
  )
  assert sweep._failure(oom) == "out of memory"
  assert sweep._failure("Traceback\nValueError: bad thing\n") == "failed: ValueError: bad thing"
  assert sweep._failure("") == "failed"
