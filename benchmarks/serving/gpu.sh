#!/usr/bin/env bash
# The serving benchmark on one GPU with the vLLM installed there (vLLM 0.26 with torch 2.11 on
# the H200 machine). Builds vllm-ext in place unless a CUDA build is already there, checks that
# vLLM's load generator and the connector import, then runs the gpu preset (7B geometry, dummy
# weights, 600 requests at 10 req/s, two instances sharing the GPU) into benchmarks/out/ and
# copies the report, and the work folder with every process's log, to OUT.
#   benchmarks/serving/gpu.sh --build              # build and check only (about 1-2 min)
#   benchmarks/serving/gpu.sh OUT [options...]     # options of python -m benchmarks.serving
# Needs no network: the model folder (config.json and a BPE tokenizer) and the requests are
# generated. Without matplotlib there is no PNG: `python -m benchmarks.serving.report
# serving.json` redraws the Markdown and the PNG from the JSON on another machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: benchmarks/serving/gpu.sh --build | OUT [options...]}
shift
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
start=$(date +%s)
if ! $PY -c 'from vllm_ext import _lib; assert _lib.built_with_cuda()' 2>/dev/null; then
  echo "building vllm-ext in place (log: build/serving-gpu-build.log)"
  mkdir -p build
  VLLM_EXT_TARGET_DEVICE=cuda $PY -m pip install -v --no-build-isolation --no-deps -e . \
    >build/serving-gpu-build.log 2>&1 || { tail -n 40 build/serving-gpu-build.log; exit 1; }
fi
$PY -c 'import vllm, vllm.benchmarks.serve, vllm_ext.connector, vllm_ext.proxy; print("vLLM", vllm.__version__)'
echo "[$(( $(date +%s) - start ))s] vllm-ext built, vLLM's load generator imports"
[ "$OUT" = "--build" ] && exit 0
rc=0
$PY -m benchmarks.serving --preset gpu "$@" || rc=$?
mkdir -p "$OUT" && cp -r benchmarks/out/serving.* benchmarks/out/serving-work "$OUT"/ 2>/dev/null || true
echo "[$(( $(date +%s) - start ))s] done (exit $rc); results in $OUT"
exit $rc
