# Two commands: `make demo` and `make test`. Both bootstrap from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshscope-installed

.PHONY: demo test system-deps bench clean

$(STAMP): pyproject.toml setup.py $(wildcard collector/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on this machine's disk and not a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshscope run --config configs/demo.toml

system-deps:
	scripts/install-system-deps.sh

test: $(STAMP) system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# every server, the browser too, is installed above: missing one fails, never skips
	# the slowest tests are listed: what the suite's time goes to stays visible in every CI log
	MESHSCOPE_E2E=required OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=25

bench: $(STAMP) system-deps
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/comm_breakdown.py
	$(PY) benchmarks/fault_recovery.py
	$(PY) benchmarks/detection_quality.py --long-clean 15000
	$(PY) benchmarks/alert_latency.py --runs 3

clean:
	rm -rf $(VENV) runs .meshscope
