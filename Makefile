# The two commands at the top of README.md, the exhaustive test cases they leave out (marked
# beside each case), the documentation build, and CI.
.PHONY: demo test test-exhaustive docs ci

demo:
	python3 -m venv .venv && .venv/bin/pip install -e ".[experiments]" && .venv/bin/python -m experiments.train --config configs/compare_backward.yaml

test:
	python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest

test-exhaustive:
	.venv/bin/python -m pytest -m exhaustive

docs:
	.venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

ci:
	.ci/run
