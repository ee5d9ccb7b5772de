# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned exactly: this version's CPU build is what CI and the tests use.
TORCH := torch==2.13.0
# Test processes for the tests that start no process group (pytest-xdist): one per usable CPU, at most 4
# (each imports torch). The multi-rank tests in tests/distributed run one at a time: their ranks
# and emulated nodes time work under CPU quotas, which a second test beside them would disturb.
JOBS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)))")

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
	$(PY) -m pytest -q -n $(JOBS) --durations=30 --ignore=tests/distributed
	$(PY) -m pytest -q --durations=30 tests/distributed

test: lint typecheck unit

# The fast tier: no process group, no emulated cluster, no test marked slow.
fast: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS) -m "not slow" --ignore=tests/distributed

test-fast: lint typecheck fast

bench: $(VENV)/.installed
	$(PY) benchmarks/planner_scale.py
	$(PY) benchmarks/plan_vs_dp.py
	$(PY) benchmarks/simulator_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
