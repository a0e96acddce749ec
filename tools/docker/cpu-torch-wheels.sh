#!/usr/bin/env bash
# cpu-torch-wheels.sh find REQUIREMENTS
#   Prints the first folder of pip's find-links setting (PIP_FIND_LINKS, then `pip config`) that
#   holds a wheel of the torch REQUIREMENTS pins; prints nothing when none does.
# cpu-torch-wheels.sh image REQUIREMENTS DIR NAME
#   Builds the image NAME holding only that torch's wheels from DIR, at its root: the build
#   argument CPU_TORCH_WHEELS of the Dockerfile (this Docker client cannot pass a folder as a
#   second build context). Stops when DIR holds no such wheel.
# Environment: DOCKER (docker), PYTHON (python3).
set -euo pipefail
cmd=${1:-} req=${2:-}
pin=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$req" 2>/dev/null || true)
if [ -z "$pin" ]; then
  echo "cpu-torch-wheels: ${req:-REQUIREMENTS} has no torch== line" >&2
  exit 2
fi
has_wheel() { compgen -G "$1/torch-$pin-*.whl" >/dev/null; }

case "$cmd" in
  find)
    # find-links entries are paths or file:// URLs, several to a setting, space or newline separated.
    for dir in ${PIP_FIND_LINKS:-} $("${PYTHON:-python3}" -m pip config get global.find-links 2>/dev/null || true); do
      dir=${dir#file://}
      if [ -d "$dir" ] && has_wheel "$dir"; then
        echo "$dir"
        exit 0
      fi
    done
    ;;
  image)
    dir=${3:?usage: $0 image REQUIREMENTS DIR NAME} name=${4:?usage: $0 image REQUIREMENTS DIR NAME}
    if ! has_wheel "$dir"; then
      echo "cpu-torch-wheels: CPU_TORCH_WHEELS=$dir holds no torch-$pin-*.whl (the torch of $req)" >&2
      exit 1
    fi
    echo "cpu-torch-wheels: $name from $dir: $(cd "$dir" && echo "torch-$pin-"*.whl)"
    printf 'FROM scratch\nCOPY torch-%s-*.whl /\n' "$pin" |
      DOCKER_BUILDKIT=1 "${DOCKER:-docker}" build -q -f - -t "$name" "$dir" >/dev/null
    ;;
  *)
    echo "usage: $0 find REQUIREMENTS | image REQUIREMENTS DIR NAME" >&2
    exit 2
    ;;
esac
