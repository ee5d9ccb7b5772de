# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned exactly: this version's CPU build is what CI and the tests use.
TORCH := torch==2.13.0

.PHONY: demo test test-fast lint typecheck unit fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[train,dev,hf]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hetrain demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

unit: $(VENV)/.installed
	$(PY) -m pytest -q --durations=30

test: lint typecheck unit

# The fast tier: no process group, no emulated cluster, no test marked slow.
fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" --ignore=tests/distributed

test-fast: lint typecheck fast

bench: $(VENV)/.installed
	$(PY) benchmarks/planner_scale.py
	$(PY) benchmarks/plan_vs_dp.py
	$(PY) benchmarks/simulator_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
