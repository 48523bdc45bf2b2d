# make demo: create .venv, install, run the main job.   make test: create .venv, install, lint, run the tests.
# make test-fast: the tests not marked slow.   make lint: ruff and mypy, as CI runs them.
# TEST_WORKERS: pytest-xdist processes the test targets run (default 2, CI's cores; 0: one process).
# make test-min: the tests in .venv-min, on the lowest versions pyproject.toml declares (.ci/min_constraints.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2

.PHONY: demo test test-fast test-min lint bench runtime-wheel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nwsconvert.cli.demo

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS)

test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow"

# A fresh .venv-min every time: the oldest supported torch, timm, onnx... pinned, the rest as pip resolves.
MIN := .venv-min
test-min:
	rm -rf $(MIN)
	$(PYTHON) -m venv $(MIN)
	$(MIN)/bin/python -m pip install --quiet --upgrade pip packaging 'tomli; python_version < "3.11"'
	$(MIN)/bin/python .ci/min_constraints.py > $(MIN)/constraints.txt
	$(MIN)/bin/python -m pip install --quiet -c $(MIN)/constraints.txt -e '.[test]'
	$(MIN)/bin/python -m pip list --format=freeze > $(MIN)/installed.txt
	$(MIN)/bin/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS)

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
	rm -rf $(VENV) $(MIN) build dist *.egg-info
