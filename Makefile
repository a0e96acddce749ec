# vllm-ext: one entry point for building, testing and benchmarking.
# `make` (or `make help`) lists every target and variable with its default.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# ---- variables (override on the command line: make test PYTHON=python3.12) ----
PYTHON ?= python3
VENV ?= .venv
TORCH_CUDA_ARCH_LIST ?= 8.0 8.6 8.9 9.0 10.0 12.0+PTX
MAX_JOBS ?=
NVCC_THREADS ?=
PYTEST_ARGS ?=

# Where develop/test/bench run: the venv's Python when it exists, else $(PYTHON).
VENV_PY := $(abspath $(VENV))/bin/python
PY = $(if $(wildcard $(VENV_PY)),$(VENV_PY),$(PYTHON))

# The one definition of "the CPU tests" and "the GPU tests", shared by every runner.
CPU_TEST_SELECTION := -m "not gpu and not multi_gpu"
GPU_TEST_SELECTION := -m "gpu or multi_gpu"

export TORCH_CUDA_ARCH_LIST MAX_JOBS NVCC_THREADS

.PHONY: help develop test bench lint clean

help: ## List targets and variables
	@echo "Targets:"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  %-14s %s\n", $$1, $$2}'
	@echo "Variables (current value):"
	@grep -hE '^[A-Z_]+ \?=' $(MAKEFILE_LIST) | sed -E 's/ \?=.*//' | sort -u | while read -r v; do \
	  printf "  %-22s %s\n" "$$v" "$$($(MAKE) -s --no-print-directory print-$$v)"; done

print-%:
	@echo '$($*)'

$(VENV_PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && [ -f requirements-cuda.txt ]; then \
	  echo "GPU found: installing requirements-cuda.txt"; \
	  $(VENV_PY) -m pip install -r requirements-cuda.txt; \
	else \
	  echo "no GPU found: installing the CPU build of torch (requirements-cpu.txt)"; \
	  $(VENV_PY) -m pip install -r requirements-cpu.txt; \
	fi
	$(VENV_PY) -m pip install -r requirements-build.txt -r requirements-test.txt

develop: $(VENV_PY) ## Create $(VENV) and build + install vllm-ext into it, editable
	$(VENV_PY) -m pip install --no-build-isolation --no-deps -e .
	$(VENV_PY) -m vllm_ext.info

test: ## Run the CPU test suite (builds the package first when needed)
	@$(PY) -c 'import vllm_ext' 2>/dev/null || $(MAKE) develop
	$(PY) -m pytest $(CPU_TEST_SELECTION) $(PYTEST_ARGS) tests

bench: ## Run the benchmarks on this machine's GPUs (CPU paths when there are none)
	@$(PY) -c 'import vllm_ext' 2>/dev/null || $(MAKE) develop
	$(PY) benchmarks/kernels.py

lint: ## ruff for Python
	$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) -m pip install -q ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean: ## Remove build outputs (keeps $(VENV))
	rm -rf build dist *.egg-info vllm_ext/*.so vllm_ext/_build_info.json
