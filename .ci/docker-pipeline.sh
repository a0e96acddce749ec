#!/usr/bin/env bash
# CI, part 2 (called by .ci/run after the CPU tests): the Make + Docker pipeline, built for real.
# Runs as root on a machine with no GPU and no container registry:
#   1. installs Docker and debootstrap from Debian's packages and starts the daemon;
#   2. builds the stand-in base images (make base-images);
#   3. make wheel and make image (cold) for one arch, to save time; make image gates image sizes;
#   4. runs the test image's CPU selection (make image-test-cpu);
#   5. smoke-tests vllm-openai: the entrypoint answers --help, vllm and vllm_ext import, pip check
#      (only the pins of requirements-openai-overrides.txt may differ from vLLM's), FlashInfer's
#      JIT toolchain; once vllm_ext/connector is in the tree, VllmExtConnector registers in its
#      vLLM (tools/docker/check_connector.py), and tests/connector runs against that vLLM, the
#      newest release the connector supports (make image-test-connector, on the CPU);
#   6. make image DEVICE=cpu (cold): vllm-openai-cpu, with the CPU torch from this machine's pip
#      find-links folder when it has one; import and pip checks (the connector too, as in 5);
#   7. make image-serve-cpu: vllm-openai-cpu serves a tiny random model: health, completions, a
#      streamed chat completion; then P/D (prefill + decode containers, the proxy) when
#      vllm_ext/connector is in the tree (tools/docker/serve-test.sh);
#   8. make image and make image DEVICE=cpu again with no change: every image must come out of
#      the cache unchanged;
#   9. prints the timings and sizes, and removes the containers, images and build cache it made.
# Each step has a time limit, so a hung download fails the step by name, not the whole CI run.
# Environment: CI_TORCH_CUDA_ARCH_LIST (default 9.0).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
stamp() { echo "== [docker-pipeline $(( $(date +%s) - start ))s] $*"; }

archs=${CI_TORCH_CUDA_ARCH_LIST:-9.0}
# Debian's client has BuildKit built in; a newer client without buildx refuses BuildKit builds.
DOCKER=/usr/bin/docker
image_repo=vllm-ext-ci
make_args=(DOCKER="$DOCKER" "TORCH_CUDA_ARCH_LIST=$archs" IMAGE_REPO="$image_repo" IMAGE_TAG=ci)
stages=(vllm-base test vllm-openai vllm-openai-cpu)
workdir=$(mktemp -d)
dockerd_pid=
declare -A seconds

timed() {  # timed NAME CMD...: runs CMD, records its wall time under NAME
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@"
  seconds[$name]=$(( $(date +%s) - t0 ))
}

cleanup() {
  local status=$?
  stamp "cleanup: images and build cache this run made"
  if "$DOCKER" version >/dev/null 2>&1; then
    # shellcheck disable=SC2046
    "$DOCKER" rm -f $("$DOCKER" ps -aq --filter "ancestor=$image_repo/vllm-openai-cpu:ci" \
      --filter "ancestor=$image_repo/vllm-openai:ci" --filter "ancestor=$image_repo/vllm-openai-test:ci") \
      >/dev/null 2>&1 || true
    # shellcheck disable=SC2046
    "$DOCKER" rmi -f $("$DOCKER" images -q --filter "reference=$image_repo/*" \
      --filter "reference=vllm-ext-standin/*" | sort -u) >/dev/null 2>&1 || true
    if [ -n "$dockerd_pid" ]; then
      "$DOCKER" builder prune -af >/dev/null || true
    else
      echo "build cache kept: the Docker engine was running before this script ('docker builder prune -a' frees it)"
    fi
    "$DOCKER" system df || true
  fi
  rm -f dist/vllm_ext-*.whl
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null || true
  fi
  if [ "$status" != 0 ] && [ -s "$workdir/dockerd.log" ]; then
    echo "--- last lines of dockerd's log"
    tail -n 12 "$workdir/dockerd.log"
  fi
  rm -rf "$workdir"
  exit "$status"
}
trap cleanup EXIT

apt_get() {  # Debian mirrors fail transiently: three tries
  local attempt
  for attempt in 1 2 3; do
    apt-get "$@" && return 0
    echo "apt-get $* failed (attempt $attempt of 3)" >&2
    sleep $((attempt * 15))
  done
  return 1
}

