#!/usr/bin/env bash
# serve-test.sh IMAGE: serves a tiny random model from the vllm-openai-cpu image IMAGE and checks
# the answers (make image-serve-cpu; CI runs it). Steps, each timed:
#   1. model: tools/docker/tiny_model.py, run with the image's Python, writes a seeded random Llama
#      (4 layers, hidden 256, 2 KV heads of head_dim 64) with a byte-level tokenizer and a chat
#      template into a temporary folder, mounted read-only into the servers;
#   2. serve: one server; tools/docker/serve_check.py waits for /health, then asks for completions
#      and a streamed chat completion; the image's HEALTHCHECK must report the container healthy.
#      Its answers are the reference of step 3;
#   3. P/D, only when this tree has vllm_ext/connector (the wheel then carries the connector): a
#      prefill and a decode server (VllmExtConnector as kv_producer / kv_consumer, gloo) and the
#      proxy (python -m vllm_ext.proxy) on a user-defined Docker network; the same greedy requests
#      through the proxy must give step 2's answers, and the decode server's /metrics must count
#      pulls. PD=0 skips it, PD=1 runs it whatever the tree holds.
# Every container, the network and the model folder are removed on exit, failure included; on
# failure the containers' last log lines are shown first.
# Environment: DOCKER (docker), PYTHON (python3), PD (auto), SERVE_TIMEOUT (seconds a server may take
#   to become healthy: 600), SERVE_LOGS (a folder: every container's whole log is saved there).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 IMAGE" >&2; exit 2; }
image=$1
DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-python3}
PD=${PD:-auto}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-600}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
run_id=vllm-ext-serve-$$
workdir=$(mktemp -d)
models=$workdir/models
network=
declare -A seconds
start=$(date +%s)
stamp() { echo "== [serve-test $(( $(date +%s) - start ))s] $*"; }

save_logs() {  # save_logs CONTAINER...: their whole logs into $SERVE_LOGS, when it is set
  local id
  [ -n "${SERVE_LOGS:-}" ] || return 0
  mkdir -p "$SERVE_LOGS"
  for id in "$@"; do
    "$DOCKER" logs "$id" >"$SERVE_LOGS/$("$DOCKER" inspect --format '{{.Name}}' "$id" | tr -d /).log" 2>&1 || true
  done
}

cleanup() {
  local status=$? ids
  ids=$("$DOCKER" ps -aq --filter "label=$run_id" 2>/dev/null || true)
  # shellcheck disable=SC2086  # one id a word
  save_logs $ids
  if [ "$status" != 0 ] && [ -n "$ids" ]; then
    for id in $ids; do
      echo "--- last log lines of $("$DOCKER" inspect --format '{{.Name}}' "$id")"
      "$DOCKER" logs --tail 40 "$id" 2>&1 || true
    done
    # last, where a CI log's tail shows it: each container's errors and warnings
    for id in $ids; do
      echo "--- errors and warnings of $("$DOCKER" inspect --format '{{.Name}}' "$id")"
      "$DOCKER" logs "$id" 2>&1 | grep -E "ERROR|FAIL|Traceback|vllm-ext.*(failed|refused)" | tail -n 6 || true
    done
  fi
  if [ "$status" != 0 ] && [ -s "$workdir/failed.txt" ]; then
    echo "--- what failed"
    tail -n 5 "$workdir/failed.txt"
  fi
  # shellcheck disable=SC2086
  [ -z "$ids" ] || "$DOCKER" rm -f $ids >/dev/null || true
  [ -z "$network" ] || "$DOCKER" network rm "$network" >/dev/null || true
  rm -rf "$workdir"
  exit "$status"
}
trap cleanup EXIT

serve_check() {  # serve_check ARGS...: serve_check.py, its FAIL lines kept for the end of the log too
  "$PYTHON" "$here/serve_check.py" "$@" 2> >(tee -a "$workdir/failed.txt" >&2)
}

timed() {  # timed NAME CMD...: runs CMD, records its wall time under NAME
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@"
  seconds[$name]=$(( $(date +%s) - t0 ))
}

# What every server gets: the model, a small KV cache, shared memory for vLLM's engine-to-worker
# queue (Docker's default 64 MB /dev/shm is too small). float32: on CPUs with AMX, bf16 takes
# vLLM 0.32's AMX attention kernels, which crashed after an external KV load (docs/connector.md).
server_args=(/models/tiny-llama --served-model-name tiny --dtype float32 --max-model-len 512)
run_server() {  # run_server NAME [DOCKER RUN OPTIONS...] -- [SERVER ARGS...]: prints the host address
  local name=$1 opts=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  "$DOCKER" run -d --name "$name" --label "$run_id" --shm-size 1g --health-interval 5s \
    -e VLLM_CPU_KVCACHE_SPACE=1 -v "$models:/models:ro" -p 127.0.0.1::8000 "${opts[@]}" \
    "$image" "${server_args[@]}" "$@" >/dev/null
  "$DOCKER" port "$name" 8000/tcp | head -n 1
}

