#!/usr/bin/env bash
# check-docker.sh GOAL: stops `make GOAL` at once, with the reason, when no Docker engine answers
# or when the Docker client cannot run BuildKit builds. Environment: DOCKER (docker).
set -uo pipefail
DOCKER=${DOCKER:-docker}
goal=${1:-wheel}
host_hint="On a machine without Docker, build and test with this machine's toolchain instead:
  make wheel RUNNER=host      (build the wheel and check it)
  make test-gpu RUNNER=host   (build in place and run the GPU tests)"

if ! command -v "$DOCKER" >/dev/null 2>&1; then
  printf 'make %s: no Docker client "%s" on this machine.\n%s\n' "$goal" "$DOCKER" "$host_hint" >&2
  exit 1
fi
if ! error=$("$DOCKER" version --format '{{.Server.Version}}' 2>&1 >/dev/null); then
  printf 'make %s: no Docker engine answers to "%s":\n  %s\n%s\n' \
    "$goal" "$DOCKER" "$(echo "$error" | grep -m 1 .)" "$host_hint" >&2
  exit 1
fi
# Clients from Docker 23 on hand BuildKit builds to the buildx plugin and refuse them without it;
# older clients (Debian's docker.io 20.10) have BuildKit built in.
client=$("$DOCKER" version --format '{{.Client.Version}}' 2>/dev/null || echo 0)
if [ "${client%%.*}" -ge 23 ] 2>/dev/null && ! "$DOCKER" buildx version >/dev/null 2>&1; then
  printf 'make %s: the Docker client "%s" (%s) needs the buildx plugin for BuildKit builds, and it is\nmissing. Install buildx, or pick a client with BuildKit built in, e.g. DOCKER=/usr/bin/docker\nfrom Debian'"'"'s docker.io package.\n' \
    "$goal" "$(command -v "$DOCKER")" "$client" >&2
  exit 1
fi
