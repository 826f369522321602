"""The character-level language model on pydoc_data's topics: the corpus and its splits, the
three rules on it, QK-clip driven by the sown max logits, the run's files and its config."""

import ast
import json
import math
import pathlib
import pydoc_data

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

import jattn
from experiments import train as train_cli
from experiments.toy import clip, config, corpus, model, training

ROOT = pathlib.Path(__file__).resolve().parent.parent
THRESHOLD = 0.5  # τ far below the tiny model's first logits: the clip bites at every step
STEPS = 5

TINY = dict(
  model=dict(d_model=16, num_heads=2, num_layers=2, mlp_ratio=2),
  task=dict(name="pydoc_topics", length=16),
  optimizer=dict(learning_rate=3e-2, warmup_steps=1),
  training=dict(steps=STEPS, batch_size=8, eval_every=2, eval_samples=16, progress=False),
  qk_clip=dict(threshold=THRESHOLD, rule="blockwise"),
)


def tiny(**sections) -> config.Config:
  data = {k: dict(v) for k, v in TINY.items()}
  for key, value in sections.items():
    data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
  return config.from_dict(config.Config, data)


# ------------------------------------------------------------------ the corpus


def _topics_from_the_file() -> str:
  """pydoc_data/topics.py's dict read as a literal, not imported: the texts in key order."""
  source = (pathlib.Path(pydoc_data.__file__).parent / "topics.py").read_text(encoding="utf-8")
  assign = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign))
  topics = ast.literal_eval(assign.value)
  return "".join(topics[key] for key in sorted(topics))


def test_the_corpus_is_the_documentation_topics_and_its_vocabulary_round_trips():
  task = corpus.CharTask("pydoc_topics", length=16)
  text = _topics_from_the_file()
  assert task.text == text and len(text) > 100_000
  chars = task.vocab.chars
  assert list(chars) == sorted(set(text)) and task.vocab_size == len(chars)
  assert task.vocab.decode(task.ids) == text
  assert [chars[i] for i in task.ids[:200]] == list(text[:200])
  assert corpus.Vocabulary.of("cabbage").chars == "abceg"
  assert corpus.Vocabulary("abc").encode("cab").tolist() == [2, 0, 1]
  with pytest.raises(ValueError, match="character 'z' is not in the vocabulary"):
    corpus.Vocabulary("abc").encode("abz")
  assert task.token_names(task.vocab.encode("a b\n")) == ["a", "␣", "b", "↵"]


def test_train_and_held_out_windows_do_not_overlap():
  task = corpus.CharTask("pydoc_topics", length=32, holdout=0.1)
  n = len(task.text)
  cut = task.bounds("train")[1]
  assert task.bounds("eval") == (cut, n) and abs(cut - 0.9 * n) <= 1
  ends, starts = [], []
  for index in range(20):
    for split, found in (("train", ends), ("eval", starts)):
      batch = task.batch(16, seed=3, index=index, split=split)
      offsets = task.starts(16, seed=3, index=index, split=split)
      assert batch.tokens.shape == (16, 33) and batch.tokens.dtype == np.int32
      for row, offset in zip(batch.tokens, offsets):
        assert task.vocab.decode(row) == task.text[offset : offset + 33]
      found.extend(offsets + 33 if split == "train" else offsets)
  assert max(ends) <= cut <= min(starts) and max(starts) + 33 <= n
  assert not task.batch(4, seed=0, index=0).answer[:, 0].any()  # the first char is no target
  assert task.batch(4, seed=0, index=0).answer[:, 1:].all()  # every next char is one
  again = task.batch(16, seed=3, index=7)
  assert np.array_equal(again.tokens, task.batch(16, seed=3, index=7).tokens)
  assert not np.array_equal(again.tokens, task.batch(16, seed=3, index=8).tokens)
  assert not np.array_equal(again.tokens, task.batch(16, seed=4, index=7).tokens)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(name="shakespeare"), ValueError, r"name must be one of \['pydoc_topics'\]"),
    (dict(length=0), ValueError, r"length must be >= 1"),
    (dict(holdout=1.0), ValueError, r"holdout must be in \(0, 1\)"),
    (dict(holdout="a"), TypeError, r"holdout must be a float"),
    (dict(length=10**6), ValueError, r"the train split holds \d+ characters, fewer than"),
  ],
)
def test_bad_tasks_are_refused(kwargs, error, match):
  with pytest.raises(error, match=match):
    corpus.CharTask(**{"name": "pydoc_topics", "length": 8, **kwargs})