wait_docker_healthy() {  # the image's own HEALTHCHECK, at the 5 s interval run_server sets
  local name=$1 state
  for _ in $(seq 30); do
    state=$("$DOCKER" inspect --format '{{.State.Health.Status}}' "$name")
    [ "$state" = healthy ] && { echo "  docker health of $name: healthy"; return 0; }
    sleep 2
  done
  echo "FAIL: docker health of $name is '$state' although /health answers" >&2
  return 1
}

stamp "model: tiny random Llama with a tokenizer and a chat template (tools/docker/tiny_model.py)"
mkdir -p "$models"
timed model "$DOCKER" run --rm --label "$run_id" -v "$models:/models" -v "$here:/tools:ro" \
  --entrypoint python "$image" /tools/tiny_model.py /models/tiny-llama

stamp "serve: one server, health, completions, streamed chat completion"
serve() {
  local address
  address=$(run_server "$run_id-single" --)
  serve_check "http://$address" tiny --docker "$DOCKER" --container "$run_id-single" \
    --health-timeout "$SERVE_TIMEOUT" --out "$workdir/reference.json"
  wait_docker_healthy "$run_id-single"
  save_logs "$run_id-single"
  "$DOCKER" rm -f "$run_id-single" >/dev/null
}
timed serve serve

if [ "$PD" = auto ]; then
  if [ -d "$repo/vllm_ext/connector" ]; then PD=1; else
    PD=0
    stamp "P/D: skipped, this tree has no vllm_ext/connector (the step runs once the connector lands)"
  fi
fi
if [ "$PD" = 1 ]; then
  stamp "P/D: prefill + decode servers (VllmExtConnector over gloo) and the proxy on a Docker network"
  pd() {
    local secret prefill decode proxy cores bind_p=() bind_d=()
    network=$run_id
    "$DOCKER" network create --label "$run_id" "$network" >/dev/null
    secret=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')
    # One core each where there are two: with both on the same cores, the first gloo connect
    # can starve behind the engines' busy loops.
    cores=$(nproc)
    if [ "$cores" -ge 2 ]; then
      bind_p=(-e VLLM_CPU_OMP_THREADS_BIND=0)
      bind_d=(-e VLLM_CPU_OMP_THREADS_BIND=1)
    fi
    # kv_config ROLE HOST EXTRA: the connector binds and advertises HOST, its network alias. The
    # producer's lease channel has a fixed port, and the consumer dials only producers it lists.
    kv_config() {
      printf '{"kv_connector":"VllmExtConnector","kv_role":"%s","kv_connector_extra_config":{"backend":"gloo","endpoint_host":"%s","lease_host":"%s"%s}}' "$1" "$2" "$2" "$3"
    }
    prefill=$(run_server "$run_id-prefill" --network "$network" --network-alias prefill --hostname prefill \
      -e "VLLM_EXT_AUTH_SECRET=$secret" "${bind_p[@]}" -- \
      --kv-transfer-config "$(kv_config kv_producer prefill ',"lease_port":8101')")
    decode=$(run_server "$run_id-decode" --network "$network" --network-alias decode --hostname decode \
      -e "VLLM_EXT_AUTH_SECRET=$secret" "${bind_d[@]}" -- \
      --kv-transfer-config "$(kv_config kv_consumer decode ',"connect_to":["prefill:8101"]')")
    "$DOCKER" run -d --name "$run_id-proxy" --label "$run_id" --network "$network" -p 127.0.0.1::8000 \
      --entrypoint python "$image" -m vllm_ext.proxy --host 0.0.0.0 --port 8000 \
      --prefill http://prefill:8000 --decode http://decode:8000 >/dev/null
    proxy=$("$DOCKER" port "$run_id-proxy" 8000/tcp | head -n 1)
    serve_check "http://$prefill" tiny --steps health --docker "$DOCKER" \
      --container "$run_id-prefill" --container "$run_id-decode" --health-timeout "$SERVE_TIMEOUT"
    serve_check "http://$decode" tiny --steps health --docker "$DOCKER" \
      --container "$run_id-decode" --health-timeout "$SERVE_TIMEOUT"
    serve_check "http://$proxy" tiny --steps health,completions,chat-stream,metrics \
      --docker "$DOCKER" --container "$run_id-proxy" --health-timeout 60 --expect "$workdir/reference.json" \
      --metric "http://$decode=vllm:vllm_ext_transfers_total"
  }
  timed pd pd
fi

stamp "summary"
printf '  %-34s %s\n' "tiny model" "${seconds[model]} s" \
  "one server: start, answers, stop" "${seconds[serve]} s"
[ "$PD" != 1 ] || printf '  %-34s %s\n' "P/D: 2 servers + proxy" "${seconds[pd]} s"
