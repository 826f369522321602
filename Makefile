# The two commands at the top of README.md.
.PHONY: demo test ci

demo:
	python3 -m venv .venv && .venv/bin/pip install -e ".[viz]" && .venv/bin/python -m experiments.train --config configs/compare_backward.yaml

test:
	python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest

ci:
	.ci/run