# ------------------------------------------------------------------ the clip


def _logits_layer0(m: model.Transformer, tokens) -> np.ndarray:
  """Layer 0's largest causal logits (B, T, N) in float64 from its query and key
  projections (sinusoidal positions: no rotation inside attention)."""
  x = m.embed(tokens)
  x = x + jattn.positional.sinusoidal(jnp.arange(tokens.shape[1]), x.shape[-1])[None]
  block = m.blocks[0]
  h = block.attention_norm(x)
  q = np.asarray(block.attention.query(h), np.float64)  # (B, T, N, H)
  k = np.asarray(block.attention.key(h), np.float64)
  scores = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
  T = tokens.shape[1]
  scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
  return scores.max(-1).transpose(0, 2, 1)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_the_clip_scales_each_head_to_the_threshold(alpha):
  """The sown max logits are the largest logits, and after the clip the same tokens' largest
  logit of each head is min(its old one, τ): the query and key kernels scaled per head by
  η**alpha and η**(1 - alpha), η = min(1, τ / max)."""
  cfg = tiny(model=dict(positions="sinusoidal"))
  m = model.build(cfg.model, 103, "autodiff", seed=0, sow_max_logit=True)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 103)
  _, before = model.forward(m, tokens)
  assert before is not None and len(before) == 2 and before[0].shape == (2, 12, 2)
  np.testing.assert_allclose(before[0], _logits_layer0(m, tokens), rtol=1e-5, atol=1e-5)
  heads = np.asarray(clip.head_max(before))  # (L, N)
  tau = float(np.median(heads))  # some heads above, some below
  assert (heads > tau).any() and (heads <= tau).any()
  kernels = [(b.attention.query.kernel[...], b.attention.key.kernel[...]) for b in m.blocks]
  clip.qk_clip(m, before, tau, alpha=alpha)
  eta = np.minimum(1.0, tau / heads)
  for block, (wq, wk), e in zip(m.blocks, kernels, eta):
    np.testing.assert_allclose(
      block.attention.query.kernel[...], wq * e[None, :, None] ** alpha, rtol=1e-6
    )
    np.testing.assert_allclose(
      block.attention.key.kernel[...], wk * e[None, :, None] ** (1 - alpha), rtol=1e-6
    )
  # Layer 0's input is unchanged, so its heads' largest logits are now exactly min(m, τ).
  _, after = model.forward(m, tokens)
  assert after is not None
  np.testing.assert_allclose(clip.head_max(after)[0], np.minimum(heads[0], tau), rtol=1e-5)
  with pytest.raises(ValueError, match="max_logits holds 1 layers, the model 2"):
    clip.qk_clip(m, before[:1], tau)


def test_a_clipped_step_is_the_plain_step_then_the_clip():
  """One step of the clip run: the same update as the run without it, then each layer's
  query and key kernels scaled by sqrt(min(1, τ / max)) of the max logits the step recorded."""
  cfg = tiny()
  task = cfg.task.make()
  batch = training.as_jax(task.batch(8, seed=0, index=0))
  plain = training.Trainer(cfg, task, "blockwise")
  clipped = training.Trainer(cfg, task, "blockwise", qk_clip=True)
  a, b = plain.step(batch), clipped.step(batch)
  assert a["max_logit"] == max(map(max, a["max_logit_heads"]))
  assert b["max_logit"] == pytest.approx(a["max_logit"], rel=1e-6)  # the same forward pass
  assert a["max_logit"] > THRESHOLD  # the clip bites
  eta = np.minimum(1.0, THRESHOLD / np.asarray(b["max_logit_heads"]))
  for path, got in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(clipped.state.params)):
    want = nnx.to_pure_dict(plain.state.params)
    for key in path:
      want = want[key.key]
    names = [str(k.key) for k in path]
    if names[-2] in ("query", "key") and names[-3] == "attention":
      layer = int(names[1])
      want = want * np.sqrt(eta[layer])[None, :, None]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg="/".join(names))
  with pytest.raises(ValueError, match="qk_clip=True needs a config with 'qk_clip.threshold'"):
    training.Trainer(tiny(qk_clip=dict(threshold=None)), task, "blockwise", qk_clip=True)


