#!/usr/bin/env bash
# Builds local stand-ins for nvidia/cuda's base and devel images, for machines that cannot
# reach a registry (air gaps, this project's CI). Called by `make base-images`.
#
#   base stand-in : Debian minbase (debootstrap), imported with `docker import`; the same
#                   NVIDIA_* environment as nvidia/cuda's base image, no CUDA libraries (our
#                   library links cudart statically and torch brings its own).
#   devel stand-in: the base stand-in plus g++, Python and a CUDA toolkit pinned to one
#                   release (nvcc, headers, cudart, cuobjdump) from PyPI's nvidia-* wheels,
#                   linked at /usr/local/cuda.
#
# Usage: build.sh BASE_NAME DEVEL_NAME
# Environment: DOCKER (docker), CUDA_VERSION (13.0.2), DEBIAN_SUITE (bookworm),
#   DEBIAN_MIRROR (http://deb.debian.org/debian), CA_BUNDLE (a CA bundle file for pip).
# An image that already exists is kept: rebuilding it would change its id and invalidate every
# Docker cache built on it. Remove it with `docker rmi` to rebuild it.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BASE_NAME DEVEL_NAME" >&2
  exit 2
fi
base_name=$1
devel_name=$2
DOCKER=${DOCKER:-docker}
CUDA_VERSION=${CUDA_VERSION:-13.0.2}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
here=$(cd "$(dirname "$0")" && pwd)

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

if have_image "$base_name"; then
  echo "base-images: $base_name exists, kept"
else
  if [ "$(id -u)" != 0 ]; then
    echo "base-images: debootstrap needs root; run 'sudo make base-images'" >&2
    exit 1
  fi
  command -v debootstrap >/dev/null || {
    echo "base-images: debootstrap not found (Debian/Ubuntu: apt-get install debootstrap)" >&2
    exit 1
  }
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  echo "base-images: debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR"
  # Mirrors fail transiently; a partial rootfs is wiped before the next try.
  for attempt in 1 2 3; do
    if debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" \
         >"$rootfs.log" 2>&1; then
      break
    fi
    tail -n 20 "$rootfs.log" >&2
    [ "$attempt" = 3 ] && { echo "base-images: debootstrap failed 3 times" >&2; exit 1; }
    echo "base-images: debootstrap failed (attempt $attempt), retrying" >&2
    rm -rf "$rootfs" && mkdir -p "$rootfs"
    sleep $((attempt * 10))
  done
  rm -f "$rootfs.log"
  # Keep the image small and reproducible in content: no package lists or apt caches.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64' \
    --change 'ENV NVIDIA_VISIBLE_DEVICES=all' \
    --change 'ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility' \
    --change "ENV CUDA_VERSION=$CUDA_VERSION" \
    --change 'LABEL org.opencontainers.image.title="nvidia/cuda base stand-in (Debian, no registry)"' \
    --change 'CMD ["bash"]' \
    - "$base_name" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "base-images: built $base_name"
fi

if have_image "$devel_name"; then
  echo "base-images: $devel_name exists, kept"
else
  ca_bundle=${CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
  secret=()
  [ -s "$ca_bundle" ] && secret=(--secret "id=ca-bundle,src=$ca_bundle")
  echo "base-images: building $devel_name (CUDA toolkit $CUDA_VERSION from PyPI wheels)"
  DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain \
    --build-arg "BASE_IMAGE=$base_name" \
    --build-arg "CUDA_VERSION=$CUDA_VERSION" \
    "${secret[@]}" \
    -f "$here/devel.Dockerfile" -t "$devel_name" "$here/.."
  echo "base-images: built $devel_name"
fi
