# The devel stand-in: the base stand-in plus a compiler, Python and a CUDA toolkit pinned to
# one release, from PyPI's nvidia-* wheels. Built by build.sh (context: tools/).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

ARG CUDA_VERSION
ARG DEBIAN_FRONTEND=noninteractive
COPY docker/retry.sh /usr/local/bin/retry
RUN retry sh -c 'apt-get update && apt-get install -y --no-install-recommends \
        g++ make binutils python3 python3-venv ca-certificates' \
    && rm -rf /var/lib/apt/lists/*

# Every part pinned to CUDA_VERSION's major.minor: unpinned, a newer nvvm arrives whose PTX the
# older ptxas rejects. cuobjdump is read-only tooling (the wheel checker lists the machine code
# with it); PyPI has no 13.0 build of it, and 13.2 reads 13.0 binaries.
RUN --mount=type=secret,id=ca-bundle \
    set -eu; \
    mm=${CUDA_VERSION%.*}; \
    python3 -m venv /opt/cuda-toolkit; \
    retry /opt/cuda-toolkit/bin/pip install --no-cache-dir --progress-bar off --only-binary=:all: \
        "nvidia-cuda-nvcc==${mm}.*" "nvidia-cuda-runtime==${mm}.*" "nvidia-cuda-cccl==${mm}.*" \
        "nvidia-nvvm==${mm}.*" "nvidia-cuda-crt==${mm}.*" "nvidia-cuda-cuobjdump==13.2.*"; \
    root=$(echo /opt/cuda-toolkit/lib/python3*/site-packages/nvidia/cu"${mm%%.*}"); \
    test -x "$root/bin/nvcc"; \
    ln -s lib "$root/lib64"; \
    ln -s "$root" /usr/local/cuda; \
    /usr/local/cuda/bin/nvcc --version; \
    /usr/local/cuda/bin/cuobjdump --version

ENV CUDA_HOME=/usr/local/cuda
LABEL org.opencontainers.image.title="nvidia/cuda devel stand-in (Debian, CUDA toolkit from PyPI wheels)"
