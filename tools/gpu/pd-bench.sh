#!/usr/bin/env bash
# pd-bench.sh OUT_DIR: benchmarks/pd.py on one CUDA GPU, every configuration in one run with one
# client: a single instance, vllm-ext's P/D (ipc) and vLLM's NixlConnector P/D (pull, zero-copy
# GET on; and NixlPushConnector), direct and through the project's proxy, requests interleaved.
# Run it from the repository root of a machine whose $PYTHON has torch with CUDA, a CUDA build of
# vLLM and this repository installed (BUILD=1: install it here first, editable); no network needed.
# Steps:
#   1. nixl: with NIXL_WHEELS set, installs the wheels in that folder (pip --no-index --no-deps:
#      nixl and nixl-cu13, see docs/benchmarks.md); without it, whatever is installed is used and
#      the NIXL rows are skipped, with the reason, where `nixl` does not import;
#   2. model: a LLaMA-7B-shaped config.json (32 layers, 32 KV heads of 128, bf16: 0.5 MiB of KV per
#      token), served with dummy weights;
#   3. bench: python -m benchmarks.pd --device cuda --backend ipc, LENGTHS, REPEATS, six servers
#      on the GPU (GPU_MEMORY of it each), started one after the other (vLLM sizes its cache from
#      the memory free when it starts), eager.
# Written into OUT_DIR: pd.md, pd.json, pd.png (with matplotlib), summary.txt (versions, GPU, step
# times), bench.log, gpu.csv (memory and utilisation every 5 s), pd-work/ (each server's log).
# Environment: PYTHON (python3); NIXL_WHEELS; BUILD=1; LENGTHS ("128 512 1024 2048 4096 8192");
#   REPEATS (3); MAX_TOKENS (8); GPU_MEMORY (0.15: six servers and this process's ceiling cache);
#   CONFIGS (all of benchmarks.pd's); REQUEST_TIMEOUT (20 s: a request that takes longer fails its
#   configuration, reported); TIME_LIMIT (600 s from the bench's start, the servers' start-ups
#   included: no round starts after it, the report says how far it got); SERVER_ARGS (more vLLM
#   server arguments, words).
# About 9 minutes in all: nixl install ~10 s, build ~30 s, six server start-ups one after the other
# ~60 s each (seen at 2026-12-05 on one H200, vLLM 0.26 eager: 6 minutes before the first round),
# the rounds (6 lengths x 3 repeats x 7 configurations, plus the checks and the ceiling) ~1-2 min.
# CONFIGS naming fewer pairs starts fewer servers (e.g. single,ext,nixl: four).
# Exit status: 3 (no GPU or no vLLM), else the bench's (124 when killed at TIME_LIMIT + 60 s).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
LENGTHS=${LENGTHS:-128 512 1024 2048 4096 8192}
REPEATS=${REPEATS:-3}
MAX_TOKENS=${MAX_TOKENS:-8}
GPU_MEMORY=${GPU_MEMORY:-0.15}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-20}
TIME_LIMIT=${TIME_LIMIT:-600}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
summary=$out/summary.txt
monitor=
start=$(date +%s)
: >"$summary"
stamp() { echo "== [pd-bench $(( $(date +%s) - start ))s] $*" | tee -a "$summary"; }
cleanup() {
  local status=$?
  [ -z "$monitor" ] || kill "$monitor" 2>/dev/null || true
  echo "exit status $status; total $(( $(date +%s) - start )) s" | tee -a "$summary"
  exit "$status"
}
trap cleanup EXIT

stamp "check"
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: this needs a CUDA GPU" | tee -a "$summary"; exit 3; }
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee -a "$summary"
if [ -n "${NIXL_WHEELS:-}" ]; then
  stamp "nixl (from $NIXL_WHEELS)"
  "$PYTHON" -m pip install -q --no-index --no-deps "$NIXL_WHEELS"/*.whl >"$out/nixl-install.log" 2>&1 \
    || echo "installing nixl failed (see nixl-install.log): the NIXL rows will say why" | tee -a "$summary"
fi
if [ "${BUILD:-0}" = 1 ]; then
  stamp "build (editable install; log: build.log)"
  VLLM_EXT_TARGET_DEVICE=cuda "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 \
    || { tail -n 40 "$out/build.log"; echo "the build failed; see build.log" | tee -a "$summary"; exit 1; }
fi
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$summary" || exit 3
import importlib, importlib.metadata, platform, sys
import torch
def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
vllm = version("vllm")
if vllm is None:
    sys.exit(f"vLLM is not installed for {sys.executable}")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU")
try:  # as vLLM imports it
    importlib.import_module("nixl._api")
    nixl = "imports"
except Exception as e:  # noqa: BLE001
    nixl = f"does not import ({type(e).__name__}: {e})"
import vllm_ext
print(f"python {platform.python_version()}, torch {torch.__version__}, vLLM {vllm}, vllm-ext "
      f"{vllm_ext.build_info().get('version')}, nixl {version('nixl')} / nixl-cu13 {version('nixl-cu13')}: {nixl}, "
      f"GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF
revision=$(git rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)")
! git status --porcelain 2>/dev/null | grep -q . || revision+=" with uncommitted changes"
echo "revision $revision" | tee -a "$summary"

stamp "model (LLaMA-7B geometry, dummy weights)"
max_len=$(( $(tr ' ' '\n' <<<"$LENGTHS" | sort -n | tail -n 1) + MAX_TOKENS + 64 ))
"$PYTHON" -c "import sys; from pathlib import Path; from vllm_ext.fleet import write_7b_config; \
write_7b_config(Path(sys.argv[1]), int(sys.argv[2]))" "$out/model-7b" "$max_len"

stamp "bench (log: bench.log)"
nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 5 >"$out/gpu.csv" 2>&1 &
monitor=$!
status=0
# shellcheck disable=SC2086  # LENGTHS, SERVER_ARGS: words
VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 timeout -k 30 $(( TIME_LIMIT + 60 )) \
  "$PYTHON" -m benchmarks.pd --device cuda --backend ipc --model "$out/model-7b" --dtype bfloat16 --block-size 16 \
  --lengths $LENGTHS --repeats "$REPEATS" --max-tokens "$MAX_TOKENS" ${CONFIGS:+--configs "$CONFIGS"} \
  --request-timeout "$REQUEST_TIMEOUT" --time-limit "$TIME_LIMIT" \
  --server-arg=--gpu-memory-utilization="$GPU_MEMORY" --server-arg=--load-format=dummy \
  --server-arg=--enforce-eager $(for a in ${SERVER_ARGS:-}; do printf -- '--server-arg=%s ' "$a"; done) \
  --out "$out" 2>&1 | tee "$out/bench.log" || status=$?
stamp "bench exit status $status"
exit "$status"