# ------------------------------------------------------------------ the run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """Three rules and the clip run, a few steps each, through the command line."""
  out = tmp_path_factory.mktemp("runs")
  path = out / "tiny_lm.yaml"
  path.write_text(yaml.safe_dump(config.to_dict(tiny(output_dir=str(out), name="tiny_lm"))))
  summary = train_cli.main(["--config", str(path)])
  records = [
    json.loads(line) for line in (out / "tiny_lm" / "metrics.jsonl").read_text().splitlines()
  ]
  return out / "tiny_lm", summary, records


def _runs(records):
  by = {}
  for r in records:
    by.setdefault(r["rule"] + ("+qk_clip" if "qk_clip" in r else ""), []).append(r)
  return by


def test_the_rules_agree_on_the_corpus(tiny_run):
  _, summary, records = tiny_run
  runs = _runs(records)
  assert set(runs) == {"autodiff", "custom_vjp", "blockwise", "blockwise+qk_clip"}
  rules = [runs[r] for r in ("autodiff", "custom_vjp", "blockwise")]
  for recs in runs.values():
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4, 5]
    for r in recs:
      if "eval_loss" in r:
        assert r["eval_bits_per_token"] == pytest.approx(r["eval_loss"] / math.log(2))
    assert recs[0]["loss"] == pytest.approx(math.log(summary["task"]["vocab_size"]), rel=0.25)
  spread = {
    key: max(max(s[key] for s in steps) - min(s[key] for s in steps) for steps in zip(*rules))
    for key in ("loss", "max_logit")
  }
  assert spread["loss"] < 1e-4 and spread["max_logit"] < 1e-3
  assert summary["rules_spread"]["loss"] == pytest.approx(spread["loss"], abs=1e-12)
  for rule, recs in zip(("autodiff", "custom_vjp", "blockwise"), rules):
    s = summary["rules"][rule]
    assert s["final_eval_loss"] == recs[-1]["eval_loss"]
    assert s["final_eval_bits_per_token"] == pytest.approx(s["final_eval_loss"] / math.log(2))
    assert s["peak_max_logit"] == max(r["max_logit"] for r in recs)
  task = summary["task"]
  assert task["corpus"] == "pydoc_topics" and task["seq_len"] == 17
  assert task["train_chars"] + task["eval_chars"] == task["chars"] == len(_topics_from_the_file())


def test_the_clip_run_records_its_max_logits(tiny_run):
  _, summary, records = tiny_run
  runs = _runs(records)
  plain, clipped = runs["blockwise"], runs["blockwise+qk_clip"]
  assert all(r["qk_clip"] == THRESHOLD for r in clipped)
  for r in plain + clipped:
    heads = np.asarray(r["max_logit_heads"])
    assert heads.shape == (2, 2) and r["max_logit"] == heads.max()
  assert clipped[0]["max_logit"] == plain[0]["max_logit"] > THRESHOLD  # before any clip
  # After the first clip, every later step starts from logits pulled down to about τ.
  assert all(c["max_logit"] < p["max_logit"] for c, p in zip(clipped[1:], plain[1:]))
  qk = summary["qk_clip"]
  assert qk["threshold"] == THRESHOLD and qk["rule"] == "blockwise"
  for side, recs in (("without", plain), ("clipped", clipped)):
    logits = [r["max_logit"] for r in recs]
    assert qk[side]["peak_max_logit"] == max(logits)
    assert qk[side]["steps_above_threshold"] == sum(x > THRESHOLD for x in logits)
    assert qk[side]["peak_max_logit_by_layer"] == [
      max(max(r["max_logit_heads"][layer]) for r in recs) for layer in range(2)
    ]
    assert qk[side]["final_eval_loss"] == recs[-1]["eval_loss"]


