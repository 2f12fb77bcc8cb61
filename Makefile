# Quick start:  make run   (set up a venv, install, run the main job)
#               make test  (set up a venv, install with test extras, run the tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test venv gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[torch,plot,test,prometheus]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/gdskit bench

test: venv
	$(PY) -m pytest -q

gpu-test:
	bash scripts/gpu_test.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
