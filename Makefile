# The two commands of the README:
#   make run   - set up (runtime deps only, no torch) and run the main job on the embedded default:
#                build the shipped model's engines (cached) and tune them (tandem profile, once per
#                build), serve it on 127.0.0.1:8000, send one streamed sample request (make run
#                ARGS=--once stops after it)
#   make test  - set up (with test extras: CPU torch 2.13.0, transformers, ruff) and run lint + tests
# Both create their own virtual environment in .venv on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test lint setup setup-test clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# torch comes pinned to the local CPU wheel (torch==2.13.0); never a CUDA build.
$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

run: $(VENV)/.runtime
	$(VENV)/bin/tandem inspect models/tandem-tiny-code
	$(PY) tools/run_main_job.py $(ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache *.egg-info
