#!/usr/bin/env bash
# resolve.sh DEVEL BASE DEVEL_ORIGIN BASE_ORIGIN STANDIN_DEVEL STANDIN_BASE
# Prints the devel and base image names a build should use (stdout, one line); says why on stderr.
# An image found locally, or pulled, is used as asked. When one cannot be found or pulled:
#   - if it was the Makefile's default (ORIGIN "file"), the stand-ins are built where missing
#     (build.sh) and used instead;
#   - if the caller named it, the build stops: silently swapping a named image would be wrong.
# Environment: DOCKER (docker), CUDA_VERSION.
set -euo pipefail
[ $# -eq 6 ] || { echo "usage: $0 DEVEL BASE DEVEL_ORIGIN BASE_ORIGIN STANDIN_DEVEL STANDIN_BASE" >&2; exit 2; }
devel=$1 base=$2 devel_origin=$3 base_origin=$4 standin_devel=$5 standin_base=$6
DOCKER=${DOCKER:-docker}
here=$(cd "$(dirname "$0")" && pwd)

available() {
  "$DOCKER" image inspect "$1" >/dev/null 2>&1 && return 0
  echo "base images: $1 is not here; pulling it" >&2
  "$DOCKER" pull "$1" >&2 && return 0
  return 1
}

need_standins=0
resolve() {  # NAME ORIGIN STANDIN -> sets $resolved
  local name=$1 origin=$2 standin=$3
  if available "$name"; then
    resolved=$name
  elif [ "$origin" = file ]; then
    echo "base images: $name can be neither found nor pulled; using the local stand-in $standin" >&2
    need_standins=1
    resolved=$standin
  else
    echo "base images: $name can be neither found nor pulled (build a local stand-in with" \
         "'make base-images', then pass it: DEVEL_IMAGE=$standin_devel BASE_IMAGE=$standin_base)" >&2
    exit 1
  fi
}

resolve "$devel" "$devel_origin" "$standin_devel"; devel=$resolved
resolve "$base" "$base_origin" "$standin_base"; base=$resolved
if [ "$need_standins" = 1 ]; then
  "$here/build.sh" "$standin_base" "$standin_devel" >&2
fi
echo "base images: devel $devel, base $base" >&2
echo "$devel $base"