stamp "install docker.io and debootstrap"
t0=$(date +%s)
if [ ! -x "$DOCKER" ] || ! command -v debootstrap >/dev/null; then
  apt_get update -q
  apt_get install -y -q docker.io debootstrap >/dev/null
fi
if ! "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
  dockerd >"$workdir/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do
    "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1 && break
    sleep 1
  done
fi
"$DOCKER" version --format 'Docker client {{.Client.Version}}, engine {{.Server.Version}}'
seconds[install]=$(( $(date +%s) - t0 ))

stamp "make base-images (Debian stand-ins for nvidia/cuda)"
timed base-images timeout 15m make base-images "${make_args[@]}"

stamp "make wheel TORCH_CUDA_ARCH_LIST=$archs (the build stage runs tools/check_wheel.py)"
timed wheel timeout 15m make wheel "${make_args[@]}"
wheel=$(ls dist/vllm_ext-*.whl)
wheel_bytes=$(stat -c %s "$wheel")

stamp "make image, cold (vllm-base, test, vllm-openai; sizes checked against their budgets)"
timed image-cold timeout 30m make image "${make_args[@]}"

stamp "make image-test-cpu (the CPU tests inside the test image, against the installed wheel)"
timed test-image timeout 15m make image-test-cpu "${make_args[@]}"

stamp "smoke test vllm-openai"
openai=$image_repo/vllm-openai:ci
smoke_openai() {
  # No GPU here: vLLM cannot infer a device, so it is told to take its CPU platform; on a GPU
  # machine the same entrypoint picks CUDA by itself.
  "$DOCKER" run --rm -e VLLM_TARGET_DEVICE=cpu "$openai" --help | tail -n 5
  "$DOCKER" run --rm --entrypoint python "$openai" -c 'import torch, vllm, vllm_ext
print("vllm", vllm.__version__, "| vllm_ext", vllm_ext.__version__, "from", vllm_ext.__file__,
      "| torch", torch.__version__)'
  # vLLM's own pins that requirements-openai-overrides.txt replaces are the only mismatches allowed
  local overridden
  overridden=$(sed -n 's/^\([A-Za-z0-9_.-]*\)[=<>!~].*/\1/p' requirements-openai-overrides.txt | paste -sd'|')
  "$DOCKER" run --rm --entrypoint sh "$openai" -c 'pip check || true' |
    { grep -v -E "^No broken requirements|^vllm [^ ]+ has requirement (${overridden:-^$})[=<>!~ ]" || true; } |
    tee "$workdir/pip-check.txt"
  if [ -s "$workdir/pip-check.txt" ]; then
    echo "FAIL: pip check in vllm-openai"
    return 1
  fi
  # FlashInfer's run-time compiler path: vLLM finds nvcc (CUDA_HOME), and nvcc with g++ builds
  # and links a shared library the way FlashInfer's JIT does (-lcudart from CUDA_HOME/lib64).
  # shellcheck disable=SC2016  # expanded inside the container
  "$DOCKER" run --rm --entrypoint bash "$openai" -c 'set -e
    printf "__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n" > /tmp/k.cu
    "$CUDA_HOME/bin/nvcc" -arch=sm_90 -shared -Xcompiler -fPIC /tmp/k.cu -o /tmp/k.so \
      -L"$CUDA_HOME/lib64" -lcudart
    python -c "from vllm.utils.flashinfer import has_flashinfer; assert has_flashinfer(), \"FlashInfer disabled\""
    echo "FlashInfer JIT toolchain: $("$CUDA_HOME/bin/nvcc" --version | tail -n 1)"'
  "$DOCKER" image inspect --format 'labels: {{json .Config.Labels}}' "$openai"
  "$DOCKER" image inspect --format 'healthcheck: {{json .Config.Healthcheck.Test}}' "$openai"
  check_connector "$openai" -e VLLM_TARGET_DEVICE=cpu
}
check_connector() {  # check_connector IMAGE [DOCKER RUN OPTIONS...]
  local image=$1
  shift
  if [ ! -d vllm_ext/connector ]; then
    echo "connector check skipped: this tree has no vllm_ext/connector (it runs once the connector lands)"
    return 0
  fi
  "$DOCKER" run --rm "$@" -v "$PWD/tools/docker:/tools:ro" --entrypoint python "$image" /tools/check_connector.py
}
timed smoke smoke_openai

