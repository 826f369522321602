# The two commands at the top of README.md.
.PHONY: demo test ci

demo:
	python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python experiments/quickstart.py

test:
	python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest

ci:
	.ci/run
