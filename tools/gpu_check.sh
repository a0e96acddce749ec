#!/usr/bin/env bash
# One GPU session in one command: build in place with the host toolchain (no index, no Docker),
# print what the library sees, run the GPU test selection and the benchmarks, and keep logs.
#   tools/gpu_check.sh [OUTDIR]        (default benchmarks/results)
# Steps run even when an earlier one fails; the exit code says whether any failed.
set -uo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
failed=()
step() {  # step NAME CMD...: run, tee the log, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
nvidia-smi topo -m || true
step build "$py" -m pip install --no-build-isolation --no-deps -v -e .
step info "$py" -m vllm_ext.info
step tests-gpu "$py" -m pytest -q -rs -m "gpu or multi_gpu" ${GPU_TEST_FILES:-tests}
step tests-all "$py" -m pytest -q -rs -m "not gpu and not multi_gpu" ${CPU_TEST_FILES:-tests}
step bench-kernels "$py" benchmarks/kernels.py --out "$out"
if [ -f benchmarks/migration.py ] && [ -z "${SKIP_MIGRATION:-}" ]; then
  step bench-migration "$py" benchmarks/migration.py --out "$out"
fi
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
