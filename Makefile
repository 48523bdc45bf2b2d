# make demo: create .venv, install, run the main job.   make test: create .venv, install, run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench runtime-wheel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m nwsconvert.cli.demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/accuracy.py --suite split-mnist

# The torch-free wheel a robot installs to run bundles (Runtime, nws-infer): dist/nwsconvert_runtime-*.whl
runtime-wheel: $(STAMP)
	$(PY) export/dist/build_runtime.py --out dist

clean:
	rm -rf $(VENV) build dist *.egg-info
