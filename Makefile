# Quick start:  make run   (set up a venv, install the core package, run the main job)
#               make test  (set up a venv, install it with torch and the test extras, run the tests)
# Each works alone on a fresh clone: `make test` builds on what `make run` installs, one stamp each.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.installed-core
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test venv gpu-test clean

# The core package only: what `gdskit bench` needs (no torch, no matplotlib, no test tools).
$(CORE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Everything the test suite uses. torch pinned first: that version has a CPU wheel at hand,
# where a plain `torch` would pull a multi-GB CUDA build.
$(TEST_STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[torch,plot,test,prometheus,s3]"
	touch $@

venv: $(CORE_STAMP)

run: $(CORE_STAMP)
	$(VENV)/bin/gdskit bench

# Two workers (pytest-xdist): the suite's processes and fresh interpreters share the machine's cores.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2

gpu-test:
	bash scripts/gpu_test.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