def test_the_run_writes_its_report_and_plots(tiny_run):
  run_dir, summary, _ = tiny_run
  expected = {"config.yaml", "metrics.jsonl", "summary.json", "report.md", "loss_curves.png"}
  expected |= {"eval_curves.png", "qk_clip.png", "attention_layer0.png", "attention_layer1.png"}
  assert set(summary["files"]) == expected
  for name in expected:
    assert (run_dir / name).stat().st_size > 0, name
    if name.endswith(".png"):
      assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads((run_dir / "summary.json").read_text()) == summary
  text = (run_dir / "report.md").read_text()
  assert "character-level language model" in text and "| blockwise |" in text
  assert "## QK-clip" in text and f"τ = {THRESHOLD:g}" in text
  assert f"{summary['rules']['blockwise']['final_eval_bits_per_token']:.4f}" in text
  resolved = config.load(run_dir / "config.yaml")
  assert resolved == tiny(output_dir=str(run_dir.parent), name="tiny_lm")


# ------------------------------------------------------------------ the config


def test_the_char_lm_config_loads_and_its_record_comes_from_it():
  cfg = config.load(ROOT / "configs" / "char_lm.yaml")
  assert cfg.name == "char_lm" and cfg.task.is_corpus and cfg.task.name in corpus.CORPORA
  assert cfg.comparison.rules == ("autodiff", "custom_vjp", "blockwise")
  assert cfg.qk_clip.threshold is not None and cfg.qk_clip.rule in cfg.comparison.rules
  assert cfg.training.steps >= 8 * cfg.training.eval_every  # enough evaluations for a curve
  record = ROOT / "docs" / "char_lm" / "summary.json"
  summary = json.loads(record.read_text())
  shown = lambda c: {**c, "training": {**c["training"], "progress": None}}  # display only
  assert shown(summary["config"]) == shown(config.to_dict(cfg))  # the run is this config's
  qk = summary["qk_clip"]
  assert qk["without"]["peak_max_logit"] > 1.5 * qk["threshold"]  # the threshold bites
  assert qk["clipped"]["peak_max_logit"] < qk["threshold"] + qk["without"]["largest_rise_per_step"]


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["qk_clip.tau=3"], r"unknown key 'qk_clip.tau'.*valid keys of qk_clip: threshold, rule"),
    (["qk_clip.threshold=0"], r"'qk_clip.threshold' must be > 0.0, got 0"),
    (["qk_clip.threshold=big"], r"'qk_clip.threshold' must be float or null"),
    (["qk_clip.rule=flash"], r"'qk_clip.rule' must be one of \['autodiff', 'custom_vjp'"),
    (["qk_clip.alpha=2"], r"'qk_clip.alpha' must be <= 1.0, got 2"),
    (["comparison.rules=[autodiff]"], r"'qk_clip.rule' \('blockwise'\) must be one of 'compar"),
    (["task.holdout=0.9"], r"'task.holdout' must be <= 0.5, got 0.9"),
    (["task.holdout=0"], r"'task.holdout' must be > 0.0"),
    (["task.length=500000"], r"'task': the train split holds \d+ characters, fewer than one"),
    (["task.name=pydoc"], r"'task.name' must be one of \[.*'long_range', 'pydoc_topics'\]"),
  ],
)
def test_bad_keys_are_named(overrides, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load(ROOT / "configs" / "char_lm.yaml", overrides)


def test_a_null_or_absent_clip_section_means_no_clip_run(tmp_path):
  path = tmp_path / "no_clip.yaml"
  for text in ("qk_clip: null\n", "qk_clip: {threshold: null}\n", "task: {name: pydoc_topics}\n"):
    path.write_text(text)
    assert config.load(path).qk_clip.threshold is None
  cfg = config.load(ROOT / "configs" / "char_lm.yaml", ["qk_clip.threshold=null"])
  assert not training.Trainer(cfg, cfg.task.make(), "blockwise").sow_max_logit
