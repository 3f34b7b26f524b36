# Both targets set up everything on a fresh machine: .venv is created when missing and the project
# (with its dev extra) is installed into it. torch==2.13.0 is pinned here so pip takes the CPU wheel
# that lies on disk on CI machines; on a CUDA machine pip picks the CUDA build of the same release.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint readme gpu-check-cpu bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m mhcpipe demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -n 2 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo 'make test: pytest collected no tests' >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# every command the README shows, run in its order in a scratch directory (tests/readme_walk.py; CI runs it)
readme: $(STAMP)
	$(PY) tests/readme_walk.py

# the GPU check's whole script on CPU (bench/gpu_check.sh --cpu; CI runs it): every step's code path, small shapes
gpu-check-cpu: $(STAMP)
	OUT=runs/gpu_check_cpu bash bench/gpu_check.sh --cpu

bench: $(STAMP)
	$(PY) bench/schedule_bench.py

clean:
	rm -rf $(VENV) runs
