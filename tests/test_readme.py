"""README.md stays true: its commands match CI and the Makefile, its examples run, its links
lead somewhere, and it stays a short guide (the rest lives in docs/, see test_docs.py)."""

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language):
  return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_first_block_is_the_two_commands_and_ci_runs_the_second():
  assert README.index("```bash") < README.index("```python")
  demo, test = _blocks("bash")[0].strip().splitlines()
  assert "-m experiments.train --config configs/compare_backward.yaml" in demo
  assert "pytest" in test
  assert test in (ROOT / ".ci" / "run").read_text().splitlines()
  makefile = (ROOT / "Makefile").read_text()
  assert f"\t{demo}\n" in makefile and f"\t{test}\n" in makefile


# Exhaustive (6 CPU-seconds: the examples compile a dozen calls), for the README command's
# time bound; test_docs.py runs the documentation pages' examples of the same calls.
@pytest.mark.exhaustive
def test_python_examples_run():
  namespace = {}
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    for block in _blocks("python"):
      exec(compile(block, "README.md", "exec"), namespace)
  printed = stdout.getvalue()
  assert "[[1 0 0 0]\n [1 1 0 0]\n [1 1 1 0]\n [0 1 1 1]]" in printed
  assert (
    "key and value must have the same shape but for the head dimension, got key (2, 16, 2, 8) "
    "and value (2, 12, 2, 8)"
  ) in printed


def test_links_to_files_resolve():
  for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
    assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_is_a_short_guide():
  assert len(README.splitlines()) <= 400


def test_ci_fails_when_it_cannot_run_the_newest_jax():
  """.ci/run exits with an error, saying why, where it finds no Python 3.12: the newest-JAX
  run and the kernels' jax 0.11.2 run cannot be skipped with CI green."""
  ci = (ROOT / ".ci" / "run").read_text()
  assert "exit 0" not in ci
  branch = ci.split('if [ -z "$py312" ]; then', 1)[1].split("fi\n", 1)[0]
  assert "exit 1" in branch and "CI FAILED" in branch
  assert ci.index("exit 1") < ci.index(".venv312/bin/python -m pytest")
