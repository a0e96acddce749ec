#!/usr/bin/env bash
# Builds the library with several kernel tunings and runs the quick kernel benchmark on each,
# printing gather/scatter device % of ceiling per size: how the defaults in csrc/ were chosen.
#   benchmarks/tune_kernel.sh OUTDIR "UNROLL MIN_CTAS [THREADS]" ...   e.g. "4 1" "8 1 128"
set -euo pipefail
out=$1; shift
arch=${TUNE_GENCODE:--gencode=arch=compute_90a,code=sm_90a}
for variant in "$@"; do
  set -- $variant 256
  dir=$out/tune-u$1-m$2-t$3
  mkdir -p "$dir"
  cmake -S . -B "$dir/build" -GNinja -DVLLM_EXT_OUTPUT_DIR="$dir" -DVLLM_EXT_CUDA_GENCODE="$arch" \
    -DCMAKE_CUDA_FLAGS="-DVLLM_EXT_DEEP_UNROLL=$1 -DVLLM_EXT_MIN_CTAS_PER_SM=$2 -DVLLM_EXT_THREADS=$3" >/dev/null
  cmake --build "$dir/build" >/dev/null
  VLLM_EXT_LIBRARY="$dir/libvllm_ext.so" python3 -m benchmarks.kernels --sizes "${TUNE_SIZES:-1,8,16,32,68}" --out "$dir" >/dev/null 2>&1
  python3 - "$dir/kernels.json" "unroll $1, min CTAs/SM $2, threads $3" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cells = [f"{r['op']} {r['bytes'] >> 20} MiB {r['graph_pct_of_ceiling']:.1f}%" for r in rows if "graph_pct_of_ceiling" in r]
print(f"{sys.argv[2]:28s} " + " | ".join(cells))
PY
done