if [ -d vllm_ext/connector ]; then
  stamp "make image-test-connector (tests/connector against vllm-openai's vLLM, on the CPU)"
  timed test-connector timeout 15m make image-test-connector "${make_args[@]}"
else
  stamp "make image-test-connector skipped: this tree has no vllm_ext/connector"
  seconds[test-connector]=0
fi

stamp "make image DEVICE=cpu, cold (vllm-openai-cpu; its size checked against its budget)"
timed image-cpu-cold timeout 20m make image DEVICE=cpu "${make_args[@]}"

stamp "checks of vllm-openai-cpu"
openai_cpu=$image_repo/vllm-openai-cpu:ci
smoke_openai_cpu() {
  "$DOCKER" run --rm -v "$PWD/tools/docker:/tools:ro" --entrypoint python "$openai_cpu" \
    /tools/check_vllm_cpu.py vllm_ext
  # The image removes torchvision, torchaudio, torchcodec and triton on purpose (Dockerfile,
  # cpu-server-deps); any other missing or conflicting requirement fails.
  "$DOCKER" run --rm --entrypoint sh "$openai_cpu" -c 'pip check | grep -v -E "requires (torchvision|torchaudio|torchcodec|triton), which is not installed" || true' |
    tee "$workdir/pip-check-cpu.txt"
  if [ -s "$workdir/pip-check-cpu.txt" ]; then
    echo "FAIL: pip check in vllm-openai-cpu"
    return 1
  fi
  "$DOCKER" image inspect --format 'entrypoint: {{json .Config.Entrypoint}}, healthcheck: {{json .Config.Healthcheck.Test}}' "$openai_cpu"
  check_connector "$openai_cpu"
}
timed smoke-cpu smoke_openai_cpu

stamp "make image-serve-cpu (tiny random model: health, completions, streamed chat; P/D with the connector)"
timed serve-cpu timeout 20m make image-serve-cpu "${make_args[@]}"

ids_before=$(for s in "${stages[@]}"; do "$DOCKER" image inspect --format '{{.Id}}' "$image_repo/$s:ci"; done)
stamp "make image and make image DEVICE=cpu again, no change: must come entirely from the cache"
timed image-warm timeout 10m make image "${make_args[@]}"
timed image-cpu-warm timeout 10m make image DEVICE=cpu "${make_args[@]}"
ids_after=$(for s in "${stages[@]}"; do "$DOCKER" image inspect --format '{{.Id}}' "$image_repo/$s:ci"; done)
if [ "$ids_before" != "$ids_after" ]; then
  echo "FAIL: the second make image rebuilt an image (ids before/after):"
  paste <(echo "$ids_before") <(echo "$ids_after")
  exit 1
fi
echo "ok: all ${#stages[@]} images unchanged (every layer came from the cache)"

stamp "summary"
printf '  %-34s %s\n' \
  "install docker + start daemon" "${seconds[install]} s" \
  "make base-images" "${seconds[base-images]} s" \
  "make wheel ($archs)" "${seconds[wheel]} s" \
  "make image, cold" "${seconds[image-cold]} s" \
  "make image-test-cpu" "${seconds[test-image]} s" \
  "vllm-openai smoke tests" "${seconds[smoke]} s" \
  "make image-test-connector" "${seconds[test-connector]} s" \
  "make image DEVICE=cpu, cold" "${seconds[image-cpu-cold]} s" \
  "vllm-openai-cpu checks" "${seconds[smoke-cpu]} s" \
  "make image-serve-cpu" "${seconds[serve-cpu]} s" \
  "make image, warm (no change)" "${seconds[image-warm]} s" \
  "make image DEVICE=cpu, warm" "${seconds[image-cpu-warm]} s" \
  "wheel $(basename "$wheel")" "$(awk "BEGIN {printf \"%.2f MiB\", $wheel_bytes / 1048576}")"
for s in "${stages[@]}"; do
  printf '  %-34s %s\n' "image $s" \
    "$("$DOCKER" image inspect --format '{{.Size}}' "$image_repo/$s:ci" | awk '{printf "%.2f GB", $1 / 1e9}')"
done
stamp "docker pipeline done"
