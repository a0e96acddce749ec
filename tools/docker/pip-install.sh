#!/bin/sh
# pip-install.sh ARGS...: `pip install ARGS` inside a Docker build, by one policy:
# - Binary wheels only (--only-binary=:all:). pip never compiles a package here, so its cache
#   never holds a wheel built against whatever happened to be installed at the time (vLLM's
#   stale-wheel bug); a package with no wheel fails the build by name instead.
# - Downloads are cached under the build's pip cache mount, one folder per CUDA version and
#   Python version. (pip stores a download only when the index sends cache headers, as PyPI
#   does; behind a proxy that strips them the cache stays empty and pip downloads again.)
# - The CA bundle secret and retries come from retry.sh.
set -eu
py=$(python -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
PIP_CACHE_DIR="/root/.cache/pip/cu${CUDA_VERSION:-none}-${py}"
export PIP_CACHE_DIR PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
exec retry python -m pip install --only-binary=:all: "$@"
