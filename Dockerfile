# vllm-ext images, one stage per job. Build them through the Makefile (`make wheel`,
# `make image`, `make test-gpu`): it passes the build arguments, the OCI labels and the CA
# bundle secret, and builds stand-in base images where nvidia/cuda cannot be pulled.
#
#   DEVEL_IMAGE ─> dev ─> build ─> wheels            FROM scratch: the wheel alone (make wheel)
#                           :
#                           : the wheel, bind-mounted into the stages marked *
#                           :
#   BASE_IMAGE ─> torch-base ─┬─> vllm-base* ─> test          tests/ against the installed wheel
#                             └─> server-deps ─> vllm-openai*  vLLM's OpenAI server + vllm-ext
#
# `make image` builds vllm-base, test and vllm-openai. The wheel is the top layer of vllm-base
# and of vllm-openai, so a code change never reinstalls torch or vLLM.
#
# Needs BuildKit (DOCKER_BUILDKIT=1). No `# syntax=` line on purpose: it would pull a frontend
# image from a registry; the built-in frontend has cache, bind and secret mounts.

ARG CUDA_VERSION=13.0.2
ARG DEVEL_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
ARG BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

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
# torch-base: the slim CUDA base image (no compiler, no toolkit: every kernel ships
# precompiled), Python and torch. Both runtime images start here, so torch is installed once
# and stays cached when our code changes.
FROM ${BASE_IMAGE} AS torch-base
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
# requirements-cuda.txt, so torch stays at the version torch-base installed.
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
    pip-install -r /tmp/requirements-openai.txt \
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
