# make demo: create .venv, install, run the main job.   make test: create .venv, install, lint, run the tests.
# make test-fast: the tests not marked slow.   make lint: ruff and mypy, as CI runs them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench runtime-wheel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nwsconvert.cli.demo

test: lint
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# ruff (lint + format check) over the tree, mypy over nwsconvert/core and nwsconvert/conversion.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/accuracy.py --suite split-mnist

# The torch-free wheel a robot installs to run bundles (Runtime, nws-infer): dist/nwsconvert_runtime-*.whl
runtime-wheel: $(STAMP)
	$(PY) export/dist/build_runtime.py --out dist

clean:
	rm -rf $(VENV) build dist *.egg-info
